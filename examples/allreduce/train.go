package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/shrink"
)

// errWrongSum: an allreduce returned a value other than the expected sum.
var errWrongSum = errors.New("wrong allreduce result")

// result is what a rank reports at the end.
type result struct {
	rank, world, steps int     // rank and world of the current group
	sum                float64 // the last step's value (every element)
}

// backend forms a group and makes buffers in the memory that group works on.
type backend struct {
	newGroup func(ctx context.Context, b pg.Bootstrap, e workerEnv) (pg.ProcessGroup, error)
	// joinGroup forms a newcomer's side of a grow (rank and size of the
	// grown group in b).
	joinGroup func(ctx context.Context, b pg.Bootstrap, spec pg.GrowSpec, e workerEnv) (pg.ProcessGroup, error)
	newVector func(g pg.ProcessGroup, n int) (vector, error)
}

// vector is a float64 buffer a group can reduce, with host-side access.
type vector interface {
	Buffer() pg.Buffer
	// Fill sets every element to v.
	Fill(v float64) error
	// Read copies the elements into dst (len(dst) elements).
	Read(dst []float64) error
	Free()
}

// train forms the group and runs the steps, following shrink epochs in
// shrink mode. It reports progress lines on out.
func train(ctx context.Context, e workerEnv, be backend, opt options, out io.Writer) (result, error) {
	res := result{rank: e.rank, world: e.world}
	setupCtx, cancel := context.WithTimeout(ctx, opt.timeout)
	defer cancel()
	store, closeStore, err := connectStore(setupCtx, e, opt.timeout)
	if err != nil {
		return res, fmt.Errorf("worker store: %w", err)
	}
	defer closeStore()
	auth, err := e.boardAuth(out)
	if err != nil {
		return res, err
	}
	w := &worker{
		be: be, opt: opt, out: out, globalRank: e.rank, attempt: e.attempt,
		store: rendezvous.NewPrefixStore(e.namespace(), store), epoch: shrink.Initial(e.world),
		stamped: -1, auth: auth,
	}
	defer w.close()
	if e.newcomer {
		if !opt.shrink {
			return res, fmt.Errorf("GORUN_SHRINK_NEWCOMER is set, but the worker does not follow shrink epochs (--shrink=false)")
		}
		stop, err := w.enter(ctx, e, store)
		if err != nil {
			return res, err
		}
		// Deferred after w.close, so it runs before it: the watcher stops
		// before the group it may abort is closed.
		defer stop()
		return w.run(ctx, w.joinedStep)
	}
	first, err := readCheckpoint(opt.checkpoint, opt.steps)
	if err != nil {
		return res, err
	}
	if opt.shrink {
		stop, err := w.start(ctx, e, store)
		if err != nil {
			return res, err
		}
		defer stop() // before w.close, as above
		return w.run(ctx, first)
	}
	g, err := be.newGroup(setupCtx, pg.Bootstrap{
		Store: store, Namespace: e.namespace(), Rank: e.rank, Size: e.world, Timeout: opt.timeout,
	}, e)
	if err != nil {
		return res, fmt.Errorf("form the %s group: %w", opt.backend, err)
	}
	if err := w.use(g); err != nil {
		return res, err // w.close closes g
	}
	fmt.Fprintf(out, "start rank=%d world=%d backend=%s shrink=%t\n", e.rank, e.world, opt.backend, opt.shrink)
	return w.run(ctx, first)
}

// worker runs the steps on the current group. In shrink mode its follower
// moves it from epoch to epoch; the group, its vector and the epoch change
// together.
type worker struct {
	be         backend
	opt        options
	out        io.Writer
	globalRank int              // RANK, as launched
	attempt    int              // TORCHELASTIC_RESTART_COUNT
	follower   *shrink.Follower // nil unless in shrink mode
	store      rendezvous.Store // the worker store, in this attempt's namespace
	auth       *shrink.Auth     // the shrink Boards' (nil: the job has no secret)

	epoch shrink.Epoch // the membership of group, in launch (global) ranks
	group pg.ProcessGroup
	vec   vector    // in group's memory
	host  []float64 // the last result, read back from vec

	// stamped is the last epoch whose first successful collective was
	// timestamped (--timestamps); -1 before the first.
	stamped int
	// joinedStep is the step a newcomer goes on from, agreed with the
	// survivors when it joined.
	joinedStep int
}

// use makes g the current group, with a vector in its memory (a device
// buffer belongs to a group's device, so each group gets its own).
func (w *worker) use(g pg.ProcessGroup) error {
	if w.vec != nil {
		w.vec.Free()
		w.vec = nil
	}
	w.group = g
	vec, err := w.be.newVector(g, w.opt.elems)
	if err != nil {
		return err
	}
	w.vec = vec
	if w.host == nil {
		w.host = make([]float64, w.opt.elems)
	}
	return nil
}

