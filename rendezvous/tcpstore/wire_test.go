package tcpstore

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// Helpers that speak raw bytes to a server, so the tests pin the wire format
// itself rather than what our own client happens to send.

// h decodes hex with spaces and '|' separators, and quoted ASCII ("/k1").
func h(t testing.TB, s string) []byte {
	t.Helper()
	var out []byte
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == '|' || r == '\n' || r == '\t' }) {
		if len(f) >= 2 && f[0] == '"' && f[len(f)-1] == '"' {
			out = append(out, f[1:len(f)-1]...)
			continue
		}
		b, err := hex.DecodeString(f)
		if err != nil {
			t.Fatalf("bad hex %q: %v", f, err)
		}
		out = append(out, b...)
	}
	return out
}

// str is a wire string: u64 LE length, then the bytes.
func str(s string) string {
	return hex.EncodeToString(appendString(nil, s))
}

// transports are the ways a Server can carry connections; eachTransport
// runs a test once per transport, as subtests named after it.
var transports = []string{"event-loop", "goroutine-per-conn"}

func eachTransport(t *testing.T, test func(t *testing.T)) {
	for _, tr := range transports {
		t.Run(tr, test)
	}
}

// startServer starts a server on loopback for the test. Under eachTransport
// the subtest's name picks the transport.
func startServer(t testing.TB, cfg ServerConfig) *Server {
	t.Helper()
	if strings.Contains(t.Name(), "/goroutine-per-conn") {
		cfg.GoroutinePerConn = true
	}
	s, err := Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

type rawConn struct {
	t testing.TB
	net.Conn
}

func dialRaw(t testing.TB, s *Server) *rawConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", s.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{t, c}
}

func (c *rawConn) send(hexs string) {
	c.t.Helper()
	if _, err := c.Write(h(c.t, hexs)); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// expect reads exactly the bytes of hexs, failing on anything else.
func (c *rawConn) expect(hexs string) {
	c.t.Helper()
	want := h(c.t, hexs)
	got := make([]byte, len(want))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil {
		c.t.Fatalf("reading %d bytes (want % x): %v (got % x)", len(want), want, err, got)
	}
	if !bytes.Equal(got, want) {
		c.t.Fatalf("got  % x\nwant % x", got, want)
	}
}

// expectNothing asserts that no byte arrives within d.
func (c *rawConn) expectNothing(d time.Duration) {
	c.t.Helper()
	c.SetReadDeadline(time.Now().Add(d))
	var b [1]byte
	n, err := c.Read(b[:])
	var ne net.Error
	if n != 0 || !errors.As(err, &ne) || !ne.Timeout() {
		c.t.Fatalf("expected silence, got %d bytes (% x), err %v", n, b[:n], err)
	}
}

// expectClosed asserts that the server closes the connection.
func (c *rawConn) expectClosed() {
	c.t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !isReset(err) {
		c.t.Fatalf("expected the server to close the connection, got %v after % x", err, b)
	}
	if len(b) != 0 {
		c.t.Fatalf("expected close without a reply, got % x", b)
	}
}

func isReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "connection reset")
}

const (
	validate = "00 cef7853c"
	i64one   = "01000000 00000000"
	i64zero  = "00000000 00000000"
)
