package main

import (
	"errors"
	"math"
	"reflect"
	"testing"
	"time"
)

const ms = time.Millisecond

// steps returns completions of steps from..to-1 at world, one every gap
// from at.
func steps(from, to, world int, at, gap time.Duration) []Progress {
	var p []Progress
	for s := from; s < to; s++ {
		p = append(p, Progress{At: at + time.Duration(s-from)*gap, Step: s, World: world})
	}
	return p
}

func TestMeasure(t *testing.T) {
	tests := []struct {
		name     string
		run      Run
		stepTime time.Duration
		want     Report
		wantErr  error
	}{
		{
			name: "fault-free",
			run:  Run{Steps: 10, World: 4, Wall: time.Second, Progress: steps(0, 10, 4, 100*ms, 100*ms)},
			want: Report{UsefulRankSteps: 40, Goodput: 10},
		},
		{
			// A restart at 500 ms (steps 0–4 done, checkpoint at 3):
			// steps 3 and 4 redone from 800 ms; the job gets past step 4
			// at 1000 ms, 500 ms after the fault, less one step.
			name: "restart from a checkpoint",
			run: Run{Steps: 8, World: 2, Wall: 1400 * ms, Faults: []time.Duration{500 * ms},
				Progress: append(steps(0, 5, 2, 100*ms, 100*ms), steps(3, 8, 2, 800*ms, 100*ms)...)},
			stepTime: 100 * ms,
			want: Report{UsefulRankSteps: 16, Goodput: 16 / (2 * 1.4), Redone: 2,
				Lost: []time.Duration{400 * ms}, LostMedian: 400 * ms, LostP90: 400 * ms},
		},
		{
			// Shrink at 300 ms from 4 ranks to 3: steps 0–2 at 4, step 2
			// redone by the survivors (its last completion counts, at 3),
			// 3–5 at 3.
			name: "shrink counts the smaller world",
			run: Run{Steps: 6, World: 4, Wall: time.Second, Faults: []time.Duration{300 * ms},
				Progress: append(steps(0, 3, 4, 0, 100*ms), steps(2, 6, 3, 400*ms, 100*ms)...)},
			stepTime: 100 * ms,
			want: Report{UsefulRankSteps: 4 + 4 + 3 + 3 + 3 + 3, Goodput: 20 / 4.0, Redone: 1,
				Lost: []time.Duration{100 * ms}, LostMedian: 100 * ms, LostP90: 100 * ms},
		},
		{
			// Progress lines can come out of order (several ranks'
			// pipes): the latest completion of a step is its last.
			name: "out of order",
			run: Run{Steps: 2, World: 2, Wall: time.Second,
				Progress: []Progress{{At: 500 * ms, Step: 1, World: 1}, {At: 100 * ms, Step: 0, World: 2}, {At: 200 * ms, Step: 1, World: 2}}},
			want: Report{UsefulRankSteps: 3, Goodput: 1.5, Redone: 1},
		},
		{
			name: "a fault the run never recovered from counts to its end",
			run: Run{Steps: 3, World: 1, Wall: time.Second, Faults: []time.Duration{600 * ms},
				Progress: steps(0, 3, 1, 100*ms, 100*ms)},
			want: Report{UsefulRankSteps: 3, Goodput: 3, Lost: []time.Duration{400 * ms}, LostMedian: 400 * ms, LostP90: 400 * ms},
		},
		{
			name:    "a step lost",
			run:     Run{Steps: 4, World: 1, Wall: time.Second, Progress: []Progress{{Step: 0, World: 1}, {Step: 1, World: 1}, {Step: 3, World: 1}}},
			want:    Report{UsefulRankSteps: 3, Goodput: 3},
			wantErr: ErrLostStep,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Measure(tt.run, tt.stepTime)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Measure error = %v, want %v", err, tt.wantErr)
			}
			if math.Abs(got.Goodput-tt.want.Goodput) > 1e-9 {
				t.Errorf("Goodput = %v, want %v", got.Goodput, tt.want.Goodput)
			}
			got.Goodput, tt.want.Goodput = 0, 0
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Measure =\n%+v, want\n%+v", got, tt.want)
			}
		})
	}
}

func TestMeasureRejects(t *testing.T) {
	for _, r := range []Run{
		{Steps: 0, World: 1, Wall: time.Second},
		{Steps: 1, World: 1, Wall: 0},
		{Steps: 1, World: 1, Wall: time.Second, Progress: []Progress{{Step: 1, World: 1}}},
	} {
		if _, err := Measure(r, 0); err == nil || errors.Is(err, ErrLostStep) {
			t.Errorf("Measure(%+v) = %v, want a usage error", r, err)
		}
	}
}
