package rendezvous

// Plans: what a member of a complete round needs to know of the others,
// in queue mode, without reading them.
//
// A launcher's plan for a round needs more than the node's own rank: the
// first global rank of its workers (the worker counts of every node ranked
// before it), the world size (every node's), where rank 0 is (MASTER_ADDR)
// and whether every node holds the same job secret. Read from the member
// list, that is O(N) bytes for each of N nodes every round: 152 KB each at
// 1,024 nodes, and most of a round's time. So whoever completes a round in
// queue mode computes it once, from the state it holds anyway, and each
// node reads its part with its share (dynamic_share.go): O(1) bytes.
//
// The rendezvous does not know what a node's data means: the caller says,
// through DynamicConfig.Describe, how much a node weighs (its worker
// count) and which check it shows (its job secret's). Every node of a run
// must give the same Describe (the same launcher), since any of them may
// be the one that completes the round.

import (
	"fmt"
	"slices"
)

// NodeTraits is what the plan of a round needs of one node's data.
type NodeTraits struct {
	// Weight is the node's share of the ranks (its worker count): a
	// member's Summary.Offset sums those ranked before it.
	Weight int
	// Check is a value every member must show alike (the job secret's
	// check); Summary.Dissent names the first that does not.
	Check string
}

// Summary is a complete round as one of its members needs it, computed
// once for the whole round by whoever completed it (queue mode, with
// DynamicConfig.Describe): Round.Summary.
type Summary struct {
	// Offset is the sum of the weights of the members ranked before this
	// one: the first global rank of its workers.
	Offset int
	// Total is the sum of every member's weight: the world size.
	Total int
	// First is the member of rank 0, with its data.
	First Member
	// Dissent is the first member, in rank order, whose check differs from
	// First's; nil when every member's agrees.
	Dissent *Member
}

// roundPlan is a round's plan as the state keeps it (the whole round's,
// with Offsets) and as a share carries it (the round-wide part, Offsets
// left out: each node's own offset is in its share entry). It is computed
// when the round completes and kept until the round ends: a member lost
// and another admitted in its place (Admit) leaves the ranks, and so the
// offsets, as they were.
type roundPlan struct {
	Round   int         `json:"round"`
	Total   int         `json:"total"`
	First   memberJSON  `json:"first"`
	Dissent *memberJSON `json:"dissent,omitempty"`
	// Offsets are by rank; in the state only.
	Offsets []int `json:"offsets,omitempty"`
}

// planOf computes the plan of round number round, whose members are given
// in rank order with no gap (members[i].Rank == i), as describe reads
// their data. It fails when a member's data cannot be described or the
// ranks have a gap: the nodes then read the members themselves.
func planOf(round int, members []Member, describe func([]byte) (NodeTraits, error)) (*roundPlan, error) {
	if len(members) == 0 {
		return nil, fmt.Errorf("round %d has no members", round)
	}
	p := &roundPlan{Round: round, Offsets: make([]int, len(members))}
	var first string
	for i, m := range members {
		if m.Rank != i {
			return nil, fmt.Errorf("round %d: member %s has rank %d at place %d", round, m.Node, m.Rank, i)
		}
		t, err := describe(m.Data)
		if err != nil {
			return nil, fmt.Errorf("round %d: member %s: %w", round, m.Node, err)
		}
		if t.Weight < 0 {
			return nil, fmt.Errorf("round %d: member %s weighs %d", round, m.Node, t.Weight)
		}
		p.Offsets[i] = p.Total
		p.Total += t.Weight
		switch {
		case i == 0:
			first = t.Check
			p.First = memberJSONOf(m)
		case p.Dissent == nil && t.Check != first:
			d := memberJSONOf(m)
			p.Dissent = &d
		}
	}
	return p, nil
}

// summary returns the Summary of the member of rank rank, or nil when
// the plan has no offset for it.
func (p *roundPlan) summary(rank int) *Summary {
	if p == nil || rank < 0 || rank >= len(p.Offsets) {
		return nil
	}
	return p.summaryAt(p.Offsets[rank])
}

// summaryAt returns the Summary of a member whose offset is offset.
func (p *roundPlan) summaryAt(offset int) *Summary {
	s := &Summary{Offset: offset, Total: p.Total, First: p.First.member()}
	if p.Dissent != nil {
		d := p.Dissent.member()
		s.Dissent = &d
	}
	return s
}

// shared is the plan as a share carries it: without the offsets.
func (p *roundPlan) shared() *roundPlan {
	if p == nil {
		return nil
	}
	c := *p
	c.Offsets = nil
	return &c
}

func memberJSONOf(m Member) memberJSON {
	return memberJSON{NodeDesc: m.Node, Rank: m.Rank, Data: slices.Clone(m.Data), Late: m.Late}
}

func (m memberJSON) member() Member {
	return Member{Node: m.NodeDesc, Rank: m.Rank, Data: slices.Clone(m.Data), Late: m.Late}
}

// planRound gives st, about to be written in queue mode, the plan of its
// round: kept while the round it was made for is complete, made anew from
// its members when the round has just completed, dropped otherwise. A
// round whose members cannot be planned (a Describe error: a node with
// other data) gets none, and its nodes read the members.
func planRound(st *dynState, describe func([]byte) (NodeTraits, error)) {
	switch {
	case !st.Complete || describe == nil:
		st.Plan = nil
	case st.Plan != nil && st.Plan.Round == st.Round:
	default:
		st.Plan = nil
		var members []Member
		for _, e := range st.Nodes {
			if !e.Waiting {
				members = append(members, Member{Node: e.NodeDesc, Rank: e.Rank, Data: e.Data, Late: e.Late})
			}
		}
		slices.SortFunc(members, func(a, b Member) int { return a.Rank - b.Rank })
		if p, err := planOf(st.Round, members, describe); err == nil {
			st.Plan = p
		}
	}
}
