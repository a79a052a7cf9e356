package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/cgrouptest"
	"github.com/gorunhq/gorun/internal/testutil"
)

// daemonWorker starts a daemon the way a careless worker does (setsid, in
// the background, its pid written to dir/daemon-<rank>), prints pid=$$ and
// then runs tail.
func daemonWorker(dir, tail string) string {
	return `setsid sh -c 'echo $$ > ` + dir + `/daemon-$RANK.tmp; mv ` + dir + `/daemon-$RANK.tmp ` + dir + `/daemon-$RANK; exec sleep 300' </dev/null >/dev/null 2>&1 &
		while [ ! -s ` + dir + `/daemon-$RANK ]; do sleep 0.01; done
		echo pid=$$; ` + tail
}

// daemons reads the daemons' pids the workers wrote in dir.
func daemons(t *testing.T, dir string, n int) []int {
	t.Helper()
	var pids []int
	deadline := time.Now().Add(20 * time.Second)
	for len(pids) < n {
		pids = pids[:0]
		files, _ := filepath.Glob(filepath.Join(dir, "daemon-*[0-9]"))
		for _, f := range files {
			b, _ := os.ReadFile(f)
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				pids = append(pids, pid)
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d daemons started, want %d", len(pids), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Cleanup(func() {
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL) // if the test failed
		}
	})
	return pids
}

// TestNoEscapedDaemons: a daemon a worker starts with setsid (out of the
// worker's process group, so a group kill misses it) ends when the
// worker's group ends, however it ends: the job succeeds, a worker fails
// and the group restarts, gorun is stopped by a signal, a rank dies in
// shrink mode. torchrun 1.13 leaves such daemons running.
func TestNoEscapedDaemons(t *testing.T) {
	bin := testutil.BuildGorun(t)
	cases := []struct {
		name  string
		args  []string
		tail  string
		n     int // daemons to wait for before acting
		act   func(p *agentProc)
		code  int
		extra int // daemons started after act (a restarted group's)
	}{
		{"success", []string{"--nproc-per-node", "2"}, "sleep 0.2; exit 0", 2, nil, 0, 0},
		{"failure and restart", []string{"--nproc-per-node", "2", "--max-restarts", "1"},
			`[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$LOCAL_RANK" = 1 ] && exit 3; sleep 0.3; exit 0`, 2, nil, 0, 0},
		{"stopped by SIGTERM", []string{"--nproc-per-node", "2"}, "exec sleep 60", 2,
			func(p *agentProc) { p.cmd.Process.Signal(syscall.SIGTERM) }, 128 + 15, 0},
		{"shrink mode", []string{"--nproc-per-node", "3", "--on-failure", "shrink", "--regrow", "off"},
			`[ "$LOCAL_RANK" = 2 ] && exit 3; sleep 1; exit 0`, 3, nil, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			args := append(tc.args, "--log-dir", t.TempDir(), "--no-python", "sh", "-c", daemonWorker(dir, tc.tail))
			p := startAgent(t, bin, args...)
			pids := daemons(t, dir, tc.n)
			if tc.act != nil {
				tc.act(p)
			}
			if code := p.exitCode(t, 30*time.Second); code != tc.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, tc.code, p.stderr)
			}
			// Every daemon any attempt started, the restarted group's too.
			all := daemons(t, dir, tc.n)
			waitGone(t, append(pids, all...), 3*time.Second)
			if !strings.Contains(p.stderr.String(), "killed processes the workers left behind") {
				t.Errorf("the log does not say it killed leftovers:\n%s", p.stderr)
			}
		})
	}
}

