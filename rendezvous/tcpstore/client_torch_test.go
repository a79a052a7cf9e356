package tcpstore

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous"
)

// These tests point the Go client at PyTorch's own TCPStore server
// (Debian's 1.13.1, so the old wire generation). They skip without torch
// and fail without it in CI. Python runs are few: each costs seconds.

// clTorchLine waits for the Python process to print a line starting with
// prefix and returns the line.
func clTorchLine(t *testing.T, p *torchtest.Proc, prefix string, d time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		for line := range strings.Lines(p.Stdout()) {
			if strings.HasPrefix(line, prefix) {
				return strings.TrimSpace(line)
			}
		}
		select {
		case <-p.Done():
			t.Fatalf("python exited before printing %q\nstdout:\n%s\nstderr:\n%s", prefix, p.Stdout(), p.Stderr())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("python did not print %q within %v\nstdout:\n%s\nstderr:\n%s", prefix, d, p.Stdout(), p.Stderr())
		}
	}
}

// TestClientTorchServer: the Go client does every op a 1.13 server has
// against PyTorch's server, and it and PyTorch's own client (the master's)
// read each other's keys.
func TestClientTorchServer(t *testing.T) {
	torchtest.Python(t)
	const script = `
import datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
print("port", s.port, flush=True)
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
    ("multi", s.get("go/m1"), s.get("go/m2")),
    ("never", s.get("go/never")),
]
for o in out:
    print(repr(o), flush=True)
s.set("py/checked", b"1")
s.wait(["go/bye"])
`
	p := torchtest.Start(t, nil, script)
	port := strings.TrimPrefix(clTorchLine(t, p, "port ", 60*time.Second), "port ")
	c := clDial(t, "127.0.0.1:"+port, ClientConfig{Wire: GenOld, Timeout: 30 * time.Second})
	ctx := clCtx(t, 60*time.Second)

	clTorchPeerOps(ctx, t, c)

	// A timed-out wait costs the connection (spec §2.3: a 1.13 server
	// would answer the abandoned wait later), and the client goes on.
	err := c.Wait(clCtx(t, 200*time.Millisecond), "go/never")
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	clOK(t, c.Set(ctx, "go/never", []byte("set after the timeout")))
	clWantValue(t, c, "go/never", "set after the timeout")
	clWantValue(t, c, "go/key", "from-go")

	clOK(t, c.Set(ctx, "go/done", nil))
	clWantValue(t, c, "py/checked", "1")
	clOK(t, c.Set(ctx, "go/bye", nil))
	got := p.Wait(t, 30*time.Second)
	for _, want := range []string{
		`('key', b'from-go')`,
		`('cnt', b'7', 7)`,
		`('cas', b'y', b'z')`,
		`('append', b'potato', b'abab')`,
		`('multi', b'1', b'2')`,
		`('never', b'set after the timeout')`,
	} {
		if !strings.Contains(got, want+"\n") {
			t.Errorf("python printed\n%s\nwant a line %s", got, want)
		}
	}
}

// TestClientTorchWaitForWorkers: a PyTorch master created with
// world_size=2 blocks in its constructor until the Go client (WorldSize 2)
// has connected and sent ADD init/ 1.
func TestClientTorchWaitForWorkers(t *testing.T) {
	torchtest.Python(t)
	const script = `
import sys, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True,
                  timeout=datetime.timedelta(seconds=60), wait_for_workers=True)
print("ready", flush=True)
s.wait(["go/bye"])
`
	addr := clFreeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	p := torchtest.Start(t, nil, script, port)

	// Once the server listens, the master must still be waiting for us.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if nc, err := net.Dial("tcp", addr); err == nil {
			nc.Close() // an idle connection is no worker
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("python never listened on %s\nstderr:\n%s", addr, p.Stderr())
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	if strings.Contains(p.Stdout(), "ready") {
		t.Fatal("the master returned before the Go worker joined")
	}

	c := clDial(t, addr, ClientConfig{Wire: GenOld, WorldSize: 2, Timeout: 30 * time.Second})
	clTorchLine(t, p, "ready", 30*time.Second)
	ctx := clCtx(t, 10*time.Second)
	if n := clMust(c.JoinedClients(ctx))(t); n != 2 {
		t.Errorf("init/ = %d, want 2 (the master and us)", n)
	}
	clOK(t, c.Set(ctx, "go/bye", nil))
	p.Wait(t, 30*time.Second)
}
