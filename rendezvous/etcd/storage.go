package etcd

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// StorageConfig configures a Storage.
type StorageConfig struct {
	// Prefix is where the store lives in etcd; every Storage with the same
	// prefix (one per node) serves the same store. Required; it should end
	// in "/", e.g. "/gorun/job1/store/0/".
	Prefix string
	// OpTimeout bounds one storage operation, etcd's retries across a
	// leader change included. Default 60 s.
	OpTimeout time.Duration
	// AttemptTimeout bounds one etcd request of an operation; one that
	// runs out of it is sent again, under twice the time, up to OpTimeout
	// (read-modify-writes carry tokens that make a second sending safe,
	// see update; a lease granted twice leaves one unused until its TTL).
	// A follower holds a request it forwarded to a leader that has just
	// died until its own request timeout (5 s plus two election
	// timeouts) although a new leader, elected within an election
	// timeout, would answer it at once. Default 2 s.
	AttemptTimeout time.Duration
	// Logger receives watch interruptions. Default: none.
	Logger *zap.Logger
	// BatchInflight is how many etcd requests of batched operations may
	// be in flight at once; operations that arrive meanwhile wait and
	// leave together (see batch.go). Default 2.
	BatchInflight int
	// StartRevision, when positive, is a revision of etcd's that the
	// caller has seen: the watch starts after it, and NewStorage makes no
	// request before it returns (the sweep of orphan chunks, one read-only
	// request when there are none, follows in the background). An older one only makes the watch replay the prefix's
	// changes since (none, for a fresh prefix). Default: read etcd's
	// current revision.
	StartRevision int64
	// Unwatched are keys that nobody waits on (Wait, Barrier and Watch
	// refuse them), kept where the Storage's watch does not look: every
	// node's watch would otherwise carry each of their changes. The
	// dynamic rendezvous's state is one: kilobytes, rewritten by every
	// node's join and heartbeat, and only ever read. A name here also
	// names an unwatched queue, which only non-blocking pops may take
	// from (rendezvous.DynamicUnwatched lists the rendezvous's). A name
	// ending in "*" names every key (and queue) that starts with the rest.
	Unwatched []string
	// WriteLeaseTTL is how long the chunks of a large value a writer has
	// begun and not finished are kept after the writer stops renewing its
	// lease (it died between its chunks and its head): then a sweep
	// deletes them (see Large values). Default 10 s; etcd rounds it up to
	// whole seconds.
	WriteLeaseTTL time.Duration
	// Lease, if set, returns the lease to put the tokens of
	// read-modify-writes under (see Tokens in storage_lease.go): one its
	// owner keeps alive, and replaces when it lapses, such as an agent's
	// Liveness.Lease, so that the agent holds one lease rather than one
	// more per Storage and its tokens go with its presence. It is called
	// for every read-modify-write, so it should answer from memory, and
	// again, until it answers another lease, when etcd finds the one it
	// answered gone. Close deletes the tokens and leaves the lease alone.
	// Default: nil, a lease of the Storage's own (TTL OpTimeout plus
	// WriteLeaseTTL), granted at the first read-modify-write, kept alive
	// and revoked by Close.
	Lease func(ctx context.Context) (clientv3.LeaseID, error)
}

// Layout under Prefix (the watch covers k/ to m/quiet, and q/):
//
//	k/<key>                 a key's value
//	m/quiet                 written in a barrier arrival's transaction: the
//	                        key it names changed quietly in that revision
//	m/t/<node>/<stripe>     the last read-modify-write attempt applied
//	q/<hex(name)>/<unique>  one queue element; order is etcd's create revision
//	u/<key>                 an unwatched key's value
//	uq/<hex(name)>/<unique> an element of an unwatched queue
//	c/<hex(k)>/<gen>/<i>    chunk i of generation gen of a large value at
//	                        etcd key k (k/<key> or u/<key>), which holds
//	                        the value's head (see Large values)
//	m/w/<hex(k)>/<gen>      generation gen is being written, under the
//	                        writer's lease (see Large values)
const (
	keysDir      = "k/"
	queuesDir    = "q/"
	quietKey     = "m/quiet"
	tokenDir     = "m/t/" // m/t/<node>/<stripe>: see update
	unwatchedDir = "u/"
	// unwatchedQueuesDir holds the queues named in Unwatched.
	unwatchedQueuesDir = "uq/"
	chunksDir          = "c/"
	// writesDir is after tokenDir, out of the watch's range.
	writesDir = "m/w/"
)

// Large values. etcd refuses a request over its --max-request-bytes (1.5
// MiB by default), and PyTorch's workers set larger values (object
// broadcasts). A value over chunkSize, or one that would read as a head, is
// stored in chunks of chunkSize under a generation of its own, each put a
// request of its own; then one transaction puts the key's head (chunkMagic,
// the generation, the count of chunks and the size), provided its first
// and last chunks are still there, and deletes the chunks of the value it
// replaces. A reader reads the head, then the chunks at the head's
// revision: the value before or after a write, never half of one. A write
// of a small value, and a delete, remove whatever chunks the key had in
// the same transaction. So a key's chunks live exactly as long as its
// head, except the chunks of a writer that dies between its chunks and
// its head. Those are swept (storage_sweep.go): a writer marks its
// generation in flight under a lease of its own before its first chunk,
// renews the lease while it writes and revokes it once done; a sweep
// deletes the generations that no head names and no live mark protects.
//
// The watch (storage_watch.go) sees heads, not values: WATCH_KEY's
// registrations are handed the values the heads stand for.
const (
	// chunkSize leaves room under etcd's default request limit for a
	// chunk's key and the request's framing, and stays under the gRPC
	// client's default 2 MiB for a read.
	chunkSize = 1 << 20
	// chunkMagic starts every head; no user value is stored inline with
	// it (such a value is stored in chunks), so a head is never mistaken
	// for a value, nor a value for a head.
	chunkMagic = "\x00gorun/etcd-chunked/1\x00"
)

