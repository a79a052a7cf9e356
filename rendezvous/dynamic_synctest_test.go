package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// The executor in a synctest bubble: torchrun's default timers (30 s last
// call, 15 s to declare a node dead, 600 s join timeout) run in no real
// time, and the instants at which things happen can be asserted exactly.
// The store is memStore, whose waits block on channels, as a bubble needs
// (a socket read is not "durably blocked").

// memStore is the part of a Store that the dynamic rendezvous uses, in
// memory. It counts compare-sets, to show that waiting does not poll.
type memStore struct {
	Store // nil: the other methods are not used and would panic

	mu      sync.Mutex
	kv      map[string][]byte
	changed chan struct{} // closed and replaced on every write
	cas     atomic.Int64
	queues  map[string][][]byte // nil: no queues
	writes  map[string]int      // per key
}

func newMemStore() *memStore {
	return &memStore{kv: map[string][]byte{}, changed: make(chan struct{}), writes: map[string]int{}}
}

// newQueueMemStore is a memStore with queues, on which Next queues its
// requests (dynamic_queue.go); a plain memStore has none, as a FileStore,
// so the executor compare-sets the state itself.
func newQueueMemStore() *memStore {
	m := newMemStore()
	m.queues = map[string][][]byte{}
	return m
}

func (m *memStore) QueuePush(_ context.Context, k string, v []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.queues == nil {
		return ErrNotSupported
	}
	m.queues[k] = append(m.queues[k], slices.Clone(v))
	return nil
}

func (m *memStore) QueuePop(_ context.Context, k string, block bool) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.queues == nil || block:
		return nil, ErrNotSupported
	case len(m.queues[k]) == 0:
		return nil, ErrQueueEmpty
	}
	v := m.queues[k][0]
	m.queues[k] = m.queues[k][1:]
	return v, nil
}

func (m *memStore) QueueLen(_ context.Context, k string) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.queues == nil {
		return 0, ErrNotSupported
	}
	return int64(len(m.queues[k])), nil
}

// write stores v under k; mu must be held.
func (m *memStore) write(k string, v []byte) {
	m.writes[k]++
	m.kv[k] = slices.Clone(v)
	close(m.changed)
	m.changed = make(chan struct{})
}

func (m *memStore) Set(_ context.Context, k string, v []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.write(k, v)
	return nil
}

func (m *memStore) MultiSet(_ context.Context, keys []string, values [][]byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range keys {
		m.write(k, values[i])
	}
	return nil
}

func (m *memStore) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	if err := m.Wait(ctx, keys...); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([][]byte, len(keys))
	for i, k := range keys {
		out[i] = slices.Clone(m.kv[k])
	}
	return out, nil
}

func (m *memStore) CompareSet(_ context.Context, k string, expected, desired []byte) ([]byte, error) {
	m.cas.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, ok := m.kv[k]
	switch {
	case ok && string(cur) == string(expected), !ok && len(expected) == 0:
		m.write(k, desired)
		return slices.Clone(desired), nil
	case !ok:
		return slices.Clone(expected), nil
	default:
		return slices.Clone(cur), nil
	}
}

func (m *memStore) Delete(_ context.Context, k string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.kv[k]
	delete(m.kv, k)
	return ok, nil
}

func (m *memStore) Wait(ctx context.Context, keys ...string) error {
	for {
		m.mu.Lock()
		all := true
		for _, k := range keys {
			if _, ok := m.kv[k]; !ok {
				all = false
			}
		}
		ch := m.changed
		m.mu.Unlock()
		if all {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("mem wait %v: %w: %w", keys, ErrTimeout, ctx.Err())
		case <-ch:
		}
	}
}

// bubbleNodes makes n handles on one memStore; they close at cleanup.
func bubbleNodes(t *testing.T, m *memStore, n int, cfg DynamicConfig) []*Dynamic {
	t.Helper()
	ds := make([]*Dynamic, n)
	for i := range ds {
		d, err := NewDynamic(m, nd(i), []byte(fmt.Sprint("lws=", i+1)), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds[i] = d
	}
	return ds
}

type bubbleResult struct {
	r   Round
	err error
	at  time.Duration // since the bubble's start
}

// goNext starts Next on d and delivers its result, timed from start.
func goNext(d *Dynamic, start time.Time) <-chan bubbleResult {
	ch := make(chan bubbleResult, 1)
	go func() {
		r, err := d.Next(context.Background())
		ch <- bubbleResult{r, err, time.Since(start)}
	}()
	return ch
}

// TestBubbleLastCall: 2 of 2:3 nodes; the round completes exactly one last
// call (30 s) after the second joined, and a third joining during the last
// call extends it.
func TestBubbleLastCall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		lastCall(t, m)
		// A minute of waiting cost about a read and a heartbeat per node
		// every 5 s (72; more when their heartbeats, due at one instant,
		// collide), not a poll a second (180, heartbeats aside).
		if n := m.cas.Load(); n > 120 {
			t.Errorf("%d compare-sets for 3 nodes over 60 s", n)
		}
	})
}

