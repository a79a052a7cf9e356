package rendezvous

// Sealed records: a Store decorator that authenticates what the agents of
// a job write for one another (the dynamic rendezvous's state, requests,
// folder lock, marker, shares and members; the launcher's records beside
// them) under a key only the job's agents hold. It wraps any Store, so
// that the rendezvous algorithm (dynamic*.go) never sees a MAC: it reads
// genuine records, or records that look absent.
//
// A sealed value is the payload behind a one-line header:
//
//	GRS1 <seq> <check> <mac>\n<payload>
//
// seq is the writer's sequence number (decimal), check the writer's public
// key check (SealConfig.Check, hex), mac 64 lowercase hex digits of
// HMAC-SHA256(key, "gorun/rendezvous/v1\x00" + scope + "\x00" + key name +
// "\x00" + seq + "\x00" + check + "\x00" + payload). The MAC binds a record
// to its job (scope: the run id), to its key (a genuine record copied to
// another key is refused) and to its sequence number, which readers use to
// refuse a genuine record older than one they have read (replay).
//
// Sequence numbers are a Lamport clock floored by the wall clock: a writer
// numbers each write above every number it has read or written, and above
// its clock's nanoseconds, so a fresh process starts above what an older
// run wrote. A compare-set numbers its value above the value it replaces,
// so a chain of compare-sets (the state, the folder lock) numbers strictly
// upwards whatever the clocks say.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ErrSealedRecord: a store without a key read a record sealed under one
// (NewSealDetector): an agent of the job holds a job secret this one does
// not.
var ErrSealedRecord = errors.New("record sealed under a job secret")

// RefusalReason says why a sealed store refused a record.
type RefusalReason string

const (
	// RefusedUnsealed: the record carries no seal: written without the
	// job secret (by an agent that has none, or anyone else).
	RefusedUnsealed RefusalReason = "not sealed"
	// RefusedMalformed: the record starts like a sealed one, but its
	// header is out of shape.
	RefusedMalformed RefusalReason = "malformed seal"
	// RefusedOtherKey: the record is sealed under another key than this
	// store's (its check differs): an agent with another job secret, or a
	// forgery that claims so.
	RefusedOtherKey RefusalReason = "sealed under another job secret"
	// RefusedBadMAC: the record names this store's key check, and its MAC
	// does not match the record at this key in this scope: forged,
	// tampered with, or copied from another key or another run.
	RefusedBadMAC RefusalReason = "bad MAC"
	// RefusedReplayed: a genuine record older than one this store has
	// already read at the same key: an old record written back.
	RefusedReplayed RefusalReason = "replayed (older than one already read)"
)

// Refusal is a record a sealed store refused.
type Refusal struct {
	// Key is the record's key in the wrapped store (a queue's name for an
	// element of a queue).
	Key    string
	Reason RefusalReason
	// Check is the key check the record claims (its header's), "" when
	// it has none.
	Check string
}

func (r Refusal) String() string {
	return fmt.Sprintf("%s: %s", r.Key, r.Reason)
}

// SealConfig configures NewSealedStore.
type SealConfig struct {
	// Key is the MAC key: derived from the job secret for this use alone,
	// never the secret itself. Required.
	Key []byte
	// Scope binds every record to one job (its run id): a record of
	// another job that shares the secret is refused.
	Scope string
	// Check is public evidence of Key (a few bytes derived from it, hex),
	// carried in each header so that a refusal can tell "another secret"
	// from a forgery under this one. It must not let anyone compute Key.
	Check string
	// Sealed reports whether key holds sealed records; the others pass
	// through untouched (counters: Add cannot carry a MAC). nil: every key.
	Sealed func(key string) bool
	// Fresh reports whether a reader refuses a record of key older than
	// one it has read (RefusedReplayed). Keys that several writers Set
	// without reading first must not be fresh: their sequence numbers
	// follow the writers' clocks, not the order of the writes. nil: every
	// sealed key. Elements of queues are never checked for freshness.
	Fresh func(key string) bool
	// OnRefused, if not nil, is called once for each distinct refused
	// record (key and content), from the goroutine that read it: it must
	// be safe for concurrent use and not block (log and count).
	OnRefused func(Refusal)
	// Now is the wall clock that floors sequence numbers. Default
	// time.Now.
	Now func() time.Time
}

