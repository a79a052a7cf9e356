package etcd_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

var prefixes atomic.Int64

// interceptedClient is a client of cluster whose every unary call goes
// through interceptor: how a test counts etcd requests or loses replies.
func interceptedClient(t *testing.T, cluster *etcdtest.Cluster, interceptor grpc.UnaryClientInterceptor) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: cluster.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(interceptor)},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// testStorage is a Storage on cli under a prefix of the test's own,
// closed at cleanup.
func testStorage(t *testing.T, ctx context.Context, cli *clientv3.Client) *etcd.Storage {
	t.Helper()
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: fmt.Sprintf("/test/%s/", t.Name())})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// node is one gorun node's worker store: a tcpstore server on the etcd
// storage, and a client of it.
type node struct {
	st  *etcd.Storage
	srv *tcpstore.Server
	cli *tcpstore.Client
}

// startNodes starts n servers on one fresh prefix of cli's etcd.
func startNodes(t *testing.T, cli *clientv3.Client, n int) []*node {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prefix := fmt.Sprintf("/test/%s/%d/", t.Name(), prefixes.Add(1))
	var nodes []*node
	for range n {
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, OpTimeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{Storage: st, GoroutinePerConn: true})
		if err != nil {
			t.Fatal(err)
		}
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			c.Close()
			srv.Close()
			st.Close()
		})
		nodes = append(nodes, &node{st, srv, c})
	}
	return nodes
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestStorageAcrossNodes: two servers on one etcd serve one store: every
// write through one is seen through the other, waits and barriers are
// released across, counters and compare-set are atomic across.
func TestStorageAcrossNodes(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)

	t.Run("wait released by a set on the other node", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		done := make(chan error, 1)
		go func() { done <- ns[0].cli.Wait(ctx, "a", "b") }()
		if err := ns[1].cli.Set(ctx, "a", []byte("1")); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			t.Fatalf("wait returned after one of two keys: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
		if err := ns[1].cli.Set(ctx, "b", []byte("2")); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		v, err := ns[0].cli.Get(ctx, "b")
		if err != nil || string(v) != "2" {
			t.Fatalf("get through node 0 = %q, %v", v, err)
		}
	})

	t.Run("add is atomic across nodes", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 60*time.Second)
		const workers, adds = 8, 25
		var wg sync.WaitGroup
		for i := range workers {
			c, err := tcpstore.Dial(ctx, ns[i%2].srv.Addr().String(), tcpstore.ClientConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range adds {
					if _, err := c.Add(ctx, "n", 1); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		n, err := ns[0].cli.Add(ctx, "n", 0)
		if err != nil || n != workers*adds {
			t.Fatalf("total = %d, %v; want %d", n, err, workers*adds)
		}
	})

	t.Run("compare_set has one winner across nodes", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		var wins atomic.Int64
		var wg sync.WaitGroup
		for i := range 10 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				mine := []byte(fmt.Sprint("w", i))
				v, err := ns[i%2].cli.CompareSet(ctx, "leader", nil, mine)
				if err != nil {
					t.Error(err)
					return
				}
				if bytes.Equal(v, mine) {
					wins.Add(1)
				}
			}()
		}
		wg.Wait()
		if wins.Load() != 1 {
			t.Fatalf("%d winners", wins.Load())
		}
		// absent key with a non-empty expected answers expected
		v, err := ns[1].cli.CompareSet(ctx, "nokey", []byte("e"), []byte("d"))
		if err != nil || string(v) != "e" {
			t.Fatalf("compare_set on an absent key = %q, %v", v, err)
		}
	})

	t.Run("barrier across nodes", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		const n = 4
		errs := make(chan error, n)
		for i := range n - 1 {
			// A client runs one call at a time: one client per arrival.
			c, err := tcpstore.Dial(ctx, ns[i%2].srv.Addr().String(), tcpstore.ClientConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			go func() { errs <- c.Barrier(ctx, "bar", n) }()
		}
		select {
		case err := <-errs:
			t.Fatalf("barrier released before the last arrival: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
		if err := ns[1].cli.Barrier(ctx, "bar", n); err != nil {
			t.Fatal(err)
		}
		for range n - 1 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("queues across nodes", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		got := make(chan []byte, 2)
		for range 2 {
			go func() {
				v, err := ns[0].cli.QueuePop(ctx, "q", true)
				if err != nil {
					t.Error(err)
				}
				got <- v
			}()
		}
		time.Sleep(50 * time.Millisecond)
		for _, v := range []string{"x", "y"} {
			if err := ns[1].cli.QueuePush(ctx, "q", []byte(v)); err != nil {
				t.Fatal(err)
			}
		}
		a, b := <-got, <-got
		if !(string(a) == "x" && string(b) == "y" || string(a) == "y" && string(b) == "x") {
			t.Fatalf("popped %q, %q", a, b)
		}
		for _, v := range []string{"1", "2", "3"} {
			if err := ns[0].cli.QueuePush(ctx, "fifo", []byte(v)); err != nil {
				t.Fatal(err)
			}
		}
		// QUEUE_PUSH has no reply: an answered request on the same
		// connection orders them before what follows.
		if _, err := ns[0].cli.QueueLen(ctx, "fifo"); err != nil {
			t.Fatal(err)
		}
		if n, err := ns[1].cli.QueueLen(ctx, "fifo"); err != nil || n != 3 {
			t.Fatalf("queue_len = %d, %v", n, err)
		}
		for _, want := range []string{"1", "2", "3"} {
			v, err := ns[1].cli.QueuePop(ctx, "fifo", false)
			if err != nil || string(v) != want {
				t.Fatalf("pop = %q, %v; want %q", v, err, want)
			}
		}
		if _, err := ns[1].cli.QueuePop(ctx, "fifo", false); !errors.Is(err, rendezvous.ErrQueueEmpty) {
			t.Fatalf("pop of an empty queue: %v", err)
		}
	})

	t.Run("watch_key sees the other node's changes with old values", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		evs := make(chan tcpstore.WatchEvent, 10)
		// The client sends keys with c10d's leading "/".
		cancel, err := ns[0].st.Watch([]byte("/w"), func(ev tcpstore.WatchEvent) { evs <- ev })
		if err != nil {
			t.Fatal(err)
		}
		defer cancel()
		if err := ns[1].cli.Set(ctx, "w", []byte("a")); err != nil {
			t.Fatal(err)
		}
		if _, err := ns[1].cli.Add(ctx, "other", 1); err != nil { // not watched
			t.Fatal(err)
		}
		if err := ns[1].cli.Set(ctx, "w", []byte("b")); err != nil {
			t.Fatal(err)
		}
		if _, err := ns[1].cli.Delete(ctx, "w"); err != nil {
			t.Fatal(err)
		}
		want := []tcpstore.WatchEvent{
			{Type: tcpstore.KeyCreated, Key: []byte("/w"), New: []byte("a")},
			{Type: tcpstore.KeyUpdated, Key: []byte("/w"), Old: []byte("a"), New: []byte("b")},
			{Type: tcpstore.KeyDeleted, Key: []byte("/w"), Old: []byte("b")},
		}
		for _, w := range want {
			select {
			case ev := <-evs:
				if ev.Type != w.Type || string(ev.Key) != string(w.Key) || string(ev.Old) != string(w.Old) || string(ev.New) != string(w.New) {
					t.Fatalf("event %+v; want %+v", ev, w)
				}
			case <-ctx.Done():
				t.Fatalf("no event %+v", w)
			}
		}
		select {
		case ev := <-evs:
			t.Fatalf("extra event %+v", ev)
		case <-time.After(100 * time.Millisecond):
		}
	})

	t.Run("keys, check, delete across nodes", func(t *testing.T) {
		ns := startNodes(t, cli, 2)
		ctx := testCtx(t, 20*time.Second)
		if err := ns[0].cli.MultiSet(ctx, []string{"a", "b"}, [][]byte{[]byte("1"), []byte("2")}); err != nil {
			t.Fatal(err)
		}
		if _, err := ns[0].cli.NumKeys(ctx); err != nil { // orders the MULTI_SET (no reply)
			t.Fatal(err)
		}
		if err := ns[1].cli.Append(ctx, "a", []byte("+")); err != nil {
			t.Fatal(err)
		}
		if _, err := ns[1].cli.NumKeys(ctx); err != nil { // orders the APPEND (no reply)
			t.Fatal(err)
		}
		if v, err := ns[0].cli.Get(ctx, "a"); err != nil || string(v) != "1+" {
			t.Fatalf("append across = %q, %v", v, err)
		}
		if ok, err := ns[1].cli.Check(ctx, "a", "b"); err != nil || !ok {
			t.Fatalf("check = %v, %v", ok, err)
		}
		if n, err := ns[1].cli.NumKeys(ctx); err != nil || n != 2 {
			t.Fatalf("num_keys = %d, %v", n, err)
		}
		if ok, err := ns[1].cli.Delete(ctx, "a"); err != nil || !ok {
			t.Fatalf("delete = %v, %v", ok, err)
		}
		keys, err := ns[0].cli.ListKeys(ctx)
		if err != nil || len(keys) != 1 || keys[0] != "b" {
			t.Fatalf("list_keys after delete = %q, %v", keys, err)
		}
	})
}

// TestStorageLeaderLoss: on a 3-member cluster, a wait registered before the
// leader is killed is released by a set made after, through the other
// node, and a counter loses no increment. The first increment after the
// kill waits about one AttemptTimeout (2 s), sent again once a new leader
// is elected, not the member's own request timeout (5 s plus two election
// timeouts: 6 s here) for a request its dead leader took.
func TestStorageLeaderLoss(t *testing.T) {
	cluster := etcdtest.Start(t, 3, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 2)
	ctx := testCtx(t, 60*time.Second)
	for range 10 {
		if _, err := ns[0].cli.Add(ctx, "n", 1); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan error, 1)
	go func() { done <- ns[0].cli.Wait(ctx, "after") }()
	time.Sleep(50 * time.Millisecond)
	leader, err := cluster.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	leader.Kill()
	for i := range 10 {
		start := time.Now()
		if _, err := ns[1].cli.Add(ctx, "n", 1); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > 4500*time.Millisecond {
			t.Fatalf("increment %d after the leader's kill took %v; want about the 2-s attempt timeout", i, took)
		}
	}
	if err := ns[1].cli.Set(ctx, "after", []byte("x")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("wait not released after the leader change")
	}
	if err := leader.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := ns[0].cli.Add(ctx, "n", 0); err != nil || n != 20 {
		t.Fatalf("counter = %d, %v; want 20", n, err)
	}
}

// TestStorageCloseDropsTokens: the tokens that make read-modify-writes
// idempotent go with the Storage that wrote them, so that agents coming
// and going do not leave keys behind; the data stays.
func TestStorageCloseDropsTokens(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 20*time.Second)
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if _, err := st.Add([]byte(fmt.Sprint("n", i)), 1); err != nil {
			t.Fatal(err)
		}
	}
	count := func(dir string) int64 {
		r, err := cli.Get(ctx, prefix+dir, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return r.Count
	}
	if n := count("m/t/"); n == 0 {
		t.Fatal("no token written: the test tests nothing")
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if n := count("m/t/"); n != 0 {
		t.Fatalf("%d tokens left after Close", n)
	}
	if n := count("k/"); n != 10 {
		t.Fatalf("%d keys after Close; want the 10 counters", n)
	}
}

// TestStorageLostReply: etcd applies a request but its answer is lost (as
// when the leader dies right after committing). Every operation is sent
// again, and none is applied twice: an increment counts once, a queue
// element is pushed once, a compare-set whose write landed reports it.
func TestStorageLostReply(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	var drop atomic.Int64 // replies still to lose
	var dropped atomic.Int64
	lose := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err == nil && strings.HasSuffix(method, "/Txn") && drop.Add(-1) >= 0 {
			dropped.Add(1)
			return status.Error(codes.Unavailable, "reply lost by the test")
		}
		return err
	}
	cli := interceptedClient(t, cluster, lose)
	ctx := testCtx(t, 20*time.Second)
	st := testStorage(t, ctx, cli)

	for i := 1; i <= 3; i++ {
		drop.Store(1)
		if n, err := st.Add([]byte("n"), 1); err != nil || n != int64(i) {
			t.Fatalf("add %d after a lost reply = %d, %v; want %d", i, n, err, i)
		}
	}
	drop.Store(1)
	if v, err := st.CompareSet([]byte("k"), nil, []byte("first")); err != nil || string(v) != "first" {
		t.Fatalf("compare_set after a lost reply = %q, %v; want first", v, err)
	}
	drop.Store(1)
	if err := st.QueuePush([]byte("q"), []byte("x")); err != nil {
		t.Fatal(err)
	}
	if n, err := st.QueueLen([]byte("q")); err != nil || n != 1 {
		t.Fatalf("queue length after a push whose reply was lost = %d, %v; want 1", n, err)
	}
	if got := dropped.Load(); got != 5 {
		t.Fatalf("%d replies lost; the test meant to lose 5", got)
	}
	if v, ok, err := st.Get([]byte("n")); err != nil || !ok || string(v) != "3" {
		t.Fatalf("counter = %q, %v, %v; want 3", v, ok, err)
	}
}

