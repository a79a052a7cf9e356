package rendezvous

// The dynamic rendezvous, torchrun's c10d/etcd-v2 algorithm
// (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py), as a pure
// core: a state shared by every node of a run, operations that look at it
// and name the next action, and apply, which performs an action on a copy.
// Nothing here does I/O, starts a goroutine or reads the clock; time is a
// parameter. dynamic_exec.go runs these decisions against a Store.

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Defaults of the DynamicConfig fields: torchrun's.
const (
	DefaultJoinTimeout         = 600 * time.Second
	DefaultLastCallTimeout     = 30 * time.Second
	DefaultCloseTimeout        = 30 * time.Second
	DefaultKeepAliveTimeout    = 5 * time.Second
	DefaultKeepAliveInterval   = 5 * time.Second
	DefaultKeepAliveMaxAttempt = 3
	// DefaultCrowdRate is DynamicConfig.CrowdRate's default: a gorun
	// setting, torchrun has none.
	DefaultCrowdRate = 250
)

// rollbackWindow is how long past its join deadline a node still tries to
// take itself out of the state, so that the others do not count it until its
// heartbeat expires. torchrun's value.
const rollbackWindow = 5 * time.Second

var (
	// ErrRendezvousClosed: the run was closed (SetClosed) — the job is done
	// and no node may start another round.
	ErrRendezvousClosed = errors.New("rendezvous closed")
	// ErrRendezvousTimeout: a round did not complete within JoinTimeout (or
	// leaving, closing or a heartbeat did not finish in its time). It wraps
	// ErrTimeout.
	ErrRendezvousTimeout error = &wrapped{"rendezvous timed out", ErrTimeout}
)

// wrapped is a sentinel that is also another sentinel.
type wrapped struct {
	msg   string
	inner error
}

func (e *wrapped) Error() string { return e.msg }
func (e *wrapped) Unwrap() error { return e.inner }

// NodeDesc names one agent in a dynamic rendezvous. Two agents on one host
// differ by Pid, two handles in one process by LocalID, as torchrun's
// _NodeDesc does.
type NodeDesc struct {
	// Addr is the address the node advertises (--local-addr, or its host
	// name).
	Addr    string `json:"addr"`
	Pid     int    `json:"pid"`
	LocalID int    `json:"local_id"`
}

// String returns torchrun's spelling, "addr_pid_localid". It is
// unambiguous even when Addr holds underscores: the last two fields are
// numbers.
func (n NodeDesc) String() string {
	return n.Addr + "_" + strconv.Itoa(n.Pid) + "_" + strconv.Itoa(n.LocalID)
}

// compareNodes is the order ranks follow: address, then pid, then local id,
// as torchrun sorts its _NodeDesc dataclass (pids compare as numbers).
func compareNodes(a, b NodeDesc) int {
	return cmp.Or(strings.Compare(a.Addr, b.Addr), cmp.Compare(a.Pid, b.Pid), cmp.Compare(a.LocalID, b.LocalID))
}

