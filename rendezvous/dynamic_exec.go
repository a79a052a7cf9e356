package rendezvous

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Member is one node of a completed round.
type Member struct {
	Node NodeDesc
	Rank int
	// Data is what the node gave NewDynamic (an agent puts its local world
	// size and address there), so that nobody needs a second exchange.
	Data []byte
	// Late: admitted into the round after it completed, in a lost
	// member's place (Admit).
	Late bool
}

// Round is a completed rendezvous round as one node sees it.
type Round struct {
	// Number counts the rounds of the run from 0.
	Number int
	// Rank is this node's rank (its group rank).
	Rank int
	// Size is the number of nodes the round completed with.
	Size int
	// Members are the round's nodes in rank order: Members[i].Rank == i.
	// Nil in a round that Next handed out as this node's share only
	// (DynamicConfig.ShareOnly, in queue mode): Dynamic.Members reads
	// them.
	Members []Member
	// Late: this node was admitted into the running round in a lost
	// member's place (Admit), not a member from its start.
	Late bool
	// Summary is what this node needs of the others (its offset, the
	// total weight, rank 0, the check's agreement), when the round was
	// completed in queue mode with DynamicConfig.Describe
	// (dynamic_plan.go): O(1) bytes where Members is O(N). Nil otherwise,
	// or when the members' data could not be described.
	Summary *Summary
}

// Store returns a view of s for keys private to this round, under the
// prefix "gorun.rendezvous.<runID>.<round>" (torchrun uses
// "torch.rendezvous.<run_id>.<round>"): a later round starts clean.
func (r Round) Store(s Store, runID string) Store {
	return NewPrefixStore("gorun.rendezvous."+runID+"."+strconv.Itoa(r.Number), s)
}

// Status is the run as one read of the state shows it; an agent polls it
// while its workers run.
type Status struct {
	// Round is the run's current round, which is past this node's last one
	// once the others have moved on.
	Round    int
	Complete bool
	// Closed: the job is done; do not rendezvous again.
	Closed bool
	// Participants counts the nodes in the current round.
	Participants int
	// Waiting counts the nodes waiting for the next round: above zero, a
	// complete round should re-rendezvous to admit them (scale-up).
	Waiting int
	// Lost lists the members of this node's last round that are no longer
	// in the state: their heartbeats lapsed, or they left. Either way that
	// round is broken.
	Lost []NodeDesc
	// Admitted lists the nodes admitted into this node's last round in a
	// lost member's place (Admit), once each: from the read that first
	// shows one, it counts as that rank's member, so that its own loss
	// shows in Lost.
	Admitted []Member
}

// ErrNoWaitingNode: Admit found fewer nodes waiting to be admitted than
// places to fill (none, for one place).
var ErrNoWaitingNode = errors.New("no node is waiting to join")

// ErrPlacesLeft: Admit was asked to fill some of the running round's empty
// places, not all: a node admitted so would not take its place (it takes
// one only in a whole round), and would go back to waiting.
var ErrPlacesLeft = errors.New("the round would keep an empty place")

// Dynamic is one node's handle on a dynamic rendezvous run: torchrun's
// DynamicRendezvousHandler over any Store.
//
// The run's state lives under the key "gorun.rendezvous.<run_id>" as JSON,
// replaced by CompareSet with the bytes last read as the token, so a
// writer that lost a race gets the winner's state in the same reply and
// decides again. A waiting node does not poll: every write that can change
// a waiting node's decision (a round completing or ending, the run closing,
// a full round making room) is followed by a Set of
// "gorun.rendezvous.<run_id>/wake/<n>", n being the state's new Wake
// number, and a waiter blocks in Wait on the key of the number after the
// one it read, until the next instant at which time alone could change its
// decision (a deadline, a heartbeat, another node's heartbeat expiring).
//
// Next, Leave and SetClosed run one at a time; Status and Close may be
// called at any time. Next holds the store (a Wait) for up to one
// heartbeat interval (DynamicConfig.HeartbeatInterval) at a time, so a
// tcpstore.Client given to a Dynamic is best not shared with callers that
// cannot wait that long.
type Dynamic struct {
	store Store
	me    NodeDesc
	data  []byte
	cfg   DynamicConfig
	key   string
	now   func() time.Time // the clock; tests replace it

	life  context.Context // done after Close: in-flight operations end
	close context.CancelFunc

	op sync.Mutex // serializes Next, Leave and SetClosed

	// noQueue: the store has no queues (a FileStore, a PyTorch 1.13
	// server): every node compare-sets the state itself.
	noQueue atomic.Bool
	calls   atomic.Uint64 // numbers Next calls (request.Call)
	// buckets is the number of share buckets (dynamic_share.go), bucket
	// this node's. viewMultiGet: read the view with one MultiGet (its keys
	// exist); viewPeek: never (the store would not wait on them).
	buckets, bucket        int
	viewMultiGet, viewPeek atomic.Bool
	// noPeek: the store is a Peeker that cannot peek after all (a
	// wrapper of one that is not); noPushPeek: a PushPeeker that cannot
	// push and peek.
	noPeek, noPushPeek atomic.Bool
	// slow is the slowest recent store request of the queue's (in
	// nanoseconds; see observe), which sets how long a folder holds its
	// lock.
	slow atomic.Int64

	mu     sync.Mutex
	closed bool
	last   *Round // the round Next last returned
	// lateSeen is how many late members the last full read by Status
	// found in last's round: the marker's count differing says that
	// Status must read the state again (an admission).
	lateSeen int
	ka       *keepAlive // the running heartbeat, or nil
	// inNext: a Next is under way; nextBeat: what its heartbeat does
	// (holdKeepAlive).
	inNext   atomic.Bool
	nextBeat atomic.Int32
	silence  silence // when this node last found itself silent (judgedAt)
}

// keepAlive is a running heartbeat goroutine.
type keepAlive struct {
	stop context.CancelFunc
	done chan struct{}
}

// errHandleClosed is returned by operations on a closed Dynamic.
var errHandleClosed = fmt.Errorf("dynamic rendezvous handle: %w", ErrClosed)

