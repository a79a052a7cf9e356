// Package shrink is survivor agreement and heal: when ranks of a running
// job fail, every survivor must act on the same exclusion list at the same
// point; when lost slots come back (a respawned rank, a replacement node,
// a spare), every member must take the newcomers in at the same point.
//
// The agreement has five parts:
//
//   - Decider, a pure state machine run by one coordinator agent: it gathers
//     failure reports for a settle window, so that near-simultaneous failures
//     become one epoch, and then decides the next Epoch — shrink to the
//     survivors, or fall back to a restart when too few would remain. It
//     gathers joins the same way and decides grow epochs, one at a time: a
//     grow is complete once every rank of it has arrived; one that is not
//     within GrowTimeout, or a failure during it, ends in a shrink back to
//     the group before it (Epoch.Base).
//   - Board, the epochs' home in the worker store: the coordinator publishes
//     epoch n+1 with one fenced write (a compare-set that only creates), so a
//     second coordinator racing it adopts the first's decision instead of
//     publishing another; workers wait on the epoch key (a store wait, not
//     polling) and acknowledge; the last to acknowledge a grow says it is
//     complete. Its notice log carries failures, joins and completions.
//   - Coordinator, each agent's side: it files the failures its agent sees
//     on the Board, and while its agent leads, runs the Decider over every
//     notice filed and publishes the epochs it decides.
//   - Follower, a Go worker's side: it watches the Board for the next
//     epoch, aborts the worker's group so that a collective blocked on a
//     dead peer returns (and, for a grow, so that every member stops where
//     it is), moves the group to the epoch's members — shrink, grow or
//     re-form — and acknowledges (examples/torch/gorun_ft.py does the same
//     for PyTorch).
//   - Newcomer, a worker that fills a lost slot: it files its join once it is
//     ready, waits for the grow epoch that adds its slot, joins the grown
//     group and becomes a Follower.
//
// The coordinator is chosen deterministically (the first live agent in the
// rendezvous's order), and since notices live on the Board, not in the
// coordinator's memory, a successor picks up where a dead coordinator left.
//
// The worker store is reachable by anyone who reaches its port. With a job
// secret every agent and worker authenticates the Board (Auth): epochs and
// notices carry an HMAC-SHA256 bound to the job's round and to their key,
// and a record without a valid one — forged, or a genuine one replayed
// from another key or round — is never acted on, and never waited on once
// the genuine one is there; each is reported once and counted.
//
// Ranks in an Epoch are global ranks, the numbering the job was launched
// with (a newcomer keeps its slot's); Epoch.ShrinkList translates them into
// the group-relative ranks that pg.ProcessGroup.Shrink (and PyTorch's
// shrink_group) take.
package shrink

import (
	"fmt"
	"slices"
	"strconv"
	"time"
)

// Action is what survivors do in an epoch.
type Action string

const (
	// ActionShrink: survivors abort their group, shrink it to the survivors
	// and carry on; the excluded ranks are not restarted.
	ActionShrink Action = "shrink"
	// ActionRestart: shrinking cannot work (too few survivors, or the
	// agreement could not finish); the launcher restarts the whole group,
	// torchrun's way.
	ActionRestart Action = "restart"
	// ActionGrow: newcomers fill launch slots lost earlier (a respawned
	// rank, a replacement node, a spare); survivors keep their ranks and
	// grow their group to take them in, never restarted.
	ActionGrow Action = "grow"
)

// Epoch is one agreed membership of the job. Epoch 0 is the group as it was
// launched; each later epoch removes at least one rank (a shrink, or a
// restart) or brings back at least one lost launch slot (a grow).
type Epoch struct {
	Number int `json:"epoch"`
	// Excluded are the global ranks this epoch removes, sorted.
	Excluded []int `json:"excluded"`
	// Lost are all global ranks removed so far, this epoch's included,
	// sorted.
	Lost []int `json:"lost"`
	// Added are the global ranks (launch slots) this epoch grows back in,
	// sorted: the newcomers fill them, each keeping the slot's global
	// rank for its data and its name.
	Added []int `json:"added,omitempty"`
	// Ranks[g] is global rank g's rank in this epoch's group, -1 while
	// lost: dense. A shrink keeps the survivors' order (pg.Survivors'
	// renumbering); a grow keeps every survivor's rank and appends the
	// newcomers in slot order.
	Ranks []int `json:"ranks"`
	// WorldSize is the number of ranks left.
	WorldSize int `json:"world_size"`
	// Action is what survivors do.
	Action Action `json:"action"`
	// Base is the epoch whose group the survivors move from: the one
	// before, unless that was a grow that did not complete (not every
	// rank of it acknowledged it), in which case it is that grow's own
	// base — its newcomers never made a working group, so survivors go on
	// from the group they had, and this epoch excludes the newcomers.
	Base int `json:"base"`
	// Reasons says why each excluded rank was excluded, by global rank.
	Reasons map[int]string `json:"reasons,omitempty"`
	// Coordinator names the agent that decided the epoch.
	Coordinator string `json:"coordinator,omitempty"`
	// DecidedAt is when the coordinator decided.
	DecidedAt time.Time `json:"decided_at"`
}

