// Command chaos runs a job of fixed work through a seeded schedule of
// failures, under each row's launcher and failure mode, and reports per
// row: wall time, goodput (useful rank-steps ÷ (world × wall)) beside the
// fault-free run's, lost time per failure, steps redone, whether the
// result is exact, and the invariants a long job needs (no step lost, no
// process left, the agent's fds, goroutines, RSS and store keys back near
// where they started). Issue 16.
//
// Why a command of its own rather than `ftbench -schedule`: ftbench
// measures one fault to the next collective, trial after trial, its rows
// interleaved; a soak runs one long job per row through many faults and
// judges the whole run. They share the process chores (bench/internal/
// procs) and the arithmetic (bench/internal/stats), not their loops.
//
// The work is -steps steps, each -step-ms apart, every rank printing a
// progress line per step (--progress) and the group's rank 0 checkpointing
// (--checkpoint, every step), so that a restart resumes where the job was,
// as a training job that checkpoints does. The worker (-worker-kind) is
// examples/allreduce (go: pg/cpu; the result is the sum over the final
// group's ranks) or examples/torch/train_elastic.py (torch: PyTorch gloo
// through gorun_ft.py, -python's PyTorch 1.13, the sid bed's 2.14 under
// torchrun 2.14; the result is the model's loss, which must equal a
// fault-free run's where every step ran at full world, and agree across
// the final group where steps ran at a smaller one: see exactness).
// -startup is each worker's start-up cost, a sleep before it starts that
// stands for imports, device init and checkpoint load (the torch worker's
// own imports come on top). The fault-free row runs first; its rate is
// what lost time and the goodput ratio are measured against, and the
// schedule's horizon is 3× its wall time (or -horizon). The schedule
// (-seed, -mtbf, -min-gap, -kinds) is the same for every row; a fault's
// time counts from the job's launch, or with -clock first-step from its
// first step (a short run whose start-up time varies).
//
// Rows (-rows, by number):
//
//  1. gorun, no faults (--on-failure shrink --regrow on): the baseline
//     (-baseline-steps of work: its rate is what counts).
//  2. gorun --on-failure restart.
//  3. gorun --on-failure shrink --regrow off: the survivors carry on; the
//     row keeps half its ranks (later faults are skipped, and counted).
//  4. gorun --on-failure shrink --regrow on (heal): lost ranks are
//     respawned and grown back in, a replacement agent admitted.
//  5. torchrun 1.13 restart (-python -m torch.distributed.run --redirects 1
//     --tee 1), its default --monitor_interval; --standalone on one host,
//     c10d on several (each agent with its host's name: hostbed.AsHost).
//  6. gorun heal with a hot spare: a spare agent on the bed's extra host,
//     its workers pre-started (--spare-prestart), started once the job
//     runs; several hosts only.
//  7. torchrun 2.14 restart: the sid bed's torchrun (internal/sidbed;
//     -python214, root), its workers in the bed too, its default
//     --monitor_interval (0.1 s), --redirects 1 --tee 1 as row 5; either
//     worker kind (the Go worker is static, copied where the bed sees
//     it); c10d on several hosts, as row 5 (each agent enters the bed
//     from its host, under its host's name).
//  8. gorun heal with a respawn standby on each host (--respawn-standbys
//     1): a lost rank's respawn takes a worker whose start-up is done. A
//     rank fault finds a former standby by the respawn gorun logged, not
//     by its environment, which it started without (liveWorkers).
//
// Faults (-kinds): rank-kill (SIGKILL), rank-exit (SIGTERM: the Go worker
// ends between steps with exit code 1; the torch worker, which has no
// handler, dies of it), rank-hang (SIGSTOP: gorun finds it
// by --heartbeat-timeout, torchrun when a peer's collective times out,
// -worker-timeout), agent-kill (SIGKILL of a host's agent, its workers
// dying with it; a replacement agent starts on that host -replace-after
// later — in the spare row it becomes the next spare). A rank fault picks
// its rank among every agent's workers by RANK (the next running one when
// that rank is not running: a pre-started spare's workers have none); an
// agent fault never hits host 0, whose agent is the job's witness (its
// exit code is the job's, its resources are sampled; with c10d it holds
// the store). two-ranks SIGKILLs two ranks at the same moment (two faults
// at once); grow-kill SIGKILLs a rank and, the moment its respawn says it
// is a newcomer (a grow under way), a second one (a fault during a grow;
// where no newcomer comes within 5 s, as in restart rows, the second kill
// strikes the recovery all the same). spare-kill SIGKILLs the hot spare's
// agent while it stands by (the spare row; others skip it), and a new
// spare starts on its host -replace-after later. link-cut blackholes a host's link
// (never host 0's) for -cut-for, then heals it: the host's agent and
// workers live on, silent to the others, and must find their way back or
// out. coordinator-lost (-backend etcd) SIGKILLs host 0's agent, the
// job's first and the survivors' coordinator, and starts a replacement
// there -replace-after later, as agent-kill does: the agreement fails over
// to a survivor. The witness is then the last host's agent, and the other
// host faults spare it too (with coordinator-lost, agent-kill and
// link-cut need 3 hosts).
//
// With -hosts 1 the agent runs with --standalone; with -hosts H ≥ 2 (root,
// iproute2) agent i runs in host i of a network-namespace bed
// (bench/internal/hostbed) with --nnodes H, -backend's rendezvous (c10d:
// the store on host 0; etcd: one member on the bed's gateway) and its
// host's --local-addr.
//
//	go run ./bench/chaos -steps 2400 -step-ms 50 -mtbf 30s
//	go run ./bench/chaos -worker-kind torch -startup 5s -steps 1200 -mtbf 25s -kinds rank-kill,rank-exit -rows 1,2,4,5,7
//	go run ./bench/chaos -hosts 2 -nproc 2 -backend etcd -kinds rank-kill,agent-kill -rows 1,4,6
//
// The command exits 1 when a row broke an invariant.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
	"golang.org/x/sys/unix"
)

