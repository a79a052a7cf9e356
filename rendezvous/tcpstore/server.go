package tcpstore

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// ServerConfig configures a Server. The zero value is usable: every field
// has a documented default.
type ServerConfig struct {
	// Storage holds the keys. Default: a fresh NewMemoryStorage().
	Storage Storage
	// Limits bound each request; zero fields take DefaultLimits().
	Limits Limits
	// LegacyTable reads opcodes on connections that do not open with
	// VALIDATE. Default Legacy113 (PyTorch 1.13–2.0).
	LegacyTable LegacyTable
	// Logger receives connection-level problems (bad input, I/O errors).
	// Default: no logging.
	Logger *zap.Logger
}

// Server serves c10d's TCPStore protocol, both wire generations, to any
// number of connections. Each connection gets one goroutine that reads and
// answers its requests in order; waiters are released from the goroutine
// of whoever wrote the key, without blocking it.
//
// Idle connections are never timed out: PyTorch 1.13 keeps a second,
// silent socket open for the life of every store.
type Server struct {
	storage Storage
	lim     Limits
	table   LegacyTable
	log     *zap.Logger

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closed    bool
	wg        sync.WaitGroup // connection and flush goroutines

	stats serverStats
}

type serverStats struct {
	accepted atomic.Int64
	open     atomic.Int64
	requests atomic.Int64
	rejected atomic.Int64
}

// Stats is a snapshot of a Server's counters.
type Stats struct {
	Accepted int64 // connections accepted so far
	Open     int64 // connections open now
	Requests int64 // requests handled
	Rejected int64 // connections closed for bad input
}

// ErrServerClosed is returned by Serve after Close.
var ErrServerClosed = errors.New("tcpstore: server closed")

// NewServer returns a Server; call Serve or use Listen to start it.
func NewServer(cfg ServerConfig) *Server {
	s := &Server{
		storage:   cfg.Storage,
		lim:       cfg.Limits.withDefaults(),
		table:     cfg.LegacyTable,
		log:       cfg.Logger,
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*conn]struct{}),
	}
	if s.storage == nil {
		s.storage = NewMemoryStorage()
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	return s
}

// Listen binds addr ("host:port"; port 0 picks one) and serves it in the
// background until Close. addr's host may be empty to listen on every
// address, IPv4 and IPv6, as PyTorch's server does.
func Listen(addr string, cfg ServerConfig) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := NewServer(cfg)
	if !s.track(ln) {
		return nil, ErrServerClosed // unreachable: s is new
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		_ = s.serve(ln)
	}()
	return s, nil
}

// Storage returns the server's storage.
func (s *Server) Storage() Storage { return s.storage }

// Addr returns the address of one of the server's listeners, or nil.
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ln := range s.listeners {
		return ln.Addr()
	}
	return nil
}

// Stats returns the server's counters.
func (s *Server) Stats() Stats {
	return Stats{
		Accepted: s.stats.accepted.Load(),
		Open:     s.stats.open.Load(),
		Requests: s.stats.requests.Load(),
		Rejected: s.stats.rejected.Load(),
	}
}

// Serve accepts connections on ln until Close, and then returns
// ErrServerClosed. It closes ln.
func (s *Server) Serve(ln net.Listener) error {
	if !s.track(ln) {
		ln.Close()
		return ErrServerClosed
	}
	return s.serve(ln)
}

// track registers ln so that Addr and Close see it.
func (s *Server) track(ln net.Listener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.listeners[ln] = struct{}{}
	return true
}

func (s *Server) serve(ln net.Listener) error {
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		ln.Close()
	}()

	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.isClosed() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && !errors.Is(err, net.ErrClosed) {
				// Out of file descriptors and the like: wait and retry,
				// as net/http does, rather than give up the store.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed; retrying", zap.Error(err), zap.Duration("in", backoff))
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		s.stats.accepted.Add(1)
		c := s.newConn(nc)
		if c == nil {
			nc.Close()
			return ErrServerClosed
		}
		go c.serve()
	}
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// Close stops the listeners, closes every connection and waits for the
// server's goroutines to finish. The storage is left as it is.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.wg.Wait()
		return nil
	}
	s.closed = true
	for ln := range s.listeners {
		ln.Close()
	}
	for c := range s.conns {
		c.nc.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *Server) newConn(nc net.Conn) *conn {
	c := &conn{srv: s, nc: nc, dec: newDecoder(s.lim, s.table)}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	s.stats.open.Add(1)
	return c
}

