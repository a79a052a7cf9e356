package shrink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
)

// ErrAgreementTimeout: reports were pending and no epoch reached the board
// within the agreement timeout (the coordinator is gone and no successor
// was chosen, or the store stopped answering).
var ErrAgreementTimeout = errors.New("the agreement did not finish in time")

// CoordinatorConfig configures one agent's Coordinator.
type CoordinatorConfig struct {
	// Config is the agreement's tuning: settle window and floor.
	Config
	// Name is this agent as it signs reports and the epochs it decides
	// (its rendezvous node name).
	Name string
	// World is the number of ranks the group was launched with.
	World int
	// AgreementTimeout bounds how long a failure report, or a grow not
	// complete, may stay pending past its due time before the agreement
	// is given up (Err then yields ErrAgreementTimeout and the launcher
	// falls back to a restart); slots offered to grow back in, alone, are
	// never given up on (Decider.Stalls). It must cover the detection of
	// a dead coordinator, since its successor decides only once it is
	// chosen. Default 10 s.
	AgreementTimeout time.Duration
	// Logger receives the decisions. Default: none.
	Logger *zap.Logger
}

// DefaultAgreementTimeout is CoordinatorConfig.AgreementTimeout's default.
const DefaultAgreementTimeout = 10 * time.Second

// Coordinator is one agent's side of the agreement. Every agent runs one:
// each files the failures it sees (and the newcomers ready on its node),
// follows the Board's notice log and its epochs, and keeps a Decider in
// step with them, so that whichever agent leads can decide at once. Only
// the leader publishes; who leads is the launcher's choice (the first live
// agent in the rendezvous's order), given with Lead. Notices live on the
// Board, not in the leader's memory, so a successor decides on the same
// news when the leader dies.
type Coordinator struct {
	cfg CoordinatorConfig
	ops *Board // filing and publishing
	log *zap.Logger

	lead    chan bool
	notices chan indexedNotice
	epochs  chan Epoch // from the epoch watcher to the loop
	floors  chan Floor // from the loop to the collector: the latest to raise
	adopted chan Epoch // from the loop to the launcher
	grown   chan Complete
	errs    chan error

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// indexedNotice is notice i of the Board's log.
type indexedNotice struct {
	i int
	n Notice
}

// NewCoordinator starts an agent's Coordinator. ops, reportWatch and
// epochWatch must be Boards on three different connections to the same
// store: the two watchers (of the notice log and of the epochs) each hold
// a blocking wait on theirs. It starts from the Board's Floor: the launch
// when none was raised, else the floor's epoch, which it yields first on
// Epochs. Close stops it; the Boards' stores stay the caller's.
func NewCoordinator(cfg CoordinatorConfig, ops, reportWatch, epochWatch *Board) *Coordinator {
	if cfg.AgreementTimeout <= 0 {
		cfg.AgreementTimeout = DefaultAgreementTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Coordinator{
		cfg: cfg, ops: ops, log: cfg.Logger,
		lead:    make(chan bool),
		notices: make(chan indexedNotice),
		epochs:  make(chan Epoch),
		floors:  make(chan Floor, 1),
		// Room for a burst; the loop also stops waiting on a reader
		// when closed.
		adopted: make(chan Epoch, max(cfg.World, 1)),
		grown:   make(chan Complete, 1),
		errs:    make(chan error, 1),
		cancel:  cancel,
	}
	c.wg.Go(func() { c.run(ctx, reportWatch, epochWatch) })
	return c
}

// run finds where the Board's history starts and follows it from there:
// the two watchers feed the loop, and the collector raises the floors the
// loop finds.
func (c *Coordinator) run(ctx context.Context, reportWatch, epochWatch *Board) {
	dec, notice, err := c.resume(ctx)
	if err != nil {
		c.fail(ctx, err)
		return
	}
	from := dec.Current()
	if from.Number > 0 {
		c.log.Info("following the agreement from the board's floor", zap.Stringer("epoch", from))
		select {
		case c.adopted <- from:
		case <-ctx.Done():
			return
		}
	}
	c.wg.Go(func() { c.watchNotices(ctx, reportWatch, notice+1) })
	c.wg.Go(func() { c.watchEpochs(ctx, epochWatch, from.Number+1) })
	c.wg.Go(func() { c.collect(ctx) })
	c.loop(ctx, dec)
}

// resume returns the Decider to start with, and the last notice it need
// not read: at the launch, or at the Board's Floor.
func (c *Coordinator) resume(ctx context.Context) (*Decider, int, error) {
	for {
		f, err := c.ops.Floor(ctx)
		if err != nil {
			return nil, 0, err
		}
		if f.Epoch < 1 {
			return NewDecider(c.cfg.Name, c.cfg.Config, Initial(c.cfg.World)), 0, nil
		}
		e, ok, err := c.ops.Lookup(ctx, f.Epoch)
		if err != nil {
			return nil, 0, err
		}
		if ok {
			return ResumeDecider(c.cfg.Name, c.cfg.Config, e, f), f.Notice, nil
		}
		// Raised again and swept between the two reads: look again.
		if err := pause(ctx, forgedPoll); err != nil {
			return nil, 0, err
		}
	}
}

// File adds a failure report to the Board, for every agent's Decider.
func (c *Coordinator) File(ctx context.Context, r Report) error {
	c.stamp(&r.From, &r.SeenAt)
	_, err := c.ops.File(ctx, r)
	return err
}

// FileJoin adds a Join to the Board: newcomers on this agent's node are
// ready to fill lost launch slots, and the leader grows them in.
func (c *Coordinator) FileJoin(ctx context.Context, j Join) error {
	c.stamp(&j.From, &j.SeenAt)
	_, err := c.ops.FileJoin(ctx, j)
	return err
}

// stamp fills in who files news and when it was seen, where unset.
func (c *Coordinator) stamp(from *string, seen *time.Time) {
	if *from == "" {
		*from = c.cfg.Name
	}
	if seen.IsZero() {
		*seen = time.Now()
	}
}

// Lead makes this agent the one that decides (true) or stops it (false).
func (c *Coordinator) Lead(ctx context.Context, on bool) {
	select {
	case c.lead <- on:
	case <-ctx.Done():
	}
}

// Epochs yields each epoch as it reaches the board, in order, decided here
// or by another agent.
func (c *Coordinator) Epochs() <-chan Epoch { return c.adopted }

// Completions yields the grows that completed (every rank of the epoch
// arrived in its group); a reader that falls behind gets the latest.
func (c *Coordinator) Completions() <-chan Complete { return c.grown }

// Err yields the error that ended the agreement: the store failed, or
// ErrAgreementTimeout. After it nothing more is decided.
func (c *Coordinator) Err() <-chan error { return c.errs }

// Close stops the Coordinator and waits for it.
func (c *Coordinator) Close() {
	c.cancel()
	c.wg.Wait()
}

func (c *Coordinator) fail(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // closing: the store calls were cut short by us
	}
	select {
	case c.errs <- err:
	default:
	}
}

// watchNotices feeds the notice log, in order from notice i, to the loop.
// Notices collected before it read them (it fell a heal cycle behind) are
// skipped to the Floor's: the epoch watcher, behind as well, moves to the
// floor's epoch, which settled them.
func (c *Coordinator) watchNotices(ctx context.Context, b *Board, i int) {
	for ; ; i++ {
		n, err := b.AwaitNotice(ctx, i)
		if errors.Is(err, ErrForged) {
			continue // never acted on; the Auth reported it
		}
		if errors.Is(err, ErrCollected) {
			f, ferr := b.Floor(ctx)
			if ferr == nil {
				c.log.Warn("notices collected before they were read: following on from the board's floor",
					zap.Int("from", i), zap.Int("to", f.Notice+1))
				i = f.Notice // the loop's i++ makes it the next
				continue
			}
			err = ferr
		}
		if err != nil {
			c.fail(ctx, err)
			return
		}
		c.ops.seen(i) // where this agent's next filing starts looking
		select {
		case c.notices <- indexedNotice{i, n}:
		case <-ctx.Done():
			return
		}
	}
}

// watchEpochs feeds the epochs, in order from epoch n, to the loop. One
// collected before it read it moves it on to the Floor's epoch.
func (c *Coordinator) watchEpochs(ctx context.Context, b *Board, n int) {
	for ; ; n++ {
		e, err := b.Await(ctx, n)
		if errors.Is(err, ErrCollected) {
			f, ferr := b.Floor(ctx)
			if ferr == nil && f.Epoch > n {
				c.log.Warn("epochs collected before they were read: following on from the board's floor",
					zap.Int("from", n), zap.Int("to", f.Epoch))
				n = f.Epoch - 1
				continue
			}
			if ferr != nil {
				err = ferr
			}
		}
		if err != nil {
			c.fail(ctx, err)
			return
		}
		select {
		case c.epochs <- e:
		case <-ctx.Done():
			return
		}
	}
}

// loop owns the Decider: reports and epochs in, and, while leading, a
// decision published when the settle window ends, and the Floor raised
// when a grow completes with nothing pending.
func (c *Coordinator) loop(ctx context.Context, dec *Decider) {
	settle := c.cfg.Config.withDefaults().SettleWindow
	leading := false
	completed := 0 // the last grow said complete
	var decide, giveUp *time.Timer
	stop := func(t *time.Timer) {
		if t != nil {
			t.Stop()
		}
	}
	defer func() { stop(decide); stop(giveUp) }()
	// heard is when this agent first had the news now pending.
	var heard time.Time
	// arm sets the timers for the pending reports: the decision when
	// leading, and the deadline for an epoch in any case. The deadline is
	// AgreementTimeout past the due time, or past the moment this agent
	// heard the news if that is later: an agent that replays the board's
	// log (a replacement node admitted long after a loss) can read old
	// reports before the epoch that settled them — notices and epochs
	// come through two watchers — and must give that epoch time to come,
	// not give up on an agreement long done.
	arm := func() {
		stop(decide)
		stop(giveUp)
		decide, giveUp = nil, nil
		due := dec.Due()
		if due.IsZero() {
			heard = time.Time{}
			return
		}
		if leading {
			decide = time.NewTimer(time.Until(due))
		}
		// Only what stalls the group is given up on, counted from when it
		// came: a failure after a join that waited a minute gets its own
		// AgreementTimeout, not one that ran out with the join's.
		if !dec.Stalls() {
			heard = time.Time{}
			return
		}
		if heard.IsZero() {
			heard = time.Now()
		}
		giveUp = time.NewTimer(time.Until(later(due, heard).Add(c.cfg.AgreementTimeout)))
	}
	timerC := func(t *time.Timer) <-chan time.Time {
		if t == nil {
			return nil
		}
		return t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case on := <-c.lead:
			if on != leading {
				leading = on
				c.log.Debug("agreement leadership", zap.Bool("leading", on))
				arm()
			}
		case in := <-c.notices:
			n := in.n
			before, stalled := dec.Due(), dec.Stalls()
			switch {
			case n.Failure != nil:
				dec.Report(time.Now(), *n.Failure)
			case n.Join != nil:
				dec.Join(time.Now(), *n.Join)
			case n.Joined != nil:
				dec.Joined(n.Joined.Epoch, n.Joined.Slot)
			case n.Complete != nil && n.Complete.Epoch <= completed:
				// Said twice: the leader files one past the grow's
				// deadline (completeOverdue) while the last member's is
				// on its way.
			case n.Complete != nil:
				completed = n.Complete.Epoch
				dec.Complete(n.Complete.Epoch)
				if f, ok := dec.Floor(in.i); ok && leading && n.Complete.Epoch == f.Epoch {
					c.raise(f)
				}
				select {
				case c.grown <- *n.Complete:
				default: // the launcher is behind; a newer one replaces it
					select {
					case <-c.grown:
					default:
					}
					c.grown <- *n.Complete
				}
			}
			if !dec.Due().Equal(before) || dec.Stalls() != stalled {
				arm()
			}
		case e := <-c.epochs:
			dec.Adopt(e)
			select {
			case c.adopted <- e:
			case <-ctx.Done():
				return
			}
			arm()
		case <-timerC(decide):
			decide = nil
			decided, err := c.publish(ctx, dec)
			if err != nil {
				c.fail(ctx, err)
				return
			}
			if !decided {
				arm() // woken early: wait for the window's end again
			}
		case <-timerC(giveUp):
			c.fail(ctx, fmt.Errorf("shrink: %s: pending for %v past the due time (settle window %v): %w",
				dec.Outstanding(), c.cfg.AgreementTimeout, settle, ErrAgreementTimeout))
			return
		}
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// completeOverdue looks, before a grow that did not complete in time is
// given up, whether every member acknowledged it after all: the member
// that counted last died before it filed the Complete notice, or the
// counter was tampered with. Then it files the Complete notice itself (the
// other agents' Deciders follow the log) and the grow stands.
func (c *Coordinator) completeOverdue(ctx context.Context, dec *Decider) (bool, error) {
	cur := dec.Current()
	all, err := c.ops.Arrived(ctx, cur)
	if err != nil || !all {
		return false, err
	}
	c.log.Warn("every rank acknowledged the grow, and nobody said it was complete: saying so", zap.Stringer("epoch", cur))
	if _, err := c.ops.file(ctx, Notice{Complete: &Complete{Epoch: cur.Number, At: time.Now()}}); err != nil {
		return false, err
	}
	dec.Complete(cur.Number) // at once: the notice comes back through the log
	return true, nil
}

// raise hands f to the collector; a floor it has not taken yet is
// replaced by f, which is higher.
func (c *Coordinator) raise(f Floor) {
	for {
		select {
		case c.floors <- f:
			return
		default:
		}
		select {
		case <-c.floors:
		default:
		}
	}
}

// collect raises the floors the loop found, one at a time, apart from the
// loop: collecting a cycle's records is a few store round trips, which
// must not hold up a decision. A floor that cannot be raised is logged
// and left: the next complete grow raises one again.
func (c *Coordinator) collect(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case f := <-c.floors:
			if err := c.ops.Raise(ctx, f); err != nil {
				if ctx.Err() != nil {
					return
				}
				c.log.Warn("cannot raise the board's floor; its old records stay for now", zap.Int("epoch", f.Epoch), zap.Error(err))
				continue
			}
			c.log.Debug("raised the board's floor", zap.Int("epoch", f.Epoch), zap.Int("notice", f.Notice))
		}
	}
}

// publish decides the next epoch and writes it to the board. The epoch
// watcher then delivers whichever epoch the board holds: this one, or a
// rival's that won the compare-set.
func (c *Coordinator) publish(ctx context.Context, dec *Decider) (bool, error) {
	if now := time.Now(); dec.GrowOverdue(now) {
		done, err := c.completeOverdue(ctx, dec)
		if err != nil || done {
			return false, err
		}
	}
	next, ok, err := dec.Decide(time.Now())
	if err != nil || !ok {
		return false, err
	}
	held, won, err := c.ops.Publish(ctx, next)
	if err != nil {
		return false, err
	}
	if won {
		c.log.Info("published", zap.Stringer("epoch", held), zap.Any("reasons", held.Reasons))
	} else {
		c.log.Info("another agent published first", zap.Stringer("epoch", held), zap.String("by", held.Coordinator))
	}
	return true, nil
}
