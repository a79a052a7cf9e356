package launcher

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/shrink"
)

// superviseShrink is shrink mode (--on-failure shrink) for one round: a
// failure here is reported to the survivors' agreement (sv) and the other
// workers run on; the epochs the agreement publishes say who is out, and,
// with heal (--regrow on), who comes back: a lost local slot is respawned
// after a backoff and grown back in. The round lasts until the local
// workers are done, every local failure is decided and no respawn is
// due: this node may lead the agreement. It falls back to a restart when
// the agreement decides one (too few survivors) or gives up.
func (a *agent) superviseShrink(ctx context.Context, w *roundWatch, sv *survivors) outcome {
	var out outcome
	fallBack := func(why string) outcome {
		if ctx.Err() != nil {
			// A store request cut short by a stop signal is not the
			// agreement giving up: the agent stops as the signal says
			// (exit 128+N), not as a failed job.
			return w.stopped(ctx).stopped
		}
		a.log.Warn("shrink mode gives up: stopping workers to restart the group", zap.String("why", why))
		w.stop(syscall.SIGTERM)
		out.fallback = why
		return out
	}
	for w.g.running > 0 || !sv.settled() || w.respawns.pending() {
		// The pace of the job's polls follows this node's part: faster
		// while it leads, faster still while heal has a place to fill.
		w.pace(a.cfg.Regrow && sv.leading && len(sv.vacant()) > 0, sv.leading)
		ev := w.next(ctx)
		switch ev.kind {
		case evStopped:
			return ev.stopped
		case evWorkerExit:
			if ev.exit.ok() {
				a.finishedHere(w, sv)
				continue
			}
			if ev.exit.w.dropped {
				continue // stopped here: its slot was lost before, and the job is done
			}
			f := a.failure(ev.exit)
			if !sv.epoch.Alive(f.Rank) {
				if ev.exit.w.newcomer && !ev.exit.w.excluded {
					a.log.Warn("a respawned worker failed before it was grown back in", zap.Int("rank", f.Rank),
						zap.Stringer("exit", ev.exit.e))
				}
				out.lost = append(out.lost, f) // excluded before it ended
				a.respawnLater(w, sv, ev.exit.w)
				continue
			}
			a.log.Warn("worker failed; reporting it to the survivors", zap.Int("rank", f.Rank), zap.Stringer("exit", ev.exit.e))
			out.failures = append(out.failures, f)
			a.endpoint.FailureReported(ReportWorker, 1)
			if err := sv.workerFailed(ctx, f); err != nil {
				return fallBack(err.Error())
			}
		case evEpoch:
			if restart := a.adoptEpoch(w.g, sv, ev.epoch, &out); restart {
				return fallBack(fmt.Sprintf("epoch %d would leave %d rank(s), below --min-world-size %d",
					ev.epoch.Number, ev.epoch.WorldSize, a.cfg.MinWorldSize))
			}
			if err := a.newcomersGone(ctx, w.g, sv, ev.epoch, &out); err != nil {
				return fallBack(err.Error())
			}
			for _, wk := range w.g.workers {
				a.respawnLater(w, sv, wk)
			}
		case evRespawnDue:
			a.respawn(ctx, w, sv, ev.slot)
		case evGrown:
			a.grown(sv, ev.grown)
			// A standby taken for a respawn is replaced once its grow
			// is over, not beside it: its start-up would take CPU from
			// the grow that everyone waits on.
			w.standbys.fill(a.reaper, a.con, &a.cfg, w.spec, a.log)
		case evAgreementFailed:
			return fallBack(ev.err.Error())
		case evNodeDead:
			n, err := sv.nodesLost(ctx, []string{ev.node}, "node liveness: "+ev.why, false)
			if err == nil {
				a.endpoint.FailureReported(ReportNode, n)
			} else {
				// Not fatal: a node that cannot reach the store to report
				// the others may be the one cut off, and the epoch that
				// excludes it will tell it so when its link is back (a
				// restart here left the job to finish without it). A store
				// that is gone for good ends the round by the rendezvous
				// watch ("the rendezvous store stopped answering").
				a.log.Warn("cannot report the lost node's ranks; this node may be the one cut off: going on",
					zap.String("node", ev.node), zap.Error(err))
			}
			if n > 0 && a.cfg.Regrow && sv.leading {
				// Out of the rendezvous now, not when its keep-alive
				// lapses: a replacement finds room at once.
				if err := a.m.expel(ctx, ev.node); err != nil {
					a.log.Debug("expelling a lost node", zap.String("node", ev.node), zap.Error(err))
				}
			}
		case evNodeBack:
			sv.nodeBack(ctx, ev.node, ev.why)
		case evJobChanged:
			if !ev.change.closed {
				// Survivors carry on: a lost node's ranks are reported;
				// with heal, a node waiting to join takes a lost node's
				// place, else it joins at the next round.
				for _, ad := range ev.change.admitted {
					if ad.groupRank == sv.me && ad.id != sv.nodeIDs[sv.me] {
						return a.placeTaken(w, ad, out)
					}
					w.p.replace(ad)
					sv.replaced(ad.groupRank, ad.id)
				}
				if len(ev.change.admitted) > 0 {
					a.gossip.expect(w.p.gossip)
				}
				n, err := sv.nodesLost(ctx, ev.change.lost, "its rendezvous keep-alive lapsed", true)
				a.endpoint.FailureReported(ReportNode, n)
				if err != nil {
					return fallBack(err.Error())
				}
				if ev.change.waiting > 0 {
					a.admitWaiting(ctx, w, sv)
				}
				continue
			}
			a.log.Warn("stopping workers: the job changed", zap.Stringer("change", ev.change))
			w.stop(syscall.SIGTERM)
			return outcome{change: ev.change, lost: out.lost, failures: out.failures}
		}
	}
	w.finish()
	return out
}

