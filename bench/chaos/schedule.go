package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// Kind is a kind of fault the schedule brings.
type Kind string

// The fault kinds. Rank faults hit one worker; host faults need several
// hosts (-hosts 2 or more).
const (
	// RankKill SIGKILLs a rank: its connections are reset at once.
	RankKill Kind = "rank-kill"
	// RankExit makes a rank exit non-zero of its own accord: it gets
	// SIGTERM, on which examples/allreduce ends between steps with exit
	// code 1 (a failed step, as a Python exception would).
	RankExit Kind = "rank-exit"
	// RankHang SIGSTOPs a rank: its peers see no error, only silence;
	// gorun finds it by its missing heartbeats (--heartbeat-timeout),
	// torchrun only when a peer's collective times out.
	RankHang Kind = "rank-hang"
	// AgentKill SIGKILLs a host's agent, its workers dying with it, and
	// starts a replacement agent on that host.
	AgentKill Kind = "agent-kill"
	// TwoRanks SIGKILLs two ranks at the same moment: two faults at once,
	// by design (the settle window must make them one epoch).
	TwoRanks Kind = "two-ranks"
	// LinkCut cuts a host off the network (its bridge port blackholed:
	// its peers see silence, not resets) and heals the link some seconds
	// later (-cut-for); the host's agent and workers live on through it.
	LinkCut Kind = "link-cut"
	// SpareKill SIGKILLs the hot spare's agent (the spare row's extra
	// host), its pre-started workers dying with it: a spare lost while it
	// stands by. A replacement spare starts on that host, as after an
	// agent kill. Rows without a spare skip it.
	SpareKill Kind = "spare-kill"
	// CoordinatorLost SIGKILLs host 0's agent, the first of the job and
	// the survivors' coordinator, its workers dying with it, and starts a
	// replacement agent there, as after an agent kill: the agreement must
	// fail over to a survivor. It needs the etcd backend (with c10d host
	// 0 holds the store, and losing it ends the job, as torchrun's does),
	// and the job's witness is then the last host, not host 0.
	CoordinatorLost Kind = "coordinator-lost"
	// GrowKill SIGKILLs a rank and then, the moment its respawn says it
	// is a newcomer (a grow is under way), another rank: a fault during a
	// grow. Where no newcomer comes within growKillWait (restart rows),
	// the second kill strikes during the recovery all the same.
	GrowKill Kind = "grow-kill"
)

// rankKinds are the default kinds: one rank each, which a one-host run can
// bring.
var rankKinds = []Kind{RankKill, RankExit, RankHang}

// allKinds are the kinds the harness knows, in a fixed order.
var allKinds = []Kind{RankKill, RankExit, RankHang, AgentKill, TwoRanks, GrowKill, LinkCut, SpareKill, CoordinatorLost}

// growKillWait bounds how long a GrowKill waits for the newcomer before
// its second kill.
const growKillWait = 5 * time.Second

// hostFault reports whether k strikes a host, not one rank.
func (k Kind) hostFault() bool {
	return k == AgentKill || k == LinkCut || k == SpareKill || k == CoordinatorLost
}

// ScheduleConfig is what a schedule is drawn from.
type ScheduleConfig struct {
	// Seed makes the schedule: the same seed and config give the same
	// faults, so every row of a run replays the same schedule.
	Seed uint64
	// MTBF is the mean time between failures: the gaps are exponential
	// with this mean (failures as a Poisson process), no shorter than
	// MinGap. Default 30 s.
	MTBF time.Duration
	// MinGap is the shortest gap between two faults, and the first fault
	// comes no earlier than MinGap after the start: one fault's recovery
	// is measured before the next lands (overlapping faults are a kind of
	// their own, not an accident of the draw). Default MTBF / 5.
	MinGap time.Duration
	// Horizon bounds the schedule: no fault at or after it. A run that
	// finishes its steps sooner leaves the rest unused.
	Horizon time.Duration
	// Kinds are drawn uniformly for each fault. Default: the rank kinds.
	Kinds []Kind
	// World is the ranks a rank fault's target is drawn from (launch
	// ranks 0..World-1); Hosts the hosts an agent kill's or a link cut's
	// is drawn from, host 0 (with c10d it holds the store: losing it is
	// CoordinatorLost) and the witness excepted; a coordinator-lost's is
	// host 0, a spare-kill's host Hosts, the bed's extra host, where the
	// spare row's spare runs.
	World, Hosts int
}

// Witness is the host whose agent witnesses the job: never a fault's
// target, its exit code the job's, its resources the ones sampled. Host 0,
// unless the coordinator's host may be lost: then the last.
func (c ScheduleConfig) Witness() int {
	if slices.Contains(c.Kinds, CoordinatorLost) {
		return max(c.Hosts-1, 0)
	}
	return 0
}

