package launcher

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// survivors is shrink mode (--on-failure shrink) for one round on this
// node: the agent's side of the survivors' agreement. It files the
// failures this node sees (its workers' exits and hangs, nodes it finds
// lost) on the shrink Board in the worker store, keeps the agreement's
// leader the first live node of the round, and tracks the epochs, which
// the workers act on themselves (abort, shrink, carry on).
//
// It is mechanism only: the agent's loop decides what an epoch means for
// the local workers.
type survivors struct {
	log     *zap.Logger
	coord   *shrink.Coordinator
	clients []*tcpstore.Client
	board   *shrink.Board // on the filing connection, for the respawn budget
	// agreementTimeout bounds how long a filing waits for the worker
	// store (Config.AgreementTimeout).
	agreementTimeout time.Duration

	me      int      // this node's group rank
	nodeIDs []string // the round's nodes, by group rank
	nodes   nodeRanks
	dead    map[int]bool // group ranks of nodes whose agents were found lost
	leading bool

	epoch  shrink.Epoch   // the latest epoch
	epochs []shrink.Epoch // every epoch of the round, in order
	// completed holds the grow epochs whose every rank is in the grown
	// group (the Coordinator's Complete notices).
	completed map[int]bool
	pending   map[int]string // local global ranks reported and not yet excluded
	// since is when the first of the pending reports was filed: the start
	// of the failure-to-epoch latency.
	since time.Time
	// unreported are the nodes (group ranks) lost in everyone's view (the
	// rendezvous state) that this node has not reported: the leader
	// reports those (see nodesLost).
	unreported map[int]string
	// unfilled is why heal last could not fill the vacant places
	// (admitWaiting), logged once until it changes.
	unfilled string
}

// startSurvivors joins the agreement of round p as node me (its group
// rank). It opens three connections to the round's worker store: one for
// filing and publishing, and one for each of the Coordinator's watchers.
// With a job secret the board is authenticated for the round (its run id
// and generation, as the workers see them): what the agents write is
// sealed, and a record that fails the check is logged, counted through
// refused (by kind: epoch, notice) and ignored.
func startSurvivors(ctx context.Context, cfg *Config, log *zap.Logger, p *plan, refused func(kind string)) (*survivors, error) {
	me := p.assignments[0].GroupRank
	s := &survivors{
		log: log.Named("shrink"), me: me, nodeIDs: p.nodeIDs, nodes: p.nodes,
		dead: map[int]bool{}, pending: map[int]string{}, completed: map[int]bool{},
		epoch: shrink.Initial(p.nodes.world()), agreementTimeout: cfg.AgreementTimeout,
	}
	addr := net.JoinHostPort(p.env.MasterAddr, strconv.Itoa(p.env.MasterPort))
	var auth *shrink.Auth
	if cfg.JobSecret != nil {
		var err error
		auth, err = shrink.NewAuth(cfg.JobSecret, shrink.Scope(p.env.RunID, strconv.Itoa(p.env.Generation)), func(f shrink.Forgery) {
			kind, _, _ := strings.Cut(f.Key, "/")
			if kind == "report" {
				kind = "notice"
			}
			s.log.Warn("ignored a record that fails the job secret's check (forged, replayed, or written without the secret)",
				zap.String("key", f.Key), zap.String("why", string(f.Reason)))
			refused(kind)
		})
		if err != nil {
			return nil, fmt.Errorf("shrink mode: %w", err)
		}
	}
	boards := make([]*shrink.Board, 3)
	for i := range boards {
		c, err := dialWorkerStore(ctx, s.log, addr, cfg.AgreementTimeout, cfg.rdzv.dynamic.JoinTimeout)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("shrink mode: worker store %s: %w", addr, err)
		}
		s.clients = append(s.clients, c)
		boards[i] = shrink.NewBoard(c, shrink.DefaultPrefix)
		if auth != nil {
			boards[i] = boards[i].Authenticated(auth)
		}
	}
	s.board = boards[0]
	s.coord = shrink.NewCoordinator(shrink.CoordinatorConfig{
		Config:           shrink.Config{SettleWindow: cfg.SettleWindow, MinWorldSize: cfg.MinWorldSize, GrowTimeout: cfg.GrowTimeout},
		Name:             p.nodeIDs[me],
		World:            p.nodes.world(),
		AgreementTimeout: cfg.AgreementTimeout,
		Logger:           s.log,
	}, boards[0], boards[1], boards[2])
	s.updateLeader(ctx)
	return s, nil
}

