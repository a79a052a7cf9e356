package launcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/filestore"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

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

// dynamicNode is the membership of a multi-node job, run by gorun's
// dynamic rendezvous over a store every agent reaches:
//
//   - c10d: a TCPStore at --rdzv-endpoint (default port 29400), hosted by
//     the agent that can bind it (is_host, or inferred as torchrun does), or
//     a FileStore at that path with store_type=file;
//   - static: the same at --master-addr:--master-port, hosted by node rank
//     0, with min = max = --nnodes and group ranks = node ranks.
//
// Group rank 0 hosts each round's worker store and publishes its address
// in the round's keys. Restarts are counted for the whole job in the store.
type dynamicNode struct {
	cfg   *Config
	log   *zap.Logger
	runID string
	me    rendezvous.NodeDesc
	addr  string // the address this node advertises
	// storeHost serves the rendezvous store when this node hosts it.
	storeHost *tcpstore.Server
	store     rendezvous.Store // every agent's view of the rendezvous store
	dyn       *rendezvous.Dynamic
	round     rendezvous.Round
	// storeOutlivesHosts: the rendezvous store lives on without any
	// agent (etcd), so nobody waits for the others to see the job closed
	// (seenClosed).
	storeOutlivesHosts bool
	// lastSeen is when the rendezvous store last answered a watch: a store
	// silent for longer than the keep-alive window means its host is gone.
	lastSeen time.Time
}

// nodeInfo is what each node publishes in the rendezvous.
type nodeInfo struct {
	NProc    int    `json:"nproc"`
	Addr     string `json:"addr"`
	NodeRank int    `json:"node_rank"` // static only
	// Gossip is the agent's node-liveness member.
	Gossip gossipPeer `json:"gossip"`
}

// Keys in the rendezvous store, besides the rendezvous's own.
func (d *dynamicNode) restartsKey() string { return "gorun." + d.runID + ".restarts" }
func (d *dynamicNode) outcomeKey() string  { return "gorun." + d.runID + ".outcome" }

// seenClosedKey counts the nodes that have seen the job closed: the
// rendezvous store's host waits for them before it takes the store away.
// A counter, not the nodes leaving the shared state: N nodes leaving at once
// would fight over one compare-set.
func (d *dynamicNode) seenClosedKey() string { return "gorun." + d.runID + ".seen_closed" }

const (
	outcomeSucceeded = "succeeded"
	outcomeFailed    = "failed"
)

func newDynamicNode(ctx context.Context, cfg *Config, log *zap.Logger, runID string) (*dynamicNode, error) {
	d, dcfg, err := newDynamicBase(cfg, log, runID)
	if err != nil {
		return nil, err
	}
	if err := d.connect(ctx, cfg.Rendezvous.Backend == backendStatic, dcfg.JoinTimeout); err != nil {
		d.close()
		return nil, err
	}
	if err := d.start(ctx, dcfg); err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

// newDynamicBase returns a dynamicNode with this node's identity, and the
// rendezvous's configuration, before any store is reached.
func newDynamicBase(cfg *Config, log *zap.Logger, runID string) (*dynamicNode, rendezvous.DynamicConfig, error) {
	r := cfg.Rendezvous
	d := &dynamicNode{cfg: cfg, log: log, runID: runID}
	d.addr = r.LocalAddr
	if d.addr == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, rendezvous.DynamicConfig{}, fmt.Errorf("this node's address (set --local-addr): %w", err)
		}
		d.addr = h
	}
	d.me = rendezvous.NodeDesc{Addr: d.addr, Pid: os.Getpid()}

	minNodes, maxNodes := cfg.MinNodes, cfg.MaxNodes
	dcfg := cfg.rdzv.dynamic
	dcfg.OnProgress = func(p rendezvous.Progress) { logProgress(log, minNodes, maxNodes, p) }
	return d, dcfg, nil
}

// start creates the job's restart counter and this node's handle on the
// rendezvous, once d.store is up.
func (d *dynamicNode) start(ctx context.Context, dcfg rendezvous.DynamicConfig) error {
	// Create the job's restart counter now, before joining, so that after
	// a round completes one MultiGet reads it with rank 0's worker store
	// (fillPlan): the round trips after completion are what a large job
	// waits for, every node asking the one store host at once.
	if _, err := d.store.CompareSet(ctx, d.restartsKey(), nil, []byte("0")); err != nil {
		return fmt.Errorf("rendezvous store: %w", err)
	}
	data, _ := json.Marshal(nodeInfo{NProc: d.cfg.NProcPerNode, Addr: d.addr, NodeRank: d.cfg.Rendezvous.NodeRank, Gossip: d.cfg.gossip})
	var err error
	if d.dyn, err = rendezvous.NewDynamic(d.store, d.me, data, dcfg); err != nil {
		return fmt.Errorf("rendezvous: %w", err)
	}
	return nil
}

