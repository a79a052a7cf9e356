package cpu

import (
	"context"
	"fmt"

	"github.com/gorunhq/gorun/pg"
)

// AllReduce reduces buf across the group with op, in place.
func (g *Group) AllReduce(ctx context.Context, b pg.Buffer, op pg.ReduceOp) error {
	const name = "allreduce"
	h, err := hostBuffer(name, b)
	if err != nil {
		return err
	}
	if err := checkOp(name, op); err != nil {
		return err
	}
	var c call
	if err := g.begin(ctx, &c, name, true); err != nil {
		return err
	}
	return g.end(&c, g.allReduce(&c, h, op))
}

func checkOp(name string, op pg.ReduceOp) error {
	if !op.Valid() {
		return fmt.Errorf("pg/cpu: %s: %w: unknown reduce op %v", name, pg.ErrInvalidArgument, op)
	}
	return nil
}

func (g *Group) allReduce(c *call, h pg.HostBuffer, op pg.ReduceOp) error {
	buf := h.Bytes()
	if g.size > 1 && len(buf) > 0 {
		red := reducerFor(h.DType(), op)
		var err error
		if g.small(len(buf)) {
			err = g.exchangeReduce(c, buf, red)
		} else {
			err = g.ringAllReduce(c, buf, h.DType().Size(), red)
		}
		if err != nil {
			return err
		}
	}
	finish(buf, h.DType(), op, g.size)
	return nil
}

func (g *Group) small(n int) bool { return g.cfg.SmallBytes >= 0 && n <= g.cfg.SmallBytes }

// exchangeReduce is the small-buffer AllReduce: every rank sends buf to
// every other one and reduces the n copies in rank order.
func (g *Group) exchangeReduce(c *call, buf []byte, red reducer) error {
	n := len(buf)
	stride := (n + 7) &^ 7
	slots := g.scratchBytes(stride * g.size)
	slot := func(k int) []byte { return slots[k*stride : k*stride+n] }
	own := slot(g.rank)
	copy(own, buf)
	if err := g.exchange(c, func(int) []byte { return own }, slot); err != nil {
		return err
	}
	red(buf, slot(0), slot(1))
	for k := 2; k < g.size; k++ {
		red(buf, buf, slot(k))
	}
	return nil
}

// exchange sends out(k) to every peer k and receives in(k) from it, then
// waits until everything was sent.
func (g *Group) exchange(c *call, out, in func(k int) []byte) error {
	for k, p := range g.peers {
		if p != nil {
			p.send.post(out(k))
		}
	}
	for k, p := range g.peers {
		if p != nil {
			if err := g.recv(c, p, in(k)); err != nil {
				return err
			}
		}
	}
	return g.flushAll(c)
}

func (g *Group) ringAllReduce(c *call, buf []byte, esize int, red reducer) error {
	l := newLayout(g.size, len(buf)/esize, esize, g.cfg.ChunkBytes, false)
	tmp := g.scratchBytes(l.maxChunkBytes())
	if err := g.ringReduceScatter(c, l, buf, buf, nil, tmp, red, true); err != nil {
		return err
	}
	return g.ringAllGather(c, l, buf)
}

func (g *Group) neighbours() (left, right *peer) {
	return g.peers[mod(g.rank-1, g.size)], g.peers[mod(g.rank+1, g.size)]
}

// ringReduceScatter runs the reduce-scatter half of the ring (schedule.go):
// segments of src reduced with what arrives go to dst, the last step's (the
// segment this rank ends with, r+1) to last instead when last is not nil
// (indexed from that segment's start). With forward, that segment is also
// sent on, as the all-gather half's first step.
func (g *Group) ringReduceScatter(c *call, l layout, src, dst, last, tmp []byte, red reducer, forward bool) error {
	r, n := g.rank, g.size
	left, right := g.neighbours()
	first, _ := rsStep(r, n, 0)
	for ch := range l.chunks {
		lo, hi := l.chunk(first, ch)
		right.send.post(src[lo:hi])
	}
	for s := range n - 1 {
		_, k := rsStep(r, n, s)
		base := 0
		if s == n-2 && last != nil {
			off, _ := l.seg(k)
			base = off * l.esize
		}
		for ch := range l.chunks {
			lo, hi := l.chunk(k, ch)
			if lo == hi {
				continue
			}
			out := dst[lo:hi]
			if s == n-2 && last != nil {
				out = last[lo-base : hi-base]
			}
			if err := g.recvReduce(c, left, out, src[lo:hi], tmp, red); err != nil {
				return err
			}
			if s < n-2 || forward {
				right.send.post(out)
			}
		}
	}
	return nil
}

