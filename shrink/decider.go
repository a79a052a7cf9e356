package shrink

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Config tunes the agreement. DefaultConfig documents every default.
type Config struct {
	// SettleWindow is how long the coordinator gathers failure reports,
	// from the moment the first one was seen, before it decides: failures
	// seen within the window become one epoch instead of a cascade of
	// shrinks. It should cover the spread of detection times of one
	// incident (a host's ranks die together but are noticed by different
	// agents). Zero (or less) decides on the first report; DefaultConfig's
	// window is DefaultSettleWindow.
	SettleWindow time.Duration
	// MinWorldSize is the floor: an epoch that would leave fewer ranks is
	// decided as ActionRestart. Below 1 means 1.
	MinWorldSize int
	// GrowTimeout is how long the newcomers of a grow epoch have, from its
	// decision, to finish joining the group (Decider.Joined) before they
	// are excluded again: survivors never wait on a newcomer without
	// bound. Zero (or less) means DefaultGrowTimeout.
	GrowTimeout time.Duration
	// RejoinWait is how long, from the first join of a grow, the grow
	// waits for the other slots lost in the same epoch as the joined ones
	// (a node's ranks, lost together) before it brings back only those
	// that came: what was lost together comes back in one grow, even when
	// its newcomers are ready more than a settle window apart (a loaded
	// machine), and a slot that never comes back (its respawn refused, its
	// node not replaced) holds the others up no longer than this. Zero
	// means DefaultRejoinWait; negative, no wait beyond the settle window.
	RejoinWait time.Duration
}

// Defaults of Config.
const (
	DefaultSettleWindow = 100 * time.Millisecond
	DefaultMinWorldSize = 1
	DefaultGrowTimeout  = 30 * time.Second
	DefaultRejoinWait   = time.Second
)

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{SettleWindow: DefaultSettleWindow, MinWorldSize: DefaultMinWorldSize, GrowTimeout: DefaultGrowTimeout,
		RejoinWait: DefaultRejoinWait}
}

func (c Config) withDefaults() Config {
	c.SettleWindow = max(c.SettleWindow, 0)
	if c.MinWorldSize < 1 {
		c.MinWorldSize = DefaultMinWorldSize
	}
	if c.GrowTimeout <= 0 {
		c.GrowTimeout = DefaultGrowTimeout
	}
	switch {
	case c.RejoinWait == 0:
		c.RejoinWait = DefaultRejoinWait
	case c.RejoinWait < 0:
		c.RejoinWait = 0
	}
	return c
}

// Join is one agent's word that newcomers are ready to fill lost launch
// slots (global ranks): a respawned rank, a replacement node's ranks, a
// hot spare's.
type Join struct {
	Slots  []int     `json:"slots"`
	From   string    `json:"from,omitempty"`
	SeenAt time.Time `json:"seen_at"`
	// After is the latest epoch the newcomers knew of when they offered
	// their slots: a grow later than that which added a slot answered
	// this offer already. The log is read beside the epochs, so a
	// coordinator (a new leader resuming from the floor) may read the
	// Join after the grow it brought; taken as news then, it grew a slot
	// back a second time for a newcomer since excluded and gone, and the
	// survivors waited on it for the grow timeout. Nil: not said (older
	// helpers), and the Join is taken as news.
	After *int `json:"after,omitempty"`
}

// Report is one agent's word that global ranks failed.
type Report struct {
	Ranks  []int     `json:"ranks"`
	Reason string    `json:"reason"`
	From   string    `json:"from,omitempty"`
	SeenAt time.Time `json:"seen_at"`
	// Epoch says which lives of the ranks the report is about: those of
	// the epoch it names. A worker's failure names the epoch after which
	// the worker was started (0, or the epoch a newcomer follows); a
	// report of nodes lost, the latest epoch the reporter had adopted (a
	// liveness view, which a partition makes stale). A rank excluded by a
	// later epoch than that is not reported by it: the life it saw ended
	// already (the worker that exits because an epoch excluded it; a
	// report filed against a node cut off, read after the grow that
	// brought it back). Nil: not said, and the report is taken as news.
	Epoch *int `json:"epoch,omitempty"`
	// Holds are the global ranks of the reporting agent's node, on a
	// report of nodes lost. One from a node that an epoch after Epoch
	// excluded entirely is not acted on: that node was cut off, and what
	// it saw while apart (the others gone silent) is its own isolation,
	// not their failure. Seen with a link cut and healed: the cut-off
	// node's agent filed the others as lost the moment the link came
	// back, and the job fell back to a restart.
	Holds []int `json:"holds,omitempty"`
}

