package rendezvous

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// foldRequest applies a queued Next as its node would: exit, then join.
func TestFoldRequest(t *testing.T) {
	cfg := coreCfg() // 2:4
	req := func(i int, call uint64) request {
		return request{Node: nd(i), Data: []byte("req"), Call: call, Deadline: at(600 * time.Second)}
	}
	withCall := func(e nodeState, call uint64) nodeState { e.Call = call; return e }
	ranked := func(e nodeState, rank int) nodeState { e.Rank = rank; return e }
	now := at(10 * time.Second)
	// stampedNow: node 0's heartbeat is the fold's instant.
	stampedNow := func(t *testing.T, s *dynState) {
		if !s.Nodes[0].Heartbeat.Equal(now) {
			t.Fatalf("%+v", s.Nodes)
		}
	}
	for _, tc := range []struct {
		name    string
		st      *dynState
		r       request
		changed bool
		check   func(t *testing.T, s *dynState)
	}{{
		name: "a fresh node joins, with its call",
		st:   mkState(dynState{}),
		r:    req(1, 7), changed: true,
		check: func(t *testing.T, s *dynState) {
			if len(s.Nodes) != 1 || s.Nodes[0].Waiting || s.Nodes[0].Call != 7 || string(s.Nodes[0].Data) != "req" || !s.Nodes[0].Heartbeat.Equal(now) {
				t.Fatalf("%+v", s.Nodes)
			}
		},
	}, {
		name: "the join that fills the round completes it",
		st:   mkState(dynState{Deadline: at(35 * time.Second)}, part(0, 5*time.Second), part(2, 5*time.Second), part(3, 5*time.Second)),
		r:    req(1, 7), changed: true,
		check: func(t *testing.T, s *dynState) {
			if !s.Complete || s.Size != 4 || s.Nodes[1].Rank != 1 || s.Nodes[1].Call != 7 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a member of a complete round leaves it and joins the next, which it starts",
		st:   mkState(dynState{Complete: true, Size: 2}, ranked(part(0, 5*time.Second), 0), ranked(part(1, 5*time.Second), 1)),
		r:    req(1, 8), changed: true,
		check: func(t *testing.T, s *dynState) {
			// Node 1 left to rejoin; node 0 still holds round 0, so node 1
			// waits in the list for round 1, its exit recorded.
			if s.Round != 0 || len(s.Nodes) != 2 || !s.Nodes[1].Waiting || s.Nodes[1].Call != 8 || len(s.Rejoin) != 1 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "the same request again does not take the node out again",
		st: mkState(dynState{Round: 1, Deadline: at(40 * time.Second), Rejoin: []rejoiner{{NodeDesc: nd(0)}, {NodeDesc: nd(1)}}},
			withCall(part(1, 8*time.Second), 8)),
		r: req(1, 8),
		check: func(t *testing.T, s *dynState) {
			if s.Round != 1 || len(s.Nodes) != 1 || s.Nodes[0].Waiting || !s.Nodes[0].Heartbeat.Equal(at(8*time.Second)) {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a new call of the same node does leave its round",
		st: mkState(dynState{Complete: true, Size: 2},
			ranked(withCall(part(0, 5*time.Second), 3), 0), ranked(withCall(part(1, 5*time.Second), 8), 1)),
		r: req(1, 9), changed: true,
		check: func(t *testing.T, s *dynState) {
			if len(s.Rejoin) != 1 || s.Rejoin[0].NodeDesc != nd(1) || !s.Nodes[1].Waiting || s.Nodes[1].Call != 9 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a complete, full round leaves an outsider out",
		st: mkState(dynState{Complete: true, Size: 4}, ranked(part(0, 5*time.Second), 0), ranked(part(2, 5*time.Second), 1),
			ranked(part(3, 5*time.Second), 2), ranked(part(4, 5*time.Second), 3)),
		r: req(1, 7),
		check: func(t *testing.T, s *dynState) {
			if p, w := s.role(nd(1)); p || w {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a complete round with room puts an outsider in the wait list",
		st:   mkState(dynState{Complete: true, Size: 2}, ranked(part(0, 5*time.Second), 0), ranked(part(2, 5*time.Second), 1)),
		r:    req(1, 7), changed: true,
		check: func(t *testing.T, s *dynState) {
			if _, w := s.role(nd(1)); !w || s.Nodes[1].Call != 7 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a closed run takes nobody",
		st:   mkState(dynState{Closed: true}),
		r:    req(1, 7),
		check: func(t *testing.T, s *dynState) {
			if len(s.Nodes) != 0 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "past its deadline a participant rolls itself back",
		st:   mkState(dynState{}, withCall(part(0, 5*time.Second), 7)),
		r:    request{Node: nd(0), Call: 7, Deadline: at(9 * time.Second)}, changed: true,
		check: func(t *testing.T, s *dynState) {
			if len(s.Nodes) != 0 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "past the rollback window, nothing",
		st:   mkState(dynState{}),
		r:    request{Node: nd(0), Call: 7, Deadline: at(time.Second)},
		check: func(t *testing.T, s *dynState) {
			if len(s.Nodes) != 0 {
				t.Fatalf("%+v", s)
			}
		},
	}, {
		name: "a queued heartbeat refreshes a due one, stamped when folded",
		st:   mkState(dynState{Complete: true, Size: 1}, part(0, 4*time.Second)),
		r:    request{Node: nd(0), KeepAlive: true, Deadline: at(15 * time.Second)}, changed: true,
		check: stampedNow,
	}, {
		name: "a heartbeat folded after its deadline still counts, stamped when folded",
		st:   mkState(dynState{Complete: true, Size: 1}, part(0, 2*time.Second)),
		r:    request{Node: nd(0), KeepAlive: true, Deadline: at(3 * time.Second)}, changed: true,
		check: stampedNow,
	}, {
		name: "a queued heartbeat does not put a dropped node back",
		st:   mkState(dynState{Complete: true, Size: 1}, part(1, 4*time.Second)),
		r:    request{Node: nd(0), KeepAlive: true, Deadline: at(15 * time.Second)},
		check: func(t *testing.T, s *dynState) {
			if len(s.Nodes) != 1 || s.Nodes[0].NodeDesc != nd(1) {
				t.Fatalf("%+v", s.Nodes)
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.st.clone()
			if got := s.foldRequest(tc.r, now, cfg); got != tc.changed {
				t.Errorf("changed = %v, want %v", got, tc.changed)
			}
			tc.check(t, s)
			// Folding it a second time changes nothing more.
			again := s.clone()
			if again.foldRequest(tc.r, now, cfg) {
				t.Errorf("a second fold changed %+v into %+v", s, again)
			}
		})
	}
}

// TestBubbleQueuedLastCall is TestBubbleLastCall on a store with queues:
// every Next's writes go through the request queue, and torchrun's
// timing holds to the nanosecond.
func TestBubbleQueuedLastCall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		lastCall(t, m)
		// Every join was folded; a keep-alive pushed since may wait for
		// the next fold, and so may a copy of a join already applied (a
		// request pushed again at its node's look, left by the folder
		// that completed the round). Read under the store's lock: it may
		// come now.
		m.mu.Lock()
		queued := slices.Clone(m.queues["gorun.rendezvous.job"+queueSuffix])
		state := slices.Clone(m.kv["gorun.rendezvous.job"])
		m.mu.Unlock()
		var st dynState
		if err := json.Unmarshal(state, &st); err != nil {
			t.Fatal(err)
		}
		for _, b := range queued {
			var r request
			if err := json.Unmarshal(b, &r); err != nil {
				t.Errorf("a request that does not decode left in the queue: %s (%v)", b, err)
				continue
			}
			if i, ok := st.find(r.Node); !r.KeepAlive && (!ok || st.Nodes[i].Call != r.Call) {
				t.Errorf("a join whose call the state does not record as done left in the queue: %s", b)
			}
		}
	})
}

// TestBubbleQueuedRestartAndDeadFolder: three nodes rendezvous and
// restart together through the queue (round 1 completes at once: every
// rejoiner is back); then a folder dies holding the lock (a lock value
// nobody will release), and the next restart still completes, once the
// lock has expired (4 s on), at the requesters' next look: a request
// unanswered for KeepAliveTimeout (5 s) is pushed again, and folded.
func TestBubbleQueuedRestartAndDeadFolder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 3, QueueMinNodes: 1})
		all := func(round int, want time.Duration) {
			t.Helper()
			start := time.Now()
			chs := []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)}
			for i, ch := range chs {
				x := <-ch
				if x.err != nil || x.r.Number != round || x.r.Rank != i || len(x.r.Members) != 3 || x.at > want {
					t.Fatalf("round %d, node %d: %+v (%v)", round, i, x, x.err)
				}
			}
		}
		all(0, 0)
		all(1, 0)
		dead := lockValue{holder: nd(99).String(), expiry: time.Now().Add(4 * time.Second), start: time.Now()}.bytes()
		m.Set(context.Background(), "gorun.rendezvous.job"+lockSuffix, dead)
		all(2, 5*time.Second)
	})
}

// TestBubbleQueuedJoinTimeout: a lone node gives up after exactly 600 s
// and takes itself out, through the queue as well.
func TestBubbleQueuedJoinTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		joinTimeout(t, newQueueMemStore())
	})
}

