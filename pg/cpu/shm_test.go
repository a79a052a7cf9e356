package cpu_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestShmCleanup checks that shared-memory groups give back every
// descriptor and mapping: after Close, after Abort, and after a failure
// (a peer that left mid-collective) without any Close.
func TestShmCleanup(t *testing.T) {
	const size = 4
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv := startStore(t)
	stores := make([]*tcpstore.Client, size)
	for r := range stores {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		stores[r] = c
	}
	form := func(ns string) []*cpu.Group {
		t.Helper()
		groups := make([]*cpu.Group, size)
		errs := make([]error, size)
		var wg sync.WaitGroup
		for r := range size {
			cfg := cpu.DefaultConfig()
			cfg.ListenAddr = "127.0.0.1:0"
			cfg.LocalTransport = cpu.TransportShm
			cfg.ChunkBytes = 64 << 10
			cfg.Bootstrap = pg.Bootstrap{Store: stores[r], Namespace: ns, Rank: r, Size: size}
			wg.Go(func() { groups[r], errs[r] = cpu.New(ctx, cfg) })
		}
		wg.Wait()
		for r, err := range errs {
			if err != nil {
				t.Fatalf("rank %d: %v", r, err)
			}
		}
		return groups
	}
	allReduce := func(groups []*cpu.Group, skip int) []error {
		errs := make([]error, len(groups))
		var wg sync.WaitGroup
		for r, g := range groups {
			if r != skip {
				wg.Go(func() {
					buf := make([]float32, 1<<18) // 1 MiB: the ring, several slots
					for i := range buf {
						buf[i] = float32(r + 1)
					}
					errs[r] = g.AllReduce(ctx, pg.Host(buf), pg.Sum)
					if errs[r] == nil && (buf[0] != 10 || buf[len(buf)-1] != 10) {
						errs[r] = errors.New("wrong sum")
					}
				})
			}
		}
		wg.Wait()
		return errs
	}
	closeAll := func(groups []*cpu.Group) {
		for _, g := range groups {
			g.Close()
		}
	}
	fds0, maps0 := countFDs(t), countRings(t)
	settled := func(what string) {
		t.Helper()
		// Abort and failures release in the background; allow a moment.
		for end := time.Now().Add(2 * time.Second); countRings(t) != maps0 && time.Now().Before(end); {
			time.Sleep(5 * time.Millisecond)
		}
		if n := countRings(t); n != maps0 {
			t.Errorf("%s: %d ring mappings left", what, n-maps0)
		}
	}

	groups := form("close")
	if n := countRings(t) - maps0; n != size*(size-1)*2 {
		t.Errorf("%d ring mappings, want %d: shared memory not in use", n, size*(size-1)*2)
	}
	if n := countFDs(t) - fds0; n != size*(size-1)*3 {
		t.Errorf("%d descriptors, want %d: three sockets a pair, no more", n, size*(size-1)*3)
	}
	for r, err := range allReduce(groups, -1) {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	closeAll(groups)
	if n := countRings(t); n != maps0 {
		t.Errorf("after Close: %d ring mappings left", n-maps0)
	}

	groups = form("abort")
	allReduce(groups, -1)
	for _, g := range groups {
		g.Abort(errors.New("test"))
	}
	settled("after Abort")
	closeAll(groups)

	// Rank 0 leaves while the others wait for it: they fail on their own.
	groups = form("failure")
	done := make(chan []error)
	go func() { done <- allReduce(groups, 0) }()
	time.Sleep(20 * time.Millisecond)
	groups[0].Abort(errors.New("leaving"))
	for r, err := range <-done {
		if r != 0 && err == nil {
			t.Errorf("rank %d: AllReduce without rank 0 succeeded", r)
		}
	}
	settled("after a failure, before Close")
	closeAll(groups)

	if n := countFDs(t); n != fds0 {
		t.Errorf("%d descriptors leaked", n-fds0)
	}
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(ents)
}

// countRings counts this process's mappings of pg/cpu's memfds.
func countRings(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skip("no /proc/self/maps")
	}
	return strings.Count(string(b), "memfd:gorun-pgcpu")
}
