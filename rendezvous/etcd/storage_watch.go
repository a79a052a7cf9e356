package etcd

import (
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// How a registration sees writes it races with: it is entered into the
// dispatch tables before its keys are read at revision R, and until R is
// known (armed false) it only records the writes dispatched to it. Then
// writes after R count, whether dispatched before or after it was armed,
// and writes at or before R are already in what the read saw.

// waiter is one Wait registration.
type waiter struct {
	ready   func()
	armed   bool
	rev     int64            // the revision the keys were read at, once armed
	missing map[string]int64 // key → last write dispatched before arming (0: none)
}

// barrier is one Barrier registration.
type barrier struct {
	ready     func()
	armed     bool
	worldSize int64
	reached   bool // the counter reached worldSize before arming
}

type watch struct{ fn func(tcpstore.WatchEvent) }

func (s *Storage) Wait(keys [][]byte, ready func()) (tcpstore.Cancel, bool, error) {
	if err := s.refuseUnwatched("wait", keys...); err != nil {
		return nil, false, err
	}
	w := &waiter{ready: ready, missing: make(map[string]int64, len(keys))}
	s.mu.Lock()
	for _, k := range keys {
		if _, dup := w.missing[string(k)]; dup {
			continue // a key listed twice is one key
		}
		w.missing[string(k)] = 0
		addTo(s.waiters, string(k), w)
	}
	s.mu.Unlock()
	cancel := func() { s.dropWaiter(w) }
	ex, rev, err := s.existence(keys)
	if err != nil {
		cancel()
		return nil, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		if wrote, ok := w.missing[string(k)]; ok && (ex[i] || wrote > rev) {
			s.credit(w, string(k))
		}
	}
	if len(w.missing) == 0 {
		return nil, true, nil
	}
	w.armed, w.rev = true, rev
	return cancel, false, nil
}

// credit counts a write of key for w; mu held.
func (s *Storage) credit(w *waiter, key string) {
	delete(w.missing, key)
	removeFrom(s.waiters, key, w)
}

func (s *Storage) dropWaiter(w *waiter) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range w.missing {
		removeFrom(s.waiters, k, w)
	}
	clear(w.missing)
}

