package tcpstore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// This file is the Client's transport: taking turns on the connection,
// deadlines and context cancellation, connecting with backoff and the
// handshake, reading replies, and turning I/O failures into the
// rendezvous sentinels.

const (
	// cancelWaitGrace bounds the CANCEL_WAIT exchange after a wait ran out
	// of time; a server that does not answer within it loses the
	// connection instead.
	cancelWaitGrace = 10 * time.Second

	// maxReplyLen bounds a string in a reply, so that a desynchronised or
	// hostile stream cannot make the client allocate without limit. The
	// libuv backend's own value limit is 8 MiB.
	maxReplyLen = 1 << 30
)

// ErrHungUp: the server closed the connection while a request was in
// flight. c10d's protocol has no error reply, so a server refuses a request
// that way — a key or value over its limits, ADD on a value that is not a
// number, an unknown opcode — and it also happens when a server stops.
// Errors that wrap it also wrap rendezvous.ErrUnavailable.
var ErrHungUp = errors.New("connection closed by the server")

// pastDeadline, set on a connection, fails its pending reads and writes at
// once.
var pastDeadline = time.Unix(1, 0)

// call is one operation in progress. It holds the Client's turn from
// begin (or acquire) to end (or release), so it alone uses the connection,
// the reader and the request buffer meanwhile.
type call struct {
	c        *Client
	ctx      context.Context
	op       Op
	start    time.Time
	deadline time.Time   // ctx's deadline, or start + Timeout
	seq      uint64      // this call's number, for Client.armed
	stop     func() bool // stops the context.AfterFunc; nil if ctx cannot end
}

// begin starts op: it takes the Client's turn, arms the deadline and, if the
// last connection was dropped, reconnects. Its errors are ready to return.
func (c *Client) begin(ctx context.Context, op Op) (call, error) {
	k, err := c.acquire(ctx, op)
	if err != nil {
		return call{}, c.opError(op, err)
	}
	if c.nc == nil {
		if err := k.connect(); err != nil {
			k.release()
			if !errors.Is(err, rendezvous.ErrClosed) {
				// The store was reachable once: say it is unavailable
				// now, besides why reconnecting failed (often ErrTimeout).
				err = fmt.Errorf("%w: reconnect: %w", rendezvous.ErrUnavailable, err)
			}
			return call{}, c.opError(op, err)
		}
	}
	return k, nil
}

// beginNew is begin for an operation that only the new wire generation has.
func (c *Client) beginNew(ctx context.Context, op Op) (call, error) {
	if c.cfg.Wire != GenNew {
		return call{}, c.opError(op, fmt.Errorf("%w: the %v wire generation (PyTorch 1.13–2.0) has no %v", rendezvous.ErrNotSupported, c.cfg.Wire, op))
	}
	return c.begin(ctx, op)
}

// end finishes what begin started, prefixing *err with the address and
// the operation.
func (k *call) end(err *error) {
	k.release()
	if *err != nil {
		*err = k.c.opError(k.op, *err)
	}
}

func (c *Client) opError(op Op, err error) error {
	return fmt.Errorf("tcpstore %s: %v: %w", c.addr, op, err)
}

// acquire waits for the Client's turn and arms the call: the connection's
// deadline is the call's, and ctx ending moves it to the past so that a
// blocked read returns at once.
func (c *Client) acquire(ctx context.Context, op Op) (call, error) {
	k := call{c: c, ctx: ctx, op: op, start: time.Now()}
	k.deadline = c.deadline(ctx, k.start)
	if ctx.Err() != nil {
		return call{}, k.timeout("", "")
	}
	select {
	case c.turn <- struct{}{}:
	default:
		if err := k.queue(); err != nil {
			return call{}, err
		}
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		<-c.turn
		return call{}, rendezvous.ErrClosed
	}
	c.seq++
	k.seq = c.seq
	c.armed = k.seq
	if c.nc != nil {
		c.nc.SetDeadline(k.deadline)
	}
	c.mu.Unlock()
	if ctx.Done() != nil {
		seq := k.seq // not k: capturing it would move every call to the heap
		k.stop = context.AfterFunc(ctx, func() { c.interrupt(seq) })
	}
	return k, nil
}

// queue waits for the turn while another call holds it, until the call's
// deadline: time spent queueing counts against the call, as in c10d,
// whose client holds a lock for the whole of a request.
func (k *call) queue() error {
	t := time.NewTimer(time.Until(k.deadline))
	defer t.Stop()
	select {
	case k.c.turn <- struct{}{}:
		return nil
	case <-k.ctx.Done():
	case <-t.C:
	case <-k.c.closing:
		return rendezvous.ErrClosed
	}
	return k.timeout("", "")
}

