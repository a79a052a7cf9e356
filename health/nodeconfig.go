package health

import (
	"errors"
	"fmt"
	"math"
	"net"
	"time"

	"go.uber.org/zap"
)

// NodeConfig configures node liveness among agents (see StartNodes). Start
// from DefaultNodeConfig and change what you need; every timer below is
// passed to hashicorp/memberlist as is.
//
// # Detection time
//
// memberlist runs SWIM. Every ProbeInterval each member probes one other
// member, going round a shuffled list, so the n−1 survivors of a silent
// member together probe it about once per interval. A probe waits
// ProbeTimeout for a direct UDP ack, then asks IndirectChecks other members
// to probe for it and tries TCP, and gives up at the end of the interval
// (memberlist waits a whole ProbeInterval for an indirect ack). The prober
// then marks the member suspect and gossips that; the suspect has
// SuspicionTimeout(n) to refute before it is declared dead. The other
// members learn the verdict by gossip within a GossipInterval. So, for a
// member that goes silent (crashed, frozen, cut off):
//
//	detection = wait for a probe + ProbeInterval + SuspicionTimeout(n) + up to GossipInterval
//
// The wait for a probe is about one interval on average and at most n−1
// (every survivor had just probed the member when it went silent; the
// chance of waiting more than k intervals is about e^−k). DetectionBound
// adds the worst case up. At the defaults, for 2 to 10 agents:
//
//	≤ (n−1) × 100 ms + 100 ms + 4 × 100 ms + 20 ms: 620 ms for 2 agents, 820 ms for 4,
//
// and bench/livenessbench measured a SIGSTOPped member of 4 declared dead by
// every survivor in 590 ms (median of 20 trials; 730 ms the most in three
// such runs) on a 2-core machine, and the same for a cut link. Beyond 10 agents the
// suspicion timeout grows with log10 n (720 ms at 64), so large jobs
// detect in about a second; lower SuspicionMult there if their machines
// are not starved of CPU.
//
// # False positives
//
// A live member is declared dead only if it answers no direct, indirect or
// TCP probe for a whole ProbeInterval and its refutation does not reach
// the prober within SuspicionTimeout: it must get no CPU at all for
// ProbeInterval + SuspicionTimeout − GossipInterval, 480 ms at the
// defaults (bench/livenessbench freezes members for 300 ms: every one is
// suspected and refutes, none is declared dead). Starved longer, a member
// is indistinguishable from a dead one, whatever the timers: on the shared
// 2-core VM these defaults were tuned on, with two CPU-spinning processes
// per core at the agents' priority and other jobs loading the machine
// (load average 18), a Go process woke up to 470 ms late; with the
// spinners at nice 10, 80 ms. The benchmark counted no false verdict in
// 60 s runs with both cores saturated at load 14, at either priority, but
// 9 at equal priority and load 22, members starved for about a second.
// So run workers below their agent (nice 10 costs them nothing unless the
// agent needs the CPU); where that cannot be, raise SuspicionMult (the
// tolerated silence grows by a ProbeInterval per step, and so does
// detection). For slower or lossier networks raise ProbeInterval
// (everything scales with it) and ProbeTimeout.
type NodeConfig struct {
	// Name identifies this agent among its peers; it must be unique in the
	// cluster. The launcher uses the agent's rendezvous identity so that a
	// node event names the same agent the rendezvous does. Empty means
	// "<hostname>-<pid>".
	Name string

	// Cluster labels every packet and stream; members with another label
	// ignore them. Set it to the job's run ID so that two jobs sharing hosts
	// (and perhaps reusing each other's ports) never merge. At most 255
	// bytes. Default: "" (no label).
	Cluster string

	// SecretKey, when set, encrypts and authenticates every gossip packet
	// and stream with AES-GCM (memberlist's keyring, verified both ways):
	// a member without the key can neither join nor be heard, so it cannot
	// declare anyone dead. 16, 24 or 32 bytes (AES-128, -192, -256). The
	// launcher derives it from the job secret. Default: none (plaintext).
	SecretKey []byte

	// OnRefused, if set, is called for each gossip packet or stream the
	// member refused: another cluster's label, or, with SecretKey, one it
	// could not decrypt (sent without the key, under another key, or
	// altered). from is the sender's address ("" when memberlist does not
	// say) and why memberlist's message. memberlist reports these only in
	// its log, where they are found. Default: none.
	OnRefused func(from, why string)

	// BindAddr and BindPort are where the member listens, UDP and TCP on the
	// same port. BindPort 0 picks a free port. Default: 0.0.0.0, port 0.
	BindAddr string
	BindPort int

	// AdvertiseAddr and AdvertisePort are the address peers reach this member
	// at: what Addr returns and the launcher publishes in its rendezvous
	// record. Empty AdvertiseAddr means the bound address, or a private IP of
	// this host when bound to 0.0.0.0 (memberlist's rule: StartNodes fails
	// on a host with none; set the address the agent is reached at);
	// AdvertisePort 0 means the bound port. Default: empty, 0.
	AdvertiseAddr string
	AdvertisePort int

	// ProbeInterval is the time between two probes by this member (of one
	// peer each). It is the unit of detection time: see above. Lower detects
	// faster at the cost of more packets (one probe per member per
	// interval) and a shorter silence before a verdict. Default: 100 ms.
	ProbeInterval time.Duration

	// ProbeTimeout is how long a probe waits for the direct ack before it
	// asks other members to probe indirectly and tries TCP. It must be below
	// ProbeInterval and above the round-trip time under load, or a slow ack
	// costs indirect probes (but no false verdict: the probe still succeeds
	// if any ack arrives within the interval). Default: 50 ms.
	ProbeTimeout time.Duration

	// IndirectChecks is how many other members are asked to probe a peer
	// that did not ack directly; one ack from any of them clears it. More
	// guards better against a lossy path between two members. Default: 3.
	IndirectChecks int

	// SuspicionMult and SuspicionMaxTimeoutMult set the suspicion timeout:
	// how long a suspect member has to refute before it is declared dead.
	// memberlist's minimum is SuspicionMult × max(1, log10 n) ×
	// ProbeInterval for n members. When SuspicionMult > 2 and there are
	// enough members, memberlist starts the timer at SuspicionMaxTimeoutMult
	// times the minimum and shortens it towards the minimum as up to
	// SuspicionMult − 2 other members confirm the suspicion (Lifeguard).
	// SuspicionMaxTimeoutMult 1 makes the timer the minimum from the start:
	// detection time does not wait for confirmations (which take further
	// probe rounds), and the refutation window stays SuspicionTimeout(n).
	// Defaults: 4 and 1 (400 ms at the default ProbeInterval, up to 10
	// agents).
	SuspicionMult           int
	SuspicionMaxTimeoutMult int

	// AwarenessMaxMultiplier bounds how far memberlist stretches this
	// member's ProbeInterval when it finds itself unhealthy (its own probes
	// fail without the nacks that would blame the target): an overloaded
	// member slows down rather than accuse healthy peers. Default: 8.
	AwarenessMaxMultiplier int

	// GossipInterval is the time between gossip rounds, each sending queued
	// suspicions, refutations and verdicts to GossipNodes random members
	// (they also piggyback on probes). It bounds how fast a verdict reaches
	// every member, and how fast a suspected member hears that it must
	// refute. A round with nothing queued sends nothing. Default: 20 ms, to
	// 3 members.
	GossipInterval time.Duration
	GossipNodes    int

	// RetransmitMult: each member that learns a suspicion, refutation or
	// verdict gossips it RetransmitMult × ceil(log10(n+1)) times. A
	// suspicion must reach the suspect, and its refutation every member
	// holding a suspicion timer, well within SuspicionTimeout: a member
	// that misses the refutation declares a live member dead. memberlist's
	// 4 leaves roughly e^−4 of a small cluster unreached per message (one
	// such false verdict was seen on the busy 2-core machine); 16 makes that
	// negligible for a few dozen bytes per message. Default: 16.
	RetransmitMult int

	// GossipToTheDeadTime is how long members keep gossiping to a member
	// declared dead, giving a wrongly accused one the chance to hear it and
	// refute (it then comes back as NodeJoined). Default: 5 s.
	GossipToTheDeadTime time.Duration

	// PushPullInterval is the time between full state exchanges with a
	// random member over TCP (anti-entropy: it heals what gossip missed,
	// e.g. after a partition). 0 disables them. Default: 5 s.
	PushPullInterval time.Duration

	// TCPTimeout bounds connecting to and exchanging state with one member
	// over TCP: each seed of Join, and each push-pull. (TCP probes end with
	// their probe interval instead.) Default: 2 s.
	TCPTimeout time.Duration

	// ReconnectInterval is how often a member tries to join again one of
	// the members of the current round it holds dead, each in turn (a TCP
	// join, bounded by TCPTimeout), as Serf's reconnect does: after a
	// partition heals each side holds the other dead, and memberlist
	// alone never merges them again (push-pull only goes to live members).
	// One that answers comes back as NodeJoined. 0 disables it. Default:
	// 1 s.
	ReconnectInterval time.Duration

	// DeadNodeReclaimTime is how long after a member was declared dead
	// another member may take its name from a different address (an agent
	// restarted on a new port). 0 never allows it. Default: 1 s.
	DeadNodeReclaimTime time.Duration

	// Logger receives this package's logs and memberlist's own, the latter
	// at debug level. Nil: no logs.
	Logger *zap.Logger
}

