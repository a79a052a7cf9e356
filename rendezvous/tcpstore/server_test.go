package tcpstore

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// step is one exchange on a connection: bytes the client sends, then bytes
// it must receive ("" = no reply expected; "CLOSED" = the server must close).
type step struct{ send, want string }

// The server tests below hold for every Storage. serverSuite lists them;
// each runs here as its own Test function on a MemoryStorage, and
// RunServerSuite (export_test.go) runs them all on another Storage (the
// etcd one, in etcd_conformance_test.go).

// newStorage returns a fresh, empty storage for one server of a test.
type newStorage func(t testing.TB) Storage

func memoryStorage(testing.TB) Storage { return NewMemoryStorage() }

var serverSuite = []struct {
	name string
	test func(*testing.T, newStorage)
}{
	{"ServerWireOld", testServerWireOld},
	{"ServerWireNew", testServerWireNew},
	{"ServerGenerationsShareKeys", testServerGenerationsShareKeys},
	{"ServerWaitReleasedBySet", testServerWaitReleasedBySet},
	{"ServerDeleteDoesNotReleaseWait", testServerDeleteDoesNotReleaseWait},
	{"ServerCancelWaitNeverFollowedByStop", testServerCancelWaitNeverFollowedByStop},
	{"ServerCancelRace", testServerCancelRace},
	{"ServerAbandonedWaitWithdrawn", testServerAbandonedWaitWithdrawn},
	{"ServerBarrier", testServerBarrier},
	{"ServerWatchKeyOld", testServerWatchKeyOld},
	{"ServerIdleConnectionsStay", testServerIdleConnectionsStay},
	{"ServerManyClients", testServerManyClients},
	{"ServerSplitAndCoalesced", testServerSplitAndCoalesced},
	{"ServerMalformedInput", testServerMalformedInput},
	{"ServerTruncatedFrameThenClose", testServerTruncatedFrameThenClose},
	{"ServerPartialHugeValueIsBounded", testServerPartialHugeValueIsBounded},
	{"ServerSlowClientDoesNotBlockOthers", testServerSlowClientDoesNotBlockOthers},
	{"ServerCloseReleasesEverything", testServerCloseReleasesEverything},
}

func TestServerWireOld(t *testing.T)              { testServerWireOld(t, memoryStorage) }
func TestServerWireNew(t *testing.T)              { testServerWireNew(t, memoryStorage) }
func TestServerGenerationsShareKeys(t *testing.T) { testServerGenerationsShareKeys(t, memoryStorage) }
func TestServerWaitReleasedBySet(t *testing.T)    { testServerWaitReleasedBySet(t, memoryStorage) }
func TestServerDeleteDoesNotReleaseWait(t *testing.T) {
	testServerDeleteDoesNotReleaseWait(t, memoryStorage)
}
func TestServerCancelWaitNeverFollowedByStop(t *testing.T) {
	testServerCancelWaitNeverFollowedByStop(t, memoryStorage)
}
func TestServerCancelRace(t *testing.T) { testServerCancelRace(t, memoryStorage) }
func TestServerAbandonedWaitWithdrawn(t *testing.T) {
	testServerAbandonedWaitWithdrawn(t, memoryStorage)
}
func TestServerBarrier(t *testing.T)             { testServerBarrier(t, memoryStorage) }
func TestServerWatchKeyOld(t *testing.T)         { testServerWatchKeyOld(t, memoryStorage) }
func TestServerIdleConnectionsStay(t *testing.T) { testServerIdleConnectionsStay(t, memoryStorage) }
func TestServerManyClients(t *testing.T)         { testServerManyClients(t, memoryStorage) }
func TestServerSplitAndCoalesced(t *testing.T)   { testServerSplitAndCoalesced(t, memoryStorage) }
func TestServerMalformedInput(t *testing.T)      { testServerMalformedInput(t, memoryStorage) }
func TestServerTruncatedFrameThenClose(t *testing.T) {
	testServerTruncatedFrameThenClose(t, memoryStorage)
}
func TestServerPartialHugeValueIsBounded(t *testing.T) {
	testServerPartialHugeValueIsBounded(t, memoryStorage)
}
func TestServerSlowClientDoesNotBlockOthers(t *testing.T) {
	testServerSlowClientDoesNotBlockOthers(t, memoryStorage)
}
func TestServerCloseReleasesEverything(t *testing.T) {
	testServerCloseReleasesEverything(t, memoryStorage)
}

