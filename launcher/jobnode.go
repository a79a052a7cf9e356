package launcher

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// jobNode is what a multi-node membership does whatever store holds the
// rendezvous: this node's identity, its handle on the dynamic rendezvous,
// and the job's records beside it — the restart count, the outcome, the
// exit barrier. dynamicNode (c10d, static) and etcdNode each hold one and
// add where the store and the worker store live.
type jobNode struct {
	cfg   *Config
	log   *zap.Logger
	runID string
	me    rendezvous.NodeDesc
	addr  string // the address this node advertises
	// store is the rendezvous store, once the membership has opened it.
	store rendezvous.Store
	// dcfg is the rendezvous's configuration; dyn the handle on it, once
	// start has run.
	dcfg  rendezvous.DynamicConfig
	dyn   *rendezvous.Dynamic
	round rendezvous.Round
	// countSeenClosed: count this node under seenClosedKey when it sees
	// the job closed, for the agent that hosts the store, which waits for
	// the others before it takes the store away (c10d, static). A store
	// that outlives every agent (etcd) needs no such count.
	countSeenClosed bool
	// lastSeen is when the rendezvous store last answered a status read:
	// a store silent for longer than the keep-alive window means its host
	// is gone.
	lastSeen time.Time
	// slowLogged: status reads time out on a store that still holds the
	// connection, and that was logged (false again once it answers).
	slowLogged bool
	// sealed is j.store's sealing layer, with a job secret (nil without).
	sealed *rendezvous.SealedStore
	// refusalsLogged are the sources (why, and the key check claimed) of
	// refused rendezvous records already logged: each is logged once.
	refusalsMu     sync.Mutex
	refusalsLogged map[string]bool
}

// nodeInfo is what each node publishes in the rendezvous.
type nodeInfo struct {
	NProc    int    `json:"nproc"`
	Addr     string `json:"addr"`
	NodeRank int    `json:"node_rank"` // static only
	// Gossip is the agent's node-liveness member.
	Gossip gossipPeer `json:"gossip"`
	// SecretCheck shows which job secret the node holds (Secret.check),
	// "" for none: every node of a round must show the same.
	SecretCheck string `json:"secret_check,omitempty"`
}

const (
	outcomeSucceeded = "succeeded"
	outcomeFailed    = "failed"
	// closeWritesTimeout bounds the writes that end the job (outcome,
	// closing, seen-closed).
	closeWritesTimeout = 5 * time.Second
)

// newJobNode returns this node's jobNode, before any store is reached.
func newJobNode(cfg *Config, log *zap.Logger, runID string) (*jobNode, error) {
	j := &jobNode{cfg: cfg, log: log, runID: runID, addr: cfg.Rendezvous.LocalAddr}
	if j.addr == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("this node's address (set --local-addr): %w", err)
		}
		j.addr = h
	}
	j.me = rendezvous.NodeDesc{Addr: j.addr, Pid: os.Getpid()}
	minNodes, maxNodes := cfg.MinNodes, cfg.MaxNodes
	j.dcfg = cfg.rdzv.dynamic
	j.dcfg.OnProgress = func(p rendezvous.Progress) { logProgress(log, minNodes, maxNodes, p) }
	j.dcfg.OnSlowStore = slowStoreLogger(log, 10*time.Second)
	j.dcfg.OnDrop = func(d rendezvous.Drop) { logDrop(log, d) }
	j.dcfg.OnKeepAliveFailed = keepAliveLogger(log, 10*time.Second)
	// In queue mode (large runs) the rendezvous hands each node its
	// summary of the round (offset, world size, rank 0, the secrets'
	// agreement), computed once by the node that completes it: this
	// node's plan needs no member list, which costs O(N) bytes a node
	// every round. Where the plan does need every member, Next reads
	// them as before.
	j.dcfg.Describe = describeNode
	j.dcfg.ShareOnly = !cfg.needsMembers()
	return j, nil
}