// TestBubbleQueuedNoQueues: on a store without queues the executor
// compare-sets the state itself, and remembers not to try again.
func TestBubbleQueuedNoQueues(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newMemStore()
		ds := bubbleNodes(t, m, 2, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 2, QueueMinNodes: 1})
		start := time.Now()
		for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start)} {
			if x := <-ch; x.err != nil || x.r.Rank != i {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
		if !ds[0].noQueue.Load() || !ds[1].noQueue.Load() {
			t.Error("the handles kept trying queues")
		}
	})
}

// TestBubbleQueuedHeartbeats: 32 members of a round keep their heartbeats
// through the queue: a minute later all are alive, having written the
// state about once per lazy fold (1 s), not once per heartbeat (32 every
// 5 s); then one stops and is lost once its last heartbeat, stamped when
// it was folded, is 15 s old, at the next fold.
func TestBubbleQueuedHeartbeats(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		const n = 32
		ds := bubbleNodes(t, m, n, DynamicConfig{RunID: "job", MinNodes: n - 1, MaxNodes: n, QueueMinNodes: 1})
		start := time.Now()
		chs := make([]<-chan bubbleResult, n)
		for i := range ds {
			chs[i] = goNext(ds[i], start)
		}
		for i, ch := range chs {
			if x := <-ch; x.err != nil || x.r.Rank != i {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
		m.mu.Lock()
		w0 := m.writes["gorun.rendezvous.job"]
		m.mu.Unlock()
		time.Sleep(60 * time.Second)
		m.mu.Lock()
		w := m.writes["gorun.rendezvous.job"] - w0
		m.mu.Unlock()
		if st, err := ds[0].Status(context.Background()); err != nil || st.Lost != nil || st.Participants != n {
			t.Fatalf("after a minute: %+v, %v", st, err)
		}
		if w > 75 {
			t.Errorf("%d writes of the state in 60 s", w)
		}
		t.Logf("%d writes of the state in 60 s of heartbeats from %d nodes", w, n)
		ds[n-1].Close()
		closed := time.Now()
		for {
			st, err := ds[0].Status(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if st.Lost != nil {
				// Its last heartbeat was pushed at most 5 s before it
				// stopped, and folded at most 1 s after the push; the
				// fold that drops it comes up to an interval after the
				// window (Status leaves the drop to the folds).
				if took := time.Since(closed); took < 10*time.Second || took > 22*time.Second {
					t.Errorf("lost %v after %v", st.Lost, took)
				}
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
}

// joinAll runs every node's Next at once and fails the test unless all
// return a round.
func joinAll(t *testing.T, ds []*Dynamic) {
	t.Helper()
	start := time.Now()
	chs := make([]<-chan bubbleResult, len(ds))
	for i := range ds {
		chs[i] = goNext(ds[i], start)
	}
	for i, ch := range chs {
		if x := <-ch; x.err != nil {
			t.Fatalf("node %d: %+v", i, x)
		}
	}
}

// quietTrio starts three queued nodes' first round on m, complete, and
// stops their keep-alives: the test beats for them.
func quietTrio(t *testing.T, m *memStore, onDrop func(Drop)) []*Dynamic {
	t.Helper()
	ds := bubbleNodes(t, m, 3, DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, QueueMinNodes: 1, OnDrop: onDrop})
	start := time.Now()
	for i, ch := range []<-chan bubbleResult{goNext(ds[0], start), goNext(ds[1], start), goNext(ds[2], start)} {
		if x := <-ch; x.err != nil {
			t.Fatalf("node %d: %+v", i, x)
		}
	}
	for _, d := range ds {
		if err := d.stopKeepAlive(); err != nil {
			t.Fatal(err)
		}
	}
	return ds
}

// TestBubbleQueuedBeatsBeforeJudging: a batch's heartbeats count before
// the folder judges the state. Node 1's beats did not get through for 32 s
// (twice the drop timeout) and then one lands: the fold that carries it
// keeps node 1, and drops node 2, whose beats never came. Judged first,
// node 1 was dropped with its beat in the folder's hands (a beat does not
// put a dropped node back).
func TestBubbleQueuedBeatsBeforeJudging(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		ds := quietTrio(t, m, nil)
		ctx := context.Background()
		fold := func(nodes ...int) {
			t.Helper()
			var reqs []request
			for _, i := range nodes {
				reqs = append(reqs, request{Node: nd(i), KeepAlive: true, Deadline: time.Now().Add(ds[0].cfg.KeepAliveTimeout)})
			}
			snap, err := ds[0].read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := ds[0].apply(ctx, snap, reqs, true); err != nil {
				t.Fatal(err)
			}
		}
		drop := ds[0].cfg.DropTimeout()
		time.Sleep(drop + time.Second) // every beat in the state is old
		// Node 0 finds itself silent too: it judges as of its own last
		// beat for a drop timeout, beating all the while; then as of now.
		for range int(drop / (5 * time.Second)) {
			fold(0)
			time.Sleep(5 * time.Second)
		}
		time.Sleep(time.Second)
		fold(0, 1)
		snap, err := ds[0].read(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var in []NodeDesc
		for _, n := range snap.st.Nodes {
			in = append(in, n.NodeDesc)
		}
		if want := []NodeDesc{nd(0), nd(1)}; !slices.Equal(in, want) {
			t.Errorf("the state holds %v, want %v", in, want)
		}
	})
}

// TestBubbleSmallRunsDoNotQueue: below QueueMinNodes (32 by default) a
// run compare-sets its state directly even on a store with queues.
func TestBubbleSmallRunsDoNotQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		ds := bubbleNodes(t, m, 2, DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 31})
		start := time.Now()
		a, b := goNext(ds[0], start), goNext(ds[1], start)
		time.Sleep(31 * time.Second) // the last call
		for i, ch := range []<-chan bubbleResult{a, b} {
			if x := <-ch; x.err != nil || x.r.Rank != i {
				t.Fatalf("node %d: %+v", i, x)
			}
		}
		if len(m.queues) != 0 {
			t.Errorf("queues used: %v", m.queues)
		}
	})
}

