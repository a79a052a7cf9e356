package nccl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

// Group is a pg.ProcessGroup over one NCCL communicator on one CUDA device.
// Its buffers are *DeviceBuffer (see Alloc and Upload).
//
// Every collective is enqueued on the group's own stream and then waited
// for by polling the stream and ncclCommGetAsyncError, so that the caller's
// context, Abort and the watchdog all interrupt the wait. When a wait ends
// early (deadline, cancellation) the group aborts itself: the operation is
// still on the device and the peers are still in it, so nothing else is
// consistent.
type Group struct {
	cfg  Config
	nccl ncclAPI
	cuda cudaAPI
	ver  Version
	dev  *device
	rank int
	size int

	stream  streamHandle
	scratch *DeviceBuffer // one element, for Barrier

	// opMu is held for the whole of a collective, Shrink and Close, so
	// that Close never frees the stream under a waiting collective.
	opMu     sync.Mutex
	inFlight atomic.Bool

	// commMu guards comm and revoked: NCCL calls on the communicator hold
	// it for reading, calls that end it (abort, destroy, shrink, revoke)
	// for writing. comm is 0 once ncclCommAbort or ncclCommDestroy freed
	// it.
	commMu  sync.RWMutex
	comm    commHandle
	revoked bool // stopped with ncclCommRevoke; kept for Shrink, freed by Close
	// held: aborted without revoke or ncclCommAbort (see Config.FreeOnAbort);
	// kept for Shrink, freed by Close.
	held bool
	// lent: comm is in a blocking ncclCommGrow that runs outside commMu
	// (growMemberBlocking), and nothing else may call NCCL on it. Whoever
	// ends the group meanwhile forfeits it: comm becomes 0 and forfeited
	// holds it until the call returns, which aborts it (returnComm).
	lent      bool
	forfeited commHandle

	stopped  atomic.Pointer[pg.AbortedError] // first reason wins
	stopCh   chan struct{}                   // closed when stopped is set
	closed   atomic.Bool
	asyncMu  sync.Mutex
	asyncErr error

	idCounter int // PyTorch's ncclCommCounter_: the next unique-id key

	wdStop chan struct{}
	wdDone chan struct{}
}

var (
	_ pg.ProcessGroup = (*Group)(nil)
	_ pg.Grower       = (*Group)(nil)
)

// New forms the group: it finds the GPU, loads NCCL, exchanges the unique
// id through the bootstrap store as PyTorch does (rank 0 runs
// ncclGetUniqueId and sets the 128 raw bytes under the decimal key "0" of
// the bootstrap namespace; the others get it), creates the communicator
// (blocking, or non-blocking and polled) and starts the watchdog. Forming is
// bounded by ctx and by Bootstrap's timeout.
//
// Errors: ErrNoGPU when there is no CUDA driver or no device; a *LoadError
// naming the library when NCCL cannot be loaded; in a build without cgo, an
// error saying pg/nccl needs cgo.
func New(ctx context.Context, cfg Config) (*Group, error) {
	g, err := open(cfg)
	if err != nil {
		return nil, err
	}
	if err := g.form(ctx, g.initFresh); err != nil {
		return nil, err
	}
	return g, nil
}

// initFresh makes a communicator of the group's rank and size from
// nothing: a unique id through the store (exchangeID), then initComm.
func (g *Group) initFresh(ctx context.Context) (commHandle, error) {
	id, err := g.exchangeID(ctx)
	if err != nil {
		return 0, err
	}
	return g.initComm(ctx, nil, id)
}

// form makes the communicator of a Group from open or derive with mk,
// within ctx and the bootstrap timeout, and starts the group; on failure it
// releases the group.
func (g *Group) form(ctx context.Context, mk func(context.Context) (commHandle, error)) error {
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, g.cfg.Bootstrap.OpTimeout())
	defer cancel()
	comm, err := mk(ctx)
	if err == nil {
		g.comm = comm
		err = g.start()
	}
	if err != nil {
		g.release()
	}
	return err
}

// open is what New and JoinGrow do before they meet their peers: check the
// configuration, find the GPU, load NCCL and retain the device. The Group
// it returns has no communicator yet; release frees it.
func open(cfg Config) (*Group, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	cuda, ordinal, err := findGPU(cfg)
	if err != nil {
		return nil, err
	}
	nccl, err := openNCCL(cfg.NCCLLibrary)
	if err != nil {
		return nil, err
	}
	code, r := nccl.getVersion()
	if r != Success {
		return nil, &Error{Op: "ncclGetVersion", Result: r, Text: nccl.errorString(r)}
	}
	ver := DecodeVersion(code)
	if cfg.NonBlocking && !(ver.AtLeast(VersionInitConfig) && nccl.has("ncclCommInitRankConfig")) {
		return nil, fmt.Errorf("pg/nccl: non-blocking communicators need NCCL ≥ %v (ncclCommInitRankConfig); %s is NCCL %v: %w",
			VersionInitConfig, nccl.path(), ver, pg.ErrNotSupported)
	}
	dev, err := retainDevice(cuda, ordinal)
	if err != nil {
		return nil, err
	}
	return &Group{cfg: cfg, nccl: nccl, cuda: cuda, ver: ver, dev: dev,
		rank: cfg.Bootstrap.Rank, size: cfg.Bootstrap.Size}, nil
}

