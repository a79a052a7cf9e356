package rendezvous

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// The pure core, with explicit times: no store, no goroutines, no clock.

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

// nd returns node i: addresses sort the same way as i.
func nd(i int) NodeDesc { return NodeDesc{Addr: fmt.Sprintf("10.0.0.%02d", i), Pid: 1000 + i} }

// coreCfg is 2:4 nodes with torchrun's timers.
func coreCfg() DynamicConfig {
	return DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 4}.withDefaults()
}

// part and wl build state entries with a heartbeat at hb.
func part(i int, hb time.Duration) nodeState {
	return nodeState{NodeDesc: nd(i), Heartbeat: at(hb), Data: []byte(fmt.Sprint("data", i))}
}

func wl(i int, hb time.Duration) nodeState {
	e := part(i, hb)
	e.Waiting = true
	return e
}

// mkState builds a state with its nodes in order.
func mkState(s dynState, nodes ...nodeState) *dynState {
	s.Nodes = slices.Clone(nodes)
	slices.SortFunc(s.Nodes, func(a, b nodeState) int { return compareNodes(a.NodeDesc, b.NodeDesc) })
	return &s
}

func TestNodeDescStringAndOrder(t *testing.T) {
	n := NodeDesc{Addr: "host_a", Pid: 1234, LocalID: 0}
	if got := n.String(); got != "host_a_1234_0" {
		t.Errorf("String = %q", got)
	}
	// torchrun sorts the dataclass: address, then pid as a number, then
	// local id. A string sort would put pid 1000 before 999.
	nodes := []NodeDesc{
		{Addr: "b", Pid: 1},
		{Addr: "a", Pid: 1000},
		{Addr: "a", Pid: 999, LocalID: 1},
		{Addr: "a", Pid: 999},
	}
	slices.SortFunc(nodes, compareNodes)
	want := []NodeDesc{{Addr: "a", Pid: 999}, {Addr: "a", Pid: 999, LocalID: 1}, {Addr: "a", Pid: 1000}, {Addr: "b", Pid: 1}}
	if !slices.Equal(nodes, want) {
		t.Errorf("order = %v, want %v", nodes, want)
	}
}

// TestHeartbeatStretchesWithTheCrowd: beyond CrowdRate ×
// KeepAliveInterval nodes the heartbeat interval is MaxNodes ÷ CrowdRate
// and the drop timeout follows it; below, torchrun's figures stand.
func TestHeartbeatStretchesWithTheCrowd(t *testing.T) {
	for _, tc := range []struct {
		max, rate      int
		interval, drop time.Duration
	}{
		{max: 4, interval: 5 * time.Second, drop: 15 * time.Second},
		{max: 1250, interval: 5 * time.Second, drop: 15 * time.Second},
		{max: 2500, interval: 10 * time.Second, drop: 30 * time.Second},
		{max: 10000, interval: 40 * time.Second, drop: 120 * time.Second},
		{max: 10000, rate: 1000, interval: 10 * time.Second, drop: 30 * time.Second},
		{max: 10000, rate: -1, interval: 5 * time.Second, drop: 15 * time.Second},
	} {
		c := DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: tc.max, CrowdRate: tc.rate}
		if got := c.HeartbeatInterval(); got != tc.interval {
			t.Errorf("%d nodes at rate %d: heartbeat interval %v, want %v", tc.max, tc.rate, got, tc.interval)
		}
		if got := c.DropTimeout(); got != tc.drop {
			t.Errorf("%d nodes at rate %d: drop timeout %v, want %v", tc.max, tc.rate, got, tc.drop)
		}
		if got := c.withDefaults().DropTimeout(); got != tc.drop {
			t.Errorf("%d nodes at rate %d: sanitize's ttl %v, want %v", tc.max, tc.rate, got, tc.drop)
		}
	}
}

func TestParseDynamicConfig(t *testing.T) {
	c, err := ParseDynamicConfig("job", 2, 4, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := DynamicConfig{RunID: "job", MinNodes: 2, MaxNodes: 4,
		JoinTimeout: 600 * time.Second, LastCallTimeout: 30 * time.Second, CloseTimeout: 30 * time.Second,
		KeepAliveTimeout: 5 * time.Second, KeepAliveInterval: 5 * time.Second, KeepAliveMaxAttempt: 3, CrowdRate: 250}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("defaults = %+v, want %+v", c, want)
	}
	if c.DropTimeout() != 15*time.Second {
		t.Errorf("drop timeout = %v, want torchrun's 15s", c.DropTimeout())
	}

	c, err = ParseDynamicConfig("job", 1, 1, map[string]string{
		"join_timeout": "120", "last_call_timeout": "0.5", "close_timeout": " 7 ",
		"heartbeat_timeout": "2", "keep_alive_interval": "1.25", "keep_alive_max_attempt": "5", "crowd_rate": "1000",
		"read_timeout": "60", "is_host": "true", "store_type": "file", // the backend's
	})
	if err != nil {
		t.Fatal(err)
	}
	want = DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1,
		JoinTimeout: 120 * time.Second, LastCallTimeout: 500 * time.Millisecond, CloseTimeout: 7 * time.Second,
		KeepAliveTimeout: 2 * time.Second, KeepAliveInterval: 1250 * time.Millisecond, KeepAliveMaxAttempt: 5, CrowdRate: 1000}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("parsed = %+v, want %+v", c, want)
	}

	bad := []struct {
		min, max int
		conf     map[string]string
	}{
		{2, 4, map[string]string{"join_timeout": "abc"}},
		{2, 4, map[string]string{"join_timeout": "0"}},
		{2, 4, map[string]string{"last_call_timeout": "-1"}},
		{2, 4, map[string]string{"close_timeout": "NaN"}},
		{2, 4, map[string]string{"keep_alive_interval": "inf"}},
		{2, 4, map[string]string{"heartbeat_timeout": "1e300"}},
		{2, 4, map[string]string{"keep_alive_interval": "1e-12"}},
		{2, 4, map[string]string{"keep_alive_max_attempt": "0"}},
		{2, 4, map[string]string{"keep_alive_max_attempt": "1.5"}},
		{0, 4, nil},
		{3, 2, nil},
	}
	for _, b := range bad {
		if _, err := ParseDynamicConfig("job", b.min, b.max, b.conf); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("ParseDynamicConfig(%d, %d, %v) = %v, want ErrInvalidArgument", b.min, b.max, b.conf, err)
		}
	}
	if _, err := ParseDynamicConfig("", 1, 1, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("empty run id: %v", err)
	}
}