// TestStorageBatches: many callers at once share etcd requests (group
// commit), including callers writing the same key, which etcd would refuse
// in one transaction.
func TestStorageBatches(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	var txns atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if strings.HasSuffix(method, "/Txn") {
			txns.Add(1)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cli := interceptedClient(t, cluster, count)
	ctx := testCtx(t, 20*time.Second)
	st := testStorage(t, ctx, cli)

	// run starts every op at once and returns how many etcd
	// transactions they took.
	run := func(n int, op func(i int) error) int64 {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				if err := op(i); err != nil {
					t.Error(err)
				}
			})
		}
		txns.Store(0)
		close(start)
		wg.Wait()
		return txns.Load()
	}
	const callers = 96
	n := run(callers, func(i int) error {
		if i%2 == 0 {
			_, _, err := st.Get([]byte(fmt.Sprint("key", i-1)))
			return err
		}
		return st.Set([]byte(fmt.Sprint("key", i)), []byte("v"))
	})
	t.Logf("%d sets and gets of distinct keys in %d etcd transactions", callers, n)
	if n > callers/4 {
		t.Fatalf("%d transactions for %d concurrent operations; want them batched", n, callers)
	}
	n = run(callers, func(i int) error {
		_, err := st.Add([]byte(fmt.Sprint("ctr", i)), 1)
		return err
	})
	t.Logf("%d adds of distinct counters in %d etcd transactions", callers, n)
	if n > callers/4 {
		t.Fatalf("%d transactions for %d concurrent adds; want them batched", n, callers)
	}
	// Writes of one key cannot share a transaction: they take turns.
	run(callers, func(i int) error {
		if i%2 == 0 {
			_, err := st.Add([]byte("shared"), 1)
			return err
		}
		return st.Set([]byte("same"), []byte(fmt.Sprint(i)))
	})
	if v, err := st.Add([]byte("shared"), 0); err != nil || v != callers/2 {
		t.Fatalf("shared counter = %d, %v; want %d", v, err, callers/2)
	}
}