// findGPU loads the CUDA driver and picks the device, or says there is
// none in PyTorch's words.
func findGPU(cfg Config) (cudaAPI, int, error) {
	cuda, err := openCUDA(cfg.CUDALibrary)
	if err != nil {
		var le *LoadError
		if errors.As(err, &le) {
			return nil, 0, fmt.Errorf("%w (%v)", ErrNoGPU, err)
		}
		return nil, 0, err
	}
	if code := cuda.initDriver(); code != cudaSuccess {
		err := cudaError(cuda, "cuInit", code)
		if code == cudaErrorNoDevice {
			return nil, 0, fmt.Errorf("%w (%v)", ErrNoGPU, err)
		}
		return nil, 0, err
	}
	n, code := cuda.deviceCount()
	if code != cudaSuccess {
		return nil, 0, cudaError(cuda, "cuDeviceGetCount", code)
	}
	if n == 0 {
		return nil, 0, fmt.Errorf("%w (%s sees 0 devices)", ErrNoGPU, cuda.path())
	}
	if cfg.Device >= 0 {
		if cfg.Device >= n {
			return nil, 0, fmt.Errorf("%w: pg/nccl: device %d, but the driver sees %d", pg.ErrInvalidArgument, cfg.Device, n)
		}
		return cuda, cfg.Device, nil
	}
	r := cfg.Bootstrap.Rank
	if lr, err := strconv.Atoi(os.Getenv("LOCAL_RANK")); err == nil && lr >= 0 {
		r = lr
	}
	return cuda, r % n, nil
}

// exchangeID is PyTorch's broadcastUniqueNCCLID for a collective
// communicator: the key is the group's counter in decimal, incremented on
// every rank; rank 0 generates and sets, the others get and check the size.
func (g *Group) exchangeID(ctx context.Context) (uniqueID, error) {
	var id uniqueID
	key := strconv.Itoa(g.idCounter)
	g.idCounter++
	store := g.cfg.Bootstrap.NamespacedStore()
	if g.rank == 0 {
		id, r := g.nccl.getUniqueID()
		if r != Success {
			return id, g.ncclError("ncclGetUniqueId", r, 0)
		}
		if err := store.Set(ctx, key, id[:]); err != nil {
			return id, fmt.Errorf("pg/nccl: [0] cannot set ncclUniqueId in the c10d key-value store under key '%s': %w", key, err)
		}
		return id, nil
	}
	v, err := store.Get(ctx, key)
	if err != nil {
		return id, storeError(fmt.Errorf("[%d] is setting up NCCL communicator and retreiving ncclUniqueId from [0] via c10d key-value store by key '%s', but store->get('%s') got error: %w",
			g.rank, key, key, err))
	}
	if len(v) != uniqueIDBytes {
		return id, fmt.Errorf("%w: pg/nccl: [%d] the ncclUniqueId under key '%s' has %d bytes, want NCCL_UNIQUE_ID_BYTES (%d)",
			pg.ErrInvalidArgument, g.rank, key, len(v), uniqueIDBytes)
	}
	copy(id[:], v)
	return id, nil
}

// initComm creates the communicator: ncclCommInitRankConfig where the
// library has it (config.blocking from Config.NonBlocking), else
// ncclCommInitRank. A non-blocking init is polled with
// ncclCommGetAsyncError until it leaves ncclInProgress, within ctx.
func (g *Group) initComm(ctx context.Context, stop <-chan struct{}, id uniqueID) (commHandle, error) {
	op, call := "ncclCommInitRank", func() (commHandle, Result) {
		return g.nccl.commInitRank(g.dev.ctx, g.size, g.rank, id)
	}
	if g.ver.AtLeast(VersionInitConfig) && g.nccl.has("ncclCommInitRankConfig") {
		op, call = "ncclCommInitRankConfig", func() (commHandle, Result) {
			return g.nccl.commInitRankConfig(g.dev.ctx, g.size, g.rank, id, !g.cfg.NonBlocking)
		}
	}
	return g.makeComm(ctx, stop, op, call)
}

// makeComm makes a communicator with call (an init or a grow) within ctx
// and until stop (which may be nil) closes: then the error is errStopped.
// A non-blocking call returns at once and finishComm polls the
// communicator, aborting it when ctx ends; a blocking one runs through
// callBlocking.
func (g *Group) makeComm(ctx context.Context, stop <-chan struct{}, op string, call func() (commHandle, Result)) (commHandle, error) {
	if g.cfg.NonBlocking {
		comm, r := call()
		return g.finishComm(ctx, stop, op, comm, r)
	}
	comm, r, returned, err := g.callBlocking(ctx, stop, func(ctxHandle) (commHandle, Result) { return call() }, nil)
	switch {
	case err != nil:
		return 0, err
	case !returned && ctx.Err() != nil:
		return 0, fmt.Errorf("%w; the blocking call is left to NCCL (it cannot be interrupted), its communicator aborted if it ever forms", g.ctxError(ctx, op))
	case !returned:
		return 0, errStopped
	}
	return g.finishComm(ctx, stop, op, comm, r)
}

