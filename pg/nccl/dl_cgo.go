//go:build cgo

package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// Declared here from nccl.h and cuda.h facts, so that building needs neither:
// ncclResult_t, CUresult, ncclDataType_t and ncclRedOp_t are int-sized C
// enums; ncclComm_t, CUcontext and CUstream are pointers; CUdeviceptr is an
// unsigned long long; CUdevice is an int.
typedef int gr_res;
typedef struct { char internal[128]; } gr_uid;

#include "gr_config.h"

static void *gr_open(const char *path, char *err, size_t n) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *e = dlerror();
		snprintf(err, n, "%s", e ? e : "unknown dlopen error");
	}
	return h;
}

static void *gr_sym(void *h, const char *name, char *err, size_t n) {
	dlerror();
	void *p = dlsym(h, name);
	if (!p) {
		const char *e = dlerror();
		snprintf(err, n, "%s", e ? e : "symbol is NULL");
	}
	return p;
}

// A context handle is a gr_dev: the driver's cuCtxSetCurrent and the
// context. Every call that touches the device makes the context current
// first, in the same C call: the Go scheduler may have moved the goroutine
// to another OS thread since the last one.
typedef struct {
	void *set_current;
	void *ctx;
} gr_dev;
static int gr_use(uintptr_t h) {
	gr_dev *d = (gr_dev *)h;
	if (!d) return 0;
	return ((int (*)(void *))d->set_current)(d->ctx);
}
static uintptr_t gr_new_dev(void *set_current, uintptr_t ctx) {
	gr_dev *d = malloc(sizeof *d);
	if (!d) return 0;
	d->set_current = set_current;
	d->ctx = (void *)ctx;
	return (uintptr_t)d;
}
#define GR_USE(ctx) do { if (gr_use(ctx) != 0) return 1; } while (0) // ncclUnhandledCudaError