// release disarms the call and gives the turn back.
func (k *call) release() {
	k.c.disarm()
	if k.stop != nil {
		k.stop()
	}
	<-k.c.turn
}

// deadline is when an operation starting at start must be over.
func (c *Client) deadline(ctx context.Context, start time.Time) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d
	}
	return start.Add(c.cfg.Timeout)
}

// interrupt is the context.AfterFunc of call seq. Checking armed under mu
// keeps a late-running AfterFunc from hitting a later call, or the
// CANCEL_WAIT exchange, which runs disarmed.
func (c *Client) interrupt(seq uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.armed == seq && c.nc != nil {
		c.nc.SetDeadline(pastDeadline)
	}
}

func (c *Client) disarm() {
	c.mu.Lock()
	c.armed = 0
	c.mu.Unlock()
}

func (c *Client) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// install makes nc the Client's connection.
func (c *Client) install(nc net.Conn, deadline time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		nc.Close()
		return rendezvous.ErrClosed
	}
	nc.SetDeadline(deadline)
	c.nc = nc
	c.r.Reset(nc)
	return nil
}

// drop closes the connection; the next operation reconnects.
func (c *Client) drop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.nc != nil {
		c.nc.Close()
		c.nc = nil
	}
}

// Connecting.

// connect dials and handshakes until it succeeds, retrying what c10d
// retries — refused, reset and timed-out connections, failed name lookups,
// a handshake cut short — with jittered exponential backoff until the
// call's deadline.
func (k *call) connect() error {
	bo := backoff{next: k.c.cfg.ConnectBackoffMin, max: k.c.cfg.ConnectBackoffMax}
	var last error
	for {
		err := k.connectOnce()
		if err == nil {
			return nil
		}
		if !retryable(err) {
			return err
		}
		// An attempt cut short by the deadline or ctx says less than the
		// one before it ("connection refused").
		if last == nil || !k.expired() {
			last = err
		}
		if perr := k.pause(bo.delay()); perr != nil {
			if errors.Is(perr, rendezvous.ErrClosed) {
				return perr
			}
			return k.connectTimeout(last)
		}
	}
}

// expired reports whether the call's time is up.
func (k *call) expired() bool {
	return k.ctx.Err() != nil || !time.Now().Before(k.deadline)
}

func (k *call) connectOnce() error {
	c := k.c
	// No TCP keep-alive, as c10d's client: liveness is not the store's
	// job, and its four setsockopts per connection add up in a storm.
	d := net.Dialer{Deadline: k.deadline, KeepAlive: -1}
	nc, err := d.DialContext(k.ctx, "tcp", c.addr)
	if err != nil {
		return err
	}
	if err := c.install(nc, k.deadline); err != nil {
		return err
	}
	// An AfterFunc that ran before install found no connection to
	// interrupt; one that runs after finds this one.
	if err := k.ctx.Err(); err != nil {
		c.drop()
		return err
	}
	if c.cfg.Wire != GenNew {
		return nil // the old generation has no handshake
	}
	if err := k.handshake(); err != nil {
		c.drop()
		return err
	}
	return nil
}

// handshake sends VALIDATE and PING in one write and checks PING's echo.
// The nonce is the pid, as c10d's.
func (k *call) handshake() error {
	c := k.c
	nonce := uint32(os.Getpid())
	b := c.buf[:0]
	b = appendU8(b, byte(OpValidate))
	b = appendU32(b, ValidationMagic)
	b = appendU8(b, byte(OpPing))
	b = appendU32(b, nonce)
	c.buf = b[:0]
	if _, err := c.nc.Write(b); err != nil {
		return fmt.Errorf("handshake: %w", err)
	}
	p, err := c.readN(4)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
		// What a 1.13 server does to VALIDATE (spec §2.3).
		return fmt.Errorf("handshake: the server hung up (as PyTorch ≤2.0 servers do on new-generation clients): %w", err)
	}
	if err != nil {
		return fmt.Errorf("handshake: %w", err)
	}
	if got := binary.LittleEndian.Uint32(p); got != nonce {
		return fmt.Errorf("%w: ping failed: sent nonce %d, got %d back", rendezvous.ErrUnavailable, nonce, got)
	}
	return nil
}

// retryable tells a transient connection failure from one that retrying
// cannot fix.
func retryable(err error) bool {
	var addrErr *net.AddrError
	var netErr net.UnknownNetworkError
	switch {
	case errors.Is(err, rendezvous.ErrClosed),
		errors.Is(err, rendezvous.ErrUnavailable), // a failed ping: a server, but not a TCPStore
		errors.As(err, &addrErr),
		errors.As(err, &netErr):
		return false
	}
	return true
}