// callBlocking runs call, a blocking NCCL call that makes a communicator
// (init, grow), and waits for it within ctx and until stop (which may be
// nil) closes. NCCL's blocking call returns only when every rank has
// joined, which a lost rank never does, and hands out no communicator to
// abort until then: it would outlast any deadline, and a worker that
// should give up a formation (its peer lost, an epoch come) would wait in
// it for ever. So call runs on a goroutine of its own, in a device context
// it retains (valid after the Group is released), and returned reports
// whether it came back in time. If not, it is left to NCCL: should it ever
// return, what it made is aborted, then after runs (when not nil), then
// the device is released. The error is only the device's retain failing.
func (g *Group) callBlocking(ctx context.Context, stop <-chan struct{}, call func(ctxHandle) (commHandle, Result), after func(dev *device)) (comm commHandle, r Result, returned bool, err error) {
	dev, err := retainDevice(g.cuda, g.dev.ordinal)
	if err != nil {
		return 0, 0, false, err
	}
	type made struct {
		comm commHandle
		r    Result
	}
	done := make(chan made, 1)
	go func() {
		comm, r := call(dev.ctx)
		done <- made{comm, r}
	}()
	select {
	case m := <-done:
		if after != nil {
			after(dev)
		}
		dev.release()
		return m.comm, m.r, true, nil
	case <-stop:
	case <-ctx.Done():
	}
	go func() {
		if m := <-done; m.comm != 0 {
			g.nccl.commAbort(dev.ctx, m.comm)
		}
		if after != nil {
			after(dev)
		}
		dev.release()
	}()
	return 0, 0, false, nil
}

// finishComm completes the making of a communicator (init, grow): r is
// what op returned. A non-blocking one is polled with
// ncclCommGetAsyncError until it leaves ncclInProgress, within ctx and
// until stop (which may be nil) closes: then the error is errStopped. On
// any error the half-made communicator is aborted.
func (g *Group) finishComm(ctx context.Context, stop <-chan struct{}, op string, comm commHandle, r Result) (commHandle, error) {
	var err error
	switch {
	case r == InProgress || (r == Success && g.cfg.NonBlocking):
		err = g.settle(ctx, stop, comm, op)
	case r != Success:
		err = g.ncclError(op, r, comm)
	}
	if err != nil {
		if comm != 0 {
			g.nccl.commAbort(g.dev.ctx, comm)
		}
		return 0, err
	}
	return comm, nil
}

// start creates what a formed group owns besides the communicator (its
// stream, the barrier's scratch element) and starts the watchdog.
func (g *Group) start() error {
	g.stopCh = make(chan struct{})
	g.wdStop = make(chan struct{})
	g.wdDone = make(chan struct{})
	s, code := g.cuda.streamCreate(g.dev.ctx)
	if code != cudaSuccess {
		close(g.wdDone)
		return cudaError(g.cuda, "cuStreamCreate", code)
	}
	g.stream = s
	scratch, err := g.dev.alloc(pg.Float32, 1)
	if err != nil {
		close(g.wdDone)
		return err
	}
	g.scratch = scratch
	if g.cfg.WatchdogInterval < 0 {
		close(g.wdDone)
		return nil
	}
	go g.watchdog(g.cfg.WatchdogInterval)
	return nil
}

// release frees what New or Shrink got before failing, or what Close
// leaves: the communicator must already be gone.
func (g *Group) release() {
	if g.comm != 0 {
		g.nccl.commAbort(g.dev.ctx, g.comm)
		g.comm = 0
	}
	if g.scratch != nil {
		_ = g.scratch.Free()
	}
	if g.stream != 0 {
		g.cuda.streamDestroy(g.dev.ctx, g.stream)
		g.stream = 0
	}
	g.dev.release()
}

// Rank is this process's rank in the group.
func (g *Group) Rank() int { return g.rank }

// Size is the number of ranks.
func (g *Group) Size() int { return g.size }

// Backend is "nccl".
func (g *Group) Backend() string { return "nccl" }

// Version is the NCCL library's version.
func (g *Group) Version() Version { return g.ver }

// Device is the CUDA device ordinal the group runs on.
func (g *Group) Device() int { return g.dev.ordinal }

// AsyncError returns the first failure the group saw on its own: an
// ncclCommGetAsyncError result (a dead peer is a *pg.PeerError with Rank
// -1: NCCL does not say which), a CUDA error, or a collective that ran past
// its deadline.
func (g *Group) AsyncError() error {
	g.asyncMu.Lock()
	defer g.asyncMu.Unlock()
	return g.asyncErr
}

// Abort stops the group: every collective in flight returns at once and
// every later one too, with a *pg.AbortedError carrying reason. The
// communicator is revoked where NCCL can (≥ 2.28.7) and kept for Shrink;
// with Config.FreeOnAbort it is freed with ncclCommAbort instead. Abort is
// idempotent; the first reason wins.
func (g *Group) Abort(reason error) {
	g.stop(reason)
	g.endComm()
}

// stop marks the group stopped and wakes every waiter; the first call
// wins.
func (g *Group) stop(reason error) bool {
	if !g.stopped.CompareAndSwap(nil, pg.NewAbortedError(reason)) {
		return false
	}
	close(g.stopCh)
	return true
}

// fail records err as the group's async error (the first one wins) and
// aborts the group with it.
func (g *Group) fail(err error) {
	g.asyncMu.Lock()
	if g.asyncErr == nil {
		g.asyncErr = err
	}
	g.asyncMu.Unlock()
	g.Abort(err)
}

// endComm ends the communicator of a stopped group. With FreeOnAbort it is
// freed (ncclCommAbort). Otherwise it is kept for Shrink: revoked where the
// library can (operations on the device end), else held as it is.
func (g *Group) endComm() {
	g.commMu.Lock()
	defer g.commMu.Unlock()
	if g.comm == 0 || g.revoked || g.held {
		return
	}
	if g.lent {
		g.forfeit()
		return
	}
	if !g.cfg.FreeOnAbort {
		if g.revokeSupported() == nil {
			if r := g.nccl.commRevoke(g.dev.ctx, g.comm, 0); r == Success || r == InProgress {
				g.revoked = true
				return
			}
		}
		g.held = true
		return
	}
	g.nccl.commAbort(g.dev.ctx, g.comm)
	g.comm = 0
}

