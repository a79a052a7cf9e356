package shrink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gorunhq/gorun/pg"
)

// Errors Follower.Recover returns when the worker must not go on as it was.
var (
	// ErrExcluded: this rank was excluded by the epoch; it must stop and
	// not rejoin.
	ErrExcluded = errors.New("this rank was excluded")
	// ErrRestart: the agents decided to restart the group (too few
	// survivors); the worker should exit non-zero so that the launcher
	// restarts it.
	ErrRestart = errors.New("the group is to be restarted")
	// ErrGrowIncomplete: the group of a grow epoch could not be formed (a
	// newcomer did not come, or a rank failed during the grow). The worker
	// keeps the group it had, aborted, and calls Recover again: the next
	// epoch, which the agents decide within their grow timeout, settles
	// it.
	ErrGrowIncomplete = errors.New("the grow did not complete")
	// ErrSuperseded: the next epoch came while this rank was shrinking its
	// group to an epoch (a member of it hung, or died, before the shrink
	// completed). The worker keeps the group it had, aborted, and calls
	// Recover again: it moves from that group to the next epoch's members.
	ErrSuperseded = errors.New("the shrink was superseded by the next epoch")
)

// JoinFunc forms a newcomer's side of a grow, with its backend (pg/cpu's
// JoinGrow, for instance): rank and size in the grown group, and the spec
// the members grow with.
type JoinFunc func(ctx context.Context, rank, size int, spec pg.GrowSpec) (pg.ProcessGroup, error)

// Follower moves a worker's process group from epoch to epoch: the worker
// side of the agreement.
//
// A watcher waits for the next epoch on a store connection of its own (a
// blocking store wait holds its connection) and, when the epoch appears,
// aborts the current group: a collective blocked on a dead peer returns,
// and, for a grow, every member stops at once, wherever it was, so that
// they all meet in the grown group. The worker then calls Recover, which
// moves the group to the epoch's members and hands the new group back.
//
// Groups are kept by the epoch they belong to: after a grow, the group it
// grew from is held (aborted) until the next epoch says which one the
// survivors go on from (Epoch.Base) — the grown group, or, when the grow
// did not complete for every rank, the one before.
type Follower struct {
	board      *Board // acknowledgements and reads, on the worker's connection
	watch      *Board // the watcher's own connection
	globalRank int

	mu      sync.Mutex
	epoch   Epoch              // the latest epoch this rank acted on
	current int                // the epoch whose group is in use
	groups  map[int]epochGroup // by epoch number: current's and a held base
	pending *Epoch             // the watcher saw the next epoch
	moved   chan struct{}      // cap 1: Recover advanced the epoch
	// stopMove ends the move to epoch moving that Recover is doing, when
	// the epoch after comes first.
	stopMove context.CancelFunc
	moving   int
	// seen is the latest epoch the watcher has seen: one that supersedes
	// a move Recover begins afterwards ends that move at once.
	seen Epoch
	// superseded: the latest epoch's shrink was cut short by the next
	// (ErrSuperseded), and the group in use is the one before it.
	superseded bool

	cancel context.CancelFunc
	done   chan struct{}
}

// epochGroup is the group a rank formed for an epoch.
type epochGroup struct {
	e Epoch
	g pg.ProcessGroup
}

// NewFollower starts following epochs for the worker of global rank
// globalRank, whose group g is epoch 0's (as launched, of world ranks).
// board and watch must be Boards on two different connections to the same
// store. Close stops the watcher; the group in use and the stores stay
// the caller's.
func NewFollower(board, watch *Board, globalRank, world int, g pg.ProcessGroup) *Follower {
	return startFollower(board, watch, globalRank, Initial(world), g)
}

func startFollower(board, watch *Board, globalRank int, e Epoch, g pg.ProcessGroup) *Follower {
	ctx, cancel := context.WithCancel(context.Background())
	f := &Follower{
		board: board, watch: watch, globalRank: globalRank,
		epoch: e, current: e.Number, groups: map[int]epochGroup{e.Number: {e, g}},
		moved: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{}),
	}
	go f.run(ctx)
	return f
}