// needsMembers reports whether an agent's plan needs every member of each
// round rather than its summary: static rendezvous (group ranks are the
// node ranks in the members' data, not the round's ranks), shrink mode
// (the survivors' agreement names every node and its ranks: leadership,
// lost nodes, vacant places) and node liveness (the gossip expects every
// member by name, and maps its news back to rendezvous identities).
func (c *Config) needsMembers() bool {
	return c.Rendezvous.Backend == backendStatic || c.OnFailure == OnFailureShrink || c.gossip.Name != ""
}

// describeNode reads what the round's plan needs of a node's published
// nodeInfo: its worker count and its job secret's check.
func describeNode(data []byte) (rendezvous.NodeTraits, error) {
	var info nodeInfo
	if err := json.Unmarshal(data, &info); err != nil {
		return rendezvous.NodeTraits{}, fmt.Errorf("node info %q: %w", data, err)
	}
	return rendezvous.NodeTraits{Weight: info.NProc, Check: info.SecretCheck}, nil
}

// Keys in the rendezvous store, besides the rendezvous's own.
func (j *jobNode) restartsKey() string { return "gorun." + j.runID + ".restarts" }
func (j *jobNode) outcomeKey() string  { return "gorun." + j.runID + ".outcome" }

// seenClosedKey counts the nodes that have seen the job closed: the
// rendezvous store's host waits for them before it takes the store away.
// A counter, not the nodes leaving the shared state: N nodes leaving at once
// would fight over one compare-set.
func (j *jobNode) seenClosedKey() string { return "gorun." + j.runID + ".seen_closed" }

// start creates the job's restart counter and this node's handle on the
// rendezvous, once j.store is up.
func (j *jobNode) start(ctx context.Context) error {
	if err := j.seal(); err != nil {
		return err
	}
	// Create the job's restart counter now, before joining, so that after
	// a round completes one read gets it (with rank 0's worker store, for
	// c10d: fillPlan): the round trips after completion are what a large
	// job waits for, every node asking the one store at once.
	// Create-only (rendezvous.CreateOnce): sent again while the store
	// cannot tell its outcome; at 512 agents on etcd that error ended
	// three agents here, and the round of 512 never completed.
	if _, err := rendezvous.CreateOnce(ctx, j.store, j.restartsKey(), []byte("0")); err != nil {
		if errors.Is(err, rendezvous.ErrSealedRecord) {
			return errNoSecret() // the restart count is sealed too
		}
		return fmt.Errorf("rendezvous store: %w", err)
	}
	data, _ := json.Marshal(nodeInfo{NProc: j.cfg.NProcPerNode, Addr: j.addr, NodeRank: j.cfg.Rendezvous.NodeRank, Gossip: j.cfg.gossip,
		SecretCheck: j.cfg.JobSecret.check(j.runID)})
	var err error
	if j.dyn, err = rendezvous.NewDynamic(j.store, j.me, data, j.dcfg); err != nil {
		return fmt.Errorf("rendezvous: %w", err)
	}
	return nil
}

// isCounter reports whether key is one of the job's counters in the
// rendezvous store, which Add cannot seal (see seal). The restart count
// is no such counter: it is read and compare-set, and sealed.
func (j *jobNode) isCounter(key string) bool {
	return key == j.seenClosedKey()
}

// seal puts the sealing layer over j.store: with a job secret, every
// record the agents write there for one another (the rendezvous's state,
// requests, lock and views, the worker store addresses, the outcome, a
// round's failure) carries a MAC under a key derived from the secret for
// this use, bound to the run and the key, and what fails is ignored,
// logged and counted (kind "rendezvous"). A spare's assignment (its
// admission into a running round) is part of those records.
//
// The restart count is sealed like the records (a compare-set of "COUNT
// ROUND"), so a forger cannot spend the restart budget, and the exit
// barrier's arrivals are sealed records too (exitBarrier). The seen-closed
// count stays plain (an Add cannot carry a MAC): a forged increment lets
// the store's host leave before the others have read the outcome, so they
// cannot tell the job's end from its loss, as a forger who deletes the
// outcome can make them; it cannot make the job restart, shrink, take in
// a node or end.
//
// Without a secret the records stay as they were; the layer only turns a
// sealed record (an agent of the job holds a secret this one does not)
// into a clear error.
func (j *jobNode) seal() error {
	sealed := func(key string) bool { return !j.isCounter(key) }
	if j.cfg.JobSecret == nil {
		j.store = rendezvous.NewSealDetector(j.store, sealed)
		return nil
	}
	views := rendezvous.DynamicViews(j.runID)
	st, err := rendezvous.NewSealedStore(j.store, rendezvous.SealConfig{
		Key:       j.cfg.JobSecret.derive("rendezvous"),
		Scope:     j.runID,
		Check:     j.cfg.JobSecret.check(j.runID),
		Sealed:    sealed,
		Fresh:     func(key string) bool { return !views(key) },
		OnRefused: j.onRefused,
	})
	if err != nil {
		return fmt.Errorf("rendezvous store: %w", err)
	}
	j.sealed, j.store = st, st
	return nil
}