// forfeit gives up a lent communicator to the blocking call that has it:
// the group no longer owns it, and returnComm aborts it when the call
// returns. The caller holds commMu.
func (g *Group) forfeit() {
	if g.lent && g.comm != 0 {
		g.forfeited, g.comm = g.comm, 0
	}
}

// lendComm hands the communicator to a blocking call made outside commMu
// (see lent); returnComm takes it back.
func (g *Group) lendComm() (commHandle, error) {
	g.commMu.Lock()
	defer g.commMu.Unlock()
	if g.comm == 0 || g.stopped.Load() != nil {
		return 0, g.usable()
	}
	g.lent = true
	return g.comm, nil
}

// returnComm ends a loan of the communicator: the call that had it has
// returned. A communicator forfeited meanwhile is aborted now, in dev's
// context (the call's retained device: the group may be released).
func (g *Group) returnComm(dev *device) {
	g.commMu.Lock()
	forfeited := g.forfeited
	g.lent, g.forfeited = false, 0
	g.commMu.Unlock()
	if forfeited != 0 {
		g.nccl.commAbort(dev.ctx, forfeited)
	}
}

// usable returns nil, or why the group takes no more operations.
func (g *Group) usable() error {
	if g.closed.Load() {
		return fmt.Errorf("pg/nccl: rank %d: %w", g.rank, pg.ErrClosed)
	}
	if e := g.stopped.Load(); e != nil {
		return e
	}
	return nil
}

// watchdog polls ncclCommGetAsyncError every interval until the group
// stops or closes; an error aborts the group (see checkAsync).
func (g *Group) watchdog(interval time.Duration) {
	defer close(g.wdDone)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-g.wdStop:
			return
		case <-g.stopCh:
			return
		case <-t.C:
		}
		_ = g.checkAsync("watchdog")
	}
}

// checkAsync polls ncclCommGetAsyncError once. An error (other than
// ncclInProgress) fails the group: it is recorded for AsyncError and the
// group aborts itself. It returns usable's answer afterwards.
func (g *Group) checkAsync(op string) error {
	g.commMu.RLock()
	if g.comm == 0 || g.lent || g.stopped.Load() != nil {
		g.commMu.RUnlock()
		return g.usable()
	}
	async, r := g.nccl.commGetAsyncError(g.comm)
	var err error
	switch {
	case r != Success:
		err = g.ncclError("ncclCommGetAsyncError", r, g.comm)
	case async != Success && async != InProgress:
		err = peerLost(g.ncclError(op+": async error", async, g.comm))
	}
	g.commMu.RUnlock()
	if err != nil {
		g.fail(fmt.Errorf("pg/nccl: rank %d: %w", g.rank, err))
	}
	return g.usable()
}

// errStopped is what poll returns when the stop channel closes.
var errStopped = errors.New("stopped")

// poll calls check until it says done or fails, pausing between calls
// from a few microseconds up to maxPause. It returns errStopped when stop
// closes and ctx's error when ctx is done.
func poll(ctx context.Context, stop <-chan struct{}, maxPause time.Duration, check func() (bool, error)) error {
	pause := 2 * time.Microsecond
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		done, err := check()
		if err != nil || done {
			return err
		}
		t.Reset(pause)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-stop:
			return errStopped
		case <-t.C:
		}
		pause = min(2*pause, maxPause)
	}
}

// settle polls ncclCommGetAsyncError on comm until it leaves ncclInProgress:
// how a non-blocking communicator's init, enqueue or shrink completes.
// stop may be nil. comm must stay valid meanwhile (the caller holds it
// privately, or holds commMu).
func (g *Group) settle(ctx context.Context, stop <-chan struct{}, comm commHandle, op string) error {
	err := poll(ctx, stop, g.cfg.MaxPollInterval, func() (bool, error) {
		async, r := g.nccl.commGetAsyncError(comm)
		switch {
		case r != Success:
			return false, g.ncclError("ncclCommGetAsyncError", r, comm)
		case async == InProgress:
			return false, nil
		case async != Success:
			return false, peerLost(g.ncclError(op, async, comm))
		}
		return true, nil
	})
	if err != nil && ctx.Err() != nil && !errors.Is(err, errStopped) {
		return g.ctxError(ctx, op)
	}
	return err
}

// ctxError is the error for an operation whose context ended first.
func (g *Group) ctxError(ctx context.Context, op string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("pg/nccl: rank %d: %s did not complete in time: %w (%w)", g.rank, op, pg.ErrTimeout, context.Cause(ctx))
	}
	return fmt.Errorf("pg/nccl: rank %d: %s: %w", g.rank, op, context.Cause(ctx))
}

// run is every collective: check the group, enqueue on the stream under a
// read lock of the communicator, settle a non-blocking enqueue, wait for the
// stream.
func (g *Group) run(ctx context.Context, op string, enqueue func(c commHandle) Result) error {
	if err := g.usable(); err != nil {
		return err
	}
	g.opMu.Lock()
	defer g.opMu.Unlock()
	g.inFlight.Store(true)
	defer g.inFlight.Store(false)
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, g.cfg.Bootstrap.OpTimeout())
	defer cancel()

	g.commMu.RLock()
	if g.comm == 0 || g.stopped.Load() != nil || g.closed.Load() {
		g.commMu.RUnlock()
		return g.usable()
	}
	comm := g.comm
	r := enqueue(comm)
	var err error
	if r != Success && r != InProgress {
		err = peerLost(g.ncclError(op, r, comm))
	}
	g.commMu.RUnlock()
	if err != nil {
		var pe *pg.PeerError
		if errors.As(err, &pe) {
			g.fail(fmt.Errorf("pg/nccl: rank %d: %w", g.rank, err))
			return g.usable()
		}
		return err
	}
	if r == InProgress {
		if err := g.settleLocked(ctx, op); err != nil {
			return err
		}
	}
	return g.waitStream(ctx, op)
}

