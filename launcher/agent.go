package launcher

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/launcher/reaper"
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
	for _, w := range cfg.warnings() {
		log.Warn(w)
	}
	// Signals are caught from here on: a stop signal ends every wait.
	stop := startStopper(ctx, cfg.SignalsToHandle)
	defer stop.close()
	ctx = stop.ctx
	a, err := newAgent(cfg, log, stdout, stderr)
	if err != nil {
		return err
	}
	defer a.close()
	if cfg.HealthAddr != "" {
		// Up before the rendezvous, which can take long on a big job.
		a.endpoint = NewHealth()
		addr, err := a.endpoint.Serve(cfg.HealthAddr, log)
		if err != nil {
			return localf("--health-addr: %w", err)
		}
		log.Info("serving /healthz, /readyz and /metrics", zap.Stringer("addr", addr))
	}
	a.multiNode = cfg.MaxNodes > 1
	if a.multiNode && cfg.JobSecret == nil {
		log.Warn("no job secret (--job-secret-file, " + JobSecretEnv + "): node liveness gossip is not encrypted and " +
			"nothing the agents and workers read from the stores is authenticated; anyone who reaches their ports can steer the job")
	}
	if cfg.NodeLiveness.runs(cfg.MaxNodes, cfg.OnFailure) {
		// Before the rendezvous: this node's record carries its address.
		addr := cfg.Rendezvous.LocalAddr
		if addr == "" {
			addr, _ = os.Hostname()
		}
		if a.gossip, err = startGossip(cfg.NodeLiveness, log, a.runID, addr, a.cfg.JobSecret, a.endpoint.RecordRefused); err != nil {
			return err
		}
		a.cfg.gossip = a.gossip.self()
	}
	a.cfg.refused = a.endpoint.RecordRefused
	m, err := newMembership(ctx, &a.cfg, log, a.runID)
	if err != nil {
		return stoppedOr(ctx, log, err, "while reaching the rendezvous store")
	}
	a.m = m
	err = a.run(ctx, stop.later)
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
	// endpoint serves /healthz, /readyz and /metrics; nil without
	// --health-addr (its methods accept nil).
	endpoint *Health
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
	// containment holds what the workers start: a cgroup each (see
	// Config.Cgroup), and the OOM counts their exits are read against.
	containment containment
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
	if cfg.VirtualLocalRank {
		if err := checkVirtualDevices(environ(), cfg.NProcPerNode); err != nil {
			return nil, err
		}
	}
	a.runID = cfg.Rendezvous.RunID
	if cfg.Rendezvous.Standalone {
		a.runID = randomID()
		if a.cfg.JobSecret == nil {
			// The job is this agent's alone: its secret too.
			a.cfg.JobSecret = NewSecret()
		}
	}
	base := cfg.LogDir
	if base == "" {
		if base, err = os.MkdirTemp("", "torchelastic_"); err != nil {
			return nil, localf("log directory: %w", err)
		}
	} else if err := os.MkdirAll(base, 0o755); err != nil {
		return nil, localf("--log-dir: %w", err)
	}
	if a.runDir, err = os.MkdirTemp(base, a.runID+"_"); err != nil {
		return nil, localf("--log-dir: %w", err)
	}
	// As PID 1, or asked to, adopt and reap orphaned descendants (tini's
	// job): otherwise they would pile up as zombies in a container.
	pid1 := os.Getpid() == 1
	if cfg.Init && !pid1 {
		if err := reaper.BecomeSubreaper(); err != nil {
			return nil, fmt.Errorf("--init: %w", err)
		}
	}
	if cfg.ContainDescendants && !cfg.Init && !pid1 {
		if err := reaper.BecomeSubreaper(); err != nil {
			log.Warn("cannot become a child subreaper; what the workers leave behind may outlive them", zap.Error(err))
		}
	}
	if cfg.HeartbeatTimeout > 0 {
		if err := a.listenHeartbeats(); err != nil {
			return nil, err
		}
	}
	a.reaper = reaper.New(reaper.Config{
		ReapOrphans: pid1 || cfg.Init || cfg.ContainDescendants,
		OnOrphan: func(e reaper.Exit) {
			log.Debug("reaped an orphan", zap.Stringer("exit", e))
		},
	})
	if err := a.openContainment(); err != nil {
		a.reaper.Close()
		return nil, err
	}
	return a, nil
}