// maxRefusalSources bounds the refusal sources logged one by one.
const maxRefusalSources = 64

// onRefused counts a refused rendezvous record and logs the first from
// each source: why, and which secret's check it claims.
func (j *jobNode) onRefused(r rendezvous.Refusal) {
	if j.cfg.refused != nil {
		j.cfg.refused("rendezvous")
	}
	src := string(r.Reason) + "\x00" + r.Check
	j.refusalsMu.Lock()
	if j.refusalsLogged == nil {
		j.refusalsLogged = map[string]bool{}
	}
	n := len(j.refusalsLogged)
	first := !j.refusalsLogged[src] && n <= maxRefusalSources
	if first {
		j.refusalsLogged[src] = true
	}
	j.refusalsMu.Unlock()
	switch {
	case first && n == maxRefusalSources:
		j.log.Warn("ignoring more rendezvous records that fail the job secret's check; no more of their sources are logged")
	case first:
		fields := []zap.Field{zap.String("key", r.Key), zap.String("why", string(r.Reason))}
		if r.Check != "" {
			fields = append(fields, zap.String("their_secret_check", r.Check))
		}
		j.log.Warn("ignored a rendezvous record that fails the job secret's check (forged, replayed, or written by an agent "+
			"without this job's secret); the first from this source", fields...)
	}
}

// errNoSecret: this agent found a record sealed under a job secret and
// holds none.
func errNoSecret() error {
	return invalidf("the rendezvous records are sealed under a job secret and this node holds none: "+
		"every agent of a job needs the same secret (--job-secret-file or %s)", JobSecretEnv)
}

// join completes the next round, turning the rendezvous's errors into the
// agent's.
func (j *jobNode) join(ctx context.Context) (rendezvous.Round, error) {
	round, err := j.dyn.Next(ctx)
	switch {
	case errors.Is(err, rendezvous.ErrRendezvousClosed):
		j.seenClosed(ctx)
		return round, j.closedError(ctx)
	case errors.Is(err, rendezvous.ErrSealedRecord):
		return round, errNoSecret()
	case errors.Is(err, rendezvous.ErrRendezvousTimeout) && j.sealed != nil && j.sealed.Refused() > 0:
		return round, fmt.Errorf("%w (%d rendezvous record(s) failed the job secret's check and were ignored: "+
			"does every agent of the job hold the same secret?)", err, j.sealed.Refused())
	case err != nil:
		return round, err // it says "rendezvous: run …"
	}
	j.round = round
	j.lastSeen = time.Now()
	return round, nil
}

// roundView is what a node's plan takes from a complete round: every
// member (infos and ids, in group-rank order) when the round came with
// them, else this node's summary (queue mode, rendezvous.Round.Summary).
type roundView struct {
	// infos and ids are the members' published infos and identities by
	// group rank; nil with a summary.
	infos []nodeInfo
	ids   []string
	// groupRank is this node's, size the number of nodes.
	groupRank, size int
	// offset is the first global rank of this node's workers, world the
	// number of workers of all nodes.
	offset, world int
	// rank0 is the node of group rank 0.
	rank0 rendezvous.NodeDesc
	// mixed: the round's nodes do not all hold this node's job secret
	// (sameSecret's error); nil when they do.
	mixed error
}

