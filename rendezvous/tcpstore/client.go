package tcpstore

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// ClientConfig configures a Client. The zero value is usable: every field
// has a documented default.
type ClientConfig struct {
	// Wire is the server's wire generation. GenNew (the default) opens
	// every connection with VALIDATE and PING and uses the new opcodes;
	// GenOld talks to PyTorch 1.13–2.0 servers, which have no handshake and
	// no APPEND, MULTI_*, CANCEL_WAIT, queues, LIST_KEYS or BARRIER.
	Wire Generation
	// Timeout bounds connecting and every operation whose context has no
	// deadline, as c10d's store timeout does. Default
	// rendezvous.DefaultTimeout (300 s).
	Timeout time.Duration
	// WorldSize > 0 makes Dial send ADD "init/" 1 after the first
	// handshake, as a c10d TCPStore created with world_size does, so that a
	// PyTorch master waiting for its workers counts this client. It is sent
	// once per Client, never again on a reconnect. 0: not sent.
	WorldSize int
	// ConnectBackoffMin is the first pause between connection attempts.
	// Later pauses grow by half each time up to ConnectBackoffMax, and each
	// is drawn uniformly from [pause/2, 3·pause/2), c10d's jitter: without
	// it thousands of workers that started together retry together (PyTorch
	// PR #129261). Default 100 ms.
	ConnectBackoffMin time.Duration
	// ConnectBackoffMax caps the pause between connection attempts.
	// Default 2 s.
	ConnectBackoffMax time.Duration
	// ConfirmWrites ends every write that has no reply on the wire (SET,
	// APPEND, MULTI_SET, QUEUE_PUSH) with a GETNUMKEYS on the same
	// connection, in the same TCP write, and waits for its answer. A c10d
	// server refuses a request only by closing the connection, so without
	// a following round trip a refused write looks stored; with one, it
	// fails with an error wrapping ErrHungUp. GETNUMKEYS is on both wire
	// generations and every c10d server, and changes nothing. It costs a
	// round trip per write. Default false, as c10d's own client.
	ConfirmWrites bool
}

// Defaults of the ClientConfig fields.
const (
	DefaultConnectBackoffMin = 100 * time.Millisecond
	DefaultConnectBackoffMax = 2 * time.Second
)

func (cfg ClientConfig) withDefaults() ClientConfig {
	if cfg.Timeout <= 0 {
		cfg.Timeout = rendezvous.DefaultTimeout
	}
	if cfg.ConnectBackoffMin <= 0 {
		cfg.ConnectBackoffMin = DefaultConnectBackoffMin
	}
	if cfg.ConnectBackoffMax <= 0 {
		cfg.ConnectBackoffMax = DefaultConnectBackoffMax
	}
	cfg.ConnectBackoffMax = max(cfg.ConnectBackoffMax, cfg.ConnectBackoffMin)
	return cfg
}

// Client is a c10d TCPStore client: it talks to PyTorch's TCPStore server of
// either wire generation, or to ours.
//
// Keys are sent as c10d's client sends them — KeyPrefix + key — so a Go
// Client and PyTorch's TCPStore on one server share their keys. Only the
// join counter InitKey goes on the wire without the prefix; JoinedClients
// reads it.
//
// Like c10d's client, a Client has one connection and runs one request at a
// time; concurrent calls queue for it, and the time they queue counts
// against their context (or Timeout). A connection that breaks, or that a
// cancelled context leaves mid-request, is closed, and the next operation
// reconnects.
type Client struct {
	addr string
	cfg  ClientConfig

	// turn is a one-slot semaphore held from begin to end of each
	// operation; unlike a mutex, waiting for it respects the context.
	turn chan struct{}

	// Owned by the holder of turn.
	r       *bufio.Reader // reads nc; Reset on every new connection
	buf     []byte        // the request being built, kept for reuse
	scratch [8]byte       // fixed-size replies

	// mu guards the fields below, which Close and context cancellation
	// touch without holding turn. Only the holder of turn replaces nc.
	mu      sync.Mutex
	nc      net.Conn // nil: reconnect before the next request
	closed  bool
	closing chan struct{} // closed by Close; ends backoff pauses
	seq     uint64        // numbers operations, for armed
	armed   uint64        // the operation a context cancellation may interrupt; 0: none
}