// listenHeartbeats opens the heartbeat socket the workers find in
// GORUN_HEARTBEAT. It lives in a directory of its own under the system's
// temporary directory: a unix socket's path must stay under 108 bytes,
// which a --log-dir path need not. Those that agents killed without a
// chance to clean up left behind go first.
func (a *agent) listenHeartbeats() error {
	if gone := sweepHeartbeatDirs(os.TempDir(), time.Now()); len(gone) > 0 {
		a.log.Debug("removed heartbeat directories of agents gone", zap.Strings("dirs", gone))
	}
	dir, err := os.MkdirTemp("", heartbeatDirPrefix)
	if err != nil {
		return localf("--heartbeat-timeout: %w", err)
	}
	m, err := health.ListenHeartbeats(filepath.Join(dir, "hb.sock"), a.cfg.HeartbeatTimeout)
	if err != nil {
		os.RemoveAll(dir)
		return localf("--heartbeat-timeout: %w", err)
	}
	m.SetDoneTimeout(a.cfg.DoneTimeout)
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
	a.endpoint.Close()
	if a.m != nil {
		a.m.close()
	}
	a.containment.close()
	a.killLeftovers()
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
		if errors.Is(err, fs.ErrPermission) {
			return "", invalidf("%s %q is not executable (permission denied)", what, argv[0])
		}
		return "", invalidf("%s %q not found: %w", what, argv[0], err)
	}
	if !e.NoPython && !e.Module {
		if _, err := os.Stat(e.Program); err != nil {
			return "", invalidf("script %q: %w", e.Program, err)
		}
	}
	return path, nil
}

