package launcher

import (
	"context"
	"errors"
	"os"
	"os/signal"
	"syscall"
)

// stopper is the agent's one path from a stop signal to every wait. From
// the agent's first moment, the first stop signal (stopSignals among the
// handled ones) cancels the agent's context with a *SignalError as its
// cause, so that whatever the agent is waiting for — the rendezvous store,
// a rendezvous round, the survivors' agreement, its workers, the exit
// barrier — returns at once and the agent ends with 128+N. Every signal
// after it, and every handled signal that does not stop the agent (SLURM's
// SIGUSR1), goes to later, for the running round to pass on to its workers:
// a second SIGINT or SIGTERM kills them without waiting out the grace.
type stopper struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	later  chan os.Signal
	in     chan os.Signal
	quit   chan struct{}
	done   chan struct{}
}

// startStopper starts catching the handled signals; ctx derives from
// parent. Call close when the agent ends.
func startStopper(parent context.Context, handled []syscall.Signal) *stopper {
	ctx, cancel := context.WithCancelCause(parent)
	s := &stopper{ctx: ctx, cancel: cancel, later: make(chan os.Signal, 16), in: make(chan os.Signal, 16),
		quit: make(chan struct{}), done: make(chan struct{})}
	if len(handled) > 0 {
		sigs := make([]os.Signal, len(handled))
		for i, sig := range handled {
			sigs[i] = sig
		}
		signal.Notify(s.in, sigs...)
	}
	go s.dispatch()
	return s
}

func (s *stopper) dispatch() {
	defer close(s.done)
	stopped := false
	for {
		select {
		case <-s.quit:
			return
		case sig := <-s.in:
			if n := sig.(syscall.Signal); stopSignals[n] && !stopped {
				stopped = true
				s.cancel(&SignalError{Signal: n})
				continue
			}
			select {
			case s.later <- sig:
			default: // nobody is reading: a round is not running
			}
		}
	}
}

// close stops catching signals.
func (s *stopper) close() {
	signal.Stop(s.in)
	close(s.quit)
	<-s.done
	s.cancel(nil)
}

// stoppedBy returns the signal that stopped the agent whose context is
// ctx, or 0.
func stoppedBy(ctx context.Context) syscall.Signal {
	var se *SignalError
	if errors.As(context.Cause(ctx), &se) {
		return se.Signal
	}
	return 0
}
