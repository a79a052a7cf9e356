package tcpstore

import (
	"errors"
	"io"
	"net"
	"sync"

	"go.uber.org/zap"
)

// connTransport serves one net.Conn from its own goroutine with blocking
// reads and writes. It works with any net.Conn (sockets of any kind, pipes,
// test doubles); on Linux, sockets go to the event loops instead unless
// ServerConfig.GoroutinePerConn asks for this.
type connTransport struct {
	srv  *Server
	nc   net.Conn
	sess *session

	wmu   sync.Mutex // serialises writes, so bytes leave in queue order
	spare []byte     // a drained output buffer for the next swap; under wmu
}

func (s *Server) newConnTransport(nc net.Conn) *connTransport {
	t := &connTransport{srv: s, nc: nc, sess: newSession(s, nc.RemoteAddr().String())}
	t.sess.kick = t.flushAsync
	return t
}

// serve reads and answers requests until the connection ends. The caller
// has registered the goroutine in srv.wg and t in srv.conns.
func (t *connTransport) serve() {
	s := t.srv
	defer func() {
		t.nc.Close()
		t.sess.release()
		t.sess.dec.drop()
		s.forget(t)
		s.wg.Done()
	}()
	dec := &t.sess.dec
	for {
		buf, err := dec.spare()
		if err != nil {
			s.refuse(t.sess, err)
			t.flush() // answers to the requests before this one
			return
		}
		n, rerr := t.nc.Read(buf)
		dec.commit(n)
		if err := t.sess.consume(); err != nil {
			t.flush() // answers queued before the bad request still go out
			return
		}
		if err := t.flush(); err != nil {
			s.log.Debug("store connection write failed", t.sess.logRemote(), zap.Error(err))
			return
		}
		dec.compact()
		if rerr != nil {
			if rerr != io.EOF && !errors.Is(rerr, net.ErrClosed) {
				s.log.Debug("store connection read failed", t.sess.logRemote(), zap.Error(rerr))
			} else if dec.pending() {
				s.log.Debug("store connection closed mid-request", t.sess.logRemote())
			}
			return
		}
	}
}

// flush writes everything queued so far.
func (t *connTransport) flush() error {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	buf := t.sess.takeOutput(t.spare)
	t.spare = nil
	var err error
	if len(buf) > 0 {
		_, err = t.nc.Write(buf)
	}
	if cap(buf) <= maxKeptOutput {
		t.spare = buf[:0]
	}
	return err
}

// flushAsync is the session's kick: it writes bytes queued by another
// connection's goroutine (a released waiter, a watch event) without making
// that goroutine wait on this client's socket.
func (t *connTransport) flushAsync() {
	s := t.srv
	if !s.goAsync() {
		return
	}
	go func() {
		defer s.wg.Done()
		if err := t.flush(); err != nil {
			t.nc.Close() // the serve goroutine sees it and cleans up
		}
	}()
}

// maxKeptOutput is the largest output buffer a connection keeps for reuse;
// a larger one (a big GET) is left to the garbage collector.
const maxKeptOutput = 64 << 10
