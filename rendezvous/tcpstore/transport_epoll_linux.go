//go:build linux

package tcpstore

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// eventLoop serves many connections from one goroutine with epoll, the way
// PyTorch's libuv backend does, instead of a goroutine per connection.
//
// Why: a store's requests are tiny, so its cost is syscalls. Go's netpoller
// spends three per request (a read that returns EAGAIN, the read after the
// wakeup, the write) plus a goroutine park and wakeup; level-triggered epoll
// spends one read and one write, and epoll_wait is shared by every
// connection that is ready. Idle connections cost no goroutine and no
// buffer, only their small session.
//
// One loop owns a connection: it alone reads, writes and closes it. Other
// goroutines (a SET on another connection releasing a waiter here) only
// queue output in the session and kick the loop, which writes it.
type eventLoop struct {
	srv     *Server
	epfd    int
	wakefd  int // eventfd: kicks and stop
	scratch []byte
	events  []unix.EpollEvent
	conns   []*loopConn // indexed by fd; owned by the loop goroutine

	qmu      sync.Mutex
	incoming []*loopConn // accepted, not yet registered
	kicked   []*loopConn // with output queued by other goroutines
	stopping bool
	done     bool // wakefd is closed: never write it again
	// sleeping is set while the loop is (about to be) in epoll_wait, so
	// that kickers write the eventfd only when it is needed.
	sleeping atomic.Bool
}

// loopConn is one connection owned by an event loop.
type loopConn struct {
	fd      int
	sess    *session
	out     []byte // output being written; owned by the loop
	off     int    // bytes of out already written
	writing bool   // the socket is full: wait for EPOLLOUT, stop reading
	queued  bool   // in loop.kicked; guarded by loop.qmu
	closed  bool
}

const (
	scratchSize = 64 << 10
	readEvents  = unix.EPOLLIN | unix.EPOLLRDHUP
	// While output is stuck, stop reading: a client that does not read
	// its answers cannot make us buffer without bound.
	writeEvents = unix.EPOLLOUT | unix.EPOLLRDHUP
)

func newEventLoop(srv *Server) (*eventLoop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(epfd)
		return nil, err
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wakefd)}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &ev); err != nil {
		unix.Close(epfd)
		unix.Close(wakefd)
		return nil, err
	}
	return &eventLoop{
		srv:     srv,
		epfd:    epfd,
		wakefd:  wakefd,
		scratch: make([]byte, scratchSize),
		events:  make([]unix.EpollEvent, 256),
	}, nil
}

