// Package health watches liveness and reports what it sees as Events; it
// never decides what to do about them (the launcher and package shrink do).
//
// Node liveness (Nodes, StartNodes): the agents of a job gossip with
// hashicorp/memberlist, seeded from the rendezvous, and each reports peers
// that join, die (crash, frozen, cut off: about a second, see NodeConfig) or
// leave gracefully.
//
// Worker liveness beyond exits (which the launcher's reaper reports):
// heartbeats for hang detection. A worker refreshes its heartbeat by
// sending a datagram to the unix socket named in GORUN_HEARTBEAT (Beat,
// Beat, or three lines of Python); a worker whose heartbeats stop
// for longer than the timeout — hung in a collective, deadlocked, or
// SIGSTOPped — is reported as hung.
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
	// NodeJoined: a peer agent joined the gossip, or came back after it was
	// declared dead or left.
	NodeJoined EventKind = "node_joined"
	// NodeDead: a peer agent stopped answering probes and did not refute
	// the suspicion in time: crashed, frozen or cut off. A failure.
	NodeDead EventKind = "node_dead"
	// NodeLeft: a peer agent announced that it leaves. Not a failure.
	NodeLeft EventKind = "node_left"
)

// Event is one observation: what, about whom, when it was seen and why.
type Event struct {
	Kind EventKind
	// Rank is the worker's local rank (WorkerHung).
	Rank int
	// Node is the peer agent's name, Addr its gossip address (Node… kinds).
	Node, Addr string
	// SeenAt is when the observation was made.
	SeenAt time.Time
	// Reason says why, in words a log line can carry.
	Reason string
	// Done (WorkerHung): the worker had said it was done, and its exit
	// did not come within the done timeout: its work was over, its
	// teardown is what hung.
	Done bool
}

func (e Event) String() string {
	if e.Node != "" {
		return fmt.Sprintf("%s %s (%s) at %s: %s", e.Kind, e.Node, e.Addr, e.SeenAt.Format(time.RFC3339Nano), e.Reason)
	}
	return fmt.Sprintf("%s rank %d at %s: %s", e.Kind, e.Rank, e.SeenAt.Format(time.RFC3339Nano), e.Reason)
}
