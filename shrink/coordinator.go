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
	// AgreementTimeout bounds how long a report may stay pending, past its
	// settle window, before the agreement is given up (Err then yields
	// ErrAgreementTimeout and the launcher falls back to a restart). It
	// must cover the detection of a dead coordinator, since its successor
	// decides only once it is chosen. Default 10 s.
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
	notices chan Notice
	epochs  chan Epoch // from the epoch watcher to the loop
	adopted chan Epoch // from the loop to the launcher
	grown   chan Complete
	errs    chan error

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// NewCoordinator starts an agent's Coordinator. ops, reportWatch and
// epochWatch must be Boards on three different connections to the same
// store: the two watchers (of the notice log and of the epochs) each hold
// a blocking wait on theirs. Close stops it; the Boards' stores stay the
// caller's.
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
		notices: make(chan Notice),
		epochs:  make(chan Epoch),
		// Room for a burst; the loop also stops waiting on a reader
		// when closed.
		adopted: make(chan Epoch, max(cfg.World, 1)),
		grown:   make(chan Complete, 1),
		errs:    make(chan error, 1),
		cancel:  cancel,
	}
	c.wg.Add(3)
	go c.watchNotices(ctx, reportWatch)
	go c.watchEpochs(ctx, epochWatch)
	go c.loop(ctx)
	return c
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

// watchNotices feeds the notice log, in order, to the loop.
func (c *Coordinator) watchNotices(ctx context.Context, b *Board) {
	defer c.wg.Done()
	for i := 1; ; i++ {
		n, err := b.AwaitNotice(ctx, i)
		if errors.Is(err, ErrForged) {
			continue // never acted on; the Auth reported it
		}
		if err != nil {
			c.fail(ctx, err)
			return
		}
		select {
		case c.notices <- n:
		case <-ctx.Done():
			return
		}
	}
}

// watchEpochs feeds the epochs, in order, to the loop.
func (c *Coordinator) watchEpochs(ctx context.Context, b *Board) {
	defer c.wg.Done()
	for n := 1; ; n++ {
		e, err := b.Await(ctx, n)
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
// decision published when the settle window ends.
func (c *Coordinator) loop(ctx context.Context) {
	defer c.wg.Done()
	dec := NewDecider(c.cfg.Name, c.cfg.Config, Initial(c.cfg.World))
	settle := c.cfg.Config.withDefaults().SettleWindow
	leading := false
	var decide, giveUp *time.Timer
	stop := func(t *time.Timer) {
		if t != nil {
			t.Stop()
		}
	}
	defer func() { stop(decide); stop(giveUp) }()
	// arm sets the timers for the pending reports: the decision when
	// leading, and the deadline for an epoch in any case.
	arm := func() {
		stop(decide)
		stop(giveUp)
		decide, giveUp = nil, nil
		due := dec.Due()
		if due.IsZero() {
			return
		}
		if leading {
			decide = time.NewTimer(time.Until(due))
		}
		giveUp = time.NewTimer(time.Until(due.Add(c.cfg.AgreementTimeout)))
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
		case n := <-c.notices:
			before := dec.Due()
			switch {
			case n.Failure != nil:
				dec.Report(time.Now(), *n.Failure)
			case n.Join != nil:
				dec.Join(time.Now(), *n.Join)
			case n.Joined != nil:
				dec.Joined(n.Joined.Epoch, n.Joined.Slot)
			case n.Complete != nil:
				dec.Complete(n.Complete.Epoch)
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
			if !dec.Due().Equal(before) {
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
			c.fail(ctx, fmt.Errorf("shrink: failed ranks %v (newcomers %v awaited) pending for %v past their due time (settle window %v): %w",
				dec.Pending(), dec.Awaiting(), c.cfg.AgreementTimeout, settle, ErrAgreementTimeout))
			return
		}
	}
}

// publish decides the next epoch and writes it to the board. The epoch
// watcher then delivers whichever epoch the board holds: this one, or a
// rival's that won the compare-set.
func (c *Coordinator) publish(ctx context.Context, dec *Decider) (bool, error) {
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
