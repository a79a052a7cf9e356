package etcd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Group commit: the operations of concurrent callers go to etcd together,
// as the Then branch of one transaction: plain puts and gets (Set, Get,
// QueuePush) and the compare-and-swap transactions of read-modify-writes
// (Add, CompareSet, Append, Barrier), nested, each deciding on its own
// comparison. etcd's cost is per request (a gRPC call, a Raft proposal for
// a write, a read index for a read), far more than per key, so a node whose
// workers hammer the store sends one request where it would send dozens.
//
// A request goes out at once when fewer than maxInflight are in flight;
// otherwise it waits for one to come back, and leaves with everything that
// queued meanwhile. An idle store adds no latency; a busy one trades a
// little of it for much more throughput. A transaction is atomic, so the
// batch's operations take effect at one revision, in some order, which is
// one the callers could have seen anyway: they were concurrent.

const (
	// maxBatchOps stays within etcd's --max-txn-ops (128 by default).
	maxBatchOps = 128
	// maxBatchBytes stays well within etcd's --max-request-bytes (1.5 MiB
	// by default); a bigger value travels alone.
	maxBatchBytes = 512 << 10
)

// batchCall is one caller's operation in a batch.
type batchCall struct {
	op     clientv3.Op
	writes []string // the keys op may write
	size   int
	done   chan struct{}
	resp   *etcdserverpb.ResponseOp
	rev    int64 // the batch's revision
	err    error
	// leased: op puts a token under its lease (doTokened); resent: the
	// batch was sent more than once.
	leased, resent bool
}

// batcher queues operations and sends them in transactions.
type batcher struct {
	s           *Storage
	maxInflight int

	wg sync.WaitGroup // batches in flight

	mu       sync.Mutex
	pending  []*batchCall
	inflight int
	closed   bool
	maxOps   int // operations per batch: maxBatchOps, or less once etcd refused that many
}

// do runs op in the next batch and returns its response and the revision
// of the batch (for a write, the mod revision of what it wrote). writes
// names every key op may write; a plain put's own key need not be named.
// size estimates op's bytes.
//
// A batch whose outcome is unknown (etcd lost its leader mid-request) is
// sent again: a plain operation may be repeated, and a compare-and-swap
// that was applied the first time fails its comparison the second (the
// caller tells its own write from another's; see Storage.update).
func (b *batcher) do(op clientv3.Op, size int, writes ...string) (*etcdserverpb.ResponseOp, int64, error) {
	if op.IsPut() {
		writes = append(writes, string(op.KeyBytes()))
		size = len(op.KeyBytes()) + len(op.ValueBytes())
	}
	c := &batchCall{op: op, writes: writes, size: size, done: make(chan struct{})}
	b.run(c)
	return c.resp, c.rev, c.err
}

// doTokened is do for an operation that puts a token under its lease (see
// Storage.update), and also reports whether its batch was sent more than
// once. When etcd refuses the batch because a lease is gone, nothing in it
// was applied: the operations with tokens fail with errLeaseGone, and the
// others are sent again without them.
func (b *batcher) doTokened(op clientv3.Op, size int, writes ...string) (*etcdserverpb.ResponseOp, int64, bool, error) {
	c := &batchCall{op: op, writes: writes, size: size, done: make(chan struct{}), leased: true}
	b.run(c)
	return c.resp, c.rev, c.resent, c.err
}

// run queues c and waits for its batch's outcome.
func (b *batcher) run(c *batchCall) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		c.err = errStorageClosed
		return
	}
	b.pending = append(b.pending, c)
	b.startLocked()
	b.mu.Unlock()
	<-c.done
}

// doAll runs ops in one batch where the limits allow (they are queued
// together, in order; a batch cut by its limits leaves the rest to the
// next), and returns their responses and their batches' revisions in
// order. writes, when not nil, names the keys each op may write (as do's);
// a plain put's own key need not be named.
func (b *batcher) doAll(ops []clientv3.Op, sizes []int, writes ...[]string) ([]*etcdserverpb.ResponseOp, []int64, error) {
	cs := make([]*batchCall, len(ops))
	for i, op := range ops {
		cs[i] = &batchCall{op: op, size: sizes[i], done: make(chan struct{})}
		if i < len(writes) {
			cs[i].writes = append(cs[i].writes, writes[i]...)
		}
		if op.IsPut() {
			cs[i].writes = append(cs[i].writes, string(op.KeyBytes()))
		}
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, nil, errStorageClosed
	}
	b.pending = append(b.pending, cs...)
	b.startLocked()
	b.mu.Unlock()
	out := make([]*etcdserverpb.ResponseOp, len(cs))
	revs := make([]int64, len(cs))
	var errs []error
	for i, c := range cs {
		<-c.done
		out[i], revs[i] = c.resp, c.rev
		errs = append(errs, c.err)
	}
	return out, revs, errors.Join(errs...)
}

