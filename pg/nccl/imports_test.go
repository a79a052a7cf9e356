package nccl

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLauncherDoesNotImportNCCL keeps pg/nccl (and cgo) out of the static
// gorun binary: only worker programs link it.
func TestLauncherDoesNotImportNCCL(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/gorunhq/gorun/cmd/gorun").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "github.com/gorunhq/gorun/pg/nccl") {
			t.Errorf("cmd/gorun depends on %s", dep)
		}
	}
}
