package tcpstore

import (
	"bytes"
	"errors"
	"fmt"
	"sync"

	"github.com/gorunhq/gorun/rendezvous"
)

// MemoryStorage keeps everything in this process, as PyTorch's own server
// does. The zero value is not usable; call NewMemoryStorage.
type MemoryStorage struct {
	mu      sync.Mutex
	kv      map[string]*entry
	queues  map[string]*fifo
	waiters map[string]map[*waiter]struct{}
	// barriers holds Barrier registrations apart from plain waiters: a
	// barrier's own increments must not release them.
	barriers map[string]map[*waiter]struct{}
	watches  map[string][]*watch
	// held counts the bytes of keys and values (queued values and queue
	// names included); max caps it, 0 for no cap.
	held, max int64
}

var _ Storage = (*MemoryStorage)(nil)

// MemoryStorageConfig configures a MemoryStorage. The zero value is
// usable: every field has a documented default.
type MemoryStorageConfig struct {
	// MaxBytes caps the bytes of keys and values the storage holds, queued
	// values and queue names included. A write that would pass it fails
	// with an error wrapping ErrStorageFull and changes nothing; the server
	// answers it by closing that connection, c10d's only refusal. Default
	// 0: no cap, as PyTorch's own server.
	MaxBytes int64
}

// ErrStorageFull: a write would take a MemoryStorage past its MaxBytes.
var ErrStorageFull = errors.New("tcpstore: the store is full")

// NewMemoryStorage returns an empty MemoryStorage with no cap.
func NewMemoryStorage() *MemoryStorage { return NewMemoryStorageConfig(MemoryStorageConfig{}) }

// NewMemoryStorageConfig returns an empty MemoryStorage configured by cfg.
func NewMemoryStorageConfig(cfg MemoryStorageConfig) *MemoryStorage {
	return &MemoryStorage{
		max:      max(cfg.MaxBytes, 0),
		kv:       make(map[string]*entry),
		queues:   make(map[string]*fifo),
		waiters:  make(map[string]map[*waiter]struct{}),
		barriers: make(map[string]map[*waiter]struct{}),
		watches:  make(map[string][]*watch),
	}
}

type entry struct{ val []byte }

type waiter struct {
	remaining int // keys not yet written
	ready     func()
	keys      []string // where it is registered
}

type watch struct{ fn func(WatchEvent) }

// fifo is a queue that reuses its backing array.
type fifo struct {
	items [][]byte
	head  int
}

func (q *fifo) len() int { return len(q.items) - q.head }

func (q *fifo) push(v []byte) { q.items = append(q.items, v) }

func (q *fifo) pop() []byte {
	v := q.items[q.head]
	q.items[q.head] = nil
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	}
	return v
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }

// Bytes returns the bytes of keys and values the storage holds now, what
// MemoryStorageConfig.MaxBytes caps.
func (m *MemoryStorage) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held
}

// room checks that key can hold a value of n bytes (replacing its current
// value) within the cap; mu must be held.
func (m *MemoryStorage) room(key []byte, n int) error {
	if m.max == 0 {
		return nil
	}
	grow := int64(n)
	if e, ok := m.kv[string(key)]; ok {
		grow -= int64(len(e.val))
	} else {
		grow += int64(len(key))
	}
	return m.fits(grow)
}

// fits checks that grow more bytes stay within the cap; mu must be held.
func (m *MemoryStorage) fits(grow int64) error {
	if m.max != 0 && grow > 0 && m.held+grow > m.max {
		return fmt.Errorf("%w: %d more bytes would pass its limit of %d, %d held "+
			"(MemoryStorageConfig.MaxBytes; gorun store serve --max-stored)", ErrStorageFull, grow, m.max, m.held)
	}
	return nil
}

