package shrink

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
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestFollowerHeals runs heal end to end on real pg/cpu groups and a real
// store, an agent's Coordinator deciding: four ranks, each a goroutine doing
// allreduce steps where global rank g contributes g+1, so that the sum says
// who took part.
func TestFollowerHeals(t *testing.T) {
	tests := []struct {
		name string
		// newcomer: a worker for slot 2 enters once epoch 1 is out;
		// otherwise a Join for slot 2 is filed and nobody comes.
		newcomer bool
		// failDuringGrow: global rank 3 dies when it sees the grow, and
		// its failure is reported.
		failDuringGrow bool
		wantEpochs     []Action // every epoch, in order
		wantMembers    []int    // global ranks of the final group
	}{
		{name: "respawned rank grown back", newcomer: true,
			wantEpochs: []Action{ActionShrink, ActionGrow}, wantMembers: []int{0, 1, 2, 3}},
		{name: "a newcomer that never comes",
			wantEpochs: []Action{ActionShrink, ActionGrow, ActionShrink}, wantMembers: []int{0, 1, 3}},
		{name: "a failure during the grow", newcomer: true, failDuringGrow: true,
			wantEpochs: []Action{ActionShrink, ActionGrow, ActionShrink, ActionGrow}, wantMembers: []int{0, 1, 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			dial := storeDialer(ctx, t)
			const world = 4
			coord := agentSide(t, dial, CoordinatorConfig{
				Config: Config{SettleWindow: 20 * time.Millisecond, GrowTimeout: 400 * time.Millisecond},
				Name:   "a", World: world,
			})
			coord.Lead(ctx, true)
			report := func(g int, why string) {
				if err := coord.File(ctx, Report{Ranks: []int{g}, Reason: why}); err != nil {
					t.Error(err)
				}
			}

			// The last epoch the test expects: the workers stop once they
			// are in it and have done a few steps there.
			last := len(tt.wantEpochs)
			results := make([]healResult, world)
			var wg sync.WaitGroup
			groups := formGroups(ctx, t, dial, world)
			for g := range world {
				f := NewFollower(NewBoard(dial(), ""), NewBoard(dial(), ""), g, world, groups[g])
				w := &healWorker{f: f, global: g, last: last}
				switch g {
				case 2:
					w.dieAtStep = 5
					w.died = func() { report(2, "exit code 1") }
				case 3:
					if tt.failDuringGrow {
						w.dieOnGrow = true
						w.died = func() { report(3, "exit code 1") }
					}
				}
				wg.Go(func() {
					defer f.Close()
					results[g] = w.run(ctx)
				})
			}
			shrunk := nextEpoch(t, coord, 10*time.Second)
			var newcomer healResult
			if tt.newcomer {
				wg.Go(func() {
					n := Newcomer{Board: NewBoard(dial(), ""), Watch: NewBoard(dial(), ""), Slot: 2, After: shrunk.Number,
						Join: cpuJoin(dial())}
					f, g, e, err := n.Enter(ctx)
					if err != nil {
						newcomer.err = fmt.Errorf("enter: %w", err)
						return
					}
					defer f.Close()
					if g.Rank() != e.Ranks[2] {
						newcomer.err = fmt.Errorf("joined as rank %d, epoch %d says %d", g.Rank(), e.Number, e.Ranks[2])
						return
					}
					newcomer = (&healWorker{f: f, global: 2, last: last, newcomer: true}).run(ctx)
				})
			} else {
				if _, err := NewBoard(dial(), "").FileJoin(ctx, Join{Slots: []int{2}, From: "a respawn that dies at once"}); err != nil {
					t.Fatal(err)
				}
			}
			epochs := []Epoch{shrunk}
			for len(epochs) < last {
				epochs = append(epochs, nextEpoch(t, coord, 10*time.Second))
			}
			wg.Wait()

			for i, e := range epochs {
				if e.Action != tt.wantEpochs[i] {
					t.Errorf("epoch %d is a %s (%v), want a %s", e.Number, e.Action, e, tt.wantEpochs[i])
				}
			}
			final := epochs[len(epochs)-1]
			var members []int
			for g := range final.Ranks {
				if final.Alive(g) {
					members = append(members, g)
				}
			}
			if !slices.Equal(members, tt.wantMembers) {
				t.Fatalf("final epoch %v has %v, want %v", final, members, tt.wantMembers)
			}
			want := 0.0
			for _, g := range members {
				want += float64(g + 1)
			}
			if tt.newcomer {
				results[2] = newcomer
			}
			for _, g := range members {
				r := results[g]
				if r.err != nil || r.epoch != final.Number || r.world != len(members) || r.rank != final.Ranks[g] || r.sum != want {
					t.Errorf("global rank %d ended at epoch %d, rank %d of %d, sum %g (error %v); want epoch %d, rank %d of %d, sum %g",
						g, r.epoch, r.rank, r.world, r.sum, r.err, final.Number, final.Ranks[g], len(members), want)
				}
			}
			if final.Action == ActionGrow {
				if n, err := NewBoard(dial(), "").Acks(ctx, final.Number); err != nil || n != int64(final.WorldSize) {
					t.Errorf("acks of the grow: %d %v, want %d", n, err, final.WorldSize)
				}
			}
			select {
			case e := <-coord.Epochs():
				t.Errorf("an epoch after the last one: %v", e)
			case err := <-coord.Err():
				t.Errorf("agreement failed: %v", err)
			case <-time.After(600 * time.Millisecond): // past the grow timeout
			}
		})
	}
}

