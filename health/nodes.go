package health

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// ErrNoSeedReached is returned by Join when none of the seeds could be
// joined (all unreachable, or of another Cluster).
var ErrNoSeedReached = errors.New("no seed reached")

// ErrNodesClosed is returned by Join and Leave after Close.
var ErrNodesClosed = errors.New("gossip member closed")

// Member is one agent in this member's view of the cluster.
type Member struct {
	Name string
	Addr string // gossip address, host:port
}

// Nodes is this agent's member of the gossip among the job's agents: the
// I/O around a nodeTracker. It reports peers that join, die or leave as
// Events (NodeJoined, NodeDead, NodeLeft) through Run.
//
// Lifecycle: StartNodes binds and starts gossiping; Addr is what the
// launcher publishes in its rendezvous record; Join, with the addresses the
// round published, connects the agents; Expect names the round's agents;
// at the end Leave (a graceful departure peers report as NodeLeft) and
// Close. Close without Leave is what a crash looks like to the peers: they
// declare this agent dead.
type Nodes struct {
	ml  *memberlist.Memberlist
	log *zap.Logger
	// name and addr are this member's, read once at start: memberlist
	// updates its own node record concurrently.
	name, addr string

	mu    sync.Mutex
	core  *nodeTracker
	queue []Event // observed, not yet delivered by Run

	wake chan struct{} // capacity 1: queue has grown

	// life serialises Leave and Close: memberlist panics on a Leave after
	// Shutdown.
	life    sync.Mutex
	closing chan struct{}  // closed by Close
	sends   sync.WaitGroup // departure announcements in flight, and reconnect
}

// leaveMsg, followed by the member's name, is the departure announcement a
// member sends each peer before it leaves. memberlist's own departure
// notice reaches the EventDelegate looking exactly like a death (v0.7 does
// not set Node.State there), so peers tell the two apart by this message.
const leaveMsg = "gorun/health leaving "

// StartNodes starts a gossip member configured by cfg (see
// DefaultNodeConfig): it binds its UDP and TCP ports and answers probes at
// once. It knows no peers until Join.
func StartNodes(cfg NodeConfig) (*Nodes, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		host, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("node name: %w", err)
		}
		cfg.Name = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	logger := cfg.Logger
	if logger == nil {
		logger = zap.NewNop()
	}
	logger = logger.With(zap.String("node", cfg.Name))
	n := &Nodes{
		log:     logger,
		core:    newNodeTracker(cfg.Name, cfg),
		wake:    make(chan struct{}, 1),
		closing: make(chan struct{}),
	}
	ml, err := memberlist.Create(memberlistConfig(cfg, n, logger))
	if err != nil {
		return nil, fmt.Errorf("start gossip member %s: %w", cfg.Name, err)
	}
	n.ml = ml
	local := ml.LocalNode()
	n.name, n.addr = local.Name, local.Address()
	logger.Debug("gossip member started", zap.String("addr", n.Addr()))
	if cfg.ReconnectInterval > 0 {
		n.sends.Add(1)
		go n.reconnect(cfg.ReconnectInterval)
	}
	return n, nil
}

// reconnect tries, every interval until Close, to join again one of the
// members of the round held dead, each in turn (NodeConfig.ReconnectInterval).
//
// One a tick, as Serf does: a join is a TCP exchange of the whole member
// state, and rejoining every member held dead every second cost a member
// up to N exchanges a second, on an overloaded host just when starved
// members are declared dead by the dozen. One that answers brings back, by
// the exchange and then gossip, what it knows, so a healed partition
// merges all the same.
func (n *Nodes) reconnect(interval time.Duration) {
	defer n.sends.Done()
	t := time.NewTicker(interval)
	defer t.Stop()
	for turn := 0; ; turn++ {
		select {
		case <-n.closing:
			return
		case <-t.C:
		}
		n.mu.Lock()
		addrs := n.core.deadAddrs()
		n.mu.Unlock()
		if len(addrs) == 0 || n.closed() {
			continue
		}
		addr := addrs[turn%len(addrs)]
		if _, err := n.ml.Join([]string{addr}); err == nil {
			n.log.Debug("rejoined a member held dead", zap.String("addr", addr))
		}
	}
}

