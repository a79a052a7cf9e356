package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// slowMemStore is a memStore whose writes and reads time out now and then,
// as a swamped store's do: one in three, drawn from a seeded source,
// fails with c10d's "timeout after" (ErrTimeout), half of those after it
// was applied (its answer lost) and the rest before. With refuse, every operation is
// refused instead, as by a store that is gone; with never, every one times
// out.
type slowMemStore struct {
	*memStore
	refuse, never bool

	mu   sync.Mutex
	rand *rand.Rand
	slow int // operations that timed out
}

// fails reports whether this call fails, and if so whether it is applied
// first, and with what error.
func (s *slowMemStore) fails(op string) (bool, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.refuse:
		return true, false, fmt.Errorf("%w: test: %s: connection refused", ErrUnavailable, op)
	case s.never || s.rand.IntN(3) == 0:
		s.slow++
		return true, !s.never && s.rand.IntN(2) == 0, fmt.Errorf("%w: test: %s timeout after 2s", ErrTimeout, op)
	}
	return false, false, nil
}

func (s *slowMemStore) slowOps() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.slow
}

func (s *slowMemStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	fail, apply, err := s.fails("COMPARE_SET")
	if !fail || apply {
		b, cerr := s.memStore.CompareSet(ctx, k, expected, desired)
		if !fail {
			return b, cerr
		}
	}
	return nil, err
}

func (s *slowMemStore) QueuePush(ctx context.Context, k string, v []byte) error {
	fail, apply, err := s.fails("QUEUE_PUSH")
	if !fail || apply {
		perr := s.memStore.QueuePush(ctx, k, v)
		if !fail {
			return perr
		}
	}
	return err
}

func (s *slowMemStore) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	if fail, _, err := s.fails("MULTI_GET"); fail {
		return nil, err
	}
	return s.memStore.MultiGet(ctx, keys...)
}

func (s *slowMemStore) Set(ctx context.Context, k string, v []byte) error {
	fail, apply, err := s.fails("SET")
	if !fail || apply {
		serr := s.memStore.Set(ctx, k, v)
		if !fail {
			return serr
		}
	}
	return err
}

// TestNextOutwaitsASlowStore: operations of the rendezvous that time out
// on a store that still answers, applied or not, hold a join up; the
// nodes read afresh and the round completes with every node in it, once,
// each told (OnSlowStore). A store that refuses ends Next at once; one
// that never answers in time ends it at JoinTimeout, not at its first
// timeout. It used to end Next at the first timed-out operation: at 1,024
// real agents on etcd, hundreds of agents exited on "read …/marker: store
// unavailable: … context deadline exceeded" (BENCHMARKS, issue 19).
func TestNextOutwaitsASlowStore(t *testing.T) {
	for _, tc := range []struct {
		name          string
		queues        bool
		refuse, never bool
	}{
		{name: "compare-set"},
		{name: "queues", queues: true},
		{name: "refused", refuse: true},
		{name: "never in time", never: true},
		{name: "never in time, queues", queues: true, never: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := newMemStore()
				if tc.queues {
					m = newQueueMemStore()
				}
				s := &slowMemStore{memStore: m, refuse: tc.refuse, never: tc.never, rand: rand.New(rand.NewPCG(1, 2))}
				var told sync.Map
				const n = 4
				var ds []*Dynamic
				for i := range n {
					cfg := DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, QueueMinNodes: 1, JoinTimeout: 600 * time.Second,
						// No node is dropped for heartbeats that a third of
						// operations timing out held up for 15 s (it would
						// be right to, and the round would start again).
						KeepAliveMaxAttempt: 200,
						OnSlowStore: func(op string, err error) {
							if !errors.Is(err, ErrTimeout) {
								t.Errorf("OnSlowStore(%s, %v): not a timeout", op, err)
							}
							told.Store(i, true)
						}}
					d, err := NewDynamic(s, nd(i), []byte(fmt.Sprint("lws=", i+1)), cfg)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					ds = append(ds, d)
				}
				start := time.Now()
				var results []<-chan bubbleResult
				for _, d := range ds {
					results = append(results, goNext(d, start))
				}
				ranks := map[int]bool{}
				for i, ch := range results {
					x := <-ch
					switch {
					case tc.refuse:
						if !errors.Is(x.err, ErrUnavailable) || x.at > time.Second {
							t.Errorf("node %d: %v after %v; want the refusal at once", i, x.err, x.at)
						}
						continue
					case tc.never:
						if !errors.Is(x.err, ErrTimeout) || x.at < 600*time.Second || x.at > 610*time.Second {
							t.Errorf("node %d: %v after %v; want a timeout at the 600-s join timeout (torchrun's)", i, x.err, x.at)
						}
						continue
					case x.err != nil:
						t.Fatalf("node %d: %v after %v (after %d slow operations)", i, x.err, x.at, s.slowOps())
					}
					if x.r.Size != n || ranks[x.r.Rank] {
						t.Errorf("node %d: rank %d of %d; ranks so far %v", i, x.r.Rank, x.r.Size, ranks)
					}
					ranks[x.r.Rank] = true
				}
				if tc.refuse {
					return
				}
				count := 0
				told.Range(func(any, any) bool { count++; return true })
				if s.slowOps() == 0 || count == 0 {
					t.Errorf("%d operations timed out, %d nodes told; want some of both", s.slowOps(), count)
				}
			})
		})
	}
}

