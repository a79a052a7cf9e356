package launcher

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/launcher/cgroup"
	"github.com/gorunhq/gorun/launcher/reaper"
	"github.com/gorunhq/gorun/prestart"
)

// group is one attempt of the local worker group.
type group struct {
	workers []*worker
	exits   chan workerExit // every worker's exit, once
	running int
	// stopping is set once the agent has begun stopping the group: exits
	// from then on are the agent's doing, not failures.
	stopping bool
	// onExit, if set, is told of each exit as it is recorded.
	onExit func(w *worker, stopped bool)
	// contain holds what the workers start (their cgroups); nil holds
	// nothing.
	contain *containment
}

type worker struct {
	a         Assignment
	proc      *os.Process
	errorFile string
	out       *workerOutput
	started   time.Time // when the agent started it
	exited    bool
	exit      reaper.Exit
	// hung says why the agent killed it for a lack of heartbeats;
	// finished, that it had said it was done, and its teardown outlasted
	// the done timeout: its exit counts as a success.
	hung     string
	finished bool
	// excluded: a shrink epoch excluded it while it ran, and the agent
	// killed it. dropped: a newcomer the agent stopped because the job
	// finished before its grow completed.
	excluded, dropped bool
	// newcomer: heal respawned it into a lost slot (or a node admitted
	// late started it), to be grown back in. grownIn is the grow epoch
	// that added it (0: none yet); it is in the group once that grow has
	// completed (survivors.completed).
	newcomer bool
	grownIn  int
	// since is the shrink epoch after which it was started
	// (GORUN_SHRINK_NEWCOMER; 0 for a round's workers).
	since int
	// assignTo is a parked worker's assignment pipe (the agent's end),
	// nil once assigned or for a worker started with its assignment.
	assignTo *os.File
	// exitTo carries the worker's exit to the channel that owns it when
	// it ends: a standby's moves to its group's when it takes a slot.
	exitTo *exitRoute
	// slot is the worker's own cgroup (nil without one): it and all it
	// starts, and nothing else.
	slot *cgroup.Slot
	// oomMark is the OOM kill count that covers the worker when it
	// started (oomKnown: there is one); oom says why an OOM kill is
	// taken to have ended it, "" when none did.
	oomMark  int64
	oomKnown bool
	oom      string
}

type workerExit struct {
	w *worker
	e reaper.Exit
}

// ok reports whether the worker succeeded: it exited 0, or it had said
// it was done and the agent ended its teardown (--done-timeout).
func (x workerExit) ok() bool { return x.e.Code() == 0 || x.w.finished }

// spawnSpec is what startGroup needs besides the assignments.
type spawnSpec struct {
	path   string   // resolved program to exec
	argv   []string // its argv
	env    WorkerEnv
	base   []string // the agent's environment
	dir    string   // the attempt's log directory
	prefix func(Assignment) string
	// filtered are the attempt's filtered_stdout.log and
	// filtered_stderr.log (--duplicate-std*-filters), nil when not asked.
	filtered [2]*filteredLog
	// appendLogs: the workers' log files are added to, not started afresh
	// (heal's newcomers, in a slot whose worker wrote them before).
	appendLogs bool
	// parked starts the workers before their round (SparePrestart): only
	// their local ranks count, and they wait for assign.
	parked bool
	// standby starts a parked worker that has no slot yet (heal's
	// RespawnStandbys): no local rank, no logs of its own, until
	// takeSlot gives it a lost rank's.
	standby bool
	// contain gives each worker a cgroup of its own; nil gives none.
	contain *containment
}

// assignmentFD is the descriptor a parked worker reads its assignment from:
// the first after stdin, stdout and stderr.
const assignmentFD = 3

