// Command allreduce is a Go worker for gorun (or torchrun): every rank joins
// a process group through the store the launcher serves and runs --steps
// allreduce steps, --step-ms apart, in which rank r contributes r+1 to every
// element. Each step's result is checked on every rank; at the end each rank
// prints
//
//	done rank=R world=W steps=S sum=X
//
// and exits 0 if every step's X was 1+2+…+W, 1 if a result was wrong or a
// collective failed, 2 for bad flags or a missing launcher environment
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each with one line on
// stderr.
//
//	go build -o bin/allreduce ./examples/allreduce
//	gorun --standalone --nproc-per-node 4 --no-python bin/allreduce --steps 50
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
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // a collective failed or a result was wrong
	exitUsage = 2
)

type options struct {
	steps   int
	stepGap time.Duration
	elems   int
	backend string
	timeout time.Duration
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("allreduce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var opt options
	var stepMs int
	fs.IntVar(&opt.steps, "steps", 100, "allreduce steps to run")
	fs.IntVar(&stepMs, "step-ms", 10, "pause between steps, in milliseconds")
	fs.IntVar(&opt.elems, "elems", 1024, "float64 elements per allreduce")
	fs.StringVar(&opt.backend, "backend", "cpu", "process group backend: cpu or nccl")
	fs.DurationVar(&opt.timeout, "timeout", 5*time.Minute, "bound on forming the group and on each step")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "allreduce: unexpected arguments %q\n", fs.Args())
		return exitUsage
	case opt.steps < 1 || stepMs < 0 || opt.elems < 1:
		fmt.Fprintln(stderr, "allreduce: --steps and --elems must be at least 1, --step-ms at least 0")
		return exitUsage
	}
	opt.stepGap = time.Duration(stepMs) * time.Millisecond
	be, ok := backends[opt.backend]
	if !ok {
		fmt.Fprintf(stderr, "allreduce: unknown --backend %q (want cpu or nccl)\n", opt.backend)
		return exitUsage
	}

	env, err := readEnv(os.Getenv)
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitUsage
	}
	// SIGTERM from the launcher ends the run between steps, not mid-write.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	res, err := train(ctx, env, be, opt)
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: rank %d: %v\n", env.rank, err)
		if errors.Is(err, errWrongSum) && res.steps > 0 {
			fmt.Fprintf(stdout, "done rank=%d world=%d steps=%d sum=%g\n", res.rank, res.world, res.steps, res.sum)
		}
		return exitFail
	}
	fmt.Fprintf(stdout, "done rank=%d world=%d steps=%d sum=%g\n", res.rank, res.world, res.steps, res.sum)
	return exitOK
}
