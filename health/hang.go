package health

import (
	"fmt"
	"slices"
	"time"
)

// BlockedFactor bounds how long a worker may stay blocked on its peers: a
// worker that keeps saying it is waiting (wait beats) and makes no
// progress for BlockedFactor heartbeat timeouts is declared hung all the
// same (its group is deadlocked, or the peer it waits on is out of
// anyone's sight).
const BlockedFactor = 10

// HangDetector is the decision core of heartbeat monitoring: beats in,
// hung workers out. It does no I/O and reads no clock.
//
// There are two kinds of beats. A progress beat (Beat) says the worker
// finished a step. A wait beat (Wait) says it is alive and blocked on its
// peers, in a collective or awaiting the agents: a rank that hangs stops
// its peers' progress too, since they wait for it in their next
// collective, and progress beats alone cannot tell the one from the
// others — every rank of the group goes silent within a step. A worker is
// declared hung when it sends neither for the timeout, or only wait beats
// for BlockedFactor timeouts.
//
// A worker is watched from its first beat on — workers that never beat
// (they do not use heartbeats) are never declared hung — and is reported
// once: after that only a new beat re-arms it. Ranks started together
// (Expect) are watched from the first beat of any of them, with one more
// timeout of grace: a rank that hangs before its first beat would
// otherwise never be found, and its peers, blocked on it, would be.
//
// A worker that says it is done (Done) is no longer watched for beats: its
// teardown, a final checkpoint save included, may take any time. With a
// done timeout (SetDoneTimeout) it is declared hung all the same when it
// has not exited that long after: a teardown that hangs (a stopped
// process, a deadlock in a library's shutdown) would otherwise hold the
// agent for ever, the job's work done.
type HangDetector struct {
	timeout time.Duration
	blocked time.Duration
	// doneTimeout bounds a done worker's teardown (0: unbounded). done
	// marks the ranks that said they were done (then watched only with a
	// done timeout, last holding when they said it).
	doneTimeout time.Duration
	done        map[int]bool
	last        map[int]time.Time // rank → last progress beat (or first wait beat)
	waiting     map[int]time.Time // rank → last wait beat since its last progress beat
	hung        map[int]bool      // reported and not beaten since
	// expected are ranks started together and not watched yet; never are
	// those watched because a peer beat, that have not beaten themselves.
	expected map[int]bool
	never    map[int]bool
}

// NewHangDetector returns a detector that declares a worker hung when no
// beat has come for timeout, or only wait beats for BlockedFactor times
// timeout.
func NewHangDetector(timeout time.Duration) *HangDetector {
	return &HangDetector{timeout: timeout, blocked: BlockedFactor * timeout,
		last: map[int]time.Time{}, waiting: map[int]time.Time{}, hung: map[int]bool{},
		expected: map[int]bool{}, never: map[int]bool{}, done: map[int]bool{}}
}

// SetDoneTimeout bounds how long a worker that said it is done may take to
// exit before it is declared hung; 0 (the default) leaves it unbounded.
func (d *HangDetector) SetDoneTimeout(t time.Duration) { d.doneTimeout = max(t, 0) }

// Done records that rank said at now that it is done: it is no longer
// watched for beats, and with a done timeout it must exit within it.
func (d *HangDetector) Done(rank int, now time.Time) {
	d.Forget(rank)
	if d.doneTimeout > 0 {
		d.last[rank], d.done[rank] = now, true
	}
}

// Expect says that ranks were started together (a group's local workers):
// the first beat of any of them starts watching the others too, which must
// beat within two timeouts of it. A rank started on its own later (a
// respawn, whose start-up may take long) is watched from its own first
// beat only.
func (d *HangDetector) Expect(ranks []int) {
	clear(d.expected)
	for _, r := range ranks {
		if _, watched := d.last[r]; !watched {
			d.expected[r] = true
		}
	}
}

// firstBeat starts watching rank, beating for the first time at now (or
// for the first time itself, after a peer's beat armed it), and the
// expected ranks not watched yet: from a timeout past now.
func (d *HangDetector) firstBeat(rank int, now time.Time) {
	d.last[rank] = now
	delete(d.never, rank)
	delete(d.expected, rank)
	for r := range d.expected {
		d.last[r] = now.Add(d.timeout)
		d.never[r] = true
	}
	clear(d.expected)
}