// DynamicConfig configures a dynamic rendezvous. Every node of a run must
// use the same values. A zero duration or count means torchrun's default.
type DynamicConfig struct {
	// RunID names the run (--rdzv-id); it is part of every store key.
	RunID string
	// MinNodes and MaxNodes bound a round (--nnodes MIN:MAX). A round
	// completes at once when MaxNodes nodes have joined, or LastCallTimeout
	// after the latest joiner once at least MinNodes have. A round that
	// follows a complete one also completes at once, with at least
	// MinNodes, when every member of the previous round that left it to
	// rejoin has rejoined and none of them is dead (see dynState.Rejoin).
	MinNodes, MaxNodes int
	// JoinTimeout bounds Next as a whole: leaving the previous round and
	// completing the next. Default 600 s.
	JoinTimeout time.Duration
	// LastCallTimeout is the grace period, restarted by every joiner, that a
	// round with at least MinNodes (but fewer than MaxNodes) nodes waits for
	// more before it completes. Default 30 s.
	LastCallTimeout time.Duration
	// CloseTimeout bounds SetClosed and Leave. Default 30 s.
	CloseTimeout time.Duration
	// KeepAliveTimeout bounds one keep-alive (heartbeat) write: torchrun's
	// heartbeat_timeout. Default 5 s. (Not the launcher's HeartbeatTimeout,
	// which finds hung workers.)
	KeepAliveTimeout time.Duration
	// KeepAliveInterval is the heartbeat period. Default 5 s.
	KeepAliveInterval time.Duration
	// KeepAliveMaxAttempt heartbeats may be missed before the others count
	// a node as dead and drop it: after KeepAliveInterval ×
	// KeepAliveMaxAttempt without one (15 s by default). Default 3.
	KeepAliveMaxAttempt int
	// CrowdRate bounds, for runs of thousands of nodes, what their waiting
	// costs the store: the heartbeats a second that all MaxNodes nodes
	// send together, and, in queue mode, the looks a second that the
	// nodes whose requests a folder has yet to apply take at its lock.
	// Where MaxNodes ÷ CrowdRate is longer than KeepAliveInterval (beyond
	// 1,250 nodes at the defaults) it replaces it as the heartbeat
	// interval (HeartbeatInterval), the drop timeout stretches with it
	// (DropTimeout), and a queued node looks at the folder lock that
	// seldom (with a jitter), not every KeepAliveTimeout: otherwise every
	// node's periodic requests grow the store's load with N, and on a
	// store that serves a few thousand requests a second (one etcd member
	// on two cores) 10,000 nodes' looks and heartbeats starve the folder
	// that would complete their round. Default 250 a second (10,000 nodes
	// beat every 40 s, and are dropped after 120 s without one); negative:
	// never stretch. (rdzv-conf crowd_rate.)
	CrowdRate int
	// QueueMinNodes: runs with MaxNodes at least this many queue their
	// joins and heartbeats (dynamic_queue.go) on a store with queues;
	// smaller ones compare-set the state directly, where contention costs
	// little and the direct write takes fewer round trips. 0 means 32; a
	// negative value, never.
	QueueMinNodes int
	// ShareOnly: in queue mode (see QueueMinNodes), Next returns only
	// this node's share of the round (Round.Number, Rank, Size, Late) and
	// leaves Round.Members nil; Dynamic.Members reads them on demand.
	// With Describe, Round.Summary holds what a plan needs of them.
	// Otherwise Next reads the members once per round (O(N) bytes per
	// node, O(N²) for the run). Below QueueMinNodes, and on a store
	// without queues, Members are always filled: every node reads the
	// whole state there anyway. Default false.
	ShareOnly bool
	// OnProgress, when set, is called by Next each time it reads a state
	// whose membership differs from the last it reported (who joined, who
	// waits, when the last call ends), so that an agent can log progress;
	// Status cannot serve that purpose while Next holds the store. Next
	// reads when it writes, when it is woken (completion, a new round) and
	// at its own timers (at least once per KeepAliveInterval), so joins may
	// be reported that late. It runs on Next's goroutine and must not
	// block.
	OnProgress func(Progress)
	// OnSlowStore, when set, is called each time one of the rendezvous's
	// operations timed out on a store that still answers (an etcd that
	// takes longer than read_timeout, a TCPStore host that is swamped)
	// and the operation is about to read the state afresh and go on, as
	// it does until its own deadline (JoinTimeout for Next): a slow store
	// holds a join up, it does not end it. A store that refuses, hangs up
	// or is closed still ends the operation at once. It runs on the
	// operation's goroutine and must not block.
	OnSlowStore func(op string, err error)
	// OnDrop, when set, is called each time this node drops others from
	// the state for heartbeats older than the drop timeout, before it
	// writes the state without them: the judgment that ends their place
	// in the round, with what it was made on. It runs on the operation's
	// goroutine and must not block.
	OnDrop func(Drop)
	// OnKeepAliveFailed, when set, is called each time this node's
	// heartbeat could not be sent or applied (the next is tried an
	// interval later; KeepAliveMaxAttempt in a row and the others drop
	// this node). It runs on the keep-alive's goroutine and must not
	// block.
	OnKeepAliveFailed func(error)
	// Describe, when set, reads a node's data (what it gave NewDynamic)
	// for the round's plan: in queue mode, whoever completes a round
	// computes each member's Round.Summary from every member's traits
	// once, so that the nodes need not read the members
	// (dynamic_plan.go). Every node of a run must give the same function.
	// It must be pure and fast: it runs on every member's data whenever a
	// round completes.
	Describe func(data []byte) (NodeTraits, error)
}

// Progress is the view of a round in progress that Next reports through
// OnProgress.
type Progress struct {
	Round    int
	Complete bool
	// NumParticipants and NumWaiting count the nodes in the round and
	// those waiting for the next.
	NumParticipants, NumWaiting int
	// Participants (in rank order) and Waiting (for the next round) name
	// them, except in queue mode, where a node reads only its own bucket
	// of the state (dynamic_share.go): nil there.
	Participants []NodeDesc
	Waiting      []NodeDesc
	// LastCall is when the round completes unless more nodes join; zero
	// until MinNodes nodes have joined.
	LastCall time.Time
	// InWaitList: this node waits in the wait list for the round after
	// Round, which is complete without it (others restarting still leave
	// it so until the last of them has).
	InWaitList bool
}

func (p Progress) equal(q Progress) bool {
	return p.Round == q.Round && p.Complete == q.Complete && p.InWaitList == q.InWaitList && p.LastCall.Equal(q.LastCall) &&
		p.NumParticipants == q.NumParticipants && p.NumWaiting == q.NumWaiting &&
		slices.Equal(p.Participants, q.Participants) && slices.Equal(p.Waiting, q.Waiting)
}

// withDefaults fills in the zero fields.
func (c DynamicConfig) withDefaults() DynamicConfig {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.JoinTimeout, DefaultJoinTimeout)
	def(&c.LastCallTimeout, DefaultLastCallTimeout)
	def(&c.CloseTimeout, DefaultCloseTimeout)
	def(&c.KeepAliveTimeout, DefaultKeepAliveTimeout)
	def(&c.KeepAliveInterval, DefaultKeepAliveInterval)
	if c.KeepAliveMaxAttempt == 0 {
		c.KeepAliveMaxAttempt = DefaultKeepAliveMaxAttempt
	}
	if c.CrowdRate == 0 {
		c.CrowdRate = DefaultCrowdRate
	}
	return c
}

// validate checks a config after withDefaults.
func (c DynamicConfig) validate() error {
	switch {
	case c.RunID == "":
		return fmt.Errorf("%w: dynamic rendezvous: empty run id", ErrInvalidArgument)
	case c.MinNodes < 1 || c.MaxNodes < c.MinNodes:
		return fmt.Errorf("%w: dynamic rendezvous: nodes %d:%d (need 1 ≤ min ≤ max)", ErrInvalidArgument, c.MinNodes, c.MaxNodes)
	case c.JoinTimeout < 0, c.LastCallTimeout < 0, c.CloseTimeout < 0, c.KeepAliveTimeout < 0, c.KeepAliveInterval < 0:
		return fmt.Errorf("%w: dynamic rendezvous: negative timeout", ErrInvalidArgument)
	case c.KeepAliveMaxAttempt < 0:
		return fmt.Errorf("%w: dynamic rendezvous: negative keep_alive_max_attempt", ErrInvalidArgument)
	}
	return nil
}

