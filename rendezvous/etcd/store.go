package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Store is a rendezvous.Store on a Storage: what an agent uses directly
// (the dynamic rendezvous's state, its wake keys) where workers use a
// tcpstore server. Every blocking operation waits through the Storage's
// watch, never by polling; CompareSet is a transaction fenced on the key's
// mod_revision.
type Store struct {
	st      *Storage
	timeout time.Duration

	closeOnce sync.Once
}

var (
	_ rendezvous.Store       = (*Store)(nil)
	_ rendezvous.BatchPopper = (*Store)(nil)
	_ rendezvous.Peeker      = (*Store)(nil)
	_ rendezvous.PushPeeker  = (*Store)(nil)
)

// NewStore returns a Store on st; blocking operations whose context has no
// deadline are bounded by timeout (rendezvous.DefaultTimeout if 0). Close
// closes st.
func NewStore(st *Storage, timeout time.Duration) *Store {
	if timeout <= 0 {
		timeout = rendezvous.DefaultTimeout
	}
	return &Store{st: st, timeout: timeout}
}

// Storage returns the Storage under s.
func (s *Store) Storage() *Storage { return s.st }

func (s *Store) Set(_ context.Context, key string, value []byte) error {
	return s.st.Set([]byte(key), value)
}

func (s *Store) Get(ctx context.Context, key string) ([]byte, error) {
	for {
		if err := s.Wait(ctx, key); err != nil {
			return nil, err
		}
		v, ok, err := s.st.Get([]byte(key))
		if err != nil || ok {
			return v, err
		}
		// Deleted between the wait and the read: wait again.
	}
}

// Peek reads keys without waiting, watched or not (rendezvous.Peeker):
// plain etcd reads, queued together so that they leave in one read-only
// transaction, which a member serves from a read index without a Raft
// proposal; the compare-set a Store would otherwise read an unwatched key
// with is a transaction logged in the WAL whatever its outcome.
func (s *Store) Peek(_ context.Context, keys ...string) ([][]byte, error) {
	ops := make([]clientv3.Op, len(keys))
	sizes := make([]int, len(keys))
	for i, k := range keys {
		ops[i], sizes[i] = clientv3.OpGet(s.st.kkey([]byte(k))), len(k)
	}
	resps, _, err := s.st.batch.doAll(ops, sizes)
	if err != nil {
		return nil, s.st.fail("peek", []byte(keys[0]), err)
	}
	return s.peeked(keys, resps)
}

// QueuePushPeek pushes value onto the queue named key and looks at look
// in the same batch (rendezvous.PushPeeker): one transaction, the look
// part of the write's, where a Peek after the push is a read-only
// transaction of its own. With create, the look is a transaction nested
// in the batch that creates look when it is absent (its version 0) and
// reads it otherwise; a batch sent again finds it created, with create. A
// large value (in chunks) is neither looked at so nor created: a Peek
// follows the push.
func (s *Store) QueuePushPeek(ctx context.Context, key string, value []byte, look string, create []byte) ([]byte, error) {
	if chunked(create) {
		return nil, fmt.Errorf("%w: create a value of %d bytes with a push", rendezvous.ErrInvalidArgument, len(create))
	}
	el, lk := s.st.element([]byte(key)), s.st.kkey([]byte(look))
	get := clientv3.OpGet(lk)
	op := get
	if create != nil {
		op = clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Version(lk), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(lk, string(create))}, []clientv3.Op{get})
	}
	// A retry puts the same element again: never a duplicate.
	resps, revs, err := s.st.batch.doAll([]clientv3.Op{clientv3.OpPut(el, string(value)), op},
		[]int{len(el) + len(value), len(lk) + len(create)}, nil, []string{lk})
	if err != nil {
		return nil, s.st.fail("queue_push", []byte(key), err)
	}
	if revs[1] < revs[0] {
		return nil, s.st.fail("queue_push", []byte(key), fmt.Errorf("a look at revision %d before its push at %d", revs[1], revs[0]))
	}
	r := resps[1]
	if create != nil {
		tx := r.GetResponseTxn()
		if tx.Succeeded {
			return create, nil
		}
		r = tx.Responses[0]
	}
	vs, err := s.peeked([]string{look}, []*etcdserverpb.ResponseOp{r})
	if err != nil {
		return nil, err
	}
	return vs[0], nil
}

// peeked is the values of keys in their reads' responses, a large value
// read whole (Peek).
func (s *Store) peeked(keys []string, resps []*etcdserverpb.ResponseOp) ([][]byte, error) {
	out := make([][]byte, len(keys))
	for i, r := range resps {
		kvs := r.GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			continue
		}
		out[i] = kvs[0].Value
		if out[i] == nil {
			out[i] = []byte{}
		}
		if _, chunked := parseHead(out[i]); chunked {
			// A large value (a rendezvous state of thousands of nodes)
			// is a head naming its chunks: read it whole.
			v, ok, err := s.st.Get([]byte(keys[i]))
			if err != nil {
				return nil, err
			}
			if out[i] = nil; ok {
				out[i] = v
			}
		}
	}
	return out, nil
}

