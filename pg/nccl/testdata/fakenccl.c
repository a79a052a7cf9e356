// fakenccl.c is a TEST DOUBLE for pg/nccl's tests. It is not NCCL and not
// the CUDA driver: it exports the entry points pg/nccl looks up in
// libnccl.so.2 and libcuda.so.1 (same names, same C signatures) with
// single-process behaviour, so that the package's logic runs on machines
// without a GPU.
//
// Behaviour:
//   - "device memory" is host memory (malloc); copies are memcpy;
//   - every collective acts as if the world had one rank: allreduce,
//     broadcast, allgather and reducescatter copy send to recv; a send is
//     kept until the matching recv of the same group copies it;
//   - a communicator records nranks and rank; init, abort, destroy, shrink,
//     revoke, grow and the ids append a line to the log file ($FAKENCCL_LOG)
//     so that tests can check what was called with which arguments;
//   - ncclCommGrow checks its arguments the way nccl.h documents them (a
//     member: its communicator, rank -1, the id only from the root; a
//     newcomer: no communicator, the id, its rank) and makes the grown
//     communicator at once, without waiting for the other ranks; like NCCL,
//     a communicator refuses a second ncclCommGetUniqueId while its last id
//     is not consumed by a grow;
//   - a non-blocking shrink or grow that returns ncclInProgress stores the
//     new communicator into the caller's newcomm again when it completes
//     (the poll of ncclCommGetAsyncError that ends it, or its abort or
//     destroy), after the call has returned, as NCCL's init job does; so,
//     like NCCL, it needs newcomm to outlive the call, and it refuses one
//     on the calling thread's stack (ncclInvalidUsage, logged), where that
//     store would land in whatever frame is there by then;
//   - work "completes" at enqueue, unless the control file says hang=1.
//
// Injection: $FAKENCCL_CONTROL names a file of key=value lines, read on
// every call that consults it, so a test can change behaviour while a group
// runs:
//   version=N       ncclGetVersion's code (else $FAKENCCL_VERSION, else 22807)
//   devices=N       devices the "driver" sees (default 1); -1: cuInit fails
//                   with CUDA_ERROR_NO_DEVICE
//   async_error=N   ncclCommGetAsyncError reports N
//   async_error_nranks=N  only communicators of N ranks report it
//   hang=1          cuStreamQuery says CUDA_ERROR_NOT_READY: work never ends
//   init_polls=N    a non-blocking init stays ncclInProgress for N polls
//                   (-1: for ever)
//   shrink_polls=N  likewise for a non-blocking shrink's child
//   init_error=N    ncclCommInitRank* returns N
//   init_block=1    a blocking init does not return while this holds, as
//                   NCCL's waits for a rank that never comes
//   grow_polls=N    likewise for a non-blocking grow's new communicator
//   grow_error=N    ncclCommGrow returns N
//   grow_block=1    a blocking ncclCommGrow does not return while this
//                   holds (after its log line), as NCCL's waits for a
//                   newcomer that never joins
//   async_error_us=N  ncclCommGetAsyncError takes N µs (a wider window
//                   for the check of concurrent calls on one communicator,
//                   which it logs)
//
// Built with -DFAKENCCL_OLD it lacks the entry points of newer libraries
// (ncclCommInitRankConfig, ncclGetLastError, ncclCommShrink,
// ncclCommRevoke, ncclCommGrow, ncclCommGetUniqueId), like an old NCCL;
// with -DFAKENCCL_NO_GROW it lacks only ncclCommGrow and
// ncclCommGetUniqueId.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { char internal[128]; } fake_uid;

typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
} fake_config_head;

typedef struct fake_comm_s {
	int nranks, rank, blocking;
	int polls;   // ncclInProgress polls left; -1: for ever
	int grow_id; // an ncclCommGetUniqueId id not yet consumed by a grow
	// where a non-blocking shrink or grow in progress stores this
	// communicator again when it completes (NCCL's *job->newcomm)
	struct fake_comm_s **late_store;
	int in_async_error; // ncclCommGetAsyncError calls under way
} fake_comm;

