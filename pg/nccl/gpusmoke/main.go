// Command gpusmoke checks pg/nccl on a machine with a GPU and NCCL (`make
// gpu-smoke`): a world-1 communicator formed through an in-process TCPStore,
// an allreduce on device memory checked on the host, AsyncError none, a
// grow (see growCheck), Abort, and an operation after it failing as
// aborted. It prints one PASS or FAIL line and exits non-zero on FAIL; a
// run that hangs fails after a few minutes.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/nccl"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

func main() {
	cfg := nccl.DefaultConfig()
	flag.StringVar(&cfg.NCCLLibrary, "nccl", cfg.NCCLLibrary, "NCCL library to dlopen (name or path)")
	flag.StringVar(&cfg.CUDALibrary, "cuda", cfg.CUDALibrary, "CUDA driver library to dlopen")
	flag.IntVar(&cfg.Device, "device", 0, "CUDA device ordinal")
	flag.BoolVar(&cfg.NonBlocking, "nonblocking", false, "non-blocking communicator")
	n := flag.Int("n", 1<<20, "float32 elements to allreduce")
	probe := flag.Bool("probe", false, "only load NCCL and check it (no GPU needed)")
	growDevice := flag.Int("grow-device", -1, "CUDA device of the grow check's newcomer (default: -device's; NCCL refuses two ranks on one device, and the check then wants the grow refused and the group intact)")
	flag.Parse()
	if *probe {
		rep, err := nccl.Probe(cfg.NCCLLibrary)
		if err != nil {
			fmt.Printf("FAIL nccl probe: %v\n", err)
			os.Exit(1)
		}
		fmt.Println(rep)
		return
	}
	if *growDevice < 0 {
		*growDevice = cfg.Device
	}
	// Blocking NCCL calls cannot be interrupted: a hang ends the smoke.
	time.AfterFunc(5*time.Minute, func() {
		fmt.Println("FAIL gpu-smoke: still running after 5 minutes")
		os.Exit(1)
	})
	detail, err := smoke(cfg, *n, *growDevice)
	if err != nil {
		fmt.Printf("FAIL gpu-smoke: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("PASS gpu-smoke: %s\n", detail)
}

func smoke(cfg nccl.Config, n, growDevice int) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		return "", err
	}
	defer srv.Close()
	store, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
	if err != nil {
		return "", err
	}
	defer store.Close()
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "gpu-smoke", Rank: 0, Size: 1, Timeout: time.Minute}

	start := time.Now()
	g, err := nccl.New(ctx, cfg)
	if err != nil {
		return "", err
	}
	defer g.Close()
	initTime := time.Since(start)

	host := make([]float32, n)
	for i := range host {
		host[i] = float32(i%1000) + 0.5
	}
	buf, err := g.Upload(pg.Host(host))
	if err != nil {
		return "", err
	}
	defer buf.Free()
	start = time.Now()
	for _, op := range []pg.ReduceOp{pg.Sum, pg.Max, pg.Avg} {
		if err := g.AllReduce(ctx, buf, op); err != nil {
			return "", fmt.Errorf("allreduce %v: %w", op, err)
		}
	}
	opTime := time.Since(start) / 3
	if err := g.Barrier(ctx); err != nil {
		return "", fmt.Errorf("barrier: %w", err)
	}
	got := make([]float32, n)
	if err := buf.CopyToHost(pg.Host(got)); err != nil {
		return "", err
	}
	for i := range got {
		if got[i] != host[i] { // one rank: sum, max and avg are the identity
			return "", fmt.Errorf("element %d is %v after allreduce, want %v", i, got[i], host[i])
		}
	}
	if err := g.AsyncError(); err != nil {
		return "", fmt.Errorf("async error: %w", err)
	}
	grew, err := growCheck(ctx, g, cfg, srv.Addr().String(), growDevice)
	if err != nil {
		return "", fmt.Errorf("grow: %w", err)
	}
	g.Abort(errors.New("gpu-smoke done"))
	if err := g.AllReduce(ctx, buf, pg.Sum); !errors.Is(err, pg.ErrAborted) {
		return "", fmt.Errorf("allreduce after Abort: %v, want an error wrapping pg.ErrAborted", err)
	}
	if err := g.AsyncError(); err != nil {
		return "", fmt.Errorf("async error after Abort: %w", err)
	}
	return fmt.Sprintf("NCCL %v, device %d, init %v, allreduce of %d float32 %v, %s, abort ok, async error none",
		g.Version(), g.Device(), initTime.Round(time.Millisecond), n, opTime.Round(time.Microsecond), grew), nil
}

