package launcher

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/health"
)

// gossipPeer is one agent's gossip identity, published in its rendezvous
// record.
type gossipPeer struct {
	Name string `json:"gossip_name,omitempty"`
	Addr string `json:"gossip_addr,omitempty"`
}

// gossip is node liveness among the job's agents (health.Nodes, on
// hashicorp/memberlist): a node that stops answering probes — crashed,
// frozen, cut off — is declared dead in well under a second, where the
// rendezvous keep-alive takes its whole window. It runs in multi-node
// shrink mode, and in restart mode with --node-liveness on, started before
// the rendezvous so that its address is in this node's record, and joined
// to each round (a few of its agents; gossip brings the rest). A dead node
// is reported to the survivors' agreement in shrink mode; in restart mode
// the survivors take it out of the rendezvous and re-rendezvous at once.
type gossip struct {
	log    *zap.Logger
	nodes  *health.Nodes
	events chan health.Event
	ctx    context.Context // the member's life: ends at close
	cancel context.CancelFunc
	done   chan struct{}
	joins  sync.WaitGroup // joins under way (join)
	once   sync.Once
}

// gossipJoinTimeout bounds joining a round's peers; a node that cannot be
// reached still has the rendezvous keep-alive behind it.
const gossipJoinTimeout = 5 * time.Second