// TestNoEscapeAfterAgentKilled: when the agent itself is SIGKILLed, nothing
// of the job survives where gorun is PID 1 of a PID namespace (a
// container's entrypoint): the kernel ends the namespace with it, daemons
// included. (Elsewhere its workers die with it, Pdeathsig, but what they
// started may not: see README, "What gorun guarantees".)
func TestNoEscapeAfterAgentKilled(t *testing.T) {
	unshare := requireUnshare(t)
	bin := testutil.BuildGorun(t)
	dir := t.TempDir()
	// The pids the daemons could write are the namespace's, meaningless
	// here: the test finds them by a command line of their own (GNU sleep
	// sums its arguments).
	marker := "0." + strconv.Itoa(os.Getpid())
	worker := `setsid sleep 300 ` + marker + ` </dev/null >/dev/null 2>&1 & echo pid=$$; exec sleep 300`
	cmd := exec.Command(unshare, "--pid", "--fork", "--kill-child", "--mount-proc", bin, "--log-dir", dir, "--nproc-per-node", "2", "--no-python", "sh", "-c", worker)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := startAgentCmd(t, cmd)
	p.pids(t, 2)
	var daemons []int
	for deadline := time.Now().Add(10 * time.Second); len(daemons) < 2; time.Sleep(20 * time.Millisecond) {
		if daemons = pidsNamed(marker); time.Now().After(deadline) {
			t.Fatalf("%d daemons found, want 2", len(daemons))
		}
	}
	// unshare --kill-child: SIGKILL to unshare is SIGKILL to gorun, PID 1
	// of the namespace.
	cmd.Process.Kill()
	p.exitCode(t, 10*time.Second)
	waitGone(t, daemons, 5*time.Second)
}

// pidsNamed lists the processes that have arg among their arguments.
func pidsNamed(arg string) []int {
	var pids []int
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range cmdlines {
		b, err := os.ReadFile(f)
		if err != nil || !strings.Contains(string(b), "\x00"+arg+"\x00") {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(f))); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestNoEscapeAfterAgentKilledWithCgroups: outside a PID namespace of its
// own, where a cgroup v2 is writable, a SIGKILLed agent leaves nothing of
// the job either: its guard empties the workers' cgroups, daemons
// included, and removes them. Killed while the workers run, and in shrink
// mode after a rank was lost and its slot respawned.
func TestNoEscapeAfterAgentKilledWithCgroups(t *testing.T) {
	parent := cgrouptest.V2(t)
	bin := testutil.BuildGorun(t)
	cases := []struct {
		name string
		args []string
		tail string
		n    int // daemons to wait for before the kill
	}{
		{"running", []string{"--nproc-per-node", "2"}, "exec sleep 300", 2},
		{"after a respawn in shrink mode", []string{"--nproc-per-node", "2", "--on-failure", "shrink", "--respawn-backoff", "0.01"},
			`[ -e ` + "$DIR" + `/respawned ] || { [ "$LOCAL_RANK" = 1 ] && touch $DIR/respawned && rm $DIR/daemon-1 && exit 3; }; exec sleep 300`, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tail := strings.ReplaceAll(tc.tail, "$DIR", dir)
			args := append(tc.args, "--log-dir", t.TempDir(), "--no-python", "sh", "-c", daemonWorker(dir, tail))
			p := startAgent(t, bin, args...)
			if strings.Contains(tc.name, "respawn") {
				// The respawned rank 1 writes its daemon again.
				for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
					if _, err := os.Stat(filepath.Join(dir, "respawned")); err == nil {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("rank 1 never failed; stderr:\n%s", p.stderr)
					}
				}
			}
			pids := daemons(t, dir, tc.n)
			jails, _ := filepath.Glob(filepath.Join(parent, "gorun-*-"+strconv.Itoa(p.cmd.Process.Pid)+"-*"))
			if len(jails) != 1 {
				t.Fatalf("want the agent's one jail under %s, found %v", parent, jails)
			}
			p.cmd.Process.Kill()
			p.exitCode(t, 10*time.Second)
			waitGone(t, pids, 5*time.Second)
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				if _, err := os.Stat(jails[0]); os.IsNotExist(err) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the jail %s outlived its agent by 5 s", jails[0])
				}
			}
		})
	}
}

