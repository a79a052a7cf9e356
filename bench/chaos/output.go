package main

import (
	"bufio"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

var (
	progressRE = regexp.MustCompile(`progress attempt=(\d+) epoch=(\d+) step=(\d+) rank=(\d+) world=(\d+) unix_ns=(\d+)`)
	// The launcher's prefix, [defaultN]: (gorun's and torchrun's with
	// --tee), names the local rank: on one host, the launch rank.
	// gorun's log field, or the "  group_rank=G" line of torchrun's
	// "Rendezvous complete" (LOGLEVEL=INFO), bare in 1.13 and after
	// glog's prefix in 2.14 ("I1127 08:26:13.570000 19195 …/api.py:553]
	// group_rank=1").
	groupRankRE      = regexp.MustCompile(`"group_rank": (\d+)|group_rank=(\d+)`)
	torchGroupRankRE = regexp.MustCompile(`^\s*(?:[IWE]\d{4} [^\]]*\]\s+)?group_rank=\d+\s*$`)
	// A rank's last line: examples/allreduce's sum, train_elastic.py's
	// loss (then its pid).
	doneRE = regexp.MustCompile(`\[default(\d+)\]:done rank=\d+ world=(\d+) steps=(\d+) (?:sum|loss)=(\S+)`)
	// gorun's log of a respawn: the rank and the PID that now runs it
	// (a standby's has no RANK in its environment: it got it on its
	// assignment pipe).
	respawnedRE = regexp.MustCompile(`respawned a lost rank.*"rank": (\d+), "pid": (\d+)`)
)

// placeTakenLine is gorun's log when the others took its node for lost
// and admitted another in its place (a link cut past the liveness
// timeout, with a spare or a replacement waiting).
const placeTakenLine = "this node's place in the round went to another node"

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
	// newcomers counts the workers that said they are newcomers: a grow
	// is under way (GrowKill waits for one).
	newcomers int
	// respawned maps the PID of each respawn gorun logged to its launch
	// rank.
	respawned map[int]int
}

func newOutput() *output {
	return &output{others: map[int]Progress{}, epochs: map[[2]int]bool{}, respawned: map[int]int{}}
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
// size, the steps it ran and its result: the last step's sum (Go worker)
// or the model's loss (torch worker).
type doneLine struct {
	launch, world, steps int
	result               float64
}

// scan reads the agent's output (its workers' included) to the end,
// copying it to console.
//
// label starts every console line (a host's, on several); nproc is the
// agent's ranks: a done line's launch rank is the agent's group rank ×
// nproc + the local rank, the group rank from the agent's latest
// "starting workers", "admitted into the running round" or "assigning the
// pre-started workers" line, or torchrun's "Rendezvous complete" (0 until
// there is one: one host).
// placeTaken is called when the agent says the others gave its place in
// the round to another node: it waits to join again, as a spare.
func (o *output) scan(r io.Reader, console io.Writer, t0 time.Time, label string, nproc int, placeTaken func()) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	groupRank := 0
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(console, label+line)
		// A spare admitted in a lost node's place says so instead, and
		// a spare with its workers pre-started hands them their place.
		if strings.Contains(line, "starting workers") || strings.Contains(line, "admitted into the running round") ||
			strings.Contains(line, "assigning the pre-started workers") || torchGroupRankRE.MatchString(line) {
			if m := groupRankRE.FindStringSubmatch(line); m != nil {
				groupRank, _ = strconv.Atoi(m[1] + m[2])
			}
		}
		if strings.Contains(line, placeTakenLine) {
			placeTaken()
		}
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
		} else if m := respawnedRE.FindStringSubmatch(line); m != nil {
			rank, _ := strconv.Atoi(m[1])
			pid, _ := strconv.Atoi(m[2])
			o.mu.Lock()
			o.respawned[pid] = rank
			o.mu.Unlock()
		} else if strings.Contains(line, "]:newcomer slot=") {
			o.mu.Lock()
			o.newcomers++
			o.mu.Unlock()
		} else if m := doneRE.FindStringSubmatch(line); m != nil {
			var d doneLine
			d.launch, _ = strconv.Atoi(m[1])
			d.launch += groupRank * nproc
			d.world, _ = strconv.Atoi(m[2])
			d.steps, _ = strconv.Atoi(m[3])
			d.result, _ = strconv.ParseFloat(m[4], 64)
			o.mu.Lock()
			o.done = append(o.done, d)
			o.mu.Unlock()
		}
	}
}

func (o *output) started() bool { return o.lines() > 0 }

// respawnedAs returns the launch rank gorun logged pid was respawned as.
func (o *output) respawnedAs(pid int) (int, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	r, ok := o.respawned[pid]
	return r, ok
}

// finishing reports whether a rank has printed its done line.
func (o *output) finishing() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.done) > 0
}

// lines counts the progress lines read so far.
func (o *output) lines() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.steps
}

func (o *output) nNewcomers() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.newcomers
}

func (o *output) nEpochs() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.epochs)
}
