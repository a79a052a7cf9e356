package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// These tests run the gorun binary as a user would: a real agent process,
// real workers, real signals.

// agentProc is a gorun process whose stdout lines a test reads.
type agentProc struct {
	cmd    *exec.Cmd
	lines  chan string
	stderr *testutil.SyncBuffer
	done   chan struct{}
	err    error
}

func startAgent(t *testing.T, bin string, args ...string) *agentProc {
	t.Helper()
	return startAgentEnv(t, bin, nil, args...)
}

// startAgentEnv starts gorun with extra environment variables.
func startAgentEnv(t *testing.T, bin string, env []string, args ...string) *agentProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	// If the test binary dies (a timeout panic skips cleanups), the agent
	// dies with it, and its workers with the agent.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return startAgentCmd(t, cmd)
}

// startAgentCmd starts an agent prepared by the caller (e.g. inside a
// network namespace), with debug logging.
func startAgentCmd(t *testing.T, cmd *exec.Cmd) *agentProc {
	t.Helper()
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, "GORUN_LOG_LEVEL=debug")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &agentProc{cmd: cmd, lines: make(chan string, 100), stderr: &testutil.SyncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// expectLine waits for a stdout line containing want and returns it.
func (p *agentProc) expectLine(t *testing.T, want string) string {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				t.Fatalf("agent stdout ended before %q; stderr:\n%s", want, p.stderr)
			}
			if strings.Contains(l, want) {
				return l
			}
		case <-timeout:
			t.Fatalf("no line %q within 20s; stderr:\n%s", want, p.stderr)
		}
	}
}

// exitCode waits for the agent and returns its exit code.
func (p *agentProc) exitCode(t *testing.T, within time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(within):
		t.Fatalf("agent did not exit within %v; stderr:\n%s", within, p.stderr)
	}
	var ee *exec.ExitError
	if p.err == nil {
		return 0
	}
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	t.Fatalf("wait: %v", p.err)
	return -1
}

// pids reads "pid=N" lines, one per worker.
func (p *agentProc) pids(t *testing.T, n int) []int {
	t.Helper()
	var pids []int
	for range n {
		l := p.expectLine(t, "pid=")
		v, err := strconv.Atoi(l[strings.Index(l, "pid=")+4:])
		if err != nil {
			t.Fatalf("line %q", l)
		}
		pids = append(pids, v)
	}
	return pids
}

func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	// A zombie still answers kill(0); it is not running.
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	return !strings.HasPrefix(strings.Fields(s[strings.LastIndexByte(s, ')')+1:])[0], "Z")
}

