package main

import (
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
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

// The failure modes (gorun's --on-failure; torchrun only restarts), and
// heal: --on-failure shrink with the lost rank respawned and grown back in
// (--regrow on, gorun's default).
const (
	modeShrink  = "shrink"
	modeRestart = "restart"
	modeHeal    = "heal"
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
	{"gorun heal, Go allreduce (pg/cpu)", gorunLauncher, modeHeal, goWorker},
	{"gorun heal, PyTorch gloo (gorun_ft)", gorunLauncher, modeHeal, elasticWorker},
}

// torch reports whether the row's workers need PyTorch.
func (r row) torch() bool { return r.worker != goWorker }

// recovery is the (attempt, epoch) whose first successful collective marks
// the group as working again after the fault, and how many ranks must
// reach it. In shrink mode the survivors move to epoch 1 of the same
// attempt; in restart mode the group starts attempt 1. The survivors are
// every rank but the killed one, or every rank of the hosts that were not
// cut off; a restart after a SIGKILL brings the killed rank back, one
// after a cut does not (its host cannot rejoin).
//
// Heal recovers to full size: the killed rank's newcomer grown back in by
// epoch 2, every rank there.
func (r row) recovery(fault string, hosts, nproc int) (attempt, epoch, ranks int) {
	world, lost := hosts*nproc, 1
	if hostLost(fault) {
		lost = nproc
	}
	switch {
	case r.mode == modeHeal:
		return 0, 2, world
	case r.mode == modeShrink:
		return 0, 1, world - lost
	case hostLost(fault):
		return 1, 0, world - lost
	}
	return 1, 0, world
}

// torchrunPort is where torchrun 1.13 --standalone always hosts its
// rendezvous store (run.py: "localhost:29400"). The multi-host mode hosts
// the c10d store on host 0 at the same port (its own network namespace).
const torchrunPort = 29400

// agentSpec is how one agent of a run is started.
type agentSpec struct {
	host int      // the bed's host it runs in; -1: the root namespace (-hosts 1)
	argv []string // the program and its arguments
	env  []string // added to the benchmark's environment
}

// agents builds the command of every agent of one run of r — the one
// place that knows launchers' and workers' command lines. dir is the run's
// own directory (for the launchers' logs), runID its --rdzv-id (a fresh
// one per run: etcd keeps a finished run's state). With -hosts 1 there is
// one agent, started with --standalone; with several, agent i runs in host
// i and the agents meet through the -backend rendezvous; a heal row after
// a cut-off host adds a spare (see hasSpare).
func (c *config) agents(r row, dir, runID string) ([]agentSpec, error) {
	if r.launcher == torchrunLauncher && r.mode != modeRestart {
		return nil, fmt.Errorf("torchrun has no %s mode", r.mode)
	}
	var specs []agentSpec
	agents := c.hosts
	if c.hasSpare(r) {
		agents++ // the spare, on the bed's extra host
	}
	for host := range agents {
		var (
			argv []string
			err  error
		)
		switch r.launcher {
		case gorunLauncher:
			argv = c.gorunArgs(r, host, dir, runID)
		case torchrunLauncher:
			argv, err = c.torchrunArgs(host, dir, runID)
		default:
			err = fmt.Errorf("unknown launcher %q", r.launcher)
		}
		if err != nil {
			return nil, err
		}
		// PYTHON_EXEC: the python gorun runs a script with.
		spec := agentSpec{host: host, argv: append(argv, c.workerArgs(r.worker)...), env: []string{"PYTHON_EXEC=" + c.python}}
		if c.hosts == 1 {
			spec.host = -1
		} else if r.torch() {
			// Every host has the machine's host name, which resolves to
			// loopback: gloo is told its interface, as on any
			// multi-homed host.
			spec.env = append(spec.env, "GLOO_SOCKET_IFNAME=eth0")
		}
		specs = append(specs, spec)
	}
	return specs, nil
}

// gorunArgs is gorun's command line for host's agent, up to the worker.
func (c *config) gorunArgs(r row, host int, dir, runID string) []string {
	nproc := strconv.Itoa(c.nproc)
	argv := []string{c.gorun}
	if c.hosts == 1 {
		argv = append(argv, "--standalone")
	} else {
		backend, endpoint, conf := c.rendezvous()
		argv = append(argv, "--nnodes", c.nnodes(r), "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
			"--rdzv-id", runID, "--rdzv-conf", conf, "--local-addr", c.hostIPs[host])
	}
	argv = append(argv, "--nproc-per-node", nproc, "--log-dir", c.logDir(dir, host))
	switch r.mode {
	case modeRestart:
		argv = append(argv, "--on-failure", modeRestart, "--max-restarts", "1")
	case modeShrink:
		// Shrink alone: the rows measure the survivors carrying on.
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "off")
	case modeHeal:
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "on", "--respawn-backoff", c.respawnBackoff)
	}
	if r.mode != modeRestart && c.settleWindow != "" {
		argv = append(argv, "--settle-window", c.settleWindow)
	}
	argv = append(argv, strings.Fields(c.gorunFlags)...)
	if c.sparePrestart && c.hasSpare(r) && host == c.spareHost() {
		argv = append(argv, "--spare-prestart")
	}
	if r.worker == goWorker {
		argv = append(argv, "--no-python")
	}
	return argv
}