// config is the command's settings, from the flags.
type config struct {
	job        Job
	sched      ScheduleConfig
	kinds      string
	horizon    time.Duration // 0: 3× the fault-free wall time
	rows       string
	rowTimeout time.Duration
	logs       string // keep every row's console output here
	root       string // the repository, to build from
	limits     Limits
	etcd       string        // the etcd binary, for -backend etcd
	replace    time.Duration // a killed agent's replacement starts this much later
	cutFor     time.Duration // a link cut lasts this long
	clock      string        // the schedule's zero: clockLaunch ("": the same) or clockFirstStep
	// baselineSteps is the fault-free row's work (0: -steps): its rate is
	// what is measured, and a shorter run gives it sooner.
	baselineSteps int
	// python214 is -python214: "auto" (the sid bed's), "" (none) or a path.
	python214 string
}

// The schedule's zero (-clock).
const (
	clockLaunch    = "launch"
	clockFirstStep = "first-step"
)

func main() {
	c, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case err != nil:
		os.Exit(2) // the flag package has said why
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	results, err := run(ctx, c, os.Stdout, os.Stderr)
	if err == nil {
		for _, r := range results {
			if len(r.Violations) > 0 {
				err = errors.New("a row broke an invariant")
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command's flags from args; errors and -help go to
// stderr.
func parseFlags(args []string, stderr io.Writer) (*config, error) {
	var c config
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&c.job.Nproc, "nproc", 4, "ranks per host")
	fs.IntVar(&c.job.Hosts, "hosts", 1, "hosts: 1 (--standalone), or 2 or more network-namespace hosts (root, iproute2), with a spare host for the hot-spare row")
	fs.StringVar(&c.job.Backend, "backend", backendC10d, "the rendezvous of several hosts: c10d (the store on host 0) or etcd (a member on the bed's gateway)")
	fs.StringVar(&c.job.RdzvConf, "rdzv-conf", "join_timeout=1800,last_call_timeout=1", "every multi-host agent's --rdzv-conf (a spare stands by for up to join_timeout)")
	fs.StringVar(&c.etcd, "etcd", "etcd", "etcd binary, for -backend etcd")
	fs.DurationVar(&c.replace, "replace-after", time.Second, "a killed agent's replacement (a replacement node) starts on its host this much later")
	fs.DurationVar(&c.cutFor, "cut-for", 10*time.Second, "a link cut (link-cut) lasts this long before the link heals")
	fs.IntVar(&c.baselineSteps, "baseline-steps", 0, "the fault-free row's steps (default -steps)")
	fs.IntVar(&c.job.Steps, "steps", 1200, "the fixed work: steps (allreduce, or training steps)")
	fs.IntVar(&c.job.StepMs, "step-ms", 50, "each step's cost: the worker's pause before it, ms")
	fs.StringVar(&c.job.WorkerTimeout, "worker-timeout", "15s", "the worker's --timeout (train_elastic.py's in seconds): how long a collective waits on a silent peer")
	fs.StringVar(&c.job.HeartbeatTimeout, "heartbeat-timeout", "2", "gorun's --heartbeat-timeout, seconds (a hung rank)")
	fs.StringVar(&c.job.DoneTimeout, "done-timeout", "10", "gorun's --done-timeout, seconds (a rank hung in its teardown, after it said it was done); empty: unbounded")
	fs.StringVar(&c.job.RespawnBackoff, "respawn-backoff", "0.1", "gorun's --respawn-backoff in the heal row, seconds")
	fs.StringVar(&c.job.ShutdownTimeout, "shutdown-timeout", "", "gorun's --shutdown-timeout, seconds (default gorun's, 30: a hung rank ignores SIGTERM)")
	fs.StringVar(&c.job.Gorun, "gorun", "", "gorun binary (default: build ./cmd/gorun)")
	fs.StringVar(&c.job.Worker, "worker", "", "examples/allreduce binary (default: build it)")
	fs.StringVar(&c.job.Python, "python", "/usr/bin/python3", "Python with PyTorch 1.13, for torchrun 1.13 and the torch workers of the other rows")
	fs.StringVar(&c.python214, "python214", "auto", `Python with PyTorch 2.14 for the torchrun 2.14 row ("auto": the sid bed's, internal/sidbed, when built; "": no such row)`)
	fs.StringVar(&c.job.WorkerKind, "worker-kind", workerGo, "the workers: go (examples/allreduce, pg/cpu) or torch (examples/torch/train_elastic.py, PyTorch gloo)")
	fs.DurationVar(&c.job.Startup, "startup", 0, "each worker's start-up cost: a sleep before it starts (a bare -python that sleeps, then execs the worker), standing for imports, device init and checkpoint load (the issue's 0s, 5s, 30s)")
	fs.StringVar(&c.job.LR, "lr", "0.001", "train_elastic.py's --lr (torch workers): small, so that the final loss stays far above rounding and compares to a fault-free run's")
	fs.Uint64Var(&c.sched.Seed, "seed", 1, "the schedule's seed")
	fs.DurationVar(&c.sched.MTBF, "mtbf", 30*time.Second, "mean time between failures")
	fs.DurationVar(&c.sched.MinGap, "min-gap", 0, "shortest gap between faults (default mtbf/5)")
	fs.StringVar(&c.kinds, "kinds", "rank-kill,rank-exit,rank-hang", "fault kinds, comma-separated: rank-kill, rank-exit, rank-hang, two-ranks, grow-kill; on several hosts also agent-kill, link-cut, spare-kill; with -backend etcd coordinator-lost")
	fs.StringVar(&c.clock, "clock", clockLaunch, `the schedule's zero: "launch" (the row's start) or "first-step" (when the job has trained its first step)`)
	fs.DurationVar(&c.horizon, "horizon", 0, "no fault after this (default 3× the fault-free run's wall time)")
	fs.StringVar(&c.rows, "rows", "", "rows to run, by number, comma-separated (default all)")
	fs.DurationVar(&c.rowTimeout, "row-timeout", 30*time.Minute, "bound on one row's run")
	fs.StringVar(&c.logs, "logs", "", "keep every row's console output in this directory")
	fs.StringVar(&c.root, "root", ".", "the repository's root")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	return &c, nil
}

// run runs the selected rows and prints the table on stdout, progress on
// stderr.
func run(ctx context.Context, c *config, stdout, stderr io.Writer) ([]RowResult, error) {
	selected, err := selectRows(c.rows)
	if err != nil {
		return nil, err
	}
	if c.baselineSteps == 0 {
		c.baselineSteps = c.job.Steps
	}
	if c.job.WorkerKind == "" {
		c.job.WorkerKind = workerGo // what every run was before the torch kind
	}
	switch {
	case c.job.Hosts < 1 || c.job.Nproc < 1:
		return nil, errors.New("-hosts and -nproc must be at least 1")
	case c.job.Hosts > 1 && c.job.Backend != backendC10d && c.job.Backend != backendEtcd:
		return nil, fmt.Errorf("-backend %q: want %s or %s", c.job.Backend, backendC10d, backendEtcd)
	case c.job.WorkerKind != workerGo && c.job.WorkerKind != workerTorch:
		return nil, fmt.Errorf("-worker-kind %q: want %s or %s", c.job.WorkerKind, workerGo, workerTorch)
	case c.job.Startup < 0:
		return nil, fmt.Errorf("-startup %v: want 0 or more", c.job.Startup)
	case c.clock != "" && c.clock != clockLaunch && c.clock != clockFirstStep:
		return nil, fmt.Errorf("-clock %q: want %s or %s", c.clock, clockLaunch, clockFirstStep)
	}
	if d, err := time.ParseDuration(c.job.WorkerTimeout); err != nil || d <= 0 {
		return nil, fmt.Errorf("-worker-timeout %q: want a duration above 0, such as 15s", c.job.WorkerTimeout)
	}
	split := strings.Split(c.kinds, ",")
	if c.sched.Kinds, err = ParseKinds(split); err != nil {
		return nil, err
	}
	if slices.Contains(c.sched.Kinds, CoordinatorLost) && (c.job.Hosts < 2 || c.job.Backend != backendEtcd) {
		return nil, fmt.Errorf("%w: %s needs -hosts 2 or more and -backend %s: with %s host 0 holds the job's store, "+
			"and losing it ends the job (as it does torchrun's)", ErrSchedule, CoordinatorLost, backendEtcd, backendC10d)
	}
	// Orphans of a launcher are reparented to us, so none escapes.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, fmt.Errorf("become a subreaper: %w", err)
	}
	tmp, err := os.MkdirTemp("", "chaos-bin-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if err := build(ctx, c.root, tmp, &c.job); err != nil {
		return nil, err
	}
	refLoss := map[int]float64{} // by steps: the torch rows' reference
	if c.job.WorkerKind == workerTorch {
		if !torchAvailable(ctx, c.job.Python) {
			return nil, fmt.Errorf("-worker-kind torch: %s cannot import torch", c.job.Python)
		}
		if c.job.TorchScript, err = stageTorch(c.root, tmp); err != nil {
			return nil, err
		}
		for _, n := range []int{c.baselineSteps, c.job.Steps} {
			if refLoss[n], err = referenceLoss(ctx, c.job.Python, c.job.TorchScript, n, c.job.World(), c.job.LR); err != nil {
				return nil, err
			}
		}
		c.job.RefLoss = refLoss[c.job.Steps]
		fmt.Fprintf(stderr, "chaos: reference loss after %d steps at world %d: %.9g\n", c.job.Steps, c.job.World(), refLoss[c.job.Steps])
	}
	if c.logs != "" {
		if err := os.MkdirAll(c.logs, 0o755); err != nil {
			return nil, err
		}
	}
	var notes []string
	skip := func(drop func(Row) bool, note string) {
		if slices.ContainsFunc(selected, drop) {
			notes = append(notes, note)
			fmt.Fprintln(stderr, "chaos:", note)
			selected = slices.DeleteFunc(selected, drop)
		}
	}
	torchrun113 := func(r Row) bool { return r.Torchrun && !r.Torch214 }
	torchrun214 := func(r Row) bool { return r.Torch214 }
	switch {
	case c.job.Hosts > 1 && c.job.Backend != backendC10d:
		skip(torchrun113, "torchrun row skipped: torchrun 1.13's etcd rendezvous speaks etcd's v2 API; it runs with -backend c10d")
	case !torchAvailable(ctx, c.job.Python):
		skip(torchrun113, fmt.Sprintf("torchrun row skipped: %s cannot import torch", c.job.Python))
	}
	if slices.ContainsFunc(selected, torchrun214) {
		py, why := resolvePython214(c.python214)
		switch {
		case c.job.Hosts > 1 && c.job.Backend != backendC10d:
			// 2.14's etcd rendezvous (etcd-v2) speaks etcd's v2 API too.
			skip(torchrun214, "torchrun 2.14 row skipped: its etcd rendezvous speaks etcd's v2 API; it runs with -backend c10d")
		case py == "":
			skip(torchrun214, "torchrun 2.14 row skipped: "+why)
		case !torchAvailable(ctx, py):
			skip(torchrun214, fmt.Sprintf("torchrun 2.14 row skipped: %s cannot import torch", py))
		default:
			c.job.Python214 = py
			if c.job.WorkerKind == workerGo {
				// Its workers run in the bed, which sees the temporary
				// directory only.
				if c.job.Worker, err = stageWorker(c.job.Worker, tmp); err != nil {
					return nil, err
				}
			}
		}
	}
	if c.job.Hosts <= 1 {
		skip(func(r Row) bool { return r.Spare }, "hot-spare row skipped: it needs -hosts 2 or more")
	}
	env := runEnv{replaceAfter: c.replace, cutFor: c.cutFor, timeout: c.rowTimeout, fromFirstStep: c.clock == clockFirstStep,
		witness: ScheduleConfig{Kinds: c.sched.Kinds, Hosts: c.job.Hosts}.Witness()}
	if c.job.Hosts > 1 {
		cfg := hostbed.Config{Hosts: c.job.Hosts + 1, Dir: tmp} // the last: the spare's
		if c.job.Backend == backendEtcd {
			cfg.Etcd = c.etcd
		}
		bed, err := hostbed.Create(ctx, cfg)
		if err != nil {
			return nil, err
		}
		defer bed.Close()
		env.bed, c.job.HostIPs, c.job.HostNames, c.job.HostsFile = bed, bed.IPs, bed.Names, bed.HostsFile
		if bed.Etcd != nil {
			c.job.EtcdEndpoint = bed.Etcd.Endpoint
		}
	}

	var results []RowResult
	var stepTime time.Duration
	var sched []Fault
	runOne := func(i int, r Row) error {
		console := io.Discard
		if c.logs != "" {
			f, err := os.Create(consolePath(c.logs, i, r))
			if err != nil {
				return err
			}
			defer f.Close()
			console = f
		}
		j := c.job
		// Each run its own rendezvous id: etcd keeps a finished run's
		// state.
		j.RunID = fmt.Sprintf("chaos-%d-%d", os.Getpid(), i+1)
		var s []Fault
		if r.FaultFree {
			j.Steps = c.baselineSteps
		} else {
			s = sched
		}
		j.RefLoss = refLoss[j.Steps]
		env.console = console
		res, err := runRow(ctx, j, r, s, stepTime, c.limits, env)
		switch {
		case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && !r.FaultFree:
			// A row that never finished is the row's result, not the
			// end of the run: the job did not complete.
			res.Wall = c.rowTimeout
			res.Violations = append(res.Violations, err.Error())
		case err != nil:
			return err
		}
		fmt.Fprintf(stderr, "chaos: %s: wall %.1f s, goodput %.2f, %d faults, %d violations %v\n",
			r.Name, res.Wall.Seconds(), res.Report.Goodput, res.Brought(), len(res.Violations), res.Violations)
		results = append(results, res)
		return nil
	}
	// The fault-free row first: the others are measured against it.
	for i, r := range rows {
		if r.FaultFree {
			if err := runOne(i, r); err != nil {
				return results, err
			}
			stepTime = results[0].Wall / time.Duration(c.baselineSteps)
		}
	}
	c.sched.World, c.sched.Hosts = c.job.World(), c.job.Hosts
	c.sched.Horizon = c.horizon
	if c.sched.Horizon == 0 {
		c.sched.Horizon = 3 * time.Duration(c.job.Steps) * max(stepTime, time.Duration(c.job.StepMs)*time.Millisecond)
	}
	if sched, err = NewSchedule(c.sched); err != nil {
		return results, err
	}
	fmt.Fprintf(stderr, "chaos: schedule (seed %d): %d faults within %v\n", c.sched.Seed, len(sched), c.sched.Horizon)
	for _, r := range selected {
		if r.FaultFree {
			continue
		}
		i := indexOf(r)
		if err := runOne(i, r); err != nil {
			return results, err
		}
	}
	printTable(stdout, c, results, notes)
	return results, nil
}

func indexOf(r Row) int {
	for i, x := range rows {
		if x.Name == r.Name {
			return i
		}
	}
	return -1
}

// build builds gorun and the Go worker into dir unless the job names them
// (the Go worker only for its kind).
func build(ctx context.Context, root, dir string, j *Job) error {
	for _, b := range []struct {
		path *string
		pkg  string
	}{{&j.Gorun, "./cmd/gorun"}, {&j.Worker, "./examples/allreduce"}} {
		if *b.path != "" || (b.path == &j.Worker && j.WorkerKind == workerTorch) {
			continue
		}
		*b.path = filepath.Join(dir, filepath.Base(b.pkg))
		cmd := exec.CommandContext(ctx, "go", "build", "-o", *b.path, b.pkg)
		cmd.Dir = root
		cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w\n%s", b.pkg, err, out)
		}
	}
	return nil
}

// torchAvailable reports whether python can import torch.
func torchAvailable(ctx context.Context, python string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return exec.CommandContext(ctx, python, "-c", "import torch").Run() == nil
}

// stageWorker returns the Go worker at a path in dir, copying it there
// unless it is there already: torchrun 2.14 starts its workers inside the
// sid bed, which sees the temporary directory at the same path and no
// other of the host's files. The worker is built static (CGO_ENABLED=0),
// so it runs on the bed's libraries as well as the host's.
func stageWorker(worker, dir string) (string, error) {
	abs, err := filepath.Abs(worker)
	if err != nil {
		return "", fmt.Errorf("stage the worker: %w", err)
	}
	if filepath.Dir(abs) == dir {
		return abs, nil
	}
	b, err := os.ReadFile(abs)
	if err != nil {
		return "", fmt.Errorf("stage the worker: %w", err)
	}
	staged := filepath.Join(dir, "staged-"+filepath.Base(abs))
	if err := os.WriteFile(staged, b, 0o755); err != nil {
		return "", fmt.Errorf("stage the worker: %w", err)
	}
	return staged, nil
}