func waitGone(t *testing.T, pids []int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for _, pid := range pids {
		for alive(pid) {
			if time.Now().After(deadline) {
				t.Fatalf("worker %d still alive after %v", pid, within)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

func TestLaunchSignalForwardingAndExitCode(t *testing.T) {
	bin := testutil.BuildGorun(t)
	cases := []struct {
		name     string
		worker   string
		extra    []string
		send     []syscall.Signal
		wantCode int
		maxTime  time.Duration
		minTime  time.Duration
	}{
		{
			name:     "SIGTERM reaches workers, agent exits 128+15",
			worker:   `trap 'echo got-TERM; exit 0' TERM; echo pid=$$; while :; do sleep 0.05; done`,
			send:     []syscall.Signal{syscall.SIGTERM},
			wantCode: 128 + 15, maxTime: 5 * time.Second,
		},
		{
			name:     "a worker ignoring SIGTERM is killed after --shutdown-timeout",
			worker:   `trap '' TERM; echo pid=$$; while :; do sleep 0.05; done`,
			extra:    []string{"--shutdown-timeout", "0.7"},
			send:     []syscall.Signal{syscall.SIGTERM},
			wantCode: 128 + 15, minTime: 600 * time.Millisecond, maxTime: 5 * time.Second,
		},
		{
			// A stopped worker (SIGSTOP: a debugger's, or a chaos test's
			// hang) gets SIGCONT after the SIGTERM, so it need not wait
			// out the grace period to act on it.
			name:     "a stopped worker acts on SIGTERM at once",
			worker:   `trap 'echo got-TERM; exit 0' TERM; echo pid=$$; kill -STOP $$; while :; do sleep 0.05; done`,
			extra:    []string{"--shutdown-timeout", "30"},
			send:     []syscall.Signal{syscall.SIGTERM},
			wantCode: 128 + 15, maxTime: 5 * time.Second,
		},
		{
			name:     "a second SIGINT kills at once",
			worker:   `trap '' INT; echo pid=$$; while :; do sleep 0.05; done`,
			extra:    []string{"--shutdown-timeout", "30"},
			send:     []syscall.Signal{syscall.SIGINT, syscall.SIGINT},
			wantCode: 128 + 2, maxTime: 5 * time.Second,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--nproc-per-node", "2", "--no-python"}, tc.extra...)
			p := startAgent(t, bin, append(args, "sh", "-c", tc.worker)...)
			pids := p.pids(t, 2)
			start := time.Now()
			for i, s := range tc.send {
				if i > 0 {
					time.Sleep(200 * time.Millisecond)
				}
				p.cmd.Process.Signal(s)
			}
			code := p.exitCode(t, 15*time.Second)
			d := time.Since(start)
			if code != tc.wantCode || d > tc.maxTime || d < tc.minTime {
				t.Fatalf("exit %d after %v; want %d within [%v, %v]; stderr:\n%s", code, d, tc.wantCode, tc.minTime, tc.maxTime, p.stderr)
			}
			waitGone(t, pids, 2*time.Second)
		})
	}
}

// TestLaunchForwardsUserSignals: SIGUSR1 (SLURM's warning) is passed to the
// workers and does not stop the job.
func TestLaunchForwardsUserSignals(t *testing.T) {
	bin := testutil.BuildGorun(t)
	p := startAgent(t, bin, "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "--no-python",
		"sh", "-c", `trap 'echo usr1-$LOCAL_RANK; exit 0' USR1; echo pid=$$; while :; do sleep 0.05; done`)
	p.pids(t, 2)
	p.cmd.Process.Signal(syscall.SIGUSR1)
	p.expectLine(t, "usr1-")
	p.expectLine(t, "usr1-")
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
	}
}

// TestLaunchAgentKilledTakesWorkers: when the agent is SIGKILLed its
// workers die too (Pdeathsig): no orphaned training processes.
func TestLaunchAgentKilledTakesWorkers(t *testing.T) {
	bin := testutil.BuildGorun(t)
	p := startAgent(t, bin, "--nproc-per-node", "3", "--no-python", "sh", "-c", `echo pid=$$; exec sleep 60`)
	pids := p.pids(t, 3)
	p.cmd.Process.Kill()
	p.exitCode(t, 5*time.Second)
	waitGone(t, pids, 3*time.Second)
}

// TestLaunchAsPID1 runs gorun as PID 1 of a new PID namespace (as in a
// container) with a worker that leaves orphaned grandchildren: they are
// re-parented to gorun, which must reap them, and the exit code must come
// through.
// requireUnshare returns util-linux's unshare, or skips the test (fails it
// in CI, which runs as root): PID namespaces need both.
func requireUnshare(t *testing.T) string {
	t.Helper()
	unshare, err := exec.LookPath("unshare")
	if err != nil || os.Geteuid() != 0 {
		if torchtest.InCI() {
			t.Fatalf("needs root and unshare (CI runs as root): euid %d, %v", os.Geteuid(), err)
		}
		t.Skipf("skipped: needs root and util-linux unshare (euid %d)", os.Geteuid())
	}
	return unshare
}

func TestLaunchAsPID1(t *testing.T) {
	unshare := requireUnshare(t)
	bin := testutil.BuildGorun(t)
	// The orphans (sleeps whose parent shell exits at once) end while the
	// worker still runs; then the worker counts zombies in the namespace.
	worker := `sh -c 'sleep 0.1 &'; sh -c 'sleep 0.2 &'; sleep 0.8
		z=$(awk '{print $3}' /proc/[0-9]*/stat 2>/dev/null | grep -c Z)
		echo "pid1=$(awk '{print $1}' /proc/1/stat) zombies=$z"
		exit 3`
	cmd := exec.Command(unshare, "--pid", "--fork", "--mount-proc", bin, "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)
	cmd.Env = append(os.Environ(), "GORUN_LOG_LEVEL=debug")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatal("gorun as PID 1 did not finish")
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("exit %v, want 1 (a worker failed); stderr:\n%s", err, &errb)
	}
	if got := strings.TrimSpace(out.String()); got != "[default0]:pid1=1 zombies=0" {
		t.Fatalf("worker saw %q; stderr:\n%s", got, &errb)
	}
	if !strings.Contains(errb.String(), "reaped an orphan") {
		t.Fatalf("no orphan was reaped; stderr:\n%s", &errb)
	}
}

// TestLaunchBadInputProcess: one clear line, exit code 2, nothing started.
func TestLaunchBadInputProcess(t *testing.T) {
	bin := testutil.BuildGorun(t)
	notExec := filepath.Join(t.TempDir(), "data.txt")
	if err := os.WriteFile(notExec, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := [][]string{
		{"--no-python", "/nonexistent/program"},
		{"--no-python", notExec}, // not executable: says so, not "not found"
		{"/nonexistent/train.py"},
		{"--standalone", "--nnodes", "2", "--no-python", "true"},
		{"--nproc-per-node", "zero", "--no-python", "true"},
	}
	for _, args := range cases {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, append([]string{"--log-dir", t.TempDir()}, args...)...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			var errb bytes.Buffer
			cmd.Stderr, cmd.Stdout = &errb, io.Discard
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != ExitUsage {
				t.Fatalf("exit %v, want %d; stderr %q", err, ExitUsage, &errb)
			}
			if lines := strings.Split(strings.TrimSpace(errb.String()), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], "gorun: ") {
				t.Fatalf("stderr should be one gorun: line, got %q", &errb)
			}
			if slices.Contains(args, notExec) && !strings.Contains(errb.String(), "is not executable") {
				t.Errorf("stderr %q does not say the program is not executable", &errb)
			}
		})
	}
}

