package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// epochOf returns the epoch after the initial one of world ranks that
// excludes the global ranks in lost, as a coordinator decides it.
func epochOf(t *testing.T, world int, lost []int, minWorld int) shrink.Epoch {
	t.Helper()
	d := shrink.NewDecider("test", shrink.Config{SettleWindow: -1, MinWorldSize: minWorld}, shrink.Initial(world))
	now := time.Now()
	d.Report(now, shrink.Report{Ranks: lost, Reason: "killed by the test"})
	e, ok, err := d.Decide(now)
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	return e
}

func TestExpectedSum(t *testing.T) {
	tests := []struct {
		name  string
		world int
		lost  []int
		want  float64
	}{
		{"all of 4", 4, nil, 1 + 2 + 3 + 4},
		{"4 without 2", 4, []int{2}, 1 + 2 + 4},
		{"4 without 0", 4, []int{0}, 2 + 3 + 4},
		{"8 without 0 and 5", 8, []int{0, 5}, 2 + 3 + 4 + 5 + 7 + 8},
		{"1", 1, nil, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := shrink.Initial(tt.world)
			if len(tt.lost) > 0 {
				e = epochOf(t, tt.world, tt.lost, 1)
			}
			if got := expectedSum(e); got != tt.want {
				t.Errorf("expectedSum = %g, want %g", got, tt.want)
			}
		})
	}
}

func TestCheckSum(t *testing.T) {
	tests := []struct {
		name    string
		got     []float64
		want    float64
		wantErr string // "" for no error
	}{
		{"every element right", []float64{7, 7, 7}, 7, ""},
		{"the sum with the dead rank", []float64{10, 10, 10}, 7, "element 0 = 10, want 7"},
		{"one element wrong", []float64{7, 7, 6.5, 7}, 7, "element 2 = 6.5, want 7"},
		{"NaN", []float64{7, 7, 7, math.NaN()}, 7, "element 3 = NaN, want 7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := checkSum(tt.got, tt.want)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("checkSum: %v", err)
				}
				return
			}
			if !errors.Is(err, errWrongSum) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("checkSum = %v, want errWrongSum saying %q", err, tt.wantErr)
			}
			if code := exitCode(fmt.Errorf("step 3: %w", err)); code != exitWrongSum {
				t.Errorf("exit code %d, want %d", code, exitWrongSum)
			}
		})
	}
}

func TestExitCode(t *testing.T) {
	tests := []struct {
		err  error
		want int
	}{
		{nil, exitOK},
		{fmt.Errorf("step 1: %w", errWrongSum), exitWrongSum},
		{fmt.Errorf("step 4: %w", shrink.ErrExcluded), exitExcluded},
		{fmt.Errorf("step 4: %w", shrink.ErrRestart), exitFail},
		{fmt.Errorf("step 4: allreduce: %w", pg.ErrPeerLost), exitFail},
		{context.Canceled, exitFail},
	}
	for _, tt := range tests {
		if got := exitCode(tt.err); got != tt.want {
			t.Errorf("exitCode(%v) = %d, want %d", tt.err, got, tt.want)
		}
	}
}

func TestLines(t *testing.T) {
	if got, want := epochLine(epochOf(t, 8, []int{6, 1}, 1)), "shrink epoch=1 world=6 excluded=[1 6]"; got != want {
		t.Errorf("epochLine = %q, want %q", got, want)
	}
	if got, want := epochLine(epochOf(t, 4, []int{3}, 1)), "shrink epoch=1 world=3 excluded=[3]"; got != want {
		t.Errorf("epochLine = %q, want %q", got, want)
	}
	d := shrink.NewDecider("test", shrink.Config{SettleWindow: -1}, epochOf(t, 4, []int{2, 0}, 1))
	d.Join(time.Now(), shrink.Join{Slots: []int{2, 0}})
	grow, ok, err := d.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide the grow: %v %v", ok, err)
	}
	if got, want := epochLine(grow), "grow epoch=2 world=4 added=[0 2]"; got != want {
		t.Errorf("epochLine = %q, want %q", got, want)
	}
	if got, want := expectedSum(grow), 10.0; got != want {
		t.Errorf("expectedSum of the grow = %v, want %v: newcomers contribute as the slots they fill", got, want)
	}
	if got, want := doneLine(result{rank: 1, world: 3, steps: 50, sum: 7}), "done rank=1 world=3 steps=50 sum=7"; got != want {
		t.Errorf("doneLine = %q, want %q", got, want)
	}
}

