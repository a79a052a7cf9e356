package main

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/bench/internal/procs"
)

// Limits are how far an agent's resources may be above their first sample
// at the end of a run (the invariants "back within a small constant").
// Defaults: 8 fds, 30 goroutines, 24 MiB of RSS, 16 store keys plus
// keysPerRank a rank of the world (perRank; with torch workers plus
// torchFDsPerRank and torchKeysPerRank a rank: torchGroups);
// on etcd 64 keys under the job's prefix and 4 leases beyond their count
// after 2 epochs, plus, a host (perHost), 64 keys and 8 leases: what an
// agent holds once it has used its stores (a token per stripe of its worker store,
// rendezvous/etcd's numStripes: the board's keys hash to more stripes as
// epochs go by) and what a killed agent leaves until its leases lapse
// (about 70 s).
type Limits struct {
	FDs, Goroutines int
	RSSKiB          int
	Keys            int
	EtcdKeys        int
	EtcdLeases      int
}

// perHost adds what each of hosts agents may hold in etcd (see Limits).
func (l Limits) perHost(hosts int) Limits {
	l.EtcdKeys += 64 * hosts
	l.EtcdLeases += 8 * hosts
	return l
}

// keysPerRank is what the agreement may hold in the workers' store beyond
// its base, per rank of the world: the records of the epochs in flight
// since the Board's floor was last raised (it is raised when a grow
// completes, and what is a generation below it collected), each epoch an
// acknowledgement and a group-formation address per rank. Two such
// epochs past the base, 4 keys a rank: 32 in all at world 4, the limit the
// soaks on 2 hosts × 2 ranks ran under; at world 6 the keys went 36 to 88
// and back over 111 epochs with no trend (BENCHMARKS, "The soak's other
// kinds"), which a flat 32 took for a leak.
const keysPerRank = 4

// perRank adds what the agreement's records of a world of ranks may hold
// in the workers' store (see keysPerRank).
func (l Limits) perRank(world int) Limits {
	l.Keys += keysPerRank * world
	return l
}

// torchFDsPerRank is how many more of the agent's fds the torch worker may
// hold, per rank of the world, than at the first sample: once the first
// epoch has changed, each gorun_ft worker keeps about 2 more connections to
// the agent's worker store (its watcher's and the board's; 8 each, seen),
// a plateau that later respawns do not raise (62 → 70 at world 4 after
// the second heal and flat through a third; 64 → 73 on two hosts).
const torchFDsPerRank = 3

// torchKeysPerRank is what the torch worker's groups may hold in the
// workers' store beyond the Go worker's, per rank of the world: gorun_ft
// keeps the gloo groups of the last three epochs (the older ones are swept
// with the board's floor) and epoch 0's, each about 5 keys a rank (its
// member and built marks, gloo's rank and address keys). Seen: 10 keys at
// the start, 88 after 5 epochs and 89 after 7 at world 4 (BENCHMARKS,
// "PyTorch gloo workers"): bounded, but more than the 32 the Go worker
// needs after its first epochs.
const torchKeysPerRank = 16

// torchGroups adds what the torch worker's groups of world ranks hold in
// the workers' store and of the agent's fds (see torchKeysPerRank and
// torchFDsPerRank).
func (l Limits) torchGroups(world int) Limits {
	l.Keys += torchKeysPerRank * world
	l.FDs += torchFDsPerRank * world
	return l
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
		l.Keys = 16
	}
	if l.EtcdKeys == 0 {
		l.EtcdKeys = 64
	}
	if l.EtcdLeases == 0 {
		l.EtcdLeases = 4
	}
	return l
}

// Applied is a fault as it was brought: when (from the job's start), to
// which rank and process; or why it was skipped.
type Applied struct {
	Fault
	At   time.Duration
	Rank int
	PID  int
	// Second is the rank a two-rank fault (TwoRanks, GrowKill) struck
	// second, -1 when none was; SecondAt when.
	Second   int
	SecondAt time.Duration
	Skipped  string
}

// String is the fault as the console shows it: when it was due, when it
// was brought and on what, or why it was skipped.
func (a Applied) String() string {
	switch {
	case a.Skipped != "":
		return fmt.Sprintf("%v: skipped (%s)", a.Fault, a.Skipped)
	case a.Rank >= 0 && a.Second >= 0:
		return fmt.Sprintf("%v: at %v, rank %d (pid %d), then rank %d at %v", a.Fault, a.At.Round(time.Millisecond), a.Rank, a.PID,
			a.Second, a.SecondAt.Round(time.Millisecond))
	case a.Rank >= 0:
		return fmt.Sprintf("%v: at %v, rank %d (pid %d)", a.Fault, a.At.Round(time.Millisecond), a.Rank, a.PID)
	}
	return fmt.Sprintf("%v: at %v (pid %d)", a.Fault, a.At.Round(time.Millisecond), a.PID)
}