// TestSlowStore: which failures of a store operation a rendezvous waits
// out: timeouts, on a connection or reconnecting, not a refusal (even one
// whose reconnecting then ran out of time: a TCPStore whose host died), a
// reset, a closed store, or anything once the caller's own context has
// ended.
func TestSlowStore(t *testing.T) {
	live := context.Background()
	ended, cancel := context.WithCancel(live)
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"c10d's timeout", live, fmt.Errorf("%w: tcpstore 127.0.0.1:1: COMPARE_SET: timeout after 2s (%w)", ErrTimeout, context.DeadlineExceeded), true},
		{"etcd's op timeout", live, fmt.Errorf("%w: etcd storage get %q: no answer in 1m0s: %w", ErrTimeout, "k", context.DeadlineExceeded), true},
		{"a deadline alone", live, context.DeadlineExceeded, true},
		{"refused", live, fmt.Errorf("%w: reconnect: connection refused", ErrUnavailable), false},
		{"reconnecting refused till the deadline", live, fmt.Errorf("%w: reconnect: timeout after 60s (%w): %w", ErrUnavailable, context.DeadlineExceeded, syscall.ECONNREFUSED), false},
		{"reconnecting timed out (a swamped host's handshake)", live, fmt.Errorf("%w: reconnect: %w: PING timeout after 1s (%w)", ErrUnavailable, ErrTimeout, context.DeadlineExceeded), true},
		{"reconnecting hung up on till the deadline (a proxy whose server died)", live, fmt.Errorf("%w: reconnect: %w after 100ms (%w): handshake: the server hung up: %w", ErrUnavailable, ErrTimeout, context.DeadlineExceeded, io.EOF), false},
		{"reset", live, fmt.Errorf("%w: connection closed by the server (%w)", ErrUnavailable, syscall.ECONNRESET), false},
		{"closed", live, fmt.Errorf("%w (%w)", ErrClosed, ErrTimeout), false},
		{"caller's context ended", ended, fmt.Errorf("%w: timeout after 2s", ErrTimeout), false},
		{"not a store's failure", live, ErrNotInteger, false},
	} {
		if got := slowStore(tc.ctx, tc.err); got != tc.want {
			t.Errorf("%s: slowStore = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// swampedMemStore is a memStore that, while swamped, answers nothing in
// time: every compare-set and set waits 2 s and times out, as a store host
// buried under hundreds of agents does.
type swampedMemStore struct {
	*memStore
	swamped atomic.Bool
}

func (s *swampedMemStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	if s.swamped.Load() {
		time.Sleep(2 * time.Second)
		return nil, fmt.Errorf("%w: test: COMPARE_SET timeout after 2s", ErrTimeout)
	}
	return s.memStore.CompareSet(ctx, k, expected, desired)
}

func (s *swampedMemStore) Set(ctx context.Context, k string, v []byte) error {
	if s.swamped.Load() {
		time.Sleep(2 * time.Second)
		return fmt.Errorf("%w: test: SET timeout after 2s", ErrTimeout)
	}
	return s.memStore.Set(ctx, k, v)
}

// TestSwampedStoreKillsNobody: a store that takes no heartbeat for 40 s
// (longer than the 15-s drop timeout) and then recovers: no member of the
// running round is found dead, however the beats land again (each node
// judges the others' heartbeats as of its own, which did not land either,
// and gives theirs a drop timeout to land after its own did). A member
// that died before the swamp is still found dead after it. Judging by the
// clock alone, the first agent of 512 whose beat got through found every
// other dead.
func TestSwampedStoreKillsNobody(t *testing.T) {
	for _, dead := range []bool{false, true} {
		t.Run(fmt.Sprintf("one dead before=%v", dead), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := &swampedMemStore{memStore: newMemStore()}
				var ds []*Dynamic
				for i := range 3 {
					d, err := NewDynamic(s, nd(i), nil, DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					ds = append(ds, d)
				}
				start := time.Now()
				for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
					if x := <-ch; x.err != nil {
						t.Fatalf("node %d: %v", i, x.err)
					}
				}
				time.Sleep(10 * time.Second)
				if dead {
					ds[2].Close()
				}
				s.swamped.Store(true)
				time.Sleep(40 * time.Second)
				s.swamped.Store(false)
				var lost []NodeDesc
				for range 60 { // a minute after, a look a second
					time.Sleep(time.Second)
					for i, d := range ds[:2] {
						st, err := d.Status(context.Background())
						if err != nil {
							t.Fatalf("node %d: status: %v", i, err)
						}
						if st.Round != 0 {
							t.Fatalf("node %d: the run is at round %d: the round ended", i, st.Round)
						}
						for _, n := range st.Lost {
							if !slices.Contains(lost, n) {
								lost = append(lost, n)
							}
						}
					}
				}
				if want := []NodeDesc(nil); dead {
					want = []NodeDesc{nd(2)}
					if !slices.Equal(lost, want) {
						t.Errorf("lost %v, want %v", lost, want)
					}
				} else if len(lost) != 0 {
					t.Errorf("lost %v after the store recovered; want nobody", lost)
				}
			})
		})
	}
}