// Decider is the coordinator's decision core: reports in, the next epoch
// out. It does no I/O and reads no clock: callers pass the time. It does
// not advance on its own decision: the caller publishes the decided epoch
// and then Adopts whatever epoch the board holds, which is someone else's
// when a racing coordinator published first.
type Decider struct {
	cfg     Config
	name    string
	current Epoch
	pending map[int]string // global rank → first reason
	// pendingBy are the reports that named each pending rank: a rank
	// whose every report comes from a node cut off from a newly adopted
	// epoch is pending no more (Report.Holds).
	pendingBy map[int][]Report
	// excludedIn is, for each launch slot ever excluded, the latest
	// epoch that excluded it: what Report.Epoch is weighed against;
	// addedIn, for each slot ever grown back, the latest grow that added
	// it: what Join.After is weighed against.
	excludedIn map[int]int
	addedIn    map[int]int
	// due is when the pending reports are to be decided: the earliest
	// pending report's SeenAt plus the settle window.
	due time.Time
	// joins are the lost slots offered by a Join, with who offered them;
	// joinDue is when they are to be decided, as due for failures.
	joins   map[int]string
	joinDue time.Time
	// joinFirst is when the first of the joins was seen; lostIn names, for
	// each lost slot, the epoch that excluded it: slots lost together are
	// awaited together (Config.RejoinWait).
	joinFirst time.Time
	lostIn    map[int]int
	// complete is whether the current epoch is complete: every rank of it
	// has moved to its group. Shrink epochs count as complete from the
	// start (a survivor that cannot shrink fails, and is reported); a grow
	// is complete once its last rank acknowledged it (Complete).
	complete bool
	// awaiting are the newcomers of the current grow epoch that have not
	// said they finished joining (Joined): they are named when the grow
	// does not complete.
	awaiting map[int]bool
	// early are Joined news (epoch, slot) and Complete news (epoch, -1) of
	// epochs not adopted yet.
	early [][2]int
}

// NewDecider returns a decider for the coordinator called name, starting
// from current.
func NewDecider(name string, cfg Config, current Epoch) *Decider {
	d := &Decider{cfg: cfg.withDefaults(), name: name, pending: map[int]string{}, pendingBy: map[int][]Report{}, excludedIn: map[int]int{},
		addedIn: map[int]int{}, joins: map[int]string{}, awaiting: map[int]bool{}, lostIn: map[int]int{}}
	d.Adopt(current)
	return d
}

// Current returns the epoch the decider builds on.
func (d *Decider) Current() Epoch { return d.current }

// Report records r, received at now. Ranks already lost, or out of range,
// are ignored, and so is news out of date (Report.Epoch, Report.Holds).
// It returns when Decide is due (zero when nothing is pending).
func (d *Decider) Report(now time.Time, r Report) time.Time {
	r.Ranks = slices.DeleteFunc(slices.Clone(r.Ranks), func(g int) bool { return d.stale(r, g) })
	if d.record(d.pending, r.Ranks, r.Reason, d.current.Alive) {
		d.settleBy(&d.due, r.SeenAt, now)
	}
	for _, g := range r.Ranks {
		if _, ok := d.pending[g]; ok {
			d.pendingBy[g] = append(d.pendingBy[g], r)
		}
	}
	return d.due
}

