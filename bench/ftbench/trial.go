package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// result is one trial of one row: a JSON line of -out.
type result struct {
	Row        string `json:"row"`
	Trial      int    `json:"trial"`
	Hosts      int    `json:"hosts"`
	World      int    `json:"world"`
	Victim     int    `json:"victim"`
	KillUnixNs int64  `json:"kill_unix_ns,omitempty"`
	// LastMs: kill → the last survivor's first successful collective (the
	// group has recovered when every survivor has); FirstMs: → the first
	// survivor's. SurvivorsMs: every survivor's, sorted.
	LastMs      float64   `json:"last_ms,omitempty"`
	FirstMs     float64   `json:"first_ms,omitempty"`
	SurvivorsMs []float64 `json:"survivors_ms,omitempty"`
	// LeftBehind counts the processes still there (alive, or unreaped)
	// after the launcher stopped, which the benchmark killed and reaped.
	LeftBehind int    `json:"left_behind,omitempty"`
	Error      string `json:"error,omitempty"`
}

// stamp is one first-collective line: a rank's first successful collective
// of an attempt and epoch, at unix nanoseconds ns.
type stamp struct {
	agent   int    // which agent's output
	prefix  string // the launcher's line prefix, e.g. "[default3]:", which tells ranks apart
	attempt int
	epoch   int
	ns      int64
}

var stampRE = regexp.MustCompile(`^(.*?)first-collective attempt=(\d+) epoch=(\d+) unix_ns=(\d+)\s*$`)

// parseStamp reads a first-collective line as a launcher prints it.
func parseStamp(agent int, line string) (stamp, bool) {
	m := stampRE.FindStringSubmatch(line)
	if m == nil {
		return stamp{}, false
	}
	s := stamp{agent: agent, prefix: m[1]}
	var err1, err2, err3 error
	s.attempt, err1 = strconv.Atoi(m[2])
	s.epoch, err2 = strconv.Atoi(m[3])
	s.ns, err3 = strconv.ParseInt(m[4], 10, 64)
	return s, err1 == nil && err2 == nil && err3 == nil
}

// tally collects stamps of one (attempt, epoch), one per rank.
type tally struct {
	attempt, epoch int
	ns             map[string]int64 // by agent and prefix
}

func newTally(attempt, epoch int) *tally {
	return &tally{attempt: attempt, epoch: epoch, ns: map[string]int64{}}
}

// add counts s if it is of the tally's attempt and epoch; a rank's repeated
// line keeps its first time.
func (t *tally) add(s stamp) {
	if s.attempt != t.attempt || s.epoch != t.epoch {
		return
	}
	k := strconv.Itoa(s.agent) + s.prefix
	if _, ok := t.ns[k]; !ok {
		t.ns[k] = s.ns
	}
}

// since returns every rank's stamp in ms after t0, sorted.
func (t *tally) since(t0 int64) []float64 {
	var v []float64
	for _, ns := range t.ns {
		v = append(v, float64(ns-t0)/1e6)
	}
	slices.Sort(v)
	return v
}