// slowPushStore is a queue memStore whose pushes, while slow is set, take
// 7 s to land (longer than a keep-alive's 5-s timeout), as on a store's
// host that hundreds of agents swamp; a push whose caller gives up first
// does not land.
type slowPushStore struct {
	*memStore
	slow   atomic.Bool
	refuse atomic.Bool // every push refused at once
}

// nodesOn makes node i's handle on stores[i], closed at the test's end.
func nodesOn(t *testing.T, cfg DynamicConfig, stores ...Store) []*Dynamic {
	t.Helper()
	var ds []*Dynamic
	for i, s := range stores {
		d, err := NewDynamic(s, nd(i), nil, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds = append(ds, d)
	}
	return ds
}

// slowPushPair starts two nodes on s and their first round, complete.
func slowPushPair(t *testing.T, s *slowPushStore, cfg DynamicConfig) []*Dynamic {
	t.Helper()
	ds := nodesOn(t, cfg, s, s)
	start := time.Now()
	for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start)} {
		if x := <-ch; x.err != nil {
			t.Fatalf("node %d: %v", i, x.err)
		}
	}
	return ds
}

func (s *slowPushStore) QueuePush(ctx context.Context, k string, v []byte) error {
	if s.refuse.Load() {
		return fmt.Errorf("%w: test: QUEUE_PUSH refused", ErrUnavailable)
	}
	if s.slow.Load() {
		t := time.NewTimer(7 * time.Second)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: test: QUEUE_PUSH timeout (%w)", ErrTimeout, ctx.Err())
		case <-t.C:
		}
	}
	return s.memStore.QueuePush(ctx, k, v)
}

