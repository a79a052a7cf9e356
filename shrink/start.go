package shrink

import (
	"context"
	"errors"
	"fmt"

	"github.com/gorunhq/gorun/pg"
)

// FormFunc forms a group afresh with a backend (pg/cpu's New, for
// instance): this rank and the size in the group, and the namespace the
// group's keys go under ("" for epoch 0's group, which the worker names as
// it likes; Namespace(n) for epoch n's, the namespace a grow of epoch n
// forms under, so that the members of a grow that form it afresh meet
// those that grow into it).
type FormFunc func(ctx context.Context, rank, size int, namespace string) (pg.ProcessGroup, error)

// Launched is a worker started with the job (not a newcomer) on its way to
// its first group.
//
// A formation waits for every member, up to the group's timeout. A member
// lost before the group has formed (killed in its start-up, or in the
// formation) would hold the others there for that long while the agents,
// who saw it die, publish an epoch without it that nobody acts on: the
// worker has no group yet to abort, and no Follower. Launched watches for
// that epoch from the start: when it comes first, the formation is given
// up and the worker forms, afresh, the group of the first epoch that keeps
// it, as every other member of that epoch does.
//
// A member lost in the middle of a formation can leave some members with
// the group formed (their side of it complete) and others without; those
// move by the Follower and these afresh, which do not meet. Each then
// fails at its own timeout, and the agents' next epoch settles it (the
// workers that fail are excluded): slower, never stuck.
type Launched struct {
	Board, Watch *Board // as NewFollower's
	// GlobalRank is this worker's launch rank, World the job's size.
	GlobalRank, World int
	// Form forms a group afresh.
	Form FormFunc
}

// Start forms this worker's first group, epoch 0's unless an epoch came
// first, and starts following the next epochs from it. It acknowledges
// an epoch it formed afresh, as Recover does. An epoch that excludes this
// rank gives ErrExcluded, a restart epoch ErrRestart. ctx bounds the whole;
// a formation that fails with no epoch to follow returns its error.
func (l Launched) Start(ctx context.Context) (*Follower, pg.ProcessGroup, Epoch, error) {
	e, namespace := Initial(l.World), ""
	for {
		g, superseded, err := formUnlessSuperseded(ctx, l.Watch, e, func(ctx context.Context) (pg.ProcessGroup, error) {
			return l.Form(ctx, e.Ranks[l.GlobalRank], e.WorldSize, namespace)
		})
		if err == nil {
			if e.Number > 0 {
				if err := l.Board.Arrive(ctx, e, l.GlobalRank); err != nil {
					g.Close()
					return nil, nil, e, err
				}
			}
			return startFollower(l.Board, l.Watch, l.GlobalRank, e, g), g, e, nil
		}
		// A peer lost or an abort: the agents' next epoch says what now,
		// as after a failed collective.
		peer := errors.Is(err, pg.ErrPeerLost) || errors.Is(err, pg.ErrAborted)
		if ctx.Err() != nil || !(superseded || peer) {
			return nil, nil, e, fmt.Errorf("shrink: rank %d forming the group of epoch %d: %w", l.GlobalRank, e.Number, err)
		}
		next, err := l.Board.Await(ctx, e.Number+1)
		if err != nil {
			return nil, nil, e, fmt.Errorf("shrink: rank %d, its group of epoch %d not formed, waiting for the next epoch: %w",
				l.GlobalRank, e.Number, err)
		}
		if err := stopsAt(next, l.GlobalRank); err != nil {
			return nil, nil, next, err
		}
		e, namespace = next, Namespace(next.Number)
	}
}

// formUnlessSuperseded forms epoch e's group with form, given up when an
// epoch that supersedes e comes first (see supersedes); superseded says
// whether one came before the formation ended.
func formUnlessSuperseded(ctx context.Context, watch *Board, e Epoch, form func(context.Context) (pg.ProcessGroup, error)) (g pg.ProcessGroup, superseded bool, err error) {
	fctx, stop := context.WithCancel(ctx)
	ahead := make(chan bool, 1)
	go func() {
		for n := e.Number + 1; ; n++ {
			later, err := watch.Await(fctx, n)
			if err != nil {
				ahead <- false
				return
			}
			if supersedes(later, e.Number) {
				stop()
				ahead <- true
				return
			}
		}
	}()
	g, err = form(fctx)
	stop()
	// The watch connection is the caller's from here. A group that formed
	// as the next epoch came is kept: the Follower moves it, as it would
	// at every other member that formed it.
	return g, <-ahead, err
}
