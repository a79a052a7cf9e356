// Package cpu is a pg.ProcessGroup in pure Go over sockets, for buffers in
// host memory (pg.HostBuffer): float32, float64, int32 and int64.
//
// Every pair of ranks shares a data connection and a control connection,
// made through the bootstrap store (see New): TCP between hosts, an
// abstract unix socket between ranks of one host, whose bytes may travel
// through shared memory instead (Config.LocalTransport, shm.go).
// Collectives on small buffers exchange them directly (one message hop);
// larger ones run the ring, reduce-scatter then all-gather, pipelined in
// chunks (see Config). Every element is reduced once, in an order fixed by
// the algorithm, so every rank ends with the same bits.
//
// Fault tolerance: a peer whose connections break (its process died: EOF,
// reset) fails the collective in flight at once with a *pg.PeerError naming
// it, and every rank of the group learns of it through its own control
// connection to that peer, so the survivors name the dead rank, not the
// rank that noticed first. A rank that gives up (a failure, a timeout,
// Abort) tells its peers why. Abort closes the sockets, so a blocked
// operation returns within microseconds. An operation that fails leaves the
// group aborted: its streams may be mid-message, so the only ways on are
// Shrink (which builds a new mesh among the survivors through a fresh store
// namespace) and Close.
package cpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

// Group is a pg.ProcessGroup over sockets. Make one with New.
type Group struct {
	cfg        Config
	rank, size int
	peers      []*peer // by rank; nil at this rank

	// Owned by the goroutine running collectives (one at a time).
	scratch []uint64 // receive slots and work space, 8-byte aligned
	token   [1]byte  // barrier payload

	stop     chan struct{} // closed when the group aborts, fails or closes
	stopOnce sync.Once
	wg       sync.WaitGroup // sender and control-reader goroutines

	mu       sync.Mutex
	rings    []*shmRing // every shared-memory ring this rank maps
	holds    int        // users of rings: shm senders running, plus the operation in flight
	closed   bool
	retired  bool             // shrunk with ShrinkDefault
	aborted  *pg.AbortedError // set by Abort or by a failure
	failure  error            // what made the group fail on its own
	inflight bool             // an operation is running
	opID     uint64           // numbers operations, for interrupts
	opName   string           // the operation in flight
	opColl   bool             // it is a collective (not Send/Recv)
	collSeq  int64            // collectives started
	byeAt    []int64          // per peer: collectives it completed before it left; -1: still here
	shrinks  int              // Shrink calls so far, for the child's namespace
}

type peer struct {
	rank int
	link
	send     *sender
	in       inbound
	ctrlDone chan struct{} // closed when readControl returns
}

// ctrlGrace bounds how long an operation that saw a peer's data
// connection break waits for that peer's control connection to say why
// (see ioErr).
const ctrlGrace = 100 * time.Millisecond

var _ pg.Grower = (*Group)(nil)

// New forms a group: this rank listens on cfg.ListenAddr, publishes its
// address in cfg.Store under cfg.Namespace ("pgcpu/addr/<rank>"), reads
// the addresses of the lower ranks and dials them; the higher ranks dial
// it. It returns once this rank is connected to every other one; ctx (or,
// when ctx has no deadline, cfg.Timeout) bounds the whole. A peer that
// cannot be reached is named in a *pg.PeerError.
func New(ctx context.Context, cfg Config) (*Group, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("pg/cpu: %w", err)
	}
	g := &Group{
		cfg:   cfg,
		rank:  cfg.Rank,
		size:  cfg.Size,
		peers: make([]*peer, cfg.Size),
		stop:  make(chan struct{}),
		byeAt: make([]int64, cfg.Size),
	}
	for i := range g.byeAt {
		g.byeAt[i] = -1
	}
	if cfg.Size == 1 {
		return g, nil
	}
	fctx, cancel := rendezvous.WithDefaultTimeout(ctx, cfg.OpTimeout())
	defer cancel()
	links, err := formMesh(fctx, cfg)
	if err != nil {
		if fctx.Err() == context.DeadlineExceeded {
			err = fmt.Errorf("%w: %w", pg.ErrTimeout, err)
		}
		return nil, fmt.Errorf("pg/cpu: form group (rank %d of %d, namespace %q): %w", cfg.Rank, cfg.Size, cfg.Namespace, err)
	}
	for r, l := range links {
		if r == g.rank {
			continue
		}
		p := &peer{rank: r, link: l, ctrlDone: make(chan struct{})}
		if l.ring == nil {
			p.send, p.in = newSender(&sockWire{conn: l.data}), sockInbound{l.data}
		} else {
			out, in := l.shmConns(g.rank, r)
			inline := max(cfg.SmallBytes, 0) // what the small collectives send
			p.send, p.in = newSender(newShmWire(out, l.tx, inline)), newShmInbound(in, l.rx)
			g.rings = append(g.rings, l.tx, l.rx)
			g.holds++
		}
		g.peers[r] = p
	}
	// Every hold is counted before a goroutine that may drop one starts.
	for _, p := range g.peers {
		if p == nil {
			continue
		}
		g.wg.Go(func() {
			p.send.run(g.stop)
			if p.ring != nil {
				g.dropRingHold()
			}
		})
		g.wg.Go(func() { g.readControl(p) })
	}
	return g, nil
}

