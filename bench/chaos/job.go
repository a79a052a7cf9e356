package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
	"github.com/gorunhq/gorun/bench/internal/procs"
)

// Run-time settings of a row's run that are not the job's.
type runEnv struct {
	bed *hostbed.Bed // nil with one host
	// replaceAfter is how long after an agent is killed a replacement
	// agent starts on its host (a replacement node).
	replaceAfter time.Duration
	// cutFor is how long a link cut lasts before the link heals.
	cutFor  time.Duration
	timeout time.Duration // bound on the run
	// fromFirstStep counts the schedule from the job's first step
	// (-clock first-step) instead of from its launch: a short run's faults
	// then strike training however long the start-up took.
	fromFirstStep bool
	// witness is the host whose agent witnesses the job
	// (ScheduleConfig.Witness).
	witness int
	console io.Writer
}

// agent is one launcher process of a run, on a host.
type agent struct {
	host    int
	cmd     *exec.Cmd
	pipe    *os.File
	exited  chan struct{} // closed once waited for; err holds Wait's
	err     error
	at      time.Time // when it exited
	scanned chan struct{}
	killed  bool // by a fault
	standby bool // came to a running job: a spare, a replacement
	// placeTaken: its place in the round went to another node; it waits
	// to join again, as a spare does.
	placeTaken atomic.Bool
	stopped    bool // still standing by at the end, stopped by the harness
	// restarted: it exited by itself, in error, while the job ran, and the
	// harness started its host's agent again (restartExited).
	restarted bool
}

func (a *agent) done() bool {
	select {
	case <-a.exited:
		return true
	default:
		return false
	}
}

// runner is one row's run: its agents and what they printed.
type runner struct {
	j      Job
	r      Row
	env    runEnv
	dir    string
	marker string
	t0     time.Time
	out    *output
	agents []*agent
	// spares are our children that are no job's (etcd): never reaped
	// as leftovers.
	spares []int
	single string // one host: the agent's --health-addr (a free port)
	// cut are the hosts whose link is cut now (LinkCut): healed when the
	// cut ends, and at the row's end, since the bed serves the next row.
	cut map[int]bool
}

// healthAddr is host's agent's --health-addr.
func (ru *runner) healthAddr(host int) string {
	if ru.env.bed == nil {
		return ru.single
	}
	return net.JoinHostPort(ru.j.HostIPs[host], strconv.Itoa(healthPort))
}

// start starts an agent on host.
func (ru *runner) start(host int, standby bool) error {
	argv := ru.j.agentArgv(ru.r, ru.dir, ru.healthAddr(host), host, standby)
	var cmd *exec.Cmd
	if ru.env.bed == nil {
		cmd = exec.Command(argv[0], argv[1:]...)
	} else {
		cmd = ru.env.bed.Hosts[host].Command(context.Background(), argv[0], argv[1:]...)
	}
	cmd.Env = append(os.Environ(), ru.j.agentEnv(ru.marker, ru.env.bed != nil)...)
	// Its own process group, to end the whole tree at once; it dies with
	// us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	label := ""
	if ru.env.bed != nil {
		label = "[h" + strconv.Itoa(host) + "] "
	}
	fmt.Fprintf(ru.env.console, "# %v %s%s\n", time.Since(ru.t0).Round(time.Millisecond), label, strings.Join(argv, " "))
	err = cmd.Start()
	pw.Close() // the agent and its workers hold it now
	if err != nil {
		pr.Close()
		return fmt.Errorf("start %s: %w", argv[0], err)
	}
	a := &agent{host: host, cmd: cmd, pipe: pr, exited: make(chan struct{}), scanned: make(chan struct{}), standby: standby}
	ru.agents = append(ru.agents, a)
	go func() {
		ru.out.scan(pr, ru.env.console, ru.t0, label, ru.j.Nproc, func() { a.placeTaken.Store(true) })
		close(a.scanned)
	}()
	go func() { a.err = cmd.Wait(); a.at = time.Now(); close(a.exited) }()
	return nil
}

