package shrink

import (
	"slices"
	"testing"
	"time"
)

func TestDeciderSettleWindow(t *testing.T) {
	t0 := time.Unix(5000, 0)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	cfg := Config{SettleWindow: 100 * time.Millisecond}
	type step struct {
		at     int   // ms after t0
		report []int // nil: call Decide instead
		seenAt int   // ms after t0 when the failure was seen; -1: unset
		// for Decide:
		wantOK    bool
		wantExcl  []int
		wantDueMs int // for Report: the due time returned, ms after t0; -1: zero
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"two failures 40 ms apart become one epoch", []step{
			{at: 0, report: []int{2}, seenAt: -1, wantDueMs: 100},
			{at: 40, report: []int{6}, seenAt: -1, wantDueMs: 100},
			{at: 99},
			{at: 100, wantOK: true, wantExcl: []int{2, 6}},
		}},
		{"the window runs from when the failure was seen", []step{
			{at: 30, report: []int{1}, seenAt: 0, wantDueMs: 100},
			{at: 100, wantOK: true, wantExcl: []int{1}},
		}},
		{"an earlier sighting moves the decision earlier", []step{
			{at: 50, report: []int{1}, seenAt: -1, wantDueMs: 150},
			{at: 60, report: []int{3}, seenAt: 10, wantDueMs: 110},
			{at: 110, wantOK: true, wantExcl: []int{1, 3}},
		}},
		{"a repeated report does not extend the window", []step{
			{at: 0, report: []int{4}, seenAt: -1, wantDueMs: 100},
			{at: 90, report: []int{4}, seenAt: -1, wantDueMs: 100},
			{at: 100, wantOK: true, wantExcl: []int{4}},
		}},
		{"ranks out of range are ignored", []step{
			{at: 0, report: []int{99, -1}, seenAt: -1, wantDueMs: -1},
			{at: 500},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecider("agent0", cfg, Initial(8))
			for i, s := range tt.steps {
				if s.report != nil {
					r := Report{Ranks: s.report, Reason: "exit code 1"}
					if s.seenAt >= 0 {
						r.SeenAt = ms(s.seenAt)
					}
					due := d.Report(ms(s.at), r)
					wantDue := time.Time{}
					if s.wantDueMs >= 0 {
						wantDue = ms(s.wantDueMs)
					}
					if !due.Equal(wantDue) {
						t.Fatalf("step %d: Report due %v, want %v", i, due.Sub(t0), wantDue.Sub(t0))
					}
					continue
				}
				e, ok, err := d.Decide(ms(s.at))
				if err != nil {
					t.Fatalf("step %d: Decide: %v", i, err)
				}
				if ok != s.wantOK || (ok && !slices.Equal(e.Excluded, s.wantExcl)) {
					t.Fatalf("step %d at %d ms: Decide = %v, %v; want ok=%v excluded %v", i, s.at, e, ok, s.wantOK, s.wantExcl)
				}
			}
		})
	}
}

func TestDeciderAdopt(t *testing.T) {
	t0 := time.Unix(0, 0)
	d := NewDecider("agent1", Config{SettleWindow: 10 * time.Millisecond}, Initial(4))
	d.Report(t0, Report{Ranks: []int{1}})
	e1, ok, err := d.Decide(t0.Add(10 * time.Millisecond))
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	// A report that arrives between the decision and its publication
	// stays pending for the next epoch.
	d.Report(t0.Add(12*time.Millisecond), Report{Ranks: []int{3}})
	d.Adopt(e1)
	if d.Current().Number != 1 || !slices.Equal(d.Pending(), []int{3}) {
		t.Fatalf("after Adopt: epoch %d pending %v, want 1 and [3]", d.Current().Number, d.Pending())
	}
	e2, ok, _ := d.Decide(t0.Add(22 * time.Millisecond))
	if !ok || e2.Number != 2 || !slices.Equal(e2.Excluded, []int{3}) || e2.WorldSize != 2 {
		t.Fatalf("second decision = %v, %v", e2, ok)
	}

	// A rival's epoch that already excluded our pending rank settles it.
	r := NewDecider("agent2", Config{SettleWindow: time.Second}, Initial(4))
	r.Report(t0, Report{Ranks: []int{1}})
	r.Adopt(e1)
	if len(r.Pending()) != 0 || !r.Due().IsZero() {
		t.Errorf("rival epoch did not settle the pending report: pending %v due %v", r.Pending(), r.Due())
	}
	// Adopting an older epoch never moves back.
	r.Adopt(Initial(4))
	if r.Current().Number != 1 {
		t.Errorf("Adopt(epoch 0) moved the decider back to %d", r.Current().Number)
	}
}