// stale reports whether r, as news of rank g's failure, is out of date: a
// later epoch than the one it names excluded g (the life it saw ended), or
// excluded every rank of the reporter's node (it was cut off: see
// Report.Holds).
func (d *Decider) stale(r Report, g int) bool {
	if r.Epoch == nil {
		return false
	}
	if d.excludedIn[g] > *r.Epoch {
		return true
	}
	if len(r.Holds) == 0 {
		return false
	}
	for _, h := range r.Holds {
		if d.excludedIn[h] <= *r.Epoch {
			return false
		}
	}
	return true
}

// record adds the ranks that want admits to m, each with v unless already
// there, and reports whether any was new.
func (d *Decider) record(m map[int]string, ranks []int, v string, want func(int) bool) bool {
	added := false
	for _, g := range ranks {
		if _, dup := m[g]; want(g) && !dup {
			m[g] = v
			added = true
		}
	}
	return added
}

// settleBy moves *due to the end of the settle window that began when the
// news was seen (now, if seen is unset or in the future), unless *due is
// earlier already.
func (d *Decider) settleBy(due *time.Time, seen, now time.Time) {
	if seen.IsZero() || seen.After(now) {
		seen = now
	}
	if t := seen.Add(d.cfg.SettleWindow); due.IsZero() || t.Before(*due) {
		*due = t
	}
}

// Join records j, received at now: lost slots it offers are grown back
// in by an epoch once the settle window has passed (a node's ranks join in
// one epoch) and the current epoch is complete. Slots alive in the
// current epoch (but a newcomer's of a grow not complete), or out of
// range, are ignored, and so are slots a grow after j.After added (the
// offer was answered). It returns Due.
func (d *Decider) Join(now time.Time, j Join) time.Time {
	j.Slots = slices.DeleteFunc(slices.Clone(j.Slots), func(g int) bool {
		return j.After != nil && d.addedIn[g] > *j.After
	})
	// A newcomer of a grow under way may offer its slot again: its join
	// failed, and the epoch that ends the grow excludes it.
	open := func(g int) bool {
		_, failed := d.pending[g]
		return g >= 0 && g < len(d.current.Ranks) && (!d.current.Alive(g) || failed || (!d.complete && d.current.Newcomer(g)))
	}
	first := len(d.joins) == 0
	if d.record(d.joins, j.Slots, j.From, open) {
		d.settleBy(&d.joinDue, j.SeenAt, now)
		if first {
			d.joinFirst = d.joinDue.Add(-d.cfg.SettleWindow)
		}
	}
	return d.Due()
}

// rejoinDue is when the pending joins are to be grown back in: at the end
// of their settle window, or, while a slot lost together with a joined one
// has not joined, RejoinWait after the first join (whichever is later).
func (d *Decider) rejoinDue() time.Time {
	if d.joinDue.IsZero() {
		return d.joinDue
	}
	for g := range d.joins {
		e, ok := d.lostIn[g]
		if !ok {
			continue
		}
		for h, eh := range d.lostIn {
			if _, joined := d.joins[h]; eh == e && !joined && !d.current.Alive(h) {
				if t := d.joinFirst.Add(d.cfg.RejoinWait); t.After(d.joinDue) {
					return t
				}
				return d.joinDue
			}
		}
	}
	return d.joinDue
}

// Joined records that newcomer g finished joining the group of grow epoch
// epoch. News of an epoch not adopted yet (the newcomer was quicker than
// this agent's view of the board) is kept until that epoch is; news of an
// older epoch is stale and dropped.
func (d *Decider) Joined(epoch, g int) { d.news(epoch, g) }

// Complete records that every rank of epoch epoch has moved to its group:
// a grow is done, and survivors go on from its group. News of an epoch not
// adopted yet is kept until it is.
func (d *Decider) Complete(epoch int) { d.news(epoch, -1) }

// news applies a Joined (g ≥ 0) or Complete (g < 0) of epoch to the
// current epoch, or keeps it for a later one.
func (d *Decider) news(epoch, g int) {
	switch {
	case epoch > d.current.Number:
		d.early = append(d.early, [2]int{epoch, g})
	case epoch < d.current.Number:
	case g < 0:
		d.complete = true
		clear(d.awaiting)
		for g := range d.joins {
			if d.current.Alive(g) {
				delete(d.joins, g) // a newcomer's second offer, not needed
			}
		}
		if len(d.joins) == 0 {
			d.joinDue = time.Time{}
		}
	default:
		delete(d.awaiting, g)
	}
}

