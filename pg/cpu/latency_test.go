package cpu_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// formGroups forms a group of size in-process; t's cleanup closes it.
func formGroups(t *testing.T, srv *tcpstore.Server, ns string, size int) []*cpu.Group {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	groups := make([]*cpu.Group, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		cfg := cpu.DefaultConfig()
		cfg.ListenAddr = "127.0.0.1:0"
		cfg.Bootstrap = pg.Bootstrap{Store: c, Namespace: ns, Rank: r, Size: size}
		wg.Go(func() { groups[r], errs[r] = cpu.New(ctx, cfg) })
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		g := groups[r]
		t.Cleanup(func() { g.Close() })
	}
	return groups
}

func startStore(t *testing.T) *tcpstore.Server {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

// blockAll starts an AllReduce on every rank but skip (which is absent, so
// they block) and returns a wait for their errors.
func blockAll(groups []*cpu.Group, skip int) func() []error {
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for r, g := range groups {
		if r == skip {
			continue
		}
		wg.Go(func() {
			buf := make([]float32, 1<<10)
			errs[r] = g.AllReduce(context.Background(), pg.Host(buf), pg.Sum)
		})
	}
	time.Sleep(30 * time.Millisecond)
	return func() []error { wg.Wait(); return errs }
}

// TestAbortLatency: from Abort to the return of an AllReduce blocked on an
// absent peer. The goal is 10 ms; the bound here is looser for
// loaded CI machines and -race.
func TestAbortLatency(t *testing.T) {
	srv := startStore(t)
	var took []time.Duration
	for i := range 5 {
		groups := formGroups(t, srv, fmt.Sprintf("abort%d", i), 4)
		wait := blockAll(groups, 0)
		reason := errors.New("latency test")
		start := time.Now()
		groups[1].Abort(reason)
		done := make(chan error, 1)
		go func() { done <- wait()[1] }()
		// Only rank 1's return is timed; the others follow.
		err := <-done
		took = append(took, time.Since(start))
		if !errors.Is(err, reason) {
			t.Fatalf("got %v", err)
		}
		for _, g := range groups {
			g.Abort(reason)
		}
	}
	slices.Sort(took)
	t.Logf("abort → blocked AllReduce returns: median %v (all %v)", took[len(took)/2], took)
	if took[len(took)/2] > 50*time.Millisecond {
		t.Errorf("median %v", took[len(took)/2])
	}
}

// TestShrinkLatency: 8 ranks blocked on rank 3; every survivor calls
// ShrinkAbort; time until the slowest has its new group, checked with an
// AllReduce. The goal is 50 ms.
func TestShrinkLatency(t *testing.T) {
	srv := startStore(t)
	var took []time.Duration
	for i := range 3 {
		groups := formGroups(t, srv, fmt.Sprintf("shrink%d", i), 8)
		wait := blockAll(groups, 3)
		start := time.Now()
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for r, g := range groups {
			if r == 3 {
				continue
			}
			wg.Go(func() {
				ng, err := g.Shrink(context.Background(), []int{3}, pg.ShrinkAbort)
				if err != nil {
					errs[r] = err
					return
				}
				t.Cleanup(func() { ng.Close() })
				buf := []float32{float32(r + 1)}
				if err := ng.AllReduce(context.Background(), pg.Host(buf), pg.Sum); err != nil {
					errs[r] = err
				} else if buf[0] != 32 {
					errs[r] = fmt.Errorf("sum %v, want 32", buf[0])
				}
			})
		}
		wg.Wait()
		took = append(took, time.Since(start))
		for r, err := range errs {
			if err != nil {
				t.Fatalf("rank %d: %v", r, err)
			}
		}
		for r, err := range wait() {
			if r != 3 && err == nil {
				t.Fatalf("rank %d: blocked AllReduce succeeded", r)
			}
		}
	}
	slices.Sort(took)
	t.Logf("ShrinkAbort 8→7 + first AllReduce: median %v (all %v)", took[len(took)/2], took)
	if took[len(took)/2] > 500*time.Millisecond {
		t.Errorf("median %v", took[len(took)/2])
	}
}

// TestFormingLeavesNoKeys: once a group is formed no rank needs another's
// address, and the store holds none of them — a job that forms a group per
// shrink or grow epoch must not leave a key per rank per epoch (issue 16).
// Shrink forms its group the same way.
func TestFormingLeavesNoKeys(t *testing.T) {
	for _, size := range []int{1, 2, 4} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			srv := startStore(t)
			groups := formGroups(t, srv, "leak", size)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if size > 1 {
				shrunk, err := shrinkAll(ctx, groups, []int{0})
				if err != nil {
					t.Fatal(err)
				}
				for _, g := range shrunk {
					t.Cleanup(func() { g.Close() })
				}
			}
			c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			keys, err := c.ListKeys(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(keys) != 0 {
				t.Errorf("after forming a group of %d (and shrinking it): keys %q, want none", size, keys)
			}
		})
	}
}

// shrinkAll shrinks every group but the excluded ranks' and returns the
// survivors' new groups.
func shrinkAll(ctx context.Context, groups []*cpu.Group, exclude []int) ([]pg.ProcessGroup, error) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		out  []pg.ProcessGroup
		errs []error
	)
	for r, g := range groups {
		if slices.Contains(exclude, r) {
			continue
		}
		wg.Go(func() {
			s, err := g.Shrink(ctx, exclude, pg.ShrinkAbort)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("rank %d: %w", r, err))
				return
			}
			out = append(out, s)
		})
	}
	wg.Wait()
	return out, errors.Join(errs...)
}