// ringAllGather runs the all-gather half of the ring on buf, whose segment
// r+1 is complete and already posted to the right neighbour.
func (g *Group) ringAllGather(c *call, l layout, buf []byte) error {
	r, n := g.rank, g.size
	left, right := g.neighbours()
	for s := range n - 1 {
		_, k := agStep(r, n, s)
		for ch := range l.chunks {
			lo, hi := l.chunk(k, ch)
			if lo == hi {
				continue
			}
			if err := g.recv(c, left, buf[lo:hi]); err != nil {
				return err
			}
			if s < n-2 {
				right.send.post(buf[lo:hi])
			}
		}
	}
	return g.flush(c, right)
}

// Broadcast copies root's buf to every rank.
func (g *Group) Broadcast(ctx context.Context, b pg.Buffer, root int) error {
	const name = "broadcast"
	h, err := hostBuffer(name, b)
	if err != nil {
		return err
	}
	if root < 0 || root >= g.size {
		return fmt.Errorf("pg/cpu: %s: %w: root %d out of range for size %d", name, pg.ErrInvalidArgument, root, g.size)
	}
	var c call
	if err := g.begin(ctx, &c, name, true); err != nil {
		return err
	}
	return g.end(&c, g.broadcast(&c, h, root))
}

func (g *Group) broadcast(c *call, h pg.HostBuffer, root int) error {
	buf := h.Bytes()
	if g.size == 1 || len(buf) == 0 {
		return nil
	}
	if g.small(len(buf)) || g.size == 2 {
		if g.rank != root {
			return g.recv(c, g.peers[root], buf)
		}
		for _, p := range g.peers {
			if p != nil {
				p.send.post(buf)
			}
		}
		return g.flushAll(c)
	}
	// A pipelined chain root → root+1 → … → root-1.
	pos := chainPos(g.rank, root, g.size)
	left, right := g.neighbours()
	esize := h.DType().Size()
	l := newLayout(1, len(buf)/esize, esize, g.cfg.ChunkBytes, false)
	for ch := range l.chunks {
		lo, hi := l.chunk(0, ch)
		if pos > 0 {
			if err := g.recv(c, left, buf[lo:hi]); err != nil {
				return err
			}
		}
		if pos < g.size-1 {
			right.send.post(buf[lo:hi])
		}
	}
	if pos < g.size-1 {
		return g.flush(c, right)
	}
	return nil
}

// AllGather concatenates every rank's in, in rank order, into out.
func (g *Group) AllGather(ctx context.Context, out, in pg.Buffer) error {
	const name = "allgather"
	ho, hi, err := g.pair(name, out, in, true)
	if err != nil {
		return err
	}
	var c call
	if err := g.begin(ctx, &c, name, true); err != nil {
		return err
	}
	return g.end(&c, g.allGather(&c, ho, hi))
}

// pair checks a collective's out and in: HostBuffers of one dtype, out
// size times in (gather: AllGather) or in size times out (ReduceScatter).
func (g *Group) pair(name string, out, in pg.Buffer, gather bool) (ho, hi pg.HostBuffer, err error) {
	if ho, err = hostBuffer(name, out); err != nil {
		return
	}
	if hi, err = hostBuffer(name, in); err != nil {
		return
	}
	if ho.DType() != hi.DType() {
		err = fmt.Errorf("pg/cpu: %s: %w: output is %v, input %v", name, pg.ErrInvalidArgument, ho.DType(), hi.DType())
		return
	}
	if gather && ho.Len() != g.size*hi.Len() {
		err = fmt.Errorf("pg/cpu: %s: %w: output has %d elements, want %d (size %d × input %d)", name, pg.ErrInvalidArgument, ho.Len(), g.size*hi.Len(), g.size, hi.Len())
	}
	if !gather && hi.Len() != g.size*ho.Len() {
		err = fmt.Errorf("pg/cpu: %s: %w: input has %d elements, want %d (size %d × output %d)", name, pg.ErrInvalidArgument, hi.Len(), g.size*ho.Len(), g.size, ho.Len())
	}
	return
}

