// Tests of the PyTorch fault-tolerance helper (gorun_ft.py) with real
// PyTorch 1.13 gloo workers. The test itself plays the agents' part: it
// SIGKILLs a rank, then decides and publishes the next epoch with package
// shrink, exactly as a coordinator agent does.
package torch_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

type worker struct {
	cmd    *exec.Cmd
	out    *testutil.SyncBuffer
	exited chan struct{} // closed when the process has been waited for
	err    error         // its exit, valid once exited is closed
}

// wait returns the worker's exit, or false if ctx ends first.
func (w *worker) wait(ctx context.Context) (error, bool) {
	select {
	case <-w.exited:
		return w.err, true
	case <-ctx.Done():
		return nil, false
	}
}

// dumpStacks asks the workers still running to print every thread's
// Python stack (gorun_ft's GORUN_FT_STACKS, which start sets), and gives
// them a moment to: where a stuck worker waits, in a failing test's output.
func dumpStacks(ws ...*worker) {
	asked := false
	for _, w := range ws {
		select {
		case <-w.exited:
		default:
			asked = w.cmd.Process.Signal(syscall.SIGUSR1) == nil || asked
			fmt.Fprint(w.out, kernelView(w.cmd.Process.Pid))
		}
	}
	if asked {
		time.Sleep(300 * time.Millisecond)
	}
}

// kernelView says what the kernel sees of process pid, which Python's
// stacks do not show: each thread's state and wait channel (a C++
// collective's threads) and each TCP socket's ports and state.
func kernelView(pid int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "kernel's view of %d:\n", pid)
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	for _, task := range tasks {
		comm, _ := os.ReadFile(task + "/comm")
		wchan, _ := os.ReadFile(task + "/wchan")
		stat, _ := os.ReadFile(task + "/stat")
		state := ""
		if _, after, ok := strings.Cut(string(stat), ") "); ok && after != "" {
			state = after[:1]
		}
		fmt.Fprintf(&b, "  thread %s %q %s %s\n", filepath.Base(task), strings.TrimSpace(string(comm)), state, wchan)
	}
	// inode → "local->remote state", from the process's network namespace.
	socks := map[string]string{}
	for _, table := range []string{"tcp", "tcp6"} {
		data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		for _, line := range strings.Split(string(data), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 10 {
				continue
			}
			port := func(addr string) string {
				_, hex, _ := strings.Cut(addr, ":")
				n, _ := strconv.ParseUint(hex, 16, 16)
				return strconv.FormatUint(n, 10)
			}
			socks[f[9]] = port(f[1]) + "->" + port(f[2]) + " st=" + f[3] + " txq:rxq=" + f[4]
		}
	}
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	for _, fd := range fds {
		l, err := os.Readlink(fd)
		if inode, ok := strings.CutPrefix(l, "socket:["); err == nil && ok {
			inode = strings.TrimSuffix(inode, "]")
			fmt.Fprintf(&b, "  fd %s socket %s %s\n", filepath.Base(fd), inode, socks[inode])
		}
		if l == "anon_inode:[eventpoll]" {
			// The descriptors an epoll instance (a gloo device's loop)
			// watches, and for which events.
			info, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, filepath.Base(fd)))
			var watched []string
			for _, line := range strings.Split(string(info), "\n") {
				if f := strings.Fields(line); len(f) >= 4 && f[0] == "tfd:" {
					watched = append(watched, f[1]+"/"+f[3])
				}
			}
			fmt.Fprintf(&b, "  fd %s epoll watching %v\n", filepath.Base(fd), watched)
		}
	}
	return b.String()
}

// storeServer says who serves the workers' store: gorun's TCPStore server
// (what the agents run) or PyTorch's own (the helper must not depend on
// gorun's server to be safe).
type storeServer string

const (
	gorunServer storeServer = "gorun"
	torchServer storeServer = "torch"
)