func TestSentinels(t *testing.T) {
	if !errors.Is(ErrRendezvousTimeout, ErrTimeout) {
		t.Error("ErrRendezvousTimeout does not wrap ErrTimeout")
	}
	err := fmt.Errorf("ctx: %w", ErrRendezvousTimeout)
	if !errors.Is(err, ErrRendezvousTimeout) || !errors.Is(err, ErrTimeout) {
		t.Error("wrapped timeout lost its sentinels")
	}
}

func TestJoinAction(t *testing.T) {
	cfg := coreCfg()
	me := 1
	deadline := at(600 * time.Second)
	fresh := 10 * time.Second // a heartbeat that is not yet due at 12s
	type tc struct {
		name string
		s    *dynState
		now  time.Duration
		want action
	}
	tests := []tc{
		{"closed", mkState(dynState{Closed: true}), 12 * time.Second, actErrClosed},
		{"closed beats complete", mkState(dynState{Closed: true, Complete: true, Size: 2}, part(1, fresh), part(2, fresh)), 12 * time.Second, actErrClosed},
		{"complete, mine", mkState(dynState{Complete: true, Size: 2}, part(1, fresh), part(2, fresh)), 12 * time.Second, actFinish},
		{"complete, mine, even past the deadline", mkState(dynState{Complete: true, Size: 2}, part(1, fresh), part(2, fresh)), 700 * time.Second, actFinish},
		{"complete, mine, but a member is gone", mkState(dynState{Complete: true, Size: 3}, part(1, fresh), part(2, fresh)), 12 * time.Second, actRemoveToRejoin},
		{"past deadline, participant: roll back", mkState(dynState{}, part(1, fresh)), 601 * time.Second, actRemoveFromParticipants},
		{"past deadline, waiting: roll back", mkState(dynState{Complete: true, Size: 2}, part(2, fresh), part(3, fresh), wl(1, fresh)), 601 * time.Second, actRemoveFromWaitList},
		{"past deadline, nowhere", mkState(dynState{}, part(2, fresh)), 601 * time.Second, actErrTimeout},
		{"rollback window's last instant", mkState(dynState{}, part(1, fresh)), 605 * time.Second, actRemoveFromParticipants},
		{"past the rollback window", mkState(dynState{}, part(1, fresh)), 605*time.Second + 1, actErrTimeout},
		{"at the deadline exactly: not past", mkState(dynState{}, part(1, fresh)), 600 * time.Second, actKeepAlive},
		{"complete, not mine, room: wait list", mkState(dynState{Complete: true, Size: 2}, part(2, fresh), part(3, fresh)), 12 * time.Second, actAddToWaitList},
		{"complete, already waiting", mkState(dynState{Complete: true, Size: 2}, part(2, fresh), part(3, fresh), wl(1, fresh)), 12 * time.Second, actSync},
		{"complete, already waiting, heartbeat due", mkState(dynState{Complete: true, Size: 2}, part(2, fresh), part(3, fresh), wl(1, fresh)), 15 * time.Second, actKeepAlive},
		{"complete, full: just sync", mkState(dynState{Complete: true, Size: 4}, part(2, fresh), part(3, fresh), part(4, fresh), part(5, fresh)), 12 * time.Second, actSync},
		{"gathering, last call over", mkState(dynState{Deadline: at(11 * time.Second)}, part(1, fresh), part(2, fresh)), 12 * time.Second, actMarkComplete},
		{"gathering, last call ends now: not yet", mkState(dynState{Deadline: at(12 * time.Second)}, part(1, fresh), part(2, fresh)), 12 * time.Second, actSync},
		{"gathering, last call running", mkState(dynState{Deadline: at(30 * time.Second)}, part(1, fresh), part(2, fresh)), 12 * time.Second, actSync},
		{"gathering, below min", mkState(dynState{}, part(1, fresh)), 12 * time.Second, actSync},
		{"gathering, every rejoiner back", mkState(dynState{Deadline: at(30 * time.Second), Rejoin: []rejoiner{{NodeDesc: nd(1)}, {NodeDesc: nd(2)}}}, part(1, fresh), part(2, fresh)), 12 * time.Second, actMarkComplete},
		{"gathering, a rejoiner missing", mkState(dynState{Deadline: at(30 * time.Second), Rejoin: []rejoiner{{NodeDesc: nd(1)}, {NodeDesc: nd(3)}}}, part(1, fresh), part(2, fresh)), 12 * time.Second, actSync},
		{"gathering, every rejoiner back but below min", mkState(dynState{Rejoin: []rejoiner{{NodeDesc: nd(1)}}}, part(1, fresh)), 12 * time.Second, actSync},
		{"gathering, below min with a stray deadline", mkState(dynState{Deadline: at(time.Second)}, part(1, fresh)), 12 * time.Second, actSync},
		{"gathering, heartbeat due", mkState(dynState{Deadline: at(30 * time.Second)}, part(1, fresh), part(2, fresh)), 15 * time.Second, actKeepAlive},
		{"gathering, not in it", mkState(dynState{}, part(2, fresh)), 12 * time.Second, actAddToParticipants},
		{"empty", mkState(dynState{}), 12 * time.Second, actAddToParticipants},
		{"new round, I was waiting", mkState(dynState{Round: 1}, wl(1, fresh)), 12 * time.Second, actAddToParticipants},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := nextJoinAction(tt.s, nd(me), at(tt.now), deadline, cfg); got != tt.want {
				t.Errorf("join = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestExitLeaveCloseKeepAliveActions(t *testing.T) {
	cfg := coreCfg()
	me := nd(1)
	deadline := at(30 * time.Second)
	mine := mkState(dynState{Complete: true, Size: 2}, part(1, 0), part(2, 0))
	waiting := mkState(dynState{Complete: true, Size: 1}, part(2, 0), wl(1, 0))
	other := mkState(dynState{}, part(2, 0))
	closed := mkState(dynState{Closed: true})
	early, late := at(10*time.Second), at(31*time.Second)
	tests := []struct {
		name string
		got  action
		want action
	}{
		{"exit: participant, to rejoin", nextExitAction(mine, me, early, deadline), actRemoveToRejoin},
		{"exit: participant, late", nextExitAction(mine, me, late, deadline), actErrTimeout},
		{"exit: waiting is not torchrun's business", nextExitAction(waiting, me, early, deadline), actFinish},
		{"exit: nowhere", nextExitAction(other, me, late, deadline), actFinish},
		{"leave: participant", nextLeaveAction(mine, me, early, deadline), actRemoveFromParticipants},
		{"leave: waiting", nextLeaveAction(waiting, me, early, deadline), actRemoveFromWaitList},
		{"leave: late", nextLeaveAction(waiting, me, late, deadline), actErrTimeout},
		{"leave: nowhere", nextLeaveAction(other, me, late, deadline), actFinish},
		{"leave: a rejoiner on its way", nextLeaveAction(mkState(dynState{Rejoin: []rejoiner{{NodeDesc: me}}}, part(2, 0)), me, early, deadline), actForgetRejoin},
		{"close: open", nextCloseAction(other, early, deadline), actMarkClosed},
		{"close: late", nextCloseAction(other, late, deadline), actErrTimeout},
		{"close: closed", nextCloseAction(closed, late, deadline), actFinish},
		{"keep-alive: due", nextKeepAliveAction(mine, me, at(5*time.Second), deadline, cfg), actKeepAlive},
		{"keep-alive: not due", nextKeepAliveAction(mine, me, at(5*time.Second-1), deadline, cfg), actFinish},
		{"keep-alive: due, late", nextKeepAliveAction(mine, me, late, deadline, cfg), actErrTimeout},
		{"keep-alive: dropped, do not come back", nextKeepAliveAction(other, me, early, deadline, cfg), actFinish},
		{"keep-alive: waiting", nextKeepAliveAction(waiting, me, early, deadline, cfg), actKeepAlive},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, tt.got, tt.want)
		}
	}
}

// ranks maps each participant to its rank.
func ranks(s *dynState) map[NodeDesc]int {
	m := map[NodeDesc]int{}
	for _, e := range s.Nodes {
		if !e.Waiting {
			m[e.NodeDesc] = e.Rank
		}
	}
	return m
}

func TestApplyAddToParticipants(t *testing.T) {
	cfg := coreCfg() // 2:4, last call 30s
	s := &dynState{}
	// Join out of order: ranks must follow node order, not arrival.
	if !s.apply(actAddToParticipants, nd(3), []byte("three"), at(1*time.Second), cfg) {
		t.Fatal("no change")
	}
	if !s.Deadline.IsZero() || s.Complete {
		t.Fatalf("1 of min 2: deadline %v complete %v", s.Deadline, s.Complete)
	}
	s.apply(actAddToParticipants, nd(1), []byte("one"), at(2*time.Second), cfg)
	if want := at(32 * time.Second); !s.Deadline.Equal(want) {
		t.Fatalf("min reached: deadline %v, want %v", s.Deadline, want)
	}
	s.apply(actAddToParticipants, nd(0), []byte("zero"), at(10*time.Second), cfg)
	if want := at(40 * time.Second); !s.Deadline.Equal(want) {
		t.Fatalf("a third joiner extends the last call: deadline %v, want %v", s.Deadline, want)
	}
	if s.Complete {
		t.Fatal("complete before max")
	}
	s.apply(actAddToParticipants, nd(2), []byte("two"), at(11*time.Second), cfg)
	if !s.Complete || !s.Deadline.IsZero() || s.Size != 4 {
		t.Fatalf("max reached: complete %v deadline %v size %d", s.Complete, s.Deadline, s.Size)
	}
	want := map[NodeDesc]int{nd(0): 0, nd(1): 1, nd(2): 2, nd(3): 3}
	if got := ranks(s); !reflect.DeepEqual(got, want) {
		t.Fatalf("ranks %v, want %v", got, want)
	}
	r, ok := s.round(nd(2))
	if !ok || r.Rank != 2 || r.Number != 0 || len(r.Members) != 4 {
		t.Fatalf("round = %+v, %v", r, ok)
	}
	for i, m := range r.Members {
		name := []string{"zero", "one", "two", "three"}[i]
		if m.Rank != i || m.Node != nd(i) || string(m.Data) != name {
			t.Errorf("member %d = %+v, want %v with %q", i, m, nd(i), name)
		}
	}
	if _, ok := s.round(nd(9)); ok {
		t.Error("a stranger is in the round")
	}
	// Heartbeats are stored without a monotonic reading, in UTC.
	if hb := s.Nodes[0].Heartbeat; hb != hb.Round(0) || hb.Location() != time.UTC {
		t.Errorf("heartbeat %v keeps a monotonic reading or a zone", hb)
	}
}

func TestApplyMarkCompleteRanksBySortedNodes(t *testing.T) {
	cfg := coreCfg()
	// pid 999 sorts before pid 1000 (numeric), host "a" before "b".
	a1000 := NodeDesc{Addr: "a", Pid: 1000}
	a999 := NodeDesc{Addr: "a", Pid: 999}
	b1 := NodeDesc{Addr: "b", Pid: 1}
	s := &dynState{}
	for _, n := range []NodeDesc{b1, a1000, a999} {
		s.apply(actAddToParticipants, n, []byte(n.String()), t0, cfg)
	}
	s.apply(actAddToWaitList, NodeDesc{Addr: "0-first", Pid: 1}, nil, t0, cfg) // waiters get no rank
	if !s.apply(actMarkComplete, a999, nil, at(time.Minute), cfg) {
		t.Fatal("no change")
	}
	if want := (map[NodeDesc]int{a999: 0, a1000: 1, b1: 2}); !reflect.DeepEqual(ranks(s), want) {
		t.Errorf("ranks %v, want %v", ranks(s), want)
	}
	if s.apply(actMarkComplete, a999, nil, at(time.Minute), cfg) {
		t.Error("completing twice changed the state")
	}
	r, _ := s.round(b1)
	if len(r.Members) != 3 || string(r.Members[2].Data) != b1.String() {
		t.Errorf("round %+v", r)
	}
}

func TestApplyWaitListAndRemovals(t *testing.T) {
	cfg := coreCfg()
	complete := func() *dynState {
		s := &dynState{}
		for i := range 3 {
			s.apply(actAddToParticipants, nd(i), nil, t0, cfg)
		}
		s.apply(actMarkComplete, nd(0), nil, t0, cfg)
		return s
	}

	s := complete()
	s.apply(actAddToWaitList, nd(7), []byte("w"), at(time.Second), cfg)
	if p, w := s.role(nd(7)); p || !w || s.participants() != 3 {
		t.Fatalf("wait list: participant %v waiting %v participants %d", p, w, s.participants())
	}
	// A waiter is not a participant: removing it from participants does
	// nothing; from the wait list it goes.
	if s.apply(actRemoveFromParticipants, nd(7), nil, t0, cfg) {
		t.Error("removed a waiter from participants")
	}
	if !s.apply(actRemoveFromWaitList, nd(7), nil, t0, cfg) {
		t.Error("could not leave the wait list")
	}
	if s.apply(actRemoveFromWaitList, nd(7), nil, t0, cfg) || s.apply(actKeepAlive, nd(7), nil, t0, cfg) {
		t.Error("a gone node changed the state")
	}

	// Participants leave a complete round one by one: it stays complete
	// (with its ranks) until the last one goes, which starts round 1 and
	// admits the wait list into it.
	s = complete()
	s.apply(actAddToWaitList, nd(7), []byte("w"), t0, cfg)
	for i := range 2 {
		s.apply(actRemoveFromParticipants, nd(i), nil, t0, cfg)
		if !s.Complete || s.Round != 0 {
			t.Fatalf("after %d left: complete %v round %d", i+1, s.Complete, s.Round)
		}
	}
	s.apply(actRemoveFromParticipants, nd(2), nil, t0, cfg)
	if s.Complete || s.Round != 1 || s.Size != 0 {
		t.Fatalf("all left: complete %v round %d size %d", s.Complete, s.Round, s.Size)
	}
	if p, _ := s.role(nd(7)); !p {
		t.Fatal("the waiter was not admitted")
	}
	if got := nextJoinAction(s, nd(7), t0, at(time.Hour), cfg); got != actSync {
		t.Errorf("admitted waiter decides %v", got) // 1 of min 2: it waits
	}
	// A node joining anew replaces its entry, data included.
	s.apply(actAddToParticipants, nd(7), []byte("w2"), at(time.Second), cfg)
	if p, w := s.role(nd(7)); !p || w || s.participants() != 1 {
		t.Fatalf("joined: participant %v waiting %v", p, w)
	}
	if i, _ := s.find(nd(7)); string(s.Nodes[i].Data) != "w2" {
		t.Errorf("data %q", s.Nodes[i].Data)
	}

	// A gathering round that drops below min loses its last call.
	s = &dynState{}
	s.apply(actAddToParticipants, nd(0), nil, t0, cfg)
	s.apply(actAddToParticipants, nd(1), nil, t0, cfg)
	if s.Deadline.IsZero() {
		t.Fatal("no last call at min")
	}
	s.apply(actRemoveFromParticipants, nd(1), nil, t0, cfg)
	if !s.Deadline.IsZero() {
		t.Error("last call survived dropping below min")
	}

	// Keep-alive touches my heartbeat only; close closes once.
	s = complete()
	before := s.clone()
	if !s.apply(actKeepAlive, nd(1), nil, at(9*time.Second), cfg) {
		t.Fatal("keep-alive changed nothing")
	}
	before.Nodes[1].Heartbeat = at(9 * time.Second)
	if !reflect.DeepEqual(s, before) {
		t.Errorf("keep-alive: %+v, want %+v", s, before)
	}
	if !s.apply(actMarkClosed, nd(1), nil, t0, cfg) || !s.Closed || s.apply(actMarkClosed, nd(1), nil, t0, cfg) {
		t.Error("mark closed")
	}
	for _, a := range []action{actSync, actFinish, actErrClosed, actErrTimeout} {
		if s.apply(a, nd(1), nil, t0, cfg) {
			t.Errorf("%v changed the state", a)
		}
	}
}

// TestAdmitWaiting: the write that starts a round admits the wait list, in
// node order, up to MaxNodes, and completes the round or starts its last
// call as adding them one by one would.
func TestAdmitWaiting(t *testing.T) {
	cfg := coreCfg() // 2:4
	now := at(time.Minute)
	tests := []struct {
		name          string
		waiting       []int
		wantIn        []int // participants after the last member left
		wantComplete  bool
		wantLastCall  bool
		wantStillWait []int
	}{
		{"none", nil, nil, false, false, nil},
		{"one, below min", []int{5}, []int{5}, false, false, nil},
		{"two: min, last call", []int{6, 5}, []int{5, 6}, false, true, nil},
		{"four: max, complete", []int{8, 7, 6, 5}, []int{5, 6, 7, 8}, true, false, nil},
		{"six: the first four by node order", []int{9, 8, 7, 6, 5, 4}, []int{4, 5, 6, 7}, true, false, []int{8, 9}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			nodes := []nodeState{part(0, 50*time.Second)}
			for _, i := range tt.waiting {
				nodes = append(nodes, wl(i, 50*time.Second))
			}
			s := mkState(dynState{Round: 2, Complete: true, Size: 1}, nodes...)
			s.apply(actRemoveFromParticipants, nd(0), nil, now, cfg)
			var in, waiting []int
			for _, e := range s.Nodes {
				i := e.Pid - 1000
				if e.Waiting {
					waiting = append(waiting, i)
				} else {
					in = append(in, i)
				}
			}
			if s.Round != 3 || !slices.Equal(in, tt.wantIn) || !slices.Equal(waiting, tt.wantStillWait) {
				t.Fatalf("round %d participants %v waiting %v", s.Round, in, waiting)
			}
			if s.Complete != tt.wantComplete || s.Deadline.IsZero() == tt.wantLastCall {
				t.Fatalf("complete %v deadline %v", s.Complete, s.Deadline)
			}
			if tt.wantLastCall && !s.Deadline.Equal(now.Add(cfg.LastCallTimeout)) {
				t.Errorf("deadline %v", s.Deadline)
			}
			if tt.wantComplete {
				if want := (map[NodeDesc]int{nd(in[0]): 0, nd(in[1]): 1, nd(in[2]): 2, nd(in[3]): 3}); !reflect.DeepEqual(ranks(s), want) {
					t.Errorf("ranks %v", ranks(s))
				}
			}
		})
	}
}

