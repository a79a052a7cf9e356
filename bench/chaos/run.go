package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
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
)

// Limits are how far an agent's resources may be above their first sample
// at the end of a run (the invariants "back within a small constant").
// Defaults: 8 fds, 30 goroutines, 24 MiB of RSS, 32 store keys.
type Limits struct {
	FDs, Goroutines int
	RSSKiB          int
	Keys            int
}

func (l Limits) withDefaults() Limits {
	if l.FDs == 0 {
		l.FDs = 8
	}
	if l.Goroutines == 0 {
		l.Goroutines = 30
	}
	if l.RSSKiB == 0 {
		l.RSSKiB = 24 << 10
	}
	if l.Keys == 0 {
		l.Keys = 32
	}
	return l
}

// Applied is a fault as it was brought: when (from the job's start), to
// which rank and process; or why it was skipped.
type Applied struct {
	Fault
	At      time.Duration
	Rank    int
	PID     int
	Skipped string
}

// Sample is an agent's resources at a moment of the run. -1: unknown
// (torchrun has no /metrics; a store that did not answer).
type Sample struct {
	At         time.Duration
	FDs        int
	Goroutines int
	RSSKiB     int
	Keys       int
	Epochs     int // distinct (attempt, epoch) pairs seen so far
}

// RowResult is one row's run.
type RowResult struct {
	Row     Row
	Wall    time.Duration
	Report  Report
	Faults  []Applied
	Samples []Sample
	Epochs  int     // distinct (attempt, epoch) pairs the workers ran
	Sum     float64 // the final sum every rank reported
	Exact   bool    // every rank done with the expected sum, all steps
	// Left counts the job's processes found after its agent exited.
	Left int
	// Violations are the invariants the run broke; none for a good run.
	Violations []string
}

// Brought counts the faults that were brought, not skipped.
func (r RowResult) Brought() int {
	n := 0
	for _, a := range r.Faults {
		if a.Skipped == "" {
			n++
		}
	}
	return n
}

var (
	progressRE = regexp.MustCompile(`progress attempt=(\d+) epoch=(\d+) step=(\d+) rank=(\d+) world=(\d+) unix_ns=(\d+)`)
	// The launcher's prefix, [defaultN]: (gorun's and torchrun's with
	// --tee), names the local rank: on one host, the launch rank.
	doneRE = regexp.MustCompile(`\[default(\d+)\]:done rank=\d+ world=(\d+) steps=(\d+) sum=(\S+)`)
)

// output is what the run's scanner gathers from the agents' output.
type output struct {
	mu sync.Mutex
	// completions are the group's rank 0's progress lines: one per
	// completion of a step (a group has one rank 0 at a time, whichever
	// agent it runs under and whatever attempt number that agent is at).
	completions []Progress
	// others are the first line of each step from any other rank: a step
	// whose rank 0 died before its line still completed.
	others map[int]Progress
	epochs map[[2]int]bool // (attempt, epoch) pairs seen
	done   []doneLine
	steps  int // progress lines read
}

func newOutput() *output {
	return &output{others: map[int]Progress{}, epochs: map[[2]int]bool{}}
}

// progress returns every completion: rank 0's, and another rank's for a
// step rank 0 never printed.
func (o *output) progress() []Progress {
	out := slices.Clone(o.completions)
	seen := map[int]bool{}
	for _, p := range o.completions {
		seen[p.Step] = true
	}
	for s, p := range o.others {
		if !seen[s] {
			out = append(out, p)
		}
	}
	return out
}

// doneLine is a rank's last line: its launch rank, the final group's
// size, the steps it ran and the last step's sum.
type doneLine struct {
	launch, world, steps int
	sum                  float64
}

