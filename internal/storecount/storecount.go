// Package storecount wraps a rendezvous.Store to count the requests made
// through it and the bytes they carry, as a benchmark or a test of the
// rendezvous's cost per agent needs. Bytes are counted at the Store's API
// (keys and values sent, values received), not on the wire: the same
// measure for every backend.
package storecount

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/gorunhq/gorun/rendezvous"
)

// Counts are totals; the zero value is ready. Several Stores may share one.
type Counts struct {
	Requests atomic.Int64
	Sent     atomic.Int64 // key and value bytes of requests
	Received atomic.Int64 // value bytes of replies
	Writes   atomic.Int64 // requests that may change the store
	Written  atomic.Int64 // key and value bytes of those

	// Detail, set before the first request, also tallies the requests by
	// operation and key (Breakdown), where a benchmark needs to say which
	// requests a cost is made of.
	Detail bool
	byKind sync.Map // Kind -> *Tally
}

// Kind names a class of requests: an operation and its key with every
// run of digits read as "#" (a wake-up number, a bucket, a round).
type Kind struct{ Op, Key string }

// Tally is what the requests of one Kind cost.
type Tally struct {
	Requests, Sent, Received atomic.Int64
}

// Breakdown returns the tallies so far by Kind (empty unless Detail).
func (c *Counts) Breakdown() map[Kind]*Tally {
	out := map[Kind]*Tally{}
	c.byKind.Range(func(k, v any) bool {
		out[k.(Kind)] = v.(*Tally)
		return true
	})
	return out
}

// keyClass is key with its runs of digits replaced by "#".
func keyClass(key string) string {
	var b strings.Builder
	digits := false
	for _, r := range key {
		if r >= '0' && r <= '9' {
			if !digits {
				b.WriteByte('#')
			}
			digits = true
			continue
		}
		digits = false
		b.WriteRune(r)
	}
	return b.String()
}

// Store is a rendezvous.Store that counts every call into C.
type Store struct {
	rendezvous.Store
	C *Counts
}

var (
	_ rendezvous.Store       = (*Store)(nil)
	_ rendezvous.BatchPopper = (*Store)(nil)
	_ rendezvous.Peeker      = (*Store)(nil)
	_ rendezvous.PushPeeker  = (*Store)(nil)
)

// New wraps s, counting into c.
func New(s rendezvous.Store, c *Counts) *Store { return &Store{Store: s, C: c} }

// req counts a request of op on key (the first of several) carrying sent
// bytes, and returns the tally its reply's bytes go to (nil: none kept).
func (s *Store) req(op, key string, sent int, write bool) *Tally {
	s.C.Requests.Add(1)
	s.C.Sent.Add(int64(sent))
	if write {
		s.C.Writes.Add(1)
		s.C.Written.Add(int64(sent))
	}
	if !s.C.Detail {
		return nil
	}
	k := Kind{Op: op, Key: keyClass(key)}
	v, ok := s.C.byKind.Load(k)
	if !ok {
		v, _ = s.C.byKind.LoadOrStore(k, new(Tally))
	}
	t := v.(*Tally)
	t.Requests.Add(1)
	t.Sent.Add(int64(sent))
	return t
}

// recv counts n bytes received for a request tallied in t.
func (s *Store) recv(t *Tally, n int) {
	s.C.Received.Add(int64(n))
	if t != nil {
		t.Received.Add(int64(n))
	}
}

func first(keys []string) string {
	if len(keys) == 0 {
		return ""
	}
	return keys[0]
}

func keysLen(keys []string) int {
	n := 0
	for _, k := range keys {
		n += len(k)
	}
	return n
}

func (s *Store) Set(ctx context.Context, key string, value []byte) error {
	s.req("set", key, len(key)+len(value), true)
	return s.Store.Set(ctx, key, value)
}

func (s *Store) Get(ctx context.Context, key string) ([]byte, error) {
	t := s.req("get", key, len(key), false)
	v, err := s.Store.Get(ctx, key)
	s.recv(t, len(v))
	return v, err
}

func (s *Store) Add(ctx context.Context, key string, delta int64) (int64, error) {
	t := s.req("add", key, len(key)+8, delta != 0)
	v, err := s.Store.Add(ctx, key, delta)
	s.recv(t, 8)
	return v, err
}

func (s *Store) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	t := s.req("compare_set", key, len(key)+len(expected)+len(desired), true)
	v, err := s.Store.CompareSet(ctx, key, expected, desired)
	s.recv(t, len(v))
	return v, err
}

