package tcpstore

import (
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// These tests point PyTorch 2.14's own TCPStore client (Debian sid's
// python3-torch, in the sid bed: internal/sidbed) at the Go server, through
// a proxy that decodes what the client sends with the server's own decoder,
// so that each test can say which requests a real 2.14 client really sent.
// They skip without the bed and fail without it in CI.

// opSpy is a TCP proxy in front of a server that records, per client
// connection, the wire generation the decoder detected and the requests.
type opSpy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns []*spiedConn
	open  []net.Conn
}

type spiedConn struct {
	gen Generation
	ops []Op
}

func startOpSpy(t *testing.T, target string) *opSpy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &opSpy{ln: ln, target: target}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(s.close)
	return s
}

func (s *opSpy) port() string {
	a := s.ln.Addr().String()
	return a[strings.LastIndexByte(a, ':')+1:]
}

func (s *opSpy) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", s.target)
		if err != nil {
			c.Close()
			continue
		}
		sc := &spiedConn{gen: genUnknown}
		s.mu.Lock()
		s.conns = append(s.conns, sc)
		s.open = append(s.open, c, up)
		s.mu.Unlock()
		s.wg.Add(2)
		go func() { // server to client: as it is
			defer s.wg.Done()
			_, _ = io.Copy(c, up)
			c.Close()
		}()
		go func() { // client to server: forwarded, then decoded
			defer s.wg.Done()
			defer up.Close()
			d := newDecoder(DefaultLimits(), Legacy113, nil) // nil: no memory account
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := up.Write(buf[:n]); werr != nil {
						return
					}
					d.feed(buf[:n])
					for {
						req, derr := d.next()
						if derr != nil {
							break
						}
						s.mu.Lock()
						sc.gen, sc.ops = d.gen, append(sc.ops, req.op)
						s.mu.Unlock()
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

func (s *opSpy) close() {
	s.ln.Close()
	s.mu.Lock()
	for _, c := range s.open {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// seen returns the requests of every connection of generation g, and how
// many connections of each generation sent anything.
func (s *opSpy) seen(g Generation) (ops map[Op]int, gens map[Generation]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ops, gens = map[Op]int{}, map[Generation]int{}
	for _, c := range s.conns {
		if len(c.ops) == 0 {
			continue
		}
		gens[c.gen]++
		if c.gen != g {
			continue
		}
		for _, op := range c.ops {
			ops[op]++
		}
	}
	return ops, gens
}

// TestTorch214ClientsEveryOp drives every operation PyTorch 2.14's Python
// TCPStore has against the Go server, and checks both what Python got back
// and that each request type really went over the wire: the VALIDATE/PING
// handshake, APPEND, MULTI_GET/SET, LIST_KEYS, BARRIER, a CANCEL_WAIT
// after a timed-out wait or barrier (after which the same store goes on
// working). The queues it refuses: Debian's torch has no libuv, and its
// classic-backend client sends no queue request.
func TestTorch214ClientsEveryOp(t *testing.T) {
	bed := sidbed.Require(t)
	s := startServer(t, ServerConfig{})
	spy := startOpSpy(t, s.Addr().String())
	const script = `
import sys, threading, time, datetime
import torch.distributed as dist
port = int(sys.argv[1])
T = datetime.timedelta
def store(ws=None, **kw):
    return dist.TCPStore("127.0.0.1", port, ws, False, timeout=T(seconds=20), **kw)
a, b = store(2), store(2)
out = []
out.append(("classic", a.libuvBackend, b.libuvBackend))
a.set("k1", b"v1"); out.append(("get", b.get("k1")))
out.append(("add", a.add("cnt", 5), b.add("cnt", -2), b.get("cnt")))
out.append(("cas", a.compare_set("c", "", "x"), a.compare_set("c", "x", "y"),
            a.compare_set("c", "z", "w"), a.compare_set("absent", "e", "d"), b.get("c")))
# APPEND has no reply: two connections' appends may reach the server in
# either order, so one client appends and the other reads after it
a.append("ap", b"po"); a.append("ap", b"tato"); out.append(("append", a.get("ap"), b.get("ap")))
a.multi_set(["m1", "m2"], [b"1", b"2"]); out.append(("multi_get", b.multi_get(["m2", "m1"])))
out.append(("check", a.check(["k1", "m1"]), a.check(["k1", "nope"])))
out.append(("num_keys", a.num_keys()))  # init/, k1, cnt, c, ap, m1, m2
out.append(("delete", a.delete_key("k1"), a.delete_key("k1"), a.num_keys()))
out.append(("list_keys", sorted(a.list_keys())))
# a WAIT released by another client's SET
def setter():
    time.sleep(0.3); b.set("released", b"1")
threading.Thread(target=setter).start()
t0 = time.time(); a.wait(["released"]); out.append(("wait", time.time() - t0 >= 0.2))
# a wait that times out: the client cancels it (CANCEL_WAIT) and keeps its connection
t0 = time.time()
try:
    a.wait(["never"], T(milliseconds=300)); out.append(("wait timeout", "no error"))
except Exception as e:
    out.append(("wait timeout", type(e).__name__, time.time() - t0 < 3))
b.set("never", b"late")
a.set("after", b"ok"); out.append(("after cancel", a.get("after"), a.get("never"), a.add("cnt", 1)))
# BARRIER: released when the second client arrives; a lone one times out
threading.Thread(target=lambda: (time.sleep(0.3), b.barrier("bar", 2))).start()
t0 = time.time(); a.barrier("bar", 2); out.append(("barrier", time.time() - t0 >= 0.2))
try:
    a.barrier("lonely", 2, T(milliseconds=300)); out.append(("barrier timeout", "no error"))
except Exception as e:
    out.append(("barrier timeout", type(e).__name__))
out.append(("after barrier", a.add("cnt", 1)))
# queues: a classic-backend client refuses them, and Debian's torch has no
# libuv client to send them
for name, call in (("push", lambda: a.queue_push("q", "x")), ("pop", lambda: a.queue_pop("q", False)),
                   ("len", lambda: a.queue_len("q"))):
    try:
        call(); out.append(("queue " + name, "sent"))
    except Exception as e:
        out.append(("queue " + name, type(e).__name__, "legacy TCPStore backend" in str(e)))
for o in out: print(repr(o))
`
	p := torchtest.StartWith(t, bed.Python(), nil, script, spy.port())
	got := p.Wait(t, 120*time.Second)
	want := []string{
		`('classic', False, False)`,
		`('get', b'v1')`,
		`('add', 5, 3, b'3')`,
		`('cas', b'x', b'y', b'y', b'e', b'y')`,
		`('append', b'potato', b'potato')`,
		`('multi_get', [b'2', b'1'])`,
		`('check', True, False)`,
		`('num_keys', 7)`,
		`('delete', True, False, 6)`,
		`('list_keys', ['ap', 'c', 'cnt', 'm1', 'm2'])`,
		`('wait', True)`,
		`('wait timeout', 'DistStoreError', True)`,
		`('after cancel', b'ok', b'late', 4)`,
		`('barrier', True)`,
		`('barrier timeout', 'DistStoreError')`,
		`('after barrier', 5)`,
		`('queue push', 'NotImplementedError', True)`,
		`('queue pop', 'NotImplementedError', True)`,
		`('queue len', 'NotImplementedError', True)`,
	}
	if strings.TrimSpace(got) != strings.Join(want, "\n") {
		t.Fatalf("python printed\n%s\nwant\n%s\nstderr:\n%s", got, strings.Join(want, "\n"), p.Stderr())
	}
	ops, gens := spy.seen(GenNew)
	if gens[GenOld] != 0 || gens[GenNew] != 2 {
		t.Errorf("connections by generation %v, want the two stores' new-generation ones", gens)
	}
	var missing []string
	for op := OpValidate; op <= OpBarrier; op++ {
		if op == OpQueuePush || op == OpQueuePop || op == OpQueueLen {
			if ops[op] != 0 {
				t.Errorf("the classic client sent %d %v", ops[op], op)
			}
			continue
		}
		if ops[op] == 0 {
			missing = append(missing, op.String())
		}
	}
	if len(missing) > 0 {
		t.Errorf("the 2.14 client never sent %v (sent %v)", missing, ops)
	}
	if ops[OpValidate] != ops[OpPing] {
		t.Errorf("%d VALIDATE but %d PING: every connection opens with both", ops[OpValidate], ops[OpPing])
	}
}

// TestTorch214And113ClientsShareServer: PyTorch 1.13 (old wire) and 2.14
// (new wire) clients use one Go server at the same time, each connection's
// generation detected on its first bytes, and read each other's keys.
func TestTorch214And113ClientsShareServer(t *testing.T) {
	bed := sidbed.Require(t)
	py113 := torchtest.Python(t)
	s := startServer(t, ServerConfig{})
	spy := startOpSpy(t, s.Addr().String())
	const script = `
import sys, datetime
import torch, torch.distributed as dist
me, other = sys.argv[2], sys.argv[3]
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=30))
s.add("both", 1)
s.set("from/" + me, torch.__version__.encode())  # after the add: whoever reads it sees both
s.wait(["from/" + other])
print(me, "read", s.get("from/" + other).decode().split("+")[0], "both", s.add("both", 0))
`
	p214 := torchtest.StartWith(t, bed.Python(), nil, script, spy.port(), "new", "old")
	p113 := torchtest.StartWith(t, py113, nil, script, spy.port(), "old", "new")
	out := []string{strings.TrimSpace(p214.Wait(t, 90*time.Second)), strings.TrimSpace(p113.Wait(t, 90*time.Second))}
	v214, v113 := strings.Split(bed.Stamp.Torch, "+")[0], strings.Split(torchtest.Version(t), "+")[0]
	want := []string{"new read " + v113 + " both 2", "old read " + v214 + " both 2"}
	if !slices.Equal(out, want) {
		t.Fatalf("printed %q, want %q", out, want)
	}
	_, gens := spy.seen(GenNew)
	if gens[GenNew] == 0 || gens[GenOld] == 0 {
		t.Fatalf("connections by generation %v, want both generations", gens)
	}
	if v, ok, _ := s.Storage().Get([]byte(InitKey)); !ok || string(v) != "2" {
		t.Fatalf("init/ = %q, want 2 (one client of each generation)", v)
	}
}