// TestRunChecksEveryStep runs the real step loop on a real one-rank pg/cpu
// group whose epoch says a second rank is alive: the sum (1) misses that
// rank's 2, and the run must end at the first step with errWrongSum.
func TestRunChecksEveryStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	store, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	cfg := cpu.DefaultConfig()
	cfg.ListenAddr = "127.0.0.1:0"
	cfg.Bootstrap = pg.Bootstrap{Store: store, Rank: 0, Size: 1}
	g, err := cpu.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	opt := options{steps: 5, elems: 16, timeout: 10 * time.Second}
	tests := []struct {
		name      string
		epoch     shrink.Epoch
		wantErr   error
		wantSteps int
	}{
		{"the group's own membership", shrink.Initial(1), nil, 5},
		{"a rank missing from the sum", shrink.Initial(2), errWrongSum, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &worker{be: backends["cpu"], opt: opt, out: new(strings.Builder), epoch: tt.epoch}
			if err := w.use(g); err != nil {
				t.Fatal(err)
			}
			res, err := w.run(ctx, 0)
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("run: %v, want %v", err, tt.wantErr)
			}
			if res.steps != tt.wantSteps || res.sum != 1 {
				t.Errorf("run ended after %d steps with sum %g, want %d steps with sum 1", res.steps, res.sum, tt.wantSteps)
			}
		})
	}
	g.Close()
}

// TestShrink runs worker processes as gorun starts them in shrink mode, on a
// worker store the test serves, and plays gorun's agents itself: it kills
// ranks mid-run (SIGKILL), or stops one (SIGSTOP, a hang), and publishes
// the epoch that excludes them on the shrink Board.
func TestShrink(t *testing.T) {
	tests := []struct {
		name     string
		world    int
		victims  []int
		signal   syscall.Signal
		minWorld int      // the agents' floor: below it the epoch says restart
		flags    []string // extra flags
		onFail   string   // GORUN_ON_FAILURE
	}{
		{name: "4 ranks, rank 2 killed", world: 4, victims: []int{2}, signal: syscall.SIGKILL, onFail: "shrink"},
		// 2 MiB steps without a pause: the kill lands mid-collective, which
		// can leave survivors a step apart (about one run in three here);
		// they must agree on the step to redo.
		{name: "4 ranks, rank 2 killed mid-collective", world: 4, victims: []int{2}, signal: syscall.SIGKILL, onFail: "shrink",
			flags: []string{"--step-ms", "0", "--elems", "262144"}},
		{name: "4 ranks, rank 0 killed", world: 4, victims: []int{0}, signal: syscall.SIGKILL, onFail: "shrink"},
		{name: "8 ranks, ranks 1 and 6 killed", world: 8, victims: []int{1, 6}, signal: syscall.SIGKILL, onFail: "shrink"},
		{name: "4 ranks, rank 1 hangs, --shrink", world: 4, victims: []int{1}, signal: syscall.SIGSTOP, flags: []string{"--shrink"}},
		{name: "4 ranks, rank 3 killed, floor 4: restart", world: 4, victims: []int{3}, signal: syscall.SIGKILL, minWorld: 4, onFail: "shrink"},
	}
	bin := buildExample(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			const steps = 150
			j := startJob(ctx, t, bin, tt.world, nil, tt.onFail,
				append([]string{"--steps", strconv.Itoa(steps), "--step-ms", "10", "--elems", "4096", "--timeout", "60s"}, tt.flags...))
			j.waitStarted(ctx)
			time.Sleep(200 * time.Millisecond) // a few steps in

			for _, v := range tt.victims {
				if err := j.procs[v].Process.Signal(tt.signal); err != nil {
					t.Fatal(err)
				}
			}
			if tt.signal == syscall.SIGKILL {
				// As the agent's reaper: report a rank once it has exited.
				for _, v := range tt.victims {
					j.wait(ctx, v)
				}
			}
			e := epochOf(t, tt.world, tt.victims, tt.minWorld)
			if _, won, err := j.board.Publish(ctx, e); err != nil || !won {
				t.Fatalf("Publish: %v %v", won, err)
			}

			for g := range tt.world {
				if !slices.Contains(tt.victims, g) {
					j.wait(ctx, g)
				}
			}
			if e.Action == shrink.ActionRestart {
				j.checkRestarted(tt.victims)
				return
			}
			j.checkShrunk(e, steps)
			if n, err := j.board.Acks(ctx, e.Number); err != nil || n != int64(e.WorldSize) {
				t.Errorf("acks of epoch %d: %d %v, want %d", e.Number, n, err, e.WorldSize)
			}
			if tt.signal == syscall.SIGSTOP {
				// The hung rank wakes up in an epoch that excludes it.
				for _, v := range tt.victims {
					if err := j.procs[v].Process.Signal(syscall.SIGCONT); err != nil {
						t.Fatal(err)
					}
					if code := j.wait(ctx, v); code != exitExcluded {
						t.Errorf("excluded rank %d woke up and exited %d, want %d\n%s", v, code, exitExcluded, j.outs[v])
					}
				}
			}
		})
	}
}