// Initial returns epoch 0 of a job of world ranks.
func Initial(world int) Epoch {
	ranks := make([]int, world)
	for g := range ranks {
		ranks[g] = g
	}
	return Epoch{Number: 0, Excluded: []int{}, Lost: []int{}, Ranks: ranks, WorldSize: world, Action: ActionShrink}
}

// Alive reports whether global rank g is in e's group.
func (e Epoch) Alive(g int) bool { return g >= 0 && g < len(e.Ranks) && e.Ranks[g] >= 0 }

// next returns the epoch after e that excludes the global ranks in exclude
// (already-lost ranks are ignored), with survivors moving from the group of
// epoch base. minWorld (at least 1) is the floor below which the epoch's
// action is a restart instead of a shrink.
func (e Epoch) next(exclude map[int]string, minWorld, base int, coordinator string, now time.Time) (Epoch, error) {
	n := Epoch{
		Number:      e.Number + 1,
		Base:        base,
		Ranks:       slices.Clone(e.Ranks),
		Reasons:     map[int]string{},
		Coordinator: coordinator,
		DecidedAt:   now,
		Lost:        slices.Clone(e.Lost),
	}
	for g, why := range exclude {
		if !e.Alive(g) {
			continue
		}
		n.Excluded = append(n.Excluded, g)
		n.Reasons[g] = why
	}
	if len(n.Excluded) == 0 {
		return Epoch{}, fmt.Errorf("shrink: epoch %d: no live rank to exclude", n.Number)
	}
	slices.Sort(n.Excluded)
	n.Lost = append(n.Lost, n.Excluded...)
	slices.Sort(n.Lost)
	// Survivors keep their order: by their rank in e, which after a grow
	// is not the slot order.
	order := make([]int, 0, len(n.Ranks))
	for g := range n.Ranks {
		if e.Alive(g) && !slices.Contains(n.Excluded, g) {
			order = append(order, g)
		}
		n.Ranks[g] = -1
	}
	slices.SortFunc(order, func(a, b int) int { return e.Ranks[a] - e.Ranks[b] })
	next := 0
	for _, g := range order {
		n.Ranks[g] = next
		next++
	}
	n.WorldSize = next
	n.Action = ActionShrink
	if next < max(minWorld, 1) {
		// No survivors at all is a restart too, published like any
		// epoch: every agent learns it at once. It used to fail the
		// deciding coordinator alone, and the agents that decide nothing
		// (not leading) sat out their agreement timeout, 10 s, before the
		// job's restart could form (bench/chaos, two ranks struck while
		// the others were down).
		n.Action = ActionRestart
	}
	return n, nil
}

// grow returns the epoch after e that brings back the lost launch slots in
// add (slots alive in e, or out of range, are ignored): survivors keep
// their ranks, newcomers get the next ones in slot order.
func (e Epoch) grow(add []int, coordinator string, now time.Time) (Epoch, error) {
	n := Epoch{
		Number:      e.Number + 1,
		Excluded:    []int{},
		Ranks:       slices.Clone(e.Ranks),
		Coordinator: coordinator,
		DecidedAt:   now,
		Action:      ActionGrow,
		WorldSize:   e.WorldSize,
		Base:        e.Number,
	}
	for _, g := range add {
		if g >= 0 && g < len(e.Ranks) && !e.Alive(g) && !slices.Contains(n.Added, g) {
			n.Added = append(n.Added, g)
		}
	}
	if len(n.Added) == 0 {
		return Epoch{}, fmt.Errorf("shrink: epoch %d: no lost slot to grow back", n.Number)
	}
	slices.Sort(n.Added)
	for _, g := range n.Added {
		n.Ranks[g] = n.WorldSize
		n.WorldSize++
	}
	for _, g := range e.Lost {
		if !slices.Contains(n.Added, g) {
			n.Lost = append(n.Lost, g)
		}
	}
	if n.Lost == nil {
		n.Lost = []int{}
	}
	return n, nil
}

// Newcomer reports whether global rank g joins the group in e (a slot e
// grows back in): it has no group of its own to grow from.
func (e Epoch) Newcomer(g int) bool { return slices.Contains(e.Added, g) }

// ShrinkList returns the ranks that move a survivor from base's group to
// e's: the ranks alive in base and not in e, in base's numbering, sorted —
// the list to pass to pg.ProcessGroup.Shrink or PyTorch's shrink_group.
// base is e's Base (for a shrink after a shrink, the epoch before e).
func (e Epoch) ShrinkList(base Epoch) []int {
	var out []int
	for g := range base.Ranks {
		if base.Alive(g) && !e.Alive(g) {
			out = append(out, base.Ranks[g])
		}
	}
	slices.Sort(out)
	return out
}

// Namespace is where the ranks of epoch n form its group in the worker
// store when they form a fresh one (a grow, or a re-forming after a grow
// that did not complete): fresh for every epoch, and the same for every
// rank, whichever group it comes from.
func Namespace(n int) string { return "gorun/epoch/" + strconv.Itoa(n) }

func (e Epoch) String() string {
	if e.Action == ActionGrow {
		return fmt.Sprintf("epoch %d (%s): added %v, world %d", e.Number, e.Action, e.Added, e.WorldSize)
	}
	return fmt.Sprintf("epoch %d (%s): excluded %v, world %d", e.Number, e.Action, e.Excluded, e.WorldSize)
}
