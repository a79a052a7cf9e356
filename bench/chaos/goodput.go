package main

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gorunhq/gorun/bench/internal/stats"
)

// Progress is one step's completion by the group: step Step (from 0) done
// by a group of World ranks, At after the job started. A step can complete
// more than once: redone after a restart (from the last checkpoint) or in a
// new epoch.
type Progress struct {
	At    time.Duration
	Step  int
	World int
}

// Run is what a run of fixed work left to measure.
type Run struct {
	Steps int           // the steps of the work
	World int           // the job's full size, ranks
	Wall  time.Duration // start → the last rank done
	// Faults are when the schedule's faults were brought, from the start.
	Faults   []time.Duration
	Progress []Progress
}

// Report is a run's goodput and what the faults cost.
type Report struct {
	// UsefulRankSteps: every step counted once, at the size of the group
	// that did it last (a step done at 3/4 size counts 3/4).
	UsefulRankSteps int
	// Goodput is UsefulRankSteps ÷ (World × Wall), rank-steps per second
	// per rank: a fault-free run's is its step rate, and the ratio of two
	// runs' is what the faults cost.
	Goodput float64
	// Redone counts completions beyond the first of a step.
	Redone int
	// Lost is, per fault, how long the job took to get past the step it
	// had reached at the fault, less one step's time at the fault-free
	// rate (the step it would have done anyway): the time the fault cost
	// before progress resumed, redone steps included. A run that never
	// got past it counts to its end.
	Lost []time.Duration
	// LostMedian and LostP90 summarise Lost.
	LostMedian, LostP90 time.Duration
}

// ErrLostStep: a step of the work was never completed, yet the run ended.
var ErrLostStep = errors.New("step lost")

// Measure computes r's report. stepTime is one step at the fault-free rate
// (0 when unknown: Lost then counts it). It is pure.
func Measure(r Run, stepTime time.Duration) (Report, error) {
	if r.Steps < 1 || r.World < 1 || r.Wall <= 0 {
		return Report{}, fmt.Errorf("measure: steps %d, world %d, wall %v: want all positive", r.Steps, r.World, r.Wall)
	}
	last := make(map[int]Progress, r.Steps) // by step: its last completion
	var rep Report
	for _, p := range r.Progress {
		if p.Step < 0 || p.Step >= r.Steps {
			return Report{}, fmt.Errorf("measure: step %d is not a step of 0..%d", p.Step, r.Steps-1)
		}
		if q, ok := last[p.Step]; ok {
			rep.Redone++
			if p.At < q.At {
				continue
			}
		}
		last[p.Step] = p
	}
	var missing []int
	for s := range r.Steps {
		p, ok := last[s]
		if !ok {
			missing = append(missing, s)
			continue
		}
		rep.UsefulRankSteps += p.World
	}
	rep.Goodput = float64(rep.UsefulRankSteps) / (float64(r.World) * r.Wall.Seconds())

	byTime := slices.Clone(r.Progress)
	slices.SortStableFunc(byTime, func(a, b Progress) int { return int(a.At - b.At) })
	for _, f := range r.Faults {
		rep.Lost = append(rep.Lost, lostAt(byTime, f, r.Wall, stepTime))
	}
	if len(rep.Lost) > 0 {
		rep.LostMedian = stats.Quantile(rep.Lost, 0.5)
		rep.LostP90 = stats.Quantile(rep.Lost, 0.9)
	}
	if len(missing) > 0 {
		return rep, fmt.Errorf("%w: %d of %d steps never completed (first %d)", ErrLostStep, len(missing), r.Steps, missing[0])
	}
	return rep, nil
}

// lostAt is the time a fault at f cost: from f to the first completion of
// a step beyond every step completed before f (progress sorted by time),
// less stepTime; to end when there is none.
func lostAt(progress []Progress, f, end, stepTime time.Duration) time.Duration {
	frontier := -1
	i := 0
	for ; i < len(progress) && progress[i].At <= f; i++ {
		frontier = max(frontier, progress[i].Step)
	}
	resumed := end
	for ; i < len(progress); i++ {
		if progress[i].Step > frontier {
			resumed = progress[i].At
			break
		}
	}
	return max(resumed-f-stepTime, 0)
}
