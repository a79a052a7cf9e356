package main

import (
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// exitedAgent is an agent on host whose process (a real sh) has exited
// with code, err being Wait's, as the runner records them.
func exitedAgent(t *testing.T, host, code int) *agent {
	t.Helper()
	cmd := exec.Command("sh", "-c", "exit "+strconv.Itoa(code))
	err := cmd.Run()
	if (code == 0) != (err == nil) {
		t.Fatalf("sh exit %d: %v", code, err)
	}
	a := &agent{host: host, cmd: cmd, exited: make(chan struct{}), err: err, at: time.Now()}
	close(a.exited)
	return a
}

// TestRestartExited: the harness starts again the agent of a host that
// exited by itself in error while the job ran (exit 3: the run that found
// a spare's agent ending), once; not the witness, an agent a fault killed,
// one it stopped, one still running, one that succeeded, one that found
// the job ended (exit 7), nor one already started again.
func TestRestartExited(t *testing.T) {
	running := &agent{host: 5, exited: make(chan struct{})}
	killed, stopped, ended, ok := exitedAgent(t, 2, 137), exitedAgent(t, 3, 1), exitedAgent(t, 4, exitJobEnded), exitedAgent(t, 6, 0)
	killed.killed, stopped.stopped = true, true
	again := exitedAgent(t, 7, 3)
	again.restarted = true
	witness, failed := exitedAgent(t, 0, 1), exitedAgent(t, 1, 3)
	var console strings.Builder
	ru := &runner{env: runEnv{console: &console}, t0: time.Now().Add(-time.Minute),
		agents: []*agent{witness, failed, killed, stopped, ended, running, ok, again}}

	if got := ru.restartExited(witness); !slices.Equal(got, []int{1}) {
		t.Fatalf("restartExited = %v, want host 1 only", got)
	}
	if !failed.restarted {
		t.Error("the agent started again is not marked restarted")
	}
	if !strings.Contains(console.String(), "the agent on host 1 exited by itself") || strings.Count(console.String(), "\n") != 1 {
		t.Errorf("console:\n%s\nwant one line for host 1", console.String())
	}
	if got := ru.restartExited(witness); len(got) != 0 {
		t.Errorf("a second look = %v, want nothing: each exit is started again once", got)
	}
}