// TestStorageUnwatched: an unwatched key reads and writes like any other,
// on every node, and is listed; nothing may wait on it.
func TestStorageUnwatched(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 20*time.Second)
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	var sts []*etcd.Storage
	for range 2 {
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, Unwatched: []string{"state"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		sts = append(sts, st)
	}
	if v, err := sts[0].CompareSet([]byte("state"), nil, []byte("v1")); err != nil || string(v) != "v1" {
		t.Fatalf("compare_set = %q, %v", v, err)
	}
	if err := sts[0].Set([]byte("plain"), []byte("p")); err != nil {
		t.Fatal(err)
	}
	if v, ok, err := sts[1].Get([]byte("state")); err != nil || !ok || string(v) != "v1" {
		t.Fatalf("get through the other node = %q, %v, %v", v, ok, err)
	}
	if v, err := sts[1].CompareSet([]byte("state"), []byte("v1"), []byte("v2")); err != nil || string(v) != "v2" {
		t.Fatalf("compare_set through the other node = %q, %v", v, err)
	}
	keys, err := sts[0].Keys()
	if err != nil || len(keys) != 2 {
		t.Fatalf("keys = %q, %v; want plain and state", keys, err)
	}
	if n, err := sts[0].NumKeys(); err != nil || n != 2 {
		t.Fatalf("num_keys = %d, %v", n, err)
	}
	r, err := cli.Get(ctx, prefix+"k/state")
	if err != nil || r.Count != 0 {
		t.Fatalf("the unwatched key is among the watched: %v, %v", r, err)
	}
	if _, _, err := sts[0].Wait([][]byte{[]byte("plain"), []byte("state")}, func() {}); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Fatalf("wait on an unwatched key: %v", err)
	}
	if _, _, err := sts[0].Barrier([]byte("state"), 2, func() {}); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Fatalf("barrier on an unwatched key: %v", err)
	}
	if _, err := sts[0].Watch([]byte("state"), func(tcpstore.WatchEvent) {}); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Fatalf("watch_key on an unwatched key: %v", err)
	}
}

