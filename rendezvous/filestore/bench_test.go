package filestore

import (
	"testing"
)

// Each operation is open + flock + fstat + (read tail) + unlock + close, so
// these measure the per-operation syscall cost that c10d pays too.

func BenchmarkSet(b *testing.B) {
	s := openStore(b, tempPath(b), testConfig())
	v := []byte("value")
	ctx := b.Context()
	for b.Loop() {
		if err := s.Set(ctx, "key", v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkGet(b *testing.B) {
	s := openStore(b, tempPath(b), testConfig())
	s.set("key", "value")
	ctx := b.Context()
	for b.Loop() {
		if _, err := s.Get(ctx, "key"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAddParallel has every goroutine use its own Store, as separate
// processes would, so they contend on the flock.
func BenchmarkAddParallel(b *testing.B) {
	path := tempPath(b)
	b.RunParallel(func(pb *testing.PB) {
		s, err := Open(b.Context(), path, testConfig())
		if err != nil {
			b.Error(err)
			return
		}
		defer s.Close()
		for pb.Next() {
			if _, err := s.Add(b.Context(), "counter", 1); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