// scan reads the agent's output (its workers' included) to the end,
// copying it to console.
func (o *output) scan(r io.Reader, console io.Writer, t0 time.Time) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(console, line)
		if m := progressRE.FindStringSubmatch(line); m != nil {
			var v [6]int64
			for i := range v {
				v[i], _ = strconv.ParseInt(m[i+1], 10, 64)
			}
			p := Progress{At: time.Duration(v[5] - t0.UnixNano()), Step: int(v[2]), World: int(v[4])}
			o.mu.Lock()
			o.steps++
			if v[3] == 0 {
				o.completions = append(o.completions, p)
			} else if _, ok := o.others[p.Step]; !ok {
				o.others[p.Step] = p
			}
			o.epochs[[2]int{int(v[0]), int(v[1])}] = true
			o.mu.Unlock()
		} else if m := doneRE.FindStringSubmatch(line); m != nil {
			var d doneLine
			d.launch, _ = strconv.Atoi(m[1])
			d.world, _ = strconv.Atoi(m[2])
			d.steps, _ = strconv.Atoi(m[3])
			d.sum, _ = strconv.ParseFloat(m[4], 64)
			o.mu.Lock()
			o.done = append(o.done, d)
			o.mu.Unlock()
		}
	}
}

func (o *output) started() bool { return o.lines() > 0 }

// lines counts the progress lines read so far.
func (o *output) lines() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.steps
}

func (o *output) nEpochs() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.epochs)
}