// placeTaken ends the round on a node whose own place in it went to
// another (ad): the others took it for lost (a link cut, a keep-alive
// that lapsed) and, with heal, admitted a waiting node (a hot spare) in
// its place. Its workers are out of the job, whatever their state; the
// node stops them and joins again as a waiting node, a spare for the
// next loss. No failure of the job: nothing is counted. (Left to run on,
// it reported failures for ranks another node now holds, waited for an
// agreement that would never decide them, and fell back to a restart it
// counted against the job.)
func (a *agent) placeTaken(w *roundWatch, ad admitted, out outcome) outcome {
	a.log.Warn("this node's place in the round went to another node (the others took it for lost); "+
		"stopping its workers and joining again as a waiting node", zap.Int("group_rank", ad.groupRank), zap.String("node", ad.id))
	w.stop(syscall.SIGTERM)
	out.placeTaken = true
	return out
}

// adoptEpoch acts on an epoch here: local workers it excludes that still
// run (hung, or on a node taken for lost) are killed, so that no excluded
// rank comes back but by a grow; failures it excludes become losses. It
// reports whether the epoch is a restart.
func (a *agent) adoptEpoch(g *group, sv *survivors, e shrink.Epoch, out *outcome) (restart bool) {
	local := make([]int, len(g.workers))
	for i, w := range g.workers {
		local[i] = w.a.Rank
	}
	excluded, reportedAt := sv.adopt(e, local)
	a.endpoint.EpochAdopted(e, reportedAt)
	if e.Action == shrink.ActionGrow {
		var added []int
		for _, w := range g.workers {
			if e.Newcomer(w.a.Rank) {
				added = append(added, w.a.Rank)
				w.grownIn = e.Number
			}
		}
		a.log.Warn(fmt.Sprintf("grow epoch=%d world=%d added=%v", e.Number, e.WorldSize, e.Added),
			zap.String("coordinator", e.Coordinator), zap.Ints("local_added", added))
		return false
	}
	a.log.Warn(fmt.Sprintf("shrink epoch=%d world=%d excluded=%v", e.Number, e.WorldSize, e.Excluded),
		zap.String("action", string(e.Action)), zap.String("coordinator", e.Coordinator),
		zap.Ints("local_excluded", excluded))
	kept := out.failures[:0]
	for _, f := range out.failures {
		if e.Alive(f.Rank) {
			kept = append(kept, f)
		} else {
			out.lost = append(out.lost, f)
		}
	}
	out.failures = kept
	if e.Action == shrink.ActionRestart {
		return true
	}
	for _, w := range g.workers {
		// A newcomer not grown in yet is out of every epoch until its
		// grow: one that came late sees the epochs before it.
		if !w.exited && slices.Contains(excluded, w.a.Rank) && (!w.newcomer || w.grownIn > 0) {
			a.log.Warn("stopping a worker the epoch excludes", zap.Int("rank", w.a.Rank), zap.Int("epoch", e.Number))
			w.excluded = true
			syscall.Kill(-w.proc.Pid, syscall.SIGKILL)
		}
	}
	return false
}

