package shrink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// rankResult is what one simulated worker ends with.
type rankResult struct {
	epoch, world, steps int
	sum                 float64
	err                 error
}

// TestFollower runs four pg/cpu ranks, each a goroutine doing allreduce
// steps where global rank g contributes g+1. Rank 2 fails — its process
// dies (its group is closed), or it hangs (it stops calling collectives,
// its sockets stay open) — and the test, as the coordinator, publishes
// epoch 1 excluding it. The survivors must move to a group of three and
// end with the sum over the survivors, 1+2+4.
func TestFollower(t *testing.T) {
	for _, mode := range []string{"dies", "hangs"} {
		t.Run("rank 2 "+mode, func(t *testing.T) { testFollower(t, mode) })
	}
}

func testFollower(t *testing.T, mode string) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)

	const world, victim, steps = 4, 2, 60
	groups := formGroups(ctx, t, dial, world)
	var wg sync.WaitGroup

	results := make([]rankResult, world)
	victimAt := make(chan struct{})
	for g := range world {
		f := NewFollower(NewBoard(dial(), ""), NewBoard(dial(), ""), g, world, groups[g])
		wg.Go(func() {
			defer f.Close()
			results[g] = worker(ctx, f, g, steps, g == victim, mode, victimAt)
		})
	}
	<-victimAt
	coord := NewDecider("test", Config{SettleWindow: 20 * time.Millisecond}, Initial(world))
	coord.Report(time.Now(), Report{Ranks: []int{victim}, Reason: "rank 2 " + mode})
	time.Sleep(time.Until(coord.Due()))
	e, ok, err := coord.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	board := NewBoard(dial(), "")
	if _, won, err := board.Publish(ctx, e); err != nil || !won {
		t.Fatalf("Publish: %v %v", won, err)
	}
	wg.Wait()

	if mode == "hangs" && !errors.Is(results[victim].err, ErrExcluded) {
		t.Errorf("the hung rank's Recover: %v, want ErrExcluded", results[victim].err)
	}
	for g, r := range results {
		if g == victim {
			continue
		}
		if r.err != nil {
			t.Errorf("global rank %d: %v", g, r.err)
			continue
		}
		if r.epoch != 1 || r.world != 3 || r.steps != steps || r.sum != 1+2+4 {
			t.Errorf("global rank %d ended at epoch %d world %d after %d steps with sum %g; want epoch 1, world 3, %d steps, sum 7",
				g, r.epoch, r.world, r.steps, r.sum, steps)
		}
	}
	if n, err := board.Acks(ctx, 1); err != nil || n != 3 {
		t.Errorf("acks of epoch 1: %d %v, want 3", n, err)
	}
}

// worker runs steps allreduce steps, following epochs. The victim fails
// after a few steps, as mode says.
func worker(ctx context.Context, f *Follower, g, steps int, victim bool, mode string, victimAt chan<- struct{}) rankResult {
	buf := make([]float64, 256)
	res := rankResult{}
	for step := 0; step < steps; {
		if victim && step == 5 {
			close(victimAt)
			if mode == "dies" {
				f.Group().Close()
				return res
			}
			// Hung: it holds its sockets open and calls nothing, until
			// its own follower sees the epoch that excludes it.
			for !f.Pending() && ctx.Err() == nil {
				time.Sleep(5 * time.Millisecond)
			}
			_, _, err := f.Recover(ctx)
			return rankResult{err: err}
		}
		if f.Pending() {
			if _, _, err := f.Recover(ctx); err != nil {
				return rankResult{err: err}
			}
		}
		for i := range buf {
			buf[i] = float64(g + 1)
		}
		err := f.Group().AllReduce(ctx, pg.Host(buf), pg.Sum)
		if err != nil {
			if !errors.Is(err, pg.ErrPeerLost) && !errors.Is(err, pg.ErrAborted) {
				return rankResult{err: fmt.Errorf("step %d: %w", step, err)}
			}
			if _, _, err := f.Recover(ctx); err != nil {
				return rankResult{err: fmt.Errorf("recover at step %d: %w", step, err)}
			}
			continue // redo the step in the new group
		}
		e := f.Epoch()
		if err := checkStepSum(e, step, buf[0]); err != nil {
			return rankResult{err: err}
		}
		res = rankResult{epoch: e.Number, world: f.Group().Size(), steps: step + 1, sum: buf[0]}
		step++
		time.Sleep(2 * time.Millisecond)
	}
	f.Group().Close()
	return res
}

