package launcher

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/shrink"
)

// This file is a round's mechanism, shared by both failure policies:
// starting the local workers, and one loop (roundWatch.next) that turns
// everything that can happen while they run into the events a policy
// decides on. The policies are restart_mode.go and shrink_mode.go.

// outcome is how one round ended here.
type outcome struct {
	failures []Failure      // local workers that failed
	change   *change        // the job changed under the round
	signal   syscall.Signal // the signal that stopped the agent
	err      error          // the context's error
	// lost are local workers that failed and that a shrink epoch excluded:
	// the survivors carried on without them.
	lost []Failure
	// fallback says why shrink mode gave up and hands the round to a
	// restart; "" when it did not.
	fallback string
	// placeTaken: the others took this node for lost and admitted another
	// in its place (shrink mode, heal); it joins the job again as a
	// waiting node.
	placeTaken bool
}

// roundEventKind says what a roundEvent is.
type roundEventKind uint8

const (
	// evStopped: a stop signal or the end of the context stopped the
	// group; the round is over with roundEvent.stopped.
	evStopped roundEventKind = iota
	// evWorkerExit: a local worker exited (roundEvent.exit).
	evWorkerExit
	// evNodeDead: node liveness declared a member of the round dead
	// (roundEvent.node, roundEvent.why).
	evNodeDead
	// evNodeBack: a member of the round node liveness had declared dead
	// answers again (roundEvent.node, roundEvent.why): a partition healed.
	evNodeBack
	// evJobChanged: the rendezvous reports a change of the job
	// (roundEvent.change).
	evJobChanged
	// evEpoch: shrink mode's agreement published an epoch
	// (roundEvent.epoch).
	evEpoch
	// evAgreementFailed: shrink mode's agreement gave up (roundEvent.err).
	evAgreementFailed
	// evRespawnDue: a lost local slot's backoff is over (roundEvent.slot):
	// heal respawns it.
	evRespawnDue
	// evGrown: a grow epoch completed (roundEvent.grown): every rank of it
	// is in the grown group.
	evGrown
)

// roundEvent is one thing that happened in a round that the failure
// policy decides on.
type roundEvent struct {
	kind    roundEventKind
	stopped outcome
	exit    workerExit
	node    string
	why     string
	change  *change
	epoch   shrink.Epoch
	err     error
	slot    int
	grown   shrink.Complete
}

// roundWatch gathers the event sources of one running round.
type roundWatch struct {
	a    *agent
	p    *plan
	g    *group
	sigs <-chan os.Signal
	// poll ticks when the job is to be asked for changes (multi-node
	// jobs only; nil otherwise), every pollEvery, or faster (pace).
	poll      <-chan time.Time
	stopPoll  func()
	ticker    *time.Ticker
	pollEvery time.Duration
	paced     time.Duration // the ticker's period now (pace)
	// epochs, agreementFailed and grown are shrink mode's (nil otherwise).
	epochs          <-chan shrink.Epoch
	agreementFailed <-chan error
	grown           <-chan shrink.Complete
	// spec starts the round's workers, and heal's newcomers.
	spec spawnSpec
	// respawns is heal's policy (shrink mode with --regrow on; nil
	// otherwise), standbys its pre-started workers (nil: none).
	respawns *respawns
	standbys *standbys
}

// watchRound starts watching round p's group g; sv is shrink mode's
// agreement, nil in restart mode. Call close when the round ends.
func (a *agent) watchRound(p *plan, g *group, spec spawnSpec, sigs <-chan os.Signal, sv *survivors) *roundWatch {
	w := &roundWatch{a: a, p: p, g: g, spec: spec, sigs: sigs, stopPoll: func() {}}
	if a.multiNode {
		w.pollEvery = a.m.watchEvery(a.cfg.MonitorInterval)
		w.ticker, w.paced = time.NewTicker(w.pollEvery), w.pollEvery
		w.poll, w.stopPoll = w.ticker.C, w.ticker.Stop
	}
	if sv != nil {
		w.epochs, w.agreementFailed, w.grown = sv.coord.Epochs(), sv.coord.Err(), sv.coord.Completions()
		w.respawns = newRespawns(a.cfg.Regrow, a.cfg.RespawnBackoff, len(p.assignments))
		if a.cfg.Regrow {
			w.standbys = newStandbys(a.cfg.RespawnStandbys)
			w.standbys.fill(a.reaper, a.con, &a.cfg, spec, a.log)
		}
	}
	return w
}