// TestSlowPushesKeepHeartbeats: on a store whose every push takes 7 s,
// the members' heartbeats still land within the drop timeout (a
// keep-alive waits for its push up to what the drop timeout leaves, not
// its own 5-s timeout). Given up at 5 s, none landed: the members lived
// on only because each judged the others as of its own stale beat, and
// any node whose writes did get through (a patient Next's) judged every
// member dead — 509 of 512 agents in one write on two cores.
func TestSlowPushesKeepHeartbeats(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &slowPushStore{memStore: newQueueMemStore()}
		cfg := DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 2, QueueMinNodes: 1}
		ds := slowPushPair(t, s, cfg)
		s.slow.Store(true)
		drop := ds[0].cfg.DropTimeout()
		oldest := time.Duration(0)
		for range 60 {
			time.Sleep(time.Second)
			snap, err := ds[0].read(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(snap.st.Nodes) != 2 {
				t.Fatalf("the state holds %+v, want both members", snap.st.Nodes)
			}
			for _, n := range snap.st.Nodes {
				oldest = max(oldest, time.Since(n.Heartbeat))
			}
		}
		if oldest >= drop {
			t.Errorf("a member's heartbeat in the state grew %v old on a slow store; want under the drop timeout (%v)", oldest, drop)
		}
		t.Logf("the oldest heartbeat seen: %v", oldest)
	})
}

// TestOnDropSaysWhom: a node that stops beating is dropped, and whoever
// drops it says so: that node alone, its heartbeat at least a drop timeout
// old, judged as of now (the judge's own beats landed), two nodes kept.
func TestOnDropSaysWhom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var drops []Drop
		cfg := DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, OnDrop: func(d Drop) {
			mu.Lock()
			defer mu.Unlock()
			drops = append(drops, d)
		}}
		ds := bubbleNodes(t, newMemStore(), 3, cfg)
		start := time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
			if x := <-ch; x.err != nil {
				t.Fatalf("node %d: %v", i, x.err)
			}
		}
		time.Sleep(10 * time.Second)
		ds[2].Close()
		for {
			time.Sleep(time.Second)
			st, err := ds[0].Status(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if len(st.Lost) > 0 {
				break
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if len(drops) == 0 {
			t.Fatal("node 2 was lost and nobody said it dropped it")
		}
		drop := ds[0].cfg.DropTimeout()
		for _, d := range drops {
			if !slices.Equal(d.Nodes, []NodeDesc{nd(2)}) || d.Newest < drop || d.Oldest != d.Newest || d.Behind != 0 || d.Kept != 2 || d.Op == "" {
				t.Errorf("drop %+v; want node 2 alone, a heartbeat at least %v old, judged as of now, 2 kept", d, drop)
			}
		}
	})
}

// TestOnKeepAliveFailed: each heartbeat that does not get through is
// told, with the store's error; none while they do.
func TestOnKeepAliveFailed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &slowPushStore{memStore: newQueueMemStore()}
		var mu sync.Mutex
		var errs []error
		cfg := DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 2, QueueMinNodes: 1, OnKeepAliveFailed: func(err error) {
			mu.Lock()
			defer mu.Unlock()
			errs = append(errs, err)
		}}
		slowPushPair(t, s, cfg)
		time.Sleep(12 * time.Second)
		mu.Lock()
		if len(errs) != 0 {
			t.Errorf("%d failures told while every beat got through: %v", len(errs), errs)
		}
		mu.Unlock()
		s.refuse.Store(true)
		time.Sleep(11 * time.Second) // two intervals: two beats a node
		mu.Lock()
		defer mu.Unlock()
		if len(errs) < 4 {
			t.Errorf("%d failures told in two intervals of refused beats from two nodes, want at least 4", len(errs))
		}
		for _, err := range errs {
			if !errors.Is(err, ErrUnavailable) {
				t.Errorf("told %v, want the store's refusal", err)
			}
		}
	})
}

// stallStore is one node's way to a shared store whose every answer,
// while stalled, times out (after 5 s, as a swamped c10d server's client
// does) but its queue pushes, which go through: a node whose reads of
// the round's outcome lag while its beats still land.
type stallStore struct {
	Store
	stalled atomic.Bool
}

