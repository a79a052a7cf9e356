// Command gpusmoke checks pg/nccl on a machine with a GPU and NCCL (`make
// gpu-smoke`): a world-1 communicator formed through an in-process TCPStore,
// an allreduce on device memory checked on the host, AsyncError none, Abort,
// and an operation after it failing as aborted. It prints one PASS or FAIL
// line and exits non-zero on FAIL.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
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
	detail, err := smoke(cfg, *n)
	if err != nil {
		fmt.Printf("FAIL gpu-smoke: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("PASS gpu-smoke: %s\n", detail)
}

func smoke(cfg nccl.Config, n int) (string, error) {
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
	g.Abort(errors.New("gpu-smoke done"))
	if err := g.AllReduce(ctx, buf, pg.Sum); !errors.Is(err, pg.ErrAborted) {
		return "", fmt.Errorf("allreduce after Abort: %v, want an error wrapping pg.ErrAborted", err)
	}
	if err := g.AsyncError(); err != nil {
		return "", fmt.Errorf("async error after Abort: %w", err)
	}
	return fmt.Sprintf("NCCL %v, device %d, init %v, allreduce of %d float32 %v, abort ok, async error none",
		g.Version(), g.Device(), initTime.Round(time.Millisecond), n, opTime.Round(time.Microsecond)), nil
}
