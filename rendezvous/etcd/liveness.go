package etcd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// DefaultLeaseTTL is LivenessConfig.TTL's default.
const DefaultLeaseTTL = 5 * time.Second

// LivenessConfig configures a Liveness.
type LivenessConfig struct {
	// Dir is the directory of presence keys, one per node, e.g.
	// "/gorun/job1/alive/". Required; it should end in "/".
	Dir string
	// Name is this node's key under Dir. Required.
	Name string
	// Value is stored in this node's key, for operators (etcdctl get).
	Value []byte
	// TTL is the lease's time to live: a node that stops renewing its
	// lease is gone TTL after its last renewal, plus the up to 0.5 s etcd
	// takes to notice. etcd grants whole seconds (a fraction is rounded
	// up) and no less than its own minimum, 1.5 election timeouts (2 s
	// with etcd's default flags): TTL() tells what was granted. Default
	// DefaultLeaseTTL.
	TTL time.Duration
	// Logger receives lease losses and watch interruptions. Default: none.
	Logger *zap.Logger
	// OnDelete, if set, is called with the name of every node whose key
	// the watch sees deleted (its lease expired or was revoked), after
	// the view took the deletion. It runs on the watch's goroutine and
	// must not block.
	OnDelete func(name string)
}

// Liveness is one node's presence in a directory of etcd keys bound to
// leases, and its view of the others' presence.
//
// The node's key lives as long as its lease, renewed every third of the
// TTL: a node that dies, hangs or loses etcd for a TTL is deleted by etcd
// itself, on etcd's clock, and every other node learns it from its watch
// on the directory, not by polling. A node whose own lease lapsed (etcd
// unreachable for longer than the TTL, a long pause) takes a new one and
// puts its key back, but the others have seen it deleted, and so does its
// own view: Lost reports it, as it reports any node deleted since a mark.
type Liveness struct {
	cli *clientv3.Client
	cfg LivenessConfig
	key string
	ttl int64 // granted, seconds

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	closeOnce sync.Once
	mu        sync.Mutex
	lease     clientv3.LeaseID
	nodes     map[string]*presence
	rev       int64 // the revision the view reflects
	closed    bool
}

// presence is one node's entry in the view.
type presence struct {
	alive   bool
	deleted int64 // the revision of the last deletion seen; 0: none
}

// StartLiveness takes a lease for cfg.Name, puts its key, reads the
// directory and starts renewing the lease and watching the directory until
// Close.
func StartLiveness(ctx context.Context, cli *clientv3.Client, cfg LivenessConfig) (*Liveness, error) {
	if cfg.Dir == "" || cfg.Name == "" {
		return nil, fmt.Errorf("%w: etcd liveness needs a directory and a name", rendezvous.ErrInvalidArgument)
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultLeaseTTL
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	l := &Liveness{
		cli:   cli,
		cfg:   cfg,
		key:   cfg.Dir + cfg.Name,
		ttl:   int64(math.Ceil(cfg.TTL.Seconds())),
		nodes: make(map[string]*presence),
	}
	if err := l.register(ctx); err != nil {
		return nil, err
	}
	rev, err := l.Sync(ctx)
	if err != nil {
		l.revoke(ctx)
		return nil, err
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.wg.Add(2)
	go l.keepAliveLoop()
	go l.watchLoop(rev + 1)
	return l, nil
}

// register grants a lease and puts this node's key on it.
func (l *Liveness) register(ctx context.Context) error {
	g, err := l.cli.Grant(ctx, l.ttl)
	if err != nil {
		return fmt.Errorf("%w: etcd lease for %s: %w", rendezvous.ErrUnavailable, l.key, err)
	}
	if _, err := l.cli.Put(ctx, l.key, string(l.cfg.Value), clientv3.WithLease(g.ID)); err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		l.cli.Revoke(rctx, g.ID)
		cancel()
		return fmt.Errorf("%w: etcd presence key %s: %w", rendezvous.ErrUnavailable, l.key, err)
	}
	l.mu.Lock()
	l.lease = g.ID
	if g.TTL > 0 {
		l.ttl = g.TTL // etcd may raise it to its minimum
	}
	l.mu.Unlock()
	return nil
}

// Lease returns the lease the node's key is bound to now, for keys that
// are to live no longer than the node's presence: an etcd Storage's
// tokens (StorageConfig.Lease), so that the node keeps one lease alive,
// not one more per Storage. After a loss it is the lease the node
// registered again with, once granted. It does not wait for that: a put
// under the lease etcd expired is refused, and the Storage asks again
// until the answer changes (waiting here held every store operation of a
// busy agent for a grant: BENCHMARKS.md, 512 agents). ctx is unused
// (StorageConfig.Lease takes one). A closed Liveness has no lease.
func (l *Liveness) Lease(ctx context.Context) (clientv3.LeaseID, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return clientv3.NoLease, fmt.Errorf("%w: the etcd liveness of %s is closed", rendezvous.ErrClosed, l.key)
	}
	return l.lease, nil
}