func TestDeciderFloorAndNoSurvivors(t *testing.T) {
	t0 := time.Unix(0, 0)
	d := NewDecider("a", Config{MinWorldSize: 3}, Initial(4))
	d.Report(t0, Report{Ranks: []int{0, 2}})
	e, ok, err := d.Decide(t0.Add(DefaultSettleWindow))
	if err != nil || !ok || e.Action != ActionRestart || e.WorldSize != 2 {
		t.Errorf("below the floor: %v %v %v, want a restart epoch of world 2", e, ok, err)
	}
	// Every rank failed: a restart epoch too, which every agent reads,
	// not an error of the deciding coordinator alone.
	all := NewDecider("a", Config{}, Initial(2))
	all.Report(t0, Report{Ranks: []int{0, 1}})
	if e, ok, err := all.Decide(t0.Add(time.Hour)); err != nil || !ok || e.Action != ActionRestart || e.WorldSize != 0 || !slices.Equal(e.Excluded, []int{0, 1}) {
		t.Errorf("every rank failed: %v %v %v, want a restart epoch of world 0 excluding both", e, ok, err)
	}
}

// TestDeciderFencesExcludedReporters: a node cut off and excluded sees the
// others go silent; when its link comes back, its agent files them as lost
// before it has read the epoch that excluded it. That report must not
// exclude the nodes that carried on, while reports from nodes the epoch
// keeps, from a node that knew it was excluded (its workers all failed,
// and then it saw another node go), and from agents that do not say what
// they hold, count as ever.
func TestDeciderFencesExcludedReporters(t *testing.T) {
	t0 := time.Unix(0, 0)
	// Three nodes of two ranks: node B (ranks 2, 3) was cut off and
	// excluded; A holds 0 and 1, C 4 and 5.
	cut := mustNext(t, Initial(6), 2, 3)
	for _, tt := range []struct {
		name string
		r    Report
		want bool // a shrink is decided
	}{
		{"from the node cut off", Report{Ranks: []int{0, 1}, Reason: "node A lost", Holds: []int{2, 3}, Epoch: new(0)}, false},
		{"from the excluded node that knew", Report{Ranks: []int{0, 1}, Reason: "node A lost", Holds: []int{2, 3}, Epoch: new(1)}, true},
		{"from a node the epoch keeps", Report{Ranks: []int{1}, Reason: "rank 1 exited", Holds: []int{0, 1}, Epoch: new(1)}, true},
		{"from a node half kept", Report{Ranks: []int{0}, Reason: "rank 0 exited", Holds: []int{0, 2}, Epoch: new(0)}, true},
		{"from an agent that does not say", Report{Ranks: []int{1}, Reason: "rank 1 exited"}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecider("a", Config{}, cut)
			due := d.Report(t0, tt.r)
			e, ok, err := d.Decide(t0.Add(time.Hour))
			if err != nil || ok != tt.want || due.IsZero() == tt.want {
				t.Fatalf("Report then Decide: due %v, epoch %v, decided %v, %v; want decided %v", due, e, ok, err, tt.want)
			}
			if ok && e.Alive(tt.r.Ranks[0]) {
				t.Errorf("epoch %v keeps rank %d", e, tt.r.Ranks[0])
			}
		})
	}
}

