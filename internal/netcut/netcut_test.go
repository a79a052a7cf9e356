package netcut

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// echoServer answers each line with itself.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

// TestLink: bytes pass while the link is up; an armed cut comes with the
// chunk that begins with its byte, and that chunk and what follows are
// held, not lost, until the link heals.
func TestLink(t *testing.T) {
	l := New(t, echoServer(t))
	c, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	say := func(s string) {
		t.Helper()
		if _, err := io.WriteString(c, s+"\n"); err != nil {
			t.Fatal(err)
		}
	}
	hear := func(within time.Duration) (string, error) {
		c.SetReadDeadline(time.Now().Add(within))
		return r.ReadString('\n')
	}
	say("a")
	if got, err := hear(5 * time.Second); err != nil || got != "a\n" {
		t.Fatalf("through the link: %q, %v", got, err)
	}
	l.CutOnFirst('x')
	say("b") // not the armed byte: passes
	if got, err := hear(5 * time.Second); err != nil || got != "b\n" {
		t.Fatalf("before the armed byte: %q, %v", got, err)
	}
	say("xy")
	if got, err := hear(200 * time.Millisecond); err == nil {
		t.Fatalf("through a cut link: %q", got)
	}
	if l.Cuts() != 1 {
		t.Fatalf("cuts = %d, want 1", l.Cuts())
	}
	l.Heal()
	if got, err := hear(5 * time.Second); err != nil || got != "xy\n" {
		t.Fatalf("after the heal: %q, %v; want the held bytes", got, err)
	}
	l.Cut()
	say("z")
	if got, err := hear(200 * time.Millisecond); err == nil {
		t.Fatalf("through a cut link: %q", got)
	}
	l.Heal()
	if got, err := hear(5 * time.Second); err != nil || got != "z\n" {
		t.Fatalf("after the second heal: %q, %v", got, err)
	}
}
