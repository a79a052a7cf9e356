package main

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The failure modes of a row: gorun's --on-failure, and heal (shrink with
// the lost ranks respawned and grown back in). torchrun only restarts.
const (
	modeRestart = "restart"
	modeShrink  = "shrink"
	modeHeal    = "heal"
)

// Row is one line of the table: a launcher in a failure mode. Every row
// runs the same Go worker (examples/allreduce) through the same schedule.
type Row struct {
	Name     string
	Torchrun bool   // torchrun 1.13 instead of gorun
	Mode     string // modeRestart, modeShrink or modeHeal
	// FaultFree: the row runs no fault; its goodput is the one the others
	// are compared with.
	FaultFree bool
}

// rows are the rows the harness knows, in table order.
var rows = []Row{
	{Name: "gorun, no faults", Mode: modeHeal, FaultFree: true},
	{Name: "gorun restart", Mode: modeRestart},
	{Name: "gorun shrink (--regrow off)", Mode: modeShrink},
	{Name: "gorun shrink+heal", Mode: modeHeal},
	{Name: "torchrun 1.13 restart", Torchrun: true, Mode: modeRestart},
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

// Job is what every row runs: the binaries and the fixed work.
type Job struct {
	Gorun, Worker, Python string
	Nproc                 int // ranks (one host, --standalone)
	Steps                 int // the fixed work
	StepMs                int // each step's cost: the worker's pause before it
	// WorkerTimeout is the worker's --timeout: how long a collective may
	// wait on a silent (hung) peer before it fails. Under torchrun, which
	// has no hang detection, it is what ends a hang.
	WorkerTimeout string
	// HeartbeatTimeout is gorun's --heartbeat-timeout, in seconds: a
	// rank that has not stepped for that long is hung.
	HeartbeatTimeout string
	// RespawnBackoff is gorun's --respawn-backoff in the heal rows.
	RespawnBackoff string
	// ShutdownTimeout is gorun's --shutdown-timeout, seconds; "" for its
	// default (30 s, torchrun's too). A hung (SIGSTOPped) rank ignores
	// the SIGTERM that stops a group, so a restart that stops one waits
	// this long before its SIGKILL.
	ShutdownTimeout string
}

// agentArgv is the command line of a row's agent: dir holds its logs and
// the worker's checkpoint, healthAddr is gorun's --health-addr.
func (j Job) agentArgv(r Row, dir, healthAddr string) []string {
	logs := filepath.Join(dir, "logs")
	worker := []string{j.Worker, "--steps", strconv.Itoa(j.Steps), "--step-ms", strconv.Itoa(j.StepMs),
		"--progress", "--checkpoint", filepath.Join(dir, "checkpoint"), "--timeout", j.WorkerTimeout}
	// Restarts and respawns are not what ends a run here: the schedule's
	// faults are many by design.
	const plenty = "100000"
	if r.Torchrun {
		// --redirects 1 --tee 1: torchrun 1.13 crashes on Python 3.11
		// without them. Its --monitor_interval stays its default (5 s).
		argv := []string{j.Python, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1", "--standalone",
			"--nproc_per_node", strconv.Itoa(j.Nproc), "--max_restarts", plenty, "--log_dir", logs, "--no_python"}
		return append(argv, worker...)
	}
	argv := []string{j.Gorun, "--standalone", "--nproc-per-node", strconv.Itoa(j.Nproc), "--log-dir", logs,
		"--health-addr", healthAddr, "--heartbeat-timeout", j.HeartbeatTimeout, "--max-restarts", plenty}
	if j.ShutdownTimeout != "" {
		argv = append(argv, "--shutdown-timeout", j.ShutdownTimeout)
	}
	switch r.Mode {
	case modeRestart:
		argv = append(argv, "--on-failure", modeRestart)
	case modeShrink:
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "off")
	case modeHeal:
		argv = append(argv, "--on-failure", modeShrink, "--regrow", "on", "--max-respawns", plenty,
			"--respawn-backoff", j.RespawnBackoff)
	}
	return append(append(argv, "--no-python"), worker...)
}