// TestAdmitPlaces: admit fills the running round's empty places from the
// wait list, in node order, all of them in one change or none. A node
// admitted beside a place left empty would not take its own (its join
// leaves a round with a member gone): admit refuses that, and fewer
// waiting nodes than places, changing nothing; every node it admits then
// finishes its join at once.
func TestAdmitPlaces(t *testing.T) {
	cfg := coreCfg()
	now := at(12 * time.Second)
	fresh := 10 * time.Second
	// running is a complete round of size 4 whose members of ranks held
	// live, with waiting nodes 7, 8, ...
	running := func(held []int, waiting int) *dynState {
		var nodes []nodeState
		for _, r := range held {
			e := part(r, fresh)
			e.Rank = r
			nodes = append(nodes, e)
		}
		for i := range waiting {
			nodes = append(nodes, wl(7+i, fresh))
		}
		return mkState(dynState{Complete: true, Size: 4}, nodes...)
	}
	tests := []struct {
		name  string
		s     *dynState
		ranks []int
		want  []int // the nodes admitted, in the order of ranks
		err   error // a sentinel it wraps; nil: any error, when want is nil
	}{
		{"one place, one waiting", running([]int{0, 1, 3}, 1), []int{2}, []int{7}, nil},
		{"one place, two waiting: the first in node order", running([]int{0, 1, 3}, 2), []int{2}, []int{7}, nil},
		{"two places, two waiting, in one change", running([]int{0, 3}, 2), []int{2, 1}, []int{8, 7}, nil},
		{"two places, one asked: the other left empty", running([]int{0, 3}, 1), []int{1}, nil, ErrPlacesLeft},
		{"two places, the other asked", running([]int{0, 3}, 2), []int{2}, nil, ErrPlacesLeft},
		{"two places, one waiting", running([]int{0, 3}, 1), []int{1, 2}, nil, ErrNoWaitingNode},
		{"one place, nobody waiting", running([]int{0, 1, 3}, 0), []int{2}, nil, ErrNoWaitingNode},
		{"a rank that has a member", running([]int{0, 1, 3}, 1), []int{1}, nil, nil},
		{"a rank past the round's size", running([]int{0, 1, 3}, 1), []int{4}, nil, nil},
		{"a rank twice", running([]int{0, 3}, 2), []int{1, 1}, nil, nil},
		{"no rank", running([]int{0, 1, 3}, 1), nil, nil, nil},
		{"a round still gathering", mkState(dynState{}, part(0, fresh), wl(7, fresh)), []int{1}, nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := tt.s.clone()
			got, err := tt.s.admit(tt.ranks...)
			if tt.want == nil {
				if err == nil || tt.err != nil && !errors.Is(err, tt.err) {
					t.Fatalf("admit%v = %v, %v; want an error wrapping %v", tt.ranks, got, err, tt.err)
				}
				if !reflect.DeepEqual(tt.s, before) {
					t.Fatalf("a refused admission changed the state: %+v, was %+v", tt.s, before)
				}
				return
			}
			var want []NodeDesc
			for _, i := range tt.want {
				want = append(want, nd(i))
			}
			if err != nil || !slices.Equal(got, want) {
				t.Fatalf("admit%v = %v, %v; want %v", tt.ranks, got, err, want)
			}
			for k, n := range got {
				if r, ok := tt.s.round(n); !ok || !r.Late || r.Rank != tt.ranks[k] || len(r.Members) != r.Size {
					t.Errorf("node %v's round %+v, %v; want late at rank %d in a whole round", n, r, ok, tt.ranks[k])
				}
				if a := nextJoinAction(tt.s, n, now, at(600*time.Second), cfg); a != actFinish {
					t.Errorf("node %v admitted at rank %d: join = %v, want %v", n, tt.ranks[k], a, actFinish)
				}
			}
		})
	}
}

