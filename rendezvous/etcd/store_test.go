package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/storecount"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// newStores returns n Stores (n agents) on one fresh prefix.
func newStores(t *testing.T, cli *clientv3.Client, n int) []*etcd.Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prefix := fmt.Sprintf("/test/%s/%d/", t.Name(), prefixes.Add(1))
	out := make([]*etcd.Store, n)
	for i := range out {
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, OpTimeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		out[i] = etcd.NewStore(st, 10*time.Second)
		t.Cleanup(func() { out[i].Close() })
	}
	return out
}

func TestStoreBlockingOps(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ss := newStores(t, cli, 2)
	ctx := testCtx(t, 20*time.Second)

	got := make(chan []byte, 1)
	go func() {
		v, err := ss[0].Get(ctx, "k")
		if err != nil {
			t.Error(err)
		}
		got <- v
	}()
	time.Sleep(50 * time.Millisecond)
	if err := ss[1].Set(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if v := <-got; string(v) != "v" {
		t.Fatalf("get released by the other store = %q", v)
	}

	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	err := ss[0].Wait(short, "never")
	if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait timeout error = %v", err)
	}

	var wg sync.WaitGroup
	for i := range 3 {
		wg.Go(func() {
			if err := ss[i%2].Barrier(ctx, "b", 3); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()

	go func() {
		time.Sleep(50 * time.Millisecond)
		ss[1].QueuePush(ctx, "q", []byte("x"))
	}()
	if v, err := ss[0].QueuePop(ctx, "q", true); err != nil || string(v) != "x" {
		t.Fatalf("blocking pop = %q, %v", v, err)
	}
}

// TestStoreDynamicRendezvous runs gorun's dynamic rendezvous over etcd:
// three agents, each with its own Store, complete one round with one rank
// each, and a node whose heartbeat lapses is reported lost.
func TestStoreDynamicRendezvous(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	const n = 3
	ss := newStores(t, cli, n)
	cfg := rendezvous.DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n,
		KeepAliveInterval: 100 * time.Millisecond, KeepAliveMaxAttempt: 3}
	ds := make([]*rendezvous.Dynamic, n)
	for i := range ds {
		d, err := rendezvous.NewDynamic(ss[i], rendezvous.NodeDesc{Addr: fmt.Sprintf("node%d", i), Pid: 100 + i}, nil, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds[i] = d
	}
	rounds := make([]rendezvous.Round, n)
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Go(func() {
			r, err := d.Next(ctx)
			if err != nil {
				t.Error(err)
			}
			rounds[i] = r
		})
	}
	wg.Wait()
	seen := map[int]bool{}
	for i, r := range rounds {
		if r.Number != 0 || len(r.Members) != n || seen[r.Rank] {
			t.Fatalf("node %d: round %+v", i, r)
		}
		seen[r.Rank] = true
	}
	// Node 2 stops its heartbeat: the others see it lost.
	ds[2].Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := ds[0].Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Lost) == 1 && st.Lost[0].Addr == "node2" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node2 not reported lost: %+v", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestStoreDynamicQueued: 48 agents rendezvous at once over etcd with the
// rendezvous's keys unwatched (as the launcher sets it up): their joins go
// through the request queue, each writes a few hundred bytes (not the
// whole state), and no request is left in etcd afterwards.
func TestStoreDynamicQueued(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 60*time.Second)
	const n = 48
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	var counts storecount.Counts
	ds := make([]*rendezvous.Dynamic, n)
	var s *etcd.Store
	for i := range ds {
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, Unwatched: rendezvous.DynamicUnwatched("job")})
		if err != nil {
			t.Fatal(err)
		}
		es := etcd.NewStore(st, 30*time.Second)
		t.Cleanup(func() { es.Close() })
		s = es
		d, err := rendezvous.NewDynamic(storecount.New(es, &counts), rendezvous.NodeDesc{Addr: fmt.Sprintf("node%02d", i), Pid: 100}, nil,
			rendezvous.DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds[i] = d
	}
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Go(func() {
			r, err := d.Next(ctx)
			if err != nil || r.Rank != i || len(r.Members) != n {
				t.Errorf("node %d: rank %d of %d, %v", i, r.Rank, len(r.Members), err)
			}
		})
	}
	wg.Wait()
	if w := counts.Written.Load() / n; w > 2000 {
		t.Errorf("%d bytes written per agent", w)
	}
	// Unwatched queue elements live under uq/; none is left.
	resp, err := cli.Get(ctx, prefix+"uq/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || resp.Count != 0 {
		t.Errorf("requests left in etcd: %v, %v", resp, err)
	}
	resp, err = cli.Get(ctx, prefix+"q/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || resp.Count != 0 {
		t.Errorf("watched queue elements: %v, %v", resp, err)
	}
	// Nothing would wake a blocking pop of an unwatched queue.
	q := rendezvous.DynamicUnwatched("job")[1]
	if _, err := s.QueuePop(ctx, q, true); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Errorf("blocking pop of %q: %v", q, err)
	}
}

