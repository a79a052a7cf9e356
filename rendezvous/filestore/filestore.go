// Package filestore implements c10d's FileStore: a key-value store kept in
// one append-only file that PyTorch processes and Go processes share.
//
// The file format, the locking discipline and the file-removal rules are
// c10d's, byte for byte (spec/c10d-wire.md §3): every operation opens the
// file, takes a whole-file flock, replays the records appended since it last
// looked, does its work, unlocks and closes. There is no server and no
// notification; blocking operations poll every PollInterval, as c10d does,
// because inotify does not work on the shared filesystems (NFS) a FileStore
// is used on.
//
// Every operation, Check and NumKeys included, waits for the file to exist
// (c10d retries its open so that another rank can create the file); only
// writers create it.
//
// A file outlives a job unless a cleanup rule removes it, and a reused file
// is replayed with every key of its past. Give each rendezvous round a fresh
// path.
package filestore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// Cleanup selects the c10d generation whose file-removal rule Close applies.
// Every process sharing a file should use the same rule: the two
// generations count differently, so mixing them can remove the file while
// stores are still open, or never remove it (spec/c10d-wire.md §3.4).
type Cleanup uint8

const (
	// CleanupNewest is current PyTorch's rule. Open adds 1 to "refcount/".
	// Close, if the file still exists, adds 1 to "cleanup/" (c) and -1 to
	// "refcount/" (r), and removes the file iff r == 0, WorldSize >= 0 and
	// c >= WorldSize: the last store to close removes it.
	CleanupNewest Cleanup = iota
	// Cleanup113 is PyTorch 1.13's rule. Open writes nothing. Close, if the
	// file still exists, adds 1 to "cleanup/" (c) and removes the file iff
	// c == WorldSize — equality, so a file whose counter is already past
	// WorldSize is never removed.
	Cleanup113
	// CleanupNone writes no bookkeeping at all: Open and Close leave the
	// file exactly as they found it. For tools that inspect a file that
	// belongs to a job (`gorun store … --store file://…`) without counting
	// themselves among its users.
	CleanupNone
)

func (c Cleanup) String() string {
	switch c {
	case CleanupNewest:
		return "newest"
	case Cleanup113:
		return "1.13"
	case CleanupNone:
		return "none"
	}
	return fmt.Sprintf("Cleanup(%d)", uint8(c))
}

// DefaultPollInterval is how often c10d's FileStore polls: for a key to
// appear, for Wait, and for the file to be created.
const DefaultPollInterval = 10 * time.Millisecond

// Config configures a Store. Start from DefaultConfig: the zero Config has
// WorldSize 0, which under CleanupNewest lets the last store to close remove
// the file.
type Config struct {
	// WorldSize is c10d's world_size argument, used only by the cleanup
	// rule. -1, c10d's default, never removes the file.
	WorldSize int
	// Timeout bounds a blocking operation (Get, Wait, MultiGet, Barrier) when
	// its context has no deadline, and every operation's wait for the file
	// to be created or unlocked; it is c10d's store timeout. Zero selects
	// rendezvous.DefaultTimeout; a negative value means no store timeout,
	// only the context's (c10d's kNoTimeout). Close uses it to bound its
	// cleanup.
	Timeout time.Duration
	// Cleanup is the file-removal rule Close applies.
	Cleanup Cleanup
	// PollInterval is the pause between polls. Zero selects
	// DefaultPollInterval.
	PollInterval time.Duration
}

// DefaultConfig returns c10d's defaults: WorldSize -1, a 300 s timeout,
// current PyTorch's cleanup rule and 10 ms polling.
func DefaultConfig() Config {
	return Config{
		WorldSize:    -1,
		Timeout:      rendezvous.DefaultTimeout,
		Cleanup:      CleanupNewest,
		PollInterval: DefaultPollInterval,
	}
}

