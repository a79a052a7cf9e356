package rendezvous

// Joins by queue: a crowd of N nodes calling Next at once would otherwise
// race to compare-set one state of O(N) bytes, each losing O(N) times. So
// a Next that would write queues its request instead (one push of its own
// few hundred bytes), and the node that holds the folder lock pops every
// queued request, applies them to the state as their own nodes would
// (foldRequest), and writes the state once for the whole batch. A
// requester then waits on the wake-up key like any other waiter (and
// looks once a lazy fold's delay after its push, in case the folder let
// go just before it; not a crowd's join on etcd: crowded), reading only
// its own share of the state (dynamic_share.go). Runs smaller than
// DynamicConfig.QueueMinNodes (32) keep compare-setting directly.
//
// Heartbeats go the same way, lazily: a node pushes its keep-alive and
// folds only lazyDelay later, and not at all if a fold has started since
// its push (which took its heartbeat along). So N nodes beating every
// KeepAliveInterval make about KeepAliveInterval/lazyDelay writes of the
// state per interval, not N.
//
// The lock is a key holding its holder, an expiry and when its last fold
// started; a holder that dies is replaced when the expiry passes. Losing
// it is harmless (every write is still a compare-set of the state), and so
// is losing a request (its node queues it again when it has seen no
// effect for a while): the lock and the queue save work, the state's
// compare-set keeps it correct.
//
// Keys, next to the state's ("gorun.rendezvous.<run_id>"): the queue
// "<state>/requests" and the lock "<state>/folder".

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

const (
	// defaultQueueMinNodes is DynamicConfig.QueueMinNodes's default.
	defaultQueueMinNodes = 32
	queueSuffix          = "/requests"
	lockSuffix           = "/folder"
	// lockFree is the lock's holder when nobody holds it.
	lockFree = "-"
	// foldBatch bounds the requests one pass applies, so that a pass
	// writes (and wakes) while more arrive. Each batch wakes the nodes
	// whose requests are still queued: a crowd of 10,000 makes one or two.
	foldBatch = 8192
)

// queued is a Next's request and when it was last pushed.
type queued struct {
	req   request
	sent  time.Time // zero: never
	token []byte    // the state (or view) the node had read then
	// due is when to look again at a request that shows no effect:
	// settle after the push, or after the last look that found a folder
	// at work.
	due time.Time
	// beat: a fold has started since a keep-alive of this call was
	// queued at beat, so the node's heartbeat is at least that new (its
	// view does not show heartbeats that change nothing else).
	beat time.Time
	// staleSince is when the node's views began to show a bucket not of
	// the marker's round (zero: they do not).
	staleSince time.Time
	// lapsed: the node's last look at the folder lock (awaitQueued's)
	// found nobody holding it, so its next decision folds.
	lapsed bool
	// atWork: in a crowd, the fold right after the last push found
	// another node folding (or took the lock and found the queue
	// empty), so no lazy look follows the push (awaitQueued).
	atWork bool
}

// settle is how long a queued request may stay without effect before its
// node queues it again (the folder that popped it may have died).
func (d *Dynamic) settle() time.Duration { return d.cfg.KeepAliveTimeout }

// lockHold is how long the folder lock lasts unless renewed; the holder
// renews it at every pass, and a quarter of a hold into a batch. It is
// KeepAliveTimeout, or four times the slowest recent store request of
// this node (slow) where that is longer, up to maxHoldFactor
// KeepAliveTimeouts: on a store swamped by a crowd's requests (etcd under
// thousands of agents) one request of the folder's can take seconds, and
// a lock that lapsed while its holder's renewal was on the way would let
// every other node fold (and push its request again) at once.
func (d *Dynamic) lockHold() time.Duration {
	return min(max(d.cfg.KeepAliveTimeout, 4*time.Duration(d.slow.Load())), maxHoldFactor*d.cfg.KeepAliveTimeout)
}