// dropRingHold releases one hold on the shared-memory rings and unmaps
// them with the last. The senders hold them until the group stops, and an
// operation while it runs: so they go once the group stopped and the last
// operation returned, and never under a copy or a reduction. (Once
// stopped, the group starts no operation.)
func (g *Group) dropRingHold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holds--
	if g.holds == 0 {
		for _, r := range g.rings {
			r.unmap()
		}
		g.rings = nil
	}
}

func (g *Group) Rank() int       { return g.rank }
func (g *Group) Size() int       { return g.size }
func (g *Group) Backend() string { return "cpu" }

// AsyncError returns the first failure the group saw on its own, or nil.
func (g *Group) AsyncError() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.failure
}

// Abort stops the group: it closes every connection, so that an operation
// blocked in another goroutine returns at once, and tells the peers why.
// Every operation in flight or later returns a *pg.AbortedError with the
// first reason given (or the failure that aborted the group first).
func (g *Group) Abort(reason error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return
	}
	if g.aborted == nil {
		g.aborted = pg.NewAbortedError(reason)
		g.tellLocked(ctrlMsg{kind: msgAbort, culprit: -1, reason: g.aborted.Reason.Error()})
		g.stopOnce.Do(func() { close(g.stop) })
	}
	for _, p := range g.peers {
		if p != nil {
			p.close()
		}
	}
}

// Close releases the group's connections and goroutines. A healthy group
// says goodbye to its peers first, so that a peer still finishing the last
// collective does not take this rank for dead. Close does not wait for
// peers; every later operation returns an error wrapping pg.ErrClosed.
func (g *Group) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	if g.aborted == nil && !g.inflight {
		g.tellLocked(ctrlMsg{kind: msgBye, count: g.collSeq})
	}
	g.stopOnce.Do(func() { close(g.stop) })
	for _, p := range g.peers {
		if p != nil {
			p.close()
		}
	}
	g.mu.Unlock()
	g.wg.Wait()
	return nil
}

// tellLocked sends m to every peer, best effort.
func (g *Group) tellLocked(m ctrlMsg) {
	for _, p := range g.peers {
		if p != nil {
			writeCtrl(p.ctrl, m)
		}
	}
}

// failLocked records err as the group's failure, aborts the group with it,
// interrupts the operation in flight and tells the peers. The connections
// stay open (unlike Abort), so that the peers learn of the failure's cause
// from the message, not from this rank's hang-up.
func (g *Group) failLocked(err error) {
	if g.aborted != nil || g.closed {
		return
	}
	g.failure = err
	g.aborted = pg.NewAbortedError(err)
	culprit, reason := -1, err.Error()
	var pe *pg.PeerError
	if errors.As(err, &pe) {
		culprit, reason = pe.Rank, pe.Err.Error()
		var rep *reported
		if errors.As(pe.Err, &rep) {
			reason = rep.reason // pass on the original, not a chain
		}
	}
	g.tellLocked(ctrlMsg{kind: msgAbort, culprit: culprit, reason: reason})
	g.stopOnce.Do(func() { close(g.stop) })
	g.interruptLocked()
}