// runRow runs the job of row r through sched (none for a fault-free row)
// and checks the invariants. stepTime is a step at the fault-free rate (0
// when not known yet). console receives the agent's output. Everything it
// starts is ended before it returns.
func runRow(ctx context.Context, j Job, r Row, sched []Fault, stepTime time.Duration, lim Limits, timeout time.Duration, console io.Writer) (res RowResult, err error) {
	res.Row = r
	lim = lim.withDefaults()
	dir, err := os.MkdirTemp("", "chaos-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if r.Torchrun {
		// torchrun 1.13 --standalone always hosts its store on 29400.
		if err := procs.WaitPortFree(ctx, 29400); err != nil {
			return res, err
		}
	}
	healthAddr, err := freeAddr()
	if err != nil {
		return res, err
	}
	marker := fmt.Sprintf("GORUN_CHAOS_RUN=%d-%d", os.Getpid(), time.Now().UnixNano())
	argv := j.agentArgv(r, dir, healthAddr)
	cmd := exec.Command(argv[0], argv[1:]...)
	// The marker finds the job's processes wherever they end up.
	cmd.Env = append(os.Environ(), marker, "PYTHON_EXEC="+j.Python)
	// Its own process group, to end the whole tree at once; it dies with
	// us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	pr, pw, err := os.Pipe()
	if err != nil {
		return res, err
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	fmt.Fprintf(console, "# %s: %s\n", r.Name, strings.Join(argv, " "))
	out := newOutput()
	t0 := time.Now()
	err = cmd.Start()
	pw.Close()
	if err != nil {
		pr.Close()
		return res, fmt.Errorf("start %s: %w", argv[0], err)
	}
	scanned := make(chan struct{})
	go func() { out.scan(pr, console, t0); close(scanned) }()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	var waitErr error
	var end time.Time
	ended := false
	defer func() {
		if !ended { // an error: end the job
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		res.Left += len(cleanUp(marker))
		select {
		case <-scanned:
		case <-time.After(5 * time.Second): // a writer escaped us: stop reading
		}
		pr.Close()
	}()

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	next := 0
	for !ended {
		var faultC <-chan time.Time
		if next < len(sched) {
			faultC = time.After(time.Until(t0.Add(sched[next].At)))
		}
		select {
		case waitErr = <-exited:
			end, ended = time.Now(), true
		case <-ctx.Done():
			return res, fmt.Errorf("%s: %w after %v (%d progress lines)", r.Name, context.Cause(ctx), time.Since(t0).Round(time.Second), out.lines())
		case <-faultC:
			a := bring(ctx, j, r, cmd.Process.Pid, sched[next], t0)
			res.Faults = append(res.Faults, a)
			fmt.Fprintf(console, "# fault %v\n", a)
			next++
		case <-tick.C:
			if !out.started() {
				break
			}
			// A sample the exiting agent could not answer in full is
			// not one.
			if s := sample(ctx, j, r, cmd.Process.Pid, healthAddr, time.Since(t0), out.nEpochs()); s.FDs > 0 && s.RSSKiB > 0 && (r.Torchrun || s.Goroutines > 0) {
				res.Samples = append(res.Samples, s)
			}
		}
	}
	res.Wall = end.Sub(t0)
	// The workers' last lines are read before the output is judged.
	select {
	case <-scanned:
	case <-time.After(5 * time.Second):
	}
	res.Left = len(cleanUp(marker)) // the deferred count adds anything later
	judge(&res, j, out, waitErr, stepTime, lim)
	return res, nil
}

// judge measures the run and checks the invariants, recording every
// broken one in res.Violations.
func judge(res *RowResult, j Job, out *output, waitErr error, stepTime time.Duration, lim Limits) {
	bad := func(format string, a ...any) { res.Violations = append(res.Violations, fmt.Sprintf(format, a...)) }
	if waitErr != nil {
		bad("the job did not complete: agent %v", waitErr)
	}
	out.mu.Lock()
	run := Run{Steps: j.Steps, World: j.Nproc, Wall: res.Wall}
	run.Progress = out.progress()
	done := slices.Clone(out.done)
	res.Epochs = len(out.epochs)
	out.mu.Unlock()
	for _, a := range res.Faults {
		if a.Skipped == "" {
			run.Faults = append(run.Faults, a.At)
		}
	}
	rep, err := Measure(run, stepTime)
	res.Report = rep
	if err != nil {
		bad("%v", err)
	}

	// Launch rank r contributes r+1: the sum must be over exactly the
	// ranks of the final group. Its size is the last done line's world,
	// and its members the ranks of the last that many lines (a group that
	// finished before a late restart printed done lines too).
	res.Exact = len(done) > 0
	if res.Exact {
		final := done[max(len(done)-done[len(done)-1].world, 0):]
		want := 0.0
		ranks := map[int]bool{}
		for _, d := range final {
			if !ranks[d.launch] {
				want += float64(d.launch + 1)
			}
			ranks[d.launch] = true
		}
		if len(ranks) != len(final) {
			res.Exact = false
			bad("the last %d done lines are not %d ranks'", len(final), len(final))
		}
		for _, d := range final {
			res.Sum = d.sum
			if d.steps != j.Steps || d.sum != want {
				res.Exact = false
				bad("launch rank %d done after %d of %d steps with sum %g, want %g (the final group's ranks %v)", d.launch, d.steps, j.Steps, d.sum, want, slices.Sorted(maps.Keys(ranks)))
			}
		}
	} else {
		bad("no rank reported done")
	}
	if res.Left > 0 {
		bad("%d processes of the job left after its agent exited", res.Left)
	}
	checkSamples(res, res.Row, lim, bad)
}

// checkSamples checks the agent's resources at its last sample against
// its first: fds, goroutines and RSS back within lim; store keys against
// the first sample after 2 epochs.
func checkSamples(res *RowResult, r Row, lim Limits, bad func(string, ...any)) {
	if len(res.Samples) < 2 {
		return
	}
	first, last := res.Samples[0], res.Samples[len(res.Samples)-1]
	grew := func(what string, a, b, limit int) {
		if a >= 0 && b >= 0 && b-a > limit {
			bad("agent %s grew from %d to %d by epoch %d (limit +%d)", what, a, b, last.Epochs, limit)
		}
	}
	grew("open fds", first.FDs, last.FDs, lim.FDs)
	grew("goroutines", first.Goroutines, last.Goroutines, lim.Goroutines)
	grew("RSS KiB", first.RSSKiB, last.RSSKiB, lim.RSSKiB)
	// Keys against the store after 2 epochs (the measure): a
	// job's first epochs add its bookkeeping once.
	base := first
	for _, s := range res.Samples {
		if s.Epochs >= 3 { // the initial (attempt, epoch) and 2 more
			base = s
			break
		}
	}
	grew("store keys", base.Keys, last.Keys, lim.Keys)
	if !r.Torchrun && first.Goroutines < 0 {
		bad("the agent's /metrics had no go_goroutines")
	}
}

// bring brings fault f to the job under agent: it picks the target rank's
// worker (or, when that rank is not running, the next launch rank that
// is), and signals it. A shrink row keeps at least half its ranks (a
// fault that would take more is skipped), and a rank already hung is not
// hit again.
func bring(ctx context.Context, j Job, r Row, agent int, f Fault, t0 time.Time) Applied {
	a := Applied{Fault: f, Rank: -1}
	var workers map[int]int
	// Between a failure and the next group there may be no worker: wait
	// a while for one, as a fault would strike the next group.
	for deadline := time.Now().Add(10 * time.Second); ; {
		workers = liveWorkers(agent)
		if len(workers) > 0 || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if r.Mode == modeShrink && len(workers) <= j.Nproc/2 {
		a.Skipped = "the shrink row keeps half its ranks"
		return a
	}
	for i := range j.Nproc {
		rank := (f.Target + i) % j.Nproc
		if pid, ok := workers[rank]; ok {
			a.Rank, a.PID = rank, pid
			break
		}
	}
	if a.PID == 0 {
		a.Skipped = "no rank running"
		return a
	}
	sig := map[Kind]syscall.Signal{RankKill: syscall.SIGKILL, RankExit: syscall.SIGTERM, RankHang: syscall.SIGSTOP}[f.Kind]
	a.At = time.Since(t0)
	if err := syscall.Kill(a.PID, sig); err != nil {
		a.Skipped = fmt.Sprintf("signal %d: %v", a.PID, err)
		return a
	}
	return a
}

// liveWorkers maps the launch rank of every worker under agent that is
// running (not stopped, not a zombie) to its PID.
func liveWorkers(agent int) map[int]int {
	out := map[int]int{}
	for _, pid := range procs.Descendants(agent) {
		v, ok := procs.Env(pid, "RANK")
		if !ok || !running(pid) {
			continue
		}
		if rank, err := strconv.Atoi(v); err == nil {
			out[rank] = pid
		}
	}
	return out
}

// running reports whether pid is neither stopped nor a zombie.
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] != "T" && f[0] != "t" && f[0] != "Z"
}

// sample reads the agent's resources: fds and RSS from /proc, goroutines
// from its /metrics (gorun), store keys by `gorun store num-keys` on the
// workers' store (GORUN_STORE, gorun).
func sample(ctx context.Context, j Job, r Row, agent int, healthAddr string, at time.Duration, epochs int) Sample {
	s := Sample{At: at, FDs: -1, Goroutines: -1, RSSKiB: -1, Keys: -1, Epochs: epochs}
	if fds, err := os.ReadDir("/proc/" + strconv.Itoa(agent) + "/fd"); err == nil {
		s.FDs = len(fds)
	}
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(agent) + "/status"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				s.RSSKiB, _ = strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			}
		}
	}
	if r.Torchrun {
		return s
	}
	s.Goroutines = metric(ctx, healthAddr, "go_goroutines")
	for _, pid := range procs.Children(agent) {
		if store, ok := procs.Env(pid, "GORUN_STORE"); ok {
			s.Keys = numKeys(ctx, j.Gorun, store)
			break
		}
	}
	return s
}