// startServerOn starts a server on a storage from ns (unless cfg names
// one), as startServer does.
func startServerOn(t testing.TB, ns newStorage, cfg ServerConfig) *Server {
	t.Helper()
	if cfg.Storage == nil {
		cfg.Storage = ns(t)
	}
	return startServer(t, cfg)
}

// testServerWireOld replays traffic captured from PyTorch 1.13 clients
// (spec §2.1–2.2) and checks the server's exact replies.
func testServerWireOld(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		k1 := str("/k1")
		cases := []struct {
			name  string
			steps []step
		}{
			{"set then get (captured)", []step{
				{"00 03000000 00000000 2f6b31 02000000 00000000 7631", ""},
				{"05 01000000 00000000 03000000 00000000 2f6b31", "00"},
				{"02 03000000 00000000 2f6b31", "02000000 00000000 7631"},
			}},
			{"init key counting", []step{
				{"03 " + str("init/") + i64one, i64one},
				{"03 " + str("init/") + i64one, "02000000 00000000"},
				{"06", "01000000 00000000"},
			}},
			{"num_keys and delete (captured)", []step{
				{"00 " + k1 + str("v1"), ""},
				{"06", i64one},
				{"08 " + k1, i64one},
				{"08 " + k1, i64zero},
				{"06", i64zero},
			}},
			{"add as ascii decimal (captured)", []step{
				{"03 " + str("/cnt") + "05000000 00000000", "05000000 00000000"},
				{"03 " + str("/cnt") + "feffffff ffffffff", "03000000 00000000"},
				{"02 " + str("/cnt"), str("3")},
			}},
			{"compare_set four cases", []step{
				// absent, expected empty: stores desired, returns it
				{"01 " + str("/c") + str("") + str("x"), str("x")},
				// present and equal: stores desired
				{"01 " + str("/c") + str("x") + str("y"), str("y")},
				// present and different: returns current, no change
				{"01 " + str("/c") + str("z") + str("w"), str("y")},
				// absent, expected non-empty: returns expected, no change
				{"01 " + str("/nokey") + str("e") + str("d"), str("e")},
				{"04 01000000 00000000 " + str("/nokey"), "01"},
				{"02 " + str("/c"), str("y")},
			}},
			{"check", []step{
				{"00 " + k1 + str("v"), ""},
				{"04 01000000 00000000 " + k1, "00"},
				{"04 02000000 00000000 " + k1 + str("/zz"), "01"},
			}},
			{"get of a deleted key answers empty like libuv", []step{
				{"02 " + str("/gone"), str("")},
			}},
			{"unknown opcode closes", []step{{"09", "CLOSED"}}},
			{"add on a non-number closes", []step{
				{"00 " + str("/s") + str("abc"), ""},
				{"03 " + str("/s") + i64one, "CLOSED"},
			}},
			{"add uses stoll rules", []step{
				{"00 " + str("/s") + str(" 12abc"), ""},
				{"03 " + str("/s") + i64one, "0d000000 00000000"},
			}},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				s := startServerOn(t, ns, ServerConfig{})
				runSteps(t, dialRaw(t, s), tc.steps)
			})
		}
	})
}

func runSteps(t *testing.T, c *rawConn, steps []step) {
	t.Helper()
	for _, st := range steps {
		c.send(st.send)
		switch st.want {
		case "":
		case "CLOSED":
			c.expectClosed()
		default:
			c.expect(st.want)
		}
	}
}