// startLocked sends the queue's head as a batch if a slot is free; mu
// held.
func (b *batcher) startLocked() {
	if b.inflight >= b.maxInflight || len(b.pending) == 0 {
		return
	}
	batch := b.takeLocked()
	b.inflight++
	b.wg.Add(1)
	go b.send(batch)
}

// takeLocked removes a batch from the queue: in arrival order, up to the
// limits, leaving behind an operation that writes a key the batch already
// writes (etcd refuses a transaction that writes a key twice, even in two
// nested ones); mu held.
func (b *batcher) takeLocked() []*batchCall {
	var batch []*batchCall
	var rest []*batchCall
	written := make(map[string]bool)
	bytes := 0
	for i, c := range b.pending {
		if len(batch) == b.maxOps || (len(batch) > 0 && bytes+c.size > maxBatchBytes) {
			rest = append(rest, b.pending[i:]...)
			break
		}
		if slices.ContainsFunc(c.writes, func(k string) bool { return written[k] }) {
			rest = append(rest, c)
			continue
		}
		for _, k := range c.writes {
			written[k] = true
		}
		batch = append(batch, c)
		bytes += c.size
	}
	b.pending = rest
	return batch
}

// send commits one batch, retrying across leader changes (every operation
// in a batch may be repeated: puts of the same values, reads), and hands
// each caller its response.
func (b *batcher) send(batch []*batchCall) {
	b.commit(batch)
	b.mu.Lock()
	b.inflight--
	if !b.closed {
		b.startLocked()
	}
	b.mu.Unlock()
	b.wg.Done()
}

// commit sends one batch and hands each caller its response. A batch that
// etcd finds too big (a member run with a lower --max-txn-ops or
// --max-request-bytes than its defaults) is split in two, and later
// batches are kept as small.
func (b *batcher) commit(batch []*batchCall) {
	ops := make([]clientv3.Op, len(batch))
	for i, c := range batch {
		ops[i] = c.op
	}
	ctx, cancel := b.s.opCtx()
	var resp *clientv3.TxnResponse
	sends := 0
	err := b.s.retry(ctx, func(ctx context.Context) (err error) {
		sends++
		resp, err = b.s.cli.Txn(ctx).Then(ops...).Commit()
		return err
	})
	cancel()
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		// Only tokens name leases: the operations without one are not
		// to fail for another's lapse.
		var rest []*batchCall
		for _, c := range batch {
			if c.leased {
				c.err, c.resent = markLeaseGone(err), sends > 1
				close(c.done)
			} else {
				rest = append(rest, c)
			}
		}
		if len(rest) < len(batch) {
			if len(rest) > 0 {
				b.commit(rest)
			}
			return
		}
	}
	if len(batch) > 1 && (errors.Is(err, rpctypes.ErrTooManyOps) || errors.Is(err, rpctypes.ErrRequestTooLarge)) {
		half := len(batch) / 2
		b.mu.Lock()
		b.maxOps = max(1, min(b.maxOps, half))
		b.mu.Unlock()
		b.commit(batch[:half])
		b.commit(batch[half:])
		return
	}
	if err == nil && len(resp.Responses) != len(batch) {
		err = fmt.Errorf("etcd answered a batch of %d with %d responses", len(batch), len(resp.Responses))
	}
	for i, c := range batch {
		c.resent = sends > 1
		if err != nil {
			c.err = err
		} else {
			c.resp, c.rev = resp.Responses[i], resp.Header.Revision
		}
		close(c.done)
	}
}

// close fails what is queued, refuses what comes, and waits for the
// batches in flight, which end with the Storage's context.
func (b *batcher) close() {
	b.mu.Lock()
	b.closed = true
	for _, c := range b.pending {
		c.err = errStorageClosed
		close(c.done)
	}
	b.pending = nil
	b.mu.Unlock()
	b.wg.Wait()
}

var errStorageClosed = errors.New("etcd storage closed")