// numStripes spreads read-modify-write operations of one node over this
// many locks, so that local clients of one counter take turns instead of
// failing each other's transactions, and clients of different keys batch
// together (TestStorageBatches: 16 stripes made 96 concurrent adds take
// 32 transactions). Each stripe a Storage has used holds one token key in
// etcd while the Storage lives (see update), under its lease: a node's
// worker store touches many keys (the shrink board's), so it holds up to
// numStripes.
const numStripes = 64

// Storage is a tcpstore.Storage whose keys and queues live in etcd, so a
// tcpstore.Server on every node serves one store to PyTorch workers and no
// node holds it.
//
// Set, Get and QueuePush are one plain etcd operation. Add, CompareSet,
// Append and Barrier are compare-and-swap transactions on the key's
// mod_revision, atomic across nodes. Concurrent callers' operations of
// both kinds travel together in one etcd request (batch.go). Delete, Check,
// NumKeys and the like are requests of their own, reading at one revision.
// Waits, barriers and WATCH_KEY are released by one etcd watch on the
// prefix, whichever node wrote the key.
//
// A queue push wakes one waiter on each node (a waiter that then finds the
// queue empty pops nothing, as with a race between two local poppers).
type Storage struct {
	cli     *clientv3.Client
	prefix  string
	timeout time.Duration
	attempt time.Duration // an etcd request's first patience (AttemptTimeout)
	// leaseTTL is StorageConfig.WriteLeaseTTL.
	leaseTTL time.Duration
	log      *zap.Logger
	id       string // names this Storage's queue elements, chunks and tokens
	seq      atomic.Uint64
	lastPush atomic.Int64 // pushClock's last figure

	seed    maphash.Seed
	stripes [numStripes]stripe
	tokens  tokenLease // see storage_lease.go
	batch   batcher

	ctx    context.Context
	cancel context.CancelFunc
	loops  sync.WaitGroup // the watch loops

	mu       sync.Mutex
	waiters  map[string]map[*waiter]struct{} // by key
	barriers map[string]map[*barrier]struct{}
	watches  map[string]map[*watch]struct{}
	// unwatched are StorageConfig.Unwatched, the prefixes (names ending
	// in "*") in unwatchedPrefixes; read-only after NewStorage.
	unwatched         map[string]bool
	unwatchedPrefixes []string
	// watchingOld: the second watch, with previous values, runs (see
	// Watch).
	watchingOld bool
}

var _ tcpstore.Storage = (*Storage)(nil)

// stripe serializes this node's read-modify-writes of some keys and
// remembers their last known values, the first guess of the next
// transaction.
type stripe struct {
	mu    sync.Mutex
	cache map[string]known
}

type known struct {
	val    []byte
	modRev int64 // 0: absent
}

const maxCachePerStripe = 1024