// testServerWireNew checks the VALIDATE-era protocol (spec §1) from byte
// fixtures: PyTorch ≥2.1 cannot be installed here.
func testServerWireNew(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		k := str("/k")
		hello := validate + " 0d 78563412" // VALIDATE, PING 0x12345678
		cases := []struct {
			name  string
			steps []step
		}{
			{"handshake echoes the ping nonce", []step{{hello, "78563412"}}},
			{"handshake coalesced with ADD init/", []step{
				{hello + " 04 " + str("init/") + i64one, "78563412 " + i64one},
			}},
			{"set get add", []step{
				{validate + " 01 " + k + str("v") + " 03 " + k, str("v")},
				{"04 " + str("/n") + "07000000 00000000", "07000000 00000000"},
			}},
			{"compare_set, check, num_keys, delete", []step{
				{validate + " 02 " + k + str("") + str("a"), str("a")},
				{"02 " + k + str("b") + str("c"), str("a")},
				{"05 01000000 00000000 " + k, "00"},
				{"07", i64one},
				{"08 " + k, i64one},
				{"05 01000000 00000000 " + k, "01"},
			}},
			{"append, multi_set, multi_get", []step{
				{validate + " 01 " + str("/foo") + str("po") + " 09 " + str("/foo") + str("tato") +
					" 09 " + str("/bar") + str("pota") + " 09 " + str("/bar") + str("to"), ""},
				{"0a 02000000 00000000 " + str("/foo") + str("/bar"), str("potato") + str("potato")},
				{"0b 02000000 00000000 " + str("/a") + str("1") + str("/b") + str("2"), ""},
				{"0a 03000000 00000000 " + str("/b") + str("/a") + str("/missing"), str("2") + str("1") + str("")},
			}},
			{"cancel_wait with nothing pending still answers", []step{
				{validate + " 0c", "01"},
				{"0c", "01"},
			}},
			{"wait on present key answers at once", []step{
				{validate + " 01 " + k + str("v") + " 06 01000000 00000000 " + k, "00"},
			}},
			{"wait then cancel", []step{
				{validate + " 06 01000000 00000000 " + k, ""},
				{"0c", "01"},
			}},
			{"queues", []step{
				{validate + " 10 " + str("/q"), i64zero},
				{"0f " + str("/q"), i64zero},
				{"0e " + str("/q") + str("a") + " 0e " + str("/q") + str("b") + " 10 " + str("/q"), "02000000 00000000"},
				// a non-empty queue satisfies CHECK (libuv) but is not a key
				{"05 01000000 00000000 " + str("/q"), "00"},
				{"07", i64zero},
				{"0f " + str("/q"), "02000000 00000000 " + str("a")},
				{"0f " + str("/q"), i64one + str("b")},
				{"0f " + str("/q"), i64zero},
			}},
			{"list_keys", []step{
				{validate + " 01 " + str("/x") + str("1"), ""},
				{"11", i64one + str("/x")},
			}},
			{"barrier of one answers at once and keeps the count", []step{
				{validate + " 12 " + str("/bar") + i64one, "00"},
				{"03 " + str("/bar"), str("1")},
				{"12 " + str("/bar") + i64one, "00"},
			}},
			{"second VALIDATE closes", []step{{validate + " " + validate, "CLOSED"}}},
			{"unknown opcode closes", []step{{validate + " 13", "CLOSED"}}},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				s := startServerOn(t, ns, ServerConfig{})
				runSteps(t, dialRaw(t, s), tc.steps)
			})
		}
	})
}

// testServerGenerationsShareKeys: one server, an old and a new client, the
// same keys (spec §2.4: decided per connection, not per process).
func testServerGenerationsShareKeys(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		old, nu := dialRaw(t, s), dialRaw(t, s)
		nu.send(validate + " 0d 01000000")
		nu.expect("01000000")
		old.send("00 " + str("/k") + str("from-old") + " 06") // GETNUMKEYS orders the SET first
		old.expect(i64one)
		nu.send("03 " + str("/k"))
		nu.expect(str("from-old"))
		nu.send("01 " + str("/j") + str("from-new") + " 07")
		nu.expect("02000000 00000000")
		old.send("02 " + str("/j"))
		old.expect(str("from-new"))
	})
}