// startGroup starts one worker per assignment. Each worker is the leader
// of its own process group, so that stopping it reaches its children too,
// and gets SIGKILL if the agent dies (Pdeathsig), so that no worker
// outlives its agent. If one fails to start, those already started are
// killed. Under --numa-binding each starts bound to its CPUs, which are
// found for all first: a binding that cannot be honoured starts none.
func startGroup(rp *reaper.Reaper, con *console, cfg *Config, spec spawnSpec, as []Assignment) (*group, error) {
	cpus, err := numaCPUs(cfg, as)
	if err != nil {
		return nil, err
	}
	g := &group{exits: make(chan workerExit, len(as)), contain: spec.contain}
	for _, a := range as {
		w, err := startWorker(rp, con, cfg, spec, a, cpus[a.LocalRank], g.exits)
		if err != nil {
			g.kill()
			g.wait(nil, 0, nil)
			return nil, err
		}
		g.workers = append(g.workers, w)
		g.running++
	}
	return g, nil
}

// startWorker starts one worker, bound to cpus unless they are nil.
func startWorker(rp *reaper.Reaper, con *console, cfg *Config, spec spawnSpec, a Assignment, cpus []int, exits chan<- workerExit) (*worker, error) {
	w := &worker{a: a}
	var out *workerOutput
	var ends [2]*os.File
	var err error
	if spec.standby {
		out, ends, err = openHeldOutput(con)
	} else {
		var plans [2]streamPlan
		if plans, err = w.logsIn(cfg, spec); err != nil {
			return nil, err
		}
		out, ends, err = openOutput(con, spec.prefix(a), plans)
	}
	if err != nil {
		return nil, err
	}
	attr := &os.ProcAttr{
		Env:   spec.env.Environ(spec.base, a, w.errorFile),
		Files: []*os.File{os.Stdin, ends[0], ends[1]},
		Sys:   &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL},
	}
	if err := spec.contain.slotFor(w, attr); err != nil {
		out.abort()
		return nil, err
	}
	var assignFrom *os.File
	if spec.parked {
		if assignFrom, w.assignTo, err = os.Pipe(); err != nil {
			out.abort()
			spec.contain.remove(w)
			return nil, err
		}
		if spec.standby {
			attr.Env = spec.env.StandbyEnviron(spec.base, assignmentFD)
		} else {
			attr.Env = spec.env.ParkedEnviron(spec.base, a.LocalRank, w.errorFile, assignmentFD)
		}
		attr.Files = append(attr.Files, assignFrom)
	}
	var proc *os.Process
	var ch <-chan reaper.Exit
	w.started = time.Now()
	err = startBound(cpus, func() (err error) {
		proc, ch, err = rp.Start(spec.path, spec.argv, attr)
		return err
	})
	out.started()
	if assignFrom != nil {
		assignFrom.Close() // the worker's end
	}
	if err != nil {
		out.abort()
		w.closeAssignment()
		spec.contain.remove(w)
		return nil, fmt.Errorf("start %s: %w", spec.path, err)
	}
	spec.contain.started(w)
	w.proc, w.out, w.since = proc, out, spec.env.NewcomerAfter
	w.exitTo = &exitRoute{to: exits}
	go func() { w.exitTo.deliver(workerExit{w, <-ch}) }()
	return w, nil
}

// logsIn readies w's log directory in the attempt's (spec.dir), for its
// local rank, and returns where its streams go: its error file is named
// there, and a stale one from an earlier run, which must not be taken for
// this worker's, is removed.
func (w *worker) logsIn(cfg *Config, spec spawnSpec) ([2]streamPlan, error) {
	dir := filepath.Join(spec.dir, strconv.Itoa(w.a.LocalRank))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return [2]streamPlan{}, err
	}
	w.errorFile = filepath.Join(dir, "error.json")
	if err := os.Remove(w.errorFile); err != nil && !os.IsNotExist(err) {
		return [2]streamPlan{}, err
	}
	plans := routes(cfg, w.a.LocalRank, dir, spec.filtered)
	for i := range plans {
		plans[i].appendFile = spec.appendLogs
	}
	return plans, nil
}

// exitRoute carries one worker's exit to the channel that owns the worker
// when it ends. A standby's goes to the standbys' until it takes a slot
// (move), then to its group's, which every wait on the group reads.
type exitRoute struct {
	mu   sync.Mutex
	to   chan<- workerExit
	sent bool
}

