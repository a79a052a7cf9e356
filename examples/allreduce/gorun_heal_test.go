package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

// Heal end to end on one node, through the real CLI: gorun --on-failure
// shrink (heal on by default) runs four Go allreduce ranks, global rank r
// contributing r+1; the test SIGKILLs rank 2. The survivors shrink and
// carry on, gorun respawns the rank, and the newcomer is grown back in:
// everyone finishes at world 4 with the sum 1+2+3+4, and the survivors are
// the processes they were.

// healJob is a four-rank heal job: gorun and the helpers to watch it.
type healJob struct {
	g     *testutil.Gorun
	steps int
}

func startHealJob(ctx context.Context, t *testing.T, steps int, extra ...string) *healJob {
	t.Helper()
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	args := append([]string{"--standalone", "--nproc-per-node", "4", "--on-failure", "shrink",
		"--respawn-backoff", "0.1", "--log-dir", t.TempDir()}, extra...)
	args = append(args, "--no-python", bin, "--steps", strconv.Itoa(steps), "--step-ms", "5")
	j := &healJob{g: testutil.StartGorun(t, gorun, nil, args...), steps: steps}
	j.g.AwaitLines(ctx, t, "start rank=", 4)
	return j
}

// pid returns the PID of gorun's worker of global rank r.
func (j *healJob) pid(t *testing.T, r int) int {
	t.Helper()
	pid, err := testutil.ChildWithEnv(j.g.Cmd.Process.Pid, "RANK", strconv.Itoa(r))
	if err != nil {
		t.Fatalf("rank %d: %v\n%s", r, err, j.g.Output())
	}
	return pid
}

// done returns the done lines' fields by rank: world, steps and sum.
func (j *healJob) done(t *testing.T) map[int][3]string {
	t.Helper()
	out := map[int][3]string{}
	for _, m := range doneRE.FindAllStringSubmatch(j.g.Stdout.String(), -1) {
		r, _ := strconv.Atoi(m[1])
		if _, dup := out[r]; dup {
			t.Errorf("rank %d printed two done lines", r)
		}
		out[r] = [3]string{m[2], m[3], m[4]}
	}
	return out
}

// expectDone checks that ranks 0 to world-1 each printed one done line
// with world, every step and sum.
func (j *healJob) expectDone(t *testing.T, world int, sum int) {
	t.Helper()
	done := j.done(t)
	want := [3]string{strconv.Itoa(world), strconv.Itoa(j.steps), strconv.Itoa(sum)}
	if len(done) != world {
		t.Errorf("%d done lines, want %d\n%s", len(done), world, j.g.Output())
	}
	for r := range world {
		if got, ok := done[r]; !ok || got != want {
			t.Errorf("rank %d done %v (printed: %v), want world=%s steps=%s sum=%s", r, got, ok, want[0], want[1], want[2])
		}
	}
}