// Newcomer is a worker that fills a lost launch slot of a running job (a
// respawned rank, a replacement node's, a spare's) on its way into the
// group: it says it is ready, waits for the grow epoch that brings its slot
// back, and joins that epoch's group.
type Newcomer struct {
	Board, Watch *Board // as NewFollower's
	// Slot is the launch slot (global rank) it fills.
	Slot int
	// After is the latest epoch decided before this worker started (the
	// launcher says which): the grow that brings it in comes later.
	After int
	// Join forms its side of the grown group.
	Join JoinFunc
	// From names who offers the slot, in the Join notice; default "slot N".
	From string
}

// Enter files the newcomer's Join, waits for the grow epoch that adds its
// slot and joins that epoch's group, then acknowledges the epoch and starts
// following the next ones. An epoch that adds the slot but whose group
// cannot be formed (the grow does not complete) is waited out: the Join is
// filed again and the next grow is awaited. ctx bounds the whole; a restart
// epoch ends it with ErrRestart.
func (n Newcomer) Enter(ctx context.Context) (*Follower, pg.ProcessGroup, Epoch, error) {
	if n.From == "" {
		n.From = fmt.Sprintf("slot %d", n.Slot)
	}
	// after is the latest epoch this newcomer knows of when it offers
	// its slot (Join.After): a grow up to it that added the slot did not
	// take it in.
	join := func(after int) error {
		_, err := n.Board.FileJoin(ctx, Join{Slots: []int{n.Slot}, From: n.From, SeenAt: time.Now(), After: &after})
		return err
	}
	if err := join(n.After); err != nil {
		return nil, nil, Epoch{}, err
	}
	for next := n.After + 1; ; next++ {
		e, err := n.Board.Await(ctx, next)
		if errors.Is(err, ErrCollected) {
			// It fell a heal cycle behind: the epochs collected did not
			// grow its slot back for good (it is still out). Offer the
			// slot again, in case one took its Join and it missed it.
			f, ferr := n.Board.Floor(ctx)
			if ferr == nil && f.Epoch > next {
				if err := join(f.Epoch); err != nil {
					return nil, nil, Epoch{}, err
				}
				next = f.Epoch - 1
				continue
			}
		}
		if err != nil {
			return nil, nil, Epoch{}, fmt.Errorf("shrink: slot %d waiting for its grow: %w", n.Slot, err)
		}
		switch {
		case e.Action == ActionRestart:
			return nil, nil, e, fmt.Errorf("shrink: epoch %d: %w", e.Number, ErrRestart)
		case !e.Newcomer(n.Slot):
			continue
		}
		g, err := n.join(ctx, e)
		if err != nil {
			if ctx.Err() != nil {
				return nil, nil, e, fmt.Errorf("shrink: slot %d joining epoch %d: %w", n.Slot, e.Number, err)
			}
			if err := join(e.Number); err != nil { // the next epoch excludes us; offer the slot again
				return nil, nil, e, err
			}
			continue
		}
		if _, err := n.Board.FileJoined(ctx, Joined{Epoch: e.Number, Slot: n.Slot, At: time.Now()}); err != nil {
			g.Close()
			return nil, nil, e, err
		}
		if err := n.Board.Arrive(ctx, e, n.Slot); err != nil {
			g.Close()
			return nil, nil, e, err
		}
		return startFollower(n.Board, n.Watch, n.Slot, e, g), g, e, nil
	}
}

// join forms the newcomer's side of grow epoch e, given up when the epoch
// after e comes first (the grow did not complete for someone).
func (n Newcomer) join(ctx context.Context, e Epoch) (pg.ProcessGroup, error) {
	g, _, err := formUnlessSuperseded(ctx, n.Watch, e, func(ctx context.Context) (pg.ProcessGroup, error) {
		return n.Join(ctx, e.Ranks[n.Slot], e.WorldSize, pg.GrowSpec{Added: len(e.Added), Namespace: Namespace(e.Number)})
	})
	return g, err
}

// Group returns the group in use.
func (f *Follower) Group() pg.ProcessGroup {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.groups[f.current].g
}

// Epoch returns the latest epoch this rank acted on. After a grow that did
// not complete, the group in use is an earlier epoch's.
func (f *Follower) Epoch() Epoch {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.epoch
}

// Pending reports whether the next epoch has been published: the worker
// should call Recover before its next collective.
func (f *Follower) Pending() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pending != nil
}