// emptyState is what an absent or empty key stands for.
var emptyState = func() []byte {
	b, err := json.Marshal(&dynState{})
	if err != nil {
		panic(err)
	}
	return b
}()

// NewDynamic returns a handle for node me in the run cfg.RunID on store. It
// does no I/O: the state is created by the first operation that reads it.
// data travels with the node's entry and comes back in every Member.
func NewDynamic(store Store, me NodeDesc, data []byte, cfg DynamicConfig) (*Dynamic, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if store == nil {
		return nil, fmt.Errorf("%w: dynamic rendezvous: nil store", ErrInvalidArgument)
	}
	if me.Addr == "" {
		return nil, fmt.Errorf("%w: dynamic rendezvous: node with no address", ErrInvalidArgument)
	}
	life, cancel := context.WithCancel(context.Background())
	d := &Dynamic{
		store: store,
		me:    me,
		data:  slices.Clone(data),
		cfg:   cfg,
		key:   "gorun.rendezvous." + cfg.RunID,
		now:   time.Now,
		life:  life,
		close: cancel,
	}
	if q := cmp.Or(cfg.QueueMinNodes, defaultQueueMinNodes); q < 0 || cfg.MaxNodes < q {
		d.noQueue.Store(true)
	}
	d.buckets = shareBuckets(cfg.MaxNodes)
	d.bucket = bucketOf(me, d.buckets)
	// Call numbers start from the clock so that a handle made anew for the
	// same node (same address, pid and local id) does not reuse one that
	// the state may still hold.
	d.calls.Store(uint64(time.Now().UnixNano()))
	return d, nil
}

// Node returns the node this handle speaks for.
func (d *Dynamic) Node() NodeDesc { return d.me }

// Config returns the configuration, defaults filled in.
func (d *Dynamic) Config() DynamicConfig { return d.cfg }

// Next leaves the round this node was in, if any, and joins the next one,
// returning when it completes: at once when MaxNodes nodes are in, or when
// every member of the previous round that left it to rejoin is back and
// MinNodes are; otherwise LastCallTimeout after the latest joiner once
// MinNodes are. A node that finds the round complete without it waits for
// the one after. It fails with an error wrapping ErrRendezvousClosed when
// the run is closed, and with one wrapping ErrRendezvousTimeout (and
// ErrTimeout) after JoinTimeout. While the node is in no Next, a goroutine
// keeps its heartbeat, so that the others do not count it as dead.
//
// Next, Leave and SetClosed run one at a time: to stop a Next in flight,
// cancel its context (or Close the handle).
func (d *Dynamic) Next(ctx context.Context) (Round, error) {
	d.op.Lock()
	defer d.op.Unlock()
	if err := d.holdKeepAlive(!d.noQueue.Load()); err != nil {
		return Round{}, err
	}
	d.inNext.Store(true)
	d.nextBeat.Store(beatNone)
	if d.lastRound() != nil {
		d.nextBeat.Store(beatInState)
	}
	joined := false
	defer func() {
		d.inNext.Store(false)
		if !joined {
			d.stopKeepAlive() // as before Next: no round, no heartbeat
		}
	}()
	ctx, done := d.bind(ctx)
	defer done()
	// Past the deadline the join may still spend the rollback window
	// taking itself out; the context only guards against a hung store.
	ctx, cancel := context.WithTimeout(ctx, d.cfg.JoinTimeout+rollbackWindow)
	defer cancel()
	deadline := d.now().Add(d.cfg.JoinTimeout)

	// In queue mode the node reads its view (the marker and its bucket),
	// never the whole state: dynamic_share.go.
	snap, err := d.readFor(ctx, !d.noQueue.Load())
	if err != nil {
		snap = &snapshot{}
		if err := d.outwait(ctx, "next", err, deadline, snap, !d.noQueue.Load()); err != nil {
			return Round{}, d.fail("next", err)
		}
	}
	exit := func(s *dynState, now time.Time) action { return nextExitAction(s, d.me, now, deadline) }
	join := func(s *dynState, now time.Time) action { return nextJoinAction(s, d.me, now, deadline, d.cfg) }
	var report func(*dynState)
	if d.cfg.OnProgress != nil {
		var last *Progress
		report = func(s *dynState) {
			if p := s.progress(d.me); last == nil || !p.equal(*last) {
				last = &p
				d.cfg.OnProgress(p)
			}
		}
	}
	call := d.calls.Add(1)
	var q *queued
	if !d.noQueue.Load() {
		q = &queued{req: request{Node: d.me, Data: d.data, Call: call, Deadline: deadline.UTC()}}
	}
	st, err := d.run(ctx, snap, "next", deadline, []decider{exit, join}, report, q, call)
	if err != nil {
		return Round{}, d.fail("next", err)
	}
	var r Round
	var ok bool
	if st.view {
		r, ok = st.viewRound(d.me)
	} else {
		r, ok = st.round(d.me)
	}
	if !ok { // the join op finishes only as a member
		return Round{}, fmt.Errorf("rendezvous: run %q: join finished outside the round", d.cfg.RunID)
	}
	if d.cfg.ShareOnly && q != nil {
		// Same contract whether the round came from a view or, on the
		// node that folded it, from the state.
		r.Members = nil
	}
	if r.Members == nil && !d.cfg.ShareOnly {
		err := d.fetchMembers(ctx, &r)
		err = d.patiently(ctx, "next", deadline, err, func() error { return d.fetchMembers(ctx, &r) })
		if err != nil {
			return Round{}, d.fail("next", err)
		}
	}
	i, _ := st.find(d.me)
	beat := st.Nodes[i].Heartbeat
	if q != nil && q.beat.After(beat) {
		beat = q.beat
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return Round{}, errHandleClosed
	}
	d.last = &r
	d.lateSeen = 0
	if r.Late {
		d.lateSeen = -1 // unknown: Status reads the state once
	}
	if d.ka == nil { // compare-set mode: Next beat itself until now
		d.startKeepAlive(beat.Add(d.cfg.HeartbeatInterval()))
	}
	joined = true
	return r, nil
}