// Awaiting returns the newcomers of the current grow epoch that have not
// finished joining, sorted.
func (d *Decider) Awaiting() []int { return sortedKeys(d.awaiting) }

// GrowOverdue reports whether the current epoch is a grow that has not
// completed within its GrowTimeout by now.
func (d *Decider) GrowOverdue(now time.Time) bool {
	due := d.growDue()
	return !due.IsZero() && !now.Before(due)
}

// growDue is when the current grow, if it is not complete, is given up
// (zero when there is none).
func (d *Decider) growDue() time.Time {
	if d.complete {
		return time.Time{}
	}
	return d.current.DecidedAt.Add(d.cfg.GrowTimeout)
}

// Due returns when Decide is next due, zero when nothing is pending: the
// failures' settle window, the current grow's GrowTimeout, or (once the
// current epoch is complete) the joins' settle window, whichever ends
// first.
func (d *Decider) Due() time.Time {
	due := d.due
	earliest := func(t time.Time) {
		if !t.IsZero() && (due.IsZero() || t.Before(due)) {
			due = t
		}
	}
	earliest(d.growDue())
	if d.complete {
		earliest(d.rejoinDue())
	}
	return due
}

// Stalls reports whether what is pending holds the group up: failed ranks
// not yet excluded (the survivors wait on them in their collectives), or a
// grow not complete. Slots offered to grow back in alone do not: the group
// runs on without them, and the newcomers wait for a grow, their own
// timeouts bounding the wait. Only what stalls is given up on
// (Coordinator's AgreementTimeout): a restart of every rank for a newcomer
// that no leader let in in time would cost the job what heal is for.
func (d *Decider) Stalls() bool { return len(d.pending) > 0 || !d.complete }

// Pending returns the global ranks reported and not yet excluded, sorted.
func (d *Decider) Pending() []int { return sortedKeys(d.pending) }

// Outstanding says what is still to be decided, for the message of an
// agreement given up: the failed ranks pending, the current grow while it
// is not complete (the newcomers that have not joined it, or, all of them
// in, the acknowledgements of the others that its Complete waits for),
// and the slots offered to grow back in; "" when nothing is. Due waits on
// each of them, and a give-up that named only the first two read
// "failed ranks [] (newcomers [] awaited)" when it was a grow's last
// acknowledgements, or a grow not decided, that nobody saw to in time.
func (d *Decider) Outstanding() string {
	var out []string
	if len(d.pending) > 0 {
		out = append(out, fmt.Sprintf("failed ranks %v", d.Pending()))
	}
	if !d.complete {
		g := fmt.Sprintf("the grow of epoch %d (slots %v), not complete", d.current.Number, d.current.Added)
		if a := d.Awaiting(); len(a) > 0 {
			g += fmt.Sprintf(": newcomers %v have not joined", a)
		} else {
			g += ": every newcomer joined, not every rank has acknowledged it"
		}
		out = append(out, g)
	}
	if len(d.joins) > 0 {
		out = append(out, fmt.Sprintf("slots %v offered to grow back in", sortedKeys(d.joins)))
	}
	return strings.Join(out, "; ")
}

