package cpu

import (
	"fmt"
	"testing"
)

// TestRingSchedule runs the ring's schedule on integers without sockets:
// every rank must end with every segment summed over all ranks, each
// element reduced exactly once per rank's contribution, for uneven and
// empty segments and any number of chunks.
func TestRingSchedule(t *testing.T) {
	for n := 1; n <= 9; n++ {
		for _, count := range []int{0, 1, 2, 5, 8, 17, 64, 101} {
			for _, chunkBytes := range []int{1, 8, 12, 1 << 20} {
				for _, blocks := range []bool{false, true} {
					if blocks && count%n != 0 {
						continue
					}
					name := fmt.Sprintf("n=%d/count=%d/chunk=%d/blocks=%v", n, count, chunkBytes, blocks)
					if err := simulateRing(newLayout(n, count, 4, chunkBytes, blocks)); err != nil {
						t.Fatalf("%s: %v", name, err)
					}
				}
			}
		}
	}
}

// simulateRing runs both halves of the ring step by step; rank r's element
// i starts as a bit set {r}, reduction is set union, and at the end every
// element of every rank must be the set of all ranks.
func simulateRing(l layout) error {
	n := l.n
	if n == 1 {
		return nil
	}
	bufs := make([][]uint64, n)
	for r := range bufs {
		bufs[r] = make([]uint64, l.count)
		for i := range bufs[r] {
			bufs[r][i] = 1 << r
		}
	}
	elems := func(k, c int) (int, int) {
		lo, hi := l.chunk(k, c)
		return lo / l.esize, hi / l.esize
	}
	// sends returns what every rank sends at step s, chunks flattened.
	sends := func(step func(r, n, s int) (int, int), s int) [][]uint64 {
		sent := make([][]uint64, n)
		for r := range n {
			k, _ := step(r, n, s)
			for c := range l.chunks {
				lo, hi := elems(k, c)
				sent[r] = append(sent[r], bufs[r][lo:hi]...)
			}
		}
		return sent
	}
	for s := range n - 1 {
		sent := sends(rsStep, s)
		for r := range n {
			_, k := rsStep(r, n, s)
			in := sent[mod(r-1, n)]
			for c := range l.chunks {
				lo, hi := elems(k, c)
				for i := lo; i < hi; i++ {
					if bufs[r][i]&in[0] != 0 {
						return fmt.Errorf("reduce-scatter step %d: rank %d reduces element %d twice", s, r, i)
					}
					bufs[r][i] |= in[0]
					in = in[1:]
				}
			}
		}
	}
	all := uint64(1)<<n - 1
	for r := range n {
		off, cnt := l.seg(r + 1)
		for i := off; i < off+cnt; i++ {
			if bufs[r][i] != all {
				return fmt.Errorf("after reduce-scatter rank %d's element %d is %b", r, i, bufs[r][i])
			}
		}
	}
	for s := range n - 1 {
		sent := sends(agStep, s)
		for r := range n {
			_, k := agStep(r, n, s)
			in := sent[mod(r-1, n)]
			for c := range l.chunks {
				lo, hi := elems(k, c)
				copy(bufs[r][lo:hi], in)
				in = in[hi-lo:]
			}
		}
	}
	for r := range n {
		for i, v := range bufs[r] {
			if v != all {
				return fmt.Errorf("rank %d's element %d is %b, want every rank", r, i, v)
			}
		}
	}
	return nil
}

func TestLayoutCoversBuffer(t *testing.T) {
	for _, l := range []layout{newLayout(4, 10, 4, 4, false), newLayout(3, 12, 8, 16, true), newLayout(5, 3, 4, 1, false)} {
		seen := make([]int, l.count*l.esize)
		for k := range l.n {
			for c := range l.chunks {
				lo, hi := l.chunk(k, c)
				if hi-lo > l.maxChunkBytes() {
					t.Fatalf("%+v: chunk %d/%d has %d bytes, max %d", l, k, c, hi-lo, l.maxChunkBytes())
				}
				for i := lo; i < hi; i++ {
					seen[i]++
				}
			}
		}
		for i, v := range seen {
			if v != 1 {
				t.Fatalf("%+v: byte %d covered %d times", l, i, v)
			}
		}
	}
}

func TestShrinkNamespace(t *testing.T) {
	for _, c := range []struct {
		parent string
		k      int
		excl   []int
		want   string
	}{
		{"", 0, []int{3}, "pgcpu-shrink0-x3"},
		{"job/7", 2, []int{1, 5}, "job/7/pgcpu-shrink2-x1,5"},
	} {
		if got := shrinkNamespace(c.parent, c.k, c.excl); got != c.want {
			t.Errorf("shrinkNamespace(%q, %d, %v) = %q, want %q", c.parent, c.k, c.excl, got, c.want)
		}
	}
}