// crowdPeriod is MaxNodes ÷ CrowdRate: the period at which MaxNodes
// nodes doing one thing each make CrowdRate of them a second (0 when
// CrowdRate never stretches anything).
func (c DynamicConfig) crowdPeriod() time.Duration {
	if c.CrowdRate <= 0 {
		return 0
	}
	return time.Duration(c.MaxNodes) * time.Second / time.Duration(c.CrowdRate)
}

// HeartbeatInterval is the heartbeat period of c's nodes:
// KeepAliveInterval, or MaxNodes ÷ CrowdRate where that is longer.
func (c DynamicConfig) HeartbeatInterval() time.Duration {
	c = c.withDefaults()
	return max(c.KeepAliveInterval, c.crowdPeriod())
}

// DropTimeout is how long a heartbeat keeps a node alive in the others'
// eyes: KeepAliveMaxAttempt heartbeat intervals.
func (c DynamicConfig) DropTimeout() time.Duration {
	return c.HeartbeatInterval() * time.Duration(c.withDefaults().KeepAliveMaxAttempt)
}

// ParseDynamicConfig builds a DynamicConfig from torchrun's --rdzv-conf
// keys: join_timeout, last_call_timeout, close_timeout, heartbeat_timeout,
// keep_alive_interval (seconds; fractions are accepted where torchrun takes
// only integers) and keep_alive_max_attempt; and gorun's crowd_rate
// (DynamicConfig.CrowdRate, a positive integer). Keys it does not know
// belong to the store backend (read_timeout, is_host, store_type, …) and
// are ignored.
// A malformed or non-positive value is an error wrapping ErrInvalidArgument
// (torchrun rejects non-positive timeouts too).
func ParseDynamicConfig(runID string, minNodes, maxNodes int, conf Conf) (DynamicConfig, error) {
	c := DynamicConfig{RunID: runID, MinNodes: minNodes, MaxNodes: maxNodes}
	for _, f := range []struct {
		key string
		dst *time.Duration
	}{
		{"join_timeout", &c.JoinTimeout},
		{"last_call_timeout", &c.LastCallTimeout},
		{"close_timeout", &c.CloseTimeout},
		{"heartbeat_timeout", &c.KeepAliveTimeout},
		{"keep_alive_interval", &c.KeepAliveInterval},
	} {
		d, err := conf.Seconds(f.key, 0) // 0: the default, below
		if err != nil {
			return DynamicConfig{}, err
		}
		*f.dst = d
	}
	n, err := conf.Count("keep_alive_max_attempt", 0)
	if err != nil {
		return DynamicConfig{}, err
	}
	c.KeepAliveMaxAttempt = n
	if c.CrowdRate, err = conf.Count("crowd_rate", 0); err != nil {
		return DynamicConfig{}, err
	}
	c = c.withDefaults()
	if err := c.validate(); err != nil {
		return DynamicConfig{}, err
	}
	return c, nil
}

// dynState is the state that every node of a run shares: one JSON document
// under the run's key, replaced as a whole by compare-set. torchrun keeps
// participants{node→rank}, wait_list and last_heartbeats{node→time} apart;
// here they are one table, because every node in either list has exactly
// one heartbeat and both lists are disjoint, which the layout then enforces.
type dynState struct {
	Round    int  `json:"round"`
	Complete bool `json:"complete"`
	Closed   bool `json:"closed,omitzero"`
	// Deadline is when the last call ends; zero when no last call runs.
	Deadline time.Time `json:"deadline,omitzero"`
	// Size is the number of participants the round completed with. A
	// complete round with fewer has lost a member, and Next does not hand
	// it out (see nextJoinAction).
	Size int `json:"size,omitzero"`
	// Wake counts the writes that waiting nodes must see (see wakes). The
	// executor names its wake-up keys after it.
	Wake uint64 `json:"wake"`
	// Batch counts the batches of queued requests written into the state
	// (dynamic_queue.go); the executor names the keys that wake their
	// requesters after it.
	Batch uint64 `json:"batch,omitzero"`
	// Nodes are the participants and the waiting nodes, sorted by
	// compareNodes.
	Nodes []nodeState `json:"nodes,omitempty"`
	// Rejoin lists the members of the last complete round that left it to
	// join the next (a restart, a lost member), sorted by compareNodes,
	// until that round completes. They are the nodes the next round is
	// known to expect: once every one of them is a participant again (or
	// has died meanwhile) and MinNodes are in, nobody is left for the last
	// call to wait for, and the round completes at once. Nodes that arrive
	// while a round runs are in the wait list, and admitted with the next
	// round. torchrun waits the whole last call after every restart.
	Rejoin []rejoiner `json:"rejoin,omitempty"`
	// Gone lists the participants of the complete round that are no
	// longer in it (dropped, or left), in the order they went, until the
	// next round. The marker carries it: a node's Status learns whom its
	// round lost from O(lost) bytes, not the state's O(N) and the member
	// list's (at 512 real agents, every survivor read both as one node
	// was lost).
	Gone []NodeDesc `json:"gone,omitempty"`
	// Pub numbers the writes that changed the header, which queue mode
	// publishes as the marker (dynamic_share.go).
	Pub uint64 `json:"pub,omitzero"`
	// Plan is the complete round's plan (dynamic_plan.go), made by the
	// writer that completed it in queue mode with DynamicConfig.Describe;
	// nil otherwise.
	Plan *roundPlan `json:"plan,omitempty"`

	// view: this is a node's view (the marker and its bucket), not the
	// state: Nodes holds the bucket's nodes only, others counts the
	// participants outside it, and there is no Rejoin. Never written.
	view            bool
	others, waiting int
	// stale: a view whose bucket was not of the marker's round as it is
	// (dynamic_share.go): Nodes is empty, and the node pushes its request
	// again (at settle), which makes the folder publish its share anew.
	stale bool
}