// lookPeriod is how long a node whose request no folder has applied yet
// waits before it looks at the folder lock (and pushes the request again
// if nobody holds it): settle; for a crowd whose MaxNodes ÷ CrowdRate is
// longer, that, with a jitter of ±25 % so that nodes that pushed together
// do not look together. The crowd's looks then come at about CrowdRate a
// second however many nodes wait, and a folder that died is still
// noticed within a fraction of a second of its lock's lapse by one of
// them; a node whose request died with it waits up to a look period.
func (d *Dynamic) lookPeriod() time.Duration {
	p := d.cfg.crowdPeriod()
	if p <= d.settle() {
		return d.settle()
	}
	return p*3/4 + rand.N(p/2)
}

// maxHoldFactor bounds lockHold: a folder that dies holding the lock
// stalls the queue for at most this many KeepAliveTimeouts.
const maxHoldFactor = 6

// observe records a store request that began at start: slow keeps the
// slowest of the recent ones, each older one worth an eighth less.
func (d *Dynamic) observe(start time.Time) {
	took := int64(d.now().Sub(start))
	for {
		old := d.slow.Load()
		v := max(took, old-old/8)
		if d.slow.CompareAndSwap(old, v) {
			return
		}
	}
}

// lazyDelay is how long a queued heartbeat may wait for somebody else's
// fold before its node folds.
func (d *Dynamic) lazyDelay() time.Duration { return d.cfg.KeepAliveInterval / 5 }

// lockValue is the folder lock's value: holder (lockFree when none),
// expiry and the start of the holder's (or the last) fold.
type lockValue struct {
	holder        string
	expiry, start time.Time
}

func (v lockValue) bytes() []byte {
	return []byte(v.holder + " " + strconv.FormatInt(v.expiry.UnixNano(), 10) + " " + strconv.FormatInt(v.start.UnixNano(), 10))
}

// parseLock reads a lock value; anything else reads as a free lock that
// never folded.
func parseLock(b []byte) lockValue {
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return lockValue{holder: lockFree}
	}
	exp, err1 := strconv.ParseInt(f[len(f)-2], 10, 64)
	start, err2 := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err1 != nil || err2 != nil {
		return lockValue{holder: lockFree}
	}
	return lockValue{holder: strings.Join(f[:len(f)-2], " "), expiry: time.Unix(0, exp), start: time.Unix(0, start)}
}