// NewStorage returns a Storage on cli under cfg.Prefix and starts its watch.
// cli stays the caller's; Close the Storage before closing cli.
func NewStorage(ctx context.Context, cli *clientv3.Client, cfg StorageConfig) (*Storage, error) {
	if cfg.Prefix == "" {
		return nil, fmt.Errorf("%w: etcd storage needs a prefix", rendezvous.ErrInvalidArgument)
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 60 * time.Second
	}
	if cfg.AttemptTimeout <= 0 {
		cfg.AttemptTimeout = DefaultAttemptTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.BatchInflight <= 0 {
		cfg.BatchInflight = 2
	}
	if cfg.WriteLeaseTTL <= 0 {
		cfg.WriteLeaseTTL = 10 * time.Second
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	s := &Storage{
		cli:      cli,
		prefix:   cfg.Prefix,
		timeout:  cfg.OpTimeout,
		attempt:  cfg.AttemptTimeout,
		leaseTTL: cfg.WriteLeaseTTL,
		log:      cfg.Logger,
		id:       hex.EncodeToString(id[:]),
		seed:     maphash.MakeSeed(),
		waiters:  make(map[string]map[*waiter]struct{}),
		barriers: make(map[string]map[*barrier]struct{}),
		watches:  make(map[string]map[*watch]struct{}),
		tokens:   tokenLease{shared: cfg.Lease, kept: make(chan clientv3.LeaseID, 1)},
	}
	for i := range s.stripes {
		s.stripes[i].cache = make(map[string]known)
	}
	s.batch = batcher{s: s, maxInflight: cfg.BatchInflight, maxOps: maxBatchOps}
	if len(cfg.Unwatched) > 0 {
		s.unwatched = make(map[string]bool, len(cfg.Unwatched))
		for _, k := range cfg.Unwatched {
			if p, ok := strings.CutSuffix(k, "*"); ok {
				s.unwatchedPrefixes = append(s.unwatchedPrefixes, p)
				continue
			}
			s.unwatched[k] = true
		}
	}
	// The watch starts after a revision no later than any that an
	// operation after NewStorage reads.
	rev := cfg.StartRevision
	if rev <= 0 {
		rctx, cancel := context.WithTimeout(ctx, cfg.OpTimeout)
		resp, err := cli.Get(rctx, s.prefix+quietKey, clientv3.WithCountOnly())
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w: etcd storage at %q: %w", rendezvous.ErrUnavailable, cfg.Prefix, err)
		}
		rev = resp.Header.Revision
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.loops.Add(3)
	go s.watchLoop(rev+1, watchKeys)
	go s.watchLoop(rev+1, watchQueues)
	go s.sweepLoop()
	if cfg.Lease == nil {
		s.loops.Add(1)
		go s.keepTokens()
	}
	return s, nil
}

// Close stops the watch and deletes this Storage's bookkeeping (the tokens
// of its read-modify-writes, which no operation needs once none is in
// flight, and their lease if it is the Storage's own). Registered waiters
// are never released afterwards; the data stays in etcd (see Drop).
func (s *Storage) Close() error {
	s.cancel()
	s.loops.Wait()
	s.batch.close()
	// Briefly: an agent leaving a broken etcd should not hang on this.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s.revokeTokens(ctx)
	_, err := s.cli.Delete(ctx, s.prefix+tokenDir+s.id+"/", clientv3.WithPrefix())
	return err
}

// Drop deletes everything under the Storage's prefix.
func (s *Storage) Drop(ctx context.Context) error {
	_, err := s.cli.Delete(ctx, s.prefix, clientv3.WithPrefix())
	return err
}

// Prefix returns where the store lives in etcd.
func (s *Storage) Prefix() string { return s.prefix }

func (s *Storage) kkey(key []byte) string {
	if s.isUnwatched(key) {
		return s.prefix + unwatchedDir + string(key)
	}
	return s.prefix + keysDir + string(key)
}

// isUnwatched reports whether key (or queue) is one of StorageConfig's
// Unwatched.
func (s *Storage) isUnwatched(key []byte) bool {
	if s.unwatched[string(key)] {
		return true
	}
	for _, p := range s.unwatchedPrefixes {
		if strings.HasPrefix(string(key), p) {
			return true
		}
	}
	return false
}

// refuseUnwatched fails an operation that would wait on one of keys when
// it is unwatched: nothing would ever release it.
func (s *Storage) refuseUnwatched(op string, keys ...[]byte) error {
	for _, k := range keys {
		if s.isUnwatched(k) {
			return fmt.Errorf("%w: etcd storage %s %q: the key is unwatched", rendezvous.ErrInvalidArgument, op, k)
		}
	}
	return nil
}

func (s *Storage) qdir(name []byte) string {
	if s.isUnwatched(name) {
		return s.prefix + unwatchedQueuesDir + hex.EncodeToString(name) + "/"
	}
	return s.prefix + queuesDir + hex.EncodeToString(name) + "/"
}

func (s *Storage) opCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(s.ctx, s.timeout)
}

func (s *Storage) fail(op string, key []byte, err error) error {
	switch {
	case errors.Is(err, rendezvous.ErrNotInteger):
		return err
	case tooLarge(err):
		return fmt.Errorf("%w: etcd storage %s %q: more than one etcd request carries (etcd's --max-request-bytes): %w",
			rendezvous.ErrTooLarge, op, key, err)
	case errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded:
		// etcd did not answer within OpTimeout: slow (or down, and
		// perhaps back soon), which a caller may wait out, as it would
		// not a store that hung up.
		return fmt.Errorf("%w: etcd storage %s %q: no answer in %v: %w", rendezvous.ErrTimeout, op, key, s.timeout, err)
	}
	return fmt.Errorf("%w: etcd storage %s %q: %w", rendezvous.ErrUnavailable, op, key, err)
}

// tooLarge reports whether etcd, or the gRPC client before it, refused a
// request for its size: no retry helps.
func tooLarge(err error) bool {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) && ee.Error() == rpctypes.ErrRequestTooLarge.Error() {
		return true
	}
	return status.Code(err) == codes.ResourceExhausted
}

// Set stores value: inline, or in chunks when large (see Large values).
// An inline value replaces a head together with its chunks, in one
// transaction that tells a head from a value by comparing the key's value
// with chunkMagic.
func (s *Storage) Set(key, value []byte) error {
	k := s.kkey(key)
	if chunked(value) {
		if err := s.setChunked(k, value); err != nil {
			return s.fail("set", key, err)
		}
		return nil
	}
	put := clientv3.OpPut(k, string(value))
	op := clientv3.OpTxn(isHead(k), []clientv3.Op{put, clientv3.OpDelete(s.chunkDir(k), clientv3.WithPrefix())}, []clientv3.Op{put})
	if _, _, err := s.batch.do(op, len(k)+len(value), k, s.chunkDir(k)); err != nil {
		return s.fail("set", key, err)
	}
	return nil
}

// chunked reports whether v is stored in chunks.
func chunked(v []byte) bool {
	return len(v) > chunkSize || bytes.HasPrefix(v, []byte(chunkMagic))
}

// isHead compares true when etcd key k holds a head: a value starting with
// chunkMagic is above it and below chunkMagic with its last byte raised
// (and never equal to it: a head is longer). A comparison of an absent
// key's value is false.
func isHead(k string) []clientv3.Cmp {
	end := []byte(chunkMagic)
	end[len(end)-1]++
	return []clientv3.Cmp{
		clientv3.Compare(clientv3.Value(k), ">", chunkMagic),
		clientv3.Compare(clientv3.Value(k), "<", string(end)),
	}
}

