package pgtest

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/pg"
)

// Run runs the conformance suite against f. Its subtests run one after
// the other; at the end no goroutine started during Run may be left.
func Run(t *testing.T, f Factory) {
	leaks := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })
	f = f.withDefaults()
	h := newHarness(t, f)
	for _, size := range []int{1, 2, 3, 4, 5, 8} {
		if size > f.Caps.MaxSize {
			continue
		}
		t.Run(fmt.Sprintf("Collectives/size=%d", size), func(t *testing.T) { h.collectives(t, size) })
	}
	t.Run("InvalidArguments", h.invalidArguments)
	t.Run("Abort", h.abort)
	t.Run("PeerLost", h.peerLost)
	t.Run("Timeout", h.timeout)
	t.Run("Close", h.close)
	if f.Caps.Shrink {
		t.Run("ShrinkValidation", h.shrinkValidation)
		t.Run("Shrink", h.shrink)
		t.Run("ShrinkAbortWhileBlocked", h.shrinkAbortWhileBlocked)
	}
	if f.Caps.Grow && f.Caps.Shrink {
		t.Run("ShrinkThenGrow", h.shrinkThenGrow)
		t.Run("GrowThatDoesNotComplete", h.growIncomplete)
		t.Run("ReformAfterAbort", h.reformAfterAbort)
		t.Run("GrowValidation", h.growValidation)
	}
}

// lengths are the buffer lengths checked for dtype d, where per is the
// number of buffers of that length one rank sends at once in the
// collective (1, or size for AllGather's output and ReduceScatter's input):
// tiny ones, either side of the small/large threshold, and a large one.
func (h *harness) lengths(d pg.DType, per int) []int {
	ls := []int{1, 2, 3, 7, 33}
	unit := d.Size() * per
	if small := h.f.Caps.SmallBytes; small > 0 {
		n := small / unit
		ls = append(ls, max(n-1, 1), n, n+1)
	}
	return append(ls, h.f.Caps.LargeBytes/unit+3)
}

func (h *harness) collectives(t *testing.T, size int) {
	groups := h.form(t, size)
	ops := []pg.ReduceOp{pg.Sum, pg.Prod, pg.Min, pg.Max, pg.Avg}
	for _, d := range h.f.Caps.DTypes {
		t.Run("AllReduce/"+d.String(), func(t *testing.T) {
			for _, op := range ops {
				for _, n := range h.lengths(d, 1) {
					h.checkAllReduce(t, groups, d, op, n)
				}
			}
		})
		t.Run("Broadcast/"+d.String(), func(t *testing.T) {
			for root := range size {
				for _, n := range h.lengths(d, 1) {
					h.checkBroadcast(t, groups, d, root, n)
				}
			}
		})
		t.Run("AllGather/"+d.String(), func(t *testing.T) {
			for _, n := range h.lengths(d, size) {
				h.checkAllGather(t, groups, d, n)
			}
		})
		t.Run("ReduceScatter/"+d.String(), func(t *testing.T) {
			for _, op := range ops {
				for _, n := range h.lengths(d, size) {
					h.checkReduceScatter(t, groups, d, op, n)
				}
			}
		})
		if d == pg.Float32 || d == pg.Float64 {
			t.Run("BitIdentical/"+d.String(), func(t *testing.T) {
				for _, n := range h.lengths(d, 1) {
					h.checkBitIdentical(t, groups, d, n)
				}
			})
		}
	}
	t.Run("Barrier", func(t *testing.T) { h.checkBarrier(t, groups) })
	if size > 1 {
		t.Run("SendRecv", func(t *testing.T) {
			d := h.f.Caps.DTypes[0]
			for _, n := range []int{1, h.f.Caps.LargeBytes / d.Size()} {
				h.checkSendRecv(t, groups, d, n)
			}
		})
	}
}

func (h *harness) checkAllReduce(t *testing.T, groups []pg.ProcessGroup, d pg.DType, op pg.ReduceOp, n int) {
	t.Helper()
	size := len(groups)
	want := gen(n, func(i int) float64 {
		return reduced(d, op, gen(size, func(r int) float64 { return value(r, i) }))
	})
	raw := make([][]byte, size)
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		b, err := h.upload(d, gen(n, func(i int) float64 { return value(r, i) }))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(b)
		if err := g.AllReduce(ctx, b, op); err != nil {
			return fmt.Errorf("allreduce %v %v n=%d: %w", op, d, n, err)
		}
		got, bits, err := h.download(d, n, b)
		if err != nil {
			return err
		}
		raw[r] = bits
		return checkEqual(fmt.Sprintf("allreduce %v %v n=%d", op, d, n), got, want)
	})
	checkSameBits(t, fmt.Sprintf("allreduce %v %v n=%d", op, d, n), raw)
}

func checkSameBits(t *testing.T, what string, raw [][]byte) {
	t.Helper()
	for r := 1; r < len(raw); r++ {
		if !bytes.Equal(raw[r], raw[0]) {
			t.Fatalf("%s: rank %d's result differs from rank 0's in its bits", what, r)
		}
	}
}