// view reads round as this node's plan needs it: from its summary when
// the round came without members (a queue-mode round, ShareOnly), else
// from the members. A round with neither (its folder could not plan it)
// has its members read now.
func (j *jobNode) view(ctx context.Context, round rendezvous.Round) (roundView, error) {
	if round.Members == nil && round.Summary != nil {
		j.log.Debug("planning the round from this node's summary; no member list read", zap.Int("round", round.Number),
			zap.Int("group_rank", round.Rank), zap.Int("nodes", round.Size), zap.Int("world_size", round.Summary.Total))
		return j.summaryView(round)
	}
	if round.Members == nil {
		ms, err := j.dyn.Members(ctx)
		if err != nil {
			return roundView{}, fmt.Errorf("rendezvous: the members of round %d: %w", round.Number, err)
		}
		round.Members = ms
	}
	infos, ids, me, rank0, err := j.order(round)
	if err != nil {
		return roundView{}, err
	}
	nodes := make(nodeRanks, len(infos))
	for i, in := range infos {
		nodes[i].nproc = in.NProc
	}
	return roundView{infos: infos, ids: ids, groupRank: me, size: len(infos), offset: nodes.offset(me), world: nodes.world(),
		rank0: rank0, mixed: sameSecret(infos, ids, me)}, nil
}

// summaryView is view from the round's summary: O(1) bytes, whatever the
// number of nodes.
func (j *jobNode) summaryView(round rendezvous.Round) (roundView, error) {
	s := round.Summary
	v := roundView{groupRank: round.Rank, size: round.Size, offset: s.Offset, world: s.Total, rank0: s.First.Node}
	var first nodeInfo
	if err := json.Unmarshal(s.First.Data, &first); err != nil {
		return roundView{}, fmt.Errorf("rendezvous: node %s published %q: %w", s.First.Node, s.First.Data, err)
	}
	// What this node published (start): the rendezvous compared every
	// node's check with rank 0's.
	mine := j.cfg.JobSecret.check(j.runID)
	switch {
	case first.SecretCheck != mine:
		v.mixed = secretMismatch(mine, first, s.First.Node.String())
	case s.Dissent != nil:
		var theirs nodeInfo
		if err := json.Unmarshal(s.Dissent.Data, &theirs); err != nil {
			return roundView{}, fmt.Errorf("rendezvous: node %s published %q: %w", s.Dissent.Node, s.Dissent.Data, err)
		}
		v.mixed = secretMismatch(mine, theirs, s.Dissent.Node.String())
	}
	return v, nil
}

// order returns the members' published infos and identities in group-rank
// order and this node's group rank: the round's ranks for c10d, the node
// ranks for static.
func (j *jobNode) order(round rendezvous.Round) ([]nodeInfo, []string, int, rendezvous.NodeDesc, error) {
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
		ms[i].node, ms[i].me = m.Node, m.Node == j.me
	}
	if j.cfg.Rendezvous.Backend == backendStatic {
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
		return nil, nil, 0, rendezvous.NodeDesc{}, fmt.Errorf("rendezvous: round %d does not include this node %s", round.Number, j.me)
	}
	return infos, ids, me, ms[0].node, nil
}

// refuseMixedSecrets fails when the round's nodes do not all hold this
// node's job secret (v.mixed: sameSecret, or the round's summary). Every
// node of the round finds that in the round itself and stops with its own
// clear error; each says it needs the rendezvous store no more
// (seenClosed), so that the store's host waits for the others to have
// read the round before it takes the store away with it.
func (j *jobNode) refuseMixedSecrets(ctx context.Context, v roundView) error {
	err := v.mixed
	if err != nil {
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeWritesTimeout)
		defer cancel()
		j.seenClosed(wctx)
	}
	return err
}

// sameSecret checks that every node of a round holds the job secret node
// me holds (or, with me, none): a node that does not would be refused by
// the others' gossip and records, and run the job half blind. Every node
// of such a round stops with the same clear error (ErrInvalidConfig).
func sameSecret(infos []nodeInfo, ids []string, me int) error {
	mine := infos[me].SecretCheck
	for i, info := range infos {
		if info.SecretCheck != mine {
			return secretMismatch(mine, info, ids[i])
		}
	}
	return nil
}

