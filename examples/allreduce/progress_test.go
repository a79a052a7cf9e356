package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestProgressLine(t *testing.T) {
	at := time.Unix(1700000000, 5)
	if got, want := progressLine(1, 2, 41, 0, 3, at), "progress attempt=1 epoch=2 step=41 rank=0 world=3 unix_ns=1700000000000000005"; got != want {
		t.Errorf("progressLine = %q, want %q", got, want)
	}
}

func TestCheckpoint(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		content *string // nil: no file
		steps   int
		want    int
		wantErr bool
	}{
		{"no file", nil, 10, 0, false},
		{"written", ptr("7\n"), 10, 7, false},
		{"all done", ptr("10"), 10, 10, false},
		{"beyond the run", ptr("11"), 10, 0, true},
		{"garbage", ptr("x"), 10, 0, true},
		{"negative", ptr("-1"), 10, 0, true},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, "ckpt"+string(rune('a'+i)))
			if tc.content != nil {
				if err := os.WriteFile(path, []byte(*tc.content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, err := readCheckpoint(path, tc.steps)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("readCheckpoint = %d, %v; want %d, error %t", got, err, tc.want, tc.wantErr)
			}
		})
	}
	if got, err := readCheckpoint("", 10); got != 0 || err != nil {
		t.Errorf("readCheckpoint(\"\") = %d, %v; want 0, nil", got, err)
	}

	// A write replaces the previous checkpoint and leaves no temporary
	// file.
	path := filepath.Join(dir, "w")
	for _, n := range []int{3, 4} {
		if err := writeCheckpoint(path, n); err != nil {
			t.Fatal(err)
		}
		if got, err := readCheckpoint(path, 10); got != n || err != nil {
			t.Errorf("after writeCheckpoint(%d): readCheckpoint = %d, %v", n, got, err)
		}
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "w.tmp-*")); len(m) != 0 {
		t.Errorf("temporary files left: %v", m)
	}
}

func ptr(s string) *string { return &s }
