package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/shrink"
)

// start forms a launched worker's first group in shrink mode and follows
// the shrink epochs that gorun's agents publish on the Board in the worker
// store (at shrink.DefaultPrefix), authenticated by w.auth when the job
// has a secret: epoch 0's group, as launched, unless an epoch comes while
// it forms (a rank lost before the group formed), and then the group of
// the first epoch that keeps this rank (shrink.Launched). The watcher gets
// a store connection of its own, because a store wait holds its
// connection until the epoch appears; acknowledgements share the worker's.
// The returned function stops the follower and closes its connection.
func (w *worker) start(ctx context.Context, e workerEnv, store rendezvous.Store) (stop func(), err error) {
	watch, err := dialStore(ctx, e, w.opt.timeout)
	if err != nil {
		return nil, fmt.Errorf("worker store, for the shrink watcher: %w", err)
	}
	// The formation, and, if an epoch comes first, the wait for it and the
	// next formation: as a newcomer's wait for its grow, bounded.
	sctx, cancel := context.WithTimeout(ctx, w.opt.timeout+shrink.DefaultGrowTimeout)
	defer cancel()
	unblocked := health.Blocked() // waiting on the peers
	f, g, ep, err := shrink.Launched{
		Board: board(store, w.auth), Watch: board(watch, w.auth), GlobalRank: e.rank, World: e.world,
		Form: func(ctx context.Context, rank, size int, namespace string) (pg.ProcessGroup, error) {
			if namespace == "" {
				namespace = e.namespace()
			}
			return w.be.newGroup(ctx, pg.Bootstrap{Store: store, Namespace: namespace, Rank: rank, Size: size, Timeout: w.opt.timeout}, e)
		},
	}.Start(sctx)
	unblocked()
	if err != nil {
		watch.Close()
		return nil, fmt.Errorf("form the %s group: %w", w.opt.backend, err)
	}
	stop = func() {
		f.Close()
		watch.Close()
	}
	w.follower, w.epoch = f, ep
	if err := w.use(g); err != nil {
		return stop, err // w.close closes g
	}
	fmt.Fprintf(w.out, "start rank=%d world=%d backend=%s shrink=true\n", e.rank, e.world, w.opt.backend)
	if ep.Number > 0 {
		// Formed afresh for this epoch, as every member of it was.
		fmt.Fprintln(w.out, epochLine(ep))
	}
	return stop, nil
}

// board is the shrink Board on a connection to the worker store.
func board(s rendezvous.Store, auth *shrink.Auth) *shrink.Board {
	return shrink.NewBoard(s, shrink.DefaultPrefix).Authenticated(auth)
}

// recoverable reports whether err is one the next epoch resolves: a peer
// lost, or the group aborted (by the follower, on seeing an epoch).
func (w *worker) recoverable(err error) bool {
	return w.follower != nil && (errors.Is(err, pg.ErrPeerLost) || errors.Is(err, pg.ErrAborted))
}

// enter joins a running job as a newcomer (GORUN_SHRINK_NEWCOMER): it
// offers its launch slot, waits for the grow epoch that brings the slot
// back, joins that epoch's group and agrees on the step with the
// survivors. The returned function stops the follower and closes its
// connection.
func (w *worker) enter(ctx context.Context, e workerEnv, store rendezvous.Store) (stop func(), err error) {
	watch, err := dialStore(ctx, e, w.opt.timeout)
	if err != nil {
		return nil, fmt.Errorf("worker store, for the shrink watcher: %w", err)
	}
	fmt.Fprintf(w.out, "newcomer slot=%d after epoch=%d\n", e.rank, e.after)
	if w.opt.timestamps {
		// Enter files the join first thing: from here the start-up is over.
		fmt.Fprintf(w.out, "ready attempt=%d unix_ns=%d\n", w.attempt, time.Now().UnixNano())
	}
	// The grow comes within the agents' settle window, or, while another
	// grow is under way, within their grow timeout.
	ectx, cancel := context.WithTimeout(ctx, w.opt.timeout+shrink.DefaultGrowTimeout)
	defer cancel()
	f, g, ep, err := shrink.Newcomer{
		Board: board(store, w.auth), Watch: board(watch, w.auth),
		Slot: e.rank, After: e.after,
		Join: func(ctx context.Context, rank, size int, spec pg.GrowSpec) (pg.ProcessGroup, error) {
			return w.be.joinGroup(ctx, pg.Bootstrap{Store: store, Rank: rank, Size: size, Timeout: w.opt.timeout}, spec, e)
		},
	}.Enter(ectx)
	if err != nil {
		watch.Close()
		return nil, err
	}
	stop = func() {
		f.Close()
		watch.Close()
	}
	w.follower, w.epoch = f, ep
	if err := w.use(g); err != nil {
		return stop, err
	}
	fmt.Fprintln(w.out, epochLine(ep))
	// A newcomer has done no step: the survivors' lowest step is where
	// everyone goes on from.
	if w.joinedStep, err = w.agreeStep(ctx, math.MaxInt32); err != nil {
		if !w.recoverable(err) {
			return stop, err
		}
		if w.joinedStep, err = w.recover(ctx, math.MaxInt32); err != nil {
			return stop, err
		}
	}
	return stop, nil
}