// conn is one client connection.
//
// Lock order: a conn's mu is never held while calling the Storage, because
// the Storage calls fire and event with its own lock held, and those take
// mu. wmu serialises socket writes so that bytes leave in the order they
// were queued in out.
type conn struct {
	srv *Server
	nc  net.Conn
	dec decoder // owned by the serve goroutine

	mu      sync.Mutex
	out     []byte // queued response bytes
	spare   []byte // the other half of out's double buffer
	waits   []*pendingWait
	watches []Cancel
	dead    bool

	wmu sync.Mutex
}

type waitState uint8

const (
	wsPending waitState = iota
	wsFired
	wsCanceled
)

// pendingWait is one WAIT or BARRIER registered with the storage. Its state
// moves once, under conn.mu, from pending to fired (STOP_WAITING queued) or
// to canceled (CANCEL_WAIT or disconnect), so a WAIT_CANCELED is never
// followed by a STOP_WAITING for the same wait.
type pendingWait struct {
	state  waitState
	cancel Cancel
}

func (c *conn) remote() zap.Field { return zap.Stringer("remote", c.nc.RemoteAddr()) }

func (c *conn) serve() {
	s := c.srv
	defer func() {
		c.nc.Close()
		c.release()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		s.stats.open.Add(-1)
		s.wg.Done()
	}()
	for {
		n, rerr := c.nc.Read(c.dec.spare())
		c.dec.commit(n)
		for {
			req, err := c.dec.next()
			if err == errIncomplete {
				break
			}
			if err == nil {
				s.stats.requests.Add(1)
				err = c.handle(req)
			}
			if err != nil {
				s.stats.rejected.Add(1)
				s.log.Warn("closing store connection", c.remote(), zap.Error(err))
				c.flush() // answers queued before the bad request still go out
				return
			}
		}
		if err := c.flush(); err != nil {
			s.log.Debug("store connection write failed", c.remote(), zap.Error(err))
			return
		}
		c.dec.compact()
		if rerr != nil {
			if rerr != io.EOF && !errors.Is(rerr, net.ErrClosed) {
				s.log.Debug("store connection read failed", c.remote(), zap.Error(rerr))
			} else if c.dec.pending() {
				s.log.Debug("store connection closed mid-request", c.remote())
			}
			return
		}
	}
}

// release withdraws every registration the connection holds.
func (c *conn) release() {
	c.mu.Lock()
	c.dead = true
	waits, watches := c.waits, c.watches
	c.waits, c.watches = nil, nil
	for _, w := range waits {
		w.state = wsCanceled
	}
	c.mu.Unlock()
	for _, w := range waits {
		w.cancel()
	}
	for _, cancel := range watches {
		cancel()
	}
}

// queue appends response bytes built by fn.
func (c *conn) queue(fn func([]byte) []byte) {
	c.mu.Lock()
	c.out = fn(c.out)
	c.mu.Unlock()
}

// flush writes everything queued so far.
func (c *conn) flush() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	buf := c.out
	c.out, c.spare = c.spare[:0], nil
	c.mu.Unlock()
	if len(buf) == 0 {
		c.mu.Lock()
		c.spare = buf
		c.mu.Unlock()
		return nil
	}
	_, err := c.nc.Write(buf)
	if cap(buf) <= 64<<10 {
		c.mu.Lock()
		c.spare = buf[:0]
		c.mu.Unlock()
	}
	return err
}

// flushAsync writes bytes queued by another connection's goroutine (a
// released waiter, a watch event) without making that goroutine wait on
// this client's socket.
func (c *conn) flushAsync() {
	s := c.srv
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		if err := c.flush(); err != nil {
			c.nc.Close() // the serve goroutine sees it and cleans up
		}
	}()
}

// fire is the storage's ready callback for w.
func (c *conn) fire(w *pendingWait) {
	c.mu.Lock()
	if w.state != wsPending || c.dead {
		c.mu.Unlock()
		return
	}
	w.state = wsFired
	c.out = append(c.out, stopWaiting)
	c.dropWait(w)
	c.mu.Unlock()
	c.flushAsync()
}

// dropWait removes w from c.waits; mu must be held.
func (c *conn) dropWait(w *pendingWait) {
	for i, x := range c.waits {
		if x == w {
			c.waits = append(c.waits[:i], c.waits[i+1:]...)
			return
		}
	}
}

