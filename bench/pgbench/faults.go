package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// faults measures abort and shrink latency in-process, reps times each,
// and returns the medians.
func faults(reps int) (abort, shrink time.Duration, err error) {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		return 0, 0, err
	}
	defer srv.Close()
	var aborts, shrinks []float64
	for i := range reps {
		d, err := abortOnce(srv, fmt.Sprintf("abort%d", i))
		if err != nil {
			return 0, 0, fmt.Errorf("abort: %w", err)
		}
		aborts = append(aborts, d.Seconds())
		if d, err = shrinkOnce(srv, fmt.Sprintf("shrink%d", i)); err != nil {
			return 0, 0, fmt.Errorf("shrink: %w", err)
		}
		shrinks = append(shrinks, d.Seconds())
	}
	sec := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	return sec(stats.Median(aborts)), sec(stats.Median(shrinks)), nil
}

func form(srv *tcpstore.Server, ns string, size int) ([]*cpu.Group, func(), error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	groups := make([]*cpu.Group, size)
	errs := make([]error, size)
	var clients []*tcpstore.Client
	var wg sync.WaitGroup
	for r := range size {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			return nil, nil, err
		}
		clients = append(clients, c)
		cfg := cpu.DefaultConfig()
		cfg.ListenAddr = "127.0.0.1:0"
		cfg.Bootstrap = pg.Bootstrap{Store: c, Namespace: ns, Rank: r, Size: size}
		wg.Go(func() { groups[r], errs[r] = cpu.New(ctx, cfg) })
	}
	wg.Wait()
	cleanup := func() {
		for _, g := range groups {
			if g != nil {
				g.Close()
			}
		}
		for _, c := range clients {
			c.Close()
		}
	}
	if err := errors.Join(errs...); err != nil {
		cleanup()
		return nil, nil, err
	}
	return groups, cleanup, nil
}

// blockAll starts an AllReduce on every rank but skip; the returned
// channel yields rank `watch`'s error.
func blockAll(groups []*cpu.Group, skip, watch int) (<-chan error, *sync.WaitGroup) {
	var wg sync.WaitGroup
	ch := make(chan error, 1)
	for r, g := range groups {
		if r == skip {
			continue
		}
		wg.Go(func() {
			buf := make([]float32, 1024)
			err := g.AllReduce(context.Background(), pg.Host(buf), pg.Sum)
			if r == watch {
				ch <- err
			}
		})
	}
	time.Sleep(50 * time.Millisecond)
	return ch, &wg
}

func abortOnce(srv *tcpstore.Server, ns string) (time.Duration, error) {
	groups, cleanup, err := form(srv, ns, 4)
	if err != nil {
		return 0, err
	}
	defer cleanup()
	ch, wg := blockAll(groups, 0, 1)
	reason := errors.New("bench")
	start := time.Now()
	groups[1].Abort(reason)
	err = <-ch
	took := time.Since(start)
	for _, g := range groups {
		g.Abort(reason)
	}
	wg.Wait()
	if !errors.Is(err, reason) {
		return 0, fmt.Errorf("blocked AllReduce returned %v", err)
	}
	return took, nil
}

func shrinkOnce(srv *tcpstore.Server, ns string) (time.Duration, error) {
	groups, cleanup, err := form(srv, ns, 8)
	if err != nil {
		return 0, err
	}
	defer cleanup()
	_, wg := blockAll(groups, 3, -1)
	start := time.Now()
	var swg sync.WaitGroup
	errs := make([]error, 8)
	news := make([]pg.ProcessGroup, 8)
	for r, g := range groups {
		if r == 3 {
			continue
		}
		swg.Go(func() { news[r], errs[r] = g.Shrink(context.Background(), []int{3}, pg.ShrinkAbort) })
	}
	swg.Wait()
	took := time.Since(start)
	wg.Wait()
	for _, g := range news {
		if g != nil {
			defer g.Close()
		}
	}
	return took, errors.Join(errs...)
}