func sortedKeys[V any](m map[int]V) []int {
	out := make([]int, 0, len(m))
	for g := range m {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// Decide returns the next epoch once one is due (ok false while nothing
// is). Failures come first: once their settle window has passed, or the
// current grow's GrowTimeout has without it completing, the epoch is a
// shrink that excludes every pending rank, ActionRestart if fewer than
// MinWorldSize ranks (or none) would remain. Its survivors move from the current
// epoch's group, unless that is a grow that did not complete: then they go
// on from the group they had before it (its Base), and the epoch excludes
// the grow's newcomers too, who never made a working group (they may join
// again). Otherwise, once the joins' settle window has passed and the
// current epoch is complete, it is a grow that brings back every slot
// offered. An error means no epoch can be formed from the pending news
// (no live rank left to exclude, or none to add).
func (d *Decider) Decide(now time.Time) (next Epoch, ok bool, err error) {
	growDue := d.growDue()
	overdue := !growDue.IsZero() && !now.Before(growDue)
	if (!d.due.IsZero() && !now.Before(d.due)) || overdue {
		exclude := maps.Clone(d.pending)
		base := d.current.Number
		if !d.complete {
			base = d.current.Base
			for _, g := range d.current.Added {
				if _, failed := exclude[g]; failed {
					continue
				}
				exclude[g] = d.newcomerOut(g, overdue, now)
			}
		}
		next, err = d.current.next(exclude, d.cfg.MinWorldSize, base, d.name, now)
		if err != nil {
			return Epoch{}, false, err
		}
		return next, true, nil
	}
	if due := d.rejoinDue(); d.complete && !due.IsZero() && !now.Before(due) {
		next, err = d.current.grow(sortedKeys(d.joins), d.name, now)
		if err != nil {
			return Epoch{}, false, err
		}
		return next, true, nil
	}
	return Epoch{}, false, nil
}

// newcomerOut is why newcomer g of the current, incomplete grow is
// excluded: the grow ran out of GrowTimeout, or a failure ended it first
// (the newcomer may have been on time; it is told so, not blamed).
func (d *Decider) newcomerOut(g int, overdue bool, now time.Time) string {
	e := d.current.Number
	switch {
	case overdue && d.awaiting[g]:
		return fmt.Sprintf("newcomer in slot %d did not finish joining the group of epoch %d within %v", g, e, d.cfg.GrowTimeout)
	case overdue:
		return fmt.Sprintf("the grow of epoch %d did not complete within %v", e, d.cfg.GrowTimeout)
	case d.awaiting[g]:
		return fmt.Sprintf("a failure ended the grow of epoch %d %v after it began, before newcomer in slot %d had joined",
			e, now.Sub(d.current.DecidedAt).Round(time.Millisecond), g)
	default:
		return fmt.Sprintf("a failure ended the grow of epoch %d before it completed", e)
	}
}

// Adopt makes e, the epoch the board now holds, current. Pending reports
// of ranks e excluded are settled; reports of ranks still alive in e stay
// pending (they arrived after the decision, or a rival coordinator did not
// know of them) with their original due time. Joins of slots e brought
// back are settled; a grow's newcomers are awaited until GrowTimeout after
// its decision.
func (d *Decider) Adopt(e Epoch) {
	if e.Number < d.current.Number || (e.Number == d.current.Number && d.current.Ranks != nil) {
		return // stale, or adopted already: never go back
	}
	for g := range e.Ranks {
		// Out of the first epoch adopted: excluded then at the latest.
		if !e.Alive(g) && (d.current.Ranks == nil || d.current.Alive(g)) {
			d.excludedIn[g] = e.Number
		}
	}
	d.current = e
	for g := range d.pending {
		// Kept while the rank is in e and some report of it is still
		// current (not from a node e cut off).
		keep := false
		for _, r := range d.pendingBy[g] {
			keep = keep || !d.stale(r, g)
		}
		if !e.Alive(g) || !keep {
			delete(d.pending, g)
			delete(d.pendingBy, g)
		}
	}
	if len(d.pending) == 0 {
		d.due = time.Time{}
	}
	d.complete = e.Action != ActionGrow
	clear(d.awaiting)
	for _, g := range e.Added {
		d.awaiting[g] = true
		d.addedIn[g] = e.Number
	}
	early := d.early
	d.early = nil
	for _, n := range early {
		d.news(n[0], n[1])
	}
	for g := range d.joins {
		if e.Alive(g) {
			delete(d.joins, g)
		}
	}
	if len(d.joins) == 0 {
		d.joinDue, d.joinFirst = time.Time{}, time.Time{}
	}
	for _, g := range e.Excluded {
		d.lostIn[g] = e.Number
	}
	for g := range d.lostIn {
		if e.Alive(g) {
			delete(d.lostIn, g)
		}
	}
}
