package tcpstore

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous"
)

// These tests point the Go client at PyTorch 2.14's own TCPStore server
// (Debian sid's, in the sid bed: the classic backend, since Debian builds
// torch without libuv), so the new wire generation. They skip without the
// bed and fail without it in CI.

// TestClientTorch214Server: the Go client does every op against PyTorch
// 2.14's server, with the master waiting for it as a worker (ADD init/),
// and it and PyTorch's own client read each other's keys. A timed-out wait
// is cancelled (CANCEL_WAIT) and the connection goes on.
func TestClientTorch214Server(t *testing.T) {
	bed := sidbed.Require(t)
	const script = `
import sys, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=datetime.timedelta(seconds=60))
print("ready", s.libuvBackend, flush=True)
s.set("py/key", b"from-python")
s.add("py/cnt", 5)
s.compare_set("py/cas", "", "first")
s.set("py/ready", b"1")
s.wait(["go/done"])
out = [
    ("key", s.get("go/key")),
    ("cnt", s.get("go/cnt"), s.add("go/cnt", 0)),
    ("cas", s.get("go/cas"), s.compare_set("go/cas", "y", "z")),
    ("append", s.get("go/append"), s.get("go/twice")),
    ("multi", s.multi_get(["go/m1", "go/m2"])),
    ("never", s.get("go/never")),
]
for o in out:
    print(repr(o), flush=True)
s.set("py/checked", b"1")
s.wait(["go/bye"])
`
	addr := clFreeAddr(t)
	port := addr[strings.LastIndexByte(addr, ':')+1:]
	p := torchtest.StartWith(t, bed.Python(), nil, script, port)

	// The master blocks until a second worker has joined: us.
	c := clDial(t, addr, ClientConfig{Wire: GenNew, WorldSize: 2, Timeout: 60 * time.Second})
	if line := clTorchLine(t, p, "ready", 60*time.Second); line != "ready False" {
		t.Fatalf("master printed %q, want the classic backend", line)
	}
	ctx := clCtx(t, 60*time.Second)
	if n := clMust(c.JoinedClients(ctx))(t); n != 2 {
		t.Errorf("init/ = %d, want 2 (the master and us)", n)
	}

	clTorchPeerOps(ctx, t, c)
	keys := clMust(c.ListKeys(ctx))(t)
	for _, want := range []string{"py/key", "go/key", "go/m1", "go/append"} {
		if !containsString(keys, want) {
			t.Errorf("ListKeys = %q, missing %q", keys, want)
		}
	}

	// A timed-out wait is cancelled on the same connection (CANCEL_WAIT),
	// which goes on: new-generation servers answer the cancel.
	err := c.Wait(clCtx(t, 200*time.Millisecond), "go/never")
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	clOK(t, c.Set(ctx, "go/never", []byte("set after the timeout")))
	clWantValue(t, c, "go/never", "set after the timeout")

	// BARRIER with world size 1 returns at once; the key keeps its count.
	clOK(t, c.Barrier(ctx, "go/bar", 1))

	clOK(t, c.Set(ctx, "go/done", nil))
	clWantValue(t, c, "py/checked", "1")
	clOK(t, c.Set(ctx, "go/bye", nil))
	got := p.Wait(t, 30*time.Second)
	for _, want := range []string{
		`('key', b'from-go')`,
		`('cnt', b'7', 7)`,
		`('cas', b'y', b'z')`,
		`('append', b'potato', b'abab')`,
		`('multi', [b'1', b'2'])`,
		`('never', b'set after the timeout')`,
	} {
		if !strings.Contains(got, want+"\n") {
			t.Errorf("python printed\n%s\nwant a line %s", got, want)
		}
	}
}