// SealedStore is a Store whose records under SealConfig.Sealed keys are
// sealed when written and verified when read. A record that fails is
// reported (OnRefused) and then treated as absent: Get and MultiGet wait
// for a genuine one, Check reports the key absent, QueuePop skips it, and
// CompareSet replaces it (with the newest genuine record this store has
// read at that key, else as if the key were absent), so the job neither
// acts on a forged record nor stalls on it.
//
// What it does not authenticate: a key's presence (Wait), deletions, the
// counters (Add, Barrier, and keys Sealed leaves out), NumKeys, ListKeys
// and QueueLen.
type SealedStore struct {
	inner Store
	cfg   SealConfig
	mac   []byte // the MAC key
	clock atomic.Uint64

	mu      sync.Mutex
	latest  map[string]sealedEntry // newest genuine record read or written, per key
	backoff map[string]int         // consecutive refusals per key
	seen    map[[sha256.Size]byte]bool
	refused atomic.Int64
}

// sealedEntry is a genuine record: as stored, its payload, its number.
type sealedEntry struct {
	sealed, plain []byte
	seq           uint64
}

var (
	_ Store       = (*SealedStore)(nil)
	_ BatchPopper = (*SealedStore)(nil)
)

const (
	sealMagic  = "GRS1 "
	sealDomain = "gorun/rendezvous/v1\x00"
	// maxRemembered bounds the per-key maps and the refusals remembered:
	// an attacker's flood of keys clears them rather than grows them.
	maxRemembered = 4096
	// refusedPause is the first pause after a refused record at a key,
	// doubled for each consecutive refusal there up to refusedPauseMax:
	// what a forger writing as fast as it can costs the job.
	refusedPause    = 10 * time.Millisecond
	refusedPauseMax = time.Second
)

// probeValue is what a probe compare-sets: a value no sealed store
// writes, so that the compare never matches and the probe never writes
// (c10d returns the current value, or the expected one when the key is
// absent).
var probeValue = []byte("\x00gorun: probe, never stored\x00")