// dialWorkerStore connects to the round's worker store for the survivors'
// agreement; timeout bounds each of the client's operations.
//
// Every agent of the round connects to the store's host as the round
// starts, and on a loaded host the handshake can take longer than timeout:
// at 256 agents on two cores, two agents gave up after 10 s and ended. The
// connection waits up to wait (the rendezvous join timeout; timeout when
// it is shorter or unset), as the rendezvous store's does, and says what
// it waits for once timeout has passed (announceWaitAfter).
func dialWorkerStore(ctx context.Context, log *zap.Logger, addr string, timeout, wait time.Duration) (*tcpstore.Client, error) {
	wait = max(wait, timeout)
	dctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if wait > timeout {
		deadline, _ := dctx.Deadline()
		stop := announceWaitAfter(log, timeout, "the worker store", deadline, zap.String("endpoint", addr))
		defer stop()
	}
	return tcpstore.Dial(dctx, addr, tcpstore.ClientConfig{Timeout: timeout})
}

// leader is the agreement's leader: the first node of the round, in
// group-rank order, not gone.
func (s *survivors) leader() int {
	for g := range s.nodeIDs {
		if !s.gone(g) {
			return g
		}
	}
	return -1
}

// gone reports whether the node of group rank g no longer counts, for
// leadership and the exit barrier: its agent was found lost, or every one
// of its ranks is out of the current epoch (it may finish and leave at any
// time; a grow that gives its ranks back brings it back). This node never
// is.
func (s *survivors) gone(g int) bool {
	return g != s.me && (s.dead[g] || allGone(s.epoch, s.nodes.ranksOf(g)))
}

func (s *survivors) updateLeader(ctx context.Context) {
	lead := s.leader() == s.me
	if lead != s.leading {
		s.leading = lead
		s.coord.Lead(ctx, lead)
		if lead {
			s.log.Info("this node leads the survivors' agreement", zap.String("node", s.nodeIDs[s.me]))
		}
	}
}

// workerFailed files the failure of a local worker.
func (s *survivors) workerFailed(ctx context.Context, f Failure) error {
	if !s.epoch.Alive(f.Rank) {
		return nil // already excluded: we or an epoch stopped it
	}
	if len(s.pending) == 0 {
		s.since = time.Now()
	}
	s.pending[f.Rank] = f.Message
	// Epoch: the life of the rank that failed, the epoch after which its
	// worker was started (an exit because a later epoch excluded it, filed
	// before this agent read that epoch, is no news).
	return s.file(ctx, shrink.Report{Ranks: []int{f.Rank}, Reason: fmt.Sprintf("rank %d on %s: %s", f.Rank, s.nodeIDs[s.me], f.Message),
		SeenAt: f.Time, Epoch: new(f.Since)})
}

// nodesLost files the ranks of nodes found lost (their agents stopped
// answering) and re-chooses the leader. Nodes already known lost, and
// names that are not the round's nodes, are skipped. It returns how many
// nodes were newly lost.
//
// shared says every node sees the loss alike (the rendezvous state's
// lapsed keep-alives, not this node's own gossip view): then only the
// leader files it, once, with every shared loss it has not filed yet (it
// may have become leader by this very loss). At 512 agents every survivor
// filed the same node's failure at once, each taking the board's next free
// index by create-only compare-sets from the last it had seen: O(N²)
// requests on the worker store, and 508 of the 511 gave up and restarted.
func (s *survivors) nodesLost(ctx context.Context, ids []string, why string, shared bool) (int, error) {
	var names []string
	for _, id := range ids {
		g := slices.Index(s.nodeIDs, id)
		if g < 0 || s.dead[g] || g == s.me {
			continue
		}
		s.dead[g] = true
		names = append(names, id)
		if shared {
			if s.unreported == nil {
				s.unreported = map[int]string{}
			}
			s.unreported[g] = why
		}
	}
	if len(names) == 0 {
		return 0, nil
	}
	s.updateLeader(ctx)
	var report []int // group ranks of the nodes this node reports
	switch {
	case !shared:
		for _, id := range names {
			report = append(report, slices.Index(s.nodeIDs, id))
		}
	case s.leading:
		report = slices.Sorted(maps.Keys(s.unreported))
		clear(s.unreported)
	}
	var ranks []int
	for _, g := range report {
		for _, r := range s.nodes.ranksOf(g) {
			if s.epoch.Alive(r) {
				ranks = append(ranks, r)
			}
		}
	}
	by := "this node"
	if shared && !s.leading {
		by = "the agreement's leader"
	}
	s.log.Warn("nodes lost; reporting their ranks", zap.Strings("nodes", names), zap.Ints("ranks", ranks),
		zap.String("why", why), zap.String("reported_by", by))
	if len(ranks) == 0 {
		return len(names), nil
	}
	// Holds and Epoch let the leader tell a node cut off (whose view of
	// the others is its own isolation) from one that saw them fail, and
	// the ranks' lives this view saw from those grown back in since.
	return len(names), s.file(ctx, shrink.Report{Ranks: ranks, Reason: fmt.Sprintf("node %s lost: %s", strings.Join(names, ", "), why),
		SeenAt: time.Now(), Holds: s.nodes.ranksOf(s.me), Epoch: new(s.epoch.Number)})
}