func (s *Store) Wait(ctx context.Context, keys ...string) error {
	s.req("wait", first(keys), keysLen(keys), false)
	return s.Store.Wait(ctx, keys...)
}

func (s *Store) Check(ctx context.Context, keys ...string) (bool, error) {
	s.req("check", first(keys), keysLen(keys), false)
	return s.Store.Check(ctx, keys...)
}

func (s *Store) Delete(ctx context.Context, key string) (bool, error) {
	s.req("delete", key, len(key), true)
	return s.Store.Delete(ctx, key)
}

func (s *Store) NumKeys(ctx context.Context) (int64, error) {
	s.req("num_keys", "", 0, false)
	return s.Store.NumKeys(ctx)
}

func (s *Store) Append(ctx context.Context, key string, value []byte) error {
	s.req("append", key, len(key)+len(value), true)
	return s.Store.Append(ctx, key, value)
}

func (s *Store) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	t := s.req("multi_get", first(keys), keysLen(keys), false)
	vs, err := s.Store.MultiGet(ctx, keys...)
	for _, v := range vs {
		s.recv(t, len(v))
	}
	return vs, err
}

func (s *Store) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	n := keysLen(keys)
	for _, v := range values {
		n += len(v)
	}
	s.req("multi_set", first(keys), n, true)
	return s.Store.MultiSet(ctx, keys, values)
}

func (s *Store) ListKeys(ctx context.Context) ([]string, error) {
	t := s.req("list_keys", "", 0, false)
	ks, err := s.Store.ListKeys(ctx)
	s.recv(t, keysLen(ks))
	return ks, err
}

func (s *Store) QueuePush(ctx context.Context, key string, value []byte) error {
	s.req("queue_push", key, len(key)+len(value), true)
	return s.Store.QueuePush(ctx, key, value)
}

func (s *Store) QueuePop(ctx context.Context, key string, block bool) ([]byte, error) {
	t := s.req("queue_pop", key, len(key), true)
	v, err := s.Store.QueuePop(ctx, key, block)
	s.recv(t, len(v))
	return v, err
}

func (s *Store) QueueLen(ctx context.Context, key string) (int64, error) {
	t := s.req("queue_len", key, len(key), false)
	n, err := s.Store.QueueLen(ctx, key)
	s.recv(t, 8)
	return n, err
}

func (s *Store) Barrier(ctx context.Context, key string, worldSize int64) error {
	s.req("barrier", key, len(key)+8, true)
	return s.Store.Barrier(ctx, key, worldSize)
}

// QueuePopBatch forwards to the inner Store's, or says it has none.
func (s *Store) QueuePopBatch(ctx context.Context, key string, max int) ([][]byte, error) {
	bp, ok := s.Store.(rendezvous.BatchPopper)
	if !ok {
		return nil, rendezvous.ErrNotSupported
	}
	t := s.req("queue_pop_batch", key, len(key)+8, true)
	vs, err := bp.QueuePopBatch(ctx, key, max)
	for _, v := range vs {
		s.recv(t, len(v))
	}
	return vs, err
}

// Peek forwards to the inner Store's, or says it has none.
func (s *Store) Peek(ctx context.Context, keys ...string) ([][]byte, error) {
	p, ok := s.Store.(rendezvous.Peeker)
	if !ok {
		return nil, rendezvous.ErrNotSupported
	}
	t := s.req("peek", first(keys), keysLen(keys), false)
	vs, err := p.Peek(ctx, keys...)
	for _, v := range vs {
		s.recv(t, len(v))
	}
	return vs, err
}

// QueuePushPeek forwards to the inner Store's, or says it has none: one
// request, a push with the key it looks at and the value it may create.
// Written are the push's bytes, and create's only when it created the key
// (its answer is create, a value nobody else writes).
func (s *Store) QueuePushPeek(ctx context.Context, key string, value []byte, look string, create []byte) ([]byte, error) {
	p, ok := s.Store.(rendezvous.PushPeeker)
	if !ok {
		return nil, rendezvous.ErrNotSupported
	}
	t := s.req("queue_push", key, len(key)+len(value), true)
	extra := int64(len(look) + len(create))
	s.C.Sent.Add(extra)
	if t != nil {
		t.Sent.Add(extra)
	}
	v, err := p.QueuePushPeek(ctx, key, value, look, create)
	if err == nil && create != nil && bytes.Equal(v, create) {
		s.C.Written.Add(int64(len(look) + len(create)))
	}
	s.recv(t, len(v))
	return v, err
}