// TestClientTorch214ServerWrongGeneration: an old-generation client (no
// VALIDATE) is refused by PyTorch 2.14's server, which closes the
// connection; Dial reports it within its bound instead of hanging.
func TestClientTorch214ServerWrongGeneration(t *testing.T) {
	bed := sidbed.Require(t)
	const script = `
import datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
print("port", s.port, flush=True)
s.wait(["never"])
`
	p := torchtest.StartWith(t, bed.Python(), nil, script)
	port := strings.TrimPrefix(clTorchLine(t, p, "port ", 60*time.Second), "port ")
	c, err := Dial(clCtx(t, 10*time.Second), "127.0.0.1:"+port, ClientConfig{Wire: GenOld, Timeout: 3 * time.Second})
	if err == nil {
		defer c.Close()
		start := time.Now()
		err = c.Set(clCtx(t, 3*time.Second), "k", []byte("v"))
		if err == nil {
			_, err = c.Get(clCtx(t, 3*time.Second), "k")
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("an old-generation request took %v", time.Since(start))
		}
	}
	if err == nil {
		t.Fatal("an old-generation client worked against PyTorch 2.14's server")
	}
	t.Logf("old generation on a 2.14 server: %v", err)
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// clTorchPeerOps reads the keys a PyTorch peer set (py/ready, py/key,
// py/cas, py/cnt) and does every op both wire generations have, leaving
// go/key, go/cnt (7), go/cas (y), go/append (potato), go/twice (abab),
// go/m1 and go/m2 for the peer to check.
func clTorchPeerOps(ctx context.Context, t *testing.T, c *Client) {
	t.Helper()
	// Python's keys, read from Go.
	clWantValue(t, c, "py/ready", "1")
	clWantValue(t, c, "py/key", "from-python")
	clWantValue(t, c, "py/cas", "first")
	if n := clMust(c.Add(ctx, "py/cnt", 0))(t); n != 5 {
		t.Errorf("Add(py/cnt, 0) = %d, want 5", n)
	}

	// Every op, checked from Go and (below) from Python.
	clOK(t, c.Set(ctx, "go/key", []byte("from-go")))
	clMust(c.Add(ctx, "go/cnt", 3))(t)
	if n := clMust(c.Add(ctx, "go/cnt", 4))(t); n != 7 {
		t.Errorf("Add(go/cnt) = %d, want 7", n)
	}
	for _, tc := range []struct{ key, expected, desired, want string }{
		{"go/cas", "", "x", "x"},
		{"go/cas", "wrong", "y", "x"},
		{"go/cas", "x", "y", "y"},
		{"go/absent", "e", "d", "e"},
	} {
		if got := clMust(c.CompareSet(ctx, tc.key, []byte(tc.expected), []byte(tc.desired)))(t); string(got) != tc.want {
			t.Errorf("CompareSet(%s, %q, %q) = %q, want %q", tc.key, tc.expected, tc.desired, got, tc.want)
		}
	}
	n0 := clMust(c.NumKeys(ctx))(t)
	clOK(t, c.Set(ctx, "go/deleted", nil))
	if n := clMust(c.NumKeys(ctx))(t); n != n0+1 {
		t.Errorf("NumKeys after a Set = %d, want %d", n, n0+1)
	}
	if !clMust(c.Delete(ctx, "go/deleted"))(t) || clMust(c.Delete(ctx, "go/deleted"))(t) {
		t.Error("Delete did not report true, then false")
	}
	if !clMust(c.Check(ctx, "go/key", "py/key"))(t) || clMust(c.Check(ctx, "go/absent"))(t) {
		t.Error("Check is wrong")
	}
	clOK(t, c.Append(ctx, "go/append", []byte("po")))
	clOK(t, c.Append(ctx, "go/append", []byte("tato")))
	clOK(t, c.Append(ctx, "go/twice", []byte("ab")))
	clOK(t, c.Append(ctx, "go/twice", []byte("ab")))
	clOK(t, c.MultiSet(ctx, []string{"go/m1", "go/m2"}, [][]byte{[]byte("1"), []byte("2")}))
	if got := clMust(c.MultiGet(ctx, "go/m2", "go/m1"))(t); string(got[0]) != "2" || string(got[1]) != "1" {
		t.Errorf("MultiGet = %q", got)
	}
}