// nodeBack records that node id, found lost before, answers again (a
// partition healed): it counts again for leadership and the exit barrier.
// What was reported of it stands: an epoch may have excluded its ranks,
// and then they come back by a grow. Without this, a node cut off and back
// held the others dead to the end of the job: it took the lead, and did
// not wait for them at the exit barrier.
func (s *survivors) nodeBack(ctx context.Context, id, why string) {
	g := slices.Index(s.nodeIDs, id)
	if g < 0 || !s.dead[g] {
		return
	}
	s.dead[g] = false
	delete(s.unreported, g)
	s.log.Warn("a node found lost answers again; it counts again", zap.String("node", id), zap.String("why", why))
	s.updateLeader(ctx)
}

// file files r on the board. A filing the worker store does not answer
// within an attempt is made again, up to the agreement timeout in all: at
// 512 agents on two cores the store's host answered some survivors'
// filings in more than the one 5-s attempt they had, and each of them fell
// back to a restart of the whole job. Filing twice is harmless: a report
// of ranks already pending adds nothing.
func (s *survivors) file(ctx context.Context, r shrink.Report) error {
	window := s.agreementTimeout
	if window <= 0 {
		window = shrink.DefaultAgreementTimeout
	}
	err := s.persist(ctx, fmt.Sprintf("the filing of the failure of ranks %v", r.Ranks), min(5*time.Second, window/2), window,
		func(ctx context.Context) error { return s.coord.File(ctx, r) })
	if err != nil {
		return fmt.Errorf("shrink mode: filing the failure of ranks %v: %w", r.Ranks, err)
	}
	return nil
}

// errAgreementUnanswered: the round's worker store did not answer an
// operation of the survivors' agreement (a node admitted late reading it,
// a survivor filing a failure) for as long as the agent waits for it.
var errAgreementUnanswered = errors.New("the running round's agreement did not answer")

// latest returns the number of the latest epoch on the board: where a node
// admitted late starts its workers from. A read the worker store does not
// answer within attempt is tried again, up to window in all, and then
// fails with errAgreementUnanswered: a link cut as the node is admitted
// (bench/chaos cut a spare's link for 4 s at its admission, and its agent
// ended on the one 5-s read) costs a retry, not the agent.
func (s *survivors) latest(ctx context.Context, attempt, window time.Duration) (int, error) {
	var n int
	err := s.persist(ctx, "the read of the latest epoch", attempt, window, func(ctx context.Context) (err error) {
		n, err = s.board.Latest(ctx)
		return err
	})
	return n, err
}

// persist runs op, each try bounded by attempt, until it succeeds, fails
// with what no retry mends (anything but a slow store's timeout,
// rendezvous.SlowStore: a worker store whose host is gone refuses, and
// waiting for it would only delay the fall-back), ctx ends, or window has
// passed since the first try: then it fails with errAgreementUnanswered. Each retry is logged, naming
// what (the operation).
func (s *survivors) persist(ctx context.Context, what string, attempt, window time.Duration, op func(context.Context) error) error {
	began := time.Now()
	deadline := began.Add(window)
	pause := 100 * time.Millisecond
	for try := 1; ; try++ {
		actx, cancel := context.WithTimeout(ctx, min(attempt, time.Until(deadline)))
		err := op(actx)
		cancel()
		switch {
		case err == nil || ctx.Err() != nil:
			return err
		case !rendezvous.SlowStore(err):
			return err
		case time.Until(deadline) <= pause:
			return fmt.Errorf("%w in %v (%d tries): %w", errAgreementUnanswered, window, try, err)
		}
		s.log.Warn("waiting for the running round's worker store: it did not answer "+what+"; trying again",
			zap.Int("try", try), zap.Duration("waited", time.Since(began).Round(time.Millisecond)),
			zap.Duration("wait_up_to", window), zap.Error(err))
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		pause = min(2*pause, time.Second)
	}
}

// replaced records that node id took the place of the lost node of group
// rank g (heal, a replacement node): it counts again once a grow gives
// its ranks back.
func (s *survivors) replaced(g int, id string) {
	s.nodeIDs[g] = id
	s.dead[g] = false
	s.log.Warn("a node takes a lost node's place; its workers join by a grow", zap.Int("group_rank", g), zap.String("node", id))
}

// vacant returns the group ranks of nodes found lost whose ranks are all
// out of the current epoch: places a waiting node can take.
func (s *survivors) vacant() []int {
	var out []int
	for g := range s.nodeIDs {
		if s.dead[g] && allGone(s.epoch, s.nodes.ranksOf(g)) {
			out = append(out, g)
		}
	}
	return out
}

