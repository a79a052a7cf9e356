package etcd

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Tokens. Every read-modify-write of a Storage stamps a token key of its
// own (m/t/<id>/<stripe>, see update), which only its retries read, within
// OpTimeout. Tokens live under a lease of the Storage's: granted at its
// first read-modify-write (NewStorage makes no request), kept alive until
// Close, and granted anew after a lapse. An agent killed without its Close
// leaves its tokens for the lease's TTL, not for the rest of the round: up
// to one key per stripe per killed agent, which a long job with repeated
// agent losses would otherwise pile up in etcd (bench/chaos found ~4 keys
// an epoch). The TTL outlasts OpTimeout, so a retry never finds its
// attempt's token gone while the Storage lives.

// tokenLease grants the tokens' lease on demand and keeps it alive.
type tokenLease struct {
	mu   sync.Mutex
	id   clientv3.LeaseID // 0: none granted, or lapsed
	kept chan clientv3.LeaseID
}

// tokenTTL is the tokens' lease's time to live.
func (s *Storage) tokenTTL() int64 {
	return int64((s.timeout + s.leaseTTL + time.Second - 1) / time.Second)
}

// lease returns the tokens' lease, granting it when there is none.
func (s *Storage) lease(ctx context.Context) (clientv3.LeaseID, error) {
	l := &s.tokens
	l.mu.Lock()
	defer l.mu.Unlock()
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

// keepTokens keeps each lease lease grants alive until Close; a lease that
// lapses (etcd unreachable for longer than its TTL) is forgotten, and the
// next read-modify-write grants another.
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
		if err == nil {
			for range ch {
			}
		}
		if s.ctx.Err() != nil {
			return
		}
		s.log.Warn("etcd storage: the tokens' lease lapsed; granting another", zap.String("prefix", s.prefix), zap.Error(err))
		s.tokens.mu.Lock()
		if s.tokens.id == id {
			s.tokens.id = 0
		}
		s.tokens.mu.Unlock()
	}
}

// revokeTokens ends the tokens' lease, and with it the tokens (Close).
func (s *Storage) revokeTokens(ctx context.Context) {
	s.tokens.mu.Lock()
	id := s.tokens.id
	s.tokens.id = 0
	s.tokens.mu.Unlock()
	if id != 0 {
		_, _ = s.cli.Revoke(ctx, id)
	}
}
