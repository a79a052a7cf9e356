package testutil

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Gorun is a gorun process a test started, in a process group of its own
// so that it and everything under it can be killed at once.
type Gorun struct {
	Cmd            *exec.Cmd
	Stdout, Stderr SyncBuffer
	// exited is closed once the process has been waited for; err is valid
	// then. (A channel of the error could be drained only once, and the
	// cleanup must not block on a drained one.)
	exited chan struct{}
	err    error
}

// StartGorun starts bin with args and extra environment variables (added
// to the test's own). The test's cleanup kills its process group and
// waits for it.
func StartGorun(t *testing.T, bin string, env []string, args ...string) *Gorun {
	t.Helper()
	g := &Gorun{Cmd: exec.Command(bin, args...), exited: make(chan struct{})}
	if env != nil {
		g.Cmd.Env = append(g.Cmd.Environ(), env...)
	}
	g.Cmd.Stdout, g.Cmd.Stderr = &g.Stdout, &g.Stderr
	g.Cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := g.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { g.err = g.Cmd.Wait(); close(g.exited) }()
	t.Cleanup(func() {
		syscall.Kill(-g.Cmd.Process.Pid, syscall.SIGKILL)
		<-g.exited
	})
	return g
}

// Output is stdout then stderr, for failure messages.
func (g *Gorun) Output() string {
	return "stdout:\n" + g.Stdout.String() + "\nstderr:\n" + g.Stderr.String()
}

// AwaitLines waits until stdout holds n lines containing s.
func (g *Gorun) AwaitLines(ctx context.Context, t *testing.T, s string, n int) {
	t.Helper()
	for strings.Count(g.Stdout.String(), s) < n {
		select {
		case <-g.exited:
			t.Fatalf("gorun exited before %d lines with %q: %v\n%s", n, s, g.err, g.Output())
		case <-ctx.Done():
			t.Fatalf("no %d lines with %q\n%s", n, s, g.Output())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// AwaitLog waits until gorun's own log (stderr) holds s.
func (g *Gorun) AwaitLog(ctx context.Context, t *testing.T, s string) {
	t.Helper()
	for !strings.Contains(g.Stderr.String(), s) {
		select {
		case <-g.exited:
			if !strings.Contains(g.Stderr.String(), s) {
				t.Fatalf("gorun exited before it logged %q: %v\n%s", s, g.err, g.Output())
			}
		case <-ctx.Done():
			t.Fatalf("gorun never logged %q\n%s", s, g.Output())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// KillRank SIGKILLs gorun's worker of global rank r.
func (g *Gorun) KillRank(t *testing.T, r int) {
	t.Helper()
	pid, err := ChildWithEnv(g.Cmd.Process.Pid, "RANK", strconv.Itoa(r))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
}

// Wait waits for gorun to exit and fails the test unless it exits 0.
func (g *Gorun) Wait(ctx context.Context, t *testing.T) {
	t.Helper()
	select {
	case <-g.exited:
		if g.err != nil {
			t.Fatalf("gorun: %v\n%s", g.err, g.Output())
		}
	case <-ctx.Done():
		t.Fatalf("gorun did not finish\n%s", g.Output())
	}
}