// testServerWaitReleasedBySet: a WAIT is answered when another client writes
// the key, by each kind of write.
func testServerWaitReleasedBySet(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		writes := map[string]string{
			"set":         "01 " + str("/w") + str("v"),
			"add":         "04 " + str("/w") + i64one,
			"append":      "09 " + str("/w") + str("v"),
			"compare_set": "02 " + str("/w") + str("") + str("v"),
			"multi_set":   "0b 01000000 00000000 " + str("/w") + str("v"),
		}
		for name, write := range writes {
			t.Run(name, func(t *testing.T) {
				s := startServerOn(t, ns, ServerConfig{})
				waiter, writer := dialRaw(t, s), dialRaw(t, s)
				waiter.send(validate + " 06 02000000 00000000 " + str("/w") + str("/other"))
				writer.send(validate + " " + write)
				waiter.expectNothing(50 * time.Millisecond) // one of two keys
				writer.send("01 " + str("/other") + str("x"))
				waiter.expect("00")
				// After STOP_WAITING a CANCEL_WAIT still gets exactly one 01.
				waiter.send("0c")
				waiter.expect("01")
				waiter.expectNothing(50 * time.Millisecond)
			})
		}
	})
}

// testServerDeleteDoesNotReleaseWait pins c10d's rule that DELETE_KEY leaves
// waiters alone.
func testServerDeleteDoesNotReleaseWait(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		waiter, writer := dialRaw(t, s), dialRaw(t, s)
		waiter.send(validate + " 06 01000000 00000000 " + str("/w"))
		writer.send(validate + " 08 " + str("/w"))
		writer.expect(i64zero)
		waiter.expectNothing(50 * time.Millisecond)
	})
}

// testServerCancelWaitNeverFollowedByStop: after WAIT_CANCELED, a later write
// of the key must not send a stray STOP_WAITING (spec §1.7).
func testServerCancelWaitNeverFollowedByStop(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		waiter, writer := dialRaw(t, s), dialRaw(t, s)
		waiter.send(validate + " 06 01000000 00000000 " + str("/w"))
		waiter.send("0c")
		waiter.expect("01")
		writer.send(validate + " 01 " + str("/w") + str("v") + " 07")
		writer.expect(i64one)
		waiter.expectNothing(100 * time.Millisecond)
		// The connection is still in sync.
		waiter.send("07")
		waiter.expect(i64one)
	})
}

// testServerAbandonedWaitWithdrawn: PyTorch 1.13 times a WAIT out on its
// socket and sends nothing; its next request means the WAIT was given up.
// The server must withdraw it unanswered, so that a later write of the key
// puts no stray STOP_WAITING in front of the client's next replies (the
// survivor-mode hang of issue 12). Both generations.
func testServerAbandonedWaitWithdrawn(t *testing.T, ns newStorage) {
	gens := []struct {
		name, hello, wait, set, numKeys string
	}{
		{"old", "", "05", "00", "06"},
		{"new", validate, "06", "01", "07"},
	}
	for _, g := range gens {
		t.Run(g.name, func(t *testing.T) {
			eachTransport(t, func(t *testing.T) {
				s := startServerOn(t, ns, ServerConfig{})
				waiter, writer := dialRaw(t, s), dialRaw(t, s)
				if g.hello != "" {
					waiter.send(g.hello)
					writer.send(g.hello)
				}
				// Two abandoned WAITs, as a watcher that timed out twice.
				for range 2 {
					waiter.send(g.wait + " 01000000 00000000 " + str("/epoch/1"))
					waiter.expectNothing(30 * time.Millisecond)
				}
				waiter.send(g.numKeys)
				waiter.expect(i64zero)
				writer.send(g.set + " " + str("/epoch/1") + str("e1"))
				writer.send(g.numKeys)
				writer.expect(i64one)
				waiter.expectNothing(100 * time.Millisecond)
				// The next WAIT, for a key that does not exist, must wait
				// rather than read a stale answer.
				waiter.send(g.wait + " 01000000 00000000 " + str("/epoch/2"))
				waiter.expectNothing(50 * time.Millisecond)
				waiter.send(g.numKeys)
				waiter.expect(i64one)
				if n := s.Stats().AbandonedWaits; n != 3 {
					t.Errorf("AbandonedWaits = %d, want 3", n)
				}
			})
		})
	}
}