// TestStorageStartRevision: given a revision the caller has seen, a new
// Storage makes no request, and its watch, replaying from there, releases
// waits as one that read the revision itself.
func TestStorageStartRevision(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	var calls atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		calls.Add(1)
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cli := interceptedClient(t, cluster, count)
	ctx := testCtx(t, 20*time.Second)
	r, err := cli.Get(ctx, "any")
	if err != nil {
		t.Fatal(err)
	}
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	writer, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { writer.Close() })
	if err := writer.Set([]byte("before"), []byte("1")); err != nil {
		t.Fatal(err)
	}
	calls.Store(0)
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, StartRevision: r.Header.Revision})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if n := calls.Load(); n != 0 {
		t.Fatalf("NewStorage with a start revision made %d requests", n)
	}
	released := make(chan struct{})
	cancel, done, err := st.Wait([][]byte{[]byte("before"), []byte("after")}, func() { close(released) })
	if err != nil || done {
		t.Fatalf("wait = %v, %v; want it registered", done, err)
	}
	defer cancel()
	if err := writer.Set([]byte("after"), []byte("2")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-released:
	case <-ctx.Done():
		t.Fatal("wait not released")
	}
}

// TestStorageSmallTxnLimit: a member run with a lower --max-txn-ops than
// etcd's default refuses big batches; they are split, and every operation
// still lands.
func TestStorageSmallTxnLimit(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{Args: []string{"--max-txn-ops", "8"}})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	st := testStorage(t, ctx, cli)
	const n = 100
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			if err := st.Set([]byte(fmt.Sprint("k", i)), []byte("v")); err != nil {
				t.Error(err)
			}
		})
	}
	close(start)
	wg.Wait()
	if got, err := st.NumKeys(); err != nil || got != n {
		t.Fatalf("num_keys = %d, %v; want %d", got, err, n)
	}
}

