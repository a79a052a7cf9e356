package etcd

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	// StartTTL, when longer than TTL, is the first lease's TTL, until
	// Settle shortens it to TTL. A big job's start swamps etcd: while its
	// apply runs more than a second behind its log etcd renews no lease
	// at all, and at 1,024 agents on two cores that lasted 20-32 s; a
	// 5-s lease lapsed, its news went to every agent and the lapses fed
	// on the load they made (BENCHMARKS.md, issue 19). A long lease while
	// the node joins rides that out, and the short one, once its workers
	// run, finds a lost node within TTL. It should grow with the crowd
	// (the launcher's is 50 ms a node); Settle spreads the crowd's
	// shortenings over a tenth of it. A node lost before its lease is
	// shortened is found within StartTTL. Default: TTL (one lease, never
	// shortened).
	StartTTL time.Duration
	// Logger receives lease losses and watch interruptions. Default: none.
	Logger *zap.Logger
	// OnLapse, if set, is called with the name of every node whose key
	// this node saw deleted as its successor (its lease expired or was
	// revoked): the one node that acts on the departure, so that a lapse
	// costs etcd one action, not one per node. It runs on the ring
	// watch's goroutine and must not block. Two nodes may be called for
	// one departure while their rings settle (the action must be
	// idempotent), and a departure whose successor died with it is
	// called on the next live node.
	OnLapse func(name string)
}

// Liveness is one node's presence in a directory of etcd keys bound to
// leases, and its view of the others' departures.
//
// The node's key lives as long as its lease, renewed every third of the
// TTL: a node that dies, hangs or loses etcd for a TTL is deleted by etcd
// itself, on etcd's clock. What each node watches costs it O(1) whatever
// the number of nodes (a watch of the whole directory cost every node an
// event per node's registration: N² events for N agents starting, and a
// read of the directory per round):
//
//   - its ring: the keys between its predecessor (the greatest name below
//     its own, wrapping to the greatest of all) and itself. It sees its
//     predecessor deleted, and a node registering in between, which
//     becomes its predecessor. The node whose predecessor is deleted is
//     that node's successor: it announces the departure (OnLapse here).
//     It finds its predecessor in an order index beside Dir (orderKeyOf),
//     with a read of one key;
//   - the news: one key, Dir's name with ".news" (outside Dir), on which
//     a successor announces a departure ("lost NAME") and a node that
//     registered again after its lease was lost its return ("back NAME").
//     Every node watches it: one event per departure, not per node.
//
// A node whose own lease lapsed (etcd unreachable for longer than the
// TTL, a long pause) takes a new one and puts its key back, but its
// successor has seen it deleted, and it announces its return, which
// tells the departure too: every view, its own included, reports it lost
// (Lost), as any node announced since a mark.
//
// A node may start on a longer lease (LivenessConfig.StartTTL) and move
// its key onto one of TTL once its workers run (Settle).
type Liveness struct {
	cli  *clientv3.Client
	cfg  LivenessConfig
	key  string
	news string
	// order is the order index's directory, orderKey this node's key
	// in it (orderKeyOf).
	order, orderKey string
	ttl             int64 // the current lease's, as granted, seconds
	// startTTL and shortTTL are the TTLs to ask for (seconds): startTTL
	// until Settle, shortTTL after (equal when cfg.StartTTL is not
	// longer than cfg.TTL).
	startTTL, shortTTL int64
	// settle carries Settle's request to the renewals' loop.
	settle chan struct{}

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	closeOnce sync.Once
	mu        sync.Mutex
	lease     clientv3.LeaseID
	// granted is when the lease was asked for: its TTL runs from then at
	// the earliest, not from when the grant and the key's put answered.
	granted time.Time
	// keyRev is the revision of the node's last put of its key.
	keyRev int64
	// settled: Settle was called; a lease granted from now on is short.
	// short: the current lease is.
	settled, short bool
	// nodes are the nodes the news named, by name.
	nodes  map[string]*presence
	rev    int64 // the news's revision the view reflects
	closed bool
	// announced are the departures this node announced, by name: the
	// deletion's revision (a replay of its ring would announce them
	// again).
	announced map[string]int64
	// events counts the watch events this node received, ring and news:
	// what its liveness costs it (a test reads it).
	events atomic.Int64
	// quiet: this node no longer tells of departures (Quiet).
	quiet atomic.Bool
	// ownLoss carries, from the news to the renewals' loop, a departure
	// of this node's current key announced while its lease lives: the
	// key went some other way (see hearOwnLoss).
	ownLoss chan int64
}

