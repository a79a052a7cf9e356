//go:build unix

package filestore

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestFlockDiscipline holds a flock on the file through a descriptor of its
// own, as a PyTorch process would, and checks which operations it blocks:
// LOCK_EX blocks everything, LOCK_SH blocks writers only. A blocked
// operation gives up when its context does and goes ahead once the lock is
// released.
func TestFlockDiscipline(t *testing.T) {
	tests := []struct {
		name    string
		how     int
		op      func(context.Context, *Store) error
		blocked bool
	}{
		{"set under LOCK_EX", syscall.LOCK_EX, func(ctx context.Context, s *Store) error { return s.Set(ctx, "k", nil) }, true},
		{"check under LOCK_EX", syscall.LOCK_EX, func(ctx context.Context, s *Store) error { _, err := s.Check(ctx, "k"); return err }, true},
		{"set under LOCK_SH", syscall.LOCK_SH, func(ctx context.Context, s *Store) error { return s.Set(ctx, "k", nil) }, true},
		{"add under LOCK_SH", syscall.LOCK_SH, func(ctx context.Context, s *Store) error { _, err := s.Add(ctx, "n", 1); return err }, true},
		{"num_keys under LOCK_SH", syscall.LOCK_SH, func(ctx context.Context, s *Store) error { _, err := s.NumKeys(ctx); return err }, false},
		{"get under LOCK_SH", syscall.LOCK_SH, func(ctx context.Context, s *Store) error { _, err := s.Get(ctx, "present"); return err }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
			s.set("present", "1")
			peer, err := os.Open(path)
			check(t, err)
			defer peer.Close()
			check(t, syscall.Flock(int(peer.Fd()), tc.how))

			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			err = tc.op(ctx, s.Store)
			if !tc.blocked {
				check(t, err)
				return
			}
			if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("while locked: %v, want a timeout", err)
			}
			done := make(chan error, 1)
			go func() { done <- tc.op(t.Context(), s.Store) }()
			time.Sleep(20 * time.Millisecond)
			check(t, syscall.Flock(int(peer.Fd()), syscall.LOCK_UN))
			select {
			case err := <-done:
				check(t, err)
			case <-time.After(2 * time.Second):
				t.Fatal("still blocked after the lock was released")
			}
		})
	}
}