// TestLaunchLocalResourceFailures: a resource of this machine that fails
// gives exit code 8 at once, with one line naming it, and leaves nothing
// running: a static node rank 0 whose --master-port is taken (torchrun
// fails there too, "Address already in use"; gorun once joined as a client
// and waited out the join timeout), a taken --health-addr, a --log-dir that
// cannot be made.
func TestLaunchLocalResourceFailures(t *testing.T) {
	bin := testutil.BuildGorun(t)
	taken, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := strconv.Itoa(taken.Addr().(*net.TCPAddr).Port)
	notADir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notADir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		args []string
		says string
	}{
		{"static master port taken", []string{"--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port,
			"--rdzv-conf", "join_timeout=600", "--log-dir", t.TempDir()}, "address already in use"},
		{"health address taken", []string{"--health-addr", "127.0.0.1:" + port, "--log-dir", t.TempDir()}, "--health-addr"},
		{"log dir is a file", []string{"--log-dir", filepath.Join(notADir, "logs")}, "--log-dir"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, append(tc.args, "--no-python", "sleep", "60")...)
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			var errb bytes.Buffer
			cmd.Stderr, cmd.Stdout = &errb, io.Discard
			began := time.Now()
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != ExitLocalResource {
				t.Fatalf("exit %v, want %d; stderr %q", err, ExitLocalResource, &errb)
			}
			if took := time.Since(began); took > 5*time.Second {
				t.Errorf("took %v: it waited instead of failing", took)
			}
			last := strings.TrimSpace(errb.String())
			last = last[strings.LastIndexByte(last, '\n')+1:]
			if !strings.HasPrefix(last, "gorun: ") || !strings.Contains(last, tc.says) {
				t.Errorf("last line %q, want a gorun: line saying %q", last, tc.says)
			}
		})
	}
}