// TestBubbleQueuedStatusLeavesTheDropToTheFolds: in queue mode a member
// that stops beating is dropped by a fold, not by the others' Status
// polls: an expired heartbeat that a fold has judged since does not send
// every poll to the state (at 512 agents, every poller reading and
// writing back the whole state each second swamped the store). Every node
// sees the loss within the drop window and two intervals of its last beat
// (the folds of in-phase beats are an interval apart).
func TestBubbleQueuedStatusLeavesTheDropToTheFolds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		const n = 32
		ops := make(chan string, 64)
		cfg := DynamicConfig{RunID: "job", MinNodes: n - 1, MaxNodes: n, QueueMinNodes: 1, OnDrop: func(d Drop) { ops <- d.Op }}
		ds := bubbleNodes(t, m, n, cfg)
		joinAll(t, ds)
		time.Sleep(10 * time.Second)
		if err := ds[n-1].stopKeepAlive(); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		limit := ds[0].cfg.DropTimeout() + 2*ds[0].cfg.HeartbeatInterval()
		for lost := 0; lost < n-1; {
			time.Sleep(time.Second)
			if time.Since(stopped) > limit {
				t.Fatalf("%d of %d saw the loss %v after the last beat", lost, n-1, limit)
			}
			lost = 0
			for _, d := range ds[:n-1] {
				st, err := d.Status(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if len(st.Lost) > 0 {
					lost++
				}
			}
		}
		var by []string
		for len(ops) > 0 {
			by = append(by, <-ops)
		}
		if !slices.Contains(by, "fold") || slices.Contains(by, "status") {
			t.Errorf("dropped by %v; want by a fold, never by a Status", by)
		}
	})
}