// serveStore starts a worker store of the given kind and returns its
// address and the wire generation to speak to it.
func serveStore(ctx context.Context, t *testing.T, kind storeServer) (string, tcpstore.Generation) {
	t.Helper()
	switch kind {
	case gorunServer:
		srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		return srv.Addr().String(), tcpstore.GenNew
	case torchServer:
		p := torchtest.Start(t, nil, `
import datetime, time, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
print("port", s.port, flush=True)
time.sleep(3600)
`)
		for !strings.HasPrefix(p.Stdout(), "port ") {
			select {
			case <-p.Done():
				t.Fatalf("PyTorch's store server exited: %s", p.Stderr())
			case <-ctx.Done():
				t.Fatal("PyTorch's store server did not start")
			case <-time.After(20 * time.Millisecond):
			}
		}
		port := strings.TrimSpace(strings.TrimPrefix(p.Stdout(), "port "))
		return "127.0.0.1:" + port, tcpstore.GenOld
	}
	t.Fatalf("unknown store server %q", kind)
	return "", 0
}

// job is a run of train_elastic.py ranks on one worker store.
type job struct {
	py, script string // the interpreter, and train_elastic.py where it sees it
	addr       string // the worker store
	wire       tcpstore.Generation
	world      int      // the launch world size
	env        []string // added to every rank's environment
	args       []string // train_elastic.py's flags
}

// newJob returns a job of world ranks on a fresh worker store served by
// kind, run by interpreter py (with train_elastic.py at script).
func newJob(ctx context.Context, t *testing.T, py, script string, kind storeServer, env []string, world int, args ...string) job {
	t.Helper()
	addr, wire := serveStore(ctx, t, kind)
	return job{py: py, script: script, addr: addr, wire: wire, world: world, env: env, args: args}
}

// thisDir is the directory of this package's sources.
func thisDir() string {
	_, self, _, _ := runtime.Caller(0)
	return filepath.Dir(self)
}

// start starts the process of global rank r, with extra added to its
// environment. The test's cleanup kills it.
func (j job) start(t *testing.T, r int, extra ...string) *worker {
	t.Helper()
	_, port, _ := net.SplitHostPort(j.addr)
	w := &worker{out: new(testutil.SyncBuffer), exited: make(chan struct{})}
	w.cmd = exec.Command(j.py, append([]string{"-u", j.script}, j.args...)...)
	w.cmd.Env = append(os.Environ(), "RANK="+strconv.Itoa(r), "LOCAL_RANK="+strconv.Itoa(r),
		"WORLD_SIZE="+strconv.Itoa(j.world), "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+port,
		"TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_RESTART_COUNT=0", "OMP_NUM_THREADS=1", "GORUN_FT_STACKS=1", "GORUN_FT_DEBUG=1")
	w.cmd.Env = append(append(w.cmd.Env, j.env...), extra...)
	w.cmd.Stdout, w.cmd.Stderr = w.out, w.out
	w.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		w.err = w.cmd.Wait()
		close(w.exited)
	}()
	t.Cleanup(func() {
		w.cmd.Process.Kill()
		<-w.exited
	})
	return w
}