// rejoiner is a member of the last complete round on its way to the next.
type rejoiner struct {
	NodeDesc
	// Left is when it left the round. A rejoiner that is in neither list
	// a heartbeat's TTL after that has died between leaving and joining.
	Left time.Time `json:"left"`
}

// nodeState is one node of the state.
type nodeState struct {
	NodeDesc
	// Waiting: in the wait list for the next round rather than a
	// participant of this one.
	Waiting bool `json:"waiting,omitzero"`
	// Rank is set when the round completes: the node's index among the
	// participants in compareNodes order.
	Rank      int       `json:"rank,omitzero"`
	Heartbeat time.Time `json:"heartbeat"`
	// Late: admitted into the complete round to take a lost member's rank
	// (Dynamic.Admit), not a member from its start.
	Late bool `json:"late,omitzero"`
	// Data is what the node gave NewDynamic.
	Data []byte `json:"data,omitempty"`
	// Call is the Next call (Dynamic's own numbering) that last took this
	// node out of its previous round and into the state, by its queued
	// request (see foldRequest) or its own write (run): a later request
	// or pass of the same call must not take it out again.
	Call uint64 `json:"call,omitzero"`
	// offset is a view's: the node's shareEntry.Offset (one more than
	// its offset in the round's plan, 0 for none). Never written.
	offset int
}

func (s *dynState) clone() *dynState {
	c := *s
	c.Nodes = slices.Clone(s.Nodes)
	c.Rejoin = slices.Clone(s.Rejoin)
	c.Gone = slices.Clone(s.Gone)
	return &c
}

// find returns n's index in Nodes, or where it would go.
func (s *dynState) find(n NodeDesc) (int, bool) {
	return slices.BinarySearchFunc(s.Nodes, n, func(e nodeState, n NodeDesc) int { return compareNodes(e.NodeDesc, n) })
}

// role reports whether n is a participant and whether it is waiting.
func (s *dynState) role(n NodeDesc) (participant, waiting bool) {
	i, ok := s.find(n)
	if !ok {
		return false, false
	}
	return !s.Nodes[i].Waiting, s.Nodes[i].Waiting
}

func (s *dynState) participants() int {
	n := s.others
	for _, e := range s.Nodes {
		if !e.Waiting {
			n++
		}
	}
	return n
}

// action is what an operation decides to do next.
type action int

const (
	actSync                   action = iota // wait for the state to change
	actFinish                               // the operation is done
	actErrClosed                            // fail: the run is closed
	actErrTimeout                           // fail: out of time
	actKeepAlive                            // refresh my heartbeat
	actAddToParticipants                    // join the round
	actAddToWaitList                        // wait for the next round
	actRemoveFromParticipants               // leave the round
	actRemoveToRejoin                       // leave the round, to join the next
	actRemoveFromWaitList                   // stop waiting
	actForgetRejoin                         // a rejoiner that will not join
	actMarkComplete                         // close the round, assign ranks
	actMarkClosed                           // close the run
)

var actionNames = [...]string{
	actSync:                   "sync",
	actFinish:                 "finish",
	actErrClosed:              "error-closed",
	actErrTimeout:             "error-timeout",
	actKeepAlive:              "keep-alive",
	actAddToParticipants:      "add-to-participants",
	actAddToWaitList:          "add-to-wait-list",
	actRemoveFromParticipants: "remove-from-participants",
	actRemoveToRejoin:         "remove-to-rejoin",
	actRemoveFromWaitList:     "remove-from-wait-list",
	actForgetRejoin:           "forget-rejoin",
	actMarkComplete:           "mark-complete",
	actMarkClosed:             "mark-closed",
}

func (a action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return "action(" + strconv.Itoa(int(a)) + ")"
}

// wakes reports whether the change from before to after can alter the
// decision of a node that decided to sync on before, so that it must be
// woken rather than left to its timers. A node syncs in three situations:
//
//   - a participant of a round still gathering: it waits for completion.
//     A joiner needs to wake nobody: the last call's end is known to the
//     node that set it (it wakes then and completes the round), and the
//     others learn of an extension when they wake at the end they knew;
//   - a node in the wait list of a complete round: it waits for the round
//     to end (its last participant leaving);
//   - a node outside a complete, full round: it waits for room.
//
// and every one of them must see the run closed. So: completion, the next
// round, closing, and a complete round ceasing to be full. Joins, waits
// and departures that change none of these wake nobody, which keeps a
// crowd of N joiners at O(N) reads instead of O(N²).
//
// An admission (Dynamic.Admit) wakes the waiting node it made a member.
func wakes(before, after *dynState, cfg DynamicConfig) bool {
	return before.Closed != after.Closed ||
		before.Round != after.Round ||
		before.Complete != after.Complete ||
		after.Complete && before.participants() >= cfg.MaxNodes && after.participants() < cfg.MaxNodes ||
		after.participants() > before.participants() && before.Complete && after.Complete
}