// testServerCancelRace hammers the window between a SET releasing a wait and
// the waiter cancelling it: the reply must be either 01 or 00 01, never
// anything else, and the stream must stay in sync.
func testServerCancelRace(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		waiter, writer := dialRaw(t, s), dialRaw(t, s)
		waiter.send(validate)
		writer.send(validate)
		for i := range 200 {
			key := str(fmt.Sprintf("/race%d", i))
			waiter.send("06 01000000 00000000 " + key)
			writer.send("01 " + key + str("v"))
			waiter.send("0c")
			waiter.SetReadDeadline(time.Now().Add(5 * time.Second))
			var b [1]byte
			if _, err := waiter.Read(b[:]); err != nil {
				t.Fatal(err)
			}
			if b[0] == 0 {
				waiter.expect("01")
			} else if b[0] != 1 {
				t.Fatalf("round %d: unexpected byte %02x", i, b[0])
			}
			// Once the writer has seen its SET applied, the waiter's stream
			// must be in sync and show the same count.
			count := fmt.Sprintf("%016x", swap64(uint64(i+1)))
			writer.send("07")
			writer.expect(count)
			waiter.send("07")
			waiter.expect(count)
		}
	})
}

func swap64(v uint64) uint64 {
	var r uint64
	for range 8 {
		r = r<<8 | v&0xff
		v >>= 8
	}
	return r
}

// testServerBarrier: N connections, the last arrival releases everyone, a
// plain WAIT on the key is released too, and early arrivals are not released
// by later increments.
func testServerBarrier(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		const n = 5
		s := startServerOn(t, ns, ServerConfig{})
		ws := fmt.Sprintf("%016x", swap64(n))
		conns := make([]*rawConn, n)
		for i := range conns {
			conns[i] = dialRaw(t, s)
			conns[i].send(validate)
		}
		watcher := dialRaw(t, s)
		watcher.send(validate + " 06 01000000 00000000 " + str("/b"))
		for i := range n - 1 {
			conns[i].send("12 " + str("/b") + ws)
		}
		for i := range n - 1 {
			conns[i].expectNothing(20 * time.Millisecond)
		}
		conns[n-1].send("12 " + str("/b") + ws)
		for _, c := range conns {
			c.expect("00")
		}
		watcher.expect("00")
	})
}

// testServerWatchKeyOld covers 1.13's WATCH_KEY callbacks on the second
// socket (captured: 01 S"/wk" S"" S"val"; delete → 02 …).
func testServerWatchKeyOld(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		main, cb := dialRaw(t, s), dialRaw(t, s)
		cb.expectNothing(50 * time.Millisecond) // an idle callback socket is fine
		cb.send("07 " + str("/wk"))
		cb.expect("03")
		main.send("00 " + str("/wk") + str("val"))
		cb.expect("01 " + str("/wk") + str("") + str("val"))
		main.send("00 " + str("/wk") + str("v2"))
		cb.expect("00 " + str("/wk") + str("val") + str("v2"))
		main.send("08 " + str("/wk"))
		main.expect(i64one)
		cb.expect("02 " + str("/wk") + str("v2") + str(""))
	})
}

// testServerIdleConnectionsStay: connections that say nothing are kept (the
// 1.13 callback socket), and a connection idle between requests still works.
func testServerIdleConnectionsStay(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		c := dialRaw(t, s)
		c.expectNothing(300 * time.Millisecond)
		c.send("06")
		c.expect(i64zero)
		if got := s.Stats().Open; got != 1 {
			t.Fatalf("open connections = %d, want 1", got)
		}
	})
}

