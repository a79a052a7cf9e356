package torch_test

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// killTimes are when shrink-mode tests kill a rank, from every rank
// training: early, and late, after the helper's watcher has timed out its
// store waits a few times (the case that once hung PyTorch 1.13's
// survivors; 2.14 cancels timed-out waits with CANCEL_WAIT).
var killTimes = []struct {
	name  string
	after time.Duration
	steps int // long enough to outlast the kill
}{
	{"early", 300 * time.Millisecond, 150},
	{"late", 3500 * time.Millisecond, 400},
}

// TestGorunShrinksTorchGloo is the whole of shrink mode with real PyTorch
// 1.13 gloo workers: gorun --on-failure shrink --regrow off runs four ranks
// of train_elastic.py; the test SIGKILLs rank 2 mid-training; the agent
// reports it, decides and publishes epoch 1, the three survivors shrink
// and finish with the same model, and gorun exits 0 naming the lost rank.
func TestGorunShrinksTorchGloo(t *testing.T) {
	py := torchtest.Python(t)
	script := filepath.Join(thisDir(), "train_elastic.py")
	for _, tc := range killTimes {
		t.Run(tc.name, func(t *testing.T) { testGorunShrinksTorchGloo(t, py, script, tc.after, tc.steps) })
	}
}

// TestGorunShrinksTorch214Gloo is the same with PyTorch 2.14 gloo workers
// (the sid bed's python, internal/sidbed). The bed sees only the temporary
// directory, so the script and its helper are copied there.
func TestGorunShrinksTorch214Gloo(t *testing.T) {
	bed := sidbed.Require(t)
	script := copyScripts(t)
	for _, tc := range killTimes {
		t.Run(tc.name, func(t *testing.T) {
			testGorunShrinksTorchGloo(t, bed.Python(), script, tc.after, tc.steps)
		})
	}
}

func testGorunShrinksTorchGloo(t *testing.T, py, script string, after time.Duration, steps int) {
	gorun := testutil.BuildGorun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := testutil.StartGorun(t, gorun, []string{"PYTHON_EXEC=" + py}, "--standalone", "--nproc-per-node", "4",
		"--on-failure", "shrink", "--regrow", "off", "--log-dir", t.TempDir(), script, "--steps", strconv.Itoa(steps), "--step-ms", "15")
	g.AwaitLines(ctx, t, ": training, world 4", 4)
	time.Sleep(after)
	if strings.Contains(g.Stdout.String(), "done rank=") {
		t.Fatal("a rank finished before the kill: the run is too short")
	}
	killed := time.Now()
	g.KillRank(t, 2)
	g.Wait(ctx, t)
	if took := time.Since(killed); took > 60*time.Second {
		t.Errorf("the job ended %v after the kill: recovery waited out a timeout", took.Round(time.Millisecond))
	}
	expectTrained(t, g, 3, steps)
	if errs := g.Stderr.String(); !strings.Contains(errs, "lost ranks [2] in 1 epoch(s), world 4 -> 3") {
		t.Errorf("gorun's log does not sum up the loss:\n%s", errs)
	}
}