// lookAgain is when a node whose request a folder holding lock at now
// has not yet applied looks again: settle later, or when the lock would
// lapse if that is later (the folder renews it while it works; a look
// before then would only find it at work, and in a crowd of thousands
// those looks are what a loaded store serves instead of the folder).
func lookAgain(now time.Time, lock lockValue, settle time.Duration) time.Time {
	return maxTime(now.Add(settle), lock.expiry.Add(time.Nanosecond))
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// lapsed reports whether nobody holds the lock at now.
func (v lockValue) lapsed(now time.Time) bool {
	return v.holder == lockFree || now.After(v.expiry)
}

// foldedSince reports whether a fold has started after t (and so took
// along whatever was queued before t), as the lock shows.
func (d *Dynamic) foldedSince(ctx context.Context, t time.Time) (bool, error) {
	cur, err := d.readLock(ctx)
	if err != nil {
		return false, err
	}
	return parseLock(cur).start.After(t), nil
}

// readLock reads the folder lock without taking it; an absent lock reads
// as a free one that never folded.
func (d *Dynamic) readLock(ctx context.Context) ([]byte, error) {
	cur, err := d.peek(ctx, d.key+lockSuffix, lockValue{holder: lockFree}.bytes())
	if err != nil {
		return nil, fmt.Errorf("folder lock: %w", err)
	}
	return cur, nil
}

// request queues q's request and folds the queue unless another node
// holds the lock. It does not queue the request again while it may still
// be in the queue: while the state is the one the node read when it
// pushed it, for up to settle (a request applied, or dropped by a folder
// that failed, leaves the state changed or, after settle, is pushed
// again; a duplicate does no harm, foldRequest being idempotent). It reports
// whether the caller should decide again at once: this node folded (snap
// holds the state as it last read or wrote it), or the store has no
// queues (the caller falls back to compare-setting).
//
// lazy (the request only refreshes a heartbeat) defers the fold: it is
// made lazyDelay after the push, and only if no fold has started since.
func (d *Dynamic) request(ctx context.Context, snap *snapshot, q *queued, now time.Time, lazy bool) (bool, error) {
	push, err := d.mustPush(ctx, snap, q, now)
	if err != nil {
		return false, err
	}
	var look *lockLook // the folder lock as the push found it
	if push {
		b, err := json.Marshal(q.req)
		if err != nil {
			return false, err
		}
		start := d.now()
		if look, err = d.push(ctx, b, !lazy); err != nil {
			if errors.Is(err, ErrNotSupported) {
				d.noQueue.Store(true)
				return true, nil
			}
			return false, fmt.Errorf("queue request: %w", err)
		}
		d.observe(start)
		d.nextBeat.CompareAndSwap(beatNone, beatQueued)
		q.sent, q.token, q.due = now, snap.token, now.Add(d.lookPeriod())
		q.atWork = false
	}
	if !push && !lazy && !q.lapsed && d.canPeek() {
		// Still queued, and where the store peeks a look at the lock is
		// awaitQueued's, at its own times (a folder at work: no need to
		// look at every wake-up, which in a crowd is its looks again).
		return false, nil
	}
	q.lapsed = false
	if lazy {
		if now.Sub(q.sent) < d.lazyDelay() {
			return false, nil
		}
		done, err := d.foldedSince(ctx, q.sent)
		if done {
			q.beat = q.sent
		}
		if err != nil || done {
			return false, err
		}
	}
	applied, err := d.fold(ctx, snap, look)
	if applied && lazy {
		q.beat = q.sent
	}
	if push && !lazy && !applied && err == nil && d.crowded() && d.canPeek() {
		q.atWork = true
	}
	return applied, err
}

// lockLook is the folder lock as a push read it (push): its value (nil:
// absent) and whether the push took it (created it with the value this
// node holds it with).
type lockLook struct {
	cur  []byte
	mine bool
}

// push queues a request, b. With look, where the store pushes and looks in
// one request (PushPeeker), it reads the folder lock with the push, and
// takes it if nobody has yet (the key is absent), and returns what it
// found: that stands for the fold's look after the push (lock). On etcd a
// look of its own is a read-only transaction, one of a crowd's five
// requests a node, and in a crowd that starts together every node's look
// finds the lock absent and its compare-set (a Raft proposal) then fails
// for all but one. A nil look: not read.
func (d *Dynamic) push(ctx context.Context, b []byte, look bool) (*lockLook, error) {
	if pp, ok := d.store.(PushPeeker); ok && look && d.canPeek() && !d.noPushPeek.Load() {
		now := d.now()
		want := lockValue{holder: d.me.String(), expiry: now.Add(d.lockHold()), start: now}.bytes()
		cur, err := pp.QueuePushPeek(ctx, d.key+queueSuffix, b, d.key+lockSuffix, want)
		switch {
		case err == nil:
			return &lockLook{cur: cur, mine: bytes.Equal(cur, want)}, nil
		case !errors.Is(err, ErrNotSupported):
			return nil, err
		}
		d.noPushPeek.Store(true) // nothing pushed: push plainly
	}
	return nil, d.store.QueuePush(ctx, d.key+queueSuffix, b)
}

// crowded reports whether this run's nodes are a crowd: MaxNodes ÷
// CrowdRate beyond settle, where the look period stretches.
//
// Where the store peeks (etcd), a crowd's queued join makes no lazy look
// after its push when its own fold right after the push found the lock
// held (awaitQueued): the push
// went before that look, so a folder letting go afterwards sees the
// request in the queue (fold's QueueLen) and folds on; the one it could
// leave there (a pass of heartbeats past lazyDelay) is folded by the
// crowd's looks, at about CrowdRate a second, and its heartbeats' lazy
// folds. In a crowd of 10,000 on etcd the lazy look was two of an
// agent's seven requests (a look at the lock, a second wait), all within
// a second of the crowd's pushes, and each one found the folder at work.
func (d *Dynamic) crowded() bool { return d.cfg.crowdPeriod() > d.settle() }

// keepAliveQueued queues this node's heartbeat and, lazyDelay later,
// folds unless somebody has since (not in a Next whose node is only
// queued: beatQueued): the keep-alive of a node, without reading the
// state. It returns when the next is due.
func (d *Dynamic) keepAliveQueued(ctx context.Context) (time.Time, error) {
	now := d.now()
	next := now.Add(d.cfg.HeartbeatInterval())
	b, err := json.Marshal(request{Node: d.me, Call: d.calls.Load(), Deadline: now.Add(d.cfg.KeepAliveTimeout).UTC(), KeepAlive: true})
	if err != nil {
		return next, err
	}
	// The push may take what the drop timeout leaves after an interval,
	// not KeepAliveTimeout: on a store that answers slower than that, a
	// beat given up never lands, while a patient Next's writes do, and
	// such a writer judged every member dead (509 of 512 agents at once
	// on two cores). A beat that lands late is stamped when folded.
	pctx, cancel := context.WithTimeout(ctx, max(d.cfg.KeepAliveTimeout, d.cfg.DropTimeout()-d.cfg.HeartbeatInterval()))
	err = d.store.QueuePush(pctx, d.key+queueSuffix, b)
	cancel()
	if err != nil {
		if !errors.Is(err, ErrNotSupported) {
			d.keepAliveFailed(ctx, err)
		}
		return next, err
	}
	if d.inNext.Load() && d.nextBeat.Load() != beatInState {
		return next, nil // left to the folder (beatQueued)
	}
	ctx, cancel = context.WithTimeout(ctx, d.cfg.KeepAliveTimeout)
	defer cancel()
	if err := sleep(ctx, d.lazyDelay()); err != nil {
		return next, err
	}
	if done, err := d.foldedSince(ctx, now); err != nil || done {
		return next, err
	}
	// The state is read once the lock is won (fold), not before: at 512
	// agents restarting, every one whose beat found no fold since read
	// the whole state, and all but one of them then lost the lock.
	_, err = d.fold(ctx, nil, nil)
	return next, err
}

// mustPush reports whether q's request must be pushed (again): never
// pushed; or applied (the state shows this call with the node) and the
// state has changed since, or settle has passed (a heartbeat due again):
// the node's decision on it is a new request; or not applied after settle
// while nobody holds the folder lock (a folder died with it). A request
// still queued, or being folded, is not pushed twice: in a crowd of
// thousands whose folder takes longer than settle, every node pushing
// again would double the queue the folder has to get through.
func (d *Dynamic) mustPush(ctx context.Context, snap *snapshot, q *queued, now time.Time) (bool, error) {
	settled := !now.Before(q.due)
	switch {
	case q.sent.IsZero():
		return true, nil
	case bytes.Equal(q.token, snap.token) && !settled:
		return false, nil
	}
	if i, ok := snap.st.find(d.me); ok && snap.st.Nodes[i].Call == q.req.Call {
		return true, nil
	}
	if !settled {
		return false, nil
	}
	cur, err := d.readLock(ctx)
	if err != nil {
		return false, err
	}
	lock := parseLock(cur)
	if lock.lapsed(now) {
		return true, nil
	}
	q.due = lookAgain(now, lock, d.lookPeriod()) // a folder is at work: look again later
	return false, nil
}

// fold takes the folder lock if it is free (or its holder's expired), and
// while it holds it applies the queued requests in batches, one write a
// batch; it lets go when the queue is empty, or after lazyDelay of
// folding nothing but heartbeats: they keep arriving, and the folder has
// its own Next to finish. (Whoever queued what it leaves is woken by its
// last batch, or folds after its own lazy delay, and takes the lock
// over.) Joins keep it folding: their nodes wait for them, and a crowd's
// would otherwise be left to whoever wakes next. It reports
// whether it applied any request (snap then holds the state as it last
// read or wrote it). A look that is not nil is the lock as this node's
// push found it (push), after which it need not look again before taking
// it, nor take it if the push did (lock). A nil snap is read once the
// lock is taken, so that the nodes that do not get it read nothing.
func (d *Dynamic) fold(ctx context.Context, snap *snapshot, look *lockLook) (bool, error) {
	mine, ok, err := d.lock(ctx, nil, look)
	if err != nil || !ok {
		return false, err
	}
	k := d.keepLock(ctx, mine)
	defer func() { k.halt(ctx) }()
	if snap == nil {
		if snap, err = d.read(ctx); err != nil {
			return false, err
		}
	}
	applied := false
	start := d.now()
	for {
		reqs, more, err := d.pop(ctx, d.gatherFor())
		if err != nil {
			return applied, err
		}
		completed := false
		if len(reqs) > 0 {
			round, was := snap.st.Round, snap.st.Complete
			if err := d.apply(ctx, snap, reqs, !more); err != nil {
				return applied, err
			}
			applied = true
			completed = snap.st.Complete && (!was || snap.st.Round != round)
		}
		if !k.held() {
			return applied, nil // lapsed and taken midway: the taker folds
		}
		if completed {
			// The batch completed the round: this node's Next has its
			// answer, as has every node the write woke. What the queue
			// still holds its own nodes fold after their lazy delay:
			// heartbeats, joins of nodes that will wait for the next
			// round, and copies of requests already applied (a request
			// pushed again at its node's look), which reach the state
			// before any later call of their node (the queue is FIFO)
			// and so find their call done. Folding on, the folder that
			// completed a round of 512 agents on etcd logged it 2.6–3.3 s
			// after the others, and its workers started last, every run.
			if _, err := k.release(ctx); err != nil {
				return applied, fmt.Errorf("release folder lock: %w", err)
			}
			return applied, nil
		}
		// Heartbeats alone do not hold the folder past lazyDelay; joins
		// do, whose nodes wait for their batch (a crowd's rendezvous).
		joins := slices.ContainsFunc(reqs, func(r request) bool { return !r.KeepAlive })
		if spent := d.now().Sub(start) >= d.lazyDelay() && !joins; !more || spent {
			// Let go, then look again: a request pushed before the
			// release is seen here, one pushed after it finds the lock
			// free.
			released, err := k.release(ctx)
			if err != nil {
				return applied, fmt.Errorf("release folder lock: %w", err)
			}
			if !released {
				return applied, nil // expired and taken: the taker folds
			}
			n, err := d.store.QueueLen(ctx, d.key+queueSuffix)
			if err != nil || n == 0 || spent {
				return applied, err
			}
			if mine, ok, err = d.lock(ctx, nil, nil); err != nil || !ok {
				return applied, err
			}
			k = d.keepLock(ctx, mine)
		}
	}
}

// lockKeeper renews a folder lock this node holds, every quarter of a
// hold, while it folds: on a loaded store one batch (pops, a read and a
// write of the state, the shares) can outlast the hold, and a second
// folder would then race this one with O(N)-byte compare-sets while
// every waiting node, finding the lock lapsed, pushed its request again.
// Losing the lock midway is harmless: the state's compare-set keeps
// every write correct.
type lockKeeper struct {
	d    *Dynamic
	stop context.CancelFunc
	done chan struct{}

	mu   sync.Mutex
	mine []byte // the lock's value as held; nil once lost or let go
}

// keepLock starts renewing the lock held with mine.
func (d *Dynamic) keepLock(ctx context.Context, mine []byte) *lockKeeper {
	ctx, stop := context.WithCancel(ctx)
	k := &lockKeeper{d: d, stop: stop, done: make(chan struct{}), mine: mine}
	go func() {
		defer close(k.done)
		for sleep(ctx, d.lockHold()/4) == nil {
			k.mu.Lock()
			held := k.mine
			k.mu.Unlock()
			// Only this goroutine changes mine until it is stopped.
			mine, ok, err := d.lock(ctx, held, nil)
			switch {
			case ok:
				held = mine
			case err == nil: // taken by another
				held = nil
			}
			// (A renewal the store failed leaves the lock as it was, to
			// be renewed at the next try or to lapse.)
			k.mu.Lock()
			k.mine = held
			k.mu.Unlock()
			if held == nil {
				return
			}
		}
	}()
	return k
}

// held reports whether the lock is still this node's, as far as it knows.
func (k *lockKeeper) held() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.mine != nil
}