// Status reads the state once. A read that finds dead nodes writes the
// sanitized state back (once; a lost race is not retried), so that a node
// that is not in Next still makes them go.
func (d *Dynamic) Status(ctx context.Context) (Status, error) {
	ctx, done := d.bind(ctx)
	defer done()
	if st, ok, err := d.quickStatus(ctx); err != nil || ok {
		return st, d.fail("status", err)
	}
	snap, err := d.read(ctx)
	if err != nil {
		return Status{}, d.fail("status", err)
	}
	now := d.now()
	st := snap.st.clone()
	judged := d.judgedAt(st, now)
	lapsed := snap.st.clone().sanitizeAt(now, judged, d.cfg)
	if lapsed {
		// Not while beats wait in the queue: the folds apply them before
		// they judge (apply), and a Status that judged first dropped the
		// nodes whose beats were there.
		if queued, err := d.requestsQueued(ctx); err != nil {
			return Status{}, d.fail("status", err)
		} else if queued {
			lapsed = false
		}
	}
	if lapsed && d.sanitize(st, now, judged, "status") {
		if _, err := d.commit(ctx, snap, st, time.Time{}); err != nil {
			return Status{}, d.fail("status", err)
		}
		st = snap.st.clone()
		st.sanitizeAt(now, d.judgedAt(st, now), d.cfg)
	}
	d.mu.Lock()
	shareOnly := d.last != nil && d.last.Members == nil && d.last.Size > 0
	d.mu.Unlock()
	if shareOnly { // Lost needs the round's members
		if _, err := d.Members(ctx); err != nil {
			return Status{}, err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	status := st.status(d.last)
	if d.last != nil && st.Round == d.last.Number {
		d.lateSeen = st.marker(d.cfg).Late
	}
	if len(status.Admitted) > 0 {
		r := *d.last
		r.Members = slices.Clone(r.Members)
		for _, m := range status.Admitted {
			r.Members[m.Rank] = m
		}
		d.last = &r
	}
	return status, nil
}

// requestsQueued reports whether requests wait in the run's queue (false
// where the store has none, or this run does not queue).
func (d *Dynamic) requestsQueued(ctx context.Context) (bool, error) {
	if d.noQueue.Load() {
		return false, nil
	}
	n, err := d.store.QueueLen(ctx, d.key+queueSuffix)
	if errors.Is(err, ErrNotSupported) {
		return false, nil
	}
	return n > 0, err
}

// quickStatus answers Status from the marker alone, in queue mode, when
// it shows this node's last round complete, as it was at the last look
// but for the members it names gone or counts rejoining (none admitted,
// not closed, no heartbeat expired that no fold has judged since, and
// nobody waiting unless a member is gone: the round is broken then, and
// the waiting are the next round's, among them every member counted as
// rejoining, after a restart): what Status finds on almost every poll, and on the
// polls after a member is lost, for O(1) bytes (O(lost)) instead of the
// state's O(N). It reports false when the state must be read.
func (d *Dynamic) quickStatus(ctx context.Context) (Status, bool, error) {
	d.mu.Lock()
	last, lateSeen := d.last, d.lateSeen
	d.mu.Unlock()
	if d.noQueue.Load() || last == nil {
		return Status{}, false, nil
	}
	b, err := d.peek(ctx, d.key+markerSuffix, emptyMarker)
	if err != nil {
		return Status{}, false, err
	}
	var m marker
	if json.Unmarshal(b, &m) != nil || m.Pub == 0 || m.Round != last.Number || !m.Complete || m.Closed ||
		m.Participants+len(m.Gone)+m.Rejoining != last.Size || m.Rejoining > m.Waiting || m.Waiting != 0 && len(m.Gone) == 0 ||
		m.Late != lateSeen || len(m.Gone) > 0 && m.Late > 0 {
		return Status{}, false, nil
	}
	if now := d.now(); now.After(m.Expires) && !now.Before(m.Expires.Add(d.cfg.HeartbeatInterval())) {
		// The oldest heartbeat has lapsed: the state's next writer drops
		// its node, and the marker will say so. The heartbeats' folds
		// write it as they go (at least one an interval while anyone
		// beats), and a fold started since the expiry has judged it (it
		// may have kept it: judgedAt). Read and written back by every
		// Status instead (at 512 agents, 441 of them at once, the whole
		// state each, every second, on the store that had to take their
		// beats), it swamped the store. So Status reads the state only
		// when no fold has started an interval after the expiry: a loss
		// is seen up to an interval later than the window.
		folded, err := d.foldedSince(ctx, m.Expires)
		if err != nil || !folded {
			return Status{}, false, err
		}
	}
	// A member gone is named by the marker (unless someone was admitted
	// into the round: then the state says who holds which rank).
	return Status{Round: m.Round, Complete: true, Participants: m.Participants, Waiting: m.Waiting, Lost: m.Gone}, true, nil
}

// errNoRound: an operation on the round Next returned, before it did.
var errNoRound = errors.New("this node is in no round")

// lastRound returns the round Next last returned, or nil.
func (d *Dynamic) lastRound() *Round {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.last
}

// Admit makes nodes waiting for the next round members of the running
// one, one in the place of each of its members of ranks ranks, which must
// be lost: the replacements for nodes that died, taken in while the others
// go on (gorun's heal), where torchrun would end the round for everyone.
// The admitted nodes' Next returns this round, with Late set. ranks must
// be every place of the round that no member holds (else the error wraps
// ErrPlacesLeft): an admitted node takes its place only in a whole round,
// and all of them are admitted in one write, so that none wakes to a
// round that still has a hole. It returns the admitted nodes in the order
// of ranks, or an error wrapping ErrNoWaitingNode when fewer nodes wait
// than ranks has places, admitting none. The caller must be a member of
// the round.
func (d *Dynamic) Admit(ctx context.Context, ranks ...int) ([]NodeDesc, error) {
	ctx, done := d.bind(ctx)
	defer done()
	last := d.lastRound()
	if last == nil {
		return nil, d.fail("admit", errNoRound)
	}
	snap, err := d.read(ctx)
	for err == nil {
		st := snap.st.clone()
		now := d.now()
		d.sanitize(st, now, d.judgedAt(st, now), "admit")
		if st.Round != last.Number {
			return nil, d.fail("admit", fmt.Errorf("round %d has ended (the run is at round %d)", last.Number, st.Round))
		}
		var ns []NodeDesc
		if ns, err = st.admit(ranks...); err != nil {
			break
		}
		var won bool
		if won, err = d.commit(ctx, snap, st, time.Time{}); err == nil && won {
			return ns, nil
		}
	}
	return nil, d.fail("admit", err)
}

// SetClosed marks the run closed: the job is done, and every node's Next
// fails with ErrRendezvousClosed from now on, the waiting ones at once.
// It gives up after CloseTimeout. In queue mode a run the marker already
// shows closed is left as it is, for one read of the marker: at a job's
// end every node closes the run, and 512 of them each reading the whole
// state (on etcd a Raft proposal with an O(N) answer) held etcd long
// enough to let hundreds of their leases lapse.
func (d *Dynamic) SetClosed(ctx context.Context) error {
	d.op.Lock()
	defer d.op.Unlock()
	ctx, done := d.bind(ctx)
	defer done()
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CloseTimeout)
	defer cancel()
	deadline := d.now().Add(d.cfg.CloseTimeout)
	if closed, err := d.markedClosed(ctx); err != nil || closed {
		return d.fail("set closed", err)
	}
	snap, err := d.read(ctx)
	if err == nil {
		closeOp := func(s *dynState, now time.Time) action { return nextCloseAction(s, now, deadline) }
		_, err = d.run(ctx, snap, "close", deadline, []decider{closeOp}, nil, nil, 0)
	}
	return d.fail("set closed", err)
}

// markedClosed reports whether the marker shows the run closed, in queue
// mode. The marker is published after the state is written, so a marker
// that says closed is never ahead of the state; one that does not may be
// behind it, and then the state is read.
func (d *Dynamic) markedClosed(ctx context.Context) (bool, error) {
	if d.noQueue.Load() {
		return false, nil
	}
	b, err := d.peek(ctx, d.key+markerSuffix, emptyMarker)
	if err != nil {
		return false, err
	}
	var m marker
	return json.Unmarshal(b, &m) == nil && m.Pub > 0 && m.Closed, nil
}

// Leave takes this node out of the run (out of its round, or out of the
// wait list) and stops its heartbeat: a node shutting down cleanly, which
// the others then need not wait KeepAliveInterval × KeepAliveMaxAttempt to
// see gone. It gives up after CloseTimeout.
func (d *Dynamic) Leave(ctx context.Context) error {
	d.op.Lock()
	defer d.op.Unlock()
	if err := d.stopKeepAlive(); err != nil {
		return err
	}
	ctx, done := d.bind(ctx)
	defer done()
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CloseTimeout)
	defer cancel()
	deadline := d.now().Add(d.cfg.CloseTimeout)
	snap, err := d.read(ctx)
	if err == nil {
		leave := func(s *dynState, now time.Time) action { return nextLeaveAction(s, d.me, now, deadline) }
		_, err = d.run(ctx, snap, "leave", deadline, []decider{leave}, nil, nil, 0)
	}
	return d.fail("leave", err)
}