// newcomersGone reports the local slots that grow epoch e adds but whose
// newcomer has exited: a Join it filed before it died (or before an epoch
// excluded it and this agent stopped it) brought the grow, and nobody will
// join in that slot. Reported now, the grow ends in a shrink at once,
// not at its grow timeout, with every member blocked meanwhile, and the
// slot is respawned; the agent does not respawn a slot the current epoch
// has alive.
func (a *agent) newcomersGone(ctx context.Context, g *group, sv *survivors, e shrink.Epoch, out *outcome) error {
	if e.Action != shrink.ActionGrow {
		return nil
	}
	for _, wk := range g.workers {
		if !wk.exited || !e.Newcomer(wk.a.Rank) {
			continue
		}
		f := newFailure(wk.a.LocalRank, wk.a.Rank, wk.exit, wk.errorFile, a.host)
		// The news is of the slot's life in e, whoever e expected there:
		// the life of a newcomer an epoch before e excluded (its Join read
		// late, or filed again as it was stopped) would make the report
		// stale, and the grow would wait for a newcomer nobody will start.
		f.Since = e.Number - 1
		f.Message = fmt.Sprintf("the grow of epoch %d adds slot %d, whose newcomer is gone (%s)", e.Number, wk.a.Rank, f.Message)
		a.log.Warn("a grow adds a slot whose newcomer is gone; reporting it", zap.Int("rank", wk.a.Rank), zap.Int("epoch", e.Number))
		out.failures = append(out.failures, f)
		a.endpoint.FailureReported(ReportWorker, 1)
		if err := sv.workerFailed(ctx, f); err != nil {
			return err
		}
	}
	return nil
}

// admitWaiting, on the node that leads the agreement with heal on, takes
// nodes waiting to join into the places of lost nodes whose ranks are all
// out: a replacement node's workers then join the running group by a grow,
// the survivors never restarted. The lost nodes are expelled from the
// rendezvous first, in case their keep-alives have not lapsed yet (node
// liveness found them dead sooner).
//
// Every vacant place is filled in one admission, or none is: a node
// admitted beside a place left empty does not take its own (the
// rendezvous hands a late node only a whole round), and goes back to
// waiting. Admitted one place at a time, a lone spare after two nodes
// lost went in and out of the wait list, the leader admitting it again at
// every read of the rendezvous state (every second) and none of its
// workers ever joining (bench/chaos). Short of waiting nodes, the job runs
// on shrunk until enough of them wait; the admission is tried again at
// each read.
func (a *agent) admitWaiting(ctx context.Context, w *roundWatch, sv *survivors) {
	if !a.cfg.Regrow || !sv.leading {
		return
	}
	places := sv.vacant()
	if len(places) == 0 {
		return
	}
	for _, g := range places {
		if err := a.m.expel(ctx, w.p.nodeIDs[g]); err != nil {
			a.log.Debug("expelling a lost node", zap.String("node", w.p.nodeIDs[g]), zap.Error(err))
		}
	}
	ids, err := a.m.admit(ctx, places)
	switch {
	case errors.Is(err, rendezvous.ErrNoWaitingNode), errors.Is(err, rendezvous.ErrPlacesLeft):
		// Not yet: more nodes to wait, or a lost node's ranks still to
		// go out. Said once for each reason, not at every read.
		if why := err.Error(); why != sv.unfilled {
			sv.unfilled = why
			a.log.Info("lost nodes' places stay vacant for now", zap.Ints("group_ranks", places), zap.Error(err))
		}
		return
	case err != nil:
		a.log.Warn("cannot admit waiting nodes", zap.Ints("group_ranks", places), zap.Error(err))
		return
	}
	sv.unfilled = ""
	for k, g := range places {
		a.log.Warn("admitted a waiting node in a lost node's place", zap.Int("group_rank", g),
			zap.String("node", ids[k]), zap.String("lost", w.p.nodeIDs[g]))
	}
}

// respawnLater starts the backoff of wk's slot when heal is on, wk has
// exited and the current epoch has its slot lost.
func (a *agent) respawnLater(w *roundWatch, sv *survivors, wk *worker) {
	if w.respawns == nil || !wk.exited || sv.epoch.Alive(wk.a.Rank) {
		return
	}
	if d, ok := w.respawns.schedule(wk.a.Rank); ok {
		a.log.Info("rank will be respawned and grown back in", zap.Int("rank", wk.a.Rank), zap.Duration("in", d))
	}
}