// TestUnderGorunHeal kills rank 2 early and in mid-run: either way it is
// shrunk away, respawned and grown back in, and the survivors never
// restart. It also stops rank 2 (SIGSTOP: a hang, not a death) with
// --heartbeat-timeout: its peers block on it in their next collective and
// say so (health.Blocked), so gorun declares rank 2 alone hung and kills
// it. (Before wait beats every rank of the group went silent within a
// step, all four were declared hung and shrink fell back to a restart.)
func TestUnderGorunHeal(t *testing.T) {
	for _, tt := range []struct {
		name   string
		sig    syscall.Signal
		killAt time.Duration // after every rank started
	}{
		{"early", syscall.SIGKILL, 200 * time.Millisecond},
		{"mid-run", syscall.SIGKILL, 1500 * time.Millisecond},
		{"hung early", syscall.SIGSTOP, 300 * time.Millisecond},
		{"hung mid-run", syscall.SIGSTOP, 2 * time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			j := startHealJob(ctx, t, 1000, "--heartbeat-timeout", "1") // 5 s of steps
			time.Sleep(tt.killAt)
			survivors := map[int]int{}
			for _, r := range []int{0, 1, 3} {
				survivors[r] = j.pid(t, r)
			}
			victim := j.pid(t, 2)
			if err := syscall.Kill(victim, tt.sig); err != nil {
				t.Fatal(err)
			}
			defer syscall.Kill(victim, syscall.SIGCONT) // a test that fails early leaves no stopped process
			j.g.AwaitLines(ctx, t, "]:grow epoch=2 world=4 added=[2]", 4)
			for r, pid := range survivors {
				if got := j.pid(t, r); got != pid {
					t.Errorf("rank %d is pid %d after the grow, was %d: a survivor was restarted", r, got, pid)
				}
			}
			if got := j.pid(t, 2); got == victim {
				t.Errorf("rank 2 is still pid %d", got)
			}
			j.g.Wait(ctx, t)
			out, errs := j.g.Stdout.String(), j.g.Stderr.String()
			if n := strings.Count(out, "]:shrink epoch=1 world=3 excluded=[2]"); n != 3 {
				t.Errorf("%d survivors printed the shrink line, want 3\n%s", n, j.g.Output())
			}
			if n := strings.Count(out, "]:newcomer slot=2 after epoch=1"); n != 1 {
				t.Errorf("%d newcomer lines, want 1\n%s", n, j.g.Output())
			}
			j.expectDone(t, 4, 10)
			if !strings.Contains(errs, "lost ranks [2] in 2 epoch(s), world 4 -> 4, grown back [2]") {
				t.Errorf("gorun's summary does not say rank 2 was grown back:\n%s", errs)
			}
			hung := 0
			if tt.sig == syscall.SIGSTOP {
				hung = 1
			}
			if n := strings.Count(errs, "worker hung; killing it"); n != hung || hung == 1 && !strings.Contains(errs, `"rank": 2, "why": "no heartbeat for`) {
				t.Errorf("%d ranks declared hung, want %d (rank 2 if any):\n%s", n, hung, errs)
			}
		})
	}
}

// TestUnderGorunHealBudget is a crash loop: rank 2 is killed, and so is
// every newcomer that fills its slot. After --max-respawns 2 the slot stays
// out, the log says why, and the three survivors finish at world 3.
func TestUnderGorunHealBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	j := startHealJob(ctx, t, 1600, "--max-respawns", "2", "--grow-timeout", "2") // 8 s of steps
	for k := range 3 {
		if k > 0 {
			j.g.AwaitLines(ctx, t, "]:newcomer slot=2", k)
		}
		if err := syscall.Kill(j.pid(t, 2), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // reaped before the next lookup
	}
	j.g.Wait(ctx, t)
	if n := strings.Count(j.g.Stdout.String(), "]:newcomer slot=2"); n != 2 {
		t.Errorf("%d newcomers, want 2 (--max-respawns 2)\n%s", n, j.g.Output())
	}
	if !strings.Contains(j.g.Stderr.String(), "rank stays out: the job's respawn budget is spent") {
		t.Errorf("the log does not say why rank 2 stays out:\n%s", j.g.Stderr.String())
	}
	j.expectDone(t, 3, 1+2+4)
}

// TestUnderGorunHealFailureDuringGrow kills rank 1 the moment rank 2's
// newcomer announces itself: whatever the grow had reached, the job ends
// consistent, every rank of the last epoch done with the same world.
func TestUnderGorunHealFailureDuringGrow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	j := startHealJob(ctx, t, 1200, "--grow-timeout", "2")
	j.g.KillRank(t, 2)
	j.g.AwaitLines(ctx, t, "]:newcomer slot=2", 1)
	j.g.KillRank(t, 1)
	j.g.Wait(ctx, t)
	done := j.done(t)
	for r := range len(done) {
		if d, ok := done[r]; !ok || d[0] != strconv.Itoa(len(done)) || d[1] != strconv.Itoa(j.steps) {
			t.Errorf("rank %d done %v (printed: %v), want world=%d steps=%d\n%s", r, d, ok, len(done), j.steps, j.g.Output())
		}
	}
	if len(done) < 2 {
		t.Errorf("%d ranks finished\n%s", len(done), j.g.Output())
	}
}

