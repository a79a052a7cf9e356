package rendezvous

// Joins by queue: a crowd of N nodes calling Next at once would otherwise
// race to compare-set one state of O(N) bytes, each losing O(N) times. So
// a Next that would write queues its request instead (one push of its own
// few hundred bytes), and the node that holds the folder lock pops every
// queued request, applies them to the state as their own nodes would
// (foldRequest), and writes the state once for the whole batch. A
// requester then waits on the wake-up key like any other waiter (and
// looks once a lazy fold's delay after its push, in case the folder let
// go just before it), reading only its own share of the state
// (dynamic_share.go). Runs smaller than
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
	"slices"
	"strconv"
	"strings"
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
}

// settle is how long a queued request may stay without effect before its
// node queues it again (the folder that popped it may have died).
func (d *Dynamic) settle() time.Duration { return d.cfg.KeepAliveTimeout }

// lockHold is how long the folder lock lasts unless renewed; the holder
// renews it at every pass.
func (d *Dynamic) lockHold() time.Duration { return d.cfg.KeepAliveTimeout }

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

// lapsed reports whether nobody holds the lock at now.
func (v lockValue) lapsed(now time.Time) bool {
	return v.holder == lockFree || now.After(v.expiry)
}

// foldedSince reports whether a fold has started after t (and so took
// along whatever was queued before t), as the lock shows.
func (d *Dynamic) foldedSince(ctx context.Context, t time.Time) (bool, error) {
	cur, err := d.store.CompareSet(ctx, d.key+lockSuffix, nil, lockValue{holder: lockFree}.bytes())
	if err != nil {
		return false, fmt.Errorf("folder lock: %w", err)
	}
	return parseLock(cur).start.After(t), nil
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
	if push {
		b, err := json.Marshal(q.req)
		if err != nil {
			return false, err
		}
		if err := d.store.QueuePush(ctx, d.key+queueSuffix, b); err != nil {
			if errors.Is(err, ErrNotSupported) {
				d.noQueue.Store(true)
				return true, nil
			}
			return false, fmt.Errorf("queue request: %w", err)
		}
		q.sent, q.token, q.due = now, snap.token, now.Add(d.settle())
	}
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
	applied, err := d.fold(ctx, snap)
	if applied && lazy {
		q.beat = q.sent
	}
	return applied, err
}