// TestStoreQueuePopBatch: batches come off the head in order, at most 100
// at a time (etcd's transaction limit), and two stores popping one queue
// at once take every element exactly once.
func TestStoreQueuePopBatch(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	ss := newStores(t, cli, 2)
	const n = 250
	for i := range n {
		if err := ss[0].QueuePush(ctx, "q", []byte(fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	first, err := ss[0].QueuePopBatch(ctx, "q", 1000)
	if err != nil || len(first) != 100 || string(first[0]) != "0" || string(first[99]) != "99" {
		t.Fatalf("first batch: %d elements, %v", len(first), err)
	}
	seen := map[string]int{}
	for _, v := range first {
		seen[string(v)]++
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, s := range ss {
		wg.Go(func() {
			for {
				vs, err := s.QueuePopBatch(ctx, "q", 7)
				if err != nil {
					t.Error(err)
					return
				}
				if len(vs) == 0 {
					return
				}
				mu.Lock()
				for _, v := range vs {
					seen[string(v)]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for i := range n {
		if seen[fmt.Sprint(i)] != 1 {
			t.Fatalf("element %d popped %d times", i, seen[fmt.Sprint(i)])
		}
	}
	if vs, err := ss[1].QueuePopBatch(ctx, "q", 10); err != nil || len(vs) != 0 {
		t.Fatalf("empty queue: %q, %v", vs, err)
	}
}

// TestStoreQueueReadsAreBounded: a pop reads the queue's head and no more
// (a limited read in key order: etcd reads a whole range before it applies
// a limit to any other order, 20 ms a pop of 100 from a queue of 10,000),
// and pushes one after another, from two nodes in turn, come out in the
// order they were pushed, past the elements' sixteenth and 256th.
func TestStoreQueueReadsAreBounded(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	var unbounded atomic.Int32
	var reads atomic.Int32
	cli := interceptedClient(t, cluster, func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*etcdserverpb.RangeRequest); ok && strings.Contains(string(r.Key), "/q/") && !r.CountOnly {
			reads.Add(1)
			if r.SortOrder != etcdserverpb.RangeRequest_NONE || r.Limit == 0 || r.Limit > 100 {
				unbounded.Add(1)
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	ctx := testCtx(t, 60*time.Second)
	ss := newStores(t, cli, 2)
	const n = 300
	for i := range n {
		if err := ss[i%2].QueuePush(ctx, "q", []byte(strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for len(got) < n {
		vs, err := ss[len(got)%2].QueuePopBatch(ctx, "q", 70)
		if err != nil || len(vs) == 0 {
			t.Fatalf("after %d elements: %d popped, %v", len(got), len(vs), err)
		}
		for _, v := range vs {
			got = append(got, string(v))
		}
	}
	for i, v := range got {
		if v != strconv.Itoa(i) {
			t.Fatalf("element %d popped as the %dth: %q", i, i+1, got)
		}
	}
	if err := ss[1].QueuePush(ctx, "q", []byte("last")); err != nil {
		t.Fatal(err)
	}
	if v, err := ss[0].QueuePop(ctx, "q", false); err != nil || string(v) != "last" {
		t.Fatalf("the last pop: %q, %v", v, err)
	}
	if reads.Load() == 0 {
		t.Fatal("no queue read seen")
	}
	if u := unbounded.Load(); u > 0 {
		t.Fatalf("%d of %d queue reads sorted or unlimited", u, reads.Load())
	}
}

// TestStorePeek: Peek reads watched and unwatched keys without waiting
// (absent: nil; an empty value: empty, not nil) and without a write: the
// revision does not move, where the compare-set that read an unwatched
// key before is a transaction etcd logs whatever its outcome.
func TestStorePeek(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: "/test/peek/", Unwatched: []string{"u*"}})
	if err != nil {
		t.Fatal(err)
	}
	s := etcd.NewStore(st, 10*time.Second)
	t.Cleanup(func() { s.Close() })
	// big is over one chunk: stored as a head naming its chunks, which a
	// peek must read whole (a rendezvous state of thousands of nodes).
	big := strings.Repeat("0123456789abcdef", 100_000)
	for k, v := range map[string]string{"k": "v", "empty": "", "u1": "unwatched", "big": big} {
		if err := s.Set(ctx, k, []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	rev := func() int64 {
		resp, err := cli.Get(ctx, "/test/peek/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	before := rev()
	for _, tc := range []struct {
		keys []string
		want []any // string, or nil for absent
	}{
		{[]string{"k"}, []any{"v"}},
		{[]string{"absent"}, []any{nil}},
		{[]string{"empty", "k", "u1", "u2"}, []any{"", "v", "unwatched", nil}},
		{[]string{"k", "big"}, []any{"v", big}},
	} {
		vs, err := s.Peek(ctx, tc.keys...)
		if err != nil || len(vs) != len(tc.keys) {
			t.Fatalf("Peek(%q): %q, %v", tc.keys, vs, err)
		}
		for i, w := range tc.want {
			switch w := w.(type) {
			case nil:
				if vs[i] != nil {
					t.Errorf("Peek(%q)[%d] = %q, want absent", tc.keys, i, vs[i])
				}
			case string:
				if vs[i] == nil || string(vs[i]) != w {
					t.Errorf("Peek(%q)[%d] = %q (nil %v), want %q", tc.keys, i, vs[i], vs[i] == nil, w)
				}
			}
		}
	}
	if after := rev(); after != before {
		t.Errorf("peeks moved the revision from %d to %d", before, after)
	}
}

// TestStoreQueuePushPeek: a push with a look puts the element behind the
// queue's others and reads the key as Peek does (absent: nil; a large
// value whole; unwatched or not), after the push, in one request: one
// revision for the element, none for the read; with a value to create, it
// creates an absent key (in the same revision) and leaves a present one.
func TestStoreQueuePushPeek(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: "/test/pushpeek/", Unwatched: []string{"u*", "q"}})
	if err != nil {
		t.Fatal(err)
	}
	s := etcd.NewStore(st, 10*time.Second)
	t.Cleanup(func() { s.Close() })
	big := strings.Repeat("0123456789abcdef", 100_000)
	for k, v := range map[string]string{"k": "v", "u1": "unwatched", "big": big} {
		if err := s.Set(ctx, k, []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	rev := func() int64 {
		resp, err := cli.Get(ctx, "/test/pushpeek/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	if err := s.QueuePush(ctx, "q", []byte("first")); err != nil {
		t.Fatal(err)
	}
	for i, tc := range []struct {
		look   string
		create []byte
		want   any // string, or nil for absent
	}{
		{"u1", nil, "unwatched"},
		{"absent", nil, nil},
		{"k", nil, "v"},
		{"big", nil, big},
		{"u1", []byte("mine"), "unwatched"},
		{"k", []byte("mine"), "v"},
		{"u2", []byte("mine"), "mine"},
		{"u2", []byte("again"), "mine"},
		{"new", []byte("mine"), "mine"},
	} {
		before := rev()
		v, err := s.QueuePushPeek(ctx, "q", []byte(fmt.Sprint(i)), tc.look, tc.create)
		if err != nil {
			t.Fatalf("QueuePushPeek(%q, %q): %v", tc.look, tc.create, err)
		}
		switch w := tc.want.(type) {
		case nil:
			if v != nil {
				t.Errorf("QueuePushPeek(%q, %q) = %q, want absent", tc.look, tc.create, v)
			}
		case string:
			if v == nil || string(v) != w {
				t.Errorf("QueuePushPeek(%q, %q) = %.40q, want %.40q", tc.look, tc.create, v, w)
			}
		}
		if after := rev(); after != before+1 {
			t.Errorf("QueuePushPeek(%q, %q) moved the revision from %d to %d, want one write", tc.look, tc.create, before, after)
		}
	}
	for k, want := range map[string]string{"u1": "unwatched", "k": "v", "u2": "mine", "new": "mine"} {
		if vs, err := s.Peek(ctx, k); err != nil || string(vs[0]) != want {
			t.Errorf("%s after the pushes: %q, %v; want %q", k, vs, err, want)
		}
	}
	got, err := s.QueuePopBatch(ctx, "q", 20)
	if err != nil || len(got) != 10 || string(got[0]) != "first" || string(got[9]) != "8" {
		t.Fatalf("the queue after the pushes: %q, %v", got, err)
	}
}