func randomID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// run is the agent's loop: rendezvous, start the local workers, watch
// them and the job, and decide — the next round, a restart, or the end.
// sigs are the handled signals a running round passes on to its workers
// (the stopper's later).
func (a *agent) run(ctx context.Context, sigs <-chan os.Signal) error {
	if a.cfg.NProcPerNode > 1 {
		if _, set := os.LookupEnv("OMP_NUM_THREADS"); !set {
			a.log.Warn("setting OMP_NUM_THREADS=1 for each worker, as torchrun does, to avoid overloading the system; tune it for your job")
		}
	}
	// The pre-started workers (--spare-prestart) wait for the first
	// round; until runRound takes them, whatever ends the agent stops them.
	var pk *parked
	if a.cfg.SparePrestart {
		var err error
		if pk, err = a.prestart(); err != nil {
			a.endpoint.SetPhase(PhaseFailed)
			return err
		}
		defer func() { a.stopParked(ctx, pk, sigs) }()
	}
	for {
		a.endpoint.SetPhase(PhaseRendezvous)
		began := time.Now()
		p, err := a.nextRound(ctx, pk)
		if errors.Is(err, errParkedExited) {
			a.endpoint.SetPhase(PhaseFailed)
			a.m.leave(context.WithoutCancel(ctx))
			return a.parkedFailed(pk)
		}
		if err != nil {
			a.endpoint.SetPhase(PhaseFailed)
			if stoppedBy(ctx) != 0 {
				a.m.leave(context.WithoutCancel(ctx))
			}
			return stoppedOr(ctx, a.log, err, "while waiting for the rendezvous")
		}
		a.endpoint.RendezvousDone(p.round, time.Since(began))
		var sv *survivors
		if a.cfg.OnFailure == OnFailureShrink {
			if sv, err = startSurvivors(ctx, &a.cfg, a.log, p, a.endpoint.RecordRefused); err != nil {
				p.release()
				a.endpoint.SetPhase(PhaseFailed)
				return stoppedOr(ctx, a.log, err, "while joining the survivors' agreement")
			}
			if p.late {
				if err := a.joinLate(ctx, p, sv); err != nil {
					sv.close()
					p.release()
					if errors.Is(err, errAgreementUnanswered) && ctx.Err() == nil {
						// Not a failure of the job, nor of this node: the
						// next rendezvous takes it out of the round (it
						// leaves before it joins), the place is vacant
						// again, and it waits to be admitted, its
						// pre-started workers kept.
						a.log.Warn("leaving the round this node was admitted into: its agreement did not answer; waiting to be admitted again",
							zap.Int("round", p.round), zap.Error(err))
						continue
					}
					a.endpoint.SetPhase(PhaseFailed)
					return stoppedOr(ctx, a.log, err, "while joining the running round")
				}
			}
		}
		if a.gossip != nil {
			a.gossip.join(ctx, p.gossip)
		}
		out, err := a.runRound(ctx, p, sigs, sv, pk)
		pk = nil // the round's group now, stopped with it
		if err != nil {
			sv.close()
			p.release()
			a.endpoint.SetPhase(PhaseFailed)
			return err
		}
		// The round's worker store (when this node hosts it) and the
		// agreement stay up through decide: in shrink mode the other
		// nodes' survivors may still need them until the exit barrier.
		done, err := a.decide(ctx, p, out, sv)
		sv.close()
		p.release()
		switch {
		case done && err == nil && stoppedBy(ctx) != 0:
			// Stopped after the workers succeeded, at the exit barrier.
			a.endpoint.SetPhase(PhaseFailed)
			return stoppedOr(ctx, a.log, context.Cause(ctx), "at the exit barrier")
		case done && err == nil:
			a.endpoint.SetPhase(PhaseSucceeded)
			return nil
		case done:
			a.endpoint.SetPhase(PhaseFailed)
			return err
		case out.placeTaken:
			// Not a restart of the job: it went on without this node.
		case len(out.failures) > 0 || (out.change != nil && len(out.change.lost) > 0):
			a.endpoint.Restarted()
		}
	}
}

// joinLate readies a plan for a round this node was admitted into while it
// ran, in a lost node's place: its workers start as newcomers, after the
// latest epoch, and join the running group by a grow.
//
// The latest epoch is read from the agreement, each try bounded by half
// the agreement timeout (5 s at most), for up to the agreement timeout:
// the same bound as a failure's wait for the survivors' decision. Past it
// the error wraps errAgreementUnanswered.
func (a *agent) joinLate(ctx context.Context, p *plan, sv *survivors) error {
	window := a.cfg.AgreementTimeout
	after, err := sv.latest(ctx, min(5*time.Second, window/2), window)
	if err != nil {
		return err
	}
	if after == 0 {
		return fmt.Errorf("admitted into round %d, whose agreement has no epoch: no place was lost", p.round)
	}
	p.env.NewcomerAfter = after
	a.log.Warn("admitted into the running round in a lost node's place; the workers join by a grow",
		zap.Int("round", p.round), zap.Int("group_rank", p.assignments[0].GroupRank), zap.Int("after_epoch", after))
	return nil
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
			a.m.sawClosed(context.WithoutCancel(ctx))
		}
		if out.change.ok {
			return true, nil
		}
		return true, &JobFailedError{Reason: out.change.String()}
	case out.change != nil && len(out.change.lost) > 0:
		return a.restartOrFail(ctx, p, out.change.String(), nil,
			"re-rendezvous without the lost node(s)", zap.Strings("lost", out.change.lost))
	case out.change != nil:
		// Scale-up: not a failure, not counted as a restart (torchrun's
		// rule).
		a.log.Info("membership changed; re-rendezvous", zap.Int("waiting", out.change.waiting))
		return false, nil
	case out.placeTaken:
		// Not a failure of the job: the job goes on without this node,
		// which waits to be admitted again.
		return false, nil
	case out.fallback != "":
		// Shrink mode gave up: a restart, counted as restart mode counts
		// one.
		return a.restartOrFail(ctx, p, "shrink mode fell back to restart: "+out.fallback, append(slices.Clone(out.lost), out.failures...),
			"shrink mode fell back to restart; restarting the worker group", zap.String("why", out.fallback))
	case len(out.failures) == 0:
		return true, a.succeeded(ctx, p, sv)
	}
	return a.restartOrFail(ctx, p, failureText(out.failures), out.failures,
		"worker group failed; restarting", zap.String("cause", failureText(out.failures)))
}

