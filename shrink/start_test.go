package shrink

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// cpuForm is a FormFunc on pg/cpu, meeting the other ranks on store, with
// a formation timeout far beyond what the tests allow themselves.
func cpuForm(store *tcpstore.Client) FormFunc {
	return func(ctx context.Context, rank, size int, namespace string) (pg.ProcessGroup, error) {
		if namespace == "" {
			namespace = "launched"
		}
		cfg := cpu.DefaultConfig()
		cfg.ListenAddr = "127.0.0.1:0"
		cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: namespace, Rank: rank, Size: size, Timeout: 30 * time.Second}
		g, err := cpu.New(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return g, nil
	}
}

// TestLaunchedMemberLostBeforeTheGroupForms: of four launched ranks, rank
// 2 never comes (it died in its start-up); the other three wait for it in
// the formation of epoch 0's group. The agents publish epoch 1 without
// it, and without rank 3 as well in one case, or a restart. The ranks
// must leave the formation at once, not at its 30-s timeout, and each
// follow the epoch: the members of epoch 1 form its group afresh and
// acknowledge it, an excluded rank gets ErrExcluded, a restart
// ErrRestart.
func TestLaunchedMemberLostBeforeTheGroupForms(t *testing.T) {
	cases := []struct {
		name     string
		excluded []int // beyond rank 2
		floor    int
		members  []int // the ranks that form epoch 1's group
		excl     []int // the ranks told ErrExcluded
		restart  bool
	}{
		{name: "shrink", members: []int{0, 1, 3}},
		{name: "shrink excluding a waiting rank too", excluded: []int{3}, members: []int{0, 1}, excl: []int{3}},
		{name: "below the floor", floor: 4, restart: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dial := storeDialer(ctx, t)
			const world = 4
			type result struct {
				f   *Follower
				g   pg.ProcessGroup
				e   Epoch
				err error
			}
			results := make([]result, world)
			var wg sync.WaitGroup
			for _, r := range []int{0, 1, 3} {
				store := dial()
				l := Launched{Board: NewBoard(store, ""), Watch: NewBoard(dial(), ""), GlobalRank: r, World: world, Form: cpuForm(store)}
				wg.Go(func() {
					f, g, e, err := l.Start(ctx)
					results[r] = result{f, g, e, err}
				})
			}
			time.Sleep(300 * time.Millisecond) // every one in the formation
			d := NewDecider("test", Config{SettleWindow: -1, MinWorldSize: tc.floor}, Initial(world))
			d.Report(time.Now(), Report{Ranks: append([]int{2}, tc.excluded...), Reason: "lost before the group formed"})
			e, ok, err := d.Decide(time.Now())
			if err != nil || !ok {
				t.Fatalf("Decide: %v %v", ok, err)
			}
			published := time.Now()
			if _, won, err := NewBoard(dial(), "").Publish(ctx, e); err != nil || !won {
				t.Fatalf("Publish: %v %v", won, err)
			}
			wg.Wait()
			if took := time.Since(published); took > 10*time.Second {
				t.Errorf("the ranks followed the epoch %v after it was published: they waited out the formation", took)
			}
			for _, r := range tc.excl {
				if !errors.Is(results[r].err, ErrExcluded) {
					t.Errorf("rank %d: %v, want ErrExcluded", r, results[r].err)
				}
			}
			if tc.restart {
				for _, r := range []int{0, 1, 3} {
					if !errors.Is(results[r].err, ErrRestart) {
						t.Errorf("rank %d: %v, want ErrRestart", r, results[r].err)
					}
				}
				return
			}
			// The members of epoch 1 work as its group: dense ranks, and
			// an allreduce of global rank + 1 over them.
			var sum float64
			for _, r := range tc.members {
				sum += float64(r + 1)
			}
			sums := make([]float64, world)
			for _, r := range tc.members {
				res := results[r]
				if res.err != nil {
					t.Fatalf("rank %d: %v", r, res.err)
				}
				defer res.f.Close()
				defer res.g.Close()
				if res.e.Number != 1 || res.g.Size() != len(tc.members) || res.g.Rank() != slices.Index(tc.members, r) {
					t.Errorf("rank %d: epoch %d, rank %d of %d; want epoch 1, rank %d of %d", r, res.e.Number,
						res.g.Rank(), res.g.Size(), slices.Index(tc.members, r), len(tc.members))
				}
				wg.Go(func() {
					buf := []float64{float64(r + 1)}
					if err := res.g.AllReduce(ctx, pg.Host(buf), pg.Sum); err != nil {
						t.Errorf("rank %d: allreduce in epoch 1's group: %v", r, err)
					}
					sums[r] = buf[0]
				})
			}
			wg.Wait()
			for _, r := range tc.members {
				if sums[r] != sum {
					t.Errorf("rank %d: sum %g, want %g", r, sums[r], sum)
				}
			}
			// Each acknowledged epoch 1, as Recover would have.
			if all, err := NewBoard(dial(), "").Arrived(ctx, e); err != nil || !all {
				t.Errorf("epoch 1 acknowledged by every member: %v %v", all, err)
			}
		})
	}
}

// TestLaunchedFormsEpochZero: with every rank there and no epoch, Start
// forms epoch 0's group, as launched, and follows from it.
func TestLaunchedFormsEpochZero(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	const world = 3
	var wg sync.WaitGroup
	for r := range world {
		store := dial()
		l := Launched{Board: NewBoard(store, ""), Watch: NewBoard(dial(), ""), GlobalRank: r, World: world, Form: cpuForm(store)}
		wg.Go(func() {
			f, g, e, err := l.Start(ctx)
			if err != nil {
				t.Errorf("rank %d: %v", r, err)
				return
			}
			defer f.Close()
			defer g.Close()
			if e.Number != 0 || g.Rank() != r || g.Size() != world || f.Epoch().Number != 0 {
				t.Errorf("rank %d: epoch %d, rank %d of %d", r, e.Number, g.Rank(), g.Size())
			}
			if err := g.Barrier(ctx); err != nil {
				t.Errorf("rank %d: barrier: %v", r, err)
			}
		})
	}
	wg.Wait()
}
