package pgtest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
)

// sumOnAll checks that an AllReduce of contrib(r) works on every rank and
// returns the sum.
func (h *harness) sumOnAll(t *testing.T, groups []pg.ProcessGroup, contrib func(r int) float64) float64 {
	t.Helper()
	d := h.f.Caps.DTypes[0]
	sums := make([]float64, len(groups))
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		b, err := h.upload(d, []float64{contrib(r), contrib(r)})
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(b)
		if err := g.AllReduce(ctx, b, pg.Sum); err != nil {
			return err
		}
		got, _, err := h.download(d, 2, b)
		sums[r] = got[0]
		return err
	})
	for r, s := range sums {
		if s != sums[0] {
			t.Fatalf("rank %d's sum is %v, rank 0's %v", r, s, sums[0])
		}
	}
	return sums[0]
}

func (h *harness) invalidArguments(t *testing.T) {
	size := min(3, h.f.Caps.MaxSize)
	if size < 2 {
		t.Skip("needs 2 ranks")
	}
	groups := h.form(t, size)
	d := h.f.Caps.DTypes[0]
	buf := func(n int) pg.Buffer {
		b, err := h.upload(d, make([]float64, n))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.f.Memory.Free(b) })
		return b
	}
	other := pg.Int64
	if d == pg.Int64 {
		other = pg.Int32
	}
	mismatched, err := h.upload(other, make([]float64, 2*size))
	if err != nil {
		t.Fatal(err)
	}
	defer h.f.Memory.Free(mismatched)
	cases := []struct {
		name string
		call func(ctx context.Context, g pg.ProcessGroup) error
	}{
		{"allgather/short output", func(ctx context.Context, g pg.ProcessGroup) error { return g.AllGather(ctx, buf(2*size-1), buf(2)) }},
		{"allgather/long output", func(ctx context.Context, g pg.ProcessGroup) error { return g.AllGather(ctx, buf(2*size+1), buf(2)) }},
		{"allgather/dtype mismatch", func(ctx context.Context, g pg.ProcessGroup) error { return g.AllGather(ctx, mismatched, buf(2)) }},
		{"reducescatter/short input", func(ctx context.Context, g pg.ProcessGroup) error {
			return g.ReduceScatter(ctx, buf(2), buf(2*size-1), pg.Sum)
		}},
		{"reducescatter/dtype mismatch", func(ctx context.Context, g pg.ProcessGroup) error {
			return g.ReduceScatter(ctx, buf(2), mismatched, pg.Sum)
		}},
		{"allreduce/bad op", func(ctx context.Context, g pg.ProcessGroup) error { return g.AllReduce(ctx, buf(2), pg.ReduceOp(42)) }},
		{"reducescatter/bad op", func(ctx context.Context, g pg.ProcessGroup) error {
			return g.ReduceScatter(ctx, buf(2), buf(2*size), pg.ReduceOp(-1))
		}},
		{"broadcast/root -1", func(ctx context.Context, g pg.ProcessGroup) error { return g.Broadcast(ctx, buf(2), -1) }},
		{"broadcast/root size", func(ctx context.Context, g pg.ProcessGroup) error { return g.Broadcast(ctx, buf(2), size) }},
		{"send/peer -1", func(ctx context.Context, g pg.ProcessGroup) error { return g.Send(ctx, buf(2), -1) }},
		{"send/peer size", func(ctx context.Context, g pg.ProcessGroup) error { return g.Send(ctx, buf(2), size) }},
		{"send/self", func(ctx context.Context, g pg.ProcessGroup) error { return g.Send(ctx, buf(2), g.Rank()) }},
		{"recv/peer -1", func(ctx context.Context, g pg.ProcessGroup) error { return g.Recv(ctx, buf(2), -1) }},
		{"recv/peer size", func(ctx context.Context, g pg.ProcessGroup) error { return g.Recv(ctx, buf(2), size) }},
		{"recv/self", func(ctx context.Context, g pg.ProcessGroup) error { return g.Recv(ctx, buf(2), g.Rank()) }},
	}
	for _, u := range h.f.Caps.Unsupported {
		cases = append(cases, struct {
			name string
			call func(ctx context.Context, g pg.ProcessGroup) error
		}{"allreduce/" + u.String(), func(ctx context.Context, g pg.ProcessGroup) error {
			hb, err := pg.HostBytes(u, make([]byte, 4*u.Size()))
			if err != nil {
				return err
			}
			b, err := h.f.Memory.Buffer(hb)
			if err != nil {
				return fmt.Errorf("%w (from Memory.Buffer)", err)
			}
			defer h.f.Memory.Free(b)
			return g.AllReduce(ctx, b, pg.Sum)
		}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// Only rank 0 calls: the check must be local, before any
			// communication.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err := c.call(ctx, groups[0])
			if !errors.Is(err, pg.ErrInvalidArgument) {
				t.Fatalf("got %v, want an error wrapping pg.ErrInvalidArgument", err)
			}
			t.Log(err)
		})
	}
	// The group is still whole.
	if got, want := h.sumOnAll(t, groups, func(r int) float64 { return float64(r + 1) }), float64(size*(size+1)/2); got != want {
		t.Fatalf("sum after the invalid calls = %v, want %v", got, want)
	}
}