// TestShrinkAtFinishLine: a rank lost after the last step, before every
// survivor has finished. The test itself is global rank 3 of four: it runs
// every step with the three worker processes, then stays silent (as a rank
// that died on its way out, or hung) and closes its group. The workers
// must wait at the finish line instead of leaving — a survivor still in the
// last step might need them to shrink — and, once the epoch excluding rank 3
// comes, redo the last step among themselves, so that every survivor ends
// with the sum over the survivors.
func TestShrinkAtFinishLine(t *testing.T) {
	bin := buildExample(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const world, self, steps, elems = 4, 3, 20, 64
	j := startJob(ctx, t, bin, world, []int{self}, "shrink",
		[]string{"--steps", strconv.Itoa(steps), "--step-ms", "1", "--elems", strconv.Itoa(elems), "--timeout", "60s"})

	cfg := cpu.DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: j.store, Namespace: "allreduce/attempt_0", Rank: self, Size: world}
	g, err := cpu.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	buf := make([]float64, elems)
	for step := range steps {
		for i := range buf {
			buf[i] = self + 1
		}
		if err := g.AllReduce(ctx, pg.Host(buf), pg.Sum); err != nil {
			t.Fatalf("step %d: %v\n%s", step, err, j.output())
		}
	}
	// Wait for the workers at the finish line, and a little more: time
	// enough to leave, were they to.
	finished := rendezvous.NewPrefixStore("allreduce/attempt_0", j.store)
	atLine := time.Time{}
	for atLine.IsZero() || time.Since(atLine) < 200*time.Millisecond {
		for r, done := range j.exited {
			select {
			case <-done:
				t.Fatalf("rank %d left before every survivor had finished\n%s", r, j.output())
			default:
			}
		}
		n, err := finished.Add(ctx, finishedKey(0), 0)
		if err != nil {
			t.Fatalf("%v\n%s", err, j.output())
		}
		if n == world-1 && atLine.IsZero() {
			atLine = time.Now()
		}
		time.Sleep(10 * time.Millisecond)
	}
	g.Close()

	e := epochOf(t, world, []int{self}, 1)
	if _, won, err := j.board.Publish(ctx, e); err != nil || !won {
		t.Fatalf("Publish: %v %v", won, err)
	}
	for r := range world - 1 {
		j.wait(ctx, r)
	}
	j.checkShrunk(e, steps)
}

// job is a set of worker processes started with the environment gorun
// gives them, on a worker store the test serves.
type job struct {
	t      *testing.T
	addr   string // the worker store's
	bin    string
	args   []string
	env    []string // every rank's environment
	store  *tcpstore.Client
	board  *shrink.Board
	procs  []*exec.Cmd            // by global rank; nil for a rank not started
	outs   []*testutil.SyncBuffer // by global rank
	exited map[int]chan struct{}  // closed when the process has been waited for
}

// startJob starts a worker process for every global rank of world but
// those in skip.
func startJob(ctx context.Context, t *testing.T, bin string, world int, skip []int, onFailure string, args []string) *job {
	t.Helper()
	return startJobEnv(ctx, t, bin, world, skip, onFailure, args, nil)
}

