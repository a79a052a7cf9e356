// Package health watches liveness and reports what it sees as Events; it
// never decides what to do about them (the launcher and package shrink do).
//
// This file set covers worker liveness beyond exits (which the launcher's
// reaper reports): heartbeats for hang detection. A worker refreshes its
// heartbeat by sending a datagram to the unix socket named in
// GORUN_HEARTBEAT (Beat, StartBeating, or three lines of Python); a worker
// whose heartbeats stop for longer than the timeout — hung in a collective,
// deadlocked, or SIGSTOPped — is reported as hung.
package health

import (
	"fmt"
	"time"
)

// EventKind says what an Event is about.
type EventKind string

const (
	// WorkerHung: a worker's heartbeats stopped for longer than the timeout.
	WorkerHung EventKind = "worker_hung"
)

// Event is one observation: what, about whom, when it was seen and why.
type Event struct {
	Kind EventKind
	// Rank is the worker's local rank (WorkerHung).
	Rank int
	// SeenAt is when the observation was made.
	SeenAt time.Time
	// Reason says why, in words a log line can carry.
	Reason string
}

func (e Event) String() string {
	return fmt.Sprintf("%s rank %d at %s: %s", e.Kind, e.Rank, e.SeenAt.Format(time.RFC3339Nano), e.Reason)
}
