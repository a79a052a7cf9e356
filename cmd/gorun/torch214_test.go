package main

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/testutil"
)

// gorun (the binary `make build` makes as bin/gorun) running PyTorch 2.14
// workers: the sid bed's python3 (internal/sidbed) is the worker
// interpreter, through PYTHON_EXEC. The bed sees the host's temporary
// directory, so the job's script is copied there. These tests skip without
// the bed and fail without it in CI.

// bedScript returns examples/torch/name copied where the bed sees it, made
// to fail unless it runs under the bed's torch.
func bedScript(t *testing.T, bed *sidbed.Bed, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "examples", "torch", name))
	if err != nil {
		t.Fatal(err)
	}
	guard := fmt.Sprintf("import torch\nassert torch.__version__ == %q, torch.__version__\n", bed.Stamp.Torch)
	script := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(script, append([]byte(guard), b...), 0o644); err != nil {
		t.Fatal(err)
	}
	return script
}

// lightGorun builds gorun as `make build` builds bin/gorun.
func lightGorun(t *testing.T) string {
	t.Helper()
	return testutil.BuildGorunAs(t, filepath.Join(t.TempDir(), "gorun"), "gorun_noetcd")
}

// TestTorch214GlooStandalone: one node, three PyTorch 2.14 workers join a
// gloo group through gorun's embedded store and all_reduce.
func TestTorch214GlooStandalone(t *testing.T) {
	t.Parallel()
	bed := sidbed.Require(t)
	bin, script := lightGorun(t), bedScript(t, bed, "allreduce.py")
	p := startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + bed.Python()},
		"--standalone", "--nproc-per-node", "3", "--log-dir", t.TempDir(), script)
	expectGlooAllreduce(t, []*agentProc{p}, 3, nil)
}

// TestTorch214GlooTwoNodes: two agents on loopback meet over the c10d
// rendezvous; their two PyTorch 2.14 workers each all_reduce as one world
// of four through group rank 0's worker store.
func TestTorch214GlooTwoNodes(t *testing.T) {
	t.Parallel()
	bed := sidbed.Require(t)
	bin, script := lightGorun(t), bedScript(t, bed, "allreduce.py")
	port := freePort(t)
	var agents []*agentProc
	for range 2 {
		args := c10dArgs(port, "2", "--nproc-per-node", "2", "--log-dir", t.TempDir(), script)
		agents = append(agents, startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + bed.Python()}, args...))
	}
	expectGlooAllreduce(t, agents, 2, nil)
}

// TestTorchrun214SameEnvironment runs one command line under torchrun 2.14
// (in the bed) and under gorun with the bed's python, with a worker that
// prints its environment, and compares what each worker got. gorun also
// sets NCCL_ASYNC_ERROR_HANDLING (the name 1.13 reads); torchrun 2.14's
// TORCHELASTIC_SIGNALS_TO_HANDLE is checked once gorun sets it (issue 13,
// item 3).
func TestTorchrun214SameEnvironment(t *testing.T) {
	bed := sidbed.Require(t)
	bin := testutil.BuildGorun(t)
	script := filepath.Join(t.TempDir(), "dump_env.py")
	if err := os.WriteFile(script, []byte(envDump), 0o644); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	flags := []string{"--nnodes", "1", "--nproc-per-node", "2", "--master-port", strconv.Itoa(port),
		"--max-restarts", "2", "--redirects", "1", "--tee", "1"}
	// PYTHON_EXEC names the same interpreter, as each launcher sees it:
	// torchrun runs inside the bed, gorun outside.
	torchrun := exec.Command(bed.Torchrun(), append(append(flags, "--log-dir", t.TempDir()), script)...)
	torchrun.Env = append(os.Environ(), "PYTHON_EXEC=/usr/bin/python3")
	tr := runWithin(t, torchrun, 120*time.Second)
	gorun := exec.Command(bin, append(append(flags, "--log-dir", t.TempDir()), script)...)
	gorun.Env = append(os.Environ(), "PYTHON_EXEC="+bed.Python())
	gr := runWithin(t, gorun, 120*time.Second)
	trEnv, grEnv := workerEnvs(t, tr), workerEnvs(t, gr)
	for _, envs := range []map[int]map[string]string{trEnv, grEnv} {
		for _, e := range envs {
			delete(e, "PYTHON_EXEC")
		}
	}

	extras := maps.Clone(gorunExtras)
	extras["NCCL_ASYNC_ERROR_HANDLING"] = true
	compareWorkerEnvs(t, trEnv, grEnv, 2, envCompare{
		required: []string{"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
			"WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
			"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
			"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"},
		extras: extras,
		notYet: map[string]bool{"TORCHELASTIC_SIGNALS_TO_HANDLE": true},
	}, tr, gr)
}
