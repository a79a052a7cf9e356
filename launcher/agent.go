package launcher

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/launcher/reaper"
	"github.com/gorunhq/gorun/shrink"
)

// Run runs one agent until its job ends: nil when every worker succeeded,
// *WorkersFailedError when they failed with no restart left (exit code 1),
// *JobFailedError when the job failed elsewhere or lost a node with no
// restart left (1), *SignalError when a signal stopped it (128+N), errors
// wrapping ErrRendezvousTimeout or ErrRendezvousClosed when it could not
// join, and ErrInvalidConfig for what it cannot run (bad settings, and etcd
// certificates or credentials that etcd refuses).
// Workers' output goes to the agent's stdout and stderr.
func Run(ctx context.Context, cfg Config, log *zap.Logger) error {
	return run(ctx, cfg, log, os.Stdout, os.Stderr)
}

func run(ctx context.Context, cfg Config, log *zap.Logger, stdout, stderr io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	a, err := newAgent(cfg, log, stdout, stderr)
	if err != nil {
		return err
	}
	defer a.close()
	if cfg.HealthAddr != "" {
		// Up before the rendezvous, which can take long on a big job.
		a.health = NewHealth()
		addr, err := a.health.Serve(cfg.HealthAddr, log)
		if err != nil {
			return fmt.Errorf("--health-addr: %w", err)
		}
		log.Info("serving /healthz, /readyz and /metrics", zap.Stringer("addr", addr))
	}
	a.multiNode = cfg.MaxNodes > 1
	if cfg.NodeLiveness.runs(cfg.MaxNodes, cfg.OnFailure) {
		// Before the rendezvous: this node's record carries its address.
		addr := cfg.Rendezvous.LocalAddr
		if addr == "" {
			addr, _ = os.Hostname()
		}
		if a.gossip, err = startGossip(cfg.NodeLiveness, log, a.runID, addr); err != nil {
			return err
		}
		a.cfg.gossip = a.gossip.self()
	}
	m, err := newMembership(ctx, &a.cfg, log, a.runID)
	if err != nil {
		return err
	}
	a.m = m
	err = a.run(ctx)
	// A node that ends well leaves the gossip, so that the others see a
	// departure, not a death.
	a.gossip.close(err == nil)
	return err
}

// agent runs the local worker group through its attempts.
type agent struct {
	cfg    Config
	log    *zap.Logger
	con    *console
	reaper *reaper.Reaper
	host   string
	runID  string
	runDir string // <log dir>/<run id>_<random>
	path   string // resolved program
	argv   []string
	m      membership
	health *Health // nil without --health-addr; its methods accept nil
	// multiNode: the job has other nodes to watch while workers run.
	multiNode bool
	// gossip finds lost nodes in a multi-node job (see
	// NodeLivenessConfig.Mode); nil otherwise.
	gossip *gossip
	// heartbeats receives workers' heartbeats (--heartbeat-timeout); nil
	// when they are off. hung carries its reports to the monitor loop.
	heartbeats *health.Monitor
	hung       chan health.Event
	stopBeats  context.CancelFunc
	beatsDone  chan struct{}
}

