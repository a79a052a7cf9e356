package pg

import (
	"errors"
	"fmt"
)

// Sentinel errors that callers branch on. Backends wrap them with %w and say
// what they know (the operation, the peer, the reason).
var (
	// ErrAborted: the group was aborted (Abort, or an abortive Shrink).
	// Errors that wrap it are *AbortedError and carry the reason.
	ErrAborted = errors.New("process group aborted")
	// ErrPeerLost: a peer died or its connection broke (EOF, reset, a
	// communicator error). Errors that wrap it are *PeerError and name the
	// rank.
	ErrPeerLost = errors.New("peer lost")
	// ErrTimeout: an operation ran past its context's deadline or the
	// group's timeout.
	ErrTimeout = errors.New("process group operation timed out")
	// ErrClosed: the group was closed by its owner.
	ErrClosed = errors.New("process group closed")
	// ErrInvalidArgument: bad arguments (mismatched lengths, a rank out of
	// range, an unsupported dtype or op for this backend, a bad shrink list).
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrNotSupported: the backend, or the library version it loaded, cannot
	// do this (shrink on NCCL older than 2.27.3, for instance).
	ErrNotSupported = errors.New("not supported")
)

// AbortedError is the error every operation of an aborted group returns.
type AbortedError struct {
	// Reason is what the caller of Abort gave (or what made the backend
	// abort itself).
	Reason error
}

func (e *AbortedError) Error() string {
	if e.Reason == nil {
		return ErrAborted.Error()
	}
	return ErrAborted.Error() + ": " + e.Reason.Error()
}

// Is makes errors.Is(err, ErrAborted) true.
func (e *AbortedError) Is(target error) bool { return target == ErrAborted }

// Unwrap returns the reason, so that errors.Is sees through it too.
func (e *AbortedError) Unwrap() error { return e.Reason }

// NewAbortedError returns the error for an abort with reason; a nil reason
// reads "aborted by the caller".
func NewAbortedError(reason error) *AbortedError {
	if reason == nil {
		reason = errors.New("aborted by the caller")
	}
	return &AbortedError{Reason: reason}
}

// PeerError reports that rank Rank of the group failed or became
// unreachable during Op.
type PeerError struct {
	// Rank is the peer's rank in the group, or -1 when the backend cannot
	// tell which peer failed (NCCL reports only that one did).
	Rank int
	// Op is the operation that noticed ("allreduce", "recv", "connect").
	Op string
	// Err is what the transport said (io.EOF, ECONNRESET, an NCCL result).
	Err error
}

func (e *PeerError) Error() string {
	if e.Rank < 0 {
		return fmt.Sprintf("%s: a peer was lost: %v", e.Op, e.Err)
	}
	return fmt.Sprintf("%s: peer rank %d lost: %v", e.Op, e.Rank, e.Err)
}

// Unwrap makes errors.Is(err, ErrPeerLost) true and exposes the cause.
func (e *PeerError) Unwrap() []error { return []error{ErrPeerLost, e.Err} }

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidArgument, fmt.Sprintf(format, args...))
}