// admit makes waiting nodes, the first in node order, members of the
// complete round, one for each of ranks (in ascending rank order), and
// returns them in the order of ranks. Each rank must be a lost member's
// (no participant holds it, and it is below the size the round completed
// with), and together they must be every such rank: an admitted node
// takes its place only in a whole round (nextJoinAction, which a Late
// round with a hole would give a member list with a gap), so one admitted
// beside a place left empty went back to the wait list at once, to be
// admitted again by the next poll, and again (seen with one spare and
// two nodes lost: a leader re-admitted it every second). It changes
// nothing when it fails: ErrPlacesLeft when ranks leave a place empty,
// ErrNoWaitingNode when fewer nodes wait than ranks asks for.
func (s *dynState) admit(ranks ...int) ([]NodeDesc, error) {
	if !s.Complete || s.Closed {
		return nil, fmt.Errorf("round %d is not running (complete %v, closed %v)", s.Round, s.Complete, s.Closed)
	}
	if len(ranks) == 0 {
		return nil, errors.New("no rank to admit a node into")
	}
	asked := make([]bool, s.Size)
	for _, r := range ranks {
		switch {
		case r < 0 || r >= s.Size:
			return nil, fmt.Errorf("rank %d is not one of round %d's %d", r, s.Round, s.Size)
		case asked[r]:
			return nil, fmt.Errorf("rank %d asked for twice", r)
		}
		asked[r] = true
	}
	held := make([]bool, s.Size)
	var waiting []int
	for i, e := range s.Nodes {
		switch {
		case !e.Waiting && e.Rank < s.Size && asked[e.Rank]:
			return nil, fmt.Errorf("rank %d of round %d has a member: %v", e.Rank, s.Round, e.NodeDesc)
		case !e.Waiting && e.Rank < s.Size:
			held[e.Rank] = true
		case e.Waiting:
			waiting = append(waiting, i)
		}
	}
	var empty []int
	for r := range s.Size {
		if !held[r] && !asked[r] {
			empty = append(empty, r)
		}
	}
	if len(empty) > 0 {
		return nil, fmt.Errorf("admitting into rank(s) %v of round %d would leave rank(s) %v empty: %w", ranks, s.Round, empty, ErrPlacesLeft)
	}
	if len(waiting) < len(ranks) {
		return nil, fmt.Errorf("%d place(s) to fill in round %d, %d node(s) waiting: %w", len(ranks), s.Round, len(waiting), ErrNoWaitingNode)
	}
	sorted := slices.Sorted(slices.Values(ranks))
	byRank := make(map[int]NodeDesc, len(ranks))
	for k, r := range sorted {
		w := waiting[k]
		s.Nodes[w].Waiting, s.Nodes[w].Rank, s.Nodes[w].Late = false, r, true
		byRank[r] = s.Nodes[w].NodeDesc
	}
	out := make([]NodeDesc, len(ranks))
	for i, r := range ranks {
		out[i] = byRank[r]
	}
	return out, nil
}

// keepAliveDue reports whether me is in the state with a heartbeat at least
// one interval old.
func keepAliveDue(s *dynState, me NodeDesc, now time.Time, cfg DynamicConfig) bool {
	i, ok := s.find(me)
	return ok && !s.Nodes[i].Heartbeat.After(now.Add(-cfg.HeartbeatInterval()))
}

// nextJoinAction is torchrun's join operation: given the freshest state,
// what me does next to become a participant of a complete round before
// deadline (its own, local: JoinTimeout after Next began).
//
// One addition: a complete round that has lost a member (fewer participants
// than it completed with) is not finished but left, as if Next had been
// called again at once; torchrun would hand out a world with a hole.
func nextJoinAction(s *dynState, me NodeDesc, now, deadline time.Time, cfg DynamicConfig) action {
	if s.Closed {
		return actErrClosed
	}
	participant, waiting := s.role(me)
	if s.Complete && participant && s.participants() == s.Size {
		return actFinish
	}
	if now.After(deadline) {
		// Within the rollback window, take myself out so that nobody waits
		// for my heartbeat to expire; past it, just give up.
		if !now.After(deadline.Add(rollbackWindow)) {
			if participant {
				return actRemoveFromParticipants
			}
			if waiting {
				return actRemoveFromWaitList
			}
		}
		return actErrTimeout
	}
	switch {
	case s.Complete && participant: // a member is gone: this round is over
		return actRemoveToRejoin
	case s.Complete:
		// Not mine: wait for the next one if there will be room.
		if !waiting && s.participants() < cfg.MaxNodes {
			return actAddToWaitList
		}
	case participant:
		n := s.participants()
		if n >= cfg.MinNodes && n <= cfg.MaxNodes && (!s.Deadline.IsZero() && s.Deadline.Before(now) || s.rejoined()) {
			return actMarkComplete
		}
	default:
		return actAddToParticipants
	}
	if keepAliveDue(s, me, now, cfg) {
		return actKeepAlive
	}
	return actSync
}

// nextExitAction is torchrun's exit operation, run before every join: leave
// the round I took part in, to join the next.
func nextExitAction(s *dynState, me NodeDesc, now, deadline time.Time) action {
	if participant, _ := s.role(me); !participant {
		return actFinish
	}
	if now.After(deadline) {
		return actErrTimeout
	}
	return actRemoveToRejoin
}

// nextLeaveAction is the exit operation for a node that shuts down (or one
// that another node takes out, found dead): it also leaves the wait list,
// where a cancelled Next may have left it, and the rejoiners, where a
// Next that died between its exit and its join left it.
func nextLeaveAction(s *dynState, me NodeDesc, now, deadline time.Time) action {
	participant, waiting := s.role(me)
	switch {
	case !participant && !waiting && !s.rejoining(me):
		return actFinish
	case now.After(deadline):
		return actErrTimeout
	case participant:
		return actRemoveFromParticipants
	case waiting:
		return actRemoveFromWaitList
	default:
		return actForgetRejoin
	}
}

// nextCloseAction is torchrun's close operation.
func nextCloseAction(s *dynState, now, deadline time.Time) action {
	switch {
	case s.Closed:
		return actFinish
	case now.After(deadline):
		return actErrTimeout
	default:
		return actMarkClosed
	}
}