// NewSealedStore wraps inner. The SealedStore does not own inner beyond
// Close, which it passes on.
func NewSealedStore(inner Store, cfg SealConfig) (*SealedStore, error) {
	if len(cfg.Key) == 0 {
		return nil, fmt.Errorf("%w: sealed store: empty key", ErrInvalidArgument)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &SealedStore{inner: inner, cfg: cfg, mac: bytes.Clone(cfg.Key),
		latest: map[string]sealedEntry{}, backoff: map[string]int{}, seen: map[[sha256.Size]byte]bool{}}, nil
}

// Refused returns how many distinct records the store has refused.
func (s *SealedStore) Refused() int64 { return s.refused.Load() }

func (s *SealedStore) sealed(key string) bool { return s.cfg.Sealed == nil || s.cfg.Sealed(key) }

func (s *SealedStore) fresh(key string) bool { return s.cfg.Fresh == nil || s.cfg.Fresh(key) }

// next returns a sequence number above after, above every number seen,
// and at least the clock's nanoseconds.
func (s *SealedStore) next(after uint64) uint64 {
	for {
		cur := s.clock.Load()
		n := max(cur+1, after+1, uint64(max(s.cfg.Now().UnixNano(), 0)))
		if s.clock.CompareAndSwap(cur, n) {
			return n
		}
	}
}

// observe moves the clock past seq.
func (s *SealedStore) observe(seq uint64) {
	for {
		cur := s.clock.Load()
		if seq <= cur || s.clock.CompareAndSwap(cur, seq) {
			return
		}
	}
}

func (s *SealedStore) sum(key string, seq, check string, payload []byte) []byte {
	m := hmac.New(sha256.New, s.mac)
	m.Write([]byte(sealDomain))
	for _, f := range []string{s.cfg.Scope, key, seq, check} {
		m.Write([]byte(f))
		m.Write([]byte{0})
	}
	m.Write(payload)
	return m.Sum(nil)
}

// seal returns payload sealed for key with number seq.
func (s *SealedStore) seal(key string, seq uint64, payload []byte) []byte {
	n := strconv.FormatUint(seq, 10)
	out := make([]byte, 0, len(sealMagic)+len(n)+len(s.cfg.Check)+2*sha256.Size+3+len(payload))
	out = append(out, sealMagic...)
	out = append(out, n...)
	out = append(out, ' ')
	out = append(out, s.cfg.Check...)
	out = append(out, ' ')
	out = hex.AppendEncode(out, s.sum(key, n, s.cfg.Check, payload))
	out = append(out, '\n')
	return append(out, payload...)
}

// parseSealed splits a sealed value into its header's fields and payload.
func parseSealed(rec []byte) (seq uint64, seqText, check string, mac, payload []byte, reason RefusalReason) {
	rest, ok := bytes.CutPrefix(rec, []byte(sealMagic))
	if !ok {
		return 0, "", "", nil, nil, RefusedUnsealed
	}
	header, payload, ok := bytes.Cut(rest, []byte{'\n'})
	if !ok {
		return 0, "", "", nil, nil, RefusedMalformed
	}
	f := bytes.Split(header, []byte{' '})
	if len(f) != 3 || len(f[2]) != 2*sha256.Size {
		return 0, "", "", nil, nil, RefusedMalformed
	}
	seq, err := strconv.ParseUint(string(f[0]), 10, 64)
	if err != nil || string(f[0]) != strconv.FormatUint(seq, 10) {
		return 0, "", "", nil, nil, RefusedMalformed
	}
	mac = make([]byte, sha256.Size)
	if _, err := hex.Decode(mac, f[2]); err != nil || !bytes.Equal(f[2], []byte(hex.EncodeToString(mac))) {
		return 0, "", "", nil, nil, RefusedMalformed
	}
	return seq, string(f[0]), string(f[1]), mac, payload, ""
}

// verify checks rec, read at key, without remembering or reporting it:
// its payload and number, or why it is refused. checkFresh: refuse it if
// older than the newest genuine record read at key.
func (s *SealedStore) verify(key string, rec []byte, checkFresh bool) (sealedEntry, Refusal) {
	seq, seqText, check, mac, payload, reason := parseSealed(rec)
	switch {
	case reason != "":
		return sealedEntry{}, Refusal{Key: key, Reason: reason}
	case check != s.cfg.Check:
		return sealedEntry{}, Refusal{Key: key, Reason: RefusedOtherKey, Check: check}
	case !hmac.Equal(mac, s.sum(key, seqText, check, payload)):
		return sealedEntry{}, Refusal{Key: key, Reason: RefusedBadMAC, Check: check}
	}
	if checkFresh {
		s.mu.Lock()
		l, ok := s.latest[key]
		s.mu.Unlock()
		if ok && seq < l.seq {
			return sealedEntry{}, Refusal{Key: key, Reason: RefusedReplayed, Check: check}
		}
	}
	return sealedEntry{sealed: rec, plain: payload, seq: seq}, Refusal{}
}

// open verifies rec, read at key: a genuine record is remembered (as the
// key's newest, and its number on the clock); a refused one is reported.
func (s *SealedStore) open(key string, rec []byte) (sealedEntry, bool) {
	e, r := s.verify(key, rec, s.fresh(key))
	if r.Reason != "" {
		s.report(r, rec)
		return sealedEntry{}, false
	}
	s.remember(key, e)
	return e, true
}

// remember records e as key's newest genuine record if it is, and clears
// the key's refusals.
func (s *SealedStore) remember(key string, e sealedEntry) {
	s.observe(e.seq)
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.backoff, key)
	if l, ok := s.latest[key]; ok && l.seq > e.seq {
		return
	}
	if _, ok := s.latest[key]; !ok && len(s.latest) >= maxRemembered {
		// Full (a long run's wake-up keys, or a flood of keys): forget
		// one at random rather than all, so that the state's record,
		// read at every step, is almost always still here.
		for k := range s.latest {
			delete(s.latest, k)
			break
		}
	}
	s.latest[key] = e
}

// newest returns the newest genuine record remembered at key.
func (s *SealedStore) newest(key string) (sealedEntry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.latest[key]
	return e, ok
}

// report counts and reports a refused record, once per key and content.
func (s *SealedStore) report(r Refusal, rec []byte) {
	h := sha256.New()
	h.Write([]byte(r.Key))
	h.Write([]byte{0})
	h.Write([]byte(r.Reason))
	h.Write([]byte{0})
	h.Write(rec)
	var d [sha256.Size]byte
	h.Sum(d[:0])
	s.mu.Lock()
	dup := s.seen[d]
	if !dup {
		if len(s.seen) >= maxRemembered {
			clear(s.seen)
		}
		s.seen[d] = true
	}
	s.mu.Unlock()
	if dup {
		return
	}
	s.refused.Add(1)
	if s.cfg.OnRefused != nil {
		s.cfg.OnRefused(r)
	}
}

