//go:build !gorun_noetcd

package launcher

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// etcdNode is the membership of a multi-node job whose rendezvous runs in
// etcd (--rdzv-backend etcd or etcd-v2). No agent hosts anything another
// needs, so losing a node loses that node only. The job's keys are under
// <prefix>/<run id>/:
//
//	rdzv/           the dynamic rendezvous's state and the job's counters
//	alive/<node>    one key per agent, bound to the agent's lease
//	store/<round>/  the round's worker store
//
// An agent holds one etcd lease, its liveness's: both its stores put the
// tokens of their read-modify-writes under it (etcd.StorageConfig.Lease),
// so that they go with the agent's presence and etcd renews one lease per
// agent, not three (at 512 agents on two cores it could not keep three
// renewed: BENCHMARKS.md).
//
// The dynamic rendezvous runs as with c10d, on an etcd.Store. Liveness is
// the leases': a node whose lease expires is seen gone by its successor in
// alive/ (etcd.Liveness: each node watches its own stretch of the
// directory, O(1) whatever N), which announces it on one news key every
// node watches, within about lease_ttl, by etcd's clock, which a leader
// change does not stop (the new leader extends every lease). The
// successor also takes that node out of the rendezvous state, as the node
// would have left itself, so that the survivors' next round does not wait
// for its heartbeat there to lapse; those heartbeats
// (keep_alive_interval × keep_alive_max_attempt, 15 s by default) remain as
// a backstop (a node lost while no successor watched it, before the
// others started, is dropped by them).
//
// Every agent serves the worker store on its own node: a tcpstore server
// whose keys live in etcd under the round's directory, so MASTER_ADDR is
// the local node and every node's workers see one store. A new round
// starts in a fresh directory; its group rank 0 deletes the older ones.
type etcdNode struct {
	job      *jobNode
	settings etcdSettings
	// base is the directory of the job's keys, "<prefix>/<run id>/".
	base string
	cli  *clientv3.Client
	rdzv *etcd.Storage // under the rendezvous store
	live *etcd.Liveness
	// members names the current round's nodes, since is the liveness
	// view's revision when the round began, and back its revision once
	// the round had formed (a member that lapsed and was readmitted before
	// then is the round's member, not lost: Liveness.Lost).
	//
	// A round planned from its summary (queue mode) comes without member
	// names: members stays nil, and watch reads the names only once the
	// view shows a departure (lazyMembers): O(N) bytes a node only in a
	// round that may have lost one.
	members     []string
	lazyMembers bool
	since, back int64
	// reported are the members whose loss watch has reported this round
	// (see unreported).
	reported []string
	// dropBefore, when positive, is a round whose older worker stores
	// this node (its group rank 0) is to delete.
	dropBefore int
	// worker is the storage of the current round's worker store (the
	// plan holds its server).
	worker *etcd.Storage
	// lastStatus is when watch last read the rendezvous state.
	lastStatus time.Time

	// The expeller takes nodes whose leases lapsed out of the rendezvous
	// (not to be mistaken for package reaper, the agent's wait4 owner).
	dcfg         rendezvous.DynamicConfig
	gone         chan string // names of nodes whose presence keys went
	stopExpeller context.CancelFunc
	expellerDone chan struct{}
	// over: the job is over for this node; departures are no longer
	// failures to act on.
	over atomic.Bool
}

// EtcdBackendLinked reports whether this build has the etcd backends. A
// build with the gorun_noetcd tag leaves out etcd's client and its gRPC
// stack (a quarter of the binary, and about 5 MiB and 4 ms at every start:
// BENCHMARKS.md); its command line hands etcd jobs to a full build.
const EtcdBackendLinked = true

// newEtcdMembership is newEtcdNode as a membership.
func newEtcdMembership(ctx context.Context, cfg *Config, log *zap.Logger, runID string) (membership, error) {
	e, err := newEtcdNode(ctx, cfg, log, runID)
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return e, nil
}

