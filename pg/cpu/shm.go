package cpu

// Shared memory between the ranks of one host (TransportShm).
//
// A socket copies every byte twice: into the kernel's buffer and out of
// it. Between ranks of one host one copy will do: for each directed pair,
// the sending rank owns a ring of ShmSlots slots in a memfd that both
// ranks map. Its sender goroutine copies a posted slice into the next free
// slot and rings the doorbell, a 4-byte "the next slot holds n bytes", on
// a unix socket; the receiver reads the doorbell, consumes the slot in
// place (the ring's reduce-scatter reduces straight from it) and hands it
// back with a one-byte credit on the same socket. Slots are filled and
// freed in order, so neither message needs to name one. Small slices (at
// most Config.SmallBytes) skip the ring: their bytes follow the doorbell
// on the socket, where one message costs fewer system calls.
//
// The socket does everything but carry the bytes. A rank with nothing to
// do blocks in a read, never spins; a dead peer is an EOF or a reset;
// deadlines, interrupts and Abort work on the sockets as on the other
// transports. Each direction of a pair has its own connection (see
// shmConns), so that each end of a connection has exactly one reader: the
// receiving collective reads doorbells, the sending goroutine credits.
//
// The ring's owner creates the memfd, seals its size (a file that shrank
// under a mapping would raise SIGBUS in the reader) and passes it with
// SCM_RIGHTS while the mesh forms; both ends close the fd once mapped, so
// a formed group holds no descriptors but its sockets. The mappings live
// until nothing can touch them any more (Group.dropRingHold).

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"golang.org/x/sys/unix"
)

const (
	shmMagic    = 0x4d485347 // "GSHM", little-endian
	shmHelloLen = 12         // magic, slots, slot bytes
	bellLen     = 4          // doorbell: the bytes in the next slot, or inline
	bellInline  = 1 << 31    // doorbell flag: the bytes follow on the socket

	minSlotBytes = 4 << 10  // a page: no smaller mapping exists anyway
	maxSlotBytes = 64 << 20 // a bound on what a peer may ask us to map
	maxShmSlots  = 64
)

// shmRing is one directed pair's ring as one of its ends maps it.
type shmRing struct {
	mem   []byte   // the whole mapping
	slots [][]byte // views of mem
}