// DefaultNodeConfig returns the configuration described on NodeConfig:
// a blackholed agent declared dead within 1 s, no false verdicts on a busy
// machine.
func DefaultNodeConfig() NodeConfig {
	return NodeConfig{
		BindAddr:                "0.0.0.0",
		ProbeInterval:           100 * time.Millisecond,
		ProbeTimeout:            50 * time.Millisecond,
		IndirectChecks:          3,
		SuspicionMult:           4,
		SuspicionMaxTimeoutMult: 1,
		AwarenessMaxMultiplier:  8,
		GossipInterval:          20 * time.Millisecond,
		GossipNodes:             3,
		RetransmitMult:          16,
		GossipToTheDeadTime:     5 * time.Second,
		PushPullInterval:        5 * time.Second,
		TCPTimeout:              2 * time.Second,
		ReconnectInterval:       time.Second,
		DeadNodeReclaimTime:     time.Second,
	}
}

// SuspicionTimeout is how long a member suspected in a cluster of n members
// has to refute before it is declared dead when no other member confirms
// the suspicion (see SuspicionMult), as memberlist computes it.
func (c NodeConfig) SuspicionTimeout(n int) time.Duration {
	scale := math.Max(1, math.Log10(math.Max(1, float64(n))))
	timeout := time.Duration(c.SuspicionMult) * time.Duration(scale*1000) * c.ProbeInterval / 1000
	// Confirmations expected: the timer starts at the maximum.
	if k := c.SuspicionMult - 2; k >= 1 && n-2 >= k {
		timeout *= time.Duration(c.SuspicionMaxTimeoutMult)
	}
	return timeout
}