// TestNoDropWhileBeatsWaitInTheQueue: nobody drops a node while requests
// wait in the queue, as its beat may be among them. A fold whose batch
// leaves requests queued applies their beats but judges nobody; the first
// that empties the queue drops a node that is silent. A Status that finds
// a heartbeat lapsed while requests are queued reports no loss and writes
// nothing; once the folds have applied the queued beat, the node is alive.
// (At 512 real agents, folds cut short by their time and Status readers
// dropped live nodes whose beats were still in the queue.)
func TestNoDropWhileBeatsWaitInTheQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		ds := quietTrio(t, m, nil)
		ctx := context.Background()
		beat := func(i int) request {
			return request{Node: nd(i), KeepAlive: true, Deadline: time.Now().Add(ds[0].cfg.KeepAliveTimeout)}
		}
		fold := func(drained bool, nodes ...int) {
			t.Helper()
			var reqs []request
			for _, i := range nodes {
				reqs = append(reqs, beat(i))
			}
			snap, err := ds[0].read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := ds[0].apply(ctx, snap, reqs, drained); err != nil {
				t.Fatal(err)
			}
		}
		in := func(i int) bool {
			t.Helper()
			snap, err := ds[0].read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			_, ok := snap.st.find(nd(i))
			return ok
		}
		drop := ds[0].cfg.DropTimeout()
		// Nodes 0 and 1 beat; node 2 is silent for two drop timeouts,
		// while every batch leaves requests in the queue.
		for range 2 * int(drop/(5*time.Second)) {
			time.Sleep(5 * time.Second)
			fold(false, 0, 1)
		}
		if !in(2) {
			t.Fatal("a batch that left requests queued dropped node 2")
		}
		fold(true, 0, 1)
		if in(2) {
			t.Fatalf("node 2, silent %v, is still in the state after a batch that emptied the queue", 2*drop)
		}

		// Node 1 is silent past the drop timeout, its beat queued and not
		// yet folded: Status leaves it be.
		time.Sleep(drop + time.Second)
		fold(true, 0)
		b, err := json.Marshal(beat(1))
		if err != nil {
			t.Fatal(err)
		}
		if err := m.QueuePush(ctx, ds[0].key+queueSuffix, b); err != nil {
			t.Fatal(err)
		}
		for range 3 { // past any marker's grace: the state is read
			time.Sleep(ds[0].cfg.HeartbeatInterval())
			fold(false, 0)
		}
		st, err := ds[0].Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(st.Lost, nd(1)) || !in(1) {
			t.Fatalf("Status found %v lost (node 1 in the state: %v) while node 1's beat waited in the queue", st.Lost, in(1))
		}
		snap, err := ds[0].read(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ds[0].fold(ctx, snap, nil); err != nil {
			t.Fatal(err)
		}
		snap, err = ds[0].read(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if i, ok := snap.st.find(nd(1)); !ok || time.Since(snap.st.Nodes[i].Heartbeat) > time.Second {
			t.Errorf("node 1 gone or its beat old after the fold (in the state: %v); want its queued beat applied", ok)
		}
	})
}