func (c Config) withDefaults() (Config, error) {
	if c.Timeout == 0 {
		c.Timeout = rendezvous.DefaultTimeout
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.Cleanup > CleanupNone {
		return c, fmt.Errorf("%w: unknown cleanup rule %v", rendezvous.ErrInvalidArgument, c.Cleanup)
	}
	return c, nil
}

// Store is a c10d FileStore. It is safe for concurrent use; goroutines of
// one Store exclude each other the way processes do, through the file's
// flock, and share one replayed table.
type Store struct {
	path string
	cfg  Config

	mu     sync.Mutex // guards tab and closed; taken only while the file is locked
	tab    table
	closed bool

	done chan struct{} // closed by Close, to stop operations that are waiting
}

var _ rendezvous.Store = (*Store)(nil)

// Open returns a Store over the file at path, which need not exist yet:
// writers create it, and readers wait up to the timeout for it to appear.
// Under CleanupNewest, Open registers the store in the file's "refcount/",
// as c10d's constructor does; under Cleanup113 it touches nothing.
func Open(ctx context.Context, path string, cfg Config) (*Store, error) {
	if path == "" {
		return nil, fmt.Errorf("filestore: %w: empty path", rendezvous.ErrInvalidArgument)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("filestore: %w", err)
	}
	s := &Store{path: path, cfg: cfg, tab: newTable(), done: make(chan struct{})}
	if cfg.Cleanup == CleanupNewest {
		ctx, _, cancel := s.begin(ctx)
		defer cancel()
		if err := s.do(ctx, writeAccess, func(t *txn) error {
			_, err := t.add(refcountKey, 1)
			return err
		}); err != nil {
			return nil, fail("open", err, "")
		}
	}
	return s, nil
}

// Path returns the file's path.
func (s *Store) Path() string { return s.path }

// txn is one operation's view of the file: open, locked, and replayed to its
// end, so tab.offset is the file's size and appends land there.
type txn struct {
	f   *os.File
	tab *table
}

func (t *txn) value(key string) (string, bool) {
	v, ok := t.tab.kv[key]
	return v, ok
}

// append writes recs at the end of the file in one write and applies them to
// the table, which therefore stays replayed to the end.
func (t *txn) append(recs ...record) error {
	var buf []byte
	for _, r := range recs {
		var err error
		if buf, err = appendRecord(buf, r); err != nil {
			return err
		}
	}
	if _, err := t.f.WriteAt(buf, t.tab.offset); err != nil {
		// Leave no torn record behind for the next reader to choke on.
		_ = t.f.Truncate(t.tab.offset)
		return err
	}
	for _, r := range recs {
		t.tab.apply(r)
	}
	t.tab.offset += int64(len(buf))
	return nil
}

// add is c10d's add helper, used for user counters ("/"+k) and internal ones
// alike: it appends the new decimal value even when delta is 0. c10d's
// FileStore counts an empty value as 0, unlike its TCPStore server, which
// fails on one.
func (t *txn) add(key string, delta int64) (int64, error) {
	old, _ := t.value(key)
	n, dec, err := rendezvous.AddCounter([]byte(old), old != "", delta)
	if err != nil {
		return 0, err
	}
	return n, t.append(record{key, string(dec)})
}

// do runs fn with the file opened and locked as a needs and the table
// replayed to the file's end, then unlocks and closes the file. The file is
// locked before mu is taken and mu is never held while waiting, so a waiting
// operation never blocks the store's other goroutines.
func (s *Store) do(ctx context.Context, a access, fn func(*txn) error) error {
	f, err := s.openFile(ctx, a)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := s.lockFile(ctx, f, a); err != nil {
		return err
	}
	defer unlock(f) // an unlock error changes nothing: closing f releases the lock too

	fi, err := f.Stat()
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed && a != cleanupAccess {
		return rendezvous.ErrClosed
	}
	if err := s.tab.replay(f, fi); err != nil {
		return err
	}
	return fn(&txn{f: f, tab: &s.tab})
}

// begin bounds ctx by the store's timeout and returns the time it allows,
// which c10d's timeout messages quote: the store timeout exactly when it
// applies, else what is left of the caller's deadline.
func (s *Store) begin(ctx context.Context) (context.Context, time.Duration, context.CancelFunc) {
	var budget time.Duration
	if _, ok := ctx.Deadline(); !ok && s.cfg.Timeout > 0 {
		budget = s.cfg.Timeout
	}
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, s.cfg.Timeout)
	if d, ok := ctx.Deadline(); ok && budget == 0 {
		budget = time.Until(d).Round(time.Millisecond)
	}
	return ctx, budget, cancel
}

