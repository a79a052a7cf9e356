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
	all := NewDecider("a", Config{}, Initial(2))
	all.Report(t0, Report{Ranks: []int{0, 1}})
	if _, _, err := all.Decide(t0.Add(time.Hour)); err == nil {
		t.Error("Decide with every rank failed returned no error")
	}
}