// freeValue is the lock's value let go by mine's holder.
func freeValue(mine []byte) []byte {
	v := parseLock(mine)
	v.holder, v.expiry = lockFree, time.Unix(0, 0)
	return v.bytes()
}

// take stops the renewals and returns the lock's value as this node
// holds it, nil if it does not; the keeper holds nothing after.
func (k *lockKeeper) take() []byte {
	k.stop()
	<-k.done
	k.mu.Lock()
	defer k.mu.Unlock()
	mine := k.mine
	k.mine = nil
	return mine
}

// release stops the renewals and lets go of the lock, reporting whether
// it was still this node's.
func (k *lockKeeper) release(ctx context.Context) (bool, error) {
	mine := k.take()
	if mine == nil {
		return false, nil
	}
	released := freeValue(mine)
	cur, err := k.d.compareSetLock(ctx, k.d.key+lockSuffix, mine, released)
	if err != nil {
		return false, err
	}
	return bytes.Equal(cur, released), nil
}

// halt stops the renewals and, where the fold failed midway with the
// lock held, lets go of it (briefly: the others may fold without
// waiting out the expiry).
func (k *lockKeeper) halt(ctx context.Context) {
	if mine := k.take(); mine != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		k.d.store.CompareSet(rctx, k.d.key+lockSuffix, mine, freeValue(mine))
		cancel()
	}
}