var _ rendezvous.Store = (*Client)(nil)

// Dial connects to the TCPStore server at addr ("host:port"), retrying
// refused, reset and timed-out attempts (and failed name lookups, as c10d
// does) with jittered exponential backoff until ctx's deadline or
// cfg.Timeout. On the new wire generation every connection opens with
// VALIDATE and PING. With cfg.WorldSize > 0 it then sends ADD "init/" 1.
//
// A Dial that runs out of time returns an error wrapping rendezvous.ErrTimeout
// and the context's error, naming the address and the last failure.
func Dial(ctx context.Context, addr string, cfg ClientConfig) (*Client, error) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("tcpstore: dial %q: %w: %w", addr, rendezvous.ErrInvalidArgument, err)
	}
	if cfg.Wire != GenNew && cfg.Wire != GenOld {
		return nil, fmt.Errorf("tcpstore: dial %s: %w: unknown wire generation %v", addr, rendezvous.ErrInvalidArgument, cfg.Wire)
	}
	c := &Client{
		addr:    addr,
		cfg:     cfg.withDefaults(),
		turn:    make(chan struct{}, 1),
		r:       bufio.NewReader(nil),
		closing: make(chan struct{}),
	}
	if err := c.join(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("tcpstore: connect to %s: %w", addr, err)
	}
	return c, nil
}

// join makes the first connection and, with a world size, counts this
// client in InitKey.
func (c *Client) join(ctx context.Context) error {
	k, err := c.acquire(ctx, OpValidate)
	if err != nil {
		return err
	}
	defer k.release()
	if err := k.connect(); err != nil {
		return err
	}
	if c.cfg.WorldSize > 0 {
		if _, err := k.addWire(InitKey, 1); err != nil {
			return fmt.Errorf("ADD %s: %w", InitKey, err)
		}
	}
	return nil
}

// Addr returns the server address given to Dial.
func (c *Client) Addr() string { return c.addr }

// Close closes the connection, interrupting an operation in flight. Later
// operations return an error wrapping rendezvous.ErrClosed. Close is
// idempotent and always returns nil.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	close(c.closing)
	if c.nc != nil {
		c.nc.Close() // the holder of turn sees the error and drops it
	}
	return nil
}

// Set stores value under key.
func (c *Client) Set(ctx context.Context, key string, value []byte) (err error) {
	k, err := c.begin(ctx, OpSet)
	if err != nil {
		return err
	}
	defer k.end(&err)
	b := k.request(OpSet)
	b = appendKey(b, key)
	b = appendBytes(b, value)
	return k.sendWrite(b)
}

// Get waits for key and returns its value: WAIT then GET, as c10d's client
// does, because a PyTorch 1.13 server drops the connection on a GET of a
// missing key.
func (c *Client) Get(ctx context.Context, key string) (v []byte, err error) {
	k, err := c.begin(ctx, OpGet)
	if err != nil {
		return nil, err
	}
	defer k.end(&err)
	if err := k.wait(key); err != nil {
		return nil, err
	}
	return k.get(key)
}

// Add adds delta to the counter under key and returns the new value.
func (c *Client) Add(ctx context.Context, key string, delta int64) (n int64, err error) {
	k, err := c.begin(ctx, OpAdd)
	if err != nil {
		return 0, err
	}
	defer k.end(&err)
	return k.add(key, delta)
}

// JoinedClients returns how many clients created with a world size have
// joined this server: the raw InitKey counter that a c10d master polls
// while it waits for its workers.
func (c *Client) JoinedClients(ctx context.Context) (n int64, err error) {
	k, err := c.begin(ctx, OpAdd)
	if err != nil {
		return 0, err
	}
	defer k.end(&err)
	return k.addWire(InitKey, 0)
}

// CompareSet stores desired if key's value is expected; see
// rendezvous.Store for the four cases and what it returns.
func (c *Client) CompareSet(ctx context.Context, key string, expected, desired []byte) (v []byte, err error) {
	k, err := c.begin(ctx, OpCompareSet)
	if err != nil {
		return nil, err
	}
	defer k.end(&err)
	return k.compareSet(key, expected, desired)
}