// logProgress prints one rendezvous progress line: who joined, how many
// are still awaited, when the last call ends.
func logProgress(log *zap.Logger, minNodes, maxNodes int, p rendezvous.Progress) {
	names := func(ns []rendezvous.NodeDesc) []string {
		out := make([]string, len(ns))
		for i, n := range ns {
			out[i] = n.String()
		}
		return out
	}
	fields := []zap.Field{
		zap.Int("round", p.Round), zap.Strings("joined", names(p.Participants)),
		zap.Int("awaited_for_min", max(0, minNodes-len(p.Participants))), zap.Int("max", maxNodes),
	}
	if len(p.Waiting) > 0 {
		fields = append(fields, zap.Strings("waiting_for_next_round", names(p.Waiting)))
	}
	if !p.LastCall.IsZero() && !p.Complete {
		fields = append(fields, zap.Time("last_call_ends", p.LastCall))
	}
	msg := "rendezvous in progress"
	if p.Complete {
		msg = "rendezvous complete"
	}
	log.Info(msg, fields...)
}

// connect opens the rendezvous store, hosting it first when this node is
// the host.
func (d *dynamicNode) connect(ctx context.Context, static bool, joinTimeout time.Duration) error {
	rs := d.cfg.rdzv
	if rs.fileStore {
		fcfg := filestore.DefaultConfig()
		fcfg.Timeout = rs.readTimeout
		s, err := filestore.Open(ctx, d.cfg.Rendezvous.Endpoint, fcfg)
		if err != nil {
			return fmt.Errorf("rendezvous FileStore %s: %w", d.cfg.Rendezvous.Endpoint, err)
		}
		d.store = s
		return nil
	}
	endpoint := net.JoinHostPort(rs.host, strconv.Itoa(rs.port))
	isHost := rs.isHost
	if !static && !rs.isHostGiven {
		isHost = isLocalHost(rs.host)
	}
	if isHost {
		srv, err := tcpstore.Listen(net.JoinHostPort("", strconv.Itoa(rs.port)), tcpstore.ServerConfig{Logger: d.log.Named("rdzv-store")})
		switch {
		case err == nil:
			d.storeHost = srv
			d.log.Info("hosting the rendezvous store", zap.String("endpoint", endpoint))
		case rs.isHostGiven:
			return fmt.Errorf("hosting the rendezvous store (is_host=%s) on port %d: %w", d.cfg.Rendezvous.Conf["is_host"], rs.port, err)
		default:
			// torchrun's fallback: another agent on this host got there
			// first, so be its client.
			d.log.Info("the rendezvous store is hosted by another agent; joining as a client",
				zap.String("endpoint", endpoint), zap.Error(err))
		}
	}
	dctx, cancel := context.WithTimeout(ctx, joinTimeout)
	defer cancel()
	c, err := tcpstore.Dial(dctx, endpoint, tcpstore.ClientConfig{Timeout: rs.readTimeout})
	if errors.Is(err, rendezvous.ErrTimeout) {
		return fmt.Errorf("%w: no rendezvous store answered at %s within join_timeout %v: %w", ErrRendezvousTimeout, endpoint, joinTimeout, err)
	}
	if err != nil {
		return fmt.Errorf("rendezvous store %s: %w", endpoint, err)
	}
	d.store = c
	return nil
}

func (d *dynamicNode) next(ctx context.Context) (*plan, error) {
	// Every node starts its worker store before joining and publishes
	// where it is; the round's group rank 0 keeps its own and the others
	// close theirs. So when the round completes nobody waits for rank 0
	// to be scheduled and start one: its address is already there.
	srv, err := d.offerWorkerStore(ctx)
	if err != nil {
		return nil, err
	}
	round, err := d.join(ctx)
	if err != nil {
		srv.Close()
		return nil, err
	}
	p := &plan{round: round.Number}
	if err := d.fillPlan(ctx, p, round, srv); err != nil {
		p.release()
		return nil, err
	}
	return p, nil
}