// TestGorunHealsTorchGloo is heal through the real CLI with PyTorch gloo
// workers: gorun --on-failure shrink (heal on) runs four ranks of
// train_elastic.py; the test SIGKILLs rank 2; the survivors shrink and go
// on training, gorun respawns rank 2, the newcomer takes the model from
// the survivors and is grown in, and all four finish at world 4 with the
// same loss, the survivors in the processes they started in.
func TestGorunHealsTorchGloo(t *testing.T) {
	testGorunHealsTorchGloo(t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"), healCase{})
}

// TestGorunHealsTorch214Gloo is the same with PyTorch 2.14 (the sid bed).
func TestGorunHealsTorch214Gloo(t *testing.T) {
	testGorunHealsTorchGloo(t, sidbed.Require(t).Python(), copyScripts(t), healCase{})
}

// TestGorunHealsTorchGlooHungRank is the same with rank 2 stopped
// (SIGSTOP: a hang) under --heartbeat-timeout: gorun_ft.py beats once a
// step and sends wait beats while blocked in a collective or a recovery,
// so rank 2 alone is declared hung, shrunk away and healed — not the
// whole group, whose peers stop stepping with it.
func TestGorunHealsTorchGlooHungRank(t *testing.T) {
	testGorunHealsTorchGloo(t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"), healCase{hang: true})
}

// TestGorunHealsTorchGlooFromAStandby is the same with --respawn-standbys
// 1: a fifth train_elastic.py starts beside the four, imports torch and
// parks in gorun_ft.await_assignment; when rank 2 is killed that process
// takes its slot (its LOCAL_RANK, RANK and GORUN_SHRINK_NEWCOMER on its
// assignment pipe) and is grown back in.
func TestGorunHealsTorchGlooFromAStandby(t *testing.T) {
	testGorunHealsTorchGloo(t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"), healCase{standby: true})
}

// healCase is how testGorunHealsTorchGloo loses rank 2: killed (or, with
// hang, stopped), and respawned cold (or, with standby, from a standby).
type healCase struct{ hang, standby bool }

func testGorunHealsTorchGloo(t *testing.T, py, script string, c healCase) {
	hang := c.hang
	gorun := testutil.BuildGorun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	steps := 2000 // 30 s at 15 ms: the newcomer's start-up fits, loaded
	if c.standby {
		steps = 700 // the standby's start-up is over before the kill
	}
	args := []string{"--standalone", "--nproc-per-node", "4", "--on-failure", "shrink", "--respawn-backoff", "0.1",
		"--log-dir", t.TempDir()}
	if hang {
		args = append(args, "--heartbeat-timeout", "2")
	}
	if c.standby {
		args = append(args, "--respawn-standbys", "1")
	}
	g := testutil.StartGorun(t, gorun, []string{"PYTHON_EXEC=" + py},
		append(args, script, "--steps", strconv.Itoa(steps), "--step-ms", "15")...)
	g.AwaitLines(ctx, t, ": training, world 4", 4)
	time.Sleep(300 * time.Millisecond)
	var standby []int
	if c.standby {
		var err error
		if standby, err = testutil.ChildrenWithEnv(g.Cmd.Process.Pid, "GORUN_ASSIGNMENT_FD", "3"); err != nil || len(standby) != 1 {
			t.Fatalf("standbys %v (%v), want one\n%s", standby, err, g.Output())
		}
	}
	killed := time.Now()
	survivors := map[string]bool{}
	for _, r := range []int{0, 1, 3} {
		pid, err := testutil.ChildWithEnv(g.Cmd.Process.Pid, "RANK", strconv.Itoa(r))
		if err != nil {
			t.Fatal(err)
		}
		survivors[strconv.Itoa(pid)] = true
	}
	if hang {
		pid, err := testutil.ChildWithEnv(g.Cmd.Process.Pid, "RANK", "2")
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		defer syscall.Kill(pid, syscall.SIGCONT) // a test that fails early leaves no stopped process
	} else {
		g.KillRank(t, 2)
	}
	g.AwaitLines(ctx, t, "grow epoch=2 world=4 added=[2]", 4)
	t.Logf("rank 2 lost → grown back: %v", time.Since(killed).Round(time.Millisecond))
	g.Wait(ctx, t)
	out := expectTrained(t, g, 4, steps)
	if c.standby && !strings.Contains(g.Stderr.String(), `"rank": 2, "pid": `+strconv.Itoa(standby[0])) {
		t.Errorf("rank 2 was not respawned from the standby %d:\n%s", standby[0], g.Stderr.String())
	}
	if n, errs := strings.Count(g.Stderr.String(), "worker hung; killing it"), g.Stderr.String(); hang && (n != 1 || !strings.Contains(errs, `"rank": 2, "why": "no heartbeat for`)) {
		t.Errorf("%d ranks declared hung, want rank 2 alone:\n%s", n, errs)
	}
	expectSurvivorsKept(t, out, survivors)
	if errs := g.Stderr.String(); !strings.Contains(errs, "lost ranks [2] in 2 epoch(s), world 4 -> 4, grown back [2]") {
		t.Errorf("gorun's log does not sum up the heal:\n%s", errs)
	}
}

// expectTrained checks a 4-rank train_elastic.py job under gorun whose
// rank 2 was killed: the three survivors reported the shrink to world 3,
// and world ranks printed a done line at world after every step, all with
// the same loss. It returns the job's stdout.
func expectTrained(t *testing.T, g *testutil.Gorun, world, steps int) string {
	t.Helper()
	out := g.Stdout.String()
	if n := strings.Count(out, "shrink epoch=1 world=3 excluded=[2]"); n != 3 {
		t.Errorf("%d survivors reported the shrink, want 3:\n%s", n, g.Output())
	}
	dones := doneLine.FindAllStringSubmatch(out, -1)
	if len(dones) != world {
		t.Fatalf("%d done lines, want %d:\n%s", len(dones), world, g.Output())
	}
	for _, m := range dones {
		if m[2] != strconv.Itoa(world) || m[3] != strconv.Itoa(steps) || m[4] != dones[0][4] {
			t.Errorf("%s: want world=%d steps=%d and the same loss as %s", m[0], world, steps, dones[0][0])
		}
	}
	return out
}

// TestGorunHealsTorchGlooWithPrestartedSpare: heal across nodes with real
// PyTorch 1.13 gloo workers and a hot spare whose workers are pre-started
// (--spare-prestart): two agents of two ranks each on loopback run
// train_elastic.py, and a third agent, started with the same command,
// finds the round full and stands by, its two workers started, torch
// imported, parked. The second agent is SIGKILLed with its workers; the
// survivors shrink, the spare is admitted in the lost node's place, its
// parked workers get ranks 2 and 3 and are grown in, and all four finish
// at world 4 with the same loss.
func TestGorunHealsTorchGlooWithPrestartedSpare(t *testing.T) {
	py, script := torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py")
	gorun := testutil.BuildGorun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const steps = 1500 // about 25 s at 15 ms: the spare's start-up fits, loaded
	port := etcdtest.FreePorts(t, 1)[0]
	agent := func() *testutil.Gorun {
		return testutil.StartGorun(t, gorun, []string{"PYTHON_EXEC=" + py}, "--nnodes", "2", "--nproc-per-node", "2",
			"--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:"+strconv.Itoa(port), "--rdzv-id", "spare",
			"--local-addr", "127.0.0.1", "--on-failure", "shrink", "--spare-prestart", "--log-dir", t.TempDir(),
			script, "--steps", strconv.Itoa(steps), "--step-ms", "15", "--timestamps")
	}
	nodes := []*testutil.Gorun{agent()}
	nodes[0].AwaitLog(ctx, t, "hosting the rendezvous store")
	nodes = append(nodes, agent())
	for _, n := range nodes {
		n.AwaitLines(ctx, t, ": training, world 4", 2)
	}
	spare := agent()
	spare.AwaitLog(ctx, t, "pre-started the workers")
	spare.AwaitLog(ctx, t, "rendezvous complete")    // standing by
	spare.AwaitLines(ctx, t, "]:parked unix_ns=", 2) // torch imported
	lost := time.Now()
	nodes[1].Cmd.Process.Kill()
	spare.AwaitLines(ctx, t, "grow epoch=2 world=4 added=[2, 3]", 2)
	t.Logf("node lost → the spare's pre-started workers grown in: %v", time.Since(lost).Round(time.Millisecond))
	nodes[0].Wait(ctx, t)
	spare.Wait(ctx, t)
	out := nodes[0].Stdout.String() + spare.Stdout.String()
	dones := doneLine.FindAllStringSubmatch(out, -1)
	if len(dones) != 4 {
		t.Fatalf("%d done lines, want 4:\n%s\n%s", len(dones), nodes[0].Output(), spare.Output())
	}
	for _, m := range dones {
		if m[2] != "4" || m[3] != strconv.Itoa(steps) || m[4] != dones[0][4] {
			t.Errorf("%s: want world=4 steps=%d and the same loss as %s", m[0], steps, dones[0][0])
		}
	}
	if !strings.Contains(spare.Stderr.String(), "assigning the pre-started workers") {
		t.Errorf("the spare's workers were not the pre-started ones:\n%s", spare.Stderr.String())
	}
}

// TestGorunHealsTorchGlooRankLostBeforeTheGroupForms: heal when the fault
// lands before the first group has formed. gorun --on-failure shrink runs
// four ranks of train_elastic.py; the test stops rank 2 while it is still
// importing torch, waits until the other three are inside
// init_process_group (waiting there for rank 2's address), and kills it.
// The survivors must leave the construction when the agents' epoch comes,
// not at the group's 60-s timeout: they shrink to world 3, rank 2 is
// respawned and grown back, and all four finish at world 4 with the same
// loss, the survivors in the processes they started in.
func TestGorunHealsTorchGlooRankLostBeforeTheGroupForms(t *testing.T) {
	testGorunHealsBeforeTheGroupForms(t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"))
}

// TestGorunHealsTorch214GlooRankLostBeforeTheGroupForms is the same with
// PyTorch 2.14 (the sid bed).
func TestGorunHealsTorch214GlooRankLostBeforeTheGroupForms(t *testing.T) {
	testGorunHealsBeforeTheGroupForms(t, sidbed.Require(t).Python(), copyScripts(t))
}

func testGorunHealsBeforeTheGroupForms(t *testing.T, py, script string) {
	gorun := testutil.BuildGorun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const steps = 600
	g := testutil.StartGorun(t, gorun, []string{"PYTHON_EXEC=" + py, "GORUN_FT_DEBUG=1"},
		"--standalone", "--nproc-per-node", "4", "--on-failure", "shrink", "--respawn-backoff", "0.1",
		"--log-dir", t.TempDir(), script, "--steps", strconv.Itoa(steps), "--step-ms", "15")
	// Rank 2, stopped as soon as it exists: still in its imports.
	victim := awaitRankPID(ctx, t, g, 2)
	if err := syscall.Kill(victim, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	survivors := map[string]bool{}
	for _, r := range []int{0, 1, 3} {
		survivors[strconv.Itoa(awaitRankPID(ctx, t, g, r))] = true
	}
	for strings.Count(g.Stderr.String(), "constructing epoch 0's group") < 3 {
		select {
		case <-ctx.Done():
			t.Fatalf("the other ranks never began forming the group\n%s", g.Output())
		case <-time.After(10 * time.Millisecond):
		}
	}
	time.Sleep(500 * time.Millisecond) // well inside init_process_group
	if strings.Contains(g.Stdout.String(), ": training, world") {
		t.Fatalf("a rank began training without rank 2\n%s", g.Output())
	}
	killed := time.Now()
	if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	g.AwaitLines(ctx, t, "shrink epoch=1 world=3 excluded=[2]", 3)
	if took := time.Since(killed); took > 30*time.Second {
		t.Errorf("the survivors shrank %v after the kill: they waited out the group's timeout", took.Round(time.Millisecond))
	}
	t.Logf("rank lost while the group formed → the survivors at world 3: %v", time.Since(killed).Round(time.Millisecond))
	g.AwaitLines(ctx, t, "grow epoch=2 world=4 added=[2]", 4)
	g.Wait(ctx, t)
	out := expectTrained(t, g, 4, steps)
	expectSurvivorsKept(t, out, survivors)
}

// expectSurvivorsKept checks that the three survivors (PIDs) printed their
// done lines in out: they finished in the processes they started in.
func expectSurvivorsKept(t *testing.T, out string, survivors map[string]bool) {
	t.Helper()
	kept := 0
	for _, m := range donePID.FindAllStringSubmatch(out, -1) {
		if survivors[m[1]] {
			kept++
		}
	}
	if kept != 3 {
		t.Errorf("%d done lines from the survivors' original processes %v, want 3:\n%s", kept, survivors, out)
	}
}

// awaitRankPID waits for gorun's worker of global rank r to exist and
// returns its PID.
func awaitRankPID(ctx context.Context, t *testing.T, g *testutil.Gorun, r int) int {
	t.Helper()
	for {
		if pid, err := testutil.ChildWithEnv(g.Cmd.Process.Pid, "RANK", strconv.Itoa(r)); err == nil {
			return pid
		}
		select {
		case <-ctx.Done():
			t.Fatalf("rank %d never started\n%s", r, g.Output())
		case <-time.After(time.Millisecond):
		}
	}
}