// Wait blocks until every key exists. When time runs out it withdraws the
// wait (CANCEL_WAIT on the new generation, so the connection stays usable;
// a fresh connection on the old one) and returns an error wrapping
// rendezvous.ErrTimeout, worded as c10d's: "wait timeout after 100ms, keys:
// [/k]".
func (c *Client) Wait(ctx context.Context, keys ...string) (err error) {
	if len(keys) == 0 {
		return nil
	}
	k, err := c.begin(ctx, OpWait)
	if err != nil {
		return err
	}
	defer k.end(&err)
	return k.wait(keys...)
}

// Check reports whether every key exists.
func (c *Client) Check(ctx context.Context, keys ...string) (ok bool, err error) {
	if len(keys) == 0 {
		return true, nil
	}
	k, err := c.begin(ctx, OpCheck)
	if err != nil {
		return false, err
	}
	defer k.end(&err)
	b := k.request(OpCheck)
	b = appendKeys(b, keys)
	if err := k.send(b); err != nil {
		return false, err
	}
	switch r, err := k.u8(); {
	case err != nil:
		return false, err
	case r == checkReady:
		return true, nil
	case r == checkNotReady:
		return false, nil
	default:
		return false, k.protocolError("CHECK answered %#x", r)
	}
}

// Delete removes key and reports whether it existed.
func (c *Client) Delete(ctx context.Context, key string) (ok bool, err error) {
	k, err := c.begin(ctx, OpDelete)
	if err != nil {
		return false, err
	}
	defer k.end(&err)
	b := k.request(OpDelete)
	b = appendKey(b, key)
	if err := k.send(b); err != nil {
		return false, err
	}
	n, err := k.i64()
	return n != 0, err
}

// NumKeys returns the number of keys on the server, those of every client
// and InitKey included, as c10d counts them.
func (c *Client) NumKeys(ctx context.Context) (n int64, err error) {
	k, err := c.begin(ctx, OpNumKeys)
	if err != nil {
		return 0, err
	}
	defer k.end(&err)
	if err := k.send(k.request(OpNumKeys)); err != nil {
		return 0, err
	}
	return k.i64()
}

// Append appends value to key's value, creating the key. The old wire
// generation has no APPEND; there it is emulated with COMPARE_SET, as
// c10d's Store::append fallback does (see appendByCompareSet).
func (c *Client) Append(ctx context.Context, key string, value []byte) (err error) {
	k, err := c.begin(ctx, OpAppend)
	if err != nil {
		return err
	}
	defer k.end(&err)
	if c.cfg.Wire == GenOld {
		return k.appendByCompareSet(key, value)
	}
	b := k.request(OpAppend)
	b = appendKey(b, key)
	b = appendBytes(b, value)
	return k.sendWrite(b)
}

// appendByCompareSet appends with a COMPARE_SET loop: read the current
// value, compare-and-set it to current+value, and retry with what the
// server says is there until that succeeds.
//
// c10d's fallback starts from the guess "absent", and so appends nothing
// when the key already holds exactly value (COMPARE_SET returns value in
// both cases). Reading first (peek) closes that hole for a lone writer.
// What no COMPARE_SET loop can close: its reply does not say whether it
// stored, so when another client concurrently produces the very value this
// one meant to store, one of the two appends is lost.
func (k *call) appendByCompareSet(key string, value []byte) error {
	cur, present, err := k.peek(key, value)
	if err != nil {
		return err
	}
	for {
		desired := append(cur[:len(cur):len(cur)], value...)
		got, err := k.compareSet(key, cur, desired)
		switch {
		case err != nil:
			return err
		case bytes.Equal(got, desired):
			return nil
		case present && len(cur) > 0 && bytes.Equal(got, cur):
			// Only an absent key answers with expected itself: the key
			// was deleted since we read it.
			cur, present = nil, false
		default:
			cur, present = got, true
		}
	}
}

