package tcpstore

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// errIncomplete: the buffer holds only part of the next request.
var errIncomplete = errors.New("incomplete request")

// ProtocolError is bad input from a client. The server answers it the way
// c10d does — by closing that connection — and logs it.
type ProtocolError struct{ Reason string }

func (e *ProtocolError) Error() string { return "protocol error: " + e.Reason }

func protocolErrorf(format string, args ...any) error {
	return &ProtocolError{Reason: fmt.Sprintf(format, args...)}
}

// request is one decoded request. Its byte slices point into the decoder's
// buffer and stay valid until the decoder reads or compacts again.
type request struct {
	op   Op
	key  []byte
	val  []byte // SET, APPEND, QUEUE_PUSH value; COMPARE_SET expected
	val2 []byte // COMPARE_SET desired
	keys [][]byte
	vals [][]byte // MULTI_SET values
	n    int64    // ADD delta, BARRIER world size
	u32  uint32   // VALIDATE magic, PING nonce
}

// genUnknown: no byte seen yet (an idle 1.13 callback socket stays so).
const genUnknown Generation = 0xff

// decoder parses one connection's byte stream into requests. It is a
// streaming parser: bytes arrive in any split (spare/commit), complete
// requests come out (next), and a partial request is parsed again only when
// enough bytes have arrived to make progress (need).
//
// Memory follows the bytes that actually arrived, never a length prefix:
// the buffer at most doubles what it holds (by a quarter past
// growStepLimit) and never grows past the end of the field being read, so
// a prefix announcing gigabytes costs nothing until its bytes come, and a
// prefix over the Limits fails at once. Every byte of capacity the decoder
// owns is reserved in the server's budget, which refuses growth past
// ServerConfig.MaxBuffered.
type decoder struct {
	buf []byte // buf[r:] is unparsed
	r   int
	// borrowed: buf is the transport's read buffer (see borrow), not ours.
	borrowed bool
	need     int // parse again once len(buf)-r >= need
	gen      Generation
	legacy   []Op
	lim      Limits
	req      request
	mem      *budget // the server's; nil: unaccounted (tests)
	held     int     // capacity of an owned buf, reserved in mem
}

// initialBufSize is the read buffer of a fresh or idle connection. Requests
// are small (a SET of a short key is ~30 bytes), so this keeps idle
// connections cheap; larger requests grow it.
const initialBufSize = 512

// growStepLimit is the capacity past which the buffer grows by a quarter
// instead of doubling, so that a large request's buffer holds at most 25%
// more than has arrived (copying stays linear in the request's size).
const growStepLimit = 64 << 20

func newDecoder(lim Limits, table LegacyTable, mem *budget) decoder {
	return decoder{gen: genUnknown, legacy: oldOpcodes[table], lim: lim, mem: mem}
}

// nextCap is the capacity to grow a full buffer to.
func (d *decoder) nextCap() int {
	c := cap(d.buf)
	n := max(2*c, initialBufSize)
	if c >= growStepLimit {
		n = c + c/4
	}
	// The field being read ends at r+need: no room past it is useful yet.
	if want := d.r + d.need; want > len(d.buf) && want < n {
		n = max(want, min(n, initialBufSize))
	}
	return n
}

// own makes the decoder's buffer a fresh one of capacity n holding p,
// moving the budget's reservation from the old buffer to the new.
func (d *decoder) own(p []byte, n int) error {
	if err := d.mem.reserve(n - d.held); err != nil {
		return err
	}
	d.mem.free(d.held - n)
	nb := make([]byte, len(p), n)
	copy(nb, p)
	d.buf, d.held, d.borrowed = nb, n, false
	return nil
}

// drop lets go of the buffer and its reservation.
func (d *decoder) drop() {
	d.mem.free(d.held)
	d.buf, d.held, d.r, d.borrowed = nil, 0, 0, false
}