// startGossip starts this agent's gossip member, advertising an address
// of the host addr names (--local-addr, or the host name). With a job
// secret every message is encrypted and authenticated under a key derived
// from it: an agent without it can neither join nor declare anyone dead.
//
// Gossip the member refuses (another key, none, another job's label) is
// counted by refused("gossip") and logged once per source address.
func startGossip(cfg NodeLivenessConfig, log *zap.Logger, runID, addr string, secret Secret, refused func(kind string)) (*gossip, error) {
	ip, err := advertiseIP(addr)
	if err != nil {
		return nil, fmt.Errorf("node liveness: %w", err)
	}
	nc := health.DefaultNodeConfig()
	nc.Name = fmt.Sprintf("%s-%d", addr, os.Getpid())
	nc.Cluster = runID
	nc.AdvertiseAddr = ip
	if cfg.ProbeInterval > 0 {
		nc.ProbeInterval = cfg.ProbeInterval
		nc.ProbeTimeout = cfg.ProbeInterval / 2
	}
	if cfg.SuspicionMult > 0 {
		nc.SuspicionMult = cfg.SuspicionMult
	}
	if secret != nil {
		nc.SecretKey = secret.derive("gossip")
	}
	nc.Logger = log.Named("gossip")
	nc.OnRefused = refusedGossip(log, refused)
	nodes, err := health.StartNodes(nc)
	if err != nil {
		return nil, fmt.Errorf("node liveness: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	g := &gossip{log: log, nodes: nodes, events: make(chan health.Event, 64), ctx: ctx, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(g.done)
		nodes.Run(ctx, g.events)
	}()
	return g, nil
}

// advertiseIP resolves addr to the IP address peers reach this node at.
func advertiseIP(addr string) (string, error) {
	if ip := net.ParseIP(addr); ip != nil {
		return ip.String(), nil
	}
	ips, err := net.LookupIP(addr)
	if err != nil || len(ips) == 0 {
		return "", fmt.Errorf("no address for %q (set --local-addr): %v", addr, err)
	}
	for _, ip := range ips {
		if ip.To4() != nil {
			return ip.String(), nil
		}
	}
	return ips[0].String(), nil
}

// self is what this node publishes.
func (g *gossip) self() gossipPeer {
	if g == nil {
		return gossipPeer{}
	}
	return gossipPeer{Name: g.nodes.Name(), Addr: g.nodes.Addr()}
}

// gossipSeeds is how many of the round's other agents a member joins. One
// live one is enough to learn the rest (the join's state exchange, then
// gossip); a few guard against a dead or slow one. A join is a TCP
// exchange of the whole member state: every agent joining every other was
// O(N) exchanges of O(N) bytes an agent, and at 256 agents on two cores
// the start-up's 65,000 exchanges starved the gossip into false deaths
// and kept workers from starting.
const gossipSeeds = 3

// join makes the round's agents this member's peers: all of them are
// expected at once, and it joins the gossipSeeds that follow it in the
// round's order (seedsAfter) in the background, until ctx or the member
// ends. The workers need not wait for it: a join is TCP exchanges, slow on
// a loaded host, and until it completes a lost node is still found by the
// others' gossip or the rendezvous keep-alive.
func (g *gossip) join(ctx context.Context, peers []gossipPeer) {
	g.expect(peers)
	seeds := seedsAfter(g.nodes.Name(), peers, gossipSeeds)
	jctx, cancel := context.WithTimeout(g.ctx, gossipJoinTimeout)
	stop := context.AfterFunc(ctx, cancel)
	g.joins.Add(1)
	go func() {
		defer g.joins.Done()
		defer stop()
		defer cancel()
		if _, err := g.nodes.Join(jctx, seeds); err != nil && g.ctx.Err() == nil && ctx.Err() == nil {
			g.log.Warn("node liveness: cannot reach the round's other agents; lost nodes are found by the rendezvous keep-alive only", zap.Error(err))
		}
	}()
}

// expect makes peers the agents whose loss this member reports: the
// round's, and again when a node is admitted into the running round in a
// lost node's place (heal), which joins the gossip itself. Without it the
// member went on expecting the lost node's name, and a replacement lost
// in its turn was found only by the rendezvous keep-alive, its whole
// window (15 s) later.
func (g *gossip) expect(peers []gossipPeer) {
	if g == nil {
		return
	}
	var names []string
	for _, p := range peers {
		if p.Name != "" {
			names = append(names, p.Name)
		}
	}
	g.nodes.Expect(names)
}

// seedsAfter is the gossip addresses of up to k of peers that follow self
// in their order, wrapping round (from the first when self is not among
// them): each agent's joins go to its own successors, so no agent is
// everybody's seed and the joins link the round in a ring.
func seedsAfter(self string, peers []gossipPeer, k int) []string {
	var ring []gossipPeer
	at := -1
	for _, p := range peers {
		if p.Name == self {
			at = len(ring)
		} else if p.Name != "" {
			ring = append(ring, p)
		}
	}
	if at < 0 {
		at = 0
	}
	k = min(k, len(ring))
	seeds := make([]string, 0, k)
	for i := range k {
		seeds = append(seeds, ring[(at+i)%len(ring)].Addr)
	}
	return seeds
}

// close leaves the gossip (graceful: the peers see a departure, not a
// death) and stops the member.
func (g *gossip) close(graceful bool) {
	if g == nil {
		return
	}
	g.once.Do(func() {
		if graceful {
			g.nodes.Leave(time.Second)
		}
		g.cancel()
		g.nodes.Close()
		<-g.done
		g.joins.Wait() // each seed's exchange ends within its TCPTimeout
	})
}

// eventsOrNil is the member's event stream, nil (never ready) without
// gossip.
func (g *gossip) eventsOrNil() <-chan health.Event {
	if g == nil {
		return nil
	}
	return g.events
}

// refusedGossip counts each gossip packet or stream the member refused and
// logs the first from each source: a rogue or misconfigured host sends
// many.
func refusedGossip(log *zap.Logger, refused func(kind string)) func(from, why string) {
	var mu sync.Mutex
	seen := map[string]bool{}
	return func(from, why string) {
		refused("gossip")
		mu.Lock()
		first := !seen[from] && len(seen) < maxRefusedSources
		if first {
			seen[from] = true
		}
		mu.Unlock()
		if first {
			log.Warn("ignored gossip that fails the job secret's check or is another job's (sent without the secret, under another, "+
				"or altered); further refusals from this source are counted in /metrics only", zap.String("from", from), zap.String("why", why))
		}
	}
}

// maxRefusedSources bounds the sources whose first refusal is logged:
// a flood from spoofed addresses must not grow the agent's memory.
const maxRefusedSources = 64