func newAgent(cfg Config, log *zap.Logger, stdout, stderr io.Writer) (*agent, error) {
	a := &agent{cfg: cfg, log: log, con: &console{stdout: stdout, stderr: stderr}}
	a.argv = cfg.Entrypoint.Argv()
	path, err := resolveProgram(cfg.Entrypoint, a.argv)
	if err != nil {
		return nil, err
	}
	a.path = path
	a.host, _ = os.Hostname()
	a.runID = cfg.Rendezvous.RunID
	if cfg.Rendezvous.Standalone {
		a.runID = randomID()
	}
	base := cfg.LogDir
	if base == "" {
		if base, err = os.MkdirTemp("", "torchelastic_"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(base, 0o755); err != nil {
		return nil, fmt.Errorf("--log-dir: %w", err)
	}
	if a.runDir, err = os.MkdirTemp(base, a.runID+"_"); err != nil {
		return nil, fmt.Errorf("--log-dir: %w", err)
	}
	// As PID 1, or asked to, adopt and reap orphaned descendants (tini's
	// job): otherwise they would pile up as zombies in a container.
	pid1 := os.Getpid() == 1
	if cfg.Init && !pid1 {
		if err := reaper.BecomeSubreaper(); err != nil {
			return nil, fmt.Errorf("--init: %w", err)
		}
	}
	if cfg.HeartbeatTimeout > 0 {
		if err := a.listenHeartbeats(); err != nil {
			return nil, err
		}
	}
	a.reaper = reaper.New(reaper.Config{
		ReapOrphans: pid1 || cfg.Init,
		OnOrphan: func(e reaper.Exit) {
			log.Debug("reaped an orphan", zap.Stringer("exit", e))
		},
	})
	return a, nil
}

// listenHeartbeats opens the heartbeat socket the workers find in
// GORUN_HEARTBEAT. It lives in a directory of its own under the system's
// temporary directory: a unix socket's path must stay under 108 bytes,
// which a --log-dir path need not.
func (a *agent) listenHeartbeats() error {
	dir, err := os.MkdirTemp("", "gorun-hb-")
	if err != nil {
		return fmt.Errorf("--heartbeat-timeout: %w", err)
	}
	m, err := health.ListenHeartbeats(filepath.Join(dir, "hb.sock"), a.cfg.HeartbeatTimeout)
	if err != nil {
		os.RemoveAll(dir)
		return fmt.Errorf("--heartbeat-timeout: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a.heartbeats, a.hung, a.stopBeats, a.beatsDone = m, make(chan health.Event, 16), cancel, make(chan struct{})
	go func() {
		defer close(a.beatsDone)
		defer os.RemoveAll(dir)
		if err := m.Run(ctx, a.hung); err != nil && ctx.Err() == nil {
			a.log.Error("heartbeat socket failed; hang detection is off", zap.Error(err))
		}
	}()
	return nil
}

func (a *agent) close() {
	a.gossip.close(false)
	if a.heartbeats != nil {
		a.stopBeats()
		a.heartbeats.Close()
		<-a.beatsDone
	}
	a.health.Close()
	if a.m != nil {
		a.m.close()
	}
	a.reaper.Close()
}

// resolveProgram finds the executable to start, so that a missing program
// or script is one clear error before anything runs.
func resolveProgram(e Entrypoint, argv []string) (string, error) {
	path, err := exec.LookPath(argv[0])
	if err != nil {
		what := "program"
		if !e.NoPython {
			what = "Python interpreter (set PYTHON_EXEC)"
		}
		return "", fmt.Errorf("%w: %s %q not found: %v", ErrInvalidConfig, what, argv[0], err)
	}
	if !e.NoPython && !e.Module {
		if _, err := os.Stat(e.Program); err != nil {
			return "", fmt.Errorf("%w: script %q: %v", ErrInvalidConfig, e.Program, err)
		}
	}
	return path, nil
}

func randomID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

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
}

// stopSignals end the agent, torchrun's defaults; other handled signals
// (SIGUSR1, SIGUSR2: SLURM's warnings) are only passed on to the workers.
var stopSignals = map[syscall.Signal]bool{
	syscall.SIGTERM: true, syscall.SIGINT: true, syscall.SIGHUP: true, syscall.SIGQUIT: true,
}

// run is the agent's loop: rendezvous, start the local workers, watch
// them and the job, and decide — the next round, a restart, or the end.
func (a *agent) run(ctx context.Context) error {
	sigs := make(chan os.Signal, 4)
	if len(a.cfg.SignalsToHandle) > 0 {
		handled := make([]os.Signal, len(a.cfg.SignalsToHandle))
		for i, s := range a.cfg.SignalsToHandle {
			handled[i] = s
		}
		signal.Notify(sigs, handled...)
		defer signal.Stop(sigs)
	}
	if a.cfg.NProcPerNode > 1 {
		if _, set := os.LookupEnv("OMP_NUM_THREADS"); !set {
			a.log.Warn("setting OMP_NUM_THREADS=1 for each worker, as torchrun does, to avoid overloading the system; tune it for your job")
		}
	}
	for {
		a.health.SetPhase(PhaseRendezvous)
		began := time.Now()
		p, err := a.m.next(ctx)
		if err != nil {
			a.health.SetPhase(PhaseFailed)
			return err
		}
		a.health.RendezvousDone(p.round, time.Since(began))
		var sv *survivors
		if a.cfg.OnFailure == OnFailureShrink {
			if sv, err = startSurvivors(ctx, &a.cfg, a.log, p); err != nil {
				p.release()
				a.health.SetPhase(PhaseFailed)
				return err
			}
		}
		if a.gossip != nil {
			a.gossip.join(ctx, p.gossip)
		}
		out, err := a.runRound(ctx, p, sigs, sv)
		if err != nil {
			sv.close()
			p.release()
			a.health.SetPhase(PhaseFailed)
			return err
		}
		// The round's worker store (when this node hosts it) and the
		// agreement stay up through decide: in shrink mode the other
		// nodes' survivors may still need them until the exit barrier.
		done, err := a.decide(ctx, p, out, sv)
		sv.close()
		p.release()
		switch {
		case done && err == nil:
			a.health.SetPhase(PhaseSucceeded)
			return nil
		case done:
			a.health.SetPhase(PhaseFailed)
			return err
		case len(out.failures) > 0 || (out.change != nil && len(out.change.lost) > 0):
			a.health.Restarted()
		}
	}
}

// decide acts on how a round ended: it reports whether the agent is done,
// and with what.
func (a *agent) decide(ctx context.Context, p *plan, out outcome, sv *survivors) (bool, error) {
	switch {
	case out.signal != 0:
		a.m.leave(context.WithoutCancel(ctx))
		return true, &SignalError{Signal: out.signal}
	case out.err != nil:
		a.m.leave(context.WithoutCancel(ctx))
		return true, out.err
	case out.change != nil && out.change.closed:
		if !out.change.storeLost {
			a.m.closed(context.WithoutCancel(ctx))
		}
		if out.change.ok {
			return true, nil
		}
		return true, &JobFailedError{Reason: out.change.String()}
	case out.change != nil && len(out.change.lost) > 0:
		left, err := a.m.failed(ctx, p, out.change.String())
		if err != nil {
			return true, err
		}
		if !left {
			a.m.finish(ctx, p, false)
			return true, &JobFailedError{Reason: out.change.String() + ", and no restart is left"}
		}
		a.log.Warn("re-rendezvous without the lost node(s)", zap.Strings("lost", out.change.lost))
		return false, nil
	case out.change != nil:
		// Scale-up: not a failure, not counted as a restart (torchrun's
		// rule).
		a.log.Info("membership changed; re-rendezvous", zap.Int("waiting", out.change.waiting))
		return false, nil
	case out.fallback != "":
		return a.fallBack(ctx, p, out)
	case len(out.failures) == 0:
		if sv != nil {
			p.barrierNodes = sv.liveNodes()
		}
		if err := a.m.finish(ctx, p, true); err != nil {
			return true, err
		}
		if sv != nil && len(sv.epochs) > 0 {
			a.log.Warn("the surviving workers succeeded", zap.String("run_id", a.runID), zap.Int("round", p.round),
				zap.String("shrink", sv.summary()))
			return true, nil
		}
		a.log.Info("all workers succeeded", zap.String("run_id", a.runID), zap.Int("round", p.round),
			zap.Int("restarts", p.env.RestartCount))
		return true, nil
	}
	left, err := a.m.failed(ctx, p, failureText(out.failures))
	if err != nil {
		return true, err
	}
	if left {
		a.log.Warn("worker group failed; restarting", zap.Int("max_restarts", a.cfg.MaxRestarts),
			zap.String("cause", failureText(out.failures)))
		return false, nil
	}
	e := &WorkersFailedError{Name: a.cfg.Entrypoint.Program, Failures: out.failures, Restarts: p.env.RestartCount}
	io.WriteString(a.con.stderr, e.Summary())
	a.m.finish(ctx, p, false)
	return true, e
}

// fallBack restarts the group after shrink mode gave up (too few
// survivors, or no agreement), counting a restart as restart mode does.
func (a *agent) fallBack(ctx context.Context, p *plan, out outcome) (bool, error) {
	left, err := a.m.failed(ctx, p, "shrink mode fell back to restart: "+out.fallback)
	if err != nil {
		return true, err
	}
	if left {
		a.log.Warn("shrink mode fell back to restart; restarting the worker group",
			zap.String("why", out.fallback), zap.Int("max_restarts", a.cfg.MaxRestarts))
		return false, nil
	}
	failures := append(slices.Clone(out.lost), out.failures...)
	if len(failures) == 0 {
		a.m.finish(ctx, p, false)
		return true, &JobFailedError{Reason: "shrink mode fell back to restart (" + out.fallback + "), and no restart is left"}
	}
	e := &WorkersFailedError{Name: a.cfg.Entrypoint.Program, Failures: failures, Restarts: p.env.RestartCount}
	io.WriteString(a.con.stderr, e.Summary())
	a.m.finish(ctx, p, false)
	return true, e
}

func failureText(fs []Failure) string {
	f := fs[rootCause(fs)]
	return fmt.Sprintf("rank %d: %s", f.Rank, describeExit(f.ExitCode))
}

// runRound starts the local workers of a round and watches them until the
// round ends here.
func (a *agent) runRound(ctx context.Context, p *plan, sigs <-chan os.Signal, sv *survivors) (outcome, error) {
	dir := filepath.Join(a.runDir, "attempt_"+strconv.Itoa(p.env.RestartCount))
	if a.heartbeats != nil {
		p.env.Heartbeat = a.heartbeats.Path()
	}
	spec := spawnSpec{
		path: a.path, argv: a.argv, env: p.env, base: environ(), dir: dir,
		prefix: func(as Assignment) string { return fmt.Sprintf("[%s%d]:", a.cfg.Role, as.LocalRank) },
	}
	first := p.assignments[0]
	a.log.Info("starting workers",
		zap.Int("round", p.round), zap.Int("restart", p.env.RestartCount),
		zap.Int("group_rank", first.GroupRank), zap.Int("group_world_size", first.GroupWorldSize),
		zap.Int("local_world_size", len(p.assignments)), zap.Int("world_size", first.WorldSize),
		zap.String("master", net.JoinHostPort(p.env.MasterAddr, strconv.Itoa(p.env.MasterPort))),
		zap.String("run_id", a.runID), zap.String("log_dir", dir))
	g, err := startGroup(a.reaper, a.con, &a.cfg, spec, p.assignments)
	if err != nil {
		return outcome{}, err
	}
	g.onExit = a.reportExit
	a.log.Debug("workers started", zap.Ints("pids", g.pids()))
	a.health.WorkersStarted(len(p.assignments))
	a.health.SetPhase(PhaseRunning)
	out := a.monitor(ctx, p, g, sigs, sv)
	return out, nil
}

// monitor waits for the round's outcome. Exits arrive from the reaper the
// moment they happen. In restart mode a failure stops the rest of the
// group at once; in shrink mode (sv non-nil) it is reported to the
// survivors' agreement and the others run on. The job is polled every
// MonitorInterval for changes that end the round (nodes waiting, nodes
// lost, the job closed); node liveness reports a dead node of the round
// (p) as soon as it declares it.
func (a *agent) monitor(ctx context.Context, p *plan, g *group, sigs <-chan os.Signal, sv *survivors) outcome {
	forward := func(s os.Signal) {
		a.log.Info("forwarding signal to workers", zap.Stringer("signal", s))
		g.signal(s.(syscall.Signal))
	}
	grace := a.cfg.ShutdownTimeout
	var poll <-chan time.Time
	if a.multiNode {
		t := time.NewTicker(a.m.watchEvery(a.cfg.MonitorInterval))
		defer t.Stop()
		poll = t.C
	}
	var out outcome
	var epochs <-chan shrink.Epoch
	var agreementFailed <-chan error
	if sv != nil {
		epochs, agreementFailed = sv.coord.Epochs(), sv.coord.Err()
	}
	stop := func(sig syscall.Signal) {
		a.health.SetPhase(PhaseStopping)
		g.stop(sig, grace, sigs, forward)
	}
	fallBack := func(why string) outcome {
		a.log.Warn("shrink mode gives up: stopping workers to restart the group", zap.String("why", why))
		stop(syscall.SIGTERM)
		out.fallback = why
		return out
	}
	// In shrink mode the round lasts until the local workers are done and
	// every local failure is decided: this node may lead the agreement.
	for g.running > 0 || (sv != nil && !sv.settled()) {
		select {
		case x := <-g.exits:
			g.record(x)
			if x.e.Code() == 0 {
				continue
			}
			f := a.failure(x)
			if sv != nil {
				if !sv.epoch.Alive(f.Rank) {
					out.lost = append(out.lost, f) // excluded before it ended
					continue
				}
				a.log.Warn("worker failed; reporting it to the survivors", zap.Int("rank", f.Rank), zap.Stringer("exit", x.e))
				out.failures = append(out.failures, f)
				a.health.FailureReported(ReportWorker, 1)
				if err := sv.workerFailed(ctx, f); err != nil {
					return fallBack(err.Error())
				}
				continue
			}
			// Collect failures that happened together, then stop the
			// others: torchrun stops the whole local group on the
			// first failure.
			failures := []Failure{f}
			for drained := false; !drained && g.running > 0; {
				select {
				case y := <-g.exits:
					g.record(y)
					if y.e.Code() != 0 {
						failures = append(failures, a.failure(y))
					}
				default:
					drained = true
				}
			}
			a.log.Warn("worker failed", zap.Int("rank", x.w.a.Rank), zap.Stringer("exit", x.e))
			stop(syscall.SIGTERM)
			return outcome{failures: failures}
		case e := <-epochs:
			if restart := a.adoptEpoch(g, sv, e, &out); restart {
				return fallBack(fmt.Sprintf("epoch %d would leave %d rank(s), below --min-world-size %d",
					e.Number, e.WorldSize, a.cfg.MinWorldSize))
			}
		case err := <-agreementFailed:
			return fallBack(err.Error())
		case ev := <-a.hung:
			a.stopHung(g, ev)
		case ev := <-a.gossip.eventsOrNil():
			id, member := p.nodeOfGossip(ev.Node)
			if ev.Kind != health.NodeDead || !member {
				a.log.Debug("node liveness", zap.Stringer("event", ev))
				continue
			}
			if sv != nil {
				n, err := sv.nodesLost(ctx, []string{id}, "node liveness: "+ev.Reason)
				a.health.FailureReported(ReportNode, n)
				if err != nil {
					return fallBack(err.Error())
				}
				continue
			}
			// Restart mode: the survivors re-rendezvous without it now,
			// rather than when its rendezvous keep-alive lapses.
			a.log.Warn("stopping workers: node liveness declared a node dead", zap.String("node", id), zap.String("why", ev.Reason))
			if err := a.m.expel(ctx, id); err != nil {
				a.log.Warn("taking the dead node out of the rendezvous; the next round waits for its keep-alive to lapse", zap.String("node", id), zap.Error(err))
			}
			stop(syscall.SIGTERM)
			return outcome{change: &change{lost: []string{id}}, lost: out.lost, failures: out.failures}
		case <-poll:
			c, err := a.m.watch(ctx)
			if err != nil {
				a.log.Warn("cannot read the rendezvous state", zap.Error(err))
				continue
			}
			if c == nil {
				continue
			}
			if sv != nil && !c.closed {
				// Survivors carry on: a lost node's ranks are
				// reported, and nodes waiting to join are admitted
				// at the next round.
				n, err := sv.nodesLost(ctx, c.lost, "its rendezvous keep-alive lapsed")
				a.health.FailureReported(ReportNode, n)
				if err != nil {
					return fallBack(err.Error())
				}
				continue
			}
			a.log.Warn("stopping workers: the job changed", zap.Stringer("change", c))
			stop(syscall.SIGTERM)
			return outcome{change: c, lost: out.lost, failures: out.failures}
		case s := <-sigs:
			sig := s.(syscall.Signal)
			if !stopSignals[sig] {
				forward(s)
				continue
			}
			a.log.Warn("stopping workers on signal", zap.Stringer("signal", s), zap.Duration("grace", grace))
			stop(sig)
			return outcome{signal: sig}
		case <-ctx.Done():
			g.stop(syscall.SIGTERM, grace, sigs, forward)
			return outcome{err: ctx.Err()}
		}
	}
	g.wait(nil, 0, nil) // drain the output
	return out
}

// adoptEpoch acts on a shrink epoch here: local workers it excludes that
// still run (hung, or on a node taken for lost) are killed, so that no
// excluded rank comes back; failures it excludes become losses. It reports
// whether the epoch is a restart.
func (a *agent) adoptEpoch(g *group, sv *survivors, e shrink.Epoch, out *outcome) (restart bool) {
	local := make([]int, len(g.workers))
	for i, w := range g.workers {
		local[i] = w.a.Rank
	}
	excluded, reportedAt := sv.adopt(e, local)
	a.health.EpochAdopted(e, reportedAt)
	a.log.Warn(fmt.Sprintf("shrink epoch=%d world=%d excluded=%v", e.Number, e.WorldSize, e.Excluded),
		zap.String("action", string(e.Action)), zap.String("coordinator", e.Coordinator),
		zap.Ints("local_excluded", excluded))
	kept := out.failures[:0]
	for _, f := range out.failures {
		if e.Alive(f.Rank) {
			kept = append(kept, f)
		} else {
			out.lost = append(out.lost, f)
		}
	}
	out.failures = kept
	if e.Action == shrink.ActionRestart {
		return true
	}
	for _, w := range g.workers {
		if !w.exited && slices.Contains(excluded, w.a.Rank) {
			a.log.Warn("stopping a worker the epoch excludes", zap.Int("rank", w.a.Rank), zap.Int("epoch", e.Number))
			w.excluded = true
			syscall.Kill(-w.proc.Pid, syscall.SIGKILL)
		}
	}
	return false
}

// stopHung kills a worker whose heartbeats stopped: its exit then counts
// as its failure, in either mode.
func (a *agent) stopHung(g *group, ev health.Event) {
	for _, w := range g.workers {
		if w.a.LocalRank == ev.Rank && !w.exited {
			a.log.Warn("worker hung; killing it", zap.Int("rank", w.a.Rank), zap.String("why", ev.Reason))
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
	case w.exit.Code() == 0:
		a.health.WorkerExited(true, "")
	case stopped || w.excluded:
		a.health.WorkerExited(false, ReasonStopped)
	case w.exit.Signal() != 0:
		a.health.WorkerExited(false, ReasonSignal)
	default:
		a.health.WorkerExited(false, ReasonExitCode)
	}
}

func (a *agent) failure(x workerExit) Failure {
	f := newFailure(x.w.a.LocalRank, x.w.a.Rank, x.e, x.w.errorFile, a.host)
	if x.w.hung != "" {
		f.Message = "hung (" + x.w.hung + "); killed by gorun"
	}
	return f
}
