package tcpstore

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// decodeAll feeds chunks to a fresh decoder the way the server reads (into
// the decoder's spare room, parsing after every read) and renders every
// request it yields, then the terminal state ("incomplete" or the protocol
// error). It checks that the buffer never outgrows the request limit.
func decodeAll(t testing.TB, lim Limits, chunks ...[]byte) []string {
	lim = lim.withDefaults()
	d := newDecoder(lim, Legacy113)
	var out []string
	for _, ch := range chunks {
		for len(ch) > 0 {
			n := copy(d.spare(), ch)
			d.commit(n)
			ch = ch[n:]
			if max := 2*lim.MaxRequestSize + initialBufSize; cap(d.buf) > max {
				t.Fatalf("buffer grew to %d (limit %d)", cap(d.buf), max)
			}
			for {
				req, err := d.next()
				if err == errIncomplete {
					break
				}
				if err != nil {
					var pe *ProtocolError
					if !errors.As(err, &pe) {
						t.Fatalf("decoder returned a non-protocol error: %v", err)
					}
					return append(out, "error: "+pe.Reason)
				}
				out = append(out, render(req))
			}
			d.compact()
		}
	}
	if d.pending() {
		out = append(out, "incomplete")
	}
	return out
}

func render(r *request) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v key=%q val=%q val2=%q n=%d u32=%#x", r.op, r.key, r.val, r.val2, r.n, r.u32)
	for i, k := range r.keys {
		fmt.Fprintf(&b, " k%d=%q", i, k)
	}
	for i, v := range r.vals {
		fmt.Fprintf(&b, " v%d=%q", i, v)
	}
	return b.String()
}

func TestDecoderGenerationDetection(t *testing.T) {
	cases := []struct {
		name, stream string
		want         []string
	}{
		{"VALIDATE makes a new-generation connection", validate + " 0d 01000000",
			[]string{`VALIDATE key="" val="" val2="" n=0 u32=0x3c85f7ce`, `PING key="" val="" val2="" n=0 u32=0x1`}},
		{"first byte 03 is an old ADD", "03 " + str("init/") + i64one,
			[]string{`ADD key="init/" val="" val2="" n=1 u32=0x0`}},
		{"first byte 00 without magic is an old SET", "00 " + str("/k1") + str("v1"),
			[]string{`SET key="/k1" val="v1" val2="" n=0 u32=0x0`}},
		{"a partial magic waits for more bytes", "00 cef785", []string{"incomplete"}},
		{"old opcode 07 is WATCH_KEY", "07 " + str("/w"),
			[]string{`WATCH_KEY key="/w" val="" val2="" n=0 u32=0x0`}},
		{"new opcode 07 is GETNUMKEYS", validate + " 07",
			[]string{`VALIDATE key="" val="" val2="" n=0 u32=0x3c85f7ce`, `GETNUMKEYS key="" val="" val2="" n=0 u32=0x0`}},
		{"old generation has no opcode 9", "09", []string{"error: unknown opcode 9 for PyTorch ≤2.0 wire"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := decodeAll(t, Limits{}, h(t, tc.stream))
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Fatalf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

func TestDecoderLegacy21Table(t *testing.T) {
	d := newDecoder(DefaultLimits(), Legacy21)
	d.feed(h(t, "07 "+str("/k")+" 08 "+str("/k")+str("v")+" 0b"))
	var ops []Op
	for {
		req, err := d.next()
		if err != nil {
			break
		}
		ops = append(ops, req.op)
	}
	if fmt.Sprint(ops) != "[DELETE_KEY APPEND CANCEL_WAIT]" {
		t.Fatalf("ops = %v", ops)
	}
}

// TestDecoderIdleBufferIsReleased: after a large request the buffer of an
// idle connection goes back to nothing.
func TestDecoderIdleBufferIsReleased(t *testing.T) {
	d := newDecoder(DefaultLimits(), Legacy113)
	d.feed(h(t, validate+" 01 "+str("/k")+hex.EncodeToString(appendBytes(nil, make([]byte, 1<<20)))))
	for {
		if _, err := d.next(); err != nil {
			break
		}
	}
	d.compact()
	if cap(d.buf) != 0 {
		t.Fatalf("idle buffer keeps %d bytes", cap(d.buf))
	}
}

// fuzzSeeds are request streams from the captured traffic and the tests.
var fuzzSeeds = []string{
	"00 03000000 00000000 2f6b31 02000000 00000000 7631",
	"05 01000000 00000000 03000000 00000000 2f6b31 02 03000000 00000000 2f6b31",
	"03 05000000 00000000 696e69742f 01000000 00000000 06 08 03000000 00000000 2f6b31",
	"07 03000000 00000000 2f776b",
	validate + " 0d 78563412 04 05000000 00000000 696e69742f 01000000 00000000",
	validate + " 02 " + str("/c") + str("") + str("x") + " 0a 02000000 00000000 " + str("/a") + str("/b"),
	validate + " 0b 02000000 00000000 " + str("/a") + str("1") + str("/b") + str("2") + " 0c 11",
	validate + " 0e " + str("/q") + str("a") + " 0f " + str("/q") + " 10 " + str("/q") + " 12 " + str("/b") + i64one,
	"00 ffffffff ffffffff",
	validate + " 05 ffffffff ffffffff",
}

// FuzzDecoder checks that the parser never panics, that any split of a
// stream decodes exactly like the whole stream, and (in decodeAll) that its
// buffer stays within the request limit.
func FuzzDecoder(f *testing.F) {
	for _, s := range fuzzSeeds {
		b := h(f, s)
		f.Add(b, uint16(1), uint16(3))
		f.Add(b, uint16(len(b)/2), uint16(7))
	}
	lim := Limits{MaxKeySize: 64, MaxValueSize: 256, MaxKeyCount: 16, MaxRequestSize: 1024}
	f.Fuzz(func(t *testing.T, stream []byte, first, step uint16) {
		whole := decodeAll(t, lim, stream)
		// Split at first, then every step bytes.
		var chunks [][]byte
		rest := stream
		n := int(first)
		for len(rest) > 0 {
			if n <= 0 || n > len(rest) {
				n = len(rest)
			}
			chunks = append(chunks, rest[:n])
			rest = rest[n:]
			n = int(step)
		}
		split := decodeAll(t, lim, chunks...)
		if strings.Join(whole, "\n") != strings.Join(split, "\n") {
			t.Fatalf("split decode differs\nwhole:\n%s\nsplit:\n%s", strings.Join(whole, "\n"), strings.Join(split, "\n"))
		}
	})
}