// TTL returns the lease's time to live as etcd granted it.
func (l *Liveness) TTL() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return time.Duration(l.ttl) * time.Second
}

// Sync reads the directory as it is now and brings the view up to it,
// returning the revision read: from then on, a node is lost if it is
// absent or deleted after that revision (Lost).
func (l *Liveness) Sync(ctx context.Context) (int64, error) {
	resp, err := l.cli.Get(ctx, l.cfg.Dir, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, fmt.Errorf("%w: etcd presence directory %s: %w", rendezvous.ErrUnavailable, l.cfg.Dir, err)
	}
	rev := resp.Header.Revision
	l.mu.Lock()
	defer l.mu.Unlock()
	if rev <= l.rev {
		return l.rev, nil // the watch is ahead of this read already
	}
	present := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		present[string(kv.Key[len(l.cfg.Dir):])] = true
	}
	for name, p := range l.nodes {
		p.alive = present[name]
	}
	for name := range present {
		if _, ok := l.nodes[name]; !ok {
			l.nodes[name] = &presence{alive: true}
		}
	}
	l.rev = rev
	return rev, nil
}

// Successor returns the present node that follows name in the names'
// order, wrapping around to the first; "" when no other node is present.
// It names the one node that acts on name's departure, so that a lapse
// costs etcd one action, not one per node: at 512 agents on two cores,
// every agent taking every lapsed node out of the rendezvous made 62,111
// expulsions in three minutes, which starved the renewals and made more
// lapses. Views that differ for a moment may name two nodes (the action
// must be idempotent) or none (the caller needs a slower way as well).
func (l *Liveness) Successor(name string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var next, first string
	for n, p := range l.nodes {
		if !p.alive || n == name {
			continue
		}
		if first == "" || n < first {
			first = n
		}
		if n > name && (next == "" || n < next) {
			next = n
		}
	}
	if next == "" {
		return first
	}
	return next
}

// Rev returns the revision the view reflects.
func (l *Liveness) Rev() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.rev
}

// Lost returns those of names that were deleted after revision since (a
// node that came back after a deletion was still lost) and, with absent,
// those not present either. A node's key put before since but not yet seen
// by the watch is absent from the view: count absence only once a Sync
// (or the view's revision) is known to be past the puts in question.
//
// One return is forgiven: a node present again whose deletion the view
// had seen by revision back left and came back before that mark. A caller
// that marks since before joining a round and back once the round has
// formed keeps a node that lapsed and was readmitted while the round
// formed (it is the round's member in its new life) and still loses one
// that lapses afterwards.
func (l *Liveness) Lost(names []string, since, back int64, absent bool) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var lost []string
	for _, n := range names {
		p, ok := l.nodes[n]
		if (ok && p.departed(since, back)) || (absent && (!ok || !p.alive)) {
			lost = append(lost, n)
		}
	}
	return lost
}

// departed reports whether the node's deletion after since counts (see
// Lost).
func (p *presence) departed(since, back int64) bool {
	return p.deleted > since && !(p.alive && p.deleted <= back)
}

// Departures reports whether any node's key was deleted after revision
// since (and not forgiven by back, as in Lost), and how many keys the view
// holds present: a caller that does not hold a round's member names (they
// cost O(N) bytes to read) asks Lost about them only once either says that
// one of them may be gone.
func (l *Liveness) Departures(since, back int64) (deleted bool, present int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range l.nodes {
		deleted = deleted || p.departed(since, back)
		if p.alive {
			present++
		}
	}
	return deleted, present
}

// Close stops renewing the lease and revokes it, so that the node's key
// goes at once (the others see a departure now, not a TTL later), and
// stops the watch. It is idempotent.
func (l *Liveness) Close(ctx context.Context) error {
	var err error
	l.closeOnce.Do(func() {
		l.mu.Lock()
		l.closed = true
		l.mu.Unlock()
		l.cancel()
		l.wg.Wait()
		err = l.revoke(ctx)
	})
	return err
}