// head is a parsed head.
type head struct {
	gen  string
	n    int
	size int
}

func (h head) bytes() []byte {
	return []byte(chunkMagic + h.gen + " " + strconv.Itoa(h.n) + " " + strconv.Itoa(h.size))
}

// parseHead reads a head; ok is false for any other value.
func parseHead(v []byte) (head, bool) {
	rest, ok := bytes.CutPrefix(v, []byte(chunkMagic))
	if !ok {
		return head{}, false
	}
	f := strings.Fields(string(rest))
	if len(f) != 3 {
		return head{}, false
	}
	n, err1 := strconv.Atoi(f[1])
	size, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || n < 1 || size < 0 {
		return head{}, false
	}
	return head{gen: f[0], n: n, size: size}, true
}

// chunkDir is where the chunks of etcd key k live, every generation.
func (s *Storage) chunkDir(k string) string {
	return s.prefix + chunksDir + hex.EncodeToString([]byte(strings.TrimPrefix(k, s.prefix))) + "/"
}

func (s *Storage) chunkKey(k, gen string, i int) string {
	return s.chunkDir(k) + gen + "/" + fmt.Sprintf("%08d", i)
}

// chunkWrite is a generation of a large value's chunks, written and not
// yet named by a head, with the lease its mark in flight lives under.
type chunkWrite struct {
	head
	lease clientv3.LeaseID
}

// writeChunks marks a new generation in flight, puts value's chunks under
// it and returns it. The caller names it in a head (then settle) or drops
// it (dropChunks).
func (s *Storage) writeChunks(ctx context.Context, k string, value []byte) (chunkWrite, error) {
	w := chunkWrite{head: head{gen: s.id + strconv.FormatUint(s.seq.Add(1), 16), n: (len(value) + chunkSize - 1) / chunkSize, size: len(value)}}
	ttl := int64(max(1, (s.leaseTTL+time.Second-1)/time.Second))
	err := s.retry(ctx, func(ctx context.Context) error {
		g, err := s.cli.Grant(ctx, ttl)
		if err == nil {
			w.lease = g.ID
		}
		return err
	})
	if err == nil {
		err = s.retry(ctx, func(ctx context.Context) error {
			_, err := s.cli.Put(ctx, s.markKey(k, w.gen), "", clientv3.WithLease(w.lease))
			return err
		})
	}
	renewed := time.Now()
	for i := 0; err == nil && i < w.n; i++ {
		if time.Since(renewed) > s.leaseTTL/3 {
			// A sweep takes a generation whose mark lapsed for an orphan.
			if _, err = s.cli.KeepAliveOnce(ctx, w.lease); err != nil {
				break
			}
			renewed = time.Now()
		}
		c := value[i*chunkSize : min(len(value), (i+1)*chunkSize)]
		err = s.retry(ctx, func(ctx context.Context) error {
			_, err := s.cli.Put(ctx, s.chunkKey(k, w.gen, i), string(c))
			return err
		})
	}
	if err != nil {
		s.dropChunks(k, w)
		return chunkWrite{}, err
	}
	return w, nil
}

// markKey is where generation gen of etcd key k is marked in flight.
func (s *Storage) markKey(k, gen string) string {
	return s.prefix + writesDir + hex.EncodeToString([]byte(strings.TrimPrefix(k, s.prefix))) + "/" + gen
}

// dropChunks deletes a generation that no head names, and its mark (best
// effort: a generation left behind is swept later, see sweep).
func (s *Storage) dropChunks(k string, w chunkWrite) {
	ctx, cancel := s.opCtx()
	defer cancel()
	_ = s.retry(ctx, func(ctx context.Context) error {
		_, err := s.cli.Delete(ctx, s.chunkDir(k)+w.gen+"/", clientv3.WithPrefix())
		return err
	})
	s.unmark(w)
}

// unmark revokes a generation's lease, and so its mark in flight (best
// effort: the lease lapses by itself within WriteLeaseTTL).
func (s *Storage) unmark(w chunkWrite) {
	if w.lease == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(s.ctx), time.Second)
	defer cancel()
	_, _ = s.cli.Revoke(ctx, w.lease)
}

// settle follows a head's write that named w: w is no longer in flight,
// and the generations that earlier writers of k left behind go.
func (s *Storage) settle(k string, w chunkWrite) {
	s.unmark(w)
	ctx, cancel := s.opCtx()
	defer cancel()
	if _, err := s.sweep(ctx, s.chunkDir(k)); err != nil && s.ctx.Err() == nil {
		s.log.Debug("etcd storage: sweeping a key's chunks", zap.String("key", k), zap.Error(err))
	}
}

// headWrite returns what a transaction that puts head h at k (replacing
// old, the key's current raw value) compares and does: the chunks of h
// must still be there (a small write or a delete of k since removes every
// generation, a sweep an unmarked one), and the chunks of old, if a head,
// go.
func (s *Storage) headWrite(k string, h head, old []byte) ([]clientv3.Cmp, []clientv3.Op) {
	cmps := []clientv3.Cmp{
		clientv3.Compare(clientv3.CreateRevision(s.chunkKey(k, h.gen, 0)), ">", 0),
		clientv3.Compare(clientv3.CreateRevision(s.chunkKey(k, h.gen, h.n-1)), ">", 0),
	}
	ops := []clientv3.Op{clientv3.OpPut(k, string(h.bytes()))}
	if oh, ok := parseHead(old); ok && oh.gen != h.gen {
		ops = append(ops, clientv3.OpDelete(s.chunkDir(k)+oh.gen+"/", clientv3.WithPrefix()))
	}
	return cmps, ops
}

