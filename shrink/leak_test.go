package shrink

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// healCycle drives one heal cycle through the Board as the agents and
// workers of a world-rank job do, a Coordinator deciding: rank victim
// fails, the shrink epoch is acknowledged by the survivors, a newcomer
// joins, forms the grown group under the epoch's Namespace (a key per
// rank, as a backend's formation leaves) and every rank arrives, the last
// filing the Complete. It returns the grow epoch.
func healCycle(ctx context.Context, t *testing.T, coord *Coordinator, b *Board, raw rendezvous.Store, world, victim int) Epoch {
	t.Helper()
	if err := coord.File(ctx, Report{Ranks: []int{victim}, Reason: "killed"}); err != nil {
		t.Fatal(err)
	}
	shrunk := nextEpoch(t, coord, 10*time.Second)
	if !slices.Equal(shrunk.Excluded, []int{victim}) {
		t.Fatalf("epoch %v, want rank %d excluded", shrunk, victim)
	}
	arriveAll(ctx, t, b, shrunk)
	// The agent counts the respawn against the job's budget, then starts
	// the newcomer.
	if _, ok, err := b.TakeRespawn(ctx, 1<<20); err != nil || !ok {
		t.Fatalf("take a respawn ticket: %v, %v", ok, err)
	}
	if err := coord.FileJoin(ctx, Join{Slots: []int{victim}}); err != nil {
		t.Fatal(err)
	}
	grown := nextEpoch(t, coord, 10*time.Second)
	if grown.Action != ActionGrow || !slices.Equal(grown.Added, []int{victim}) {
		t.Fatalf("epoch %v, want slot %d grown back", grown, victim)
	}
	for r := range grown.WorldSize {
		// As Go's pg/cpu and PyTorch's gloo under gorun_ft.py leave them.
		for _, k := range []string{fmt.Sprintf("%s/addr/%d", Namespace(grown.Number), r),
			fmt.Sprintf("gorun_ft/attempt_0/epoch_%d/%d", grown.Number, r)} {
			if err := raw.Set(ctx, k, []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := b.FileJoined(ctx, Joined{Epoch: grown.Number, Slot: victim}); err != nil {
		t.Fatal(err)
	}
	arriveAll(ctx, t, b, grown)
	select {
	case c := <-coord.Completions():
		if c.Epoch != grown.Number {
			t.Fatalf("complete %d, want %d", c.Epoch, grown.Number)
		}
	case err := <-coord.Err():
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("the grow never completed")
	}
	return grown
}

// TestFormedIn: the formation keys the floor collects, by epoch.
func TestFormedIn(t *testing.T) {
	for key, want := range map[string]int{
		"gorun/epoch/3/addr/1": 3, "gorun/epoch/12/x": 12, "gorun_ft/attempt_0/epoch_4/0": 4,
		"gorun_ft/attempt_2/epoch_7/switch/1": 7,
		// Not an epoch's formation: kept.
		"gorun/epoch/3": 0, "gorun/epoch/x/1": 0, "gorun/epoch/0/1": 0, "gorun_ft/attempt_0/epoch_0/1": 0,
		"gorun_ft/attempt_0/built": 0, "gorun/shrink/epoch/3": 0, "epoch_3/1": 0,
	} {
		n, ok := formedIn(key)
		if ok != (want > 0) || n != want {
			t.Errorf("formedIn(%q) = %d, %v; want %d", key, n, ok, want)
		}
	}
}

// TestBoardKeysBoundedOverEpochs is issue 16's store invariant on the
// agreement alone: a job that loses a rank and grows it back, over and
// over, holds no more keys after 40 such cycles (80 epochs) than after 3,
// give or take a cycle's worth — the leader raises the Board's Floor on
// each complete grow and collects what is a generation older (epochs,
// counters, notices, respawn tickets, the groups' formation keys). A Coordinator started
// afterwards, as an agent admitted late starts one, resumes from the
// Floor (its first epoch is the floor's, not epoch 1) and follows the
// next epoch; a worker that fell a cycle behind is told ErrCollected.
func TestBoardKeysBoundedOverEpochs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	dial := func() *tcpstore.Client {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	raw := dial()
	b := NewBoard(raw, "")
	const world = 4
	cfg := CoordinatorConfig{Config: Config{SettleWindow: time.Millisecond, RejoinWait: -1}, World: world, Name: "a"}
	lead := agentSide(t, dial, cfg)
	lead.Lead(ctx, true)
	keys := func() []string {
		t.Helper()
		ks, err := raw.ListKeys(ctx)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(ks)
		return ks
	}
	// swept reports whether the sweep that follows f's raise is done: no
	// epoch, ack, notice or formation key below f is left.
	swept := func(f Floor) bool {
		t.Helper()
		for _, k := range keys() {
			var n int
			if formed, ok := formedIn(k); ok {
				n = formed
			} else if _, err := fmt.Sscanf(k, DefaultPrefix+"/epoch/%d", &n); err != nil {
				if _, err := fmt.Sscanf(k, DefaultPrefix+"/ack/%d", &n); err != nil {
					if _, err := fmt.Sscanf(k, DefaultPrefix+"/report/%d", &n); err == nil && f.noticeCollected(n) {
						return false
					}
					if _, err := fmt.Sscanf(k, DefaultPrefix+"/respawns/%d", &n); err == nil && n <= f.SweptTickets {
						return false
					}
					continue
				}
			}
			if f.collected(n) {
				return false
			}
		}
		return true
	}
	// The collector raises the floor, then sweeps below it, apart from the
	// loop: wait for both.
	floorAt := func(epoch int) Floor {
		t.Helper()
		for giveUp := time.Now().Add(10 * time.Second); ; {
			f, err := b.Floor(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if f.Epoch >= epoch && swept(f) {
				return f
			}
			if time.Now().After(giveUp) {
				t.Fatalf("the floor stays at epoch %d (want %d), what is below it swept: %v", f.Epoch, epoch, swept(f))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	var e Epoch
	for range 3 {
		e = healCycle(ctx, t, lead, b, raw, world, 2)
	}
	floorAt(e.Number)
	after3 := len(keys())
	for i := range 37 {
		e = healCycle(ctx, t, lead, b, raw, world, i%world)
	}
	f := floorAt(e.Number)
	if got, limit := keys(), after3+4*world; len(got) > limit {
		t.Errorf("after %d epochs the store holds %d keys; after 6 it held %d: want at most %d:\n%v", e.Number, len(got), after3, limit, got)
	}
	if f.SweptEpoch != e.Number-2 || f.Notice < f.SweptNotice {
		t.Errorf("floor %+v after epoch %d: want the previous grow's epoch (%d) swept below", f, e.Number, e.Number-2)
	}
	// The collector raises each floor apart from the loop: the previous
	// one may have counted the last cycle's ticket too.
	if f.Tickets != 40 || f.SweptTickets < 39 || f.SweptTickets > f.Tickets {
		t.Errorf("floor %+v after 40 respawns: want 40 tickets counted, 39 or 40 swept", f)
	}
	if _, err := b.Await(ctx, 1); !errors.Is(err, ErrCollected) {
		t.Errorf("await epoch 1 after %d epochs: %v, want ErrCollected", e.Number, err)
	}
	if _, err := b.AwaitNotice(ctx, 1); !errors.Is(err, ErrCollected) {
		t.Errorf("await notice 1: %v, want ErrCollected", err)
	}
	if n, err := b.Latest(ctx); err != nil || n != e.Number {
		t.Errorf("latest = %d, %v; want %d", n, err, e.Number)
	}

	// An agent admitted late: its Coordinator starts at the floor.
	cfg.Name = "late"
	late := agentSide(t, dial, cfg)
	if first := nextEpoch(t, late, 10*time.Second); first.Number != f.Epoch {
		t.Fatalf("the late coordinator starts at epoch %d, want the floor's %d", first.Number, f.Epoch)
	}
	if err := late.File(ctx, Report{Ranks: []int{1}, Reason: "killed"}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*Coordinator{lead, late} {
		if next := nextEpoch(t, c, 10*time.Second); next.Number != e.Number+1 || !slices.Equal(next.Excluded, []int{1}) {
			t.Errorf("after the floor: %v, want epoch %d excluding rank 1", next, e.Number+1)
		}
	}
}

// TestDeciderFloor: a floor is offered only when the current epoch is
// complete and nothing is pending; a Decider resumed from it decides as
// the one that followed the whole history.
func TestDeciderFloor(t *testing.T) {
	t0 := time.Unix(0, 0)
	cfg := Config{SettleWindow: time.Millisecond, RejoinWait: time.Second}
	d := NewDecider("a", cfg, Initial(4))
	if _, ok := d.Floor(0); ok {
		t.Fatal("a floor at the launch")
	}
	decide := func(at time.Time) Epoch {
		t.Helper()
		e, ok, err := d.Decide(at)
		if err != nil || !ok {
			t.Fatalf("decide at %v: %v %v", at, ok, err)
		}
		d.Adopt(e)
		return e
	}
	d.Report(t0, Report{Ranks: []int{2, 3}, SeenAt: t0})
	decide(t0.Add(time.Millisecond)) // epoch 1: 2 and 3 lost together
	d.Join(t0, Join{Slots: []int{2, 3}, SeenAt: t0})
	g := decide(t0.Add(2 * time.Second)) // epoch 2: both back
	if _, ok := d.Floor(5); ok {
		t.Fatal("a floor while the grow is not complete")
	}
	d.Report(t0, Report{Ranks: []int{1}, SeenAt: t0})
	d.Complete(g.Number)
	if _, ok := d.Floor(7); ok {
		t.Fatal("a floor while a failure is pending")
	}
	d.Report(t0, Report{Ranks: []int{0}, SeenAt: t0})
	decide(t0.Add(3 * time.Second)) // epoch 3: ranks 0 and 1 out together
	f, ok := d.Floor(9)
	if !ok || f.Epoch != 3 || f.Notice != 9 || f.LostIn[1] != 3 || f.LostIn[0] != 3 || len(f.LostIn) != 2 {
		t.Fatalf("floor %+v %v, want epoch 3, notice 9, lost in {0:3, 1:3}", f, ok)
	}
	r := ResumeDecider("b", cfg, d.Current(), f)
	// Rank 1 joins alone: lost together with 0, it waits RejoinWait for
	// it, in the resumed Decider as in the one that saw epoch 3 decided.
	at := t0.Add(5 * time.Second)
	for _, x := range []*Decider{d, r} {
		x.Join(at, Join{Slots: []int{1}, SeenAt: at})
		if e, ok, err := x.Decide(at.Add(2 * time.Millisecond)); ok || err != nil {
			t.Errorf("%s: %v %v %v, want a wait for slot 0", x.name, e, ok, err)
		}
		e, ok, err := x.Decide(at.Add(time.Second))
		if err != nil || !ok || !slices.Equal(e.Added, []int{1}) {
			t.Errorf("%s: %v %v %v, want slot 1 grown back after RejoinWait", x.name, e, ok, err)
		}
	}
}

// TestTicketsCollectedBudgetKept: the respawn tickets a floor counts are
// collected a generation later, and the budget is still the job's: takers
// on fresh Boards (agents that never saw the collected tickets) start
// after the floor's count, so no ticket is spent twice and the budget
// runs out where it did. A forged ticket is not counted as spent: the
// next taker takes it over.
func TestTicketsCollectedBudgetKept(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			a, _ := testAuth(t, "run/tickets")
			lead, raw := authBoard(t, open, "tickets", a)
			take := func(want int, within bool) {
				t.Helper()
				b, _ := authBoard(t, open, "tickets", a) // another agent each time
				n, ok, err := b.TakeRespawn(ctx, 5)
				if err != nil || ok != within || (ok && n != want) {
					t.Fatalf("take: ticket %d, within the budget %v, %v; want %d, %v", n, ok, err, want, within)
				}
			}
			raise := func(epoch, tickets, swept int) {
				t.Helper()
				if err := lead.Raise(ctx, Floor{Epoch: epoch}); err != nil {
					t.Fatal(err)
				}
				f, err := lead.Floor(ctx)
				if err != nil || f.Tickets != tickets || f.SweptTickets != swept {
					t.Fatalf("floor at epoch %d: %+v, %v; want %d tickets counted, %d swept", epoch, f, err, tickets, swept)
				}
			}
			have := func(k int) bool {
				t.Helper()
				ok, err := raw.Check(ctx, ticketKey(k))
				if err != nil {
					t.Fatal(err)
				}
				return ok
			}
			take(1, true)
			take(2, true)
			raise(1, 2, 0)
			if !have(1) || !have(2) {
				t.Fatal("tickets 1 and 2 collected with the floor that counts them: a generation early")
			}
			forge(ctx, t, raw, ticketKey(3), []byte(`{"ticket":3}`))
			raise(2, 2, 2) // the forged ticket 3 is not counted
			if have(1) || have(2) {
				t.Error("tickets 1 and 2 left a generation below the floor that counted them")
			}
			take(3, true) // takes the forged ticket over
			take(4, true)
			raise(3, 4, 2)
			take(5, true)
			take(0, false)
			raise(4, 5, 4)
			take(0, false)
			if have(3) || have(4) {
				t.Error("tickets 3 and 4 left a generation below the floor that counted them")
			}
		})
	}
}