// put writes v (already owned) under key without notifying anyone and
// returns the previous value; mu must be held.
func (m *MemoryStorage) put(key []byte, v []byte) (old []byte, existed bool) {
	if e, ok := m.kv[string(key)]; ok {
		old, e.val = e.val, v
		m.held += int64(len(v) - len(old))
		return old, true
	}
	m.kv[string(key)] = &entry{val: v}
	m.held += int64(len(key) + len(v))
	return nil, false
}

// counter computes key's counter plus delta; mu must be held.
func (m *MemoryStorage) counter(key []byte, delta int64) (int64, []byte, error) {
	e, ok := m.kv[string(key)]
	var old []byte
	if ok {
		old = e.val
	}
	return rendezvous.AddCounter(old, ok, delta)
}

// store writes v (already owned) under key and notifies; mu must be held.
func (m *MemoryStorage) store(key []byte, v []byte) {
	old, ok := m.put(key, v)
	if ws := m.watches[string(key)]; len(ws) > 0 {
		ev := WatchEvent{Type: KeyUpdated, Key: clone(key), Old: old, New: v}
		if !ok {
			ev.Type = KeyCreated
		}
		for _, w := range ws {
			w.fn(ev)
		}
	}
	m.wakeAll(key)
}

// wakeAll counts a write of key against every plain waiter on it; mu held.
func (m *MemoryStorage) wakeAll(key []byte) {
	set, ok := m.waiters[string(key)]
	if !ok {
		return
	}
	delete(m.waiters, string(key))
	for w := range set {
		w.remaining--
		if w.remaining == 0 {
			w.ready()
		}
	}
}

func (m *MemoryStorage) Set(key, value []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.room(key, len(value)); err != nil {
		return err
	}
	m.store(key, clone(value))
	return nil
}

func (m *MemoryStorage) Get(key []byte) ([]byte, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.kv[string(key)]; ok {
		return e.val, true, nil
	}
	return nil, false, nil
}

func (m *MemoryStorage) Add(key []byte, delta int64) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, v, err := m.counter(key, delta)
	if err != nil {
		return 0, err
	}
	if err := m.room(key, len(v)); err != nil {
		return 0, err
	}
	m.store(key, v)
	return n, nil
}

func (m *MemoryStorage) CompareSet(key, expected, desired []byte) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.kv[string(key)]
	switch {
	case !ok && len(expected) != 0:
		// c10d answers with expected itself and stores nothing.
		return clone(expected), nil
	case ok && !bytes.Equal(e.val, expected):
		return e.val, nil
	}
	if err := m.room(key, len(desired)); err != nil {
		return nil, err
	}
	v := clone(desired)
	m.store(key, v)
	return v, nil
}

func (m *MemoryStorage) Append(key, value []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var v []byte
	e, ok := m.kv[string(key)]
	if ok {
		if err := m.room(key, len(e.val)+len(value)); err != nil {
			return err
		}
		v = make([]byte, 0, len(e.val)+len(value))
		v = append(v, e.val...)
	} else if err := m.room(key, len(value)); err != nil {
		return err
	}
	m.store(key, append(v, value...))
	return nil
}

func (m *MemoryStorage) Delete(key []byte) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.kv[string(key)]
	if !ok {
		return false, nil
	}
	delete(m.kv, string(key))
	m.held -= int64(len(key) + len(e.val))
	for _, w := range m.watches[string(key)] {
		w.fn(WatchEvent{Type: KeyDeleted, Key: clone(key), Old: e.val})
	}
	return true, nil
}

// exists is Check's rule for one key; mu must be held.
func (m *MemoryStorage) exists(key []byte) bool {
	if _, ok := m.kv[string(key)]; ok {
		return true
	}
	q, ok := m.queues[string(key)]
	return ok && q.len() > 0
}

func (m *MemoryStorage) Check(keys [][]byte) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range keys {
		if !m.exists(k) {
			return false, nil
		}
	}
	return true, nil
}

func (m *MemoryStorage) NumKeys() (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return int64(len(m.kv)), nil
}

func (m *MemoryStorage) Keys() ([][]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([][]byte, 0, len(m.kv))
	for k := range m.kv {
		out = append(out, []byte(k))
	}
	return out, nil
}

