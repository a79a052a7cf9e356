package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/testutil"
)

// gorun (the binary `make build` makes as bin/gorun) running PyTorch 2.14
// workers: the sid bed's python3 (internal/sidbed) is the worker
// interpreter, through PYTHON_EXEC. The bed sees the host's temporary
// directory, so the job's script is copied there. These tests skip without
// the bed and fail without it in CI.

// bedJob returns bin/gorun's build and examples/torch/name copied where the
// bed sees it, made to fail unless it runs under the bed's torch.
func bedJob(t *testing.T, bed *sidbed.Bed, name string) (bin, script string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "examples", "torch", name))
	if err != nil {
		t.Fatal(err)
	}
	guard := fmt.Sprintf("import torch\nassert torch.__version__ == %q, torch.__version__\n", bed.Stamp.Torch)
	script = filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(script, append([]byte(guard), b...), 0o644); err != nil {
		t.Fatal(err)
	}
	return testutil.BuildGorunAs(t, filepath.Join(t.TempDir(), "gorun"), "gorun_noetcd"), script
}

// TestTorch214GlooStandalone: one node, three PyTorch 2.14 workers join a
// gloo group through gorun's embedded store and all_reduce.
func TestTorch214GlooStandalone(t *testing.T) {
	bed := sidbed.Require(t)
	bin, script := bedJob(t, bed, "allreduce.py")
	p := startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + bed.Python()},
		"--standalone", "--nproc-per-node", "3", "--log-dir", t.TempDir(), script)
	expectGlooAllreduce(t, []*agentProc{p}, 3, nil)
}

// TestTorch214GlooTwoNodes: two agents on loopback meet over the c10d
// rendezvous; their two PyTorch 2.14 workers each all_reduce as one world
// of four through group rank 0's worker store.
func TestTorch214GlooTwoNodes(t *testing.T) {
	bed := sidbed.Require(t)
	bin, script := bedJob(t, bed, "allreduce.py")
	port := freePort(t)
	var agents []*agentProc
	for range 2 {
		args := c10dArgs(port, "2", "--nproc-per-node", "2", "--log-dir", t.TempDir(), script)
		agents = append(agents, startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + bed.Python()}, args...))
	}
	expectGlooAllreduce(t, agents, 2, nil)
}