static long ctl(const char *key, long def) {
	const char *path = getenv("FAKENCCL_CONTROL");
	if (!path) return def;
	FILE *f = fopen(path, "r");
	if (!f) return def;
	char line[256];
	size_t klen = strlen(key);
	long v = def;
	while (fgets(line, sizeof line, f)) {
		if (strncmp(line, key, klen) == 0 && line[klen] == '=') v = strtol(line + klen + 1, NULL, 10);
	}
	fclose(f);
	return v;
}

static void logline(const char *fmt, ...) {
	const char *path = getenv("FAKENCCL_LOG");
	if (!path) return;
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
	va_end(ap);
	if (n < 0) return;
	if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
	buf[n++] = '\n';
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
	if (fd < 0) return;
	ssize_t w = write(fd, buf, n); // one write: lines of concurrent callers do not mix
	(void)w;
	close(fd);
}

// on_caller_stack: whether p lies on the calling thread's stack.
static int on_caller_stack(const void *p) {
	pthread_attr_t attr;
	void *lo;
	size_t size;
	if (pthread_getattr_np(pthread_self(), &attr) != 0) return 0;
	int r = pthread_attr_getstack(&attr, &lo, &size) == 0 && (const char *)p >= (const char *)lo &&
	        (const char *)p < (const char *)lo + size;
	pthread_attr_destroy(&attr);
	return r;
}

// defer_store arranges a non-blocking shrink's or grow's later store of c
// into out; it fails (ncclInvalidUsage) when out is on the caller's stack.
static int defer_store(fake_comm *c, fake_comm **out, const char *fn) {
	if (on_caller_stack(out)) {
		logline("%s newcomm on the caller's stack: refused (stored again when the communicator completes)", fn);
		return 0;
	}
	c->late_store = out;
	return 1;
}

// late_store is NCCL's store at the end of a shrink's or grow's init.
static void late_store(fake_comm *c) {
	if (c->late_store) {
		__atomic_store_n(c->late_store, c, __ATOMIC_RELEASE);
		c->late_store = NULL;
	}
}

static void hex(const fake_uid *id, char out[257]) {
	for (int i = 0; i < 128; i++) sprintf(out + 2 * i, "%02x", (unsigned char)id->internal[i]);
}

// A thread-local "current context", so that calls made without one fail
// as they would on a real driver whose thread has no context.
static __thread void *cur_ctx;
static int ctx_token[64];

// ---- CUDA driver double -------------------------------------------------

int cuInit(unsigned int flags) {
	(void)flags;
	return ctl("devices", 1) < 0 ? 100 /* CUDA_ERROR_NO_DEVICE */ : 0;
}
int cuDeviceGetCount(int *n) {
	long d = ctl("devices", 1);
	*n = d < 0 ? 0 : (int)d;
	return 0;
}
int cuDeviceGet(int *dev, int ordinal) {
	if (ordinal < 0 || ordinal >= ctl("devices", 1)) return 101; // CUDA_ERROR_INVALID_DEVICE
	*dev = ordinal;
	return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
	*ctx = &ctx_token[dev % 64];
	logline("cuDevicePrimaryCtxRetain dev=%d", dev);
	return 0;
}
int cuDevicePrimaryCtxRelease_v2(int dev) {
	logline("cuDevicePrimaryCtxRelease dev=%d", dev);
	return 0;
}
int cuCtxSetCurrent(void *ctx) {
	cur_ctx = ctx;
	return 0;
}
int cuMemAlloc_v2(unsigned long long *p, size_t n) {
	if (!cur_ctx) return 201; // CUDA_ERROR_INVALID_CONTEXT
	void *m = malloc(n);
	if (!m) return 2; // CUDA_ERROR_OUT_OF_MEMORY
	*p = (unsigned long long)(uintptr_t)m;
	logline("cuMemAlloc bytes=%zu", n);
	return 0;
}
int cuMemFree_v2(unsigned long long p) {
	free((void *)(uintptr_t)p);
	logline("cuMemFree");
	return 0;
}
int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
	if (!cur_ctx) return 201;
	memcpy((void *)(uintptr_t)dst, src, n);
	return 0;
}
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) {
	if (!cur_ctx) return 201;
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return 0;
}
int cuStreamCreate(void **s, unsigned int flags) {
	(void)flags;
	if (!cur_ctx) return 201;
	*s = malloc(1);
	logline("cuStreamCreate");
	return 0;
}
int cuStreamQuery(void *s) {
	(void)s;
	return ctl("hang", 0) ? 600 /* CUDA_ERROR_NOT_READY */ : 0;
}
int cuStreamDestroy_v2(void *s) {
	free(s);
	logline("cuStreamDestroy");
	return 0;
}
int cuGetErrorString(int code, const char **s) {
	switch (code) {
	case 100: *s = "test double: no CUDA-capable device"; return 0;
	case 201: *s = "test double: no current context"; return 0;
	case 600: *s = "test double: not ready"; return 0;
	}
	*s = NULL;
	return 1;
}

