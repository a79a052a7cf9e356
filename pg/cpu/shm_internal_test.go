package cpu

import (
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/pg"
)

// unixPair returns the two ends of a unix stream socketpair.
func unixPair(t *testing.T) (a, b net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(10 * time.Second))
		conns[i] = c
	}
	return conns[0], conns[1]
}

// TestShmStream sends more than the ring holds, in slices that span
// slots and small slices that go inline, and receives it cut differently
// from how it was sent (so that readReduce meets slots it cannot reduce
// from in place), after passing the ring over the socket as formMesh does.
func TestShmStream(t *testing.T) {
	const slots, size = 3, minSlotBytes
	out, in := unixPair(t)
	tx, fd, err := newShmRing(slots, size)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.unmap()
	if err := sendRing(out, fd, slots, size); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	rx, err := recvRing(in)
	if err != nil {
		t.Fatal(err)
	}
	defer rx.unmap()

	// float32 elements 1, 2, 3, … sent in slices of 3 (inline), 5000 (in
	// slots of 1024 elements) and 2000 (inline), and received cut at other
	// elements: only [1027, 5003) starts at a slot and can be reduced in
	// place; [700, 1027) starts 4 bytes into one.
	const count = 3 + 5000 + 2000
	sent, got, ones := floats(count), floats(count), floats(count)
	for i := range count {
		sent.f[i], ones.f[i] = float32(i+1), 1
	}
	w := newShmWire(out, tx, 8000)
	errc := make(chan error, 1)
	go func() { errc <- w.write([][]byte{sent.bytes(0, 3), sent.bytes(3, 5003), sent.bytes(5003, count)}) }()

	r := newShmInbound(in, rx)
	tmp := make([]byte, 4*count)
	add := reducerFor(pg.Float32, pg.Sum)
	const reduced = 6000
	for _, c := range [][2]int{{0, 1}, {1, 700}, {700, 1027}, {1027, reduced}} {
		if err := r.readReduce(got.bytes(c[0], c[1]), ones.bytes(c[0], c[1]), tmp, add); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.read(got.bytes(reduced, count)); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for i := range count {
		want := float32(i + 1)
		if i < reduced {
			want++
		}
		if got.f[i] != want {
			t.Fatalf("element %d: %v, want %v", i, got.f[i], want)
		}
	}
	if r.left != 0 || r.next != 5%slots { // 20000 bytes: 5 slot messages
		t.Errorf("stream not drained: %d bytes left, at slot %d (want %d)", r.left, r.next, 5%slots)
	}
}

// f32s is a float32 slice with byte views, 8-byte aligned as pg/cpu's
// buffers are.
type f32s struct {
	f []float32
	b []byte
}

func floats(n int) f32s {
	b := asBytes(make([]uint64, (n+1)/2))[:4*n]
	return f32s{f: view[float32](b), b: b}
}

func (s f32s) bytes(lo, hi int) []byte { return s.b[4*lo : 4*hi] }