func (g *Group) allGather(c *call, ho, hi pg.HostBuffer) error {
	out, in := ho.Bytes(), hi.Bytes()
	blk := len(in)
	copy(out[g.rank*blk:], in)
	if g.size == 1 || blk == 0 {
		return nil
	}
	if g.small(len(out)) {
		return g.exchange(c, func(int) []byte { return in }, func(k int) []byte { return out[k*blk : (k+1)*blk] })
	}
	esize := ho.DType().Size()
	l := newLayout(g.size, ho.Len(), esize, g.cfg.ChunkBytes, true)
	_, right := g.neighbours()
	own := g.rank + 1 // segment r+1 is block r
	for ch := range l.chunks {
		lo, hi := l.chunk(own, ch)
		right.send.post(out[lo:hi])
	}
	return g.ringAllGather(c, l, out)
}

// ReduceScatter reduces in across the group with op and leaves block r of
// the result in rank r's out.
func (g *Group) ReduceScatter(ctx context.Context, out, in pg.Buffer, op pg.ReduceOp) error {
	const name = "reducescatter"
	ho, hi, err := g.pair(name, out, in, false)
	if err != nil {
		return err
	}
	if err := checkOp(name, op); err != nil {
		return err
	}
	var c call
	if err := g.begin(ctx, &c, name, true); err != nil {
		return err
	}
	return g.end(&c, g.reduceScatter(&c, ho, hi, op))
}

func (g *Group) reduceScatter(c *call, ho, hi pg.HostBuffer, op pg.ReduceOp) error {
	out, in := ho.Bytes(), hi.Bytes()
	blk := len(out)
	if g.size == 1 || blk == 0 {
		copy(out, in)
		finish(out, ho.DType(), op, g.size)
		return nil
	}
	red := reducerFor(ho.DType(), op)
	if g.small(len(in)) {
		stride := (blk + 7) &^ 7
		slots := g.scratchBytes(stride * g.size)
		block := func(k int) []byte {
			if k == g.rank {
				return in[k*blk : (k+1)*blk]
			}
			return slots[k*stride : k*stride+blk]
		}
		if err := g.exchange(c, func(k int) []byte { return in[k*blk : (k+1)*blk] }, block); err != nil {
			return err
		}
		red(out, block(0), block(1))
		for k := 2; k < g.size; k++ {
			red(out, out, block(k))
		}
	} else {
		esize := ho.DType().Size()
		l := newLayout(g.size, hi.Len(), esize, g.cfg.ChunkBytes, true)
		workLen := (len(in) + 7) &^ 7
		space := g.scratchBytes(workLen + l.maxChunkBytes())
		work, tmp := space[:len(in)], space[workLen:]
		if err := g.ringReduceScatter(c, l, in, work, out, tmp, red, false); err != nil {
			return err
		}
		_, right := g.neighbours()
		if err := g.flush(c, right); err != nil {
			return err
		}
	}
	finish(out, ho.DType(), op, g.size)
	return nil
}

// Barrier returns once every rank has entered it.
func (g *Group) Barrier(ctx context.Context) error {
	var c call
	if err := g.begin(ctx, &c, "barrier", true); err != nil {
		return err
	}
	return g.end(&c, g.barrier(&c))
}

func (g *Group) barrier(c *call) error {
	if g.size == 1 {
		return nil
	}
	got := g.scratchBytes(g.size)
	return g.exchange(c, func(int) []byte { return g.token[:] }, func(k int) []byte { return got[k : k+1] })
}

// Send sends buf to rank peer.
func (g *Group) Send(ctx context.Context, b pg.Buffer, peer int) error {
	const name = "send"
	h, p, err := g.p2p(name, b, peer)
	if err != nil {
		return err
	}
	var c call
	if err := g.begin(ctx, &c, name, false); err != nil {
		return err
	}
	p.send.post(h.Bytes())
	return g.end(&c, g.flush(&c, p))
}

// Recv receives into buf what rank peer sent.
func (g *Group) Recv(ctx context.Context, b pg.Buffer, peer int) error {
	const name = "recv"
	h, p, err := g.p2p(name, b, peer)
	if err != nil {
		return err
	}
	var c call
	if err := g.begin(ctx, &c, name, false); err != nil {
		return err
	}
	return g.end(&c, g.recv(&c, p, h.Bytes()))
}

func (g *Group) p2p(name string, b pg.Buffer, peer int) (pg.HostBuffer, *peer, error) {
	h, err := hostBuffer(name, b)
	if err != nil {
		return h, nil, err
	}
	if peer < 0 || peer >= g.size || peer == g.rank {
		return h, nil, fmt.Errorf("pg/cpu: %s: %w: peer %d (rank %d of %d)", name, pg.ErrInvalidArgument, peer, g.rank, g.size)
	}
	return h, g.peers[peer], nil
}