// runTrial runs one row once: it starts the job, waits until every rank
// has run a collective, lets it run -warmup more, SIGKILLs the victim rank
// and waits until the ranks of the recovery attempt and epoch have each
// run their first collective. Everything it started is killed and reaped
// before it returns.
func runTrial(ctx context.Context, c *config, r row, trial int) (res result) {
	res = result{Row: r.name, Trial: trial, Hosts: c.hosts, World: c.nproc, Victim: c.victim}
	dir, err := os.MkdirTemp(c.tmp, "trial-")
	if err != nil {
		res.Error = err.Error()
		return res
	}
	defer os.RemoveAll(dir)
	console, err := c.consoleFile(r, trial, dir)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	defer console.Close()

	ctx, cancel := context.WithTimeout(ctx, c.trialTimeout)
	defer cancel()
	if r.launcher == torchrunLauncher {
		if err := waitPortFree(ctx, torchrunPort); err != nil {
			res.Error = err.Error()
			return res
		}
	}
	j, err := startJob(c, r, dir, console)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	defer func() { res.LeftBehind = j.stop() }()

	fail := func(err error) result {
		res.Error = fmt.Sprintf("%v; console tail: %s", err, tailOf(console.Name(), 600))
		return res
	}
	started := newTally(0, 0)
	if err := j.await(ctx, started, c.nproc); err != nil {
		return fail(fmt.Errorf("waiting for every rank's first collective: %w", err))
	}
	select {
	case <-time.After(c.warmup):
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	pid, err := j.rankPID(c.victim)
	if err != nil {
		return fail(err)
	}
	attempt, epoch, ranks := r.recovery(c.nproc)
	recovered := newTally(attempt, epoch)
	kill := time.Now().UnixNano() // the same clock as the workers' unix_ns
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fail(fmt.Errorf("kill rank %d (pid %d): %w", c.victim, pid, err))
	}
	res.KillUnixNs = kill
	if err := j.await(ctx, recovered, ranks); err != nil {
		return fail(fmt.Errorf("waiting for the first collective of attempt %d epoch %d after the kill: %w", attempt, epoch, err))
	}
	res.SurvivorsMs = recovered.since(kill)
	res.FirstMs, res.LastMs = res.SurvivorsMs[0], res.SurvivorsMs[len(res.SurvivorsMs)-1]
	if res.FirstMs < 0 {
		return fail(fmt.Errorf("a rank stamped attempt %d epoch %d %.1f ms before the kill", attempt, epoch, -res.FirstMs))
	}
	return res
}

// consoleFile is where a trial's console output goes: under -logs when
// given (kept), else in the trial's directory (removed with it).
func (c *config) consoleFile(r row, trial int, dir string) (*os.File, error) {
	path := filepath.Join(dir, "console.log")
	if c.logs != "" {
		name := strings.Map(func(r rune) rune {
			if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
				return r
			}
			return '-'
		}, r.name)
		path = filepath.Join(c.logs, fmt.Sprintf("trial%02d-%s.log", trial, name))
	}
	return os.Create(path)
}

// job is one run's agents and the reading of their output.
type job struct {
	agents  []*exec.Cmd
	done    []chan struct{} // closed when agents[i] has been waited for
	ended   chan struct{}   // closed when the first agent has
	endOnce sync.Once
	stamps  chan stamp
	readers sync.WaitGroup
	pipes   []*os.File // read ends of the agents' output
}

// startJob starts the agents of one run of r, their output (stdout and
// stderr together) copied to console and scanned for first-collective
// lines.
func startJob(c *config, r row, dir string, console io.Writer) (*job, error) {
	cmds, err := c.agentCommands(r, dir)
	if err != nil {
		return nil, err
	}
	// Room for far more lines than a run prints (one per rank, attempt
	// and epoch), so that a reader never blocks — a blocked reader would
	// stall the workers writing to its pipe.
	j := &job{stamps: make(chan stamp, 4096), ended: make(chan struct{})}
	out := &lockedWriter{w: console}
	for i, cmd := range cmds {
		pr, pw, err := os.Pipe()
		if err != nil {
			j.stop()
			return nil, err
		}
		cmd.Stdout, cmd.Stderr = pw, pw
		err = cmd.Start()
		pw.Close() // the agent and its workers hold it now
		if err != nil {
			pr.Close()
			j.stop()
			return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
		}
		done := make(chan struct{})
		j.agents, j.done, j.pipes = append(j.agents, cmd), append(j.done, done), append(j.pipes, pr)
		j.readers.Add(1)
		go j.read(i, pr, out)
		go func() {
			cmd.Wait()
			close(done)
			j.endOnce.Do(func() { close(j.ended) })
		}()
	}
	return j, nil
}

// read scans agent i's output until every process holding the pipe is gone.
func (j *job) read(i int, pr io.Reader, out io.Writer) {
	defer j.readers.Done()
	sc := bufio.NewScanner(pr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(out, line)
		if s, ok := parseStamp(i, line); ok {
			j.stamps <- s
		}
	}
}

