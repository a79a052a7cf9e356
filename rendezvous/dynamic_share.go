package rendezvous

// Shares: what a node reads of the state in queue mode (runs of
// DynamicConfig.QueueMinNodes or more on a store with queues).
//
// The state holds every node (O(N) bytes). If every node read it at every
// wake-up, a round would cost O(N²) bytes read and decoded: at 1,024 nodes
// that decoding was 70% of the CPU, and 10,000 nodes would decode about
// 20 GB. So whoever writes the state (the folder, or a node that
// compare-sets it directly: Leave, SetClosed, Admit, Status) also
// publishes, beside it:
//
//   - the marker "<state>/marker": the state's header (round, complete,
//     closed, last call, size, the wake-up and batch numbers, the counts
//     of participants, waiting and late nodes), rewritten by every write
//     that changes it;
//   - the shares "<state>/share/<b>": bucket b's nodes (a node's bucket is
//     a hash of its identity; about shareBucketNodes nodes a bucket), each
//     with its role, rank, late flag and call, without its data; a bucket
//     is rewritten only when one of its nodes changes other than by a
//     heartbeat (every bucket when a round completes: the ranks);
//   - the members "<state>/members": the last round to complete, every
//     member with its data, once per round.
//
// A node in Next reads the marker and its own bucket (a view: O(1) bytes)
// and decides on them with the same operations as on the state
// (dynamic.go); only the folder reads the state. Next hands out the node's
// share of the round (Round.Number, Rank, Size, Late, and with
// DynamicConfig.Describe its Summary: dynamic_plan.go) and, unless
// DynamicConfig.ShareOnly, the members (one read of the members key per
// round: O(N) bytes). Status reads the marker, and the state only when the
// marker shows a change of the round (a member gone, a node admitted or
// waiting, the run closed).
//
// The state stays the one truth: a view is only ever read, and everything
// written is decided on the state by whoever writes it. A view older than
// the state (a publisher that died midway, two publishers crossing) makes a
// node wait longer or queue a request again, never take a wrong round: its
// round comes from its own bucket, which holds the call that put it there.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"sync"
	"time"
)

const (
	markerSuffix  = "/marker"
	membersSuffix = "/members"
	shareSuffix   = "/share/"
	// shareBucketNodes is about how many nodes share a bucket: what a
	// node reads at each look, whatever N.
	shareBucketNodes = 8
	// publishChunk bounds the keys of one MultiSet (etcd's --max-txn-ops
	// is 128 by default).
	publishChunk = 100
)

// marker is the state's header, as a node in queue mode reads it.
type marker struct {
	// Pub numbers the publications (dynState.Pub): a publisher does not
	// replace a later one's marker.
	Pub          uint64    `json:"pub"`
	Round        int       `json:"round"`
	Complete     bool      `json:"complete,omitzero"`
	Closed       bool      `json:"closed,omitzero"`
	Deadline     time.Time `json:"deadline,omitzero"`
	Size         int       `json:"size,omitzero"`
	Wake         uint64    `json:"wake"`
	Batch        uint64    `json:"batch,omitzero"`
	Participants int       `json:"participants"`
	Waiting      int       `json:"waiting,omitzero"`
	// Late counts the participants admitted into the complete round
	// (Admit): a change tells Status to look at the state.
	Late int `json:"late,omitzero"`
	// Expires is when the oldest heartbeat in the state expires: from
	// then on the state's next writer drops a node (sanitize). The
	// heartbeats' folds find it at their next fold; Status reads the
	// state itself only if none has started an interval after
	// (quickStatus).
	Expires time.Time `json:"expires,omitzero"`
	// Gone is whom the complete round lost: the state's Gone less the
	// members that left it to rejoin (dynState.Rejoin), who are counted
	// in Rejoining instead. A restart after a loss sends every survivor
	// through the wait list; named here, the marker grew with each (O(N)
	// at the end), and Status, finding nodes waiting, read the whole
	// state and the member list (511 survivors at once at 512 agents).
	Gone []NodeDesc `json:"gone,omitempty"`
	// Rejoining counts the complete round's members that left it to join
	// the next (the state's Gone and Rejoin both hold them).
	Rejoining int `json:"rejoining,omitzero"`
}

