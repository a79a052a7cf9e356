package main

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestJobSecretReachesWorkersOnly: the workers get the job secret in
// their environment (GORUN_JOB_SECRET) — the one given, or, under
// --standalone without one, one the agent made — and it is on no command
// line and in no log line of the agent.
func TestJobSecretReachesWorkersOnly(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	const given = "s3cr3t-given-0123456789"
	script := `echo "pid=$$"; echo "secret=$GORUN_JOB_SECRET"; sleep 1`
	for _, tc := range []struct {
		name string
		env  []string
		want *regexp.Regexp
	}{
		{"given", []string{"GORUN_JOB_SECRET=" + given}, regexp.MustCompile(`^` + given + `$`)},
		{"made by --standalone", nil, regexp.MustCompile(`^[0-9a-f]{64}$`)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := startAgentEnv(t, bin, tc.env, "--standalone", "--nproc-per-node", "2", "--log-dir", dir,
				"--tee", "3", "--no-python", "sh", "-c", script)
			var pids []int
			var secrets []string
			for len(pids) < 2 || len(secrets) < 2 {
				l := p.expectLine(t, "=")
				if _, v, ok := strings.Cut(l, "pid="); ok {
					pid, err := strconv.Atoi(v)
					if err != nil {
						t.Fatalf("line %q", l)
					}
					pids = append(pids, pid)
				} else if _, v, ok := strings.Cut(l, "secret="); ok {
					secrets = append(secrets, v)
				}
			}
			// While they run: no process of the job carries it in argv.
			for _, pid := range append(pids, p.cmd.Process.Pid) {
				argv, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
				if err == nil && strings.Contains(string(argv), secrets[0]) {
					t.Errorf("pid %d's command line holds the secret: %q", pid, argv)
				}
			}
			if code := p.exitCode(t, 30*time.Second); code != 0 {
				t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
			}
			if secrets[0] != secrets[1] || !tc.want.MatchString(secrets[0]) {
				t.Errorf("workers saw %q, want twice a match of %v", secrets, tc.want)
			}
			if strings.Contains(p.stderr.String(), secrets[0]) {
				t.Errorf("the agent's log holds the secret:\n%s", p.stderr)
			}
		})
	}
}

// TestMultiNodeJobSecretGossip: node liveness with a job secret. Two
// agents that hold the same secret gossip (encrypted): the second agent
// SIGKILLed, the first finds it dead by node liveness and its workers
// shrink. Agents without a secret say once that nothing is authenticated;
// with one they do not.
func TestMultiNodeJobSecretGossip(t *testing.T) {
	t.Setenv("GORUN_JOB_SECRET", "s3cr3t-for-the-gossip-0123")
	const nodes, nproc, steps = 2, 2, 600
	j := startShrinkJob(t, nodes, nproc, steps)
	time.Sleep(300 * time.Millisecond)
	j.agents[1].cmd.Process.Signal(syscall.SIGKILL)
	j.agents[1].exitCode(t, 10*time.Second)
	j.expectSurvivors(t, j.agents[:1], nodes*nproc, []int{2, 3}, steps)
	log := j.agents[0].stderr.String()
	if !strings.Contains(log, "node liveness: unreachable") {
		t.Errorf("the lost node was not found by node liveness:\n%s", log)
	}
	if strings.Contains(log, "no job secret") || strings.Contains(log, "s3cr3t") {
		t.Errorf("the log warns of no secret, or shows it:\n%s", log)
	}
}