// growCheck grows the world-1 group g (pg.Grower): first by a newcomer
// that never comes, which must time out and leave g working; then by a
// newcomer in a goroutine of its own on device (a store client of its
// own, as a separate process would have). On two devices the grown group
// must allreduce across both ranks. On one device NCCL refuses two ranks
// (ncclInvalidUsage, "Duplicate GPU detected"): then the grow must fail
// with NCCL's error and g must still work.
func growCheck(ctx context.Context, g *nccl.Group, cfg nccl.Config, addr string, device int) (string, error) {
	short, cancel := context.WithTimeout(ctx, time.Second)
	_, err := g.Grow(short, pg.GrowSpec{Added: 1, Namespace: "gpu-smoke-grow-absent"})
	cancel()
	if !errors.Is(err, pg.ErrTimeout) {
		return "", fmt.Errorf("grow without its newcomer: %v, want an error wrapping pg.ErrTimeout", err)
	}
	if err := g.Barrier(ctx); err != nil {
		return "", fmt.Errorf("barrier after a grow that did not complete: %w", err)
	}

	store, err := tcpstore.Dial(ctx, addr, tcpstore.ClientConfig{})
	if err != nil {
		return "", err
	}
	defer store.Close()
	ncfg := cfg
	ncfg.Device = device
	ncfg.Bootstrap = pg.Bootstrap{Store: store, Rank: 1, Size: 2, Timeout: time.Minute}
	spec := pg.GrowSpec{Added: 1, Namespace: "gpu-smoke-grow"}
	type joined struct {
		g   *nccl.Group
		err error
	}
	newcomer := make(chan joined, 1)
	start := time.Now()
	go func() {
		ng, err := nccl.JoinGrow(ctx, ncfg, spec)
		newcomer <- joined{ng, err}
	}()
	grown, err := g.Grow(ctx, spec)
	j := <-newcomer
	growTime := time.Since(start)
	if grown != nil {
		defer grown.Close()
	}
	if j.g != nil {
		defer j.g.Close()
	}
	if err != nil || j.err != nil {
		var ne *nccl.Error
		if device != cfg.Device || !errors.As(err, &ne) {
			return "", fmt.Errorf("member: %v; newcomer on device %d: %v", err, device, j.err)
		}
		if err := g.Barrier(ctx); err != nil {
			return "", fmt.Errorf("barrier after a refused grow: %w", err)
		}
		return fmt.Sprintf("grow onto the same device refused by NCCL (%s), group intact", ne.Result), nil
	}
	if grown.Size() != 2 || grown.Rank() != 0 || j.g.Rank() != 1 {
		return "", fmt.Errorf("grown groups are rank %d and %d of %d", grown.Rank(), j.g.Rank(), grown.Size())
	}
	sums, err := allreduceOnes(ctx, []pg.ProcessGroup{grown, j.g})
	if err != nil {
		return "", err
	}
	for r, s := range sums {
		if s != 2 {
			return "", fmt.Errorf("rank %d of the grown group: allreduce of ones = %v, want 2", r, s)
		}
	}
	return fmt.Sprintf("grow 1→2 (devices %d, %d) %v", cfg.Device, device, growTime.Round(time.Millisecond)), nil
}

// allreduceOnes sums a one-element buffer of 1 over the ranks of groups
// (each a *nccl.Group, all at once) and returns each rank's result.
func allreduceOnes(ctx context.Context, groups []pg.ProcessGroup) ([]float32, error) {
	sums := make([]float32, len(groups))
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for r, pgr := range groups {
		wg.Go(func() {
			g := pgr.(*nccl.Group)
			buf, err := g.Upload(pg.Host([]float32{1}))
			if err != nil {
				errs[r] = err
				return
			}
			defer buf.Free()
			if err := g.AllReduce(ctx, buf, pg.Sum); err != nil {
				errs[r] = fmt.Errorf("rank %d: allreduce on the grown group: %w", r, err)
				return
			}
			out := make([]float32, 1)
			errs[r] = buf.CopyToHost(pg.Host(out))
			sums[r] = out[0]
		})
	}
	wg.Wait()
	return sums, errors.Join(errs...)
}
