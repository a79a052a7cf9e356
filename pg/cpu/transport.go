package cpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// sender feeds one peer's outbound stream from its own goroutine, so that
// a rank can send to a peer while it reads from another (or the same) one:
// the ring and the exchanges would deadlock on full socket buffers (or
// full shared-memory rings) otherwise. The collective posts byte slices
// (views of the caller's buffer or of scratch, never copies) and, before it
// returns, waits until every one was handed to the wire. Posting never
// blocks and costs no allocation once the queues have grown.
type sender struct {
	wire wire
	kick chan struct{} // cap 1: work was posted
	done chan struct{} // cap 1: progress was made

	mu      sync.Mutex
	queue   [][]byte
	spare   [][]byte
	posted  int64
	written int64
	err     error
}

// A wire moves posted slices to the peer, in order. Only the sender's
// goroutine calls it.
type wire interface {
	write(batch [][]byte) error
}

func newSender(w wire) *sender {
	return &sender{wire: w, kick: make(chan struct{}, 1), done: make(chan struct{}, 1)}
}

// post queues b for writing; empty slices are skipped.
func (s *sender) post(b []byte) {
	if len(b) == 0 {
		return
	}
	s.mu.Lock()
	s.queue = append(s.queue, b)
	s.posted++
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// run writes what is posted until stop is closed.
func (s *sender) run(stop <-chan struct{}) {
	for {
		select {
		case <-s.kick:
		case <-stop:
			return
		}
		for {
			s.mu.Lock()
			batch := s.queue
			s.queue, s.spare = s.spare[:0], nil
			s.mu.Unlock()
			if len(batch) == 0 {
				s.mu.Lock()
				s.spare = batch
				s.mu.Unlock()
				break
			}
			err := s.wire.write(batch)
			clear(batch)
			s.mu.Lock()
			s.spare = batch[:0]
			s.written += int64(len(batch))
			if err != nil && s.err == nil {
				s.err = err
			}
			s.mu.Unlock()
			select {
			case s.done <- struct{}{}:
			default:
			}
		}
	}
}

// wait returns once everything posted was written, or the first write
// error, or errStopped when stop is closed first.
func (s *sender) wait(stop <-chan struct{}) error {
	for {
		s.mu.Lock()
		w, p, err := s.written, s.posted, s.err
		s.mu.Unlock()
		if err != nil {
			return err
		}
		if w >= p {
			return nil
		}
		select {
		case <-s.done:
		case <-stop:
			return errStopped
		}
	}
}

// sockWire writes a batch to a socket with one writev.
type sockWire struct {
	conn net.Conn
	bufs net.Buffers // a field, so that WriteTo does not allocate
	iov  [][]byte
}

func (w *sockWire) write(batch [][]byte) error {
	w.iov = append(w.iov[:0], batch...)
	w.bufs = w.iov
	_, err := w.bufs.WriteTo(w.conn)
	clear(w.iov)
	return err
}

// An inbound is how a rank receives a peer's stream. Only the goroutine
// running collectives calls it.
type inbound interface {
	// read fills b with the stream's next len(b) bytes.
	read(b []byte) error
	// readReduce consumes the stream's next len(dst) bytes, in, and sets
	// dst = src op in with red; tmp (len(dst) bytes, 8-byte aligned) is
	// space it may use. src and dst may be the same.
	readReduce(dst, src, tmp []byte, red reducer) error
}

// sockInbound reads a socket: a kernel copy into tmp, then the reduction.
type sockInbound struct{ conn net.Conn }

func (r sockInbound) read(b []byte) error {
	for n := 0; n < len(b); {
		m, err := r.conn.Read(b[n:])
		n += m
		if err != nil && n < len(b) {
			return err
		}
	}
	return nil
}

func (r sockInbound) readReduce(dst, src, tmp []byte, red reducer) error {
	in := tmp[:len(dst)]
	if err := r.read(in); err != nil {
		return err
	}
	red(dst, src, in)
	return nil
}

// Control messages travel on a pair's control connection, which a reader
// goroutine drains at all times: a rank says goodbye when it closes a
// healthy group (so that a peer can tell a finished rank from a dead one)
// and why it gave up when it aborts or fails (so that the survivors name the
// rank that died, not the one that noticed first).
const (
	msgBye   = 1 // count: collectives this rank completed
	msgAbort = 2 // culprit: the rank at fault (-1: the sender); reason

	ctrlHeaderLen    = 16
	maxReasonLen     = 1024
	ctrlWriteTimeout = time.Second
)

type ctrlMsg struct {
	kind    byte
	culprit int
	count   int64
	reason  string
}

func writeCtrl(c net.Conn, m ctrlMsg) {
	reason := m.reason
	if len(reason) > maxReasonLen {
		reason = reason[:maxReasonLen]
	}
	b := make([]byte, ctrlHeaderLen+len(reason))
	b[0] = m.kind
	binary.LittleEndian.PutUint16(b[2:], uint16(len(reason)))
	binary.LittleEndian.PutUint32(b[4:], uint32(int32(m.culprit)))
	binary.LittleEndian.PutUint64(b[8:], uint64(m.count))
	copy(b[ctrlHeaderLen:], reason)
	c.SetWriteDeadline(time.Now().Add(ctrlWriteTimeout))
	c.Write(b) // best effort: the peer may be gone
}

func readCtrl(r io.Reader) (ctrlMsg, error) {
	var h [ctrlHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return ctrlMsg{}, err
	}
	m := ctrlMsg{
		kind:    h[0],
		culprit: int(int32(binary.LittleEndian.Uint32(h[4:]))),
		count:   int64(binary.LittleEndian.Uint64(h[8:])),
	}
	if n := binary.LittleEndian.Uint16(h[2:]); n > 0 {
		if n > maxReasonLen {
			return ctrlMsg{}, errors.New("control message too long")
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return ctrlMsg{}, err
		}
		m.reason = string(b)
	}
	if m.kind != msgBye && m.kind != msgAbort {
		return ctrlMsg{}, fmt.Errorf("unknown control message %d", m.kind)
	}
	return m, nil
}