// Next returns the next epoch, if the watcher has seen it: what the worker
// is about to move to when Pending.
func (f *Follower) Next() (Epoch, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.pending == nil {
		return Epoch{}, false
	}
	return *f.pending, true
}

// run waits for each next epoch; on one it aborts the group in use. It
// looks one epoch ahead: a grow's group may never form (a newcomer that
// does not come), and the epoch after, which the agents decide within
// their grow timeout, ends the attempt at once.
func (f *Follower) run(ctx context.Context) {
	defer close(f.done)
	f.mu.Lock()
	n := f.epoch.Number + 1
	f.mu.Unlock()
	for ; ; n++ {
		e, err := f.watch.Await(ctx, n)
		if err != nil {
			return // ctx ended (Close), or the store is gone: Recover will say
		}
		f.mu.Lock()
		f.seen = e
		if f.stopMove != nil && supersedes(e, f.moving) {
			f.stopMove()
		}
		f.mu.Unlock()
		// Hand e over once Recover has moved to the epoch before.
		for {
			f.mu.Lock()
			if f.epoch.Number >= n-1 {
				if f.epoch.Number == n-1 {
					f.pending = &e
					if cur, ok := f.groups[f.current]; ok {
						cur.g.Abort(fmt.Errorf("shrink: %v", e))
					}
				}
				f.mu.Unlock()
				break
			}
			f.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-f.moved:
			}
		}
	}
}

// Recover moves to the next epoch: it waits for it (if the watcher has not
// seen it yet), moves the group the epoch builds on (Epoch.Base) to the
// epoch's members — a shrink with pg.ShrinkAbort, a grow with pg.Grower, a
// fresh group of the same members after a grow that did not complete —,
// acknowledges the epoch and returns the new group, closing the groups no
// later epoch can build on. An epoch that excludes this rank gives
// ErrExcluded, a restart epoch ErrRestart; every group is closed in both
// cases. A grow whose group cannot be formed gives ErrGrowIncomplete and
// the group in use, and a shrink that the next epoch cuts short (a member
// hung or died before it) ErrSuperseded and the group in use: call
// Recover again.
func (f *Follower) Recover(ctx context.Context) (pg.ProcessGroup, Epoch, error) {
	f.mu.Lock()
	prev, next := f.epoch, f.pending
	f.mu.Unlock()
	if next == nil {
		e, err := f.board.Await(ctx, prev.Number+1)
		if err != nil {
			return nil, Epoch{}, err
		}
		next = &e
	}
	e := *next
	if err := stopsAt(e, f.globalRank); err != nil {
		f.advance(e, nil)
		return nil, e, err
	}
	f.mu.Lock()
	base, ok := f.groups[e.Base]
	if !ok && e.Action != ActionGrow && f.superseded {
		// The shrink to e.Base was cut short by e: move from the group
		// in use to e's members (ShrinkList counts from its epoch).
		base, ok = f.groups[f.current]
	}
	gone := !ok && e.Action == ActionGrow && f.superseded && f.seen.Number > e.Number
	cur := f.groups[f.current]
	f.mu.Unlock()
	if gone {
		// The shrink this grow builds on was cut short, and the epoch
		// after the grow is out: the grow cannot complete, and the next
		// epoch goes on, from the group in use, without it.
		f.supersede(e)
		return cur.g, e, fmt.Errorf("shrink: epoch %d: %w: the shrink to epoch %d it builds on was cut short", e.Number, ErrGrowIncomplete, e.Base)
	}
	if !ok {
		return nil, e, fmt.Errorf("shrink: epoch %d goes on from the group of epoch %d, which global rank %d does not have", e.Number, e.Base, f.globalRank)
	}
	mctx, stop := context.WithCancel(ctx)
	defer stop()
	// The watcher may see this very epoch after Recover did (a peer's
	// abort ended our collective first): only a later one ends the move.
	// A grow's ends when a newcomer does not come; a shrink's when a
	// member hangs or dies before it joined the shrunk group.
	f.mu.Lock()
	f.stopMove, f.moving = stop, e.Number
	if supersedes(f.seen, e.Number) {
		stop() // the epoch after came before the move began: it cannot complete
	}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.stopMove = nil
		f.mu.Unlock()
	}()
	ng, err := move(mctx, base, e)
	if err != nil {
		switch {
		case ctx.Err() != nil:
		case e.Action == ActionGrow:
			f.advance(e, nil) // keep the base; the next epoch settles it
			return base.g, e, fmt.Errorf("shrink: epoch %d: %w: %w", e.Number, ErrGrowIncomplete, err)
		case mctx.Err() != nil:
			f.supersede(e)
			return base.g, e, fmt.Errorf("shrink: epoch %d: %w: %w", e.Number, ErrSuperseded, err)
		}
		return nil, e, fmt.Errorf("shrink: epoch %d: %w", e.Number, err)
	}
	f.advance(e, ng)
	if err := f.board.Arrive(ctx, e, f.globalRank); err != nil {
		return ng, e, err
	}
	return ng, e, nil
}

