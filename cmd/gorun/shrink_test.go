package main

import (
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

// Shrink mode across nodes on loopback: two real agents with four Go
// allreduce workers each (examples/allreduce, pg/cpu), --on-failure
// shrink. Global rank r contributes r+1, so every survivor can check its
// sum against the ranks that remain.

// buildAllreduce builds examples/allreduce, once for the package's tests.
func buildAllreduce(t *testing.T) string {
	t.Helper()
	return testutil.Build(t, "../../examples/allreduce", "allreduce", nil)
}

// shrinkJob is a two-node shrink-mode job of Go allreduce workers.
type shrinkJob struct {
	agents  []*agentProc
	command func(node int) *exec.Cmd // how node's agent is started
	mu      sync.Mutex
	lines   []string // every agent's stdout, as it came
	readers sync.WaitGroup
	done    chan struct{} // closed when every agent's stdout has ended
}

// placement says where a job's nodes run (loopback, or the hosts of a
// network-namespace test bed) and how they meet.
type placement struct {
	// rdzv returns node's rendezvous flags for a job of nnodes nodes.
	rdzv    func(node int, nnodes string) []string
	command func(node int, bin string, args []string) *exec.Cmd // how node's agent is started
	// hostLine, if set, is what node 0 logs once it serves the rendezvous
	// store: the others start after it.
	hostLine string
}

// c10dAt is a c10d rendezvous hosted by node 0 at endpoint, each node
// advertising addr(node).
func c10dAt(t *testing.T, endpoint string, addr func(int) string) placement {
	port := freePort(t)
	return placement{
		rdzv: func(node int, nnodes string) []string {
			return c10dArgsAt(endpoint, addr(node), port, nnodes)
		},
		hostLine: "hosting the rendezvous store",
	}
}

// loopback puts every node on 127.0.0.1, meeting through c10d.
func loopback(t *testing.T) placement {
	at := c10dAt(t, "127.0.0.1", func(int) string { return "127.0.0.1" })
	at.command = func(_ int, bin string, args []string) *exec.Cmd {
		cmd := exec.Command(bin, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		return cmd
	}
	return at
}

func startShrinkJob(t *testing.T, nodes, nproc, steps int, extra ...string) *shrinkJob {
	t.Helper()
	return startShrinkJobAt(t, loopback(t), nodes, nproc, steps, extra...)
}

func startShrinkJobAt(t *testing.T, at placement, nodes, nproc, steps int, extra ...string) *shrinkJob {
	t.Helper()
	gorun, worker := testutil.BuildGorun(t), buildAllreduce(t)
	j := &shrinkJob{done: make(chan struct{})}
	j.command = func(i int) *exec.Cmd {
		// Heal is off unless extra turns it on (a later flag wins): these
		// jobs check how survivors shrink.
		args := append(at.rdzv(i, strconv.Itoa(nodes)), "--nproc-per-node", strconv.Itoa(nproc),
			"--on-failure", "shrink", "--regrow", "off", "--log-dir", t.TempDir())
		args = append(append(args, extra...), "--no-python", worker, "--steps", strconv.Itoa(steps), "--step-ms", "5")
		return at.command(i, gorun, args)
	}
	for i := range nodes {
		p := j.start(t, i)
		if i == 0 && at.hostLine != "" {
			waitStderr(t, p, at.hostLine)
		}
	}
	go func() { j.readers.Wait(); close(j.done) }()
	deadline := time.Now().Add(60 * time.Second)
	for j.count("]:start rank=") < nodes*nproc {
		if time.Now().After(deadline) {
			t.Fatalf("the ranks did not start:\n%s", j.report())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return j
}

// start starts an agent for node i (again, for a replacement) and copies
// its stdout into the job's lines.
func (j *shrinkJob) start(t *testing.T, i int) *agentProc {
	t.Helper()
	p := startAgentCmd(t, j.command(i))
	j.agents = append(j.agents, p)
	j.readers.Add(1)
	go func() {
		defer j.readers.Done()
		for l := range p.lines {
			j.mu.Lock()
			j.lines = append(j.lines, l)
			j.mu.Unlock()
		}
	}()
	return p
}

func (j *shrinkJob) count(s string) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for _, l := range j.lines {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

func (j *shrinkJob) output() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return strings.Join(j.lines, "\n")
}

func (j *shrinkJob) report() string {
	var b strings.Builder
	b.WriteString(j.output())
	for i, p := range j.agents {
		fmt.Fprintf(&b, "\n--- agent %d stderr:\n%s", i, p.stderr)
	}
	return b.String()
}

// kill SIGKILLs the worker of each global rank; nproc workers run per node.
func (j *shrinkJob) kill(t *testing.T, nproc int, ranks ...int) {
	t.Helper()
	for _, r := range ranks {
		agent := j.agents[r/nproc].cmd.Process.Pid
		pid, err := testutil.ChildWithEnv(agent, "RANK", strconv.Itoa(r))
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
}

var doneRE = regexp.MustCompile(`done rank=(\d+) world=(\d+) steps=(\d+) sum=(\S+)`)

// expectSurvivors waits for the live agents to exit 0 and checks the
// survivors' lines: one shrink line each, and a done line with the dense
// new ranks, the new world and the sum over the surviving original ranks.
func (j *shrinkJob) expectSurvivors(t *testing.T, live []*agentProc, world int, excluded []int, steps int) {
	t.Helper()
	j.expectExit0(t, live)
	survivors := world - len(excluded)
	sum := 0
	for r := range world {
		if !slices.Contains(excluded, r) {
			sum += r + 1
		}
	}
	shrinkLine := fmt.Sprintf("]:shrink epoch=1 world=%d excluded=%v", survivors, fmt.Sprint(excluded))
	if n := j.count(shrinkLine); n != survivors {
		t.Errorf("%d survivors printed %q, want %d\n%s", n, shrinkLine, survivors, j.report())
	}
	var ranks []int
	for _, m := range doneRE.FindAllStringSubmatch(j.output(), -1) {
		r, _ := strconv.Atoi(m[1])
		ranks = append(ranks, r)
		if m[2] != strconv.Itoa(survivors) || m[3] != strconv.Itoa(steps) || m[4] != strconv.Itoa(sum) {
			t.Errorf("%s: want world=%d steps=%d sum=%d", m[0], survivors, steps, sum)
		}
	}
	slices.Sort(ranks)
	want := make([]int, survivors)
	for i := range want {
		want[i] = i
	}
	if !slices.Equal(ranks, want) {
		t.Errorf("done lines from ranks %v, want %v\n%s", ranks, want, j.report())
	}
}

// expectExit0 waits for the live agents to exit 0 and their output to
// end.
func (j *shrinkJob) expectExit0(t *testing.T, live []*agentProc) {
	t.Helper()
	for i, p := range live {
		if code := p.exitCode(t, 90*time.Second); code != 0 {
			t.Fatalf("agent %d exited %d\n%s", i, code, j.report())
		}
	}
	select {
	case <-j.done:
	case <-time.After(10 * time.Second):
		t.Fatal("agents' output did not end")
	}
}

// TestMultiNodeShrink: ranks SIGKILLed on two nodes. Killed together
// (within a few ms, on different nodes) they make one epoch: both agents
// report, the leader gathers both within its settle window. The window is
// 1 s there, not the default 0.1 s: under CI's load the two agents noticed
// their workers' deaths 100 ms apart, and the leader decided between.
func TestMultiNodeShrink(t *testing.T) {
	t.Parallel()
	const nodes, nproc, steps = 2, 4, 500
	for _, tt := range []struct {
		name   string
		killed []int
		extra  []string
	}{
		{"one rank on the second node", []int{5}, nil},
		{"two ranks on different nodes at once", []int{1, 6}, []string{"--settle-window", "1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			j := startShrinkJob(t, nodes, nproc, steps, tt.extra...)
			time.Sleep(300 * time.Millisecond) // some steps in
			j.kill(t, nproc, tt.killed...)
			j.expectSurvivors(t, j.agents, nodes*nproc, tt.killed, steps)
		})
	}
}

// TestMultiNodeShrinkLostNode: the second node's agent is SIGKILLed (its
// workers die with it). The first agent finds the node lost when its
// rendezvous keep-alive lapses, reports the node's four ranks, and the
// first node's workers finish as a group of four.
func TestMultiNodeShrinkLostNode(t *testing.T) {
	t.Parallel()
	const nodes, nproc, steps = 2, 4, 600
	j := startShrinkJob(t, nodes, nproc, steps)
	time.Sleep(300 * time.Millisecond)
	j.agents[1].cmd.Process.Signal(syscall.SIGKILL)
	j.agents[1].exitCode(t, 10*time.Second)
	j.expectSurvivors(t, j.agents[:1], nodes*nproc, []int{4, 5, 6, 7}, steps)
	if !strings.Contains(j.agents[0].stderr.String(), "nodes lost; reporting their ranks") {
		t.Errorf("the agent did not say the node was lost:\n%s", j.agents[0].stderr)
	}
}