// secretMismatch is the error of a node that shows check mine and meets
// node id, which published theirs with another.
func secretMismatch(mine string, theirs nodeInfo, id string) error {
	var what string
	switch {
	case mine == "":
		what = "holds a job secret and this node none"
	case theirs.SecretCheck == "":
		what = "holds no job secret, and this node one"
	default:
		what = "holds another job secret than this node"
	}
	return invalidf("node %s (%s) %s: every agent of a job needs the same secret (--job-secret-file or %s)",
		id, theirs.Addr, what, JobSecretEnv)
}

// statusEvery is how often to read the rendezvous state while workers run:
// every --monitor-interval, but no more often than a fifth of the
// keep-alive interval: every read gets the whole shared state (all nodes),
// so at torchrun's defaults (0.1 s, 5 s) a 1000-node job would otherwise
// make 10,000 reads of a ~100 KB state a second. A lost node is noticed
// within its keep-alive window plus one read.
func (j *jobNode) statusEvery(monitor time.Duration) time.Duration {
	return max(monitor, j.dcfg.KeepAliveInterval/5)
}

// status reads the rendezvous state and reports a change of the job that
// ends the current round, or nil.
func (j *jobNode) status(ctx context.Context) (*change, error) {
	window := j.dcfg.DropTimeout()
	// A read must not block on a store that is gone (the client would
	// retry connecting for the whole read_timeout).
	wctx, cancel := context.WithTimeout(ctx, window)
	defer cancel()
	st, err := j.dyn.Status(wctx)
	if err != nil {
		silent := time.Since(j.lastSeen)
		if rendezvous.SlowStore(err) {
			// It answers, late: a host swamped by a large job's agents
			// (at 512 on two cores every agent, the host's own included,
			// took it for gone after the keep-alive window), or one that
			// hangs. Gone only after read_timeout, as a torchrun agent's
			// store client would give up.
			window = max(window, j.cfg.rdzv.readTimeout)
			if !j.slowLogged {
				j.slowLogged = true
				j.log.Warn("the rendezvous store answers late; its host counts as gone only if it stays silent",
					zap.Duration("silent", silent.Round(time.Millisecond)), zap.Duration("gone_after", window), zap.Error(err))
			}
		}
		if silent > window {
			return &change{closed: true, storeLost: true}, nil
		}
		return nil, err
	}
	j.lastSeen, j.slowLogged = time.Now(), false
	switch {
	case st.Closed:
		ok, _ := j.outcome(ctx)
		return &change{closed: true, ok: ok}, nil
	case len(st.Lost) > 0 || len(st.Admitted) > 0:
		c := &change{waiting: st.Waiting}
		for _, n := range st.Lost {
			c.lost = append(c.lost, n.String())
		}
		for _, m := range st.Admitted {
			a := admitted{groupRank: m.Rank, id: m.Node.String()}
			if err := json.Unmarshal(m.Data, &a.info); err != nil {
				return nil, fmt.Errorf("node %v admitted with data %q: %w", m.Node, m.Data, err)
			}
			c.admitted = append(c.admitted, a)
		}
		return c, nil
	case st.Waiting > 0:
		return &change{waiting: st.Waiting}, nil
	}
	return nil, nil
}

// admitted is a node taken into the running round in a lost node's place.
type admitted struct {
	groupRank int
	id        string
	info      nodeInfo
}

// admit takes waiting nodes into the running round in the places of the
// lost nodes of group ranks groupRanks (membership.admit).
func (j *jobNode) admit(ctx context.Context, groupRanks []int) ([]string, error) {
	ns, err := j.dyn.Admit(ctx, groupRanks...)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(ns))
	for i, n := range ns {
		ids[i] = n.String()
	}
	return ids, nil
}