// shmWorks reports whether this process can create memfds (a seccomp
// filter or an old kernel may forbid it); a rank that cannot does not ask
// its peers for shared memory, and its pairs use plain unix sockets.
var shmWorks = sync.OnceValue(func() bool {
	fd, err := unix.MemfdCreate("gorun-pgcpu-probe", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
})

// slotBytes is the slot size of a ring for chunks of chunkBytes: a whole
// chunk fits in one slot, and slots are whole pages, so every slot is
// aligned for every dtype.
func slotBytes(chunkBytes int) int {
	n := min(max(chunkBytes, minSlotBytes), maxSlotBytes)
	return (n + minSlotBytes - 1) &^ (minSlotBytes - 1)
}

// newShmRing creates a ring of slots slots of size bytes, mapped for
// writing; the caller passes fd to the peer and closes it.
func newShmRing(slots, size int) (r *shmRing, fd int, err error) {
	fd, err = unix.MemfdCreate("gorun-pgcpu", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, fmt.Errorf("memfd_create: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	if err := unix.Ftruncate(fd, int64(slots*size)); err != nil {
		return nil, -1, fmt.Errorf("size the ring: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return nil, -1, fmt.Errorf("seal the ring: %w", err)
	}
	r, err = mapRing(fd, slots, size, unix.PROT_READ|unix.PROT_WRITE)
	return r, fd, err
}

func mapRing(fd, slots, size, prot int) (*shmRing, error) {
	mem, err := unix.Mmap(fd, 0, slots*size, prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map the ring: %w", err)
	}
	r := &shmRing{mem: mem, slots: make([][]byte, slots)}
	for k := range r.slots {
		r.slots[k] = mem[k*size : (k+1)*size : (k+1)*size]
	}
	return r, nil
}

func (r *shmRing) unmap() {
	if r != nil && r.mem != nil {
		unix.Munmap(r.mem)
		r.mem, r.slots = nil, nil
	}
}

// sendRing passes a ring's fd and shape to the peer on c.
func sendRing(c net.Conn, fd, slots, size int) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("shared memory over a %T", c)
	}
	var h [shmHelloLen]byte
	binary.LittleEndian.PutUint32(h[0:], shmMagic)
	binary.LittleEndian.PutUint32(h[4:], uint32(slots))
	binary.LittleEndian.PutUint32(h[8:], uint32(size))
	_, _, err := uc.WriteMsgUnix(h[:], unix.UnixRights(fd), nil)
	return err
}

// recvRing receives the peer's ring on c and maps it for reading.
func recvRing(c net.Conn) (*shmRing, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("shared memory over a %T", c)
	}
	var h [shmHelloLen]byte
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := uc.ReadMsgUnix(h[:], oob)
	fd, ferr := takeFD(oob[:oobn])
	if fd >= 0 {
		defer unix.Close(fd) // the mapping keeps the memory
	}
	switch {
	case err != nil:
		return nil, err
	case ferr != nil:
		return nil, ferr
	}
	if err := (sockInbound{c}).read(h[n:]); err != nil {
		return nil, err
	}
	slots, size := int(binary.LittleEndian.Uint32(h[4:])), int(binary.LittleEndian.Uint32(h[8:]))
	if binary.LittleEndian.Uint32(h[0:]) != shmMagic || slots < 1 || slots > maxShmSlots ||
		size < minSlotBytes || size > maxSlotBytes || size%minSlotBytes != 0 {
		return nil, errors.New("bad shared-memory ring header")
	}
	// Map only a file of the announced size that can no longer shrink.
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 || st.Size != int64(slots*size) {
		return nil, errors.New("shared-memory ring is not a sealed file of its announced size")
	}
	return mapRing(fd, slots, size, unix.PROT_READ)
}

// takeFD returns the one descriptor passed in the control message oob, or
// -1; it closes any others.
func takeFD(oob []byte) (int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1, err
	}
	fd := -1
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, f := range fds {
			if fd < 0 {
				fd = f
			} else {
				unix.Close(f)
			}
		}
	}
	if fd < 0 {
		return -1, errors.New("no shared-memory ring passed")
	}
	return fd, nil
}

// shmWire is the sending end of a ring: the wire of a sender to a peer
// on the same host.
type shmWire struct {
	conn   net.Conn // doorbells out, credits in
	ring   *shmRing
	inline int // slices of at most this many bytes go on the socket
	next   int // the slot to fill next
	free   int // slots the receiver has handed back

	bell    [bellLen]byte
	bufs    net.Buffers // a field, so that WriteTo does not allocate
	iov     [2][]byte
	credits [maxShmSlots]byte
}

// newShmWire returns the wire of ring r with doorbells on c. Slices of
// at most inline bytes — the small collectives' messages, whose latency a
// slot's round trip (a credit back for every message) would only add to —
// follow their doorbell on the socket instead.
func newShmWire(c net.Conn, r *shmRing, inline int) *shmWire {
	return &shmWire{conn: c, ring: r, inline: inline, free: len(r.slots)}
}

// write copies each slice into slots, a slot at most at a time (so that
// every fragment but a slice's last fills a slot: whole elements of any
// dtype), and rings the doorbell after each; or sends it inline.
func (w *shmWire) write(batch [][]byte) error {
	for _, b := range batch {
		if len(b) <= w.inline {
			binary.LittleEndian.PutUint32(w.bell[:], uint32(len(b))|bellInline)
			w.iov = [2][]byte{w.bell[:], b}
			w.bufs = w.iov[:]
			_, err := w.bufs.WriteTo(w.conn)
			w.iov = [2][]byte{}
			if err != nil {
				return err
			}
			continue
		}
		for len(b) > 0 {
			if err := w.awaitSlot(); err != nil {
				return err
			}
			n := copy(w.ring.slots[w.next], b)
			binary.LittleEndian.PutUint32(w.bell[:], uint32(n))
			if _, err := w.conn.Write(w.bell[:]); err != nil {
				return err
			}
			w.next = (w.next + 1) % len(w.ring.slots)
			w.free--
			b = b[n:]
		}
	}
	return nil
}

