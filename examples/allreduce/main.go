// Command allreduce is a Go worker for gorun (or torchrun): every rank joins
// a process group through the store the launcher serves and runs --steps
// allreduce steps, --step-ms apart, in which rank r contributes r+1 to every
// element.
//
//	go build -o bin/allreduce ./examples/allreduce
//	gorun --standalone --nproc-per-node 4 --no-python bin/allreduce --steps 50
//
// Once its group is formed a rank prints
//
//	start rank=R world=W backend=B shrink=true|false
//
// and every rank checks every step's result.
//
// Under gorun --on-failure shrink (the launcher sets GORUN_ON_FAILURE=shrink;
// --shrink forces the mode) the worker follows gorun's shrink epochs: when a
// collective fails because ranks died, it waits for the epoch that excludes
// them, shrinks its group to the survivors (renumbered densely, in launch
// order), prints
//
//	shrink epoch=E world=W excluded=[a b c]
//
// and redoes the step — the survivors agree on which, since a peer dying
// mid-collective can leave them a step apart. The original rank r keeps
// contributing r+1, so every survivor can check that the sum is over exactly
// the surviving ranks. A rank that has run every step waits until every
// survivor has, in case a peer lost in the last step makes them redo it. At
// the end each rank prints
//
//	done rank=R world=W steps=S sum=X
//
// with R and W the current group's. With --timestamps every rank also
// prints, after the first successful collective of each attempt and epoch,
//
//	first-collective attempt=A epoch=E unix_ns=T
//
// (A is TORCHELASTIC_RESTART_COUNT, T the wall clock in Unix nanoseconds),
// and, when it starts and when a new epoch stops its steps in epoch E,
//
//	started attempt=A unix_ns=T
//	stopped attempt=A epoch=E unix_ns=T
//
// and a newcomer, once its start-up is over and it asks to be grown in,
//
//	ready attempt=A unix_ns=T
//
// and a worker gorun pre-started (--spare-prestart), before it waits for
// its place (package prestart),
//
//	parked unix_ns=T
//
// With --progress every rank prints, after every step S (from 0),
//
//	progress attempt=A epoch=E step=S rank=R world=W unix_ns=T
//
// (R and W the group's rank and size; bench/chaos counts useful and redone
// rank-steps from them). With
// --checkpoint FILE the group's rank 0 records the steps done in FILE, and
// a group that forms (a start, a restart) resumes from there: a restart
// redoes only the steps since the last checkpoint. Every step sends gorun
// a heartbeat when it asks for them (--heartbeat-timeout), so that a hung
// rank is found.
//
// bench/ftbench measures recovery from these: the group working again, a
// newcomer's start and readiness, and how long a survivor did no step. `allreduce -h` lists the
// flags and the exit codes.
//
// The group is pg/cpu by default (host memory over TCP); --backend nccl uses
// pg/nccl (one GPU per local rank, device memory), which needs a build with
// cgo and a machine with NCCL.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/prestart"
	"github.com/gorunhq/gorun/shrink"
)

// Exit codes; usage explains them to users.
const (
	exitOK       = 0
	exitFail     = 1 // a collective failed, or a restart epoch: the launcher restarts
	exitUsage    = 2
	exitWrongSum = 3 // a step's sum was not the sum over the surviving ranks
	exitExcluded = 4 // shrink mode: alive, but an epoch excluded this rank
)

const usage = `Usage: allreduce [flags]

Run under gorun or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Every step allreduces a vector in which the rank launched as r
contributes r+1, and checks the sum. With GORUN_ON_FAILURE=shrink (gorun
--on-failure shrink) or --shrink the worker follows gorun's shrink epochs
and carries on without the ranks they exclude.

With --timestamps each rank prints, after the first successful collective
of each attempt (TORCHELASTIC_RESTART_COUNT) and shrink epoch,
  first-collective attempt=A epoch=E unix_ns=T
with T the wall clock in nanoseconds since the Unix epoch, so that a
benchmark can tell when the group was working again after a failure; and
  started attempt=A unix_ns=T            as the process starts
  ready attempt=A unix_ns=T              a newcomer, asking to be grown in
  stopped attempt=A epoch=E unix_ns=T    when a new epoch stops its steps
  parked unix_ns=T                       pre-started (gorun --spare-prestart,
                                         or a --respawn-standbys standby),
                                         waiting for its place

Exit codes:
  0  every step's sum was right (shrink mode: this rank survived to the end)
  1  a collective failed, or a shrink epoch asked for a restart: the
     launcher restarts the group
  2  bad flags or a missing launcher environment
  3  a step's sum was not the sum over the surviving ranks
  4  shrink mode: a shrink epoch excluded this rank while it was still alive
     (a hung rank that woke up); it stops as told, but did not finish its
     steps, so it is not a success — gorun already counts it as lost

Flags:
`