// spare returns the free tail of the buffer for the next read, growing the
// buffer when it is full. It fails with ErrBufferFull when the server's
// budget has no room for the growth.
func (d *decoder) spare() ([]byte, error) {
	if d.r > 0 && len(d.buf) == cap(d.buf) {
		d.compact()
	}
	if len(d.buf) == cap(d.buf) {
		if err := d.own(d.buf, d.nextCap()); err != nil {
			return nil, err
		}
	}
	return d.buf[len(d.buf):cap(d.buf)], nil
}

// commit records that n bytes were read into spare().
func (d *decoder) commit(n int) { d.buf = d.buf[:len(d.buf)+n] }

// feed appends p (for tests and the fuzzer, which have bytes in hand).
func (d *decoder) feed(p []byte) error {
	for len(p) > 0 {
		sp, err := d.spare()
		if err != nil {
			return err
		}
		n := copy(sp, p)
		d.commit(n)
		p = p[n:]
	}
	return nil
}

// compact drops parsed bytes. A connection with nothing pending gives a
// grown buffer back, so a one-off large request does not pin memory on an
// idle connection.
func (d *decoder) compact() {
	if d.r == len(d.buf) {
		if cap(d.buf) > 4*initialBufSize {
			d.drop()
		} else {
			d.buf = d.buf[:0]
		}
		d.r = 0
		if cap(d.req.keys) > 1024 {
			d.req.keys, d.req.vals = nil, nil
		}
		return
	}
	if d.r > 0 {
		n := copy(d.buf, d.buf[d.r:])
		d.buf = d.buf[:n]
		d.r = 0 // need counts from r, so it stays valid
	}
}

// borrow parses p, a transport's read buffer, in place: no copy for the
// common case of whole requests. retain must follow before p is reused.
// The decoder must have nothing pending.
func (d *decoder) borrow(p []byte) {
	d.drop()
	d.buf, d.borrowed = p, true
}

// retain ends a parsing round of the event loop: a partial request's bytes
// are copied out of a borrowed buffer, and with nothing pending the decoder
// keeps no buffer at all, so an idle connection costs none. It fails with
// ErrBufferFull when the server's budget has no room for the partial
// request.
func (d *decoder) retain() error {
	if cap(d.req.keys) > 1024 {
		d.req.keys, d.req.vals = nil, nil
	}
	rest := d.buf[d.r:]
	switch {
	case len(rest) == 0:
		d.drop()
		return nil
	case d.borrowed:
		n := max(2*len(rest), initialBufSize)
		if want := d.need; want > len(rest) && want < n {
			n = max(want, initialBufSize)
		}
		d.buf, d.r = rest, 0 // need counts from r, so it stays valid
		if err := d.own(rest, n); err != nil {
			d.buf, d.borrowed = nil, false
			return err
		}
	default:
		d.buf, d.r = d.buf[:copy(d.buf, rest)], 0
	}
	return nil
}

// pending reports whether part of a request is buffered.
func (d *decoder) pending() bool { return d.r < len(d.buf) }

