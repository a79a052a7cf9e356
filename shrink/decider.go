package shrink

import (
	"fmt"
	"maps"
	"slices"
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
}

// Defaults of Config.
const (
	DefaultSettleWindow = 100 * time.Millisecond
	DefaultMinWorldSize = 1
	DefaultGrowTimeout  = 30 * time.Second
)

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{SettleWindow: DefaultSettleWindow, MinWorldSize: DefaultMinWorldSize, GrowTimeout: DefaultGrowTimeout}
}

func (c Config) withDefaults() Config {
	c.SettleWindow = max(c.SettleWindow, 0)
	if c.MinWorldSize < 1 {
		c.MinWorldSize = DefaultMinWorldSize
	}
	if c.GrowTimeout <= 0 {
		c.GrowTimeout = DefaultGrowTimeout
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
}

// Report is one agent's word that global ranks failed.
type Report struct {
	Ranks  []int     `json:"ranks"`
	Reason string    `json:"reason"`
	From   string    `json:"from,omitempty"`
	SeenAt time.Time `json:"seen_at"`
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
	// due is when the pending reports are to be decided: the earliest
	// pending report's SeenAt plus the settle window.
	due time.Time
	// joins are the lost slots offered by a Join, with who offered them;
	// joinDue is when they are to be decided, as due for failures.
	joins   map[int]string
	joinDue time.Time
	// awaiting are the newcomers of the current grow epoch that have not
	// finished joining, with the time they must have by (GrowTimeout).
	awaiting map[int]time.Time
	// early are Joined news (epoch, slot) of epochs not adopted yet.
	early [][2]int
}

// NewDecider returns a decider for the coordinator called name, starting
// from current.
func NewDecider(name string, cfg Config, current Epoch) *Decider {
	return &Decider{cfg: cfg.withDefaults(), name: name, current: current, pending: map[int]string{},
		joins: map[int]string{}, awaiting: map[int]time.Time{}}
}

// Current returns the epoch the decider builds on.
func (d *Decider) Current() Epoch { return d.current }

// Report records r, received at now. Ranks already lost, or out of range,
// are ignored. It returns when Decide is due (zero when nothing is pending).
func (d *Decider) Report(now time.Time, r Report) time.Time {
	if d.record(d.pending, r.Ranks, r.Reason, d.current.Alive) {
		d.settleBy(&d.due, r.SeenAt, now)
	}
	return d.due
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
// one epoch) and no earlier grow is still awaited. Slots alive in the
// current epoch, or out of range, are ignored. It returns Due.
func (d *Decider) Join(now time.Time, j Join) time.Time {
	lost := func(g int) bool { return g >= 0 && g < len(d.current.Ranks) && !d.current.Alive(g) }
	if d.record(d.joins, j.Slots, j.From, lost) {
		d.settleBy(&d.joinDue, j.SeenAt, now)
	}
	return d.Due()
}

// Joined records that newcomer g finished joining the group of grow epoch
// epoch: it is no longer awaited. News of an epoch not adopted yet (the
// newcomer was quicker than this agent's view of the board) is kept until
// that epoch is; news of an older epoch is stale and dropped.
func (d *Decider) Joined(epoch, g int) {
	switch {
	case epoch == d.current.Number:
		delete(d.awaiting, g)
	case epoch > d.current.Number:
		d.early = append(d.early, [2]int{epoch, g})
	}
}

// Awaiting returns the newcomers of the current grow epoch that have not
// finished joining, sorted.
func (d *Decider) Awaiting() []int { return sortedKeys(d.awaiting) }

// Due returns when Decide is next due, zero when nothing is pending: the
// failures' settle window, a newcomer's GrowTimeout, or (when no newcomer
// is awaited) the joins' settle window, whichever ends first.
func (d *Decider) Due() time.Time {
	due := d.due
	earliest := func(t time.Time) {
		if !t.IsZero() && (due.IsZero() || t.Before(due)) {
			due = t
		}
	}
	for _, t := range d.awaiting {
		earliest(t)
	}
	if len(d.awaiting) == 0 {
		earliest(d.joinDue)
	}
	return due
}

// Pending returns the global ranks reported and not yet excluded, sorted.
func (d *Decider) Pending() []int { return sortedKeys(d.pending) }

func sortedKeys[V any](m map[int]V) []int {
	out := make([]int, 0, len(m))
	for g := range m {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// Decide returns the next epoch once one is due (ok false while nothing
// is). Failures come first: once their settle window has passed, or a
// newcomer's GrowTimeout has, the epoch is a shrink that excludes every
// pending rank and every newcomer that has not finished joining (a grow
// that does not complete ends in a shrink; survivors never wait on it),
// ActionRestart if fewer than MinWorldSize ranks would remain. Otherwise,
// once the joins' settle window has passed and no newcomer is awaited, it
// is a grow that brings back every slot offered. An error means no epoch
// can be formed (every rank failed): the job cannot go on by shrinking.
func (d *Decider) Decide(now time.Time) (next Epoch, ok bool, err error) {
	expired := false
	for _, t := range d.awaiting {
		expired = expired || !now.Before(t)
	}
	if (!d.due.IsZero() && !now.Before(d.due)) || expired {
		exclude := maps.Clone(d.pending)
		for g := range d.awaiting {
			if _, failed := exclude[g]; !failed {
				exclude[g] = fmt.Sprintf("newcomer in slot %d did not finish joining the group of epoch %d within %v",
					g, d.current.Number, d.cfg.GrowTimeout)
			}
		}
		next, err = d.current.next(exclude, d.cfg.MinWorldSize, d.name, now)
		if err != nil {
			return Epoch{}, false, err
		}
		return next, true, nil
	}
	if len(d.awaiting) == 0 && !d.joinDue.IsZero() && !now.Before(d.joinDue) {
		next, err = d.current.grow(sortedKeys(d.joins), d.name, now)
		if err != nil {
			return Epoch{}, false, err
		}
		return next, true, nil
	}
	return Epoch{}, false, nil
}

// Adopt makes e, the epoch the board now holds, current. Pending reports
// of ranks e excluded are settled; reports of ranks still alive in e stay
// pending (they arrived after the decision, or a rival coordinator did not
// know of them) with their original due time. Joins of slots e brought
// back are settled, and its newcomers are awaited until GrowTimeout after
// its decision; newcomers it excluded are awaited no more.
func (d *Decider) Adopt(e Epoch) {
	if e.Number < d.current.Number {
		return // stale: never go back
	}
	d.current = e
	for g := range d.pending {
		if !e.Alive(g) {
			delete(d.pending, g)
		}
	}
	if len(d.pending) == 0 {
		d.due = time.Time{}
	}
	for g := range d.awaiting {
		if !e.Alive(g) {
			delete(d.awaiting, g)
		}
	}
	for _, g := range e.Added {
		d.awaiting[g] = e.DecidedAt.Add(d.cfg.GrowTimeout)
	}
	early := d.early[:0]
	for _, j := range d.early {
		switch {
		case j[0] == e.Number:
			delete(d.awaiting, j[1])
		case j[0] > e.Number:
			early = append(early, j)
		}
	}
	d.early = early
	for g := range d.joins {
		if e.Alive(g) {
			delete(d.joins, g)
		}
	}
	if len(d.joins) == 0 {
		d.joinDue = time.Time{}
	}
}
