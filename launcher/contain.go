package launcher

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/launcher/cgroup"
	"github.com/gorunhq/gorun/launcher/reaper"
)

// Cgroup modes (Config.Cgroup); anything else is a cgroup v2 directory.
const (
	CgroupAuto = "auto"
	CgroupOff  = "off"
)

// cgroupRemoveTimeout bounds the wait for a killed cgroup's processes to
// be gone before its directory is removed (a process in uninterruptible
// sleep can take a while to die).
const cgroupRemoveTimeout = 5 * time.Second

// containment is how the agent holds what its workers start: a cgroup v2
// per worker under a jail, and a guard that empties the jail if the
// agent dies; and how it tells an OOM kill from any other SIGKILL. The
// zero value confines nothing (the subreaper alone) and tells no OOM.
type containment struct {
	jail      *cgroup.Jail
	guard     *cgroup.Guard
	guardExit <-chan reaper.Exit
	// own is the agent's memory cgroup's OOM count, for workers whose
	// slot has none.
	own    cgroup.OOMCounter
	hasOwn bool
	log    *zap.Logger
}

// openContainment sets up a.containment from a.cfg.Cgroup: under auto, a
// jail in the agent's own cgroup v2 where one is writable, else none
// (logged); under a path, a jail there or ErrLocalResource. The agent's
// own OOM count is read in every mode.
func (a *agent) openContainment() error {
	c := &a.containment
	c.log = a.log
	mode := a.cfg.Cgroup
	if mode == "" {
		mode = CgroupAuto
	}
	self, err := cgroup.Locate()
	if err != nil {
		a.log.Debug("cannot read this process's cgroups", zap.Error(err))
	}
	c.own, c.hasOwn = cgroup.OwnOOMCounter(self)
	if mode == CgroupOff {
		return nil
	}
	parent := mode
	if mode == CgroupAuto {
		parent = self.V2
	}
	// The jail's name says whose it is — the agent's PID, and the PID
	// namespace that number belongs to — so that a later agent can tell
	// a dead agent's jail from a live one's (SweepStale).
	prefix, known := jailPrefix()
	if parent != "" && known {
		if removed, err := cgroup.SweepStale(parent, prefix, cgroupRemoveTimeout); len(removed) > 0 || err != nil {
			a.log.Info("removed the cgroups of agents that died with their guard", zap.Strings("jails", removed), zap.Error(err))
		}
		if removed, err := cgroup.SweepDeadNamespaces(parent, jailFamily, cgroupRemoveTimeout); len(removed) > 0 || err != nil {
			a.log.Info("removed the cgroups of agents that were PID 1 of a namespace now gone", zap.Strings("jails", removed), zap.Error(err))
		}
	}
	j, err := cgroup.Open(parent, fmt.Sprintf("%s%d-%s", prefix, os.Getpid(), randomID()[:8]))
	if err != nil {
		if mode == CgroupAuto {
			a.log.Info("workers share the agent's cgroup: what they leave behind is killed when their group ends, "+
				"and survives the agent if it is SIGKILLed outside a PID namespace of its own", zap.Error(err))
			return nil
		}
		return localf("--cgroup: %w", err)
	}
	c.jail = j
	// PID 1 of a PID namespace needs no guard: its death ends every
	// process of the namespace, whatever cgroup holds them.
	if os.Getpid() != 1 {
		g, err := j.StartGuard(a.cfg.CgroupGuard, func(name string, argv []string, attr *os.ProcAttr) (*os.Process, error) {
			p, ch, err := a.reaper.Start(name, argv, attr)
			c.guardExit = ch
			return p, err
		})
		if err != nil {
			a.log.Warn("no guard for the workers' cgroups: what they start survives the agent if it is SIGKILLed", zap.Error(err))
		}
		c.guard = g
	}
	a.log.Debug("each worker runs in a cgroup of its own", zap.String("jail", j.Dir()), zap.Bool("memory", j.Memory()),
		zap.Bool("guard", c.guard != nil))
	return nil
}

