package shrink

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gorunhq/gorun/pg"
)

// Errors Follower.Recover returns when the worker must not go on.
var (
	// ErrExcluded: this rank was excluded by the epoch; it must stop and
	// not rejoin.
	ErrExcluded = errors.New("this rank was excluded")
	// ErrRestart: the agents decided to restart the group (too few
	// survivors); the worker should exit non-zero so that the launcher
	// restarts it.
	ErrRestart = errors.New("the group is to be restarted")
)

// Follower moves a worker's process group from epoch to epoch: the worker
// side of the agreement.
//
// A watcher waits for the next epoch on a store connection of its own (a
// blocking store wait holds its connection) and, when the epoch appears,
// aborts the current group so that a collective blocked on a dead peer
// returns. The worker then calls Recover, which shrinks the group to the
// epoch's survivors and hands the new group back.
type Follower struct {
	board      *Board // acknowledgements and reads, on the worker's connection
	watch      *Board // the watcher's own connection
	globalRank int

	mu      sync.Mutex
	epoch   Epoch
	group   pg.ProcessGroup
	pending *Epoch        // the watcher saw the next epoch
	moved   chan struct{} // cap 1: Recover advanced the epoch

	cancel context.CancelFunc
	done   chan struct{}
}

// NewFollower starts following epochs for the worker of global rank
// globalRank, whose group g is epoch 0's (as launched, of world ranks).
// board and watch must be Boards on two different connections to the same
// store. Close stops the watcher; it does not close g or the stores.
func NewFollower(board, watch *Board, globalRank, world int, g pg.ProcessGroup) *Follower {
	ctx, cancel := context.WithCancel(context.Background())
	f := &Follower{
		board: board, watch: watch, globalRank: globalRank,
		epoch: Initial(world), group: g,
		moved: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{}),
	}
	go f.run(ctx)
	return f
}

// Group returns the current group.
func (f *Follower) Group() pg.ProcessGroup {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.group
}

// Epoch returns the current epoch.
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

// run waits for each next epoch; on one it aborts the current group.
func (f *Follower) run(ctx context.Context) {
	defer close(f.done)
	for {
		f.mu.Lock()
		n := f.epoch.Number + 1
		f.mu.Unlock()
		e, err := f.watch.Await(ctx, n)
		if err != nil {
			return // ctx ended (Close), or the store is gone: Recover will say
		}
		f.mu.Lock()
		if f.epoch.Number+1 == n && f.pending == nil {
			f.pending = &e
			f.group.Abort(fmt.Errorf("shrink epoch %d excludes global ranks %v", e.Number, e.Excluded))
		}
		f.mu.Unlock()
		// Wait until Recover moved on before waiting for the epoch after.
		for {
			f.mu.Lock()
			moved := f.epoch.Number >= n
			f.mu.Unlock()
			if moved {
				break
			}
			select {
			case <-ctx.Done():
				return
			case <-f.moved:
			}
		}
	}
}

// Recover moves to the next epoch: it waits for it (if the watcher has not
// seen it yet), shrinks the current group to the survivors with
// pg.ShrinkAbort, acknowledges the epoch and returns the new group, closing
// the old one. An epoch that excludes this rank gives ErrExcluded, a
// restart epoch ErrRestart; the current group is closed in both cases.
func (f *Follower) Recover(ctx context.Context) (pg.ProcessGroup, Epoch, error) {
	f.mu.Lock()
	prev, g, next := f.epoch, f.group, f.pending
	f.mu.Unlock()
	if next == nil {
		e, err := f.board.Await(ctx, prev.Number+1)
		if err != nil {
			return nil, Epoch{}, err
		}
		next = &e
	}
	e := *next
	switch {
	case !e.Alive(f.globalRank):
		f.advance(e, nil)
		g.Close()
		return nil, e, fmt.Errorf("shrink: epoch %d: global rank %d: %w", e.Number, f.globalRank, ErrExcluded)
	case e.Action == ActionRestart:
		f.advance(e, nil)
		g.Close()
		return nil, e, fmt.Errorf("shrink: epoch %d leaves %d ranks: %w", e.Number, e.WorldSize, ErrRestart)
	}
	ng, err := g.Shrink(ctx, e.ShrinkList(prev), pg.ShrinkAbort)
	if err != nil {
		return nil, e, fmt.Errorf("shrink: epoch %d: %w", e.Number, err)
	}
	g.Close()
	f.advance(e, ng)
	if _, err := f.board.Ack(ctx, e.Number); err != nil {
		return ng, e, err
	}
	return ng, e, nil
}

func (f *Follower) advance(e Epoch, g pg.ProcessGroup) {
	f.mu.Lock()
	f.epoch, f.group, f.pending = e, g, nil
	f.mu.Unlock()
	select {
	case f.moved <- struct{}{}:
	default:
	}
}

// Close stops the watcher and waits for it.
func (f *Follower) Close() {
	f.cancel()
	<-f.done
}