// presence is one node's entry in the view.
type presence struct {
	alive   bool
	deleted int64 // the news's revision of the last departure heard; 0: none
	// keyRev is the revision of the node's key that the last news about
	// it was of: its deletion (lost) or its put (back). News of an older
	// one, come late, changes whether it is alive no more.
	keyRev int64
	// lostKeyRev is the greatest keyRev of the news of its departures.
	lostKeyRev int64
}

// StartLiveness takes a lease for cfg.Name, puts its key and starts
// renewing the lease and watching its ring and the news until Close. A
// registration that etcd answers late ("request timed out": a member
// swamped by a crowd's connections, one without a leader) is asked again
// until ctx ends: ctx bounds how long a slow etcd is waited out.
func StartLiveness(ctx context.Context, cli *clientv3.Client, cfg LivenessConfig) (*Liveness, error) {
	if cfg.Dir == "" || cfg.Name == "" {
		return nil, fmt.Errorf("%w: etcd liveness needs a directory and a name", rendezvous.ErrInvalidArgument)
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultLeaseTTL
	}
	if cfg.StartTTL < cfg.TTL {
		cfg.StartTTL = cfg.TTL
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	l := &Liveness{
		cli:       cli,
		cfg:       cfg,
		key:       cfg.Dir + cfg.Name,
		news:      strings.TrimSuffix(cfg.Dir, "/") + ".news",
		order:     strings.TrimSuffix(cfg.Dir, "/") + ".order/",
		orderKey:  strings.TrimSuffix(cfg.Dir, "/") + ".order/" + orderKeyOf(cfg.Name),
		shortTTL:  int64(math.Ceil(cfg.TTL.Seconds())),
		startTTL:  int64(math.Ceil(cfg.StartTTL.Seconds())),
		settle:    make(chan struct{}, 1),
		ownLoss:   make(chan int64, 1),
		nodes:     make(map[string]*presence),
		announced: make(map[string]int64),
	}
	rev, err := l.registerPatiently(ctx)
	if err != nil {
		return nil, err
	}
	l.rev = rev
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.wg.Add(3)
	go l.keepAliveLoop()
	go l.newsLoop(rev + 1)
	go l.ringLoop(rev)
	return l, nil
}

// registerPatiently registers, again after each failure that a retry
// may mend (patiently), until ctx ends. At 1,024 agents starting on two
// cores, 6 of them ended on the first "etcdserver: request timed out" of
// their presence key's put, and the round, waiting for all 1,024, never
// completed.
func (l *Liveness) registerPatiently(ctx context.Context) (int64, error) {
	var rev int64
	logged := false
	err := patiently(ctx, func(ctx context.Context) (err error) {
		rev, err = l.register(ctx)
		return err
	}, func(err error) {
		if !logged {
			logged = true
			l.cfg.Logger.Info("etcd answers late; registering this node again", zap.String("key", l.key), zap.Error(err))
		}
	})
	return rev, err
}

// register grants a lease and puts this node's key on it, returning the
// put's revision.
func (l *Liveness) register(ctx context.Context) (int64, error) {
	asked := time.Now() // the lease's TTL runs from no earlier than this
	l.mu.Lock()
	ask, short := l.startTTL, l.settled || l.startTTL == l.shortTTL
	if short {
		ask = l.shortTTL
	}
	l.mu.Unlock()
	g, err := l.cli.Grant(ctx, ask)
	if err != nil {
		return 0, fmt.Errorf("%w: etcd lease for %s: %w", rendezvous.ErrUnavailable, l.key, err)
	}
	// The presence key and its order index entry, in one write: they
	// come and go together (the same lease).
	resp, err := l.cli.Txn(ctx).Then(
		clientv3.OpPut(l.key, string(l.cfg.Value), clientv3.WithLease(g.ID)),
		clientv3.OpPut(l.orderKey, "", clientv3.WithLease(g.ID)),
	).Commit()
	if err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		l.cli.Revoke(rctx, g.ID)
		cancel()
		return 0, fmt.Errorf("%w: etcd presence key %s: %w", rendezvous.ErrUnavailable, l.key, err)
	}
	l.adopt(g, asked, ask, short, resp.Header.Revision)
	return resp.Header.Revision, nil
}

