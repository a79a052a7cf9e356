package filestore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// access says how an operation opens and locks the file. These are c10d's
// rules (spec/c10d-wire.md §3.2); following them exactly is what lets PyTorch
// and Go processes share one file.
type access uint8

const (
	// readAccess: O_RDONLY and LOCK_SH (get, check, num_keys, list_keys).
	readAccess access = iota
	// writeAccess: O_RDWR|O_CREAT 0644 and LOCK_EX (set, add, compare_set).
	writeAccess
	// updateAccess: O_RDWR without create and LOCK_EX (delete).
	updateAccess
	// cleanupAccess is updateAccess for Close's cleanup: a missing file is
	// reported at once instead of waited for (c10d's destructor checks that
	// the file exists first; opening without O_CREAT makes the check and the
	// open one step, so cleanup never recreates a file someone removed), and
	// the store's being closed does not stop it.
	cleanupAccess
)

func (a access) flags() int {
	switch a {
	case readAccess:
		return os.O_RDONLY
	case writeAccess:
		return os.O_RDWR | os.O_CREATE
	default:
		return os.O_RDWR
	}
}

func (a access) exclusive() bool { return a != readAccess }

// errNoFile: cleanupAccess found no file.
var errNoFile = errors.New("file does not exist")

// lockRetryMax caps the pause between attempts to take a contended flock.
// Locks are held for microseconds, so a short cap keeps a contended Go
// process from losing every race to PyTorch processes blocked in flock(2).
const lockRetryMax = time.Millisecond

// openFile opens the store's file as a needs. While the file does not exist
// it retries every PollInterval, as c10d does so that another rank can create
// it, until ctx is done.
func (s *Store) openFile(ctx context.Context, a access) (*os.File, error) {
	for {
		f, err := os.OpenFile(s.path, a.flags(), 0o644)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		if a == cleanupAccess {
			return nil, errNoFile
		}
		if err := s.pause(ctx, s.cfg.PollInterval, a); err != nil {
			return nil, fmt.Errorf("waiting for %s to be created: %w", s.path, err)
		}
	}
}

// lockFile takes a whole-file flock on f, shared or exclusive as a needs.
// It polls with LOCK_NB rather than block in flock(2), so that ctx and Close
// can interrupt it: a peer that stops while holding the lock (a PyTorch
// process under SIGSTOP, say) must not hang a gorun agent.
func (s *Store) lockFile(ctx context.Context, f *os.File, a access) error {
	backoff := 50 * time.Microsecond
	for {
		ok, err := tryLock(f, a.exclusive())
		if err != nil || ok {
			return err
		}
		if err := s.pause(ctx, backoff, a); err != nil {
			return fmt.Errorf("waiting for the lock on %s: %w", s.path, err)
		}
		backoff = min(2*backoff, lockRetryMax)
	}
}

// pause sleeps for d. It returns early with the reason when ctx is done or,
// unless a is cleanupAccess, when the store is closed.
func (s *Store) pause(ctx context.Context, d time.Duration, a access) error {
	var closed <-chan struct{}
	if a != cleanupAccess {
		closed = s.done
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctxErr(ctx)
	case <-closed:
		return rendezvous.ErrClosed
	}
}

// ctxErr is why ctx is done: context.DeadlineExceeded for a deadline (so
// timeouts are recognised even under a custom cause), else the cause.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return context.Cause(ctx)
}