// shareEntry is a node's entry in its bucket: its nodeState without the
// data.
type shareEntry struct {
	NodeDesc
	Waiting   bool      `json:"waiting,omitzero"`
	Rank      int       `json:"rank,omitzero"`
	Late      bool      `json:"late,omitzero"`
	Call      uint64    `json:"call,omitzero"`
	Heartbeat time.Time `json:"heartbeat"`
	// Offset is one more than the participant's offset in the complete
	// round's plan (dynamic_plan.go); 0 for none.
	Offset int `json:"offset,omitzero"`
}

// shareValue is a share key's value: its bucket's nodes, and the round
// and completeness of the state it was written from. A node's view is
// only as good as its bucket is as new as the marker: a bucket older
// than the round's completion (two publishers crossing can leave one so)
// would show the node a participant with no rank yet (rank 0) in a
// complete round.
type shareValue struct {
	Round    int          `json:"round"`
	Complete bool         `json:"complete,omitzero"`
	Nodes    []shareEntry `json:"nodes"`
	// Plan is the round-wide part of the complete round's plan (no
	// offsets: each entry has its own), when it has one.
	Plan *roundPlan `json:"plan,omitempty"`
}

// shareBytes is the share value of nodes, a bucket of s.
func (s *dynState) shareBytes(nodes []shareEntry) ([]byte, error) {
	return json.Marshal(shareValue{Round: s.Round, Complete: s.Complete, Nodes: nodes, Plan: s.Plan.shared()})
}

// sameShare: a and b differ at most by their heartbeats, which do not make
// a bucket worth rewriting (the node itself tracks its own: queued.beat).
func sameShare(a, b shareEntry) bool {
	return a.NodeDesc == b.NodeDesc && a.Waiting == b.Waiting && a.Rank == b.Rank && a.Late == b.Late && a.Call == b.Call &&
		a.Offset == b.Offset
}

// membersValue is the members key's value.
type membersValue struct {
	Round   int          `json:"round"`
	Members []memberJSON `json:"members"`
}

type memberJSON struct {
	NodeDesc
	Rank int    `json:"rank"`
	Data []byte `json:"data,omitempty"`
	Late bool   `json:"late,omitzero"`
}

var (
	emptyMarker  = mustMarshal(marker{})
	emptyShare   = mustMarshal(shareValue{Nodes: []shareEntry{}})
	emptyMembers = mustMarshal(membersValue{Round: -1})
)

func mustMarshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// shareBuckets is the number of buckets of a run of at most maxNodes.
func shareBuckets(maxNodes int) int {
	return max(1, (maxNodes+shareBucketNodes-1)/shareBucketNodes)
}

// bucketOf is n's bucket among nb.
func bucketOf(n NodeDesc, nb int) int {
	h := fnv.New32a()
	h.Write([]byte(n.String()))
	return int(h.Sum32() % uint32(nb))
}

// marker returns s's header.
func (s *dynState) marker(cfg DynamicConfig) marker {
	m := marker{Pub: s.Pub, Round: s.Round, Complete: s.Complete, Closed: s.Closed, Deadline: s.Deadline,
		Size: s.Size, Wake: s.Wake, Batch: s.Batch}
	for _, n := range s.Gone {
		if s.rejoining(n) {
			m.Rejoining++
		} else {
			m.Gone = append(m.Gone, n)
		}
	}
	drop := cfg.DropTimeout()
	for _, e := range s.Nodes {
		if exp := e.Heartbeat.Add(drop); m.Expires.IsZero() || exp.Before(m.Expires) {
			m.Expires = exp
		}
		switch {
		case e.Waiting:
			m.Waiting++
		case e.Late:
			m.Participants++
			m.Late++
		default:
			m.Participants++
		}
	}
	return m
}

// sameMarker: a and b differ at most by their publication numbers. (A
// field added to marker must be added here.)
func sameMarker(a, b marker) bool {
	type counts struct {
		round                    int
		complete, closed         bool
		size                     int
		wake, batch              uint64
		participants, wait, late int
		rejoining                int
	}
	key := func(m marker) counts {
		return counts{m.Round, m.Complete, m.Closed, m.Size, m.Wake, m.Batch, m.Participants, m.Waiting, m.Late, m.Rejoining}
	}
	return key(a) == key(b) && a.Deadline.Equal(b.Deadline) && a.Expires.Equal(b.Expires) && slices.Equal(a.Gone, b.Gone)
}

// numberPublication gives after the next publication number when its
// header differs from before's (so that publish rewrites the marker), and
// before's otherwise.
func numberPublication(before, after *dynState, cfg DynamicConfig) {
	after.Pub = before.Pub
	if !sameMarker(before.marker(cfg), after.marker(cfg)) {
		after.Pub++
	}
}