// adopt makes g, asked for at asked with a TTL of ask seconds, the lease
// of this node's key, put at revision keyRev.
func (l *Liveness) adopt(g *clientv3.LeaseGrantResponse, asked time.Time, ask int64, short bool, keyRev int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lease, l.granted, l.ttl, l.short, l.keyRev = g.ID, asked, ask, short, keyRev
	if g.TTL > 0 {
		l.ttl = g.TTL // etcd may raise it to its minimum
	}
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

// grantedAt is when the current lease was asked for.
func (l *Liveness) grantedAt() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.granted
}

// TTL returns the lease's time to live as etcd granted it.
func (l *Liveness) TTL() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return time.Duration(l.ttl) * time.Second
}

// Rev returns the revision the view reflects.
func (l *Liveness) Rev() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.rev
}

// Lost returns those of names whose departure the news announced after
// revision since (a node that came back after a departure was still
// lost). Marks are the view's revisions (Rev).
//
// One return is forgiven: a node back again whose departure the view had
// seen by revision back left and came back before that mark. A caller
// that marks since before joining a round and back once the round has
// formed keeps a node that lapsed and was readmitted while the round
// formed (it is the round's member in its new life) and still loses one
// that lapses afterwards.
func (l *Liveness) Lost(names []string, since, back int64) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var lost []string
	for _, n := range names {
		if p, ok := l.nodes[n]; ok && p.departed(since, back) {
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

// Departures reports whether the news announced any node's departure
// after revision since (and not forgiven by back, as in Lost): a caller
// that does not hold a round's member names (they cost O(N) bytes to
// read) asks Lost about them only once this says that one of them may be
// gone.
func (l *Liveness) Departures(since, back int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range l.nodes {
		if p.departed(since, back) {
			return true
		}
	}
	return false
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
// It renews with one request at a time on one stream, kept through late
// answers (leaseRenewer).
func (l *Liveness) keepAliveLoop() {
	defer l.wg.Done()
	renewer := newLeaseRenewer(l.ctx, l.cli, l.cfg.Logger)
	defer renewer.close("", nil)
	// The first renewal is due a third of the TTL after the grant was
	// asked for, not after the loop starts: on a busy etcd the grant and
	// the put took seconds, and leases expired before their first
	// renewal (45 of 512 agents in one start).
	lastOK := l.grantedAt()
	var shortenAt time.Time // when Settle's shortening is due; zero: none is
	for {
		ttl := l.TTL()
		wait := time.Until(lastOK.Add(ttl / 3))
		if wait <= 0 {
			wait = min(ttl/3, 100*time.Millisecond) // failing, or due already: soon
		}
		if !shortenAt.IsZero() {
			wait = max(0, min(wait, time.Until(shortenAt)))
		}
		select {
		case <-l.ctx.Done():
			return
		case <-l.settle:
			shortenAt = time.Now().Add(l.shortenDelay())
			continue
		case rev := <-l.ownLoss:
			if rev > l.currentKeyRev() {
				l.cfg.Logger.Warn("etcd liveness: this node's key was announced deleted before its renewals found its lease gone; registering again",
					zap.String("key", l.key))
				lastOK = l.registerAgain()
			}
			continue
		case <-time.After(wait):
		}
		// A shortening due is preceded by a renewal, early if need be,
		// which shows whether etcd keeps up (renewals are not Raft
		// proposals; a grant and a put are).
		shortenDue := !shortenAt.IsZero() && !time.Now().Before(shortenAt)
		l.mu.Lock()
		id := l.lease
		l.mu.Unlock()
		left, sent, err := renewer.renew(id, ttl, ttl/3)
		switch {
		case l.ctx.Err() != nil:
			return
		case err == nil && left > 0:
			lastOK = sent
			if shortenDue {
				shortenAt = l.shortenIfPrompt(sent, ttl)
				if shortenAt.IsZero() {
					lastOK = l.grantedAt()
				}
			}
			continue
		case err != nil:
			if shortenDue {
				shortenAt = shortenRetryAt(ttl)
			}
			continue // not known lost: the next attempt may get through
		}
		l.cfg.Logger.Warn("etcd lease lost (etcd knows it no more); registering again", zap.String("key", l.key),
			zap.Int64("lease", int64(id)), zap.Duration("since_last_renewal", time.Since(lastOK).Round(time.Millisecond)),
			zap.String("hint", lapseHint))
		lastOK = l.registerAgain()
	}
}

// promptRenewal is how soon a renewal must be answered for the lease to
// be shortened after it: etcd answers a renewal only once its apply has
// caught up with its log, giving up after a second, so a prompt answer
// says etcd keeps up now. At 512 agents, shortening while etcd lagged
// (its grants timing out, tried again, each perhaps granted all the same)
// added thousands of proposals to a start that was behind already.
const promptRenewal = 250 * time.Millisecond

// shortenRetry bounds how long a shortening waits for etcd to keep up
// again after a renewal that was not prompt or a shortening that failed.
const shortenRetry = 2 * time.Second

// shortenRetryAt is when a shortening put off is tried again, for a
// lease of ttl.
func shortenRetryAt(ttl time.Duration) time.Time { return time.Now().Add(min(ttl/3, shortenRetry)) }

// shortenIfPrompt shortens the lease (shorten) if the renewal sent at sent
// that just succeeded was answered promptly, and returns when to try
// again: zero when there is nothing more to do.
func (l *Liveness) shortenIfPrompt(sent time.Time, ttl time.Duration) time.Time {
	if rtt := time.Since(sent); rtt > promptRenewal {
		l.cfg.Logger.Debug("etcd liveness: etcd answers renewals late; the lease stays long for now",
			zap.String("key", l.key), zap.Duration("renewal", rtt.Round(time.Millisecond)))
		return shortenRetryAt(ttl)
	}
	switch done, err := l.shorten(); {
	case done:
		return time.Time{}
	case err != nil:
		l.cfg.Logger.Debug("etcd liveness: the lease not shortened yet", zap.String("key", l.key), zap.Error(err))
		return shortenRetryAt(ttl)
	}
	return time.Time{} // short already, or the key is off the lease: the renewals tell
}

// registerAgain registers this node with a new lease, trying until it
// is registered or the liveness is closed, announces its return, and
// returns when the new lease was asked for.
func (l *Liveness) registerAgain() time.Time {
	for l.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(l.ctx, l.TTL())
		rev, err := l.register(ctx)
		cancel()
		if err == nil {
			// Its return, which tells its departure as well (hear): one
			// event to every watcher, not a "lost" and a "back". Its
			// successor, unless it is alone or its successor is gone as
			// well, may have told the departure already; it tells it no
			// more once it has heard the return. Beside the renewals'
			// loop, which must renew the new lease while a slow etcd
			// takes the news.
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				l.announce(l.ctx, newsBack, l.cfg.Name, rev)
			}()
			return l.grantedAt()
		}
		if !sleepCtx(l.ctx, 200*time.Millisecond) {
			break
		}
	}
	return time.Time{}
}

// Settle shortens this node's lease from StartTTL to TTL (see
// LivenessConfig.StartTTL), to be called once the node's workers run,
// and every lease granted after a loss is short from then on. It returns
// at once: the renewals' loop moves the key onto a short lease after a
// random delay of up to a tenth of StartTTL, so that a crowd that settles
// together (every node of a round starts its workers at once) grants its
// leases at a rate that does not grow with the crowd: with the launcher's
// StartTTL of 50 ms a node, two proposals per node over 5 ms a node, 400
// a second. It is idempotent.
func (l *Liveness) Settle() {
	l.mu.Lock()
	first, long := !l.settled, !l.short
	l.settled = true
	l.mu.Unlock()
	if first && long {
		select {
		case l.settle <- struct{}{}:
		default:
		}
	}
}

// shortenDelay is how long after Settle the lease is shortened: random,
// up to a tenth of StartTTL.
func (l *Liveness) shortenDelay() time.Duration {
	return rand.N(time.Duration(l.startTTL) * time.Second / 10)
}

// currentKeyRev is the revision of this node's last put of its key.
func (l *Liveness) currentKeyRev() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.keyRev
}

