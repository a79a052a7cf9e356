package main

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
)

// launcherKind is the program that runs the job.
type launcherKind string

const (
	gorunLauncher    launcherKind = "gorun"
	torchrunLauncher launcherKind = "torchrun"
)

// workerKind is the program every rank runs.
type workerKind string

const (
	// goWorker is examples/allreduce on pg/cpu, with --timestamps.
	goWorker workerKind = "go-allreduce"
	// glooWorker is bench/gloo_resume.py: PyTorch gloo, fails on a lost
	// peer, to be restarted.
	glooWorker workerKind = "torch-gloo"
	// elasticWorker is examples/torch/train_elastic.py: PyTorch gloo through
	// gorun_ft, which shrinks.
	elasticWorker workerKind = "torch-elastic"
)

// The failure modes (gorun's --on-failure; torchrun only restarts).
const (
	modeShrink  = "shrink"
	modeRestart = "restart"
)

// row is one line of the table: a launcher, its failure mode and a worker.
type row struct {
	name     string
	launcher launcherKind
	mode     string
	worker   workerKind
}

// rows are the measured combinations, in table order.
var rows = []row{
	{"gorun shrink, Go allreduce (pg/cpu)", gorunLauncher, modeShrink, goWorker},
	{"gorun restart, Go allreduce (pg/cpu)", gorunLauncher, modeRestart, goWorker},
	{"torchrun 1.13 restart, PyTorch gloo", torchrunLauncher, modeRestart, glooWorker},
	{"gorun restart, PyTorch gloo", gorunLauncher, modeRestart, glooWorker},
	{"gorun shrink, PyTorch gloo (gorun_ft)", gorunLauncher, modeShrink, elasticWorker},
}

// torch reports whether the row's workers need PyTorch.
func (r row) torch() bool { return r.worker != goWorker }

// recovery is the (attempt, epoch) whose first successful collective marks
// the group as working again after one rank is killed, and how many ranks
// must reach it: in shrink mode the survivors move to epoch 1 of the same
// attempt; in restart mode every rank starts attempt 1.
func (r row) recovery(world int) (attempt, epoch, ranks int) {
	if r.mode == modeShrink {
		return 0, 1, world - 1
	}
	return 1, 0, world
}

// torchrunPort is where torchrun 1.13 --standalone always hosts its
// rendezvous store (run.py: "localhost:29400").
const torchrunPort = 29400

// agentCommands builds the command of every agent of one run of r — the
// one place that knows launchers' and workers' command lines. dir is the
// run's own directory (for the launchers' logs). With -hosts 1 there is
// one agent, started with --standalone. A multi-host mode would return one
// agent per host here (--nnodes H, a shared --rdzv-endpoint, each started
// in its host's network namespace), and the rest of the benchmark would
// carry on unchanged: it already counts first-collective lines across all
// agents' output.
func (c *config) agentCommands(r row, dir string) ([]*exec.Cmd, error) {
	if c.hosts != 1 {
		return nil, fmt.Errorf("-hosts %d: only 1 is supported yet", c.hosts)
	}
	nproc := strconv.Itoa(c.nproc)
	logDir := filepath.Join(dir, "logs")
	var argv []string
	switch r.launcher {
	case gorunLauncher:
		argv = []string{c.gorun, "--standalone", "--nproc-per-node", nproc, "--log-dir", logDir,
			"--on-failure", r.mode}
		if r.mode == modeRestart {
			argv = append(argv, "--max-restarts", "1")
		}
		if r.mode == modeShrink && c.settleWindow != "" {
			argv = append(argv, "--settle-window", c.settleWindow)
		}
		if r.worker == goWorker {
			argv = append(argv, "--no-python")
		}
	case torchrunLauncher:
		if r.mode != modeRestart {
			return nil, fmt.Errorf("torchrun has no %s mode", r.mode)
		}
		// --redirects 1 --tee 1: torchrun 1.13 crashes on Python 3.11
		// without them.
		argv = []string{c.python, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
			"--standalone", "--nproc_per_node", nproc, "--max_restarts", "1", "--log_dir", logDir}
		if r.worker == goWorker {
			argv = append(argv, "--no_python")
		}
	default:
		return nil, fmt.Errorf("unknown launcher %q", r.launcher)
	}
	argv = append(argv, c.workerArgs(r.worker)...)
	cmd := exec.Command(argv[0], argv[1:]...)
	// PYTHON_EXEC: the python gorun runs a script with.
	cmd.Env = append(cmd.Environ(), "PYTHON_EXEC="+c.python)
	// Its own process group, so that the whole tree can be killed at once
	// (torchrun's workers share it; gorun's have groups of their own and
	// die with gorun by Pdeathsig); and it dies with us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	return []*exec.Cmd{cmd}, nil
}

// workerArgs is the worker's program and arguments, as the launcher takes
// them (a Python script is run by the launcher's Python). Every worker
// runs long enough that only the benchmark ends it, and prints a
// first-collective line per attempt and epoch.
func (c *config) workerArgs(w workerKind) []string {
	step := strconv.Itoa(c.stepMs)
	switch w {
	case goWorker:
		return []string{c.worker, "--steps", "1000000", "--step-ms", step, "--timestamps"}
	case glooWorker:
		return []string{filepath.Join(c.root, "bench", "gloo_resume.py"), "--step-ms", step}
	case elasticWorker:
		return []string{filepath.Join(c.root, "examples", "torch", "train_elastic.py"),
			"--steps", "1000000", "--step-ms", step, "--timestamps"}
	}
	panic("unknown worker " + string(w))
}