func (m *MemoryStorage) QueuePush(key, value []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	q, ok := m.queues[string(key)]
	grow := int64(len(value))
	if !ok {
		grow += int64(len(key))
	}
	if err := m.fits(grow); err != nil {
		return err
	}
	if !ok {
		q = &fifo{}
		m.queues[string(key)] = q
	}
	q.push(clone(value))
	m.held += grow
	// One element can satisfy one popper: wake a single waiter.
	if set := m.waiters[string(key)]; len(set) > 0 {
		for w := range set {
			delete(set, w)
			if len(set) == 0 {
				delete(m.waiters, string(key))
			}
			w.remaining--
			if w.remaining == 0 {
				w.ready()
			}
			break
		}
	}
	return nil
}

func (m *MemoryStorage) QueuePop(key []byte) ([]byte, int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	q, ok := m.queues[string(key)]
	if !ok || q.len() == 0 {
		return nil, 0, nil
	}
	n := int64(q.len())
	v := q.pop()
	m.held -= int64(len(v))
	if q.len() == 0 {
		delete(m.queues, string(key))
		m.held -= int64(len(key))
	}
	return v, n, nil
}

func (m *MemoryStorage) QueueLen(key []byte) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if q, ok := m.queues[string(key)]; ok {
		return int64(q.len()), nil
	}
	return 0, nil
}

func (m *MemoryStorage) register(reg map[string]map[*waiter]struct{}, key string, w *waiter) {
	set, ok := reg[key]
	if !ok {
		set = make(map[*waiter]struct{})
		reg[key] = set
	}
	set[w] = struct{}{}
	w.keys = append(w.keys, key)
}

func (m *MemoryStorage) cancel(reg map[string]map[*waiter]struct{}, w *waiter) Cancel {
	return func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		for _, k := range w.keys {
			if set, ok := reg[k]; ok {
				delete(set, w)
				if len(set) == 0 {
					delete(reg, k)
				}
			}
		}
		w.keys = nil
	}
}

func (m *MemoryStorage) Wait(keys [][]byte, ready func()) (Cancel, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	missing := false
	for _, k := range keys {
		if !m.exists(k) {
			missing = true
			break
		}
	}
	if !missing {
		return nil, true, nil
	}
	w := &waiter{ready: ready}
	for _, k := range keys {
		if !m.exists(k) {
			if set := m.waiters[string(k)]; set != nil {
				if _, dup := set[w]; dup {
					continue // a key listed twice is one key
				}
			}
			m.register(m.waiters, string(k), w)
			w.remaining++
		}
	}
	return m.cancel(m.waiters, w), false, nil
}

func (m *MemoryStorage) Barrier(key []byte, worldSize int64, ready func()) (Cancel, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, v, err := m.counter(key, 1)
	if err != nil {
		return nil, false, err
	}
	if err := m.room(key, len(v)); err != nil {
		return nil, false, err
	}
	m.put(key, v) // quietly: arrivals must not release earlier arrivals
	if n >= worldSize {
		if set, ok := m.barriers[string(key)]; ok {
			delete(m.barriers, string(key))
			for w := range set {
				w.ready()
			}
		}
		m.wakeAll(key)
		return nil, true, nil
	}
	w := &waiter{ready: ready}
	m.register(m.barriers, string(key), w)
	return m.cancel(m.barriers, w), false, nil
}

func (m *MemoryStorage) Watch(key []byte, fn func(WatchEvent)) (Cancel, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := &watch{fn: fn}
	k := string(key)
	m.watches[k] = append(m.watches[k], w)
	return func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		ws := m.watches[k]
		for i, x := range ws {
			if x == w {
				ws = append(ws[:i], ws[i+1:]...)
				break
			}
		}
		if len(ws) == 0 {
			delete(m.watches, k)
		} else {
			m.watches[k] = ws
		}
	}, nil
}