// pace sets how often the job is asked for changes: every monitor
// interval while soon (a place is vacant and a spare or replacement may
// come at any moment: the rendezvous's own pace, a fifth of its
// keep-alive, would add up to a second to heal); four times the usual
// pace, but no faster than the monitor interval, on the node that leads
// the survivors' agreement (it files a lost node's ranks for everyone:
// at 512 agents its next poll, up to a second after the loss, was half of
// what the survivors' next epoch took); the usual pace otherwise. A
// faster pace on one node, reading the marker, costs the store nothing
// that grows with the job.
func (w *roundWatch) pace(soon, leading bool) {
	if w.ticker == nil {
		return
	}
	d := w.pollEvery
	switch monitor := w.a.cfg.MonitorInterval; {
	case soon:
		d = min(d, monitor)
	case leading:
		d = min(d, max(monitor, d/4))
	}
	if d == w.paced {
		return
	}
	w.paced = d
	w.ticker.Reset(d)
}

func (w *roundWatch) close() {
	w.stopPoll()
	w.respawns.cancel()
	w.standbys.signal(syscall.SIGKILL) // none left by now, but for a panic's unwinding
	w.standbys.wait(0, w.g.contain)
}

// next waits for the round's next event. What means the same under both
// policies is handled here: a hung worker is killed (its exit comes as an
// event), a signal that does not stop the agent is passed on to the
// workers, node liveness news about anyone but a member's death is logged,
// a failed poll of the job is logged and retried. The end of ctx (a stop
// signal cancels it: stopper) stops the group and returns evStopped.
func (w *roundWatch) next(ctx context.Context) roundEvent {
	a := w.a
	for {
		select {
		case x := <-w.g.exits:
			w.g.record(x)
			return roundEvent{kind: evWorkerExit, exit: x}
		case x := <-w.standbys.exitsC():
			w.standbys.exited(x, w.g.contain, a.log)
		case e := <-w.epochs:
			return roundEvent{kind: evEpoch, epoch: e}
		case err := <-w.agreementFailed:
			return roundEvent{kind: evAgreementFailed, err: err}
		case slot := <-w.respawns.dueC():
			return roundEvent{kind: evRespawnDue, slot: slot}
		case c := <-w.grown:
			return roundEvent{kind: evGrown, grown: c}
		case ev := <-a.hung:
			a.stopHung(w.g, ev)
		case ev := <-a.gossip.eventsOrNil():
			if id, member := w.p.nodeOfGossip(ev.Node); member {
				switch ev.Kind {
				case health.NodeDead:
					return roundEvent{kind: evNodeDead, node: id, why: ev.Reason}
				case health.NodeJoined:
					return roundEvent{kind: evNodeBack, node: id, why: ev.Reason}
				}
			}
			a.log.Debug("node liveness", zap.Stringer("event", ev))
		case <-w.poll:
			c, err := a.m.watch(ctx)
			if err != nil {
				a.log.Warn("cannot read the rendezvous state", zap.Error(err))
			} else if c != nil {
				return roundEvent{kind: evJobChanged, change: c}
			}
		case s := <-w.sigs:
			sig := s.(syscall.Signal)
			if !stopSignals[sig] {
				w.forward(s)
				continue
			}
			// A stop signal after the first (which cancelled ctx): no
			// grace for the workers.
			w.g.kill()
			return w.stopped(ctx)
		case <-ctx.Done():
			return w.stopped(ctx)
		}
	}
}

// stopped ends the round when ctx is done: the workers get the stop
// signal that cancelled it (SIGTERM if none did), the shutdown timeout,
// then SIGKILL.
func (w *roundWatch) stopped(ctx context.Context) roundEvent {
	sig := stoppedBy(ctx)
	if sig == 0 {
		w.stop(syscall.SIGTERM)
		return roundEvent{kind: evStopped, stopped: outcome{err: ctx.Err()}}
	}
	w.a.log.Warn("stopping workers on signal", zap.Stringer("signal", sig), zap.Duration("grace", w.a.cfg.ShutdownTimeout))
	w.stop(sig)
	return roundEvent{kind: evStopped, stopped: outcome{signal: sig}}
}

