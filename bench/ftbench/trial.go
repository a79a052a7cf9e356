package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
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

	"github.com/gorunhq/gorun/bench/internal/procs"
	"github.com/gorunhq/gorun/internal/netns"
)

// result is one trial of one row: a JSON line of -out.
type result struct {
	Row     string `json:"row"`
	Trial   int    `json:"trial"`
	Hosts   int    `json:"hosts"`
	Backend string `json:"backend,omitempty"` // with several hosts
	World   int    `json:"world"`
	Fault   string `json:"fault"`
	Victim  int    `json:"victim"`
	// CutHost is the host cut off (-fault blackhole): the one that ran
	// the victim.
	CutHost string `json:"cut_host,omitempty"`
	// Commands are the agents' command lines, as run.
	Commands []string `json:"commands,omitempty"`
	// KillUnixNs is the fault's time: just before the SIGKILL, or the
	// link cut.
	KillUnixNs int64 `json:"kill_unix_ns,omitempty"`
	// LastMs: fault → the last survivor's first successful collective (the
	// group has recovered when every survivor has); FirstMs: → the first
	// survivor's. SurvivorsMs: every survivor's, sorted.
	LastMs      float64   `json:"last_ms,omitempty"`
	FirstMs     float64   `json:"first_ms,omitempty"`
	SurvivorsMs []float64 `json:"survivors_ms,omitempty"`
	// Heal rows (the value above is to every rank at full size, epoch 2):
	// ShrinkMs: fault → the last survivor's first collective of epoch 1;
	// NewcomerMs: fault → the respawned rank's process start;
	// FromNewcomerMs: that start → full size (LastMs − NewcomerMs);
	// GrowStallMs: the longest a survivor did no step for the grow (its
	// first collective of epoch 2 − the moment epoch 2 stopped its steps).
	// ReadyMs: fault → the newcomer asking to be grown in (its start-up
	// over); FromReadyMs: that → full size, the grow itself.
	ShrinkMs       float64 `json:"shrink_ms,omitempty"`
	NewcomerMs     float64 `json:"newcomer_ms,omitempty"`
	FromNewcomerMs float64 `json:"from_newcomer_ms,omitempty"`
	ReadyMs        float64 `json:"ready_ms,omitempty"`
	FromReadyMs    float64 `json:"from_ready_ms,omitempty"`
	GrowStallMs    float64 `json:"grow_stall_ms,omitempty"`
	// LeftBehind counts the processes still there (alive, or unreaped)
	// after the launchers stopped, which the benchmark killed and reaped
	// (the cut-off host's, killed on purpose, are not counted).
	LeftBehind int    `json:"left_behind,omitempty"`
	Error      string `json:"error,omitempty"`
}

// stamp is one timestamp line of a worker (examples/allreduce
// --timestamps): its first successful collective of an attempt and epoch
// (kind first-collective), its process start (started, no epoch), or the
// moment a new epoch stopped its steps in epoch (stopped); at unix
// nanoseconds ns.
type stamp struct {
	agent   int    // which agent's output
	prefix  string // the launcher's line prefix, e.g. "[default3]:", which tells ranks apart
	kind    string
	attempt int
	epoch   int
	ns      int64
}

// The kinds of stamp.
const (
	stampFirst   = "first-collective"
	stampStarted = "started"
	stampReady   = "ready" // a newcomer's start-up is over: it asks to be grown in
	stampStopped = "stopped"
	stampParked  = "parked" // a pre-started worker's start-up is over: it waits for its place
	// stampRendezvous is an agent's log line saying it saw a round
	// complete (a spare: the running one, full).
	stampRendezvous = "rendezvous"
)

var stampRE = regexp.MustCompile(`^(.*?)(first-collective|started|ready|stopped|parked)(?: attempt=(\d+))?(?: epoch=(\d+))? unix_ns=(\d+)\s*$`)

