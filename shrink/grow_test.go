package shrink

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestEpochGrow: a grow epoch brings lost slots back; survivors keep their
// ranks, newcomers get the next ones in slot order; a shrink after it keeps
// the order the group has, not the launch order.
func TestEpochGrow(t *testing.T) {
	now := time.Unix(2000, 0)
	e1 := mustNext(t, Initial(4), 1, 2)                // ranks [0 -1 -1 1]
	e2, err := e1.grow([]int{2, 1, 2, 0, 9}, "a", now) // 0 alive and 9 out of range: ignored
	if err != nil {
		t.Fatal(err)
	}
	if e2.Number != 2 || e2.Action != ActionGrow || !slices.Equal(e2.Added, []int{1, 2}) || !slices.Equal(e2.Ranks, []int{0, 2, 3, 1}) ||
		e2.WorldSize != 4 || len(e2.Lost) != 0 || len(e2.Excluded) != 0 || !e2.Newcomer(1) || e2.Newcomer(3) {
		t.Fatalf("grow = %+v", e2)
	}
	if !strings.Contains(e2.String(), "added [1 2], world 4") {
		t.Errorf("String() = %q", e2.String())
	}
	// Slot 3 (rank 1) leaves: slot 1 (rank 2) and slot 2 (rank 3) keep
	// their order after slot 0, as pg.Shrink renumbers them.
	e3 := mustNext(t, e2, 3)
	if !slices.Equal(e3.Ranks, []int{0, 1, 2, -1}) || !slices.Equal(e3.ShrinkList(e2), []int{1}) {
		t.Errorf("shrink after grow: ranks %v, shrink list %v; want [0 1 2 -1], [1]", e3.Ranks, e3.ShrinkList(e2))
	}
	e4 := mustNext(t, e2, 0)
	if !slices.Equal(e4.Ranks, []int{-1, 1, 2, 0}) {
		t.Errorf("shrink of rank 0 after grow: ranks %v, want [-1 1 2 0] (slot 3 was rank 1, before the newcomers)", e4.Ranks)
	}
	if _, err := e2.grow([]int{0, 3}, "a", now); err == nil {
		t.Error("a grow of live slots only was accepted")
	}
}