// formGroups forms a pg/cpu group of world ranks, each on its own store
// connection.
func formGroups(ctx context.Context, t *testing.T, dial func() *tcpstore.Client, world int) []pg.ProcessGroup {
	t.Helper()
	groups := make([]pg.ProcessGroup, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		store := dial()
		wg.Go(func() {
			cfg := cpu.DefaultConfig()
			cfg.ListenAddr = "127.0.0.1:0"
			cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "heal", Rank: r, Size: world, Timeout: 20 * time.Second}
			groups[r], errs[r] = cpu.New(ctx, cfg)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return groups
}

// cpuJoin is a newcomer's JoinFunc on pg/cpu, meeting the members on store.
func cpuJoin(store *tcpstore.Client) JoinFunc {
	return func(ctx context.Context, rank, size int, spec pg.GrowSpec) (pg.ProcessGroup, error) {
		cfg := cpu.DefaultConfig()
		cfg.ListenAddr = "127.0.0.1:0"
		cfg.Bootstrap = pg.Bootstrap{Store: store, Rank: rank, Size: size, Timeout: 20 * time.Second}
		return cpu.JoinGrow(ctx, cfg, spec)
	}
}

// healWorker runs allreduce steps on its follower's group, moving from
// epoch to epoch, until it has done a few steps in epoch last.
type healWorker struct {
	f         *Follower
	global    int
	last      int
	dieAtStep int    // > 0: at this step the worker's process dies
	dieOnGrow bool   // the worker dies when a grow epoch comes
	died      func() // its agent reports the death
	// newcomer: the worker joined a running group, whose members agree
	// on the step with it first.
	newcomer bool
}

type healResult struct {
	epoch, rank, world int
	sum                float64
	err                error
}

func (w *healWorker) run(ctx context.Context) healResult {
	buf := make([]float64, 64)
	inLast := 0
	step := 0
	if w.newcomer {
		if err := w.agree(ctx, w.f.Group(), &step); err != nil && w.recover(ctx, &step) != nil {
			return healResult{err: err}
		}
	}
	for inLast < 20 {
		if w.dieAtStep > 0 && step == w.dieAtStep {
			w.f.Group().Close()
			w.died()
			return healResult{}
		}
		if w.f.Pending() {
			if err := w.recover(ctx, &step); err != nil {
				return healResult{err: err}
			}
			continue
		}
		for i := range buf {
			buf[i] = float64(w.global + 1)
		}
		if err := w.f.Group().AllReduce(ctx, pg.Host(buf), pg.Sum); err != nil {
			if !errors.Is(err, pg.ErrPeerLost) && !errors.Is(err, pg.ErrAborted) {
				return healResult{err: fmt.Errorf("step %d: %w", step, err)}
			}
			if err := w.recover(ctx, &step); err != nil {
				return healResult{err: err}
			}
			continue
		}
		e := w.f.Epoch()
		if err := checkStepSum(e, step, buf[0]); err != nil {
			return healResult{err: err}
		}
		if e.Number == w.last {
			inLast++
		}
		step++
		time.Sleep(2 * time.Millisecond)
	}
	g, e := w.f.Group(), w.f.Epoch()
	defer g.Close()
	return healResult{epoch: e.Number, rank: g.Rank(), world: g.Size(), sum: buf[0]}
}

// recover moves to the next epoch (again, after a grow that did not
// complete) and agrees on the step with the others: the highest any of
// them reached, a newcomer's being 0.
func (w *healWorker) recover(ctx context.Context, step *int) error {
	for {
		if w.dieOnGrow {
			// The watcher may not have seen the epoch yet (a collective
			// failed because another rank's watcher aborted): ask.
			if e, ok, _ := w.f.board.Lookup(ctx, w.f.Epoch().Number+1); ok && e.Action == ActionGrow {
				w.f.Group().Close()
				w.died()
				return errDied
			}
		}
		g, _, err := w.f.Recover(ctx)
		if errors.Is(err, ErrGrowIncomplete) {
			continue
		}
		if err != nil {
			return err
		}
		err = w.agree(ctx, g, step)
		if errors.Is(err, pg.ErrPeerLost) || errors.Is(err, pg.ErrAborted) {
			continue
		}
		return err
	}
}

// agree sets step to the highest any rank of g reached: the first
// collective of every group.
func (w *healWorker) agree(ctx context.Context, g pg.ProcessGroup, step *int) error {
	agreed := []float64{float64(*step)}
	if err := g.AllReduce(ctx, pg.Host(agreed), pg.Max); err != nil {
		return err
	}
	*step = int(agreed[0])
	return nil
}

var errDied = errors.New("died (as the test wants)")

// checkStepSum checks a step's sum in epoch e: every rank alive in e
// contributed its global rank + 1.
func checkStepSum(e Epoch, step int, sum float64) error {
	want := 0.0
	for g := range e.Ranks {
		if e.Alive(g) {
			want += float64(g + 1)
		}
	}
	if sum != want {
		return fmt.Errorf("step %d epoch %d: sum %g, want %g", step, e.Number, sum, want)
	}
	return nil
}

// lateWatch is a store whose waits return a while after their keys exist:
// a Follower's watcher that sees an epoch later than its worker does.
type lateWatch struct {
	rendezvous.Store
	delay time.Duration
}

func (s lateWatch) Wait(ctx context.Context, keys ...string) error {
	if err := s.Store.Wait(ctx, keys...); err != nil {
		return err
	}
	select {
	case <-time.After(s.delay):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TestFollowerGrowSeenLateByWatcher: a member's collective can fail (a
// peer's watcher aborted first) before its own watcher has seen the grow
// epoch, so Recover finds the epoch itself and begins the grow; when the
// watcher then sees that same epoch, the grow must go on — only a later
// epoch ends it. The newcomer comes after the watchers have seen the epoch.
func TestFollowerGrowSeenLateByWatcher(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	const watchDelay = 100 * time.Millisecond
	lost := mustNext(t, Initial(3), 2) // slot 2 lost: members 0 and 1
	d := NewDecider("test", Config{SettleWindow: -1}, lost)
	d.Join(time.Now(), Join{Slots: []int{2}})
	grow, ok, err := d.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	board := NewBoard(dial(), "")
	for _, e := range []Epoch{lost, grow} {
		if _, _, err := board.Publish(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	groups := formGroups(ctx, t, dial, 2)
	for _, g := range groups {
		defer g.Close()
	}
	var wg sync.WaitGroup
	errs := make([]error, 3)
	sizes := make([]int, 3)
	for r, g := range groups {
		// Epoch 1 keeps both members (slot 2 was never launched here):
		// followers start from it.
		f := startFollower(NewBoard(dial(), ""), NewBoard(lateWatch{dial(), watchDelay}, ""), r, lost, g)
		wg.Go(func() {
			defer f.Close()
			ng, _, err := f.Recover(ctx)
			if err == nil {
				sizes[r] = ng.Size()
				ng.Close()
			}
			errs[r] = err
		})
	}
	wg.Go(func() {
		time.Sleep(3 * watchDelay) // after both watchers have seen the grow
		sizes[2], errs[2] = joinSlot2(ctx, dial, grow)
	})
	wg.Wait()
	checkGrownToThree(t, sizes, errs)
}

// joinSlot2 is the newcomer of slot 2 joining grow epoch e on pg/cpu, as
// rank 2 of 3; it returns the grown group's size.
func joinSlot2(ctx context.Context, dial func() *tcpstore.Client, e Epoch) (int, error) {
	g, err := cpuJoin(dial())(ctx, 2, 3, pg.GrowSpec{Added: 1, Namespace: Namespace(e.Number)})
	if err != nil {
		return 0, err
	}
	defer g.Close()
	return g.Size(), nil
}

// checkGrownToThree checks that every rank of a grow to 3 ended in a group
// of 3.
func checkGrownToThree(t *testing.T, sizes []int, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil || sizes[r] != 3 {
			t.Errorf("rank %d: grown group of %d, %v; want 3", r, sizes[r], err)
		}
	}
}

// TestFollowerGrowSupersededBeforeItBegins: the epoch after a grow (the
// shrink that ends a grow whose newcomer never came) reaches the watchers
// before their workers begin the grow. Recover must give the grow up at
// once — not wait in it for the newcomer until its context ends — and the
// next Recover moves the members to the epoch after.
func TestFollowerGrowSupersededBeforeItBegins(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	cfg := Config{SettleWindow: -1, GrowTimeout: time.Millisecond}
	lost := mustNext(t, Initial(3), 2) // slot 2 lost: members 0 and 1
	d := NewDecider("test", cfg, lost)
	d.Join(time.Now(), Join{Slots: []int{2}})
	grow, ok, err := d.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide the grow: %v %v", ok, err)
	}
	back, ok, err := NewDecider("test", cfg, grow).Decide(grow.DecidedAt.Add(cfg.GrowTimeout))
	if err != nil || !ok || back.Base != lost.Number {
		t.Fatalf("Decide the shrink after the grow: %v (base %d) %v %v", back, back.Base, ok, err)
	}
	groups := formGroups(ctx, t, dial, 2)
	followers := make([]*Follower, len(groups))
	for r, g := range groups {
		followers[r] = startFollower(NewBoard(dial(), ""), NewBoard(dial(), ""), r, lost, g)
		defer followers[r].Close()
	}
	board := NewBoard(dial(), "")
	for _, e := range []Epoch{grow, back} {
		if _, _, err := board.Publish(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(300 * time.Millisecond) // both watchers see both epochs
	var wg sync.WaitGroup
	for r, f := range followers {
		wg.Go(func() {
			start := time.Now()
			rctx, stop := context.WithTimeout(ctx, 20*time.Second)
			defer stop()
			g, e, err := f.Recover(rctx)
			if !errors.Is(err, ErrGrowIncomplete) || e.Number != grow.Number || g != groups[r] {
				t.Errorf("rank %d: Recover = epoch %d, %v; want the grow given up, in the group held", r, e.Number, err)
				return
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("rank %d: the superseded grow was given up after %v", r, took)
			}
			ng, e, err := f.Recover(rctx)
			if err != nil || e.Number != back.Number || ng.Size() != 2 {
				t.Errorf("rank %d: the next Recover = epoch %d, %v; want epoch %d's group of 2", r, e.Number, err, back.Number)
				return
			}
			ng.Close()
		})
	}
	wg.Wait()
}

// TestFollowerGrowOnAShrinkUnderWay: the grow that brings a respawned rank
// back can be out before the survivors have finished the shrink it builds
// on (a Go newcomer is ready in milliseconds; on a GPU the survivors' shrink
// waits for NCCL). The grow must not cut that shrink short: the survivors
// finish it, then grow. Seen on an H100 before the fix: both survivors gave
// the shrink up, then failed, lacking the group the grow builds on, and the
// job fell back to a restart.
func TestFollowerGrowOnAShrinkUnderWay(t *testing.T) {
	for _, tt := range []struct {
		name string
		// late: how long rank 1 waits before it begins the move, so that
		// rank 0 is in the shrink (waiting for rank 1) when the grow is
		// published; 0 publishes the grow before either begins.
		late time.Duration
	}{
		{"grow seen before the shrink begins", 0},
		{"grow seen during the shrink", 400 * time.Millisecond},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dial := storeDialer(ctx, t)
			initial := Initial(3)
			shrunk := mustNext(t, initial, 2)
			d := NewDecider("test", Config{SettleWindow: -1}, shrunk)
			d.Join(time.Now(), Join{Slots: []int{2}})
			grow, ok, err := d.Decide(time.Now())
			if err != nil || !ok || grow.Base != shrunk.Number {
				t.Fatalf("Decide: %v (base %d) %v %v", grow, grow.Base, ok, err)
			}
			board := NewBoard(dial(), "")
			groups := formGroups(ctx, t, dial, 3)
			groups[2].Close() // slot 2 died
			followers := make([]*Follower, 2)
			for r := range followers {
				followers[r] = startFollower(NewBoard(dial(), ""), NewBoard(dial(), ""), r, initial, groups[r])
				defer followers[r].Close()
			}
			if _, _, err := board.Publish(ctx, shrunk); err != nil {
				t.Fatal(err)
			}
			if tt.late == 0 {
				if _, _, err := board.Publish(ctx, grow); err != nil {
					t.Fatal(err)
				}
				time.Sleep(200 * time.Millisecond) // both watchers see both epochs
			}
			var wg sync.WaitGroup
			errs := make([]error, 3)
			sizes := make([]int, 3)
			for r, f := range followers {
				wg.Go(func() {
					if r == 1 {
						time.Sleep(tt.late)
					}
					g, e, err := f.Recover(ctx)
					if err != nil || e.Number != shrunk.Number || g.Size() != 2 {
						errs[r] = fmt.Errorf("the shrink: epoch %d, %v; want epoch %d's group of 2", e.Number, err, shrunk.Number)
						return
					}
					g, e, err = f.Recover(ctx)
					if err != nil || e.Number != grow.Number {
						errs[r] = fmt.Errorf("the grow: epoch %d, %v; want epoch %d", e.Number, err, grow.Number)
						return
					}
					sizes[r] = g.Size()
					g.Close()
				})
			}
			if tt.late > 0 {
				time.Sleep(tt.late / 4) // rank 0 is in the shrink, rank 1 not yet
				if _, _, err := board.Publish(ctx, grow); err != nil {
					t.Fatal(err)
				}
			}
			wg.Go(func() { sizes[2], errs[2] = joinSlot2(ctx, dial, grow) })
			wg.Wait()
			checkGrownToThree(t, sizes, errs)
		})
	}
}