// TestUnderGorunHealRankLostBeforeTheGroupForms: rank 2 is lost before the
// first group has formed. A wrapper holds launched rank 2 in a long
// start-up (a sleep, standing for imports and device init) while ranks 0,
// 1 and 3 start at once and wait for it in the formation; the test kills
// rank 2 there. The three must leave the formation on the agents' epoch
// (not at the group's timeout), form epoch 1's group among themselves,
// take the respawned rank 2 back by a grow, and finish at world 4.
func TestUnderGorunHealRankLostBeforeTheGroupForms(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	wrapper := filepath.Join(t.TempDir(), "slow-rank-2.sh")
	// A newcomer (the respawn) starts at once.
	script := "#!/bin/sh\nif [ \"$RANK\" = 2 ] && [ -z \"$GORUN_SHRINK_NEWCOMER\" ]; then sleep 60; fi\nexec \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	const steps = 400
	g := testutil.StartGorun(t, gorun, nil, "--standalone", "--nproc-per-node", "4", "--on-failure", "shrink",
		"--respawn-backoff", "0.1", "--log-dir", t.TempDir(), "--no-python", wrapper, bin,
		"--steps", strconv.Itoa(steps), "--step-ms", "5", "--timeout", "60s")
	j := &healJob{g: g, steps: steps}
	// Ranks 0, 1 and 3 in the allreduce binary, forming; rank 2 asleep.
	for _, r := range []int{0, 1, 3} {
		for {
			if pid, err := testutil.ChildWithEnv(g.Cmd.Process.Pid, "RANK", strconv.Itoa(r)); err == nil {
				if exe, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/exe"); err == nil && exe == bin {
					break
				}
			}
			select {
			case <-ctx.Done():
				t.Fatalf("rank %d never started the worker\n%s", r, g.Output())
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	time.Sleep(500 * time.Millisecond) // well inside the formation
	if strings.Contains(g.Stdout.String(), "start rank=") {
		t.Fatalf("a rank formed a group without rank 2\n%s", g.Output())
	}
	killed := time.Now()
	g.KillRank(t, 2)
	g.AwaitLines(ctx, t, "]:shrink epoch=1 world=3 excluded=[2]", 3)
	if took := time.Since(killed); took > 20*time.Second {
		t.Errorf("the survivors moved to epoch 1 %v after the kill: they waited out the formation", took.Round(time.Millisecond))
	}
	t.Logf("rank lost before the group formed → the survivors at world 3: %v", time.Since(killed).Round(time.Millisecond))
	g.AwaitLines(ctx, t, "]:grow epoch=2 world=4 added=[2]", 4)
	g.Wait(ctx, t)
	j.expectDone(t, 4, 10)
	if errs := g.Stderr.String(); !strings.Contains(errs, "lost ranks [2] in 2 epoch(s), world 4 -> 4, grown back [2]") {
		t.Errorf("gorun's summary does not say rank 2 was grown back:\n%s", errs)
	}
}

// TestUnderGorunHealEndsWhenTheJobFinishes: heal stops once the job is
// done. Of two ranks, rank 1 fails at once and is respawned (the Go
// worker, a newcomer), and its grow is published; rank 0, a stand-in
// that never joins a grow, finishes (exit 0) while the newcomer waits in
// it. No grow can complete after that: the agent must stop the newcomer
// and respawn nothing more, and gorun ends with success at once — not
// loop, grow after grow timing out, until the respawn budget is spent.
func TestUnderGorunHealEndsWhenTheJobFinishes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	wrapper := filepath.Join(t.TempDir(), "job.sh")
	script := "#!/bin/sh\n" +
		"if [ -n \"$GORUN_SHRINK_NEWCOMER\" ]; then exec " + bin + " --steps 100 --step-ms 5; fi\n" +
		"if [ \"$RANK\" = 0 ]; then sleep 4; exit 0; fi\n" +
		"exit 1\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	g := testutil.StartGorun(t, gorun, nil, "--standalone", "--nproc-per-node", "2", "--on-failure", "shrink",
		"--respawn-backoff", "0.1", "--grow-timeout", "20", "--max-respawns", "5", "--log-dir", t.TempDir(),
		"--no-python", wrapper)
	g.AwaitLines(ctx, t, "]:newcomer slot=1 after epoch=1", 1)
	g.AwaitLog(ctx, t, "grow epoch=2 world=2 added=[1]")
	g.Wait(ctx, t)
	if took := time.Since(start); took > 15*time.Second {
		t.Errorf("gorun ended %v after it started: the finished job waited on its grow", took.Round(time.Millisecond))
	}
	errs := g.Stderr.String()
	if n := strings.Count(errs, "respawned a lost rank"); n != 1 {
		t.Errorf("%d respawns, want 1: none after the job finished\n%s", n, errs)
	}
	if !strings.Contains(errs, "stopping a newcomer: the group it was to join has finished") {
		t.Errorf("the log does not say why the newcomer was stopped:\n%s", errs)
	}
	// The stopped newcomer is no failure, and its slot was not grown back.
	if !strings.Contains(errs, "lost ranks [1] in 2 epoch(s), world 2 -> 1:") {
		t.Errorf("gorun's summary: want rank 1 lost, two epochs, world 1 at the end:\n%s", errs)
	}
}