// close kills what is left in the jail, removes it and ends the guard.
func (c *containment) close() {
	removed := true
	if c.jail != nil {
		if err := c.jail.Close(cgroupRemoveTimeout); err != nil {
			c.log.Warn("cannot remove the workers' cgroups; the guard goes on trying", zap.Error(err))
			removed = false
		}
	}
	if c.guard == nil {
		return
	}
	c.guard.Release()
	if removed {
		// Nothing is left to guard: end it now rather than wait for a
		// guard still starting up (a short job) to read its end of file.
		c.guard.Process.Kill()
	}
	select {
	case <-c.guardExit:
	case <-time.After(cgroupRemoveTimeout):
		c.guard.Process.Kill()
		<-c.guardExit
	}
}

// slotFor gives w a cgroup of its own (nil without a jail) and sets attr
// to start it there.
func (c *containment) slotFor(w *worker, attr *os.ProcAttr) error {
	if c == nil || c.jail == nil {
		return nil
	}
	label := fmt.Sprintf("rank%d", w.a.LocalRank)
	if w.a.LocalRank < 0 {
		label = "standby" // no slot yet (RespawnStandbys)
	}
	s, err := c.jail.NewSlot(label)
	if err != nil {
		return localf("%w", err)
	}
	w.slot = s
	attr.Sys.UseCgroupFD, attr.Sys.CgroupFD = true, s.FD()
	return nil
}

// oomCount is the OOM kill count that covers w: its slot's, else the
// agent's cgroup's; ok is false when neither can be read.
func (c *containment) oomCount(w *worker) (n int64, ok bool) {
	if c == nil {
		return 0, false
	}
	if w.slot != nil {
		if n, ok := w.slot.OOMKills(); ok {
			return n, true
		}
	}
	if c.hasOwn {
		return c.own.Read()
	}
	return 0, false
}

// started marks the OOM count w's exit is compared with.
func (c *containment) started(w *worker) {
	if c == nil {
		return
	}
	if w.slot != nil {
		w.slot.Started()
	}
	w.oomMark, w.oomKnown = c.oomCount(w)
}

// ended is told of w's exit: it notes an OOM kill (a SIGKILL while the
// count went up) and kills what w left in its cgroup, at once.
func (c *containment) ended(w *worker) {
	if c == nil {
		return
	}
	if w.exit.Signal() == syscall.SIGKILL && w.oomKnown {
		if n, ok := c.oomCount(w); ok && n > w.oomMark {
			w.oom = fmt.Sprintf("the kernel's OOM killer (out of memory: oom_kill %d → %d)", w.oomMark, n)
		}
	}
	if w.slot != nil {
		if n, _ := w.slot.Kill(); n > 0 {
			c.log.Info("killed processes the workers left behind", zap.Int("processes", n), zap.Int("local_rank", w.a.LocalRank))
		}
	}
}

// remove empties and removes w's cgroup.
func (c *containment) remove(w *worker) {
	if c == nil || w.slot == nil {
		return
	}
	if err := w.slot.Remove(cgroupRemoveTimeout); err != nil {
		c.log.Warn("cannot remove a worker's cgroup", zap.Int("local_rank", w.a.LocalRank), zap.Error(err))
	}
	w.slot = nil
}

// jailFamily starts every agent's jail name.
const jailFamily = "gorun-"

// jailPrefix starts the names of this PID namespace's agents' jails:
// jailFamily, the PID namespace's inode, "-"; known is false when the
// namespace cannot be read, and then no jail is taken for another's.
func jailPrefix() (prefix string, known bool) {
	l, err := os.Readlink("/proc/self/ns/pid") // "pid:[4026531836]"
	_, v, ok := strings.Cut(l, "[")
	if err != nil || !ok {
		return jailFamily, false
	}
	return jailFamily + strings.TrimSuffix(v, "]") + "-", true
}