// settleLocked is settle on the group's communicator, taking the read lock
// for each poll so that Abort can end it meanwhile.
func (g *Group) settleLocked(ctx context.Context, op string) error {
	err := poll(ctx, g.stopCh, g.cfg.MaxPollInterval, func() (bool, error) {
		g.commMu.RLock()
		defer g.commMu.RUnlock()
		if g.comm == 0 {
			return false, errStopped
		}
		async, r := g.nccl.commGetAsyncError(g.comm)
		switch {
		case r != Success:
			return false, g.ncclError("ncclCommGetAsyncError", r, g.comm)
		case async == InProgress:
			return false, nil
		case async != Success:
			return false, peerLost(g.ncclError(op, async, g.comm))
		}
		return true, nil
	})
	return g.waitEnd(ctx, op, err)
}

// waitStream waits for the group's stream to drain, checking for async
// errors, Abort and ctx between polls.
func (g *Group) waitStream(ctx context.Context, op string) error {
	err := poll(ctx, g.stopCh, g.cfg.MaxPollInterval, func() (bool, error) {
		switch code := g.cuda.streamQuery(g.dev.ctx, g.stream); code {
		case cudaSuccess:
			return true, nil
		case cudaErrorNotReady:
		default:
			return false, cudaError(g.cuda, "cuStreamQuery", code)
		}
		if err := g.checkAsync(op); err != nil {
			return false, errStopped
		}
		return false, nil
	})
	return g.waitEnd(ctx, op, err)
}

// waitEnd turns the end of a wait into the collective's result: stopped
// groups answer usable's error; a deadline or cancellation aborts the
// group (the operation is still on the device), recording a deadline as
// the async error; NCCL and CUDA errors fail the group.
func (g *Group) waitEnd(ctx context.Context, op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errStopped):
		return g.usable()
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		cerr := g.ctxError(ctx, op)
		if errors.Is(cerr, pg.ErrTimeout) {
			g.fail(cerr)
		} else {
			g.Abort(cerr)
		}
		return cerr
	}
	g.fail(fmt.Errorf("pg/nccl: rank %d: %w", g.rank, err))
	return g.usable()
}

// AllReduce reduces buf across the ranks in place.
func (g *Group) AllReduce(ctx context.Context, buf pg.Buffer, op pg.ReduceOp) error {
	b, err := g.deviceBuffer("allreduce", buf)
	if err != nil {
		return err
	}
	if !op.Valid() {
		return fmt.Errorf("%w: pg/nccl: allreduce: reduce op %v", pg.ErrInvalidArgument, op)
	}
	return g.run(ctx, "ncclAllReduce", func(c commHandle) Result {
		return g.nccl.allReduce(g.dev.ctx, b.ptr, b.ptr, b.n, b.dtype, op, c, g.stream)
	})
}

// Broadcast copies root's buf to every rank, in place.
func (g *Group) Broadcast(ctx context.Context, buf pg.Buffer, root int) error {
	b, err := g.deviceBuffer("broadcast", buf)
	if err != nil {
		return err
	}
	if err := g.checkPeer("broadcast", "root", root); err != nil {
		return err
	}
	return g.run(ctx, "ncclBroadcast", func(c commHandle) Result {
		return g.nccl.broadcast(g.dev.ctx, b.ptr, b.ptr, b.n, b.dtype, root, c, g.stream)
	})
}

// AllGather concatenates every rank's in into out, in rank order.
func (g *Group) AllGather(ctx context.Context, out, in pg.Buffer) error {
	o, i, err := g.bufferPair("allgather", out, in)
	if err != nil {
		return err
	}
	if o.n != g.size*i.n {
		return fmt.Errorf("%w: pg/nccl: allgather: out has %d elements, want size %d × in's %d", pg.ErrInvalidArgument, o.n, g.size, i.n)
	}
	return g.run(ctx, "ncclAllGather", func(c commHandle) Result {
		return g.nccl.allGather(g.dev.ctx, i.ptr, o.ptr, i.n, i.dtype, c, g.stream)
	})
}

// ReduceScatter reduces in across the ranks and leaves block r in rank r's
// out.
func (g *Group) ReduceScatter(ctx context.Context, out, in pg.Buffer, op pg.ReduceOp) error {
	o, i, err := g.bufferPair("reducescatter", out, in)
	if err != nil {
		return err
	}
	if !op.Valid() {
		return fmt.Errorf("%w: pg/nccl: reducescatter: reduce op %v", pg.ErrInvalidArgument, op)
	}
	if i.n != g.size*o.n {
		return fmt.Errorf("%w: pg/nccl: reducescatter: in has %d elements, want size %d × out's %d", pg.ErrInvalidArgument, i.n, g.size, o.n)
	}
	return g.run(ctx, "ncclReduceScatter", func(c commHandle) Result {
		return g.nccl.reduceScatter(g.dev.ctx, i.ptr, o.ptr, o.n, o.dtype, op, c, g.stream)
	})
}

