package launcher

import (
	"os"
	"testing"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain builds the gorun binary the process tests start once for the
// package (testutil.Shared).
func TestMain(m *testing.M) {
	os.Exit(testutil.Shared(m).Run())
}