// current is host's latest agent that is running, or nil.
func (ru *runner) current(host int) *agent {
	for i := len(ru.agents) - 1; i >= 0; i-- {
		if a := ru.agents[i]; a.host == host && !a.done() {
			return a
		}
	}
	return nil
}

// pids are the running agents' processes.
func (ru *runner) pids() []int {
	var out []int
	for _, a := range ru.agents {
		if !a.done() {
			out = append(out, a.cmd.Process.Pid)
		}
	}
	return out
}

// runRow runs the job of row r through sched (none for a fault-free row)
// and checks the invariants. stepTime is a step at the fault-free rate (0
// when not known yet). Everything it starts is ended before it returns.
//
// The witness host's agent (host 0's, unless the coordinator's host may be
// lost: see ScheduleConfig.Witness) is never a fault's target, so the run
// ends when it exits, its exit code is the job's, and its resources are
// the ones sampled.
func runRow(ctx context.Context, j Job, r Row, sched []Fault, stepTime time.Duration, lim Limits, env runEnv) (res RowResult, err error) {
	res.Row = r
	lim = lim.withDefaults().perRank(j.World())
	if j.Backend == backendEtcd {
		lim = lim.perHost(max(j.Hosts, 1))
	}
	if j.WorkerKind == workerTorch {
		lim = lim.torchGroups(j.World())
	}
	ru := &runner{j: j, r: r, env: env, out: newOutput(), cut: map[int]bool{},
		marker: fmt.Sprintf("GORUN_CHAOS_RUN=%d-%d", os.Getpid(), time.Now().UnixNano())}
	ru.env.console = &procs.LockedWriter{W: env.console}
	if env.bed != nil && env.bed.Etcd != nil {
		ru.spares = append(ru.spares, env.bed.Etcd.PID())
	}
	if ru.dir, err = os.MkdirTemp("", "chaos-"); err != nil {
		return res, err
	}
	defer os.RemoveAll(ru.dir)
	ctx, cancel := context.WithTimeout(ctx, env.timeout)
	defer cancel()
	if r.Torchrun && env.bed == nil {
		// torchrun 1.13 --standalone always hosts its store on 29400.
		if err := procs.WaitPortFree(ctx, 29400); err != nil {
			return res, err
		}
	}
	if env.bed == nil {
		if ru.single, err = freeAddr(); err != nil {
			return res, err
		}
	}
	ru.t0 = time.Now()
	defer ru.end(&res)
	for host := range max(j.Hosts, 1) {
		if err := ru.start(host, false); err != nil {
			return res, err
		}
	}
	witness := ru.current(env.witness)
	var ec *etcdCounter
	if j.Backend == backendEtcd && j.Hosts > 1 && !r.Torchrun {
		ec = newEtcdCounter(j.EtcdEndpoint, j.RunID)
		defer ec.close()
	}

	cmd := commander(exec.CommandContext)
	if env.bed != nil {
		cmd = env.bed.Hosts[env.witness].Command
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	// After a host fault: a replacement agent (AgentKill), or the link
	// healed (LinkCut, heal).
	type replacement struct {
		host int
		at   time.Time
		heal bool
	}
	var pending []replacement
	spareStarted := !r.Spare || env.bed == nil
	next := 0
	clock := ru.t0 // the schedule's zero
	if env.fromFirstStep {
		clock = time.Time{} // set at the first step
	}
	for !witness.done() {
		var faultC, replaceC <-chan time.Time
		if next < len(sched) {
			if clock.IsZero() && ru.out.started() {
				clock = time.Now()
				fmt.Fprintf(ru.env.console, "# the schedule's clock starts at %v (the first step)\n", time.Since(ru.t0).Round(time.Millisecond))
			}
			if clock.IsZero() {
				faultC = time.After(20 * time.Millisecond) // look for the first step again
			} else {
				faultC = time.After(time.Until(clock.Add(sched[next].At)))
			}
		}
		if len(pending) > 0 {
			replaceC = time.After(time.Until(pending[0].at))
		}
		select {
		case <-witness.exited:
		case <-ctx.Done():
			return res, fmt.Errorf("%s: %w after %v (%d progress lines)", r.Name, context.Cause(ctx), time.Since(ru.t0).Round(time.Second), ru.out.lines())
		case <-faultC:
			if clock.IsZero() {
				break
			}
			a := ru.bring(ctx, sched[next])
			res.Faults = append(res.Faults, a)
			fmt.Fprintf(ru.env.console, "# fault %v\n", a)
			switch {
			case a.Skipped != "":
			case a.Kind == LinkCut:
				pending = append(pending, replacement{a.Target, time.Now().Add(env.cutFor), true})
				slices.SortFunc(pending, func(x, y replacement) int { return x.at.Compare(y.at) })
			case a.Kind.hostFault():
				pending = append(pending, replacement{a.Target, time.Now().Add(env.replaceAfter), false})
				slices.SortFunc(pending, func(x, y replacement) int { return x.at.Compare(y.at) })
			}
			next++
		case <-replaceC:
			p := pending[0]
			pending = pending[1:]
			if p.heal {
				if err := ru.heal(p.host); err != nil {
					return res, err
				}
				fmt.Fprintf(ru.env.console, "# healed the link of host %d at %v\n", p.host, time.Since(ru.t0).Round(time.Millisecond))
				break
			}
			if err := ru.start(p.host, true); err != nil {
				return res, err
			}
		case <-tick.C:
			for _, host := range ru.restartExited(witness) {
				pending = append(pending, replacement{host, time.Now().Add(env.replaceAfter), false})
				slices.SortFunc(pending, func(x, y replacement) int { return x.at.Compare(y.at) })
			}
			// Samples while the workers run: a finishing job's agent
			// has fewer of everything.
			if !ru.out.started() || ru.out.finishing() {
				break
			}
			if !spareStarted {
				// The spare comes once the job runs, so that it cannot
				// take a member's place: on the bed's extra host.
				if err := ru.start(j.Hosts, true); err != nil {
					return res, err
				}
				spareStarted = true
			}
			// A sample the exiting agent could not answer in full is
			// not one.
			s := sample(ctx, j, r, witness.cmd.Process.Pid, ru.healthAddr(env.witness), cmd, time.Since(ru.t0), ru.out.nEpochs(), ec)
			if s.FDs > 0 && s.RSSKiB > 0 && (r.Torchrun || s.Goroutines > 0) {
				fmt.Fprintf(ru.env.console, "# sample %+v\n", s)
				res.Samples = append(res.Samples, s)
				if ec != nil && len(res.Samples)%15 == 0 {
					fmt.Fprintf(ru.env.console, "# etcd keys by directory: %v\n", ec.dirs(ctx))
				}
			}
		}
	}
	res.Wall = witness.at.Sub(ru.t0)
	if ec != nil {
		fmt.Fprintf(ru.env.console, "# etcd keys at the end, by directory: %v\n", ec.dirs(ctx))
	}
	waitErr := witness.err
	// The others finish with it; an agent still standing by (a spare
	// never admitted) is stopped, which is no failure.
	ru.settle(10 * time.Second)
	for _, a := range ru.agents {
		if a == witness {
			continue
		}
		// A replacement that came as the job ended finds it over:
		// gorun's exit code 7, no failure; so does an agent whose place
		// went to another while it was cut off, waiting to join again.
		late := (a.standby || a.placeTaken.Load()) && a.cmd.ProcessState != nil && a.cmd.ProcessState.ExitCode() == exitJobEnded
		if !a.killed && !a.stopped && !late && a.err != nil && waitErr == nil {
			waitErr = fmt.Errorf("the agent on host %d: %w", a.host, a.err)
		}
	}
	for _, a := range ru.agents {
		select {
		case <-a.scanned:
		case <-time.After(5 * time.Second):
		}
	}
	res.Left = len(ru.cleanUp())
	judge(&res, j, ru.out, waitErr, stepTime, lim)
	return res, nil
}

// restartExited returns the hosts whose agent (the witness's aside) has
// exited by itself, in error, since the last look (but for a late node's
// exit 7: the job has ended), and says so on the console. Such an exit is gorun's failure, judged at the end (the job did
// not complete), but its host is not left empty for the rest of the
// schedule, every later fault there skipped: the harness starts it again,
// as a Job's pod restart would.
func (ru *runner) restartExited(witness *agent) []int {
	var hosts []int
	for _, a := range ru.agents {
		if a == witness || a.killed || a.stopped || a.restarted || !a.done() || a.err == nil {
			continue
		}
		if a.cmd.ProcessState != nil && a.cmd.ProcessState.ExitCode() == exitJobEnded {
			continue // the job ends: nothing to start again for
		}
		a.restarted = true
		hosts = append(hosts, a.host)
		fmt.Fprintf(ru.env.console, "# the agent on host %d exited by itself at %v (%v): starting it again\n",
			a.host, a.at.Sub(ru.t0).Round(time.Millisecond), a.err)
	}
	return hosts
}

// exitJobEnded is gorun's exit code for a node that tried to join a job
// that had already ended.
const exitJobEnded = 7

// settle waits up to grace for every agent to exit, then stops (SIGTERM,
// and SIGKILL after 10 s) those still running: spares that were never
// admitted.
func (ru *runner) settle(grace time.Duration) {
	deadline := time.After(grace)
	for _, a := range ru.agents {
		select {
		case <-a.exited:
			continue
		case <-deadline:
		}
		a.stopped = true
		a.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-a.exited:
		case <-time.After(10 * time.Second):
			syscall.Kill(-a.cmd.Process.Pid, syscall.SIGKILL)
			<-a.exited
		}
	}
}