// pause sleeps d before the next attempt. If the deadline comes first it
// sleeps until then and returns context.DeadlineExceeded; it returns early
// with ctx's error or rendezvous.ErrClosed.
func (k *call) pause(d time.Duration) error {
	var expire error
	if remaining := time.Until(k.deadline); d >= remaining {
		d, expire = max(remaining, 0), context.DeadlineExceeded
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return expire
	case <-k.ctx.Done():
		return k.ctx.Err()
	case <-k.c.closing:
		return rendezvous.ErrClosed
	}
}

// connectTimeout is the error of a connect that ran out of time; last is
// the last attempt's failure.
func (k *call) connectTimeout(last error) error {
	d, cause := k.elapsed()
	var dnsErr *net.DNSError
	if errors.As(last, &dnsErr) {
		return fmt.Errorf("%w after %v (%w), retrying a failed name lookup: %w", rendezvous.ErrTimeout, d, cause, last)
	}
	return fmt.Errorf("%w after %v (%w): %w", rendezvous.ErrTimeout, d, cause, last)
}

// backoff yields exponentially growing pauses with c10d's jitter: each is
// uniform in [p/2, 3p/2) around the nominal pause p, which grows by half
// per attempt up to max.
type backoff struct{ next, max time.Duration }

func (b *backoff) delay() time.Duration {
	p := b.next
	b.next = min(p+p/2, b.max)
	return p/2 + rand.N(p)
}

// Requests and replies.

// opcode is op's byte in the Client's wire generation. Callers check that
// the generation has op (beginNew) or emulate it.
func (k *call) opcode(op Op) byte {
	code, ok := opcode(k.c.cfg.Wire, op)
	if !ok {
		panic(fmt.Sprintf("tcpstore: %v has no opcode in the %v wire generation", op, k.c.cfg.Wire))
	}
	return code
}

// request starts building a request for op in the Client's buffer.
func (k *call) request(op Op) []byte {
	return append(k.c.buf[:0], k.opcode(op))
}

// send writes a request in one Write, as c10d batches its requests, and
// keeps the buffer for the next one.
func (k *call) send(b []byte) error {
	if cap(b) <= 64<<10 {
		k.c.buf = b[:0]
	} else {
		k.c.buf = nil // a one-off large request does not pin memory
	}
	if _, err := k.c.nc.Write(b); err != nil {
		return k.broken(err)
	}
	return nil
}

// sendWrite sends b, a write without a reply, and with
// ClientConfig.ConfirmWrites confirms it: a GETNUMKEYS goes out in the
// same write, and its answer shows that the server read the write and did
// not close the connection on it.
func (k *call) sendWrite(b []byte) error {
	if !k.c.cfg.ConfirmWrites {
		return k.send(b)
	}
	if err := k.send(append(b, k.opcode(OpNumKeys))); err != nil {
		return err
	}
	if _, err := k.i64(); err != nil {
		return fmt.Errorf("write not confirmed: %w", err)
	}
	return nil
}

// readN reads n ≤ 8 bytes into the scratch buffer.
func (c *Client) readN(n int) ([]byte, error) {
	p := c.scratch[:n]
	_, err := io.ReadFull(c.r, p)
	return p, err
}

func (k *call) u8() (byte, error) {
	b, err := k.c.r.ReadByte()
	if err != nil {
		return 0, k.broken(err)
	}
	return b, nil
}

func (k *call) i64() (int64, error) {
	p, err := k.c.readN(8)
	if err != nil {
		return 0, k.broken(err)
	}
	return int64(binary.LittleEndian.Uint64(p)), nil
}

// count reads a u64 count of strings that follow.
func (k *call) count() (int, error) {
	n, err := k.i64()
	if err != nil {
		return 0, err
	}
	if uint64(n) > maxReplyLen/8 {
		return 0, k.protocolError("reply announces %d strings", uint64(n))
	}
	return int(n), nil
}

// bytes reads a u64-length-prefixed string.
func (k *call) bytes() ([]byte, error) {
	n, err := k.i64()
	if err != nil {
		return nil, err
	}
	if uint64(n) > maxReplyLen {
		return nil, k.protocolError("reply announces a %d-byte string", uint64(n))
	}
	// A large reply's buffer grows with the bytes that arrive (doubling,
	// up to the announced length), not with the length alone: a
	// desynchronised stream announces nonsense.
	v := make([]byte, min(n, replyChunk))
	filled := 0
	for {
		if _, err := io.ReadFull(k.c.r, v[filled:]); err != nil {
			return nil, k.broken(err)
		}
		filled = len(v)
		if int64(filled) == n {
			return v, nil
		}
		next := int(min(n, 2*int64(filled)))
		v = slices.Grow(v, next-filled)[:next]
	}
}