func TestSanitize(t *testing.T) {
	cfg := coreCfg() // ttl 15s
	now := at(100 * time.Second)
	edge := 85 * time.Second // exactly ttl old: alive (torchrun drops only older)

	s := mkState(dynState{Deadline: at(110 * time.Second)}, part(0, 99*time.Second), part(1, edge), part(2, edge-1), wl(3, edge-1))
	if !s.sanitize(now, cfg) {
		t.Fatal("nothing dropped")
	}
	if got := len(s.Nodes); got != 2 {
		t.Fatalf("%d nodes left: %+v", got, s.Nodes)
	}
	if _, ok := s.find(nd(1)); !ok {
		t.Error("a heartbeat exactly ttl old was dropped")
	}
	if s.Deadline.IsZero() {
		t.Error("still 2 of min 2: the last call must stay")
	}
	if s.sanitize(now, cfg) {
		t.Error("second sanitize dropped something")
	}

	// Dropping below min clears the last call.
	s = mkState(dynState{Deadline: at(110 * time.Second)}, part(0, 99*time.Second), part(1, 0))
	s.sanitize(now, cfg)
	if !s.Deadline.IsZero() {
		t.Error("last call survived a dead participant")
	}

	// The last participant of a complete round dies: the round advances
	// and the waiter (alive) can start it.
	s = mkState(dynState{Round: 4, Complete: true, Size: 2}, part(0, 0), part(1, 0), wl(2, 99*time.Second))
	s.sanitize(now, cfg)
	if s.Complete || s.Round != 5 || s.Size != 0 || len(s.Nodes) != 1 {
		t.Fatalf("after the round died: %+v", s)
	}
	if p, _ := s.role(nd(2)); !p {
		t.Errorf("waiter not admitted into round 5: %+v", s)
	}

	// A dead waiter alone does not touch the round.
	s = mkState(dynState{Complete: true, Size: 1}, part(0, 99*time.Second), wl(1, 0))
	s.sanitize(now, cfg)
	if !s.Complete || s.Round != 0 || len(s.Nodes) != 1 {
		t.Errorf("dead waiter: %+v", s)
	}
}