// metric reads one gauge from a Prometheus text endpoint; -1 when absent.
func metric(ctx context.Context, addr, name string) int {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	// No connection is kept: the agent's fd count is what is measured.
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int(f)
			}
		}
	}
	return -1
}

// numKeys counts the keys of a store with the store toolbox; -1 when it
// does not answer.
func numKeys(ctx context.Context, gorun, store string) int {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, gorun, "store", "num-keys", "--store", store).Output()
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return -1
	}
	return n
}

// cleanUp kills and reaps whatever of the job is left — our orphaned
// children (we are a child subreaper), and any process with the job's
// marker — and returns their PIDs.
func cleanUp(marker string) []int {
	var left []int
	for _, pid := range procs.WithEnv(marker) {
		if pid != os.Getpid() {
			syscall.Kill(pid, syscall.SIGKILL)
			left = append(left, pid)
		}
	}
	n := procs.ReapOrphans()
	for len(left) < n {
		left = append(left, 0) // reaped before the scan saw it
	}
	return left
}

// freeAddr is a loopback address with a port that was free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// consolePath names a row's console log under dir.
func consolePath(dir string, i int, r Row) string {
	name := strings.Map(func(c rune) rune {
		if c >= 'a' && c <= 'z' || c >= '0' && c <= '9' {
			return c
		}
		return '-'
	}, strings.ToLower(r.Name))
	return filepath.Join(dir, fmt.Sprintf("row%d-%s.log", i+1, name))
}
