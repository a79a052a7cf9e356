package main

import (
	"errors"
	"fmt"

	"github.com/gorunhq/gorun/launcher"
	"github.com/gorunhq/gorun/rendezvous"
)

// Exit codes. They are part of gorun's contract (README, "Exit codes"):
// scripts and Kubernetes restart policies branch on them.
const (
	ExitOK = 0
	// ExitWorkersFailed: workers failed and no restart was left
	// (torchrun's code).
	ExitWorkersFailed = 1
	// ExitFalse: a query answered no (`store check` with a key missing);
	// the store toolbox shares 1 with the launcher's failure, as grep and
	// test do.
	ExitFalse = 1
	// ExitUsage: bad flags, arguments, URLs or values (for the launcher:
	// any launcher.ErrInvalidConfig, etcd certificates or credentials that
	// etcd refuses included).
	ExitUsage = 2
	// ExitTimeout: a store operation or a connection attempt timed out.
	ExitTimeout = 3
	// ExitUnavailable: the store cannot be reached, or dropped the
	// connection and no longer answers.
	ExitUnavailable = 4
	// ExitStoreError: the store refused the operation (not supported by
	// this backend, a non-integer counter, a key or value over a server's
	// limits: a TCPStore server that closes the connection on a request
	// and still answers a fresh one refused it).
	ExitStoreError = 5
	// ExitRendezvousTimeout: the multi-node rendezvous did not complete
	// within join_timeout.
	ExitRendezvousTimeout = 6
	// ExitRendezvousClosed: the job had already ended when this node
	// tried to join.
	ExitRendezvousClosed = 7
	// ExitLocalResource: a resource of this machine failed: a port in use
	// (a static node rank 0's --master-port, the worker store's,
	// --health-addr's), the log directory, starting a worker (fork, a
	// pids limit).
	ExitLocalResource = 8
	// ExitSignalBase: stopped by signal N gives ExitSignalBase+N (the
	// agent stops its workers first).
	ExitSignalBase = 128
)

// exitError carries an exit code out of a command.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// usageErrorf reports bad input from the user.
func usageErrorf(format string, args ...any) error {
	return &exitError{code: ExitUsage, err: fmt.Errorf(format, args...)}
}

// exitCode maps an error from a command's work to gorun's exit code.
func exitCode(err error) int {
	var ee *exitError
	var sig *launcher.SignalError
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, new(*launcher.WorkersFailedError)), errors.As(err, new(*launcher.JobFailedError)):
		return ExitWorkersFailed
	case errors.Is(err, launcher.ErrRendezvousTimeout):
		return ExitRendezvousTimeout
	case errors.Is(err, launcher.ErrRendezvousClosed):
		return ExitRendezvousClosed
	case errors.As(err, &sig):
		return ExitSignalBase + int(sig.Signal)
	case errors.Is(err, rendezvous.ErrInvalidArgument),
		errors.Is(err, launcher.ErrInvalidConfig):
		return ExitUsage
	case errors.Is(err, launcher.ErrLocalResource):
		return ExitLocalResource
	case errors.Is(err, rendezvous.ErrUnavailable), errors.Is(err, rendezvous.ErrClosed):
		// Before ErrTimeout: a store reachable once whose reconnection
		// timed out is one that no longer answers (the README's 4), not a
		// timed-out operation.
		return ExitUnavailable
	case errors.Is(err, rendezvous.ErrTimeout):
		return ExitTimeout
	}
	return ExitStoreError
}
