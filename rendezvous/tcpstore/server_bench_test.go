package tcpstore

import (
	"io"
	"net"
	"testing"
	"time"
)

// scriptConn is a net.Conn whose reads return first, then req n times, one
// request per call, and whose writes are discarded: it measures the server's
// own cost per request, without sockets or a client.
type scriptConn struct {
	first, req []byte
	n, i       int
}

func (c *scriptConn) Read(p []byte) (int, error) {
	if c.i > c.n {
		return 0, io.EOF
	}
	r := c.req
	if c.i == 0 {
		r = c.first
	}
	c.i++
	return copy(p, r), nil
}
func (c *scriptConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *scriptConn) Close() error                     { return nil }
func (c *scriptConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *scriptConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *scriptConn) SetDeadline(time.Time) error      { return nil }
func (c *scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptConn) SetWriteDeadline(time.Time) error { return nil }

// BenchmarkServerHandle reports the server's allocations per request for
// the ops of the mixed load (make bench).
func BenchmarkServerHandle(b *testing.B) {
	value := make([]byte, 32)
	ops := map[string]string{
		"set":          "01 " + str("/load/0/1") + hexOf(value),
		"get":          "03 " + str("/load/0/1"),
		"add":          "04 " + str("/load/0/counter") + i64one,
		"wait-present": "06 01000000 00000000 " + str("/load/0/1"),
		"check":        "05 01000000 00000000 " + str("/load/0/1"),
	}
	for _, name := range []string{"set", "get", "add", "wait-present", "check"} {
		b.Run(name, func(b *testing.B) {
			s := NewServer(ServerConfig{})
			s.storage.Set([]byte("/load/0/1"), value)
			req := h(b, ops[name])
			fc := &scriptConn{first: h(b, validate), req: req, n: b.N}
			c := s.newConn(fc)
			b.ReportAllocs()
			b.ResetTimer()
			c.serve()
			if got := s.Stats().Requests; got != int64(b.N)+1 || s.Stats().Rejected != 0 {
				b.Fatalf("served %d requests (%d rejected), want %d", got, s.Stats().Rejected, b.N+1)
			}
		})
	}
}

func hexOf(b []byte) string { return str(string(b)) }