// bigReads counts one node's reads of the run's O(N) keys, the state and
// the member list, through Get, MultiGet and CompareSet (the state's read).
type bigReads struct {
	Store
	keys []string
	n    atomic.Int64
}

func (s *bigReads) count(keys ...string) {
	for _, k := range keys {
		if slices.Contains(s.keys, k) {
			s.n.Add(1)
		}
	}
}

func (s *bigReads) Get(ctx context.Context, k string) ([]byte, error) {
	s.count(k)
	return s.Store.Get(ctx, k)
}

func (s *bigReads) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	s.count(keys...)
	return s.Store.MultiGet(ctx, keys...)
}

func (s *bigReads) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	s.count(k)
	return s.Store.CompareSet(ctx, k, expected, desired)
}

// TestStatusNamesTheLostFromTheMarker: when a member of a complete round
// is lost, the others' Status polls name it from the marker (O(lost)
// bytes), reading neither the state nor the member list (O(N) each); only
// the folds read the state. At 512 real agents every survivor read both
// as the loss became known, all at once, on the store's host; and again,
// in restart mode, once the first of them had left the round to rejoin.
func TestStatusNamesTheLostFromTheMarker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		const n = 8
		cfg := DynamicConfig{RunID: "job", MinNodes: n - 1, MaxNodes: n, QueueMinNodes: 1, ShareOnly: true}
		var stores []Store
		var counted []*bigReads
		for range n {
			b := &bigReads{Store: m, keys: []string{"gorun.rendezvous.job", "gorun.rendezvous.job" + membersSuffix}}
			stores, counted = append(stores, b), append(counted, b)
		}
		ds := nodesOn(t, cfg, stores...)
		joinAll(t, ds)
		ds[n-1].Close()
		// Node 0 alone folds: the others' beats are pushed for them (as
		// their keep-alives would, without the keep-alives' lazy folds,
		// which read the state), and they only poll.
		for _, d := range ds[1 : n-1] {
			if err := d.stopKeepAlive(); err != nil {
				t.Fatal(err)
			}
		}
		ctx := context.Background()
		beats := time.Now()
		beat := func() {
			t.Helper()
			if time.Since(beats) < ds[0].cfg.HeartbeatInterval() {
				return
			}
			beats = time.Now()
			for i := 1; i < n-1; i++ {
				b, err := json.Marshal(request{Node: nd(i), KeepAlive: true, Call: 1, Deadline: time.Now().Add(5 * time.Second)})
				if err != nil {
					t.Fatal(err)
				}
				if err := m.QueuePush(ctx, ds[0].key+queueSuffix, b); err != nil {
					t.Fatal(err)
				}
			}
		}
		deadline := time.Now().Add(time.Minute)
		for {
			time.Sleep(time.Second)
			beat()
			st, err := ds[0].Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(st.Lost) > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("node 0 never saw node 7 lost")
			}
		}
		for _, c := range counted[1 : n-1] {
			c.n.Store(0)
		}
		for range 3 {
			for i, d := range ds[1 : n-1] {
				st, err := d.Status(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(st.Lost, []NodeDesc{nd(n - 1)}) || st.Participants != n-1 {
					t.Fatalf("node %d: Status %+v, want node %d lost and %d participants", i+1, st, n-1, n-1)
				}
			}
			time.Sleep(time.Second)
			beat()
		}
		for i, c := range counted[1 : n-1] {
			if got := c.n.Load(); got > 0 {
				t.Errorf("node %d read the state or the member list %d times to learn of the loss; want none (the marker names it)", i+1, got)
			}
		}

		// Nodes 1 and 2 restart, as survivors in restart mode do: each
		// leaves the round to rejoin and waits in the wait list. The
		// others' polls still learn of the loss from the marker, which
		// counts the rejoiners without naming them (at 512 agents it
		// named every one, and Status, finding nodes waiting, read the
		// state and the member list instead).
		rctx, stop := context.WithCancel(ctx)
		var rejoins sync.WaitGroup
		for _, d := range ds[1:3] {
			rejoins.Go(func() { d.Next(rctx) })
		}
		defer func() { stop(); rejoins.Wait() }()
		for {
			time.Sleep(time.Second)
			beat()
			vs, err := m.MultiGet(ctx, ds[0].key+markerSuffix)
			if err != nil {
				t.Fatal(err)
			}
			var mk marker
			if err := json.Unmarshal(vs[0], &mk); err != nil {
				t.Fatal(err)
			}
			if mk.Rejoining == 2 {
				if !slices.Equal(mk.Gone, []NodeDesc{nd(n - 1)}) || mk.Waiting != 2 {
					t.Fatalf("marker %+v: want node %d gone and the 2 rejoiners waiting", mk, n-1)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the marker never counted nodes 1 and 2 rejoining: %+v", mk)
			}
		}
		for _, c := range counted[3 : n-1] {
			c.n.Store(0)
		}
		for i, d := range ds[3 : n-1] {
			st, err := d.Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(st.Lost, []NodeDesc{nd(n - 1)}) || st.Waiting != 2 || st.Participants != n-3 {
				t.Fatalf("node %d, while 2 rejoin: Status %+v, want node %d lost, 2 waiting, %d participants", i+3, st, n-1, n-3)
			}
		}
		for i, c := range counted[3 : n-1] {
			if got := c.n.Load(); got > 0 {
				t.Errorf("node %d read the state or the member list %d times while others rejoined; want none", i+3, got)
			}
		}
	})
}

