package health

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The test binary doubles as a worker: with HEALTH_TEST_WORKER=1 it beats
// every 20 ms (what TestMonitorStoppedWorker SIGSTOPs); with =blocked it
// beats once and then blocks, as a peer of a hung rank blocks in its next
// collective, saying so (Blocked).
func TestMain(m *testing.M) {
	switch os.Getenv("HEALTH_TEST_WORKER") {
	case "1":
		for {
			if err := Beat(); err != nil {
				os.Exit(3)
			}
			time.Sleep(20 * time.Millisecond)
		}
	case "blocked":
		if err := Beat(); err != nil {
			os.Exit(3)
		}
		defer Blocked()()
		select {}
	case "done":
		if Beat() != nil || Done() != nil {
			os.Exit(3)
		}
		select {} // a teardown that takes for ever
	}
	goleak.VerifyTestMain(m)
}

// startWorker starts the test binary as worker kind of local rank rank,
// beating to m; the test's end kills it.
func startWorker(t *testing.T, m *Monitor, kind string, rank int, extra ...string) *exec.Cmd {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "HEALTH_TEST_WORKER="+kind, HeartbeatEnv+"="+m.Path(), "LOCAL_RANK="+strconv.Itoa(rank)), extra...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Wait()
	})
	return cmd
}

// TestMonitorHungAmongBlockedPeers: real worker processes. Rank 5 hangs
// (SIGSTOP) while ranks 1 and 2 are blocked on it and say so (Blocked, at
// the pace GORUN_HEARTBEAT_TIMEOUT sets): only rank 5 is reported, one
// timeout after its last beat; a blocked rank is reported only once it has
// been blocked for BlockedFactor timeouts without progress. Rank 7 said it
// is done (Done) and then never exits: it is never reported.
func TestMonitorHungAmongBlockedPeers(t *testing.T) {
	const timeout = 500 * time.Millisecond
	m, events := startMonitor(t, timeout)
	pace := HeartbeatTimeoutEnv + "=0.5"
	started := time.Now()
	hung := startWorker(t, m, "1", 5, pace)
	for _, r := range []int{1, 2} {
		startWorker(t, m, "blocked", r, pace)
	}
	startWorker(t, m, "done", 7, pace) // finished: never reported
	time.Sleep(3 * timeout)
	select {
	case ev := <-events:
		t.Fatalf("reported while every rank beats or waits: %v", ev)
	default:
	}
	if err := hung.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	select {
	case ev := <-events:
		if ev.Rank != 5 {
			t.Fatalf("%v reported first, want the SIGSTOPped rank 5", ev)
		}
		if took := time.Since(stopped); took > timeout+500*time.Millisecond {
			t.Errorf("rank 5 reported %v after its stop, want about %v", took, timeout)
		}
	case <-time.After(10 * timeout):
		t.Fatal("the SIGSTOPped worker was never reported hung")
	}
	for range 2 {
		select {
		case ev := <-events:
			if ev.Rank != 1 && ev.Rank != 2 || !strings.Contains(ev.Reason, "blocked on its peers") {
				t.Fatalf("event %v, want a blocked rank, blocked too long", ev)
			}
			if since := time.Since(started); since < BlockedFactor*timeout-100*time.Millisecond {
				t.Errorf("blocked rank %d reported %v after it started, want no sooner than %v", ev.Rank, since, BlockedFactor*timeout)
			}
		case <-time.After(2 * BlockedFactor * timeout):
			t.Fatal("a rank blocked for ever was never reported")
		}
	}
}

func startMonitor(t *testing.T, timeout time.Duration) (*Monitor, <-chan Event) {
	t.Helper()
	m, err := ListenHeartbeats(filepath.Join(t.TempDir(), "hb.sock"), timeout)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan Event, 16)
	done := make(chan error, 1)
	go func() { done <- m.Run(context.Background(), events) }()
	t.Cleanup(func() {
		m.Close()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if _, err := os.Stat(m.Path()); !os.IsNotExist(err) {
			t.Errorf("socket file left behind: %v", err)
		}
	})
	return m, events
}

