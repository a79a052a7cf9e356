// Package torchtest runs real PyTorch from Go tests.
//
// Debian's python3-torch (1.13.1) imports only under /usr/bin/python3, while
// a developer's PATH often starts with another Python, so the interpreter is
// found by trying candidates rather than trusting PATH. Without torch a test
// is skipped with one line saying why — except in CI (GORUN_CI=1), where a
// missing torch fails the test: CI skips nothing silently.
package torchtest

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

var (
	findOnce sync.Once
	found    string
	version  string
	findErr  string
)

// candidates lists interpreters to try, in order: $GORUN_TEST_PYTHON, then
// Debian's, then whatever python3 PATH names.
func candidates() []string {
	var c []string
	if p := os.Getenv("GORUN_TEST_PYTHON"); p != "" {
		c = append(c, p)
	}
	c = append(c, "/usr/bin/python3")
	if p, err := exec.LookPath("python3"); err == nil {
		c = append(c, p)
	}
	return c
}

func find() {
	var tried []string
	for _, p := range candidates() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		out, err := exec.CommandContext(ctx, p, "-c", "import torch, torch.distributed as d; assert d.is_available(); print(torch.__version__)").Output()
		cancel()
		if err == nil {
			found, version = p, strings.TrimSpace(string(out))
			return
		}
		tried = append(tried, p)
	}
	findErr = "no Python with torch.distributed (tried " + strings.Join(tried, ", ") + "; install Debian's python3-torch or set GORUN_TEST_PYTHON)"
}

// InCI reports whether the tests run in CI, where nothing may be skipped.
func InCI() bool { return os.Getenv("GORUN_CI") == "1" }

// Python returns an interpreter that imports torch.distributed, or skips the
// test (fails it in CI).
func Python(t testing.TB) string {
	t.Helper()
	findOnce.Do(find)
	if found == "" {
		if InCI() {
			t.Fatalf("torch interop: %s", findErr)
		}
		t.Skipf("torch interop skipped: %s", findErr)
	}
	return found
}

// Version returns torch.__version__ of the interpreter Python found.
func Version(t testing.TB) string {
	Python(t)
	return version
}

// Proc is a Python process started by Start.
type Proc struct {
	Cmd    *exec.Cmd
	stdout *testutil.SyncBuffer
	stderr *testutil.SyncBuffer
	done   chan struct{}
	err    error
}

// Start runs `python -c script args...` in its own process group. The test's
// cleanup kills the group if the process is still running.
func Start(t testing.TB, env []string, script string, args ...string) *Proc {
	t.Helper()
	return StartWith(t, Python(t), env, script, args...)
}

// StartWith is Start with a given interpreter (for instance the sid bed's,
// internal/sidbed).
func StartWith(t testing.TB, py string, env []string, script string, args ...string) *Proc {
	t.Helper()
	cmd := exec.Command(py, append([]string{"-c", script}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p := &Proc{Cmd: cmd, stdout: &testutil.SyncBuffer{}, stderr: &testutil.SyncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.stdout, p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", py, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	})
	return p
}

// Wait waits up to d for the process to exit and returns its stdout. It
// fails the test, showing stderr, if the process fails or outlives d.
func (p *Proc) Wait(t testing.TB, d time.Duration) string {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		_ = syscall.Kill(-p.Cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
		t.Fatalf("python did not finish within %v\nstdout:\n%s\nstderr:\n%s", d, p.stdout, p.stderr)
	}
	if p.err != nil {
		t.Fatalf("python failed: %v\nstdout:\n%s\nstderr:\n%s", p.err, p.stdout, p.stderr)
	}
	return p.stdout.String()
}

// Stdout returns what the process has written to stdout so far.
func (p *Proc) Stdout() string { return p.stdout.String() }

// Stderr returns what the process has written to stderr so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Run runs a script to completion within d and returns its stdout.
func Run(t testing.TB, d time.Duration, env []string, script string, args ...string) string {
	t.Helper()
	return Start(t, env, script, args...).Wait(t, d)
}
