package launcher

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

const key = "gorun.job.restarts"

// restartCounter serves a TCPStore for the test and returns a client of
// it holding the job's restart counter at 0 under key.
func restartCounter(ctx context.Context, t *testing.T) *tcpstore.Client {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.Set(ctx, key, []byte("0")); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestRestartCountOfARound: a round's own failure, counted by a faster node
// before a slower one read the counter, is not in the slower node's count;
// earlier rounds' failures are. Plain counts (the counter as created, or
// as an older agent's ADD leaves it) read as they are.
func TestRestartCountOfARound(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := restartCounter(ctx, t)
	read := func(round int) int64 {
		t.Helper()
		v, err := c.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		n, err := restartsBefore(v, round)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := read(0); n != 0 {
		t.Fatalf("round 0 before any failure: %d restarts", n)
	}
	// Round 0 fails on a fast node before the slow one has read.
	if n, counted, err := countRestart(ctx, c, key, 0, "fast"); err != nil || n != 1 || !counted {
		t.Fatalf("counting round 0's failure: %d, %v, %v", n, counted, err)
	}
	// The slow node reports the same failure: counted already.
	if n, counted, err := countRestart(ctx, c, key, 0, "fast"); err != nil || n != 1 || counted {
		t.Fatalf("round 0's failure reported again: %d, counted %v, %v", n, counted, err)
	}
	if n := read(0); n != 0 {
		t.Fatalf("round 0 read after its own failure was counted: %d restarts, want 0", n)
	}
	if n := read(1); n != 1 {
		t.Fatalf("round 1: %d restarts, want 1", n)
	}
	if n, counted, err := countRestart(ctx, c, key, 3, "fast"); err != nil || n != 2 || !counted {
		t.Fatalf("counting round 3's failure: %d, %v, %v", n, counted, err)
	}
	// A node still in round 1 reports its failure after round 3's was
	// counted: round 1 ended before round 3 began, and was counted then.
	if n, counted, err := countRestart(ctx, c, key, 1, "slow"); err != nil || n != 2 || counted {
		t.Fatalf("round 1's failure reported after round 3's: %d, counted %v, %v", n, counted, err)
	}
	for round, want := range map[int]int64{3: 1, 4: 2} {
		if n := read(round); n != want {
			t.Fatalf("round %d: %d restarts, want %d", round, n, want)
		}
	}
	// An older agent's ADD turns the value back into a plain count.
	if n, err := c.Add(ctx, key, 1); err != nil || n != 3 {
		t.Fatalf("ADD on the counter: %d, %v", n, err)
	}
	if n := read(4); n != 3 {
		t.Fatalf("round 4 after a plain ADD: %d restarts, want 3", n)
	}
	if _, _, err := parseRestarts([]byte("2 x")); err == nil {
		t.Fatal(`"2 x" parsed`)
	}
	if n, round, err := parseRestarts([]byte("2 7 10.0.0.1_42_0")); err != nil || n != 2 || round != 7 {
		t.Fatalf(`"2 7 10.0.0.1_42_0": %d, %d, %v`, n, round, err)
	}
}

// TestRestartCountedOnce: every node of a round reports its failure at
// once; the job's counter goes up by one, one node says it counted it, and
// nothing per round is left in the store (the nodes used to mark the
// round's failure with a key of their own for good).
func TestRestartCountedOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := restartCounter(ctx, t)
	for round := range 5 {
		var wg sync.WaitGroup
		var counted atomic.Int32
		for node := range 8 {
			wg.Go(func() {
				n, ok, err := countRestart(ctx, c, key, round, fmt.Sprint("node", node))
				if err != nil || n != int64(round+1) {
					t.Errorf("round %d: count %d, %v", round, n, err)
				}
				if ok {
					counted.Add(1)
				}
			})
		}
		wg.Wait()
		if counted.Load() != 1 {
			t.Errorf("round %d: %d nodes counted its failure", round, counted.Load())
		}
	}
	if n, err := c.NumKeys(ctx); err != nil || n != 1 {
		t.Errorf("%d keys in the store (%v), want the counter alone", n, err)
	}
}