func (w *roundWatch) forward(s os.Signal) {
	w.a.log.Info("forwarding signal to workers", zap.Stringer("signal", s))
	w.g.signal(s.(syscall.Signal))
}

// stop stops the group with sig: the workers get the shutdown timeout,
// then SIGKILL; a second SIGINT or SIGTERM kills at once.
func (w *roundWatch) stop(sig syscall.Signal) {
	w.a.endpoint.SetPhase(PhaseStopping)
	w.standbys.signal(sig)
	w.g.stop(sig, w.a.cfg.ShutdownTimeout, w.sigs, w.forward)
	w.standbys.wait(w.a.cfg.ShutdownTimeout, w.g.contain)
}

// gatherFailures returns first and the failures of the other workers that
// exit within window of it: workers that fail together (a node's ranks
// dying at once, a bad batch on every rank) are all in the failure table,
// as torchrun, which polls its workers every monitor interval, lists them.
func (w *roundWatch) gatherFailures(first Failure, window time.Duration) []Failure {
	failures := []Failure{first}
	t := time.NewTimer(window)
	defer t.Stop()
	for w.g.running > 0 {
		select {
		case y := <-w.g.exits:
			w.g.record(y)
			if !y.ok() {
				failures = append(failures, w.a.failure(y))
			}
		case <-t.C:
			return failures
		}
	}
	return failures
}

// finish waits for the last of the workers' output once all have exited,
// and ends the standbys: the round needs no more respawns.
func (w *roundWatch) finish() {
	w.standbys.signal(syscall.SIGTERM)
	w.g.wait(nil, 0, nil)
	w.standbys.wait(w.a.cfg.ShutdownTimeout, w.g.contain)
}

// runRound starts the local workers of a round, or gives pk's parked
// workers the round when it is not nil, and supervises them under the
// job's failure policy until the round ends here.
func (a *agent) runRound(ctx context.Context, p *plan, sigs <-chan os.Signal, sv *survivors, pk *parked) (outcome, error) {
	dir := a.attemptDir(p.env.RestartCount)
	if a.heartbeats != nil {
		p.env.Heartbeat, p.env.HeartbeatTimeout = a.heartbeats.Path(), a.cfg.HeartbeatTimeout
	}
	var at *attempt
	var err error
	if pk != nil {
		at = pk.at
	} else if at, err = a.openAttempt(dir); err != nil {
		return outcome{}, err
	}
	defer at.close() // after the round: the copies are drained by then
	spec := spawnSpec{path: a.path, argv: a.argv, contain: &a.containment, env: p.env, base: environ(), dir: dir, prefix: a.linePrefix,
		filtered: at.filtered}
	first := p.assignments[0]
	msg := "starting workers"
	if pk != nil {
		msg = "assigning the pre-started workers"
	}
	a.log.Info(msg,
		zap.Int("round", p.round), zap.Int("restart", p.env.RestartCount),
		zap.Int("group_rank", first.GroupRank), zap.Int("group_world_size", first.GroupWorldSize),
		zap.Int("local_world_size", len(p.assignments)), zap.Int("world_size", first.WorldSize),
		zap.String("master", net.JoinHostPort(p.env.MasterAddr, strconv.Itoa(p.env.MasterPort))),
		zap.String("run_id", a.runID), zap.String("log_dir", dir))
	var g *group
	if pk != nil {
		g, err = pk.adopt(spec, p)
	} else {
		g, err = startGroup(a.reaper, a.con, &a.cfg, spec, p.assignments)
	}
	if err != nil {
		if pk != nil {
			pk.g.kill()
			pk.g.wait(nil, 0, nil)
		}
		return outcome{}, localf("starting the workers: %w", err)
	}
	for _, w := range g.workers {
		w.newcomer = p.env.NewcomerAfter > 0 // a node admitted late
	}
	g.onExit = a.reportExit
	if a.heartbeats != nil {
		// Started together: one that hangs before its first beat is
		// found from its peers' first.
		local := make([]int, len(g.workers))
		for i, w := range g.workers {
			local[i] = w.a.LocalRank
		}
		a.heartbeats.Expect(local)
	}
	a.log.Debug("workers started", zap.Ints("pids", g.pids()))
	a.endpoint.WorkersStarted(len(p.assignments))
	a.endpoint.SetPhase(PhaseRunning)
	w := a.watchRound(p, g, spec, sigs, sv)
	defer w.close()
	// The group has ended when supervision returns: what its workers left
	// behind goes with it.
	defer a.killLeftovers()
	if sv != nil {
		return a.superviseShrink(ctx, w, sv), nil
	}
	return a.superviseRestart(ctx, w), nil
}