// blockedAllReduce starts an AllReduce on every rank in ranks, which block
// because some rank of the group is not in it; the channel yields each
// one's error and how long after `since` was last set it returned.
type blocked struct {
	wg    sync.WaitGroup
	mu    sync.Mutex
	errs  map[int]error
	at    map[int]time.Time
	start time.Time
}

func (h *harness) blockedAllReduce(t *testing.T, groups []pg.ProcessGroup, ranks []int, ctx context.Context) *blocked {
	t.Helper()
	d := h.f.Caps.DTypes[0]
	bl := &blocked{errs: map[int]error{}, at: map[int]time.Time{}, start: time.Now()}
	for _, r := range ranks {
		b, err := h.upload(d, make([]float64, 1024))
		if err != nil {
			t.Fatal(err)
		}
		bl.wg.Go(func() {
			defer h.f.Memory.Free(b)
			err := groups[r].AllReduce(ctx, b, pg.Sum)
			bl.mu.Lock()
			bl.errs[r], bl.at[r] = err, time.Now()
			bl.mu.Unlock()
		})
	}
	time.Sleep(50 * time.Millisecond) // let them block
	bl.mu.Lock()
	defer bl.mu.Unlock()
	for r, err := range bl.errs {
		t.Fatalf("rank %d's AllReduce returned before it could have: %v", r, err)
	}
	return bl
}

// wait waits (bounded) for every blocked AllReduce to return.
func (bl *blocked) wait(t *testing.T, bound time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { bl.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(bound):
		t.Fatalf("blocked collectives still blocked %v later", bound)
	}
}

func (h *harness) abort(t *testing.T) {
	size := min(4, h.f.Caps.MaxSize)
	if size < 2 {
		t.Skip("needs 2 ranks")
	}
	groups := h.form(t, size)
	reason := errors.New("pgtest: abort reason")
	victim := 1
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	ranks := make([]int, 0, size)
	for r := 1; r < size; r++ {
		ranks = append(ranks, r)
	}
	bl := h.blockedAllReduce(t, groups, ranks, ctx)
	at := time.Now()
	groups[victim].Abort(reason)
	bl.wg.Wait()
	err, took := bl.errs[victim], bl.at[victim].Sub(at)
	t.Logf("blocked AllReduce returned %v after Abort: %v", took, err)
	if !errors.Is(err, pg.ErrAborted) || !errors.Is(err, reason) {
		t.Fatalf("blocked AllReduce after Abort: %v, want an error wrapping pg.ErrAborted and the reason", err)
	}
	if took > h.f.Caps.AbortBound {
		t.Fatalf("blocked AllReduce took %v to return after Abort, want at most %v", took, h.f.Caps.AbortBound)
	}
	if err := groups[victim].AsyncError(); err != nil {
		t.Errorf("AsyncError after the caller's Abort = %v, want nil", err)
	}
	// Idempotent: the first reason stays; later operations fail at once.
	groups[victim].Abort(errors.New("pgtest: second reason"))
	for name, err := range h.laterOps(t, groups[victim], ctx, h.f.Caps.AbortBound) {
		if !errors.Is(err, pg.ErrAborted) || !errors.Is(err, reason) || strings.Contains(fmt.Sprint(err), "second reason") {
			t.Errorf("%s after Abort: %v, want an error wrapping pg.ErrAborted and the first reason", name, err)
		}
	}
	for _, g := range groups {
		g.Abort(reason)
	}
	bl.wait(t, 5*time.Second)
}