// lock takes the folder lock, or renews it when mine is the value this
// node holds it with, and returns the new value. A fold starts when the
// lock is taken, not when it is renewed. A look that is not nil is the
// lock as the push just made found it (push): it stands for the look
// before writing, and says whether the push took the lock.
func (d *Dynamic) lock(ctx context.Context, mine []byte, look *lockLook) ([]byte, bool, error) {
	now := d.now()
	want := lockValue{holder: d.me.String(), expiry: now.Add(d.lockHold()), start: now}
	key := d.key + lockSuffix
	expected := mine
	switch {
	case expected != nil:
		want.start = parseLock(mine).start
	case d.canPeek():
		// Look before writing: on etcd a compare-set is a Raft proposal
		// even when it fails, and in a crowd every node looks at the
		// lock once per push while one holds it.
		var cur []byte
		var err error
		if look != nil && look.mine {
			return look.cur, true, nil
		} else if look != nil {
			cur = look.cur
		} else if cur, err = d.peek(ctx, key, nil); err != nil {
			return nil, false, fmt.Errorf("folder lock: %w", err)
		}
		if len(cur) > 0 && !parseLock(cur).lapsed(now) {
			return nil, false, nil
		}
		expected = cur // nil: absent, which a compare-set expecting nothing creates
	default:
		// A compare-set expecting nothing creates the key, or reads it.
		cur, err := d.compareSetLock(ctx, key, nil, want.bytes())
		if err != nil {
			return nil, false, fmt.Errorf("folder lock: %w", err)
		}
		if bytes.Equal(cur, want.bytes()) {
			return cur, true, nil
		}
		if !parseLock(cur).lapsed(now) {
			return nil, false, nil
		}
		expected = cur
	}
	b := want.bytes()
	start := d.now()
	cur, err := d.compareSetLock(ctx, key, expected, b)
	if err != nil {
		return nil, false, fmt.Errorf("folder lock: %w", err)
	}
	d.observe(start)
	return b, bytes.Equal(cur, b), nil
}