// NCCL.
static gr_res gr_getVersion(void *f, int *v) { return ((gr_res (*)(int *))f)(v); }
static gr_res gr_getUniqueId(void *f, gr_uid *id) { return ((gr_res (*)(gr_uid *))f)(id); }
static const char *gr_errorString(void *f, int r) { return ((const char *(*)(int))f)(r); }
static const char *gr_lastError(void *f, uintptr_t c) { return ((const char *(*)(void *))f)((void *)c); }
static gr_res gr_initRank(void *f, uintptr_t ctx, uintptr_t *out, int n, gr_uid *id, int rank) {
	GR_USE(ctx);
	void *c = NULL;
	gr_res r = ((gr_res (*)(void **, int, gr_uid, int))f)(&c, n, *id, rank);
	*out = (uintptr_t)c;
	return r;
}
// gr_make_config is the ncclConfig_t pg/nccl passes: blocking set, every
// other field NCCL_CONFIG_UNDEF_INT (INT_MIN) or NULL, NCCL's defaults.
static gr_config gr_make_config(int blocking) {
	gr_config cfg = {sizeof(gr_config), GR_CONFIG_MAGIC, GR_CONFIG_VERSION, blocking, INT_MIN, INT_MIN, INT_MIN, NULL};
	return cfg;
}
static gr_res gr_initRankConfig(void *f, uintptr_t ctx, uintptr_t *out, int n, gr_uid *id, int rank, int blocking) {
	GR_USE(ctx);
	gr_config cfg = gr_make_config(blocking);
	void *c = NULL;
	gr_res r = ((gr_res (*)(void **, int, gr_uid, int, gr_config *))f)(&c, n, *id, rank, &cfg);
	*out = (uintptr_t)c;
	return r;
}
static gr_res gr_asyncError(void *f, uintptr_t c, int *e) { return ((gr_res (*)(void *, int *))f)((void *)c, e); }
static gr_res gr_commCall(void *f, uintptr_t ctx, uintptr_t c) {
	GR_USE(ctx);
	return ((gr_res (*)(void *))f)((void *)c);
}
// A child slot is where ncclCommShrink and ncclCommGrow store the new
// communicator: C memory, never the caller's stack, since a non-blocking
// call stores into it again from NCCL's own thread after it has returned
// (see childSlots).
static void **gr_slot_new(void) { return (void **)calloc(1, sizeof(void *)); }
static uintptr_t gr_slot_load(void **slot) { return (uintptr_t)__atomic_load_n(slot, __ATOMIC_ACQUIRE); }
static gr_res gr_shrink(void *f, uintptr_t ctx, uintptr_t c, int *ex, int n, void **slot, int flags) {
	GR_USE(ctx);
	return ((gr_res (*)(void *, int *, int, void **, void *, int))f)((void *)c, ex, n, slot, NULL, flags);
}
// ncclCommGetUniqueId(ncclComm_t, ncclUniqueId *).
static gr_res gr_commGetUniqueId(void *f, uintptr_t ctx, uintptr_t c, gr_uid *id) {
	GR_USE(ctx);
	return ((gr_res (*)(void *, gr_uid *))f)((void *)c, id);
}
// ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId,
// int rank, ncclComm_t *newcomm, ncclConfig_t *config); comm and uniqueId
// may be NULL (0 and NULL from Go), config is NULL unless with_config.
static gr_res gr_grow(void *f, uintptr_t ctx, uintptr_t c, int n, const gr_uid *id, int rank, void **slot, int with_config, int blocking) {
	GR_USE(ctx);
	gr_config cfg = gr_make_config(blocking);
	return ((gr_res (*)(void *, int, const gr_uid *, int, void **, gr_config *))f)((void *)c, n, id, rank, slot, with_config ? &cfg : NULL);
}
static gr_res gr_revoke(void *f, uintptr_t ctx, uintptr_t c, int flags) {
	GR_USE(ctx);
	return ((gr_res (*)(void *, int))f)((void *)c, flags);
}
static gr_res gr_groupStart(void *f) { return ((gr_res (*)(void))f)(); }
static gr_res gr_groupEnd(void *f, uintptr_t ctx) {
	GR_USE(ctx);
	return ((gr_res (*)(void))f)();
}
static gr_res gr_allReduce(void *f, uintptr_t ctx, uintptr_t s, uintptr_t r, size_t n, int dt, int op, uintptr_t c, uintptr_t st) {
	GR_USE(ctx);
	return ((gr_res (*)(const void *, void *, size_t, int, int, void *, void *))f)((const void *)s, (void *)r, n, dt, op, (void *)c, (void *)st);
}
static gr_res gr_broadcast(void *f, uintptr_t ctx, uintptr_t s, uintptr_t r, size_t n, int dt, int root, uintptr_t c, uintptr_t st) {
	GR_USE(ctx);
	return ((gr_res (*)(const void *, void *, size_t, int, int, void *, void *))f)((const void *)s, (void *)r, n, dt, root, (void *)c, (void *)st);
}
static gr_res gr_allGather(void *f, uintptr_t ctx, uintptr_t s, uintptr_t r, size_t n, int dt, uintptr_t c, uintptr_t st) {
	GR_USE(ctx);
	return ((gr_res (*)(const void *, void *, size_t, int, void *, void *))f)((const void *)s, (void *)r, n, dt, (void *)c, (void *)st);
}
// ncclReduceScatter has ncclAllReduce's signature (count is recvcount).
#define gr_reduceScatter gr_allReduce
// ncclSend(const void*, ...) and ncclRecv(void*, ...) share a layout.
static gr_res gr_p2p(void *f, uintptr_t ctx, uintptr_t b, size_t n, int dt, int peer, uintptr_t c, uintptr_t st) {
	GR_USE(ctx);
	return ((gr_res (*)(void *, size_t, int, int, void *, void *))f)((void *)b, n, dt, peer, (void *)c, (void *)st);
}