func (r *exitRoute) deliver(x workerExit) {
	r.mu.Lock()
	to := r.to
	r.sent = true
	r.mu.Unlock()
	to <- x
}

// move sends the exit to to from now on; false when it has been sent
// already (the worker has exited).
func (r *exitRoute) move(to chan<- workerExit) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sent {
		return false
	}
	r.to = to
	return true
}

// respawn starts a newcomer in the slot of old, a worker that has exited
// (heal): the same assignment, GORUN_SHRINK_NEWCOMER=after (the last epoch
// decided), its lines added to old's logs. It takes old's place in the
// group; what old left in its process group is killed first.
func (g *group) respawn(rp *reaper.Reaper, con *console, cfg *Config, spec spawnSpec, old *worker, after int) (*worker, error) {
	i := slices.Index(g.workers, old)
	if i < 0 || !old.exited {
		return nil, fmt.Errorf("respawn of rank %d: its worker is not an exited one of this group", old.a.Rank)
	}
	syscall.Kill(-old.proc.Pid, syscall.SIGKILL) // ESRCH when nothing is left
	g.contain.remove(old)
	old.out.drain(outputDrainTimeout)
	spec.env.NewcomerAfter, spec.appendLogs = after, true
	cpus, err := numaCPUs(cfg, []Assignment{old.a})
	if err != nil {
		return nil, err
	}
	w, err := startWorker(rp, con, cfg, spec, old.a, cpus[old.a.LocalRank], g.exits)
	if err != nil {
		return nil, err
	}
	w.newcomer = true
	g.workers[i] = w
	g.running++
	return w, nil
}

// takeSlot gives the standby sb the slot of old, a worker of g that has
// exited (heal's respawn, as respawn does with a new process): old's
// assignment, GORUN_SHRINK_NEWCOMER=after, its lines (those it held while
// parked first) added to old's logs. It reports false, changing nothing,
// when sb has exited already: its exit is the standbys'.
func (g *group) takeSlot(cfg *Config, spec spawnSpec, sb, old *worker, after int) (bool, error) {
	i := slices.Index(g.workers, old)
	if i < 0 || !old.exited {
		return false, fmt.Errorf("a standby for rank %d: its worker is not an exited one of this group", old.a.Rank)
	}
	if !sb.exitTo.move(g.exits) {
		return false, nil
	}
	syscall.Kill(-old.proc.Pid, syscall.SIGKILL) // ESRCH when nothing is left
	g.contain.remove(old)
	old.out.drain(outputDrainTimeout)
	spec.env.NewcomerAfter, spec.appendLogs = after, true
	sb.a, sb.since, sb.newcomer, sb.started = old.a, after, true, time.Now()
	plans, err := sb.logsIn(cfg, spec)
	if err == nil {
		sb.out.setPrefix(spec.prefix(sb.a))
		err = sb.out.route(plans)
	}
	g.workers[i] = sb
	g.running++
	if err != nil {
		// In the group, so that its exit is waited for like any other.
		syscall.Kill(-sb.proc.Pid, syscall.SIGKILL)
		return true, fmt.Errorf("a standby for rank %d: its logs: %w", old.a.Rank, err)
	}
	// A standby that died meanwhile closed its end: the write fails
	// (EPIPE) and its exit, now the group's, tells.
	prestart.Write(sb.assignTo, spec.env.Assigned(spec.base, sb.a, sb.errorFile))
	sb.closeAssignment()
	return true, nil
}