// lastCall is TestBubbleLastCall's scenario on m, in a bubble.
func lastCall(t *testing.T, m *memStore) {
	// QueueMinNodes 1: on a store with queues, these few nodes queue too.
	ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 4, QueueMinNodes: 1})
	start := time.Now()
	a := goNext(ds[0], start)
	time.Sleep(10 * time.Second)
	b := goNext(ds[1], start)
	time.Sleep(20 * time.Second) // 20 s into the last call
	c := goNext(ds[2], start)
	for i, ch := range []<-chan bubbleResult{a, b, c} {
		x := <-ch
		if x.err != nil {
			t.Fatalf("node %d: %v", i, x.err)
		}
		// Third joined at 30 s: the last call ends at 60 s and is
		// acted on the moment it has passed.
		if x.at != 60*time.Second+time.Nanosecond || x.r.Rank != i || len(x.r.Members) != 3 {
			t.Errorf("node %d: at %v rank %d of %d", i, x.at, x.r.Rank, len(x.r.Members))
		}
	}
}

// TestBubbleJoinTimeout: a lone node of min 2 gives up after exactly 600 s,
// rolling itself back out of the state.
func TestBubbleJoinTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		joinTimeout(t, m)
		// It woke once per heartbeat (5 s) over 600 s, not once a second.
		if n := m.cas.Load(); n > 2*600/5+10 {
			t.Errorf("%d compare-sets in 600 s", n)
		}
	})
}

// joinTimeout is TestBubbleJoinTimeout's scenario on m, in a bubble.
func joinTimeout(t *testing.T, m *memStore) {
	ds := bubbleNodes(t, m, 2, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 2, QueueMinNodes: 1})
	start := time.Now()
	x := <-goNext(ds[0], start)
	if !errors.Is(x.err, ErrRendezvousTimeout) || !errors.Is(x.err, ErrTimeout) {
		t.Fatalf("Next: %v", x.err)
	}
	if x.at != 600*time.Second+time.Nanosecond {
		t.Errorf("timed out at %v", x.at)
	}
	st, err := ds[1].Status(context.Background())
	if err != nil || st.Participants != 0 {
		t.Errorf("after the rollback: %+v, %v", st, err)
	}
}

// TestBubbleDeadNode: a member that stops (Close, no Leave) is reported
// lost once its heartbeat is more than 15 s old, and the survivors'
// next round (2 of 2:3) completes a last call later without it.
func TestBubbleDeadNode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 3})
		start := time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
			if x := <-ch; x.err != nil || x.at != 0 {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
		time.Sleep(62 * time.Second) // heartbeats keep everyone in
		if st, _ := ds[0].Status(context.Background()); st.Lost != nil || st.Participants != 3 {
			t.Fatalf("alive: %+v", st)
		}
		ds[2].Close()
		// Its last heartbeat was at 60 s (they fall every 5 s); it is dead
		// once more than 15 s older than that: at the first look after 75 s.
		for {
			st, err := ds[0].Status(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if st.Lost != nil {
				if !slices.Equal(st.Lost, []NodeDesc{nd(2)}) || time.Since(start) != 75*time.Second+100*time.Millisecond {
					t.Fatalf("lost %v at %v", st.Lost, time.Since(start))
				}
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		// Both survivors leave the holed round to rejoin: round 1 expects
		// nobody else, so it completes as the second rejoins, without the
		// 30 s last call.
		start = time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start)} {
			x := <-ch
			if x.err != nil || x.r.Number != 1 || len(x.r.Members) != 2 || x.r.Rank != i || x.at != 0 {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
	})
}

// TestBubbleRejoinerDies: of round 0's three members, all leave it to
// rejoin (a restart), and one dies before it joins again. The other two
// do not wait for it past its heartbeat's TTL (15 s after it left), nor
// for the last call they started (30 s): round 1 completes when the dead
// rejoiner is forgotten.
func TestBubbleRejoinerDies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		cfg := DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 3}
		ds := bubbleNodes(t, m, 3, cfg)
		start := time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
			if x := <-ch; x.err != nil || x.at != 0 {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
		// Node 2 leaves round 0 to rejoin (Next's exit), and dies before
		// its join: its exit is played on the core, as Next would run it.
		ds[2].Close()
		snap, err := ds[0].read(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		st := snap.st.clone()
		if !st.apply(nextExitAction(st, nd(2), time.Now(), time.Now().Add(time.Hour)), nd(2), nil, time.Now(), cfg.withDefaults()) {
			t.Fatal("exit changed nothing")
		}
		if ok, err := ds[0].commit(context.Background(), snap, st, time.Time{}); err != nil || !ok {
			t.Fatalf("commit: %v %v", ok, err)
		}
		start = time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start)} {
			x := <-ch
			if x.err != nil || x.r.Number != 1 || len(x.r.Members) != 2 || x.r.Rank != i || x.at != 15*time.Second+time.Nanosecond {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
	})
}

