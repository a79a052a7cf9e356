package numa

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestParseList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
		back string
	}{
		{"", nil, ""},
		{"\n", nil, ""},
		{"0\n", []int{0}, "0"},
		{"0-3,8,10-11\n", []int{0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"},
		{"4,0-1, 2", []int{0, 1, 2, 4}, "0-2,4"},
		{"3,3,1-2", []int{1, 2, 3}, "1-3"},
		{"7-7", []int{7}, "7"},
	} {
		got, err := ParseList(tc.in)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseList(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
		if back := FormatList(got); back != tc.back {
			t.Errorf("FormatList(%v) = %q, want %q", got, back, tc.back)
		}
	}
	for _, bad := range []string{"x", "1-", "-1", "3-1", "0,,a", "0x3", "1-2-3"} {
		if got, err := ParseList(bad); err == nil {
			t.Errorf("ParseList(%q) = %v; want an error", bad, got)
		}
	}
}

func writeFile(t *testing.T, root, path, content string) {
	t.Helper()
	p := filepath.Join(root, path)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