// compareSetLock is the folder lock's compare-set (its taking, renewal
// and release). Where the store cannot tell whether it applied it
// (ErrOutcomeUnknown: its answer lost, and the lease of the token that
// would tell gone with it, on a busy etcd), the
// lock is read back: the value is this node's own, to the nanosecond, so
// the lock holding it says the write applied, and anything else that it
// did not (or was taken over since); either way the caller compares what
// it returns with its own value. The error ended the node's rendezvous:
// at 512 agents on etcd one agent exited so at its first fold, and the
// job waited for its worker to the end.
func (d *Dynamic) compareSetLock(ctx context.Context, key string, expected, want []byte) ([]byte, error) {
	cur, err := d.store.CompareSet(ctx, key, expected, want)
	if !errors.Is(err, ErrOutcomeUnknown) {
		return cur, err
	}
	return d.peek(ctx, key, lockValue{holder: lockFree}.bytes())
}

// gatherFor is how long a pass may gather a crowd's joins before it
// writes them (pop): zero for a run of at most CrowdRate ×
// KeepAliveInterval nodes, where every batch is small and written as it
// comes; beyond, half a heartbeat interval. A crowd of thousands reaches
// the queue over seconds (its pushes are what a loaded store serves),
// and a pass that wrote whenever it found the queue empty for a moment, or
// every lazyDelay, wrote the whole state (O(N) bytes, and every bucket's
// share) four or five times for one round: bytes written per node grew
// with N. Gathered, the crowd's joins go out in one or two writes. The
// nodes in the state lose nothing by the wait: a heartbeat in the batch
// is stamped when it lands, and half an interval is a sixth of the drop
// timeout.
func (d *Dynamic) gatherFor() time.Duration {
	if d.cfg.crowdPeriod() <= d.cfg.KeepAliveInterval {
		return 0
	}
	return d.cfg.HeartbeatInterval() / 2
}