// TestDeciderFencesReportsBeforeTheEpoch: the cut-off node's report can
// reach a coordinator before the epoch that excluded that node does (the
// cut-off agent's own coordinator, which reads its notice before it reads
// the epoch). Adopting the epoch drops what only such reports named.
func TestDeciderFencesReportsBeforeTheEpoch(t *testing.T) {
	t0 := time.Unix(0, 0)
	start := Initial(6) // nodes A {0, 1}, B {2, 3}, C {4, 5}
	cut := mustNext(t, start, 2, 3)
	for _, tt := range []struct {
		name    string
		reports []Report
		want    []int // pending after the adoption
	}{
		{"only from the node cut off", []Report{{Ranks: []int{0, 1}, Holds: []int{2, 3}, Epoch: new(0)}}, nil},
		{"from the node cut off and from another", []Report{
			{Ranks: []int{0, 1}, Holds: []int{2, 3}, Epoch: new(0)},
			{Ranks: []int{1}, Holds: []int{4, 5}, Epoch: new(0)},
		}, []int{1}},
		{"from another node", []Report{{Ranks: []int{0}, Holds: []int{4, 5}, Epoch: new(0)}}, []int{0}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecider("b", Config{}, start)
			for _, r := range tt.reports {
				d.Report(t0, r)
			}
			d.Adopt(cut)
			if got := d.Pending(); !slices.Equal(got, tt.want) {
				t.Fatalf("pending after adopting %v: %v, want %v", cut, got, tt.want)
			}
			e, ok, err := d.Decide(t0.Add(time.Hour))
			if ok != (len(tt.want) > 0) || err != nil {
				t.Errorf("Decide: %v %v %v; want a decision %v", e, ok, err, len(tt.want) > 0)
			}
		})
	}
}

// TestDeciderSkipsReportsOfAnEarlierLife: a node's report of another node
// lost, filed before that node's slots were grown back in, is about their
// last life: it must not exclude them again (seen with a link cut and
// healed: the cut-off node's own coordinator read the report filed against
// it after the grow that brought it back). Filed after the grow, it counts.
func TestDeciderSkipsReportsOfAnEarlierLife(t *testing.T) {
	t0 := time.Unix(0, 0)
	cut := mustNext(t, Initial(4), 2, 3)
	d := NewDecider("b", Config{SettleWindow: -1}, cut)
	d.Join(t0, Join{Slots: []int{2, 3}})
	grow, ok, err := d.Decide(t0)
	if err != nil || !ok || grow.Action != ActionGrow {
		t.Fatalf("Decide the grow: %v %v %v", grow, ok, err)
	}
	d.Adopt(grow)
	d.Report(t0, Report{Ranks: []int{2, 3}, Reason: "node B lost", Holds: []int{0, 1}, Epoch: new(cut.Number - 1)})
	if p := d.Pending(); len(p) != 0 {
		t.Errorf("pending after a report filed before the grow: %v, want none", p)
	}
	d.Report(t0, Report{Ranks: []int{3}, Reason: "node B lost", Holds: []int{0, 1}, Epoch: new(grow.Number)})
	if p := d.Pending(); !slices.Equal(p, []int{3}) {
		t.Errorf("pending after a report filed in the grow's epoch: %v, want [3]", p)
	}
}

