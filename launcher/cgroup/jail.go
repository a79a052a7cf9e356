package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Jail is a cgroup v2 directory that holds an agent's workers, one Slot
// each. It has no processes of its own, so it may enable controllers for
// its slots (memory, where its parent offers it: then each slot reports
// its own OOM kills).
type Jail struct {
	dir    string
	memory bool // the slots have memory.events

	mu    sync.Mutex
	slots map[*Slot]struct{}
	seq   int
}

// Open creates the jail name under parent, a cgroup v2 directory this
// process may write. It fails with an error wrapping ErrUnavailable when
// parent is no cgroup v2 directory, is not writable or lacks cgroup.kill
// (Linux before 5.14).
func Open(parent, name string) (*Jail, error) {
	if parent == "" {
		return nil, fmt.Errorf("%w: this process is in no mounted cgroup v2 hierarchy", ErrUnavailable)
	}
	if _, err := os.Stat(filepath.Join(parent, "cgroup.procs")); err != nil {
		return nil, fmt.Errorf("%w: %s is not a cgroup v2 directory: %v", ErrUnavailable, parent, err)
	}
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.kill")); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("%w: %s has no cgroup.kill (Linux 5.14 or later has it)", ErrUnavailable, dir)
	}
	j := &Jail{dir: dir, slots: map[*Slot]struct{}{}}
	// Best effort: where the parent delegates the memory controller, the
	// slots get memory.events of their own. Not fatal: OOM kills are then
	// read from a cgroup above (OOMCounter).
	if ctl, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers")); err == nil &&
		slices.Contains(strings.Fields(string(ctl)), "memory") {
		j.memory = os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+memory"), 0) == nil
	}
	return j, nil
}

// Dir is the jail's cgroup directory.
func (j *Jail) Dir() string { return j.dir }

// Memory says whether each slot counts its own OOM kills.
func (j *Jail) Memory() bool { return j.memory }

// Slot is one worker's cgroup inside a Jail. The worker is started into
// it through FD (syscall.SysProcAttr.UseCgroupFD).
type Slot struct {
	j   *Jail
	dir string
	fd  *os.File
}

// NewSlot creates a slot, named label and a number the jail has not
// given before.
func (j *Jail) NewSlot(label string) (*Slot, error) {
	j.mu.Lock()
	j.seq++
	dir := filepath.Join(j.dir, fmt.Sprintf("%s.%d", label, j.seq))
	j.mu.Unlock()
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup for a worker: %w", err)
	}
	fd, err := os.Open(dir)
	if err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("cgroup for a worker: %w", err)
	}
	s := &Slot{j: j, dir: dir, fd: fd}
	j.mu.Lock()
	j.slots[s] = struct{}{}
	j.mu.Unlock()
	return s, nil
}

// Dir is the slot's cgroup directory.
func (s *Slot) Dir() string { return s.dir }

// FD is the descriptor to clone a worker into the slot with; valid until
// Started.
func (s *Slot) FD() int { return int(s.fd.Fd()) }

// Started closes the descriptor FD gave, once the worker is started.
func (s *Slot) Started() {
	if s.fd != nil {
		s.fd.Close()
		s.fd = nil
	}
}

// Kill sends SIGKILL to every process in the slot, at once, in the
// kernel: none can fork out of the way meanwhile. It returns how many
// processes the slot held just before.
func (s *Slot) Kill() (int, error) {
	n := len(strings.Fields(procsOf(s.dir)))
	return n, kill(s.dir)
}

// OOMKills is how many of the slot's processes the kernel's OOM killer
// has killed; ok is false when the slot has no memory controller.
func (s *Slot) OOMKills() (n int64, ok bool) {
	if !s.j.memory {
		return 0, false
	}
	n, err := readCounter(filepath.Join(s.dir, "memory.events"), "oom_kill")
	return n, err == nil
}

// Remove kills what is left in the slot, waits up to within for it to
// be gone and removes the slot.
func (s *Slot) Remove(within time.Duration) error {
	s.Started()
	err := drain(s.dir, within)
	s.j.mu.Lock()
	delete(s.j.slots, s)
	s.j.mu.Unlock()
	return err
}

// Kill sends SIGKILL to every process of every slot.
func (j *Jail) Kill() error { return kill(j.dir) }

// Close kills every process in the jail, waits up to within for them to
// be gone, and removes the slots and the jail.
func (j *Jail) Close(within time.Duration) error {
	j.mu.Lock()
	slots := make([]*Slot, 0, len(j.slots))
	for s := range j.slots {
		slots = append(slots, s)
	}
	j.mu.Unlock()
	for _, s := range slots {
		s.Started()
	}
	return Remove(j.dir, within)
}

