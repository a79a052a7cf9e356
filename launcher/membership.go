package launcher

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// membership is how an agent learns its place in the job, round after
// round: the policy of who runs which ranks, apart from the mechanism of
// running them (group.go) and the loop that reacts to events (agent.go).
type membership interface {
	// next completes the next rendezvous round and returns this node's
	// plan for it, including a running worker store when this node hosts
	// it. When the job already ended elsewhere it returns an error
	// wrapping ErrRendezvousClosed, or a *JobFailedError if it failed.
	next(ctx context.Context) (*plan, error)
	// watch reports a change of the job that ends the current round (a
	// node waiting to join, a node lost, the job closed), or nil.
	watch(ctx context.Context) (*change, error)
	// watchEvery is how often to call watch, given --monitor-interval.
	watchEvery(monitor time.Duration) time.Duration
	// failed records that the current round failed here (cause says
	// how) and reports whether a restart is left, counted for the whole
	// job.
	failed(ctx context.Context, p *plan, cause string) (restartsLeft bool, err error)
	// finish ends the job with this node's outcome: it waits for the
	// other nodes at the exit barrier after a success, then closes the
	// rendezvous so that no node starts another round.
	finish(ctx context.Context, p *plan, ok bool) error
	// leave takes this node out of the job (stopped by a signal).
	leave(ctx context.Context)
	// expel takes the node named node (a plan's nodeIDs entry) out of the
	// rendezvous on its behalf: it was found dead, and the survivors'
	// next round need not wait for its keep-alive to lapse.
	expel(ctx context.Context, node string) error
	// sawClosed tells the job that this node has seen it closed by another.
	sawClosed(ctx context.Context)
	// admit takes nodes waiting to join into the running round, one in
	// the place of each lost node of group ranks groupRanks (heal:
	// replacement nodes), in one write, and returns their identities in
	// that order. groupRanks must be every place of the round that no
	// member holds (else the error wraps rendezvous.ErrPlacesLeft: an
	// admitted node takes its place only in a whole round). It fails with
	// an error wrapping rendezvous.ErrNoWaitingNode, admitting none, when
	// fewer nodes wait than there are places.
	admit(ctx context.Context, groupRanks []int) ([]string, error)
	close()
}

// Errors of multi-node rendezvous that the CLI maps to exit codes.
var (
	// ErrRendezvousTimeout: the round did not complete in join_timeout,
	// or no rendezvous store answered in it. The rendezvous's own
	// sentinel: one error, whichever layer saw the time run out.
	ErrRendezvousTimeout = rendezvous.ErrRendezvousTimeout
	// ErrRendezvousClosed: the job had already ended when this node came.
	ErrRendezvousClosed = rendezvous.ErrRendezvousClosed
)

// JobFailedError is returned when the job failed without a local worker
// failing: on another node, or by losing a node, with no restart left.
// gorun exits with code 1, like a local failure.
type JobFailedError struct{ Reason string }

func (e *JobFailedError) Error() string { return "job failed: " + e.Reason }

// newMembership picks the membership the configuration asks for.
func newMembership(ctx context.Context, cfg *Config, log *zap.Logger, runID string) (membership, error) {
	if cfg.MaxNodes == 1 {
		return &singleNode{cfg: cfg, log: log, runID: runID}, nil
	}
	switch cfg.Rendezvous.Backend {
	case backendC10d, backendStatic:
		d, err := newDynamicNode(ctx, cfg, log, runID)
		if err != nil {
			return nil, err // not a typed nil in the interface
		}
		return d, nil
	case backendEtcd, backendEtcdV2:
		return newEtcdMembership(ctx, cfg, log, runID)
	}
	// Validate refuses other backends; this is for a Config it did not see.
	return nil, invalidf("--rdzv-backend %q is not a rendezvous backend (static, c10d, etcd-v2, etcd)", cfg.Rendezvous.Backend)
}

// plan is one round, seen from this node.
type plan struct {
	round       int
	assignments []Assignment // this node's workers
	env         WorkerEnv
	// store is the worker store this node hosts for the round, or nil.
	store *tcpstore.Server
	// members names the nodes of the round, by group rank (for logs and
	// failure reports). members, nodeIDs, nodes and gossip are nil in a
	// round planned from its summary (queue mode, where the plan needs no
	// member list: Config.needsMembers); the assignments have the sizes.
	members []string
	// nodeIDs are the members' rendezvous identities, by group rank: the
	// names a change's lost list uses.
	nodeIDs []string
	// nodes are the members' worker counts, by group rank: which global
	// ranks each node runs.
	nodes nodeRanks
	// gossip are the members' node-liveness identities, by group rank
	// (empty names on a single node).
	gossip []gossipPeer
	// barrierRanks are the group ranks of the nodes that meet at the exit
	// barrier: the members less those lost in shrink mode. nil means all
	// members.
	barrierRanks []int
	// late: this node was admitted into the running round in a lost
	// node's place (heal); its workers join the running group by a grow.
	late bool
}

