package nccl

import (
	"errors"
	"fmt"

	"github.com/gorunhq/gorun/pg"
)

// Result is NCCL's ncclResult_t.
type Result int

// The ncclResult_t codes of nccl.h.
const (
	Success            Result = 0 // ncclSuccess
	UnhandledCudaError Result = 1 // ncclUnhandledCudaError
	SystemError        Result = 2 // ncclSystemError
	InternalError      Result = 3 // ncclInternalError
	InvalidArgument    Result = 4 // ncclInvalidArgument
	InvalidUsage       Result = 5 // ncclInvalidUsage
	RemoteError        Result = 6 // ncclRemoteError
	InProgress         Result = 7 // ncclInProgress
	Timeout            Result = 8 // ncclTimeout (NCCL 2.28+)
)

var resultNames = [...]string{
	"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress", "ncclTimeout",
}

func (r Result) String() string {
	if r >= 0 && int(r) < len(resultNames) {
		return resultNames[r]
	}
	return fmt.Sprintf("ncclResult_t(%d)", int(r))
}

// Version is an NCCL library version.
type Version struct{ Major, Minor, Patch int }

// DecodeVersion decodes ncclGetVersion's integer the way nccl.h's
// NCCL_VERSION macro encodes it: X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z
// from 2.9 on. The two ranges do not overlap (2.8.4 is 2804, 2.9.6 is
// 20906), so codes of 10000 and more use the new form.
func DecodeVersion(code int) Version {
	if code >= 10000 {
		return Version{code / 10000, code % 10000 / 100, code % 100}
	}
	return Version{code / 1000, code % 1000 / 100, code % 100}
}

// Code is the inverse of DecodeVersion: NCCL_VERSION(Major, Minor, Patch).
func (v Version) Code() int {
	if v.Major <= 2 && v.Minor <= 8 {
		return v.Major*1000 + v.Minor*100 + v.Patch
	}
	return v.Major*10000 + v.Minor*100 + v.Patch
}

// AtLeast reports whether v is w or newer.
func (v Version) AtLeast(w Version) bool {
	if v.Major != w.Major {
		return v.Major > w.Major
	}
	if v.Minor != w.Minor {
		return v.Minor > w.Minor
	}
	return v.Patch >= w.Patch
}

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

// First NCCL versions with the entry points pg/nccl uses when present.
var (
	// VersionInitConfig: ncclCommInitRankConfig and non-blocking
	// communicators (config.blocking).
	VersionInitConfig = Version{2, 14, 0}
	// VersionShrink: ncclCommShrink with NCCL_SHRINK_DEFAULT / _ABORT.
	VersionShrink = Version{2, 27, 3}
	// VersionRevoke: ncclCommRevoke.
	VersionRevoke = Version{2, 28, 7}
	// VersionGrow: ncclCommGrow and ncclCommGetUniqueId, which came with the
	// 2.29 series. The gate is the series; the entry points must be there
	// too (see Group.Grow), so a 2.29 build without them falls back.
	VersionGrow = Version{2, 29, 0}
)

// Error is a failed NCCL call.
type Error struct {
	// Op is the NCCL function ("ncclAllReduce") or the group operation
	// that noticed ("async error").
	Op string
	// Result is what NCCL returned.
	Result Result
	// Text is ncclGetErrorString(Result).
	Text string
	// Detail is ncclGetLastError, when the library has it and said
	// something.
	Detail string
	// Version of the library, for the message (PyTorch prints it too).
	Version Version
}

func (e *Error) Error() string {
	s := fmt.Sprintf("nccl: %s: %s (%v, NCCL version %v)", e.Op, e.Text, e.Result, e.Version)
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

// Unwrap maps the result onto pg's sentinels: ncclInvalidArgument and
// ncclInvalidUsage are pg.ErrInvalidArgument, ncclTimeout is pg.ErrTimeout.
// A communicator's ncclRemoteError or ncclSystemError (a dead peer, a broken
// socket) is reported as a *pg.PeerError around the Error instead; see
// peerLost.
func (e *Error) Unwrap() error {
	switch e.Result {
	case InvalidArgument, InvalidUsage:
		return pg.ErrInvalidArgument
	case Timeout:
		return pg.ErrTimeout
	}
	return nil
}

// peerLost wraps a communicator error that means a peer is gone
// (ncclRemoteError: "a remote process exiting prematurely" or a network
// error; ncclSystemError on a communicator: a socket call failed) in a
// *pg.PeerError, so that errors.Is(err, pg.ErrPeerLost) holds. NCCL does not
// say which peer, so Rank is -1. Other errors are returned as they are.
func peerLost(err error) error {
	var ne *Error
	if errors.As(err, &ne) && (ne.Result == RemoteError || ne.Result == SystemError) {
		return &pg.PeerError{Rank: -1, Op: ne.Op, Err: ne}
	}
	return err
}

// CUDAError is a failed CUDA driver call.
type CUDAError struct {
	Op   string // "cuMemAlloc_v2"
	Code int    // CUresult
	Text string // cuGetErrorString, when it knows the code
}

func (e *CUDAError) Error() string {
	if e.Text == "" {
		return fmt.Sprintf("cuda: %s: CUresult %d", e.Op, e.Code)
	}
	return fmt.Sprintf("cuda: %s: %s (CUresult %d)", e.Op, e.Text, e.Code)
}

// CUDA driver result codes pg/nccl looks at.
const (
	cudaSuccess       = 0
	cudaErrorNoDevice = 100 // CUDA_ERROR_NO_DEVICE
	cudaErrorNotReady = 600 // CUDA_ERROR_NOT_READY, from cuStreamQuery
)

// ErrNoGPU is PyTorch's message for a process group on a machine without
// GPUs: no CUDA driver library, or a driver that sees no device.
var ErrNoGPU = errors.New("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")

// LoadError is a shared library that could not be loaded, or that lacks a
// required entry point.
type LoadError struct {
	// Library is what was asked for ("libnccl.so.2" or a path).
	Library string
	// Symbol is the missing entry point, or "" when dlopen itself failed.
	Symbol string
	// Msg is dlerror's text.
	Msg string
}

func (e *LoadError) Error() string {
	if e.Symbol != "" {
		return fmt.Sprintf("pg/nccl: %s has no %s: %s", e.Library, e.Symbol, e.Msg)
	}
	return fmt.Sprintf("pg/nccl: cannot load %s: %s", e.Library, e.Msg)
}