// TestDeciderGrow walks the decision core through heal: joins are grown
// back in once their settle window passes; a grow is done once it is
// complete (every rank acknowledged it); one that does not complete within
// GrowTimeout ends in a shrink that goes back to the group before it and
// excludes its newcomers; a failure during a grow does the same; joins
// wait while a grow is under way.
func TestDeciderGrow(t *testing.T) {
	t0 := time.Unix(0, 0)
	cfg := Config{SettleWindow: 100 * time.Millisecond, GrowTimeout: 10 * time.Second}
	lost := mustNext(t, Initial(4), 2, 3) // slots 2 and 3 lost: world 2

	t.Run("join, grow, complete", func(t *testing.T) {
		d := NewDecider("a", cfg, lost)
		d.Join(t0, Join{Slots: []int{2}, From: "node1"})
		if due := d.Join(t0.Add(50*time.Millisecond), Join{Slots: []int{3, 0}, From: "node1"}); !due.Equal(t0.Add(100 * time.Millisecond)) {
			t.Fatalf("due %v, want the first join's settle window", due)
		}
		if _, ok, _ := d.Decide(t0.Add(99 * time.Millisecond)); ok {
			t.Fatal("decided inside the settle window")
		}
		e, ok, err := d.Decide(t0.Add(100 * time.Millisecond))
		if err != nil || !ok || e.Action != ActionGrow || !slices.Equal(e.Added, []int{2, 3}) || e.WorldSize != 4 || e.Base != lost.Number {
			t.Fatalf("Decide = %+v %v %v, want a grow of slots 2 and 3 from epoch %d", e, ok, err, lost.Number)
		}
		d.Adopt(e)
		if !slices.Equal(d.Awaiting(), []int{2, 3}) || !d.Due().Equal(e.DecidedAt.Add(10*time.Second)) {
			t.Fatalf("awaiting %v due %v", d.Awaiting(), d.Due())
		}
		d.Joined(e.Number, 2)
		d.Joined(e.Number-1, 3) // stale: of an older epoch
		if !slices.Equal(d.Awaiting(), []int{3}) {
			t.Fatalf("awaiting %v after slot 2 joined", d.Awaiting())
		}
		d.Joined(e.Number, 3)
		if due := d.Due(); !due.Equal(e.DecidedAt.Add(10 * time.Second)) {
			t.Fatalf("due %v: every newcomer joined, but the grow is not complete until every rank says so", due)
		}
		d.Complete(e.Number)
		if _, ok, _ := d.Decide(t0.Add(time.Hour)); ok || !d.Due().IsZero() {
			t.Fatalf("an epoch after the grow completed (due %v)", d.Due())
		}
		// The newcomer, started after epoch lost, fails: its report names
		// that epoch (Report.Epoch).
		d.Report(t0.Add(time.Hour), Report{Ranks: []int{2}, Reason: "exit code 1", Epoch: new(lost.Number)})
		s, ok, err := d.Decide(t0.Add(time.Hour + time.Second))
		if err != nil || !ok || !slices.Equal(s.Excluded, []int{2}) || s.Base != e.Number || !slices.Equal(s.ShrinkList(e), []int{2}) {
			t.Fatalf("Decide = %+v %v %v, want slot 2 excluded, from the grown group", s, ok, err)
		}
	})

	t.Run("a grow that does not complete goes back to the group before it", func(t *testing.T) {
		d := NewDecider("a", cfg, lost)
		d.Join(t0, Join{Slots: []int{2, 3}})
		e, _, _ := d.Decide(t0.Add(time.Second))
		d.Adopt(e)
		d.Joined(e.Number, 2)
		if _, ok, _ := d.Decide(e.DecidedAt.Add(9 * time.Second)); ok {
			t.Fatal("excluded before GrowTimeout")
		}
		s, ok, err := d.Decide(e.DecidedAt.Add(10 * time.Second))
		if err != nil || !ok || s.Action != ActionShrink || !slices.Equal(s.Excluded, []int{2, 3}) || s.WorldSize != 2 ||
			s.Base != lost.Number || !strings.Contains(s.Reasons[3], "did not finish joining") ||
			!strings.Contains(s.Reasons[2], "did not complete within 10s") || !slices.Equal(s.Ranks, lost.Ranks) {
			t.Fatalf("Decide = %+v %v %v, want slots 2 and 3 excluded, back to epoch %d's group", s, ok, err, lost.Number)
		}
		if got := s.ShrinkList(lost); len(got) != 0 {
			t.Errorf("shrink list from the base %v: the survivors re-form with nobody dropped", got)
		}
		d.Adopt(s)
		if len(d.Awaiting()) != 0 || !d.Due().IsZero() {
			t.Errorf("still awaiting %v, due %v", d.Awaiting(), d.Due())
		}
	})

	t.Run("a failure during a grow", func(t *testing.T) {
		d := NewDecider("a", cfg, lost)
		d.Join(t0, Join{Slots: []int{2, 3}})
		e, _, _ := d.Decide(t0.Add(time.Second))
		d.Joined(e.Number, 3) // before this agent adopted the epoch
		d.Adopt(e)
		d.Report(t0.Add(2*time.Second), Report{Ranks: []int{0}, Reason: "exit code 1"})
		s, ok, err := d.Decide(t0.Add(2*time.Second + 100*time.Millisecond))
		if err != nil || !ok || s.Action != ActionShrink || !slices.Equal(s.Excluded, []int{0, 2, 3}) || s.Reasons[0] != "exit code 1" ||
			s.Base != lost.Number || !slices.Equal(s.ShrinkList(lost), []int{0}) {
			t.Fatalf("Decide = %+v %v %v, want rank 0 (failed) and the newcomers excluded, from epoch %d", s, ok, err, lost.Number)
		}
		// The newcomers are not blamed for a grow the failure cut short.
		for g, want := range map[int]string{
			2: "a failure ended the grow of epoch 2 1.1s after it began, before newcomer in slot 2 had joined",
			3: "a failure ended the grow of epoch 2 before it completed",
		} {
			if s.Reasons[g] != want {
				t.Errorf("reason for slot %d: %q, want %q", g, s.Reasons[g], want)
			}
		}
	})

	t.Run("news of a grow before it is adopted", func(t *testing.T) {
		d := NewDecider("a", cfg, lost)
		d.Join(t0, Join{Slots: []int{2}})
		e, _, _ := d.Decide(t0.Add(time.Second))
		d.Joined(e.Number, 2)
		d.Complete(e.Number)
		d.Adopt(e)
		if len(d.Awaiting()) != 0 || !d.Due().IsZero() {
			t.Errorf("awaiting %v, due %v: the grow completed before this agent saw it", d.Awaiting(), d.Due())
		}
	})

	t.Run("joins wait for the grow under way", func(t *testing.T) {
		d := NewDecider("a", cfg, mustNext(t, Initial(4), 1, 2, 3))
		d.Join(t0, Join{Slots: []int{1}})
		e, _, _ := d.Decide(t0.Add(time.Second))
		d.Adopt(e)
		d.Join(t0.Add(time.Second), Join{Slots: []int{2, 3}})
		if _, ok, _ := d.Decide(t0.Add(5 * time.Second)); ok {
			t.Fatal("a second grow while the first is under way")
		}
		d.Complete(e.Number)
		g, ok, err := d.Decide(t0.Add(5 * time.Second))
		if err != nil || !ok || !slices.Equal(g.Added, []int{2, 3}) || !slices.Equal(g.Ranks, []int{0, 1, 2, 3}) || g.Base != e.Number {
			t.Fatalf("Decide = %v %v %v, want a grow of 2 and 3", g, ok, err)
		}
	})

	t.Run("a join of a live slot is ignored", func(t *testing.T) {
		d := NewDecider("a", cfg, lost)
		if due := d.Join(t0, Join{Slots: []int{0, 1, -1, 7}}); !due.IsZero() {
			t.Fatalf("due %v for joins of live or unknown slots", due)
		}
	})
}