// TestDeciderOutstanding: what an agreement given up names is whatever Due
// waits on: failed ranks, a grow not complete (its newcomers not joined,
// or, all in, the acknowledgements still missing), slots offered. A
// give-up named only the first two, and read "failed ranks [] (newcomers
// [] awaited)" on a grow whose newcomers had all joined (bench/chaos).
func TestDeciderOutstanding(t *testing.T) {
	t0 := time.Unix(0, 0)
	cut := mustNext(t, Initial(4), 2, 3) // epoch 1: slots 2 and 3 lost
	// grown returns a decider on the grow of slots 2 and 3 after cut.
	grown := func(t *testing.T) *Decider {
		d := NewDecider("a", Config{SettleWindow: -1}, cut)
		d.Join(t0, Join{Slots: []int{2, 3}})
		g, ok, err := d.Decide(t0)
		if err != nil || !ok || g.Action != ActionGrow {
			t.Fatalf("Decide the grow: %v %v %v", g, ok, err)
		}
		d.Adopt(g)
		return d
	}
	tests := []struct {
		name string
		d    func(*testing.T) *Decider
		want string
		// stalls: what is pending holds the group up (Stalls), which
		// the coordinator gives up on after its timeout.
		stalls bool
	}{
		{"nothing", func(*testing.T) *Decider { return NewDecider("a", Config{}, cut) }, "", false},
		{"a failure", func(*testing.T) *Decider {
			d := NewDecider("a", Config{}, cut)
			d.Report(t0, Report{Ranks: []int{1, 0}, Reason: "exited"})
			return d
		}, "failed ranks [0 1]", true},
		{"slots offered", func(*testing.T) *Decider {
			d := NewDecider("a", Config{}, cut)
			d.Join(t0, Join{Slots: []int{3, 2}})
			return d
		}, "slots [2 3] offered to grow back in", false},
		{"a grow, newcomers not joined", func(t *testing.T) *Decider {
			d := grown(t)
			d.Joined(2, 3)
			return d
		}, "the grow of epoch 2 (slots [2 3]), not complete: newcomers [2] have not joined", true},
		{"a grow, every newcomer joined", func(t *testing.T) *Decider {
			d := grown(t)
			d.Joined(2, 2)
			d.Joined(2, 3)
			return d
		}, "the grow of epoch 2 (slots [2 3]), not complete: every newcomer joined, not every rank has acknowledged it", true},
		{"a grow and a failure", func(t *testing.T) *Decider {
			d := grown(t)
			d.Report(t0, Report{Ranks: []int{0}, Reason: "exited"})
			return d
		}, "failed ranks [0]; the grow of epoch 2 (slots [2 3]), not complete: newcomers [2 3] have not joined", true},
		{"a grow complete", func(t *testing.T) *Decider {
			d := grown(t)
			d.Complete(2)
			return d
		}, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := tt.d(t)
			if got := d.Outstanding(); got != tt.want {
				t.Errorf("Outstanding() = %q, want %q", got, tt.want)
			}
			// Named exactly when Due waits on something.
			if got := d.Outstanding(); (got == "") != d.Due().IsZero() {
				t.Errorf("Outstanding() = %q with Due %v", got, d.Due())
			}
			if got := d.Stalls(); got != tt.stalls {
				t.Errorf("Stalls() = %v, want %v", got, tt.stalls)
			}
		})
	}
}

// TestDeciderJoinAnsweredAlready: a Join read after a grow that answered
// it (a new leader resuming from the floor reads the log beside the
// epochs) does not grow the slot back again. Seen in bench/chaos: the
// coordinator's host lost, its replacement led from the floor (epoch 1
// here), read slot 5's Join after adopting the grow that added it and the
// shrink that excluded it again (its newcomer stopped), and grew slot 5
// back for a newcomer nobody would start: the survivors waited out the
// grow and the job restarted. A Join the newcomer filed after that grow
// (its formation failed), or one that says nothing of its epoch, is news.
func TestDeciderJoinAnsweredAlready(t *testing.T) {
	t0 := time.Unix(0, 0)
	lost := mustNext(t, Initial(6), 5) // epoch 1: slot 5 lost
	grown, err := lost.grow([]int{5}, "a", t0)
	if err != nil {
		t.Fatal(err)
	}
	again := mustNext(t, grown, 4, 5) // epoch 3: the grow ended by a failure
	for _, tt := range []struct {
		name  string
		after *int
		grow  []int // what the decider grows back; nil: nothing
	}{
		{"filed before the grow that answered it", new(lost.Number), nil},
		{"filed after that grow", new(grown.Number), []int{5}},
		{"filed after the epoch that excluded it", new(again.Number), []int{5}},
		{"its epoch not said", nil, []int{5}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecider("late", Config{SettleWindow: -1, RejoinWait: -1}, lost)
			d.Adopt(grown)
			d.Adopt(again)
			d.Join(t0, Join{Slots: []int{5}, From: "slot 5", After: tt.after})
			e, ok, err := d.Decide(t0.Add(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			if ok != (tt.grow != nil) || (ok && (e.Action != ActionGrow || !slices.Equal(e.Added, tt.grow))) {
				t.Errorf("Decide: %v (decided %v); want a grow of %v", e, ok, tt.grow)
			}
		})
	}
}
