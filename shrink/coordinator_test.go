package shrink

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// agentSide is one agent's Coordinator on its own three connections.
func agentSide(t *testing.T, dial func() *tcpstore.Client, cfg CoordinatorConfig) *Coordinator {
	t.Helper()
	c := NewCoordinator(cfg, NewBoard(dial(), ""), NewBoard(dial(), ""), NewBoard(dial(), ""))
	t.Cleanup(c.Close)
	return c
}

// nextEpoch waits for the coordinator's next epoch or fails the test.
func nextEpoch(t *testing.T, c *Coordinator, within time.Duration) Epoch {
	t.Helper()
	select {
	case e := <-c.Epochs():
		return e
	case err := <-c.Err():
		t.Fatalf("agreement failed: %v", err)
	case <-time.After(within):
		t.Fatalf("no epoch within %v", within)
	}
	return Epoch{}
}

func TestCoordinator(t *testing.T) {
	const world = 8
	tests := []struct {
		name  string
		cfg   Config
		fails [][]int // reports filed by the follower, 20 ms apart
		// leaderDead: the leader is gone before the reports come; the
		// follower is made leader 300 ms later.
		leaderDead   bool
		wantExcluded []int
		wantAction   Action
		wantBy       string
	}{
		{name: "one rank", cfg: Config{SettleWindow: 100 * time.Millisecond},
			fails: [][]int{{3}}, wantExcluded: []int{3}, wantAction: ActionShrink, wantBy: "a"},
		{name: "failures within the window make one epoch", cfg: Config{SettleWindow: 300 * time.Millisecond},
			fails: [][]int{{6}, {1}, {6, 7}}, wantExcluded: []int{1, 6, 7}, wantAction: ActionShrink, wantBy: "a"},
		{name: "below the floor", cfg: Config{SettleWindow: 100 * time.Millisecond, MinWorldSize: 7},
			fails: [][]int{{0}, {5}}, wantExcluded: []int{0, 5}, wantAction: ActionRestart, wantBy: "a"},
		// Every rank: a restart epoch that the follower reads too. It
		// failed the leader alone, and the follower gave up 10 s later.
		{name: "every rank", cfg: Config{SettleWindow: 100 * time.Millisecond},
			fails: [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}, wantExcluded: []int{0, 1, 2, 3, 4, 5, 6, 7}, wantAction: ActionRestart, wantBy: "a"},
		{name: "successor decides on the dead leader's reports", cfg: Config{SettleWindow: 50 * time.Millisecond},
			fails: [][]int{{2}}, leaderDead: true, wantExcluded: []int{2}, wantAction: ActionShrink, wantBy: "b"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dial := storeDialer(ctx, t)
			a := agentSide(t, dial, CoordinatorConfig{Config: tt.cfg, Name: "a", World: world})
			b := agentSide(t, dial, CoordinatorConfig{Config: tt.cfg, Name: "b", World: world})
			a.Lead(ctx, true)
			if tt.leaderDead {
				a.Close()
			}
			for i, ranks := range tt.fails {
				if i > 0 {
					time.Sleep(20 * time.Millisecond)
				}
				if err := b.File(ctx, Report{Ranks: ranks, Reason: "exited"}); err != nil {
					t.Fatal(err)
				}
			}
			if tt.leaderDead {
				select {
				case e := <-b.Epochs():
					t.Fatalf("an epoch with no leader: %v", e)
				case <-time.After(300 * time.Millisecond):
				}
				b.Lead(ctx, true)
			}
			e := nextEpoch(t, b, 10*time.Second)
			if e.Number != 1 || !slices.Equal(e.Excluded, tt.wantExcluded) || e.Action != tt.wantAction || e.Coordinator != tt.wantBy {
				t.Fatalf("epoch = %+v; want 1 excluding %v, %s, by %s", e, tt.wantExcluded, tt.wantAction, tt.wantBy)
			}
			if e.WorldSize != world-len(tt.wantExcluded) {
				t.Errorf("world = %d; want %d", e.WorldSize, world-len(tt.wantExcluded))
			}
			if !tt.leaderDead {
				if got := nextEpoch(t, a, 5*time.Second); got.Number != 1 || !slices.Equal(got.Excluded, e.Excluded) {
					t.Errorf("the leader adopted %+v; the follower %+v", got, e)
				}
			}
		})
	}
}