// interruptLocked makes every blocked read and write return at once.
func (g *Group) interruptLocked() {
	past := time.Unix(1, 0)
	for _, p := range g.peers {
		if p != nil {
			p.setDeadline(past)
		}
	}
}

// readControl drains peer p's control connection until it breaks.
func (g *Group) readControl(p *peer) {
	defer close(p.ctrlDone)
	for {
		m, err := readCtrl(p.ctrl)
		g.mu.Lock()
		switch {
		case err != nil:
			if g.byeAt[p.rank] < 0 {
				g.failLocked(&pg.PeerError{Rank: p.rank, Op: g.opNameLocked(), Err: err})
			}
			g.mu.Unlock()
			return
		case m.kind == msgBye:
			g.byeAt[p.rank] = m.count
			if g.inflight && g.opColl && g.collSeq > m.count {
				g.failLocked(&pg.PeerError{Rank: p.rank, Op: g.opName, Err: peerLeft(m.count)})
			}
		case m.kind == msgAbort:
			var cause error
			if m.culprit < 0 || m.culprit == p.rank || m.culprit >= g.size {
				cause = &pg.PeerError{Rank: p.rank, Op: g.opNameLocked(), Err: fmt.Errorf("peer gave up: %s", m.reason)}
			} else {
				cause = &pg.PeerError{Rank: m.culprit, Op: g.opNameLocked(), Err: &reported{by: p.rank, reason: m.reason}}
			}
			g.failLocked(cause)
		}
		g.mu.Unlock()
	}
}

func (g *Group) opNameLocked() string {
	if g.inflight {
		return g.opName
	}
	return "connection"
}

// reported is a peer's failure as another peer told it.
type reported struct {
	by     int
	reason string
}

func (r *reported) Error() string { return fmt.Sprintf("%s (reported by rank %d)", r.reason, r.by) }

func peerLeft(count int64) error {
	return fmt.Errorf("peer closed the group after %d collectives", count)
}

// call is one operation in flight.
type call struct {
	ctx  context.Context
	name string
	id   uint64
	stop func() bool // stops the context watch; nil: none

	holdsRings bool // it holds the shared-memory rings (see dropRingHold)
}

// begin checks that the group can run an operation, sets the connections'
// deadlines and registers the operation; end must follow.
func (g *Group) begin(ctx context.Context, o *call, name string, coll bool) error {
	o.ctx, o.name = ctx, name
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.closed:
		return fmt.Errorf("pg/cpu: %s: %w", name, pg.ErrClosed)
	case g.retired:
		return fmt.Errorf("pg/cpu: %s: %w: the group was shrunk into a new one", name, pg.ErrClosed)
	case g.aborted != nil:
		return g.aborted
	}
	if err := ctx.Err(); err != nil {
		// Nothing was sent: the group stays usable.
		return ctxErr(name, g.rank, err, -1)
	}
	if coll {
		for q, c := range g.byeAt {
			if c >= 0 && c <= g.collSeq {
				e := &pg.PeerError{Rank: q, Op: name, Err: peerLeft(c)}
				g.failLocked(e)
				return e
			}
		}
		g.collSeq++
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(g.cfg.OpTimeout())
	}
	for _, p := range g.peers {
		if p != nil {
			p.setDeadline(deadline)
		}
	}
	if o.holdsRings = len(g.rings) > 0; o.holdsRings {
		g.holds++
	}
	g.inflight, g.opColl, g.opName = true, coll, name
	g.opID++
	o.id = g.opID
	if ctx.Done() != nil {
		id := o.id
		o.stop = context.AfterFunc(ctx, func() {
			g.mu.Lock()
			if g.inflight && g.opID == id {
				g.interruptLocked()
			}
			g.mu.Unlock()
		})
	}
	return nil
}

// end finishes o; err is what the operation saw (nil on success), and the
// result is what it returns.
func (g *Group) end(o *call, err error) error {
	if o.stop != nil {
		o.stop()
	}
	g.mu.Lock()
	g.inflight = false
	g.mu.Unlock()
	if o.holdsRings {
		g.dropRingHold()
	}
	return err
}

