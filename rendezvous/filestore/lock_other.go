//go:build !unix

package filestore

import (
	"fmt"
	"os"

	"github.com/gorunhq/gorun/rendezvous"
)

// c10d's FileStore needs flock(2); without it the file cannot be shared
// safely, so every operation fails.

func tryLock(*os.File, bool) (bool, error) {
	return false, fmt.Errorf("flock: %w on this platform", rendezvous.ErrNotSupported)
}

func unlock(*os.File) error { return nil }