// nextKeepAliveAction is torchrun's keep-alive operation: refresh my
// heartbeat if it is due. A node dropped from the state does not put
// itself back.
func nextKeepAliveAction(s *dynState, me NodeDesc, now, deadline time.Time, cfg DynamicConfig) action {
	switch {
	case !keepAliveDue(s, me, now, cfg):
		return actFinish
	case now.After(deadline):
		return actErrTimeout
	default:
		return actKeepAlive
	}
}

// apply performs a on behalf of me at now and reports whether the state
// changed. Sync, finish and the errors change nothing. It does not touch
// Wake: that is the writer's business.
func (s *dynState) apply(a action, me NodeDesc, data []byte, now time.Time, cfg DynamicConfig) bool {
	now = now.UTC() // drops the monotonic reading: the state crosses machines
	i, in := s.find(me)
	switch a {
	case actKeepAlive:
		if !in {
			return false
		}
		s.Nodes[i].Heartbeat = now
	case actAddToParticipants, actAddToWaitList:
		e := nodeState{NodeDesc: me, Waiting: a == actAddToWaitList, Heartbeat: now, Data: slices.Clone(data)}
		if in {
			s.Nodes[i] = e
		} else {
			s.Nodes = slices.Insert(s.Nodes, i, e)
		}
		if a == actAddToWaitList {
			break
		}
		// Full, or every rejoiner back: complete at once. Enough:
		// (re)start the last call, so each new joiner buys the stragglers
		// another LastCallTimeout.
		switch n := s.participants(); {
		case n == cfg.MaxNodes, n >= cfg.MinNodes && s.rejoined():
			s.markComplete()
		case n >= cfg.MinNodes:
			s.Deadline = now.Add(cfg.LastCallTimeout)
		}
	case actRemoveFromParticipants, actRemoveToRejoin:
		if !in || s.Nodes[i].Waiting {
			return false
		}
		s.Nodes = slices.Delete(s.Nodes, i, i+1)
		s.forgetRejoin(me)
		if s.Complete {
			s.Gone = append(s.Gone, me)
		}
		if a == actRemoveToRejoin && s.Complete {
			j, _ := s.findRejoin(me)
			s.Rejoin = slices.Insert(s.Rejoin, j, rejoiner{NodeDesc: me, Left: now})
		}
		s.removeEpilogue(now, cfg)
	case actRemoveFromWaitList:
		if !in || !s.Nodes[i].Waiting {
			return false
		}
		s.Nodes = slices.Delete(s.Nodes, i, i+1)
		s.forgetRejoin(me)
		s.completeIfRejoined(cfg)
	case actForgetRejoin:
		if !s.forgetRejoin(me) {
			return false
		}
		s.completeIfRejoined(cfg)
	case actMarkComplete:
		if s.Complete {
			return false
		}
		s.markComplete()
	case actMarkClosed:
		if s.Closed {
			return false
		}
		s.Closed = true
	default:
		return false
	}
	return true
}

// markComplete closes the round: ranks follow node order, so every node
// computes the same assignment.
func (s *dynState) markComplete() {
	s.Complete = true
	s.Deadline = time.Time{}
	s.Rejoin, s.Gone = nil, nil
	rank := 0
	for i := range s.Nodes {
		if !s.Nodes[i].Waiting {
			s.Nodes[i].Rank = rank
			rank++
		}
	}
	s.Size = rank
}

// removeEpilogue follows every removal of a participant (by its own exit or
// by sanitize) at now: the last participant of a complete round to go
// starts the next round; a round still gathering that drops below MinNodes
// loses its last call.
//
// Starting the next round admits the wait list into it at once (torchrun
// leaves each waiting node to add itself when it next polls). They asked
// for this round and their heartbeats are fresh (sanitize runs first), and
// admitting them in the same write spares a crowd of N nodes, restarting
// together, a second race of N writers for the state.
func (s *dynState) removeEpilogue(now time.Time, cfg DynamicConfig) {
	n := s.participants()
	switch {
	case s.Complete && n == 0:
		s.Complete = false
		s.Size = 0
		s.Gone = nil
		s.Round++
		s.admitWaiting(now, cfg)
	case !s.Complete && n < cfg.MinNodes:
		s.Deadline = time.Time{}
	default:
		// A gathering round that lost a rejoiner may now hold every
		// other one.
		s.completeIfRejoined(cfg)
	}
}

// admitWaiting moves waiting nodes, in node order, into a round that is
// gathering, as far as MaxNodes allows, and then completes it or starts
// its last call as adding each of them would have.
func (s *dynState) admitWaiting(now time.Time, cfg DynamicConfig) {
	n := s.participants()
	admitted := false
	for i := range s.Nodes {
		if n == cfg.MaxNodes {
			break
		}
		if s.Nodes[i].Waiting {
			s.Nodes[i].Waiting = false
			s.Nodes[i].Rank = 0
			n++
			admitted = true
		}
	}
	switch {
	case !admitted:
	case n == cfg.MaxNodes, n >= cfg.MinNodes && s.rejoined():
		s.markComplete()
	case n >= cfg.MinNodes:
		s.Deadline = now.UTC().Add(cfg.LastCallTimeout)
	}
}

// findRejoin returns n's index in Rejoin, or where it would go.
func (s *dynState) findRejoin(n NodeDesc) (int, bool) {
	return slices.BinarySearchFunc(s.Rejoin, n, func(e rejoiner, n NodeDesc) int { return compareNodes(e.NodeDesc, n) })
}

// rejoining reports whether n is a rejoiner.
func (s *dynState) rejoining(n NodeDesc) bool {
	_, ok := s.findRejoin(n)
	return ok
}