// ioErr turns an I/O error on the connection to peer into the operation's
// error, and fails the group with it if nothing else did first.
//
// A peer that breaks the data connection (EOF, reset) has closed both of
// its connections, or died; if it gave up because a third rank died, it
// said so on the control connection first. So before blaming the peer,
// ioErr lets the control reader drain that connection (for at most
// ctrlGrace): the survivors then name the rank that died, not the rank
// that noticed first.
func (g *Group) ioErr(o *call, peer int, err error) error {
	if e, done := g.settledErr(o, peer, err); done {
		return e
	}
	t := time.NewTimer(ctrlGrace)
	select {
	case <-g.peers[peer].ctrlDone:
	case <-t.C:
	}
	t.Stop()
	e, done := g.settledErr(o, peer, err)
	if done {
		return e
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.failure != nil {
		return g.failure
	}
	pe := &pg.PeerError{Rank: peer, Op: o.name, Err: err}
	g.failLocked(pe)
	return pe
}

// settledErr returns the operation's error when the group's state, the
// context or a deadline explain err.
func (g *Group) settledErr(o *call, peer int, err error) (error, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.closed:
		return fmt.Errorf("pg/cpu: %s: %w", o.name, pg.ErrClosed), true
	case g.failure != nil:
		return g.failure, true
	case g.aborted != nil:
		return g.aborted, true
	}
	if ctxErr := o.ctx.Err(); ctxErr != nil {
		return g.ctxErrLocked(o.name, ctxErr, peer), true
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return g.ctxErrLocked(o.name, context.DeadlineExceeded, peer), true
	}
	return nil, false
}

func (g *Group) ctxErrLocked(name string, err error, peer int) error {
	e := ctxErr(name, g.rank, err, peer)
	g.failLocked(e)
	return e
}

// ctxErr is the error of an operation whose context ended: it wraps
// pg.ErrTimeout when the deadline passed.
func ctxErr(name string, rank int, err error, peer int) error {
	waiting := ""
	if peer >= 0 {
		waiting = " waiting on rank " + strconv.Itoa(peer)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("pg/cpu: %s: rank %d%s: %w: %w", name, rank, waiting, pg.ErrTimeout, err)
	}
	return fmt.Errorf("pg/cpu: %s: rank %d%s: %w", name, rank, waiting, err)
}

// recv reads exactly len(b) bytes from peer p.
func (g *Group) recv(o *call, p *peer, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if err := p.in.read(b); err != nil {
		return g.ioErr(o, p.rank, err)
	}
	return nil
}

// recvReduce receives len(dst) bytes from peer p and sets dst = src op
// them; tmp is scratch of at least len(dst) bytes.
func (g *Group) recvReduce(o *call, p *peer, dst, src, tmp []byte, red reducer) error {
	if err := p.in.readReduce(dst, src, tmp, red); err != nil {
		return g.ioErr(o, p.rank, err)
	}
	return nil
}

// flush waits until everything posted to p was written.
func (g *Group) flush(o *call, p *peer) error {
	if err := p.send.wait(g.stop); err != nil {
		return g.ioErr(o, p.rank, err)
	}
	return nil
}

// flushAll flushes every peer.
func (g *Group) flushAll(o *call) error {
	for _, p := range g.peers {
		if p != nil {
			if err := g.flush(o, p); err != nil {
				return err
			}
		}
	}
	return nil
}

// scratchBytes returns 8-byte-aligned scratch space of at least n bytes.
func (g *Group) scratchBytes(n int) []byte {
	words := (n + 7) / 8
	if cap(g.scratch) < words {
		g.scratch = make([]uint64, words)
	}
	return asBytes(g.scratch[:words])[:n]
}

