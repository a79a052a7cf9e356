package shrink

import (
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
}

// Defaults of Config.
const (
	DefaultSettleWindow = 100 * time.Millisecond
	DefaultMinWorldSize = 1
)

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{SettleWindow: DefaultSettleWindow, MinWorldSize: DefaultMinWorldSize}
}

func (c Config) withDefaults() Config {
	c.SettleWindow = max(c.SettleWindow, 0)
	if c.MinWorldSize < 1 {
		c.MinWorldSize = DefaultMinWorldSize
	}
	return c
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
}

// NewDecider returns a decider for the coordinator called name, starting
// from current.
func NewDecider(name string, cfg Config, current Epoch) *Decider {
	return &Decider{cfg: cfg.withDefaults(), name: name, current: current, pending: map[int]string{}}
}

// Current returns the epoch the decider builds on.
func (d *Decider) Current() Epoch { return d.current }

// Report records r, received at now. Ranks already lost, or out of range,
// are ignored. It returns when Decide is due (zero when nothing is pending).
func (d *Decider) Report(now time.Time, r Report) time.Time {
	seen := r.SeenAt
	if seen.IsZero() || seen.After(now) {
		seen = now
	}
	added := false
	for _, g := range r.Ranks {
		if !d.current.Alive(g) {
			continue
		}
		if _, dup := d.pending[g]; !dup {
			d.pending[g] = r.Reason
			added = true
		}
	}
	if added {
		if due := seen.Add(d.cfg.SettleWindow); d.due.IsZero() || due.Before(d.due) {
			d.due = due
		}
	}
	return d.due
}

// Due returns when Decide is due, zero when nothing is pending.
func (d *Decider) Due() time.Time { return d.due }

// Pending returns the global ranks reported and not yet excluded, sorted.
func (d *Decider) Pending() []int {
	out := make([]int, 0, len(d.pending))
	for g := range d.pending {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// Decide returns the next epoch once the settle window has passed: every
// pending rank excluded, ActionRestart if fewer than MinWorldSize ranks
// would remain. ok is false while nothing is due. An error means no epoch
// can be formed (every rank failed): the job cannot continue by shrinking.
func (d *Decider) Decide(now time.Time) (next Epoch, ok bool, err error) {
	if d.due.IsZero() || now.Before(d.due) {
		return Epoch{}, false, nil
	}
	next, err = d.current.next(d.pending, d.cfg.MinWorldSize, d.name, now)
	if err != nil {
		return Epoch{}, false, err
	}
	return next, true, nil
}

// Adopt makes e, the epoch the board now holds, current. Pending reports
// of ranks e excluded are settled; reports of ranks still alive in e stay
// pending (they arrived after the decision, or a rival coordinator did not
// know of them) with their original due time.
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
}
