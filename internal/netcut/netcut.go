// Package netcut is a TCP proxy for tests that stands for a link between a
// client and its server, and can cut it: while cut, bytes are held, not
// passed on, and nothing is reset, as on a blackholed link whose packets
// are dropped until it heals; healed, the held bytes go on. A cut can be
// armed to come when the client first sends a given request, so that it
// lands after the connections are made.
package netcut

import (
	"net"
	"sync"
	"testing"
)

// Link is one proxied link; the client dials Addr.
type Link struct {
	addr string

	mu     sync.Mutex
	up     chan struct{} // closed while the link passes bytes
	armed  bool
	first  byte // with armed: the byte a client's chunk begins with that cuts the link
	cuts   int
	conns  []net.Conn
	closed chan struct{}
	wg     sync.WaitGroup
}

// New starts a Link to upstream, up; the test's cleanup closes it and its
// connections.
func New(t testing.TB, upstream string) *Link {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &Link{addr: ln.Addr().String(), up: make(chan struct{}), closed: make(chan struct{})}
	close(l.up)
	l.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", upstream)
			if err != nil {
				c.Close()
				continue
			}
			l.track(c, u)
			l.wg.Go(func() { l.pipe(u, c, true) })
			l.wg.Go(func() { l.pipe(c, u, false) })
		}
	})
	t.Cleanup(func() {
		close(l.closed)
		ln.Close()
		l.mu.Lock()
		for _, c := range l.conns {
			c.Close()
		}
		l.mu.Unlock()
		l.wg.Wait()
	})
	return l
}

// Addr is where the client connects.
func (l *Link) Addr() string { return l.addr }

// CutOnFirst arms a cut: the link is cut as the client next sends a chunk
// that begins with b (a request's first byte on a request-response
// protocol).
func (l *Link) CutOnFirst(b byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.armed, l.first = true, b
}

// Cut cuts the link now.
func (l *Link) Cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cutLocked()
}

// Heal lets the link pass bytes again, those held first.
func (l *Link) Heal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.up:
	default:
		close(l.up)
	}
}

// Cuts is how many times the link was cut.
func (l *Link) Cuts() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cuts
}

func (l *Link) cutLocked() {
	select {
	case <-l.up:
		l.up = make(chan struct{})
		l.cuts++
	default: // cut already
	}
}

func (l *Link) track(cs ...net.Conn) {
	l.mu.Lock()
	l.conns = append(l.conns, cs...)
	l.mu.Unlock()
}

// pipe copies src to dst while the link is up; a chunk read while it is
// cut waits for it to heal. From the client (fromClient), a chunk that
// begins with the armed byte cuts the link first.
func (l *Link) pipe(dst, src net.Conn, fromClient bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			l.mu.Lock()
			if fromClient && l.armed && buf[0] == l.first {
				l.armed = false
				l.cutLocked()
			}
			up := l.up
			l.mu.Unlock()
			select {
			case <-up:
			case <-l.closed:
				return
			}
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
