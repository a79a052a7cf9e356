// Package reaper is the single owner of wait4 in a gorun agent.
//
// Two parts of a process that both reap children race: whichever calls
// wait4 first takes the exit status and the other gets ECHILD (the
// well-known os/exec + background-reaper bug). So the agent starts workers
// through a Reaper and never waits on them any other way. The Reaper learns
// of exits from SIGCHLD at once — not at a polling interval — and hands each
// exit to the one channel registered for that PID.
//
// In the default mode it reaps only the children it started (wait4 on each
// of their PIDs), so it coexists with other code in the process that runs
// its own commands. As PID 1 or a subreaper (ReapOrphans), it also reaps
// every other child — orphaned grandchildren re-parented to us — with
// wait4(-1), as tini does.
package reaper

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Exit is how a child ended.
type Exit struct {
	Pid    int
	Status syscall.WaitStatus
	// Time is when the reaper collected the exit.
	Time time.Time
}

// Code returns the exit code, or -N if the process was killed by signal N
// (Python's subprocess and torchrun's convention).
func (e Exit) Code() int {
	if e.Status.Signaled() {
		return -int(e.Status.Signal())
	}
	return e.Status.ExitStatus()
}

// Signal returns the signal that killed the process, or 0.
func (e Exit) Signal() syscall.Signal {
	if e.Status.Signaled() {
		return e.Status.Signal()
	}
	return 0
}

func (e Exit) String() string {
	if s := e.Signal(); s != 0 {
		return fmt.Sprintf("pid %d killed by signal %d (%s)", e.Pid, int(s), SignalName(s))
	}
	return fmt.Sprintf("pid %d exited with code %d", e.Pid, e.Status.ExitStatus())
}

// SignalName returns "SIGKILL" for syscall.SIGKILL and so on.
func SignalName(s syscall.Signal) string {
	if n := unix.SignalName(s); n != "" {
		return n
	}
	return fmt.Sprintf("signal %d", int(s))
}

// Config configures a Reaper.
type Config struct {
	// ReapOrphans makes the Reaper collect every child of this process, not
	// only those it started: what PID 1 and a subreaper must do so that
	// orphaned grandchildren do not linger as zombies. Default false.
	ReapOrphans bool
	// OnOrphan, if set, is told of each orphan reaped (for logs).
	OnOrphan func(Exit)
}

// Reaper starts processes and reports their exits.
type Reaper struct {
	cfg  Config
	sigc chan os.Signal

	mu       sync.Mutex
	children map[int]chan Exit
	closed   bool

	done chan struct{}
	wg   sync.WaitGroup
}

// ErrClosed is returned by Start after Close.
var ErrClosed = errors.New("reaper closed")

// New starts a Reaper. Close it to stop reaping.
func New(cfg Config) *Reaper {
	r := &Reaper{
		cfg:      cfg,
		sigc:     make(chan os.Signal, 1),
		children: make(map[int]chan Exit),
		done:     make(chan struct{}),
	}
	signal.Notify(r.sigc, syscall.SIGCHLD)
	r.wg.Add(1)
	go r.loop()
	return r
}

// Start starts a process (as os.StartProcess does) and returns it with a
// channel that receives its Exit exactly once. The caller must not Wait on
// the process.
func (r *Reaper) Start(name string, argv []string, attr *os.ProcAttr) (*os.Process, <-chan Exit, error) {
	// Holding mu across the fork means the loop cannot dispatch this
	// child's exit before its channel is registered, however fast it dies.
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, nil, ErrClosed
	}
	p, err := os.StartProcess(name, argv, attr)
	if err != nil {
		return nil, nil, err
	}
	ch := make(chan Exit, 1)
	r.children[p.Pid] = ch
	// The child may have exited before SIGCHLD was ours to see; poke
	// the loop so it looks.
	r.poke()
	return p, ch, nil
}

func (r *Reaper) poke() {
	select {
	case r.sigc <- syscall.SIGCHLD:
	default:
	}
}

// Close stops the Reaper. Children still running are not signalled, and
// their channels never receive.
func (r *Reaper) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	r.mu.Unlock()
	signal.Stop(r.sigc)
	close(r.done)
	r.wg.Wait()
}