// shorten moves this node's key and its order index entry onto a new
// lease of TTL, from the long one they are on. The long lease is left to
// expire: the tokens a Storage put under it live until then, and a retry
// within its OpTimeout finds its token (etcd.StorageConfig.Lease). It
// reports whether it moved the key; false and no error when the lease is
// short already or the key is off it (lost: the next renewal tells).
//
// When it cannot tell (etcd unanswering for half a TTL), the key may be
// on the new lease, which then expires unrenewed: the key's successor
// announces the node lost, and the node, hearing that while its old lease
// lives, registers again (ownLoss).
func (l *Liveness) shorten() (bool, error) {
	l.mu.Lock()
	old, short := l.lease, l.short
	l.mu.Unlock()
	if short {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(l.ctx, time.Duration(l.shortTTL)*time.Second/2)
	defer cancel()
	asked := time.Now()
	g, err := l.cli.Grant(ctx, l.shortTTL)
	if err != nil {
		return false, fmt.Errorf("etcd: a short lease for %s: %w", l.key, err)
	}
	for {
		// Only from the old lease: a key put again meanwhile (the old
		// lease lapsed and the node registered again) is not moved.
		// The Else tells a try whose answer was lost and that applied.
		resp, err := l.cli.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(l.key), "=", old)).Then(
			clientv3.OpPut(l.key, string(l.cfg.Value), clientv3.WithLease(g.ID)),
			clientv3.OpPut(l.orderKey, "", clientv3.WithLease(g.ID)),
		).Else(clientv3.OpGet(l.key)).Commit()
		if err == nil {
			rev := resp.Header.Revision
			moved := resp.Succeeded
			if kvs := resp.Responses[0].GetResponseRange().GetKvs(); !moved && len(kvs) == 1 && kvs[0].Lease == int64(g.ID) {
				moved, rev = true, kvs[0].ModRevision
			}
			if !moved {
				rctx, rcancel := context.WithTimeout(l.ctx, time.Second)
				l.cli.Revoke(rctx, g.ID)
				rcancel()
				return false, nil
			}
			l.adopt(g, asked, l.shortTTL, true, rev)
			l.cfg.Logger.Debug("etcd liveness: lease shortened", zap.String("key", l.key),
				zap.Int64("from", int64(old)), zap.Int64("to", int64(g.ID)), zap.Int64("ttl", l.ttl))
			return true, nil
		}
		if !retriable(ctx, err) || !sleepCtx(ctx, 100*time.Millisecond) {
			return false, fmt.Errorf("etcd: moving %s onto its short lease: %w", l.key, err)
		}
	}
}