// awaitOutput waits until w has printed s.
func (w *worker) awaitOutput(ctx context.Context, t *testing.T, name, s string) {
	t.Helper()
	for !strings.Contains(w.out.String(), s) {
		select {
		case <-w.exited:
			t.Fatalf("%s exited before printing %q: %v\n%s", name, s, w.err, w.out)
		case <-ctx.Done():
			t.Fatalf("%s never printed %q\n%s", name, s, w.out)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// dial returns a client of the job's store, closed by the test's cleanup.
func (j job) dial(ctx context.Context, t *testing.T) *tcpstore.Client {
	t.Helper()
	c, err := tcpstore.Dial(ctx, j.addr, tcpstore.ClientConfig{Wire: j.wire, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// startAll starts every rank and waits until every one is training.
func (j job) startAll(ctx context.Context, t *testing.T) []*worker {
	t.Helper()
	ws := make([]*worker, j.world)
	for r := range ws {
		ws[r] = j.start(t, r)
	}
	for r, w := range ws {
		w.awaitOutput(ctx, t, fmt.Sprintf("rank %d", r), "training")
	}
	return ws
}

// startWorkers starts world train_elastic.py ranks of PyTorch 1.13 on a
// fresh worker store served by kind, with env added to their environment,
// waits until every one is training, and returns a client of the store.
func startWorkers(ctx context.Context, t *testing.T, kind storeServer, env []string, world int, args ...string) (*tcpstore.Client, []*worker) {
	t.Helper()
	j := newJob(ctx, t, torchtest.Python(t), filepath.Join(thisDir(), "train_elastic.py"), kind, env, world, args...)
	ws := j.startAll(ctx, t)
	return j.dial(ctx, t), ws
}

// killAndPublish SIGKILLs the given ranks and, as the coordinator agent
// would, reports them, lets the settle window pass, decides the next epoch
// and publishes it.
func killAndPublish(ctx context.Context, t *testing.T, board *shrink.Board, cfg shrink.Config, ws []*worker, ranks ...int) shrink.Epoch {
	t.Helper()
	d := shrink.NewDecider("test-coordinator", cfg, shrink.Initial(len(ws)))
	for _, r := range ranks {
		ws[r].cmd.Process.Kill()
		d.Report(time.Now(), shrink.Report{Ranks: []int{r}, Reason: "Signal 9 (SIGKILL)", From: "test"})
	}
	time.Sleep(time.Until(d.Due()))
	e, ok, err := d.Decide(time.Now())
	if err != nil || !ok {
		t.Fatalf("Decide: %v %v", ok, err)
	}
	held, won, err := board.Publish(ctx, e)
	if err != nil || !won {
		t.Fatalf("Publish: won=%v %v", won, err)
	}
	return held
}

var doneLine = regexp.MustCompile(`done rank=(\d+) world=(\d+) steps=(\d+) loss=(\S+)`)

// TestTorchGlooShrink: four gloo ranks train; rank 2 is SIGKILLed mid-run;
// the survivors move to epoch 1, shrink to three and finish with the same
// model. The kill comes early (before the helper's watcher has timed out
// once) and late (after it timed out three times: a PyTorch 1.13 client
// that times a wait out leaves the server to answer it later, which once
// made the survivors await an epoch that never came), on gorun's store
// server and on PyTorch's own.
func TestTorchGlooShrink(t *testing.T) {
	for _, tc := range []struct {
		name   string
		server storeServer
		after  time.Duration // from the last rank training to the kill
		steps  int
	}{
		{"gorun/early", gorunServer, 400 * time.Millisecond, 120},
		{"gorun/late", gorunServer, 3500 * time.Millisecond, 400},
		{"torch/late", torchServer, 3500 * time.Millisecond, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testTorchGlooShrink(t, tc.server, tc.after, tc.steps)
		})
	}
}

func testTorchGlooShrink(t *testing.T, server storeServer, after time.Duration, steps int) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// --step-ms 15 makes a step last at least 15 ms, so the late kill
	// comes well before the end of the run on any machine.
	store, ws := startWorkers(ctx, t, server, nil, 4, "--steps", strconv.Itoa(steps), "--step-ms", "15")
	board := shrink.NewBoard(store, "")
	time.Sleep(after)
	for g, w := range ws {
		if strings.Contains(w.out.String(), "done rank=") {
			t.Fatalf("rank %d finished before the kill: the run is too short to test a late kill", g)
		}
	}
	killed := time.Now()
	e := killAndPublish(ctx, t, board, shrink.DefaultConfig(), ws, 2)
	if e.Action != shrink.ActionShrink || e.WorldSize != 3 {
		t.Fatalf("epoch %v, want a shrink to 3", e)
	}

	var losses []string
	var ranks []int
	for g, w := range ws {
		if g == 2 {
			continue
		}
		err, ok := w.wait(ctx)
		if !ok {
			t.Fatalf("survivor %d did not finish\n%s", g, w.out)
		}
		if err != nil {
			t.Fatalf("survivor %d: %v\n%s\nthe others:\n%s", g, err, w.out, others(ws, g))
		}
		out := w.out.String()
		if !strings.Contains(out, "shrink epoch=1 world=3 excluded=[2]") {
			t.Errorf("survivor %d did not report the shrink:\n%s", g, out)
		}
		m := doneLine.FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("survivor %d printed no done line:\n%s", g, out)
		}
		r, _ := strconv.Atoi(m[1])
		ranks = append(ranks, r)
		if m[2] != "3" || m[3] != strconv.Itoa(steps) {
			t.Errorf("survivor %d: %s, want world=3 steps=%d", g, m[0], steps)
		}
		losses = append(losses, m[4])
		if r != e.Ranks[g] {
			t.Errorf("global rank %d finished as rank %d, epoch says %d", g, r, e.Ranks[g])
		}
	}
	// The workers' gloo timeout is 60 s: a survivor left blocked on a
	// peer that is waiting for the decision would finish only after it.
	if took := time.Since(killed); took > 30*time.Second {
		t.Errorf("survivors finished %v after the kill: recovery waited for a timeout", took.Round(time.Millisecond))
	}
	slices.Sort(ranks)
	if !slices.Equal(ranks, []int{0, 1, 2}) {
		t.Errorf("survivors finished as ranks %v, want 0 1 2", ranks)
	}
	if losses[0] != losses[1] || losses[1] != losses[2] {
		t.Errorf("survivors disagree on the model: losses %v", losses)
	}
	if loss, err := strconv.ParseFloat(losses[0], 64); err != nil || loss > 1e-3 {
		t.Errorf("final loss %v (%v): the survivors did not keep training", losses[0], err)
	}
	if n, err := board.Acks(ctx, 1); err != nil || n != 3 {
		t.Errorf("acks of epoch 1 = %d %v, want 3", n, err)
	}
}

// TestTorchGlooBelowFloor: with a floor of three, losing one of three ranks
// is decided as a restart; the survivors stop with exit code 1 so that the
// launcher restarts the group.
func TestTorchGlooBelowFloor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	store, ws := startWorkers(ctx, t, gorunServer, nil, 3, "--steps", "100000", "--step-ms", "15")
	board := shrink.NewBoard(store, "")
	time.Sleep(200 * time.Millisecond)
	e := killAndPublish(ctx, t, board, shrink.Config{MinWorldSize: 3}, ws, 0)
	if e.Action != shrink.ActionRestart {
		t.Fatalf("epoch %v, want a restart", e)
	}
	for g, w := range ws[1:] {
		err, ok := w.wait(ctx)
		if !ok {
			t.Fatalf("survivor %d kept running after a restart epoch\n%s", g+1, w.out)
		}
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("survivor %d: exit %v, want code 1\n%s", g+1, err, w.out)
		}
		if !strings.Contains(w.out.String(), "restart") {
			t.Errorf("survivor %d did not say why it stopped:\n%s", g+1, w.out)
		}
	}
}

// TestTorchGlooNoEpoch: a rank dies and no agent ever publishes an epoch
// (the agents are gone, or gave up). The survivors must not wait without
// end: past GORUN_AGREEMENT_TIMEOUT and the detection slack they stop with
// exit code 1, as for a restart, and say why.
func TestTorchGlooNoEpoch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const agreement, slack = 1 * time.Second, 10 * time.Second // slack: gorun_ft.DETECTION_SLACK
	_, ws := startWorkers(ctx, t, gorunServer, []string{"GORUN_AGREEMENT_TIMEOUT=1"}, 3, "--steps", "100000", "--step-ms", "15")
	time.Sleep(2500 * time.Millisecond) // the watchers have timed out twice
	ws[0].cmd.Process.Kill()
	killed := time.Now()
	for g, w := range ws[1:] {
		err, ok := w.wait(ctx)
		if !ok {
			t.Fatalf("survivor %d still waits for an epoch %v after the kill\n%s", g+1, time.Since(killed), w.out)
		}
		took := time.Since(killed)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("survivor %d: exit %v, want code 1\n%s", g+1, err, w.out)
		}
		if !strings.Contains(w.out.String(), "no epoch 1 within 11 s") {
			t.Errorf("survivor %d did not say why it stopped:\n%s", g+1, w.out)
		}
		if took < agreement+slack {
			t.Errorf("survivor %d gave up %v after the kill, before the agreement timeout and slack", g+1, took)
		}
	}
}

// others returns every worker's output but worker skip's, for a failure
// message.
func others(ws []*worker, skip int) string {
	var b strings.Builder
	for g, w := range ws {
		if g != skip {
			fmt.Fprintf(&b, "--- global rank %d:\n%s\n", g, w.out)
		}
	}
	return b.String()
}