// TestStorageLargeValues: values over one etcd request's limit (1.5 MiB
// by default) are stored in chunks, with every operation as on any value:
// set and get across nodes, a waiter released by the write, compare-set
// and append on and to large values, add refusing one, check, num_keys and
// list_keys counting the key once. (Sets and appends go to the storage
// itself after the first: they have no answer on the wire, so a read
// through another node could overtake them.) The chunks go with the value that
// owns them: overwritten (large or small) or deleted, none is left.
func TestStorageLargeValues(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 2)
	ctx := testCtx(t, 60*time.Second)
	fill := func(n int, seed byte) []byte {
		v := make([]byte, n)
		for i := range v {
			v[i] = seed + byte(i%251)
		}
		return v
	}
	prefix := ns[0].st.Prefix()
	const bigKey = "/big" // as the storage sees "big" from a client (c10d prepends "/")
	chunks := func() int64 {
		r, err := cli.Get(ctx, prefix+"c/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return r.Count
	}
	big, bigger := fill(5<<20+17, 1), fill(3<<20, 2)
	// A waiter on the other node is released by the large write and
	// reads it whole.
	waited := make(chan error, 1)
	go func() {
		if err := ns[1].cli.Wait(ctx, "big"); err != nil {
			waited <- err
			return
		}
		v, err := ns[1].cli.Get(ctx, "big")
		if err == nil && !bytes.Equal(v, big) {
			err = fmt.Errorf("the waiter read %d bytes, not the %d written", len(v), len(big))
		}
		waited <- err
	}()
	time.Sleep(100 * time.Millisecond)
	for _, step := range []struct {
		name   string
		do     func() error
		want   []byte // big's value after, nil: absent
		chunks int64
	}{
		{"set 5 MiB", func() error { return ns[0].cli.Set(ctx, "big", big) }, big, 6},
		{"overwrite with 3 MiB", func() error { return ns[1].st.Set([]byte(bigKey), bigger) }, bigger, 3},
		{"compare-set a stale expected", func() error {
			got, err := ns[0].cli.CompareSet(ctx, "big", big, []byte("x"))
			if err == nil && !bytes.Equal(got, bigger) {
				err = fmt.Errorf("compare-set answered %d bytes, want the current %d", len(got), len(bigger))
			}
			return err
		}, bigger, 3},
		{"compare-set large over large", func() error {
			got, err := ns[0].cli.CompareSet(ctx, "big", bigger, big)
			if err == nil && !bytes.Equal(got, big) {
				err = fmt.Errorf("compare-set answered %d bytes", len(got))
			}
			return err
		}, big, 6},
		{"append to large", func() error { return ns[1].st.Append([]byte(bigKey), []byte("tail")) }, append(bytes.Clone(big), "tail"...), 6},
		{"add refuses a large value", func() error {
			if _, err := ns[0].st.Add([]byte(bigKey), 1); !errors.Is(err, rendezvous.ErrNotInteger) {
				return fmt.Errorf("add: %v, want ErrNotInteger", err)
			}
			return nil
		}, append(bytes.Clone(big), "tail"...), 6},
		{"compare-set small over large", func() error {
			_, err := ns[0].cli.CompareSet(ctx, "big", append(bytes.Clone(big), "tail"...), []byte("small"))
			return err
		}, []byte("small"), 0},
		{"compare-set large over small", func() error {
			_, err := ns[1].cli.CompareSet(ctx, "big", []byte("small"), bigger)
			return err
		}, bigger, 3},
		{"overwrite with small", func() error { return ns[0].st.Set([]byte(bigKey), []byte("small")) }, []byte("small"), 0},
		{"a small value that starts like a head", func() error {
			return ns[0].st.Set([]byte(bigKey), []byte("\x00gorun/etcd-chunked/1\x00g 1 4"))
		}, []byte("\x00gorun/etcd-chunked/1\x00g 1 4"), 1},
		{"set large again", func() error { return ns[0].st.Set([]byte(bigKey), big) }, big, 6},
		{"delete", func() error {
			ok, err := ns[1].cli.Delete(ctx, "big")
			if err == nil && !ok {
				err = errors.New("delete found nothing")
			}
			return err
		}, nil, 0},
	} {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if step.name == "set 5 MiB" {
			if err := <-waited; err != nil {
				t.Fatal(err)
			}
		}
		for i, n := range ns {
			v, ok, err := n.st.Get([]byte(bigKey))
			if err != nil || ok != (step.want != nil) || !bytes.Equal(v, step.want) {
				t.Fatalf("%s: node %d gets %d bytes, %v, %v; want %d", step.name, i, len(v), ok, err, len(step.want))
			}
		}
		if step.want != nil {
			if k, err := ns[1].st.Keys(); err != nil || len(k) != 1 || string(k[0]) != bigKey {
				t.Fatalf("%s: keys %q, %v", step.name, k, err)
			}
			if n, err := ns[1].st.NumKeys(); err != nil || n != 1 {
				t.Fatalf("%s: num_keys %d, %v", step.name, n, err)
			}
			if ok, err := ns[0].st.Check([][]byte{[]byte(bigKey)}); err != nil || !ok {
				t.Fatalf("%s: check %v, %v", step.name, ok, err)
			}
		}
		if n := chunks(); n != step.chunks {
			t.Fatalf("%s: %d chunks in etcd, want %d", step.name, n, step.chunks)
		}
	}
}

