package nccl

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

// Grow and JoinGrow: heal's second half (pg.Grower).
//
// Members and newcomers meet under spec.Namespace in the group's store:
//
//	newcomer/<rank>  set by each newcomer once its device and library are up
//	method           how the root member grows: "ncclCommGrow" or "ncclCommInitRank"
//	0                the 128 raw bytes of the id, the key New's bootstrap uses
//
// The root member (rank 0) waits for every newcomer's key before it makes
// an id, then sets method and 0 (in that order); the other members and the
// newcomers wait for both. So a newcomer that never comes leaves the
// members waiting on the store, within their context, before any NCCL
// call: the root has taken no grow id (NCCL lets a communicator have one
// unconsumed grow id at a time) and the old group is as it was. The root's
// choice of method is the one everybody follows, so that members and
// newcomers never take different paths.
const (
	growKeyMethod = "method"
	growKeyID     = "0"

	// growMethodGrow: ncclCommGrow on the members' communicators (NCCL ≥
	// 2.29), the id from the root's ncclCommGetUniqueId.
	growMethodGrow = "ncclCommGrow"
	// growMethodInit is the fallback for libraries without ncclCommGrow: a
	// fresh communicator of the grown size (ncclCommInitRank or
	// ncclCommInitRankConfig) with an id from the root's ncclGetUniqueId.
	growMethodInit = "ncclCommInitRank"
)

func newcomerKey(rank int) string { return "newcomer/" + strconv.Itoa(rank) }

// growSupported says whether the library grows a communicator in place.
func (g *Group) growSupported() error {
	if g.ver.AtLeast(VersionGrow) && g.nccl.has("ncclCommGrow") && g.nccl.has("ncclCommGetUniqueId") {
		return nil
	}
	return fmt.Errorf("pg/nccl: grow in place needs NCCL ≥ %v (ncclCommGrow, ncclCommGetUniqueId); %s is NCCL %v%s: %w",
		VersionGrow, g.nccl.path(), g.ver, missing(g.ver.AtLeast(VersionGrow)), pg.ErrNotSupported)
}

// growsInPlace says whether the root member grows with ncclCommGrow: the
// library has it and the group is blocking. A non-blocking group forms a
// fresh communicator instead. On an H200 with NCCL 2.29.7 a newcomer's
// non-blocking ncclCommGrow crashed or hung in 5 of 10 runs of
// TestGPUShrinkGrow (its process's next thread creation faulted inside
// glibc, or the newcomer never reached the first collective), where
// blocking ones passed every run and non-blocking fresh communicators 3 of
// 3 (NCCL 2.28.9): the non-blocking grow waits for a run that passes.
func (g *Group) growsInPlace() bool {
	return !g.cfg.NonBlocking && g.growSupported() == nil
}