// TestBubbleClockSkew: the clock is the handle's own (injected here).
// Within the 15-s heartbeat TTL, skew is harmless. A node whose clock runs
// 20 s ahead sees everyone else's heartbeats as expired — torchrun's node
// would drop them all, since heartbeats are wall-clock times written by
// each node — but all of them at once, and the crowd's rule (crowdJudged)
// gives them one more TTL: nobody is dropped.
func TestBubbleClockSkew(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3})
		var skew atomic.Int64
		skew.Store(int64(10 * time.Second))
		ds[1].now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
		start := time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
			if x := <-ch; x.err != nil || x.r.Rank != i {
				t.Fatalf("node %d with 10 s skew among them: %+v", i, x)
			}
		}
		skew.Store(int64(20 * time.Second))
		st, err := ds[1].Status(context.Background())
		if err != nil || len(st.Lost) != 0 {
			t.Fatalf("20 s ahead: %+v, %v", st, err)
		}
	})
}

// TestCommitStateDeleted: a compare-set on a key that somebody deleted
// comes back with the expected value (c10d's quirk). The writer must see
// that as a lost race on a fresh, empty state — not loop on its stale
// token.
func TestCommitStateDeleted(t *testing.T) {
	m := newMemStore()
	ctx := context.Background()
	d, err := NewDynamic(m, nd(0), nil, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	snap, err := d.read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st := snap.st.clone()
	st.apply(actAddToParticipants, nd(0), nil, time.Now(), d.cfg)
	if won, err := d.commit(ctx, snap, st, time.Time{}); !won || err != nil {
		t.Fatalf("first commit: %v, %v", won, err)
	}
	if _, err := m.Delete(ctx, d.key); err != nil {
		t.Fatal(err)
	}
	st = snap.st.clone()
	st.apply(actMarkClosed, nd(0), nil, time.Now(), d.cfg)
	won, err := d.commit(ctx, snap, st, time.Time{})
	if won || err != nil || len(snap.st.Nodes) != 0 || snap.st.Closed || string(m.kv[d.key]) != string(emptyState) {
		t.Fatalf("commit on a deleted state: won %v, %v; now %+v, stored %s", won, err, snap.st, m.kv[d.key])
	}
	// And Next simply proceeds on the fresh state.
	if r, err := d.Next(ctx); err != nil || r.Number != 0 || len(r.Members) != 1 {
		t.Fatalf("Next: %+v, %v", r, err)
	}
}

// TestBubbleStateReset: the state is deleted while its wake-up keys stay.
// A waiter then finds the key it waits on already there; it must not spin
// on it, and the rendezvous still completes.
func TestBubbleStateReset(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3})
		start := time.Now()
		for _, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
			if x := <-ch; x.err != nil {
				t.Fatal(x.err)
			}
		}
		if _, ok := m.kv[ds[0].wakeKey(1)]; !ok {
			t.Fatal("completion left no wake-up key")
		}
		m.Delete(context.Background(), ds[0].key)
		m.cas.Store(0)
		start = time.Now()
		first := goNext(ds[0], start) // alone in a fresh state: waits on wake/1, which exists
		time.Sleep(2 * time.Second)
		if n := m.cas.Load(); n > 10 {
			t.Fatalf("%d compare-sets in 2 s: the waiter spins", n)
		}
		rest := []<-chan bubbleResult{goNext(ds[1], start), goNext(ds[2], start)}
		for i, ch := range append([]<-chan bubbleResult{first}, rest...) {
			x := <-ch
			// The first waiter learns of completion at its next look,
			// within a heartbeat interval.
			if x.err != nil || x.r.Number != 0 || x.r.Rank != i || x.at > 7*time.Second {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
	})
}