// TestFollowerRestartEpoch: below the floor the epoch says restart; the
// survivor's Recover returns ErrRestart and closes its group.
func TestFollowerRestartEpoch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	store := dial()
	g, err := cpu.New(ctx, cpu.Config{Bootstrap: pg.Bootstrap{Store: store, Namespace: "restart", Rank: 0, Size: 1}})
	if err != nil {
		t.Fatal(err)
	}
	// A world of 2 in the epochs' numbering; the group itself is a
	// stand-in of size 1, enough to see it closed.
	f := NewFollower(NewBoard(store, ""), NewBoard(dial(), ""), 0, 2, g)
	defer f.Close()
	d := NewDecider("test", Config{SettleWindow: -1, MinWorldSize: 2}, Initial(2))
	d.Report(time.Now(), Report{Ranks: []int{1}})
	e, _, err := d.Decide(time.Now())
	if err != nil || e.Action != ActionRestart {
		t.Fatalf("Decide: %v %v", e, err)
	}
	if _, _, err := NewBoard(dial(), "").Publish(ctx, e); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.Recover(ctx); !errors.Is(err, ErrRestart) {
		t.Fatalf("Recover = %v, want ErrRestart", err)
	}
	if err := g.Barrier(ctx); !errors.Is(err, pg.ErrClosed) {
		t.Errorf("group after a restart epoch: %v, want it closed", err)
	}
}

// storeDialer starts a TCPStore server for the test and returns a function
// that opens a new client connection to it.
func storeDialer(ctx context.Context, t *testing.T) func() *tcpstore.Client {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return func() *tcpstore.Client {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
}

// TestFollowerShrinkSuperseded: rank 2 dies and epoch 1 shrinks it away;
// rank 3 hangs the moment it sees epoch 1, so ranks 0 and 1 block in the
// shrink, forming the group of three without it. Epoch 2, excluding rank
// 3 (its agent found it hung), cuts that shrink short: ranks 0 and 1 move
// from the group they had to epoch 2's (ErrSuperseded, then Recover again)
// at once, not after the group's 20-s formation timeout, and finish with
// the sum 1+2.
func TestFollowerShrinkSuperseded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	const world, steps = 4, 40
	groups := formGroups(ctx, t, dial, world)
	board := NewBoard(dial(), "")
	d := NewDecider("test", Config{SettleWindow: time.Millisecond}, Initial(world))
	publish := func(g int, why string) Epoch {
		t.Helper()
		d.Report(time.Now(), Report{Ranks: []int{g}, Reason: why})
		time.Sleep(time.Until(d.Due()))
		e, ok, err := d.Decide(time.Now())
		if err != nil || !ok {
			t.Fatalf("Decide: %v %v", ok, err)
		}
		if _, won, err := board.Publish(ctx, e); err != nil || !won {
			t.Fatalf("Publish: %v %v", won, err)
		}
		d.Adopt(e)
		return e
	}
	var wg, survivors sync.WaitGroup
	survivors.Add(2)
	results := make([]rankResult, 2)
	superseded := make([]int, 2)
	hung := make(chan struct{})
	for g := range world {
		f := NewFollower(NewBoard(dial(), ""), NewBoard(dial(), ""), g, world, groups[g])
		wg.Go(func() {
			defer f.Close()
			switch g {
			case 2: // dies at once
				f.Group().Close()
			case 3: // hangs once epoch 1 is out, its sockets open
				for !f.Pending() && ctx.Err() == nil {
					time.Sleep(5 * time.Millisecond)
				}
				close(hung)
				<-ctx.Done()
			default:
				results[g], superseded[g] = survive(ctx, f, g, steps)
				survivors.Done()
			}
		})
	}
	publish(2, "died")
	<-hung
	time.Sleep(300 * time.Millisecond) // ranks 0 and 1 are in the shrink, waiting for 3
	start := time.Now()
	publish(3, "hung")
	done := make(chan struct{})
	go func() {
		survivors.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Errorf("the survivors did not finish within 10 s of epoch 2: the superseded shrink held them")
	}
	t.Logf("epoch 2 → survivors done: %v", time.Since(start).Round(time.Millisecond))
	cancel() // ends the hung rank, and survivors still held
	wg.Wait()
	for g, r := range results {
		if r.err != nil || r.epoch != 2 || r.world != 2 || r.steps != steps || r.sum != 1+2 {
			t.Errorf("global rank %d: %+v; want epoch 2, world 2, %d steps, sum 3", g, r, steps)
		}
		if superseded[g] != 1 {
			t.Errorf("global rank %d saw ErrSuperseded %d times, want once", g, superseded[g])
		}
	}
}

// survive runs steps allreduce steps, following epochs through shrinks
// cut short, and counts how often a shrink was superseded.
func survive(ctx context.Context, f *Follower, g, steps int) (rankResult, int) {
	buf := make([]float64, 64)
	superseded := 0
	var res rankResult
	for step := 0; step < steps; {
		for i := range buf {
			buf[i] = float64(g + 1)
		}
		if err := f.Group().AllReduce(ctx, pg.Host(buf), pg.Sum); err != nil {
			for {
				_, _, err = f.Recover(ctx)
				if !errors.Is(err, ErrSuperseded) {
					break
				}
				superseded++
			}
			if err != nil {
				return rankResult{err: fmt.Errorf("recover at step %d: %w", step, err)}, superseded
			}
			continue
		}
		e := f.Epoch()
		res = rankResult{epoch: e.Number, world: f.Group().Size(), steps: step + 1, sum: buf[0]}
		step++
	}
	f.Group().Close()
	return res, superseded
}
