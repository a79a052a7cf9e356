package etcd_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

var prefixes atomic.Int64

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
// node, and a counter loses no increment.
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
	for range 10 {
		if _, err := ns[1].cli.Add(ctx, "n", 1); err != nil {
			t.Fatal(err)
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
