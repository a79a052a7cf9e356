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

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/launcher/reaper"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// ErrNotImplemented marks configurations this version of the agent cannot
// run yet (multi-node rendezvous). The CLI reports it as bad input.
var ErrNotImplemented = errors.New("not implemented yet")

// Run runs one agent until its job ends: nil when every worker succeeded,
// *WorkersFailedError when they failed with no restart left (exit code 1),
// *SignalError when a signal stopped it (128+N), an error wrapping
// ErrInvalidConfig or ErrNotImplemented for what it cannot run. Workers'
// output goes to the agent's stdout and stderr.
func Run(ctx context.Context, cfg Config, log *zap.Logger) error {
	return run(ctx, cfg, log, os.Stdout, os.Stderr)
}

func run(ctx context.Context, cfg Config, log *zap.Logger, stdout, stderr io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if cfg.MaxNodes > 1 {
		return fmt.Errorf("--nnodes %d:%d: multi-node rendezvous (%s backend): %w; run one node, or use torchrun for now",
			cfg.MinNodes, cfg.MaxNodes, cfg.Rendezvous.Backend, ErrNotImplemented)
	}
	a, err := newAgent(cfg, log, stdout, stderr)
	if err != nil {
		return err
	}
	defer a.close()
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

func (a *agent) close() { a.reaper.Close() }

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

// outcome is how one attempt ended.
type outcome struct {
	failures []Failure      // workers that failed
	signal   syscall.Signal // the signal that stopped the agent
	err      error          // the context's error
}

// stopSignals end the agent, torchrun's defaults; other handled signals
// (SIGUSR1, SIGUSR2: SLURM's warnings) are only passed on to the workers.
var stopSignals = map[syscall.Signal]bool{
	syscall.SIGTERM: true, syscall.SIGINT: true, syscall.SIGHUP: true, syscall.SIGQUIT: true,
}

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
	nproc := a.cfg.NProcPerNode
	if nproc > 1 {
		if _, set := os.LookupEnv("OMP_NUM_THREADS"); !set {
			a.log.Warn("setting OMP_NUM_THREADS=1 for each worker, as torchrun does, to avoid overloading the system; tune it for your job")
		}
	}
	for restart := 0; ; restart++ {
		out, err := a.attempt(ctx, restart, sigs)
		if err != nil {
			return err
		}
		switch {
		case out.signal != 0:
			return &SignalError{Signal: out.signal}
		case out.err != nil:
			return out.err
		case len(out.failures) == 0:
			a.log.Info("all workers succeeded", zap.String("run_id", a.runID), zap.Int("restarts", restart))
			return nil
		case restart < a.cfg.MaxRestarts:
			a.log.Warn("worker group failed; restarting",
				zap.Int("restart", restart+1), zap.Int("max_restarts", a.cfg.MaxRestarts),
				zap.String("cause", failureText(out.failures)))
		default:
			e := &WorkersFailedError{Name: a.cfg.Entrypoint.Program, Failures: out.failures, Restarts: restart}
			io.WriteString(a.con.stderr, e.Summary())
			return e
		}
	}
}

func failureText(fs []Failure) string {
	f := fs[rootCause(fs)]
	return fmt.Sprintf("rank %d: %s", f.Rank, describeExit(f.ExitCode))
}