// end runs as runRow returns: whatever still runs (after an error) is
// killed, the leftovers reaped and counted, the pipes closed.
func (ru *runner) end(res *RowResult) {
	for h := range ru.cut {
		ru.heal(h)
	}
	for _, a := range ru.agents {
		if !a.done() {
			syscall.Kill(-a.cmd.Process.Pid, syscall.SIGKILL)
			<-a.exited
		}
	}
	res.Left += len(ru.cleanUp())
	for _, a := range ru.agents {
		select {
		case <-a.scanned:
		case <-time.After(5 * time.Second): // a writer escaped us: stop reading
		}
		a.pipe.Close()
	}
}

// heal ends a link cut of host h.
func (ru *runner) heal(h int) error {
	if !ru.cut[h] {
		return nil
	}
	delete(ru.cut, h)
	if err := ru.env.bed.Hosts[h].Heal(); err != nil {
		return fmt.Errorf("heal the link of host %d: %w", h, err)
	}
	return nil
}

// cleanUp kills and reaps whatever of the job is left — our orphaned
// children (we are a child subreaper), any process with the job's marker,
// any process in the bed's hosts — and returns their PIDs.
func (ru *runner) cleanUp() []int {
	var left []int
	for _, pid := range procs.WithEnv(ru.marker) {
		if pid != os.Getpid() {
			syscall.Kill(pid, syscall.SIGKILL)
			left = append(left, pid)
		}
	}
	if ru.env.bed != nil {
		for _, h := range ru.env.bed.Hosts {
			if pids, _ := h.PIDs(); len(pids) > 0 {
				for _, p := range pids {
					if !slices.Contains(left, p) {
						left = append(left, p)
					}
				}
				h.Kill()
			}
		}
	}
	n := procs.ReapOrphans(ru.spares...)
	for len(left) < n {
		left = append(left, 0) // reaped before the scans saw it
	}
	return left
}

