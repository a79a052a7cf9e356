package cpu

// The ring's schedule, kept apart from the sockets so that it can be tested
// (and simulated) on its own.
//
// A buffer of count elements is cut into n segments, one per rank; each
// segment into the same number of chunks, the pipelining unit. In the
// reduce-scatter half, at step s (0 ≤ s < n-1) rank r sends segment r-s to
// its right neighbour and receives segment r-s-1 from its left one, which
// it reduces with its own copy; after n-1 steps rank r holds segment r+1
// reduced over every rank, and every element was reduced exactly once, in
// a fixed order, which is why every rank ends with the same bits. In the
// all-gather half, at step s rank r sends segment r+1-s and receives
// segment r-s. Segment indices are modulo n.

// layout places segments and chunks in a buffer, in bytes.
type layout struct {
	n      int // ranks
	count  int // elements in the whole buffer
	esize  int // bytes per element
	chunks int // chunks per segment, at least 1
	// blocks: segment k is block (k-1) mod n of count/n elements, so that
	// rank r, which ends the reduce-scatter holding segment r+1, holds
	// block r (ReduceScatter, AllGather). Otherwise segment k is the k-th
	// of n near-equal parts (AllReduce).
	blocks bool
}

// newLayout returns the layout of count elements of esize bytes over n
// ranks with chunks of at most chunkBytes (but at least one element).
func newLayout(n, count, esize, chunkBytes int, blocks bool) layout {
	l := layout{n: n, count: count, esize: esize, blocks: blocks}
	maxSeg := (count + n - 1) / n
	per := max(chunkBytes/esize, 1)
	l.chunks = max((maxSeg+per-1)/per, 1)
	return l
}

// seg returns the first element and the length of segment k.
func (l layout) seg(k int) (off, n int) {
	k = mod(k, l.n)
	if l.blocks {
		blk := l.count / l.n
		return mod(k-1, l.n) * blk, blk
	}
	lo := k * l.count / l.n
	hi := (k + 1) * l.count / l.n
	return lo, hi - lo
}

// chunk returns the byte range [lo, hi) of chunk c of segment k.
func (l layout) chunk(k, c int) (lo, hi int) {
	off, n := l.seg(k)
	return (off + c*n/l.chunks) * l.esize, (off + (c+1)*n/l.chunks) * l.esize
}

// maxChunkBytes is the size of the largest chunk.
func (l layout) maxChunkBytes() int {
	maxSeg := (l.count + l.n - 1) / l.n
	return ((maxSeg + l.chunks - 1) / l.chunks) * l.esize
}

// rsStep returns the segments rank r sends and receives at step s of the
// reduce-scatter half.
func rsStep(r, n, s int) (send, recv int) { return mod(r-s, n), mod(r-s-1, n) }

// agStep returns the segments rank r sends and receives at step s of the
// all-gather half.
func agStep(r, n, s int) (send, recv int) { return mod(r+1-s, n), mod(r-s, n) }

// chainPos is rank r's place in a broadcast chain from root: 0 for the root,
// n-1 for the last rank, which forwards nothing.
func chainPos(r, root, n int) int { return mod(r-root, n) }

func mod(a, n int) int {
	a %= n
	if a < 0 {
		a += n
	}
	return a
}