// TestStorageLargeKeyOrElement: what is not chunked — a key, a queue
// element — is still refused at once when over one etcd request, with
// ErrTooLarge.
func TestStorageLargeKeyOrElement(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 1)
	start := time.Now()
	if err := ns[0].st.Set(bytes.Repeat([]byte("k"), 2<<20), []byte("x")); !errors.Is(err, rendezvous.ErrTooLarge) {
		t.Errorf("Set with a 2 MiB key: %v, want ErrTooLarge", err)
	}
	if err := ns[0].st.QueuePush([]byte("q"), make([]byte, 2<<20)); !errors.Is(err, rendezvous.ErrTooLarge) {
		t.Errorf("QueuePush of 2 MiB: %v, want ErrTooLarge", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the refusals took %v: retried as if transient", took)
	}
}

// TestStorageLargeValueNeverHalf: a reader on one node never sees half of
// a large value that another node overwrites meanwhile: every read is one
// whole value written.
func TestStorageLargeValueNeverHalf(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 2)
	values := [][]byte{bytes.Repeat([]byte("a"), 4<<20), bytes.Repeat([]byte("b"), 3<<20+5), []byte("small")}
	if err := ns[0].st.Set([]byte("v"), values[0]); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := ns[0].st.Set([]byte("v"), values[i%len(values)]); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	reads := 0
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); reads++ {
		v, ok, err := ns[1].st.Get([]byte("v"))
		if err != nil || !ok {
			t.Fatalf("get: %v, %v", ok, err)
		}
		if !slices.ContainsFunc(values, func(w []byte) bool { return bytes.Equal(v, w) }) {
			t.Fatalf("read %d bytes starting %q: no value written", len(v), v[:min(len(v), 8)])
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d whole reads", reads)
}

// TestStorageTorchLargeValues: PyTorch 1.13 and 2.14 clients on two
// nodes' servers of one etcd-backed store: values of 16 MB and 100 MB set
// through one node are read whole through the other, then deleted (no
// key, no chunk and no mark left).
func TestStorageTorchLargeValues(t *testing.T) {
	clients := []struct {
		name   string
		python func(t *testing.T) string
	}{
		{"1.13", func(t *testing.T) string { return torchtest.Python(t) }},
		{"2.14", func(t *testing.T) string { return sidbed.Require(t).Python() }},
	}
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) { testTorchLargeValues(t, c.python(t), cli) })
	}
}

