package tcpstore

import (
	"testing"
)

// BenchmarkServerHandle reports the server's own cost per request —
// parsing, the storage, queuing the answer — for the ops of the mixed load
// (make bench), along the event loop's path: the request is parsed in place
// from the read buffer (borrow), answered, and the output taken for
// writing. Sockets are left out: they cost the same for any server.
func BenchmarkServerHandle(b *testing.B) {
	value := make([]byte, 32)
	ops := map[string]string{
		"set":          "01 " + str("/load/0/1") + str(string(value)),
		"get":          "03 " + str("/load/0/1"),
		"add":          "04 " + str("/load/0/counter") + i64one,
		"wait-present": "06 01000000 00000000 " + str("/load/0/1"),
		"check":        "05 01000000 00000000 " + str("/load/0/1"),
	}
	for _, name := range []string{"set", "get", "add", "wait-present", "check"} {
		b.Run(name, func(b *testing.B) {
			s := NewServer(ServerConfig{})
			s.storage.Set([]byte("/load/0/1"), value)
			sess := newSession(s, "bench")
			sess.kick = func() {}
			sess.dec.borrow(h(b, validate))
			if err := sess.consume(); err != nil {
				b.Fatal(err)
			}
			sess.dec.retain()
			req := h(b, ops[name])
			var out []byte
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				sess.dec.borrow(req)
				if err := sess.consume(); err != nil {
					b.Fatal(err)
				}
				sess.dec.retain()
				out = sess.takeOutput(out[:0])
			}
			b.StopTimer()
			if got := s.Stats().Requests; got != int64(b.N)+1 {
				b.Fatalf("served %d requests, want %d", got, b.N+1)
			}
		})
	}
}