// TestQueuedNextDropsNobody: a queued Next that decides on the state (its
// view stale, say) judges it for its own decision only: what it pushes
// goes to a fold, which judges the state as it is then and says whom it
// drops. It does not say it drops anyone itself (at 512 agents such a
// Next "dropped" 199 live nodes that nobody dropped).
func TestQueuedNextDropsNobody(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var ops []string
		ds := quietTrio(t, newQueueMemStore(), func(d Drop) {
			mu.Lock()
			defer mu.Unlock()
			ops = append(ops, d.Op)
		})
		// Nodes 0 and 2 beat (their folds judging nobody); node 1 is
		// silent past the drop timeout.
		ctx := context.Background()
		var snap *snapshot
		for range 4 {
			time.Sleep(5 * time.Second)
			var err error
			if snap, err = ds[0].read(ctx); err != nil {
				t.Fatal(err)
			}
			beats := []request{{Node: nd(0), KeepAlive: true, Deadline: time.Now().Add(5 * time.Second)},
				{Node: nd(2), KeepAlive: true, Deadline: time.Now().Add(5 * time.Second)}}
			if err := ds[0].apply(ctx, snap, beats, false); err != nil {
				t.Fatal(err)
			}
		}
		snap, err := ds[0].read(ctx) // the state, not a view
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(time.Minute)
		call := ds[0].calls.Add(1)
		q := &queued{req: request{Node: nd(0), Call: call, Deadline: deadline.UTC()}}
		join := func(s *dynState, now time.Time) action { return nextJoinAction(s, nd(0), now, deadline, ds[0].cfg) }
		exit := func(s *dynState, now time.Time) action { return nextExitAction(s, nd(0), now, deadline) }
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		ds[0].run(rctx, snap, "next", deadline, []decider{exit, join}, nil, q, call)
		mu.Lock()
		defer mu.Unlock()
		if slices.Contains(ops, "next") || !slices.Contains(ops, "fold") {
			t.Errorf("drops told by %v; want node 1's by the fold of the Next's request, none by the Next", ops)
		}
	})
}

