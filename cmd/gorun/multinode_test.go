package main

import (
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// Multi-node jobs on loopback: every agent is a real gorun process with its
// own workers; they find each other through the c10d rendezvous.

// fastRdzv are rendezvous timings that keep the tests short: a node whose
// keep-alive lapses for 2 s is lost. Not shorter: an agent starved of CPU
// (two cores, PyTorch workers importing, the race detector, CI's other
// jobs) has gone 0.6 s without writing its keep-alive, and been taken for
// lost.
const fastRdzv = "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8,join_timeout=30"

func c10dArgs(port int, nnodes string, extra ...string) []string {
	return c10dArgsAt("127.0.0.1", "127.0.0.1", port, nnodes, extra...)
}

// c10dArgsAt is c10dArgs for a node advertising localAddr, with the
// rendezvous store at host:port.
func c10dArgsAt(host, localAddr string, port int, nnodes string, extra ...string) []string {
	return append([]string{
		"--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", net.JoinHostPort(host, strconv.Itoa(port)),
		"--rdzv-id", "job", "--rdzv-conf", fastRdzv, "--local-addr", localAddr, "--monitor-interval", "0.1",
	}, extra...)
}

// TestMultiNodeTorchGloo: two agents, two PyTorch workers each; the four
// workers all_reduce through group rank 0's worker store.
func TestMultiNodeTorchGloo(t *testing.T) {
	t.Parallel()
	py := torchtest.Python(t)
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	script, _ := filepath.Abs(filepath.Join("..", "..", "examples", "torch", "allreduce.py"))
	var agents []*agentProc
	for range 2 {
		args := c10dArgs(port, "2", "--nproc-per-node", "2", "--log-dir", t.TempDir(), script)
		p := startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + py}, args...)
		agents = append(agents, p)
	}
	expectGlooAllreduce(t, agents, 2, nil)
}

// expectGlooAllreduce waits for the all_reduce line of each agent's nproc
// workers (examples/torch/allreduce.py; after each, seen(agent) may check
// more), then for every agent to exit 0, and checks that every rank of the
// world reduced the right sum.
func expectGlooAllreduce(t *testing.T, agents []*agentProc, nproc int, seen func(agent int)) {
	t.Helper()
	var lines []string
	for i, p := range agents {
		for range nproc {
			lines = append(lines, p.expectLineOr(t, "all_reduce sum=", agents))
			if seen != nil {
				seen(i)
			}
		}
	}
	for _, p := range agents {
		if code := p.exitCode(t, 90*time.Second); code != 0 {
			t.Fatalf("agent exit %d; stderr:\n%s", code, p.stderr)
		}
	}
	world := len(agents) * nproc
	all := strings.Join(lines, "\n")
	for r := range world {
		want := fmt.Sprintf("rank %d/%d: all_reduce sum=%d (want %d) ok", r, world, world*(world+1)/2, world*(world+1)/2)
		if !strings.Contains(all, want) {
			t.Fatalf("no line %q in\n%s", want, all)
		}
	}
}

// worldWorker prints where it stands, then waits to be stopped — or, from
// round doneRound on, exits 0.
func worldWorker(doneRound int) string {
	return fmt.Sprintf(`echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT pid=$$"
		[ "$GORUN_GENERATION" -ge %d ] && exit 0
		trap 'exit 0' TERM; while :; do sleep 0.05; done`, doneRound)
}

var roundLine = regexp.MustCompile(`round=(\d+) rank=(\d+) world=(\d+) group=(\d+)/(\d+) restarts=(\d+)`)

// expectRound waits for the agent's worker to report round r and returns
// its world size and restart count.
func (p *agentProc) expectRound(t *testing.T, r int) (world, restarts int) {
	t.Helper()
	for {
		l := p.expectLine(t, "round=")
		m := roundLine.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("bad line %q", l)
		}
		if got, _ := strconv.Atoi(m[1]); got == r {
			world, _ = strconv.Atoi(m[3])
			restarts, _ = strconv.Atoi(m[6])
			return world, restarts
		}
	}
}

