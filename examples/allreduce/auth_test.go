package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// TestShrinkAuth runs Go workers with a job secret under a coordinator on
// authenticated boards, as gorun's agents would. Before any failure a
// forger puts on the board an epoch 1 that excludes ranks 0 and 1 (a
// genuine record of the job's previous round, replayed) and a failure
// notice of rank 3 without a MAC. The workers ignore the epoch, saying so
// once, and the coordinator the notice. Rank 2 is then SIGKILLed: the
// genuine epoch 1 replaces the replay, the survivors shrink to three, and
// a newcomer for slot 2, whose join, joined and complete notices are
// sealed, is grown back in; every rank finishes at world 4 with the full
// sum, and the coordinator has counted both forgeries.
func TestShrinkAuth(t *testing.T) {
	bin := buildExample(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const secret, runID, round = "a test job's secret", "auth-job", "1"
	auth, refused := testutil.RecordingAuth(t, secret, shrink.Scope(runID, round))
	const world, steps = 4, 1000
	j := startJobEnv(ctx, t, bin, world, nil, "shrink",
		[]string{"--steps", strconv.Itoa(steps), "--step-ms", "10", "--elems", "4096", "--timeout", "60s"},
		[]string{shrink.SecretEnv + "=" + secret, "TORCHELASTIC_RUN_ID=" + runID, "GORUN_GENERATION=" + round})
	dial := func() *shrink.Board {
		c, err := tcpstore.Dial(ctx, j.addr, tcpstore.ClientConfig{Timeout: 30 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return shrink.NewBoard(c, shrink.DefaultPrefix).Authenticated(auth)
	}
	coord := shrink.NewCoordinator(shrink.CoordinatorConfig{Config: shrink.Config{SettleWindow: 100 * time.Millisecond, GrowTimeout: 10 * time.Second},
		Name: "test-agent", World: world}, dial(), dial(), dial())
	t.Cleanup(coord.Close) // before the connections close
	coord.Lead(ctx, true)
	j.waitStarted(ctx)

	previous, err := shrink.NewAuth([]byte(secret), shrink.Scope(runID, "0"), nil)
	if err != nil {
		t.Fatal(err)
	}
	replay := epochOf(t, world, []int{0, 1}, 1)
	if _, won, err := j.board.Authenticated(previous).Publish(ctx, replay); err != nil || !won {
		t.Fatalf("replaying epoch 1 of round 0: %v %v", won, err)
	}
	raw := rendezvous.NewPrefixStore(shrink.DefaultPrefix, j.store)
	i, err := raw.Add(ctx, "report/next", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Set(ctx, fmt.Sprint("report/", i), []byte(`{"failure":{"ranks":[3],"reason":"forged"}}`)); err != nil {
		t.Fatal(err)
	}
	const ignored = "ignored a forged record at epoch/1: bad MAC"
	for r := range world {
		for !strings.Contains(j.outs[r].String(), ignored) {
			select {
			case <-ctx.Done():
				t.Fatalf("rank %d never reported the replayed epoch\n%s", r, j.output())
			case <-j.exited[r]:
				t.Fatalf("rank %d exited\n%s", r, j.output())
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	time.Sleep(300 * time.Millisecond) // time to act on the forgeries, were anyone to

	if err := j.procs[2].Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	j.wait(ctx, 2)
	if err := coord.File(ctx, shrink.Report{Ranks: []int{2}, Reason: "Signal 9 (SIGKILL)"}); err != nil {
		t.Fatal(err)
	}
	next := func() shrink.Epoch {
		t.Helper()
		select {
		case e := <-coord.Epochs():
			return e
		case err := <-coord.Err():
			t.Fatalf("the agreement failed: %v\n%s", err, j.output())
		case <-ctx.Done():
			t.Fatalf("no next epoch\n%s", j.output())
		}
		return shrink.Epoch{}
	}
	if e := next(); e.Action != shrink.ActionShrink || e.WorldSize != 3 || e.Coordinator != "test-agent" {
		t.Fatalf("%v by %q, want the coordinator's shrink to 3", e, e.Coordinator)
	}
	j.start(ctx, 2, "GORUN_SHRINK_NEWCOMER=1")
	grow := next()
	if grow.Action != shrink.ActionGrow || grow.WorldSize != 4 {
		t.Fatalf("%v, want a grow back to 4", grow)
	}
	for r := range world {
		if code := j.wait(ctx, r); code != exitOK {
			t.Fatalf("rank %d exited %d\n%s", r, code, j.output())
		}
		out := j.outs[r].String()
		want := []string{epochLine(grow), doneLine(result{rank: grow.Ranks[r], world: world, steps: steps, sum: expectedSum(grow)})}
		forgeries := 1
		if r == 2 {
			forgeries = 0 // the newcomer started after the genuine epoch 1 had replaced the replay
		} else {
			want = append(want, "shrink epoch=1 world=3 excluded=[2]")
		}
		for _, line := range want {
			if !strings.Contains(out, line) {
				t.Errorf("rank %d did not print %q:\n%s", r, line, out)
			}
		}
		if n := strings.Count(out, "ignored a forged record"); n != forgeries {
			t.Errorf("rank %d reported %d forgeries, want %d:\n%s", r, n, forgeries, out)
		}
	}
	select {
	case c := <-coord.Completions():
		if c.Epoch != grow.Number {
			t.Errorf("the coordinator took epoch %d as complete, want %d", c.Epoch, grow.Number)
		}
	case <-ctx.Done():
		t.Fatal("the coordinator never took the grow as complete")
	}
	forged := refused()
	if forged["epoch/1"] != shrink.BadMAC || forged[fmt.Sprint("report/", i)] != shrink.NoMAC || auth.Forgeries() != 2 {
		t.Errorf("the coordinator counted %d forgeries %v, want epoch/1 (bad MAC) and report/%d (no MAC)", auth.Forgeries(), forged, i)
	}
}