// peek reads key's value without waiting, through COMPARE_SET's quirks:
// with expected and desired both a probe, it changes nothing and returns
// the current value — or the probe itself when the key is absent, or holds
// the probe. Taking that for "absent" is safe: the COMPARE_SET of "" that
// follows then reveals the real value, since the probe differs from value.
func (k *call) peek(key string, value []byte) (cur []byte, present bool, err error) {
	probe := []byte("\x00gorun-append-probe\x00")
	if bytes.Equal(probe, value) {
		probe = append(probe, 0)
	}
	got, err := k.compareSet(key, probe, probe)
	if err != nil || bytes.Equal(got, probe) {
		return nil, false, err
	}
	return got, true, nil
}

// MultiGet waits for every key and returns their values in order. The old
// wire generation has no MULTI_GET; there the values are read one by one
// after the one WAIT.
func (c *Client) MultiGet(ctx context.Context, keys ...string) (vals [][]byte, err error) {
	if len(keys) == 0 {
		return [][]byte{}, nil
	}
	k, err := c.begin(ctx, OpMultiGet)
	if err != nil {
		return nil, err
	}
	defer k.end(&err)
	if err := k.wait(keys...); err != nil {
		return nil, err
	}
	vals = make([][]byte, len(keys))
	if c.cfg.Wire == GenOld {
		for i, key := range keys {
			if vals[i], err = k.get(key); err != nil {
				return nil, err
			}
		}
		return vals, nil
	}
	b := k.request(OpMultiGet)
	b = appendKeys(b, keys)
	if err := k.send(b); err != nil {
		return nil, err
	}
	for i := range vals {
		if vals[i], err = k.bytes(); err != nil {
			return nil, err
		}
	}
	return vals, nil
}

// MultiSet sets keys[i] to values[i] for every i, in order. The old wire
// generation has no MULTI_SET; there the SETs go out back to back in one
// write.
func (c *Client) MultiSet(ctx context.Context, keys []string, values [][]byte) (err error) {
	if len(keys) != len(values) {
		return fmt.Errorf("tcpstore %s: %s: %w: %d keys but %d values", c.addr, OpMultiSet, rendezvous.ErrInvalidArgument, len(keys), len(values))
	}
	if len(keys) == 0 {
		return nil
	}
	k, err := c.begin(ctx, OpMultiSet)
	if err != nil {
		return err
	}
	defer k.end(&err)
	if c.cfg.Wire == GenOld {
		b := k.c.buf[:0]
		for i, key := range keys {
			b = append(b, k.opcode(OpSet))
			b = appendKey(b, key)
			b = appendBytes(b, values[i])
		}
		return k.sendWrite(b)
	}
	b := k.request(OpMultiSet)
	b = appendU64(b, uint64(len(keys)))
	for i, key := range keys {
		b = appendKey(b, key)
		b = appendBytes(b, values[i])
	}
	return k.sendWrite(b)
}

// ListKeys returns the keys that c10d clients set (those sent with
// KeyPrefix), without the prefix; InitKey is left out, as c10d's list_keys
// leaves it out. Not on the old wire generation.
func (c *Client) ListKeys(ctx context.Context) (keys []string, err error) {
	k, err := c.beginNew(ctx, OpListKeys)
	if err != nil {
		return nil, err
	}
	defer k.end(&err)
	if err := k.send(k.request(OpListKeys)); err != nil {
		return nil, err
	}
	n, err := k.count()
	if err != nil {
		return nil, err
	}
	keys = make([]string, 0, min(n, 1024))
	for range n {
		raw, err := k.bytes()
		if err != nil {
			return nil, err
		}
		if key, ok := bytes.CutPrefix(raw, []byte(KeyPrefix)); ok {
			keys = append(keys, string(key))
		}
	}
	return keys, nil
}

// QueuePush appends value to the queue named key. Not on the old wire
// generation.
func (c *Client) QueuePush(ctx context.Context, key string, value []byte) (err error) {
	k, err := c.beginNew(ctx, OpQueuePush)
	if err != nil {
		return err
	}
	defer k.end(&err)
	b := k.request(OpQueuePush)
	b = appendKey(b, key)
	b = appendBytes(b, value)
	return k.sendWrite(b)
}

