package pgtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// growAll grows the members' groups by newcomers (how many join: joining,
// of spec.Added announced) under spec, newcomers formed with the Factory's
// JoinGrow in parallel. It returns the grown groups in rank order, or the
// members' errors.
func (h *harness) growAll(t *testing.T, ctx context.Context, members []pg.ProcessGroup, spec pg.GrowSpec, joining int) ([]pg.ProcessGroup, []error) {
	t.Helper()
	size := len(members) + spec.Added
	out := make([]pg.ProcessGroup, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r, g := range members {
		wg.Go(func() {
			gr, ok := g.(pg.Grower)
			if !ok {
				errs[r] = fmt.Errorf("rank %d's group is a %T, not a pg.Grower", r, g)
				return
			}
			out[r], errs[r] = gr.Grow(ctx, spec)
		})
	}
	for k := range joining {
		r := len(members) + k
		c, err := tcpstore.Dial(ctx, h.srv.Addr().String(), tcpstore.ClientConfig{Timeout: opTimeout})
		if err != nil {
			t.Fatalf("pgtest: store client: %v", err)
		}
		t.Cleanup(func() { c.Close() })
		b := pg.Bootstrap{Store: c, Rank: r, Size: size, Timeout: opTimeout}
		wg.Go(func() { out[r], errs[r] = h.f.JoinGrow(ctx, b, spec) })
	}
	wg.Wait()
	for _, g := range out {
		if g != nil {
			t.Cleanup(func() { g.Close() })
		}
	}
	return out, errs[:len(members)]
}

// shrinkThenGrow is heal: a group of 8 loses rank 3 (shrunk to 7), and a
// newcomer is grown in as rank 7: the members keep their ranks, and the
// grown group's collectives count every one of them.
func (h *harness) shrinkThenGrow(t *testing.T) {
	groups := h.form(t, 8)
	seven, _ := h.shrinkAll(t, groups, []int{3}, pg.ShrinkDefault)
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	spec := pg.GrowSpec{Added: 1, Namespace: fmt.Sprintf("pgtest/grow/%d", h.seq.Add(1))}
	began := time.Now()
	eight, errs := h.growAll(t, ctx, seven, spec, 1)
	if err := firstErr(errs); err != nil {
		t.Fatalf("grow: %v", err)
	}
	t.Logf("grow 7→8: %v", time.Since(began))
	for r, g := range eight {
		if g.Rank() != r || g.Size() != 8 {
			t.Fatalf("grown rank %d is rank %d of %d", r, g.Rank(), g.Size())
		}
	}
	if got, want := h.sumOnAll(t, eight, func(r int) float64 { return float64(r + 1) }), 36.0; got != want {
		t.Errorf("sum on the grown group = %v, want %v", got, want)
	}
}

// growIncomplete: two newcomers are announced, one comes. The members'
// Grow fails within its deadline, not later, and their group works on.
func (h *harness) growIncomplete(t *testing.T) {
	groups := h.form(t, 4)
	const bound = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	spec := pg.GrowSpec{Added: 2, Namespace: fmt.Sprintf("pgtest/grow/%d", h.seq.Add(1))}
	began := time.Now()
	_, errs := h.growAll(t, ctx, groups, spec, 1)
	took := time.Since(began)
	for r, err := range errs {
		if err == nil {
			t.Errorf("rank %d: a grow with a newcomer missing succeeded", r)
		}
	}
	if took > bound+2*time.Second {
		t.Errorf("the incomplete grow took %v, want about its %v deadline", took, bound)
	}
	if got, want := h.sumOnAll(t, groups, func(r int) float64 { return float64(r + 1) }), 10.0; got != want {
		t.Errorf("sum on the old group after the failed grow = %v, want %v", got, want)
	}
}

// reformAfterAbort: members of an aborted group (a grow that did not
// complete aborted it) re-form with a grow of no newcomers and work again,
// each keeping its rank.
func (h *harness) reformAfterAbort(t *testing.T) {
	groups := h.form(t, 3)
	for _, g := range groups {
		g.Abort(errors.New("pgtest: a grow began"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	spec := pg.GrowSpec{Namespace: fmt.Sprintf("pgtest/grow/%d", h.seq.Add(1))}
	again, errs := h.growAll(t, ctx, groups, spec, 0)
	if err := firstErr(errs); err != nil {
		t.Fatalf("re-form: %v", err)
	}
	for r, g := range again {
		if g.Rank() != r || g.Size() != 3 {
			t.Fatalf("re-formed rank %d is rank %d of %d", r, g.Rank(), g.Size())
		}
	}
	if got, want := h.sumOnAll(t, again, func(r int) float64 { return float64(r + 1) }), 6.0; got != want {
		t.Errorf("sum on the re-formed group = %v, want %v", got, want)
	}
}

// growValidation: bad GrowSpecs are refused with pg.ErrInvalidArgument.
func (h *harness) growValidation(t *testing.T) {
	groups := h.form(t, 2)
	for _, spec := range []pg.GrowSpec{{Added: -1, Namespace: "x"}, {Added: 1}} {
		_, err := groups[0].(pg.Grower).Grow(context.Background(), spec)
		if !errors.Is(err, pg.ErrInvalidArgument) {
			t.Errorf("Grow(%+v) = %v, want pg.ErrInvalidArgument", spec, err)
		}
	}
}
