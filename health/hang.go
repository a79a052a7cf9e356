package health

import (
	"fmt"
	"slices"
	"time"
)

// HangDetector is the decision core of heartbeat monitoring: beats in,
// hung workers out. It does no I/O and reads no clock.
//
// A worker is watched from its first beat on — workers that never beat
// (they do not use heartbeats) are never declared hung — and is reported
// once: after that only a new beat re-arms it.
type HangDetector struct {
	timeout time.Duration
	last    map[int]time.Time // rank → last beat
	hung    map[int]bool      // reported and not beaten since
}

// NewHangDetector returns a detector that declares a worker hung when no
// beat has come for timeout.
func NewHangDetector(timeout time.Duration) *HangDetector {
	return &HangDetector{timeout: timeout, last: map[int]time.Time{}, hung: map[int]bool{}}
}

// Beat records a heartbeat from rank at now.
func (d *HangDetector) Beat(rank int, now time.Time) {
	if prev, ok := d.last[rank]; !ok || now.After(prev) {
		d.last[rank] = now
	}
	delete(d.hung, rank)
}

// Forget stops watching rank (it exited, or its group was restarted).
func (d *HangDetector) Forget(rank int) {
	delete(d.last, rank)
	delete(d.hung, rank)
}

// Expired returns an Event for every watched worker whose last beat is
// timeout or more before now and that has not been reported yet, in rank
// order.
func (d *HangDetector) Expired(now time.Time) []Event {
	var out []Event
	for rank, last := range d.last {
		if d.hung[rank] || now.Sub(last) < d.timeout {
			continue
		}
		d.hung[rank] = true
		out = append(out, Event{
			Kind: WorkerHung, Rank: rank, SeenAt: now,
			Reason: fmt.Sprintf("no heartbeat for %v (timeout %v)", now.Sub(last).Round(time.Millisecond), d.timeout),
		})
	}
	slices.SortFunc(out, func(a, b Event) int { return a.Rank - b.Rank })
	return out
}

// Next returns when the next worker would expire if no beat came, and
// false when no worker is watched (or all watched ones are reported).
func (d *HangDetector) Next() (time.Time, bool) {
	var next time.Time
	found := false
	for rank, last := range d.last {
		if d.hung[rank] {
			continue
		}
		if at := last.Add(d.timeout); !found || at.Before(next) {
			next, found = at, true
		}
	}
	return next, found
}