func memberlistConfig(cfg NodeConfig, n *Nodes, logger *zap.Logger) *memberlist.Config {
	mc := memberlist.DefaultLANConfig()
	mc.Name = cfg.Name
	mc.Label = cfg.Cluster
	mc.BindAddr, mc.BindPort = cfg.BindAddr, cfg.BindPort
	if mc.BindAddr == "" {
		mc.BindAddr = "0.0.0.0"
	}
	mc.AdvertiseAddr, mc.AdvertisePort = cfg.AdvertiseAddr, cfg.AdvertisePort
	if mc.AdvertisePort == 0 {
		// memberlist fills it in only for BindPort 0.
		mc.AdvertisePort = cfg.BindPort
	}
	mc.ProbeInterval = cfg.ProbeInterval
	mc.ProbeTimeout = cfg.ProbeTimeout
	mc.IndirectChecks = cfg.IndirectChecks
	mc.SuspicionMult = cfg.SuspicionMult
	mc.SuspicionMaxTimeoutMult = cfg.SuspicionMaxTimeoutMult
	mc.AwarenessMaxMultiplier = cfg.AwarenessMaxMultiplier
	mc.GossipInterval = cfg.GossipInterval
	mc.GossipNodes = cfg.GossipNodes
	mc.RetransmitMult = cfg.RetransmitMult
	mc.GossipToTheDeadTime = cfg.GossipToTheDeadTime
	mc.PushPullInterval = cfg.PushPullInterval
	mc.TCPTimeout = cfg.TCPTimeout
	mc.DeadNodeReclaimTime = cfg.DeadNodeReclaimTime
	// Gossip messages are a few hundred bytes: compressing them only costs
	// CPU, which a busy agent needs to answer probes in time.
	mc.EnableCompression = false
	if len(cfg.SecretKey) > 0 {
		mc.SecretKey = cfg.SecretKey
		mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	}
	mc.Delegate = delegate{n}
	mc.Events = delegate{n}
	mc.Ping = delegate{n}
	mc.Logger = log.New(memberlistLog{logger.Named("memberlist"), cfg.OnRefused}, "", 0)
	return mc
}

// Name is this member's name.
func (n *Nodes) Name() string { return n.name }

// Addr is this member's gossip address (host:port), the seed peers Join.
func (n *Nodes) Addr() string { return n.addr }

// Join connects to the given seeds (gossip addresses, host:port, as the
// rendezvous published them; this member's own address is skipped), one
// after the other, each bounded by TCPTimeout, and returns how many it
// joined. Joining one live member is enough to learn the others by gossip;
// joining all of them is faster. It returns an error wrapping
// ErrNoSeedReached when it reached none (and there were seeds), and
// ctx.Err() if ctx ends first.
func (n *Nodes) Join(ctx context.Context, seeds []string) (int, error) {
	if n.closed() {
		return 0, ErrNodesClosed
	}
	self := n.Addr()
	var errs []error
	joined, tried := 0, 0
	for _, seed := range seeds {
		if seed == self {
			continue
		}
		if err := ctx.Err(); err != nil {
			return joined, err
		}
		tried++
		if _, err := n.ml.Join([]string{seed}); err != nil {
			n.log.Warn("gossip seed not reached", zap.String("seed", seed), zap.Error(err))
			errs = append(errs, err)
			continue
		}
		joined++
	}
	if tried > 0 && joined == 0 {
		return 0, fmt.Errorf("join gossip: %w: %w", ErrNoSeedReached, errors.Join(errs...))
	}
	return joined, nil
}

// Expect names the agents of the current rendezvous round: from now on
// only events about them are reported. Those among them already declared
// dead or gone are reported again at once (with the time they were first
// seen), so that the round learns of a loss that happened before it began.
// Expect(nil) reports every peer, the initial setting.
func (n *Nodes) Expect(names []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.enqueue(n.core.expect(names))
}