// stopHung kills a worker whose heartbeats stopped: its exit then counts
// as its failure, in either mode; or one whose teardown outlasted the done
// timeout after it said it was done: its exit counts as a success.
func (a *agent) stopHung(g *group, ev health.Event) {
	for _, w := range g.workers {
		if w.a.LocalRank == ev.Rank && !w.exited {
			if ev.SeenAt.Before(w.started) {
				return // about an earlier worker of the rank
			}
			if ev.Done {
				a.log.Warn("worker's teardown hung; killing it (its work was done: it counts as a success)",
					zap.Int("rank", w.a.Rank), zap.String("why", ev.Reason))
				w.finished = true
			} else {
				a.log.Warn("worker hung; killing it", zap.Int("rank", w.a.Rank), zap.String("why", ev.Reason))
			}
			w.hung = ev.Reason
			syscall.Kill(-w.proc.Pid, syscall.SIGKILL)
			return
		}
	}
}

// reportExit tells the health endpoint how a worker ended.
func (a *agent) reportExit(w *worker, stopped bool) {
	if a.heartbeats != nil {
		a.heartbeats.Forget(w.a.LocalRank)
	}
	switch {
	case (workerExit{w, w.exit}).ok():
		a.endpoint.WorkerExited(true, "")
	case stopped || w.excluded:
		a.endpoint.WorkerExited(false, ReasonStopped)
	case w.oom != "":
		a.endpoint.WorkerExited(false, ReasonOOM)
	case w.exit.Signal() != 0:
		a.endpoint.WorkerExited(false, ReasonSignal)
	default:
		a.endpoint.WorkerExited(false, ReasonExitCode)
	}
}

func (a *agent) failure(x workerExit) Failure {
	f := newFailure(x.w.a.LocalRank, x.w.a.Rank, x.e, x.w.errorFile, a.host)
	f.Since = x.w.since
	switch {
	case x.w.hung != "":
		f.Message = "hung (" + x.w.hung + "); killed by gorun"
	case x.w.oom != "":
		// torchrun says "Signal 9 (SIGKILL)" and leaves the cause unsaid.
		f.Message += ": " + x.w.oom
		a.log.Warn("worker killed by the OOM killer", zap.Int("rank", x.w.a.Rank), zap.Int("pid", f.Pid), zap.String("why", x.w.oom))
	}
	return f
}

// attempt is one attempt's log directory and the filtered logs in it.
type attempt struct {
	dir      string
	filtered [2]*filteredLog
}

// openAttempt creates the log directory dir of an attempt and its filtered
// logs (--duplicate-std*-filters).
func (a *agent) openAttempt(dir string) (*attempt, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, localf("log directory: %w", err)
	}
	at := &attempt{dir: dir}
	for i, needles := range [][]string{a.cfg.DuplicateStdoutFilters, a.cfg.DuplicateStderrFilters} {
		name := [...]string{"filtered_stdout.log", "filtered_stderr.log"}[i]
		l, err := openFilteredLog(filepath.Join(dir, name), needles)
		if err != nil {
			at.close()
			return nil, localf("--duplicate-std*-filters: %w", err)
		}
		at.filtered[i] = l
	}
	return at, nil
}

// moveTo renames the attempt's directory to dir (a pre-started group's,
// once its round says which attempt it is); open files follow it.
func (at *attempt) moveTo(dir string) error {
	if dir == at.dir {
		return nil
	}
	if err := os.Rename(at.dir, dir); err != nil {
		return localf("log directory: %w", err)
	}
	at.dir = dir
	return nil
}

// close closes the filtered logs, once the attempt's workers' output is
// drained.
func (at *attempt) close() {
	for _, l := range at.filtered {
		l.close()
	}
}

// attemptDir is the log directory of the attempt with restart count n.
func (a *agent) attemptDir(n int) string {
	return filepath.Join(a.runDir, "attempt_"+strconv.Itoa(n))
}