// setChunked stores a large value: chunks first, then the head, fenced on
// the key's mod revision so that the chunks of what it replaces are known.
func (s *Storage) setChunked(k string, value []byte) error {
	ctx, cancel := s.opCtx()
	defer cancel()
	w, err := s.writeChunks(ctx, k, value)
	if err != nil {
		return err
	}
	for {
		cur, err := s.get(ctx, k)
		if err != nil {
			s.dropChunks(k, w)
			return err
		}
		var old []byte
		var modRev int64
		if len(cur.Kvs) > 0 {
			old, modRev = cur.Kvs[0].Value, cur.Kvs[0].ModRevision
		}
		if oh, ok := parseHead(old); ok && oh.gen == w.gen {
			s.settle(k, w) // an earlier sending applied it (its answer was lost)
			return nil
		}
		cmps, ops := s.headWrite(k, w.head, old)
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k), "=", modRev))
		var tx *clientv3.TxnResponse
		err = s.retry(ctx, func(ctx context.Context) (err error) {
			tx, err = s.cli.Txn(ctx).If(cmps...).Then(ops...).Else(
				clientv3.OpGet(s.chunkKey(k, w.gen, 0), clientv3.WithCountOnly()),
				clientv3.OpGet(s.chunkKey(k, w.gen, w.n-1), clientv3.WithCountOnly())).Commit()
			return err
		})
		switch {
		case err != nil:
			s.dropChunks(k, w)
			return err
		case tx.Succeeded:
			s.settle(k, w)
			return nil
		case tx.Responses[0].GetResponseRange().Count == 0 || tx.Responses[1].GetResponseRange().Count == 0:
			// A small write, a delete or a sweep took the chunks: write
			// them again.
			s.dropChunks(k, w)
			if w, err = s.writeChunks(ctx, k, value); err != nil {
				return err
			}
		}
		// Else the key changed since the read: read it again.
	}
}

// resolve returns the value that raw, read at etcd key k at revision rev,
// stands for: raw itself, or the chunks a head names, read at rev.
// errStale: the chunks are gone at rev (compacted): read the head again.
func (s *Storage) resolve(ctx context.Context, k string, raw []byte, rev int64) ([]byte, error) {
	h, ok := parseHead(raw)
	if !ok {
		return raw, nil
	}
	out := make([]byte, 0, h.size)
	for i := range h.n {
		r, err := s.get(ctx, s.chunkKey(k, h.gen, i), clientv3.WithRev(rev))
		switch {
		case errors.Is(err, rpctypes.ErrCompacted):
			return nil, errStale
		case err != nil:
			return nil, err
		case len(r.Kvs) == 0:
			return nil, fmt.Errorf("%w: chunk %d of %d of %q is missing at revision %d", errStale, i, h.n, k, rev)
		}
		out = append(out, r.Kvs[0].Value...)
	}
	if len(out) != h.size {
		return nil, fmt.Errorf("%w: the chunks of %q hold %d bytes, the head says %d", errStale, k, len(out), h.size)
	}
	return out, nil
}

// errStale: a large value's chunks were not found where its head said, at
// its revision: read the key again.
var errStale = errors.New("chunks gone at the head's revision")

// Get returns key's value, putting a large one together from its chunks.
func (s *Storage) Get(key []byte) ([]byte, bool, error) {
	k := s.kkey(key)
	for range 8 {
		resp, rev, err := s.batch.do(clientv3.OpGet(k), len(key))
		if err != nil {
			return nil, false, s.fail("get", key, err)
		}
		kvs := resp.GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			return nil, false, nil
		}
		ctx, cancel := s.opCtx()
		v, err := s.resolve(ctx, k, kvs[0].Value, rev)
		cancel()
		switch {
		case errors.Is(err, errStale):
			continue
		case err != nil:
			return nil, false, s.fail("get", key, err)
		}
		return v, true, nil
	}
	return nil, false, s.fail("get", key, errStale)
}

// change is what an update function decides for a key's current value.
type change struct {
	result []byte // what the operation answers
	write  bool   // store result as the new value
	n      int64  // a counter's new value
	extra  []clientv3.Op
}