// Members returns the members this one believes alive (including those
// suspected but not yet declared dead), itself included, sorted by name.
//
// It reads the tracker's view, fed by memberlist's callbacks, which run
// under memberlist's own lock: memberlist's Members returns its live node
// records, whose fields it updates concurrently, so reading them here
// would race.
func (n *Nodes) Members() []Member {
	n.mu.Lock()
	out := make([]Member, 0, len(n.core.peers)+1)
	for name, p := range n.core.peers {
		if p.state == nodeAlive {
			out = append(out, Member{Name: name, Addr: p.addr})
		}
	}
	n.mu.Unlock()
	out = append(out, Member{Name: n.Name(), Addr: n.Addr()})
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Run sends every event observed — since StartNodes, in order — on events
// until ctx is done (it returns ctx.Err()) or the Nodes is closed (it
// returns nil). Events not yet sent stay queued for the next Run. Run does
// not close the Nodes: call Leave, then Close.
func (n *Nodes) Run(ctx context.Context, events chan<- Event) error {
	for {
		n.mu.Lock()
		batch := n.queue
		n.queue = nil
		n.mu.Unlock()
		for i, ev := range batch {
			select {
			case events <- ev:
				continue
			case <-ctx.Done():
			case <-n.closing:
			}
			n.mu.Lock()
			n.queue = slices.Concat(batch[i:], n.queue)
			n.mu.Unlock()
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return nil
		}
		select {
		case <-n.wake:
		case <-ctx.Done():
			return ctx.Err()
		case <-n.closing:
			return nil
		}
	}
}

// Leave announces to the peers that this member leaves, and waits up to
// timeout (which must be positive) for the announcement to go out; the
// peers report NodeLeft, not NodeDead. Close it afterwards.
//
// The announcement goes to every member this one believes alive, each over
// a TCP connection of its own, before memberlist's departure notice is
// gossiped: a peer it cannot reach then (cut off, or joined a moment ago)
// reports the departure as NodeDead.
func (n *Nodes) Leave(timeout time.Duration) error {
	n.life.Lock()
	defer n.life.Unlock()
	if n.closed() {
		return ErrNodesClosed
	}
	deadline := time.Now().Add(timeout)
	n.announceLeave(deadline)
	// memberlist waits forever for a timeout of 0.
	if err := n.ml.Leave(max(time.Until(deadline), time.Millisecond)); err != nil {
		return fmt.Errorf("leave gossip: %w", err)
	}
	return nil
}

// announceLeave sends leaveMsg to every other live member and waits for
// the sends until deadline; Close waits for any still in flight.
func (n *Nodes) announceLeave(deadline time.Time) {
	self := n.Name()
	msg := []byte(leaveMsg + self)
	sent := make(chan struct{}, len(n.ml.Members()))
	pending := 0
	for _, peer := range n.ml.Members() {
		if peer.Name == self {
			continue
		}
		pending++
		n.sends.Go(func() {
			if err := n.ml.SendReliable(peer, msg); err != nil {
				n.log.Warn("departure announcement not sent", zap.String("peer", peer.Name), zap.Error(err))
			}
			sent <- struct{}{}
		})
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for ; pending > 0; pending-- {
		select {
		case <-sent:
		case <-timer.C:
			n.log.Warn("departure announcements still in flight at the leave timeout", zap.Int("pending", pending))
			return
		}
	}
}

// Close stops the member at once, without leaving: to its peers it is a
// crash. It stops Run. Closing again does nothing.
func (n *Nodes) Close() error {
	n.life.Lock()
	defer n.life.Unlock()
	if n.closed() {
		return nil
	}
	close(n.closing)
	err := n.ml.Shutdown()
	n.sends.Wait() // each ends within TCPTimeout
	if err != nil {
		return fmt.Errorf("stop gossip member: %w", err)
	}
	return nil
}

func (n *Nodes) closed() bool {
	select {
	case <-n.closing:
		return true
	default:
		return false
	}
}

// enqueue queues events for Run; n.mu must be held.
func (n *Nodes) enqueue(evs []Event) {
	if len(evs) == 0 {
		return
	}
	n.queue = append(n.queue, evs...)
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// delegate receives memberlist's callbacks. memberlist calls them holding
// its own locks, so they only record and queue: they never block.
type delegate struct{ n *Nodes }

// NotifyMsg receives user messages: departure announcements.
func (d delegate) NotifyMsg(b []byte) {
	name, ok := strings.CutPrefix(string(b), leaveMsg)
	if !ok {
		return
	}
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	d.n.core.announcedLeave(name)
}

// This package gossips no metadata, broadcasts or state of its own.
func (d delegate) NodeMeta(int) []byte                 { return nil }
func (d delegate) GetBroadcasts(int, int) [][]byte     { return nil }
func (d delegate) LocalState(bool) []byte              { return nil }
func (d delegate) MergeRemoteState(buf []byte, _ bool) {}

func (d delegate) NotifyJoin(node *memberlist.Node) {
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	d.n.enqueue(d.n.core.joined(node.Name, node.Address(), time.Now()))
}

func (d delegate) NotifyLeave(node *memberlist.Node) {
	left := node.State == memberlist.StateLeft
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	d.n.enqueue(d.n.core.gone(node.Name, node.Address(), left, time.Now()))
}

// NotifyUpdate reports a member's new metadata; this package sets none.
func (d delegate) NotifyUpdate(*memberlist.Node) {}

func (d delegate) AckPayload() []byte { return nil }

func (d delegate) NotifyPingComplete(node *memberlist.Node, rtt time.Duration, _ []byte) {
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	d.n.core.acked(node.Name, rtt, time.Now())
}

// memberlistLog turns memberlist's log lines ("[LEVEL] memberlist: text")
// into debug entries: its errors are routine here (a dead peer's failed
// probes), and verdicts reach the launcher as Events.
// It also finds the refusals among them for onRefused.
type memberlistLog struct {
	log       *zap.Logger
	onRefused func(from, why string)
}

func (w memberlistLog) Write(p []byte) (int, error) {
	ce := w.log.Check(zap.DebugLevel, "")
	if ce == nil && w.onRefused == nil {
		return len(p), nil
	}
	level, msg := parseMemberlistLog(string(p))
	if w.onRefused != nil && refusal(msg) {
		w.onRefused(refusedFrom(msg), msg)
	}
	if ce != nil {
		ce.Message = msg
		ce.Write(zap.String("memberlist_level", level))
	}
	return len(p), nil
}

// refusalMarks are what memberlist (v0.7) logs when it drops a packet or
// stream it will not hear: its label, or its encryption, is not ours.
var refusalMarks = []string{
	"Decrypt packet failed",
	"unacceptable label",
	"No installed keys could decrypt",
	"remote state is not encrypted",
	"remote state is encrypted and encryption is not configured",
}

// refusedFrom is the host a memberlist message names its sender by
// ("… from=10.0.0.9:7946"), "" when it names none.
func refusedFrom(msg string) string {
	i := strings.LastIndex(msg, "from=")
	if i < 0 {
		return ""
	}
	from := strings.TrimSpace(msg[i+len("from="):])
	if host, _, err := net.SplitHostPort(from); err == nil {
		return host
	}
	return from
}

// refusal reports whether a memberlist log message says it refused a
// packet or stream.
func refusal(msg string) bool {
	for _, m := range refusalMarks {
		if strings.Contains(msg, m) {
			return true
		}
	}
	return false
}

// parseMemberlistLog splits "[WARN] memberlist: text\n" into "WARN" and
// "text".
func parseMemberlistLog(line string) (level, msg string) {
	msg = strings.TrimSpace(line)
	if rest, ok := strings.CutPrefix(msg, "["); ok {
		if l, m, ok := strings.Cut(rest, "]"); ok {
			level, msg = l, strings.TrimSpace(m)
		}
	}
	return level, strings.TrimPrefix(msg, "memberlist: ")
}