// shares splits s's nodes into nb buckets.
func (s *dynState) shares(nb int) [][]shareEntry {
	out := make([][]shareEntry, nb)
	for _, e := range s.Nodes {
		b := bucketOf(e.NodeDesc, nb)
		// Offset 0 would not tell rank 0 from no plan: shift by one
		// (0 then means none, and is left out of the JSON).
		off := 0
		if s.Complete && !e.Waiting && s.Plan != nil && s.Plan.Round == s.Round && e.Rank < len(s.Plan.Offsets) {
			off = s.Plan.Offsets[e.Rank] + 1
		}
		out[b] = append(out[b], shareEntry{NodeDesc: e.NodeDesc, Waiting: e.Waiting, Rank: e.Rank, Late: e.Late, Call: e.Call,
			Heartbeat: e.Heartbeat, Offset: off})
	}
	return out
}

// members returns the members of s's complete round, in rank order.
func (s *dynState) members() membersValue {
	v := membersValue{Round: s.Round}
	for _, e := range s.Nodes {
		if !e.Waiting {
			v.Members = append(v.Members, memberJSON{NodeDesc: e.NodeDesc, Rank: e.Rank, Data: e.Data, Late: e.Late})
		}
	}
	slices.SortFunc(v.Members, func(a, b memberJSON) int { return a.Rank - b.Rank })
	return v
}

// viewOf builds a node's view from the marker and its bucket: a dynState
// whose Nodes are the bucket's and whose header is the marker's. The
// operations of dynamic.go decide on it as on the state: a node's own role
// is exact, and participants() counts the nodes outside the bucket too.
//
// plan is the bucket's plan (shareValue.Plan), without offsets: each
// node's own is in its entry.
func viewOf(m marker, bucket []shareEntry, plan *roundPlan) *dynState {
	st := &dynState{view: true, Pub: m.Pub, Round: m.Round, Complete: m.Complete, Closed: m.Closed,
		Deadline: m.Deadline, Size: m.Size, Wake: m.Wake, Batch: m.Batch, Plan: plan}
	in := 0
	for _, e := range bucket {
		st.Nodes = append(st.Nodes, nodeState{NodeDesc: e.NodeDesc, Waiting: e.Waiting, Rank: e.Rank, Late: e.Late, Call: e.Call,
			Heartbeat: e.Heartbeat, offset: e.Offset})
		if !e.Waiting {
			in++
		}
	}
	slices.SortFunc(st.Nodes, func(a, b nodeState) int { return compareNodes(a.NodeDesc, b.NodeDesc) })
	st.others, st.waiting = max(0, m.Participants-in), m.Waiting
	return st
}

// viewRound returns me's share of the complete round a view shows: no
// members.
func (s *dynState) viewRound(me NodeDesc) (Round, bool) {
	i, ok := s.find(me)
	if !s.Complete || !ok || s.Nodes[i].Waiting {
		return Round{}, false
	}
	r := Round{Number: s.Round, Rank: s.Nodes[i].Rank, Size: s.Size, Late: s.Nodes[i].Late}
	if off := s.Nodes[i].offset; off > 0 && s.Plan != nil && s.Plan.Round == s.Round {
		r.Summary = s.Plan.summaryAt(off - 1)
	}
	return r, true
}

func (d *Dynamic) shareKey(b int) string { return d.key + shareSuffix + strconv.Itoa(b) }

// peek reads key without blocking: with a plain read where the store can
// (Peeker; an absent key reads as empty), else with a compare-set that
// creates it with empty when absent. The marker, shares, members and lock
// are unwatched on etcd, where a Get would refuse to wait.
func (d *Dynamic) peek(ctx context.Context, key string, empty []byte) ([]byte, error) {
	vs, err := d.peekAll(ctx, []string{key}, [][]byte{empty})
	if err != nil {
		return nil, err
	}
	return vs[0], nil
}