func testTorchLargeValues(t *testing.T, python string, cli *clientv3.Client) {
	ns := startNodes(t, cli, 2)
	const script = `
import sys, datetime, time
import torch.distributed as dist
T = datetime.timedelta(seconds=120)
a = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=T)
b = dist.TCPStore("127.0.0.1", int(sys.argv[2]), None, False, timeout=T)
for key, n in (("v16", 16_000_000), ("v100", 100_000_000)):
    val = bytes(range(256)) * (n // 256)
    t0 = time.perf_counter()
    a.set(key, val)
    got = b.get(key)
    print(repr((key, len(got), got == val)), "%.0f ms" % ((time.perf_counter() - t0) * 1e3), flush=True)
    b.delete_key(key)
print(repr(("num_keys", a.num_keys())), flush=True)
`
	ctx := testCtx(t, 150*time.Second)
	port := func(n *node) string { return strconv.Itoa(n.srv.Addr().(*net.TCPAddr).Port) }
	out := torchtest.StartWith(t, python, nil, script, port(ns[0]), port(ns[1])).Wait(t, 140*time.Second)
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		v, ms, _ := strings.Cut(line, ") ")
		if ms != "" {
			t.Logf("%s) set through one node, read through the other: %s", v, ms)
			v += ")"
		}
		got = append(got, v)
	}
	want := []string{"('v16', 16000000, True)", "('v100', 100000000, True)", "('num_keys', 0)"}
	if !slices.Equal(got, want) {
		t.Fatalf("torch clients printed %q, want %q", got, want)
	}
	prefix := ns[0].st.Prefix()
	for _, dir := range []string{"c/", "m/w/"} {
		r, err := cli.Get(ctx, prefix+dir, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil || r.Count != 0 {
			t.Fatalf("%v keys under %s left after the deletes (%v)", r, dir, err)
		}
	}
}