// recover moves the worker to the next epoch after a collective failed at
// step, and returns the step to go on from. The follower waits for the
// epoch and moves the group to its members — or says that this rank is
// excluded (shrink.ErrExcluded) or that the group restarts
// (shrink.ErrRestart); a grow that did not complete is waited out, for
// the epoch that settles it. The members then agree on the step; a
// failure during that agreement is a new failure, so recover waits for
// the epoch after.
func (w *worker) recover(ctx context.Context, step int) (int, error) {
	if w.opt.timestamps {
		fmt.Fprintf(w.out, "stopped attempt=%d epoch=%d unix_ns=%d\n", w.attempt, w.epoch.Number, time.Now().UnixNano())
	}
	// Waiting on the agents' epoch and then on the peers: alive, blocked.
	defer health.Blocked()()
	for {
		rctx, cancel := context.WithTimeout(ctx, w.opt.timeout)
		g, e, err := w.follower.Recover(rctx)
		cancel()
		if errors.Is(err, shrink.ErrGrowIncomplete) {
			fmt.Fprintf(w.out, "grow epoch=%d did not complete: %v\n", e.Number, err)
			continue
		}
		if errors.Is(err, shrink.ErrSuperseded) {
			fmt.Fprintf(w.out, "shrink epoch=%d superseded by the next epoch\n", e.Number)
			continue
		}
		if g != nil {
			if err := w.use(g); err != nil {
				return step, err
			}
			w.epoch = e
		}
		if err != nil {
			return step, fmt.Errorf("step %d: %w", step, err)
		}
		fmt.Fprintln(w.out, epochLine(e))
		step, err = w.agreeStep(ctx, step)
		if err == nil {
			return step, nil
		}
		if !w.recoverable(err) {
			return step, err
		}
	}
}

// agreeStep returns the step the survivors go on from: the lowest step any
// of them has not completed. A peer that dies mid-collective can leave the
// others one step apart — a rank whose part of the ring was done returns
// and starts the next step, its neighbour does not — and every survivor
// must run the same collectives from here on. Redoing a step is harmless
// here because each step computes the same thing; a training loop would
// resynchronise its state instead.
func (w *worker) agreeStep(ctx context.Context, step int) (int, error) {
	v, err := w.be.newVector(w.group, 1)
	if err != nil {
		return step, err
	}
	defer v.Free()
	if err := v.Fill(float64(step)); err != nil {
		return step, err
	}
	actx, cancel := context.WithTimeout(ctx, w.opt.timeout)
	defer cancel()
	if err := w.group.AllReduce(actx, v.Buffer(), pg.Min); err != nil {
		return step, fmt.Errorf("step %d: agree on the step after epoch %d: %w", step, w.epoch.Number, err)
	}
	var lowest [1]float64
	if err := v.Read(lowest[:]); err != nil {
		return step, err
	}
	w.collectiveDone() // the new group's first collective
	return int(lowest[0]), nil
}

// finishPoll is how often a rank at the finish line looks whether the
// others are there too, or a new epoch came.
const finishPoll = 10 * time.Millisecond

// finishedKey counts the ranks that ran every step in epoch n.
func finishedKey(n int) string { return "finished/" + strconv.Itoa(n) }

// finished holds a rank that has run every step until every survivor of the
// current epoch has too, and then reports true. A peer that dies in the last
// collective can cut it short for some ranks after others completed it (as
// in agreeStep); those must shrink and redo the step, and for that they need
// every survivor, this rank included, still there. When a new epoch comes
// first, finished reports false: the caller recovers and redoes the last
// step. Without shrink mode there is nothing to wait for.
func (w *worker) finished(ctx context.Context) (bool, error) {
	if w.follower == nil {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, w.opt.timeout)
	defer cancel()
	defer health.Blocked()() // waiting on the peers
	key, world := finishedKey(w.epoch.Number), int64(w.epoch.WorldSize)
	n, err := w.store.Add(ctx, key, 1)
	tick := time.NewTicker(finishPoll)
	defer tick.Stop()
	for ; err == nil && n < world; n, err = w.store.Add(ctx, key, 0) {
		if w.follower.Pending() {
			// Counted once more after the epoch was seen: a rank that saw
			// everyone finished may have left, and cannot shrink with us.
			if n, err = w.store.Add(ctx, key, 0); err == nil && n < world {
				return false, nil
			}
			break
		}
		select {
		case <-ctx.Done():
			return false, fmt.Errorf("waiting for the other ranks to finish: %w", context.Cause(ctx))
		case <-tick.C:
		}
	}
	if err != nil {
		return false, fmt.Errorf("finish line of epoch %d: %w", w.epoch.Number, err)
	}
	return true, nil
}

// epochLine is what a rank prints on moving to epoch e:
//
//	shrink epoch=E world=W excluded=[a b c]
//	grow epoch=E world=W added=[a b]
//
// with the global ranks e excluded or added (launch slots), sorted.
func epochLine(e shrink.Epoch) string {
	if e.Action == shrink.ActionGrow {
		return fmt.Sprintf("grow epoch=%d world=%d added=%v", e.Number, e.WorldSize, slices.Sorted(slices.Values(e.Added)))
	}
	return fmt.Sprintf("shrink epoch=%d world=%d excluded=%v", e.Number, e.WorldSize, slices.Sorted(slices.Values(e.Excluded)))
}
