package launcher

import (
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/launcher/reaper"
)

// This file is heal's standbys (Config.RespawnStandbys): workers started
// parked beside a round's, their start-up done, each waiting to take the
// slot of a local rank that is lost. The respawn that heal makes of a lost
// rank then costs an assignment on a pipe, not a start-up (a Python
// interpreter, torch's imports, a checkpoint read: seconds to minutes),
// during which the job runs a rank short.

// standbys are one round's parked standbys.
type standbys struct {
	want   int
	parked []*worker
	// exits are the standbys' while parked: one that takes a slot sends
	// its exit to its group's channel instead (exitRoute). Buffered for
	// every standby parked at once, so that a send never waits.
	exits chan workerExit
}

// newStandbys returns the round's standbys, none started yet; nil (no
// standbys, every method a no-op) when want is 0.
func newStandbys(want int) *standbys {
	if want <= 0 {
		return nil
	}
	return &standbys{want: want, exits: make(chan workerExit, want)}
}

// exitsC is the channel the standbys' exits come on while parked; nil for
// no standbys (a receive on it never proceeds).
func (s *standbys) exitsC() <-chan workerExit {
	if s == nil {
		return nil
	}
	return s.exits
}

// fill starts standbys until want are parked. One that cannot start is
// logged and given up on for now: respawns start cold meanwhile.
func (s *standbys) fill(rp *reaper.Reaper, con *console, cfg *Config, spec spawnSpec, log *zap.Logger) {
	if s == nil {
		return
	}
	spec.parked, spec.standby = true, true
	for len(s.parked) < s.want {
		a := Assignment{LocalRank: -1, Rank: -1, GroupRank: -1, LocalWorldSize: cfg.NProcPerNode}
		w, err := startWorker(rp, con, cfg, spec, a, nil, s.exits)
		if err != nil {
			log.Warn("cannot start a standby; a lost rank is respawned cold", zap.Error(err))
			return
		}
		s.parked = append(s.parked, w)
		log.Info("started a standby: it waits, parked, to take a lost rank's place (--respawn-standbys)",
			zap.Int("pid", w.proc.Pid), zap.Int("standbys", len(s.parked)))
	}
}

// take returns the standby parked longest (its start-up the likeliest
// done) and forgets it; nil when none is parked.
func (s *standbys) take() *worker {
	if s == nil || len(s.parked) == 0 {
		return nil
	}
	w := s.parked[0]
	s.parked = s.parked[1:]
	return w
}

// exited forgets the standby of x, which exited while parked, and logs it
// with the end of what it wrote: a standby that cannot start is the first
// sign that respawns will not either. It is not replaced until a grow
// completes (the next respawn, cold, grown in), so that one that always
// fails does not start again and again.
func (s *standbys) exited(x workerExit, contain *containment, log *zap.Logger) {
	s.forget(x, contain)
	stderr, _ := x.w.out.heldTail(1, 2<<10)
	log.Warn("a standby exited while parked; the next respawn starts cold",
		zap.Int("pid", x.w.proc.Pid), zap.Stringer("exit", x.e), zap.Duration("after", time.Since(x.w.started).Round(time.Millisecond)),
		zap.String("stderr_tail", stderr))
}

// signal starts ending the parked standbys: their assignment pipes are
// closed (a parked worker reads end of file and exits on its own:
// gorun_ft and Go's package prestart do), and they get sig.
func (s *standbys) signal(sig syscall.Signal) {
	if s == nil {
		return
	}
	for _, w := range s.parked {
		w.closeAssignment()
		syscall.Kill(-w.proc.Pid, sig)
		syscall.Kill(-w.proc.Pid, syscall.SIGCONT)
	}
}

// wait returns once every parked standby has exited and its output is
// drained, killing those left after grace.
func (s *standbys) wait(grace time.Duration, contain *containment) {
	if s == nil {
		return
	}
	deadline := time.NewTimer(grace)
	defer deadline.Stop()
	for len(s.parked) > 0 {
		select {
		case x := <-s.exits:
			s.forget(x, contain)
		case <-deadline.C:
			for _, w := range s.parked {
				syscall.Kill(-w.proc.Pid, syscall.SIGKILL)
			}
		}
	}
}

// forget takes the standby of x, which ended, out of the parked ones and
// tidies what it had: its process group, its cgroup, its output.
func (s *standbys) forget(x workerExit, contain *containment) {
	for i, w := range s.parked {
		if w == x.w {
			s.parked = append(s.parked[:i], s.parked[i+1:]...)
			break
		}
	}
	x.w.exited, x.w.exit = true, x.e
	x.w.closeAssignment()
	syscall.Kill(-x.w.proc.Pid, syscall.SIGKILL) // ESRCH when nothing is left
	contain.remove(x.w)
	x.w.out.drain(outputDrainTimeout)
}