// TestCoordinatorNextEpoch: a failure after an epoch gives the next one,
// built on it.
func TestCoordinatorNextEpoch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	a := agentSide(t, dial, CoordinatorConfig{Config: Config{SettleWindow: 20 * time.Millisecond}, Name: "a", World: 4})
	a.Lead(ctx, true)
	if err := a.File(ctx, Report{Ranks: []int{1}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	if e := nextEpoch(t, a, 10*time.Second); !slices.Equal(e.Excluded, []int{1}) {
		t.Fatalf("epoch 1 = %v", e)
	}
	// A late report of the rank already lost is ignored; rank 3 is new.
	for _, r := range [][]int{{1}, {3}} {
		if err := a.File(ctx, Report{Ranks: r, Reason: "exited"}); err != nil {
			t.Fatal(err)
		}
	}
	e := nextEpoch(t, a, 10*time.Second)
	if e.Number != 2 || !slices.Equal(e.Excluded, []int{3}) || !slices.Equal(e.Lost, []int{1, 3}) || !slices.Equal(e.Ranks, []int{0, -1, 1, -1}) {
		t.Fatalf("epoch 2 = %+v", e)
	}
}

// TestCoordinatorLateReplay: an agent that comes long after a loss (a
// replacement node) replays reports an epoch settled, past their
// agreement deadline, and may read them before that epoch: it adopts the
// epoch, and does not give the agreement up.
func TestCoordinatorLateReplay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	cfg := CoordinatorConfig{Config: Config{SettleWindow: 10 * time.Millisecond}, Name: "a", World: 4,
		AgreementTimeout: 100 * time.Millisecond}
	a := agentSide(t, dial, cfg)
	a.Lead(ctx, true)
	for _, r := range [][]int{{1}, {2}} {
		if err := a.File(ctx, Report{Ranks: r, Reason: "exited"}); err != nil {
			t.Fatal(err)
		}
		nextEpoch(t, a, 5*time.Second)
	}
	time.Sleep(3 * cfg.AgreementTimeout) // every report is long past its deadline
	for i := range 12 {
		cfg.Name = fmt.Sprintf("late-%d", i)
		late := agentSide(t, dial, cfg)
		for n := 1; n <= 2; n++ {
			if e := nextEpoch(t, late, 5*time.Second); e.Number != n {
				t.Fatalf("%s: epoch %d, want %d", cfg.Name, e.Number, n)
			}
		}
		select {
		case err := <-late.Err():
			t.Fatalf("%s gave up an agreement long done: %v", cfg.Name, err)
		case <-time.After(2 * cfg.AgreementTimeout):
		}
		late.Close()
	}
}

// joinWithNoLeader runs an agreement (timeout 200 ms) whose leader
// decided the loss of slot and stepped down; a newcomer then offers the
// slot. It checks that nothing is given up for five timeouts while only
// that join waits, and returns the coordinator.
func joinWithNoLeader(t *testing.T, slot int) (context.Context, *Coordinator) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	const timeout = 200 * time.Millisecond
	a := agentSide(t, storeDialer(ctx, t), CoordinatorConfig{Config: Config{SettleWindow: 10 * time.Millisecond},
		Name: "a", World: 4, AgreementTimeout: timeout})
	a.Lead(ctx, true)
	if err := a.File(ctx, Report{Ranks: []int{slot}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	nextEpoch(t, a, 10*time.Second)
	a.Lead(ctx, false)
	if err := a.FileJoin(ctx, Join{Slots: []int{slot}}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-a.Err():
		t.Fatalf("gave up while only a join waited: %v", err)
	case e := <-a.Epochs():
		t.Fatalf("epoch %v with no leader", e)
	case <-time.After(5 * timeout):
	}
	return ctx, a
}

func TestCoordinatorGivesUp(t *testing.T) {
	t.Run("nobody leads", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		dial := storeDialer(ctx, t)
		a := agentSide(t, dial, CoordinatorConfig{Config: Config{SettleWindow: 10 * time.Millisecond},
			Name: "a", World: 4, AgreementTimeout: 200 * time.Millisecond})
		if err := a.File(ctx, Report{Ranks: []int{0}, Reason: "exited"}); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-a.Err():
			if !errors.Is(err, ErrAgreementTimeout) {
				t.Fatalf("err = %v; want ErrAgreementTimeout", err)
			}
		case e := <-a.Epochs():
			t.Fatalf("epoch %v with no leader", e)
		case <-time.After(10 * time.Second):
			t.Fatal("no error")
		}
	})
	t.Run("nobody leads a grow, and a failure comes", func(t *testing.T) {
		// Nothing is given up while only a join waits (it was, and every
		// rank restarted for a newcomer). A failure then is: the give-up
		// names both (it named only failed ranks and newcomers, "failed
		// ranks [] (newcomers [] awaited)").
		ctx, a := joinWithNoLeader(t, 1)
		filed := time.Now()
		if err := a.File(ctx, Report{Ranks: []int{2}, Reason: "exited"}); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-a.Err():
			// Its own timeout, from when it came: not the join's, run
			// out long before.
			if took := time.Since(filed); took < 200*time.Millisecond {
				t.Errorf("gave up %v after the failure came, before its agreement timeout (200ms)", took)
			}
			if !errors.Is(err, ErrAgreementTimeout) || !strings.Contains(err.Error(), "failed ranks [2]") ||
				!strings.Contains(err.Error(), "slots [1] offered to grow back in") {
				t.Fatalf("err = %v; want ErrAgreementTimeout naming rank 2 failed and slot 1 offered", err)
			}
		case e := <-a.Epochs():
			t.Fatalf("epoch %v with no leader", e)
		case <-time.After(10 * time.Second):
			t.Fatal("no error")
		}
	})
	t.Run("a join waits for a leader", func(t *testing.T) {
		// A leader, once there is one, grows the slot back.
		ctx, a := joinWithNoLeader(t, 3)
		a.Lead(ctx, true)
		e := nextEpoch(t, a, 10*time.Second)
		if e.Action != ActionGrow || !slices.Equal(e.Added, []int{3}) {
			t.Fatalf("epoch %+v, want a grow adding rank 3", e)
		}
	})
	t.Run("the store is gone", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		dial := func() *tcpstore.Client {
			c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			return c
		}
		a := agentSide(t, dial, CoordinatorConfig{Name: "a", World: 4})
		srv.Close()
		select {
		case err := <-a.Err():
			t.Logf("agreement ended: %v", err)
		case <-time.After(15 * time.Second):
			t.Fatal("no error after the store closed")
		}
	})
}