// CUDA driver.
static int gr_cuInit(void *f) { return ((int (*)(unsigned int))f)(0); }
static int gr_cuCount(void *f, int *n) { return ((int (*)(int *))f)(n); }
static int gr_cuRetain(void *get, void *retain, int ordinal, uintptr_t *out) {
	int dev = 0;
	int r = ((int (*)(int *, int))get)(&dev, ordinal);
	if (r != 0) return r;
	void *ctx = NULL;
	r = ((int (*)(void **, int))retain)(&ctx, dev);
	*out = (uintptr_t)ctx;
	return r;
}
static int gr_cuRelease(void *get, void *release, int ordinal) {
	int dev = 0;
	int r = ((int (*)(int *, int))get)(&dev, ordinal);
	if (r != 0) return r;
	return ((int (*)(int))release)(dev);
}
static int gr_cuMemAlloc(void *f, uintptr_t ctx, uintptr_t *p, size_t n) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	unsigned long long d = 0;
	int r = ((int (*)(unsigned long long *, size_t))f)(&d, n);
	*p = (uintptr_t)d;
	return r;
}
static int gr_cuMemFree(void *f, uintptr_t ctx, uintptr_t p) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	return ((int (*)(unsigned long long))f)((unsigned long long)p);
}
static int gr_cuHtoD(void *f, uintptr_t ctx, uintptr_t dst, const void *src, size_t n) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	return ((int (*)(unsigned long long, const void *, size_t))f)((unsigned long long)dst, src, n);
}
static int gr_cuDtoH(void *f, uintptr_t ctx, void *dst, uintptr_t src, size_t n) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	return ((int (*)(void *, unsigned long long, size_t))f)(dst, (unsigned long long)src, n);
}
static int gr_cuStreamCreate(void *f, uintptr_t ctx, uintptr_t *s) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	void *st = NULL;
	int r = ((int (*)(void **, unsigned int))f)(&st, 0);
	*s = (uintptr_t)st;
	return r;
}
static int gr_cuStreamCall(void *f, uintptr_t ctx, uintptr_t s) {
	int cr = gr_use(ctx);
	if (cr != 0) return cr;
	return ((int (*)(void *))f)((void *)s);
}
static const char *gr_cuErrorString(void *f, int code) {
	const char *s = NULL;
	if (!f || ((int (*)(int, const char **))f)(code, &s) != 0) return NULL;
	return s;
}
*/
import "C"

import (
	"strings"
	"sync"
	"unsafe"

	"github.com/gorunhq/gorun/pg"
)

// dlLibrary is one dlopened library and the entry points looked up in it.
type dlLibrary struct {
	name string
	h    unsafe.Pointer
}

func dlOpen(name string) (*dlLibrary, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var buf [512]C.char
	h := C.gr_open(cname, &buf[0], C.size_t(len(buf)))
	if h == nil {
		return nil, &LoadError{Library: name, Msg: C.GoString(&buf[0])}
	}
	return &dlLibrary{name: name, h: h}, nil
}

// sym looks up name, or returns nil and the reason.
func (l *dlLibrary) sym(name string) (unsafe.Pointer, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var buf [512]C.char
	p := C.gr_sym(l.h, cname, &buf[0], C.size_t(len(buf)))
	if p == nil {
		return nil, &LoadError{Library: l.name, Symbol: name, Msg: C.GoString(&buf[0])}
	}
	return p, nil
}

// entry is an entry point to look up: names are alternatives ("a|b",
// tried in order); optional ones are left nil when missing.
type entry struct {
	names    string
	dst      *unsafe.Pointer
	optional bool
}

// resolve looks every entry up, in order; a missing required one is the
// error.
func (l *dlLibrary) resolve(entries []entry) error {
	for _, e := range entries {
		p, err := l.first(e.names)
		if err != nil && !e.optional {
			return err
		}
		*e.dst = p
	}
	return nil
}

