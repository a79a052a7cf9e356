package cpu

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/pg"
)

// Forming the mesh. Every rank listens and publishes its address record
// under addrKey(rank) in the group's namespace: "host:port nonce", plus
// "hostkey @unixname" when it also listens on an abstract unix socket for
// ranks on its own host (Config.LocalTransport), plus "shm" when it wants
// shared memory with them. Rank j dials every rank i < j twice (a data and
// a control connection) — over the unix socket when the host keys match,
// else over TCP — and opens each connection with a hello naming the
// listener's nonce, so that a connection that reaches another group's
// listener on a reused port is refused. The listener answers with its own
// rank. Every pair thus has exactly one data and one control connection.
// When both want shared memory, j dials a third, the ring connection, and
// its hellos say so; then each rank passes the other its ring (shm.go).

const (
	helloMagic = 0x55435047 // "GPCU", little-endian
	helloLen   = 24
	replyLen   = 8

	kindData    = 0
	kindControl = 1
	kindRing    = 2 // shared memory: the second direction's doorbells

	// helloTimeout bounds reading one accepted connection's hello, so that a
	// stray connection cannot hold up the others for long.
	helloTimeout = 5 * time.Second
)

func addrKey(rank int) string { return "pgcpu/addr/" + strconv.Itoa(rank) }

// link is a pair's connections and, with shared memory, its rings.
type link struct {
	data, ctrl net.Conn
	ring       net.Conn // shared memory only, else nil

	tx, rx *shmRing // shared memory: this rank's ring to the peer, and the peer's
}

func (l link) close() {
	for _, c := range []net.Conn{l.data, l.ctrl, l.ring} {
		if c != nil {
			c.Close()
		}
	}
}

// setDeadline sets the deadline of the connections operations use.
func (l link) setDeadline(t time.Time) {
	l.data.SetDeadline(t)
	if l.ring != nil {
		l.ring.SetDeadline(t)
	}
}

// shmConns returns, for a shared-memory link to a peer of rank peer, the
// connection that carries this rank's doorbells (out) and the one that
// carries the peer's (in). The data connection carries the dialer's —
// the higher rank's — and the ring connection the lower rank's.
func (l link) shmConns(rank, peer int) (out, in net.Conn) {
	if peer < rank {
		return l.data, l.ring
	}
	return l.ring, l.data
}