// timeoutError is a blocking operation that ran out of time, in c10d's
// words ("Timeout waiting for key: k after 300000 ms", "Wait timeout") so
// that logs read the same whichever side failed. It matches
// rendezvous.ErrTimeout and the context's error.
type timeoutError struct {
	msg   string
	cause error // context.DeadlineExceeded, possibly wrapped
}

func (e *timeoutError) Error() string   { return "filestore: " + e.msg }
func (e *timeoutError) Unwrap() []error { return []error{rendezvous.ErrTimeout, e.cause} }

// fail gives err, from operation op, the form callers branch on: a deadline
// becomes a timeoutError with message msg (or one naming op and what it was
// waiting for, when msg is empty); anything else is wrapped with op.
func fail(op string, err error, msg string) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded):
		if msg == "" {
			msg = op + ": " + err.Error()
		}
		return &timeoutError{msg: msg, cause: err}
	default:
		return fmt.Errorf("filestore: %s: %w", op, err)
	}
}

// Set stores value under key.
func (s *Store) Set(ctx context.Context, key string, value []byte) error {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	err := s.do(ctx, writeAccess, func(t *txn) error {
		return t.append(record{userKey(key), string(value)})
	})
	return fail("set", err, "")
}

// Get returns key's value, polling until the key exists. Running out of time
// gives c10d's "Timeout waiting for key: K after N ms", where N is the time
// the operation was allowed.
func (s *Store) Get(ctx context.Context, key string) ([]byte, error) {
	vals, err := s.get(ctx, "get", key)
	if err != nil {
		return nil, err
	}
	return vals[0], nil
}

// MultiGet returns the values of keys in order, polling until all of them
// exist. The values come from one consistent view of the file, which c10d's
// one-key-at-a-time fallback does not promise but every caller assumes.
func (s *Store) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	return s.get(ctx, "multi_get", keys...)
}

func (s *Store) get(ctx context.Context, op string, keys ...string) ([][]byte, error) {
	ctx, budget, cancel := s.begin(ctx)
	defer cancel()
	vals, missing, err := s.await(ctx, keys, true)
	if err != nil {
		return nil, fail(op, err, fmt.Sprintf("Timeout waiting for key: %s after %d ms", missing, budget.Milliseconds()))
	}
	return vals, nil
}

// Wait polls until every key exists; running out of time gives c10d's
// "Wait timeout".
func (s *Store) Wait(ctx context.Context, keys ...string) error {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	_, _, err := s.await(ctx, keys, false)
	return fail("wait", err, "Wait timeout")
}

// await polls every PollInterval, with the file unlocked in between, until
// every key is live, and returns their values if want. When it gives up,
// missing is the first key still absent.
func (s *Store) await(ctx context.Context, keys []string, want bool) (vals [][]byte, missing string, err error) {
	for {
		err = s.do(ctx, readAccess, func(t *txn) error {
			missing, vals = "", nil
			for _, k := range keys {
				v, ok := t.value(userKey(k))
				if !ok {
					missing = k
					return nil
				}
				if want {
					vals = append(vals, []byte(v))
				}
			}
			return nil
		})
		if err != nil {
			if missing == "" && len(keys) > 0 {
				missing = keys[0] // gave up before the file could be read
			}
			return nil, missing, err
		}
		if missing == "" {
			return vals, "", nil
		}
		if err = s.pause(ctx, s.cfg.PollInterval, readAccess); err != nil {
			return nil, missing, err
		}
	}
}