// Close stops the heartbeat and ends any operation in flight, without
// writing to the store: the others drop this node when its heartbeat
// lapses. Later operations fail with an error wrapping ErrClosed. Close is
// idempotent and returns nil.
func (d *Dynamic) Close() error {
	d.mu.Lock()
	d.closed = true
	ka := d.ka
	d.ka = nil
	d.mu.Unlock()
	d.close()
	if ka != nil {
		ka.stop()
		<-ka.done
	}
	return nil
}

// bind derives from ctx a context that Close also ends.
func (d *Dynamic) bind(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(d.life, func() { cancel(errHandleClosed) })
	return ctx, func() {
		stop()
		cancel(nil)
	}
}

// fail wraps a failed operation's error, reporting ErrClosed when Close
// was the reason.
func (d *Dynamic) fail(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case d.life.Err() != nil:
		return fmt.Errorf("rendezvous: run %q: %s: %w", d.cfg.RunID, op, errHandleClosed)
	default:
		return fmt.Errorf("rendezvous: run %q: %s: %w", d.cfg.RunID, op, err)
	}
}

// snapshot is the state as last read or written.
type snapshot struct {
	st    *dynState // decoded from token; never modified (clone it)
	token []byte    // the bytes in the store: CompareSet's expected value
}

// read fetches the state. A CompareSet that expects an absent key both
// reads without blocking (Get would wait for the key) and creates the
// empty state when there is none.
func (d *Dynamic) read(ctx context.Context) (*snapshot, error) {
	b, err := d.readState(ctx)
	if err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	return d.decode(b)
}

// readState is read's compare-set: create-only, of one constant value
// (CreateOnce: sent again while the store cannot tell its outcome).
func (d *Dynamic) readState(ctx context.Context) ([]byte, error) {
	return CreateOnce(ctx, d.store, d.key, emptyState)
}

// readFor reads this node's view in queue mode (view), the state
// otherwise.
func (d *Dynamic) readFor(ctx context.Context, view bool) (*snapshot, error) {
	if view {
		return d.readView(ctx)
	}
	return d.read(ctx)
}

func (d *Dynamic) decode(b []byte) (*snapshot, error) {
	st := &dynState{}
	if len(b) > 0 {
		if err := json.Unmarshal(b, st); err != nil {
			return nil, fmt.Errorf("state under %q is not a gorun rendezvous state: %w", d.key, err)
		}
		slices.SortFunc(st.Nodes, func(a, b nodeState) int { return compareNodes(a.NodeDesc, b.NodeDesc) })
	}
	return &snapshot{st: st, token: b}, nil
}