type options struct {
	steps   int
	stepGap time.Duration
	elems   int
	backend string
	timeout time.Duration
	// shrink: follow gorun's shrink epochs (GORUN_ON_FAILURE=shrink, or
	// --shrink).
	shrink bool
	// timestamps: print a first-collective line per attempt and epoch.
	timestamps bool
	// progress: every rank prints a progress line after every step
	// (bench/chaos counts useful and redone rank-steps from them).
	progress bool
	// checkpoint is a file where group rank 0 records the steps done,
	// every checkpointEvery steps, and that a rank that forms a group
	// (a start or a restart, not a newcomer) resumes from: a restarted
	// job redoes only the steps since the last checkpoint, as a training
	// job that checkpoints does. "": none, every attempt starts at step 0.
	checkpoint      string
	checkpointEvery int
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	began := time.Now()
	fs := flag.NewFlagSet("allreduce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	var opt options
	var stepMs int
	fs.IntVar(&opt.steps, "steps", 100, "allreduce steps to run")
	fs.IntVar(&stepMs, "step-ms", 10, "pause between steps, in milliseconds")
	fs.IntVar(&opt.elems, "elems", 1024, "float64 elements per allreduce")
	fs.StringVar(&opt.backend, "backend", "cpu", "process group backend: cpu or nccl")
	fs.DurationVar(&opt.timeout, "timeout", 5*time.Minute, "bound on forming the group, on each step and on waiting for a shrink epoch")
	fs.BoolVar(&opt.shrink, "shrink", false, "follow gorun's shrink epochs; default: on when GORUN_ON_FAILURE=shrink (--shrink=false turns it off)")
	fs.BoolVar(&opt.timestamps, "timestamps", false, "print 'first-collective attempt=A epoch=E unix_ns=T' after the first successful collective of each attempt and epoch")
	fs.BoolVar(&opt.progress, "progress", false, "print 'progress attempt=A epoch=E step=S rank=R world=W unix_ns=T' after every step (R, W: the group's rank and size)")
	fs.StringVar(&opt.checkpoint, "checkpoint", "", "file where the group's rank 0 records the steps done and that a (re)started group resumes from (default: none, every attempt starts at step 0)")
	fs.IntVar(&opt.checkpointEvery, "checkpoint-every", 1, "steps between checkpoints (with --checkpoint)")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "allreduce: unexpected arguments %q\n", fs.Args())
		return exitUsage
	case opt.steps < 1 || stepMs < 0 || opt.elems < 1 || opt.checkpointEvery < 1:
		fmt.Fprintln(stderr, "allreduce: --steps, --elems and --checkpoint-every must be at least 1, --step-ms at least 0")
		return exitUsage
	}
	opt.stepGap = time.Duration(stepMs) * time.Millisecond
	be, ok := backends[opt.backend]
	if !ok {
		fmt.Fprintf(stderr, "allreduce: unknown --backend %q (want cpu or nccl)\n", opt.backend)
		return exitUsage
	}

	// Pre-started (gorun --spare-prestart): wait for this worker's round,
	// which sets RANK, WORLD_SIZE and the rest.
	if _, parked := os.LookupEnv(prestart.EnvFD); parked && opt.timestamps {
		fmt.Fprintf(stdout, "parked unix_ns=%d\n", time.Now().UnixNano())
	}
	if _, err := prestart.Await(); err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitFail
	}
	env, err := readEnv(os.Getenv)
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitUsage
	}
	if !flagSet(fs, "shrink") {
		opt.shrink = env.onFailure == onFailureShrink
	}
	if opt.timestamps {
		fmt.Fprintf(stdout, "started attempt=%d unix_ns=%d\n", env.attempt, began.UnixNano())
	}
	// SIGTERM from the launcher ends the run between steps, not mid-write.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	res, err := train(ctx, env, be, opt, stdout)
	if err == nil {
		// What is left (the line, the exit) is no hang; a lost beat is the
		// agent's to judge. Not after a failure (a SIGTERM included): a
		// worker that says it is done counts as a success if its teardown
		// then has to be killed (--done-timeout).
		_ = health.Done()
	}
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: rank %d: %v\n", env.rank, err)
	}
	// A wrong sum still ends with the done line, so that it shows X.
	if err == nil || errors.Is(err, errWrongSum) && res.steps > 0 {
		fmt.Fprintln(stdout, doneLine(res))
	}
	return exitCode(err)
}

// doneLine is what a rank prints at the end.
func doneLine(r result) string {
	return fmt.Sprintf("done rank=%d world=%d steps=%d sum=%g", r.rank, r.world, r.steps, r.sum)
}

// firstCollectiveLine is what a rank prints with --timestamps after the
// first successful collective of an attempt and epoch, at time t.
func firstCollectiveLine(attempt, epoch int, t time.Time) string {
	return fmt.Sprintf("first-collective attempt=%d epoch=%d unix_ns=%d", attempt, epoch, t.UnixNano())
}

// exitCode maps train's outcome to the exit code.
func exitCode(err error) int {
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errWrongSum):
		return exitWrongSum
	case errors.Is(err, shrink.ErrExcluded):
		return exitExcluded
	}
	return exitFail // shrink.ErrRestart among them
}

// flagSet reports whether name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
