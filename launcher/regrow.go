package launcher

import (
	"time"
)

// respawns is heal's policy on this node (Config.Regrow): which lost local
// slots are started again, and when. A slot is respawned once an epoch has
// excluded it and its process is gone, after a backoff that doubles with
// each respawn of the same slot; whether the job's budget allows it is the
// caller's to ask (it is counted in the worker store, across nodes).
//
// It owns the backoff timers; due delivers the slots whose wait is over.
// It does no I/O and is driven from the round's loop only.
type respawns struct {
	backoff time.Duration
	// count is how many times each slot (global rank) was respawned in
	// this round.
	count map[int]int
	// waiting are the slots with a timer running.
	waiting map[int]*time.Timer
	// due receives a slot when its backoff is over; it has room for two
	// of every local slot (one in flight past a cancel, one scheduled
	// after), so a timer never blocks.
	due chan int
}

// newRespawns returns the policy for a node of local slots, nil (heal off)
// when !on: every method is a no-op on nil.
func newRespawns(on bool, backoff time.Duration, local int) *respawns {
	if !on {
		return nil
	}
	return &respawns{backoff: backoff, count: map[int]int{}, waiting: map[int]*time.Timer{},
		due: make(chan int, 2*max(local, 1))}
}

// delay is slot's backoff before its next respawn: RespawnBackoff, doubled
// for each earlier respawn of the slot, at most maxRespawnBackoff.
func (r *respawns) delay(slot int) time.Duration {
	d := r.backoff
	for range r.count[slot] {
		if d >= maxRespawnBackoff/2 {
			return maxRespawnBackoff
		}
		d *= 2
	}
	return min(d, maxRespawnBackoff)
}

// schedule starts slot's backoff unless it is waiting already: it returns
// the backoff and whether it started it.
func (r *respawns) schedule(slot int) (time.Duration, bool) {
	if _, ok := r.waiting[slot]; ok {
		return 0, false
	}
	d := r.delay(slot)
	due := r.due
	r.waiting[slot] = time.AfterFunc(d, func() { due <- slot })
	return d, true
}

// fired records that slot's backoff is over (its value came on due): the
// caller respawns it now, or gives it up.
func (r *respawns) fired(slot int) {
	delete(r.waiting, slot)
	r.count[slot]++
}

// pending reports whether a slot waits for its respawn.
func (r *respawns) pending() bool { return r != nil && len(r.waiting) > 0 }

// dueC is the channel of slots whose backoff is over (nil when off).
func (r *respawns) dueC() <-chan int {
	if r == nil {
		return nil
	}
	return r.due
}

// cancel stops every backoff: the round is over, or the job is done here.
func (r *respawns) cancel() {
	if r == nil {
		return
	}
	for slot, t := range r.waiting {
		t.Stop()
		delete(r.waiting, slot)
	}
}