// failed counts the round's failure once for the whole job: the first node
// to report it increments the job's restart counter; the others find the
// round counted there and read the count. Nothing is kept per round: a job
// restarted a thousand times leaves one key.
func (j *jobNode) failed(ctx context.Context, p *plan, cause string) (bool, error) {
	n, counted, err := countRestart(ctx, j.store, j.restartsKey(), p.round, j.me.String())
	if err != nil {
		return false, fmt.Errorf("rendezvous store: %w", err)
	}
	if counted {
		j.log.Warn("round failed; counted a restart for the job", zap.Int("round", p.round), zap.String("cause", cause), zap.Int64("restarts", n))
	}
	return n <= int64(j.cfg.MaxRestarts), nil
}

// The job's restart counter holds "COUNT ROUND BY": the restarts counted
// so far, the round whose failure was counted last and the node that
// counted it (plain "COUNT" before the first; "COUNT ROUND" as an older
// agent wrote it). A node reads it once its round has completed, and a
// round's failure can be counted before then: a faster node's workers started and
// failed while this node's had not started yet. That restart is not one of
// the round's own, so restartsBefore leaves it out; without ROUND the slow
// node started its workers with TORCHELASTIC_RESTART_COUNT one too high
// (TestMultiNodeRestartCountedForTheJob's flake: a worker that takes the
// count for a restarted one exits at once, and its node leaves the job).

// parseRestarts reads the restart counter: the count and the round of the
// last failure counted (-1: none).
func parseRestarts(v []byte) (n int64, round int, err error) {
	count, last, found := strings.Cut(string(v), " ")
	if n, err = rendezvous.ParseCounter([]byte(count)); err != nil {
		return 0, 0, fmt.Errorf("restart count %q: %w", v, err)
	}
	round = -1
	if found {
		last, _, _ = strings.Cut(last, " ") // the counting node, if named
		if round, err = strconv.Atoi(last); err != nil {
			return 0, 0, fmt.Errorf("restart count %q: %w", v, err)
		}
	}
	return n, round, nil
}

// restartsBefore is the restart count for a node's round: the counter
// without a failure of that same round.
func restartsBefore(v []byte, round int) (int64, error) {
	n, last, err := parseRestarts(v)
	if err == nil && last == round && n > 0 {
		n--
	}
	return n, err
}

// countRestart adds the failure of round to the job's restart counter (a
// compare-and-set, as the value is not a plain number) unless it is
// counted already, and returns the count and whether this call, by the
// node named by, added to it. Rounds only grow, and a round fails once: a
// counter whose last round is round or later has counted it (the later
// round came after it ended). The counter names who counted last, so
// that two nodes counting the same round at once cannot both read the
// winner's value as their own.
func countRestart(ctx context.Context, s rendezvous.Store, key string, round int, by string) (n int64, counted bool, err error) {
	cur, err := s.Get(ctx, key)
	for err == nil {
		var last int
		if n, last, err = parseRestarts(cur); err != nil {
			break
		}
		if last >= round {
			return n, false, nil
		}
		next := []byte(strconv.FormatInt(n+1, 10) + " " + strconv.Itoa(round) + " " + by)
		var got []byte
		if got, err = s.CompareSet(ctx, key, cur, next); err == nil && bytes.Equal(got, next) {
			return n + 1, true, nil
		}
		cur = got // another node's count came between: again
	}
	return 0, false, err
}

// finish ends the job with this node's outcome: after a success it waits
// for the other nodes at the exit barrier (torchrun's: a node that
// finishes first must not look lost to the others), then it records the
// outcome and closes the rendezvous so that no node starts another round
// (closeJob). The node that ends the barrier closes the job before it
// does, so that the others find the run closed in one read.
func (j *jobNode) finish(ctx context.Context, p *plan, ok bool) {
	outcome := outcomeFailed
	if ok {
		outcome = outcomeSucceeded
	}
	if ok {
		bctx, cancel := context.WithTimeout(ctx, j.cfg.ExitBarrierTimeout)
		deadline, _ := bctx.Deadline()
		stop := announceWait(j.log, "the other nodes at the exit barrier", deadline, zap.Int("nodes", p.atBarrier()))
		err := j.exitBarrier(bctx, p, func(ctx context.Context) { j.closeJob(ctx, outcome) })
		stop()
		cancel()
		if err != nil {
			j.log.Warn("exit barrier: not every node finished in time", zap.Error(err))
		}
	}
	j.closeJob(ctx, outcome)
	j.seenClosed(ctx)
}

