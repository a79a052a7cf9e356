package tcpstore

// Storage holds a Server's keys and queues and tells it when waiters can be
// released. The Server owns the protocol (parsing, generations, connections,
// the CANCEL_WAIT rules); a Storage owns the data and the change
// notifications, so a backend whose data lives elsewhere (etcd, with writes
// arriving from other nodes) serves the same protocol.
//
// Slices passed in are borrowed: valid only during the call, so a Storage
// copies what it keeps. Slices returned are the Storage's and are never
// modified afterwards; the Server writes them to sockets without copying.
//
// Callbacks (ready, watch functions) may be called while the Storage holds
// its internal locks, so they must return quickly and must not call back into
// the Storage. Each registration's ready callback is called at most once.
//
// All methods are safe for concurrent use.
type Storage interface {
	// Set stores value under key and wakes waiters on key.
	Set(key, value []byte) error
	// Get returns key's value and whether key exists.
	Get(key []byte) (value []byte, ok bool, err error)
	// Add adds delta to the decimal counter under key (see
	// rendezvous.AddCounter) and wakes waiters on key. A value that is not a
	// counter gives an error wrapping rendezvous.ErrNotInteger.
	Add(key []byte, delta int64) (int64, error)
	// CompareSet implements c10d's four cases (rendezvous.Store.CompareSet)
	// and wakes waiters on key when it stores.
	CompareSet(key, expected, desired []byte) ([]byte, error)
	// Append appends value to key's value, creating it, and wakes waiters.
	Append(key, value []byte) error
	// Delete removes key and reports whether it existed. Waiters are not
	// affected.
	Delete(key []byte) (bool, error)
	// Check reports whether every key exists, where a key also exists if it
	// names a non-empty queue (the libuv backend's rule).
	Check(keys [][]byte) (bool, error)
	// NumKeys counts the keys (queues excluded).
	NumKeys() (int64, error)
	// Keys returns every key (queues excluded).
	Keys() ([][]byte, error)

	// QueuePush appends value to the queue named key and wakes one waiter
	// on key.
	QueuePush(key, value []byte) error
	// QueuePop removes the queue's head. lenBefore is the queue's length
	// before the pop; value is nil when it was 0.
	QueuePop(key []byte) (value []byte, lenBefore int64, err error)
	// QueueLen returns the queue's length (0 for an unknown queue).
	QueueLen(key []byte) (int64, error)

	// Wait reports done when every key exists now (as Check counts).
	// Otherwise it registers ready, to be called once each key missing now
	// has been written (set, added, appended, compare-set, pushed) at least
	// once, and returns a Cancel that withdraws the registration.
	Wait(keys [][]byte, ready func()) (cancel Cancel, done bool, err error)
	// Barrier adds one to the counter under key without waking its
	// waiters. If the counter is now at least worldSize it wakes every
	// waiter on key and reports done; otherwise it registers ready to be
	// called when the counter reaches worldSize.
	Barrier(key []byte, worldSize int64, ready func()) (cancel Cancel, done bool, err error)
	// Watch calls fn for every change of key until cancelled (the old
	// generation's WATCH_KEY).
	Watch(key []byte, fn func(WatchEvent)) (Cancel, error)
}

// Cancel withdraws a Wait, Barrier or Watch registration. It is idempotent
// and harmless after the registration fired.
type Cancel func()

// WatchEventType says what happened to a watched key.
type WatchEventType uint8

const (
	KeyUpdated WatchEventType = WatchEventType(watchKeyUpdated)
	KeyCreated WatchEventType = WatchEventType(watchKeyCreated)
	KeyDeleted WatchEventType = WatchEventType(watchKeyDeleted)
)

// WatchEvent is one change of a watched key. Old is empty for KeyCreated,
// New is empty for KeyDeleted.
type WatchEvent struct {
	Type     WatchEventType
	Key      []byte
	Old, New []byte
}
