// Package pgtest is the conformance suite of pg.ProcessGroup: what makes a
// backend a process group. A backend's test calls Run with a Factory; Run
// forms groups in-process (one goroutine per rank, every rank with its own
// client of one in-process TCPStore server) and checks every collective
// numerically, the argument errors, Abort, dead peers, timeouts, Close and
// Shrink.
package pgtest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Factory is what a backend gives the suite.
type Factory struct {
	// New forms rank b.Rank of a group of b.Size. Run calls it concurrently
	// for every rank of a group, with the same Store (each rank its own
	// client) and Namespace, and with a Timeout.
	New func(ctx context.Context, b pg.Bootstrap) (pg.ProcessGroup, error)
	// JoinGrow forms a newcomer's side of a pg.Grower's Grow: rank b.Rank
	// of the grown group of b.Size, meeting the members under
	// spec.Namespace. Required with Caps.Grow.
	JoinGrow func(ctx context.Context, b pg.Bootstrap, spec pg.GrowSpec) (pg.ProcessGroup, error)
	// Memory moves test data in and out of the backend's buffers. Default
	// HostMemory.
	Memory Memory
	// Caps says what the backend can do.
	Caps Capabilities
}

// Capabilities bound what Run asks of a backend.
type Capabilities struct {
	// MaxSize is the largest group Run forms. Default 8; the shrink tests
	// need 8.
	MaxSize int
	// DTypes the collectives are checked on. Default float32, float64,
	// int32, int64.
	DTypes []pg.DType
	// Unsupported dtypes must fail every collective with an error wrapping
	// pg.ErrInvalidArgument, before any communication.
	Unsupported []pg.DType
	// Shrink: the backend implements Shrink.
	Shrink bool
	// Grow: the backend's groups are pg.Growers (Factory.JoinGrow set).
	Grow bool
	// SmallBytes is the buffer size in bytes at which the backend switches
	// from its small-message algorithm to its large one (0: it has one
	// algorithm). Buffer lengths on both sides of it are checked.
	SmallBytes int
	// LargeBytes is the size of the largest buffer checked. Default
	// 2×SmallBytes, at least 64 KiB.
	LargeBytes int
	// AbortBound is how soon an operation blocked on peers must return after
	// Abort (and after a peer's death). Default 100 ms, generous for CI.
	AbortBound time.Duration
}

// Memory moves test data between host memory and a backend's buffers.
type Memory interface {
	// Buffer returns a new backend buffer holding a copy of src.
	Buffer(src pg.HostBuffer) (pg.Buffer, error)
	// Read copies b into dst (same dtype and length).
	Read(dst pg.HostBuffer, b pg.Buffer) error
	// Free releases a buffer made by Buffer.
	Free(b pg.Buffer)
}

// HostMemory is Memory for backends that take pg.HostBuffer.
type HostMemory struct{}

func (HostMemory) Buffer(src pg.HostBuffer) (pg.Buffer, error) {
	b := pg.NewHost(src.DType(), src.Len())
	copy(b.Bytes(), src.Bytes())
	return b, nil
}

func (HostMemory) Read(dst pg.HostBuffer, b pg.Buffer) error {
	h, ok := b.(pg.HostBuffer)
	if !ok {
		return fmt.Errorf("pgtest: HostMemory.Read of a %T", b)
	}
	copy(dst.Bytes(), h.Bytes())
	return nil
}

func (HostMemory) Free(pg.Buffer) {}

func (f Factory) withDefaults() Factory {
	if f.Memory == nil {
		f.Memory = HostMemory{}
	}
	c := &f.Caps
	if c.MaxSize <= 0 {
		c.MaxSize = 8
	}
	if len(c.DTypes) == 0 {
		c.DTypes = []pg.DType{pg.Float32, pg.Float64, pg.Int32, pg.Int64}
	}
	if c.LargeBytes <= 0 {
		c.LargeBytes = max(2*c.SmallBytes, 64<<10)
	}
	if c.AbortBound <= 0 {
		c.AbortBound = 100 * time.Millisecond
	}
	return f
}

// opTimeout bounds every operation the suite expects to succeed, so that a
// broken backend fails the test instead of hanging it.
const opTimeout = 30 * time.Second

// harness forms groups for one Run.
type harness struct {
	t   *testing.T
	f   Factory
	srv *tcpstore.Server
	seq atomic.Int64 // namespaces
}

func newHarness(t *testing.T, f Factory) *harness {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatalf("pgtest: store server: %v", err)
	}
	t.Cleanup(func() { srv.Close() })
	return &harness{t: t, f: f, srv: srv}
}