// TestMultiNodeJobSecretMismatch: two agents of one job that do not hold
// the same secret never form a round, and no worker starts. The
// rendezvous records are sealed under the secret, so neither can act on
// the other's (which is also all a forger could do, so neither may stop
// the job because of them):
//   - another secret: each ignores the other's records (logged with the
//     other's secret check) and its join times out, the error asking
//     whether every agent holds the same secret;
//   - none beside one: the agent without a secret finds sealed records and
//     stops at once with the usage exit code and one clear line; the other
//     ignores its unsealed records, and times out (or loses the store,
//     when the stopped agent hosted it).
//
// With another secret, the first agent to time out says so (the other may
// lose the store with it).
// No secret shows in any output.
func TestMultiNodeJobSecretMismatch(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	const timeoutLine = "does every agent of the job hold the same secret?"
	for _, tc := range []struct {
		name string
		envs [2][]string
		// codes are each agent's allowed exit codes; lines what its last
		// line says.
		codes [2][]int
		lines [2]string
		// logs: what each agent's log says it ignored ("" nothing).
		logs [2]string
	}{
		{"another secret", [2][]string{{"GORUN_JOB_SECRET=s3cr3t-one-0123456789"}, {"GORUN_JOB_SECRET=s3cr3t-two-0123456789"}},
			// Whichever times out first takes the store along if it hosts it.
			[2][]int{{ExitRendezvousTimeout, ExitUnavailable}, {ExitRendezvousTimeout, ExitUnavailable}}, [2]string{},
			[2]string{"sealed under another job secret", "sealed under another job secret"}},
		{"no secret", [2][]string{{"GORUN_JOB_SECRET=s3cr3t-one-0123456789"}, nil},
			[2][]int{{ExitRendezvousTimeout, ExitUnavailable}, {ExitUsage}},
			[2]string{"", "the rendezvous records are sealed under a job secret and this node holds none: every agent of a job needs the same secret"},
			[2]string{"", ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			marker := filepath.Join(t.TempDir(), "ran")
			args := []string{"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + strconv.Itoa(port),
				"--rdzv-id", "job", "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8,join_timeout=6",
				"--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
				"--on-failure", "shrink", "--log-dir", t.TempDir(), "--no-python", "touch", marker}
			var agents []*agentProc
			for i := range 2 {
				agents = append(agents, startAgentEnv(t, bin, tc.envs[i], args...))
			}
			timedOut := false
			for i, p := range agents {
				code := p.exitCode(t, 30*time.Second)
				if !slices.Contains(tc.codes[i], code) {
					t.Errorf("agent %d: exit %d, want one of %v; stderr:\n%s", i, code, tc.codes[i], p.stderr)
				}
				lines := strings.Split(strings.TrimSpace(p.stderr.String()), "\n")
				if code == ExitRendezvousTimeout && strings.Contains(lines[len(lines)-1], timeoutLine) {
					timedOut = true
				}
				if last := lines[len(lines)-1]; tc.lines[i] != "" && (!strings.HasPrefix(last, "gorun: ") || !strings.Contains(last, tc.lines[i])) {
					t.Errorf("agent %d's last line %q, want one saying %q", i, last, tc.lines[i])
				}
				if tc.logs[i] != "" && !strings.Contains(p.stderr.String(), tc.logs[i]) {
					t.Errorf("agent %d's log does not say %q:\n%s", i, tc.logs[i], p.stderr)
				}
				if strings.Contains(p.stderr.String(), "s3cr3t") {
					t.Errorf("agent %d logged a secret:\n%s", i, p.stderr)
				}
			}
			if tc.name == "another secret" && !timedOut {
				t.Errorf("no agent timed out saying %q", timeoutLine)
			}
			if _, err := os.Stat(marker); err == nil {
				t.Error("a worker started")
			}
		})
	}
}