// replyChunk is the largest reply string read into a buffer of its
// announced size at once.
const replyChunk = 1 << 20

// Waiting.

// await reads the answer to a WAIT or BARRIER. If time runs out first, the
// wait is withdrawn — CANCEL_WAIT on the new generation; on the old one,
// which has none, the connection is dropped, since the server would
// answer the abandoned wait later with a stray STOP_WAITING (spec §2.3) —
// and the error is c10d's "<what> timeout after …, keys: […]".
func (k *call) await(what string, keys ...string) error {
	c := k.c
	b, err := c.r.ReadByte()
	switch {
	case err == nil && b == stopWaiting:
		return nil
	case err == nil:
		return k.protocolError("%s answered %#x", strings.ToUpper(what), b)
	case !errors.Is(err, os.ErrDeadlineExceeded) || c.isClosed():
		return k.broken(err)
	}
	if c.cfg.Wire == GenNew {
		k.cancelWait()
	} else {
		c.drop()
	}
	if c.isClosed() {
		return rendezvous.ErrClosed
	}
	return k.timeout(what+" ", ", keys: "+keyList(keys))
}

// cancelWait withdraws the pending wait with CANCEL_WAIT, so the
// connection stays usable (PyTorch's test_tcp_store_timeout_doest_break_
// client). The server answers WAIT_CANCELED, or — if it released the wait
// just before — STOP_WAITING then WAIT_CANCELED. Anything else, or no
// answer within cancelWaitGrace, drops the connection.
func (k *call) cancelWait() {
	c := k.c
	c.mu.Lock()
	c.armed = 0 // this exchange must not be cut short by ctx
	nc := c.nc
	nc.SetDeadline(time.Now().Add(cancelWaitGrace))
	c.mu.Unlock()

	c.buf = append(c.buf[:0], k.opcode(OpCancelWait))
	if _, err := nc.Write(c.buf); err != nil {
		c.drop()
		return
	}
	b, err := c.r.ReadByte()
	if err == nil && b == stopWaiting {
		b, err = c.r.ReadByte()
	}
	if err != nil || b != waitCanceled {
		c.drop()
	}
}

// keyList formats keys as the server sees them: "[/a /b]".
func keyList(keys []string) string {
	var sb strings.Builder
	sb.WriteByte('[')
	for i, key := range keys {
		if i > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString(wireKey(key))
	}
	sb.WriteByte(']')
	return sb.String()
}

// Errors.

// broken turns a failed read or write into the operation's error. The
// stream's position is unknown after it, so the connection is dropped.
func (k *call) broken(err error) error {
	k.c.drop()
	switch {
	case k.c.isClosed():
		return rendezvous.ErrClosed
	case errors.Is(err, os.ErrDeadlineExceeded):
		return k.timeout("", "")
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: %w", rendezvous.ErrUnavailable, ErrHungUp)
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return fmt.Errorf("%w: %w (%w)", rendezvous.ErrUnavailable, ErrHungUp, err)
	}
	return fmt.Errorf("%w: %w", rendezvous.ErrUnavailable, err)
}

// protocolError reports a reply that makes no sense and drops the
// connection, which is out of step with the server.
func (k *call) protocolError(format string, args ...any) error {
	k.c.drop()
	return fmt.Errorf("%w: protocol error: %s", rendezvous.ErrUnavailable, fmt.Sprintf(format, args...))
}

// timeout is the error of a call that ran out of time: "<prefix>timeout
// after <d><suffix> (<ctx error>)", wrapping rendezvous.ErrTimeout and the
// context's error (context.DeadlineExceeded when Timeout expired).
func (k *call) timeout(prefix, suffix string) error {
	d, cause := k.elapsed()
	return fmt.Errorf("%s%w after %v%s (%w)", prefix, rendezvous.ErrTimeout, d, suffix, cause)
}

// elapsed says how long the call had and why it ended: for an expired
// deadline that is the time it was given, as c10d reports its timeout; for
// a cancellation, the time it ran.
func (k *call) elapsed() (time.Duration, error) {
	cause := k.ctx.Err()
	if cause == nil || errors.Is(cause, context.DeadlineExceeded) {
		return k.deadline.Sub(k.start).Round(time.Millisecond), context.DeadlineExceeded
	}
	return time.Since(k.start).Round(time.Millisecond), cause
}