// close releases the vector and the current group. A group the follower
// already closed is closed again harmlessly (Close is idempotent).
func (w *worker) close() {
	if w.vec != nil {
		w.vec.Free()
	}
	if w.group != nil {
		w.group.Close()
	}
}

// run runs the steps from first. A step whose collective fails because a
// peer was lost (or the follower aborted the group for a new epoch) is
// redone in the next epoch's group, in shrink mode; otherwise the failure
// ends the run.
func (w *worker) run(ctx context.Context, first int) (result, error) {
	res := result{rank: w.group.Rank(), world: w.group.Size()}
	for step := first; ; {
		var err error
		if step < w.opt.steps {
			if err = w.runStep(ctx, step, &res); err == nil {
				if err := w.stepDone(step); err != nil {
					return res, err
				}
				step++
				continue
			}
			if !w.recoverable(err) {
				return res, err
			}
		} else {
			done, err := w.finished(ctx)
			if err != nil {
				return res, err
			}
			if done {
				// X must be the sum over the ranks that are left: a rank
				// lost after the last step is not.
				return res, w.checkFinal(res)
			}
			// A new epoch came before every survivor had finished: this
			// rank is still in the last step, and redoes it with them.
			step--
		}
		if step, err = w.recover(ctx, step); err != nil {
			return res, err
		}
		res.rank, res.world = w.group.Rank(), w.group.Size()
	}
}

// checkFinal checks the last step's sum against the current epoch.
func (w *worker) checkFinal(res result) error {
	if err := checkSum([]float64{res.sum}, expectedSum(w.epoch)); err != nil {
		return fmt.Errorf("at the end (epoch %d): %w", w.epoch.Number, err)
	}
	return nil
}

// runStep runs step number step (after the pause between steps) and checks
// its result, which it records in res.
func (w *worker) runStep(ctx context.Context, step int, res *result) error {
	if step > 0 && w.opt.stepGap > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("stopped after %d steps: %w", res.steps, context.Cause(ctx))
		case <-time.After(w.opt.stepGap):
		}
	}
	if err := w.step(ctx); err != nil {
		return fmt.Errorf("step %d: %w", step, err)
	}
	res.steps, res.sum = step+1, w.host[0]
	if err := checkSum(w.host, expectedSum(w.epoch)); err != nil {
		return fmt.Errorf("step %d (epoch %d): %w", step, w.epoch.Number, err)
	}
	return nil
}

// step allreduces this rank's contribution, global rank + 1 in every
// element, and reads the result into w.host. The contribution stays the
// launch rank's after renumbering, so that any survivor can tell from the
// sum which ranks took part.
func (w *worker) step(ctx context.Context) error {
	if err := w.vec.Fill(float64(w.globalRank + 1)); err != nil {
		return err
	}
	stepCtx, cancel := context.WithTimeout(ctx, w.opt.timeout)
	defer cancel()
	// Blocked on the peers from here: a peer that hangs stops us too, and
	// the agent must not take that for a hang of ours.
	unblocked := health.Blocked()
	err := w.group.AllReduce(stepCtx, w.vec.Buffer(), pg.Sum)
	unblocked()
	if err != nil {
		return fmt.Errorf("allreduce: %w", err)
	}
	if err := w.vec.Read(w.host); err != nil {
		return err
	}
	w.collectiveDone()
	return nil
}

// collectiveDone notes that a collective of the current epoch has completed
// (its result read back, so on a device it has finished too). With
// --timestamps the first one of each epoch prints the first-collective line:
// the moment the group works again after a failure.
func (w *worker) collectiveDone() {
	if !w.opt.timestamps || w.stamped >= w.epoch.Number {
		return
	}
	now := time.Now()
	w.stamped = w.epoch.Number
	fmt.Fprintln(w.out, firstCollectiveLine(w.attempt, w.epoch.Number, now))
}

// expectedSum is what every element of a step's result must be in epoch e:
// the sum of g+1 over the global ranks g alive in e (1+2+…+W while no rank
// was lost).
func expectedSum(e shrink.Epoch) float64 {
	var sum float64
	for g := range e.Ranks {
		if e.Alive(g) {
			sum += float64(g + 1)
		}
	}
	return sum
}

// checkSum returns an error wrapping errWrongSum, naming the first element
// of got that is not want.
func checkSum(got []float64, want float64) error {
	for i, v := range got {
		if v != want {
			return fmt.Errorf("%w: element %d = %g, want %g", errWrongSum, i, v, want)
		}
	}
	return nil
}