// pause waits after a refused record at key, longer for each consecutive
// one, so that a forger rewriting a key cannot make the job spin.
func (s *SealedStore) pause(ctx context.Context, key string) error {
	s.mu.Lock()
	n := s.backoff[key]
	if len(s.backoff) >= maxRemembered {
		clear(s.backoff)
	}
	s.backoff[key] = n + 1
	s.mu.Unlock()
	d := refusedPauseMax
	if n < 7 {
		d = min(refusedPause<<n, refusedPauseMax)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return fmt.Errorf("%w: waiting past a refused record at %q: %w", ErrTimeout, key, context.Cause(ctx))
	case <-t.C:
		return nil
	}
}

// probe reads key without blocking and without writing.
func (s *SealedStore) probe(ctx context.Context, key string) (rec []byte, present bool, err error) {
	cur, err := s.inner.CompareSet(ctx, key, probeValue, probeValue)
	if err != nil {
		return nil, false, err
	}
	if bytes.Equal(cur, probeValue) {
		return nil, false, nil
	}
	return cur, true, nil
}

func (s *SealedStore) Set(ctx context.Context, key string, value []byte) error {
	if !s.sealed(key) {
		return s.inner.Set(ctx, key, value)
	}
	e := s.sealNew(key, value)
	if err := s.inner.Set(ctx, key, e.sealed); err != nil {
		return err
	}
	s.remember(key, e)
	return nil
}

// sealNew seals value for key above the newest record remembered there.
func (s *SealedStore) sealNew(key string, value []byte) sealedEntry {
	var after uint64
	if l, ok := s.newest(key); ok {
		after = l.seq
	}
	seq := s.next(after)
	return sealedEntry{sealed: s.seal(key, seq, value), plain: bytes.Clone(value), seq: seq}
}

func (s *SealedStore) Get(ctx context.Context, key string) ([]byte, error) {
	if !s.sealed(key) {
		return s.inner.Get(ctx, key)
	}
	vs, err := s.MultiGet(ctx, key)
	if err != nil {
		return nil, err
	}
	return vs[0], nil
}

// Peek is the inner store's Peek (an error wrapping ErrNotSupported where
// it has none) with every sealed record opened: one that fails the check
// reads as absent, as a read that does not wait would find no genuine
// record there.
func (s *SealedStore) Peek(ctx context.Context, keys ...string) ([][]byte, error) {
	p, ok := s.inner.(Peeker)
	if !ok {
		return nil, fmt.Errorf("peek: %w", ErrNotSupported)
	}
	vs, err := p.Peek(ctx, keys...)
	if err != nil || len(vs) != len(keys) {
		return vs, err
	}
	for i, k := range keys {
		if vs[i] == nil || !s.sealed(k) {
			continue
		}
		if e, ok := s.open(k, vs[i]); ok {
			vs[i] = e.plain
		} else {
			vs[i] = nil
		}
	}
	return vs, nil
}

// MultiGet waits for every key to hold a genuine record: a refused one is
// mended where this store has read or written a genuine record there (see
// mend), and read again after a pause, until it is replaced or ctx ends.
func (s *SealedStore) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	ctx, cancel := WithDefaultTimeout(ctx, DefaultTimeout)
	defer cancel()
	for {
		vs, err := s.inner.MultiGet(ctx, keys...)
		if err != nil {
			return nil, err
		}
		if len(vs) != len(keys) {
			return vs, nil // the inner store's answer, out of shape: not ours to mend
		}
		bad := -1
		for i, k := range keys {
			if !s.sealed(k) {
				continue
			}
			e, ok := s.open(k, vs[i])
			if !ok {
				bad = i
				break
			}
			vs[i] = e.plain
		}
		if bad < 0 {
			return vs, nil
		}
		if _, err := s.mend(ctx, keys[bad], vs[bad]); err != nil {
			return nil, err
		}
	}
}

func (s *SealedStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	return s.inner.Add(ctx, key, delta)
}

