package health

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The test binary doubles as a worker that beats every 20 ms: it is what
// TestMonitorStoppedWorker SIGSTOPs.
func TestMain(m *testing.M) {
	if os.Getenv("HEALTH_TEST_WORKER") == "1" {
		for {
			if err := Beat(); err != nil {
				os.Exit(3)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	goleak.VerifyTestMain(m)
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
