package launcher

import (
	"context"
	"fmt"
	"slices"
	"syscall"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/shrink"
)

// superviseShrink is shrink mode (--on-failure shrink) for one round: a
// failure here is reported to the survivors' agreement (sv) and the other
// workers run on; the epochs the agreement publishes say who is out. The
// round lasts until the local workers are done and every local failure is
// decided: this node may lead the agreement. It falls back to a restart
// when the agreement decides one (too few survivors) or gives up.
func (a *agent) superviseShrink(ctx context.Context, w *roundWatch, sv *survivors) outcome {
	var out outcome
	fallBack := func(why string) outcome {
		a.log.Warn("shrink mode gives up: stopping workers to restart the group", zap.String("why", why))
		w.stop(syscall.SIGTERM)
		out.fallback = why
		return out
	}
	for w.g.running > 0 || !sv.settled() {
		ev := w.next(ctx)
		switch ev.kind {
		case evStopped:
			return ev.stopped
		case evWorkerExit:
			if ev.exit.e.Code() == 0 {
				continue
			}
			f := a.failure(ev.exit)
			if !sv.epoch.Alive(f.Rank) {
				out.lost = append(out.lost, f) // excluded before it ended
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
		case evAgreementFailed:
			return fallBack(ev.err.Error())
		case evNodeDead:
			n, err := sv.nodesLost(ctx, []string{ev.node}, "node liveness: "+ev.why)
			a.endpoint.FailureReported(ReportNode, n)
			if err != nil {
				return fallBack(err.Error())
			}
		case evJobChanged:
			if !ev.change.closed {
				// Survivors carry on: a lost node's ranks are reported,
				// and nodes waiting to join are admitted at the next
				// round.
				n, err := sv.nodesLost(ctx, ev.change.lost, "its rendezvous keep-alive lapsed")
				a.endpoint.FailureReported(ReportNode, n)
				if err != nil {
					return fallBack(err.Error())
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

// adoptEpoch acts on a shrink epoch here: local workers it excludes that
// still run (hung, or on a node taken for lost) are killed, so that no
// excluded rank comes back; failures it excludes become losses. It reports
// whether the epoch is a restart.
func (a *agent) adoptEpoch(g *group, sv *survivors, e shrink.Epoch, out *outcome) (restart bool) {
	local := make([]int, len(g.workers))
	for i, w := range g.workers {
		local[i] = w.a.Rank
	}
	excluded, reportedAt := sv.adopt(e, local)
	a.endpoint.EpochAdopted(e, reportedAt)
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
		if !w.exited && slices.Contains(excluded, w.a.Rank) {
			a.log.Warn("stopping a worker the epoch excludes", zap.Int("rank", w.a.Rank), zap.Int("epoch", e.Number))
			w.excluded = true
			syscall.Kill(-w.proc.Pid, syscall.SIGKILL)
		}
	}
	return false
}
