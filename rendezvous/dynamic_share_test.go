package rendezvous

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

// shareState is a complete round of n nodes (ranks in node order), plus
// waiting nodes, at t.
func shareState(n, waiting int, t time.Time) *dynState {
	s := &dynState{Round: 3, Complete: true, Size: n, Wake: 7, Batch: 9}
	for i := range n + waiting {
		s.Nodes = append(s.Nodes, nodeState{NodeDesc: NodeDesc{Addr: fmt.Sprintf("10.0.%d.%d", i/256, i%256), Pid: 1}, Heartbeat: t, Call: uint64(100 + i)})
	}
	slices.SortFunc(s.Nodes, func(a, b nodeState) int { return compareNodes(a.NodeDesc, b.NodeDesc) })
	rank := 0
	for i := range s.Nodes {
		if i >= n {
			s.Nodes[i].Waiting = true
			continue
		}
		s.Nodes[i].Rank = rank
		rank++
	}
	return s
}

// TestViewDecidesAsTheState: a node's view (the marker and its bucket)
// gives it the same role, counts and round as the state, whatever bucket
// it is in, and its share of the round names no members.
func TestViewDecidesAsTheState(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	cfg := DynamicConfig{RunID: "r", MinNodes: 1, MaxNodes: 100}.withDefaults()
	for _, tc := range []struct {
		name       string
		n, waiting int
	}{
		{"one node", 1, 0},
		{"a bucket's worth", shareBucketNodes, 0},
		{"many, some waiting", 90, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := shareState(tc.n, tc.waiting, t0)
			nb := shareBuckets(cfg.MaxNodes)
			buckets := s.shares(nb)
			m := s.marker(cfg)
			for _, e := range s.Nodes {
				v := viewOf(m, buckets[bucketOf(e.NodeDesc, nb)], nil)
				if v.participants() != s.participants() {
					t.Fatalf("%v: view counts %d participants, state %d", e.NodeDesc, v.participants(), s.participants())
				}
				p1, w1 := v.role(e.NodeDesc)
				p2, w2 := s.role(e.NodeDesc)
				if p1 != p2 || w1 != w2 {
					t.Fatalf("%v: view role %v %v, state %v %v", e.NodeDesc, p1, w1, p2, w2)
				}
				deadline := t0.Add(time.Minute)
				if a, b := nextJoinAction(v, e.NodeDesc, t0, deadline, cfg), nextJoinAction(s, e.NodeDesc, t0, deadline, cfg); a != b {
					t.Fatalf("%v: view decides %v, state %v", e.NodeDesc, a, b)
				}
				vr, vok := v.viewRound(e.NodeDesc)
				sr, sok := s.round(e.NodeDesc)
				if vok != sok || vok && (vr.Number != sr.Number || vr.Rank != sr.Rank || vr.Size != sr.Size || vr.Members != nil) {
					t.Fatalf("%v: view's round %+v %v, state's %+v %v", e.NodeDesc, vr, vok, sr, sok)
				}
				if p := v.progress(e.NodeDesc); p.NumParticipants != tc.n || p.NumWaiting != tc.waiting || p.Participants != nil || p.InWaitList != e.Waiting {
					t.Fatalf("%v: view's progress %+v", e.NodeDesc, p)
				}
			}
		})
	}
}

