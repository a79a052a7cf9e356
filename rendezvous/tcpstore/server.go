package tcpstore

import (
	"context"
	"errors"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// ServerConfig configures a Server. The zero value is usable: every field
// has a documented default.
type ServerConfig struct {
	// Storage holds the keys. Default: a fresh MemoryStorage capped at
	// MaxStored.
	Storage Storage
	// MaxStored caps the bytes of keys and values of the MemoryStorage the
	// server creates when Storage is nil (MemoryStorageConfig.MaxBytes); a
	// write past it closes that connection. Default 0: no cap, as
	// PyTorch's server.
	MaxStored int64
	// Limits bound each request; zero fields take DefaultLimits().
	Limits Limits
	// LegacyTable reads opcodes on connections that do not open with
	// VALIDATE. Default Legacy113 (PyTorch 1.13–2.0).
	LegacyTable LegacyTable
	// Logger receives connection-level problems (bad input, I/O errors).
	// Default: no logging.
	Logger *zap.Logger
	// MaxBuffered caps the memory that all connections together may hold
	// in requests still arriving (their read buffers). A connection whose
	// next bytes would take more is closed, with a log line saying so (c10d's
	// protocol has no error reply), and counted in Stats.BufferFull; the
	// others go on. Buffers grow only as bytes arrive, so this bounds what
	// peers actually sent, not what they announced. Default
	// DefaultMaxBuffered (2 GiB), also for values ≤ 0.
	MaxBuffered int64
	// GoroutinePerConn serves every connection from its own goroutine with
	// blocking I/O instead of from the epoll event loops (one per CPU) used
	// for sockets on Linux. Default false. Connections that are not
	// sockets, and every connection on other systems, are served that way
	// regardless.
	GoroutinePerConn bool
}

// Server serves c10d's TCPStore protocol, both wire generations, to any
// number of connections. A connection's requests are answered in order;
// waiters are released from the goroutine of whoever wrote the key,
// without blocking it.
//
// Idle connections are never timed out: PyTorch 1.13 keeps a second,
// silent socket open for the life of every store.
type Server struct {
	storage Storage
	lim     Limits
	table   LegacyTable
	log     *zap.Logger
	perConn bool
	mem     *budget

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*connTransport]struct{}
	loops     []*eventLoop // started on the first socket, if epoll works
	loopErr   error        // why there are no loops, once tried
	nextLoop  int
	closed    bool
	wg        sync.WaitGroup // every goroutine the server starts

	stats serverStats
}

type serverStats struct {
	accepted  atomic.Int64
	open      atomic.Int64
	requests  atomic.Int64
	rejected  atomic.Int64
	full      atomic.Int64
	abandoned atomic.Int64
}

// Stats is a snapshot of a Server's counters.
type Stats struct {
	Accepted int64 // connections accepted so far
	Open     int64 // connections open now
	Requests int64 // requests handled
	Rejected int64 // connections closed for bad input or for BufferFull
	// BufferFull counts connections closed because their request would
	// have taken the buffered bytes past ServerConfig.MaxBuffered.
	BufferFull int64
	// Buffered is the memory that connections hold now in read buffers
	// (requests still arriving), the amount MaxBuffered caps.
	Buffered int64
	// AbandonedWaits counts WAITs a client gave up without CANCEL_WAIT
	// (a PyTorch 1.13 wait that timed out), withdrawn unanswered.
	AbandonedWaits int64
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
		perConn:   cfg.GoroutinePerConn,
		mem:       newBudget(DefaultMaxBuffered),
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*connTransport]struct{}),
	}
	if cfg.MaxBuffered > 0 {
		s.mem = newBudget(cfg.MaxBuffered)
	}
	if s.storage == nil {
		s.storage = NewMemoryStorageConfig(MemoryStorageConfig{MaxBytes: cfg.MaxStored})
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
	// No TCP keep-alive on accepted connections, as c10d's server: it
	// would cost four setsockopts per connection, and an idle client (the
	// 1.13 callback socket) is legitimate.
	lc := net.ListenConfig{KeepAlive: -1}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, err
	}
	s := NewServer(cfg)
	if !s.track(ln) || !s.goAsync() {
		return nil, ErrServerClosed // unreachable: s is new
	}
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
		Accepted:       s.stats.accepted.Load(),
		Open:           s.stats.open.Load(),
		Requests:       s.stats.requests.Load(),
		Rejected:       s.stats.rejected.Load(),
		BufferFull:     s.stats.full.Load(),
		Buffered:       s.mem.held(),
		AbandonedWaits: s.stats.abandoned.Load(),
	}
}

// refuse counts and logs a connection closed for a reason other than bad
// input (which consume reports): its buffer had no room in the budget.
func (s *Server) refuse(sess *session, err error) {
	s.stats.rejected.Add(1)
	if errors.Is(err, ErrBufferFull) {
		s.stats.full.Add(1)
	}
	s.log.Warn("closing store connection", sess.logRemote(), zap.Error(err))
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

// goAsync counts a goroutine about to start in wg, unless the server is
// closed; the goroutine must call wg.Done.
func (s *Server) goAsync() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
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
		if !s.adopt(nc) {
			nc.Close()
			return ErrServerClosed
		}
	}
}

// adopt hands a new connection to an event loop or to a goroutine of its
// own. It returns false if the server is closed.
func (s *Server) adopt(nc net.Conn) bool {
	remote := nc.RemoteAddr().String()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if l := s.loopLocked(); l != nil {
		if fd, ok := dupConn(nc); ok {
			s.stats.open.Add(1)
			l.add(fd, remote)
			return true
		}
	}
	t := s.newConnTransport(nc)
	s.conns[t] = struct{}{}
	s.stats.open.Add(1)
	s.wg.Add(1)
	go t.serve()
	return true
}

// loopLocked returns the next event loop round-robin, starting the loops on
// first use; nil when connections get goroutines instead. mu must be held.
func (s *Server) loopLocked() *eventLoop {
	if s.perConn || s.loopErr != nil {
		return nil
	}
	if s.loops == nil {
		loops, err := startLoops(s, runtime.GOMAXPROCS(0))
		if err != nil {
			s.loopErr = err
			s.log.Warn("store event loops unavailable; one goroutine per connection", zap.Error(err))
			return nil
		}
		s.loops = loops
	}
	l := s.loops[s.nextLoop%len(s.loops)]
	s.nextLoop++
	return l
}

// forget drops a finished goroutine-per-connection transport.
func (s *Server) forget(t *connTransport) {
	s.mu.Lock()
	delete(s.conns, t)
	s.mu.Unlock()
	s.stats.open.Add(-1)
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
	for t := range s.conns {
		t.nc.Close()
	}
	loops := s.loops
	s.mu.Unlock()
	for _, l := range loops {
		l.stop()
	}
	s.wg.Wait()
	return nil
}
