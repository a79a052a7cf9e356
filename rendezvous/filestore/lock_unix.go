//go:build unix

package filestore

import (
	"errors"
	"os"
	"syscall"
)

// tryLock takes a BSD flock on the whole of f without blocking and reports
// whether it got it. c10d locks with flock(2), not fcntl record locks; the
// two do not see each other on Linux, so nothing else would interoperate.
func tryLock(f *os.File, exclusive bool) (bool, error) {
	how := syscall.LOCK_SH
	if exclusive {
		how = syscall.LOCK_EX
	}
	return flock(f, how|syscall.LOCK_NB)
}

// unlock releases the flock on f. Closing f would release it too; unlocking
// first mirrors c10d and keeps the lock's extent obvious.
func unlock(f *os.File) error {
	_, err := flock(f, syscall.LOCK_UN)
	return err
}

func flock(f *os.File, how int) (bool, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) {
		for {
			ferr = syscall.Flock(int(fd), how)
			if !errors.Is(ferr, syscall.EINTR) {
				return
			}
		}
	}); err != nil {
		return false, err
	}
	switch {
	case ferr == nil:
		return true, nil
	case errors.Is(ferr, syscall.EWOULDBLOCK):
		return false, nil
	default:
		return false, &os.PathError{Op: "flock", Path: f.Name(), Err: ferr}
	}
}