// TestShrinkLeftoversEndWithTheirRank: in shrink mode the survivors run
// on, but what a lost rank started ends with it, not when the group does.
func TestShrinkLeftoversEndWithTheirRank(t *testing.T) {
	cgrouptest.V2(t)
	bin := testutil.BuildGorun(t)
	dir := t.TempDir()
	tail := `[ "$LOCAL_RANK" = 2 ] && exit 3; sleep 8; exit 0`
	p := startAgent(t, bin, "--nproc-per-node", "3", "--on-failure", "shrink", "--regrow", "off", "--log-dir", t.TempDir(),
		"--no-python", "sh", "-c", daemonWorker(dir, tail))
	pids := daemons(t, dir, 3)
	b, _ := os.ReadFile(filepath.Join(dir, "daemon-2"))
	lost, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	waitGone(t, []int{lost}, 3*time.Second)
	select {
	case <-p.done:
		t.Fatalf("the job ended before the check: it proves nothing; stderr:\n%s", p.stderr)
	default:
	}
	for _, pid := range pids {
		if pid != lost && !alive(pid) {
			t.Fatalf("a survivor's daemon %d died with rank 2's", pid)
		}
	}
	if code := p.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
	}
	waitGone(t, pids, 3*time.Second)
}

// TestWorkerOOMKillNamed: a worker the kernel's OOM killer ends is named
// as such in the failure table and the log, where torchrun says only
// "Signal 9". The agent runs in a v1 memory cgroup of 96 MiB (this
// machine's kind has v1 memory; a v2 memory.events is read the same way),
// with its workers' own cgroups on and off.
func TestWorkerOOMKillNamed(t *testing.T) {
	parent := cgrouptest.V1Memory(t)
	bin := testutil.BuildGorun(t)
	for _, mode := range []string{"auto", "off"} {
		t.Run(mode, func(t *testing.T) {
			dir := filepath.Join(parent, fmt.Sprintf("gorun-oom-%d-%s", os.Getpid(), mode))
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				for deadline := time.Now().Add(5 * time.Second); os.Remove(dir) != nil && time.Now().Before(deadline); {
					time.Sleep(20 * time.Millisecond)
				}
			})
			if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte("100663296"), 0); err != nil {
				t.Fatal(err)
			}
			// The agent enters the cgroup before it starts; its worker, a
			// tail of /dev/zero, keeps a line that never ends in memory.
			cmd := exec.Command("sh", "-c", `echo $$ > `+dir+`/cgroup.procs && exec "$0" "$@"`, bin,
				"--cgroup", mode, "--log-dir", t.TempDir(), "--no-python", "tail", "/dev/zero")
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			p := startAgentCmd(t, cmd)
			if code := p.exitCode(t, 60*time.Second); code != ExitWorkersFailed {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitWorkersFailed, p.stderr)
			}
			errs := p.stderr.String()
			if !strings.Contains(errs, "Signal 9 (SIGKILL) received by PID") || !strings.Contains(errs, "the kernel's OOM killer") {
				t.Fatalf("the failure does not name the OOM killer; stderr:\n%s", errs)
			}
		})
	}
}

// TestCgroupFlag: --cgroup names a place gorun can use or it fails at
// once, with one line and its code; nothing of the job starts.
func TestCgroupFlag(t *testing.T) {
	bin := testutil.BuildGorun(t)
	cases := []struct {
		value, want string
		code        int
	}{
		{"relative/path", "--cgroup", ExitUsage},
		{"/nonexistent/cgroup", "--cgroup", ExitLocalResource},
		{t.TempDir(), "not a cgroup v2 directory", ExitLocalResource},
	}
	for _, tc := range cases {
		t.Run(tc.value, func(t *testing.T) {
			marker := filepath.Join(t.TempDir(), "ran")
			cmd := exec.Command(bin, "--cgroup", tc.value, "--no-python", "touch", marker)
			var errb strings.Builder
			cmd.Stderr = &errb
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != tc.code {
				t.Fatalf("exit %v, want %d; stderr:\n%s", err, tc.code, &errb)
			}
			lines := strings.Split(strings.TrimSpace(errb.String()), "\n")
			if last := lines[len(lines)-1]; !strings.HasPrefix(last, "gorun: ") || !strings.Contains(last, tc.want) {
				t.Fatalf("last line %q, want one naming %q", last, tc.want)
			}
			if _, err := os.Stat(marker); err == nil {
				t.Fatal("the worker ran")
			}
		})
	}
}