// CompareSet compares and sets payloads: expected is matched against the
// genuine record at key (a refused one counts as absent, see the type),
// and desired is stored sealed above it.
func (s *SealedStore) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	if !s.sealed(key) {
		return s.inner.CompareSet(ctx, key, expected, desired)
	}
	for {
		// The sealed form of expected: the record remembered at key when
		// it holds expected (the usual case: the caller read it through
		// this store), else whatever the store holds now.
		var sexp []byte
		var after uint64
		if l, ok := s.newest(key); ok {
			after = l.seq
		}
		if len(expected) > 0 {
			if l, ok := s.newest(key); ok && bytes.Equal(l.plain, expected) {
				sexp = l.sealed
			} else {
				cur, present, err := s.probe(ctx, key)
				switch {
				case err != nil:
					return nil, err
				case !present:
					return bytes.Clone(expected), nil // c10d: an absent key answers with expected
				}
				e, ok := s.open(key, cur)
				if !ok {
					if again, err := s.mend(ctx, key, cur); err != nil || again {
						if err != nil {
							return nil, err
						}
						continue
					}
					return bytes.Clone(expected), nil // refused and nothing to restore: absent
				}
				if !bytes.Equal(e.plain, expected) {
					return e.plain, nil
				}
				sexp = cur
			}
			after = max(after, seqOf(sexp))
		}
		des := s.sealAbove(key, after, desired)
		cur, err := s.inner.CompareSet(ctx, key, sexp, des.sealed)
		if err != nil {
			return nil, err
		}
		switch {
		case bytes.Equal(cur, des.sealed):
			s.remember(key, des)
			return bytes.Clone(desired), nil
		case sexp != nil && bytes.Equal(cur, sexp):
			return bytes.Clone(expected), nil // absent after all
		}
		if e, ok := s.open(key, cur); ok {
			return e.plain, nil
		}
		again, err := s.mend(ctx, key, cur)
		switch {
		case err != nil:
			return nil, err
		case again:
			continue
		case len(expected) > 0:
			return bytes.Clone(expected), nil // absent, as c10d answers
		}
		// Absent, and expected empty: the compare succeeds on an absent
		// key, so write desired over the refused record.
		got, err := s.inner.CompareSet(ctx, key, cur, des.sealed)
		if err != nil {
			return nil, err
		}
		if bytes.Equal(got, des.sealed) {
			s.remember(key, des)
			return bytes.Clone(desired), nil
		}
	}
}

// seqOf is a sealed record's number (0 when it has none).
func seqOf(rec []byte) uint64 {
	seq, _, _, _, _, _ := parseSealed(rec)
	return seq
}

// sealAbove seals value for key with a number above after.
func (s *SealedStore) sealAbove(key string, after uint64, value []byte) sealedEntry {
	seq := s.next(after)
	return sealedEntry{sealed: s.seal(key, seq, value), plain: bytes.Clone(value), seq: seq}
}

// mend deals with a refused record cur at key: after a pause, it writes
// back the newest genuine record this store has read or written there
// (the forger overwrote it: this way a record that its writer wrote once,
// such as a node's worker store address, comes back when the writer reads
// it), and reports again=true for the caller to retry on it. Without one,
// the key counts as absent (again=false), and the caller acts
// accordingly.
func (s *SealedStore) mend(ctx context.Context, key string, cur []byte) (again bool, err error) {
	if err := s.pause(ctx, key); err != nil {
		return false, err
	}
	l, ok := s.newest(key)
	if !ok {
		return false, nil
	}
	if _, err := s.inner.CompareSet(ctx, key, cur, l.sealed); err != nil {
		return false, err
	}
	return true, nil
}

// Wait waits for the keys to exist; presence is not authenticated (a
// forged key ends the wait, and what the waiter then reads is checked).
func (s *SealedStore) Wait(ctx context.Context, keys ...string) error {
	return s.inner.Wait(ctx, keys...)
}

// Check reports whether every key holds a genuine record (counters: any
// value).
func (s *SealedStore) Check(ctx context.Context, keys ...string) (bool, error) {
	ok, err := s.inner.Check(ctx, keys...)
	if err != nil || !ok {
		return ok, err
	}
	for _, k := range keys {
		if !s.sealed(k) {
			continue
		}
		cur, present, err := s.probe(ctx, k)
		if err != nil || !present {
			return false, err
		}
		if _, ok := s.open(k, cur); !ok {
			return false, nil
		}
	}
	return true, nil
}