// QueuePop removes and returns the head of the queue named key. With block
// it first WAITs for the queue to be non-empty (and waits again if another
// client took the element first); without, an empty queue gives an error
// wrapping rendezvous.ErrQueueEmpty. Not on the old wire generation.
func (c *Client) QueuePop(ctx context.Context, key string, block bool) (v []byte, err error) {
	k, err := c.beginNew(ctx, OpQueuePop)
	if err != nil {
		return nil, err
	}
	defer k.end(&err)
	for {
		if block {
			if err := k.wait(key); err != nil {
				return nil, err
			}
		}
		b := k.request(OpQueuePop)
		b = appendKey(b, key)
		if err := k.send(b); err != nil {
			return nil, err
		}
		n, err := k.i64()
		switch {
		case err != nil:
			return nil, err
		case n > 0:
			return k.bytes()
		case !block:
			return nil, fmt.Errorf("%w: %s", rendezvous.ErrQueueEmpty, wireKey(key))
		}
	}
}

// QueueLen returns the length of the queue named key. Not on the old wire
// generation.
func (c *Client) QueueLen(ctx context.Context, key string) (n int64, err error) {
	k, err := c.beginNew(ctx, OpQueueLen)
	if err != nil {
		return 0, err
	}
	defer k.end(&err)
	b := k.request(OpQueueLen)
	b = appendKey(b, key)
	if err := k.send(b); err != nil {
		return 0, err
	}
	return k.i64()
}

// Barrier adds one to the counter under key and waits until it reaches
// worldSize. Time running out is handled as in Wait. Not on the old wire
// generation.
func (c *Client) Barrier(ctx context.Context, key string, worldSize int64) (err error) {
	if worldSize <= 0 {
		return fmt.Errorf("tcpstore %s: %s: %w: world size %d", c.addr, OpBarrier, rendezvous.ErrInvalidArgument, worldSize)
	}
	k, err := c.beginNew(ctx, OpBarrier)
	if err != nil {
		return err
	}
	defer k.end(&err)
	b := k.request(OpBarrier)
	b = appendKey(b, key)
	b = appendI64(b, worldSize)
	if err := k.send(b); err != nil {
		return err
	}
	return k.await("barrier", key)
}

// The exchanges that several operations share.

// get sends GET for a key known to exist and reads the value.
func (k *call) get(key string) ([]byte, error) {
	b := k.request(OpGet)
	b = appendKey(b, key)
	if err := k.send(b); err != nil {
		return nil, err
	}
	return k.bytes()
}

func (k *call) add(key string, delta int64) (int64, error) {
	return k.addWire(KeyPrefix+key, delta)
}

// addWire sends ADD for a key exactly as given (InitKey has no prefix).
func (k *call) addWire(wire string, delta int64) (int64, error) {
	b := k.request(OpAdd)
	b = appendString(b, wire)
	b = appendI64(b, delta)
	if err := k.send(b); err != nil {
		return 0, err
	}
	return k.i64()
}

func (k *call) compareSet(key string, expected, desired []byte) ([]byte, error) {
	b := k.request(OpCompareSet)
	b = appendKey(b, key)
	b = appendBytes(b, expected)
	b = appendBytes(b, desired)
	if err := k.send(b); err != nil {
		return nil, err
	}
	return k.bytes()
}

// wait sends WAIT for keys and reads its answer (see await).
func (k *call) wait(keys ...string) error {
	b := k.request(OpWait)
	b = appendKeys(b, keys)
	if err := k.send(b); err != nil {
		return err
	}
	return k.await("wait", keys...)
}

// appendKey appends key as c10d's client sends it: KeyPrefix + key.
func appendKey(b []byte, key string) []byte {
	b = appendU64(b, uint64(len(KeyPrefix)+len(key)))
	b = append(b, KeyPrefix...)
	return append(b, key...)
}

// appendKeys appends a key count and the keys (CHECK, WAIT, MULTI_GET).
func appendKeys(b []byte, keys []string) []byte {
	b = appendU64(b, uint64(len(keys)))
	for _, key := range keys {
		b = appendKey(b, key)
	}
	return b
}

// wireKey is key as the server sees it, for error messages.
func wireKey(key string) string { return KeyPrefix + key }