// bring brings fault f. A rank fault picks the target rank's worker (or,
// when that rank is not running, the next launch rank that is) among every
// agent's, and signals it; a shrink row keeps at least half its ranks (a
// fault that would take more is skipped), and a rank already hung is not
// hit again. A host fault SIGKILLs the target host's agent (its workers
// die with it: Pdeathsig) and reaps them; runRow starts a replacement on
// that host replaceAfter later. A link cut blackholes the target host's
// link; runRow heals it cutFor later.
func (ru *runner) bring(ctx context.Context, f Fault) Applied {
	a := Applied{Fault: f, Rank: -1, Second: -1}
	if f.Kind == LinkCut {
		ag := ru.current(f.Target)
		if ag == nil {
			a.Skipped = "no agent on the host"
			return a
		}
		a.At, a.PID = time.Since(ru.t0), ag.cmd.Process.Pid
		if err := ru.env.bed.Hosts[f.Target].Blackhole(); err != nil {
			a.Skipped = fmt.Sprintf("cut host %d: %v", f.Target, err)
			return a
		}
		ru.cut[f.Target] = true
		return a
	}
	if f.Kind == SpareKill && (!ru.r.Spare || ru.env.bed == nil) {
		a.Skipped = "no spare in this row"
		return a
	}
	if f.Kind.hostFault() {
		ag := ru.current(f.Target)
		if ag == nil {
			a.Skipped = "no agent on the host"
			return a
		}
		a.At, a.PID, ag.killed = time.Since(ru.t0), ag.cmd.Process.Pid, true
		if err := ag.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			a.Skipped = fmt.Sprintf("kill agent %d: %v", a.PID, err)
			return a
		}
		select {
		case <-ag.exited:
		case <-time.After(5 * time.Second):
		}
		// Its workers, dead with it, are our orphans now: reaped, not
		// counted as the job's leftovers; anything else of the host's
		// goes too (a lost node's processes are gone).
		ru.env.bed.Hosts[f.Target].Kill()
		procs.ReapOrphans(append(ru.pids(), ru.spares...)...)
		return a
	}
	workers := ru.workers(ctx)
	world := ru.j.World()
	struck := 1
	if f.Kind == TwoRanks || f.Kind == GrowKill {
		struck = 2
	}
	if ru.r.Mode == modeShrink && len(workers)-struck+1 <= world/2 {
		a.Skipped = "the shrink row keeps half its ranks"
		return a
	}
	a.Rank, a.PID = pickRank(workers, f.Target, world, -1)
	if a.PID == 0 {
		a.Skipped = "no rank running"
		return a
	}
	sig := map[Kind]syscall.Signal{RankKill: syscall.SIGKILL, RankExit: syscall.SIGTERM, RankHang: syscall.SIGSTOP,
		TwoRanks: syscall.SIGKILL, GrowKill: syscall.SIGKILL}[f.Kind]
	newcomers := ru.out.nNewcomers()
	a.At = time.Since(ru.t0)
	if err := syscall.Kill(a.PID, sig); err != nil {
		a.Skipped = fmt.Sprintf("signal %d: %v", a.PID, err)
		return a
	}
	switch f.Kind {
	case TwoRanks:
		// The same moment: the next running rank after the first.
	case GrowKill:
		for deadline := time.Now().Add(growKillWait); ru.out.nNewcomers() == newcomers && time.Now().Before(deadline) && ctx.Err() == nil; {
			time.Sleep(5 * time.Millisecond)
		}
		workers = ru.workers(ctx)
	default:
		return a
	}
	second, pid := pickRank(workers, a.Rank+1, world, a.Rank)
	if pid == 0 {
		return a // no other rank running: one fault, not two
	}
	a.SecondAt = time.Since(ru.t0)
	if err := syscall.Kill(pid, syscall.SIGKILL); err == nil {
		a.Second = second
	}
	return a
}

// workers returns the job's running workers, launch rank → PID. Between a
// failure and the next group there may be none: it waits a while for
// one, as a fault would strike the next group.
func (ru *runner) workers(ctx context.Context) map[int]int {
	for deadline := time.Now().Add(10 * time.Second); ; {
		workers := map[int]int{}
		for _, pid := range ru.pids() {
			for rank, w := range liveWorkers(pid, ru.out.respawnedAs) {
				workers[rank] = w
			}
		}
		if len(workers) > 0 || time.Now().After(deadline) || ctx.Err() != nil {
			return workers
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pickRank returns the first running rank from target on (wrapping
// around world), other than not, and its PID; 0 when none runs.
func pickRank(workers map[int]int, target, world, not int) (int, int) {
	for i := range world {
		rank := (target + i) % world
		if pid, ok := workers[rank]; ok && rank != not {
			return rank, pid
		}
	}
	return -1, 0
}
