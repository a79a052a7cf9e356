package tcpstore

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// accountedDecoder is a decoder with a memory account of its own; done
// drops it and checks that the account is back to zero.
func accountedDecoder(t testing.TB, lim Limits) (*decoder, *budget, func()) {
	mem := newBudget(1 << 40)
	d := new(decoder)
	*d = newDecoder(lim, Legacy113, mem)
	return d, mem, func() {
		d.drop()
		if mem.held() != 0 {
			t.Fatalf("budget holds %d bytes after drop", mem.held())
		}
	}
}

// decodeAll feeds chunks to a fresh decoder the way the server reads (into
// the decoder's spare room, parsing after every read) and renders every
// request it yields, then the terminal state ("incomplete" or the protocol
// error). It checks that the buffer never outgrows the request limit nor
// twice the bytes that arrived, that the budget holds exactly the buffer,
// and that dropping the decoder gives the budget back.
func decodeAll(t testing.TB, lim Limits, chunks ...[]byte) []string {
	lim = lim.withDefaults()
	d, mem, done := accountedDecoder(t, lim)
	defer done()
	var out []string
	arrived := 0
	for _, ch := range chunks {
		for len(ch) > 0 {
			sp, err := d.spare()
			if err != nil {
				t.Fatal(err)
			}
			n := copy(sp, ch)
			d.commit(n)
			ch = ch[n:]
			arrived += n
			if max := 2*lim.MaxRequestSize + initialBufSize; cap(d.buf) > max {
				t.Fatalf("buffer grew to %d (limit %d)", cap(d.buf), max)
			}
			if max := 2*arrived + initialBufSize; cap(d.buf) > max {
				t.Fatalf("buffer grew to %d after %d bytes arrived", cap(d.buf), arrived)
			}
			if mem.held() != int64(cap(d.buf)) {
				t.Fatalf("budget holds %d for a buffer of %d", mem.held(), cap(d.buf))
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

// decodeLoop decodes chunks the way the event loop reads: a chunk that
// arrives with nothing pending is parsed in place from a scratch buffer
// (borrow), one that completes a partial request goes into the decoder's
// own buffer, and every round ends with retain — after which the scratch
// buffer is overwritten, so a request that kept pointing into it decodes
// wrong. Buffer and budget checks as in decodeAll.
func decodeLoop(t testing.TB, lim Limits, chunks ...[]byte) []string {
	lim = lim.withDefaults()
	d, mem, done := accountedDecoder(t, lim)
	defer done()
	var out []string
	arrived := 0
	for _, ch := range chunks {
		for len(ch) > 0 {
			var scratch []byte
			if d.pending() {
				sp, err := d.spare()
				if err != nil {
					t.Fatal(err)
				}
				n := copy(sp, ch)
				d.commit(n)
				ch, arrived = ch[n:], arrived+n
			} else {
				scratch = append([]byte(nil), ch...)
				d.borrow(scratch)
				ch, arrived = nil, arrived+len(scratch)
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
			if err := d.retain(); err != nil {
				t.Fatal(err)
			}
			for i := range scratch {
				scratch[i] = 0xa5
			}
			if max := 2*arrived + initialBufSize; cap(d.buf) > max {
				t.Fatalf("buffer grew to %d after %d bytes arrived", cap(d.buf), arrived)
			}
			if mem.held() != int64(cap(d.buf)) || d.borrowed {
				t.Fatalf("budget holds %d for a buffer of %d (borrowed %v)", mem.held(), cap(d.buf), d.borrowed)
			}
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
	d := newDecoder(DefaultLimits(), Legacy21, nil)
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
	d := newDecoder(DefaultLimits(), Legacy113, nil)
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
// stream decodes exactly like the whole stream, read either way the server
// reads (decodeAll, decodeLoop), and that its buffer stays within the
// request limit and twice the bytes that arrived, all reserved in the
// budget.
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
		loop := decodeLoop(t, lim, chunks...)
		if strings.Join(whole, "\n") != strings.Join(loop, "\n") {
			t.Fatalf("event-loop decode differs\nwhole:\n%s\nloop:\n%s", strings.Join(whole, "\n"), strings.Join(loop, "\n"))
		}
	})
}

// TestDecoderMemoryFollowsArrivedBytes: a length prefix allocates nothing
// by itself; the buffer grows with the bytes that came, stops at the end of
// the request, and a prefix over the limits fails before anything arrives.
func TestDecoderMemoryFollowsArrivedBytes(t *testing.T) {
	u64 := func(n uint64) string { return hex.EncodeToString(appendU64(nil, n)) }
	cases := []struct {
		name     string
		head     string // the request's start, up to its length prefix
		sent     int    // bytes of the announced string that arrive
		maxCap   int    // the buffer may hold at most this much
		wantErr  string // a protocol error at once, or "" for incomplete
		complete bool
	}{
		{name: "1 GiB value announced, 100 bytes sent", head: validate + " 01 " + str("/k") + u64(1<<30), sent: 100, maxCap: 1024},
		{name: "1 GiB value announced, 1 MiB sent", head: validate + " 01 " + str("/k") + u64(1<<30), sent: 1 << 20, maxCap: 2<<20 + 1024},
		{name: "60 MiB key announced, 10 KiB sent", head: validate + " 03 " + u64(60<<20), sent: 10 << 10, maxCap: 32 << 10},
		{name: "4 GiB value announced", head: validate + " 01 " + str("/k") + u64(4<<30), maxCap: initialBufSize, wantErr: "value of 4294967296 bytes exceeds the limit of 1073741824"},
		{name: "2^64-1 key announced", head: "00 ffffffff ffffffff", maxCap: initialBufSize, wantErr: "key of 18446744073709551615 bytes exceeds the limit of 67108864"},
		{name: "3 MiB value sent whole: the buffer stops at the request's end", head: validate + " 01 " + str("/k") + u64(3<<20), sent: 3 << 20, maxCap: 3<<20 + 64, complete: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := newBudget(1 << 40)
			d := newDecoder(DefaultLimits(), Legacy113, mem)
			defer d.drop()
			if err := d.feed(h(t, tc.head)); err != nil {
				t.Fatal(err)
			}
			if strings.HasPrefix(tc.head, validate) {
				if req, err := d.next(); err != nil || req.op != OpValidate {
					t.Fatalf("first request %v, %v", req, err)
				}
			}
			var err error
			body := make([]byte, 64<<10)
			for left := tc.sent; ; {
				if _, err = d.next(); err != errIncomplete || left == 0 {
					break
				}
				n := min(left, len(body))
				if ferr := d.feed(body[:n]); ferr != nil {
					t.Fatal(ferr)
				}
				left -= n
			}
			switch {
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
			case tc.complete:
				if err != nil || d.req.op != OpSet || len(d.req.val) != tc.sent {
					t.Fatalf("err %v op %v value %d bytes; want a SET of %d", err, d.req.op, len(d.req.val), tc.sent)
				}
			case err != errIncomplete:
				t.Fatalf("err = %v, want incomplete", err)
			}
			if cap(d.buf) > tc.maxCap || mem.held() != int64(cap(d.buf)) {
				t.Fatalf("buffer of %d bytes (budget holds %d), want at most %d", cap(d.buf), mem.held(), tc.maxCap)
			}
		})
	}
}

// TestDecoderBudget: growth past the server's budget fails with
// ErrBufferFull and takes nothing; dropping gives everything back.
func TestDecoderBudget(t *testing.T) {
	mem := newBudget(3 << 19)
	a := newDecoder(DefaultLimits(), Legacy113, mem)
	b := newDecoder(DefaultLimits(), Legacy113, mem)
	head := h(t, validate+" 01 "+str("/k")+hex.EncodeToString(appendU64(nil, 4<<20)))
	for _, d := range []*decoder{&a, &b} {
		if err := d.feed(head); err != nil {
			t.Fatal(err)
		}
		d.next()
		d.next()
	}
	if err := a.feed(make([]byte, 600<<10)); err != nil {
		t.Fatalf("a: %v", err)
	}
	err := b.feed(make([]byte, 600<<10))
	if !errors.Is(err, ErrBufferFull) {
		t.Fatalf("b: err = %v, want ErrBufferFull", err)
	}
	if held := int64(cap(a.buf) + cap(b.buf)); mem.held() > 3<<19 || mem.held() != held {
		t.Fatalf("budget of 1.5 MiB holds %d for buffers of %d", mem.held(), held)
	}
	a.drop()
	b.drop()
	if mem.held() != 0 {
		t.Fatalf("budget holds %d after both dropped", mem.held())
	}
}