// TestPublishRewritesOnlyWhatChanged: a heartbeat rewrites no bucket, a
// join rewrites the joiner's bucket alone, a completion every bucket
// whose nodes got ranks; the marker's publication number moves only with
// the header.
func TestPublishRewritesOnlyWhatChanged(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	cfg := DynamicConfig{RunID: "r", MinNodes: 64, MaxNodes: 64}.withDefaults()
	nb := shareBuckets(cfg.MaxNodes)
	gathering := shareState(40, 0, t0)
	gathering.Complete, gathering.Size = false, 0
	for i := range gathering.Nodes {
		gathering.Nodes[i].Rank = 0
	}
	dirty := func(before, after *dynState) int {
		n := 0
		old, cur := before.shares(nb), after.shares(nb)
		for b := range cur {
			if !slices.EqualFunc(old[b], cur[b], sameShare) {
				n++
			}
		}
		return n
	}
	for _, tc := range []struct {
		name      string
		change    func(s *dynState)
		buckets   int  // rewritten; -1: at least two
		headerPub bool // the marker moves
	}{
		{"heartbeat", func(s *dynState) { s.Nodes[5].Heartbeat = s.Nodes[5].Heartbeat.Add(time.Second) }, 0, false},
		{"oldest heartbeat refreshed", func(s *dynState) {
			for i := range s.Nodes {
				s.Nodes[i].Heartbeat = t0.Add(time.Second)
			}
		}, 0, true},
		{"join", func(s *dynState) {
			s.apply(actAddToParticipants, NodeDesc{Addr: "10.9.9.9", Pid: 1}, nil, t0, cfg)
		}, 1, true},
		{"complete", func(s *dynState) { s.markComplete() }, -1, true},
		{"closed", func(s *dynState) { s.Closed = true }, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			after := gathering.clone()
			tc.change(after)
			got := dirty(gathering, after)
			if tc.buckets >= 0 && got != tc.buckets || tc.buckets < 0 && got < 2 {
				t.Errorf("%d buckets rewritten, want %d", got, tc.buckets)
			}
			numberPublication(gathering, after, cfg)
			if moved := after.Pub != gathering.Pub; moved != tc.headerPub {
				t.Errorf("marker moved %v, want %v", moved, tc.headerPub)
			}
		})
	}
}

// TestBubbleShareOnly: 40 nodes queue their joins; with ShareOnly each
// gets its rank and the round's size but no members, which Members then
// reads; with Describe, its summary (dynamic_plan.go: its offset among
// uneven weights, the total, rank 0), whichever node folded the round.
// Status answers from the marker until a member is lost, and then names
// it.
func TestBubbleShareOnly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := newQueueMemStore()
		const n = 40
		lws := func(data []byte) (NodeTraits, error) { // bubbleNodes' data: "lws=<i+1>"
			var w int
			_, err := fmt.Sscanf(string(data), "lws=%d", &w)
			return NodeTraits{Weight: w}, err
		}
		ds := bubbleNodes(t, m, n, DynamicConfig{RunID: "job", MinNodes: n - 1, MaxNodes: n, ShareOnly: true, Describe: lws})
		start := time.Now()
		chs := make([]<-chan bubbleResult, n)
		for i := range ds {
			chs[i] = goNext(ds[i], start)
		}
		for i, ch := range chs {
			x := <-ch
			if x.err != nil || x.r.Rank != i || x.r.Size != n || x.r.Members != nil {
				t.Fatalf("node %d: %+v", i, x)
			}
			if s := x.r.Summary; s == nil || s.Offset != i*(i+1)/2 || s.Total != n*(n+1)/2 || s.First.Node != ds[0].Node() ||
				s.First.Rank != 0 || string(s.First.Data) != "lws=1" || s.Dissent != nil {
				t.Fatalf("node %d: summary %+v", i, s)
			}
		}
		ms, err := ds[7].Members(context.Background())
		if err != nil || len(ms) != n || ms[7].Node != ds[7].Node() || ms[0].Node != ds[0].Node() {
			t.Fatalf("members %v, %v", ms, err)
		}
		st, err := ds[0].Status(context.Background())
		if err != nil || st.Participants != n || st.Lost != nil || !st.Complete {
			t.Fatalf("status %+v, %v", st, err)
		}
		if err := ds[n-1].Leave(context.Background()); err != nil {
			t.Fatal(err)
		}
		st, err = ds[3].Status(context.Background())
		if err != nil || len(st.Lost) != 1 || st.Lost[0] != ds[n-1].Node() {
			t.Fatalf("after a leave: %+v, %v", st, err)
		}
	})
}
