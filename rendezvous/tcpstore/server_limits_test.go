package tcpstore

import (
	"bytes"
	"context"
	"encoding/hex"
	"runtime"
	"strings"
	"testing"
	"time"
)

// waitFor polls cond every few milliseconds for up to 10 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestServerLargeKeysAndValues: what PyTorch's own server stores, ours
// stores too with its default limits: values of 16 MB and 100 MB, keys of
// 9,000 bytes and 100 KB, on both wire generations and both transports.
func TestServerLargeKeysAndValues(t *testing.T) {
	eachTransport(t, func(t *testing.T) {
		s := startServer(t, ServerConfig{})
		for _, wire := range []Generation{GenNew, GenOld} {
			t.Run(wire.String(), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				c, err := Dial(ctx, s.Addr().String(), ClientConfig{Wire: wire})
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				cases := []struct {
					name       string
					key        string
					valueBytes int
				}{
					{"16 MB value", "v16", 16_000_000},
					{"100 MB value", "v100", 100_000_000},
					{"9,000-byte key", strings.Repeat("k", 9000), 10},
					{"100 KB key", strings.Repeat("K", 100_000), 10},
				}
				for i, tc := range cases {
					val := bytes.Repeat([]byte{byte('a' + i)}, tc.valueBytes)
					if err := c.Set(ctx, tc.key, val); err != nil {
						t.Fatalf("%s: set: %v", tc.name, err)
					}
					got, err := c.Get(ctx, tc.key)
					if err != nil || !bytes.Equal(got, val) {
						t.Fatalf("%s: get: %d bytes, %v; want the %d bytes set", tc.name, len(got), err, len(val))
					}
					if _, err := c.Delete(ctx, tc.key); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
		waitFor(t, "buffers released", func() bool { return s.Stats().Buffered <= 2*4*initialBufSize })
	})
}

// TestServerMaxBuffered: requests still arriving share ServerConfig.
// MaxBuffered. The connection whose bytes would pass it is closed and
// counted; the one within it completes; the server stays up.
func TestServerMaxBuffered(t *testing.T) {
	u64 := func(n uint64) string { return hex.EncodeToString(appendU64(nil, n)) }
	eachTransport(t, func(t *testing.T) {
		s := startServer(t, ServerConfig{MaxBuffered: 8 << 20})
		// a announces 6 MiB and sends 5 MiB: its buffer holds ~6 MiB.
		a := dialRaw(t, s)
		a.send(validate + " 01 " + str("/a") + u64(6<<20))
		if _, err := a.Write(make([]byte, 5<<20)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "a's 5 MiB buffered", func() bool { return s.Stats().Buffered >= 5<<20 })
		// b announces 4 MiB; its 3 MiB do not fit beside a's.
		b := dialRaw(t, s)
		b.send(validate + " 01 " + str("/b") + u64(4<<20))
		b.Write(make([]byte, 3<<20)) // may fail once the server closed it
		b.expectClosed()
		if st := s.Stats(); st.BufferFull != 1 || st.Rejected != 1 || st.Buffered > 8<<20 {
			t.Fatalf("stats %+v; want one connection closed for BufferFull, at most 8 MiB buffered", st)
		}
		// a finishes its request, which is stored.
		if _, err := a.Write(make([]byte, 1<<20)); err != nil {
			t.Fatal(err)
		}
		a.send("08 " + str("/a"))
		a.expect(i64one)
		if v, ok, _ := s.Storage().Get([]byte("/b")); ok {
			t.Fatalf("the refused SET stored %d bytes", len(v))
		}
		waitFor(t, "a's buffer released", func() bool { return s.Stats().Buffered <= 2*initialBufSize })
		// The server still serves new connections.
		c := dialRaw(t, s)
		c.send(validate + " 0d 01020304")
		c.expect("01020304")
	})
}

// BenchmarkServerPartialRequests reports the server's memory while clients
// announce huge values and send little: -conns connections each announce
// a value of the default limit (1 GiB) and send 4 KiB. It reports the
// heap and the buffers held per connection.
func BenchmarkServerPartialRequests(b *testing.B) {
	const conns, sent = 256, 4 << 10
	for range b.N {
		s := startServer(b, ServerConfig{})
		before := heapInUse()
		for range conns {
			c := dialRaw(b, s)
			c.send(validate + " 01 " + str("/big") + "00000040 00000000")
			if _, err := c.Write(make([]byte, sent)); err != nil {
				b.Fatal(err)
			}
		}
		waitFor(b, "every partial request buffered", func() bool { return s.Stats().Buffered >= conns*sent })
		b.ReportMetric(float64(s.Stats().Buffered)/conns, "buffered-B/conn")
		b.ReportMetric(float64(heapInUse()-before)/conns, "heap-B/conn")
		b.ReportMetric(conns, "GiB-announced")
		s.Close()
	}
}

func heapInUse() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}
