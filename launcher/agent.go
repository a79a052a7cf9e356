package launcher

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/launcher/reaper"
)

// ErrNotImplemented marks configurations this version of the agent cannot
// run yet (the etcd backends). The CLI reports it as bad input.
var ErrNotImplemented = errors.New("not implemented yet")

// Run runs one agent until its job ends: nil when every worker succeeded,
// *WorkersFailedError when they failed with no restart left (exit code 1),
// *JobFailedError when the job failed elsewhere or lost a node with no
// restart left (1), *SignalError when a signal stopped it (128+N), errors
// wrapping ErrRendezvousTimeout or ErrRendezvousClosed when it could not
// join, and ErrInvalidConfig or ErrNotImplemented for what it cannot run.
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
	m, err := newMembership(ctx, &a.cfg, log, a.runID)
	if err != nil {
		return err
	}
	a.m = m
	a.multiNode = cfg.MaxNodes > 1
	return a.run(ctx)
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
	a.reaper = reaper.New(reaper.Config{
		ReapOrphans: pid1 || cfg.Init,
		OnOrphan: func(e reaper.Exit) {
			log.Debug("reaped an orphan", zap.Stringer("exit", e))
		},
	})
	return a, nil
}

func (a *agent) close() {
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
		out, err := a.runRound(ctx, p, sigs)
		p.release()
		if err != nil {
			a.health.SetPhase(PhaseFailed)
			return err
		}
		done, err := a.decide(ctx, p, out)
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
func (a *agent) decide(ctx context.Context, p *plan, out outcome) (bool, error) {
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
	case len(out.failures) == 0:
		if err := a.m.finish(ctx, p, true); err != nil {
			return true, err
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

func failureText(fs []Failure) string {
	f := fs[rootCause(fs)]
	return fmt.Sprintf("rank %d: %s", f.Rank, describeExit(f.ExitCode))
}

// runRound starts the local workers of a round and watches them until the
// round ends here.
func (a *agent) runRound(ctx context.Context, p *plan, sigs <-chan os.Signal) (outcome, error) {
	dir := filepath.Join(a.runDir, "attempt_"+strconv.Itoa(p.env.RestartCount))
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
	out := a.monitor(ctx, g, sigs)
	return out, nil
}

// monitor waits for the round's outcome. Exits arrive from the reaper the
// moment they happen: a failure stops the rest of the group at once. The
// job is polled every MonitorInterval for changes that end the round
// (nodes waiting, nodes lost, the job closed).
func (a *agent) monitor(ctx context.Context, g *group, sigs <-chan os.Signal) outcome {
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
	for g.running > 0 {
		select {
		case x := <-g.exits:
			g.record(x)
			if x.e.Code() == 0 {
				continue
			}
			// Collect failures that happened together, then stop the
			// others: torchrun stops the whole local group on the
			// first failure.
			failures := []Failure{a.failure(x)}
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
			a.health.SetPhase(PhaseStopping)
			g.stop(syscall.SIGTERM, grace, sigs, forward)
			return outcome{failures: failures}
		case <-poll:
			c, err := a.m.watch(ctx)
			if err != nil {
				a.log.Warn("cannot read the rendezvous state", zap.Error(err))
				continue
			}
			if c != nil {
				a.log.Warn("stopping workers: the job changed", zap.Stringer("change", c))
				a.health.SetPhase(PhaseStopping)
				g.stop(syscall.SIGTERM, grace, sigs, forward)
				return outcome{change: c}
			}
		case s := <-sigs:
			sig := s.(syscall.Signal)
			if !stopSignals[sig] {
				forward(s)
				continue
			}
			a.log.Warn("stopping workers on signal", zap.Stringer("signal", s), zap.Duration("grace", grace))
			a.health.SetPhase(PhaseStopping)
			g.stop(sig, grace, sigs, forward)
			return outcome{signal: sig}
		case <-ctx.Done():
			g.stop(syscall.SIGTERM, grace, sigs, forward)
			return outcome{err: ctx.Err()}
		}
	}
	g.wait(nil, 0, nil) // drain the output
	return outcome{}
}

// reportExit tells the health endpoint how a worker ended.
func (a *agent) reportExit(w *worker, stopped bool) {
	switch {
	case w.exit.Code() == 0:
		a.health.WorkerExited(true, "")
	case stopped:
		a.health.WorkerExited(false, ReasonStopped)
	case w.exit.Signal() != 0:
		a.health.WorkerExited(false, ReasonSignal)
	default:
		a.health.WorkerExited(false, ReasonExitCode)
	}
}

func (a *agent) failure(x workerExit) Failure {
	return newFailure(x.w.a.LocalRank, x.w.a.Rank, x.e, x.w.errorFile, a.host)
}