// Grow returns a group of this group's ranks plus spec.Added newcomers
// (pg.Grower): every member calls it with the same spec and keeps its rank;
// the newcomers call JoinGrow and take ranks Size() to
// Size()+spec.Added-1. The arguments are checked with pg.ValidateGrow
// first; a closed group cannot grow, and a stopped one (aborted, or a
// peer lost) grows, or re-forms (Added 0), through a fresh communicator.
//
// Where the library has ncclCommGrow (NCCL ≥ 2.29) and the group is
// blocking (growsInPlace) the root member (rank 0) makes the grow's id
// with ncclCommGetUniqueId on its communicator and publishes it under
// spec.Namespace; every member calls ncclCommGrow on its communicator
// (rank -1, the id from the root only, a NULL config: the new communicator
// inherits the group's) and each newcomer calls it with a NULL
// communicator, the id and its rank (blocking, in any group). Older
// libraries, and non-blocking groups, form a fresh communicator of the
// grown size as New forms one (ncclGetUniqueId on the root,
// ncclCommInitRank or ncclCommInitRankConfig everywhere), with the same
// ranks. A non-blocking group polls the new communicator until it is
// ready.
//
// The group must be idle, and it is left as it was: a grow that does not
// complete (a newcomer that never comes, within ctx and the bootstrap
// timeout; a failed NCCL call; Abort or Close meanwhile) returns an error,
// the new communicator, if any, is aborted, and the members carry on with
// this group — except where a blocking ncclCommGrow was given up (ctx's
// end, Abort, Close: see growMemberBlocking): its communicator is then
// NCCL's until the call returns, and the group is stopped, to be re-formed
// (Grow with no newcomers) or shrunk afresh. A newcomer that dies after it
// announced itself is noticed by NCCL, or not at all by a blocking call:
// every wait ends at ctx's end or on Abort. NCCL lets a communicator
// have one unconsumed grow id at a time, and a grow that failed after the
// root took its id may leave it unconsumed: the root's next Grow on this
// group may then be refused, and the members shrink or re-form instead.
// Once the new group is in use, Close this one (NCCL: destroy the parent
// after a grow).
func (g *Group) Grow(ctx context.Context, spec pg.GrowSpec) (pg.ProcessGroup, error) {
	if err := pg.ValidateGrow(g.size, spec); err != nil {
		return nil, fmt.Errorf("pg/nccl: %w", err)
	}
	if g.closed.Load() {
		return nil, fmt.Errorf("pg/nccl: rank %d cannot grow: %w", g.rank, pg.ErrClosed)
	}
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, g.cfg.Bootstrap.OpTimeout())
	defer cancel()
	g.opMu.Lock()
	defer g.opMu.Unlock()
	c, err := g.grow(ctx, spec)
	if err != nil {
		return nil, fmt.Errorf("pg/nccl: rank %d: grow by %d under '%s': %w", g.rank, spec.Added, spec.Namespace, err)
	}
	return c, nil
}

