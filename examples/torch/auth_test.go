package torch_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/shrink"
)

// TestTorchGlooAuth: heal with a job secret, PyTorch 1.13 gloo workers and
// a coordinator on authenticated boards. Before any failure a forger puts
// on the board an epoch 1 that excludes ranks 0 and 1 (a genuine record of
// the job's previous round, replayed) and a failure notice of rank 3
// without a MAC. The workers ignore the epoch, saying so once, and keep
// training; the coordinator ignores the notice. Rank 2 is then killed: the
// coordinator publishes the genuine epoch 1 over the replay, the survivors
// shrink by it alone, and a newcomer is grown back in by the join, joined
// and complete notices the helper seals. The coordinator counts both
// forgeries.
func TestTorchGlooAuth(t *testing.T) {
	const secret, runID, round = "a test job's secret", "auth-job", "1"
	auth, refused := testutil.RecordingAuth(t, secret, shrink.Scope(runID, round))
	env := []string{shrink.SecretEnv + "=" + secret, "TORCHELASTIC_RUN_ID=" + runID, "GORUN_GENERATION=" + round}
	const steps = 1200
	h := startHealRunAuth(t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"),
		shrink.Config{SettleWindow: 100 * time.Millisecond, GrowTimeout: 10 * time.Second}, steps, env, auth)
	ctx, ws := h.ctx, h.ws

	previous, err := shrink.NewAuth([]byte(secret), shrink.Scope(runID, "0"), nil)
	if err != nil {
		t.Fatal(err)
	}
	forger := shrink.NewDecider("forger", shrink.Config{SettleWindow: -1}, shrink.Initial(4))
	forger.Report(time.Now(), shrink.Report{Ranks: []int{0, 1}, Reason: "forged"})
	replay, ok, err := forger.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	if _, won, err := shrink.NewBoard(h.j.dial(ctx, t), "").Authenticated(previous).Publish(ctx, replay); err != nil || !won {
		t.Fatalf("replaying epoch 1 of round 0: %v %v", won, err)
	}
	raw := rendezvous.NewPrefixStore(shrink.DefaultPrefix, h.j.dial(ctx, t))
	i, err := raw.Add(ctx, "report/next", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Set(ctx, fmt.Sprint("report/", i), []byte(`{"failure":{"ranks":[3],"reason":"forged"}}`)); err != nil {
		t.Fatal(err)
	}
	const ignored = "ignored a forged record at epoch/1: bad MAC"
	for g, w := range ws {
		w.awaitOutput(ctx, t, fmt.Sprintf("rank %d", g), ignored)
	}
	time.Sleep(300 * time.Millisecond) // time to act on the forgeries, were anyone to

	killAndReport(ctx, t, h.coord, ws, 2)
	if e := nextEpoch(ctx, t, h.coord); e.Action != shrink.ActionShrink || e.WorldSize != 3 || e.Coordinator != "test-agent" {
		t.Fatalf("%v by %q, want the coordinator's shrink to 3", e, e.Coordinator)
	}
	newcomer := h.j.start(t, 2, "GORUN_SHRINK_NEWCOMER=1")
	grow := nextEpoch(ctx, t, h.coord)
	if grow.Action != shrink.ActionGrow || grow.WorldSize != 4 {
		t.Fatalf("%v, want a grow back to 4", grow)
	}
	ms := []member{{0, ws[0]}, {1, ws[1]}, {3, ws[3]}, {2, newcomer}}
	finish(ctx, t, grow, steps, ms, func(slot int) []string {
		if slot == 2 {
			return []string{"grow epoch=2 world=4 added=[2]"}
		}
		return []string{ignored, "shrink epoch=1 world=3 excluded=[2]", "grow epoch=2 world=4 added=[2]"}
	})
	for g, w := range ws {
		if n := strings.Count(w.out.String(), "ignored a forged record"); g != 2 && n != 1 {
			t.Errorf("slot %d reported %d forgeries, want the replayed epoch once:\n%s", g, n, w.out)
		}
	}
	select {
	case c := <-h.coord.Completions():
		if c.Epoch != grow.Number {
			t.Errorf("the coordinator took epoch %d as complete, want %d", c.Epoch, grow.Number)
		}
	case <-ctx.Done():
		t.Fatal("the coordinator never took the grow as complete: the helper's sealed notice was refused")
	}
	var joined bool
	for _, n := range notices(ctx, t, h.board) {
		joined = joined || n.Joined != nil && n.Joined.Epoch == grow.Number && n.Joined.Slot == 2
		if n.Failure != nil && n.Failure.Reason == "forged" {
			t.Errorf("the authenticated board returned the forged notice %+v", n.Failure)
		}
	}
	if !joined {
		t.Error("no joined notice from the newcomer on the authenticated board")
	}
	forged := refused()
	if forged["epoch/1"] != shrink.BadMAC || forged[fmt.Sprint("report/", i)] != shrink.NoMAC || auth.Forgeries() != 2 {
		t.Errorf("the coordinator counted %d forgeries %v, want epoch/1 (bad MAC) and report/%d (no MAC)", auth.Forgeries(), forged, i)
	}
}