// Barrier is an allreduce of one element: it returns once every rank has
// entered it.
func (g *Group) Barrier(ctx context.Context) error {
	if err := g.usable(); err != nil {
		return err
	}
	return g.run(ctx, "barrier (ncclAllReduce)", func(c commHandle) Result {
		s := g.scratch
		return g.nccl.allReduce(g.dev.ctx, s.ptr, s.ptr, 1, s.dtype, pg.Sum, c, g.stream)
	})
}

// Send sends buf to peer (ncclSend in a group of its own).
func (g *Group) Send(ctx context.Context, buf pg.Buffer, peer int) error {
	return g.p2p(ctx, "ncclSend", buf, peer, g.nccl.send)
}

// Recv receives into buf what peer sent (ncclRecv in a group of its own).
func (g *Group) Recv(ctx context.Context, buf pg.Buffer, peer int) error {
	return g.p2p(ctx, "ncclRecv", buf, peer, g.nccl.recv)
}

type p2pFunc func(ctx ctxHandle, buf devPtr, count int, dt pg.DType, peer int, c commHandle, s streamHandle) Result

func (g *Group) p2p(ctx context.Context, op string, buf pg.Buffer, peer int, call p2pFunc) error {
	b, err := g.deviceBuffer(op, buf)
	if err != nil {
		return err
	}
	if err := g.checkPeer(op, "peer", peer); err != nil {
		return err
	}
	return g.run(ctx, op, func(c commHandle) Result {
		if r := g.nccl.groupStart(); r != Success {
			return r
		}
		r := call(g.dev.ctx, b.ptr, b.n, b.dtype, peer, c, g.stream)
		end := g.nccl.groupEnd(g.dev.ctx)
		if r != Success {
			return r
		}
		return end
	})
}

func (g *Group) checkPeer(op, what string, r int) error {
	if r < 0 || r >= g.size {
		return fmt.Errorf("%w: pg/nccl: %s: %s %d out of range for size %d", pg.ErrInvalidArgument, op, what, r, g.size)
	}
	return nil
}

// deviceBuffer checks that buf is a live *DeviceBuffer on the group's
// device.
func (g *Group) deviceBuffer(op string, buf pg.Buffer) (*DeviceBuffer, error) {
	b, ok := buf.(*DeviceBuffer)
	if !ok {
		return nil, fmt.Errorf("%w: pg/nccl: %s: buffers must be *nccl.DeviceBuffer (device memory), got %T", pg.ErrInvalidArgument, op, buf)
	}
	if b.dtype.Size() == 0 {
		return nil, fmt.Errorf("%w: pg/nccl: %s: dtype %v", pg.ErrInvalidArgument, op, b.dtype)
	}
	if b.dev.ordinal != g.dev.ordinal {
		return nil, fmt.Errorf("%w: pg/nccl: %s: buffer on device %d, group on device %d", pg.ErrInvalidArgument, op, b.dev.ordinal, g.dev.ordinal)
	}
	if b.freed() {
		return nil, fmt.Errorf("%w: pg/nccl: %s: buffer was freed", pg.ErrInvalidArgument, op)
	}
	return b, nil
}

func (g *Group) bufferPair(op string, out, in pg.Buffer) (*DeviceBuffer, *DeviceBuffer, error) {
	o, err := g.deviceBuffer(op, out)
	if err != nil {
		return nil, nil, err
	}
	i, err := g.deviceBuffer(op, in)
	if err != nil {
		return nil, nil, err
	}
	if o.dtype != i.dtype {
		return nil, nil, fmt.Errorf("%w: pg/nccl: %s: out is %v, in is %v", pg.ErrInvalidArgument, op, o.dtype, i.dtype)
	}
	return o, i, nil
}

// shrinkSupported says whether the library has ncclCommShrink.
func (g *Group) shrinkSupported() error {
	if g.ver.AtLeast(VersionShrink) && g.nccl.has("ncclCommShrink") {
		return nil
	}
	return fmt.Errorf("pg/nccl: shrink needs NCCL ≥ %v (ncclCommShrink); %s is NCCL %v%s: %w",
		VersionShrink, g.nccl.path(), g.ver, missing(g.ver.AtLeast(VersionShrink)), pg.ErrNotSupported)
}

// revokeSupported says whether the library has ncclCommRevoke.
func (g *Group) revokeSupported() error {
	if g.ver.AtLeast(VersionRevoke) && g.nccl.has("ncclCommRevoke") {
		return nil
	}
	return fmt.Errorf("pg/nccl: revoke needs NCCL ≥ %v (ncclCommRevoke); %s is NCCL %v%s: %w",
		VersionRevoke, g.nccl.path(), g.ver, missing(g.ver.AtLeast(VersionRevoke)), pg.ErrNotSupported)
}

func missing(newEnough bool) string {
	if newEnough {
		return " without the entry point"
	}
	return ""
}