// commit tries to replace snap's state with st and reports whether it won.
// Either way snap ends up holding the store's current state: st, or the
// winner's. A change that waiters must see (wakes) takes the next Wake
// number, and the winner then wakes them.
//
// In queue mode the winner also publishes the change (the marker, the
// shares, the members: dynamic_share.go) before it wakes anybody.
//
// A write whose answer is lost or late is settled by reading the state
// back: once, or, with patience (a run's deadline), for as long as the
// store is only slow and patience is ahead. Status and the folder, which
// decide nothing more on the outcome, take no patience: a Status that
// waited out a swamped store for its whole window counted the store's host
// as gone (512 agents, every one of them).
func (d *Dynamic) commit(ctx context.Context, snap *snapshot, st *dynState, patience time.Time) (bool, error) {
	if snap.st.view || st.view {
		return false, errors.New("bug: a node's view written as the state")
	}
	notify := wakes(snap.st, st, d.cfg)
	if notify {
		st.Wake = snap.st.Wake + 1
	}
	publish := !d.noQueue.Load()
	if publish {
		planRound(st, d.cfg.Describe)
		numberPublication(snap.st, st, d.cfg)
	}
	b, err := json.Marshal(st)
	if err != nil {
		return false, err
	}
	cur, err := d.store.CompareSet(ctx, d.key, snap.token, b)
	if errors.Is(err, ErrOutcomeUnknown) || slowStore(ctx, err) {
		// The store lost the answer and cannot tell whether it applied
		// the write (etcd, its link down past the lease of the token
		// that would say), or it took too long to give one. What the
		// state holds now tells: the write, or another state (the write
		// not applied, or overwritten since by a node that read it): a
		// race lost, as below. Failing instead ended the agent of a
		// spare whose link was cut for 4 s; a caller that went on
		// without knowing would redo operations the write finished.
		cur, err = d.readState(ctx)
		if !patience.IsZero() {
			err = d.patiently(ctx, "write state", patience, err, func() (err error) {
				cur, err = d.readState(ctx)
				return err
			})
		}
	}
	if err != nil {
		return false, fmt.Errorf("write state: %w", err)
	}
	switch {
	case bytes.Equal(cur, b):
		before := snap.st
		*snap = snapshot{st: st, token: b}
		if publish {
			if err := d.publish(ctx, before, st); err != nil {
				return true, err
			}
		}
		if notify {
			return true, d.notify(ctx, st.Wake)
		}
		return true, nil
	case bytes.Equal(cur, snap.token):
		// c10d answers a CompareSet on an absent key with the expected
		// value: somebody deleted the state. Start over from a fresh one.
		fresh, err := d.read(ctx)
		if err != nil {
			return false, err
		}
		*snap = *fresh
		return false, nil
	default:
		fresh, err := d.decode(cur)
		if err != nil {
			return false, err
		}
		*snap = *fresh
		return false, nil
	}
}

// notifyKeep is how many wake-up keys are kept; the writer of number n
// deletes that of n-notifyKeep. A waiter more than that far behind just
// sleeps until its own wake-up time.
const notifyKeep = 64

func (d *Dynamic) wakeKey(n uint64) string {
	return d.key + "/wake/" + strconv.FormatUint(n, 10)
}

// notify wakes the nodes waiting for wake-up n.
func (d *Dynamic) notify(ctx context.Context, n uint64) error {
	if err := d.store.Set(ctx, d.wakeKey(n), nil); err != nil {
		return fmt.Errorf("wake-up %d: %w", n, err)
	}
	if n > notifyKeep {
		d.store.Delete(ctx, d.wakeKey(n-notifyKeep)) // tidying only; an error here changes nothing
	}
	return nil
}

// decider is one of the operations of dynamic.go bound to a node and a
// deadline.
type decider func(s *dynState, now time.Time) action

