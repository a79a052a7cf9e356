package tcpstore

import (
	"errors"
	"testing"
)

// TestMemoryStorageMaxBytes: every write that would pass MaxBytes fails
// with ErrStorageFull and changes nothing; overwrites, deletes and pops
// give their bytes back.
func TestMemoryStorageMaxBytes(t *testing.T) {
	m := NewMemoryStorageConfig(MemoryStorageConfig{MaxBytes: 100})
	b := func(n int) []byte { return make([]byte, n) }
	noop := func() {}
	steps := []struct {
		name string
		op   func() error
		full bool  // want ErrStorageFull
		held int64 // Bytes() afterwards
	}{
		{"set within the cap", func() error { return m.Set([]byte("/a"), b(50)) }, false, 52},
		{"set past it", func() error { return m.Set([]byte("/b"), b(47)) }, true, 52},
		{"set up to it", func() error { return m.Set([]byte("/b"), b(46)) }, false, 100},
		{"overwrite with less", func() error { return m.Set([]byte("/a"), b(10)) }, false, 60},
		{"append past it", func() error { return m.Append([]byte("/a"), b(41)) }, true, 60},
		{"append up to it", func() error { return m.Append([]byte("/a"), b(40)) }, false, 100},
		{"add creating a key", func() error { _, err := m.Add([]byte("/n"), 1); return err }, true, 100},
		{"compare-set creating a key", func() error { _, err := m.CompareSet([]byte("/c"), nil, b(1)); return err }, true, 100},
		{"delete gives back", func() error { _, err := m.Delete([]byte("/b")); return err }, false, 52},
		{"add within", func() error { _, err := m.Add([]byte("/n"), 5); return err }, false, 55},
		{"barrier within", func() error { _, _, err := m.Barrier([]byte("/bar"), 9, noop); return err }, false, 60},
		{"queue push within", func() error { return m.QueuePush([]byte("/q"), b(30)) }, false, 92},
		{"queue push past", func() error { return m.QueuePush([]byte("/q"), b(9)) }, true, 92},
		{"queue pop gives back", func() error { _, _, err := m.QueuePop([]byte("/q")); return err }, false, 60},
	}
	for _, st := range steps {
		err := st.op()
		if errors.Is(err, ErrStorageFull) != st.full || (err != nil && !st.full) {
			t.Fatalf("%s: err = %v, want full=%v", st.name, err, st.full)
		}
		if got := m.Bytes(); got != st.held {
			t.Fatalf("%s: holds %d bytes, want %d", st.name, got, st.held)
		}
	}
	if _, ok, _ := m.Get([]byte("/c")); ok {
		t.Fatal("a refused compare-set stored its key")
	}
}