func (h *harness) peerLost(t *testing.T) {
	size := min(4, h.f.Caps.MaxSize)
	if size < 3 {
		t.Skip("needs 3 ranks")
	}
	victim := size / 2
	for _, how := range []string{"close", "abort"} {
		t.Run(how, func(t *testing.T) {
			groups := h.form(t, size)
			ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
			defer cancel()
			var others []int
			for r := range size {
				if r != victim {
					others = append(others, r)
				}
			}
			bl := h.blockedAllReduce(t, groups, others, ctx)
			at := time.Now()
			if how == "close" {
				groups[victim].Close()
			} else {
				groups[victim].Abort(errors.New("pgtest: the victim gives up"))
			}
			bl.wait(t, 10*time.Second)
			for _, r := range others {
				err, took := bl.errs[r], bl.at[r].Sub(at)
				t.Logf("rank %d: AllReduce returned %v after rank %d's %s: %v", r, took, victim, how, err)
				checkPeerError(t, fmt.Sprintf("rank %d's AllReduce", r), err, victim)
				if took > h.f.Caps.AbortBound {
					t.Errorf("rank %d: AllReduce took %v to fail, want at most %v", r, took, h.f.Caps.AbortBound)
				}
				checkPeerError(t, fmt.Sprintf("rank %d's AsyncError", r), groups[r].AsyncError(), victim)
				// Later operations fail at once.
				start := time.Now()
				err = groups[r].Barrier(ctx)
				if err == nil || time.Since(start) > h.f.Caps.AbortBound {
					t.Errorf("rank %d: Barrier after the loss: %v after %v, want an error at once", r, err, time.Since(start))
				}
			}
		})
	}
}

func checkPeerError(t *testing.T, what string, err error, rank int) {
	t.Helper()
	var pe *pg.PeerError
	switch {
	case !errors.Is(err, pg.ErrPeerLost):
		t.Errorf("%s: %v, want an error wrapping pg.ErrPeerLost", what, err)
	case !errors.As(err, &pe):
		t.Errorf("%s: %v, want a *pg.PeerError", what, err)
	case pe.Rank != rank:
		t.Errorf("%s: %v names rank %d, want rank %d", what, err, pe.Rank, rank)
	}
}

func (h *harness) timeout(t *testing.T) {
	size := min(3, h.f.Caps.MaxSize)
	if size < 2 {
		t.Skip("needs 2 ranks")
	}
	groups := h.form(t, size)
	const limit = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	// Rank 1 alone enters: nobody joins it.
	bl := h.blockedAllReduce(t, groups, []int{1}, ctx)
	bl.wait(t, 10*time.Second)
	err, took := bl.errs[1], bl.at[1].Sub(bl.start)
	t.Logf("AllReduce with a %v deadline returned after %v: %v", limit, took, err)
	if !errors.Is(err, pg.ErrTimeout) {
		t.Fatalf("got %v, want an error wrapping pg.ErrTimeout", err)
	}
	if took < limit || took > limit+h.f.Caps.AbortBound+time.Second {
		t.Errorf("took %v for a %v deadline", took, limit)
	}
}

func (h *harness) close(t *testing.T) {
	size := min(2, h.f.Caps.MaxSize)
	groups := h.form(t, size)
	g := groups[0]
	if err := g.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := g.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for name, err := range h.laterOps(t, g, context.Background(), h.f.Caps.AbortBound) {
		if !errors.Is(err, pg.ErrClosed) {
			t.Errorf("%s after Close: %v, want an error wrapping pg.ErrClosed", name, err)
		}
	}
}