// run executes ops in sequence (each until it finishes) from snap, and
// returns the state the last one finished on; report, if not nil, sees
// every state that the last op decided on, as written or read.
//
// Each pass sanitizes the freshest state and lets the operations decide
// and apply their actions to it locally until one decides to sync, finish
// or fail; then, if anything changed, it writes the result with one
// CompareSet. A batch of actions so written is what torchrun's executor
// would do with no other writer between its steps, so it is one valid
// ordering; it saves a write per step, and contention, when many nodes
// call Next together (exit and join become one write). A lost race
// discards the batch and decides again, at once, on the winner's state,
// which came back with the loss. (No random back-off: sleeps below a
// millisecond are not to be had, and above one they cost more than the
// retries they save.)
//
// With q (Next's exit and join, on a store with queues), a pass that would
// write queues q's request instead, for whichever node holds the folder
// lock to apply with everyone else's in one write (see fold), and waits
// for the result like any other change: the state records with the node
// the call whose request last put it there, which tells the node that its
// exit is done.
func (d *Dynamic) run(ctx context.Context, snap *snapshot, name string, deadline time.Time, ops []decider, report func(*dynState), q *queued, call uint64) (*dynState, error) {
	done := 0 // ops finished on a state that is in the store
	queueMode := func() bool { return q != nil && !d.noQueue.Load() }
	// failed ends the run with err, unless the store was only slow: then
	// the run reads afresh (whatever became of the operation that timed
	// out, the state says) and decides again.
	failed := func(err error) error { return d.outwait(ctx, name, err, deadline, snap, queueMode()) }
	for {
		if snap.st.view && !queueMode() {
			// No queues after all: compare-set the state itself.
			fresh, err := d.read(ctx)
			if err != nil {
				if err := failed(err); err != nil {
					return nil, err
				}
				continue
			}
			*snap = *fresh
		}
		now := d.now()
		if snap.st.stale && queueMode() {
			// My bucket is not of the marker's round as it is: a
			// publication under way (shares go first), or one that
			// crossed another and left it older than the state. Wait
			// for the next wake-up or look; stale past settle, decide on
			// the state itself (O(N) bytes, once per look).
			if q.staleSince.IsZero() {
				q.staleSince = now
			}
			var err error
			if since := now.Sub(q.staleSince); since < d.settle() {
				err = d.await(ctx, snap, now, now.Add(d.settle()-since), true)
			} else {
				var fresh *snapshot
				if fresh, err = d.read(ctx); err == nil {
					*snap = *fresh
				}
			}
			if err != nil {
				if err := failed(err); err != nil {
					return nil, err
				}
			}
			continue
		}
		if q != nil && snap.st.view {
			q.staleSince = time.Time{}
		}
		st := snap.st.clone()
		dropped := false
		if st.view {
			// Only the state's writers sanitize (a view's heartbeats are
			// as old as its bucket's last rewrite); my own heartbeat is
			// at least as new as my last folded keep-alive.
			if i, ok := st.find(d.me); ok && q.beat.After(st.Nodes[i].Heartbeat) {
				st.Nodes[i].Heartbeat = q.beat
			}
		} else if queueMode() {
			// Decided on, not written: the request goes to a fold, which
			// judges the state as it is then (apply), and says whom it
			// drops. (Told from here too, a queued Next that read the
			// state during a crowd's rendezvous at 512 agents "dropped"
			// 199 live nodes that nobody dropped.)
			dropped = st.sanitizeAt(now, d.judgedAt(st, now), d.cfg)
		} else {
			dropped = d.sanitize(st, now, d.judgedAt(st, now), name)
		}
		cur, changed := done, dropped
		beatsOnly := !dropped // the pass only refreshes my heartbeat
		stamped := false      // … or stamps my call too
		if queueMode() {
			cur = 0
		}
		if i, ok := st.find(d.me); ok && call != 0 && st.Nodes[i].Call == call {
			cur = len(ops) - 1 // this call's exit is done (see Call)
		}
		if _, in := st.find(d.me); in && q != nil {
			d.nextBeat.Store(beatInState)
		}
		var a action
		for steps := 0; ; steps++ {
			if steps > 2*len(ops)+8 { // a decider that never settles is a bug; do not spin
				return nil, fmt.Errorf("%s: no progress after %d steps (last %v)", name, steps, a)
			}
			a = ops[cur](st, now)
			if a == actFinish && cur < len(ops)-1 {
				cur++
				continue
			}
			if a < actKeepAlive { // sync, finish, or an error: the batch ends
				break
			}
			if st.apply(a, d.me, d.data, now, d.cfg) {
				changed = true
				beatsOnly = beatsOnly && a == actKeepAlive
			}
		}
		if i, ok := st.find(d.me); ok && call != 0 && cur == len(ops)-1 && !st.view && st.Nodes[i].Call != call {
			// As a fold stamps a request's call (foldRequest): a pass
			// that decides afresh after a write whose outcome it does not
			// know (it timed out, or it won and was overwritten before
			// the read back) must not take the node out again.
			st.Nodes[i].Call = call
			changed, stamped = true, true
		}
		if changed && beatsOnly && !stamped && queueMode() {
			// My heartbeat alone is due: the keep-alive goroutine, which
			// runs through a queued Next, sends it (holdKeepAlive).
			changed = false
		}
		if changed && queueMode() {
			again, err := d.request(ctx, snap, q, now, beatsOnly)
			switch {
			case err != nil:
				if err := failed(err); err != nil {
					return nil, err
				}
			case again: // folded here, or no queues after all: decide afresh
			default:
				// Another node folds: wait for a wake-up (the round
				// completing, ending, the run closing), as after any
				// other change, and look once a lazy fold's delay after
				// the push (the folder may have let go just before it:
				// fold the rest then), and again at settle (the request
				// may have been lost with a folder that died). Not at
				// every batch: in a crowd of thousands each batch would
				// wake every node whose request is still queued, and
				// their reads would starve the folder's pops.
				if err := d.awaitQueued(ctx, snap, st, q, now, deadline); err != nil {
					if err := failed(err); err != nil {
						return nil, err
					}
				}
			}
			continue
		}
		if changed {
			won, err := d.commit(ctx, snap, st, deadline)
			if won {
				done = cur // even if telling the others failed
			}
			if err != nil {
				if err := failed(err); err != nil {
					return nil, err
				}
				continue
			}
			if !won {
				continue
			}
		}
		done = cur
		if report != nil && done == len(ops)-1 {
			report(st)
		}
		switch a {
		case actFinish:
			return st, nil
		case actErrClosed:
			return nil, ErrRendezvousClosed
		case actErrTimeout:
			others := st.participants()
			if p, _ := st.role(d.me); p {
				others--
			}
			return nil, fmt.Errorf("%w in round %d, which %d other node(s) had joined (it needs %d..%d)",
				ErrRendezvousTimeout, st.Round, others, d.cfg.MinNodes, d.cfg.MaxNodes)
		}
		if err := d.await(ctx, snap, now, st.wakeAt(d.me, now, deadline, d.cfg), queueMode()); err != nil { // actSync
			if err := failed(err); err != nil {
				return nil, err
			}
		}
	}
}

// outwait is what a run makes of err, an operation's failure: err itself,
// unless the store was only slow (slowStore) and the run's deadline is
// still ahead; then snap is read afresh (its kind, a view or the state, as
// view says) and outwait returns nil for the run to decide on it again.
func (d *Dynamic) outwait(ctx context.Context, op string, err error, deadline time.Time, snap *snapshot, view bool) error {
	return d.patiently(ctx, op, deadline, err, func() error {
		fresh, err := d.readFor(ctx, view)
		if err == nil {
			*snap = *fresh
		}
		return err
	})
}