// dupConn takes the socket out of Go's netpoller: it returns a duplicate
// descriptor (non-blocking, like the original) and closes nc. ok is false
// for a net.Conn that is not a socket.
func dupConn(nc net.Conn) (fd int, ok bool) {
	sc, isSock := nc.(syscall.Conn)
	if !isSock {
		return -1, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, false
	}
	var derr error
	if err := rc.Control(func(orig uintptr) {
		fd, derr = unix.FcntlInt(orig, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil || derr != nil {
		return -1, false
	}
	nc.Close()
	return fd, true
}

// add hands a connection to the loop; the loop registers it. The caller
// holds srv.mu and has checked that the server is open.
func (l *eventLoop) add(fd int, remote string) {
	c := &loopConn{fd: fd, sess: newSession(l.srv, remote)}
	c.sess.kick = func() { l.kick(c) }
	l.qmu.Lock()
	defer l.qmu.Unlock()
	l.incoming = append(l.incoming, c)
	l.wakeLocked()
}

// kick asks the loop to write c's queued output.
func (l *eventLoop) kick(c *loopConn) {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	if !c.queued {
		c.queued = true
		l.kicked = append(l.kicked, c)
	}
	if l.sleeping.Load() {
		l.wakeLocked()
	}
}

// stop makes the loop close its connections and return.
func (l *eventLoop) stop() {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	l.stopping = true
	l.wakeLocked()
}

// wakeLocked interrupts epoll_wait; qmu must be held, which orders it
// before shutdown closes the eventfd.
func (l *eventLoop) wakeLocked() {
	if l.done {
		return
	}
	one := [8]byte{1}
	unix.Write(l.wakefd, one[:]) // EAGAIN means it is already signalled
}

// run is the loop's goroutine; srv.wg counts it.
func (l *eventLoop) run() {
	defer l.srv.wg.Done()
	defer l.shutdown()
	for {
		if l.drain() {
			return
		}
		// Announce the sleep before the last look at the queues: a kick
		// that comes after the look sees sleeping and writes the eventfd.
		l.sleeping.Store(true)
		if l.hasWork() {
			l.sleeping.Store(false)
			continue
		}
		n, err := unix.EpollWait(l.epfd, l.events, -1)
		l.sleeping.Store(false)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			l.srv.log.Error("store event loop failed", zap.Error(err))
			return
		}
		for _, ev := range l.events[:n] {
			fd := int(ev.Fd)
			if fd == l.wakefd {
				var b [8]byte
				unix.Read(l.wakefd, b[:])
				continue
			}
			c := l.conn(fd)
			if c == nil {
				continue
			}
			if c.writing {
				l.flush(c) // EPOLLOUT, or an error the write will report
			} else {
				l.readable(c)
			}
		}
	}
}

func (l *eventLoop) hasWork() bool {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	return l.stopping || len(l.incoming) > 0 || len(l.kicked) > 0
}

// drain registers new connections and writes kicked output. It reports
// whether the loop must stop.
func (l *eventLoop) drain() bool {
	l.qmu.Lock()
	incoming, kicked, stopping := l.incoming, l.kicked, l.stopping
	l.incoming, l.kicked = nil, nil
	for _, c := range kicked {
		c.queued = false
	}
	l.qmu.Unlock()
	for _, c := range incoming {
		l.register(c)
	}
	for _, c := range kicked {
		if !c.closed && !c.writing {
			l.flush(c)
		}
	}
	return stopping
}

func (l *eventLoop) register(c *loopConn) {
	for c.fd >= len(l.conns) {
		l.conns = append(l.conns, make([]*loopConn, max(len(l.conns), 64))...)
	}
	l.conns[c.fd] = c
	ev := unix.EpollEvent{Events: readEvents, Fd: int32(c.fd)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, c.fd, &ev); err != nil {
		l.srv.log.Warn("store connection not registered", c.sess.logRemote(), zap.Error(err))
		l.close(c)
	}
}

func (l *eventLoop) conn(fd int) *loopConn {
	if fd < len(l.conns) {
		return l.conns[fd]
	}
	return nil
}

// readable reads what arrived, answers every complete request and writes
// the answers.
func (l *eventLoop) readable(c *loopConn) {
	dec := &c.sess.dec
	var n int
	var err error
	if dec.pending() {
		buf, serr := dec.spare()
		if serr != nil {
			l.srv.refuse(c.sess, serr)
			l.close(c)
			return
		}
		n, err = unix.Read(c.fd, buf)
		if n > 0 {
			dec.commit(n)
		}
	} else {
		// Nothing half-read: parse straight from the loop's buffer and
		// keep only a partial request's bytes (dec.retain).
		n, err = unix.Read(c.fd, l.scratch)
		if n > 0 {
			dec.borrow(l.scratch[:n])
		}
	}
	switch {
	case err == unix.EAGAIN || err == unix.EINTR:
		return // level-triggered: epoll reports it again
	case err != nil:
		l.srv.log.Debug("store connection read failed", c.sess.logRemote(), zap.Error(err))
		l.close(c)
		return
	case n == 0:
		if dec.pending() {
			l.srv.log.Debug("store connection closed mid-request", c.sess.logRemote())
		}
		l.close(c)
		return
	}
	perr := c.sess.consume()
	if rerr := dec.retain(); rerr != nil && perr == nil {
		l.srv.refuse(c.sess, rerr)
		perr = rerr
	}
	l.flush(c)
	if perr != nil {
		l.close(c)
	}
}

// flush writes c's output until it is all out or the socket is full.
func (l *eventLoop) flush(c *loopConn) {
	for !c.closed {
		if c.off == len(c.out) {
			drained := c.out[:0]
			if cap(drained) > maxKeptOutput {
				drained = nil
			}
			c.out, c.off = c.sess.takeOutput(drained), 0
			if len(c.out) == 0 {
				break
			}
		}
		n, err := unix.Write(c.fd, c.out[c.off:])
		switch {
		case err == unix.EAGAIN:
			l.setWriting(c, true)
			return
		case err == unix.EINTR:
			continue
		case err != nil:
			if !errors.Is(err, unix.EPIPE) && !errors.Is(err, unix.ECONNRESET) {
				l.srv.log.Debug("store connection write failed", c.sess.logRemote(), zap.Error(err))
			}
			l.close(c)
			return
		}
		c.off += n
	}
	l.setWriting(c, false)
}

// setWriting switches c between reading (the normal state) and waiting for
// room to write.
func (l *eventLoop) setWriting(c *loopConn, writing bool) {
	if c.closed || c.writing == writing {
		return
	}
	events := uint32(readEvents)
	if writing {
		events = writeEvents
	}
	ev := unix.EpollEvent{Events: events, Fd: int32(c.fd)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_MOD, c.fd, &ev); err != nil {
		l.close(c)
		return
	}
	c.writing = writing
}

func (l *eventLoop) close(c *loopConn) {
	if c.closed {
		return
	}
	c.closed = true
	unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, c.fd, nil)
	unix.Close(c.fd)
	if l.conn(c.fd) == c {
		l.conns[c.fd] = nil
	}
	c.out = nil
	c.sess.release()
	c.sess.dec.drop()
	l.srv.stats.open.Add(-1)
}

// shutdown closes every connection and the loop's own descriptors.
func (l *eventLoop) shutdown() {
	l.qmu.Lock()
	incoming := l.incoming
	l.incoming, l.kicked = nil, nil
	l.qmu.Unlock()
	for _, c := range incoming {
		l.close(c)
	}
	for _, c := range l.conns {
		if c != nil {
			l.close(c)
		}
	}
	unix.Close(l.epfd)
	l.qmu.Lock()
	l.done = true
	unix.Close(l.wakefd)
	l.qmu.Unlock()
}

// startLoops starts n event loops; the caller holds srv.mu.
func startLoops(srv *Server, n int) ([]*eventLoop, error) {
	loops := make([]*eventLoop, 0, n)
	for range max(n, 1) {
		l, err := newEventLoop(srv)
		if err != nil {
			for _, l := range loops {
				unix.Close(l.epfd)
				unix.Close(l.wakefd)
			}
			return nil, err
		}
		loops = append(loops, l)
	}
	for _, l := range loops {
		srv.wg.Add(1)
		go l.run()
	}
	return loops, nil
}
