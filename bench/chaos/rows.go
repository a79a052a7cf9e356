package main

import (
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
)

// The failure modes of a row: gorun's --on-failure, and heal (shrink with
// the lost ranks respawned and grown back in). torchrun only restarts.
const (
	modeRestart = "restart"
	modeShrink  = "shrink"
	modeHeal    = "heal"
)

// Row is one line of the table: a launcher in a failure mode. Every row
// runs the same worker (-worker-kind) through the same schedule.
type Row struct {
	Name     string
	Torchrun bool // torchrun instead of gorun: 1.13's, or 2.14's with Torch214
	// Torch214: torchrun 2.14, the sid bed's (internal/sidbed), whose
	// workers run in the bed too: with the torch worker kind, PyTorch
	// 2.14 workers.
	Torch214 bool
	Mode     string // modeRestart, modeShrink or modeHeal
	// FaultFree: the row runs no fault; its goodput is the one the others
	// are compared with.
	FaultFree bool
	// Spare: a hot spare agent stands by on the bed's extra host (several
	// hosts only), started once the job runs, its workers pre-started
	// (--spare-prestart).
	Spare bool
	// Standbys: each agent keeps this many workers pre-started for its
	// lost ranks' respawns (--respawn-standbys; heal rows).
	Standbys int
}

// rows are the rows the harness knows, in table order.
var rows = []Row{
	{Name: "gorun, no faults", Mode: modeHeal, FaultFree: true},
	{Name: "gorun restart", Mode: modeRestart},
	{Name: "gorun shrink (--regrow off)", Mode: modeShrink},
	{Name: "gorun shrink+heal", Mode: modeHeal},
	{Name: "torchrun 1.13 restart", Torchrun: true, Mode: modeRestart},
	{Name: "gorun heal, hot spare", Mode: modeHeal, Spare: true},
	// Last, so that the rows' numbers stay what earlier runs named.
	{Name: "torchrun 2.14 restart", Torchrun: true, Torch214: true, Mode: modeRestart},
	{Name: "gorun heal, a respawn standby", Mode: modeHeal, Standbys: 1},
}

// selectRows returns the rows named by number (1-based, comma-separated),
// in table order; all of them for "".
func selectRows(s string) ([]Row, error) {
	if s == "" {
		return slices.Clone(rows), nil
	}
	var idx []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > len(rows) {
			return nil, fmt.Errorf("-rows: %q is not a row number 1..%d", f, len(rows))
		}
		if !slices.Contains(idx, n-1) {
			idx = append(idx, n-1)
		}
	}
	slices.Sort(idx)
	var out []Row
	for _, i := range idx {
		out = append(out, rows[i])
	}
	return out, nil
}

// Worker kinds (-worker-kind).
const (
	// workerGo is examples/allreduce: pg/cpu, the exact sum of the ranks.
	workerGo = "go"
	// workerTorch is examples/torch/train_elastic.py: PyTorch gloo through
	// gorun_ft.py, a deterministic regression whose loss is judged.
	workerTorch = "torch"
)

// bedPython is the sid bed's interpreter as the bed's own programs see it:
// torchrun 2.14 runs in the bed, and so do the workers it starts.
const bedPython = "/usr/bin/python3"