// closeJob records the job's outcome (recordOutcome) and closes the
// rendezvous. The others learn the end from these writes, so they are
// made whatever ctx says (a stop signal that ended the barrier), within
// closeWritesTimeout.
func (j *jobNode) closeJob(ctx context.Context, outcome string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeWritesTimeout)
	defer cancel()
	if err := j.recordOutcome(ctx, outcome); err != nil {
		j.log.Debug("recording the job's outcome", zap.Error(err))
	}
	if err := j.dyn.SetClosed(ctx); err != nil {
		j.log.Debug("closing the rendezvous", zap.Error(err))
	}
}

// recordOutcome records the job's outcome unless one is recorded: the
// first one stays; later ones agree or come too late. After a success the
// node that ends the exit barrier records it before it writes the end, so
// every other node finds it there; CreateOnce reads it where the store
// peeks instead of compare-setting it, a Raft proposal each on etcd, one
// per agent at the job's end.
func (j *jobNode) recordOutcome(ctx context.Context, outcome string) error {
	_, err := rendezvous.CreateOnce(ctx, j.store, j.outcomeKey(), []byte(outcome))
	return err
}

// exitBarrier waits for the round's nodes (p.barrierGroup) at the exit
// barrier: a tree of counters (exitTree), where torchrun's is one counter
// that every node adds to. The node whose arrival completes it calls
// ending, then writes the end (exitBarrierEnd), which every node waits
// for; a node with no place in the group only waits for the end.
//
// With a job secret, a forged count or end must not end it early: that
// would close the job as a success while other nodes' workers still run.
// So each node's arrival is also a sealed record of its own,
// exit_barrier/<g>, and the counters only say when to look: a node that
// completes the tree reads every arrival and ends the barrier only when
// all are there and genuine (a forged count can bring a node there early;
// the last genuine arrival still completes the tree after it), and the end
// is sealed (a forged end is waited past by the sealed read). A node's
// cost stays a few requests; the one that completes the tree reads the
// arrivals once.
func (j *jobNode) exitBarrier(ctx context.Context, p *plan, ending func(context.Context)) error {
	rs := j.round.Store(j.store, j.runID)
	group := p.barrierGroup()
	at := -1
	if len(p.assignments) > 0 {
		at = slices.Index(group, p.assignments[0].GroupRank)
	}
	if at >= 0 {
		if err := j.arriveAtExit(ctx, rs, group, at, ending); err != nil {
			return err
		}
	}
	if err := rs.Wait(ctx, exitBarrierEnd); err != nil {
		return err
	}
	if j.sealed == nil {
		return nil
	}
	_, err := rs.Get(ctx, exitBarrierEnd) // sealed: a forged end is not the end
	return err
}

// arriveAtExit is this node's arrival at the exit barrier, at position at
// of group, and its end if this arrival completes it (see exitBarrier).
func (j *jobNode) arriveAtExit(ctx context.Context, rs rendezvous.Store, group []int, at int, ending func(context.Context)) error {
	arrival := func(g int) string { return "exit_barrier/" + strconv.Itoa(g) }
	if j.sealed != nil {
		if err := rs.Set(ctx, arrival(group[at]), []byte("arrived")); err != nil {
			return err
		}
	}
	last, err := exitTree(ctx, j.store, exitTreePrefix(j.runID, j.round.Number), at, len(group))
	if err != nil || !last {
		return err
	}
	if j.sealed != nil {
		keys := make([]string, len(group))
		for i, g := range group {
			keys[i] = arrival(g)
		}
		if all, err := rs.Check(ctx, keys...); err != nil || !all {
			return err // a forged count brought this node here early
		}
	}
	if ending != nil {
		ending(ctx)
	}
	return rs.Set(ctx, exitBarrierEnd, []byte("every node arrived"))
}