// join completes the next round, turning the rendezvous's errors into the
// agent's.
func (d *dynamicNode) join(ctx context.Context) (rendezvous.Round, error) {
	round, err := d.dyn.Next(ctx)
	switch {
	case errors.Is(err, rendezvous.ErrRendezvousClosed):
		d.seenClosed(ctx)
		return round, d.closedError(ctx)
	case err != nil:
		return round, fmt.Errorf("rendezvous: %w", err)
	}
	d.round = round
	d.lastSeen = time.Now()
	return round, nil
}

// fillPlan turns a completed round into this node's plan. srv is the worker
// store this node offered; it stays up only on group rank 0.
func (d *dynamicNode) fillPlan(ctx context.Context, p *plan, round rendezvous.Round, srv *tcpstore.Server) error {
	infos, ids, groupRank, rank0, err := d.order(round)
	if err != nil {
		srv.Close()
		return err
	}
	if groupRank == 0 {
		p.store = srv
	} else {
		srv.Close()
	}
	vals, err := d.store.MultiGet(ctx, d.restartsKey(), d.workerStoreKey(rank0))
	if err != nil {
		return fmt.Errorf("reading the restart count and group rank 0's worker store: %w", err)
	}
	restarts, err := rendezvous.ParseCounter(vals[0])
	if err != nil {
		return fmt.Errorf("rendezvous store: restart count: %w", err)
	}
	v := vals[1]
	host, portS, err := net.SplitHostPort(string(v))
	if err != nil {
		return fmt.Errorf("group rank 0 published worker store %q: %w", v, err)
	}
	port, err := strconv.Atoi(portS)
	if err != nil {
		return fmt.Errorf("group rank 0 published worker store %q: %w", v, err)
	}
	layout(p, infos, ids, groupRank)
	p.env = workerEnv(d.cfg, d.runID, host, port, int(restarts), round.Number)
	return nil
}

// layout fills in the plan's members and this node's assignments from the
// round's infos and node identities, in group-rank order.
func layout(p *plan, infos []nodeInfo, ids []string, groupRank int) {
	nodes := make(nodeRanks, len(infos))
	for i, in := range infos {
		nodes[i].nproc = in.NProc
		p.members = append(p.members, in.Addr)
		p.gossip = append(p.gossip, in.Gossip)
	}
	p.nodeIDs, p.nodes = ids, nodes
	p.assignments = assign(nodes, groupRank)
}

// order returns the members' published infos and identities in group-rank
// order and this node's group rank: the round's ranks for c10d, the node
// ranks for static.
func (d *dynamicNode) order(round rendezvous.Round) ([]nodeInfo, []string, int, rendezvous.NodeDesc, error) {
	type member struct {
		info nodeInfo
		node rendezvous.NodeDesc
		me   bool
	}
	ms := make([]member, len(round.Members))
	for i, m := range round.Members {
		if err := json.Unmarshal(m.Data, &ms[i].info); err != nil {
			return nil, nil, 0, rendezvous.NodeDesc{}, fmt.Errorf("rendezvous: node %s published %q: %w", m.Node, m.Data, err)
		}
		ms[i].node, ms[i].me = m.Node, m.Node == d.me
	}
	if d.cfg.Rendezvous.Backend == backendStatic {
		slices.SortFunc(ms, func(a, b member) int { return a.info.NodeRank - b.info.NodeRank })
		for i, m := range ms {
			if m.info.NodeRank != i {
				return nil, nil, 0, rendezvous.NodeDesc{}, invalidf("static rendezvous: node ranks %v are not 0..%d (is --node-rank unique on each node?)",
					nodeRanksOf(ms, func(m member) int { return m.info.NodeRank }), len(ms)-1)
			}
		}
	}
	infos := make([]nodeInfo, len(ms))
	ids := make([]string, len(ms))
	me := -1
	for i, m := range ms {
		infos[i], ids[i] = m.info, m.node.String()
		if m.me {
			me = i
		}
	}
	if me < 0 {
		return nil, nil, 0, rendezvous.NodeDesc{}, fmt.Errorf("rendezvous: round %d does not include this node %s", round.Number, d.me)
	}
	return infos, ids, me, ms[0].node, nil
}

func nodeRanksOf[T any](xs []T, f func(T) int) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = f(x)
	}
	return out
}

// workerStoreKey is where node publishes the worker store it offers.
func (d *dynamicNode) workerStoreKey(node rendezvous.NodeDesc) string {
	return "gorun." + d.runID + ".worker_store/" + node.String()
}