func (s *SealedStore) Delete(ctx context.Context, key string) (bool, error) {
	return s.inner.Delete(ctx, key)
}

func (s *SealedStore) NumKeys(ctx context.Context) (int64, error) { return s.inner.NumKeys(ctx) }

// Append cannot extend a sealed record (its MAC covers the whole value):
// it is refused on sealed keys.
func (s *SealedStore) Append(ctx context.Context, key string, value []byte) error {
	if s.sealed(key) {
		return fmt.Errorf("%w: append to sealed key %q", ErrNotSupported, key)
	}
	return s.inner.Append(ctx, key, value)
}

func (s *SealedStore) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	if len(keys) != len(values) {
		return s.inner.MultiSet(ctx, keys, values) // the inner store says what is wrong
	}
	out := make([][]byte, len(values))
	es := make([]sealedEntry, len(values))
	for i, k := range keys {
		if !s.sealed(k) {
			out[i] = values[i]
			continue
		}
		es[i] = s.sealNew(k, values[i])
		out[i] = es[i].sealed
	}
	if err := s.inner.MultiSet(ctx, keys, out); err != nil {
		return err
	}
	for i, k := range keys {
		if s.sealed(k) {
			s.remember(k, es[i])
		}
	}
	return nil
}

func (s *SealedStore) ListKeys(ctx context.Context) ([]string, error) { return s.inner.ListKeys(ctx) }

func (s *SealedStore) QueuePush(ctx context.Context, key string, value []byte) error {
	if !s.sealed(key) {
		return s.inner.QueuePush(ctx, key, value)
	}
	return s.inner.QueuePush(ctx, key, s.seal(key, s.next(0), value))
}

// QueuePop returns the next genuine element, dropping refused ones.
func (s *SealedStore) QueuePop(ctx context.Context, key string, block bool) ([]byte, error) {
	if !s.sealed(key) {
		return s.inner.QueuePop(ctx, key, block)
	}
	for {
		b, err := s.inner.QueuePop(ctx, key, block)
		if err != nil {
			return nil, err
		}
		if e, ok := s.openElement(key, b); ok {
			return e, nil
		}
	}
}

// openElement verifies an element of queue key: queues have many writers,
// so their elements are not checked for freshness.
func (s *SealedStore) openElement(key string, b []byte) ([]byte, bool) {
	e, r := s.verify(key, b, false)
	if r.Reason != "" {
		s.report(r, b)
		return nil, false
	}
	s.observe(e.seq)
	return e.plain, true
}

// QueuePopBatch pops where the inner store can, dropping refused elements.
func (s *SealedStore) QueuePopBatch(ctx context.Context, key string, max int) ([][]byte, error) {
	bp, ok := s.inner.(BatchPopper)
	if !ok {
		return nil, fmt.Errorf("%w: batch pop", ErrNotSupported)
	}
	for {
		bs, err := bp.QueuePopBatch(ctx, key, max)
		if err != nil || !s.sealed(key) {
			return bs, err
		}
		out := bs[:0]
		for _, b := range bs {
			if e, ok := s.openElement(key, b); ok {
				out = append(out, e)
			}
		}
		// A batch of refused elements alone is not the end of the queue:
		// genuine ones may wait behind a forger's.
		if len(out) > 0 || len(bs) == 0 {
			return out, nil
		}
	}
}

func (s *SealedStore) QueueLen(ctx context.Context, key string) (int64, error) {
	return s.inner.QueueLen(ctx, key)
}

func (s *SealedStore) Barrier(ctx context.Context, key string, worldSize int64) error {
	return s.inner.Barrier(ctx, key, worldSize)
}

// Close closes the wrapped store.
func (s *SealedStore) Close() error { return s.inner.Close() }

// DynamicViews reports the keys of run runID's published views (the
// marker, the shares and the members: dynamic_share.go), which whoever
// writes the state Sets without reading them first: not fresh in a
// SealConfig (their numbers follow the writers' clocks), and harmless
// when replayed (a view older than the state makes a node look again,
// never take a wrong round).
func DynamicViews(runID string) func(key string) bool {
	state := "gorun.rendezvous." + runID
	return func(key string) bool {
		rest, ok := strings.CutPrefix(key, state)
		if !ok {
			return false
		}
		return rest == markerSuffix || rest == membersSuffix || strings.HasPrefix(rest, shareSuffix)
	}
}