// TestKeepAliveReadsTheStateOnlyWithTheLock: a keep-alive whose beat no
// fold has taken up folds it itself, and reads the state (O(N)) only once
// it holds the folder lock. While a folder elsewhere holds the lock, no
// node's keep-alive reads the state: at 512 agents restarting, each one
// whose beat found no fold read the whole state first, and all but one
// then lost the lock.
func TestKeepAliveReadsTheStateOnlyWithTheLock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		const n = 6
		cfg := DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, QueueMinNodes: 1}
		var stores []Store
		var counted []*bigReads
		for range n {
			b := &bigReads{Store: m, keys: []string{"gorun.rendezvous.job"}}
			stores, counted = append(stores, b), append(counted, b)
		}
		ds := nodesOn(t, cfg, stores...)
		joinAll(t, ds)
		for _, c := range counted {
			c.n.Store(0)
		}
		// A folder elsewhere takes the lock and keeps it, folding nothing,
		// for three heartbeat intervals.
		ctx := context.Background()
		lockKey, start := ds[0].key+lockSuffix, time.Now()
		held := 3 * ds[0].cfg.HeartbeatInterval()
		for time.Since(start) < held {
			v := lockValue{holder: "elsewhere 1", expiry: time.Now().Add(5 * time.Second), start: start}
			m.Set(ctx, lockKey, v.bytes())
			time.Sleep(time.Second)
		}
		if n, err := m.QueueLen(ctx, ds[0].key+queueSuffix); err != nil || n < int64(2*len(ds)) {
			t.Fatalf("%d beats queued (%v), want every node's, twice at least: the keep-alives did not run", n, err)
		}
		for i, c := range counted {
			if got := c.n.Load(); got > 0 {
				t.Errorf("node %d's keep-alive read the state %d times while another held the folder lock; want none", i, got)
			}
		}
	})
}