func (s *Storage) Barrier(key []byte, worldSize int64, ready func()) (tcpstore.Cancel, bool, error) {
	if err := s.refuseUnwatched("barrier", key); err != nil {
		return nil, false, err
	}
	b := &barrier{ready: ready, worldSize: worldSize}
	k := string(key)
	s.mu.Lock()
	addTo(s.barriers, k, b)
	s.mu.Unlock()
	cancel := func() {
		s.mu.Lock()
		removeFrom(s.barriers, k, b)
		s.mu.Unlock()
	}
	ch, err := s.update("barrier", key, func(cur []byte, ok bool) (change, error) {
		ch, err := counterChange(cur, ok, 1)
		if err == nil && ch.n < worldSize {
			// Quietly: arrivals must not release plain waiters on key.
			ch.extra = []clientv3.Op{clientv3.OpPut(s.prefix+quietKey, s.kkey(key))}
		}
		return ch, err
	})
	if err != nil {
		cancel()
		return nil, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ch.n >= worldSize || b.reached {
		removeFrom(s.barriers, k, b)
		return nil, true, nil
	}
	b.armed = true
	return cancel, false, nil
}

// Watch registers fn for the changes of key. WATCH_KEY's callbacks need
// each change's old value, which costs etcd a read per event of the
// prefix, so the Storage's own watch does without: the first Watch starts
// a second watch of the prefix, with old values, which then serves every
// registration until Close. Only a store whose clients use WATCH_KEY
// (PyTorch 1.13's callbacks) pays for it.
func (s *Storage) Watch(key []byte, fn func(tcpstore.WatchEvent)) (tcpstore.Cancel, error) {
	if err := s.refuseUnwatched("watch_key", key); err != nil {
		return nil, err
	}
	w := &watch{fn: fn}
	k := string(key)
	s.mu.Lock()
	addTo(s.watches, k, w)
	start := !s.watchingOld
	s.watchingOld = true
	s.mu.Unlock()
	cancel := func() {
		s.mu.Lock()
		removeFrom(s.watches, k, w)
		s.mu.Unlock()
	}
	if start {
		// From the revision read now: every change after this call.
		ctx, done := s.opCtx()
		resp, err := s.get(ctx, s.prefix+quietKey, clientv3.WithCountOnly())
		done()
		if err != nil {
			cancel()
			s.mu.Lock()
			s.watchingOld = false
			s.mu.Unlock()
			return nil, s.fail("watch_key", key, err)
		}
		s.loops.Add(1)
		go s.watchLoop(resp.Header.Revision+1, watchOld)
	}
	return cancel, nil
}

func addTo[T comparable](m map[string]map[T]struct{}, key string, v T) {
	set, ok := m[key]
	if !ok {
		set = make(map[T]struct{})
		m[key] = set
	}
	set[v] = struct{}{}
}

func removeFrom[T comparable](m map[string]map[T]struct{}, key string, v T) {
	if set, ok := m[key]; ok {
		delete(set, v)
		if len(set) == 0 {
			delete(m, key)
		}
	}
}

// The Storage's watches.
type watchKind int

const (
	watchKeys   watchKind = iota // k/ and m/quiet: waits and barriers
	watchQueues                  // q/: queue pops
	watchOld                     // k/ and m/quiet with old values: WATCH_KEY
)

// watchLoop follows the changes of its kind's keys from rev on, until
// Close, and releases this node's waits, barriers or queue pops, or calls
// its WATCH_KEY registrations. A broken watch resumes where it stopped; a
// compacted one rescans what the registrations wait for (changes lost to
// compaction are not reported to WATCH_KEY callbacks).
//
// A barrier arrival's counter and its quiet marker must arrive in one
// response, so one watch covers both: the range from k/ to m/t/, which
// leaves out the tokens (a write with every read-modify-write, of interest
// to nobody) and the unwatched keys.
func (s *Storage) watchLoop(rev int64, kind watchKind) {
	defer s.loops.Done()
	key := s.prefix + keysDir
	opts := []clientv3.OpOption{clientv3.WithRev(rev), clientv3.WithRange(s.prefix + tokenDir)}
	switch kind {
	case watchQueues:
		key, opts[1] = s.prefix+queuesDir, clientv3.WithPrefix()
	case watchOld:
		opts = append(opts, clientv3.WithPrevKV())
	}
	old := kind == watchOld
	for s.ctx.Err() == nil {
		opts[0] = clientv3.WithRev(rev)
		wch := s.cli.Watch(clientv3.WithRequireLeader(s.ctx), key, opts...)
		for resp := range wch {
			if resp.CompactRevision != 0 {
				s.log.Warn("etcd storage: watch compacted; rescanning waiters",
					zap.String("prefix", s.prefix), zap.Int64("from", rev), zap.Int64("compacted", resp.CompactRevision))
				rev = resp.CompactRevision
				if !old {
					s.rescan()
				}
				break
			}
			if err := resp.Err(); err != nil {
				s.log.Warn("etcd storage: watch interrupted; resuming", zap.String("prefix", s.prefix), zap.Error(err))
				break
			}
			s.dispatch(resp.Events, old)
			if n := len(resp.Events); n > 0 {
				rev = resp.Events[n-1].Kv.ModRevision + 1
			}
		}
		select {
		case <-s.ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// dispatch hands a watch response's events, in revision order, to the
// registrations they concern: WATCH_KEY's alone with old.
func (s *Storage) dispatch(evs []*clientv3.Event, old bool) {
	kdir, qdir := s.prefix+keysDir, s.prefix+queuesDir
	if old {
		evs = s.resolveHeads(evs)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := 0; i < len(evs); {
		// One revision's events (one transaction) are handled together:
		// a barrier's quiet marker covers its counter's write.
		rev := evs[i].Kv.ModRevision
		j, quiet := i, ""
		for ; j < len(evs) && evs[j].Kv.ModRevision == rev; j++ {
			if ev := evs[j]; ev.Type == mvccpb.PUT && string(ev.Kv.Key) == s.prefix+quietKey {
				quiet = string(ev.Kv.Value)
			}
		}
		for _, ev := range evs[i:j] {
			full := string(ev.Kv.Key)
			switch {
			case old && strings.HasPrefix(full, kdir) && full != quiet:
				s.watchEvent(ev, full[len(kdir):])
			case old:
			case strings.HasPrefix(full, kdir):
				s.keyEvent(ev, full[len(kdir):], rev, full == quiet)
			case strings.HasPrefix(full, qdir) && ev.Type == mvccpb.PUT:
				s.pushEvent(full[len(qdir):], rev)
			}
		}
		i = j
	}
}

// resolveHeads returns evs with the heads of large values that WATCH_KEY
// registrations will see replaced by the values they stand for: a new
// value read at the event's revision, an old one just before it (its
// chunks go in the same transaction as its head). A change whose value is
// no longer there to read (compacted, and since replaced) is left out and
// logged, as changes lost to compaction are.
func (s *Storage) resolveHeads(evs []*clientv3.Event) []*clientv3.Event {
	kdir := s.prefix + keysDir
	out := evs[:0:0]
	for _, ev := range evs {
		full := string(ev.Kv.Key)
		newHead := ev.Type == mvccpb.PUT && isHeadValue(ev.Kv.Value)
		oldHead := ev.PrevKv != nil && isHeadValue(ev.PrevKv.Value)
		if !strings.HasPrefix(full, kdir) || !newHead && !oldHead || !s.watched(full[len(kdir):]) {
			out = append(out, ev)
			continue
		}
		resolved := *ev
		var err error
		if newHead {
			kv := *ev.Kv
			if kv.Value, err = s.valueAt(full, ev.Kv.Value, ev.Kv.ModRevision); err == nil {
				resolved.Kv = &kv
			}
		}
		if oldHead && err == nil {
			kv := *ev.PrevKv
			if kv.Value, err = s.valueAt(full, ev.PrevKv.Value, ev.Kv.ModRevision-1); err == nil {
				resolved.PrevKv = &kv
			}
		}
		if err != nil {
			s.log.Warn("etcd storage: a change of a large value is not reported to watch_key: its chunks are gone",
				zap.String("key", full), zap.Int64("revision", ev.Kv.ModRevision), zap.Error(err))
			continue
		}
		out = append(out, &resolved)
	}
	return out
}

// isHeadValue reports whether an etcd value is a head.
func isHeadValue(v []byte) bool {
	_, ok := parseHead(v)
	return ok
}

// watched reports whether key has WATCH_KEY registrations.
func (s *Storage) watched(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.watches[key]) > 0
}

// valueAt is the value head stands for at etcd key k, read at rev; or,
// once rev is compacted, read now: a generation's chunks never change.
func (s *Storage) valueAt(k string, head []byte, rev int64) ([]byte, error) {
	ctx, cancel := s.opCtx()
	defer cancel()
	v, err := s.resolve(ctx, k, head, rev)
	if errors.Is(err, errStale) {
		v, err = s.resolve(ctx, k, head, 0)
	}
	return v, err
}

// keyEvent releases what one change of key releases; mu held.
func (s *Storage) keyEvent(ev *clientv3.Event, key string, rev int64, quiet bool) {
	if ev.Type == mvccpb.DELETE {
		return
	}
	if set := s.barriers[key]; len(set) > 0 {
		if n, err := strconv.ParseInt(string(ev.Kv.Value), 10, 64); err == nil {
			for b := range set {
				if n < b.worldSize {
					continue
				}
				if b.armed {
					removeFrom(s.barriers, key, b)
					b.ready()
				} else {
					b.reached = true
				}
			}
		}
	}
	if quiet {
		return
	}
	for w := range s.waiters[key] {
		s.written(w, key, rev)
	}
}

// watchEvent calls the WATCH_KEY registrations of key with one of its
// changes, seen by the watch with old values; mu held.
func (s *Storage) watchEvent(ev *clientv3.Event, key string) {
	if len(s.watches[key]) == 0 {
		return
	}
	we := tcpstore.WatchEvent{Type: tcpstore.KeyUpdated, Key: []byte(key), New: ev.Kv.Value}
	switch {
	case ev.Type == mvccpb.DELETE:
		we = tcpstore.WatchEvent{Type: tcpstore.KeyDeleted, Key: []byte(key)}
		if ev.PrevKv != nil {
			we.Old = ev.PrevKv.Value
		}
	case ev.IsCreate() || ev.PrevKv == nil:
		we.Type = tcpstore.KeyCreated
	default:
		we.Old = ev.PrevKv.Value
	}
	s.notify(we)
}

// written counts a write of key at rev for w; mu held.
func (s *Storage) written(w *waiter, key string, rev int64) bool {
	if !w.armed {
		w.missing[key] = rev
		return true
	}
	if rev <= w.rev {
		return false
	}
	s.credit(w, key)
	if len(w.missing) == 0 {
		w.ready()
	}
	return true
}

// pushEvent releases one waiter on the queue named by element's directory;
// mu held.
func (s *Storage) pushEvent(element string, rev int64) {
	hexName, _, ok := strings.Cut(element, "/")
	if !ok {
		return
	}
	name, err := hexDecode(hexName)
	if err != nil {
		return
	}
	for w := range s.waiters[name] {
		if s.written(w, name, rev) {
			return // one element satisfies one popper
		}
	}
}

func (s *Storage) notify(ev tcpstore.WatchEvent) {
	for w := range s.watches[string(ev.Key)] {
		w.fn(ev)
	}
}

// rescan runs after the watch lost events to compaction: each waiter whose
// key exists now, and each barrier whose counter is reached, is released.
func (s *Storage) rescan() {
	s.mu.Lock()
	var keys [][]byte
	for k := range s.waiters {
		keys = append(keys, []byte(k))
	}
	for k := range s.barriers {
		keys = append(keys, []byte(k))
	}
	s.mu.Unlock()
	if len(keys) == 0 {
		return
	}
	for _, k := range keys {
		v, ok, err := s.Get(k)
		if err != nil {
			return
		}
		ex, rev, err := s.existence([][]byte{k})
		if err != nil {
			return
		}
		if !ex[0] {
			continue
		}
		s.mu.Lock()
		for w := range s.waiters[string(k)] {
			s.written(w, string(k), rev)
		}
		if n, err := strconv.ParseInt(string(v), 10, 64); ok && err == nil {
			for b := range s.barriers[string(k)] {
				if b.armed && n >= b.worldSize {
					removeFrom(s.barriers, string(k), b)
					b.ready()
				}
			}
		}
		s.mu.Unlock()
	}
}

func hexDecode(s string) (string, error) {
	b, err := hex.DecodeString(s)
	return string(b), err
}