var parkedForRE = regexp.MustCompile(`"standby_parked_for": ([0-9.]+)`)

// TestUnderGorunHealStandby: with --respawn-standbys 1 a fifth worker
// starts beside the four ranks, parked (no RANK, no LOCAL_RANK). When
// rank 2 is SIGKILLed the standby takes its place, the process it was, and
// is grown back in; the line it printed while parked ("parked …") reaches
// the console with rank 2's prefix, after the fact. Once the grow is over
// a new standby is started, and it ends with the job: nothing is left.
func TestUnderGorunHealStandby(t *testing.T) {
	for _, tt := range []struct {
		name   string
		killAt time.Duration // after the standby started
	}{
		{"before it may have parked", 0},
		{"early", 300 * time.Millisecond},
		{"mid-run", 1500 * time.Millisecond},
	} {
		t.Run(tt.name, func(t *testing.T) { testHealStandby(t, tt.killAt) })
	}
}

func testHealStandby(t *testing.T, killAt time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	g := testutil.StartGorun(t, gorun, nil, "--standalone", "--nproc-per-node", "4", "--on-failure", "shrink",
		"--respawn-backoff", "0.1", "--respawn-standbys", "1", "--log-dir", t.TempDir(),
		"--no-python", bin, "--steps", "1000", "--step-ms", "5", "--timestamps")
	j := &healJob{g: g, steps: 1000}
	g.AwaitLines(ctx, t, "start rank=", 4)
	g.AwaitLog(ctx, t, "started a standby")
	standbys := func() []int {
		pids, err := testutil.ChildrenWithEnv(g.Cmd.Process.Pid, "GORUN_ASSIGNMENT_FD", "3")
		if err != nil {
			t.Fatal(err)
		}
		return pids
	}
	first := standbys()
	if len(first) != 1 {
		t.Fatalf("standbys %v, want one\n%s", first, g.Output())
	}
	time.Sleep(killAt)
	victim := j.pid(t, 2)
	if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	g.AwaitLines(ctx, t, "]:grow epoch=2 world=4 added=[2]", 4)
	if err := syscall.Kill(first[0], 0); err != nil {
		t.Errorf("the standby %d is gone after the grow: %v", first[0], err)
	}
	respawned := ""
	for l := range strings.Lines(g.Stderr.String()) {
		if strings.Contains(l, "respawned a lost rank") {
			respawned = l
		}
	}
	if !strings.Contains(respawned, `"pid": `+strconv.Itoa(first[0])) {
		t.Errorf("rank 2's respawn was not the standby %d: %q\n%s", first[0], respawned, g.Output())
	}
	// Parked since before the test's wait, not since it took the slot.
	if m := parkedForRE.FindStringSubmatch(respawned); m == nil {
		t.Errorf("the respawn does not say how long the standby was parked: %q", respawned)
	} else if s, _ := strconv.ParseFloat(m[1], 64); s < killAt.Seconds() {
		t.Errorf("the standby was parked for %s s, want at least the test's %v", m[1], killAt)
	}
	deadline := time.Now().Add(30 * time.Second)
	var second []int
	for {
		second = standbys()
		if len(second) == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	second = slices.DeleteFunc(second, func(p int) bool { return p == first[0] })
	if len(second) != 1 {
		t.Fatalf("no new standby after the grow (children with an assignment pipe: %v)\n%s", standbys(), g.Output())
	}
	g.Wait(ctx, t)
	out := g.Stdout.String()
	if n := strings.Count(out, "[default2]:parked unix_ns="); n != 1 {
		t.Errorf("%d parked lines with rank 2's prefix, want the standby's one\n%s", n, g.Output())
	}
	if strings.Count(out, "parked unix_ns=") != 1 {
		t.Errorf("a parked line that no slot took reached the console\n%s", g.Output())
	}
	if n := strings.Count(out, "]:newcomer slot=2 after epoch=1"); n != 1 {
		t.Errorf("%d newcomer lines, want 1\n%s", n, g.Output())
	}
	j.expectDone(t, 4, 10)
	if err := syscall.Kill(second[0], 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("the second standby %d outlived gorun (kill 0: %v)", second[0], err)
	}
}