// attempt runs the worker group once: a fresh worker store, the workers,
// until they all succeed, one fails, or a signal stops the agent.
func (a *agent) attempt(ctx context.Context, restart int, sigs <-chan os.Signal) (outcome, error) {
	store, env, err := a.startStore(restart)
	if err != nil {
		return outcome{}, err
	}
	defer store.Close()
	dir := filepath.Join(a.runDir, "attempt_"+strconv.Itoa(restart))
	spec := spawnSpec{
		path: a.path, argv: a.argv, env: env, base: environ(), dir: dir,
		prefix: func(as Assignment) string { return fmt.Sprintf("[%s%d]:", a.cfg.Role, as.LocalRank) },
	}
	as := singleNode(a.cfg.NProcPerNode)
	a.log.Info("starting workers",
		zap.Int("restart", restart), zap.Int("local_world_size", len(as)), zap.Int("world_size", as[0].WorldSize),
		zap.String("master", net.JoinHostPort(env.MasterAddr, strconv.Itoa(env.MasterPort))),
		zap.String("run_id", a.runID), zap.String("log_dir", dir))
	g, err := startGroup(a.reaper, a.con, &a.cfg, spec, as)
	if err != nil {
		return outcome{}, err
	}
	return a.monitor(ctx, g, sigs), nil
}

// startStore starts this attempt's worker store: a fresh, empty TCPStore,
// so that every restart begins in a clean namespace whatever PyTorch the
// workers run (1.13 prefixes keys per attempt; newer versions do not).
func (a *agent) startStore(restart int) (*tcpstore.Server, WorkerEnv, error) {
	listen, advertise := "127.0.0.1:0", "127.0.0.1"
	if r := a.cfg.Rendezvous; !r.Standalone {
		// Static: the user chose the address and port workers use,
		// --rdzv-endpoint HOST:PORT or --master-addr and --master-port.
		host, port := r.MasterAddr, r.MasterPort
		if r.Endpoint != "" {
			var err error
			if host, port, err = splitEndpoint(r.Endpoint, -1); err != nil {
				return nil, WorkerEnv{}, fmt.Errorf("%w: --rdzv-endpoint: %v", ErrInvalidConfig, err)
			}
		}
		listen, advertise = net.JoinHostPort("", strconv.Itoa(port)), host
	}
	srv, err := tcpstore.Listen(listen, tcpstore.ServerConfig{Logger: a.log.Named("store")})
	if err != nil {
		return nil, WorkerEnv{}, fmt.Errorf("worker store on %s: %w", listen, err)
	}
	port := srv.Addr().(*net.TCPAddr).Port
	env := WorkerEnv{
		Role:         a.cfg.Role,
		RunID:        a.runID,
		MasterAddr:   advertise,
		MasterPort:   port,
		RestartCount: restart,
		MaxRestarts:  a.cfg.MaxRestarts,
		StoreURL:     "tcp://" + net.JoinHostPort(advertise, strconv.Itoa(port)),
		Generation:   restart,
		OMPThreads:   ompThreads(a.cfg.NProcPerNode),
	}
	return srv, env, nil
}

// singleNode assigns ranks when this agent is the whole job.
func singleNode(nproc int) []Assignment {
	as := make([]Assignment, nproc)
	for i := range as {
		as[i] = Assignment{
			LocalRank: i, Rank: i, RoleRank: i,
			LocalWorldSize: nproc, WorldSize: nproc, RoleWorldSize: nproc,
			GroupRank: 0, GroupWorldSize: 1,
		}
	}
	return as
}

// monitor waits for the group's outcome. Exits arrive from the reaper the
// moment they happen: a failure stops the rest of the group at once.
func (a *agent) monitor(ctx context.Context, g *group, sigs <-chan os.Signal) outcome {
	forward := func(s os.Signal) {
		a.log.Info("forwarding signal to workers", zap.Stringer("signal", s))
		g.signal(s.(syscall.Signal))
	}
	grace := a.cfg.ShutdownTimeout
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
			g.stop(syscall.SIGTERM, grace, sigs, forward)
			return outcome{failures: failures}
		case s := <-sigs:
			sig := s.(syscall.Signal)
			if !stopSignals[sig] {
				forward(s)
				continue
			}
			a.log.Warn("stopping workers on signal", zap.Stringer("signal", s), zap.Duration("grace", grace))
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

func (a *agent) failure(x workerExit) Failure {
	return newFailure(x.w.a.LocalRank, x.w.a.Rank, x.e, x.w.errorFile, a.host)
}