// gatherQuiet is how long a gathering pass waits for more joins on an
// empty queue before it writes what it has: the crowd has stopped coming.
func (d *Dynamic) gatherQuiet() time.Duration { return d.lazyDelay() / 2 }

// pop takes up to foldBatch requests off the queue, skipping any that do
// not decode (they are not a gorun node's), and reports whether it
// stopped before the queue was empty: at foldBatch, or after lazyDelay
// (a fifth of the lock's hold at the defaults), so that the folder writes
// what it has, renews the lock and can let go (a crowd's thousands of
// pops, one round trip each on a loaded store, would outlast the lock,
// and a second folder then race the first with O(N)-byte compare-sets).
//
// With gather (gatherFor: a crowd), a pop that has taken a join goes on
// for up to gather, and an empty queue ends it only once it has stayed
// empty for gatherQuiet; it holds up to twice MaxNodes requests.
//
// It pops in batches where the store can (BatchPopper: etcd, where a pop
// is two round trips), one by one elsewhere.
//
// popLost: a pop whose outcome the store cannot tell (ErrOutcomeUnknown:
// etcd lost its answer, and the lease of the token that would tell ended
// meanwhile) may have taken requests that nobody will see. It ends the
// pop as one cut short (more: nobody is judged on a queue that may not be
// drained), without an error: the requests already in hand are written,
// and a lost one's node pushes it again when it looks at settle, as after
// a folder that died. Failing instead ended the folder's rendezvous: at
// 512 agents on etcd, one agent whose lease lapsed exited so, and the
// job (512:512) waited for it to the end.
func (d *Dynamic) pop(ctx context.Context, gather time.Duration) ([]request, bool, error) {
	var reqs []request
	start := d.now()
	until := start.Add(min(d.lazyDelay(), d.lockHold()/2))
	joins := false
	add := func(b []byte) {
		var r request
		if json.Unmarshal(b, &r) == nil && (r.Call != 0 || r.KeepAlive) && r.Node.Addr != "" {
			reqs = append(reqs, r)
			if !r.KeepAlive && gather > 0 && !joins {
				joins, until = true, start.Add(gather)
			}
		}
	}
	bp, batch := d.store.(BatchPopper)
	waited := false // on an empty queue, gathering
	limit := foldBatch
	if gather > 0 {
		limit = max(foldBatch, 2*d.cfg.MaxNodes) // the whole crowd, its heartbeats too
	}
	for len(reqs) < limit {
		if d.now().After(until) {
			return reqs, true, nil
		}
		var got bool
		if batch {
			asked := d.now()
			bs, err := bp.QueuePopBatch(ctx, d.key+queueSuffix, limit-len(reqs))
			d.observe(asked)
			switch {
			case errors.Is(err, ErrNotSupported):
				batch = false
				continue
			case errors.Is(err, ErrOutcomeUnknown):
				return reqs, true, nil // see popLost
			case err != nil:
				return reqs, false, fmt.Errorf("pop requests: %w", err)
			}
			for _, b := range bs {
				add(b)
			}
			got = len(bs) > 0
		} else {
			b, err := d.store.QueuePop(ctx, d.key+queueSuffix, false)
			switch {
			case errors.Is(err, ErrQueueEmpty):
			case errors.Is(err, ErrOutcomeUnknown):
				return reqs, true, nil // see popLost
			case err != nil:
				return reqs, false, fmt.Errorf("pop requests: %w", err)
			default:
				add(b)
				got = true
			}
		}
		switch {
		case got:
			waited = false
		case waited || !joins || d.now().Add(d.gatherQuiet()).After(until):
			return reqs, false, nil
		default:
			waited = true
			if err := sleep(ctx, d.gatherQuiet()); err != nil {
				return reqs, false, err
			}
		}
	}
	return reqs, true, nil
}