// assign gives the parked workers of g (spec.parked) their round: as, by
// local rank, with spec's environment; spec.dir is the attempt's log
// directory, where their error files are now. A worker that has exited
// meanwhile gets nothing: its exit is the round's to handle.
func (g *group) assign(spec spawnSpec, as []Assignment) error {
	if len(as) != len(g.workers) {
		return fmt.Errorf("%d assignments for %d pre-started workers", len(as), len(g.workers))
	}
	for _, w := range g.workers {
		i := slices.IndexFunc(as, func(a Assignment) bool { return a.LocalRank == w.a.LocalRank })
		if i < 0 {
			return fmt.Errorf("no assignment for the pre-started worker of local rank %d", w.a.LocalRank)
		}
		w.a, w.since = as[i], spec.env.NewcomerAfter
		w.errorFile = filepath.Join(spec.dir, strconv.Itoa(w.a.LocalRank), "error.json")
		w.out.setPrefix(spec.prefix(w.a))
		if w.assignTo == nil {
			continue
		}
		// A worker that died meanwhile closed its end: the write fails
		// (EPIPE, no signal on this descriptor) and its exit tells.
		prestart.Write(w.assignTo, spec.env.Assigned(spec.base, w.a, w.errorFile))
		w.closeAssignment()
	}
	return nil
}

// closeAssignment closes a parked worker's assignment pipe: one not
// assigned yet reads end of file and exits.
func (w *worker) closeAssignment() {
	if w.assignTo != nil {
		w.assignTo.Close()
		w.assignTo = nil
	}
}

// pids lists the workers' PIDs in local-rank order.
func (g *group) pids() []int {
	out := make([]int, len(g.workers))
	for i, w := range g.workers {
		out[i] = w.proc.Pid
	}
	return out
}

// record marks a worker exited.
func (g *group) record(x workerExit) {
	if !x.w.exited {
		x.w.exited, x.w.exit = true, x.e
		g.contain.ended(x.w)
		g.running--
		if g.onExit != nil {
			g.onExit(x.w, g.stopping)
		}
	}
}

// signal sends sig to the process group of every worker still running,
// and then SIGCONT: a stopped worker (SIGSTOP, a debugger's) acts on sig
// only once continued, and would otherwise hold the group for the whole
// grace period.
func (g *group) signal(sig syscall.Signal) {
	for _, w := range g.workers {
		if !w.exited {
			syscall.Kill(-w.proc.Pid, sig)
			if sig != syscall.SIGKILL && sig != syscall.SIGCONT {
				syscall.Kill(-w.proc.Pid, syscall.SIGCONT)
			}
		}
	}
}

func (g *group) kill() { g.signal(syscall.SIGKILL) }

// wait collects exits until every worker has exited. If grace is positive
// and runs out first, the stragglers get SIGKILL; a second stop signal on
// sigs (SIGINT or SIGTERM again) kills at once, and any other signal is
// passed on. Then the group's leftovers — children of a worker still in
// its process group — are killed, and the output copies drained.
func (g *group) wait(sigs <-chan os.Signal, grace time.Duration, forward func(os.Signal)) {
	var deadline <-chan time.Time
	if grace > 0 {
		t := time.NewTimer(grace)
		defer t.Stop()
		deadline = t.C
	}
	for g.running > 0 {
		select {
		case x := <-g.exits:
			g.record(x)
		case <-deadline:
			g.kill()
			deadline = nil
		case s := <-sigs:
			if s == syscall.SIGINT || s == syscall.SIGTERM {
				g.kill()
			} else if forward != nil {
				forward(s)
			}
		}
	}
	for _, w := range g.workers {
		syscall.Kill(-w.proc.Pid, syscall.SIGKILL) // ESRCH when nothing is left
		w.closeAssignment()
		g.contain.remove(w)
	}
	for _, w := range g.workers {
		w.out.drain(outputDrainTimeout)
	}
}

// stop asks every running worker to stop with sig, waits up to grace, then
// kills what is left.
func (g *group) stop(sig syscall.Signal, grace time.Duration, sigs <-chan os.Signal, forward func(os.Signal)) {
	g.stopping = true
	g.signal(sig)
	g.wait(sigs, grace, forward)
}

// outputDrainTimeout bounds how long the agent waits, after a worker's
// process group is gone, for the last of its output: a grandchild that
// left the group (setsid) could otherwise hold the pipe open forever.
const outputDrainTimeout = 2 * time.Second