// testServerManyClients runs concurrent ADDs from many connections of both
// generations and checks the exact total.
func testServerManyClients(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		const clients, adds = 64, 50
		s := startServerOn(t, ns, ServerConfig{})
		var wg sync.WaitGroup
		for i := range clients {
			c := dialRaw(t, s)
			wg.Add(1)
			go func() {
				defer wg.Done()
				add := "03 " + str("/total") + i64one
				if i%2 == 0 {
					c.Write(h(t, validate))
					add = "04 " + str("/total") + i64one
				}
				msg := h(t, add)
				buf := make([]byte, 8)
				for range adds {
					if _, err := c.Write(msg); err != nil {
						t.Error(err)
						return
					}
					c.SetReadDeadline(time.Now().Add(10 * time.Second))
					if _, err := readFull(c, buf); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		v, ok, _ := s.Storage().Get([]byte("/total"))
		if !ok || string(v) != fmt.Sprint(clients*adds) {
			t.Fatalf("total = %q, want %d", v, clients*adds)
		}
	})
}

func readFull(c *rawConn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// testServerSplitAndCoalesced sends a request stream one byte per write and
// then all at once; both give the same replies.
func testServerSplitAndCoalesced(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		stream := validate + " 0d 01020304 01 " + str("/a") + str("hello") + " 04 " + str("/n") + "02000000 00000000" +
			" 0a 02000000 00000000 " + str("/a") + str("/n")
		want := "01020304 02000000 00000000 " + str("hello") + str("2")
		for _, split := range []bool{true, false} {
			t.Run(fmt.Sprintf("split=%v", split), func(t *testing.T) {
				s := startServerOn(t, ns, ServerConfig{})
				c := dialRaw(t, s)
				b := h(t, stream)
				if split {
					for i := range b {
						if _, err := c.Write(b[i : i+1]); err != nil {
							t.Fatal(err)
						}
					}
				} else {
					c.Write(b)
				}
				c.expect(want)
			})
		}
	})
}

// testServerMalformedInput: bad input closes only the offending connection;
// the server stays up, other clients are unaffected, and no length prefix
// allocates past the limits.
func testServerMalformedInput(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		cases := []struct {
			name string
			send string
		}{
			{"huge key length", "00 ffffffff ffffffff"},
			{"key just over the limit (64 MiB)", validate + " 03 01000004 00000000"},
			{"value over the limit (1 GiB)", validate + " 01 " + str("/k") + "01000040 00000000"},
			{"huge key count", validate + " 05 ffffffff ffffffff"},
			{"key count over the limit", validate + " 0a 01000200 00000000"},
			{"unknown new opcode", validate + " 7f"},
			{"unknown old opcode", "42"},
			{"wrong magic reads as an old SET with a ~1 GB key", "00 deadbeef 00000000"},
			{"VALIDATE twice", validate + " 00 cef7853c"},
			{"add on a non-number", validate + " 01 " + str("/x") + str("abc") + " 04 " + str("/x") + i64one},
			{"add overflow", validate + " 04 " + str("/x") + "ffffffff ffffff7f 04 " + str("/x") + i64one},
		}
		s := startServerOn(t, ns, ServerConfig{})
		bystander := dialRaw(t, s)
		bystander.send(validate + " 01 " + str("/alive") + str("yes"))
		var before runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				c := dialRaw(t, s)
				c.send(tc.send)
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				// Replies to well-formed requests before the bad one may come
				// first; then the connection must be closed.
				buf := make([]byte, 64)
				for {
					_, err := c.Read(buf)
					if err != nil {
						if ne, ok := err.(interface{ Timeout() bool }); ok && ne.Timeout() {
							t.Fatal("server did not close the connection")
						}
						break
					}
				}
				bystander.send("03 " + str("/alive"))
				bystander.expect(str("yes"))
			})
		}
		var after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&after)
		if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 4<<20 {
			t.Fatalf("heap grew by %d bytes after malformed input", grew)
		}
		if got := s.Stats().Rejected; got != int64(len(cases)) {
			t.Fatalf("rejected = %d, want %d", got, len(cases))
		}
	})
}