// update runs f on key's current value and stores what it decides in a
// transaction fenced on the key's mod_revision, retrying on a concurrent
// change. The first guess is the value this node last saw. The
// transaction travels in a batch (batch.go), which is sent again when its
// outcome is unknown (a leader lost mid-request).
//
// Every writing attempt also stamps a token key of this node and stripe
// with the attempt's id, and a failed comparison returns the token: a
// transaction's comparison is evaluated when it is applied, so at most one
// attempt of an operation can apply, and when the token shows this
// attempt, it was applied by an earlier sending of its batch. An increment
// is never applied twice: a token found absent after a sending again is
// believed only while its lease lives (see Tokens).
func (s *Storage) update(op string, key []byte, f func(cur []byte, exists bool) (change, error)) (change, error) {
	k := s.kkey(key)
	st, tok := s.stripe(k)
	st.mu.Lock()
	defer st.mu.Unlock()
	opID := strconv.FormatUint(s.seq.Add(1), 16) + "."
	guess, verified := st.cache[k], false
	var big chunkWrite           // the chunks written for this operation's last large result
	var refused clientv3.LeaseID // a lease etcd found gone
	refusals := 0
	defer func() {
		if big.gen != "" {
			s.dropChunks(k, big) // not the value stored: see the success paths
		}
	}()
	for attempt := 0; ; attempt++ {
		// guess.val is what etcd holds (a head, for a large value): f
		// decides on the value it stands for.
		cur := guess.val
		if _, ok := parseHead(cur); ok {
			ctx, cancel := s.opCtx()
			v, err := s.resolve(ctx, k, cur, guess.modRev)
			cancel()
			switch {
			case errors.Is(err, errStale):
				guess, verified = s.reread(k)
				continue
			case err != nil:
				return change{}, s.fail(op, key, err)
			}
			cur = v
		}
		ch, err := f(cur, guess.modRev != 0)
		if err != nil && verified {
			return change{}, err
		}
		if err == nil && !ch.write && verified {
			return ch, nil
		}
		id := opID + strconv.Itoa(attempt)
		lctx, lcancel := s.opCtx()
		lease, err2 := s.lease(lctx, refused)
		lcancel()
		if err2 != nil {
			return change{}, s.fail(op, key, err2)
		}
		var then []clientv3.Op
		writes := []string{k, tok}
		size := len(k) + len(tok) + len(id)
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(k), "=", guess.modRev)}
		stored := ch.result // what k holds if the transaction applies
		if big.gen != "" && (err != nil || !ch.write || !chunked(ch.result)) {
			s.dropChunks(k, big) // an earlier attempt's: this one stores no large value
			big = chunkWrite{}
		}
		if err == nil && ch.write {
			var put []clientv3.Op
			if chunked(ch.result) {
				if big.gen != "" {
					s.dropChunks(k, big)
				}
				ctx, cancel := s.opCtx()
				big, err = s.writeChunks(ctx, k, ch.result)
				cancel()
				if err != nil {
					return change{}, s.fail(op, key, err)
				}
				var more []clientv3.Cmp
				more, put = s.headWrite(k, big.head, guess.val)
				cmps = append(cmps, more...)
				stored = big.bytes()
			} else {
				put = []clientv3.Op{clientv3.OpPut(k, string(ch.result))}
				if oh, ok := parseHead(guess.val); ok {
					put = append(put, clientv3.OpDelete(s.chunkDir(k)+oh.gen+"/", clientv3.WithPrefix()))
				}
			}
			then = append(put, ch.extra...)
			then = append(then, clientv3.OpPut(tok, id, clientv3.WithLease(lease)))
			writes = append(writes, s.chunkDir(k))
			for _, e := range ch.extra {
				writes = append(writes, string(e.KeyBytes()))
				size += len(e.KeyBytes()) + len(e.ValueBytes())
			}
			size += len(stored)
		}
		r, rev, resent, terr := s.batch.doTokened(clientv3.OpTxn(cmps, then,
			[]clientv3.Op{clientv3.OpGet(k), clientv3.OpGet(tok)},
		), size, writes...)
		if s.leaseRefused(terr, lease, &refusals) {
			refused = lease // nothing applied: again, under another
			continue
		}
		if terr != nil {
			return change{}, s.fail(op, key, terr)
		}
		tx := r.GetResponseTxn()
		if tx.Succeeded {
			if err != nil {
				return change{}, err
			}
			if ch.write {
				guess = known{val: stored, modRev: rev}
			}
			if big.gen != "" {
				s.settle(k, big) // stored: its chunks stay
				big = chunkWrite{}
			}
			st.remember(k, guess)
			return ch, nil
		}
		now := tx.Responses
		if kvs := now[1].GetResponseRange().Kvs; len(then) > 0 && len(kvs) > 0 && string(kvs[0].Value) == id {
			st.remember(k, known{}) // applied at a revision not known: guess afresh
			if big.gen != "" {
				s.settle(k, big)
				big = chunkWrite{}
			}
			return ch, nil
		}
		if resent && len(then) > 0 && !s.tokenLives(lease) {
			return change{}, s.fail(op, key, errOutcomeUnknown)
		}
		guess, verified = known{}, true
		if kvs := now[0].GetResponseRange().Kvs; len(kvs) > 0 {
			guess = known{val: kvs[0].Value, modRev: kvs[0].ModRevision}
		}
	}
}

// reread reads etcd key k afresh, for update's next guess (verified).
func (s *Storage) reread(k string) (known, bool) {
	ctx, cancel := s.opCtx()
	defer cancel()
	r, err := s.get(ctx, k)
	if err != nil || len(r.Kvs) == 0 {
		return known{}, err == nil
	}
	return known{val: r.Kvs[0].Value, modRev: r.Kvs[0].ModRevision}, true
}

// stripe returns the stripe of an etcd key and the stripe's token key.
func (s *Storage) stripe(k string) (*stripe, string) {
	i := maphash.String(s.seed, k) % numStripes
	return &s.stripes[i], s.prefix + tokenDir + s.id + "/" + strconv.FormatUint(i, 10)
}