// keepAliveQueued queues this node's heartbeat and, lazyDelay later,
// folds unless somebody has since: the keep-alive of a node that is in
// no Next, without reading the state. It returns when the next is due.
func (d *Dynamic) keepAliveQueued(ctx context.Context) (time.Time, error) {
	now := d.now()
	next := now.Add(d.cfg.KeepAliveInterval)
	b, err := json.Marshal(request{Node: d.me, Call: d.calls.Load(), Deadline: now.Add(d.cfg.KeepAliveTimeout).UTC(), KeepAlive: true})
	if err != nil {
		return next, err
	}
	if err := d.store.QueuePush(ctx, d.key+queueSuffix, b); err != nil {
		return next, err
	}
	if err := sleep(ctx, d.lazyDelay()); err != nil {
		return next, err
	}
	if done, err := d.foldedSince(ctx, now); err != nil || done {
		return next, err
	}
	snap, err := d.read(ctx)
	if err != nil {
		return next, err
	}
	_, err = d.fold(ctx, snap)
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
	cur, err := d.store.CompareSet(ctx, d.key+lockSuffix, nil, lockValue{holder: lockFree}.bytes())
	if err != nil {
		return false, fmt.Errorf("folder lock: %w", err)
	}
	if parseLock(cur).lapsed(now) {
		return true, nil
	}
	q.due = now.Add(d.settle()) // a folder is at work: look again later
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
// read or wrote it).
func (d *Dynamic) fold(ctx context.Context, snap *snapshot) (bool, error) {
	mine, ok, err := d.lock(ctx, nil)
	if err != nil || !ok {
		return false, err
	}
	held, applied := true, false
	free := func() []byte {
		v := parseLock(mine)
		v.holder, v.expiry = lockFree, time.Unix(0, 0)
		return v.bytes()
	}
	defer func() {
		if held { // failed midway: let the others fold without waiting out the expiry
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			d.store.CompareSet(rctx, d.key+lockSuffix, mine, free())
			cancel()
		}
	}()
	start := d.now()
	for {
		reqs, more, err := d.pop(ctx)
		if err != nil {
			return applied, err
		}
		if len(reqs) > 0 {
			if err := d.apply(ctx, snap, reqs); err != nil {
				return applied, err
			}
			applied = true
		}
		// Heartbeats alone do not hold the folder past lazyDelay; joins
		// do, whose nodes wait for their batch (a crowd's rendezvous).
		joins := slices.ContainsFunc(reqs, func(r request) bool { return !r.KeepAlive })
		if spent := d.now().Sub(start) >= d.lazyDelay() && !joins; !more || spent {
			// Let go, then look again: a request pushed before the
			// release is seen here, one pushed after it finds the lock
			// free.
			released := free()
			cur, err := d.store.CompareSet(ctx, d.key+lockSuffix, mine, released)
			if err != nil {
				return applied, fmt.Errorf("release folder lock: %w", err)
			}
			held = false
			if !bytes.Equal(cur, released) {
				return applied, nil // expired and taken: the taker folds
			}
			n, err := d.store.QueueLen(ctx, d.key+queueSuffix)
			if err != nil || n == 0 || spent {
				return applied, err
			}
			if mine, ok, err = d.lock(ctx, nil); err != nil || !ok {
				return applied, err
			}
			held = true
			continue
		}
		if mine, ok, err = d.lock(ctx, mine); err != nil || !ok { // renew
			held = false
			return applied, err
		}
	}
}

// lock takes the folder lock, or renews it when mine is the value this
// node holds it with, and returns the new value. A fold starts when the
// lock is taken, not when it is renewed.
func (d *Dynamic) lock(ctx context.Context, mine []byte) ([]byte, bool, error) {
	now := d.now()
	want := lockValue{holder: d.me.String(), expiry: now.Add(d.lockHold()), start: now}
	key := d.key + lockSuffix
	expected := mine
	if expected != nil {
		want.start = parseLock(mine).start
	} else {
		// A compare-set expecting nothing creates the key, or reads it.
		cur, err := d.store.CompareSet(ctx, key, nil, want.bytes())
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
	cur, err := d.store.CompareSet(ctx, key, expected, b)
	if err != nil {
		return nil, false, fmt.Errorf("folder lock: %w", err)
	}
	return b, bytes.Equal(cur, b), nil
}

// pop takes up to foldBatch requests off the queue, skipping any that do
// not decode (they are not a gorun node's), and reports whether it
// stopped before the queue was empty: at foldBatch, or after lazyDelay
// (a fifth of the lock's hold at the defaults), so that the folder writes
// what it has, renews the lock and can let go (a crowd's thousands of
// pops, one round trip each on a loaded store, would outlast the lock,
// and a second folder then race the first with O(N)-byte compare-sets).
//
// It pops in batches where the store can (BatchPopper: etcd, where a pop
// is two round trips), one by one elsewhere.
func (d *Dynamic) pop(ctx context.Context) ([]request, bool, error) {
	var reqs []request
	until := d.now().Add(min(d.lazyDelay(), d.lockHold()/2))
	add := func(b []byte) {
		var r request
		if json.Unmarshal(b, &r) == nil && (r.Call != 0 || r.KeepAlive) && r.Node.Addr != "" {
			reqs = append(reqs, r)
		}
	}
	bp, batch := d.store.(BatchPopper)
	for len(reqs) < foldBatch {
		if d.now().After(until) {
			return reqs, true, nil
		}
		if batch {
			bs, err := bp.QueuePopBatch(ctx, d.key+queueSuffix, foldBatch-len(reqs))
			switch {
			case errors.Is(err, ErrNotSupported):
				batch = false
				continue
			case err != nil:
				return reqs, false, fmt.Errorf("pop requests: %w", err)
			case len(bs) == 0:
				return reqs, false, nil
			}
			for _, b := range bs {
				add(b)
			}
			continue
		}
		b, err := d.store.QueuePop(ctx, d.key+queueSuffix, false)
		switch {
		case errors.Is(err, ErrQueueEmpty):
			return reqs, false, nil
		case err != nil:
			return reqs, false, fmt.Errorf("pop requests: %w", err)
		}
		add(b)
	}
	return reqs, true, nil
}

// apply writes reqs into the state: one compare-set, repeated on the
// state that won when another writer was first.
//
// The folder works on the state: a node's view (dynamic_share.go) is
// replaced by it first.
func (d *Dynamic) apply(ctx context.Context, snap *snapshot, reqs []request) error {
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
		changed := st.sanitize(now, d.cfg)
		for _, r := range reqs {
			changed = st.foldRequest(r, now, d.cfg) || changed
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
				return nil
			}
			*snap = *fresh
			continue
		}
		won, err := d.commit(ctx, snap, st)
		if err != nil {
			return err
		}
		if won {
			return nil
		}
	}
}