// parseStamp reads a timestamp line as a launcher prints it. A parked
// worker knows no attempt yet; every other stamp names one, and the
// collective ones an epoch too.
func parseStamp(agent int, line string) (stamp, bool) {
	m := stampRE.FindStringSubmatch(line)
	if m == nil || (m[3] == "") != (m[2] == stampParked) ||
		(m[4] == "") != (m[2] == stampStarted || m[2] == stampReady || m[2] == stampParked) {
		return stamp{}, false
	}
	s := stamp{agent: agent, prefix: m[1], kind: m[2]}
	var err1, err2, err3 error
	if m[3] != "" {
		s.attempt, err1 = strconv.Atoi(m[3])
	}
	if m[4] != "" {
		s.epoch, err2 = strconv.Atoi(m[4])
	}
	s.ns, err3 = strconv.ParseInt(m[5], 10, 64)
	return s, err1 == nil && err2 == nil && err3 == nil
}

// tally collects stamps of one (attempt, epoch), one per rank.
type tally struct {
	attempt, epoch int
	ns             map[string]int64 // by agent and prefix
	// skip is an agent whose ranks do not count (the cut-off host's),
	// or -1.
	skip int
}

func newTally(attempt, epoch int) *tally {
	return &tally{attempt: attempt, epoch: epoch, ns: map[string]int64{}, skip: -1}
}