// peekAll reads keys as peek does, each absent one as its empties, with
// one Peek where the store has it.
func (d *Dynamic) peekAll(ctx context.Context, keys []string, empties [][]byte) ([][]byte, error) {
	if d.canPeek() {
		start := d.now()
		vs, err := d.store.(Peeker).Peek(ctx, keys...)
		d.observe(start)
		switch {
		case err == nil && len(vs) == len(keys):
			for i, v := range vs {
				if v == nil {
					vs[i] = empties[i]
				}
			}
			return vs, nil
		case err == nil, errors.Is(err, ErrNotSupported):
			d.noPeek.Store(true)
		default:
			return nil, fmt.Errorf("read %s: %w", keys[0], err)
		}
	}
	out := make([][]byte, len(keys))
	for i, key := range keys {
		// Create-only, of a constant: sent again while its outcome is
		// unknown, as readState's (at 1,024 agents on etcd, three Nexts
		// ended on a marker's read whose token lease had ended).
		b, err := CreateOnce(ctx, d.store, key, empties[i])
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", key, err)
		}
		out[i] = b
	}
	return out, nil
}

// canPeek reports whether the store reads without waiting (Peeker).
func (d *Dynamic) canPeek() bool {
	_, ok := d.store.(Peeker)
	return ok && !d.noPeek.Load()
}

// readView reads this node's view: the marker, then its bucket (in that
// order: a publisher writes the buckets first, so the bucket is at least
// as new as the marker).
//
// Where the store peeks (etcd) it reads both with one Peek, at one
// revision. Elsewhere, once both keys exist, it reads them with one
// MultiGet (one round trip on a TCPStore), unless the store refuses to
// wait on them, where it peeks at each.
func (d *Dynamic) readView(ctx context.Context) (*snapshot, error) {
	var mb, bb []byte
	if d.canPeek() {
		vs, err := d.peekAll(ctx, []string{d.key + markerSuffix, d.shareKey(d.bucket)}, [][]byte{emptyMarker, emptyShare})
		if err != nil {
			return nil, err
		}
		mb, bb = vs[0], vs[1]
		if d.noPeek.Load() && !d.viewPeek.Load() {
			// It could not peek after all (a wrapper of a store that
			// cannot) and compare-set both keys into being: one MultiGet
			// from now on, as below.
			d.viewMultiGet.Store(true)
		}
	}
	if mb == nil && d.viewMultiGet.Load() {
		vs, err := d.store.MultiGet(ctx, d.key+markerSuffix, d.shareKey(d.bucket))
		switch {
		case err == nil && len(vs) == 2:
			mb, bb = vs[0], vs[1]
		case errors.Is(err, ErrInvalidArgument), errors.Is(err, ErrNotSupported), err == nil:
			d.viewMultiGet.Store(false)
			d.viewPeek.Store(true)
		default:
			return nil, fmt.Errorf("read %s: %w", d.key+markerSuffix, err)
		}
	}
	if mb == nil {
		var err error
		if mb, err = d.peek(ctx, d.key+markerSuffix, emptyMarker); err != nil {
			return nil, err
		}
		if bb, err = d.peek(ctx, d.shareKey(d.bucket), emptyShare); err != nil {
			return nil, err
		}
		if !d.viewPeek.Load() {
			d.viewMultiGet.Store(true) // both exist now
		}
	}
	var m marker
	var sv shareValue
	if err := json.Unmarshal(mb, &m); err != nil {
		return nil, fmt.Errorf("marker of %q is not a gorun rendezvous marker: %w", d.key, err)
	}
	if err := json.Unmarshal(bb, &sv); err != nil {
		return nil, fmt.Errorf("share %d of %q is not a gorun rendezvous share: %w", d.bucket, d.key, err)
	}
	bucket, plan, stale := sv.Nodes, sv.Plan, sv.Round != m.Round || sv.Complete != m.Complete
	if stale {
		// Not the marker's round as it is: nothing to decide on (Next
		// waits, then reads the state: run).
		bucket, plan = nil, nil
	}
	token := make([]byte, 0, len(mb)+1+len(bb))
	token = append(append(append(token, mb...), 0), bb...)
	st := viewOf(m, bucket, plan)
	st.stale = stale
	return &snapshot{st: st, token: token}, nil
}