// TestWorkerStoreBoundWhereUsed: the worker store listens only where its
// users reach it: on loopback under --standalone, on the endpoint's
// address for one node, on --local-addr's address on several nodes.
// Another address of this machine is refused.
func TestWorkerStoreBoundWhereUsed(t *testing.T) {
	t.Parallel()
	other := nonLoopbackIP(t)
	bin := testutil.BuildGorun(t)
	worker := []string{"--no-python", "sh", "-c", `echo "store=$MASTER_ADDR:$MASTER_PORT"; sleep 2`}
	port := freePort(t)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"standalone", []string{"--standalone"}},
		{"one node at 127.0.0.1", c10dArgs(port, "1")},
		{"c10d, --local-addr 127.0.0.1", c10dArgs(port, "1:2")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startAgent(t, bin, append(append(tc.args, "--log-dir", t.TempDir()), worker...)...)
			l := p.expectLine(t, "store=")
			_, addr, _ := strings.Cut(l, "store=")
			host, portStr, err := net.SplitHostPort(addr)
			if err != nil || host != "127.0.0.1" {
				t.Fatalf("worker store %q, want 127.0.0.1:PORT", addr)
			}
			if c, err := net.DialTimeout("tcp", addr, 2*time.Second); err != nil {
				t.Errorf("dial %s: %v", addr, err)
			} else {
				c.Close()
			}
			if c, err := net.DialTimeout("tcp", net.JoinHostPort(other, portStr), 2*time.Second); err == nil {
				c.Close()
				t.Errorf("the worker store answers on %s too", other)
			}
			if code := p.exitCode(t, 30*time.Second); code != 0 {
				t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
			}
		})
	}
}

// nonLoopbackIP is an IPv4 address of this machine other than loopback;
// the test is skipped on a machine without one.
func nonLoopbackIP(t *testing.T) string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			return n.IP.String()
		}
	}
	t.Skip("no address but loopback")
	return ""
}

// TestForgedEpochIgnored is the attack, on a job with a secret: a
// four-rank shrink-mode job under --standalone (which makes its secret),
// and from outside the job one `gorun store set` of an epoch that
// excludes the healthy rank 2. The agent and the workers ignore it (the
// agent says so): no rank is killed, and the job ends at world 4.
func TestForgedEpochIgnored(t *testing.T) {
	t.Parallel()
	bin, worker := testutil.BuildGorun(t), buildAllreduce(t)
	const steps = 600 // 3 s at 5 ms
	p := startAgent(t, bin, "--standalone", "--nproc-per-node", "4", "--on-failure", "shrink", "--log-dir", t.TempDir(),
		"--no-python", worker, "--steps", strconv.Itoa(steps), "--step-ms", "5")
	for range 4 {
		p.expectLine(t, "start rank=")
	}
	pid, err := testutil.ChildWithEnv(p.cmd.Process.Pid, "RANK", "2")
	if err != nil {
		t.Fatal(err)
	}
	environ, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	var store string
	for _, kv := range strings.Split(string(environ), "\x00") {
		if v, ok := strings.CutPrefix(kv, "GORUN_STORE="); ok {
			store = v
		}
	}
	forged := `{"epoch":1,"excluded":[2],"lost":[2],"ranks":[0,1,-1,2],"world_size":3,"action":"shrink","base":0,"coordinator":"rogue"}`
	if out, err := exec.Command(bin, "store", "set", "--store", store, "gorun/shrink/epoch/1", forged).CombinedOutput(); err != nil {
		t.Fatalf("gorun store set: %v\n%s", err, out)
	}
	if code := p.exitCode(t, 60*time.Second); code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
	}
	var dones []string
	for l := range p.lines {
		if m := doneRE.FindStringSubmatch(l); m != nil {
			dones = append(dones, l)
			if m[2] != "4" || m[3] != strconv.Itoa(steps) {
				t.Errorf("%s: want world=4 steps=%d", l, steps)
			}
		}
	}
	if len(dones) != 4 {
		t.Errorf("%d done lines, want 4; stderr:\n%s", len(dones), p.stderr)
	}
	log := p.stderr.String()
	if !strings.Contains(log, "ignored a record that fails the job secret's check") || strings.Contains(log, "stopping a worker the epoch excludes") {
		t.Errorf("the agent did not ignore the forged epoch:\n%s", log)
	}
}
