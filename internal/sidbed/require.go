package sidbed

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/gorunhq/gorun/internal/torchtest"
)

var (
	findOnce sync.Once
	found    *Bed
	findErr  error
)

// Require returns the bed, or skips the test with one line saying why —
// except in CI (GORUN_CI=1), where a missing bed fails the test. It never
// builds: `make test-deps` does.
func Require(t testing.TB) *Bed {
	t.Helper()
	findOnce.Do(func() {
		found, findErr = Find()
		if findErr == nil && os.Geteuid() != 0 {
			// enter needs a mount namespace and chroot.
			found, findErr = nil, fmt.Errorf("the sid bed at %s is entered as root only (unshare -m, chroot)", found.Dir)
		}
	})
	if found == nil {
		if torchtest.InCI() {
			t.Fatalf("sid bed: %v", findErr)
		}
		t.Skipf("sid bed skipped: %v", findErr)
	}
	return found
}