// TestCoordinatorHeals: through a real store, a rank fails and is shrunk
// away; its respawn joins and is grown back in; once every rank has
// arrived in the grown group, nothing more happens. A second respawn that never says so is excluded
// again after GrowTimeout. A second agent, following, sees the same epochs.
func TestCoordinatorHeals(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	cfg := CoordinatorConfig{Config: Config{SettleWindow: 20 * time.Millisecond, GrowTimeout: 500 * time.Millisecond}, World: 4}
	cfg.Name = "a"
	a := agentSide(t, dial, cfg)
	cfg.Name = "b"
	b := agentSide(t, dial, cfg)
	a.Lead(ctx, true)
	both := func(want func(Epoch) bool, what string) Epoch {
		t.Helper()
		e := nextEpoch(t, a, 10*time.Second)
		if f := nextEpoch(t, b, 10*time.Second); f.Number != e.Number || !slices.Equal(f.Ranks, e.Ranks) {
			t.Fatalf("the follower saw %v, the leader %v", f, e)
		}
		if !want(e) {
			t.Fatalf("epoch %v, want %s", e, what)
		}
		return e
	}
	if err := b.File(ctx, Report{Ranks: []int{2}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	both(func(e Epoch) bool { return e.Number == 1 && slices.Equal(e.Excluded, []int{2}) }, "rank 2 excluded")
	if err := b.FileJoin(ctx, Join{Slots: []int{2}}); err != nil {
		t.Fatal(err)
	}
	g := both(func(e Epoch) bool {
		return e.Action == ActionGrow && slices.Equal(e.Added, []int{2}) && slices.Equal(e.Ranks, []int{0, 1, 3, 2})
	}, "slot 2 grown back as rank 3")
	board := NewBoard(dial(), "")
	if _, err := board.FileJoined(ctx, Joined{Epoch: g.Number, Slot: 2}); err != nil {
		t.Fatal(err)
	}
	arriveAll(ctx, t, board, g) // the last of the four files the grow's Complete
	select {
	case e := <-a.Epochs():
		t.Fatalf("an epoch after the grow completed: %v", e)
	case err := <-a.Err():
		t.Fatalf("agreement failed: %v", err)
	case <-time.After(time.Second): // two GrowTimeouts
	}
	// Rank 0 fails; its respawn is grown in but never finishes joining.
	if err := a.File(ctx, Report{Ranks: []int{0}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	both(func(e Epoch) bool { return slices.Equal(e.Excluded, []int{0}) }, "rank 0 excluded")
	if err := a.FileJoin(ctx, Join{Slots: []int{0}}); err != nil {
		t.Fatal(err)
	}
	grown := both(func(e Epoch) bool { return e.Action == ActionGrow && slices.Equal(e.Added, []int{0}) }, "slot 0 grown back")
	out := both(func(e Epoch) bool {
		return e.Action == ActionShrink && slices.Equal(e.Excluded, []int{0}) && e.Base == grown.Base
	}, "slot 0 excluded again, back to the group before the grow")
	if d := out.DecidedAt.Sub(grown.DecidedAt); d < 500*time.Millisecond || d > 5*time.Second {
		t.Errorf("excluded %v after the grow, want about GrowTimeout (500 ms)", d)
	}
}

// arriveAll acknowledges epoch e for each of its members.
func arriveAll(ctx context.Context, t *testing.T, b *Board, e Epoch) {
	t.Helper()
	for g, r := range e.Ranks {
		if r < 0 {
			continue
		}
		if err := b.Arrive(ctx, e, g); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCoordinatorCompletesATamperedGrow: the ack counter of a grow is
// tampered with (decremented by someone who reaches the store), so the
// member that arrives last does not see the count reach the world size and
// files no Complete. Every member's sealed ack is there, and the leader,
// looking before it gives the grow up at its GrowTimeout, files the
// Complete itself: the grow stands, and no epoch excludes the newcomer.
func TestCoordinatorCompletesATamperedGrow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	cfg := CoordinatorConfig{Config: Config{SettleWindow: 20 * time.Millisecond, GrowTimeout: 500 * time.Millisecond}, World: 3, Name: "a"}
	a := agentSide(t, dial, cfg)
	a.Lead(ctx, true)
	if err := a.File(ctx, Report{Ranks: []int{1}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	if e := nextEpoch(t, a, 10*time.Second); !slices.Equal(e.Excluded, []int{1}) {
		t.Fatalf("epoch %v, want rank 1 excluded", e)
	}
	if err := a.FileJoin(ctx, Join{Slots: []int{1}}); err != nil {
		t.Fatal(err)
	}
	g := nextEpoch(t, a, 10*time.Second)
	if g.Action != ActionGrow {
		t.Fatalf("epoch %v, want the grow of slot 1", g)
	}
	raw := rendezvous.NewPrefixStore(DefaultPrefix, dial())
	if _, err := raw.Add(ctx, ackKey(g.Number), -10); err != nil {
		t.Fatal(err)
	}
	board := NewBoard(dial(), "")
	if _, err := board.FileJoined(ctx, Joined{Epoch: g.Number, Slot: 1}); err != nil {
		t.Fatal(err)
	}
	arriveAll(ctx, t, board, g)
	select {
	case c := <-a.Completions():
		if c.Epoch != g.Number {
			t.Fatalf("completion of epoch %d, want %d", c.Epoch, g.Number)
		}
		if d := c.At.Sub(g.DecidedAt); d < 500*time.Millisecond {
			t.Errorf("completed %v after the decision, before the GrowTimeout (500 ms): who filed it?", d)
		}
	case e := <-a.Epochs():
		t.Fatalf("epoch %v; want the grow completed", e)
	case <-time.After(5 * time.Second):
		t.Fatal("the grow never completed")
	}
	select {
	case e := <-a.Epochs():
		t.Fatalf("an epoch after the grow completed: %v", e)
	case <-time.After(time.Second):
	}
}

// TestDeciderRejoinTogether: slots lost in one epoch (a node's ranks) are
// grown back in one epoch even when their joins come more than a settle
// window apart, up to RejoinWait after the first; a slot that never joins
// holds the others up no longer than that; slots lost in different epochs
// do not wait for each other.
func TestDeciderRejoinTogether(t *testing.T) {
	t0 := time.Unix(0, 0)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	cfg := Config{SettleWindow: 100 * time.Millisecond, GrowTimeout: 10 * time.Second, RejoinWait: time.Second}
	node := mustNext(t, Initial(8), 4, 5, 6, 7) // a node's four ranks lost together
	type join struct {
		at    int // ms
		slots []int
	}
	tests := []struct {
		name   string
		from   Epoch
		cfg    Config
		joins  []join
		growAt int   // ms: when Decide first grows
		added  []int // what it grows back
	}{
		{"all four, 300 ms apart", node, cfg,
			[]join{{0, []int{6}}, {300, []int{4}}, {450, []int{5, 7}}}, 450, []int{4, 5, 6, 7}},
		{"one never comes", node, cfg,
			[]join{{0, []int{6}}, {300, []int{4, 5}}}, 1000, []int{4, 5, 6}},
		{"no rejoin wait", node, Config{SettleWindow: 100 * time.Millisecond, RejoinWait: -1},
			[]join{{0, []int{6}}, {300, []int{4}}}, 100, []int{6}},
		{"lost apart: no wait", mustNext(t, mustNext(t, Initial(8), 4), 5), cfg,
			[]join{{0, []int{5}}}, 100, []int{5}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecider("a", tt.cfg, tt.from)
			i := 0
			for now := 0; now <= 2000; now += 10 {
				for i < len(tt.joins) && tt.joins[i].at <= now {
					d.Join(ms(now), Join{Slots: tt.joins[i].slots, From: "node2", SeenAt: ms(tt.joins[i].at)})
					i++
				}
				e, ok, err := d.Decide(ms(now))
				if err != nil {
					t.Fatal(err)
				}
				if !ok {
					continue
				}
				if now != tt.growAt || !slices.Equal(e.Added, tt.added) {
					t.Fatalf("grow at %d ms adding %v; want at %d ms adding %v", now, e.Added, tt.growAt, tt.added)
				}
				return
			}
			t.Fatalf("no grow within 2 s; want one at %d ms", tt.growAt)
		})
	}
	// While slots lost together are missing, the decision is due at the
	// end of the rejoin wait, not of the settle window.
	d := NewDecider("a", cfg, node)
	if due := d.Join(t0, Join{Slots: []int{6}, SeenAt: t0}); !due.Equal(ms(1000)) {
		t.Errorf("Due %v after the first of four joins; want %v", due, ms(1000))
	}
}