// DetectionBound is the worst-case time from a member of a cluster of n
// going silent to every other member having declared it dead (see
// NodeConfig): n−1 probe intervals before one probes it, one for the probe,
// the suspicion timeout and a gossip interval. It leaves out network and
// scheduling delays and the slower probing of a member that finds itself
// unhealthy (AwarenessMaxMultiplier).
func (c NodeConfig) DetectionBound(n int) time.Duration {
	return time.Duration(max(n-1, 1))*c.ProbeInterval + c.ProbeInterval + c.SuspicionTimeout(n) + c.GossipInterval
}

func (c NodeConfig) validate() error {
	var errs []error
	check := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	check(c.BindAddr == "" || net.ParseIP(c.BindAddr) != nil, "BindAddr %q is not an IP address", c.BindAddr)
	check(c.AdvertiseAddr == "" || net.ParseIP(c.AdvertiseAddr) != nil, "AdvertiseAddr %q is not an IP address", c.AdvertiseAddr)
	check(c.BindPort >= 0 && c.BindPort <= 65535, "BindPort %d out of range", c.BindPort)
	check(c.AdvertisePort >= 0 && c.AdvertisePort <= 65535, "AdvertisePort %d out of range", c.AdvertisePort)
	check(len(c.Cluster) <= 255, "Cluster label is %d bytes, at most 255", len(c.Cluster))
	check(len(c.SecretKey) == 0 || len(c.SecretKey) == 16 || len(c.SecretKey) == 24 || len(c.SecretKey) == 32,
		"SecretKey is %d bytes: want 16, 24 or 32", len(c.SecretKey))
	check(c.ProbeInterval > 0, "ProbeInterval %v must be positive", c.ProbeInterval)
	check(c.ProbeTimeout > 0 && c.ProbeTimeout < c.ProbeInterval,
		"ProbeTimeout %v must be positive and below ProbeInterval %v", c.ProbeTimeout, c.ProbeInterval)
	check(c.IndirectChecks >= 0, "IndirectChecks %d must not be negative", c.IndirectChecks)
	check(c.SuspicionMult >= 1, "SuspicionMult %d must be at least 1", c.SuspicionMult)
	check(c.SuspicionMaxTimeoutMult >= 1, "SuspicionMaxTimeoutMult %d must be at least 1", c.SuspicionMaxTimeoutMult)
	check(c.AwarenessMaxMultiplier >= 1, "AwarenessMaxMultiplier %d must be at least 1", c.AwarenessMaxMultiplier)
	check(c.GossipInterval > 0, "GossipInterval %v must be positive", c.GossipInterval)
	check(c.GossipNodes >= 1, "GossipNodes %d must be at least 1", c.GossipNodes)
	check(c.RetransmitMult >= 1, "RetransmitMult %d must be at least 1", c.RetransmitMult)
	check(c.GossipToTheDeadTime >= 0, "GossipToTheDeadTime %v must not be negative", c.GossipToTheDeadTime)
	check(c.PushPullInterval >= 0, "PushPullInterval %v must not be negative", c.PushPullInterval)
	check(c.TCPTimeout > 0, "TCPTimeout %v must be positive", c.TCPTimeout)
	check(c.DeadNodeReclaimTime >= 0, "DeadNodeReclaimTime %v must not be negative", c.DeadNodeReclaimTime)
	check(c.ReconnectInterval >= 0, "ReconnectInterval %v must not be negative", c.ReconnectInterval)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("node config: %w", err)
	}
	return nil
}
