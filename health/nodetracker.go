package health

import (
	"fmt"
	"slices"
	"time"
)

// nodeState is what the tracker last heard about a peer.
type nodeState int

const (
	nodeAlive nodeState = iota
	nodeDead
	nodeLeft
)

type peer struct {
	addr    string
	state   nodeState
	since   time.Time     // when state was entered
	lastAck time.Time     // last ack to one of this member's probes; zero if none
	rtt     time.Duration // round trip of that ack
	verdict Event         // the report of its death or departure
}

// nodeTracker is the decision core of node liveness: memberlist's
// membership callbacks in, Events out. It does no I/O and reads no clock.
//
// It reports each change of a peer once (memberlist may repeat itself, e.g.
// a join for a member it already had), never reports this member itself,
// and, once an expected set is given, reports only peers in it: the agents
// of the current rendezvous round.
//
// A departure is told from a death by the departing member's announcement
// (leaving) that precedes it: memberlist itself (v0.7) does not tell its
// EventDelegate which of the two it saw.
type nodeTracker struct {
	self     string
	cfg      NodeConfig
	peers    map[string]*peer
	leaving  map[string]bool // announced their departure, not gone yet
	expected map[string]bool // nil: every peer
}

func newNodeTracker(self string, cfg NodeConfig) *nodeTracker {
	return &nodeTracker{self: self, cfg: cfg, peers: map[string]*peer{}, leaving: map[string]bool{}}
}

// alive counts the members believed alive, this one included: close to
// memberlist's estimate of the cluster size that scales the suspicion
// timeout (it also counts members dead for less than GossipToTheDeadTime).
func (t *nodeTracker) alive() int {
	n := 1
	for _, p := range t.peers {
		if p.state == nodeAlive {
			n++
		}
	}
	return n
}

func (t *nodeTracker) reported(name string) bool {
	return name != t.self && (t.expected == nil || t.expected[name])
}

// joined records that name is alive at addr (memberlist's NotifyJoin).
func (t *nodeTracker) joined(name, addr string, now time.Time) []Event {
	if name == t.self {
		return nil
	}
	p, known := t.peers[name]
	if known && p.state == nodeAlive {
		p.addr = addr
		return nil
	}
	reason := "joined the gossip"
	if known {
		verb := map[nodeState]string{nodeDead: "being declared dead", nodeLeft: "leaving"}[p.state]
		reason = fmt.Sprintf("rejoined %v after %s", now.Sub(p.since).Round(time.Millisecond), verb)
		if p.addr != addr {
			reason += fmt.Sprintf(" (it was at %s)", p.addr)
		}
	}
	t.peers[name] = &peer{addr: addr, state: nodeAlive, since: now}
	if !t.reported(name) {
		return nil
	}
	return []Event{{Kind: NodeJoined, Node: name, Addr: addr, SeenAt: now, Reason: reason}}
}

// announcedLeave records that name announced its departure: when it goes, it
// left (even if it crashes on the way out: it meant to go).
func (t *nodeTracker) announcedLeave(name string) {
	if name != t.self {
		t.leaving[name] = true
	}
}

// gone records that name is gone (memberlist's NotifyLeave): it left if it
// announced so or if left is true, else it was declared dead.
func (t *nodeTracker) gone(name, addr string, left bool, now time.Time) []Event {
	if name == t.self {
		return nil
	}
	left = left || t.leaving[name]
	delete(t.leaving, name)
	p, known := t.peers[name]
	if known && p.state != nodeAlive {
		return nil
	}
	if !known {
		// Declared dead or left before this member heard it was alive
		// (learnt from a peer's state): report it all the same.
		p = &peer{}
		t.peers[name] = p
	}
	n := t.alive()
	p.addr, p.since = addr, now
	ev := Event{Kind: NodeLeft, Node: name, Addr: addr, SeenAt: now}
	if left {
		p.state = nodeLeft
		ev.Reason = "left gracefully (it announced its departure)"
	} else {
		p.state = nodeDead
		ev.Kind = NodeDead
		ev.Reason = t.deadReason(p, n, now)
	}
	p.verdict = ev
	if !t.reported(name) {
		return nil
	}
	return []Event{ev}
}

func (t *nodeTracker) deadReason(p *peer, n int, now time.Time) string {
	reason := fmt.Sprintf("unreachable: no ack to direct, indirect or TCP probes, and no refutation within the suspicion timeout (%v at %d members)",
		t.cfg.SuspicionTimeout(n), n)
	if p.lastAck.IsZero() {
		return reason + "; it never acked a probe of this member"
	}
	return reason + fmt.Sprintf("; last ack to this member %v before (rtt %v)",
		now.Sub(p.lastAck).Round(time.Millisecond), p.rtt.Round(10*time.Microsecond))
}

// deadAddrs are the addresses of the peers declared dead that are
// reported (the current round's): those a reconnect tries, sorted.
func (t *nodeTracker) deadAddrs() []string {
	var out []string
	for name, p := range t.peers {
		if p.state == nodeDead && t.reported(name) && p.addr != "" {
			out = append(out, p.addr)
		}
	}
	slices.Sort(out)
	return out
}

// acked records that name acked one of this member's probes (memberlist's
// NotifyPingComplete): the last sign of life a verdict can quote.
func (t *nodeTracker) acked(name string, rtt time.Duration, now time.Time) {
	if p, ok := t.peers[name]; ok && now.After(p.lastAck) {
		p.lastAck, p.rtt = now, rtt
	}
}

// expect limits reports to the named peers (nil: every peer, the initial
// setting) and returns an Event for each of them already dead or gone, so
// that a new round learns of a loss that happened before it began. The
// events keep their original time of observation.
func (t *nodeTracker) expect(names []string) []Event {
	if names == nil {
		t.expected = nil
		return nil
	}
	t.expected = make(map[string]bool, len(names))
	var out []Event
	for _, name := range names {
		if t.expected[name] {
			continue
		}
		t.expected[name] = true
		p, ok := t.peers[name]
		if !ok || p.state == nodeAlive || name == t.self {
			continue
		}
		ev := p.verdict
		ev.Reason += " (before this round)"
		out = append(out, ev)
	}
	return out
}