// form makes a group of size ranks in a fresh namespace; t's cleanup
// closes them.
func (h *harness) form(t *testing.T, size int) []pg.ProcessGroup {
	t.Helper()
	ns := fmt.Sprintf("pgtest/%d", h.seq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	groups := make([]pg.ProcessGroup, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		c, err := tcpstore.Dial(ctx, h.srv.Addr().String(), tcpstore.ClientConfig{Timeout: opTimeout})
		if err != nil {
			t.Fatalf("pgtest: store client: %v", err)
		}
		t.Cleanup(func() { c.Close() })
		b := pg.Bootstrap{Store: c, Namespace: ns, Rank: r, Size: size, Timeout: opTimeout}
		wg.Go(func() { groups[r], errs[r] = h.f.New(ctx, b) })
	}
	wg.Wait()
	for r := range size {
		if g := groups[r]; g != nil {
			t.Cleanup(func() { g.Close() })
		}
	}
	for r, err := range errs {
		if err != nil {
			t.Fatalf("pgtest: form rank %d of %d: %v", r, size, err)
		}
	}
	for r, g := range groups {
		if g.Rank() != r || g.Size() != size {
			t.Fatalf("pgtest: rank %d formed as rank %d of %d", r, g.Rank(), g.Size())
		}
	}
	return groups
}

// onAll runs fn on every rank at once and fails t with the first error.
func onAll(t *testing.T, groups []pg.ProcessGroup, fn func(ctx context.Context, r int, g pg.ProcessGroup) error) {
	t.Helper()
	if err := firstErr(runAll(groups, fn)); err != nil {
		t.Fatal(err)
	}
}

func runAll(groups []pg.ProcessGroup, fn func(ctx context.Context, r int, g pg.ProcessGroup) error) []error {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for r, g := range groups {
		wg.Go(func() { errs[r] = fn(ctx, r, g) })
	}
	wg.Wait()
	return errs
}

func firstErr(errs []error) error {
	for r, err := range errs {
		if err != nil {
			return fmt.Errorf("rank %d: %w", r, err)
		}
	}
	return nil
}

// Test data. Every element is a small integer, so that sums and products
// are exact in every dtype whatever the order of the reduction.

func value(r, i int) float64 { return float64((r*7+i*3)%5 + 1) }

// host returns a HostBuffer of dtype holding v.
func host(d pg.DType, v []float64) pg.HostBuffer {
	h := pg.NewHost(d, len(v))
	switch d {
	case pg.Float32:
		s := pg.HostSlice[float32](h)
		for i, x := range v {
			s[i] = float32(x)
		}
	case pg.Float64:
		copy(pg.HostSlice[float64](h), v)
	case pg.Int32:
		s := pg.HostSlice[int32](h)
		for i, x := range v {
			s[i] = int32(x)
		}
	case pg.Int64:
		s := pg.HostSlice[int64](h)
		for i, x := range v {
			s[i] = int64(x)
		}
	}
	return h
}

// values returns h's elements as float64.
func values(h pg.HostBuffer) []float64 {
	v := make([]float64, h.Len())
	switch h.DType() {
	case pg.Float32:
		for i, x := range pg.HostSlice[float32](h) {
			v[i] = float64(x)
		}
	case pg.Float64:
		copy(v, pg.HostSlice[float64](h))
	case pg.Int32:
		for i, x := range pg.HostSlice[int32](h) {
			v[i] = float64(x)
		}
	case pg.Int64:
		for i, x := range pg.HostSlice[int64](h) {
			v[i] = float64(x)
		}
	}
	return v
}

func gen(n int, f func(i int) float64) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = f(i)
	}
	return v
}

// reduced is what op makes of xs in dtype d.
func reduced(d pg.DType, op pg.ReduceOp, xs []float64) float64 {
	acc := xs[0]
	for _, x := range xs[1:] {
		switch op {
		case pg.Sum, pg.Avg:
			acc += x
		case pg.Prod:
			acc *= x
		case pg.Max:
			acc = max(acc, x)
		case pg.Min:
			acc = min(acc, x)
		}
	}
	if op == pg.Avg {
		n := len(xs)
		switch d {
		case pg.Float32:
			return float64(float32(acc) / float32(n))
		case pg.Float64:
			return acc / float64(n)
		default:
			return float64(int64(acc) / int64(n))
		}
	}
	return acc
}

// upload makes a backend buffer of v in dtype d.
func (h *harness) upload(d pg.DType, v []float64) (pg.Buffer, error) {
	return h.f.Memory.Buffer(host(d, v))
}

// download reads b (of dtype d, n elements) back as float64s and raw bytes.
func (h *harness) download(d pg.DType, n int, b pg.Buffer) ([]float64, []byte, error) {
	dst := pg.NewHost(d, n)
	if err := h.f.Memory.Read(dst, b); err != nil {
		return nil, nil, err
	}
	return values(dst), dst.Bytes(), nil
}

func checkEqual(what string, got, want []float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("%s: %d elements, want %d", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			return fmt.Errorf("%s: element %d of %d is %v, want %v", what, i, len(got), got[i], want[i])
		}
	}
	return nil
}
