package launcher

import (
	"context"
	"syscall"

	"go.uber.org/zap"
)

// superviseRestart is restart mode (torchrun's way) for one round: the
// first failure here — a worker's, or a lost node — stops the whole local
// group, and so does any change of the job; decide then restarts the
// group through a new rendezvous round, or ends the job.
func (a *agent) superviseRestart(ctx context.Context, w *roundWatch) outcome {
	for w.g.running > 0 {
		ev := w.next(ctx)
		switch ev.kind {
		case evStopped:
			return ev.stopped
		case evWorkerExit:
			if ev.exit.ok() {
				continue
			}
			// Collect the failures that come together (within a monitor
			// interval, torchrun's granularity), then stop the others:
			// torchrun stops the whole local group on a failure.
			failures := w.gatherFailures(a.failure(ev.exit), a.cfg.MonitorInterval)
			a.log.Warn("worker failed", zap.Int("rank", ev.exit.w.a.Rank), zap.Stringer("exit", ev.exit.e))
			w.stop(syscall.SIGTERM)
			return outcome{failures: failures}
		case evNodeDead:
			// The survivors re-rendezvous without it now, rather than
			// when its rendezvous keep-alive lapses.
			a.log.Warn("stopping workers: node liveness declared a node dead", zap.String("node", ev.node), zap.String("why", ev.why))
			if err := a.m.expel(ctx, ev.node); err != nil {
				a.log.Warn("taking the dead node out of the rendezvous; the next round waits for its keep-alive to lapse", zap.String("node", ev.node), zap.Error(err))
			}
			w.stop(syscall.SIGTERM)
			return outcome{change: &change{lost: []string{ev.node}}}
		case evJobChanged:
			a.log.Warn("stopping workers: the job changed", zap.Stringer("change", ev.change))
			w.stop(syscall.SIGTERM)
			return outcome{change: ev.change}
		}
	}
	w.finish()
	return outcome{}
}