// Remove empties and removes the cgroup dir and every cgroup below it:
// it kills their processes, waits up to within for them to be gone and
// removes the directories, deepest first. A dir already gone is no error.
func Remove(dir string, within time.Duration) error {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	deadline := time.Now().Add(within)
	if err := kill(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var dirs []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	var first error
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := drain(dirs[i], time.Until(deadline)); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// drain kills the processes of cgroup dir (and below), waits up to
// within for it to be unpopulated and removes it.
func drain(dir string, within time.Duration) error {
	if err := kill(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	deadline := time.Now().Add(within)
	for {
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		// EBUSY while a killed process is still exiting.
		if time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w (still populated: %s)", dir, err, procsOf(dir))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func kill(dir string) error {
	return os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
}

// procsOf lists the PIDs in cgroup dir, for an error message.
func procsOf(dir string) string {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	return strings.Join(strings.Fields(string(b)), " ")
}

// readCounter reads "key N" from a flat-keyed cgroup file (memory.events,
// memory.oom_control).
func readCounter(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return parseCounter(b, key)
}

func parseCounter(b []byte, key string) (int64, error) {
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if ok && k == key {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %q in the counters", key)
}

// SweepStale removes the jails under parent whose name says they belong
// to a process that no longer exists (prefix, then "<pid>-"): what an agent
// left when it died together with its guard (a node's OOM killer may take
// both). Their processes, the dead job's, are killed first. A jail whose
// process lives is left alone, even if its PID was reused. It returns the
// jails it removed.
func SweepStale(parent, prefix string, within time.Duration) ([]string, error) {
	return sweep(parent, within, func(name string) bool {
		rest, ok := strings.CutPrefix(name, prefix)
		pidText, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		return ok && err == nil && pid > 0 && !processExists(pid)
	})
}

// sweep removes the cgroups directly under parent whose names stale
// accepts, and returns them.
func sweep(parent string, within time.Duration, stale func(name string) bool) ([]string, error) {
	entries, err := os.ReadDir(parent)
	if err != nil {
		return nil, err
	}
	var removed []string
	var first error
	for _, e := range entries {
		if !e.IsDir() || !stale(e.Name()) {
			continue
		}
		dir := filepath.Join(parent, e.Name())
		if err := Remove(dir, within); err != nil {
			if first == nil {
				first = err
			}
			continue
		}
		removed = append(removed, dir)
	}
	return removed, first
}

// processExists reports whether a process pid exists (a zombie counts).
func processExists(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}

// initialPIDNamespace is the inode of the first PID namespace, fixed by
// Linux (PROC_PID_INIT_INO): a process in it sees every process there is.
const initialPIDNamespace = "4026531836"

// SweepDeadNamespaces removes the jails under parent named family, then
// the inode of a PID namespace other than this process's, then "-", when
// no process is left in that namespace: those of agents that were PID 1
// of a namespace of their own (`unshare --pid`), which need no guard and
// leave an empty jail behind. Only a process in the initial PID namespace
// can tell that a namespace is empty (it sees every process); anywhere
// else SweepDeadNamespaces does nothing. It returns the jails it removed.
func SweepDeadNamespaces(parent, family string, within time.Duration) ([]string, error) {
	if pidNamespace(os.Getpid()) != initialPIDNamespace {
		return nil, nil
	}
	var live map[string]bool // the namespaces with a process, read once
	return sweep(parent, within, func(name string) bool {
		rest, ok := strings.CutPrefix(name, family)
		ns, _, ok2 := strings.Cut(rest, "-")
		if !ok || !ok2 || ns == "" || ns == initialPIDNamespace || strings.Trim(ns, "0123456789") != "" {
			return false
		}
		if live == nil {
			live = livePIDNamespaces()
		}
		return !live[ns]
	})
}

// pidNamespace is the inode of process pid's PID namespace, "" if unknown.
func pidNamespace(pid int) string {
	l, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/pid") // "pid:[4026531836]"
	if err != nil {
		return ""
	}
	_, v, ok := strings.Cut(l, "[")
	if !ok {
		return ""
	}
	return strings.TrimSuffix(v, "]")
}

// livePIDNamespaces lists the PID namespaces that hold a process.
func livePIDNamespaces() map[string]bool {
	live := map[string]bool{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			if ns := pidNamespace(pid); ns != "" {
				live[ns] = true
			}
		}
	}
	return live
}