// formMesh connects this rank to every other rank of the group; links is
// indexed by rank (the own entry is empty). ctx bounds it.
func formMesh(ctx context.Context, cfg Config) (links []link, err error) {
	rank, size := cfg.Rank, cfg.Size
	tl, err := (&net.ListenConfig{}).Listen(ctx, "tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", cfg.ListenAddr, err)
	}
	listeners := []net.Listener{tl}
	nonce := rand.Uint64()
	_, port, _ := net.SplitHostPort(tl.Addr().String())
	self := net.JoinHostPort(cfg.advertiseHost(), port) + " " + strconv.FormatUint(nonce, 16)
	myKey, wantShm := "", false
	if cfg.LocalTransport != TransportTCP {
		myKey = hostKey()
	}
	if myKey != "" {
		name := fmt.Sprintf("@gorun-pgcpu-%x-%d", nonce, rank) // abstract: no file, per netns
		if ul, err := (&net.ListenConfig{}).Listen(ctx, "unix", name); err == nil {
			listeners = append(listeners, ul)
			self += " " + myKey + " " + name
			if cfg.LocalTransport == TransportShm && shmWorks() {
				wantShm = true
				self += " shm"
			}
		}
	}
	closeListeners := func() {
		for _, ln := range listeners {
			ln.Close()
		}
	}
	defer closeListeners()
	if d, ok := ctx.Deadline(); ok {
		for _, ln := range listeners {
			ln.(interface{ SetDeadline(time.Time) error }).SetDeadline(d)
		}
	}
	stop := context.AfterFunc(ctx, closeListeners)
	defer stop()

	store := cfg.NamespacedStore()
	if err := store.Set(ctx, addrKey(rank), []byte(self)); err != nil {
		return nil, fmt.Errorf("publish address: %w", err)
	}

	links = make([]link, size)
	want := 2 * (size - 1 - rank) // connections to accept; one more per shm peer
	shmPeer := make([]bool, size)
	var (
		mu       sync.Mutex
		firstErr error
		accepted int
		wg       sync.WaitGroup
	)
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
			closeListeners()
		}
		mu.Unlock()
	}
	// put files connection c to peer; shm says the peer's hellos ask for
	// shared memory, so that it dials (or this rank accepts) a ring
	// connection too.
	put := func(peer, kind int, shm bool, c net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		if shm && !shmPeer[peer] {
			shmPeer[peer] = true
			if peer > rank {
				want++
			}
		}
		slot := &links[peer].data
		switch kind {
		case kindControl:
			slot = &links[peer].ctrl
		case kindRing:
			slot = &links[peer].ring
		}
		if *slot != nil || firstErr != nil {
			return false
		}
		*slot = c
		return true
	}
	defer func() {
		if err != nil {
			for _, l := range links {
				l.close()
				l.tx.unmap()
				l.rx.unmap()
			}
		}
	}()

	// serve accepts on one listener until every expected connection has
	// come (on either listener), then closes them all.
	serve := func(ln net.Listener) {
		for {
			c, err := ln.Accept()
			if err != nil {
				mu.Lock()
				finished := accepted == want || firstErr != nil
				mu.Unlock()
				if !finished {
					fail(fmt.Errorf("accept: %w", err))
				}
				return
			}
			peer, kind, shm, err := acceptHello(c, rank, size, nonce, wantShm)
			if err != nil || !put(peer, kind, shm, c) {
				c.Close() // a stray or duplicate connection: not ours
				continue
			}
			mu.Lock()
			accepted++
			all := accepted == want
			mu.Unlock()
			if all {
				closeListeners()
				return
			}
		}
	}
	if want > 0 {
		for _, ln := range listeners {
			wg.Go(func() { serve(ln) })
		}
	}
	if rank > 0 {
		keys := make([]string, rank)
		for i := range keys {
			keys[i] = addrKey(i)
		}
		vals, err := store.MultiGet(ctx, keys...)
		if err != nil {
			fail(fmt.Errorf("read peer addresses: %w", err))
		}
		for i := 0; err == nil && i < rank; i++ {
			rec, perr := parseAddr(vals[i])
			if perr != nil {
				fail(fmt.Errorf("rank %d's address %q: %w", i, vals[i], perr))
				break
			}
			network, addr, shm := "tcp", rec.tcp, false
			if myKey != "" && rec.hostKey == myKey && rec.unix != "" {
				network, addr, shm = "unix", rec.unix, wantShm && rec.shm
			}
			kinds := []int{kindData, kindControl, kindRing}
			if !shm {
				kinds = kinds[:2]
			}
			for _, kind := range kinds {
				wg.Go(func() {
					c, err := dialPeer(ctx, cfg, network, addr, rec.nonce, i, kind, shm)
					if err != nil {
						fail(&pg.PeerError{Rank: i, Op: "connect", Err: err})
						return
					}
					if !put(i, kind, shm, c) {
						c.Close()
					}
				})
			}
		}
	}
	wg.Wait()
	if firstErr != nil {
		if ctx.Err() != nil && !errors.Is(firstErr, pg.ErrPeerLost) {
			return nil, fmt.Errorf("%w: %w", ctx.Err(), firstErr)
		}
		return nil, firstErr
	}
	// Every rank above this one has dialled it, so has read its address:
	// nobody needs the key again. Without this a job that shrinks and
	// grows leaves a key per rank per group in the store, which grows
	// with every epoch of a long job (issue 16). A store that cannot
	// delete only keeps the key, as before.
	_, _ = store.Delete(ctx, addrKey(rank))
	for _, l := range links {
		if l.data != nil && l.ring == nil {
			setupData(l.data, cfg)
		}
	}
	if err := exchangeRings(ctx, cfg, links); err != nil {
		return nil, err
	}
	return links, nil
}

// exchangeRings gives every shared-memory peer this rank's ring to it and
// maps the peer's. Every rank sends before it receives, and a ring
// message fits any socket buffer, so no pair waits on the other.
func exchangeRings(ctx context.Context, cfg Config, links []link) error {
	slots, size := ShmSlots, slotBytes(cfg.ChunkBytes)
	for p := range links {
		l := &links[p]
		if l.ring == nil {
			continue
		}
		out, _ := l.shmConns(cfg.Rank, p)
		r, fd, err := newShmRing(slots, size)
		if err == nil {
			l.tx = r
			err = sendRing(out, fd, slots, size)
			unix.Close(fd)
		}
		if err != nil {
			return &pg.PeerError{Rank: p, Op: "connect", Err: fmt.Errorf("shared memory: %w", err)}
		}
	}
	deadline, _ := ctx.Deadline()
	for p := range links {
		l := &links[p]
		if l.ring == nil {
			continue
		}
		_, in := l.shmConns(cfg.Rank, p)
		in.SetReadDeadline(deadline)
		r, err := recvRing(in)
		in.SetReadDeadline(time.Time{})
		if err != nil {
			return &pg.PeerError{Rank: p, Op: "connect", Err: fmt.Errorf("shared memory: %w", err)}
		}
		l.rx = r
	}
	return nil
}