// retry runs fn under the Storage's retry policy (storageRetry).
func (s *Storage) retry(ctx context.Context, fn func(context.Context) error) error {
	attempt := s.attempt
	if attempt <= 0 {
		attempt = DefaultAttemptTimeout
	}
	return storageRetry(attempt).do(ctx, fn)
}

func (st *stripe) remember(k string, v known) {
	if _, ok := st.cache[k]; !ok && len(st.cache) >= maxCachePerStripe {
		clear(st.cache)
	}
	st.cache[k] = v
}

func (s *Storage) Add(key []byte, delta int64) (int64, error) {
	ch, err := s.update("add", key, func(cur []byte, ok bool) (change, error) {
		return counterChange(cur, ok, delta)
	})
	return ch.n, err
}

func counterChange(cur []byte, ok bool, delta int64) (change, error) {
	n, v, err := rendezvous.AddCounter(cur, ok, delta)
	return change{result: v, write: true, n: n}, err
}

func (s *Storage) CompareSet(key, expected, desired []byte) ([]byte, error) {
	ch, err := s.update("compare_set", key, func(cur []byte, ok bool) (change, error) {
		switch {
		case !ok && len(expected) != 0:
			// c10d answers with expected itself and stores nothing.
			return change{result: bytes.Clone(expected)}, nil
		case ok && !bytes.Equal(cur, expected):
			return change{result: cur}, nil
		}
		return change{result: bytes.Clone(desired), write: true}, nil
	})
	return ch.result, err
}

func (s *Storage) Append(key, value []byte) error {
	_, err := s.update("append", key, func(cur []byte, _ bool) (change, error) {
		v := make([]byte, 0, len(cur)+len(value))
		return change{result: append(append(v, cur...), value...), write: true}, nil
	})
	return err
}

func (s *Storage) Delete(key []byte) (bool, error) {
	ctx, cancel := s.opCtx()
	defer cancel()
	var deleted bool
	k := s.kkey(key)
	err := s.retry(ctx, func(ctx context.Context) error {
		// The key and any chunks of it, together.
		resp, err := s.cli.Txn(ctx).Then(clientv3.OpDelete(k), clientv3.OpDelete(s.chunkDir(k), clientv3.WithPrefix())).Commit()
		if err == nil {
			// A retry after a lost answer may find the key gone by the
			// first attempt: it existed.
			deleted = deleted || resp.Responses[0].GetResponseDeleteRange().Deleted > 0
		}
		return err
	})
	if err != nil {
		return false, s.fail("delete", key, err)
	}
	return deleted, nil
}

// existence reads, at one revision, whether each key exists as Check counts
// (a key, or a non-empty queue of that name), and returns that revision.
func (s *Storage) existence(keys [][]byte) ([]bool, int64, error) {
	ctx, cancel := s.opCtx()
	defer cancel()
	ops := make([]clientv3.Op, 0, 2*len(keys))
	for _, k := range keys {
		ops = append(ops,
			clientv3.OpGet(s.kkey(k), clientv3.WithCountOnly()),
			clientv3.OpGet(s.qdir(k), clientv3.WithPrefix(), clientv3.WithCountOnly()))
	}
	var resp *clientv3.TxnResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Txn(ctx).Then(ops...).Commit()
		return err
	})
	if err != nil {
		return nil, 0, s.fail("check", nil, err)
	}
	out := make([]bool, len(keys))
	for i := range keys {
		out[i] = resp.Responses[2*i].GetResponseRange().Count > 0 ||
			resp.Responses[2*i+1].GetResponseRange().Count > 0
	}
	return out, resp.Header.Revision, nil
}

func (s *Storage) Check(keys [][]byte) (bool, error) {
	ex, _, err := s.existence(keys)
	if err != nil {
		return false, err
	}
	for _, ok := range ex {
		if !ok {
			return false, nil
		}
	}
	return true, nil
}

// keyRanges reads the watched and the unwatched keys at one revision.
func (s *Storage) keyRanges(op string, opts ...clientv3.OpOption) ([]*clientv3.GetResponse, error) {
	ctx, cancel := s.opCtx()
	defer cancel()
	opts = append(opts, clientv3.WithPrefix())
	var resp *clientv3.TxnResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Txn(ctx).Then(
			clientv3.OpGet(s.prefix+keysDir, opts...),
			clientv3.OpGet(s.prefix+unwatchedDir, opts...),
		).Commit()
		return err
	})
	if err != nil {
		return nil, s.fail(op, nil, err)
	}
	out := make([]*clientv3.GetResponse, len(resp.Responses))
	for i, r := range resp.Responses {
		out[i] = (*clientv3.GetResponse)(r.GetResponseRange())
	}
	return out, nil
}

func (s *Storage) NumKeys() (int64, error) {
	rs, err := s.keyRanges("num_keys", clientv3.WithCountOnly())
	if err != nil {
		return 0, err
	}
	return rs[0].Count + rs[1].Count, nil
}

func (s *Storage) Keys() ([][]byte, error) {
	rs, err := s.keyRanges("list_keys", clientv3.WithKeysOnly())
	if err != nil {
		return nil, err
	}
	var out [][]byte
	n := len(s.prefix + keysDir) // as long as unwatchedDir
	for _, r := range rs {
		for _, kv := range r.Kvs {
			out = append(out, kv.Key[n:])
		}
	}
	return out, nil
}

func (s *Storage) QueuePush(key, value []byte) error {
	el := s.element(key)
	// A retry puts the same element again: never a duplicate.
	if _, _, err := s.batch.do(clientv3.OpPut(el, string(value)), 0); err != nil {
		return s.fail("queue_push", key, err)
	}
	return nil
}