// await counts stamps into t until it holds n ranks. An agent exiting
// first is an error: the job ended, or gave up, before it recovered.
func (j *job) await(ctx context.Context, t *tally, n int) error {
	for len(t.ns) < n {
		select {
		case s := <-j.stamps:
			t.add(s)
		case <-j.ended:
			for i, d := range j.done {
				select {
				case <-d:
					return fmt.Errorf("agent %d exited (%v) with %d of %d ranks there", i, j.agents[i].ProcessState, len(t.ns), n)
				default:
				}
			}
		case <-ctx.Done():
			return fmt.Errorf("%w with %d of %d ranks there", context.Cause(ctx), len(t.ns), n)
		}
	}
	return nil
}

// rankPID finds the worker process of a global rank among the agents'
// descendants, by the RANK in its environment.
func (j *job) rankPID(rank int) (int, error) {
	want := []byte("RANK=" + strconv.Itoa(rank) + "\x00")
	for _, a := range j.agents {
		for _, pid := range descendants(a.Process.Pid) {
			env, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
			if err != nil {
				continue
			}
			if bytes.HasPrefix(env, want) || bytes.Contains(env, append([]byte{0}, want...)) {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("no worker with RANK=%d among the agents' processes", rank)
}

// stopGrace is how long the agents get to stop their workers on SIGTERM.
const stopGrace = 10 * time.Second

// stop ends the job as a user would: SIGTERM to every agent, which stops
// its workers and exits; after stopGrace its whole process group is
// SIGKILLed. Then it kills and reaps whatever the agents left (reparented
// to us, the subreaper), and returns how many such processes there were.
func (j *job) stop() int {
	for _, a := range j.agents {
		a.Process.Signal(syscall.SIGTERM)
	}
	grace := time.After(stopGrace)
	for i, d := range j.done {
		select {
		case <-d:
		case <-grace:
			syscall.Kill(-j.agents[i].Process.Pid, syscall.SIGKILL)
			<-d
		}
	}
	left := reapLeftovers()
	// The readers end when the last writer is gone; a writer that escaped
	// us would keep them waiting, so their pipes are closed after a while.
	read := make(chan struct{})
	go func() {
		j.readers.Wait()
		close(read)
	}()
	select {
	case <-read:
	case <-time.After(5 * time.Second):
	}
	for _, p := range j.pipes {
		p.Close()
	}
	<-read
	return left
}

// lockedWriter serialises lines from several agents' readers.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// waitPortFree waits until nothing listens on port: torchrun 1.13
// --standalone always uses the same port, and would join a stranger's
// rendezvous there (or a previous trial's, still closing) instead of
// hosting its own.
func waitPortFree(ctx context.Context, port int) error {
	for {
		ln, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err == nil {
			return ln.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("port %d stays busy (%v): another torchrun --standalone is running", port, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// reapLeftovers kills and reaps every child of ours (orphans of a finished
// launcher, reparented to us as subreaper) and returns how many there were.
func reapLeftovers() int {
	n := 0
	for round := 0; round < 50; round++ {
		kids := children(os.Getpid())
		if len(kids) == 0 {
			return n
		}
		for _, pid := range kids {
			syscall.Kill(pid, syscall.SIGKILL)
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, 0, nil)
			n++
		}
	}
	return n
}

// descendants lists every process under pid (children first).
func descendants(pid int) []int {
	parent := parents()
	var out []int
	frontier := []int{pid}
	for len(frontier) > 0 {
		var next []int
		for p, pp := range parent {
			if slices.Contains(frontier, pp) {
				next = append(next, p)
			}
		}
		out = append(out, next...)
		frontier = next
	}
	return out
}

// children lists the processes whose parent is ppid.
func children(ppid int) []int {
	var out []int
	for p, pp := range parents() {
		if pp == ppid {
			out = append(out, p)
		}
	}
	return out
}

// parents maps every process to its parent, from /proc.
func parents() map[int]int {
	ents, _ := os.ReadDir("/proc")
	m := map[int]int{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(f[1]); err == nil {
			m[pid] = ppid
		}
	}
	return m
}

// tailOf returns the last n bytes of a file, on one line.
func tailOf(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", " ⏎ ")
}