// statusTimeout bounds one read of the rendezvous state while workers run.
const statusTimeout = 2 * time.Second

func newEtcdNode(ctx context.Context, cfg *Config, log *zap.Logger, runID string) (*etcdNode, error) {
	s := cfg.rdzv.etcd
	if cfg.Rendezvous.Backend == backendEtcdV2 {
		log.Info("--rdzv-backend etcd-v2: gorun speaks etcd's v3 API (etcd 3.4 or later), not the v2 API")
	}
	if s.PasswordOnCommandLine {
		log.Warn("the etcd password is on the command line, where other users of this machine can read it; " +
			"use --rdzv-conf password_env=VAR or $" + etcd.EnvPassword)
	}
	j, err := newJobNode(cfg, log, runID)
	if err != nil {
		return nil, err
	}
	e := &etcdNode{job: j, settings: s, base: s.JobDir(runID), gone: make(chan string, 1024)}
	if err := e.connect(ctx, j.dcfg.JoinTimeout); err != nil {
		e.close()
		return nil, err
	}
	if err := j.start(ctx); err != nil {
		e.close()
		return nil, err
	}
	return e, nil
}

// accessRefused is the usage error for the registration of this node's
// presence key refused: on an etcd with authentication, a role that
// does not reach the job's keys (another job's, a typo in --rdzv-id or
// prefix) is one clear error at start, not a store that fails
// mid-rendezvous. The presence key is the first key the node writes under
// the job's directory, so its put is the access check: a separate put and
// delete were two more requests, each a raft proposal, per node at the
// crowd's start.
func (e *etcdNode) accessRefused() error {
	return invalidf("etcd: user %q may not write the job's keys under %s (grant its role readwrite on that prefix): %w",
		e.settings.Client.Username, e.base, rpctypes.ErrPermissionDenied)
}

// connect reaches etcd (retrying until join_timeout), takes this node's
// lease, opens the rendezvous store and starts the expeller.
func (e *etcdNode) connect(ctx context.Context, joinTimeout time.Duration) error {
	ccfg := e.settings.Client
	ccfg.Logger = e.job.log
	cctx, cancel := context.WithTimeout(ctx, joinTimeout)
	deadline, _ := cctx.Deadline()
	stop := announceWait(e.job.log, "etcd", deadline, zap.Strings("endpoints", ccfg.Endpoints))
	cli, err := etcd.Connect(cctx, ccfg)
	stop()
	cancel()
	switch {
	case errors.Is(err, etcd.ErrUnreachable):
		return fmt.Errorf("%w: join_timeout %v: %w", ErrRendezvousTimeout, joinTimeout, err)
	case errors.Is(err, etcd.ErrTLS), errors.Is(err, etcd.ErrAuth):
		// Not retried: the certificates or credentials must change.
		return invalidf("%w", err)
	case err != nil:
		return fmt.Errorf("etcd: %w", err)
	}
	e.cli = cli

	// The lease first: the rendezvous store puts its tokens under it, and
	// the presence key's put is the access check (accessRefused). An etcd
	// that answers late is waited out for read_timeout, as every other
	// store operation is.
	me := e.job.me.String()
	readTimeout := e.job.cfg.rdzv.readTimeout
	lctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	e.live, err = etcd.StartLiveness(lctx, cli, etcd.LivenessConfig{
		Dir: e.base + "alive/", Name: me, Value: []byte(e.job.addr),
		TTL: e.settings.LeaseTTL, Logger: e.job.log.Named("liveness"),
		// Long until this node's workers first run (watch settles it):
		// a big job's start can leave etcd renewing no lease for longer
		// than lease_ttl.
		StartTTL: e.settings.StartTTL(e.job.cfg.MaxNodes),
		OnLapse: func(name string) {
			if name == me || e.over.Load() {
				return // this node's own loss ends its round (watch)
			}
			select {
			case e.gone <- name:
			default: // the state's heartbeats will drop it
			}
		},
	})
	switch {
	case errors.Is(err, rpctypes.ErrPermissionDenied):
		return e.accessRefused()
	case err != nil:
		return err
	}

	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{
		Prefix: e.base + "rdzv/", OpTimeout: readTimeout, Logger: e.job.log.Named("rdzv"),
		// The rendezvous state, its request queue and folder lock are
		// only read, compare-set, pushed and popped, by every node at
		// every join and heartbeat: no node's watch need carry them to
		// every other. Nor the exit barrier's counters (exitTree), which
		// every node adds to once and nobody waits on.
		Unwatched: append(rendezvous.DynamicUnwatched(e.job.runID), exitTreeRun(e.job.runID)+"*"),
		// Not StartRevision (the presence key's, which would save a
		// read): a watch that starts in the past is one etcd catches up
		// on by scanning the revisions since, and at 512 agents it gained
		// nothing measurable (BENCHMARKS, 2026-12-03 session 2).
		Lease: e.live.Lease,
	})
	if err != nil {
		return fmt.Errorf("etcd rendezvous store: %w", err)
	}
	e.rdzv, e.job.store = st, etcd.NewStore(st, readTimeout)
	ttl := e.live.TTL()
	if start := e.settings.StartTTL(e.job.cfg.MaxNodes); ttl > start+time.Second {
		e.job.log.Info("etcd raised the lease TTL to its minimum (1.5 election timeouts)",
			zap.Duration("asked", start), zap.Duration("granted", ttl))
	}
	rctx, stop := context.WithCancel(context.Background())
	e.stopExpeller, e.expellerDone = stop, make(chan struct{})
	go e.expelLapsed(rctx)
	e.job.log.Info("rendezvous in etcd", zap.Strings("endpoints", cli.Endpoints()),
		zap.String("keys", e.base), zap.Duration("lease_ttl", e.settings.LeaseTTL), zap.Duration("lease_ttl_until_workers_run", ttl))
	return nil
}

