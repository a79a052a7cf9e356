package tcpstore

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// These tests point unmodified PyTorch clients (Debian's 1.13.1 here) at the
// Go server. They skip without torch and fail without it in CI.

func port(s *Server) string {
	a := s.Addr().String()
	return a[strings.LastIndexByte(a, ':')+1:]
}

// TestTorchClientsEveryOp drives every op PyTorch 1.13's Python TCPStore
// exposes, from several clients at once, including a WAIT released by
// another client's SET and a timeout.
func TestTorchClientsEveryOp(t *testing.T) {
	torchtest.Python(t)
	s := startServer(t, ServerConfig{})
	const script = `
import sys, threading, time, datetime
import torch.distributed as dist
port = int(sys.argv[1])
T = datetime.timedelta
def store(ws=3):
    return dist.TCPStore("127.0.0.1", port, ws, False, timeout=T(seconds=20))
a, b, c = store(), store(), store()
out = []
# set/get, both directions
a.set("k1", b"v1"); out.append(("get", b.get("k1")))
# add: ASCII decimal counters
out.append(("add", a.add("cnt", 5), b.add("cnt", -2), c.get("cnt")))
# compare_set: the four cases
out.append(("cas", a.compare_set("c", "", "x"), a.compare_set("c", "x", "y"),
            a.compare_set("c", "z", "w"), a.compare_set("absent", "e", "d"), b.get("c")))
# num_keys counts init/ (three clients joined with world_size 3)
out.append(("num_keys", a.num_keys(), a.get("init/") if False else None))
# delete
out.append(("delete", a.delete_key("k1"), a.delete_key("k1"), a.num_keys()))
# a WAIT released by another client's SET
def setter():
    time.sleep(0.3); c.set("released", b"1")
threading.Thread(target=setter).start()
t0 = time.time(); b.wait(["released"]); out.append(("wait", round(time.time() - t0, 1) >= 0.2))
# a GET that blocks until another client's ADD
def adder():
    time.sleep(0.2); c.add("late", 7)
threading.Thread(target=adder).start()
out.append(("blocking get", a.get("late")))
# many clients: 16 threads x 50 adds, each with its own store
def worker():
    s = dist.TCPStore("127.0.0.1", port, None, False, timeout=T(seconds=20))
    for _ in range(50): s.add("many", 1)
ths = [threading.Thread(target=worker) for _ in range(16)]
[x.start() for x in ths]; [x.join() for x in ths]
out.append(("many", a.get("many")))
# timeout on a missing key (use a store that is not reused afterwards: spec §2.3)
d = dist.TCPStore("127.0.0.1", port, None, False, timeout=T(seconds=20))
d.set_timeout(T(seconds=1))
t0 = time.time()
try:
    d.get("never"); out.append(("timeout", "no error"))
except RuntimeError as e:
    out.append(("timeout", "imeout" in str(e), time.time() - t0 < 3))
for o in out: print(repr(o))
`
	got := torchtest.Run(t, 90*time.Second, nil, script, port(s))
	want := []string{
		`('get', b'v1')`,
		`('add', 5, 3, b'3')`,
		`('cas', b'x', b'y', b'y', b'e', b'y')`,
		`('num_keys', 4, None)`, // init/, k1, cnt, c
		`('delete', True, False, 3)`,
		`('wait', True)`,
		`('blocking get', b'7')`,
		`('many', b'800')`,
		`('timeout', True, True)`,
	}
	if strings.TrimSpace(got) != strings.Join(want, "\n") {
		t.Fatalf("python printed\n%s\nwant\n%s", got, strings.Join(want, "\n"))
	}
	v, ok, _ := s.Storage().Get([]byte(InitKey))
	if !ok || string(v) != "3" {
		t.Fatalf("init/ = %q, want 3", v)
	}
}

