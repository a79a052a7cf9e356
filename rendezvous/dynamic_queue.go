package rendezvous

// Joins by queue: a crowd of N nodes calling Next at once would otherwise
// race to compare-set one state of O(N) bytes, each losing O(N) times. So
// a Next that would write queues its request instead (one push of its own
// few hundred bytes), and the node that holds the folder lock pops every
// queued request, applies them to the state as their own nodes would
// (foldRequest), and writes the state once for the whole batch. A
// requester then waits on the one wake-up key like any other waiter.
//
// The lock is a key holding its holder and an expiry; a holder that dies
// is replaced when the expiry passes. Losing it is harmless (every write
// is still a compare-set of the state), and so is losing a request (its
// node queues it again when it has seen no effect for a while): the lock
// and the queue save work, the state's compare-set keeps it correct.
//
// Keys, next to the state's ("gorun.rendezvous.<run_id>"): the queue
// "<state>/requests" and the lock "<state>/folder".

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

const (
	queueSuffix = "/requests"
	lockSuffix  = "/folder"
	// lockFree is the lock's value when nobody holds it.
	lockFree = "-"
	// foldBatch bounds the requests one pass applies, so that a pass
	// writes (and wakes) while more arrive.
	foldBatch = 4096
)

// queued is a Next's request and when it was last pushed.
type queued struct {
	req   request
	sent  time.Time // zero: never
	token []byte    // the state the node had read then
}

// settle is how long a queued request may stay without effect before its
// node queues it again (the folder that popped it may have died).
func (d *Dynamic) settle() time.Duration { return d.cfg.KeepAliveTimeout }

// lockHold is how long the folder lock lasts unless renewed; the holder
// renews it at every pass.
func (d *Dynamic) lockHold() time.Duration { return d.cfg.KeepAliveTimeout }

// request queues q's request and folds the queue unless another node
// holds the lock. It does not queue the request again while it may still
// be in the queue: while the state is the one the node read when it
// pushed it, for up to settle (a request applied, or dropped by a folder
// that failed, leaves the state changed or, after settle, is pushed
// again; a duplicate does no harm, foldRequest being idempotent). It reports
// whether the caller should decide again at once: this node folded (snap
// holds the state as it last read or wrote it), or the store has no
// queues (the caller falls back to compare-setting).
func (d *Dynamic) request(ctx context.Context, snap *snapshot, q *queued, now time.Time) (bool, error) {
	if q.sent.IsZero() || !bytes.Equal(q.token, snap.token) || now.Sub(q.sent) >= d.settle() {
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
		q.sent, q.token = now, snap.token
	}
	return d.fold(ctx, snap)
}

// fold takes the folder lock if it is free (or its holder's expired), and
// while it holds it applies the queued requests in batches, one write a
// batch; it lets go when the queue is empty. It reports whether it
// applied any request (snap then holds the state as it last read or
// wrote it).
func (d *Dynamic) fold(ctx context.Context, snap *snapshot) (bool, error) {
	mine, ok, err := d.lock(ctx, nil)
	if err != nil || !ok {
		return false, err
	}
	held, applied := true, false
	defer func() {
		if held { // failed midway: let the others fold without waiting out the expiry
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			d.store.CompareSet(rctx, d.key+lockSuffix, mine, []byte(lockFree))
			cancel()
		}
	}()
	for {
		reqs, err := d.pop(ctx)
		if err != nil {
			return applied, err
		}
		if len(reqs) > 0 {
			if err := d.apply(ctx, snap, reqs); err != nil {
				return applied, err
			}
			applied = true
		}
		if len(reqs) < foldBatch {
			// Let go, then look again: a request pushed before the
			// release is seen here, one pushed after it finds the lock
			// free.
			cur, err := d.store.CompareSet(ctx, d.key+lockSuffix, mine, []byte(lockFree))
			if err != nil {
				return applied, fmt.Errorf("release folder lock: %w", err)
			}
			held = false
			if !bytes.Equal(cur, []byte(lockFree)) {
				return applied, nil // expired and taken: the taker folds
			}
			n, err := d.store.QueueLen(ctx, d.key+queueSuffix)
			if err != nil || n == 0 {
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
// node holds it with, and returns the new value.
func (d *Dynamic) lock(ctx context.Context, mine []byte) ([]byte, bool, error) {
	now := d.now()
	want := []byte(d.me.String() + " " + strconv.FormatInt(now.Add(d.lockHold()).UnixNano(), 10))
	key := d.key + lockSuffix
	expected := mine
	if expected == nil {
		// A compare-set expecting nothing creates the key, or reads it.
		cur, err := d.store.CompareSet(ctx, key, nil, want)
		if err != nil {
			return nil, false, fmt.Errorf("folder lock: %w", err)
		}
		if bytes.Equal(cur, want) {
			return want, true, nil
		}
		if !lockLapsed(cur, now) {
			return nil, false, nil
		}
		expected = cur
	}
	cur, err := d.store.CompareSet(ctx, key, expected, want)
	if err != nil {
		return nil, false, fmt.Errorf("folder lock: %w", err)
	}
	return want, bytes.Equal(cur, want), nil
}

// lockLapsed reports whether the lock's value v is free or its holder's
// expiry has passed at now.
func lockLapsed(v []byte, now time.Time) bool {
	s := string(v)
	if s == lockFree || s == "" {
		return true
	}
	i := strings.LastIndexByte(s, ' ')
	ns, err := strconv.ParseInt(s[i+1:], 10, 64)
	return err != nil || now.UnixNano() > ns
}

// pop takes up to foldBatch requests off the queue, skipping any that do
// not decode (they are not a gorun node's).
func (d *Dynamic) pop(ctx context.Context) ([]request, error) {
	var reqs []request
	for len(reqs) < foldBatch {
		b, err := d.store.QueuePop(ctx, d.key+queueSuffix, false)
		switch {
		case errors.Is(err, ErrQueueEmpty):
			return reqs, nil
		case err != nil:
			return reqs, fmt.Errorf("pop requests: %w", err)
		}
		var r request
		if json.Unmarshal(b, &r) == nil && r.Call != 0 && r.Node.Addr != "" {
			reqs = append(reqs, r)
		}
	}
	return reqs, nil
}

// apply writes reqs into the state: one compare-set, repeated on the
// state that won when another writer was first.
func (d *Dynamic) apply(ctx context.Context, snap *snapshot, reqs []request) error {
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
			// Wake the requesters that wait for a batch.
			if err := d.store.Set(ctx, d.batchKey(st.Batch), nil); err != nil {
				return fmt.Errorf("batch %d: %w", st.Batch, err)
			}
			if st.Batch > notifyKeep {
				d.store.Delete(ctx, d.batchKey(st.Batch-notifyKeep)) // tidying only
			}
			return nil
		}
	}
}

// batchKey names the key set when batch n of requests is in the state.
func (d *Dynamic) batchKey(n uint64) string {
	return d.key + "/batch/" + strconv.FormatUint(n, 10)
}