// NewSealDetector wraps the store of an agent without a job secret: a
// record sealed under one, read at a key sealed reports (nil: every key),
// fails the read with ErrSealedRecord, so that the agent says what is
// wrong (another agent of the job holds a secret) instead of failing to
// decode it. Everything else passes through: without a secret, the
// records are as they were before sealing.
//
// The detector offers the inner store's optional interfaces: BatchPopper
// always (an error wrapping ErrNotSupported where the inner store has
// none, as its contract allows a wrapper), and Peeker and PushPeeker
// where the inner store peeks, since the rendezvous takes a Peeker for a
// store that reads without waiting before it ever peeks. A detector that
// offered only Store and BatchPopper hid etcd's plain reads from every
// agent without a secret (the default): each of the rendezvous's reads of
// its marker, shares and lock became a compare-set, a Raft proposal on
// etcd, the marker's alone 3 of an agent's 18 at 64 agents.
func NewSealDetector(inner Store, sealed func(key string) bool) Store {
	d := &sealDetector{Store: inner, sealed: sealed}
	if _, ok := inner.(Peeker); ok {
		return &peekingSealDetector{d}
	}
	return d
}

type sealDetector struct {
	Store
	sealed func(key string) bool
}

// peekingSealDetector is the detector of a store that peeks.
type peekingSealDetector struct{ *sealDetector }

func (d *sealDetector) check(key string, v []byte) error {
	if (d.sealed == nil || d.sealed(key)) && bytes.HasPrefix(v, []byte(sealMagic)) {
		return fmt.Errorf("%w: %q holds a sealed record and this agent holds no job secret", ErrSealedRecord, key)
	}
	return nil
}

func (d *sealDetector) Get(ctx context.Context, key string) ([]byte, error) {
	v, err := d.Store.Get(ctx, key)
	if err == nil {
		err = d.check(key, v)
	}
	return v, err
}

func (d *sealDetector) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	vs, err := d.Store.MultiGet(ctx, keys...)
	for i := 0; err == nil && i < len(vs) && i < len(keys); i++ {
		err = d.check(keys[i], vs[i])
	}
	return vs, err
}

func (d *sealDetector) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	v, err := d.Store.CompareSet(ctx, key, expected, desired)
	if err == nil {
		err = d.check(key, v)
	}
	return v, err
}

func (d *sealDetector) QueuePop(ctx context.Context, key string, block bool) ([]byte, error) {
	v, err := d.Store.QueuePop(ctx, key, block)
	if err == nil {
		err = d.check(key, v)
	}
	return v, err
}

// QueuePopBatch pops where the inner store can (BatchPopper).
func (d *sealDetector) QueuePopBatch(ctx context.Context, key string, max int) ([][]byte, error) {
	bp, ok := d.Store.(BatchPopper)
	if !ok {
		return nil, fmt.Errorf("%w: batch pop", ErrNotSupported)
	}
	vs, err := bp.QueuePopBatch(ctx, key, max)
	for i := 0; err == nil && i < len(vs); i++ {
		err = d.check(key, vs[i])
	}
	return vs, err
}

// Peek reads without waiting where the inner store can (Peeker).
func (d *peekingSealDetector) Peek(ctx context.Context, keys ...string) ([][]byte, error) {
	p, ok := d.Store.(Peeker)
	if !ok {
		return nil, fmt.Errorf("%w: peek", ErrNotSupported)
	}
	vs, err := p.Peek(ctx, keys...)
	for i := 0; err == nil && i < len(vs) && i < len(keys); i++ {
		if vs[i] != nil {
			err = d.check(keys[i], vs[i])
		}
	}
	return vs, err
}

// QueuePushPeek pushes with a look where the inner store can (PushPeeker).
func (d *peekingSealDetector) QueuePushPeek(ctx context.Context, key string, value []byte, look string, create []byte) ([]byte, error) {
	pp, ok := d.Store.(PushPeeker)
	if !ok {
		return nil, fmt.Errorf("%w: push with a look", ErrNotSupported)
	}
	v, err := pp.QueuePushPeek(ctx, key, value, look, create)
	if err == nil && v != nil {
		err = d.check(look, v)
	}
	return v, err
}