// grow is Grow with the group's operation lock held.
func (g *Group) grow(ctx context.Context, spec pg.GrowSpec) (*Group, error) {
	// Close may have come while Grow waited for the lock.
	if g.closed.Load() {
		return nil, fmt.Errorf("rank %d: %w", g.rank, pg.ErrClosed)
	}
	// A stopped (aborted, or peer lost) communicator cannot grow in place,
	// and a re-forming has no newcomers to grow by: both form a fresh
	// communicator of the same ranks.
	fresh := spec.Added == 0 || g.stopped.Load() != nil
	store := rendezvous.NewPrefixStore(spec.Namespace, g.cfg.Bootstrap.Store)
	var (
		method string
		id     uniqueID
		err    error
	)
	if g.rank == 0 {
		method, id, err = g.publishGrowID(ctx, store, spec, fresh)
	} else {
		method, id, err = getGrowID(ctx, store, g.rank)
	}
	if err != nil {
		return nil, err
	}
	c, err := g.derive(g.rank, g.size+spec.Added)
	if err != nil {
		return nil, err
	}
	c.cfg.Bootstrap.Namespace = spec.Namespace
	err = c.form(ctx, func(ctx context.Context) (commHandle, error) {
		if method == growMethodGrow {
			return g.growMember(ctx, c, id)
		}
		// A fresh communicator: its wait ends, as growMember's does, when
		// this group is aborted or closed meanwhile — unless it was stopped
		// before, which is why it re-forms.
		var stop <-chan struct{}
		if !fresh {
			stop = g.stopCh
		}
		comm, err := c.initComm(ctx, stop, id)
		if errors.Is(err, errStopped) {
			return 0, g.usable()
		}
		return comm, err
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// publishGrowID is the root member's part of the meeting: wait for every
// newcomer, make the id (ncclCommGetUniqueId on the group's communicator,
// or ncclGetUniqueId for the fallback) and set method and id.
func (g *Group) publishGrowID(ctx context.Context, store rendezvous.Store, spec pg.GrowSpec, fresh bool) (string, uniqueID, error) {
	var id uniqueID
	keys := make([]string, spec.Added)
	for i := range keys {
		keys[i] = newcomerKey(g.size + i)
	}
	if err := store.Wait(ctx, keys...); err != nil {
		return "", id, storeError(fmt.Errorf("[0] waiting for newcomers %d to %d (keys %v): %w",
			g.size, g.size+spec.Added-1, keys, err))
	}
	method, op := growMethodInit, "ncclGetUniqueId"
	var r Result
	if !fresh && g.growsInPlace() {
		method, op = growMethodGrow, "ncclCommGetUniqueId"
		g.commMu.RLock()
		if g.comm == 0 || g.stopped.Load() != nil {
			g.commMu.RUnlock()
			return "", id, g.usable()
		}
		id, r = g.nccl.commGetUniqueID(g.dev.ctx, g.comm)
		g.commMu.RUnlock()
	} else {
		id, r = g.nccl.getUniqueID()
	}
	if r != Success {
		return "", id, g.ncclError(op, r, 0)
	}
	// method first: whoever sees the id sees the method too.
	err := store.MultiSet(ctx, []string{growKeyMethod, growKeyID}, [][]byte{[]byte(method), id[:]})
	if err != nil {
		return "", id, storeError(fmt.Errorf("[0] cannot set the grow's method and %s under keys '%s' and '%s': %w",
			op, growKeyMethod, growKeyID, err))
	}
	return method, id, nil
}

// getGrowID is everybody else's part of the meeting: wait for the root's
// method and id. A member that is not the root needs only the method (it
// passes no id to ncclCommGrow); the id's arrival is its go.
func getGrowID(ctx context.Context, store rendezvous.Store, rank int) (string, uniqueID, error) {
	var id uniqueID
	v, err := store.MultiGet(ctx, growKeyMethod, growKeyID)
	if err != nil {
		return "", id, storeError(fmt.Errorf("[%d] waiting for the grow's id from [0] under key '%s': %w", rank, growKeyID, err))
	}
	method := string(v[0])
	if method != growMethodGrow && method != growMethodInit {
		return "", id, fmt.Errorf("%w: [%d] the grow's method under key '%s' is %q, want %q or %q",
			pg.ErrInvalidArgument, rank, growKeyMethod, method, growMethodGrow, growMethodInit)
	}
	if len(v[1]) != uniqueIDBytes {
		return "", id, fmt.Errorf("%w: [%d] the grow's id under key '%s' has %d bytes, want NCCL_UNIQUE_ID_BYTES (%d)",
			pg.ErrInvalidArgument, rank, growKeyID, len(v[1]), uniqueIDBytes)
	}
	copy(id[:], v[1])
	return method, id, nil
}

// storeError adds pg.ErrTimeout to a store wait that ran out of time.
func storeError(err error) error {
	if errors.Is(err, rendezvous.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w (%w)", err, pg.ErrTimeout)
	}
	return err
}

// growMember calls ncclCommGrow on the member's communicator for c (the
// new group, same rank, grown size): rank -1, the id only from the root,
// and a NULL config so that the new communicator inherits the group's. The
// wait ends early when the group is aborted or closed.
func (g *Group) growMember(ctx context.Context, c *Group, id uniqueID) (commHandle, error) {
	var idp *uniqueID
	if g.rank == 0 {
		idp = &id
	}
	if !g.cfg.NonBlocking {
		return g.growMemberBlocking(ctx, c, idp)
	}
	g.commMu.RLock()
	if g.comm == 0 || g.stopped.Load() != nil {
		g.commMu.RUnlock()
		return 0, g.usable()
	}
	comm, r := g.nccl.commGrow(g.dev.ctx, g.comm, c.size, idp, -1, nil)
	g.commMu.RUnlock()
	comm, err := c.finishComm(ctx, g.stopCh, "ncclCommGrow", comm, r)
	if errors.Is(err, errStopped) {
		return 0, g.usable()
	}
	return comm, err
}

// growMemberBlocking is growMember on a blocking communicator. A blocking
// ncclCommGrow returns only once every rank has joined the grown
// communicator, which a newcomer that died or hangs after announcing
// itself never does, and while it runs nothing can be done with the
// communicator. So the call runs on a goroutine of its own, the
// communicator lent to it (lendComm: no other NCCL call on it, Abort and
// Close leave it alone), and the member stops waiting at ctx's end or when
// the group is aborted or closed: the group is then stopped and its
// communicator forfeited to the call, which NCCL keeps; when the call
// returns, what it made and the forfeited communicator are aborted, in a
// device context it retains until then. The members re-form afresh (Grow
// with no newcomers, or Shrink).
func (g *Group) growMemberBlocking(ctx context.Context, c *Group, idp *uniqueID) (commHandle, error) {
	parent, err := g.lendComm()
	if err != nil {
		return 0, err
	}
	comm, r, returned, err := g.callBlocking(ctx, g.stopCh, func(dctx ctxHandle) (commHandle, Result) {
		return g.nccl.commGrow(dctx, parent, c.size, idp, -1, nil)
	}, g.returnComm)
	switch {
	case err != nil:
		g.returnComm(g.dev)
		return 0, err
	case returned:
		return c.finishComm(ctx, nil, "ncclCommGrow", comm, r)
	}
	why := g.usable()
	if ctx.Err() != nil {
		why = g.ctxError(ctx, "ncclCommGrow")
	}
	g.stop(fmt.Errorf("pg/nccl: rank %d: a blocking ncclCommGrow was given up (%w): its communicator is NCCL's until the call returns", g.rank, why))
	g.commMu.Lock()
	g.forfeit()
	g.commMu.Unlock()
	return 0, fmt.Errorf("%w; the blocking call is left to NCCL (it cannot be interrupted) with this group's communicator, both aborted when it returns", why)
}

// JoinGrow forms a newcomer's side of a Grow: cfg.Bootstrap.Rank is its
// rank in the grown group and cfg.Bootstrap.Size that group's size (the
// members' Size() plus spec.Added); it meets the members under
// spec.Namespace, which replaces cfg.Bootstrap.Namespace, in
// cfg.Bootstrap.Store. It announces itself, waits for the root member's id
// and calls ncclCommGrow with a NULL communicator, the id and its rank (its
// config sets blocking from cfg.NonBlocking), or, when the members fall
// back, forms the grown communicator as New does. Errors: those of New, an
// error wrapping pg.ErrInvalidArgument for a rank that is not a newcomer's,
// pg.ErrTimeout when the members never publish the id, pg.ErrNotSupported
// when the members grow in place and this library cannot.
func JoinGrow(ctx context.Context, cfg Config, spec pg.GrowSpec) (*Group, error) {
	b := cfg.Bootstrap
	members := b.Size - spec.Added
	if err := pg.ValidateGrow(members, spec); err != nil {
		return nil, fmt.Errorf("pg/nccl: join: %w", err)
	}
	if members < 1 || b.Rank < members || b.Rank >= b.Size {
		return nil, fmt.Errorf("%w: pg/nccl: join grow: rank %d of %d is not a newcomer's (%d newcomers take ranks %d to %d)",
			pg.ErrInvalidArgument, b.Rank, b.Size, spec.Added, members, b.Size-1)
	}
	cfg.Bootstrap.Namespace = spec.Namespace
	g, err := open(cfg)
	if err != nil {
		return nil, err
	}
	if err := g.form(ctx, g.join); err != nil {
		return nil, fmt.Errorf("pg/nccl: rank %d: join grow under '%s': %w", g.rank, spec.Namespace, err)
	}
	return g, nil
}

// join is the newcomer's meeting and its communicator.
func (g *Group) join(ctx context.Context) (commHandle, error) {
	store := g.cfg.Bootstrap.NamespacedStore()
	if err := store.Set(ctx, newcomerKey(g.rank), []byte("1")); err != nil {
		return 0, fmt.Errorf("[%d] cannot announce itself under key '%s': %w", g.rank, newcomerKey(g.rank), err)
	}
	method, id, err := getGrowID(ctx, store, g.rank)
	if err != nil {
		return 0, err
	}
	if method == growMethodInit {
		return g.initComm(ctx, nil, id)
	}
	if err := g.growSupported(); err != nil {
		return 0, fmt.Errorf("the members grow with ncclCommGrow: %w", err)
	}
	// Blocking even in a non-blocking group (whose members, then, are
	// blocking ones): see growsInPlace.
	return g.makeComm(ctx, nil, "ncclCommGrow", func() (commHandle, Result) {
		return g.nccl.commGrow(g.dev.ctx, 0, g.size, &id, g.rank, &commConfig{blocking: true})
	})
}