// exitBarrierEnd is the exit barrier's end, in the round's store: every
// node waits for it.
const exitBarrierEnd = "exit_barrier/end"

// exitFanIn is how many nodes (or groups of the level below) share one
// counter of the exit barrier's tree.
const exitFanIn = 8

// exitTreePrefix is where the exit barrier's counters of run runID's
// round lie in the job's store: outside the round's own prefix, so that
// an etcd Storage can keep them out of every agent's watch (etcd.go's
// Unwatched: nobody waits on them).
func exitTreePrefix(runID string, round int) string {
	return exitTreeRun(runID) + strconv.Itoa(round) + "/"
}

// exitTreeRun is the prefix of run runID's exit barrier counters.
func exitTreeRun(runID string) string { return "gorun.exit_barrier." + runID + "." }

// exitTree counts one node's arrival at the exit barrier, the node at
// position at of a group of n, and reports whether the arrival completed
// the tree. The node adds to the counter of its group of exitFanIn; the
// node whose add completes the group carries it to the level above, and
// the one that completes the root's is told so. One counter that every
// node adds to is what torchrun's barrier is, and on etcd an add is a
// compare-set: 512 agents adding to one key at once cost hundreds of
// failed attempts a success, each a Raft proposal; the counter rose at
// 3.7 a second and a 512-agent job took 2.5 minutes to end
// (BENCHMARKS.md, issue 19). Here a counter has at most exitFanIn
// contenders. An add that finds its counter full carries on, so the last
// add to every counter does, whatever extra adds a forger made: the last
// arrival always completes the tree (and without a forger exactly one
// add to each counter carries).
func exitTree(ctx context.Context, counters rendezvous.Store, prefix string, at, n int) (bool, error) {
	for level := 0; n > 1; level++ {
		group := at / exitFanIn
		members := min(exitFanIn, n-group*exitFanIn)
		c, err := counters.Add(ctx, prefix+strconv.Itoa(level)+"/"+strconv.Itoa(group), 1)
		if err != nil {
			return false, fmt.Errorf("exit barrier: %w", err)
		}
		if c < int64(members) {
			return false, nil
		}
		at, n = group, (n+exitFanIn-1)/exitFanIn
	}
	return true, nil
}

// seenClosed tells the store's host that this node has seen the job
// closed and needs the store no more (see countSeenClosed).
func (j *jobNode) seenClosed(ctx context.Context) {
	if !j.countSeenClosed {
		return
	}
	if _, err := j.store.Add(ctx, j.seenClosedKey(), 1); err != nil {
		j.log.Debug("acknowledging the closed job", zap.Error(err))
	}
}

// outcome reads how the job ended, as the closing node recorded it.
func (j *jobNode) outcome(ctx context.Context) (ok bool, known bool) {
	if present, err := j.store.Check(ctx, j.outcomeKey()); err != nil || !present {
		return false, false
	}
	v, err := j.store.Get(ctx, j.outcomeKey())
	if err != nil {
		return false, false
	}
	return string(v) == outcomeSucceeded, true
}

// closedError explains a closed rendezvous met while joining.
func (j *jobNode) closedError(ctx context.Context) error {
	ok, known := j.outcome(ctx)
	switch {
	case known && !ok:
		return &JobFailedError{Reason: "another node ended the job after a failure"}
	case known:
		return fmt.Errorf("%w: the job already finished", ErrRendezvousClosed)
	}
	return ErrRendezvousClosed
}

// leave takes this node out of the rendezvous (stopped by a signal).
func (j *jobNode) leave(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := j.dyn.Leave(ctx); err != nil {
		j.log.Debug("leaving the rendezvous", zap.Error(err))
	}
}

// expel takes the node named node, found dead, out of the rendezvous (see
// expelNode). It works before this node's first round too.
func (j *jobNode) expel(ctx context.Context, node string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return expelNode(ctx, j.store, j.dcfg, node)
}

// close lets go of the rendezvous handle and the store.
func (j *jobNode) close() {
	if j.dyn != nil {
		j.dyn.Close()
	}
	if j.store != nil {
		j.store.Close()
	}
}
