package filestore

import (
	"bytes"
	"os"
	"slices"
	"testing"
)

// TestCleanupRules opens some Stores on one file, closes them in order and
// checks after each Close whether the file still exists (spec/c10d-wire.md
// §3.4).
func TestCleanupRules(t *testing.T) {
	tests := []struct {
		name      string
		cleanup   Cleanup
		worldSize int
		initial   []byte // written before the stores open
		stores    int
		exists    []bool // after each Close
		counters  string // "cleanup/ refcount/" at the end, when the file remains
	}{
		{name: "1.13: the world_size-th close removes", cleanup: Cleanup113, worldSize: 2, stores: 2,
			exists: []bool{true, false}},
		{name: "1.13: equality, so a counter already past world_size never removes", cleanup: Cleanup113, worldSize: 2,
			initial: rec("cleanup/", "5"), stores: 2, exists: []bool{true, true}, counters: "7 "},
		{name: "1.13: world_size -1 never removes, still counts", cleanup: Cleanup113, worldSize: -1, stores: 2,
			exists: []bool{true, true}, counters: "2 "},
		{name: "1.13: no refcount, so world_size 1 removes under an open store", cleanup: Cleanup113, worldSize: 1, stores: 2,
			exists: []bool{false, false}},
		{name: "newest: the last close removes", cleanup: CleanupNewest, worldSize: 2, stores: 2,
			exists: []bool{true, false}},
		{name: "newest: refcount keeps the file while a store is open (test_refcount)", cleanup: CleanupNewest, worldSize: 1, stores: 2,
			exists: []bool{true, false}},
		{name: "newest: counter past world_size still removes", cleanup: CleanupNewest, worldSize: 2,
			initial: rec("cleanup/", "5"), stores: 1, exists: []bool{false}},
		{name: "newest: world_size -1 never removes", cleanup: CleanupNewest, worldSize: -1, stores: 2,
			exists: []bool{true, true}, counters: "2 0"},
		{name: "newest: world_size 0 removes on the last close", cleanup: CleanupNewest, worldSize: 0, stores: 2,
			exists: []bool{true, false}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			if tc.initial != nil {
				writeFile(t, path, tc.initial)
			}
			cfg := with(func(c *Config) { c.Cleanup, c.WorldSize = tc.cleanup, tc.worldSize })
			var stores []tstore
			for range tc.stores {
				s := openStore(t, path, cfg)
				s.set("k", "v") // every store has touched the file
				stores = append(stores, s)
			}
			var got []bool
			for _, s := range stores {
				check(t, s.Close())
				got = append(got, exists(t, path))
			}
			if !slices.Equal(got, tc.exists) {
				t.Fatalf("file exists after each Close: %v, want %v", got, tc.exists)
			}
			if tc.counters != "" {
				s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
				var c, r string
				check(t, s.do(t.Context(), readAccess, func(tx *txn) error {
					c, _ = tx.value(cleanupKey)
					r, _ = tx.value(refcountKey)
					return nil
				}))
				if got := c + " " + r; got != tc.counters {
					t.Errorf("cleanup/ refcount/ = %q, want %q", got, tc.counters)
				}
			}
		})
	}
}

// TestCleanupNoneLeavesFileAlone: a store with CleanupNone (the CLI's
// inspection mode) reads and closes without adding a byte.
func TestCleanupNoneLeavesFileAlone(t *testing.T) {
	path := tempPath(t)
	initial := slices.Concat(rec("/k", "v"), rec("refcount/", "1"))
	writeFile(t, path, initial)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup, c.WorldSize = CleanupNone, 1 }))
	if got := s.get("k"); got != "v" {
		t.Fatalf("get = %q", got)
	}
	check(t, s.Close())
	got, err := os.ReadFile(path)
	check(t, err)
	if !bytes.Equal(got, initial) {
		t.Fatalf("file changed:\n% x\nwant\n% x", got, initial)
	}
}

// TestCloseMissingFile: if the file is gone, Close writes nothing and does
// not recreate it, as c10d's destructor checks for the file first.
func TestCloseMissingFile(t *testing.T) {
	for _, cleanup := range []Cleanup{Cleanup113, CleanupNewest} {
		t.Run(cleanup.String(), func(t *testing.T) {
			path := tempPath(t)
			s := openStore(t, path, with(func(c *Config) { c.Cleanup = cleanup }))
			s.set("k", "v")
			check(t, os.Remove(path))
			check(t, s.Close())
			if exists(t, path) {
				t.Fatal("Close recreated the file")
			}
		})
	}
}

// TestClose113NeverOpenedFile: a 1.13 store that never touched a file that
// never existed closes cleanly without creating it.
func TestClose113NeverOpenedFile(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup, c.WorldSize = Cleanup113, 1 }))
	check(t, s.Close())
	if exists(t, path) {
		t.Fatal("Close created the file")
	}
}