// startJobEnv is startJob with env added to every rank's environment.
func startJobEnv(ctx context.Context, t *testing.T, bin string, world int, skip []int, onFailure string, args, env []string) *job {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	store, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	port := srv.Addr().(*net.TCPAddr).Port

	j := &job{t: t, addr: srv.Addr().String(), bin: bin, args: args, store: store,
		board: shrink.NewBoard(store, shrink.DefaultPrefix), exited: map[int]chan struct{}{}}
	j.env = append([]string{"WORLD_SIZE=" + strconv.Itoa(world), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + strconv.Itoa(port),
		"TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_RESTART_COUNT=0", "GORUN_ON_FAILURE=" + onFailure}, env...)
	j.procs, j.outs = make([]*exec.Cmd, world), make([]*testutil.SyncBuffer, world)
	for r := range world {
		j.outs[r] = new(testutil.SyncBuffer)
		if !slices.Contains(skip, r) {
			j.start(ctx, r)
		}
	}
	t.Cleanup(func() {
		for r, done := range j.exited {
			j.procs[r].Process.Kill() // SIGKILL ends a stopped process too
			<-done
		}
	})
	return j
}

// start starts the process of global rank r, with extra added to its
// environment; a process started earlier for r must have exited.
// Called from the test's goroutine only.
func (j *job) start(ctx context.Context, r int, extra ...string) {
	j.t.Helper()
	cmd := exec.CommandContext(ctx, j.bin, j.args...)
	cmd.Env = append(append(append(os.Environ(), j.env...), "RANK="+strconv.Itoa(r), "LOCAL_RANK="+strconv.Itoa(r)), extra...)
	j.outs[r] = new(testutil.SyncBuffer) // a newcomer's output apart from its slot's first process's
	cmd.Stdout, cmd.Stderr = j.outs[r], j.outs[r]
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		j.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	j.procs[r], j.exited[r] = cmd, done
}

// waitStarted waits until every rank has formed its group.
func (j *job) waitStarted(ctx context.Context) {
	j.t.Helper()
	for r := range j.exited {
		for !strings.Contains(j.outs[r].String(), "start rank=") {
			select {
			case <-ctx.Done():
				j.t.Fatalf("rank %d did not start\n%s", r, j.output())
			case <-j.exited[r]:
				j.t.Fatalf("rank %d exited before it started\n%s", r, j.output())
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
}

// wait waits for global rank r to exit and returns its exit code (-1 when
// a signal ended it).
func (j *job) wait(ctx context.Context, r int) int {
	j.t.Helper()
	select {
	case <-j.exited[r]:
		return j.procs[r].ProcessState.ExitCode()
	case <-ctx.Done():
		j.t.Fatalf("rank %d did not exit\n%s", r, j.output())
		return 0
	}
}

// output is every rank's output, for failure messages.
func (j *job) output() string {
	var b strings.Builder
	for r, out := range j.outs {
		fmt.Fprintf(&b, "--- global rank %d\n%s", r, out)
	}
	return b.String()
}

var shrinkRE = regexp.MustCompile(`(?m)^shrink epoch=.*$`)

// checkShrunk asserts that every survivor of epoch e moved to it once and
// finished with the sum over the survivors, in its renumbered rank.
func (j *job) checkShrunk(e shrink.Epoch, steps int) {
	j.t.Helper()
	wantShrink := epochLine(e)
	wantSum := expectedSum(e)
	for g, cmd := range j.procs {
		if !e.Alive(g) || cmd == nil {
			continue
		}
		out := j.outs[g].String()
		if code := cmd.ProcessState.ExitCode(); code != exitOK {
			j.t.Errorf("global rank %d exited %d, want 0\n%s", g, code, j.output())
			continue
		}
		if got := shrinkRE.FindAllString(out, -1); len(got) != 1 || got[0] != wantShrink {
			j.t.Errorf("global rank %d printed %q, want one %q", g, got, wantShrink)
		}
		want := doneLine(result{rank: e.Ranks[g], world: e.WorldSize, steps: steps, sum: wantSum})
		if got := doneRE.FindString(out); got != want {
			j.t.Errorf("global rank %d printed %q, want %q", g, got, want)
		}
	}
}

// checkRestarted asserts that every survivor of a restart epoch exited 1,
// for the launcher to restart the group, without shrinking.
func (j *job) checkRestarted(victims []int) {
	j.t.Helper()
	for g, cmd := range j.procs {
		if slices.Contains(victims, g) {
			continue
		}
		out := j.outs[g].String()
		if code := cmd.ProcessState.ExitCode(); code != exitFail {
			j.t.Errorf("global rank %d exited %d after a restart epoch, want %d\n%s", g, code, exitFail, j.output())
		}
		if !strings.Contains(out, shrink.ErrRestart.Error()) || shrinkRE.MatchString(out) || doneRE.MatchString(out) {
			j.t.Errorf("global rank %d: want the restart error, no shrink or done line:\n%s", g, out)
		}
	}
}