// TestMultiNodeLoseAndGrow: three agents (--nnodes 2:3) run; one is
// SIGKILLed and the other two notice the lapsed keep-alive, count a
// restart and re-rendezvous on two nodes; a fourth agent arrives and the
// job scales up to three again without counting a restart.
func TestMultiNodeLoseAndGrow(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := worldWorker(2)
	start := func() *agentProc {
		args := c10dArgs(port, "2:3", "--max-restarts", "3", "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)
		// A last call of 3 s, not 1: round 0 must hold all three, and on
		// a loaded machine the third agent has joined more than 1 s after
		// the second (round 0 then completed with two).
		args[slices.Index(args, fastRdzv)] = strings.Replace(fastRdzv, "last_call_timeout=1", "last_call_timeout=3", 1)
		return startAgent(t, bin, args...)
	}
	host := start()
	waitStderr(t, host, "hosting the rendezvous store")
	b, c := start(), start()
	for _, p := range []*agentProc{host, b, c} {
		if world, restarts := p.expectRound(t, 0); world != 3 || restarts != 0 {
			t.Fatalf("round 0: world %d restarts %d; stderr:\n%s", world, restarts, p.stderr)
		}
	}
	// Lose c: its worker dies with it (Pdeathsig) and its keep-alive lapses.
	lostAt := time.Now()
	c.cmd.Process.Signal(syscall.SIGKILL)
	c.exitCode(t, 5*time.Second)
	for _, p := range []*agentProc{host, b} {
		if world, restarts := p.expectRound(t, 1); world != 2 || restarts != 1 {
			t.Fatalf("round 1: world %d restarts %d; stderr:\n%s", world, restarts, p.stderr)
		}
	}
	t.Logf("lost node to survivors re-rendezvoused: %v", time.Since(lostAt))
	// Grow: a new agent waits; the running ones admit it.
	d := start()
	for _, p := range []*agentProc{host, b, d} {
		if world, restarts := p.expectRound(t, 2); world != 3 || restarts != 1 {
			t.Fatalf("round 2: world %d restarts %d (scale-up is not a restart); stderr:\n%s", world, restarts, p.stderr)
		}
	}
	for _, p := range []*agentProc{host, b, d} {
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestMultiNodeRestartCountedForTheJob: a worker on one node fails once;
// both nodes restart, and both see TORCHELASTIC_RESTART_COUNT=1; no worker
// of round 0 sees a restart counted in round 0 itself.
func TestMultiNodeRestartCountedForTheJob(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := `echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT pid=$$"
		[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ] && exit 3
		[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && { trap 'exit 0' TERM; while :; do sleep 0.05; done; }
		exit 0`
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, c10dArgs(port, "2", "--max-restarts", "1", "--log-dir", t.TempDir(),
			"--no-python", "sh", "-c", worker)...))
	}
	// Rank 1 fails as soon as it starts: the other node may not have
	// started its round-0 worker by then (it must still see the count of
	// round 0: 0), or not even seen round 0 complete, and go straight to
	// round 1. Every worker must see its round's count: 0 in round 0, 1
	// after it.
	round0 := 0
	for _, p := range agents {
		for {
			l := p.expectLine(t, "round=")
			m := roundLine.FindStringSubmatch(l)
			if m == nil {
				t.Fatalf("bad line %q", l)
			}
			want := "1"
			if m[1] == "0" {
				want = "0"
				round0++
			}
			if m[6] != want {
				t.Fatalf("worker line %q: TORCHELASTIC_RESTART_COUNT=%s in round %s, want %s; stderr:\n%s", l, m[6], m[1], want, p.stderr)
			}
			if m[6] == "1" {
				break
			}
		}
	}
	if round0 == 0 {
		t.Fatal("no worker ran in round 0")
	}
	for _, p := range agents {
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestMultiNodeRestartsExhausted: with no restart left, the failing node
// prints the failure table and closes the job; the other node ends too,
// both with exit code 1.
func TestMultiNodeRestartsExhausted(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := `echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT pid=$$"
		[ "$RANK" = 1 ] && exit 4
		trap 'exit 0' TERM; while :; do sleep 0.05; done`
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, c10dArgs(port, "2", "--log-dir", t.TempDir(),
			"--no-python", "sh", "-c", worker)...))
	}
	summaries := 0
	for _, p := range agents {
		if code := p.exitCode(t, 30*time.Second); code != 1 {
			t.Fatalf("exit %d, want 1; stderr:\n%s", code, p.stderr)
		}
		if strings.Contains(p.stderr.String(), "Root Cause (first observed failure):") {
			summaries++
		}
	}
	if summaries != 1 {
		t.Fatalf("%d failure tables, want 1 (from the failing node)", summaries)
	}
}

