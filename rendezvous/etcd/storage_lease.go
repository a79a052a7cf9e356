package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// Tokens. Every read-modify-write of a Storage stamps a token key of its
// own (m/t/<id>/<stripe>, see update), which only its retries read, within
// OpTimeout. Tokens live under a lease, so that an agent killed without
// its Close leaves its tokens for the lease's TTL, not for the rest of the
// round: up to one key per stripe per killed agent, which a long job with
// repeated agent losses would otherwise pile up in etcd (bench/chaos found
// ~4 keys an epoch).
//
// The lease is someone else's when StorageConfig.Lease is set: an agent's
// liveness lease (Liveness.Lease), which the agent keeps alive anyway. Each
// lease is a renewal every few seconds for etcd and for the agent, and at
// 512 agents on two cores a second and third lease per agent were more
// than they could keep up with (BENCHMARKS.md, issue 19): one lease per
// agent, and the tokens go with the agent's presence. Close deletes the
// tokens and leaves that lease alone. Otherwise the lease is the
// Storage's own: granted at its first read-modify-write (NewStorage makes
// no request), kept alive until Close, which revokes it, and granted anew
// after a lapse; its TTL outlasts OpTimeout.
//
// Either way a retry never finds its attempt's token gone while the lease
// lives. A put that etcd refuses because the lease is gone (it expired:
// the owner is registering again, or the Storage's own lapsed) was not
// applied, and is made again under the lease the Storage is given next
// (lease's refused). A lease that ends between a request whose answer was
// lost and its sending again takes the token that would have told the
// retry its first sending was applied: then the operation fails rather
// than risk applying twice (update).

// maxLeaseRefusals bounds how many times one operation is refused for its
// tokens' lease being gone: each refusal waits for a different lease, so
// more than a few means leases lapse faster than the Storage can use them.
const maxLeaseRefusals = 4

// errLeaseGone marks a request that etcd refused because the tokens' lease
// it put under no longer exists; nothing in the request was applied.
var errLeaseGone = errors.New("the tokens' lease is gone")

// tokenLease grants the tokens' lease on demand and keeps it alive; a
// Storage with StorageConfig.Lease has shared instead.
type tokenLease struct {
	shared func(context.Context) (clientv3.LeaseID, error)

	mu   sync.Mutex
	id   clientv3.LeaseID // 0: none granted, or lapsed
	kept chan clientv3.LeaseID
}

// tokenTTL is the tokens' own lease's time to live.
func (s *Storage) tokenTTL() int64 {
	return int64((s.timeout + s.leaseTTL + time.Second - 1) / time.Second)
}

// lease returns the tokens' lease, other than refused (when not 0: etcd
// found it gone). A shared lease is asked of its owner until the owner has
// a new one, pausing between asks (the owner learns of the loss on its own
// clock) until ctx ends; the Storage's own lease is granted when there is
// none.
func (s *Storage) lease(ctx context.Context, refused clientv3.LeaseID) (clientv3.LeaseID, error) {
	l := &s.tokens
	if l.shared != nil {
		pause := 20 * time.Millisecond
		for {
			id, err := l.shared(ctx)
			switch {
			case err != nil:
				return 0, fmt.Errorf("the tokens' lease: %w", err)
			case id != refused:
				return id, nil
			}
			select {
			case <-ctx.Done():
				return 0, fmt.Errorf("%w: waiting for a lease other than %x, which etcd found gone: %w",
					rendezvous.ErrUnavailable, refused, ctx.Err())
			case <-time.After(pause):
			}
			pause = min(2*pause, 500*time.Millisecond)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.id != 0 && l.id == refused {
		// The keeper learns of it from its renewals' stream; no need
		// to wait for that.
		l.id = 0
	}
	if l.id != 0 {
		return l.id, nil
	}
	var g *clientv3.LeaseGrantResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		g, err = s.cli.Grant(ctx, s.tokenTTL())
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("grant the tokens' lease: %w", err)
	}
	l.id = g.ID
	l.kept <- g.ID // the keeper takes it at once: it holds no other
	return l.id, nil
}

// leaseRefused reports whether err is etcd's refusal of a put under a
// lease that is gone, which the operation may meet again at most
// maxLeaseRefusals times (refusals counts them).
func (s *Storage) leaseRefused(err error, id clientv3.LeaseID, refusals *int) bool {
	if !errors.Is(err, errLeaseGone) {
		return false
	}
	*refusals++
	s.log.Debug("etcd storage: the tokens' lease is gone; asking for another",
		zap.String("prefix", s.prefix), zap.String("lease", fmt.Sprintf("%x", id)), zap.Int("refusals", *refusals))
	return *refusals <= maxLeaseRefusals
}

// markLeaseGone wraps etcd's lease-not-found refusal in errLeaseGone.
func markLeaseGone(err error) error {
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("%w: %w", errLeaseGone, err)
	}
	return err
}

// errOutcomeUnknown fails an operation whose request was sent again after
// its answer was lost, and whose token, which would tell whether the first
// sending was applied, went with its lease.
var errOutcomeUnknown = fmt.Errorf("the tokens' lease ended while a request whose answer was lost was sent again: %w", rendezvous.ErrOutcomeUnknown)

// tokenLives reports whether lease id, a token's, still exists: if it does,
// it did when the token was read, and the token's absence was not its
// lease's doing. An error counts as no.
func (s *Storage) tokenLives(id clientv3.LeaseID) bool {
	ctx, cancel := s.opCtx()
	defer cancel()
	var r *clientv3.LeaseTimeToLiveResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		r, err = s.cli.TimeToLive(ctx, id)
		return err
	})
	return err == nil && r.TTL > 0
}

// keepTokens keeps each lease lease grants alive until Close; a lease that
// lapses (etcd unreachable for longer than its TTL) is forgotten, and the
// next read-modify-write grants another. Each lease's renewals run on a
// goroutine of their own, so that a new lease is taken at once even while
// the renewals of one that lease forgot as refused have yet to end. Not
// run with a shared lease.
func (s *Storage) keepTokens() {
	defer s.loops.Done()
	for {
		var id clientv3.LeaseID
		select {
		case <-s.ctx.Done():
			return
		case id = <-s.tokens.kept:
		}
		ch, err := s.cli.KeepAlive(s.ctx, id)
		if err != nil {
			s.tokensLapsed(id, err)
			continue
		}
		s.loops.Add(1)
		go func() {
			defer s.loops.Done()
			for range ch {
			}
			s.tokensLapsed(id, nil)
		}()
	}
}

// tokensLapsed forgets lease id, whose renewals ended.
func (s *Storage) tokensLapsed(id clientv3.LeaseID, err error) {
	if s.ctx.Err() != nil {
		return // Close
	}
	s.log.Warn("etcd storage: the tokens' lease lapsed; granting another", zap.String("prefix", s.prefix), zap.Error(err))
	s.tokens.mu.Lock()
	if s.tokens.id == id {
		s.tokens.id = 0
	}
	s.tokens.mu.Unlock()
}

// revokeTokens ends the tokens' own lease, and with it the tokens (Close);
// a shared lease is not the Storage's to end.
func (s *Storage) revokeTokens(ctx context.Context) {
	s.tokens.mu.Lock()
	id := s.tokens.id
	s.tokens.id = 0
	s.tokens.mu.Unlock()
	if id != 0 {
		_, _ = s.cli.Revoke(ctx, id)
	}
}