// element names a new element of the queue named key. The name is the
// element's place in the queue, which is read in key order: etcd applies a
// read's limit before anything but key order, so a pop of 100 elements
// from a queue of 10,000 read 100 keys where, sorted by their creation,
// it read all 10,000 (20 ms a pop, 2.7 ms in key order). The name is the
// push's wall-clock time, in nanoseconds in fixed-width hex and later
// than this Storage's previous push's, then this Storage's id: unique,
// and a retry of the push puts it again rather than a second one. Pushes
// one after another therefore come out in order, on one host exactly and
// across hosts as far as their clocks agree (NTP keeps them within a
// millisecond, less than one push takes); pushes at once, in either
// order, as on any server.
func (s *Storage) element(key []byte) string {
	return s.qdir(key) + fmt.Sprintf("%016x", s.pushClock()) + s.id
}

// pushClock is now in nanoseconds since the epoch, or one more than the
// last figure it gave, whichever is later.
func (s *Storage) pushClock() int64 {
	for {
		last := s.lastPush.Load()
		t := max(time.Now().UnixNano(), last+1)
		if s.lastPush.CompareAndSwap(last, t) {
			return t
		}
	}
}

func (s *Storage) QueuePop(key []byte) ([]byte, int64, error) {
	vs, n, err := s.popHead(key, 1)
	if err != nil || len(vs) == 0 {
		return nil, 0, err
	}
	return vs[0], n, nil
}

// popBatchMax bounds QueuePopBatch's elements per transaction: etcd
// refuses a transaction of more than --max-txn-ops (128 by default)
// operations, and each element is one, plus the token.
const popBatchMax = 100

// QueuePopBatch removes up to max elements from the head of a queue in one
// read and one transaction (QueuePop takes two requests per element) and
// returns them in order; an empty queue gives none.
func (s *Storage) QueuePopBatch(key []byte, max int) ([][]byte, error) {
	max = min(max, popBatchMax)
	if max <= 0 {
		return nil, nil
	}
	vs, _, err := s.popHead(key, max)
	return vs, err
}

// popHead removes up to max elements from the head of a queue and returns
// them with the queue's length before. The pop takes effect at the read's
// revision: the elements are still there, so nobody popped them in
// between (a push since goes behind them, or, from a host whose clock is
// behind, ahead of them: a push at once with this pop, in either order).
// With the answer lost, the token says whether this pop took them.
func (s *Storage) popHead(key []byte, max int) ([][]byte, int64, error) {
	dir := s.qdir(key)
	st, tok := s.stripe(dir)
	st.mu.Lock()
	defer st.mu.Unlock()
	ctx, cancel := s.opCtx()
	defer cancel()
	var refused clientv3.LeaseID // a lease etcd found gone
	refusals := 0
	for {
		resp, err := s.get(ctx, dir, clientv3.WithPrefix(), clientv3.WithLimit(int64(max))) // key order (element)
		if err != nil {
			return nil, 0, s.fail("queue_pop", key, err)
		}
		if len(resp.Kvs) == 0 {
			return nil, 0, nil
		}
		cmps := make([]clientv3.Cmp, len(resp.Kvs))
		ops := make([]clientv3.Op, 0, len(resp.Kvs)+1)
		for i, kv := range resp.Kvs {
			cmps[i] = clientv3.Compare(clientv3.CreateRevision(string(kv.Key)), "=", kv.CreateRevision)
			ops = append(ops, clientv3.OpDelete(string(kv.Key)))
		}
		id := strconv.FormatUint(s.seq.Add(1), 16)
		lease, err := s.lease(ctx, refused)
		if err != nil {
			return nil, 0, s.fail("queue_pop", key, err)
		}
		ops = append(ops, clientv3.OpPut(tok, id, clientv3.WithLease(lease)))
		var popped bool
		sends := 0
		err = s.retry(ctx, func(ctx context.Context) error {
			sends++
			tx, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Else(clientv3.OpGet(tok)).Commit()
			if err != nil {
				return markLeaseGone(err)
			}
			popped = tx.Succeeded
			if kvs := tx.Responses[0].GetResponseRange().GetKvs(); !popped && len(kvs) > 0 {
				popped = string(kvs[0].Value) == id
			}
			return nil
		})
		if s.leaseRefused(err, lease, &refusals) {
			refused = lease // nothing popped: again, under another
			continue
		}
		if err != nil {
			return nil, 0, s.fail("queue_pop", key, err)
		}
		if !popped && sends > 1 && !s.tokenLives(lease) {
			return nil, 0, s.fail("queue_pop", key, errOutcomeUnknown)
		}
		if popped {
			out := make([][]byte, len(resp.Kvs))
			for i, kv := range resp.Kvs {
				out[i] = kv.Value
			}
			return out, resp.Count, nil
		}
	}
}

// get is a Get retried across leader changes (reads are safe to repeat).
func (s *Storage) get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	var resp *clientv3.GetResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Get(ctx, key, opts...)
		return err
	})
	return resp, err
}

func (s *Storage) QueueLen(key []byte) (int64, error) {
	ctx, cancel := s.opCtx()
	defer cancel()
	resp, err := s.get(ctx, s.qdir(key), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return 0, s.fail("queue_len", key, err)
	}
	return resp.Count, nil
}