// Shrink returns a new group of this group's ranks minus exclude (see
// pg.ProcessGroup). The survivors meet in a namespace derived from this
// group's namespace, the number of Shrink calls this group has seen and
// the sorted exclusion list, so that every survivor finds the same one and
// no earlier group's keys. With pg.ShrinkAbort the group is aborted first.
func (g *Group) Shrink(ctx context.Context, exclude []int, flags pg.ShrinkFlags) (pg.ProcessGroup, error) {
	if err := pg.ValidateShrink(g.rank, g.size, exclude, flags); err != nil {
		return nil, fmt.Errorf("pg/cpu: shrink: %w", err)
	}
	sorted := slices.Sorted(slices.Values(exclude))
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil, fmt.Errorf("pg/cpu: shrink: %w", pg.ErrClosed)
	}
	k := g.shrinks
	g.shrinks++
	if flags == pg.ShrinkDefault {
		g.retired = true
	}
	g.mu.Unlock()
	if flags == pg.ShrinkAbort {
		g.Abort(fmt.Errorf("shrinking without ranks %v", sorted))
	}
	cfg := g.cfg
	cfg.Namespace = shrinkNamespace(g.cfg.Namespace, k, sorted)
	cfg.Rank = pg.Survivors(g.size, sorted)[g.rank]
	cfg.Size = g.size - len(sorted)
	child, err := New(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pg/cpu: shrink without ranks %v: %w", sorted, err)
	}
	return child, nil
}

// Grow returns this group grown by spec.Added newcomers (pg.Grower): a
// new mesh under spec.Namespace of Size()+spec.Added ranks, where every
// member keeps its rank and the newcomers, formed with JoinGrow, take the
// next ones. The group stays usable: a grow that does not complete (a
// newcomer that never comes, within ctx or the group's timeout) leaves it
// as it was.
func (g *Group) Grow(ctx context.Context, spec pg.GrowSpec) (pg.ProcessGroup, error) {
	if err := pg.ValidateGrow(g.size, spec); err != nil {
		return nil, fmt.Errorf("pg/cpu: %w", err)
	}
	g.mu.Lock()
	closed := g.closed
	g.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("pg/cpu: grow: %w", pg.ErrClosed)
	}
	cfg := g.cfg
	cfg.Namespace, cfg.Size = spec.Namespace, g.size+spec.Added
	child, err := New(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pg/cpu: grow by %d: %w", spec.Added, err)
	}
	return child, nil
}

// JoinGrow forms a newcomer's side of a Grow: cfg.Rank is its rank in the
// grown group and cfg.Size that group's size (the members' Size() plus
// spec.Added); it meets the members under spec.Namespace, which replaces
// cfg.Namespace.
func JoinGrow(ctx context.Context, cfg Config, spec pg.GrowSpec) (*Group, error) {
	if err := pg.ValidateGrow(cfg.Size-spec.Added, spec); err != nil {
		return nil, fmt.Errorf("pg/cpu: %w", err)
	}
	if cfg.Rank < cfg.Size-spec.Added || cfg.Rank >= cfg.Size {
		return nil, fmt.Errorf("pg/cpu: join grow: %w: rank %d is not a newcomer's (%d to %d)", pg.ErrInvalidArgument, cfg.Rank, cfg.Size-spec.Added, cfg.Size-1)
	}
	cfg.Namespace = spec.Namespace
	return New(ctx, cfg)
}

// shrinkNamespace is where the survivors of shrink number k of a group in
// namespace parent, without the ranks in sorted, meet.
func shrinkNamespace(parent string, k int, sorted []int) string {
	var b strings.Builder
	if parent != "" {
		b.WriteString(parent)
		b.WriteByte('/')
	}
	fmt.Fprintf(&b, "pgcpu-shrink%d-x", k)
	for i, r := range sorted {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(r))
	}
	return b.String()
}

// hostBuffer checks that b is a HostBuffer of a dtype pg/cpu handles.
func hostBuffer(name string, b pg.Buffer) (pg.HostBuffer, error) {
	h, ok := b.(pg.HostBuffer)
	if !ok {
		return pg.HostBuffer{}, fmt.Errorf("pg/cpu: %s: %w: want a pg.HostBuffer, got %T", name, pg.ErrInvalidArgument, b)
	}
	if err := checkDType(h.DType()); err != nil {
		return pg.HostBuffer{}, fmt.Errorf("pg/cpu: %s: %w", name, err)
	}
	return h, nil
}

// asBytes views words as bytes.
func asBytes(words []uint64) []byte {
	if len(words) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), 8*len(words))
}