// TestMonitorStoppedWorker: a real worker process beats, is SIGSTOPped, and
// is reported hung about one timeout after its last beat.
func TestMonitorStoppedWorker(t *testing.T) {
	const timeout = 300 * time.Millisecond
	m, events := startMonitor(t, timeout)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), "HEALTH_TEST_WORKER=1", HeartbeatEnv+"="+m.Path(), "LOCAL_RANK=5")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Kill()
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Wait()
	}()

	// Beating for three timeouts: no event.
	select {
	case ev := <-events:
		t.Fatalf("a beating worker was reported: %v", ev)
	case <-time.After(3 * timeout):
	}
	stopped := time.Now()
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-events:
		took := time.Since(stopped)
		if ev.Kind != WorkerHung || ev.Rank != 5 {
			t.Fatalf("event %v, want worker_hung for rank 5", ev)
		}
		// The last beat came at most 20 ms before the stop; allow
		// scheduling slack on a busy machine.
		if took < timeout-50*time.Millisecond || took > timeout+500*time.Millisecond {
			t.Errorf("hung reported %v after SIGSTOP, want about %v", took, timeout)
		}
		t.Logf("SIGSTOPped worker reported hung %v after the stop: %s", took.Round(time.Millisecond), ev.Reason)
	case <-time.After(10 * timeout):
		t.Fatal("a SIGSTOPped worker was never reported hung")
	}
}

func TestMonitorIgnoresGarbageAndForgets(t *testing.T) {
	m, events := startMonitor(t, 150*time.Millisecond)
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: m.Path(), Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, msg := range []string{"garbage", "-4", "1"} {
		if _, err := conn.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case ev := <-events:
		if ev.Rank != 1 {
			t.Fatalf("event for rank %d, want only rank 1", ev.Rank)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("rank 1 never reported")
	}

	// Rank 2 beats once and is forgotten before its timeout.
	conn.Write([]byte("2"))
	time.Sleep(20 * time.Millisecond)
	m.Forget(2)
	select {
	case ev := <-events:
		t.Fatalf("forgotten worker reported: %v", ev)
	case <-time.After(400 * time.Millisecond):
	}
}

func TestBeatWithoutMonitor(t *testing.T) {
	t.Setenv(HeartbeatEnv, "")
	if err := Beat(); err != nil {
		t.Errorf("Beat with heartbeats off = %v, want nil", err)
	}
	t.Setenv(HeartbeatEnv, filepath.Join(t.TempDir(), "nobody-listens"))
	if err := Beat(); err == nil {
		t.Error("Beat to a missing socket succeeded")
	}
}

func TestListenHeartbeatsErrors(t *testing.T) {
	if _, err := ListenHeartbeats(filepath.Join(t.TempDir(), "s"), 0); err == nil {
		t.Error("zero timeout accepted")
	}
	if _, err := ListenHeartbeats(filepath.Join(t.TempDir(), "no", "such", "dir", "s"), time.Second); err == nil {
		t.Error("socket in a missing directory accepted")
	}
}

// TestMonitorRankReused: local rank 1 is one worker, then another (a
// respawn, the next round). The first says it is done and no one takes
// the report of its hung teardown (the agent is between rounds); then it
// exits (Forget), and its last datagram, another "done", is read after
// that. Neither may count for the next worker of the rank: the report is
// withdrawn, the datagram dropped. Once a worker starts in the rank
// again (Start), its beats count: it is reported hung after the timeout,
// not as done. (A stale report once killed a new worker as finished and
// ended a job: bench/chaos. Before that, Run sent reports blocking, and a
// Forget waited behind one nobody took.)
func TestMonitorRankReused(t *testing.T) {
	m, err := ListenHeartbeats(filepath.Join(t.TempDir(), "hb.sock"), 150*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	m.SetDoneTimeout(100 * time.Millisecond)
	events := make(chan Event) // nobody listens until below
	ran := make(chan error, 1)
	go func() { ran <- m.Run(context.Background(), events) }()
	defer func() {
		m.Close()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: m.Path(), Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	send := func(msg string) {
		t.Helper()
		if _, err := conn.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
	}
	send("1 done")
	time.Sleep(300 * time.Millisecond) // its teardown's report is due, and waits
	forgot := make(chan struct{})
	go func() { m.Forget(1); close(forgot) }()
	select {
	case <-forgot:
	case <-time.After(time.Second):
		t.Fatal("Forget blocked behind a report nobody took")
	}
	send("1 done") // read after the Forget: the first worker's last words
	time.Sleep(50 * time.Millisecond)
	m.Start(1)
	select {
	case ev := <-events:
		t.Fatalf("reported %+v about the worker that exited", ev)
	case <-time.After(400 * time.Millisecond):
	}
	send("1") // the new worker's first beat, then silence
	select {
	case ev := <-events:
		if ev.Rank != 1 || ev.Done {
			t.Fatalf("reported %+v, want rank 1 hung (not done)", ev)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the new worker of rank 1 never reported hung")
	}
}