// patiently calls again, after a pause, for as long as err, the last
// call's error (or what made the first), says the store is slow
// (slowStore) and deadline (if set; ctx's in any case) is ahead, and
// returns the last error (nil once a call succeeds).
func (d *Dynamic) patiently(ctx context.Context, op string, deadline time.Time, err error, again func() error) error {
	pause := slowStorePause
	for err != nil && slowStore(ctx, err) && (deadline.IsZero() || d.now().Before(deadline)) {
		if d.cfg.OnSlowStore != nil {
			d.cfg.OnSlowStore(op, err)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		pause = min(2*pause, 8*slowStorePause)
		err = again()
	}
	return err
}

// judgedAt is the instant as of which this node judges the heartbeats in
// s, the state: now, unless its own heartbeat in s is older than the drop
// timeout (it would count itself dead), or was within the last drop
// timeout; then one heartbeat interval after its own last heartbeat from
// before that silence. A node whose own beats have not landed (a store
// too swamped to take them, or this node paused) learns nothing of the
// others from theirs, which did not land either; judged so, it drops only
// those whose beats stopped before its own did, and the others once they
// have missed a whole drop timeout of beats after its own landed again.
// Judging by now, the first agent of 512 whose beat got through a swamped
// store found every other dead and ended the round for all of them.
//
// And the crowd's rule (crowdJudged): judged so, it would drop more than
// half of the others at once.
func (d *Dynamic) judgedAt(s *dynState, now time.Time) time.Time {
	drop := d.cfg.DropTimeout()
	d.mu.Lock()
	defer d.mu.Unlock()
	if i, ok := s.find(d.me); ok && s.Nodes[i].Heartbeat.Before(now.Add(-drop)) {
		d.silence = silence{judged: s.Nodes[i].Heartbeat.Add(d.cfg.HeartbeatInterval()), until: now.Add(drop)}
	}
	judged := now
	if now.Before(d.silence.until) {
		judged = d.silence.judged
	}
	return crowdJudged(s, d.me, now, judged, d.cfg)
}

// crowdJudged is judged, or an earlier instant: when judging as of judged
// would drop two or more nodes and more than half of the nodes other than
// me, it is a heartbeat interval after the newest of their heartbeats, but
// not earlier than a drop timeout ago. A crowd whose beats all lapse together has
// most likely not died together: its store fell behind (every agent of
// 512 on two cores, the store's host among them) or this node cannot hear
// of it (one that was itself dropped and joins again), and it is given
// one more drop timeout; nodes that fell silent a drop timeout before the
// crowd's newest beat go as before. Half of a job lost at once is found
// one drop timeout later than one node is.
func crowdJudged(s *dynState, me NodeDesc, now, judged time.Time, cfg DynamicConfig) time.Time {
	expire := judged.Add(-cfg.DropTimeout())
	others, lapsed := 0, 0
	var newest time.Time
	for _, e := range s.Nodes {
		if e.NodeDesc == me {
			continue
		}
		others++
		if e.Heartbeat.Before(expire) {
			lapsed++
		}
		if e.Heartbeat.After(newest) {
			newest = e.Heartbeat
		}
	}
	if lapsed < 2 || 2*lapsed <= others {
		return judged
	}
	crowd := newest.Add(cfg.HeartbeatInterval())
	if floor := now.Add(-cfg.DropTimeout()); crowd.Before(floor) {
		crowd = floor
	}
	if crowd.Before(judged) {
		return crowd
	}
	return judged
}

// silence is the last time this node found its own heartbeat in the state
// older than the drop timeout: until when it judges the others' as of
// judged (see judgedAt).
type silence struct{ judged, until time.Time }

// slowStorePause is the first pause before a run reads again after an
// operation timed out; it doubles, up to eight times, while the reads
// time out too.
const slowStorePause = 250 * time.Millisecond

// slowStore is SlowStore while the caller's ctx still has time.
func slowStore(ctx context.Context, err error) bool {
	return ctx.Err() == nil && SlowStore(err)
}

// awaitQueued waits, after queueing q's request on st (this node's
// decision on snap at now), as await does, until a wake-up or the first
// of st's wake-up time, the lazy look after the push (none for a crowd's
// join that found a folder at work: crowded) and settle (q.due).
// Where the store peeks (etcd), a lazy or settle look first reads the
// folder lock alone, and goes on waiting while a folder holds it (the
// folder will take the request, or a look at settle finds it gone): in a
// crowd of thousands on a loaded etcd, a look of every node at its view
// and the lock each second would starve the folder's own requests.
func (d *Dynamic) awaitQueued(ctx context.Context, snap *snapshot, st *dynState, q *queued, now, deadline time.Time) error {
	for {
		at := st.wakeAt(d.me, now, deadline, d.cfg)
		wake := at
		if q.due.Before(wake) {
			wake = q.due
		}
		if lazy := q.sent.Add(d.lazyDelay()); !q.atWork && lazy.After(now) && lazy.Before(wake) {
			wake = lazy
		}
		notified, err := d.waitWake(ctx, snap, now, wake)
		if err != nil {
			return err
		}
		if notified || !wake.Before(at) || !d.canPeek() {
			return d.reread(ctx, snap, notified, wake, true)
		}
		cur, err := d.readLock(ctx)
		if err != nil {
			return err
		}
		lock := parseLock(cur)
		if now = d.now(); lock.lapsed(now) {
			q.lapsed = true
			return d.reread(ctx, snap, false, wake, true)
		}
		q.due = lookAgain(now, lock, d.lookPeriod())
	}
}

// await blocks until the wake-up after snap's or until wake, then
// re-reads snap: this node's view with view, else the state.
func (d *Dynamic) await(ctx context.Context, snap *snapshot, now, wake time.Time, view bool) error {
	notified, err := d.waitWake(ctx, snap, now, wake)
	if err != nil {
		return err
	}
	return d.reread(ctx, snap, notified, wake, view)
}

// waitWake blocks until the wake-up after snap's (and reports true) or
// until wake.
func (d *Dynamic) waitWake(ctx context.Context, snap *snapshot, now, wake time.Time) (bool, error) {
	target := snap.st.Wake + 1
	if dur := wake.Sub(now); dur > 0 {
		wctx, cancel := context.WithTimeout(ctx, dur)
		err := d.store.Wait(wctx, d.wakeKey(target))
		cancel()
		switch {
		case ctx.Err() != nil:
			return false, context.Cause(ctx)
		case err == nil:
			return true, nil
		case !errors.Is(err, ErrTimeout) && !errors.Is(err, context.DeadlineExceeded):
			return false, fmt.Errorf("wait for wake-up %d: %w", target, err)
		}
	}
	return false, nil
}

// reread re-reads snap after a wait that ended at wake (notified: by its
// wake-up): this node's view with view, else the state.
func (d *Dynamic) reread(ctx context.Context, snap *snapshot, notified bool, wake time.Time, view bool) error {
	target := snap.st.Wake + 1
	fresh, err := d.readFor(ctx, view)
	if err != nil {
		return err
	}
	if notified && fresh.st.Wake < target {
		// The key was there but the state is older: it was reset under
		// old wake-up keys (or a view's marker lags). Sleep instead of
		// spinning on them.
		if err := sleep(ctx, wake.Sub(d.now())); err != nil {
			return err
		}
		if fresh, err = d.readFor(ctx, view); err != nil {
			return err
		}
	}
	*snap = *fresh
	return nil
}

// sleep waits for d or ctx.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}

// startKeepAlive starts the heartbeat goroutine, first due at next; d.mu
// must be held.
func (d *Dynamic) startKeepAlive(next time.Time) {
	ctx, stop := context.WithCancel(d.life)
	ka := &keepAlive{stop: stop, done: make(chan struct{})}
	d.ka = ka
	go func() {
		defer close(ka.done)
		for sleep(ctx, next.Sub(d.now())) == nil {
			next = d.keepAliveOnce(ctx)
		}
	}()
}

// What a queued Next's heartbeat does (Dynamic.nextBeat).
const (
	// beatNone: nothing yet; the node is neither in the state nor queued
	// to be, and a beat would change nothing.
	beatNone int32 = iota
	// beatQueued: its request is queued, and may be folded before its
	// reads show it: a beat is pushed, and left to whoever folds (its
	// own look at the folder lock would be one more of a crowd's looks
	// at a folder at work).
	beatQueued
	// beatInState: the node has seen itself in the state: a beat is
	// pushed and folded lazily, as outside a Next.
	beatInState
)

// holdKeepAlive readies the heartbeat for a Next: with queued (the store
// has queues) it keeps the goroutine running, starting it an interval
// from now if none runs; else it stops it, and Next beats itself. It
// fails when the handle is closed.
//
// A queued Next's heartbeats are the goroutine's: a push each interval,
// whatever the Next waits for. They used to be the Next's own decision,
// taken only when its loop came round to one: a node whose join was
// folded early in a 25-s rendezvous of 512 real agents, and whose reads
// of the outcome then lagged (a stale share, a swamped store), sent no
// beat for 24 s and was dropped as the round started, its workers not
// yet running (BENCHMARKS, issue 19).
func (d *Dynamic) holdKeepAlive(queued bool) error {
	if !queued {
		return d.stopKeepAlive()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errHandleClosed
	}
	if d.ka == nil {
		d.startKeepAlive(d.now().Add(d.cfg.HeartbeatInterval()))
	}
	return nil
}

// stopKeepAlive stops the heartbeat goroutine and waits for it; it fails
// when the handle is closed.
func (d *Dynamic) stopKeepAlive() error {
	d.mu.Lock()
	ka := d.ka
	d.ka = nil
	closed := d.closed
	d.mu.Unlock()
	if ka != nil {
		ka.stop()
		<-ka.done
	}
	if closed {
		return errHandleClosed
	}
	return nil
}

// keepAliveOnce refreshes this node's heartbeat if it is due and returns
// when the next one is. Errors are not fatal (the node has
// KeepAliveMaxAttempt-1 more chances): it tries again an interval later.
//
// On a store with queues it queues the heartbeat (keepAliveQueued) and
// reads nothing: the next is due an interval later.
func (d *Dynamic) keepAliveOnce(ctx context.Context) time.Time {
	if d.inNext.Load() && (d.noQueue.Load() || d.nextBeat.Load() == beatNone) {
		// In a Next that compare-sets (the store turned out to have no
		// queues), the Next beats itself; in a queued one whose node is
		// neither in the state nor queued to be, a beat would change
		// nothing.
		return d.now().Add(d.cfg.HeartbeatInterval())
	}
	failed := func(err error) { d.keepAliveFailed(ctx, err) }
	if !d.noQueue.Load() {
		next, err := d.keepAliveQueued(ctx)
		if !errors.Is(err, ErrNotSupported) {
			return next
		}
		d.noQueue.Store(true)
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.KeepAliveTimeout)
	defer cancel()
	retry := d.now().Add(d.cfg.HeartbeatInterval())
	deadline := d.now().Add(d.cfg.KeepAliveTimeout)
	snap, err := d.read(ctx)
	if err != nil {
		failed(err)
		return retry
	}
	beat := func(s *dynState, now time.Time) action { return nextKeepAliveAction(s, d.me, now, deadline, d.cfg) }
	st, err := d.run(ctx, snap, "keep-alive", deadline, []decider{beat}, nil, nil, 0)
	if err != nil {
		failed(err)
		return retry
	}
	if i, ok := st.find(d.me); ok {
		return st.Nodes[i].Heartbeat.Add(d.cfg.HeartbeatInterval())
	}
	return retry // dropped from the state: nothing to keep alive
}

// keepAliveFailed tells OnKeepAliveFailed that a heartbeat did not get
// through, unless the handle is closing.
func (d *Dynamic) keepAliveFailed(ctx context.Context, err error) {
	if d.cfg.OnKeepAliveFailed != nil && ctx.Err() == nil {
		d.cfg.OnKeepAliveFailed(err)
	}
}

// DynamicUnwatched lists the keys (and the queue) of run runID's dynamic
// rendezvous that no node waits on, which an etcd Storage keeps out of
// every node's watch (etcd.StorageConfig.Unwatched): the state and the
// folder lock, read and compare-set; the request queue, pushed and popped
// without blocking; and what queue mode publishes beside the state
// (dynamic_share.go): the marker, the members and, as a prefix ending in
// "*", the shares. Every node's watch would otherwise carry each bucket
// and member list written: O(N) bytes to each of N nodes.
func DynamicUnwatched(runID string) []string {
	key := "gorun.rendezvous." + runID
	return []string{key, key + queueSuffix, key + lockSuffix, key + markerSuffix, key + membersSuffix, key + shareSuffix + "*"}
}