// offerWorkerStore starts a fresh, empty worker store on this node and
// publishes its address, to be used if this node becomes group rank 0.
func (d *dynamicNode) offerWorkerStore(ctx context.Context) (*tcpstore.Server, error) {
	srv, err := tcpstore.Listen(":0", tcpstore.ServerConfig{Logger: d.log.Named("store")})
	if err != nil {
		return nil, fmt.Errorf("worker store: %w", err)
	}
	addr := net.JoinHostPort(d.addr, strconv.Itoa(srv.Addr().(*net.TCPAddr).Port))
	if err := d.store.Set(ctx, d.workerStoreKey(d.me), []byte(addr)); err != nil {
		srv.Close()
		return nil, fmt.Errorf("publishing the worker store: %w", err)
	}
	return srv, nil
}

// watchEvery polls the job every --monitor-interval, but no more often than
// a fifth of the keep-alive interval: every poll reads the whole shared
// state (all nodes), so at torchrun's defaults (0.1 s, 5 s) a 1000-node job
// would otherwise make 10,000 reads of a ~100 KB state a second. A lost
// node is noticed within its keep-alive window plus one poll.
func (d *dynamicNode) watchEvery(monitor time.Duration) time.Duration {
	return max(monitor, d.dyn.Config().KeepAliveInterval/5)
}

func (d *dynamicNode) watch(ctx context.Context) (*change, error) {
	cfg := d.dyn.Config()
	window := cfg.KeepAliveInterval * time.Duration(cfg.KeepAliveMaxAttempt)
	// A poll must not block on a store that is gone (the client would
	// retry connecting for the whole read_timeout).
	wctx, cancel := context.WithTimeout(ctx, window)
	defer cancel()
	st, err := d.dyn.Status(wctx)
	if err != nil {
		if time.Since(d.lastSeen) > window {
			return &change{closed: true, storeLost: true}, nil
		}
		return nil, err
	}
	d.lastSeen = time.Now()
	switch {
	case st.Closed:
		ok, _ := d.outcome(ctx)
		return &change{closed: true, ok: ok}, nil
	case len(st.Lost) > 0:
		c := &change{waiting: st.Waiting}
		for _, n := range st.Lost {
			c.lost = append(c.lost, n.String())
		}
		return c, nil
	case st.Waiting > 0:
		return &change{waiting: st.Waiting}, nil
	}
	return nil, nil
}

// failed counts the round's failure once for the whole job: the first node
// to report it increments the job's restart counter, the others read it.
func (d *dynamicNode) failed(ctx context.Context, p *plan, cause string) (bool, error) {
	rs := d.round.Store(d.store, d.runID)
	me := []byte(d.me.String())
	got, err := rs.CompareSet(ctx, "failed", nil, me)
	if err != nil {
		return false, fmt.Errorf("rendezvous store: %w", err)
	}
	delta := int64(0)
	if string(got) == string(me) {
		delta = 1
		d.log.Warn("round failed; counting a restart for the job", zap.Int("round", p.round), zap.String("cause", cause))
	}
	n, err := d.store.Add(ctx, d.restartsKey(), delta)
	if err != nil {
		return false, fmt.Errorf("rendezvous store: %w", err)
	}
	return n <= int64(d.cfg.MaxRestarts), nil
}

func (d *dynamicNode) finish(ctx context.Context, p *plan, ok bool) error {
	if ok {
		// torchrun's exit barrier: a node that finishes first must not
		// look like a node lost to the others.
		bctx, cancel := context.WithTimeout(ctx, d.cfg.ExitBarrierTimeout)
		err := d.round.Store(d.store, d.runID).Barrier(bctx, "exit_barrier", int64(p.atBarrier()))
		cancel()
		if err != nil {
			d.log.Warn("exit barrier: not every node finished in time", zap.Error(err))
		}
	}
	outcome := outcomeFailed
	if ok {
		outcome = outcomeSucceeded
	}
	// The first outcome stays; later ones agree or come too late.
	if _, err := d.store.CompareSet(ctx, d.outcomeKey(), nil, []byte(outcome)); err != nil {
		d.log.Debug("recording the job's outcome", zap.Error(err))
	}
	if err := d.dyn.SetClosed(ctx); err != nil {
		d.log.Debug("closing the rendezvous", zap.Error(err))
	}
	d.seenClosed(ctx)
	if d.storeHost != nil {
		d.waitOthersSawClose(ctx, p.atBarrier())
	}
	return nil
}