// takeRespawn counts a respawn against the job's budget of max and reports
// whether it is within it, and the count so far.
func (s *survivors) takeRespawn(ctx context.Context, max int) (int, bool, error) {
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return s.board.TakeRespawn(fctx, max)
}

// adopt records epoch e and returns the local global ranks it excludes,
// and, when it settles the last of this node's reported failures, when the
// first of them was reported (else zero).
func (s *survivors) adopt(e shrink.Epoch, local []int) (excluded []int, reportedAt time.Time) {
	hadPending := len(s.pending) > 0
	s.epoch = e
	s.epochs = append(s.epochs, e)
	for _, r := range local {
		if slices.Contains(e.Excluded, r) {
			excluded = append(excluded, r)
		}
	}
	for r := range s.pending {
		if !e.Alive(r) {
			delete(s.pending, r)
		}
	}
	if hadPending && len(s.pending) == 0 {
		reportedAt, s.since = s.since, time.Time{}
	}
	return excluded, reportedAt
}

func allGone(e shrink.Epoch, ranks []int) bool {
	for _, r := range ranks {
		if e.Alive(r) {
			return false
		}
	}
	return true
}

// settled reports whether every local failure filed has been decided.
func (s *survivors) settled() bool { return len(s.pending) == 0 }

// liveNodes are the group ranks of the round nodes not known lost: who meets at the
// exit barrier.
func (s *survivors) liveNodes() []int {
	out := []int{}
	for g := range s.nodeIDs {
		if !s.gone(g) {
			out = append(out, g)
		}
	}
	return out
}

// growUnfinished reports whether the latest epoch is a grow that has not
// completed: its newcomers never made it into the group.
func (s *survivors) growUnfinished() bool {
	return s.epoch.Action == shrink.ActionGrow && !s.completed[s.epoch.Number]
}

// settleGrow, at the end, reads whether the latest epoch, a grow whose
// completion this node has not heard of, did complete (every rank
// acknowledged it): its Complete notice may still be on its way.
func (s *survivors) settleGrow(ctx context.Context) {
	if !s.growUnfinished() {
		return
	}
	if all, err := s.board.Arrived(ctx, s.epoch); err == nil && all {
		s.completed[s.epoch.Number] = true
	}
}

// back reports whether launch slot g is in the job at the end: alive in
// the latest epoch, and not only as a newcomer of a grow that did not
// complete.
func (s *survivors) back(g int) bool {
	return s.epoch.Alive(g) && !(s.growUnfinished() && s.epoch.Newcomer(g))
}

// allBack reports whether every lost slot was grown back in for good.
func (s *survivors) allBack() bool {
	return len(s.epoch.Lost) == 0 && !s.growUnfinished()
}

// summary describes the round's epochs for the job's last log line.
func (s *survivors) summary() string {
	if len(s.epochs) == 0 {
		return "no rank lost"
	}
	var lost, grown []int
	for _, e := range s.epochs {
		lost = append(lost, e.Excluded...)
		for _, g := range e.Added {
			if s.back(g) { // back for good, not a grow undone
				grown = append(grown, g)
			}
		}
	}
	slices.Sort(lost)
	slices.Sort(grown)
	world := s.epoch.WorldSize
	if s.growUnfinished() {
		world -= len(s.epoch.Added)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "lost ranks %v in %d epoch(s), world %d -> %d", slices.Compact(lost), len(s.epochs),
		len(s.epoch.Ranks), world)
	if len(grown) > 0 {
		fmt.Fprintf(&b, ", grown back %v", slices.Compact(grown))
	}
	b.WriteString(":")
	for _, e := range s.epochs {
		if e.Action == shrink.ActionGrow {
			fmt.Fprintf(&b, " epoch %d (grow) added %v", e.Number, e.Added)
			if e.Number == s.epoch.Number && s.growUnfinished() {
				b.WriteString(", did not complete before the job finished")
			}
			b.WriteString(";")
			continue
		}
		fmt.Fprintf(&b, " epoch %d (%s) excluded %v", e.Number, e.Action, e.Excluded)
		var why []string
		for _, r := range e.Excluded {
			if w := e.Reasons[r]; w != "" {
				why = append(why, w)
			}
		}
		if len(why) > 0 {
			fmt.Fprintf(&b, " [%s]", strings.Join(why, "; "))
		}
		b.WriteString(";")
	}
	return strings.TrimSuffix(b.String(), ";")
}

// close stops the agreement's side here; a nil survivors (restart mode)
// is fine.
func (s *survivors) close() {
	if s == nil {
		return
	}
	if s.coord != nil {
		s.coord.Close()
	}
	for _, c := range s.clients {
		c.Close()
	}
}