// awaitSlot blocks until a slot is free.
func (w *shmWire) awaitSlot() error {
	for w.free == 0 {
		n, err := w.conn.Read(w.credits[:len(w.ring.slots)])
		w.free += n
		if w.free > len(w.ring.slots) {
			return errors.New("shared memory: more credits than slots")
		}
		if err != nil && w.free == 0 {
			return err
		}
	}
	return nil
}

// shmInbound is the receiving end of a ring: a stream of messages, each a
// doorbell and then its bytes, in the ring's next slot or on the socket.
type shmInbound struct {
	conn   net.Conn      // doorbells in, credits out
	rd     *bufio.Reader // conn: one read takes a doorbell and its inline bytes
	ring   *shmRing
	next   int  // the slot of the next slot message
	size   int  // bytes in the current message
	left   int  // of which not yet consumed; 0: read the next doorbell
	inline bool // the current message follows its doorbell on the socket
	bell   [bellLen]byte
	one    [1]byte
}

// newShmInbound returns the receiving end of ring r with doorbells on c.
// Its read buffer takes a doorbell and a small inline message in one
// system call; larger inline bytes bypass it, straight into the caller's
// buffer.
func newShmInbound(c net.Conn, r *shmRing) *shmInbound {
	return &shmInbound{conn: c, rd: bufio.NewReaderSize(c, bellLen+4<<10), ring: r, one: [1]byte{1}}
}

// advance reads the next doorbell once the current message is consumed.
func (r *shmInbound) advance() error {
	if r.left > 0 {
		return nil
	}
	if _, err := io.ReadFull(r.rd, r.bell[:]); err != nil {
		return err
	}
	v := binary.LittleEndian.Uint32(r.bell[:])
	r.inline, r.size = v&bellInline != 0, int(v&^bellInline)
	if r.size < 1 || (!r.inline && r.size > len(r.ring.slots[0])) {
		return errors.New("shared memory: bad doorbell")
	}
	r.left = r.size
	return nil
}

// unread is what is left of the current slot message.
func (r *shmInbound) unread() []byte { return r.ring.slots[r.next][r.size-r.left : r.size] }

// consume marks n more bytes of the current message read, and hands a
// slot back once all of it was. The credit's write cannot block (a sender
// has at most one per slot outstanding) and its failure is no error of
// this receive, whose bytes are in hand: a peer that finished its last
// collective and closed the group takes no more credits, and one that died
// fails the next read of its doorbells, or its control connection says so.
func (r *shmInbound) consume(n int) {
	r.left -= n
	if r.left == 0 && !r.inline {
		r.next = (r.next + 1) % len(r.ring.slots)
		r.conn.Write(r.one[:])
	}
}

func (r *shmInbound) read(b []byte) error {
	for len(b) > 0 {
		if err := r.advance(); err != nil {
			return err
		}
		n := min(len(b), r.left)
		if r.inline {
			if _, err := io.ReadFull(r.rd, b[:n]); err != nil {
				return err
			}
		} else {
			copy(b, r.unread()[:n])
		}
		r.consume(n)
		b = b[n:]
	}
	return nil
}

// readReduce reduces from the slots themselves. The ring's sends and
// receives cut the stream at the same places, so a received chunk starts
// a message and every slot of it but the last is full: whole, aligned
// elements. Inline messages, and cuts that ever differ, go through tmp.
func (r *shmInbound) readReduce(dst, src, tmp []byte, red reducer) error {
	for done := 0; done < len(dst); {
		if err := r.advance(); err != nil {
			return err
		}
		n := min(len(dst)-done, r.left)
		if r.inline || (r.size-r.left)%8 != 0 || (n%8 != 0 && done+n < len(dst)) {
			in := tmp[done:len(dst)]
			if err := r.read(in); err != nil {
				return err
			}
			red(dst[done:], src[done:], in)
			return nil
		}
		red(dst[done:done+n], src[done:done+n], r.unread()[:n])
		r.consume(n)
		done += n
	}
	return nil
}