// respawn starts a newcomer in lost slot (a global rank of this node) once
// its backoff is over, if the job's respawn budget allows: it joins the
// running group by the grow epoch its Join brings.
func (a *agent) respawn(ctx context.Context, w *roundWatch, sv *survivors, slot int) {
	w.respawns.fired(slot)
	i := slices.IndexFunc(w.g.workers, func(wk *worker) bool { return wk.a.Rank == slot })
	if i < 0 || !w.g.workers[i].exited || sv.epoch.Alive(slot) {
		return
	}
	n, ok, err := sv.takeRespawn(ctx, a.cfg.MaxRespawns)
	switch {
	case err != nil:
		a.log.Warn("rank stays out: cannot count its respawn", zap.Int("rank", slot), zap.Error(err))
		return
	case !ok:
		a.endpoint.Respawned(false)
		a.log.Warn("rank stays out: the job's respawn budget is spent", zap.Int("rank", slot),
			zap.Int("max_respawns", a.cfg.MaxRespawns))
		return
	}
	if a.heartbeats != nil {
		a.heartbeats.Start(w.g.workers[i].a.LocalRank)
	}
	old := w.g.workers[i]
	var wk *worker
	var parkedFor time.Duration
	if sb := w.standbys.take(); sb != nil {
		since := sb.started
		took, err := w.g.takeSlot(&a.cfg, w.spec, sb, old, sv.epoch.Number)
		switch {
		case err != nil:
			a.log.Error("rank stays out: the standby could not take its place", zap.Int("rank", slot), zap.Error(err))
			return
		case took:
			wk, parkedFor = sb, time.Since(since)
		}
		// Not took: the standby had exited; its exit, on the standbys'
		// channel, is logged. The respawn starts cold.
	}
	if wk == nil {
		var err error
		if wk, err = w.g.respawn(a.reaper, a.con, &a.cfg, w.spec, old, sv.epoch.Number); err != nil {
			a.log.Error("rank stays out: its respawn did not start", zap.Int("rank", slot), zap.Error(err))
			return
		}
	}
	a.endpoint.Respawned(true)
	fields := []zap.Field{zap.Int("rank", slot), zap.Int("pid", wk.proc.Pid), zap.Int("after_epoch", sv.epoch.Number),
		zap.Int("respawn", n), zap.Int("max_respawns", a.cfg.MaxRespawns)}
	if parkedFor > 0 {
		fields = append(fields, zap.Duration("standby_parked_for", parkedFor.Round(time.Millisecond)))
	}
	a.log.Warn("respawned a lost rank; it joins the running group by a grow", fields...)
}

// grown notes that a grow completed, and logs it: every rank of it is in
// the grown group, the local newcomers it added included.
func (a *agent) grown(sv *survivors, c shrink.Complete) {
	sv.completed[c.Epoch] = true
	for _, e := range sv.epochs {
		if e.Number == c.Epoch {
			a.endpoint.GrowComplete(e.DecidedAt, c.At)
			a.log.Info(fmt.Sprintf("grow epoch=%d complete: world %d", e.Number, e.WorldSize),
				zap.Duration("decided_to_complete", c.At.Sub(e.DecidedAt)))
			return
		}
	}
}

// finishedHere ends heal on this node once a local worker has succeeded:
// the job is done here, and no grow can complete any more, since that
// worker will not take part in one. A pending respawn is dropped, and
// newcomers not in a completed grow are stopped: they could not join a
// group that has finished. (Stopped only once every local member had
// ended, a newcomer whose grow was under way when the members finished
// kept the job going, grow after grow timing out and respawn after
// respawn, until the budget was spent: seen with PyTorch workers, which
// step on while a grow's group is built, and finished first.)
func (a *agent) finishedHere(w *roundWatch, sv *survivors) {
	if w.respawns == nil {
		return
	}
	w.respawns.cancel()
	w.respawns = nil
	for _, wk := range w.g.workers {
		if !wk.exited && wk.newcomer && !sv.completed[wk.grownIn] {
			a.log.Info("stopping a newcomer: the group it was to join has finished", zap.Int("rank", wk.a.Rank))
			wk.dropped = true
			syscall.Kill(-wk.proc.Pid, syscall.SIGTERM)
		}
	}
}