// TestTorchGlooAllReduceOnAgentStore is what torchrun's static backend does
// to workers: four processes run init_process_group("gloo", "env://") with
// TORCHELASTIC_USE_AGENT_STORE=True against the Go server, then all_reduce.
func TestTorchGlooAllReduceOnAgentStore(t *testing.T) {
	torchtest.Python(t)
	s := startServer(t, ServerConfig{})
	const world = 4
	const script = `
import os, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
r = dist.get_rank()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
dist.barrier()
print(f"rank={r} world={dist.get_world_size()} sum={t.item():g}")
dist.destroy_process_group()
`
	var procs []*torchtest.Proc
	for r := range world {
		env := []string{
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port(s),
			fmt.Sprintf("RANK=%d", r), fmt.Sprintf("WORLD_SIZE=%d", world),
			"TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_RESTART_COUNT=0",
		}
		procs = append(procs, torchtest.Start(t, env, script))
	}
	var lines []string
	for _, p := range procs {
		lines = append(lines, strings.TrimSpace(p.Wait(t, 120*time.Second)))
	}
	sort.Strings(lines)
	for r, line := range lines {
		want := fmt.Sprintf("rank=%d world=%d sum=10", r, world)
		if line != want {
			t.Fatalf("rank %d printed %q, want %q", r, line, want)
		}
	}
	// The workers used the agent-store namespace of PyTorch 1.13
	// (spec §4): "/" + "/worker/attempt_0/" + their keys.
	keys, _ := s.Storage().Keys()
	var agent int
	for _, k := range keys {
		if strings.HasPrefix(string(k), "//worker/attempt_0/default_pg/") {
			agent++
		}
	}
	if agent == 0 {
		t.Fatalf("no key under //worker/attempt_0/default_pg/ in %q", keys)
	}
}

// TestTorchLargeKeysAndValues: PyTorch 1.13 and 2.14 clients set and
// read back values of 16 MB and 100 MB and keys of 9,000 bytes and 100 KB,
// through their PyTorch's own server and through ours, in the same test;
// both must store all of them (issue 17: ours used to close the
// connection).
func TestTorchLargeKeysAndValues(t *testing.T) {
	clients := []struct {
		name   string
		python func(t *testing.T) string
	}{
		{"1.13", func(t *testing.T) string { return torchtest.Python(t) }},
		{"2.14", func(t *testing.T) string { return sidbed.Require(t).Python() }},
	}
	for _, c := range clients {
		t.Run(c.name, func(t *testing.T) { testLargeKeysAndValues(t, c.python(t)) })
	}
}

func testLargeKeysAndValues(t *testing.T, python string) {
	const script = `
import sys, datetime, time
import torch.distributed as dist
T = datetime.timedelta(seconds=120)
if sys.argv[1] == "torch":
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=T)
    port = master.port
else:
    port = int(sys.argv[1])
a = dist.TCPStore("127.0.0.1", port, None, False, timeout=T)
b = dist.TCPStore("127.0.0.1", port, None, False, timeout=T)
cases = [("16 MB value", "v16", 16_000_000), ("100 MB value", "v100", 100_000_000),
         ("9000-byte key", "k" * 9000, 10), ("100 KB key", "K" * 100_000, 10)]
times = []
for i, (name, key, n) in enumerate(cases):
    val = bytes([97 + i]) * n
    t0 = time.perf_counter()
    a.set(key, val)
    got = b.get(key)
    times.append("%s %.0f ms" % (name, (time.perf_counter() - t0) * 1e3))
    print(repr((name, len(got), got == val)), flush=True)
    b.delete_key(key)
print(repr(("num_keys", a.num_keys())), flush=True)
print("set+get:", ", ".join(times), flush=True)
`
	s := startServer(t, ServerConfig{})
	want := strings.Join([]string{
		`('16 MB value', 16000000, True)`,
		`('100 MB value', 100000000, True)`,
		`('9000-byte key', 10, True)`,
		`('100 KB key', 10, True)`,
		`('num_keys', 0)`,
	}, "\n")
	for _, srv := range []struct{ name, arg string }{{"torch", "torch"}, {"gorun", port(s)}} {
		out := strings.TrimSpace(torchtest.StartWith(t, python, nil, script, srv.arg).Wait(t, 180*time.Second))
		got, times, _ := strings.Cut(out, "\nset+get:")
		t.Logf("%s's server, set+get:%s", srv.name, times)
		if got != want {
			t.Errorf("through %s's server python printed\n%s\nwant\n%s", srv.name, got, want)
		}
	}
	if st := s.Stats(); st.Rejected != 0 || st.Buffered > 4*4*initialBufSize {
		t.Fatalf("gorun's server: %+v", st)
	}
}