// checkBitIdentical reduces values whose float sums depend on the order of
// the additions: every rank must still end with the same bits, close to
// the exact sum.
func (h *harness) checkBitIdentical(t *testing.T, groups []pg.ProcessGroup, d pg.DType, n int) {
	t.Helper()
	size := len(groups)
	messy := func(r, i int) float64 {
		x := uint64(r*1000003+i) * 0x9E3779B97F4A7C15
		return (float64(x%2001) - 1000) * math.Ldexp(1, int(x>>59)-16) / 3
	}
	raw := make([][]byte, size)
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		b, err := h.upload(d, gen(n, func(i int) float64 { return messy(r, i) }))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(b)
		if err := g.AllReduce(ctx, b, pg.Sum); err != nil {
			return err
		}
		got, bits, err := h.download(d, n, b)
		if err != nil {
			return err
		}
		raw[r] = bits
		for i, x := range got {
			var exact, mag float64
			for k := range size {
				exact += messy(k, i)
				mag += math.Abs(messy(k, i))
			}
			if math.Abs(x-exact) > 1e-5*mag {
				return fmt.Errorf("sum %v n=%d: element %d is %v, want about %v", d, n, i, x, exact)
			}
		}
		return nil
	})
	checkSameBits(t, fmt.Sprintf("sum %v n=%d", d, n), raw)
}

func (h *harness) checkBroadcast(t *testing.T, groups []pg.ProcessGroup, d pg.DType, root, n int) {
	t.Helper()
	want := gen(n, func(i int) float64 { return value(root, i) + 100 })
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		in := gen(n, func(int) float64 { return -1 })
		if r == root {
			in = want
		}
		b, err := h.upload(d, in)
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(b)
		if err := g.Broadcast(ctx, b, root); err != nil {
			return fmt.Errorf("broadcast %v root=%d n=%d: %w", d, root, n, err)
		}
		got, _, err := h.download(d, n, b)
		if err != nil {
			return err
		}
		return checkEqual(fmt.Sprintf("broadcast %v root=%d n=%d", d, root, n), got, want)
	})
}

func (h *harness) checkAllGather(t *testing.T, groups []pg.ProcessGroup, d pg.DType, n int) {
	t.Helper()
	size := len(groups)
	want := gen(size*n, func(j int) float64 { return value(j/n, j%n) })
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		in, err := h.upload(d, gen(n, func(i int) float64 { return value(r, i) }))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(in)
		out, err := h.upload(d, make([]float64, size*n))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(out)
		if err := g.AllGather(ctx, out, in); err != nil {
			return fmt.Errorf("allgather %v n=%d: %w", d, n, err)
		}
		got, _, err := h.download(d, size*n, out)
		if err != nil {
			return err
		}
		return checkEqual(fmt.Sprintf("allgather %v n=%d", d, n), got, want)
	})
}

func (h *harness) checkReduceScatter(t *testing.T, groups []pg.ProcessGroup, d pg.DType, op pg.ReduceOp, n int) {
	t.Helper()
	size := len(groups)
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		in, err := h.upload(d, gen(size*n, func(j int) float64 { return value(r, j) }))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(in)
		out, err := h.upload(d, make([]float64, n))
		if err != nil {
			return err
		}
		defer h.f.Memory.Free(out)
		if err := g.ReduceScatter(ctx, out, in, op); err != nil {
			return fmt.Errorf("reducescatter %v %v n=%d: %w", op, d, n, err)
		}
		got, _, err := h.download(d, n, out)
		if err != nil {
			return err
		}
		want := gen(n, func(i int) float64 {
			return reduced(d, op, gen(size, func(k int) float64 { return value(k, r*n+i) }))
		})
		return checkEqual(fmt.Sprintf("reducescatter %v %v n=%d", op, d, n), got, want)
	})
}

// checkBarrier: no rank leaves a barrier before the last one entered it.
func (h *harness) checkBarrier(t *testing.T, groups []pg.ProcessGroup) {
	t.Helper()
	last := len(groups) - 1
	var entered time.Time
	left := make([]time.Time, len(groups))
	onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
		for range 3 {
			if err := g.Barrier(ctx); err != nil {
				return err
			}
		}
		if r == last {
			time.Sleep(20 * time.Millisecond)
			entered = time.Now()
		}
		err := g.Barrier(ctx)
		left[r] = time.Now()
		return err
	})
	for r, at := range left {
		if at.Before(entered) {
			t.Errorf("rank %d left the barrier %v before rank %d entered it", r, entered.Sub(at), last)
		}
	}
}

// checkSendRecv sends between every ordered pair of ranks.
func (h *harness) checkSendRecv(t *testing.T, groups []pg.ProcessGroup, d pg.DType, n int) {
	t.Helper()
	for src := range groups {
		for dst := range groups {
			if src == dst {
				continue
			}
			want := gen(n, func(i int) float64 { return value(src, i) + float64(dst) })
			onAll(t, groups, func(ctx context.Context, r int, g pg.ProcessGroup) error {
				switch r {
				case src:
					b, err := h.upload(d, want)
					if err != nil {
						return err
					}
					defer h.f.Memory.Free(b)
					return g.Send(ctx, b, dst)
				case dst:
					b, err := h.upload(d, make([]float64, n))
					if err != nil {
						return err
					}
					defer h.f.Memory.Free(b)
					if err := g.Recv(ctx, b, src); err != nil {
						return err
					}
					got, _, err := h.download(d, n, b)
					if err != nil {
						return err
					}
					return checkEqual(fmt.Sprintf("send %d→%d %v n=%d", src, dst, d, n), got, want)
				}
				return nil
			})
		}
	}
}
