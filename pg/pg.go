// Package pg is the contract of a fault-tolerant process group: a fixed set of
// ranks that run collectives together and, when some of them die, can abort
// what is in flight and shrink to the survivors.
//
// The contract follows PyTorch's c10d ProcessGroup where PyTorch has one
// (collective semantics, shrink_group's validation and renumbering) and NCCL's
// fault-tolerance API where it does not (ncclCommAbort, ncclCommShrink with
// NCCL_SHRINK_DEFAULT / NCCL_SHRINK_ABORT, ncclCommGetAsyncError).
//
// Backends: pg/cpu (pure Go over TCP, host memory) and pg/nccl (libnccl.so.2
// loaded at run time, device memory). The conformance suite in pg/pgtest is
// what makes a backend a ProcessGroup.
//
// Collectives are synchronous: a call returns when this rank's part is done
// and the output buffer holds the result. A collective that fails — a peer
// lost, its context's deadline passed — may leave the group aborted (pg/nccl
// always does: the operation is still on the device), and its peers in an
// unknown state: after a failure, count on Shrink and Close only. Every rank of the group must call
// the same collectives in the same order with matching arguments, as with
// any MPI-style group; a mismatch is a bug in the caller, which a backend
// may detect (and report with ErrInvalidArgument) but need not.
package pg

import (
	"context"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// DefaultTimeout bounds a collective whose context has no deadline. It is
// c10d's default process-group timeout (30 minutes); callers that want fast
// failure detection pass a context with a deadline, or rely on Abort and on
// the backend's own detection of dead peers.
const DefaultTimeout = 30 * time.Minute

// ProcessGroup is a group of Size ranks running collectives together.
//
// All methods are safe for concurrent use in the sense that Abort,
// AsyncError, Rank, Size and Backend may be called from any goroutine at any
// time, in particular while a collective blocks in another goroutine.
// Collectives themselves are issued by one goroutine at a time per group, in
// the same order on every rank.
type ProcessGroup interface {
	// Rank is this process's rank in the group, in [0, Size).
	Rank() int
	// Size is the number of ranks in the group.
	Size() int
	// Backend names the implementation ("cpu", "nccl").
	Backend() string

	// AllReduce reduces buf element-wise across all ranks with op and leaves
	// the result in buf on every rank.
	AllReduce(ctx context.Context, buf Buffer, op ReduceOp) error
	// Broadcast copies root's buf into buf on every other rank.
	Broadcast(ctx context.Context, buf Buffer, root int) error
	// AllGather concatenates every rank's in, in rank order, into out on
	// every rank. out.Len() must be Size()*in.Len().
	AllGather(ctx context.Context, out, in Buffer) error
	// ReduceScatter reduces in element-wise across ranks with op and leaves
	// block r of the result (out.Len() elements) in rank r's out.
	// in.Len() must be Size()*out.Len().
	ReduceScatter(ctx context.Context, out, in Buffer, op ReduceOp) error
	// Barrier returns once every rank has entered it.
	Barrier(ctx context.Context) error
	// Send sends buf to rank peer, which must call Recv with a buffer of the
	// same type and length. Messages between a pair arrive in send order.
	Send(ctx context.Context, buf Buffer, peer int) error
	// Recv receives into buf what rank peer sent with Send.
	Recv(ctx context.Context, buf Buffer, peer int) error

	// Abort stops the group: local, non-collective and idempotent. Every
	// operation in flight returns promptly, and every later one at once,
	// with an error wrapping ErrAborted that names reason (the first reason
	// given wins). An aborted group can still be shrunk with ShrinkAbort;
	// nothing else works on it. Abort does not release resources: Close does.
	Abort(reason error)
	// AsyncError returns the first failure the group saw on its own — a dead
	// peer (an error wrapping ErrPeerLost, a *PeerError naming its rank), a
	// timeout, a transport error — or nil. It does not block. An Abort by
	// the caller is not an async error.
	AsyncError() error
	// Shrink returns a new group made of this group's ranks minus exclude,
	// renumbered densely in their old order (see Survivors). It is called by
	// the survivors only, every one with the same exclude list (in any order:
	// it is a set) and the same flags; excluded ranks must not call it. The
	// arguments are checked as PyTorch's shrink_group checks them
	// (ValidateShrink), before anything else happens.
	//
	// With ShrinkDefault the group must be idle (no collective in flight);
	// it stays usable for nothing but Close. With ShrinkAbort the group is
	// aborted first, so a collective blocked on a dead peer returns, and it
	// is left aborted (never cleanly destroyed: its peers may be gone).
	// Either way the caller should Close it once the new group is in use.
	Shrink(ctx context.Context, exclude []int, flags ShrinkFlags) (ProcessGroup, error)
	// Close releases the group's resources (sockets, communicators). After
	// Close every operation returns an error wrapping ErrClosed. Close is
	// idempotent; it does not wait for peers.
	Close() error
}

// Bootstrap is what every backend needs to form a group: where ranks meet,
// who this rank is, and how long operations may take.
type Bootstrap struct {
	// Store is where ranks exchange addresses or ids. Required. The group
	// does not close it.
	Store rendezvous.Store
	// Namespace prefixes every key the group writes, so that several groups
	// (or several generations of one job) share a Store without meeting
	// each other's keys. Groups formed with the same Namespace and Store
	// must have the same Size. Default "" (no prefix).
	Namespace string
	// Rank of this process in [0, Size). Required.
	Rank int
	// Size of the group, at least 1. Required.
	Size int
	// Timeout bounds forming the group and every operation whose context has
	// no deadline. Default DefaultTimeout.
	Timeout time.Duration
}

// Validate checks the fields every backend relies on.
func (b Bootstrap) Validate() error {
	switch {
	case b.Store == nil:
		return invalidf("bootstrap: no store")
	case b.Size < 1:
		return invalidf("bootstrap: size %d, want at least 1", b.Size)
	case b.Rank < 0 || b.Rank >= b.Size:
		return invalidf("bootstrap: rank %d out of range for size %d", b.Rank, b.Size)
	case b.Timeout < 0:
		return invalidf("bootstrap: negative timeout %v", b.Timeout)
	}
	return nil
}

// OpTimeout returns Timeout, or DefaultTimeout when it is unset.
func (b Bootstrap) OpTimeout() time.Duration {
	if b.Timeout > 0 {
		return b.Timeout
	}
	return DefaultTimeout
}

// NamespacedStore returns the bootstrap store under Namespace (the store itself when
// Namespace is empty).
func (b Bootstrap) NamespacedStore() rendezvous.Store {
	if b.Namespace == "" {
		return b.Store
	}
	return rendezvous.NewPrefixStore(b.Namespace, b.Store)
}