// forgetRejoin takes n out of Rejoin and reports whether it was there.
func (s *dynState) forgetRejoin(n NodeDesc) bool {
	i, ok := s.findRejoin(n)
	if ok {
		s.Rejoin = slices.Delete(s.Rejoin, i, i+1)
	}
	return ok
}

// rejoined reports whether this round follows a complete one whose members
// that left to rejoin it are all participants again (those that died on
// the way are forgotten): the round expects nobody else.
func (s *dynState) rejoined() bool {
	if len(s.Rejoin) == 0 {
		return false
	}
	for _, r := range s.Rejoin {
		if participant, _ := s.role(r.NodeDesc); !participant {
			return false
		}
	}
	return true
}

// completeIfRejoined completes a gathering round that has MinNodes and
// every rejoiner: the change that made it so (a rejoiner forgotten, a
// waiting one gone) is then the write that completes it, and wakes the
// participants, who would otherwise sleep until the last call's end.
func (s *dynState) completeIfRejoined(cfg DynamicConfig) {
	if n := s.participants(); !s.Complete && n >= cfg.MinNodes && n <= cfg.MaxNodes && s.rejoined() {
		s.markComplete()
	}
}

// sanitize drops the nodes whose heartbeat is older than the keep-alive
// TTL, as of now, and reports whether it dropped any. Every reader runs it
// on every read, so a dead node is gone for everyone at about the same
// time whether or not anyone writes.
func (s *dynState) sanitize(now time.Time, cfg DynamicConfig) bool {
	return s.sanitizeAt(now, now, cfg)
}

// Drop is what a node saw as it dropped others from the rendezvous state
// for heartbeats older than the drop timeout (DynamicConfig.OnDrop).
type Drop struct {
	Op    string     // the operation that judged: "next", "status", "keep-alive", "fold", "admit", "leave", "close"
	Nodes []NodeDesc // the nodes dropped
	// Newest and Oldest are the ages of the dropped nodes' heartbeats,
	// as of now.
	Newest, Oldest time.Duration
	// Behind is how long before now the heartbeats were judged as of:
	// 0 unless this node's own had lapsed too (see judgedAt).
	Behind time.Duration
	Kept   int // the nodes left in the state
}

// sanitize is st.sanitizeAt on behalf of op, telling OnDrop whom it
// dropped.
func (d *Dynamic) sanitize(st *dynState, now, judged time.Time, op string) bool {
	if d.cfg.OnDrop == nil {
		return st.sanitizeAt(now, judged, d.cfg)
	}
	expire := judged.Add(-d.cfg.DropTimeout())
	drop := Drop{Op: op, Behind: now.Sub(judged)}
	for _, e := range st.Nodes {
		if e.Heartbeat.Before(expire) {
			age := now.Sub(e.Heartbeat)
			if len(drop.Nodes) == 0 || age < drop.Newest {
				drop.Newest = age
			}
			drop.Oldest = max(drop.Oldest, age)
			drop.Nodes = append(drop.Nodes, e.NodeDesc)
		}
	}
	changed := st.sanitizeAt(now, judged, d.cfg)
	if len(drop.Nodes) > 0 {
		drop.Kept = len(st.Nodes)
		d.cfg.OnDrop(drop)
	}
	return changed
}

// sanitizeAt is sanitize with the heartbeats judged as of judged rather
// than now (see judgedAt).
func (s *dynState) sanitizeAt(now, judged time.Time, cfg DynamicConfig) bool {
	expire := judged.Add(-cfg.DropTimeout())
	dropped, participant := false, false
	s.Nodes = slices.DeleteFunc(s.Nodes, func(e nodeState) bool {
		if !e.Heartbeat.Before(expire) {
			return false
		}
		dropped = true
		participant = participant || !e.Waiting
		if s.Complete && !e.Waiting {
			s.Gone = append(s.Gone, e.NodeDesc)
		}
		return true
	})
	// A rejoiner is dead when it is out of both lists, whether it never
	// came back or came back and died.
	rejoiners := len(s.Rejoin)
	s.Rejoin = slices.DeleteFunc(s.Rejoin, func(r rejoiner) bool {
		_, in := s.find(r.NodeDesc)
		return !in && r.Left.Before(expire)
	})
	forgot := len(s.Rejoin) < rejoiners
	switch {
	case participant:
		s.removeEpilogue(now, cfg)
	case forgot:
		s.completeIfRejoined(cfg)
	}
	return dropped || forgot
}

// wakeAt is when a join that decided to sync should look again even if
// nobody writes: the earliest of my deadline passing, the last call ending,
// my heartbeat falling due, and another node's heartbeat (or a rejoiner's
// time to come back) expiring — the instants at which nextJoinAction or
// sanitize can decide differently on the same state. It is never later
// than one heartbeat interval from now.
func (s *dynState) wakeAt(me NodeDesc, now, deadline time.Time, cfg DynamicConfig) time.Time {
	beat, drop := cfg.HeartbeatInterval(), cfg.DropTimeout()
	at := now.Add(beat)
	consider := func(t time.Time) {
		if t.After(now) && t.Before(at) {
			at = t
		}
	}
	// The comparisons they feed are strict (now.After(x)), hence the +1ns.
	consider(deadline.Add(time.Nanosecond))
	if !s.Complete && !s.Deadline.IsZero() {
		consider(s.Deadline.Add(time.Nanosecond))
	}
	for _, e := range s.Nodes {
		switch {
		case e.NodeDesc == me:
			consider(e.Heartbeat.Add(beat))
		case !s.view:
			// A view's node never sanitizes (the state's writers do), and
			// its bucket's heartbeats are as old as its last rewrite.
			consider(e.Heartbeat.Add(drop + time.Nanosecond))
		}
	}
	for _, r := range s.Rejoin {
		if _, in := s.find(r.NodeDesc); !in {
			consider(r.Left.Add(drop + time.Nanosecond))
		}
	}
	return at
}