// Shrink returns a group of the survivors (ncclCommShrink): see
// pg.ProcessGroup. Every survivor calls it with the same exclude list. The
// arguments are checked with pg.ValidateShrink first;
// a library older than NCCL 2.27.3 gives an error wrapping
// pg.ErrNotSupported. With pg.ShrinkAbort the collectives in flight return
// at once, NCCL terminates the parent's operations, and the parent is then
// ended with ncclCommAbort (never destroyed: its peers may be gone). With
// pg.ShrinkDefault the parent must be idle; it stays healthy until Close
// destroys it. The child inherits the parent's configuration.
//
// An aborted group (Abort, the watchdog) can be shrunk with pg.ShrinkAbort,
// unless Config.FreeOnAbort had its communicator freed at once.
//
// NCCL refuses to shrink a communicator that has recorded an async error
// (a peer that died on a socket or InfiniBand connection leaves
// ncclRemoteError; seen with NCCL 2.28.9 on an H100), and only the
// survivors that were connected to the dead peer record one. So the
// survivors first agree through the store, under the shrink's namespace
// (shrinkNamespace), whether every communicator can be shrunk; if one
// cannot, every survivor aborts its parent and they form a fresh
// communicator of the same ranks instead, as New does.
func (g *Group) Shrink(ctx context.Context, exclude []int, flags pg.ShrinkFlags) (pg.ProcessGroup, error) {
	if err := pg.ValidateShrink(g.rank, g.size, exclude, flags); err != nil {
		return nil, err
	}
	if err := g.shrinkSupported(); err != nil {
		return nil, err
	}
	if g.closed.Load() {
		return nil, g.usable()
	}
	sorted := slices.Clone(exclude)
	slices.Sort(sorted)
	if flags == pg.ShrinkAbort {
		g.stop(fmt.Errorf("pg/nccl: shrunk with NCCL_SHRINK_ABORT, excluding ranks %v", sorted))
	} else if e := g.stopped.Load(); e != nil && !g.isRevoked() {
		return nil, fmt.Errorf("pg/nccl: shrink with NCCL_SHRINK_DEFAULT needs a healthy group; use pg.ShrinkAbort: %w", e)
	}
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, g.cfg.Bootstrap.OpTimeout())
	defer cancel()
	g.opMu.Lock()
	defer g.opMu.Unlock()
	g.commMu.Lock()
	defer g.commMu.Unlock()
	// No communicator (freed by Abort under Config.FreeOnAbort, or
	// forfeited to a blocking grow that did not return): this rank says it
	// cannot shrink in place, and the survivors form a fresh one.
	if g.comm != 0 && g.revoked {
		if err := g.quiesce(ctx, g.comm); err != nil {
			return nil, err
		}
	}
	rank, size := pg.Survivors(g.size, sorted)[g.rank], g.size-len(sorted)
	ns := shrinkNamespace(g.cfg.Bootstrap.Namespace, sorted)
	inPlace, err := g.agreeShrink(ctx, ns, rank, size)
	if err != nil {
		return nil, err
	}
	if !inPlace {
		g.stop(fmt.Errorf("pg/nccl: shrunk into a fresh communicator without ranks %v", sorted))
		if g.comm != 0 {
			g.nccl.commAbort(g.dev.ctx, g.comm)
			g.comm = 0
		}
		return g.shrinkAfresh(ctx, ns, rank, size)
	}
	ex := make([]int32, len(sorted))
	for i, r := range sorted {
		ex[i] = int32(r)
	}
	child, r := g.nccl.commShrink(g.dev.ctx, g.comm, ex, int(flags))
	if r == InProgress || (r == Success && g.cfg.NonBlocking) {
		err = g.settle(ctx, nil, child, "ncclCommShrink")
	} else if r != Success {
		err = peerLost(g.ncclError("ncclCommShrink", r, g.comm))
	}
	if flags == pg.ShrinkAbort || g.revoked || g.held {
		g.nccl.commAbort(g.dev.ctx, g.comm)
		g.comm = 0
	}
	if err != nil {
		if child != 0 {
			g.nccl.commAbort(g.dev.ctx, child)
		}
		return nil, err
	}
	if flags == pg.ShrinkDefault && g.comm != 0 {
		g.stop(fmt.Errorf("pg/nccl: shrunk into a new group without ranks %v", sorted))
	}
	return g.child(child, rank, size)
}

// shrinkNamespace is where the survivors of a shrink of the group under ns
// that excludes the ranks sorted meet: a group is shrunk once (its parent
// is ended), so the name is new.
func shrinkNamespace(ns string, sorted []int) string {
	parts := make([]string, len(sorted))
	for i, r := range sorted {
		parts[i] = strconv.Itoa(r)
	}
	return ns + "/shrink-" + strings.Join(parts, "-")
}

// shrinkAgreeKey is survivor rank's say under a shrink's namespace: "1"
// when its communicator can be shrunk, "0" when it cannot.
func shrinkAgreeKey(rank int) string { return "shrinkable/" + strconv.Itoa(rank) }

// agreeShrink tells the other survivors (new ranks 0 to size-1) whether
// this rank's communicator can be shrunk (it has one, with no async error
// recorded, so that ncclCommShrink's ncclCommEnsureReady takes it), and
// reports whether all of them can. The caller holds commMu.
func (g *Group) agreeShrink(ctx context.Context, ns string, rank, size int) (bool, error) {
	say := []byte("0")
	if g.comm != 0 {
		if async, r := g.nccl.commGetAsyncError(g.comm); r == Success && async == Success {
			say = []byte("1")
		}
	}
	store := rendezvous.NewPrefixStore(ns, g.cfg.Bootstrap.Store)
	if err := store.Set(ctx, shrinkAgreeKey(rank), say); err != nil {
		return false, fmt.Errorf("pg/nccl: [%d] cannot say whether it can shrink under '%s': %w", g.rank, ns, storeError(err))
	}
	keys := make([]string, size)
	for i := range keys {
		keys[i] = shrinkAgreeKey(i)
	}
	vals, err := store.MultiGet(ctx, keys...)
	if err != nil {
		return false, fmt.Errorf("pg/nccl: [%d] waiting for the other survivors under '%s': %w", g.rank, ns, storeError(err))
	}
	for _, v := range vals {
		if string(v) != "1" {
			return false, nil
		}
	}
	return true, nil
}