func (r *Reaper) loop() {
	defer r.wg.Done()
	for {
		select {
		case <-r.done:
			return
		case <-r.sigc:
			r.reap()
		}
	}
}

// reap collects every exit that is ready. SIGCHLD coalesces (many children
// may end per signal), so it loops until nothing is left.
func (r *Reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cfg.ReapOrphans {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if pid <= 0 || err != nil {
				return
			}
			r.dispatch(Exit{Pid: pid, Status: ws, Time: time.Now()})
		}
	}
	for pid := range r.children {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		for err == syscall.EINTR {
			got, err = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		if got == pid {
			r.dispatch(Exit{Pid: pid, Status: ws, Time: time.Now()})
		}
	}
}

// dispatch hands e to its child's channel; mu must be held.
func (r *Reaper) dispatch(e Exit) {
	if ch, ok := r.children[e.Pid]; ok {
		delete(r.children, e.Pid)
		ch <- e // buffered, never blocks
		return
	}
	if r.cfg.OnOrphan != nil {
		r.cfg.OnOrphan(e)
	}
}

// KillOrphans kills the processes this one has adopted — as PID 1 or a
// subreaper, the orphans re-parented to it: what the children it started
// left behind, a daemon that called setsid among them — and keeps at it
// as their own children are re-parented in turn, until none is left or
// within has passed. It returns how many it killed. The children it
// started are not touched. It needs ReapOrphans, which collects the
// killed as they die. Every other child of this process counts as
// adopted: use it only where the Reaper starts them all (the gorun
// command, not a library caller with children of its own).
func (r *Reaper) KillOrphans(within time.Duration) int {
	deadline := time.Now().Add(within)
	killed := map[int]bool{}
	for {
		// Under mu the loop cannot reap, so a PID found here stays this
		// process's child (alive or a zombie) until it is signalled: it
		// cannot be reused by another process meanwhile.
		r.mu.Lock()
		left := 0
		for _, pid := range r.adopted() {
			left++
			if !killed[pid] {
				syscall.Kill(pid, syscall.SIGKILL)
				killed[pid] = true
			}
		}
		r.mu.Unlock()
		r.poke()
		if left == 0 || time.Now().After(deadline) {
			return len(killed)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// adopted lists the live children of this process that the Reaper did not
// start; mu must be held.
func (r *Reaper) adopted() []int {
	self := os.Getpid()
	var out []int
	for _, pid := range children(self) {
		if _, ours := r.children[pid]; ours || pid == self {
			continue
		}
		ppid, state, ok := procStat(pid)
		if ok && ppid == self && state != 'Z' {
			out = append(out, pid)
		}
	}
	return out
}

// children lists the children of process self, zombies included, from each
// of its threads' /proc/self/task/TID/children (a child, and an orphan
// re-parented to a subreaper, hangs off one thread). A few small files per
// thread keep a sweep at tens of microseconds, where reading every
// process's /proc/PID/stat cost milliseconds a launch on a busy machine.
// Without that file (a kernel built without CONFIG_PROC_CHILDREN) it lists
// every PID in /proc; the caller checks each one's parent.
func children(self int) []int {
	if pids, ok := threadChildren(self); ok {
		return pids
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// threadChildren reads the children files of self's threads; false if the
// kernel has none.
func threadChildren(self int) ([]int, bool) {
	dir := "/proc/" + strconv.Itoa(self) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return nil, false
	}
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(dir + t.Name() + "/children")
		if err != nil {
			if _, serr := os.Stat(dir + t.Name()); serr == nil && errors.Is(err, fs.ErrNotExist) {
				return nil, false // the thread is there, its file is not
			}
			continue // the thread has gone; its children went to another
		}
		for _, f := range bytes.Fields(b) {
			if pid, err := strconv.Atoi(string(f)); err == nil {
				out = append(out, pid)
			}
		}
	}
	return out, true
}

// procStat reads a process's parent and state from /proc/PID/stat.
func procStat(pid int) (ppid int, state byte, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	// "pid (comm) state ppid …"; comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 2 || len(f[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(string(f[1]))
	return ppid, f[0][0], err == nil
}

// BecomeSubreaper makes this process adopt its orphaned descendants
// (PR_SET_CHILD_SUBREAPER), so that a Reaper with ReapOrphans collects
// them. PID 1 gets this for free.
func BecomeSubreaper() error {
	return unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
}