// seenClosed tells the store's host that this node has seen the job
// closed and needs the store no more.
func (d *dynamicNode) seenClosed(ctx context.Context) {
	if d.storeOutlivesHosts {
		return // a counter every node would fight over, for nobody
	}
	if _, err := d.store.Add(ctx, d.seenClosedKey(), 1); err != nil {
		d.log.Debug("acknowledging the closed job", zap.Error(err))
	}
}

func (d *dynamicNode) sawClosed(ctx context.Context) { d.seenClosed(ctx) }

// waitOthersSawClose keeps the rendezvous store up, after the job closed,
// until the round's other nodes have seen the end (or a keep-alive window
// passed): the store dies with its host, and a node that cannot read the
// store cannot tell a finished job from a lost one.
func (d *dynamicNode) waitOthersSawClose(ctx context.Context, members int) {
	cfg := d.dyn.Config()
	deadline := time.Now().Add(cfg.KeepAliveInterval*time.Duration(cfg.KeepAliveMaxAttempt) + cfg.KeepAliveInterval)
	for time.Now().Before(deadline) {
		n, err := d.store.Add(ctx, d.seenClosedKey(), 0)
		if err != nil || n >= int64(members) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	d.log.Warn("closing the rendezvous store while other nodes may still need it")
}

// outcome reads how the job ended, as the closing node recorded it.
func (d *dynamicNode) outcome(ctx context.Context) (ok bool, known bool) {
	if present, err := d.store.Check(ctx, d.outcomeKey()); err != nil || !present {
		return false, false
	}
	v, err := d.store.Get(ctx, d.outcomeKey())
	if err != nil {
		return false, false
	}
	return string(v) == outcomeSucceeded, true
}

// closedError explains a closed rendezvous met while joining.
func (d *dynamicNode) closedError(ctx context.Context) error {
	ok, known := d.outcome(ctx)
	switch {
	case known && !ok:
		return &JobFailedError{Reason: "another node ended the job after a failure"}
	case known:
		return fmt.Errorf("%w: the job already finished", ErrRendezvousClosed)
	}
	return ErrRendezvousClosed
}

func (d *dynamicNode) leave(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := d.dyn.Leave(ctx); err != nil {
		d.log.Debug("leaving the rendezvous", zap.Error(err))
	}
}

// expelNode takes the node named name (NodeDesc.String) out of the
// dynamic rendezvous on st, leaving on its behalf: it was found dead, and
// the round it was in is over. Every node that finds it dead may do it;
// the first to write wins and the others find it out already.
func expelNode(ctx context.Context, st rendezvous.Store, cfg rendezvous.DynamicConfig, name string) error {
	node, ok := parseNodeDesc(name)
	if !ok {
		return fmt.Errorf("%q is not a node of the rendezvous", name)
	}
	cfg.OnProgress = nil
	h, err := rendezvous.NewDynamic(st, node, nil, cfg)
	if err != nil {
		return err
	}
	defer h.Close()
	return h.Leave(ctx)
}

// parseNodeDesc reads NodeDesc.String()'s "addr_pid_localid"; the address
// may hold underscores, the last two fields are numbers.
func parseNodeDesc(s string) (rendezvous.NodeDesc, bool) {
	rest, local, ok := cutLast(s, "_")
	if !ok {
		return rendezvous.NodeDesc{}, false
	}
	addr, pid, ok := cutLast(rest, "_")
	if !ok || addr == "" {
		return rendezvous.NodeDesc{}, false
	}
	p, err1 := strconv.Atoi(pid)
	l, err2 := strconv.Atoi(local)
	if err1 != nil || err2 != nil {
		return rendezvous.NodeDesc{}, false
	}
	return rendezvous.NodeDesc{Addr: addr, Pid: p, LocalID: l}, true
}

func cutLast(s, sep string) (before, after string, ok bool) {
	i := strings.LastIndex(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+len(sep):], true
}

// expel takes a node found dead out of the rendezvous (see expelNode).
func (d *dynamicNode) expel(ctx context.Context, node string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return expelNode(ctx, d.store, d.dyn.Config(), node)
}

func (d *dynamicNode) close() {
	if d.dyn != nil {
		d.dyn.Close()
	}
	if d.store != nil {
		d.store.Close()
	}
	if d.storeHost != nil {
		d.storeHost.Close()
	}
}