// round returns the completed round as me sees it, if me is in it.
func (s *dynState) round(me NodeDesc) (Round, bool) {
	if !s.Complete {
		return Round{}, false
	}
	r := Round{Number: s.Round, Rank: -1, Size: s.Size}
	for _, e := range s.Nodes {
		if e.Waiting {
			continue
		}
		r.Members = append(r.Members, Member{Node: e.NodeDesc, Rank: e.Rank, Data: slices.Clone(e.Data), Late: e.Late})
		if e.NodeDesc == me {
			r.Rank, r.Late = e.Rank, e.Late
		}
	}
	if s.Plan != nil && s.Plan.Round == s.Round {
		r.Summary = s.Plan.summary(r.Rank)
	}
	// Node order is rank order already; sort anyway, ranks are what count.
	slices.SortFunc(r.Members, func(a, b Member) int { return cmp.Compare(a.Rank, b.Rank) })
	return r, r.Rank >= 0
}

// progress is the state as OnProgress reports it to node me.
func (s *dynState) progress(me NodeDesc) Progress {
	p := Progress{Round: s.Round, Complete: s.Complete, LastCall: s.Deadline, NumParticipants: s.participants()}
	if i, ok := s.find(me); ok {
		p.InWaitList = s.Nodes[i].Waiting
	}
	if s.view {
		p.NumWaiting = s.waiting // the marker's count: Nodes is one bucket
		return p
	}
	for _, e := range s.Nodes {
		if e.Waiting {
			p.NumWaiting++
			p.Waiting = append(p.Waiting, e.NodeDesc)
		} else {
			p.Participants = append(p.Participants, e.NodeDesc)
		}
	}
	return p
}

// status is the state as Status reports it, for a node whose last round
// was last (nil before its first).
func (s *dynState) status(last *Round) Status {
	st := Status{Round: s.Round, Closed: s.Closed, Complete: s.Complete}
	for _, e := range s.Nodes {
		if e.Waiting {
			st.Waiting++
		} else {
			st.Participants++
		}
	}
	if last == nil {
		return st
	}
	// A node admitted into the last round in a lost member's place is that
	// rank's member from now on.
	members := make([]NodeDesc, len(last.Members))
	for i, m := range last.Members {
		members[i] = m.Node
	}
	if s.Round == last.Number && s.Complete {
		for _, e := range s.Nodes {
			if e.Late && !e.Waiting && e.Rank < len(members) && members[e.Rank] != e.NodeDesc {
				st.Admitted = append(st.Admitted, Member{Node: e.NodeDesc, Rank: e.Rank, Data: slices.Clone(e.Data), Late: true})
				members[e.Rank] = e.NodeDesc
			}
		}
	}
	for _, n := range members {
		if _, ok := s.find(n); !ok {
			st.Lost = append(st.Lost, n)
		}
	}
	return st
}

// request is a node's Next, queued for whichever node folds the queue
// into the state (dynamic_exec.go): instead of N nodes racing to
// compare-set the state, each pushes one of these and one of them applies
// a batch with one write.
type request struct {
	Node NodeDesc `json:"node"`
	Data []byte   `json:"data,omitempty"`
	// Call numbers the Next call on its node; never 0.
	Call uint64 `json:"call"`
	// Deadline is the node's join deadline, or its heartbeat's (which a
	// fold does not hold it to: a late beat still counts).
	Deadline time.Time `json:"deadline"`
	// KeepAlive: refresh the node's heartbeat (keep-alive operation)
	// rather than run its Next.
	KeepAlive bool `json:"keep_alive,omitzero"`
}

// foldRequest applies r to s at now exactly as r's node would apply its
// own Next on s: its exit operation (skipped when this call has done it
// already: s records the call with the node), then its join operation,
// each until it decides to sync, finish or fail. It reports whether s
// changed. A request that its node would now decide differently on (a
// round completed meanwhile, the run closed, the deadline passed) is
// decided on s, as the node itself would on reading s.
func (s *dynState) foldRequest(r request, now time.Time, cfg DynamicConfig) bool {
	if r.KeepAlive {
		// Stamped at now, when it lands, however late: liveness is what
		// the store has heard, and a store too swamped to fold for a
		// while has heard late of every node alike. Dropping a beat that
		// came after its deadline (as a late join is dropped), or
		// stamping it then, counted the nodes of a 512-agent job dead a
		// dozen at a time when the folds fell behind by more than a drop
		// timeout. A dead node is found as much later as the folds lag.
		if !keepAliveDue(s, r.Node, now, cfg) {
			return false
		}
		return s.apply(actKeepAlive, r.Node, nil, now, cfg)
	}
	ops := [2]func() action{
		func() action { return nextExitAction(s, r.Node, now, r.Deadline) },
		func() action { return nextJoinAction(s, r.Node, now, r.Deadline, cfg) },
	}
	cur := 0
	if i, ok := s.find(r.Node); ok && s.Nodes[i].Call == r.Call {
		cur = 1
	}
	changed := false
	for steps := 0; steps < 2*len(ops)+8; steps++ { // the bound only guards against a bug
		a := ops[cur]()
		if a == actFinish && cur == 0 {
			cur = 1
			continue
		}
		if a < actKeepAlive {
			break
		}
		changed = s.apply(a, r.Node, r.Data, now, cfg) || changed
	}
	if i, ok := s.find(r.Node); ok && cur == 1 && s.Nodes[i].Call != r.Call {
		s.Nodes[i].Call = r.Call
		changed = true
	}
	return changed
}