// wait registers a WAIT or BARRIER through register and answers it now or
// when the storage fires.
func (c *conn) wait(register func(ready func()) (Cancel, bool, error)) error {
	w := &pendingWait{}
	cancel, done, err := register(func() { c.fire(w) })
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case done:
		c.out = append(c.out, stopWaiting)
	case w.state == wsPending:
		w.cancel = cancel
		c.waits = append(c.waits, w)
	}
	// Otherwise it fired already and queued its own STOP_WAITING.
	return nil
}

// cancelWaits answers CANCEL_WAIT: every pending wait is withdrawn and
// exactly one WAIT_CANCELED is sent, whether or not anything was pending.
func (c *conn) cancelWaits() {
	c.mu.Lock()
	waits := c.waits
	c.waits = nil
	for _, w := range waits {
		w.state = wsCanceled
	}
	c.out = append(c.out, waitCanceled)
	c.mu.Unlock()
	for _, w := range waits {
		w.cancel()
	}
}

// event is the storage's watch callback for the old generation's WATCH_KEY.
func (c *conn) event(ev WatchEvent) {
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		return
	}
	c.out = append(c.out, byte(ev.Type))
	c.out = appendBytes(c.out, ev.Key)
	c.out = appendBytes(c.out, ev.Old)
	c.out = appendBytes(c.out, ev.New)
	c.mu.Unlock()
	c.flushAsync()
}

// handle executes one request and queues its answer. An error closes the
// connection.
func (c *conn) handle(req *request) error {
	st := c.srv.storage
	switch req.op {
	case OpValidate:
		// The decoder accepts it only as the first request.
	case OpPing:
		c.queue(func(b []byte) []byte { return appendU32(b, req.u32) })
	case OpSet:
		return st.Set(req.key, req.val)
	case OpGet:
		// c10d clients WAIT before GET, so a missing key means it was
		// deleted in between; answer empty as the libuv backend does.
		v, _, err := st.Get(req.key)
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte { return appendBytes(b, v) })
	case OpCompareSet:
		v, err := st.CompareSet(req.key, req.val, req.val2)
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte { return appendBytes(b, v) })
	case OpAdd:
		n, err := st.Add(req.key, req.n)
		if err != nil {
			if errors.Is(err, rendezvous.ErrNotInteger) {
				return protocolErrorf("ADD %q: %v", req.key, err)
			}
			return err
		}
		c.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpCheck:
		ok, err := st.Check(req.keys)
		if err != nil {
			return err
		}
		r := checkNotReady
		if ok {
			r = checkReady
		}
		c.queue(func(b []byte) []byte { return append(b, r) })
	case OpWait:
		return c.wait(func(ready func()) (Cancel, bool, error) { return st.Wait(req.keys, ready) })
	case OpBarrier:
		return c.wait(func(ready func()) (Cancel, bool, error) { return st.Barrier(req.key, req.n, ready) })
	case OpCancelWait:
		c.cancelWaits()
	case OpNumKeys:
		n, err := st.NumKeys()
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpDelete:
		ok, err := st.Delete(req.key)
		if err != nil {
			return err
		}
		var n int64
		if ok {
			n = 1
		}
		c.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpAppend:
		return st.Append(req.key, req.val)
	case OpMultiGet:
		vals := make([][]byte, len(req.keys))
		for i, k := range req.keys {
			v, _, err := st.Get(k)
			if err != nil {
				return err
			}
			vals[i] = v
		}
		c.queue(func(b []byte) []byte {
			for _, v := range vals {
				b = appendBytes(b, v)
			}
			return b
		})
	case OpMultiSet:
		for i, k := range req.keys {
			if err := st.Set(k, req.vals[i]); err != nil {
				return err
			}
		}
	case OpListKeys:
		keys, err := st.Keys()
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte {
			b = appendI64(b, int64(len(keys)))
			for _, k := range keys {
				b = appendBytes(b, k)
			}
			return b
		})
	case OpQueuePush:
		return st.QueuePush(req.key, req.val)
	case OpQueuePop:
		v, n, err := st.QueuePop(req.key)
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte {
			b = appendI64(b, n)
			if n > 0 {
				b = appendBytes(b, v)
			}
			return b
		})
	case OpQueueLen:
		n, err := st.QueueLen(req.key)
		if err != nil {
			return err
		}
		c.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpWatchKey:
		cancel, err := st.Watch(req.key, c.event)
		if err != nil {
			return err
		}
		c.mu.Lock()
		c.watches = append(c.watches, cancel)
		c.out = append(c.out, watchKeyRegistered)
		c.mu.Unlock()
	default:
		return protocolErrorf("unhandled opcode %v", req.op)
	}
	return nil
}