// TestCrowdRule: one node of four that stops beating is dropped a drop
// timeout (15 s) after its last beat; three of four that stop at once are
// dropped one drop timeout later than that (crowdJudged), not before.
func TestCrowdRule(t *testing.T) {
	for _, tc := range []struct {
		name       string
		dead       []int
		keptAt     time.Duration // nobody lost this long after they stopped
		lostWithin time.Duration
	}{
		{"one", []int{3}, 10 * time.Second, 21 * time.Second},
		{"three at once", []int{1, 2, 3}, 25 * time.Second, 36 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ds := bubbleNodes(t, newMemStore(), 4, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 4, LastCallTimeout: time.Second})
				start := time.Now()
				var chs []<-chan bubbleResult
				for _, d := range ds {
					chs = append(chs, goNext(d, start))
				}
				for i, ch := range chs {
					if x := <-ch; x.err != nil {
						t.Fatalf("node %d: %v", i, x.err)
					}
				}
				var want []NodeDesc
				for _, i := range tc.dead {
					if err := ds[i].stopKeepAlive(); err != nil {
						t.Fatal(err)
					}
					want = append(want, nd(i))
				}
				stopped := time.Now()
				for {
					time.Sleep(500 * time.Millisecond)
					st, err := ds[0].Status(context.Background())
					if err != nil {
						t.Fatal(err)
					}
					took := time.Since(stopped)
					if len(st.Lost) > 0 {
						if !slices.Equal(st.Lost, want) || took <= tc.keptAt {
							t.Errorf("lost %v after %v; want %v, after %v", st.Lost, took, want, tc.keptAt)
						}
						return
					}
					if took > tc.lostWithin {
						t.Fatalf("nobody lost %v after %d stopped beating", took, len(tc.dead))
					}
				}
			})
		})
	}
}

// TestBubbleExpelledWaiterRejoins: a node taken out of a forming round on
// its behalf (the launcher's expulsion of a node whose etcd lease lapsed,
// as a starved agent's does) while its own Next still waits there is back
// in the round within one heartbeat interval, and the round completes
// with it: without queues the leave's write wakes it at once; through the
// queue its next look (at its heartbeat, 5 s) finds it out.
func TestBubbleExpelledWaiterRejoins(t *testing.T) {
	for _, queues := range []bool{false, true} {
		t.Run(fmt.Sprintf("queues=%v", queues), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := newMemStore()
				if queues {
					m = newQueueMemStore()
				}
				cfg := DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, QueueMinNodes: 1}
				ds := bubbleNodes(t, m, 3, cfg)
				start := time.Now()
				a, b := goNext(ds[0], start), goNext(ds[1], start)
				time.Sleep(10 * time.Second)
				h, err := NewDynamic(m, nd(0), nil, cfg)
				if err != nil {
					t.Fatal(err)
				}
				if err := h.Leave(context.Background()); err != nil {
					t.Fatal(err)
				}
				h.Close()
				out := time.Now()
				// Through the queue it is out until its next look; without,
				// the leave's wake-up may have it back before this read.
				if st, err := ds[1].Status(context.Background()); err != nil || queues && st.Participants != 1 {
					t.Fatalf("after the expulsion: %+v, %v; want 1 participant", st, err)
				}
				for {
					st, err := ds[1].Status(context.Background())
					if err != nil {
						t.Fatal(err)
					}
					if st.Participants == 2 {
						break
					}
					if since := time.Since(out); since > 5*time.Second {
						t.Fatalf("the expelled node not back %v after", since)
					}
					time.Sleep(100 * time.Millisecond)
				}
				c := goNext(ds[2], start)
				for i, ch := range []<-chan bubbleResult{a, b, c} {
					if x := <-ch; x.err != nil || len(x.r.Members) != 3 || x.r.Rank != i {
						t.Fatalf("node %d: %+v (%v)", i, x.r, x.err)
					}
				}
			})
		})
	}
}
