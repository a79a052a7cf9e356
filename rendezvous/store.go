// Package rendezvous defines the key-value store that gorun's agents and
// PyTorch's workers bootstrap from, and c10d's PrefixStore key layout.
//
// The Store contract follows c10d's Store (torch/csrc/distributed/c10d/Store.hpp)
// so that a Go program and a PyTorch worker sharing one TCPStore or FileStore
// see the same keys with the same semantics. The backends live in the
// subpackages tcpstore and filestore.
package rendezvous

import (
	"context"
	"errors"
	"io"
	"syscall"
	"time"
)

// DefaultTimeout bounds blocking operations when the caller's context has no
// deadline. It is c10d's default store timeout.
const DefaultTimeout = 300 * time.Second

// Sentinel errors that callers branch on. Backends wrap them with %w and add
// what they know (the keys, the elapsed time, the address).
var (
	// ErrTimeout: a blocking operation (Get, Wait, MultiGet, a blocking
	// QueuePop, Barrier, or connecting) ran out of time. Errors that wrap it
	// also wrap context.DeadlineExceeded when the context's deadline expired.
	ErrTimeout = errors.New("timeout")
	// ErrClosed: the Store was closed by its owner.
	ErrClosed = errors.New("store closed")
	// ErrUnavailable: the store cannot be reached or the connection to it
	// broke mid-operation.
	ErrUnavailable = errors.New("store unavailable")
	// ErrNotSupported: the backend or wire generation has no such operation
	// (queues on a FileStore or on a PyTorch 1.13 server, for instance).
	ErrNotSupported = errors.New("operation not supported by this store")
	// ErrQueueEmpty: a non-blocking QueuePop found the queue empty.
	ErrQueueEmpty = errors.New("queue is empty")
	// ErrNotInteger: Add found a value that is not a decimal integer, or the
	// sum overflowed int64. (A c10d TCPStore server answers this by closing
	// the connection; the FileStore raises.)
	ErrNotInteger = errors.New("value is not a decimal int64")
	// ErrTooLarge: a key or value over what the store can hold in one
	// operation (an etcd-backed store's request limit).
	ErrTooLarge = errors.New("key or value too large for this store")
	// ErrInvalidArgument: the request itself is malformed (MultiSet with
	// mismatched lengths, a non-positive barrier size, …).
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrOutcomeUnknown: a write's answer was lost and the store cannot
	// tell whether it was applied (etcd Storage: a CompareSet sent again
	// after the lease of the token that would tell had ended). Errors that
	// wrap it also wrap ErrUnavailable; a caller that can read the key
	// back finds out.
	ErrOutcomeUnknown = errors.New("whether the write was applied is unknown")
)

// SlowStore reports whether err, which ended a Store operation (or one of
// the dynamic rendezvous), says the store is slow rather than gone: it
// ran out of time, on its connection or reconnecting, and nothing refused,
// reset or hung up the connection. A swamped host, or one that hangs,
// times out; one whose process died refuses, or, behind a proxy that still
// accepts, hangs up (a TCPStore client's reconnecting keeps the last
// attempt's failure in its error). A closed store or handle is not slow. What
// waits out a slow store (the rendezvous, the survivors' agreement) asks
// this, so that all of it tells the two apart alike.
func SlowStore(err error) bool {
	switch {
	case errors.Is(err, ErrClosed), errors.Is(err, ErrRendezvousClosed), errors.Is(err, errHandleClosed),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return false
	}
	return errors.Is(err, ErrTimeout) || errors.Is(err, context.DeadlineExceeded)
}

// Store is c10d's key-value store.
//
// Keys are arbitrary byte strings; values are raw bytes. Blocking operations
// (Get, Wait, MultiGet, QueuePop with block, Barrier) wait until ctx is done;
// when ctx carries no deadline the store's own timeout (DefaultTimeout unless
// configured) bounds them, as c10d's store timeout does. A blocking
// operation that runs out of time returns an error wrapping ErrTimeout.
//
// Counters (Add, Barrier) are stored as ASCII decimal, so Get of a counter
// returns e.g. "42", exactly as c10d does.
//
// A Store is safe for concurrent use.
type Store interface {
	// Set stores value under key, replacing any previous value, and wakes
	// every waiter on key.
	Set(ctx context.Context, key string, value []byte) error
	// Get returns the value of key, waiting for the key to exist.
	Get(ctx context.Context, key string) ([]byte, error)
	// Add adds delta to the decimal counter under key (absent counts as 0)
	// and returns the new value. Add(key, 0) is an atomic read.
	Add(ctx context.Context, key string, delta int64) (int64, error)
	// CompareSet stores desired if the current value equals expected, where
	// an absent key equals an empty expected. It returns desired when it
	// stored it, the current value when it did not, and — c10d's quirk —
	// expected itself when the key is absent and expected is not empty.
	CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error)
	// Wait blocks until every key exists.
	Wait(ctx context.Context, keys ...string) error
	// Check reports whether every key exists, without waiting.
	Check(ctx context.Context, keys ...string) (bool, error)
	// Delete removes key and reports whether it existed. Waiters are not
	// affected.
	Delete(ctx context.Context, key string) (bool, error)
	// NumKeys counts the keys in the whole store, internal bookkeeping keys
	// (c10d's "init/", "cleanup/", "refcount/") included, as c10d does.
	NumKeys(ctx context.Context) (int64, error)
	// Append appends value to key's value, creating the key if absent.
	Append(ctx context.Context, key string, value []byte) error
	// MultiGet returns the values of keys in order, waiting for all of them.
	MultiGet(ctx context.Context, keys ...string) ([][]byte, error)
	// MultiSet sets keys[i] to values[i] for every i, in order.
	MultiSet(ctx context.Context, keys []string, values [][]byte) error
	// ListKeys returns the store's user keys, in no particular order.
	ListKeys(ctx context.Context) ([]string, error)
	// QueuePush appends value to the FIFO queue named key. Queues live in
	// their own namespace, apart from the keys.
	QueuePush(ctx context.Context, key string, value []byte) error
	// QueuePop removes and returns the head of the queue named key. With
	// block it waits for an element; without, an empty queue gives
	// ErrQueueEmpty.
	QueuePop(ctx context.Context, key string, block bool) ([]byte, error)
	// QueueLen returns the number of elements in the queue named key.
	QueueLen(ctx context.Context, key string) (int64, error)
	// Barrier increments the counter under key and blocks until it reaches
	// worldSize. The counter keeps its value afterwards, so a later Barrier
	// on the same key returns at once.
	Barrier(ctx context.Context, key string, worldSize int64) error
	// Close releases the store's resources (connections, files). It does
	// not delete shared state unless the backend's cleanup rules say so.
	Close() error
}