// shrinkAfresh forms the survivors' communicator anew under ns, rank of
// size, as New forms one.
func (g *Group) shrinkAfresh(ctx context.Context, ns string, rank, size int) (*Group, error) {
	c, err := g.derive(rank, size)
	if err != nil {
		return nil, err
	}
	c.cfg.Bootstrap.Namespace = ns
	if err := c.form(ctx, c.initFresh); err != nil {
		return nil, fmt.Errorf("pg/nccl: [%d] forming the survivors' communicator under '%s': %w", g.rank, ns, err)
	}
	return c, nil
}

func (g *Group) isRevoked() bool {
	g.commMu.RLock()
	defer g.commMu.RUnlock()
	return g.revoked
}

// child wraps a communicator made by Shrink in a Group of its own (own
// stream and watchdog, same device and configuration).
func (g *Group) child(comm commHandle, rank, size int) (*Group, error) {
	c, err := g.derive(rank, size)
	if err != nil {
		g.nccl.commAbort(g.dev.ctx, comm)
		return nil, err
	}
	c.comm = comm
	if err := c.start(); err != nil {
		c.release()
		return nil, err
	}
	return c, nil
}

// derive returns a Group for rank of size on g's device, library and
// configuration, with the device retained but no communicator yet and not
// started; release frees it.
func (g *Group) derive(rank, size int) (*Group, error) {
	dev, err := retainDevice(g.cuda, g.dev.ordinal)
	if err != nil {
		return nil, err
	}
	cfg := g.cfg
	cfg.Bootstrap.Rank, cfg.Bootstrap.Size = rank, size
	return &Group{cfg: cfg, nccl: g.nccl, cuda: g.cuda, ver: g.ver, dev: dev, rank: rank, size: size}, nil
}

// Revoke stops the communicator with ncclCommRevoke (NCCL ≥ 2.28.7): every
// operation in flight ends, the group answers every later collective with
// a *pg.AbortedError, and the communicator is kept so that the survivors
// can Shrink it. Revoke waits, within ctx, until the communicator is
// quiescent. Older libraries give an error wrapping pg.ErrNotSupported.
func (g *Group) Revoke(ctx context.Context) error {
	if err := g.revokeSupported(); err != nil {
		return err
	}
	if g.closed.Load() {
		return g.usable()
	}
	g.stop(errors.New("pg/nccl: communicator revoked"))
	ctx, cancel := rendezvous.WithDefaultTimeout(ctx, g.cfg.Bootstrap.OpTimeout())
	defer cancel()
	g.commMu.Lock()
	defer g.commMu.Unlock()
	if g.comm == 0 {
		return fmt.Errorf("pg/nccl: cannot revoke: ncclCommAbort already freed the communicator: %w", g.usable())
	}
	if !g.revoked {
		if r := g.nccl.commRevoke(g.dev.ctx, g.comm, 0); r != Success && r != InProgress {
			return g.ncclError("ncclCommRevoke", r, g.comm)
		}
		g.revoked = true
	}
	return g.quiesce(ctx, g.comm)
}

// quiesce waits until revoked communicator comm leaves ncclInProgress. Its
// async error is then whatever stopped it: a communicator revoked because
// a peer died keeps reporting ncclRemoteError (NCCL 2.28.9 on an H100 does
// so), and that is no failure of the revoke, nor a reason not to shrink it.
// The caller holds commMu.
func (g *Group) quiesce(ctx context.Context, comm commHandle) error {
	err := poll(ctx, nil, g.cfg.MaxPollInterval, func() (bool, error) {
		async, r := g.nccl.commGetAsyncError(comm)
		if r != Success {
			return false, g.ncclError("ncclCommGetAsyncError", r, comm)
		}
		return async != InProgress, nil
	})
	if err != nil && ctx.Err() != nil {
		return g.ctxError(ctx, "ncclCommRevoke")
	}
	return err
}

// Close releases the communicator, the stream and the device context. A
// healthy, idle communicator is destroyed (ncclCommDestroy); one that was
// aborted, revoked, failed or had an operation in flight is ended with
// ncclCommAbort, which never waits for peers. Close is idempotent.
func (g *Group) Close() error {
	if !g.closed.CompareAndSwap(false, true) {
		return nil
	}
	close(g.wdStop)
	<-g.wdDone
	busy := g.inFlight.Load()
	g.stop(fmt.Errorf("pg/nccl: rank %d: %w", g.rank, pg.ErrClosed))
	g.opMu.Lock()
	defer g.opMu.Unlock()
	var err error
	g.commMu.Lock()
	g.forfeit()
	if g.comm != 0 {
		// Destroy only a communicator that was never stopped and is idle:
		// ncclCommDestroy waits for peers, which may be gone.
		if g.AsyncError() == nil && !g.revoked && !g.held && !busy {
			if r := g.nccl.commDestroy(g.dev.ctx, g.comm); r != Success {
				err = g.ncclError("ncclCommDestroy", r, 0)
			}
		} else {
			g.nccl.commAbort(g.dev.ctx, g.comm)
		}
		g.comm = 0
	}
	g.commMu.Unlock()
	g.release()
	return err
}

// ncclError builds an *Error for r, with ncclGetLastError's detail when
// comm (or 0, the library's global state) has one.
func (g *Group) ncclError(op string, r Result, comm commHandle) *Error {
	return &Error{Op: op, Result: r, Text: g.nccl.errorString(r), Detail: g.nccl.lastError(comm), Version: g.ver}
}

func cudaError(cuda cudaAPI, op string, code int) *CUDAError {
	return &CUDAError{Op: op, Code: code, Text: cuda.errorString(code)}
}
