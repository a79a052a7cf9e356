package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestSparePrestartAssignment: under --spare-prestart a worker starts
// before its round without the round's variables — even those the agent's
// own environment holds — and reads them, as one JSON object, from the
// descriptor GORUN_ASSIGNMENT_FD names. Any program can: here a shell.
func TestSparePrestartAssignment(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	script := `echo "parked rank=${RANK-unset} world=${WORLD_SIZE-unset} local=$LOCAL_RANK fd=$GORUN_ASSIGNMENT_FD"; ` +
		`eval "cat <&$GORUN_ASSIGNMENT_FD"; echo`
	p := startAgentEnv(t, bin, []string{"RANK=99", "WORLD_SIZE=99"}, "--standalone", "--nproc-per-node", "2",
		"--spare-prestart", "--log-dir", t.TempDir(), "--no-python", "sh", "-c", script)
	if code := p.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
	}
	var parked, assigned []string
	for l := range p.lines {
		switch {
		case strings.Contains(l, "]:parked "):
			parked = append(parked, l)
		case strings.Contains(l, `]:{"env":`):
			assigned = append(assigned, l)
		}
	}
	if len(parked) != 2 || len(assigned) != 2 {
		t.Fatalf("%d parked and %d assignment lines, want 2 each; stderr:\n%s", len(parked), len(assigned), p.stderr)
	}
	for _, l := range parked {
		if !strings.Contains(l, "rank=unset world=unset") || !strings.Contains(l, "fd=3") {
			t.Errorf("%q: a parked worker must not see the round's variables", l)
		}
	}
	ranks := map[string]bool{}
	for _, l := range assigned {
		var a struct{ Env map[string]string }
		if err := json.Unmarshal([]byte(l[strings.Index(l, "{"):]), &a); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		env := a.Env
		if env["WORLD_SIZE"] != "2" || env["MASTER_PORT"] == "" || env["GORUN_STORE"] == "" ||
			env["TORCHELASTIC_RESTART_COUNT"] != "0" || env["LOCAL_RANK"] != env["RANK"] {
			t.Errorf("assignment %v", env)
		}
		if prefix := "[default" + env["LOCAL_RANK"] + "]:"; !strings.HasPrefix(l, prefix) {
			t.Errorf("%q: want the prefix %s", l, prefix)
		}
		ranks[env["RANK"]] = true
	}
	if !ranks["0"] || !ranks["1"] {
		t.Errorf("ranks assigned %v, want 0 and 1", ranks)
	}
	if !strings.Contains(p.stderr.String(), "assigning the pre-started workers") {
		t.Errorf("the log does not say the workers were pre-started:\n%s", p.stderr)
	}
}

// TestSparePrestartWorkerExits: a pre-started worker that exits while its
// agent still waits for a round (a spare whose script cannot run) ends
// the wait at once: exit 1, the failure table, the other pre-started
// worker stopped, nothing left running.
func TestSparePrestartWorkerExits(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	// Two nodes, one agent: the round never comes.
	p := startAgent(t, bin, append(c10dArgs(freePort(t), "2", "--log-dir", t.TempDir(), "--nproc-per-node", "2",
		"--spare-prestart"), "--no-python", "sh", "-c",
		`echo pid=$$; [ "$LOCAL_RANK" = 1 ] && { sleep 0.5; exit 3; }; exec sleep 60`)...)
	pids := p.pids(t, 2)
	code := p.exitCode(t, 20*time.Second)
	if code != 1 {
		t.Errorf("exit %d, want 1; stderr:\n%s", code, p.stderr)
	}
	log := p.stderr.String()
	for _, want := range []string{"a pre-started worker exited before this node's round", "exitcode  : 3", "stopping the pre-started workers"} {
		if !strings.Contains(log, want) {
			t.Errorf("stderr lacks %q:\n%s", want, log)
		}
	}
	waitGone(t, pids, 5*time.Second)
}

// TestSparePrestartFlag: --spare-prestart parses as a boolean flag and
// from GORUN_SPARE_PRESTART.
func TestSparePrestartFlag(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	for _, tc := range []struct {
		env  []string
		args []string
		code int
	}{
		{env: []string{"GORUN_SPARE_PRESTART=maybe"}, code: 2},
		{env: []string{"GORUN_SPARE_PRESTART=true"}, code: 0},
		{args: []string{"--spare-prestart=false"}, code: 0},
	} {
		args := append(append([]string{"--standalone", "--log-dir", t.TempDir()}, tc.args...), "--no-python", "true")
		p := startAgentEnv(t, bin, tc.env, args...)
		if code := p.exitCode(t, 20*time.Second); code != tc.code {
			t.Errorf("%v %v: exit %d, want %d; stderr:\n%s", tc.env, tc.args, code, tc.code, p.stderr)
		}
		if tc.code == 0 && strings.Contains(p.stderr.String(), "pre-started") != (len(tc.env) > 0) {
			t.Errorf("%v %v: pre-started? stderr:\n%s", tc.env, tc.args, p.stderr)
		}
	}
}

// TestRespawnStandbyExits: a standby (--respawn-standbys) that exits
// while parked is no failure of the job: the agent says so with the end of
// the standby's stderr, does not start it again, and the job ends as its
// ranks do (0 here), nothing left. The standby starts without the slot's
// variables (RANK, LOCAL_RANK), which it has no slot for yet.
func TestRespawnStandbyExits(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	script := `if [ -n "$GORUN_ASSIGNMENT_FD" ]; then echo "standby rank=${RANK-unset} local=${LOCAL_RANK-unset}: no device for me" >&2; exit 3; fi; ` +
		`echo pid=$$; sleep 2`
	p := startAgent(t, bin, "--standalone", "--nproc-per-node", "2", "--on-failure", "shrink", "--respawn-standbys", "1",
		"--log-dir", t.TempDir(), "--no-python", "sh", "-c", script)
	pids := p.pids(t, 2)
	if code := p.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d, want 0; stderr:\n%s", code, p.stderr)
	}
	log := p.stderr.String()
	if n := strings.Count(log, "a standby exited while parked"); n != 1 {
		t.Errorf("%d lines say a standby exited, want 1:\n%s", n, log)
	}
	if !strings.Contains(log, "standby rank=unset local=unset: no device for me") {
		t.Errorf("the log does not carry the standby's stderr, or the standby had a slot's variables:\n%s", log)
	}
	if n := strings.Count(log, "started a standby"); n != 1 {
		t.Errorf("%d standbys started, want 1 (one that exits is not replaced until a grow completes):\n%s", n, log)
	}
	waitGone(t, pids, 5*time.Second)
}
