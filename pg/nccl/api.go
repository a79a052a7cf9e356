package nccl

import "github.com/gorunhq/gorun/pg"

// The bindings: the slice of NCCL and of the CUDA driver API that a Group
// uses, behind two small interfaces (go-nvml's pattern), so that the
// group's logic does not care how the libraries were loaded. The real
// implementations (dlopen through cgo) are in dl_cgo.go; without cgo there
// are none and New says so.
//
// Handles are opaque integers: a communicator (ncclComm_t), a stream
// (CUstream), a device pointer (CUdeviceptr), a context (CUcontext). Every
// call that runs on the device takes the context, which the binding makes
// current on the calling OS thread first: goroutines move between threads,
// and CUDA's current context is per thread.

type (
	commHandle   uintptr
	streamHandle uintptr
	devPtr       uintptr
	ctxHandle    uintptr
)

// uniqueIDBytes is NCCL_UNIQUE_ID_BYTES.
const uniqueIDBytes = 128

// uniqueID is ncclUniqueId: 128 opaque bytes.
type uniqueID [uniqueIDBytes]byte

// commConfig is the ncclConfig_t pg/nccl passes: only blocking is set,
// every other field keeps NCCL's default.
type commConfig struct{ blocking bool }

// ncclAPI is libnccl.so.2.
type ncclAPI interface {
	// path is the library as it was asked for, for messages.
	path() string
	// has reports whether an optional entry point (ncclCommInitRankConfig,
	// ncclGetLastError, ncclCommShrink, ncclCommRevoke, ncclCommGrow,
	// ncclCommGetUniqueId) was found.
	has(symbol string) bool

	getVersion() (int, Result)
	getUniqueID() (uniqueID, Result)
	errorString(r Result) string
	// lastError is ncclGetLastError(comm), "" without the entry point.
	lastError(c commHandle) string

	commInitRank(ctx ctxHandle, nranks, rank int, id uniqueID) (commHandle, Result)
	// commInitRankConfig passes an ncclConfig_t whose only set field is
	// blocking.
	commInitRankConfig(ctx ctxHandle, nranks, rank int, id uniqueID, blocking bool) (commHandle, Result)
	commGetAsyncError(c commHandle) (async Result, r Result)
	commAbort(ctx ctxHandle, c commHandle) Result
	commDestroy(ctx ctxHandle, c commHandle) Result
	// commShrink passes a NULL config: the child inherits the parent's.
	commShrink(ctx ctxHandle, c commHandle, exclude []int32, flags int) (commHandle, Result)
	commRevoke(ctx ctxHandle, c commHandle, flags int) Result
	// commGetUniqueID is ncclCommGetUniqueId: the id of one grow of c,
	// made by the member that is the grow's root.
	commGetUniqueID(ctx ctxHandle, c commHandle) (uniqueID, Result)
	// commGrow is ncclCommGrow(parent, nranks, id, rank, &newcomm, config).
	// A member passes its communicator and rank -1, and the id only if it
	// is the root (nil passes NULL); a newcomer passes parent 0 (NULL), the
	// id and its rank. A nil cfg passes a NULL config (a member's child
	// inherits the parent's; a newcomer's gets NCCL's defaults).
	commGrow(ctx ctxHandle, parent commHandle, nranks int, id *uniqueID, rank int, cfg *commConfig) (commHandle, Result)

	groupStart() Result
	groupEnd(ctx ctxHandle) Result
	allReduce(ctx ctxHandle, send, recv devPtr, count int, dt pg.DType, op pg.ReduceOp, c commHandle, s streamHandle) Result
	broadcast(ctx ctxHandle, send, recv devPtr, count int, dt pg.DType, root int, c commHandle, s streamHandle) Result
	allGather(ctx ctxHandle, send, recv devPtr, sendCount int, dt pg.DType, c commHandle, s streamHandle) Result
	reduceScatter(ctx ctxHandle, send, recv devPtr, recvCount int, dt pg.DType, op pg.ReduceOp, c commHandle, s streamHandle) Result
	send(ctx ctxHandle, buf devPtr, count int, dt pg.DType, peer int, c commHandle, s streamHandle) Result
	recv(ctx ctxHandle, buf devPtr, count int, dt pg.DType, peer int, c commHandle, s streamHandle) Result
}

// cudaAPI is the CUDA driver, libcuda.so.1. Results are CUresult codes.
type cudaAPI interface {
	path() string
	errorString(code int) string

	initDriver() int
	deviceCount() (int, int)
	// primaryCtxRetain retains device ordinal's primary context (the one
	// the CUDA runtime, and so NCCL, uses).
	primaryCtxRetain(ordinal int) (ctxHandle, int)
	primaryCtxRelease(ordinal int) int

	memAlloc(ctx ctxHandle, bytes int) (devPtr, int)
	memFree(ctx ctxHandle, p devPtr) int
	memcpyHtoD(ctx ctxHandle, dst devPtr, src []byte) int
	memcpyDtoH(ctx ctxHandle, dst []byte, src devPtr) int

	streamCreate(ctx ctxHandle) (streamHandle, int)
	// streamQuery returns cudaSuccess when the stream is idle,
	// cudaErrorNotReady while work is pending.
	streamQuery(ctx ctxHandle, s streamHandle) int
	streamDestroy(ctx ctxHandle, s streamHandle) int
}