// laterOps calls every operation once on g, which can no longer run any,
// and returns their errors by name; each must return within bound.
func (h *harness) laterOps(t *testing.T, g pg.ProcessGroup, ctx context.Context, bound time.Duration) map[string]error {
	t.Helper()
	b, err := h.upload(h.f.Caps.DTypes[0], []float64{1})
	if err != nil {
		t.Fatal(err)
	}
	defer h.f.Memory.Free(b)
	peer := (g.Rank() + 1) % g.Size()
	errs := map[string]error{}
	for name, call := range map[string]func() error{
		"allreduce": func() error { return g.AllReduce(ctx, b, pg.Sum) },
		"broadcast": func() error { return g.Broadcast(ctx, b, 0) },
		"barrier":   func() error { return g.Barrier(ctx) },
		"send":      func() error { return g.Send(ctx, b, peer) },
		"recv":      func() error { return g.Recv(ctx, b, peer) },
	} {
		start := time.Now()
		errs[name] = call()
		if took := time.Since(start); took > bound {
			t.Errorf("%s took %v on a group that cannot run it", name, took)
		}
	}
	return errs
}

func (h *harness) shrinkValidation(t *testing.T) {
	size := min(4, h.f.Caps.MaxSize)
	if size < 2 {
		t.Skip("needs 2 ranks")
	}
	groups := h.form(t, size)
	cases := []struct {
		name    string
		exclude []int
		flags   pg.ShrinkFlags
	}{
		{"empty", nil, pg.ShrinkDefault},
		{"bad flags", []int{1}, pg.ShrinkFlags(7)},
		{"out of range", []int{size}, pg.ShrinkDefault},
		{"negative", []int{-1}, pg.ShrinkAbort},
		{"duplicate", []int{1, 1}, pg.ShrinkDefault},
		{"everyone", slices.Collect(func(yield func(int) bool) {
			for r := range size {
				if !yield(r) {
					return
				}
			}
		}), pg.ShrinkDefault},
		{"the caller", []int{0}, pg.ShrinkAbort},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := pg.ValidateShrink(0, size, c.exclude, c.flags)
			if want == nil {
				t.Fatalf("pg.ValidateShrink accepts %v", c.exclude)
			}
			ng, err := groups[0].Shrink(ctx, c.exclude, c.flags)
			if ng != nil {
				ng.Close()
			}
			if !errors.Is(err, pg.ErrInvalidArgument) || !strings.Contains(fmt.Sprint(err), want.Error()) {
				t.Fatalf("Shrink(%v, %v) = %v, want an error wrapping pg.ErrInvalidArgument with %q", c.exclude, c.flags, err, want)
			}
		})
	}
	t.Run("size 1", func(t *testing.T) {
		one := h.form(t, 1)
		_, err := one[0].Shrink(ctx, []int{0}, pg.ShrinkDefault)
		want := pg.ValidateShrink(0, 1, []int{0}, pg.ShrinkDefault)
		if !errors.Is(err, pg.ErrInvalidArgument) || !strings.Contains(fmt.Sprint(err), want.Error()) {
			t.Fatalf("Shrink on a group of 1 = %v, want %q", err, want)
		}
	})
	// Nothing happened: the group still works.
	if got, want := h.sumOnAll(t, groups, func(r int) float64 { return float64(r + 1) }), float64(size*(size+1)/2); got != want {
		t.Fatalf("sum after the refused shrinks = %v, want %v", got, want)
	}
}

// shrinkAll shrinks the groups of the survivors (original ranks in orig,
// parallel to groups) without the ranks exclude, checks the renumbering
// and returns the new groups (in new rank order) and the slowest rank's
// time.
func (h *harness) shrinkAll(t *testing.T, groups []pg.ProcessGroup, exclude []int, flags pg.ShrinkFlags) ([]pg.ProcessGroup, time.Duration) {
	t.Helper()
	newRank := pg.Survivors(len(groups), exclude)
	var survivors []pg.ProcessGroup
	for r, g := range groups {
		if newRank[r] >= 0 {
			survivors = append(survivors, g)
		}
	}
	out := make([]pg.ProcessGroup, len(survivors))
	took := make([]time.Duration, len(survivors))
	onAll(t, survivors, func(ctx context.Context, _ int, g pg.ProcessGroup) error {
		start := time.Now()
		ng, err := g.Shrink(ctx, exclude, flags)
		if err != nil {
			return err
		}
		want := newRank[g.Rank()]
		took[want] = time.Since(start)
		t.Cleanup(func() { ng.Close() })
		if ng.Rank() != want || ng.Size() != len(survivors) {
			return fmt.Errorf("rank %d became rank %d of %d, want %d of %d", g.Rank(), ng.Rank(), ng.Size(), want, len(survivors))
		}
		out[want] = ng
		return nil
	})
	return out, slices.Max(took)
}