// first returns the first of names ("a|b") that the library has.
func (l *dlLibrary) first(names string) (unsafe.Pointer, error) {
	var firstErr error
	for _, n := range strings.Split(names, "|") {
		p, err := l.sym(n)
		if err == nil {
			return p, nil
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	return nil, firstErr
}

// Loaded libraries are kept for the life of the process (dlclose of NCCL or
// of the driver is never safe while anything may still use them), one per
// name.
var (
	loadMu     sync.Mutex
	loadedNCCL = map[string]*dlNCCL{}
	loadedCUDA = map[string]*dlCUDA{}
)

// dlNCCL is libnccl.so.2 opened with dlopen.
type dlNCCL struct {
	lib *dlLibrary
	f   ncclFuncs

	childMu sync.Mutex
	// childSlots are the slots of non-blocking shrinks and grows whose
	// communicators are still in progress, by communicator. NCCL stores a
	// new communicator into the caller's slot twice: before the call
	// returns, and again from its own thread when the communicator's init
	// completes (init.cc, the async job's end: *job->newcomm = comm), long
	// after a non-blocking call has returned. A slot on the calling
	// thread's stack was overwritten there on an H200 with NCCL 2.29.7 and
	// brought the Go scheduler down (that thread's system stack), so each
	// slot is C memory, freed only once the second store is done: when
	// ncclCommGetAsyncError says the communicator is no longer in progress
	// (NCCL sets that after its init jobs have ended) or ncclCommAbort or
	// ncclCommDestroy has returned (they join the init first).
	childSlots map[commHandle]*unsafe.Pointer

	// asyncMu serializes ncclCommGetAsyncError, which is not safe on one
	// communicator from two threads at once: the call that first sees a
	// non-blocking operation's group job done joins its thread and frees
	// it (init.cc: ncclGroupJobComplete, then comm->groupJob = NULL,
	// unguarded), and a second call in between completes the freed job
	// again — a second pthread_join that corrupts glibc's cache of thread
	// stacks. pg/nccl polls a communicator from its watchdog and from the
	// operation waiting on it at once; PyTorch makes the same calls under
	// its NCCLComm's mutex. The call is a few atomic loads (and, once per
	// operation, the join of a thread that has ended), so one lock for the
	// library costs nothing measurable.
	asyncMu sync.Mutex
}

// child reads the communicator a shrink or grow that returned r stored in
// slot, and frees slot unless NCCL may still store into it (r is
// ncclInProgress): then it is kept in childSlots until releaseChild.
func (n *dlNCCL) child(slot *unsafe.Pointer, r Result) commHandle {
	c := commHandle(C.gr_slot_load(slot))
	if r == InProgress && c != 0 {
		n.childMu.Lock()
		if n.childSlots == nil {
			n.childSlots = map[commHandle]*unsafe.Pointer{}
		}
		n.childSlots[c] = slot
		n.childMu.Unlock()
		return c
	}
	C.free(unsafe.Pointer(slot))
	return c
}

// releaseChild frees c's child slot, if it has one: NCCL is done with it.
func (n *dlNCCL) releaseChild(c commHandle) {
	n.childMu.Lock()
	slot, ok := n.childSlots[c]
	delete(n.childSlots, c)
	n.childMu.Unlock()
	if ok {
		C.free(unsafe.Pointer(slot))
	}
}

// pendingChildren is how many child slots NCCL may still store into.
func (n *dlNCCL) pendingChildren() int {
	n.childMu.Lock()
	defer n.childMu.Unlock()
	return len(n.childSlots)
}

// ncclFuncs are the entry points of NCCL that pg/nccl calls or probes.
type ncclFuncs struct {
	getVersion, getUniqueID, errorString, lastError                            unsafe.Pointer
	initRank, initRankConfig, asyncError, abort, destroy, shrink, revoke, grow unsafe.Pointer
	groupStart, groupEnd, allReduce, broadcast, allGather, reduceScatter, send unsafe.Pointer
	recv, commGetUniqueID                                                      unsafe.Pointer
}

// ncclEntries is the symbol table: every entry point pg/nccl looks up in
// NCCL, where each goes, and which may be missing (older libraries).
func ncclEntries(f *ncclFuncs) []entry {
	return []entry{
		{"ncclGetVersion", &f.getVersion, false},
		{"ncclGetUniqueId", &f.getUniqueID, false},
		{"ncclGetErrorString", &f.errorString, false},
		{"ncclCommInitRank", &f.initRank, false},
		{"ncclCommGetAsyncError", &f.asyncError, false},
		{"ncclCommAbort", &f.abort, false},
		{"ncclCommDestroy", &f.destroy, false},
		{"ncclGroupStart", &f.groupStart, false},
		{"ncclGroupEnd", &f.groupEnd, false},
		{"ncclAllReduce", &f.allReduce, false},
		{"ncclBroadcast", &f.broadcast, false},
		{"ncclAllGather", &f.allGather, false},
		{"ncclReduceScatter", &f.reduceScatter, false},
		{"ncclSend", &f.send, false},
		{"ncclRecv", &f.recv, false},

		{"ncclCommInitRankConfig", &f.initRankConfig, true},
		{"ncclGetLastError", &f.lastError, true},
		{"ncclCommShrink", &f.shrink, true},
		{"ncclCommRevoke", &f.revoke, true},
		// Grow takes both (NCCL ≥ 2.29); without them it falls back to a
		// fresh communicator (see Group.Grow).
		{"ncclCommGrow", &f.grow, true},
		{"ncclCommGetUniqueId", &f.commGetUniqueID, true},
	}
}

// load returns cache[name], or opens name, has bind look its entry points
// up, and caches the result.
func load[T any](cache map[string]T, name string, bind func(*dlLibrary) (T, error)) (T, error) {
	loadMu.Lock()
	defer loadMu.Unlock()
	if l, ok := cache[name]; ok {
		return l, nil
	}
	var zero T
	lib, err := dlOpen(name)
	if err != nil {
		return zero, err
	}
	l, err := bind(lib)
	if err != nil {
		return zero, err
	}
	cache[name] = l
	return l, nil
}

// probeSymbols opens name and reports, for every entry of the symbol
// table, whether the library has it (required ones included: a library
// missing one cannot be bound, but the probe still counts).
func probeSymbols(name string) ([]probedSymbol, error) {
	lib, err := dlOpen(name)
	if err != nil {
		return nil, err
	}
	var f ncclFuncs
	var out []probedSymbol
	for _, e := range ncclEntries(&f) {
		_, err := lib.first(e.names)
		out = append(out, probedSymbol{Name: e.names, Optional: e.optional, Found: err == nil})
	}
	return out, nil
}

func openNCCL(name string) (ncclAPI, error) {
	return load(loadedNCCL, name, bindNCCL)
}

func bindNCCL(lib *dlLibrary) (*dlNCCL, error) {
	n := &dlNCCL{lib: lib}
	f := &n.f
	err := lib.resolve(ncclEntries(f))
	if err != nil {
		return nil, err
	}
	return n, nil
}

func (n *dlNCCL) path() string { return n.lib.name }

func (n *dlNCCL) has(symbol string) bool {
	switch symbol {
	case "ncclCommInitRankConfig":
		return n.f.initRankConfig != nil
	case "ncclGetLastError":
		return n.f.lastError != nil
	case "ncclCommShrink":
		return n.f.shrink != nil
	case "ncclCommRevoke":
		return n.f.revoke != nil
	case "ncclCommGrow":
		return n.f.grow != nil
	case "ncclCommGetUniqueId":
		return n.f.commGetUniqueID != nil
	}
	return false
}

func (n *dlNCCL) getVersion() (int, Result) {
	var v C.int
	r := C.gr_getVersion(n.f.getVersion, &v)
	return int(v), Result(r)
}

func (n *dlNCCL) getUniqueID() (uniqueID, Result) {
	var id C.gr_uid
	r := C.gr_getUniqueId(n.f.getUniqueID, &id)
	var out uniqueID
	copy(out[:], C.GoBytes(unsafe.Pointer(&id), uniqueIDBytes))
	return out, Result(r)
}

func (n *dlNCCL) errorString(r Result) string {
	if s := C.gr_errorString(n.f.errorString, C.int(r)); s != nil {
		return C.GoString(s)
	}
	return ""
}

func (n *dlNCCL) lastError(c commHandle) string {
	if n.f.lastError == nil {
		return ""
	}
	if s := C.gr_lastError(n.f.lastError, C.uintptr_t(c)); s != nil {
		return C.GoString(s)
	}
	return ""
}

func cUID(id uniqueID) C.gr_uid {
	var u C.gr_uid
	for i, b := range id {
		u.internal[i] = C.char(b)
	}
	return u
}

func (n *dlNCCL) commInitRank(ctx ctxHandle, nranks, rank int, id uniqueID) (commHandle, Result) {
	u := cUID(id)
	var c C.uintptr_t
	r := C.gr_initRank(n.f.initRank, C.uintptr_t(ctx), &c, C.int(nranks), &u, C.int(rank))
	return commHandle(c), Result(r)
}

func (n *dlNCCL) commInitRankConfig(ctx ctxHandle, nranks, rank int, id uniqueID, blocking bool) (commHandle, Result) {
	if n.f.initRankConfig == nil {
		return 0, InvalidUsage
	}
	u := cUID(id)
	var c C.uintptr_t
	b := C.int(0)
	if blocking {
		b = 1
	}
	r := C.gr_initRankConfig(n.f.initRankConfig, C.uintptr_t(ctx), &c, C.int(nranks), &u, C.int(rank), b)
	return commHandle(c), Result(r)
}

func (n *dlNCCL) commGetAsyncError(c commHandle) (Result, Result) {
	var e C.int
	n.asyncMu.Lock()
	r := C.gr_asyncError(n.f.asyncError, C.uintptr_t(c), &e)
	n.asyncMu.Unlock()
	if Result(r) == Success && Result(e) != InProgress {
		n.releaseChild(c)
	}
	return Result(e), Result(r)
}

func (n *dlNCCL) commAbort(ctx ctxHandle, c commHandle) Result {
	r := Result(C.gr_commCall(n.f.abort, C.uintptr_t(ctx), C.uintptr_t(c)))
	// ncclUnhandledCudaError may mean the context could not be made
	// current and NCCL was never called (GR_USE): then the slot is kept
	// (8 bytes), as NCCL may still store into it.
	if r != UnhandledCudaError {
		n.releaseChild(c)
	}
	return r
}

func (n *dlNCCL) commDestroy(ctx ctxHandle, c commHandle) Result {
	r := Result(C.gr_commCall(n.f.destroy, C.uintptr_t(ctx), C.uintptr_t(c)))
	if r != UnhandledCudaError {
		n.releaseChild(c)
	}
	return r
}

func (n *dlNCCL) commShrink(ctx ctxHandle, c commHandle, exclude []int32, flags int) (commHandle, Result) {
	if n.f.shrink == nil || len(exclude) == 0 {
		return 0, InvalidUsage
	}
	ex := (*C.int)(unsafe.Pointer(&exclude[0]))
	slot := C.gr_slot_new()
	if slot == nil {
		return 0, SystemError
	}
	r := Result(C.gr_shrink(n.f.shrink, C.uintptr_t(ctx), C.uintptr_t(c), ex, C.int(len(exclude)), slot, C.int(flags)))
	return n.child(slot, r), r
}

func (n *dlNCCL) commRevoke(ctx ctxHandle, c commHandle, flags int) Result {
	if n.f.revoke == nil {
		return InvalidUsage
	}
	return Result(C.gr_revoke(n.f.revoke, C.uintptr_t(ctx), C.uintptr_t(c), C.int(flags)))
}

func (n *dlNCCL) commGetUniqueID(ctx ctxHandle, c commHandle) (uniqueID, Result) {
	var out uniqueID
	if n.f.commGetUniqueID == nil {
		return out, InvalidUsage
	}
	var id C.gr_uid
	r := C.gr_commGetUniqueId(n.f.commGetUniqueID, C.uintptr_t(ctx), C.uintptr_t(c), &id)
	copy(out[:], C.GoBytes(unsafe.Pointer(&id), uniqueIDBytes))
	return out, Result(r)
}

func (n *dlNCCL) commGrow(ctx ctxHandle, parent commHandle, nranks int, id *uniqueID, rank int, cfg *commConfig) (commHandle, Result) {
	if n.f.grow == nil {
		return 0, InvalidUsage
	}
	// The id is passed for the call only (a Go pointer, which C may not
	// keep): the library reads it while it starts the grow, as it takes
	// ncclCommInitRank's id by value.
	var u *C.gr_uid
	if id != nil {
		cu := cUID(*id)
		u = &cu
	}
	withConfig, blocking := C.int(0), C.int(0)
	if cfg != nil {
		withConfig = 1
		if cfg.blocking {
			blocking = 1
		}
	}
	slot := C.gr_slot_new()
	if slot == nil {
		return 0, SystemError
	}
	r := Result(C.gr_grow(n.f.grow, C.uintptr_t(ctx), C.uintptr_t(parent), C.int(nranks), u, C.int(rank), slot, withConfig, blocking))
	return n.child(slot, r), r
}

func (n *dlNCCL) groupStart() Result { return Result(C.gr_groupStart(n.f.groupStart)) }

func (n *dlNCCL) groupEnd(ctx ctxHandle) Result {
	return Result(C.gr_groupEnd(n.f.groupEnd, C.uintptr_t(ctx)))
}

func (n *dlNCCL) allReduce(ctx ctxHandle, send, recv devPtr, count int, dt pg.DType, op pg.ReduceOp, c commHandle, s streamHandle) Result {
	return Result(C.gr_allReduce(n.f.allReduce, C.uintptr_t(ctx), C.uintptr_t(send), C.uintptr_t(recv),
		C.size_t(count), C.int(dt), C.int(op), C.uintptr_t(c), C.uintptr_t(s)))
}

func (n *dlNCCL) broadcast(ctx ctxHandle, send, recv devPtr, count int, dt pg.DType, root int, c commHandle, s streamHandle) Result {
	return Result(C.gr_broadcast(n.f.broadcast, C.uintptr_t(ctx), C.uintptr_t(send), C.uintptr_t(recv),
		C.size_t(count), C.int(dt), C.int(root), C.uintptr_t(c), C.uintptr_t(s)))
}

func (n *dlNCCL) allGather(ctx ctxHandle, send, recv devPtr, sendCount int, dt pg.DType, c commHandle, s streamHandle) Result {
	return Result(C.gr_allGather(n.f.allGather, C.uintptr_t(ctx), C.uintptr_t(send), C.uintptr_t(recv),
		C.size_t(sendCount), C.int(dt), C.uintptr_t(c), C.uintptr_t(s)))
}

func (n *dlNCCL) reduceScatter(ctx ctxHandle, send, recv devPtr, recvCount int, dt pg.DType, op pg.ReduceOp, c commHandle, s streamHandle) Result {
	return Result(C.gr_reduceScatter(n.f.reduceScatter, C.uintptr_t(ctx), C.uintptr_t(send), C.uintptr_t(recv),
		C.size_t(recvCount), C.int(dt), C.int(op), C.uintptr_t(c), C.uintptr_t(s)))
}

func (n *dlNCCL) send(ctx ctxHandle, buf devPtr, count int, dt pg.DType, peer int, c commHandle, s streamHandle) Result {
	return Result(C.gr_p2p(n.f.send, C.uintptr_t(ctx), C.uintptr_t(buf), C.size_t(count), C.int(dt), C.int(peer),
		C.uintptr_t(c), C.uintptr_t(s)))
}

func (n *dlNCCL) recv(ctx ctxHandle, buf devPtr, count int, dt pg.DType, peer int, c commHandle, s streamHandle) Result {
	return Result(C.gr_p2p(n.f.recv, C.uintptr_t(ctx), C.uintptr_t(buf), C.size_t(count), C.int(dt), C.int(peer),
		C.uintptr_t(c), C.uintptr_t(s)))
}

// dlCUDA is the CUDA driver (libcuda.so.1) opened with dlopen.
type dlCUDA struct {
	lib *dlLibrary
	// devs holds one context handle (a C gr_dev) per device ordinal, made
	// on the first retain and kept: the primary context of a device is the
	// same for the life of the process.
	devsMu sync.Mutex
	devs   map[int]ctxHandle
	f      struct {
		init, deviceCount, deviceGet, retain, release, setCurrent, errorString  unsafe.Pointer
		memAlloc, memFree, htod, dtoh, streamCreate, streamQuery, streamDestroy unsafe.Pointer
	}
}

func openCUDA(name string) (cudaAPI, error) {
	return load(loadedCUDA, name, bindCUDA)
}

func bindCUDA(lib *dlLibrary) (*dlCUDA, error) {
	d := &dlCUDA{lib: lib, devs: map[int]ctxHandle{}}
	f := &d.f
	err := lib.resolve([]entry{
		{"cuInit", &f.init, false},
		{"cuDeviceGetCount", &f.deviceCount, false},
		{"cuDeviceGet", &f.deviceGet, false},
		{"cuDevicePrimaryCtxRetain", &f.retain, false},
		{"cuDevicePrimaryCtxRelease_v2|cuDevicePrimaryCtxRelease", &f.release, false},
		{"cuCtxSetCurrent", &f.setCurrent, false},
		{"cuMemAlloc_v2", &f.memAlloc, false},
		{"cuMemFree_v2", &f.memFree, false},
		{"cuMemcpyHtoD_v2", &f.htod, false},
		{"cuMemcpyDtoH_v2", &f.dtoh, false},
		{"cuStreamCreate", &f.streamCreate, false},
		{"cuStreamQuery", &f.streamQuery, false},
		{"cuStreamDestroy_v2|cuStreamDestroy", &f.streamDestroy, false},

		{"cuGetErrorString", &f.errorString, true},
	})
	if err != nil {
		return nil, err
	}
	return d, nil
}

func (d *dlCUDA) path() string { return d.lib.name }

func (d *dlCUDA) errorString(code int) string {
	if s := C.gr_cuErrorString(d.f.errorString, C.int(code)); s != nil {
		return C.GoString(s)
	}
	return ""
}

func (d *dlCUDA) initDriver() int { return int(C.gr_cuInit(d.f.init)) }

func (d *dlCUDA) deviceCount() (int, int) {
	var n C.int
	r := C.gr_cuCount(d.f.deviceCount, &n)
	return int(n), int(r)
}

func (d *dlCUDA) primaryCtxRetain(ordinal int) (ctxHandle, int) {
	var c C.uintptr_t
	if r := C.gr_cuRetain(d.f.deviceGet, d.f.retain, C.int(ordinal), &c); r != 0 {
		return 0, int(r)
	}
	d.devsMu.Lock()
	defer d.devsMu.Unlock()
	if h, ok := d.devs[ordinal]; ok {
		return h, cudaSuccess
	}
	h := ctxHandle(C.gr_new_dev(d.f.setCurrent, c))
	if h == 0 {
		C.gr_cuRelease(d.f.deviceGet, d.f.release, C.int(ordinal))
		return 0, 2 // CUDA_ERROR_OUT_OF_MEMORY
	}
	d.devs[ordinal] = h
	return h, cudaSuccess
}

func (d *dlCUDA) primaryCtxRelease(ordinal int) int {
	return int(C.gr_cuRelease(d.f.deviceGet, d.f.release, C.int(ordinal)))
}

func (d *dlCUDA) memAlloc(ctx ctxHandle, bytes int) (devPtr, int) {
	var p C.uintptr_t
	r := C.gr_cuMemAlloc(d.f.memAlloc, C.uintptr_t(ctx), &p, C.size_t(bytes))
	return devPtr(p), int(r)
}

func (d *dlCUDA) memFree(ctx ctxHandle, p devPtr) int {
	return int(C.gr_cuMemFree(d.f.memFree, C.uintptr_t(ctx), C.uintptr_t(p)))
}

func (d *dlCUDA) memcpyHtoD(ctx ctxHandle, dst devPtr, src []byte) int {
	if len(src) == 0 {
		return cudaSuccess
	}
	return int(C.gr_cuHtoD(d.f.htod, C.uintptr_t(ctx), C.uintptr_t(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (d *dlCUDA) memcpyDtoH(ctx ctxHandle, dst []byte, src devPtr) int {
	if len(dst) == 0 {
		return cudaSuccess
	}
	return int(C.gr_cuDtoH(d.f.dtoh, C.uintptr_t(ctx), unsafe.Pointer(&dst[0]), C.uintptr_t(src), C.size_t(len(dst))))
}

func (d *dlCUDA) streamCreate(ctx ctxHandle) (streamHandle, int) {
	var s C.uintptr_t
	r := C.gr_cuStreamCreate(d.f.streamCreate, C.uintptr_t(ctx), &s)
	return streamHandle(s), int(r)
}

func (d *dlCUDA) streamQuery(ctx ctxHandle, s streamHandle) int {
	return int(C.gr_cuStreamCall(d.f.streamQuery, C.uintptr_t(ctx), C.uintptr_t(s)))
}

func (d *dlCUDA) streamDestroy(ctx ctxHandle, s streamHandle) int {
	return int(C.gr_cuStreamCall(d.f.streamDestroy, C.uintptr_t(ctx), C.uintptr_t(s)))
}