// Job is what every row runs: the binaries and the fixed work.
type Job struct {
	Gorun, Worker, Python string
	// Python214 is the host path of the sid bed's python3 (torchrun
	// 2.14's row); "" when there is no bed.
	Python214 string
	// WorkerKind is workerGo or workerTorch.
	WorkerKind string
	// TorchScript is train_elastic.py where the workers see it: a copy in
	// the temporary directory, which the sid bed sees at the same path.
	TorchScript string
	// LR is train_elastic.py's --lr: small enough that the loss after the
	// run's steps stays far above float64 rounding, so two runs' losses
	// compare to 1e-9 (at its default, 0.05, it converges to ~1e-20
	// within a few hundred steps, where rounding is all that is left).
	LR string
	// RefLoss is the loss a fault-free run of Steps steps at full world
	// ends with (the torch kind; see referenceLoss).
	RefLoss float64
	// Startup is each worker's start-up cost: a sleep before the worker
	// program starts, standing for imports, device init and a checkpoint
	// load. 0: none.
	Startup time.Duration
	Nproc   int // ranks per host
	// Hosts: 1 runs one agent with --standalone; 2 or more run agent i
	// on host i of a network-namespace bed, meeting by Backend's
	// rendezvous.
	Hosts   int
	Backend string // backendC10d (the store on host 0) or backendEtcd
	// The bed's host addresses and the etcd member's endpoint (several
	// hosts).
	HostIPs      []string
	EtcdEndpoint string
	// HostNames and HostsFile give torchrun its host's name (see
	// hostbed.AsHost).
	HostNames []string
	HostsFile string
	// RdzvConf is every multi-host agent's --rdzv-conf.
	RdzvConf string
	// RunID is the job's --rdzv-id: every agent of a run, replacements
	// included, has the same; each run its own (etcd keeps a finished
	// run's state).
	RunID  string
	Steps  int // the fixed work
	StepMs int // each step's cost: the worker's pause before it
	// WorkerTimeout is the worker's --timeout: how long a collective may
	// wait on a silent (hung) peer before it fails. Under torchrun, which
	// has no hang detection, it is what ends a hang.
	WorkerTimeout string
	// HeartbeatTimeout is gorun's --heartbeat-timeout, in seconds: a
	// rank that has not stepped for that long is hung.
	HeartbeatTimeout string
	// DoneTimeout is gorun's --done-timeout, seconds ("": unbounded): a
	// rank the schedule stops after it said it was done (a hang in its
	// teardown) is killed that long after, and the job ends.
	DoneTimeout string
	// RespawnBackoff is gorun's --respawn-backoff in the heal rows.
	RespawnBackoff string
	// ShutdownTimeout is gorun's --shutdown-timeout, seconds; "" for its
	// default (30 s, torchrun's too). A hung (SIGSTOPped) rank ignores
	// the SIGTERM that stops a group, so a restart that stops one waits
	// this long before its SIGKILL.
	ShutdownTimeout string
}

// Rendezvous backends of several hosts.
const (
	backendC10d = "c10d"
	backendEtcd = "etcd"
	// c10dPort is where host 0's agent hosts the c10d store (torchrun's
	// port, in host 0's own namespace).
	c10dPort = 29400
	// healthPort is every multi-host agent's --health-addr port, on its
	// host's address (each host has its own ports).
	healthPort = 29401
)

// World is the job's full size.
func (j Job) World() int { return j.Nproc * max(j.Hosts, 1) }

// agentArgv is the command line of a row's agent on host (0 with one
// host): dir holds its logs and the worker's checkpoint (one file system
// for every host), healthAddr is gorun's --health-addr. standby: the agent
// comes to a running job (a spare, a replacement); in a spare row it
// pre-starts its workers.
func (j Job) agentArgv(r Row, dir, healthAddr string, host int, standby bool) []string {
	logs := filepath.Join(dir, "logs", "h"+strconv.Itoa(host))
	worker := j.workerArgv(r, dir)
	// Restarts and respawns are not what ends a run here: the schedule's
	// faults are many by design.
	const plenty = "100000"
	if r.Torchrun {
		// --redirects 1 --tee 1: torchrun 1.13 crashes on Python 3.11
		// without them (2.14 takes them too: its lines then carry the
		// same [defaultN]: prefix). Its --monitor_interval stays its
		// default (1.13: 5 s; 2.14: 0.1 s).
		py := j.Python
		if r.Torch214 {
			py = j.Python214
		}
		argv := []string{py, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1"}
		if j.Hosts <= 1 {
			argv = append(argv, "--standalone")
		} else {
			// torchrun 1.13 finds its address by its host name, and its
			// etcd rendezvous speaks etcd's v2 API: c10d only.
			argv = append(hostbed.AsHost(j.HostsFile, j.HostNames[host]), argv...)
			argv = append(argv, "--nnodes", strconv.Itoa(j.Hosts), "--rdzv_backend", backendC10d,
				"--rdzv_endpoint", net.JoinHostPort(j.HostIPs[0], strconv.Itoa(c10dPort)), "--rdzv_id", j.RunID, "--rdzv_conf", j.RdzvConf)
		}
		argv = append(argv, "--nproc_per_node", strconv.Itoa(j.Nproc), "--max_restarts", plenty, "--log_dir", logs, "--no_python")
		return append(argv, worker...)
	}
	argv := []string{j.Gorun}
	if j.Hosts <= 1 {
		argv = append(argv, "--standalone")
	} else {
		endpoint, conf := net.JoinHostPort(j.HostIPs[0], strconv.Itoa(c10dPort)), j.RdzvConf
		if j.Backend == backendEtcd {
			// lease_ttl=1: a lost agent's lease lapses in about a second.
			endpoint, conf = j.EtcdEndpoint, strings.TrimPrefix(conf+",lease_ttl=1", ",")
		}
		argv = append(argv, "--nnodes", strconv.Itoa(j.Hosts), "--rdzv-backend", j.Backend, "--rdzv-endpoint", endpoint,
			"--rdzv-id", j.RunID, "--rdzv-conf", conf, "--local-addr", j.HostIPs[host])
		if r.Spare && standby {
			argv = append(argv, "--spare-prestart")
		}
	}
	argv = append(argv, "--nproc-per-node", strconv.Itoa(j.Nproc), "--log-dir", logs,
		"--health-addr", healthAddr, "--heartbeat-timeout", j.HeartbeatTimeout, "--max-restarts", plenty)
	if j.ShutdownTimeout != "" {
		argv = append(argv, "--shutdown-timeout", j.ShutdownTimeout)
	}
	if j.DoneTimeout != "" {
		argv = append(argv, "--done-timeout", j.DoneTimeout)
	}
	switch r.Mode {
	case modeRestart:
		argv = append(argv, "--on-failure", modeRestart)
	case modeShrink:
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "off")
	case modeHeal:
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "on", "--max-respawns", plenty,
			"--respawn-backoff", j.RespawnBackoff)
		if r.Standbys > 0 {
			argv = append(argv, "--respawn-standbys", strconv.Itoa(r.Standbys))
		}
	}
	return append(append(argv, "--no-python"), worker...)
}