// next returns the next complete request, errIncomplete, or a
// *ProtocolError.
func (d *decoder) next() (*request, error) {
	avail := d.buf[d.r:]
	if len(avail) == 0 || len(avail) < d.need {
		return nil, errIncomplete
	}
	if d.gen == genUnknown {
		// Spec §2.4: a new-generation client always opens with VALIDATE
		// (00 CE F7 85 3C). An old one never does; its first byte is an
		// old opcode, and a leading 00 is an old SET whose key length's
		// low four bytes would have to equal the magic (a ~1 GB key).
		if avail[0] != 0 {
			d.gen = GenOld
		} else {
			if len(avail) < 5 {
				d.need = 5
				return nil, errIncomplete
			}
			if binary.LittleEndian.Uint32(avail[1:5]) == ValidationMagic {
				d.gen = GenNew
				d.r += 5
				d.need = 0
				d.req = request{op: OpValidate, u32: ValidationMagic, keys: d.req.keys[:0], vals: d.req.vals[:0]}
				return &d.req, nil
			}
			d.gen = GenOld
		}
	}
	c := cursor{b: avail, lim: &d.lim}
	req := &d.req
	*req = request{keys: req.keys[:0], vals: req.vals[:0]}
	code := c.u8()
	if c.short {
		return nil, errIncomplete
	}
	switch d.gen {
	case GenNew:
		req.op = Op(code)
		if req.op == OpValidate {
			return nil, protocolErrorf("VALIDATE after the handshake")
		}
		if req.op > OpBarrier {
			return nil, protocolErrorf("unknown opcode %d", code)
		}
	default:
		if int(code) >= len(d.legacy) {
			return nil, protocolErrorf("unknown opcode %d for PyTorch ≤2.0 wire", code)
		}
		req.op = d.legacy[code]
	}
	switch req.op {
	case OpSet, OpAppend, OpQueuePush:
		req.key = c.key()
		req.val = c.value()
	case OpCompareSet:
		req.key = c.key()
		req.val = c.value()
		req.val2 = c.value()
	case OpGet, OpDelete, OpQueuePop, OpQueueLen, OpWatchKey:
		req.key = c.key()
	case OpAdd, OpBarrier:
		req.key = c.key()
		req.n = int64(c.u64())
	case OpCheck, OpWait, OpMultiGet:
		n := c.count()
		for i := uint64(0); i < n && c.ok(); i++ {
			req.keys = append(req.keys, c.key())
		}
	case OpMultiSet:
		n := c.count()
		for i := uint64(0); i < n && c.ok(); i++ {
			req.keys = append(req.keys, c.key())
			req.vals = append(req.vals, c.value())
		}
	case OpPing:
		req.u32 = c.u32()
	case OpNumKeys, OpCancelWait, OpListKeys:
	}
	if c.err != nil {
		return nil, c.err
	}
	if c.short {
		d.need = c.need
		return nil, errIncomplete
	}
	d.r += c.off
	d.need = 0
	return req, nil
}

// cursor reads fields from a byte slice. The first problem sticks: short
// (more bytes needed; need says how many in all) or err (a limit or a
// malformed field).
type cursor struct {
	b     []byte
	off   int
	lim   *Limits
	short bool
	need  int
	err   error
}

func (c *cursor) ok() bool { return !c.short && c.err == nil }

// take returns the next n bytes, or nil after recording why it cannot.
func (c *cursor) take(n int) []byte {
	if !c.ok() {
		return nil
	}
	if c.off+n > c.lim.MaxRequestSize {
		c.err = protocolErrorf("request larger than %d bytes", c.lim.MaxRequestSize)
		return nil
	}
	if len(c.b)-c.off < n {
		c.short, c.need = true, c.off+n
		return nil
	}
	p := c.b[c.off : c.off+n : c.off+n]
	c.off += n
	return p
}

func (c *cursor) u8() byte {
	if p := c.take(1); p != nil {
		return p[0]
	}
	return 0
}

func (c *cursor) u32() uint32 {
	if p := c.take(4); p != nil {
		return binary.LittleEndian.Uint32(p)
	}
	return 0
}

func (c *cursor) u64() uint64 {
	if p := c.take(8); p != nil {
		return binary.LittleEndian.Uint64(p)
	}
	return 0
}

// str reads a u64-length-prefixed string of at most max bytes. A length
// over max fails before any of the string has to arrive.
func (c *cursor) str(max int, what string) []byte {
	n := c.u64()
	if !c.ok() {
		return nil
	}
	if n > uint64(max) {
		c.err = protocolErrorf("%s of %d bytes exceeds the limit of %d", what, n, max)
		return nil
	}
	return c.take(int(n))
}

func (c *cursor) key() []byte   { return c.str(c.lim.MaxKeySize, "key") }
func (c *cursor) value() []byte { return c.str(c.lim.MaxValueSize, "value") }

func (c *cursor) count() uint64 {
	n := c.u64()
	if c.ok() && n > uint64(c.lim.MaxKeyCount) {
		c.err = protocolErrorf("key count %d exceeds the limit of %d", n, c.lim.MaxKeyCount)
	}
	return n
}