// Check reports whether every key exists.
func (s *Store) Check(ctx context.Context, keys ...string) (bool, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	ok := true
	err := s.do(ctx, readAccess, func(t *txn) error {
		for _, k := range keys {
			if _, live := t.value(userKey(k)); !live {
				ok = false
				return nil
			}
		}
		return nil
	})
	if err != nil {
		return false, fail("check", err, "")
	}
	return ok, nil
}

// Add adds delta to the decimal counter under key and returns the new value.
// Like c10d it appends a record every time, even for delta 0. A value that
// is not a counter gives an error wrapping rendezvous.ErrNotInteger.
func (s *Store) Add(ctx context.Context, key string, delta int64) (int64, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	var n int64
	err := s.do(ctx, writeAccess, func(t *txn) (err error) {
		n, err = t.add(userKey(key), delta)
		return err
	})
	if err != nil {
		return 0, fail("add", err, "")
	}
	return n, nil
}

// CompareSet stores desired if key's value equals expected, an absent key
// matching an empty expected, and appends a record only when it stores. It
// returns desired when it stored, the current value when it did not, and
// expected when the key is absent and expected is not empty (c10d's quirk).
func (s *Store) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	var out []byte
	err := s.do(ctx, writeAccess, func(t *txn) error {
		k := userKey(key)
		cur, ok := t.value(k)
		switch {
		case ok && cur == string(expected), !ok && len(expected) == 0:
			out = desired
			return t.append(record{k, string(desired)})
		case !ok:
			out = expected
		default:
			out = []byte(cur)
		}
		return nil
	})
	if err != nil {
		return nil, fail("compare_set", err, "")
	}
	return slices.Clone(out), nil
}

// Delete removes key. It always appends a tombstone and, like c10d, waits
// for the file to exist rather than create it. c10d's delete returns true
// unconditionally; this one reports whether the key was live when the
// tombstone was written, which it can do without changing the bytes written
// because it replays the file under the exclusive lock first.
func (s *Store) Delete(ctx context.Context, key string) (bool, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	var existed bool
	err := s.do(ctx, updateAccess, func(t *txn) error {
		k := userKey(key)
		_, existed = t.value(k)
		return t.append(record{tombstonePrefix + k, ""})
	})
	if err != nil {
		return false, fail("delete", err, "")
	}
	return existed, nil
}

// NumKeys counts the live keys, c10d's internal "cleanup/" and "refcount/"
// included, as c10d does.
func (s *Store) NumKeys(ctx context.Context) (int64, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	var n int64
	err := s.do(ctx, readAccess, func(t *txn) error {
		n = int64(len(t.tab.kv))
		return nil
	})
	if err != nil {
		return 0, fail("num_keys", err, "")
	}
	return n, nil
}