// TestRejoin: members that leave a complete round to rejoin are the next
// round's known arrivals; once all of them are in again (or known dead) and
// MinNodes are, the round completes without the last call.
func TestRejoin(t *testing.T) {
	cfg := coreCfg() // 2:4, last call 30s, ttl 15s
	now := at(time.Minute)
	// round0 is a complete round of nodes 0..n-1, plus waiting nodes.
	round0 := func(n int, waiting ...int) *dynState {
		var nodes []nodeState
		for i := range n {
			nodes = append(nodes, part(i, 50*time.Second))
		}
		for _, i := range waiting {
			nodes = append(nodes, wl(i, 50*time.Second))
		}
		s := mkState(dynState{Complete: true, Size: n}, nodes...)
		for i := range s.Nodes {
			if !s.Nodes[i].Waiting {
				s.Nodes[i].Rank = i
			}
		}
		return s
	}
	type step struct {
		a    action
		node int
	}
	tests := []struct {
		name         string
		s            *dynState
		steps        []step
		wantComplete bool
		wantLastCall bool
		wantIn       []int
	}{
		{"all three rejoin: complete as the last is in", round0(3), []step{
			{actRemoveToRejoin, 0}, {actRemoveToRejoin, 1}, {actRemoveToRejoin, 2},
			{actAddToParticipants, 2}, {actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, true, false, []int{0, 1, 2}},
		{"one of three not back yet: last call", round0(3), []step{
			{actRemoveToRejoin, 0}, {actRemoveToRejoin, 1}, {actRemoveToRejoin, 2},
			{actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, false, true, []int{0, 1}},
		{"the missing one shuts down: complete", round0(3), []step{
			{actRemoveToRejoin, 0}, {actRemoveToRejoin, 1}, {actRemoveToRejoin, 2},
			{actAddToParticipants, 0}, {actAddToParticipants, 1}, {actForgetRejoin, 2},
		}, true, false, []int{0, 1}},
		{"a member left for good, the others rejoin", round0(3), []step{
			{actRemoveFromParticipants, 2}, {actRemoveToRejoin, 0}, {actRemoveToRejoin, 1},
			{actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, true, false, []int{0, 1}},
		{"rejoiners wait in the round still running, admitted at once", round0(2), []step{
			{actRemoveToRejoin, 0}, {actAddToWaitList, 0}, {actRemoveToRejoin, 1}, {actAddToParticipants, 1},
		}, true, false, []int{0, 1}},
		{"a newcomer waiting is admitted, not awaited", round0(2, 7), []step{
			{actRemoveToRejoin, 0}, {actRemoveToRejoin, 1}, {actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, true, false, []int{0, 1, 7}},
		{"rejoiners below min: nothing to complete", round0(2), []step{
			{actRemoveFromParticipants, 1}, {actRemoveToRejoin, 0}, {actAddToParticipants, 0},
		}, false, false, []int{0}},
		{"a first round has no rejoiners: last call", &dynState{}, []step{
			{actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, false, true, []int{0, 1}},
		{"leaving a round still gathering is not rejoining", &dynState{}, []step{
			{actAddToParticipants, 0}, {actRemoveToRejoin, 0}, {actAddToParticipants, 0}, {actAddToParticipants, 1},
		}, false, true, []int{0, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.s
			for _, st := range tt.steps {
				if !s.apply(st.a, nd(st.node), nil, now, cfg) {
					t.Fatalf("%v of node %d changed nothing", st.a, st.node)
				}
			}
			var in []int
			for _, e := range s.Nodes {
				if !e.Waiting {
					in = append(in, e.Pid-1000)
				}
			}
			if s.Complete != tt.wantComplete || !s.Deadline.IsZero() != tt.wantLastCall || !slices.Equal(in, tt.wantIn) {
				t.Fatalf("complete %v deadline %v participants %v rejoin %v", s.Complete, s.Deadline, in, s.Rejoin)
			}
			if s.Complete && (s.Rejoin != nil || s.Size != len(in)) {
				t.Errorf("complete with rejoiners %v, size %d", s.Rejoin, s.Size)
			}
		})
	}

	// A rejoiner that dies on its way (out of both lists a TTL after it
	// left) is forgotten by sanitize, which completes the round if the
	// others are in; one still alive in the wait list is not.
	s := round0(3)
	for _, i := range []int{0, 1, 2} {
		s.apply(actRemoveToRejoin, nd(i), nil, now, cfg)
	}
	s.apply(actAddToParticipants, nd(0), nil, now, cfg)
	s.apply(actAddToParticipants, nd(1), nil, now, cfg)
	if s.sanitize(now.Add(cfg.DropTimeout()), cfg) || s.Complete {
		t.Fatal("a rejoiner forgotten at exactly its TTL")
	}
	s.Nodes[0].Heartbeat, s.Nodes[1].Heartbeat = now.Add(cfg.DropTimeout()), now.Add(cfg.DropTimeout())
	if !s.sanitize(now.Add(cfg.DropTimeout()+1), cfg) || !s.Complete || s.Size != 2 {
		t.Fatalf("dead rejoiner: changed, complete %v size %d rejoin %v", s.Complete, s.Size, s.Rejoin)
	}
	if got := s.wakeAt(nd(0), now, at(time.Hour), cfg); !got.Equal(now.Add(cfg.KeepAliveInterval)) {
		t.Errorf("wake at %v with no rejoiner out", got.Sub(t0))
	}
	s = round0(2)
	s.apply(actRemoveToRejoin, nd(1), nil, now, cfg)
	if got, want := s.wakeAt(nd(0), now.Add(14*time.Second), at(time.Hour), cfg), now.Add(cfg.DropTimeout()+1); !got.Equal(want) {
		t.Errorf("wake at %v, want the rejoiner's TTL %v", got.Sub(t0), want.Sub(t0))
	}
}

func TestWakeAt(t *testing.T) {
	cfg := coreCfg() // interval 5s, ttl 15s
	me := nd(1)
	now := at(100 * time.Second)
	far := at(time.Hour)
	tests := []struct {
		name     string
		s        *dynState
		deadline time.Time
		want     time.Time
	}{
		{"my heartbeat falls due", mkState(dynState{}, part(1, 98*time.Second)), far, at(103 * time.Second)},
		{"never past one interval", mkState(dynState{Complete: true, Size: 4}, part(2, 99*time.Second), part(3, 99*time.Second), part(4, 99*time.Second), part(5, 99*time.Second)), far, at(105 * time.Second)},
		{"last call ends", mkState(dynState{Deadline: at(101 * time.Second)}, part(1, 99*time.Second), part(2, 99*time.Second)), far, at(101*time.Second + 1)},
		{"last call of a complete round is none", mkState(dynState{Complete: true, Size: 1, Deadline: at(101 * time.Second)}, part(2, 99*time.Second), wl(1, 99*time.Second)), far, at(104 * time.Second)},
		{"my deadline", mkState(dynState{}, part(1, 99*time.Second)), at(102 * time.Second), at(102*time.Second + 1)},
		{"another node expires", mkState(dynState{}, part(1, 99*time.Second), part(2, 86*time.Second)), far, at(101*time.Second + 1)},
		{"passed instants are ignored", mkState(dynState{Deadline: at(50 * time.Second)}, part(1, 99*time.Second)), at(99 * time.Second), at(104 * time.Second)},
	}
	for _, tt := range tests {
		if got := tt.s.wakeAt(me, now, tt.deadline, cfg); !got.Equal(tt.want) {
			t.Errorf("%s: wake at %v, want %v", tt.name, got.Sub(t0), tt.want.Sub(t0))
		}
	}
}

func TestStatusAndProgress(t *testing.T) {
	s := mkState(dynState{Round: 3, Complete: true, Size: 2}, part(0, 0), wl(5, 0), wl(6, 0))
	last := &Round{Number: 3, Members: []Member{{Node: nd(0)}, {Node: nd(1), Rank: 1}}}
	st := s.status(last)
	want := Status{Round: 3, Complete: true, Participants: 1, Waiting: 2, Lost: []NodeDesc{nd(1)}}
	if !reflect.DeepEqual(st, want) {
		t.Errorf("status %+v, want %+v", st, want)
	}
	if st := s.status(nil); st.Lost != nil {
		t.Errorf("no last round, lost %v", st.Lost)
	}
	p := s.progress(nd(0))
	if p.Round != 3 || !slices.Equal(p.Participants, []NodeDesc{nd(0)}) || !slices.Equal(p.Waiting, []NodeDesc{nd(5), nd(6)}) || p.InWaitList {
		t.Errorf("progress to a member %+v", p)
	}
	// A waiting node is told the complete round is not its own (its agent
	// logged "rendezvous complete" while it waited for the next).
	if p := s.progress(nd(5)); !p.Complete || !p.InWaitList {
		t.Errorf("progress to a waiting node %+v, want the round complete and the node in the wait list", p)
	}
}

func TestStateJSON(t *testing.T) {
	s := mkState(dynState{Round: 2, Deadline: at(time.Second), Wake: 7},
		nodeState{NodeDesc: NodeDesc{Addr: "h_x", Pid: 3, LocalID: 1}, Heartbeat: t0, Data: []byte{0, 1}},
		nodeState{NodeDesc: NodeDesc{Addr: "h_y", Pid: 4}, Waiting: true, Heartbeat: t0})
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"round":2,"complete":false,"deadline":"2026-03-01T12:00:01Z","wake":7,"nodes":[` +
		`{"addr":"h_x","pid":3,"local_id":1,"heartbeat":"2026-03-01T12:00:00Z","data":"AAE="},` +
		`{"addr":"h_y","pid":4,"local_id":0,"waiting":true,"heartbeat":"2026-03-01T12:00:00Z"}]}`
	if string(b) != want {
		t.Errorf("layout:\n got %s\nwant %s", b, want)
	}
	var back dynState
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(&back, s) {
		t.Errorf("round trip: %+v, %v", back, err)
	}
	s.Rejoin = []rejoiner{{NodeDesc: NodeDesc{Addr: "h_z", Pid: 5}, Left: t0}}
	b, err = json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if want := `,"rejoin":[{"addr":"h_z","pid":5,"local_id":0,"left":"2026-03-01T12:00:00Z"}]}`; !strings.HasSuffix(string(b), want) {
		t.Errorf("rejoiners' layout: %s, want it to end %s", b, want)
	}
	back = dynState{}
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(&back, s) {
		t.Errorf("round trip with rejoiners: %+v, %v", back, err)
	}
	if string(emptyState) != `{"round":0,"complete":false,"wake":0}` {
		t.Errorf("empty state %s", emptyState)
	}
}

// sim drives the pure core for several nodes against one state, the way
// the executor would with no races: each node in turn applies actions
// until it would sync or is done.
type sim struct {
	t     *testing.T
	s     *dynState
	cfg   DynamicConfig
	alive map[NodeDesc]bool // nil: everyone
}

// step runs op for node i at now until it finishes (true) or syncs.
func (m *sim) step(i int, now time.Time, decide func(*dynState, time.Time) action) bool {
	m.t.Helper()
	for range 10 {
		m.s.sanitize(now, m.cfg)
		a := decide(m.s, now)
		switch a {
		case actFinish:
			return true
		case actSync:
			return false
		case actErrClosed, actErrTimeout:
			m.t.Fatalf("node %d: %v", i, a)
		}
		if !m.s.apply(a, nd(i), []byte(fmt.Sprint("lws=", i+1)), now, m.cfg) {
			m.t.Fatalf("node %d: %v changed nothing", i, a)
		}
	}
	m.t.Fatalf("node %d does not settle", i)
	return false
}

func (m *sim) join(i int, now time.Time) bool {
	m.beat(now)
	return m.step(i, now, func(s *dynState, now time.Time) action { return nextJoinAction(s, nd(i), now, at(time.Hour), m.cfg) })
}

// beat refreshes the heartbeats of the nodes listed in alive (all when
// nil), as their background keep-alives would.
func (m *sim) beat(now time.Time) {
	for i := range m.s.Nodes {
		if m.alive == nil || m.alive[m.s.Nodes[i].NodeDesc] {
			m.s.Nodes[i].Heartbeat = now
		}
	}
}

func (m *sim) exit(i int, now time.Time) {
	m.beat(now)
	m.step(i, now, func(s *dynState, now time.Time) action { return nextExitAction(s, nd(i), now, at(time.Hour)) })
}

// TestScenarioElastic plays torchrun's elastic story on the pure core:
// 3 nodes of 2:4 complete after the last call; a 4th waits; everyone
// re-rendezvouses into round 1 with 4 (scale-up), ranks by node order and
// each node's own data.
func TestScenarioElastic(t *testing.T) {
	m := &sim{t: t, s: &dynState{}, cfg: coreCfg()}
	for i, arrive := range []time.Duration{0, 1 * time.Second, 20 * time.Second} {
		if m.join(2-i, at(arrive)) {
			t.Fatalf("node %d done before the last call", 2-i)
		}
	}
	// The last call runs until 20s+30s: at 50s nobody completes, just after
	// it the first to look does.
	if m.join(0, at(50*time.Second)) {
		t.Fatal("completed at the last call's end, not after")
	}
	if !m.join(1, at(50*time.Second+1)) {
		t.Fatal("not complete after the last call")
	}
	for _, i := range []int{0, 2} {
		if !m.join(i, at(51*time.Second)) {
			t.Fatalf("node %d not done", i)
		}
	}
	r, _ := m.s.round(nd(2))
	if r.Number != 0 || r.Rank != 2 || len(r.Members) != 3 || string(r.Members[1].Data) != "lws=2" {
		t.Fatalf("round 0: %+v", r)
	}

	// Node 3 arrives: the round is complete and has room, so it waits.
	if m.join(3, at(52*time.Second)) {
		t.Fatal("late node joined a complete round")
	}
	if st := m.s.status(&r); st.Waiting != 1 || st.Lost != nil {
		t.Fatalf("status %+v", st)
	}
	// Everyone re-rendezvouses: exit then join. Nodes 0 and 1 find round 0
	// still complete and wait; node 2, the last to exit, starts round 1,
	// which admits the three waiters, and its own join fills it.
	now := at(53 * time.Second)
	for i := range 3 {
		m.exit(i, now)
		m.join(i, now)
		if wantRound := min(i/2, 1); m.s.Round != wantRound {
			t.Fatalf("after node %d: round %d", i, m.s.Round)
		}
	}
	if !m.s.Complete {
		t.Fatal("round 1 not complete at max")
	}
	for i := range 4 {
		if !m.join(i, now) {
			t.Fatalf("node %d not in round 1", i)
		}
		r, _ := m.s.round(nd(i))
		if r.Number != 1 || r.Rank != i || len(r.Members) != 4 {
			t.Fatalf("node %d: %+v", i, r)
		}
	}
}

// TestScenarioDeadNode: a member's heartbeat lapses; the survivors' next
// round leaves it out, and a survivor that had not yet seen the first
// round complete does not get the holed one.
func TestScenarioDeadNode(t *testing.T) {
	cfg := coreCfg()
	cfg.MinNodes, cfg.MaxNodes = 2, 3
	m := &sim{t: t, s: &dynState{}, cfg: cfg}
	for i := range 3 {
		m.join(i, t0)
	}
	if !m.s.Complete {
		t.Fatal("not complete at max")
	}
	// Nodes 0 and 1 keep alive; node 2 is silent. At 15s+1ns it is gone.
	m.alive = map[NodeDesc]bool{nd(0): true, nd(1): true}
	m.beat(at(15 * time.Second))
	last, _ := m.s.round(nd(0))
	if st := m.s.clone(); st.sanitize(at(15*time.Second), cfg) {
		t.Fatal("dropped at exactly the ttl")
	}
	if !m.s.sanitize(at(15*time.Second+1), cfg) {
		t.Fatal("dead node kept")
	}
	if st := m.s.status(&last); !slices.Equal(st.Lost, []NodeDesc{nd(2)}) {
		t.Fatalf("lost %v", st.Lost)
	}
	// Node 1 had not returned from Next yet: it must not take the holed
	// round but leave it, to rejoin.
	if got := nextJoinAction(m.s, nd(1), at(16*time.Second), at(time.Hour), cfg); got != actRemoveToRejoin {
		t.Fatalf("holed round: %v", got)
	}
	now := at(16 * time.Second)
	for i := range 2 {
		m.exit(i, now)
		m.join(i, now)
	}
	// Both survivors left round 0 to rejoin, and both are in round 1:
	// nobody else is expected, so it completed without the 30 s last call.
	if !m.s.Complete || m.s.Round != 1 || m.s.Rejoin != nil {
		t.Fatalf("round %d complete %v rejoin %v", m.s.Round, m.s.Complete, m.s.Rejoin)
	}
	if !m.join(1, now) || !m.join(0, now) {
		t.Fatal("round 1 not complete")
	}
	r, _ := m.s.round(nd(1))
	if len(r.Members) != 2 || r.Rank != 1 || !strings.HasPrefix(r.Members[0].Node.Addr, "10.0.0.00") {
		t.Fatalf("round 1: %+v", r)
	}
}