// WithDefaultTimeout returns ctx bounded by d when ctx has no deadline of its
// own. Backends use it to apply their configured store timeout.
func WithDefaultTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || d <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}

// BatchPopper is a Store that can take several elements off a queue at
// once, where one QueuePop per element would cost a round trip each (etcd).
type BatchPopper interface {
	// QueuePopBatch removes and returns up to max elements from the head
	// of the queue named key, in order, without blocking: none when the
	// queue is empty. An error wrapping ErrNotSupported says that this
	// Store cannot after all (a wrapper whose inner Store cannot).
	QueuePopBatch(ctx context.Context, key string, max int) ([][]byte, error)
}

// Peeker is a Store that can read keys without waiting for them and
// without a request that could write: on etcd a compare-set is a
// transaction that goes through Raft (and its WAL) even when its
// comparison fails, where a plain read costs a read index. The dynamic
// rendezvous reads what it never waits on (its marker, shares and folder
// lock) this way where it can, and by a compare-set that creates an
// absent key otherwise.
type Peeker interface {
	// Peek returns the values of keys in order, nil for an absent key,
	// without waiting; a present key's value is never nil. An error
	// wrapping ErrNotSupported says that this Store cannot after all (a
	// wrapper whose inner Store cannot).
	Peek(ctx context.Context, keys ...string) ([][]byte, error)
}

// PushPeeker is a Peeker that can push onto a queue and look at a key,
// creating it when absent, in one request: on etcd one transaction, whose
// read goes with its write, where a Peek after the push would be a
// read-only transaction of its own (etcd 3.4 copies its backend's buffer
// of recent writes for each one: with a crowd's pushes arriving, that copy
// is most of what a read costs it), and a compare-set creating the key a
// Raft proposal of its own. The dynamic rendezvous pushes a join with a
// look at the folder lock, which it takes when nobody has yet.
type PushPeeker interface {
	// QueuePushPeek pushes value onto the queue named key, as QueuePush
	// does, and returns look's value read at or after the push (nil:
	// absent), as Peek does; with create not nil, it creates look with
	// create if look is absent then, and returns create. An error
	// wrapping ErrNotSupported says that this Store cannot after all (a
	// wrapper whose inner Store cannot): nothing was pushed.
	QueuePushPeek(ctx context.Context, key string, value []byte, look string, create []byte) ([]byte, error)
}

// CreateOnce creates key with value v unless it exists, and returns what
// key holds then: a create-only compare-set of a constant, safe to send
// again whatever became of an earlier sending, so one whose outcome the
// store cannot tell (ErrOutcomeUnknown) is sent again, a moment later,
// until it is told or ctx ends. Sending it once more only was not enough:
// at 512 agents on etcd, three agents whose leases lapsed in the crowd's
// start lost the answer twice and ended, and the round never completed.
//
// Where the store peeks (Peeker), a key that exists is read, not
// compare-set: on etcd a compare-set is a transaction logged through Raft
// whatever its outcome, a proposal each agent of a crowd made for a key
// the first agent had created (the job's restart counter, the rendezvous
// state), and a crowd's proposals are what kept etcd's apply behind at
// 1,024 agents. An absent key, or one a SealedStore refuses (which reads
// as absent), goes to the compare-set, which creates it or says why not.
func CreateOnce(ctx context.Context, s Store, key string, v []byte) ([]byte, error) {
	if p, ok := s.(Peeker); ok {
		if vs, err := p.Peek(ctx, key); err == nil && len(vs) == 1 && vs[0] != nil {
			return vs[0], nil
		}
		// Absent, refused, or the peek failed (ErrNotSupported, a slow
		// store): the compare-set decides, as it did before peeking.
	}
	pause := 10 * time.Millisecond
	for {
		b, err := s.CompareSet(ctx, key, nil, v)
		if !errors.Is(err, ErrOutcomeUnknown) || ctx.Err() != nil {
			return b, err
		}
		select {
		case <-ctx.Done():
			return b, err
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
}