// lapseHint goes with a lapse's warning. etcd (3.4 and 3.5) renews no
// lease while its apply runs more than a second behind its log, as it did
// for 20 s and more while 1,024 agents started beside it on two cores:
// with 5-s leases hundreds lapsed, each lapse news to every agent, and
// no worker started; with 20-s leases all 1,024 did in two runs of four
// (BENCHMARKS.md, issue 19, session 4).
const lapseHint = "renewals unanswered for longer than the TTL: an etcd too busy to renew leases (a big job's start) expires them; a longer --rdzv-conf lease_ttl rides that out"

// The news's two words.
const (
	newsLost = "lost"
	newsBack = "back"
)

// announce puts "WORD NAME KEYREV" on the news key, for every node's
// view: keyRev is the revision of name's key that the news is of (its
// deletion, or its put when it came back). It tries until the put lands
// or ctx ends: the other views learn of the departure from this node
// alone, and one put lost to a slow etcd (a TTL without an answer under
// load) left a lost node unreported for the rest of the job. Between two
// tries it waits, and stops if its own view has heard the news meanwhile:
// a put that timed out may have landed.
//
// Each try puts the news only where the key does not hold it already: a
// put that timed out had often landed, its news not yet heard by this
// view, and every put of the news is an event to every node. At 1,024
// agents on a swamped etcd, 3,011 tries timed out in one start.
func (l *Liveness) announce(ctx context.Context, word, name string, keyRev int64) {
	news := word + " " + name + " " + strconv.FormatInt(keyRev, 10)
	pause := announceRetry
	for try := 1; ; try++ {
		pctx, cancel := context.WithTimeout(ctx, l.TTL())
		_, err := l.cli.Txn(pctx).If(clientv3.Compare(clientv3.Value(l.news), "=", news)).
			Else(clientv3.OpPut(l.news, news)).Commit()
		cancel()
		if err == nil || ctx.Err() != nil {
			return
		}
		l.cfg.Logger.Warn("etcd liveness: cannot announce a node's "+word+"; trying again",
			zap.String("node", name), zap.Int("try", try), zap.Duration("in", pause), zap.Error(err))
		if !sleepCtx(ctx, pause) || l.heard(word, name, keyRev) {
			return
		}
		pause = min(2*pause, l.TTL())
	}
}