// Sample is an agent's resources at a moment of the run. -1: unknown
// (torchrun has no /metrics; a store that did not answer).
type Sample struct {
	At         time.Duration
	FDs        int
	Goroutines int
	RSSKiB     int
	Keys       int
	// EtcdKeys and EtcdLeases: the job's keys in etcd and etcd's leases
	// (-backend etcd; -1 otherwise).
	EtcdKeys   int
	EtcdLeases int
	Epochs     int    // distinct (attempt, epoch) pairs seen so far
	Store      string // the workers' store whose keys were counted
}

// RowResult is one row's run.
type RowResult struct {
	Row     Row
	Wall    time.Duration
	Report  Report
	Faults  []Applied
	Samples []Sample
	Epochs  int // distinct (attempt, epoch) pairs the workers ran
	// Result is the final group's result: the sum (Go worker) or the
	// loss (torch worker) every rank reported.
	Result float64
	// Exact: every rank of the final group done after all the steps with
	// the result it must have (see exactness); ExactHow says what it was
	// held to.
	Exact    bool
	ExactHow string
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

// judge measures the run and checks the invariants, recording every
// broken one in res.Violations.
func judge(res *RowResult, j Job, out *output, waitErr error, stepTime time.Duration, lim Limits) {
	bad := func(format string, a ...any) { res.Violations = append(res.Violations, fmt.Sprintf(format, a...)) }
	if waitErr != nil {
		bad("the job did not complete: agent %v", waitErr)
	}
	out.mu.Lock()
	run := Run{Steps: j.Steps, World: j.World(), Wall: res.Wall}
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

	full := rep.UsefulRankSteps == j.Steps*j.World()
	var problems []string
	res.Result, res.ExactHow, problems = exactness(j, done, full)
	res.Exact = len(problems) == 0
	for _, p := range problems {
		bad("%s", p)
	}
	if res.Left > 0 {
		bad("%d processes of the job left after its agent exited", res.Left)
	}
	checkSamples(res, res.Row, lim, bad)
}

// checkSamples checks the agent's resources at the end against its first
// sample: fds, goroutines and RSS back within lim; store keys against the
// first sample after 2 epochs. Each is judged at the least of the last
// three samples: a leak raises every sample, records in flight only some.
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
	// The end is the least of the last three samples: one taken while a
	// restart or respawn holds a new worker's pipes and goroutines is a
	// moment, not a leak; a leak is in all three.
	least := func(tail []Sample, v func(Sample) int) int {
		tail = tail[max(len(tail)-3, 0):]
		m := v(tail[0])
		for _, s := range tail[1:] {
			m = min(m, v(s))
		}
		return m
	}
	all := res.Samples
	grew("open fds", first.FDs, least(all, func(s Sample) int { return s.FDs }), lim.FDs)
	grew("goroutines", first.Goroutines, least(all, func(s Sample) int { return s.Goroutines }), lim.Goroutines)
	grew("RSS KiB", first.RSSKiB, least(all, func(s Sample) int { return s.RSSKiB }), lim.RSSKiB)
	// Keys against the store after 2 epochs (the measure): a
	// job's first epochs add its bookkeeping once. Their end is among the
	// samples after that base (the base itself when none follows).
	at := max(slices.IndexFunc(all, func(s Sample) bool {
		return s.Epochs >= 3 // the initial (attempt, epoch) and 2 more
	}), 0)
	base, after := all[at], all[min(at+1, len(all)-1):]
	grew("store keys", base.Keys, least(after, func(s Sample) int { return s.Keys }), lim.Keys)
	grew("etcd keys", base.EtcdKeys, least(after, func(s Sample) int { return s.EtcdKeys }), lim.EtcdKeys)
	grew("etcd leases", base.EtcdLeases, least(after, func(s Sample) int { return s.EtcdLeases }), lim.EtcdLeases)
	if !r.Torchrun && first.Goroutines < 0 {
		bad("the agent's /metrics had no go_goroutines")
	}
}