// replace makes the admitted node the round's member of its group rank,
// in the lost node's place.
func (p *plan) replace(a admitted) {
	if a.groupRank >= len(p.nodeIDs) || a.groupRank >= len(p.members) {
		return // planned from a summary: no member list to mend
	}
	p.nodeIDs[a.groupRank] = a.id
	p.members[a.groupRank] = a.info.Addr
	if a.groupRank < len(p.gossip) {
		p.gossip[a.groupRank] = a.info.Gossip
	}
}

// nodeOfGossip returns the rendezvous identity of the member whose
// node-liveness name is name, if it is one of the round's.
func (p *plan) nodeOfGossip(name string) (string, bool) {
	for g, peer := range p.gossip {
		if peer.Name != "" && peer.Name == name && g < len(p.nodeIDs) {
			return p.nodeIDs[g], true
		}
	}
	return "", false
}

// atBarrier is the number of nodes the exit barrier waits for.
func (p *plan) atBarrier() int { return len(p.barrierGroup()) }

// barrierGroup returns the group ranks of the nodes that meet at the exit
// barrier.
func (p *plan) barrierGroup() []int {
	if p.barrierRanks != nil {
		return p.barrierRanks
	}
	n := len(p.members)
	if len(p.assignments) > 0 {
		n = p.assignments[0].GroupWorldSize
	}
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// release stops what the plan holds.
func (p *plan) release() {
	if p.store != nil {
		p.store.Close()
	}
}

// change is something that ends a running round, or, in shrink mode,
// changes it.
type change struct {
	waiting int      // nodes waiting to join (scale-up)
	lost    []string // nodes whose keep-alive lapsed
	// admitted are nodes taken into the running round in lost nodes'
	// places (membership.admit, by whichever node leads).
	admitted []admitted
	closed   bool // the job was closed by another node
	ok       bool // with closed: whether the job succeeded
	// storeLost: the rendezvous store stopped answering for longer than
	// the keep-alive window: its host is gone, and the job with it.
	storeLost bool
}

func (c *change) String() string {
	switch {
	case c.storeLost:
		return "the rendezvous store stopped answering (its host is gone)"
	case c.closed && c.ok:
		return "the job finished on the other nodes"
	case c.closed:
		return "the job failed on another node"
	case len(c.lost) > 0:
		return fmt.Sprintf("lost node(s) %v", c.lost)
	case len(c.admitted) > 0:
		return fmt.Sprintf("%d node(s) admitted in lost nodes' places", len(c.admitted))
	default:
		return fmt.Sprintf("%d node(s) waiting to join", c.waiting)
	}
}

// singleNode is the membership of a one-node job: no rendezvous store,
// ranks are local ranks, restarts are counted here.
type singleNode struct {
	cfg      *Config
	log      *zap.Logger
	runID    string
	restarts int
}

func (s *singleNode) next(context.Context) (*plan, error) {
	srv, env, err := s.startStore()
	if err != nil {
		return nil, err
	}
	nodes := nodeRanks{{nproc: s.cfg.NProcPerNode}}
	host, _ := os.Hostname()
	return &plan{round: s.restarts, assignments: assign(nodes, 0), env: env, store: srv,
		members: []string{host}, nodeIDs: []string{host}, nodes: nodes}, nil
}

// startStore starts the worker store: a fresh, empty TCPStore each
// attempt, so that every restart begins in a clean namespace whatever
// PyTorch the workers run (1.13 prefixes keys per attempt; newer versions
// do not).
//
// Where a TCP store's address was given (static: --rdzv-endpoint HOST:PORT
// or --master-addr and --master-port; c10d: --rdzv-endpoint), the store is
// served there, as torchrun's one node hosts its rendezvous store. An etcd
// endpoint is etcd's, and a file store's a path: then the workers, all of
// them local, find the store on loopback at a free port.
func (s *singleNode) startStore() (*tcpstore.Server, WorkerEnv, error) {
	listen, advertise := "127.0.0.1:0", "127.0.0.1"
	if r, rs := s.cfg.Rendezvous, s.cfg.rdzv; !r.Standalone && !IsEtcdBackend(r.Backend) && !rs.fileStore {
		host, port := rs.host, rs.port
		listen, advertise = net.JoinHostPort("", strconv.Itoa(port)), host
		if ip := net.ParseIP(host); ip != nil {
			// Where the workers are told to reach it, and only there.
			listen = net.JoinHostPort(ip.String(), strconv.Itoa(port))
		}
	}
	srv, err := tcpstore.Listen(listen, tcpstore.ServerConfig{Logger: s.log.Named("store")})
	if err != nil {
		return nil, WorkerEnv{}, localf("worker store on %s: %w", listen, err)
	}
	env := workerEnv(s.cfg, s.runID, advertise, srv.Addr().(*net.TCPAddr).Port, s.restarts, s.restarts)
	return srv, env, nil
}

func (s *singleNode) watch(context.Context) (*change, error)         { return nil, nil }
func (s *singleNode) watchEvery(monitor time.Duration) time.Duration { return monitor }

func (s *singleNode) failed(_ context.Context, _ *plan, _ string) (bool, error) {
	if s.restarts >= s.cfg.MaxRestarts {
		return false, nil
	}
	s.restarts++
	return true, nil
}

func (s *singleNode) finish(context.Context, *plan, bool) error { return nil }
func (s *singleNode) leave(context.Context)                     {}
func (s *singleNode) expel(context.Context, string) error       { return nil }
func (s *singleNode) admit(context.Context, []int) ([]string, error) {
	return nil, errors.New("a one-node job admits no node")
}
func (s *singleNode) sawClosed(context.Context) {}
func (s *singleNode) close()                    {}

// workerEnv is the WorkerEnv of a round whose worker store is at
// host:port.
func workerEnv(cfg *Config, runID, host string, port, restarts, generation int) WorkerEnv {
	return WorkerEnv{
		Role:         cfg.Role,
		RunID:        runID,
		MasterAddr:   host,
		MasterPort:   port,
		RestartCount: restarts,
		MaxRestarts:  cfg.MaxRestarts,
		StoreURL:     "tcp://" + net.JoinHostPort(host, strconv.Itoa(port)),
		Generation:   generation,
		OMPThreads:   ompThreads(cfg.NProcPerNode),
		OnFailure:    cfg.OnFailure,

		AgreementTimeout: cfg.AgreementTimeout,
		GrowTimeout:      cfg.GrowTimeout,
		SignalsToHandle:  signalList(cfg.SignalsToHandle),
		VirtualLocalRank: cfg.VirtualLocalRank,
		JobSecret:        cfg.JobSecret,
	}
}

// nodeRanks lists the nodes of a round in group-rank order with their
// worker counts; nodes may run different numbers of workers.
type nodeRanks []struct{ nproc int }

// offset is the first global rank node groupRank runs: the workers of the
// nodes before it.
func (n nodeRanks) offset(groupRank int) int {
	base := 0
	for i := range groupRank {
		base += n[i].nproc
	}
	return base
}

// ranksOf returns the global ranks node groupRank runs.
func (n nodeRanks) ranksOf(groupRank int) []int {
	base := n.offset(groupRank)
	out := make([]int, n[groupRank].nproc)
	for i := range out {
		out[i] = base + i
	}
	return out
}

// world is the number of ranks of all nodes.
func (n nodeRanks) world() int {
	w := 0
	for _, x := range n {
		w += x.nproc
	}
	return w
}

// assign gives the workers of node groupRank their ranks: global ranks are
// laid out node after node, in group-rank order.
func assign(nodes nodeRanks, groupRank int) []Assignment {
	return assignAt(nodes.offset(groupRank), nodes.world(), groupRank, len(nodes), nodes[groupRank].nproc)
}

// assignAt gives the nproc workers of node groupRank of size nodes their
// ranks, its first global rank being offset and the world world: what
// assign computes from every node's worker count, and a round's summary
// carries (queue mode).
func assignAt(offset, world, groupRank, size, nproc int) []Assignment {
	as := make([]Assignment, nproc)
	for i := range as {
		as[i] = Assignment{
			LocalRank: i, Rank: offset + i, RoleRank: offset + i,
			LocalWorldSize: nproc, WorldSize: world, RoleWorldSize: world,
			GroupRank: groupRank, GroupWorldSize: size,
		}
	}
	return as
}
