package launcher

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/filestore"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// dynamicNode is the membership of a multi-node job, run by gorun's
// dynamic rendezvous over a store every agent reaches:
//
//   - c10d: a TCPStore at --rdzv-endpoint (default port 29400), hosted by
//     the agent that can bind it (is_host, or inferred as torchrun does), or
//     a FileStore at that path with store_type=file;
//   - static: the same at --master-addr:--master-port, hosted by node rank
//     0, with min = max = --nnodes and group ranks = node ranks.
//
// Every node offers a worker store before it joins; the round's group
// rank 0 keeps its own and the others close theirs. The job's records
// (restart count, outcome, exit barrier) are the jobNode's; the agent
// that hosts the rendezvous store keeps it up after the job closes until
// the others have seen the end.
type dynamicNode struct {
	job *jobNode
	// storeHost serves the rendezvous store when this node hosts it.
	storeHost *tcpstore.Server
}

func newDynamicNode(ctx context.Context, cfg *Config, log *zap.Logger, runID string) (*dynamicNode, error) {
	j, err := newJobNode(cfg, log, runID)
	if err != nil {
		return nil, err
	}
	j.countSeenClosed = true
	d := &dynamicNode{job: j}
	if err := d.connect(ctx, cfg.Rendezvous.Backend == backendStatic, j.dcfg.JoinTimeout); err != nil {
		d.close()
		return nil, err
	}
	if err := j.start(ctx); err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

// slowStoreLogger returns an OnSlowStore that says what the rendezvous
// waits for: the first slow operation, then at most one line every
// interval, with how many there were since (a thousand agents on a
// swamped store would otherwise log every pause of every agent).
func slowStoreLogger(log *zap.Logger, interval time.Duration) func(op string, err error) {
	warn := warnEvery(log, interval, "the rendezvous store is slow: reading it again until the join timeout", "timeouts")
	return func(op string, err error) { warn(zap.String("op", op), zap.Error(err)) }
}

// keepAliveLogger returns an OnKeepAliveFailed that says when this node's
// rendezvous heartbeats do not get through (KeepAliveMaxAttempt in a row
// and the others drop it), at most once every interval.
func keepAliveLogger(log *zap.Logger, interval time.Duration) func(error) {
	warn := warnEvery(log, interval, "a rendezvous keep-alive did not get through; the next goes an interval later", "failures")
	return func(err error) { warn(zap.Error(err)) }
}

// warnEvery returns a function that logs msg at warn level the first
// time, then at most once every interval, each line with how many calls
// it stands for under countKey.
func warnEvery(log *zap.Logger, interval time.Duration, msg, countKey string) func(...zap.Field) {
	var mu sync.Mutex
	var last time.Time
	count := 0
	return func(fields ...zap.Field) {
		mu.Lock()
		defer mu.Unlock()
		count++
		if now := time.Now(); last.IsZero() || now.Sub(last) >= interval {
			log.Warn(msg, append(fields, zap.Int(countKey, count))...)
			last, count = now, 0
		}
	}
}

// logDrop says that this node is dropping others from the rendezvous
// state for lapsed keep-alives, and on what it judged: the judge of a
// node's loss is whoever writes the state first, and without this line a
// crowd's logs say only that nodes were lost, not who found them so.
func logDrop(log *zap.Logger, d rendezvous.Drop) {
	const shown = 8
	names := make([]string, 0, min(len(d.Nodes), shown))
	for _, n := range d.Nodes[:min(len(d.Nodes), shown)] {
		names = append(names, n.String())
	}
	log.Warn("dropping nodes from the rendezvous: their keep-alives lapsed",
		zap.String("op", d.Op), zap.Int("dropped", len(d.Nodes)), zap.Strings("nodes", names),
		zap.Duration("newest_beat_age", d.Newest.Round(time.Millisecond)), zap.Duration("oldest_beat_age", d.Oldest.Round(time.Millisecond)),
		zap.Duration("judged_behind", d.Behind.Round(time.Millisecond)), zap.Int("kept", d.Kept))
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
	fields := []zap.Field{zap.Int("round", p.Round)}
	// In runs that queue their joins the rendezvous reports counts only
	// (each node reads its own share of the state, not the whole list).
	if p.Participants != nil {
		fields = append(fields, zap.Strings("joined", names(p.Participants)))
	} else {
		fields = append(fields, zap.Int("joined", p.NumParticipants))
	}
	fields = append(fields, zap.Int("awaited_for_min", max(0, minNodes-p.NumParticipants)), zap.Int("max", maxNodes))
	switch {
	case len(p.Waiting) > 0:
		fields = append(fields, zap.Strings("waiting_for_next_round", names(p.Waiting)))
	case p.NumWaiting > 0:
		fields = append(fields, zap.Int("waiting_for_next_round", p.NumWaiting))
	}
	if !p.LastCall.IsZero() && !p.Complete {
		fields = append(fields, zap.Time("last_call_ends", p.LastCall))
	}
	msg := "rendezvous in progress"
	switch {
	case p.Complete && p.InWaitList:
		// Not this node's round: it waits for the next one (a restart
		// whose last members have yet to leave this one, a scale-up).
		msg = "rendezvous complete without this node; waiting for the next round"
	case p.Complete:
		msg = "rendezvous complete"
	}
	log.Info(msg, fields...)
}

// connect opens the rendezvous store, hosting it first when this node is
// the host.
func (d *dynamicNode) connect(ctx context.Context, static bool, joinTimeout time.Duration) error {
	rs := d.job.cfg.rdzv
	if rs.fileStore {
		fcfg := filestore.DefaultConfig()
		fcfg.Timeout = rs.readTimeout
		s, err := filestore.Open(ctx, d.job.cfg.Rendezvous.Endpoint, fcfg)
		if err != nil {
			return fmt.Errorf("rendezvous FileStore %s: %w", d.job.cfg.Rendezvous.Endpoint, err)
		}
		d.job.store = s
		return nil
	}
	endpoint := net.JoinHostPort(rs.host, strconv.Itoa(rs.port))
	isHost := rs.isHost
	if !static && !rs.isHostGiven {
		isHost = isLocalHost(rs.host)
	}
	if isHost {
		srv, err := tcpstore.Listen(net.JoinHostPort("", strconv.Itoa(rs.port)), tcpstore.ServerConfig{Logger: d.job.log.Named("rdzv-store")})
		switch {
		case err == nil:
			d.storeHost = srv
			d.job.log.Info("hosting the rendezvous store", zap.String("endpoint", endpoint))
		case rs.isHostGiven:
			return localf("hosting the rendezvous store (is_host=%s) on port %d: %w", d.job.cfg.Rendezvous.Conf["is_host"], rs.port, err)
		case static:
			// Node rank 0 hosts, and no other agent may: torchrun fails
			// at once here ("Address already in use").
			return localf("node rank 0 hosts the rendezvous store on --master-port %d: %w", rs.port, err)
		default:
			// torchrun's fallback: another agent on this host got there
			// first, so be its client.
			d.job.log.Info("the rendezvous store is hosted by another agent; joining as a client",
				zap.String("endpoint", endpoint), zap.Error(err))
		}
	}
	dctx, cancel := context.WithTimeout(ctx, joinTimeout)
	defer cancel()
	stop := func() {}
	if d.storeHost == nil { // the host's own store answers at once
		deadline, _ := dctx.Deadline()
		stop = announceWait(d.job.log, "the rendezvous store", deadline, zap.String("endpoint", endpoint))
	}
	c, err := tcpstore.Dial(dctx, endpoint, tcpstore.ClientConfig{Timeout: rs.readTimeout})
	stop()
	if errors.Is(err, rendezvous.ErrTimeout) {
		return fmt.Errorf("%w: no rendezvous store answered at %s within join_timeout %v: %w", ErrRendezvousTimeout, endpoint, joinTimeout, err)
	}
	if err != nil {
		return fmt.Errorf("rendezvous store %s: %w", endpoint, err)
	}
	d.job.store = c
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
	round, err := d.job.join(ctx)
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

// fillPlan turns a completed round into this node's plan. srv is the worker
// store this node offered; it stays up only on group rank 0.
func (d *dynamicNode) fillPlan(ctx context.Context, p *plan, round rendezvous.Round, srv *tcpstore.Server) error {
	rv, err := d.job.view(ctx, round)
	if err != nil {
		srv.Close()
		return err
	}
	if err := d.job.refuseMixedSecrets(ctx, rv); err != nil {
		srv.Close()
		if d.storeHost != nil {
			d.waitOthersSawClose(ctx, rv.size)
		}
		return err
	}
	if rv.groupRank == 0 {
		p.store = srv
	} else {
		srv.Close()
	}
	vals, err := d.job.store.MultiGet(ctx, d.job.restartsKey(), d.workerStoreKey(rv.rank0))
	if err != nil {
		return fmt.Errorf("reading the restart count and group rank 0's worker store: %w", err)
	}
	restarts, err := restartsBefore(vals[0], round.Number)
	if err != nil {
		return fmt.Errorf("rendezvous store: %w", err)
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
	layout(p, rv, d.job.cfg.NProcPerNode)
	p.late = round.Late
	p.env = workerEnv(d.job.cfg, d.job.runID, host, port, int(restarts), round.Number)
	return nil
}

// layout fills in this node's assignments from the round's view, and the
// plan's members when the view has them (not from a summary: see
// plan.members). nproc is this node's worker count, what it published.
func layout(p *plan, v roundView, nproc int) {
	if v.infos == nil {
		p.assignments = assignAt(v.offset, v.world, v.groupRank, v.size, nproc)
		return
	}
	nodes := make(nodeRanks, len(v.infos))
	for i, in := range v.infos {
		nodes[i].nproc = in.NProc
		p.members = append(p.members, in.Addr)
		p.gossip = append(p.gossip, in.Gossip)
	}
	p.nodeIDs, p.nodes = v.ids, nodes
	p.assignments = assign(nodes, v.groupRank)
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
	return "gorun." + d.job.runID + ".worker_store/" + node.String()
}

// offerWorkerStore starts a fresh, empty worker store on this node and
// publishes its address, to be used if this node becomes group rank 0. It
// listens where the others reach it: --local-addr's address when that is
// an IP address, else every interface.
func (d *dynamicNode) offerWorkerStore(ctx context.Context) (*tcpstore.Server, error) {
	host := ""
	if ip := net.ParseIP(d.job.cfg.Rendezvous.LocalAddr); ip != nil {
		host = ip.String()
	}
	srv, err := tcpstore.Listen(net.JoinHostPort(host, "0"), tcpstore.ServerConfig{Logger: d.job.log.Named("store")})
	if err != nil {
		return nil, localf("worker store: %w", err)
	}
	addr := net.JoinHostPort(d.job.addr, strconv.Itoa(srv.Addr().(*net.TCPAddr).Port))
	if err := d.job.store.Set(ctx, d.workerStoreKey(d.job.me), []byte(addr)); err != nil {
		srv.Close()
		return nil, fmt.Errorf("publishing the worker store: %w", err)
	}
	return srv, nil
}

func (d *dynamicNode) watchEvery(monitor time.Duration) time.Duration {
	return d.job.statusEvery(monitor)
}

func (d *dynamicNode) watch(ctx context.Context) (*change, error) { return d.job.status(ctx) }

func (d *dynamicNode) failed(ctx context.Context, p *plan, cause string) (bool, error) {
	return d.job.failed(ctx, p, cause)
}

func (d *dynamicNode) finish(ctx context.Context, p *plan, ok bool) error {
	d.job.finish(ctx, p, ok)
	if d.storeHost != nil {
		d.waitOthersSawClose(ctx, p.atBarrier())
	}
	return nil
}

func (d *dynamicNode) sawClosed(ctx context.Context)                { d.job.seenClosed(ctx) }
func (d *dynamicNode) leave(ctx context.Context)                    { d.job.leave(ctx) }
func (d *dynamicNode) expel(ctx context.Context, node string) error { return d.job.expel(ctx, node) }
func (d *dynamicNode) admit(ctx context.Context, groupRanks []int) ([]string, error) {
	return d.job.admit(ctx, groupRanks)
}

// waitOthersSawClose keeps the rendezvous store up, after the job closed,
// until the round's other nodes have seen the end (or a keep-alive window
// passed): the store dies with its host, and a node that cannot read the
// store cannot tell a finished job from a lost one.
func (d *dynamicNode) waitOthersSawClose(ctx context.Context, members int) {
	cfg := d.job.dcfg
	deadline := time.Now().Add(cfg.DropTimeout() + cfg.HeartbeatInterval())
	for time.Now().Before(deadline) {
		n, err := d.job.store.Add(ctx, d.job.seenClosedKey(), 0)
		if err != nil || n >= int64(members) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	d.job.log.Warn("closing the rendezvous store while other nodes may still need it")
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

func (d *dynamicNode) close() {
	d.job.close()
	if d.storeHost != nil {
		d.storeHost.Close()
	}
}