// announceRetry is announce's first pause between two tries; it doubles
// up to the lease's TTL.
const announceRetry = 250 * time.Millisecond

// heard reports whether the view holds news of word (lost or back) about
// name's key at revision keyRev or later: announce's own news, landed
// although its put timed out, or a later one.
func (l *Liveness) heard(word, name string, keyRev int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	p, ok := l.nodes[name]
	if !ok {
		return false
	}
	if word == newsLost {
		return p.lostKeyRev >= keyRev
	}
	return p.keyRev >= keyRev
}

// newsLoop follows the news key from rev on until Close. A broken watch
// resumes where it stopped; a compacted one goes on from the compaction
// (the news in between is lost to this view; the rendezvous state's
// keep-alives are the slower way).
func (l *Liveness) newsLoop(rev int64) {
	defer l.wg.Done()
	for l.ctx.Err() == nil {
		wch := l.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.news, clientv3.WithRev(rev))
		for resp := range wch {
			if resp.CompactRevision != 0 {
				l.cfg.Logger.Warn("etcd liveness: news watch compacted; going on from the compaction",
					zap.String("key", l.news), zap.Int64("from", rev), zap.Int64("compacted", resp.CompactRevision))
				rev = resp.CompactRevision
				break
			}
			if err := resp.Err(); err != nil {
				l.cfg.Logger.Debug("etcd liveness: news watch interrupted; resuming", zap.String("key", l.news), zap.Error(err))
				break
			}
			l.events.Add(int64(len(resp.Events)))
			for _, ev := range resp.Events {
				l.hear(ev)
				rev = ev.Kv.ModRevision + 1
			}
		}
		select {
		case <-l.ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// hear brings the view up to one event of the news key.
func (l *Liveness) hear(ev *clientv3.Event) {
	if ev.Type != mvccpb.PUT {
		return
	}
	f := strings.Fields(string(ev.Kv.Value))
	if len(f) != 3 || (f[0] != newsLost && f[0] != newsBack) {
		return
	}
	keyRev, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return
	}
	rev := ev.Kv.ModRevision
	l.mu.Lock()
	defer l.mu.Unlock()
	p, ok := l.nodes[f[1]]
	if !ok {
		p = &presence{alive: true}
		l.nodes[f[1]] = p
	}
	l.rev = max(l.rev, rev)
	if f[0] == newsLost {
		if keyRev <= p.lostKeyRev {
			// The same departure told again (announce tried again
			// after a put that timed out but had landed), or one
			// told by a return already (its successor's news, come
			// after the node's own): the first is the one that
			// counts, or a node back since would be lost a second
			// time.
			return
		}
		p.deleted = rev
		p.lostKeyRev = max(p.lostKeyRev, keyRev)
	}
	if f[0] == newsBack && keyRev > p.keyRev && p.alive {
		// A return is of a node whose lease was lost: a departure too,
		// before the put at keyRev, unless the view heard of it already.
		p.deleted = rev
		p.lostKeyRev = max(p.lostKeyRev, keyRev-1)
	}
	if keyRev > p.keyRev {
		p.alive, p.keyRev = f[0] == newsBack, keyRev
	}
	if f[0] == newsLost && f[1] == l.cfg.Name && keyRev > l.keyRev {
		l.hearOwnLoss(keyRev)
	}
}

// hearOwnLoss hands the renewals' loop a departure of this node's key
// announced after its last put (at revision keyRev): the key went while
// the lease the node renews may live (shorten could not tell which lease
// the key was on; an operator deleted it), and a node whose renewals
// succeed would never register again. The loop registers it again.
func (l *Liveness) hearOwnLoss(keyRev int64) {
	select {
	case l.ownLoss <- keyRev:
	default: // one is waiting already: the loop reads the key's revision afresh
	}
}

// ringLoop watches this node's ring until Close: its predecessor's key
// and the keys between it and this node's own. Each time its predecessor
// goes it watches the wider ring from revision from (this node's
// registration) on: a node of it deleted while its own successor was
// already gone (two neighbours lost together) shows in that history, and
// is announced as well. When the ring narrows (a node registers in
// between) it watches from that registration on.
func (l *Liveness) ringLoop(from int64) {
	defer l.wg.Done()
	start := from
	for l.ctx.Err() == nil {
		pred, rev, err := l.predecessor()
		if err != nil {
			l.cfg.Logger.Debug("etcd liveness: reading this node's predecessor", zap.Error(err))
			if !sleepCtx(l.ctx, 200*time.Millisecond) {
				return
			}
			continue
		}
		next, compacted := l.watchRing(pred, rev, start)
		switch {
		case compacted > 0:
			from, start = max(from, compacted), compacted
		case next == 0:
			start = from
		default:
			start = next
		}
	}
}

// predecessor reads this node's predecessor ("" when no other node is
// present) and the revision of the read. It reads the order index (see
// orderKey): the first key after this node's there, wrapping to the first
// of all. Both are ranges etcd answers with one key read; a descending
// read of the directory itself is not (etcd reads every key of a sorted
// range before it applies the limit: at 1,024 agents, every ring change
// read half the directory).
func (l *Liveness) predecessor() (string, int64, error) {
	ctx, cancel := context.WithTimeout(l.ctx, 10*time.Second)
	defer cancel()
	end := clientv3.GetPrefixRangeEnd(l.order)
	resp, err := l.cli.Get(ctx, l.orderKey+"\x00", clientv3.WithRange(end), clientv3.WithKeysOnly(), clientv3.WithLimit(1))
	if err != nil {
		return "", 0, err
	}
	rev := resp.Header.Revision
	if len(resp.Kvs) == 0 {
		resp, err = l.cli.Get(ctx, l.order, clientv3.WithRange(l.orderKey), clientv3.WithKeysOnly(), clientv3.WithLimit(1))
		if err != nil || len(resp.Kvs) == 0 {
			return "", rev, err
		}
	}
	name, ok := nameOfOrderKey(string(resp.Kvs[0].Key[len(l.order):]))
	if !ok {
		return "", 0, fmt.Errorf("etcd liveness: %q in the order index is no node's", resp.Kvs[0].Key)
	}
	return name, rev, nil
}

// orderKeyOf is name's key in the order index, under Dir's name with
// ".order/": the bytes of name, each complemented and in hex, then "~",
// so that the index's ascending order is the names' descending order
// (the "~", above every hex digit, puts a name after the longer names it
// begins). A node's predecessor is then the next key of the index, which
// etcd reads as cheaply as any one key.
func orderKeyOf(name string) string {
	b := make([]byte, 0, 2*len(name)+1)
	for i := range len(name) {
		b = hex.AppendEncode(b, []byte{^name[i]})
	}
	return string(append(b, '~'))
}

// nameOfOrderKey inverts orderKeyOf.
func nameOfOrderKey(k string) (string, bool) {
	h, ok := strings.CutSuffix(k, "~")
	if !ok {
		return "", false
	}
	b, err := hex.DecodeString(h)
	if err != nil {
		return "", false
	}
	for i := range b {
		b[i] = ^b[i]
	}
	return string(b), true
}

// ringRanges are the key ranges of the ring from pred to this node: from
// pred's key up to this node's, in two parts where it wraps around.
func (l *Liveness) ringRanges(pred string) [][2]string {
	end := clientv3.GetPrefixRangeEnd(l.cfg.Dir)
	switch {
	case pred == "":
		return [][2]string{{l.cfg.Dir, l.key}, {l.key + "\x00", end}}
	case pred < l.cfg.Name:
		return [][2]string{{l.cfg.Dir + pred, l.key}}
	default:
		return [][2]string{{l.cfg.Dir, l.key}, {l.cfg.Dir + pred, end}}
	}
}

// between reports whether name lies strictly between pred and this node
// in the ring's order ("" pred: any other name).
func (l *Liveness) between(pred, name string) bool {
	me := l.cfg.Name
	switch {
	case name == me:
		return false
	case pred == "":
		return true
	case pred < me:
		return pred < name && name < me
	default:
		return name > pred || name < me
	}
}

// watchRing watches the ring from pred (read at revision rev) from
// revision start on, until the ring changes: pred's deletion, announced
// (next 0: replay the wider ring's history), or a key put between pred
// and this node, the new predecessor (next: that put's revision). Events
// up to rev are history: every deletion there of a key other than pred
// is of a node gone by rev (no live key lies between pred and this
// node), and is announced (once: lapsed). Where etcd compacted the
// history it returns the compaction's revision; on Close, or a watch
// interrupted, start.
func (l *Liveness) watchRing(pred string, rev, start int64) (next, compacted int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(l.ctx))
	defer cancel()
	chans := make([]clientv3.WatchChan, 2)
	for i, r := range l.ringRanges(pred) {
		chans[i] = l.cli.Watch(ctx, r[0], clientv3.WithRange(r[1]), clientv3.WithRev(start))
	}
	for {
		var resp clientv3.WatchResponse
		var ok bool
		select {
		case resp, ok = <-chans[0]:
		case resp, ok = <-chans[1]: // nil with one range: never ready
		}
		switch {
		case !ok:
			sleepCtx(l.ctx, 50*time.Millisecond) // closed, or no leader: not in a tight loop
			return start, 0
		case resp.CompactRevision != 0:
			return 0, resp.CompactRevision
		case resp.Err() != nil:
			l.cfg.Logger.Debug("etcd liveness: ring watch interrupted; resuming", zap.Error(resp.Err()))
			sleepCtx(l.ctx, 50*time.Millisecond)
			return start, 0
		}
		l.events.Add(int64(len(resp.Events)))
		for _, ev := range resp.Events {
			name := string(ev.Kv.Key[len(l.cfg.Dir):])
			evRev := ev.Kv.ModRevision
			switch {
			case ev.Type == mvccpb.DELETE && (name == pred) == (evRev > rev):
				l.lapsed(name, evRev)
				if evRev > rev {
					return 0, 0
				}
			case ev.Type == mvccpb.DELETE && name == pred:
				// Gone by rev although its order index entry was there
				// at rev: the presence key went without its entry (an
				// operator's delete; a lease's expiry takes both in one
				// revision). Gone all the same; the ring stays, as the
				// index tells, until the entry goes too.
				l.lapsed(name, evRev)
			case ev.Type == mvccpb.PUT && evRev > rev && l.between(pred, name):
				return evRev, 0
			}
		}
	}
}

// Quiet stops this node telling of its predecessors' departures (the news
// and OnLapse): its job is over, and so is everyone's soon; at the end of
// a job of N nodes each one's departure told to all those still watching
// would cost etcd O(N²) events. It goes on renewing its lease and hearing
// the news.
func (l *Liveness) Quiet() { l.quiet.Store(true) }

// lapsed announces the deletion of name's key at revision rev, which
// this node saw as its successor, once, unless the news has told of it
// (a replay of a wider ring finds departures its first successor told).
func (l *Liveness) lapsed(name string, rev int64) {
	if l.quiet.Load() {
		return
	}
	l.mu.Lock()
	p := l.nodes[name]
	seen := l.announced[name] >= rev || (p != nil && p.keyRev >= rev)
	if !seen {
		l.announced[name] = rev
	}
	l.mu.Unlock()
	if seen {
		return
	}
	l.announce(l.ctx, newsLost, name, rev)
	if l.cfg.OnLapse != nil {
		l.cfg.OnLapse(name)
	}
}

// sleepCtx sleeps for d, or until ctx ends: it reports whether it slept.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