// expelLapsed takes each node whose presence key went out of the rendezvous
// state, leaving on its behalf: its lease expired, so it is gone, and the
// round it was in is over. One node does it, the lapsed one's successor
// (Liveness's OnLapse): when every node did, a lapse cost etcd one
// expulsion per node, and at 512 agents the lapses of a starved join fed
// on the load they made. Should two nodes act while their rings settle,
// the first to write wins and the other finds the node out already;
// should none, the rendezvous state's keep-alives drop it.
func (e *etcdNode) expelLapsed(ctx context.Context) {
	defer close(e.expellerDone)
	for {
		select {
		case <-ctx.Done():
			return
		case name := <-e.gone:
			if e.over.Load() {
				continue
			}
			if err := e.expel(ctx, name); err != nil {
				e.job.log.Warn("taking a node whose etcd lease expired out of the rendezvous",
					zap.String("node", name), zap.Error(err))
			}
		}
	}
}

// expel takes node name out of the rendezvous state (from the expeller,
// possibly before this node's first round).
func (e *etcdNode) admit(ctx context.Context, groupRanks []int) ([]string, error) {
	return e.job.admit(ctx, groupRanks)
}

func (e *etcdNode) expel(ctx context.Context, name string) error {
	if err := e.job.expel(ctx, name); err != nil {
		return err
	}
	e.job.log.Debug("node's etcd lease expired: taken out of the rendezvous", zap.String("node", name))
	return nil
}