// checkSurvivors checks sums and gather order on a shrunk group whose
// ranks were originally orig.
func (h *harness) checkSurvivors(t *testing.T, groups []pg.ProcessGroup, orig []int) {
	t.Helper()
	want := 0.0
	for _, o := range orig {
		want += float64(o + 1)
	}
	if got := h.sumOnAll(t, groups, func(r int) float64 { return float64(orig[r] + 1) }); got != want {
		t.Fatalf("sum over survivors %v = %v, want %v", orig, got, want)
	}
	d := h.f.Caps.DTypes[0]
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		in, err := h.upload(d, []float64{float64(orig[r])})
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(in)
		out, err := h.upload(d, make([]float64, len(groups)))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(out)
		if err := g.AllGather(ctx, out, in); err != nil {
			return err
		}
		got, _, err := h.download(d, len(groups), out)
		if err != nil {
			return err
		}
		wantOrder := make([]float64, len(orig))
		for i, o := range orig {
			wantOrder[i] = float64(o)
		}
		return checkEqual("original ranks gathered in new rank order", got, wantOrder)
	})
}

func (h *harness) shrink(t *testing.T) {
	if h.f.Caps.MaxSize < 8 {
		t.Skip("needs 8 ranks")
	}
	groups := h.form(t, 8)
	h.checkSurvivors(t, groups, []int{0, 1, 2, 3, 4, 5, 6, 7})
	// 8 → 7 without rank 3; rank 3 stays idle until the others are done.
	seven, took := h.shrinkAll(t, groups, []int{3}, pg.ShrinkDefault)
	t.Logf("shrink 8→7: %v (slowest rank)", took)
	groups[3].Close()
	h.checkSurvivors(t, seven, []int{0, 1, 2, 4, 5, 6, 7})
	// 7 → 5 without new ranks 4 and 2 (originally 5 and 2), given in
	// reverse order: the list is a set.
	for _, r := range []int{2, 4} {
		seven[r].Close()
	}
	five, took := h.shrinkAll(t, seven, []int{4, 2}, pg.ShrinkAbort)
	t.Logf("shrink 7→5 (abort, excluded ranks closed): %v (slowest rank)", took)
	h.checkSurvivors(t, five, []int{0, 1, 4, 6, 7})
}

func (h *harness) shrinkAbortWhileBlocked(t *testing.T) {
	if h.f.Caps.MaxSize < 8 {
		t.Skip("needs 8 ranks")
	}
	groups := h.form(t, 8)
	const dead = 3
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var others []int
	for r := range 8 {
		if r != dead {
			others = append(others, r)
		}
	}
	// Every rank but the dead one blocks in an AllReduce waiting for it.
	bl := h.blockedAllReduce(t, groups, others, ctx)
	at := time.Now()
	seven, took := h.shrinkAll(t, groups, []int{dead}, pg.ShrinkAbort)
	bl.wait(t, 10*time.Second)
	t.Logf("ShrinkAbort 8→7 while blocked: %v (slowest rank)", took)
	for _, r := range others {
		err := bl.errs[r]
		if !errors.Is(err, pg.ErrAborted) && !errors.Is(err, pg.ErrPeerLost) {
			t.Errorf("rank %d's blocked AllReduce: %v, want an error wrapping pg.ErrAborted or pg.ErrPeerLost", r, err)
		}
		if d := bl.at[r].Sub(at); d > took+h.f.Caps.AbortBound {
			t.Errorf("rank %d's blocked AllReduce returned %v after the shrink began", r, d)
		}
	}
	h.checkSurvivors(t, seven, []int{0, 1, 2, 4, 5, 6, 7})
}