// ---- NCCL double --------------------------------------------------------

enum { ok = 0, unhandledCuda = 1, systemError = 2, internalError = 3, invalidArgument = 4, invalidUsage = 5, remoteError = 6, inProgress = 7 };

int ncclGetVersion(int *v) {
	const char *env = getenv("FAKENCCL_VERSION");
	*v = (int)ctl("version", env ? atol(env) : 22807);
	return ok;
}

// fill_id makes an id no other call of this process made.
static void fill_id(fake_uid *id) {
	static unsigned counter;
	unsigned seed = (unsigned)getpid() * 2654435761u + __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
	for (int i = 0; i < 128; i++) {
		seed = seed * 1103515245u + 12345u;
		id->internal[i] = (char)(seed >> 16);
	}
}

int ncclGetUniqueId(fake_uid *id) {
	fill_id(id);
	char h[257];
	hex(id, h);
	logline("ncclGetUniqueId id=%s", h);
	return ok;
}

const char *ncclGetErrorString(int r) {
	switch (r) {
	case ok: return "test double: no error";
	case unhandledCuda: return "test double: unhandled cuda error";
	case systemError: return "test double: system error";
	case internalError: return "test double: internal error";
	case invalidArgument: return "test double: invalid argument";
	case invalidUsage: return "test double: invalid usage";
	case remoteError: return "test double: remote process exited or network error";
	case inProgress: return "test double: operation in progress";
	}
	return "test double: unknown result";
}

static int init(fake_comm **out, int n, fake_uid id, int rank, int blocking, const char *fn) {
	if (!cur_ctx) return unhandledCuda;
	long e = ctl("init_error", 0);
	if (e) return (int)e;
	if (n < 1 || rank < 0 || rank >= n) return invalidArgument;
	while (blocking && ctl("init_block", 0)) usleep(5000);
	fake_comm *c = calloc(1, sizeof *c);
	c->nranks = n;
	c->rank = rank;
	c->blocking = blocking;
	c->polls = blocking ? 0 : (int)ctl("init_polls", 0);
	*out = c;
	char h[257];
	hex(&id, h);
	logline("%s nranks=%d rank=%d blocking=%d id=%s", fn, n, rank, blocking, h);
	return c->polls ? inProgress : ok;
}

int ncclCommInitRank(fake_comm **c, int n, fake_uid id, int rank) {
	return init(c, n, id, rank, 1, "ncclCommInitRank");
}

static void async_error(fake_comm *c, int *e) {
	if (c->polls != 0) {
		if (c->polls > 0) c->polls--;
		*e = inProgress;
		return;
	}
	late_store(c);
	long only = ctl("async_error_nranks", 0);
	*e = only && c->nranks != only ? ok : (int)ctl("async_error", 0);
}