// liveWorkers maps the launch rank of every worker under agent that is
// running (not stopped, not a zombie) to its PID. A worker's rank is its
// environment's RANK, or, for one that started without (a respawn
// standby, which got its rank on its assignment pipe), what respawnedAs
// says its agent logged.
func liveWorkers(agent int, respawnedAs func(pid int) (int, bool)) map[int]int {
	out := map[int]int{}
	for _, pid := range procs.Descendants(agent) {
		if !running(pid) {
			continue
		}
		if v, ok := procs.Env(pid, "RANK"); ok {
			if rank, err := strconv.Atoi(v); err == nil {
				out[rank] = pid
			}
		} else if rank, ok := respawnedAs(pid); ok {
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

// commander makes a command, in the agent's host where the run has a bed:
// the workers' store of an etcd job listens on the host's loopback.
type commander func(ctx context.Context, name string, args ...string) *exec.Cmd

// sample reads the agent's resources: fds and RSS from /proc, goroutines
// from its /metrics (gorun), store keys by `gorun store num-keys` on the
// workers' store (GORUN_STORE, gorun; run by cmd), and the job's etcd keys
// and leases where it runs on etcd (ec).
func sample(ctx context.Context, j Job, r Row, agent int, healthAddr string, cmd commander, at time.Duration, epochs int, ec *etcdCounter) Sample {
	s := Sample{At: at, FDs: -1, Goroutines: -1, RSSKiB: -1, Keys: -1, EtcdKeys: -1, EtcdLeases: -1, Epochs: epochs}
	s.EtcdKeys, s.EtcdLeases = ec.count(ctx)
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
			s.Store = store
			s.Keys = numKeys(ctx, cmd, j.Gorun, store)
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
func numKeys(ctx context.Context, cmd commander, gorun, store string) int {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	out, err := cmd(ctx, gorun, "store", "num-keys", "--store", store).Output()
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return -1
	}
	return n
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

// lossTolerance is how far (relative) a torch row's loss may be from the
// reference where the run is deterministic: train_elastic.py prints the
// loss to 9 significant digits (up to 5e-9 off), and the reference sums the
// ranks' gradients in another order than gloo's allreduce (the last bits
// of each step's update). A step lost, done twice or done at another world
// moves the loss by about 4·lr relative (4e-3 at -lr 0.001), far beyond it.
const lossTolerance = 1e-8

// exactness judges the final group's done lines (the last ones: a group
// that finished before a late restart printed done lines too): every one
// a distinct launch rank, after all j.Steps steps, and the result it must
// have. It returns the result, what it was held to, and what is wrong.
//
// Go worker: launch rank r contributes r+1 each step, so the sum is
// Σ(r+1) over exactly the final group's launch ranks.
//
// Torch worker: every rank of the final group reports the same loss (the
// model stayed one model), and where the run was deterministic — every
// step's counted completion at full world (full: the fault-free row, the
// restart rows) — the loss is the reference's, j.RefLoss, a fault-free
// run's. Where steps ran at a smaller world (shrink, and heal until the
// newcomer is in), those steps averaged fewer ranks' gradients: the loss
// legitimately differs from the fault-free one, and only the agreement
// (and, from Measure, no step lost) is judged.
func exactness(j Job, done []doneLine, full bool) (result float64, how string, problems []string) {
	if len(done) == 0 {
		return 0, "", []string{"no rank reported done"}
	}
	final := done[max(len(done)-done[len(done)-1].world, 0):]
	ranks := map[int]bool{}
	for _, d := range final {
		ranks[d.launch] = true
	}
	members := slices.Sorted(maps.Keys(ranks))
	if len(ranks) != len(final) {
		problems = append(problems, fmt.Sprintf("the last %d done lines are not %d ranks'", len(final), len(final)))
	}
	for _, d := range final {
		if d.steps != j.Steps {
			problems = append(problems, fmt.Sprintf("launch rank %d done after %d of %d steps (the final group's ranks %v)", d.launch, d.steps, j.Steps, members))
		}
	}
	result = final[len(final)-1].result
	if j.WorkerKind != workerTorch {
		want := 0.0
		for _, r := range members {
			want += float64(r + 1)
		}
		for _, d := range final {
			if d.result != want {
				problems = append(problems, fmt.Sprintf("launch rank %d done with sum %g, want %g (the final group's ranks %v)", d.launch, d.result, want, members))
			}
		}
		return result, "sum of the final group's ranks", problems
	}
	for _, d := range final {
		if d.result != result {
			problems = append(problems, fmt.Sprintf("the final group's losses differ: launch rank %d has %g, launch rank %d %g", d.launch, d.result, final[len(final)-1].launch, result))
			break
		}
	}
	if !full {
		return result, "members agree (steps at a smaller world)", problems
	}
	if math.Abs(result-j.RefLoss) > lossTolerance*math.Abs(j.RefLoss) {
		problems = append(problems, fmt.Sprintf("loss %.9g, want the fault-free run's %.9g", result, j.RefLoss))
	}
	return result, "= fault-free loss", problems
}