// stall times the operation op out while s is stalled.
func (s *stallStore) stall(ctx context.Context, op string) error {
	if !s.stalled.Load() {
		return nil
	}
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	return fmt.Errorf("%w: test: %s timeout after 5s", ErrTimeout, op)
}

func (s *stallStore) Get(ctx context.Context, k string) ([]byte, error) {
	if err := s.stall(ctx, "GET"); err != nil {
		return nil, err
	}
	return s.Store.Get(ctx, k)
}

func (s *stallStore) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	if err := s.stall(ctx, "MULTI_GET"); err != nil {
		return nil, err
	}
	return s.Store.MultiGet(ctx, keys...)
}

func (s *stallStore) Check(ctx context.Context, keys ...string) (bool, error) {
	if err := s.stall(ctx, "CHECK"); err != nil {
		return false, err
	}
	return s.Store.Check(ctx, keys...)
}

func (s *stallStore) Wait(ctx context.Context, keys ...string) error {
	if err := s.stall(ctx, "WAIT"); err != nil {
		return err
	}
	return s.Store.Wait(ctx, keys...)
}

func (s *stallStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	if err := s.stall(ctx, "COMPARE_SET"); err != nil {
		return nil, err
	}
	return s.Store.CompareSet(ctx, k, expected, desired)
}

func (s *stallStore) QueuePop(ctx context.Context, k string, block bool) ([]byte, error) {
	if err := s.stall(ctx, "QUEUE_POP"); err != nil {
		return nil, err
	}
	return s.Store.QueuePop(ctx, k, block)
}

func (s *stallStore) QueueLen(ctx context.Context, k string) (int64, error) {
	if err := s.stall(ctx, "QUEUE_LEN"); err != nil {
		return 0, err
	}
	return s.Store.QueueLen(ctx, k)
}

// TestBeatsWhileNextStalls: a node whose join was folded and whose reads
// then time out for 40 s, while it waits in Next for the round to fill,
// stays in the state: its heartbeats (pushes, which get through) land
// every interval, whatever its Next waits for. They were the Next's own
// decision, taken only when its loop came round, and such a node was
// dropped after the drop timeout (15 s) and went on waiting outside the
// round (512 real agents: the last to leave its Next was dropped as its
// round started). When the third node comes, the round completes with
// all three, and nobody was dropped.
func TestBeatsWhileNextStalls(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var drops []Drop
		cfg := DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, QueueMinNodes: 1, OnDrop: func(d Drop) {
			mu.Lock()
			defer mu.Unlock()
			drops = append(drops, d)
		}}
		m := newQueueMemStore()
		slow := &stallStore{Store: m}
		ds := nodesOn(t, cfg, m, slow, m)
		start := time.Now()
		chs := []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start)}
		inState := func() (bool, time.Duration) {
			snap, err := ds[0].read(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			i, ok := snap.st.find(nd(1))
			if !ok {
				return false, 0
			}
			return true, time.Since(snap.st.Nodes[i].Heartbeat)
		}
		for {
			time.Sleep(100 * time.Millisecond)
			if in, _ := inState(); in {
				break
			}
		}
		slow.stalled.Store(true)
		drop := ds[0].cfg.DropTimeout()
		oldest := time.Duration(0)
		for range 40 {
			time.Sleep(time.Second)
			in, age := inState()
			if !in {
				t.Fatalf("node 1 was dropped from the state %v after its reads began to stall", time.Since(start))
			}
			oldest = max(oldest, age)
		}
		if oldest >= drop {
			t.Errorf("node 1's heartbeat grew %v old while its Next stalled; want under the drop timeout (%v)", oldest, drop)
		}
		slow.stalled.Store(false)
		chs = append(chs, goNext(ds[2], start))
		for i, ch := range chs {
			x := <-ch
			if x.err != nil {
				t.Fatalf("node %d: %v", i, x.err)
			}
			if x.r.Size != 3 {
				t.Errorf("node %d: a round of %d nodes, want 3", i, x.r.Size)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if len(drops) > 0 {
			t.Errorf("nodes dropped: %+v; want none", drops)
		}
		t.Logf("node 1's oldest heartbeat while it stalled: %v", oldest)
	})
}