func (e *etcdNode) next(ctx context.Context) (*plan, error) {
	e.endRound()
	since := e.live.Rev()
	round, err := e.job.join(ctx)
	if err != nil {
		return nil, err
	}
	// What the view has seen by now happened while the round formed: a
	// member that lapsed and came back meanwhile was readmitted into it.
	back := e.live.Rev()
	rv, err := e.job.view(ctx, round)
	if err != nil {
		return nil, err
	}
	if err := e.job.refuseMixedSecrets(ctx, rv); err != nil {
		return nil, err
	}
	// Between the round's completion and the workers' start every etcd
	// request counts, each node making them at once: one here (the
	// counter exists: start created it), and the rest after the workers
	// started (see watch).
	// Through the sealing layer: the count is sealed with a job secret.
	v, err := e.job.store.Get(ctx, e.job.restartsKey())
	if err != nil {
		return nil, fmt.Errorf("reading the restart count: %w", err)
	}
	restarts, err := restartsBefore(v, round.Number)
	if err != nil {
		return nil, fmt.Errorf("rendezvous store: %w", err)
	}
	srv, err := e.serveWorkerStore(ctx, round.Number, since)
	if err != nil {
		return nil, err
	}
	p := &plan{round: round.Number, store: srv, late: round.Late}
	layout(p, rv, e.job.cfg.NProcPerNode)
	// The store serves this node's workers and agent only (etcd holds
	// what they share with the other nodes): on loopback.
	p.env = workerEnv(e.job.cfg, e.job.runID, "127.0.0.1", srv.Addr().(*net.TCPAddr).Port, int(restarts), round.Number)
	e.members, e.since, e.back, e.reported = e.members[:0], since, back, e.reported[:0]
	e.lazyMembers = rv.ids == nil
	e.members = append(e.members, rv.ids...)
	if rv.groupRank == 0 && round.Number > 0 {
		e.dropBefore = round.Number
	}
	return p, nil
}

// storePrefix is the directory of a round's worker store. The round is
// zero-padded so that the directories sort by round.
func (e *etcdNode) storePrefix(round int) string {
	return fmt.Sprintf("%sstore/%010d/", e.base, round)
}

// serveWorkerStore starts this node's server of the round's worker store.
// rev is a revision of etcd's from before the round began.
func (e *etcdNode) serveWorkerStore(ctx context.Context, round int, rev int64) (*tcpstore.Server, error) {
	st, err := etcd.NewStorage(ctx, e.cli, etcd.StorageConfig{
		Prefix: e.storePrefix(round), Logger: e.job.log.Named("store"),
		// No request on the way to the workers' start.
		StartRevision: rev,
		Lease:         e.live.Lease,
	})
	if err != nil {
		return nil, fmt.Errorf("worker store: %w", err)
	}
	// Storage calls wait on etcd: a goroutine per connection, so that one
	// worker's round trip holds up no other.
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{Storage: st, GoroutinePerConn: true, Logger: e.job.log.Named("store")})
	if err != nil {
		st.Close()
		return nil, localf("worker store: %w", err)
	}
	e.worker = st
	return srv, nil
}

// endRound closes the storage of the last round's worker store, whose
// server the agent has stopped.
func (e *etcdNode) endRound() {
	if e.worker != nil {
		e.worker.Close()
		e.worker = nil
	}
}