// testServerTruncatedFrameThenClose: a client that dies mid-request
// leaves nothing behind: the key is not half-set and its connection is
// released.
func testServerTruncatedFrameThenClose(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		for _, partial := range []string{
			"00 03000000", // inside a length
			"00 " + str("/k1") + "05000000 00000000 ab",     // inside a value
			validate + " 06 02000000 00000000 " + str("/w"), // a WAIT missing a key
		} {
			c := dialRaw(t, s)
			c.send(partial)
			c.Close()
		}
		deadline := time.Now().Add(5 * time.Second)
		for s.Stats().Open != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("open connections = %d after the clients left", s.Stats().Open)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if _, ok, _ := s.Storage().Get([]byte("/k1")); ok {
			t.Fatal("a truncated SET stored its key")
		}
		c := dialRaw(t, s)
		c.send("06")
		c.expect(i64zero)
	})
}

// testServerPartialHugeValueIsBounded: a value announced at the limit
// (1 GiB) but sent slowly costs memory in proportion to what arrived, not
// to the prefix.
func testServerPartialHugeValueIsBounded(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		var before runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var conns []*rawConn
		for range 16 {
			c := dialRaw(t, s)
			c.send(validate + " 01 " + str("/big") + "00000040 00000000 " + strings.Repeat("ab", 100))
			conns = append(conns, c)
		}
		waitFor(t, "16 partial requests buffered", func() bool { return s.Stats().Buffered >= 16*100 })
		var after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&after)
		if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 2<<20 {
			t.Fatalf("16 partial 1 GiB values cost %d bytes of heap", grew)
		}
		if b := s.Stats().Buffered; b > 16*initialBufSize {
			t.Fatalf("16 partial 1 GiB values hold %d bytes of buffers", b)
		}
	})
}

// testServerSlowClientDoesNotBlockOthers: a client that sends one byte at a
// time, slowly, holds up nobody else.
func testServerSlowClientDoesNotBlockOthers(t *testing.T, ns newStorage) {
	eachTransport(t, func(t *testing.T) {
		s := startServerOn(t, ns, ServerConfig{})
		slow, fast := dialRaw(t, s), dialRaw(t, s)
		msg := h(t, validate+" 01 "+str("/slow")+str("value"))
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := range msg {
				if _, err := slow.Write(msg[i : i+1]); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
		fast.send(validate)
		start := time.Now()
		for range 100 {
			fast.send("07")
			fast.SetReadDeadline(time.Now().Add(5 * time.Second))
			var b [8]byte
			if _, err := readFull(fast, b[:]); err != nil {
				t.Fatal(err)
			}
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("100 ops beside a slow client took %v", d)
		}
		<-done
		fast.send("03 " + str("/slow"))
		fast.expect(str("value"))
	})
}

// testServerCloseReleasesEverything: Close ends connections, including ones
// with pending waits, and returns.
func testServerCloseReleasesEverything(t *testing.T, ns newStorage) {
	s, err := Listen("127.0.0.1:0", ServerConfig{Storage: ns(t)})
	if err != nil {
		t.Fatal(err)
	}
	waiter := dialRaw(t, s)
	waiter.send(validate + " 06 01000000 00000000 " + str("/never"))
	idle := dialRaw(t, s)
	_ = idle
	time.Sleep(20 * time.Millisecond)
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	waiter.expectClosed()
	if got := s.Stats().Open; got != 0 {
		t.Fatalf("open = %d after Close", got)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if strings.Contains(fmt.Sprint(s.Addr()), ":") {
		t.Fatalf("Addr after Close = %v", s.Addr())
	}
}