// agentEnv is what a row's agent adds to its environment (its workers
// inherit it). The marker finds the job's processes wherever they end up.
// LOGLEVEL=INFO: torchrun logs its rendezvous' result (the group rank)
// only at INFO. On the bed's hosts (onBed), torch workers get
// GLOO_SOCKET_IFNAME=eth0: gloo takes its address from the host name,
// which every host of the bed shares with the machine, and which resolves
// to loopback ("connect [127.0.0.1]:…: Connection refused" between hosts);
// eth0 is each host's one interface besides lo.
func (j Job) agentEnv(marker string, onBed bool) []string {
	env := []string{marker, "PYTHON_EXEC=" + j.Python, "LOGLEVEL=INFO"}
	if onBed && j.WorkerKind == workerTorch {
		env = append(env, "GLOO_SOCKET_IFNAME=eth0")
	}
	return env
}

// workerArgv is the worker's command line in row r, dir holding its
// checkpoint. Both kinds print a progress line per step and checkpoint
// every step (the group's rank 0), so that a restart redoes only the step
// it was in. A start-up cost is startupSleeper before the worker.
func (j Job) workerArgv(r Row, dir string) []string {
	checkpoint := filepath.Join(dir, "checkpoint")
	py := j.Python
	if r.Torch214 {
		py = bedPython
	}
	var argv []string
	switch j.WorkerKind {
	case workerTorch:
		argv = []string{py, j.TorchScript, "--steps", strconv.Itoa(j.Steps), "--step-ms", strconv.Itoa(j.StepMs),
			"--lr", j.LR, "--progress", "--checkpoint", checkpoint}
		// The group's timeout, which ends a hang under torchrun (parseFlags
		// checked it is a duration).
		if d, err := time.ParseDuration(j.WorkerTimeout); err == nil {
			argv = append(argv, "--timeout", strconv.FormatFloat(d.Seconds(), 'f', -1, 64))
		}
	default:
		argv = []string{j.Worker, "--steps", strconv.Itoa(j.Steps), "--step-ms", strconv.Itoa(j.StepMs),
			"--progress", "--checkpoint", checkpoint, "--timeout", j.WorkerTimeout}
	}
	if j.Startup <= 0 {
		return argv
	}
	sleep := strconv.FormatFloat(j.Startup.Seconds(), 'f', -1, 64)
	return append([]string{py, "-c", startupSleeper, sleep}, argv...)
}

// startupSleeper is the start-up cost: a bare Python (tens of ms: no
// torch) that sleeps, then execs the worker. One process throughout, so
// the worker's signals, environment (RANK, a pre-started spare's
// assignment descriptor) and PID are the sleeper's; a shell's `sleep S &&
// exec` would fork the sleep, which outlives a shell SIGKILLed during it.
// argv: seconds, then the worker's command line.
const startupSleeper = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])"