// apply writes reqs into the state: one compare-set, repeated on the
// state that won when another writer was first. With drained (the pop
// found the queue empty after reqs) it judges the heartbeats too; a batch
// that leaves requests in the queue drops nobody, as their beats may be
// among those left: at 512 real agents, with the folds behind, batches
// cut short by their time dropped live nodes a few at a time whose beats
// were still queued. A dead node is dropped by the first batch that
// empties the queue: as much later as the folds lag.
//
// The folder works on the state: a node's view (dynamic_share.go) is
// replaced by it first.
func (d *Dynamic) apply(ctx context.Context, snap *snapshot, reqs []request, drained bool) error {
	if snap.st.view {
		fresh, err := d.read(ctx)
		if err != nil {
			return err
		}
		*snap = *fresh
	}
	for {
		now := d.now()
		st := snap.st.clone()
		// The batch's heartbeats before the state is judged: a beat in
		// it says its node is alive, however old the state's is (a
		// folder that fell behind; a node whose earlier beats did not
		// get through), and a node dropped first would stay dropped.
		// As of when is judged on the state as it was: the folder's own
		// beat in the batch does not end its silence (judgedAt).
		judged := d.judgedAt(st, now)
		changed := false
		for _, r := range reqs {
			if r.KeepAlive && st.foldRequest(r, now, d.cfg) {
				changed = true
			}
		}
		if drained {
			changed = d.sanitize(st, now, judged, "fold") || changed
		}
		var idle []NodeDesc // joins that change nothing
		for _, r := range reqs {
			switch {
			case r.KeepAlive:
			case st.foldRequest(r, now, d.cfg):
				changed = true
			default:
				idle = append(idle, r.Node)
			}
		}
		if changed {
			st.Batch = snap.st.Batch + 1
		} else {
			// Nothing to write on this state; but it may be stale, and
			// the requester decides again on snap.
			fresh, err := d.read(ctx)
			if err != nil {
				return err
			}
			if bytes.Equal(fresh.token, snap.token) {
				return d.republish(ctx, snap.st, idle)
			}
			*snap = *fresh
			continue
		}
		start := d.now()
		won, err := d.commit(ctx, snap, st, time.Time{}) // the lock held: no waiting out a slow store here
		d.observe(start)
		if err != nil {
			return err
		}
		if won {
			return d.republish(ctx, snap.st, idle)
		}
	}
}

// republish rewrites, from st (the state as last read or written), the
// shares of nodes whose join requests changed nothing, and the marker
// where it is older than st's: a node pushes its join again only when its
// view does not show it, so its share (or the marker) is older than the
// state. Two publishers crossing (a folder that lost its lock midway
// publishing after the next one) can leave a share so, and no later
// write would otherwise rewrite it: the node would wait for ever.
func (d *Dynamic) republish(ctx context.Context, st *dynState, idle []NodeDesc) error {
	if len(idle) == 0 {
		return nil
	}
	shares := st.shares(d.buckets)
	var keys []string
	var vals [][]byte
	for _, n := range idle {
		b := bucketOf(n, d.buckets)
		if k := d.shareKey(b); !slices.Contains(keys, k) {
			v, err := st.shareBytes(shares[b])
			if err != nil {
				return err
			}
			keys, vals = append(keys, k), append(vals, v)
		}
	}
	if err := d.store.MultiSet(ctx, keys, vals); err != nil {
		return fmt.Errorf("republish shares: %w", err)
	}
	b, err := d.peek(ctx, d.key+markerSuffix, emptyMarker)
	if err != nil {
		return err
	}
	var m marker
	if json.Unmarshal(b, &m) == nil && m.Pub >= st.Pub {
		return nil
	}
	if err := d.store.Set(ctx, d.key+markerSuffix, mustMarshal(st.marker(d.cfg))); err != nil {
		return fmt.Errorf("republish marker: %w", err)
	}
	return nil
}