// addrRecord is what a rank publishes: its TCP address and nonce, and, when
// it listens on a unix socket too, its host key, the socket's name and
// whether it wants shared memory.
type addrRecord struct {
	tcp     string
	nonce   uint64
	hostKey string
	unix    string
	shm     bool
}

func parseAddr(v []byte) (addrRecord, error) {
	f := strings.Fields(string(v))
	if (len(f) != 2 && len(f) != 4 && len(f) != 5) || (len(f) == 5 && f[4] != "shm") {
		return addrRecord{}, errors.New("want \"host:port nonce [hostkey @unixname [shm]]\"")
	}
	nonce, err := strconv.ParseUint(f[1], 16, 64)
	if err != nil {
		return addrRecord{}, err
	}
	r := addrRecord{tcp: f[0], nonce: nonce}
	if len(f) >= 4 {
		r.hostKey, r.unix, r.shm = f[2], f[3], len(f) == 5
	}
	return r, nil
}

// hostKey identifies the kernel boot and network namespace this process
// runs in: two ranks with the same key reach each other's abstract unix
// sockets. "" when it cannot be read (then only TCP is used).
func hostKey() string {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return ""
	}
	return strings.TrimSpace(string(boot)) + "/" + strconv.FormatUint(st.Ino, 10)
}

func dialPeer(ctx context.Context, cfg Config, network, addr string, nonce uint64, peer, kind int, shm bool) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	}
	var b [helloLen]byte
	binary.LittleEndian.PutUint32(b[0:], helloMagic)
	binary.LittleEndian.PutUint64(b[4:], nonce)
	binary.LittleEndian.PutUint32(b[12:], uint32(cfg.Rank))
	binary.LittleEndian.PutUint32(b[16:], uint32(cfg.Size))
	b[20] = byte(kind)
	if shm {
		b[21] = 1
	}
	if _, err := c.Write(b[:]); err != nil {
		c.Close()
		return nil, fmt.Errorf("hello: %w", err)
	}
	var r [replyLen]byte
	if _, err := io.ReadFull(c, r[:]); err != nil {
		c.Close()
		return nil, fmt.Errorf("hello refused by %s (another group on that port, or a size mismatch): %w", addr, err)
	}
	if binary.LittleEndian.Uint32(r[0:]) != helloMagic || int(binary.LittleEndian.Uint32(r[4:])) != peer {
		c.Close()
		return nil, fmt.Errorf("bad hello reply from %s", addr)
	}
	c.SetDeadline(time.Time{})
	return c, nil
}

// acceptHello reads a dialer's hello and answers it; it returns the
// dialer's rank, the connection's kind and whether the dialer asks for
// shared memory (refused unless wantShm and the connection is a unix one).
func acceptHello(c net.Conn, rank, size int, nonce uint64, wantShm bool) (peer, kind int, shm bool, err error) {
	c.SetDeadline(time.Now().Add(helloTimeout))
	var b [helloLen]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return 0, 0, false, err
	}
	peer = int(binary.LittleEndian.Uint32(b[12:]))
	kind = int(b[20])
	shm = b[21] == 1
	_, isUnix := c.(*net.UnixConn)
	switch {
	case binary.LittleEndian.Uint32(b[0:]) != helloMagic, binary.LittleEndian.Uint64(b[4:]) != nonce:
		return 0, 0, false, errors.New("not a hello for this group")
	case int(binary.LittleEndian.Uint32(b[16:])) != size, peer <= rank, peer >= size, kind > kindRing,
		b[21] > 1, kind == kindRing && !shm, shm && !(wantShm && isUnix):
		return 0, 0, false, errors.New("hello does not fit this group")
	}
	var r [replyLen]byte
	binary.LittleEndian.PutUint32(r[0:], helloMagic)
	binary.LittleEndian.PutUint32(r[4:], uint32(rank))
	if _, err := c.Write(r[:]); err != nil {
		return 0, 0, false, err
	}
	c.SetDeadline(time.Time{})
	return peer, kind, shm, nil
}

func setupData(c net.Conn, cfg Config) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if n := cfg.SocketBufferBytes; n > 0 {
		if bc, ok := c.(interface {
			SetReadBuffer(int) error
			SetWriteBuffer(int) error
		}); ok {
			bc.SetReadBuffer(n)
			bc.SetWriteBuffer(n)
		}
	}
}