// Beat records a progress beat from rank at now.
func (d *HangDetector) Beat(rank int, now time.Time) {
	d.undone(rank)
	if prev, ok := d.last[rank]; !ok || d.never[rank] {
		d.firstBeat(rank, now)
		delete(d.waiting, rank)
	} else if now.After(prev) {
		d.last[rank] = now
		delete(d.waiting, rank)
	}
	delete(d.hung, rank)
}

// Wait records a wait beat from rank at now: alive, blocked on its peers.
// A worker's first beat may be one (it blocks in its first collective).
func (d *HangDetector) Wait(rank int, now time.Time) {
	d.undone(rank)
	if _, ok := d.last[rank]; !ok || d.never[rank] {
		d.firstBeat(rank, now)
	}
	last := d.last[rank]
	if w := d.waiting[rank]; now.After(w) && !now.Before(last) {
		d.waiting[rank] = now
	}
	delete(d.hung, rank)
}

// undone forgets that rank said it was done: it beats again (a worker
// that said so too early, or another run of the same local rank).
func (d *HangDetector) undone(rank int) {
	if d.done[rank] {
		d.Forget(rank)
	}
}

// Forget stops watching rank (it exited, or its group was restarted).
func (d *HangDetector) Forget(rank int) {
	delete(d.done, rank)
	delete(d.last, rank)
	delete(d.waiting, rank)
	delete(d.hung, rank)
	delete(d.expected, rank)
	delete(d.never, rank)
}

// deadline is when rank is declared hung if no beat comes, and why.
func (d *HangDetector) deadline(rank int) (time.Time, func(now time.Time) string) {
	last := d.last[rank]
	if d.done[rank] {
		return last.Add(d.doneTimeout), func(now time.Time) string {
			return fmt.Sprintf("said it was done %v ago and has not exited (done timeout %v)",
				now.Sub(last).Round(time.Millisecond), d.doneTimeout)
		}
	}
	w, blocked := d.waiting[rank]
	if d.never[rank] {
		return last.Add(d.timeout), func(now time.Time) string {
			return fmt.Sprintf("no heartbeat at all, %v after the first of the workers started with it (timeout %v)",
				now.Sub(last.Add(-d.timeout)).Round(time.Millisecond), d.timeout)
		}
	}
	if !blocked {
		return last.Add(d.timeout), func(now time.Time) string {
			return fmt.Sprintf("no heartbeat for %v (timeout %v)", now.Sub(last).Round(time.Millisecond), d.timeout)
		}
	}
	if silent := w.Add(d.timeout); silent.Before(last.Add(d.blocked)) {
		return silent, func(now time.Time) string {
			return fmt.Sprintf("no heartbeat for %v (timeout %v; it was waiting on its peers before)", now.Sub(w).Round(time.Millisecond), d.timeout)
		}
	}
	return last.Add(d.blocked), func(now time.Time) string {
		return fmt.Sprintf("blocked on its peers for %v without progress (limit %v, %d heartbeat timeouts)",
			now.Sub(last).Round(time.Millisecond), d.blocked, BlockedFactor)
	}
}

// Expired returns an Event for every watched worker whose deadline is at
// or before now and that has not been reported yet, in rank order.
func (d *HangDetector) Expired(now time.Time) []Event {
	var out []Event
	for rank := range d.last {
		at, why := d.deadline(rank)
		if d.hung[rank] || now.Before(at) {
			continue
		}
		d.hung[rank] = true
		out = append(out, Event{Kind: WorkerHung, Rank: rank, SeenAt: now, Reason: why(now), Done: d.done[rank]})
	}
	slices.SortFunc(out, func(a, b Event) int { return a.Rank - b.Rank })
	return out
}

// Next returns when the next worker would expire if no beat came, and
// false when no worker is watched (or all watched ones are reported).
func (d *HangDetector) Next() (time.Time, bool) {
	var next time.Time
	found := false
	for rank := range d.last {
		if d.hung[rank] {
			continue
		}
		if at, _ := d.deadline(rank); !found || at.Before(next) {
			next, found = at, true
		}
	}
	return next, found
}