func (s *Store) Add(_ context.Context, key string, delta int64) (int64, error) {
	return s.st.Add([]byte(key), delta)
}

func (s *Store) CompareSet(_ context.Context, key string, expected, desired []byte) ([]byte, error) {
	return s.st.CompareSet([]byte(key), expected, desired)
}

// block waits for a registration made by register to fire, or for ctx
// (bounded by the store's timeout) to end.
func (s *Store) block(ctx context.Context, what string, register func(ready func()) (tcpstore.Cancel, bool, error)) error {
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, s.timeout)
	defer cancel()
	fired := make(chan struct{})
	var once sync.Once
	stop, done, err := register(func() { once.Do(func() { close(fired) }) })
	if err != nil || done {
		return err
	}
	defer stop()
	start := time.Now()
	select {
	case <-fired:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("etcd store: %s: %w after %v (%w)", what, rendezvous.ErrTimeout,
			time.Since(start).Round(time.Millisecond), ctx.Err())
	}
}

func (s *Store) Wait(ctx context.Context, keys ...string) error {
	bs := make([][]byte, len(keys))
	for i, k := range keys {
		bs[i] = []byte(k)
	}
	return s.block(ctx, fmt.Sprintf("wait %q", keys), func(ready func()) (tcpstore.Cancel, bool, error) {
		return s.st.Wait(bs, ready)
	})
}

func (s *Store) Check(_ context.Context, keys ...string) (bool, error) {
	bs := make([][]byte, len(keys))
	for i, k := range keys {
		bs[i] = []byte(k)
	}
	return s.st.Check(bs)
}

func (s *Store) Delete(_ context.Context, key string) (bool, error) {
	return s.st.Delete([]byte(key))
}

func (s *Store) NumKeys(context.Context) (int64, error) { return s.st.NumKeys() }

func (s *Store) Append(_ context.Context, key string, value []byte) error {
	return s.st.Append([]byte(key), value)
}

func (s *Store) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	out := make([][]byte, len(keys))
	for i, k := range keys {
		v, err := s.Get(ctx, k)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

func (s *Store) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	if len(keys) != len(values) {
		return fmt.Errorf("%w: multi_set of %d keys and %d values", rendezvous.ErrInvalidArgument, len(keys), len(values))
	}
	// Distinct keys go out together, so that the batcher sends them in a
	// few transactions rather than one round trip each (the rendezvous
	// publishes its shares so: dozens of keys per batch); a key set twice
	// keeps its order.
	seen := make(map[string]bool, len(keys))
	for _, k := range keys {
		if seen[k] {
			for i, k := range keys {
				if err := s.Set(ctx, k, values[i]); err != nil {
					return err
				}
			}
			return nil
		}
		seen[k] = true
	}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() { errs[i] = s.Set(ctx, k, values[i]) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (s *Store) ListKeys(context.Context) ([]string, error) {
	ks, err := s.st.Keys()
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = string(k)
	}
	return out, err
}

func (s *Store) QueuePush(_ context.Context, key string, value []byte) error {
	return s.st.QueuePush([]byte(key), value)
}

func (s *Store) QueuePop(ctx context.Context, key string, block bool) ([]byte, error) {
	for {
		v, n, err := s.st.QueuePop([]byte(key))
		switch {
		case err != nil:
			return nil, err
		case n > 0:
			return v, nil
		case !block:
			return nil, fmt.Errorf("%w: %s", rendezvous.ErrQueueEmpty, key)
		}
		if err := s.Wait(ctx, key); err != nil {
			return nil, err
		}
	}
}

// QueuePopBatch takes up to max elements off the head of a queue without
// blocking, in two etcd requests (rendezvous.BatchPopper).
func (s *Store) QueuePopBatch(_ context.Context, key string, max int) ([][]byte, error) {
	return s.st.QueuePopBatch([]byte(key), max)
}

func (s *Store) QueueLen(_ context.Context, key string) (int64, error) {
	return s.st.QueueLen([]byte(key))
}

func (s *Store) Barrier(ctx context.Context, key string, worldSize int64) error {
	if worldSize <= 0 {
		return fmt.Errorf("%w: barrier of %d", rendezvous.ErrInvalidArgument, worldSize)
	}
	return s.block(ctx, fmt.Sprintf("barrier %q", key), func(ready func()) (tcpstore.Cancel, bool, error) {
		return s.st.Barrier([]byte(key), worldSize, ready)
	})
}

// Close closes the Storage under s (its watch); the data stays in etcd.
func (s *Store) Close() error {
	var err error
	s.closeOnce.Do(func() { err = s.st.Close() })
	return err
}
