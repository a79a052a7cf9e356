package netns

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// nsID identifies a network namespace: the device and inode of its nsfs
// file, the same through /run/netns/NAME and /proc/PID/ns/net.
type nsID struct{ Dev, Ino uint64 }

func statNS(path string) (nsID, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return nsID{}, err
	}
	return nsID{uint64(st.Dev), st.Ino}, nil
}

// pidsIn returns the processes in the namespace whose handle is at path
// (what `ip netns pids` prints, without running it).
func pidsIn(path string) ([]int, error) { return pidsInAny([]string{path}) }

// pidsInAny returns the processes in any of the namespaces at paths.
// Zombies have no namespace any more and are not listed.
func pidsInAny(paths []string) ([]int, error) {
	want := make(map[nsID]bool, len(paths))
	for _, p := range paths {
		id, err := statNS(p)
		if err != nil {
			return nil, fmt.Errorf("netns: %w", err)
		}
		want[id] = true
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("netns: %w", err)
	}
	self := os.Getpid()
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		// Errors are processes that exited meanwhile or zombies.
		if id, err := statNS("/proc/" + e.Name() + "/ns/net"); err == nil && want[id] {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// killAll sends SIGKILL to every process in the namespaces at paths until
// none is left and every one it killed has exited (a zombie at most), or
// returns ErrStillRunning after timeout. A dying process leaves its
// namespace before it becomes a zombie, so an empty namespace alone does
// not mean its processes are done.
func killAll(paths []string, timeout time.Duration) error {
	if len(paths) == 0 {
		return nil
	}
	deadline := time.Now().Add(timeout)
	killed := map[int]uint64{} // pid → start time, which tells a reused pid
	for {
		pids, err := pidsInAny(paths)
		if err != nil {
			return err
		}
		for pid, start := range killed {
			if exited(pid, start) {
				delete(killed, pid)
			}
		}
		if len(pids) == 0 && len(killed) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w after %v: pids %v in %s, %d more exiting", ErrStillRunning, timeout, pids, strings.Join(paths, ", "), len(killed))
		}
		for _, pid := range pids {
			start, err := procStart(pid)
			if err != nil {
				continue // gone meanwhile
			}
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("netns: kill %d: %w", pid, err)
			}
			killed[pid] = start
		}
		// SIGKILL is delivered at once but the exit takes a moment.
		time.Sleep(2 * time.Millisecond)
	}
}

// exited reports whether the process pid that started at start has
// exited: it is gone, its pid belongs to another process now, or it is a
// zombie.
func exited(pid int, start uint64) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	st, ok := parseStat(string(b))
	return !ok || st.start != start || st.state == "Z" || st.state == "X"
}

// procStart returns the start time of process pid (field 22 of
// /proc/PID/stat, in clock ticks since boot): with the PID it names one
// process, even after the PID is reused.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	st, ok := parseStat(string(b))
	if !ok {
		return 0, fmt.Errorf("netns: malformed /proc/%d/stat", pid)
	}
	return st.start, nil
}

// procStat is what this package reads of /proc/PID/stat.
type procStat struct {
	state string // field 3: R, S, D, Z, …
	start uint64 // field 22
}

func parseStat(s string) (procStat, bool) {
	// The command name, field 2, is in parentheses and may hold anything;
	// the fields after the last ')' start at field 3.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStat{}, false
	}
	f := strings.Fields(s[i+1:])
	const startField = 22 - 3
	if len(f) <= startField {
		return procStat{}, false
	}
	start, err := strconv.ParseUint(f[startField], 10, 64)
	if err != nil {
		return procStat{}, false
	}
	return procStat{state: f[0], start: start}, true
}
