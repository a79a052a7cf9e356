package etcd

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A retryPolicy says how a request to etcd is sent again after a failure
// that a retry may mend (retriable): etcd lost its leader, timed the
// request out or shed load. A Storage's requests go through one
// (storageRetry), and so does a Liveness's registration (patiently), so
// that an etcd swamped by a crowd of agents is waited out the same way.
// (A Liveness's announcements retry on their own terms: they also stop
// once the news is heard from another node; see announce.)
type retryPolicy struct {
	// Attempt bounds each attempt on its own, doubled after each attempt
	// that ran out of it, so that a request lost with a dead leader is
	// sent again once the new one is elected, not when the member gives
	// up on it. Zero: an attempt has ctx's deadline only.
	Attempt time.Duration

	// FirstPause is the pause after the first failure, doubled after each
	// later one up to MaxPause; each pause is drawn from [p/2, 3p/2) so
	// that a crowd of clients that failed together does not come back
	// together. While etcd sheds load ("too many requests") the pause is
	// at least shedPause and may grow to shedMaxPause: a refused request
	// costs etcd little, but a crowd retrying at once keeps it behind.
	FirstPause, MaxPause time.Duration

	// OnRetry, if not nil, hears of each failure before it is retried.
	OnRetry func(error)

	// Mends, if not nil, says which failures other than retriable ones
	// sending op again mends (op's own doing: a registration that asks
	// for a new lease).
	Mends func(error) bool
}

const (
	shedPause    = 100 * time.Millisecond
	shedMaxPause = 2 * time.Second
)

// storageRetry is a Storage's policy: short pauses, for requests on a
// worker's or an agent's path that a lost leader delays.
func storageRetry(attempt time.Duration) retryPolicy {
	return retryPolicy{Attempt: attempt, FirstPause: 20 * time.Millisecond, MaxPause: 500 * time.Millisecond}
}

// do runs op until it succeeds, fails in a way that a retry cannot mend,
// or ctx ends, and returns op's last error. op must be safe to run again
// after a failure whose outcome is unknown.
func (p retryPolicy) do(ctx context.Context, op func(context.Context) error) error {
	pause, patience := p.FirstPause, p.Attempt
	for {
		actx, cancel := ctx, context.CancelFunc(func() {})
		if patience > 0 {
			actx, cancel = context.WithTimeout(ctx, patience)
		}
		err := op(actx)
		outwaited := actx.Err() != nil && ctx.Err() == nil
		cancel()
		if err == nil {
			return nil
		}
		if outwaited {
			// No pause: the request has waited long enough.
			patience *= 2
			if p.OnRetry != nil {
				p.OnRetry(err)
			}
			continue
		}
		if !retriable(ctx, err) && (p.Mends == nil || ctx.Err() != nil || !p.Mends(err)) {
			return err
		}
		if p.OnRetry != nil {
			p.OnRetry(err)
		}
		limit := p.MaxPause
		if errors.Is(err, rpctypes.ErrTooManyRequests) {
			limit = max(limit, shedMaxPause)
			pause = max(pause, shedPause)
		}
		t := time.NewTimer(pause/2 + rand.N(pause))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		pause = min(2*pause, limit)
	}
}

// patiently runs op until it succeeds, fails in a way that a retry cannot
// mend, or ctx ends, and returns op's last error: what an agent's
// start-up (its presence key's registration, whose put is also the
// launcher's access check) does on an etcd swamped by a crowd of starting
// agents, which is slow, not gone. Before each retry it calls onRetry (if
// not nil) with the failure, then pauses: jittered, doubling from 0.1 s up
// to 2 s. op must be safe to run again after a failure whose outcome is
// unknown.
//
// A lease that etcd no longer knows is mended too: op grants a new one.
// At 1,024 agents on two cores a presence key's put came after its new
// lease had expired ("requested lease not found"), and the agent exited.
func patiently(ctx context.Context, op func(context.Context) error, onRetry func(error)) error {
	p := retryPolicy{FirstPause: 100 * time.Millisecond, MaxPause: 2 * time.Second, OnRetry: onRetry,
		Mends: func(err error) bool { return errors.Is(err, rpctypes.ErrLeaseNotFound) }}
	return p.do(ctx, op)
}

// retriable reports whether err may go away when op is sent again, with
// ctx still live.
func retriable(ctx context.Context, err error) bool {
	return transient(ctx, err) || serverDeadline(ctx, err)
}

// transient reports whether err may go away when retried: etcd lost its
// leader, the member went away, or it sheds load ("too many requests":
// its applied index lags what it committed by thousands, as when 10,000
// agents push their joins at once), and ctx still has time.
func transient(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	if errors.Is(err, rpctypes.ErrTooManyRequests) {
		return true
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code() == codes.Unavailable
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// serverDeadline reports whether err is a member's own deadline for a
// request, with ctx still live: a grant that the member could not settle
// in its request timeout comes back as code Unknown, "context deadline
// exceeded" (etcd 3.4, no quorum), where a put says "request timed out".
func serverDeadline(ctx context.Context, err error) bool {
	var g interface{ GRPCStatus() *status.Status }
	if ctx.Err() != nil || !errors.As(err, &g) {
		return false
	}
	s := g.GRPCStatus() // not status.FromError, whose message is all of err's
	return s.Code() == codes.Unknown && s.Message() == context.DeadlineExceeded.Error()
}