// torchrunArgs is torchrun's command line for host's agent, up to the
// worker.
//
// torchrun 1.13 has no --local_addr: it tells the workers to meet at
// MASTER_ADDR = the fully qualified host name of group rank 0's agent, and
// decides which agent hosts the c10d store by comparing the endpoint with
// its own host name. The bed's hosts share the machine's host name, which
// resolves to loopback, so on several hosts every agent runs in a UTS
// namespace of its own with its host's name (the namespace's), and sees an
// /etc/hosts (bind-mounted in the mount namespace that `ip netns exec`
// makes) that names every host of the bed — as real hosts are named.
func (c *config) torchrunArgs(host int, dir, runID string) ([]string, error) {
	// --redirects 1 --tee 1: torchrun 1.13 crashes on Python 3.11
	// without them.
	run := []string{c.python, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1"}
	if c.hosts == 1 {
		run = append(run, "--standalone")
	} else {
		if c.backend != backendC10d {
			return nil, fmt.Errorf("torchrun: -backend %s: %s", c.backend, torchrunEtcd)
		}
		run = append(run, "--nnodes", c.nnodes(row{mode: modeRestart}), "--rdzv_backend", backendC10d,
			"--rdzv_endpoint", c.c10dEndpoint(), "--rdzv_id", runID, "--rdzv_conf", c.rdzvConf)
		run = append(hostbed.AsHost(c.hostsFile, c.hostNames[host]), run...)
	}
	return append(run, "--nproc_per_node", strconv.Itoa(c.nproc), "--max_restarts", "1", "--log_dir", c.logDir(dir, host)), nil
}

// torchrunEtcd says why the torchrun row runs with the c10d backend only.
const torchrunEtcd = "torchrun 1.13's etcd rendezvous speaks etcd's v2 API through the python-etcd package; it runs with -backend c10d only"

// hasSpare reports whether a run of r has a spare agent standing by: heal
// after a cut-off host needs a node to take its place. It runs on the
// bed's extra host (setUpHosts makes one more with -fault blackhole), with
// the job's command: it finds the round full and waits for room.
func (c *config) hasSpare(r row) bool {
	return r.mode == modeHeal && hostLost(c.fault) && c.hosts > 1
}

// spareHost is the host (and agent index) of the heal rows' spare: the
// bed's extra host.
func (c *config) spareHost() int { return c.hosts }

// nnodes is --nnodes for a multi-host run of r: every host, except that a
// restart after a cut-off host needs a range that lets the others carry on.
func (c *config) nnodes(r row) string {
	if r.mode == modeRestart && hostLost(c.fault) {
		return "1:" + strconv.Itoa(c.hosts)
	}
	return strconv.Itoa(c.hosts)
}

// rendezvous returns gorun's --rdzv-backend, --rdzv-endpoint and
// --rdzv-conf for -backend.
func (c *config) rendezvous() (backend, endpoint, conf string) {
	if c.backend == backendEtcd {
		return backendEtcd, c.etcdEndpoint, joinConf(c.rdzvConf, c.etcdConf)
	}
	return backendC10d, c.c10dEndpoint(), joinConf(c.rdzvConf, c.c10dConf)
}

// c10dEndpoint is the c10d rendezvous store, hosted by host 0's agent.
func (c *config) c10dEndpoint() string {
	return net.JoinHostPort(c.hostIPs[0], strconv.Itoa(torchrunPort))
}

// joinConf joins --rdzv-conf lists, leaving out empty ones.
func joinConf(confs ...string) string {
	return strings.Join(slices.DeleteFunc(confs, func(s string) bool { return s == "" }), ",")
}

// logDir is the launcher's log directory: one per host, which share the
// file system.
func (c *config) logDir(dir string, host int) string {
	if c.hosts == 1 {
		return filepath.Join(dir, "logs")
	}
	return filepath.Join(dir, "logs", "h"+strconv.Itoa(host))
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