// restartOrFail counts the round's failure (cause says what failed)
// against the job's restarts. With a restart left it logs msg and the
// agent goes on to the next round; without, the job ends failed: with
// the local failures (the failure table, exit code 1) if there are any,
// else with cause.
func (a *agent) restartOrFail(ctx context.Context, p *plan, cause string, failures []Failure, msg string, fields ...zap.Field) (bool, error) {
	left, err := a.m.failed(ctx, p, cause)
	if err != nil {
		return true, err
	}
	if left {
		a.log.Warn(msg, append(fields, zap.Int("max_restarts", a.cfg.MaxRestarts))...)
		return false, nil
	}
	var end error = &JobFailedError{Reason: cause + ", and no restart is left"}
	if len(failures) > 0 {
		e := &WorkersFailedError{Name: a.cfg.Entrypoint.Program, Failures: failures, Restarts: p.env.RestartCount}
		io.WriteString(a.con.stderr, e.Summary())
		end = e
	}
	a.m.finish(ctx, p, false)
	return true, end
}

// succeeded ends the job after every local worker (every survivor, in
// shrink mode) succeeded: the exit barrier, then the closing.
func (a *agent) succeeded(ctx context.Context, p *plan, sv *survivors) error {
	if sv != nil {
		p.barrierRanks = sv.liveNodes()
	}
	if err := a.m.finish(ctx, p, true); err != nil {
		return err
	}
	if sv != nil && len(sv.epochs) > 0 {
		sv.settleGrow(ctx)
		msg := "the surviving workers succeeded"
		if sv.allBack() {
			msg = "all workers succeeded, the lost ones grown back in"
		}
		a.log.Warn(msg, zap.String("run_id", a.runID), zap.Int("round", p.round), zap.String("shrink", sv.summary()))
		return nil
	}
	a.log.Info("all workers succeeded", zap.String("run_id", a.runID), zap.Int("round", p.round),
		zap.Int("restarts", p.env.RestartCount))
	return nil
}

func failureText(fs []Failure) string {
	f := fs[rootCause(fs)]
	return fmt.Sprintf("rank %d: %s", f.Rank, describeExit(f.ExitCode))
}

// stoppedOr returns err, or, when a stop signal ended the wait that
// failed, the signal's *SignalError, after logging what the agent was
// doing (waiting says it: "while waiting for the rendezvous").
func stoppedOr(ctx context.Context, log *zap.Logger, err error, waiting string) error {
	sig := stoppedBy(ctx)
	if sig == 0 {
		return err
	}
	log.Warn("stopped by a signal "+waiting, zap.Stringer("signal", sig))
	return &SignalError{Signal: sig}
}

// leftoversKillTimeout bounds the sweep of what the workers left behind.
const leftoversKillTimeout = 2 * time.Second

// killLeftovers kills what the workers left behind (ContainDescendants):
// their descendants re-parented to the agent, setsid'd daemons included.
func (a *agent) killLeftovers() {
	if !a.cfg.ContainDescendants {
		return
	}
	if n := a.reaper.KillOrphans(leftoversKillTimeout); n > 0 {
		a.log.Info("killed processes the workers left behind", zap.Int("processes", n))
	}
}