// stopsAt is why global rank g stops at epoch e: ErrExcluded when e
// excludes it, ErrRestart when e is a restart; nil when it goes on.
func stopsAt(e Epoch, g int) error {
	switch {
	case !e.Alive(g):
		return fmt.Errorf("shrink: epoch %d: global rank %d: %w", e.Number, g, ErrExcluded)
	case e.Action == ActionRestart:
		return fmt.Errorf("shrink: epoch %d leaves %d ranks: %w", e.Number, e.WorldSize, ErrRestart)
	}
	return nil
}

// supersedes reports whether epoch later ends a move to epoch moving: any
// later epoch does, but a grow built on moving's group, whose members are
// to have that group first (the newcomer of a respawned rank, quick to
// start, can be ready before the survivors' shrink is done: seen with Go
// workers on a GPU, where the shrink waits for NCCL).
func supersedes(later Epoch, moving int) bool {
	return later.Number > moving && !(later.Action == ActionGrow && later.Base == moving)
}

// move forms epoch e's group from base's.
func move(ctx context.Context, base epochGroup, e Epoch) (pg.ProcessGroup, error) {
	drop := e.ShrinkList(base.e)
	if len(drop) > 0 {
		return base.g.Shrink(ctx, drop, pg.ShrinkAbort)
	}
	gr, ok := base.g.(pg.Grower)
	if !ok {
		return nil, fmt.Errorf("a %T cannot grow", base.g)
	}
	// A grow, or (no one to drop, none to add) the same members re-formed
	// after a grow that did not complete.
	return gr.Grow(ctx, pg.GrowSpec{Added: len(e.Added), Namespace: Namespace(e.Number)})
}

// supersede makes e, whose move the next epoch cut short, the latest
// epoch, keeping every group: the next move starts from the group in use.
func (f *Follower) supersede(e Epoch) {
	f.mu.Lock()
	f.epoch, f.pending, f.superseded = e, nil, true
	f.mu.Unlock()
	select {
	case f.moved <- struct{}{}:
	default:
	}
}

// advance makes e the latest epoch. With a group g, g is e's group and
// the groups no later epoch can build on are closed: all but e's, and,
// when e is a grow, its base (the next epoch goes back to it if the grow
// does not complete). Without one, a grow keeps the groups as they were
// (it did not complete) and any other epoch (excluded, restart) closes
// them all.
func (f *Follower) advance(e Epoch, g pg.ProcessGroup) {
	f.mu.Lock()
	f.epoch, f.pending, f.superseded = e, nil, false
	if g != nil {
		f.groups[e.Number] = epochGroup{e, g}
		f.current = e.Number
	}
	for n, eg := range f.groups {
		var keep bool
		switch {
		case g != nil:
			keep = n == f.current || (e.Action == ActionGrow && n == e.Base)
		case e.Action == ActionGrow:
			keep = true
		}
		if !keep {
			eg.g.Close()
			delete(f.groups, n)
		}
	}
	f.mu.Unlock()
	select {
	case f.moved <- struct{}{}:
	default:
	}
}

// Close stops the watcher and waits for it, and closes the groups held for
// a later epoch (the base of a grow); the group in use stays the caller's.
func (f *Follower) Close() {
	f.cancel()
	<-f.done
	f.mu.Lock()
	defer f.mu.Unlock()
	for n, eg := range f.groups {
		if n != f.current {
			eg.g.Close()
			delete(f.groups, n)
		}
	}
}