int ncclCommGetAsyncError(fake_comm *c, int *e) {
	if (!c) return invalidArgument;
	// NCCL's call is not safe on one communicator from two threads at
	// once (the first to see a non-blocking operation done joins and
	// frees its group job): say so when it happens.
	if (__atomic_fetch_add(&c->in_async_error, 1, __ATOMIC_ACQ_REL) != 0) {
		logline("ncclCommGetAsyncError called concurrently on one communicator (rank=%d nranks=%d)", c->rank, c->nranks);
	}
	long dwell = ctl("async_error_us", 0);
	if (dwell > 0) usleep((useconds_t)dwell);
	async_error(c, e);
	__atomic_fetch_sub(&c->in_async_error, 1, __ATOMIC_ACQ_REL);
	return ok;
}

int ncclCommAbort(fake_comm *c) {
	if (!c) return ok;
	logline("ncclCommAbort rank=%d nranks=%d", c->rank, c->nranks);
	late_store(c); // NCCL's abort joins the init, which stores
	free(c);
	return ok;
}

int ncclCommDestroy(fake_comm *c) {
	if (!c) return ok;
	logline("ncclCommDestroy rank=%d nranks=%d", c->rank, c->nranks);
	late_store(c);
	free(c);
	return ok;
}

int ncclCommCount(const fake_comm *c, int *n) {
	*n = c->nranks;
	return ok;
}

int ncclCommUserRank(const fake_comm *c, int *r) {
	*r = c->rank;
	return ok;
}

static int group_depth;
static const void *pending_send;
static size_t pending_bytes;

int ncclGroupStart(void) {
	group_depth++;
	return ok;
}

int ncclGroupEnd(void) {
	if (!cur_ctx) return unhandledCuda;
	if (group_depth == 0) return invalidUsage;
	group_depth--;
	return ok;
}

static size_t dtsize(int dt) {
	switch (dt) {
	case 0: case 1: return 1;
	case 2: case 3: case 7: return 4;
	case 4: case 5: case 8: return 8;
	case 6: case 9: return 2;
	}
	return 0;
}

static int enqueue(fake_comm *c, const void *s, void *r, size_t count, int dt, const char *fn) {
	if (!cur_ctx) return unhandledCuda;
	if (!c) return invalidArgument;
	size_t sz = dtsize(dt);
	if (sz == 0) return invalidArgument;
	if (count && s != r) memmove(r, s, count * sz);
	logline("%s count=%zu dt=%d", fn, count, dt);
	return ok;
}

int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, fake_comm *c, void *st) {
	(void)st;
	if (op < 0 || op > 4) return invalidArgument;
	return enqueue(c, s, r, n, dt, "ncclAllReduce");
}

int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, fake_comm *c, void *st) {
	(void)st;
	if (!c || root < 0 || root >= c->nranks) return invalidArgument;
	return enqueue(c, s, r, n, dt, "ncclBroadcast");
}

int ncclAllGather(const void *s, void *r, size_t n, int dt, fake_comm *c, void *st) {
	(void)st;
	return enqueue(c, s, r, n, dt, "ncclAllGather");
}

int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, fake_comm *c, void *st) {
	(void)st;
	(void)op;
	return enqueue(c, s, r, n, dt, "ncclReduceScatter");
}

int ncclSend(const void *b, size_t n, int dt, int peer, fake_comm *c, void *st) {
	(void)st;
	if (!cur_ctx) return unhandledCuda;
	if (!c || peer < 0 || peer >= c->nranks) return invalidArgument;
	pending_send = b;
	pending_bytes = n * dtsize(dt);
	logline("ncclSend count=%zu peer=%d", n, peer);
	return ok;
}

int ncclRecv(void *b, size_t n, int dt, int peer, fake_comm *c, void *st) {
	(void)st;
	if (!cur_ctx) return unhandledCuda;
	if (!c || peer < 0 || peer >= c->nranks) return invalidArgument;
	size_t bytes = n * dtsize(dt);
	if (pending_send && bytes == pending_bytes) memmove(b, pending_send, bytes);
	pending_send = NULL;
	logline("ncclRecv count=%zu peer=%d", n, peer);
	return ok;
}

#ifndef FAKENCCL_OLD
int ncclCommInitRankConfig(fake_comm **c, int n, fake_uid id, int rank, fake_config_head *cfg) {
	if (!cfg || cfg->magic != 0xcafebeef || cfg->size < sizeof *cfg) return invalidArgument;
	return init(c, n, id, rank, cfg->blocking != 0, "ncclCommInitRankConfig");
}

