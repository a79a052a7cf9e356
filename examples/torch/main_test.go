package torch_test

import (
	"os"
	"testing"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain builds the gorun binary the tests start once for the package
// (testutil.Shared).
func TestMain(m *testing.M) {
	os.Exit(testutil.Shared(m).Run())
}