// dropStores deletes the worker stores of the rounds before round (all of
// them for round -1). Once a round has completed, every member has left
// the earlier rounds, and a node lost since has its workers dead or dying.
func (e *etcdNode) dropStores(ctx context.Context, round int) {
	dir := e.base + "store/"
	end := clientv3.GetPrefixRangeEnd(dir)
	if round >= 0 {
		end = e.storePrefix(round)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := e.cli.Delete(ctx, dir, clientv3.WithRange(end)); err != nil {
		e.job.log.Warn("deleting old worker stores from etcd", zap.String("dir", dir), zap.Error(err))
	}
}

// watchEvery is the monitor interval itself: watch reads the liveness view
// in memory, and the rendezvous state only as often as c10d's would.
func (e *etcdNode) watchEvery(monitor time.Duration) time.Duration { return monitor }

// watch reports a lost node as soon as the liveness watch has seen it
// gone; the rest (nodes waiting, the job closed) comes from the
// rendezvous state, read every fifth of a keep-alive interval.
func (e *etcdNode) watch(ctx context.Context) (*change, error) {
	// This node's workers run: from now on a lost node is to be found
	// within lease_ttl, and the crowd's start is over.
	e.live.Settle()
	if e.lazyMembers {
		if e.live.Departures(e.since, e.back) {
			if ms, err := e.job.dyn.Members(ctx); err != nil {
				e.job.log.Debug("reading the round's members", zap.Error(err))
			} else {
				e.lazyMembers = false
				for _, m := range ms {
					e.members = append(e.members, m.Node.String())
				}
			}
		}
	}
	if lost := e.unreported(e.live.Lost(e.members, e.since, e.back)); len(lost) > 0 {
		return &change{lost: lost}, nil
	}
	if e.dropBefore > 0 {
		e.dropStores(ctx, e.dropBefore)
		e.dropBefore = 0
	}
	if time.Since(e.lastStatus) < e.job.statusEvery(e.job.cfg.MonitorInterval) {
		return nil, nil
	}
	e.lastStatus = time.Now()
	// The agent handles its workers' exits between two watches: do not
	// hold it for the whole keep-alive window on a slow etcd.
	sctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	c, err := e.job.status(sctx)
	if c != nil {
		// An admitted node is watched for by its presence key from now
		// on, in the lost node's place.
		for _, a := range c.admitted {
			if a.groupRank < len(e.members) {
				e.members[a.groupRank] = a.id
			}
		}
	}
	if c != nil && c.storeLost {
		// No host to lose: etcd is down or cut off. Keep watching; the
		// workers fail if their store stays away, and leases tell who
		// is gone once etcd is back.
		return nil, fmt.Errorf("etcd has not answered for %v", time.Since(e.job.lastSeen).Round(time.Millisecond))
	}
	return c, err
}

// unreported returns those of lost that watch has not reported yet this
// round, and counts them reported. A member's loss stays in the liveness
// view for the rest of the round: reported on every watch, it would end
// each one before the rendezvous state is read, and the survivors of a
// shrink would never see a replacement that came after the loss waiting
// to take the lost node's place (heal). Reported once, the loss is the
// rendezvous state's to tell from then on (status: lost, waiting,
// admitted).
func (e *etcdNode) unreported(lost []string) []string {
	fresh := lost[:0]
	for _, n := range lost {
		if !slices.Contains(e.reported, n) {
			fresh = append(fresh, n)
			e.reported = append(e.reported, n)
		}
	}
	return fresh
}

func (e *etcdNode) failed(ctx context.Context, p *plan, cause string) (bool, error) {
	return e.job.failed(ctx, p, cause)
}

// jobOver marks the job over for this node: it acts on no more lapses,
// and tells of none (etcd.Liveness.Quiet).
func (e *etcdNode) jobOver() {
	e.over.Store(true)
	if e.live != nil {
		e.live.Quiet()
	}
}

func (e *etcdNode) finish(ctx context.Context, p *plan, ok bool) error {
	e.jobOver()
	e.job.finish(ctx, p, ok)
	// The job is over: its worker stores go. The rendezvous state stays
	// (a few KB), so that an agent arriving late learns the job ended.
	if !ok || p.assignments[0].GroupRank == 0 {
		e.dropStores(ctx, -1)
	}
	return nil
}

func (e *etcdNode) sawClosed(ctx context.Context) {
	e.jobOver()
	e.job.seenClosed(ctx) // nothing to count: no agent hosts the store
}

func (e *etcdNode) leave(ctx context.Context) {
	e.jobOver()
	e.job.leave(ctx)
	e.closeLiveness()
}

// closeLiveness revokes this node's lease: the others see it gone now.
func (e *etcdNode) closeLiveness() {
	if e.live == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := e.live.Close(ctx); err != nil {
		e.job.log.Debug("revoking the etcd lease", zap.Error(err))
	}
}

func (e *etcdNode) close() {
	e.jobOver()
	if e.stopExpeller != nil {
		e.stopExpeller()
		<-e.expellerDone
	}
	e.job.close()
	e.endRound()
	e.closeLiveness()
	if e.cli != nil {
		e.cli.Close()
	}
}