const char *ncclGetLastError(fake_comm *c) {
	(void)c;
	return "test double: last error detail";
}

int ncclCommShrink(fake_comm *c, int *ex, int nex, fake_comm **out, void *cfg, int flags) {
	if (!cur_ctx) return unhandledCuda;
	if (!c || nex < 1) return invalidArgument;
	char list[512] = "";
	int below = 0;
	for (int i = 0; i < nex; i++) {
		if (ex[i] == c->rank) return invalidArgument; // excluded ranks must not call
		if (ex[i] < c->rank) below++;
		snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", ex[i]);
	}
	fake_comm *n = calloc(1, sizeof *n);
	n->nranks = c->nranks - nex;
	n->rank = c->rank - below;
	n->blocking = c->blocking;
	n->polls = c->blocking ? 0 : (int)ctl("shrink_polls", 0);
	if (n->polls && !defer_store(n, out, "ncclCommShrink")) {
		free(n);
		return invalidUsage;
	}
	*out = n;
	logline("ncclCommShrink exclude=%s flags=%d config=%s newrank=%d newnranks=%d", list, flags,
	        cfg ? "set" : "NULL", n->rank, n->nranks);
	return n->polls ? inProgress : ok;
}

int ncclCommRevoke(fake_comm *c, int flags) {
	if (!c) return invalidArgument;
	logline("ncclCommRevoke rank=%d flags=%d", c->rank, flags);
	return ok;
}

#ifndef FAKENCCL_NO_GROW
int ncclCommGetUniqueId(fake_comm *c, fake_uid *id) {
	if (!c || !id) return invalidArgument;
	if (c->grow_id) return invalidUsage; // the last one is not consumed yet
	fill_id(id);
	c->grow_id = 1;
	char h[257];
	hex(id, h);
	logline("ncclCommGetUniqueId rank=%d nranks=%d id=%s", c->rank, c->nranks, h);
	return ok;
}

int ncclCommGrow(fake_comm *c, int n, const fake_uid *id, int rank, fake_comm **out, fake_config_head *cfg) {
	if (!cur_ctx) return unhandledCuda;
	if (!out) return invalidArgument;
	*out = NULL;
	long e = ctl("grow_error", 0);
	if (e) return (int)e;
	if (cfg && (cfg->magic != 0xcafebeef || cfg->size < sizeof *cfg)) return invalidArgument;
	int blocking;
	if (c) {
		if (rank != -1 || n <= c->nranks) return invalidArgument;
		if (id) {
			if (!c->grow_id) return invalidUsage; // the root's id comes from ncclCommGetUniqueId
			c->grow_id = 0;
		}
		blocking = cfg ? cfg->blocking != 0 : c->blocking;
	} else {
		if (!id || rank < 0 || rank >= n) return invalidArgument;
		blocking = cfg ? cfg->blocking != 0 : 1;
	}
	fake_comm *nc = calloc(1, sizeof *nc);
	nc->nranks = n;
	nc->rank = c ? c->rank : rank;
	nc->blocking = blocking;
	nc->polls = blocking ? 0 : (int)ctl("grow_polls", 0);
	if (nc->polls && !defer_store(nc, out, "ncclCommGrow")) {
		free(nc);
		return invalidUsage;
	}
	*out = nc;
	char parent[32] = "NULL", h[257] = "NULL", conf[32] = "NULL";
	if (c) snprintf(parent, sizeof parent, "%d/%d", c->rank, c->nranks);
	if (id) hex(id, h);
	if (cfg) snprintf(conf, sizeof conf, "blocking=%d", cfg->blocking);
	logline("ncclCommGrow parent=%s nranks=%d rank=%d config=%s newrank=%d id=%s", parent, n, rank, conf, nc->rank, h);
	while (blocking && ctl("grow_block", 0)) usleep(5000);
	return nc->polls ? inProgress : ok;
}
#endif
#endif