// publish writes what changed from before to after (a write of the state
// that won) into the members key, the shares and the marker, in that
// order, so that a node that sees the marker finds the rest at least as
// new. after.Pub is before's + 1 (commit numbered it).
func (d *Dynamic) publish(ctx context.Context, before, after *dynState) error {
	var keys []string
	var vals [][]byte
	if after.Complete && (!before.Complete || before.Round != after.Round) {
		b, err := json.Marshal(after.members())
		if err != nil {
			return err
		}
		keys, vals = append(keys, d.key+membersSuffix), append(vals, b)
	}
	old, cur := before.shares(d.buckets), after.shares(d.buckets)
	same := before.Round == after.Round && before.Complete == after.Complete
	for b := range cur {
		if same && slices.EqualFunc(old[b], cur[b], sameShare) {
			continue
		}
		v, err := after.shareBytes(cur[b])
		if err != nil {
			return err
		}
		keys, vals = append(keys, d.shareKey(b)), append(vals, v)
	}
	// The chunks go out together: on etcd each is a round trip or more,
	// and the folder's round trips are what a crowd waits for.
	var wg sync.WaitGroup
	var errs []error
	var emu sync.Mutex
	for len(keys) > 0 {
		n := min(len(keys), publishChunk)
		ks, vs := keys[:n], vals[:n]
		wg.Go(func() {
			if err := d.store.MultiSet(ctx, ks, vs); err != nil {
				emu.Lock()
				errs = append(errs, err)
				emu.Unlock()
			}
		})
		keys, vals = keys[n:], vals[n:]
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("publish shares: %w", err)
	}
	mb, ma := before.marker(d.cfg), after.marker(d.cfg)
	if after.Pub == before.Pub { // the header did not change (commit)
		return nil
	}
	want := mustMarshal(ma)
	got, err := d.store.CompareSet(ctx, d.key+markerSuffix, mustMarshal(mb), want)
	if errors.Is(err, ErrOutcomeUnknown) {
		// Whether it applied, the marker says: this publication's
		// (applied), or another (not, or a later one's since), as below.
		got, err = d.peek(ctx, d.key+markerSuffix, nil)
	}
	if err != nil {
		return fmt.Errorf("publish marker: %w", err)
	}
	if bytes.Equal(got, want) {
		return nil
	}
	// Not the predecessor's marker: a publisher between them died midway,
	// or one after them has already published (keep its marker then).
	var m marker
	if json.Unmarshal(got, &m) == nil && m.Pub > ma.Pub {
		return nil
	}
	if err := d.store.Set(ctx, d.key+markerSuffix, want); err != nil {
		return fmt.Errorf("publish marker: %w", err)
	}
	return nil
}

// fetchMembers fills in r's members: from the members key when it holds
// r's round with this node at its rank, else from the state.
func (d *Dynamic) fetchMembers(ctx context.Context, r *Round) error {
	b, err := d.peek(ctx, d.key+membersSuffix, emptyMembers)
	if err != nil {
		return err
	}
	var v membersValue
	if json.Unmarshal(b, &v) == nil && v.Round == r.Number && !r.Late && r.Rank < len(v.Members) && v.Members[r.Rank].NodeDesc == d.me {
		r.Members = make([]Member, len(v.Members))
		for i, m := range v.Members {
			r.Members[i] = Member{Node: m.NodeDesc, Rank: m.Rank, Data: m.Data, Late: m.Late}
		}
		return nil
	}
	// Admitted late (the key holds the round as it completed), or the key
	// is already the next round's: the state has the members.
	snap, err := d.read(ctx)
	if err != nil {
		return err
	}
	if snap.st.Round != r.Number || !snap.st.Complete {
		return fmt.Errorf("round %d's members: the run is at round %d", r.Number, snap.st.Round)
	}
	full, ok := snap.st.round(d.me)
	if !ok || full.Rank != r.Rank {
		return fmt.Errorf("round %d's members: this node is no longer in it", r.Number)
	}
	r.Members = full.Members
	return nil
}

// Members returns the members of the round Next last returned, in rank
// order, as it completed (with nodes admitted into it since, once Status
// has reported them): what Round.Members holds unless
// DynamicConfig.ShareOnly. It reads O(N) bytes; call it where the whole
// membership is needed (a leader, liveness, spares), not on every node
// every round.
func (d *Dynamic) Members(ctx context.Context) ([]Member, error) {
	ctx, done := d.bind(ctx)
	defer done()
	last := d.lastRound()
	if last == nil {
		return nil, d.fail("members", errNoRound)
	}
	if last.Members != nil {
		return slices.Clone(last.Members), nil
	}
	r := *last
	if err := d.fetchMembers(ctx, &r); err != nil {
		return nil, d.fail("members", err)
	}
	d.mu.Lock()
	if d.last != nil && d.last.Number == r.Number && d.last.Members == nil {
		d.last.Members = r.Members
	}
	d.mu.Unlock()
	return slices.Clone(r.Members), nil
}