// TestMultiNodeStatic: torchrun's static backend over several nodes:
// --node-rank decides the group rank.
func TestMultiNodeStatic(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := worldWorker(0)
	var agents []*agentProc
	for _, rank := range []string{"1", "0"} { // rank 1 first: it must wait for rank 0's store
		agents = append(agents, startAgent(t, bin, "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1",
			"--master-port", strconv.Itoa(port), "--local-addr", "127.0.0.1", "--nproc-per-node", "2",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker))
	}
	for i, p := range agents {
		wantGroup := []string{"1", "0"}[i]
		for range 2 {
			m := roundLine.FindStringSubmatch(p.expectLine(t, "round="))
			if m == nil || m[4] != wantGroup || m[3] != "4" {
				t.Fatalf("node-rank %s worker: %v", wantGroup, m)
			}
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestMultiNodeRendezvousTimeout: one node of two never comes: after
// join_timeout the agent gives up with exit code 6.
func TestMultiNodeRendezvousTimeout(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	p := startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:"+strconv.Itoa(freePort(t)),
		"--rdzv-conf", "join_timeout=1", "--local-addr", "127.0.0.1", "--log-dir", t.TempDir(), "--no-python", "true")
	if code := p.exitCode(t, 20*time.Second); code != ExitRendezvousTimeout {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitRendezvousTimeout, p.stderr)
	}
}

// waitStderr waits until the agent's log contains s.
func waitStderr(t *testing.T, p *agentProc, s string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(p.stderr.String(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("agent never logged %q; stderr:\n%s", s, p.stderr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestMultiNodeStoreHostLost: the agent hosting the rendezvous store is
// SIGKILLed; the other cannot re-rendezvous without the store, so it stops
// its workers and fails within the keep-alive window instead of hanging.
func TestMultiNodeStoreHostLost(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := worldWorker(99)
	host := startAgent(t, bin, c10dArgs(port, "2", "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...)
	waitStderr(t, host, "hosting the rendezvous store")
	other := startAgent(t, bin, c10dArgs(port, "2", "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...)
	host.expectRound(t, 0)
	other.expectRound(t, 0)
	host.cmd.Process.Signal(syscall.SIGKILL)
	start := time.Now()
	if code := other.exitCode(t, 20*time.Second); code != ExitWorkersFailed {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitWorkersFailed, other.stderr)
	}
	if !strings.Contains(other.stderr.String(), "rendezvous store stopped answering") {
		t.Fatalf("stderr does not say why:\n%s", other.stderr)
	}
	t.Logf("store host lost to the other agent's exit: %v", time.Since(start))
}

// TestMultiNodeFileStore: --rdzv-conf store_type=file, torchrun's FileStore
// rendezvous: the agents meet in a shared file instead of a TCPStore.
func TestMultiNodeFileStore(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	file := filepath.Join(t.TempDir(), "rdzv")
	worker := worldWorker(0)
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", file,
			"--rdzv-conf", "store_type=file,"+fastRdzv, "--local-addr", "127.0.0.1", "--nproc-per-node", "2",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker))
	}
	for _, p := range agents {
		for range 2 {
			if m := roundLine.FindStringSubmatch(p.expectLine(t, "round=")); m == nil || m[3] != "4" {
				t.Fatalf("worker line %v; stderr:\n%s", m, p.stderr)
			}
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestMultiNodeUnreachableEndpoint: nobody serves the endpoint and this
// agent may not host it: one clear line and the rendezvous-timeout code
// after join_timeout, nothing left running.
func TestMultiNodeUnreachableEndpoint(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	p := startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:"+strconv.Itoa(freePort(t)),
		"--rdzv-conf", "is_host=false,join_timeout=1", "--local-addr", "127.0.0.1", "--log-dir", t.TempDir(), "--no-python", "true")
	if code := p.exitCode(t, 20*time.Second); code != ExitRendezvousTimeout {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitRendezvousTimeout, p.stderr)
	}
	if !strings.Contains(p.stderr.String(), "no rendezvous store answered at 127.0.0.1:") {
		t.Fatalf("stderr:\n%s", p.stderr)
	}
}

// TestMultiNodeUnevenNodes: nodes may run different numbers of workers;
// global ranks are laid out node after node in group-rank order.
func TestMultiNodeUnevenNodes(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	worker := worldWorker(0)
	var agents []*agentProc
	for _, nproc := range []string{"1", "3"} {
		agents = append(agents, startAgent(t, bin, c10dArgs(port, "2", "--nproc-per-node", nproc, "--log-dir", t.TempDir(),
			"--no-python", "sh", "-c", worker)...))
	}
	ranks := map[string][]string{} // group rank → global ranks
	for i, p := range agents {
		for range []int{1, 3}[i] {
			m := roundLine.FindStringSubmatch(p.expectLine(t, "round="))
			if m == nil || m[3] != "4" {
				t.Fatalf("worker line %v", m)
			}
			ranks[m[4]] = append(ranks[m[4]], m[2])
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
	all := map[string]bool{}
	for g, rs := range ranks {
		for _, r := range rs {
			all[r] = true
		}
		// Group rank 0's workers hold the lowest global ranks.
		if g == "0" {
			for _, r := range rs {
				if n, _ := strconv.Atoi(r); n >= len(rs) {
					t.Fatalf("group 0 has rank %s among %v", r, ranks)
				}
			}
		}
	}
	if len(all) != 4 {
		t.Fatalf("global ranks %v, want 0..3 once each", ranks)
	}
}

// TestMultiNodeIPv6Endpoint: --rdzv-endpoint ::1:PORT, an IPv6 address
// without brackets, is read as torchrun reads it (the last group is the
// port), and a two-node job meets there.
func TestMultiNodeIPv6Endpoint(t *testing.T) {
	t.Parallel()
	if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	} else {
		ln.Close()
	}
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	var agents []*agentProc
	for i := range 2 {
		agents = append(agents, startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "::1:"+strconv.Itoa(port),
			"--rdzv-id", "v6", "--rdzv-conf", fastRdzv, "--local-addr", "::1", "--log-dir", t.TempDir(),
			"--no-python", "sh", "-c", `echo "node `+strconv.Itoa(i)+` rank $RANK of $WORLD_SIZE"`))
	}
	for _, p := range agents {
		p.expectLine(t, "of 2")
		if code := p.exitCode(t, 20*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestMultiNodeQueueMode: 32 agents (queue mode) of uneven worker counts
// start every worker with torchrun's environment, each agent planning its
// round from its summary (no member list read): every global rank once,
// each agent's ranks in one run after those of the agents ranked before
// it, one world size, one MASTER, and the job ends well.
func TestMultiNodeQueueMode(t *testing.T) {
	bin := testutil.BuildGorun(t)
	port := freePort(t)
	const n = 32
	worker := `echo "rank=$RANK local=$LOCAL_RANK/$LOCAL_WORLD_SIZE world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE ` +
		`role=$ROLE_RANK/$ROLE_WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT"`
	agents := make([]*agentProc, n)
	world := 0
	for i := range agents {
		nproc := 1 + i%2
		world += nproc
		// torchrun's keep-alive (not fastRdzv's): 32 agents starting on
		// two cores starve some of them for longer than 2 s.
		agents[i] = startAgent(t, bin, "--nnodes", strconv.Itoa(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:"+strconv.Itoa(port),
			"--rdzv-id", "job", "--rdzv-conf", "last_call_timeout=1,join_timeout=60", "--local-addr", "127.0.0.1",
			"--nproc-per-node", strconv.Itoa(nproc), "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)
	}
	line := regexp.MustCompile(`rank=(\d+) local=(\d+)/(\d+) world=(\d+) group=(\d+)/(\d+) role=(\d+)/(\d+) master=(\S+)`)
	seen := make([]bool, world)
	groups := make([]int, n) // each agent's group rank
	first := make([]int, n)  // and its first global rank
	var master string
	for i, p := range agents {
		nproc := 1 + i%2
		first[i] = world
		for range nproc {
			l := p.expectLine(t, "rank=")
			m := line.FindStringSubmatch(l)
			if m == nil {
				t.Fatalf("agent %d: line %q", i, l)
			}
			num := func(k int) int { v, _ := strconv.Atoi(m[k]); return v }
			rank, local, group := num(1), num(2), num(5)
			if num(3) != nproc || num(4) != world || num(6) != n || num(7) != rank || num(8) != world || rank >= world || seen[rank] {
				t.Fatalf("agent %d (%d workers): %q (world %d of %d nodes)", i, nproc, l, world, n)
			}
			seen[rank] = true
			groups[i], first[i] = group, min(first[i], rank-local)
			if master == "" {
				master = m[9]
			} else if m[9] != master {
				t.Fatalf("agent %d: MASTER %s, another's %s", i, m[9], master)
			}
		}
	}
	for i, p := range agents {
		if code := p.exitCode(t, 90*time.Second); code != 0 {
			t.Fatalf("agent %d exit %d; stderr:\n%s", i, code, p.stderr)
		}
		if !strings.Contains(p.stderr.String(), "planning the round from this node's summary") {
			t.Errorf("agent %d read the member list; stderr:\n%s", i, p.stderr)
		}
	}
	// Global ranks run node after node in group-rank order.
	byGroup := make([]int, n)
	for i, g := range groups {
		byGroup[g] = i
	}
	next := 0
	for g, i := range byGroup {
		if first[i] != next {
			t.Fatalf("group rank %d (agent %d) starts at rank %d, want %d", g, i, first[i], next)
		}
		next += 1 + i%2
	}
}