// beatsAtCompletionStore is a memStore with queues that, as the state's
// write that completes the round lands, finds heartbeats of the round's
// nodes queued behind it (as a crowd's keep-alives arrive while the
// folder writes), pushed once.
type beatsAtCompletionStore struct {
	*memStore
	key    string
	nodes  []NodeDesc
	pushed atomic.Bool
}

func (s *beatsAtCompletionStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	cur, err := s.memStore.CompareSet(ctx, k, expected, desired)
	if err == nil && k == s.key && bytes.Equal(cur, desired) && bytes.Contains(desired, []byte(`"complete":true`)) && s.pushed.CompareAndSwap(false, true) {
		for _, n := range s.nodes {
			b, _ := json.Marshal(request{Node: n, Call: 1, KeepAlive: true, Deadline: time.Now().Add(time.Minute)})
			s.memStore.QueuePush(ctx, k+queueSuffix, b)
		}
	}
	return cur, err
}

// TestFolderStopsAtCompletion: the folder whose batch completes the round
// returns from its Next with the others, leaving the heartbeats queued
// behind the completing write to their own nodes' folds; it used to fold
// them first (at 512 agents on etcd, 2.6–3.3 s after the others had the
// round, and its workers started last).
func TestFolderStopsAtCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 4
		m := &beatsAtCompletionStore{memStore: newQueueMemStore(), key: "gorun.rendezvous.job"}
		for i := range n {
			m.nodes = append(m.nodes, nd(i))
		}
		cfg := DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, QueueMinNodes: 1}
		start := time.Now()
		var chs []<-chan bubbleResult
		for i := range n {
			d, err := NewDynamic(m, nd(i), nil, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			chs = append(chs, goNext(d, start))
		}
		for i, ch := range chs {
			if x := <-ch; x.err != nil || len(x.r.Members) != n {
				t.Fatalf("node %d: %+v (%v)", i, x.r, x.err)
			}
		}
		if !m.pushed.Load() {
			t.Fatal("no write completed the round")
		}
		m.mu.Lock()
		left := len(m.queues[m.key+queueSuffix])
		m.mu.Unlock()
		if left != n {
			t.Errorf("%d of the %d heartbeats queued behind the completing write left when every Next returned; want all (the folder stops at the completion)", left, n)
		}
	})
}