func (l *Liveness) revoke(ctx context.Context) error {
	l.mu.Lock()
	id := l.lease
	l.mu.Unlock()
	if id == clientv3.NoLease {
		return nil
	}
	if _, err := l.cli.Revoke(ctx, id); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("etcd: revoking the lease of %s: %w", l.key, err)
	}
	return nil
}

// keepAliveLoop renews the lease every third of its TTL. When etcd says the
// lease is gone, it registers again with a new lease. Renewals that time
// out do not count as a loss, however long they fail: a busy etcd (512
// agents starting on two cores) applies renewals whose answers come too
// late, and an agent that took that for a loss registered again under a
// lease it did not need, its old key and lease left to expire, and every
// agent's watch then saw it leave and come back (hundreds of
// re-registrations and thousands of expulsions a minute at 512 agents).
// An etcd that is truly gone to this node expires the lease by its own
// clock, and says so at the first renewal that reaches it.
//
// It renews with one request at a time rather than clientv3's KeepAlive,
// whose sender wakes every 500 ms: with a 1 s TTL that leaves half the TTL
// unused, and it cannot tell an expired lease from a slow stream.
func (l *Liveness) keepAliveLoop() {
	defer l.wg.Done()
	lastOK := time.Now()
	for {
		ttl := l.TTL()
		wait := ttl / 3
		if time.Since(lastOK) > ttl/3 {
			wait = min(wait, 100*time.Millisecond) // failing: try again soon
		}
		select {
		case <-l.ctx.Done():
			return
		case <-time.After(wait):
		}
		l.mu.Lock()
		id := l.lease
		l.mu.Unlock()
		ctx, cancel := context.WithTimeout(l.ctx, ttl/3)
		resp, err := l.cli.KeepAliveOnce(ctx, id)
		cancel()
		switch {
		case l.ctx.Err() != nil:
			return
		case err == nil && resp.TTL > 0:
			lastOK = time.Now()
			continue
		case err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound):
			continue // not known lost: the next attempt may get through
		}
		l.cfg.Logger.Warn("etcd lease lost; registering again", zap.String("key", l.key),
			zap.Duration("since_last_renewal", time.Since(lastOK).Round(time.Millisecond)), zap.Error(err))
		for l.ctx.Err() == nil {
			ctx, cancel := context.WithTimeout(l.ctx, ttl)
			err := l.register(ctx)
			cancel()
			if err == nil {
				lastOK = time.Now()
				break
			}
			select {
			case <-l.ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// watchLoop follows the directory from rev on until Close. A broken watch
// resumes where it stopped; a compacted one reads the directory again.
func (l *Liveness) watchLoop(rev int64) {
	defer l.wg.Done()
	for l.ctx.Err() == nil {
		wch := l.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.cfg.Dir, clientv3.WithPrefix(), clientv3.WithRev(rev))
		for resp := range wch {
			if resp.CompactRevision != 0 {
				l.cfg.Logger.Warn("etcd liveness: watch compacted; reading the directory again",
					zap.String("dir", l.cfg.Dir), zap.Int64("from", rev), zap.Int64("compacted", resp.CompactRevision))
				ctx, cancel := context.WithTimeout(l.ctx, 10*time.Second)
				if r, err := l.Sync(ctx); err == nil {
					rev = r + 1
				}
				cancel()
				break
			}
			if err := resp.Err(); err != nil {
				l.cfg.Logger.Debug("etcd liveness: watch interrupted; resuming", zap.String("dir", l.cfg.Dir), zap.Error(err))
				break
			}
			l.apply(resp.Events)
			if n := len(resp.Events); n > 0 {
				rev = resp.Events[n-1].Kv.ModRevision + 1
			}
		}
		select {
		case <-l.ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// apply brings the view up to a watch response's events, then reports
// the deletions.
func (l *Liveness) apply(evs []*clientv3.Event) {
	var deleted []string
	defer func() {
		if l.cfg.OnDelete != nil {
			for _, name := range deleted {
				l.cfg.OnDelete(name)
			}
		}
	}()
	l.mu.Lock()
	defer l.mu.Unlock()
	synced := l.rev
	for _, ev := range evs {
		rev := ev.Kv.ModRevision
		if rev <= synced {
			continue // a Sync read past it already
		}
		name := string(ev.Kv.Key[len(l.cfg.Dir):])
		p, ok := l.nodes[name]
		if !ok {
			p = &presence{}
			l.nodes[name] = p
		}
		if ev.Type == mvccpb.DELETE {
			p.alive, p.deleted = false, rev
			deleted = append(deleted, name)
		} else {
			p.alive = true
		}
		l.rev = max(l.rev, rev)
	}
}