// hostTargets are the hosts an agent kill or a link cut may strike.
func (c ScheduleConfig) hostTargets() []int {
	var out []int
	for h := 1; h < c.Hosts; h++ {
		if h != c.Witness() {
			out = append(out, h)
		}
	}
	return out
}

// withDefaults fills in the documented defaults.
func (c ScheduleConfig) withDefaults() ScheduleConfig {
	if c.MTBF == 0 {
		c.MTBF = 30 * time.Second
	}
	if c.MinGap == 0 {
		c.MinGap = c.MTBF / 5
	}
	if len(c.Kinds) == 0 {
		c.Kinds = rankKinds
	}
	if c.Hosts == 0 {
		c.Hosts = 1
	}
	return c
}

// Fault is one fault of a schedule: at At after the job starts, Kind on
// Target (a launch rank, or a host for a host fault).
type Fault struct {
	At     time.Duration
	Kind   Kind
	Target int
}

func (f Fault) String() string {
	what := "rank"
	if f.Kind.hostFault() {
		what = "host"
	}
	return fmt.Sprintf("%v %s %s %d", f.At.Round(time.Millisecond), f.Kind, what, f.Target)
}

// ErrSchedule: a schedule config that cannot be drawn from.
var ErrSchedule = errors.New("bad schedule")

// NewSchedule draws the faults of c, in time order. It is pure: no clock,
// no process, the same faults for the same c.
func NewSchedule(c ScheduleConfig) ([]Fault, error) {
	c = c.withDefaults()
	switch {
	case c.MTBF < 0 || c.MinGap < 0 || c.MinGap > c.MTBF:
		return nil, fmt.Errorf("%w: MTBF %v, MinGap %v: want 0 ≤ MinGap ≤ MTBF", ErrSchedule, c.MTBF, c.MinGap)
	case c.Horizon <= 0:
		return nil, fmt.Errorf("%w: Horizon %v must be positive", ErrSchedule, c.Horizon)
	case c.World < 1:
		return nil, fmt.Errorf("%w: World %d must be at least 1", ErrSchedule, c.World)
	}
	for _, k := range c.Kinds {
		if !slices.Contains(allKinds, k) {
			return nil, fmt.Errorf("%w: unknown fault kind %q", ErrSchedule, k)
		}
		switch {
		case k.hostFault() && c.Hosts < 2:
			return nil, fmt.Errorf("%w: %s needs 2 or more hosts (host 0 is never the target)", ErrSchedule, k)
		case (k == AgentKill || k == LinkCut) && len(c.hostTargets()) == 0:
			return nil, fmt.Errorf("%w: %s with %s needs 3 or more hosts (host 0 is %s's target, host %d the witness)",
				ErrSchedule, k, CoordinatorLost, CoordinatorLost, c.Witness())
		}
	}
	targets := c.hostTargets()
	// PCG with the seed in both words: a fixed, documented generator, so
	// that a seed means the same schedule in every Go release.
	rng := rand.New(rand.NewPCG(c.Seed, c.Seed^0x9e3779b97f4a7c15))
	var out []Fault
	// The gap beyond MinGap is exponential with mean MTBF − MinGap, so
	// that the mean gap is MTBF.
	extra := float64(c.MTBF - c.MinGap)
	for at := time.Duration(0); ; {
		at += c.MinGap + time.Duration(rng.ExpFloat64()*extra)
		if at >= c.Horizon {
			return out, nil
		}
		f := Fault{At: at, Kind: c.Kinds[rng.IntN(len(c.Kinds))]}
		if f.Kind.hostFault() {
			// One draw for every host fault, whatever its target, so
			// that adding a kind leaves the draws of the others as
			// they were; a second, uniform over the targets, only
			// where the witness took a host out of the first's range.
			i := rng.IntN(c.Hosts - 1)
			switch f.Kind {
			case SpareKill:
				f.Target = c.Hosts // the spare's: the bed's extra host
			case CoordinatorLost:
				f.Target = 0
			default:
				if i >= len(targets) {
					i = rng.IntN(len(targets))
				}
				f.Target = targets[i]
			}
		} else {
			f.Target = rng.IntN(c.World)
		}
		out = append(out, f)
	}
}

// ParseKinds reads a comma-separated list of fault kinds.
func ParseKinds(s []string) ([]Kind, error) {
	var out []Kind
	for _, f := range s {
		k := Kind(f)
		if !slices.Contains(allKinds, k) {
			return nil, fmt.Errorf("%w: unknown fault kind %q (want one of %v)", ErrSchedule, f, allKinds)
		}
		out = append(out, k)
	}
	return out, nil
}