// add counts s if it is of the tally's attempt and epoch; a rank's repeated
// line keeps its first time.
func (t *tally) add(s stamp) {
	if s.kind != stampFirst || s.attempt != t.attempt || s.epoch != t.epoch || s.agent == t.skip {
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
// has run a collective, lets it run -warmup more, brings the fault (SIGKILL
// of the victim rank, or its host's link cut) and waits until the ranks of
// the recovery attempt and epoch have each run their first collective.
// Everything it started is killed and reaped before it returns.
func runTrial(ctx context.Context, c *config, r row, trial int) (res result) {
	res = result{Row: r.name, Trial: trial, Hosts: c.hosts, World: c.hosts * c.nproc, Fault: c.fault, Victim: c.victim}
	if c.hosts > 1 {
		res.Backend = c.backend
	}
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
	if r.launcher == torchrunLauncher && c.hosts == 1 {
		if err := procs.WaitPortFree(ctx, torchrunPort); err != nil {
			res.Error = err.Error()
			return res
		}
	}
	runID := fmt.Sprintf("ftbench-%d-%d-%d", os.Getpid(), trial, slices.Index(rows, r)+1)
	j, err := startJob(c, r, dir, runID, console)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	res.Commands = j.commands
	defer func() { res.LeftBehind = j.stop(c) }()

	fail := func(err error) result {
		res.Error = fmt.Sprintf("%v; console tail: %s", err, procs.Tail(console.Name(), 600))
		return res
	}
	started := newTally(0, 0)
	if err := j.await(ctx, started, res.World); err != nil {
		return fail(fmt.Errorf("waiting for every rank's first collective: %w", err))
	}
	if err := j.startSpare(ctx, c); err != nil {
		return fail(fmt.Errorf("starting the spare: %w", err))
	}
	res.Commands = j.commands
	select {
	case <-time.After(c.warmup):
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	pid, agent, err := j.rankPID(c.victim)
	if err != nil {
		return fail(err)
	}
	attempt, epoch, ranks := r.recovery(c.fault, c.hosts, c.nproc)
	recovered := newTally(attempt, epoch)
	switch c.fault {
	case faultKill:
		res.KillUnixNs = time.Now().UnixNano() // the same clock as the workers' unix_ns
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			return fail(fmt.Errorf("kill rank %d (pid %d): %w", c.victim, pid, err))
		}
	case faultBlackhole:
		if c.backend == backendC10d && agent == 0 {
			return fail(fmt.Errorf("rank %d runs on host 0, which holds the c10d rendezvous store: cutting it off ends the job", c.victim))
		}
		host := c.bed.Hosts[agent]
		res.CutHost = host.Name
		// The cut-off agent may give up on its own (its rendezvous store
		// is gone), and its ranks are not in the recovery.
		j.cut, recovered.skip = agent, agent
		defer func() {
			if err := j.killCut(c, host); err != nil && res.Error == "" {
				res.Error = err.Error()
			}
		}()
		res.KillUnixNs = time.Now().UnixNano()
		if err := host.Blackhole(); err != nil {
			return fail(fmt.Errorf("cut %s off: %w", host.Name, err))
		}
	case faultNode:
		if c.backend == backendC10d && agent == 0 {
			return fail(fmt.Errorf("rank %d runs on host 0, which holds the c10d rendezvous store: losing it ends the job", c.victim))
		}
		res.CutHost = c.bed.Hosts[agent].Name
		// Its agent's exit is the fault, and its ranks are not in the
		// recovery.
		j.cut, recovered.skip = agent, agent
		defer func() {
			if err := j.reapLost(c); err != nil && res.Error == "" {
				res.Error = err.Error()
			}
		}()
		res.KillUnixNs = time.Now().UnixNano()
		if err := j.agents[agent].Process.Signal(syscall.SIGKILL); err != nil {
			return fail(fmt.Errorf("kill the agent of %s: %w", res.CutHost, err))
		}
	}
	if err := j.await(ctx, recovered, ranks); err != nil {
		return fail(fmt.Errorf("waiting for the first collective of attempt %d epoch %d after the %s: %w", attempt, epoch, c.fault, err))
	}
	res.SurvivorsMs = recovered.since(res.KillUnixNs)
	res.FirstMs, res.LastMs = res.SurvivorsMs[0], res.SurvivorsMs[len(res.SurvivorsMs)-1]
	if res.FirstMs < 0 {
		return fail(fmt.Errorf("a rank stamped attempt %d epoch %d %.1f ms before the %s", attempt, epoch, -res.FirstMs, c.fault))
	}
	if r.mode == modeHeal {
		spare := -1
		if c.hasSpare(r) {
			spare = c.spareHost()
		}
		if err := res.heal(j.seen, spare); err != nil {
			return fail(err)
		}
	}
	return res
}

// heal fills in a heal row's measures from the stamps of the trial: the
// shrink (epoch 1), the newcomer's start and readiness, and each survivor's
// stall for the grow (epoch 2). spare is the agent of the spare standing
// by, or -1: its workers' start counts even before the fault (they were
// pre-started).
func (res *result) heal(seen []stamp, spare int) error {
	ms := func(ns int64) float64 { return float64(ns-res.KillUnixNs) / 1e6 }
	shrunk, stopped, grown := map[string]int64{}, map[string]int64{}, map[string]int64{}
	var newcomer, ready int64
	for _, s := range seen {
		if s.attempt != 0 {
			continue
		}
		k := strconv.Itoa(s.agent) + s.prefix
		switch {
		case s.kind == stampStarted && (s.ns > res.KillUnixNs || s.agent == spare) && newcomer == 0:
			newcomer = s.ns
		case s.kind == stampReady && ready == 0:
			ready = s.ns
		case s.kind == stampFirst && s.epoch == 1:
			shrunk[k] = s.ns
		case s.kind == stampStopped && s.epoch == 1:
			stopped[k] = s.ns
		case s.kind == stampFirst && s.epoch == 2:
			grown[k] = s.ns
		}
	}
	// The survivors' own epoch (1) may never form: when the grow comes
	// while they are still forming it, they move on to the grow. Then
	// there is no shrink and no stall for the grow to measure, only the
	// way back to full size.
	if newcomer == 0 || ready == 0 {
		return fmt.Errorf("heal: stamps missing (newcomer start %v, ready %v)", newcomer != 0, ready != 0)
	}
	for _, ns := range shrunk {
		res.ShrinkMs = max(res.ShrinkMs, ms(ns))
	}
	res.NewcomerMs, res.ReadyMs = ms(newcomer), ms(ready)
	res.FromNewcomerMs, res.FromReadyMs = res.LastMs-res.NewcomerMs, res.LastMs-res.ReadyMs
	for k, at := range stopped {
		if g, ok := grown[k]; ok {
			res.GrowStallMs = max(res.GrowStallMs, float64(g-at)/1e6)
		}
	}
	return nil
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
	agents   []*exec.Cmd
	commands []string        // the agents' command lines, for the record
	done     []chan struct{} // closed when agents[i] has been waited for
	exited   chan int        // each agent's index, once it has been waited for
	// cut is the agent of the cut-off host, or -1: its exit is no
	// failure of the job.
	cut     int
	stamps  chan stamp
	seen    []stamp // every stamp await has read, in order
	readers sync.WaitGroup
	pipes   []*os.File // read ends of the agents' output
	out     io.Writer  // the console
	// spare is the heal row's spare agent, started by startSpare; nil
	// when the row has none.
	spare *agentSpec
}

// startJob starts the agents of one run of r, their output (stdout and
// stderr together) copied to console and scanned for first-collective
// lines. A heal row's spare is not started here: startSpare starts it once
// the job runs, so that it cannot take a member's place.
func startJob(c *config, r row, dir, runID string, console io.Writer) (*job, error) {
	specs, err := c.agents(r, dir, runID)
	if err != nil {
		return nil, err
	}
	// Room for far more lines than a run prints (one per rank, attempt
	// and epoch), so that a reader never blocks — a blocked reader would
	// stall the workers writing to its pipe.
	j := &job{stamps: make(chan stamp, 4096), exited: make(chan int, len(specs)), cut: -1, out: &procs.LockedWriter{W: console}}
	if c.hasSpare(r) {
		j.spare, specs = &specs[len(specs)-1], specs[:len(specs)-1]
	}
	for _, spec := range specs {
		if err := j.start(c, spec); err != nil {
			j.stop(c)
			return nil, err
		}
	}
	return j, nil
}

// startSpare starts the heal row's spare agent, when it has one, and waits
// until it stands by: it has seen the running round full (its rendezvous
// says so), and with -spare-prestart its workers are parked (their imports
// done).
func (j *job) startSpare(ctx context.Context, c *config) error {
	if j.spare == nil {
		return nil
	}
	i := len(j.agents)
	if err := j.start(c, *j.spare); err != nil {
		return err
	}
	want := map[string]bool{}
	standing := false
	for !standing || (c.sparePrestart && len(want) < c.nproc) {
		select {
		case s := <-j.stamps:
			j.seen = append(j.seen, s)
			switch {
			case s.agent != i:
			case s.kind == stampRendezvous:
				standing = true
			case s.kind == stampParked:
				want[s.prefix] = true
			}
		case a := <-j.exited:
			return fmt.Errorf("agent %d exited (%v) before the spare stood by", a, j.agents[a].ProcessState)
		case <-ctx.Done():
			return fmt.Errorf("%w before the spare stood by (%d of %d workers parked)", context.Cause(ctx), len(want), c.nproc)
		}
	}
	return nil
}

// start starts one agent, the next of j.agents.
func (j *job) start(c *config, spec agentSpec) error {
	i := len(j.agents)
	cmd := c.command(spec)
	j.commands = append(j.commands, commandLine(spec, cmd))
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	err = cmd.Start()
	pw.Close() // the agent and its workers hold it now
	if err != nil {
		pr.Close()
		return fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	done := make(chan struct{})
	j.agents, j.done, j.pipes = append(j.agents, cmd), append(j.done, done), append(j.pipes, pr)
	// On several hosts, each console line says whose it is.
	label := ""
	if spec.host >= 0 {
		label = fmt.Sprintf("[h%d] ", spec.host)
	}
	j.readers.Add(1)
	go j.read(i, pr, j.out, label)
	go func() {
		cmd.Wait()
		close(done)
		j.exited <- i
	}()
	return nil
}

// command is the process of spec: in its host's network namespace, or in
// ours with -hosts 1.
func (c *config) command(spec agentSpec) *exec.Cmd {
	var cmd *exec.Cmd
	if spec.host < 0 {
		cmd = exec.Command(spec.argv[0], spec.argv[1:]...)
	} else {
		cmd = c.bed.Hosts[spec.host].Command(context.Background(), spec.argv[0], spec.argv[1:]...)
	}
	cmd.Env = append(cmd.Environ(), spec.env...)
	// Its own process group, so that the whole tree can be killed at once
	// (torchrun's workers share it; gorun's have groups of their own and
	// die with gorun by Pdeathsig); and it dies with us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	return cmd
}

// commandLine is how an agent was started, as a shell would say it: its
// own environment variables, then its arguments.
func commandLine(spec agentSpec, cmd *exec.Cmd) string {
	var words []string
	for _, w := range append(slices.Clone(spec.env), cmd.Args...) {
		words = append(words, shellQuote(w))
	}
	return strings.Join(words, " ")
}

// shellQuote quotes s for a POSIX shell, where it needs quotes.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+=./:,@%") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// read scans agent i's output until every process holding the pipe is
// gone, and copies it to out, every line after label.
func (j *job) read(i int, pr io.Reader, out io.Writer, label string) {
	defer j.readers.Done()
	sc := bufio.NewScanner(pr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(out, label+line)
		if s, ok := parseStamp(i, line); ok {
			j.stamps <- s
		} else if strings.Contains(line, "\trendezvous complete\t") || strings.Contains(line, "\trendezvous complete without this node") {
			j.stamps <- stamp{agent: i, kind: stampRendezvous}
		}
	}
}

// await counts stamps into t until it holds n ranks. An agent exiting
// first is an error (the job ended, or gave up, before it recovered),
// unless it is the cut-off host's.
func (j *job) await(ctx context.Context, t *tally, n int) error {
	for len(t.ns) < n {
		select {
		case s := <-j.stamps:
			j.seen = append(j.seen, s)
			t.add(s)
		case i := <-j.exited:
			if i == j.cut {
				continue
			}
			return fmt.Errorf("agent %d exited (%v) with %d of %d ranks there", i, j.agents[i].ProcessState, len(t.ns), n)
		case <-ctx.Done():
			return fmt.Errorf("%w with %d of %d ranks there", context.Cause(ctx), len(t.ns), n)
		}
	}
	return nil
}

// rankPID finds the worker process of a global rank among the agents'
// descendants, by the RANK in its environment, and the agent it runs
// under (agent i runs in host i).
func (j *job) rankPID(rank int) (pid, agent int, err error) {
	for i, a := range j.agents {
		for _, pid := range procs.Descendants(a.Process.Pid) {
			if procs.HasEnv(pid, "RANK="+strconv.Itoa(rank)) {
				return pid, i, nil
			}
		}
	}
	return 0, 0, fmt.Errorf("no worker with RANK=%d among the agents' processes", rank)
}

// killCut ends the cut-off host at the trial's end: every process in it is
// killed (it cannot learn that the job ended), its agent waited for and
// the rest reaped, not counted as leftovers; then its link is restored for
// the next trial.
func (j *job) killCut(c *config, host *netns.Host) error {
	err := host.Kill()
	return errors.Join(err, j.reapLost(c), host.Heal())
}

// reapLost waits for the lost host's agent (j.cut), killed, to be waited
// for, and reaps what it left (its workers, killed with it): the fault's
// doing, not leftovers of a launcher that stopped.
func (j *job) reapLost(c *config) error {
	var err error
	select {
	case <-j.done[j.cut]:
	case <-time.After(stopGrace):
		err = fmt.Errorf("the lost agent (%d) has not exited %v after SIGKILL", j.cut, stopGrace)
	}
	// The others' agents are running and stay; their workers are theirs.
	spare := slices.Clone(c.spare)
	for i, a := range j.agents {
		select {
		case <-j.done[i]:
		default:
			spare = append(spare, a.Process.Pid)
		}
	}
	procs.ReapOrphans(spare...)
	return err
}

// stopGrace is how long the agents get to stop their workers on SIGTERM.
const stopGrace = 10 * time.Second

// stop ends the job as a user would: SIGTERM to every agent, which stops
// its workers and exits; after stopGrace its whole process group is
// SIGKILLed. Then it kills and reaps whatever the agents left (reparented
// to us, the subreaper) and whatever is left in the bed's hosts, and
// returns how many such processes there were.
func (j *job) stop(c *config) int {
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
	left := procs.ReapOrphans(c.spare...)
	if c.bed != nil {
		// Every process of the job descends from us, so none should be
		// here; count any that is, and kill it.
		for _, h := range c.bed.Hosts {
			pids, _ := h.PIDs()
			left += len(pids)
			if len(pids) > 0 {
				h.Kill()
			}
		}
	}
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