// ListKeys returns the live user keys, sorted. Current c10d returns every
// live key with its first character cut off, which mangles the internal
// counters into "efcount/" and "leanup/"; this returns what the
// rendezvous.Store contract asks for, the user keys only, so that a
// PrefixStore over a FileStore lists its own keys.
func (s *Store) ListKeys(ctx context.Context) ([]string, error) {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	var keys []string
	err := s.do(ctx, readAccess, func(t *txn) error {
		for k := range t.tab.kv {
			if uk, ok := strings.CutPrefix(k, userPrefix); ok {
				keys = append(keys, uk)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fail("list_keys", err, "")
	}
	slices.Sort(keys)
	return keys, nil
}

// Append appends value to key's value, creating the key. c10d's FileStore
// has no append of its own and falls back to a compare_set loop; doing it
// natively under the exclusive lock writes the same single record.
func (s *Store) Append(ctx context.Context, key string, value []byte) error {
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	err := s.do(ctx, writeAccess, func(t *txn) error {
		k := userKey(key)
		cur, _ := t.value(k)
		return t.append(record{k, cur + string(value)})
	})
	return fail("append", err, "")
}

// MultiSet sets keys[i] to values[i] in order. The records are those of
// c10d's one-set-per-key fallback, written under one lock, so other readers
// see all of them or none.
func (s *Store) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	if len(keys) != len(values) {
		return fmt.Errorf("filestore: multi_set: %w: %d keys, %d values", rendezvous.ErrInvalidArgument, len(keys), len(values))
	}
	ctx, _, cancel := s.begin(ctx)
	defer cancel()
	recs := make([]record, len(keys))
	for i, k := range keys {
		recs[i] = record{userKey(k), string(values[i])}
	}
	err := s.do(ctx, writeAccess, func(t *txn) error { return t.append(recs...) })
	return fail("multi_set", err, "")
}

// Barrier adds 1 to the counter under key and polls, reading without
// writing, until it reaches worldSize. c10d's FileStore has no barrier
// operation; this is gorun's equivalent, built on the same counter a PyTorch
// process would use (add(key, 1), then watch the value), so both can take
// part in one barrier.
func (s *Store) Barrier(ctx context.Context, key string, worldSize int64) error {
	if worldSize <= 0 {
		return fmt.Errorf("filestore: barrier: %w: world size %d", rendezvous.ErrInvalidArgument, worldSize)
	}
	ctx, budget, cancel := s.begin(ctx)
	defer cancel()
	k := userKey(key)
	var n int64
	err := s.do(ctx, writeAccess, func(t *txn) (err error) {
		n, err = t.add(k, 1)
		return err
	})
	for err == nil && n < worldSize {
		if err = s.pause(ctx, s.cfg.PollInterval, readAccess); err != nil {
			break
		}
		err = s.do(ctx, readAccess, func(t *txn) (err error) {
			v, _ := t.value(k)
			n, _, err = rendezvous.AddCounter([]byte(v), v != "", 0)
			return err
		})
	}
	return fail("barrier", err, fmt.Sprintf("Barrier timeout: key %s reached %d of %d after %d ms", key, n, worldSize, budget.Milliseconds()))
}

var errNoQueues = fmt.Errorf("queues: %w: c10d's FileStore has none", rendezvous.ErrNotSupported)

// QueuePush returns an error wrapping rendezvous.ErrNotSupported.
func (s *Store) QueuePush(context.Context, string, []byte) error {
	return fail("queue_push", errNoQueues, "")
}

// QueuePop returns an error wrapping rendezvous.ErrNotSupported.
func (s *Store) QueuePop(context.Context, string, bool) ([]byte, error) {
	return nil, fail("queue_pop", errNoQueues, "")
}

// QueueLen returns an error wrapping rendezvous.ErrNotSupported.
func (s *Store) QueueLen(context.Context, string) (int64, error) {
	return 0, fail("queue_len", errNoQueues, "")
}

// Close applies the configured cleanup rule, as c10d's destructor does, and
// makes every later operation fail with rendezvous.ErrClosed; operations
// that are waiting stop at once. If the file no longer exists Close writes
// nothing. The cleanup counters are updated under one exclusive lock and
// the file is removed before that lock is released, so no other store can
// count itself in between. A second Close does nothing and returns nil.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.done)
	s.mu.Unlock()
	if s.cfg.Cleanup == CleanupNone {
		return nil
	}

	ctx, cancel := rendezvous.WithDefaultTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	err := s.do(ctx, cleanupAccess, func(t *txn) error {
		c, err := t.add(cleanupKey, 1)
		if err != nil {
			return err
		}
		ws := int64(s.cfg.WorldSize)
		remove := false
		switch s.cfg.Cleanup {
		case Cleanup113:
			remove = c == ws
		case CleanupNewest:
			r, err := t.add(refcountKey, -1)
			if err != nil {
				return err
			}
			remove = r == 0 && ws >= 0 && c >= ws
		}
		if remove {
			if err := os.Remove(s.path); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
		}
		return nil
	})
	if errors.Is(err, errNoFile) {
		return nil
	}
	return fail("close", err, "")
}
