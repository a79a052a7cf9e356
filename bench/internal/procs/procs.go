// Package procs holds the process-tree chores the benchmark programs share:
// finding a launcher's workers, reaping what a launcher left behind (the
// benchmark being a child subreaper), and waiting for torchrun's fixed
// port.
package procs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Parents maps every process to its parent, from /proc.
func Parents() map[int]int {
	ents, _ := os.ReadDir("/proc")
	m := map[int]int{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces and parentheses.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(f[1]); err == nil {
			m[pid] = ppid
		}
	}
	return m
}

// Children lists the processes whose parent is ppid.
func Children(ppid int) []int {
	var out []int
	for p, pp := range Parents() {
		if pp == ppid {
			out = append(out, p)
		}
	}
	return out
}

// Descendants lists every process under pid, children first.
func Descendants(pid int) []int {
	parent := Parents()
	var out []int
	frontier := []int{pid}
	for len(frontier) > 0 {
		var next []int
		for p, pp := range parent {
			if slices.Contains(frontier, pp) {
				next = append(next, p)
			}
		}
		out = append(out, next...)
		frontier = next
	}
	return out
}

// ReapOrphans kills and reaps every child of this process but those in
// spare — in a child subreaper, the orphans a finished launcher left — and
// returns how many there were, zombies included.
func ReapOrphans(spare ...int) int {
	n := 0
	for range 50 {
		kids := slices.DeleteFunc(Children(os.Getpid()), func(pid int) bool { return slices.Contains(spare, pid) })
		if len(kids) == 0 {
			return n
		}
		for _, pid := range kids {
			syscall.Kill(pid, syscall.SIGKILL)
			var ws syscall.WaitStatus
			syscall.Wait4(pid, &ws, 0, nil)
			n++
		}
	}
	return n
}

// WaitPortFree waits until nothing listens on port: torchrun 1.13
// --standalone always hosts its store on the same port, and would join a
// stranger's rendezvous there (or a previous run's, still closing) instead
// of hosting its own.
func WaitPortFree(ctx context.Context, port int) error {
	for {
		ln, err := net.Listen("tcp", ":"+strconv.Itoa(port))
		if err == nil {
			return ln.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("port %d stays busy (%v): another torchrun --standalone is running", port, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Tail returns the last n bytes of a file, on one line.
func Tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", " ⏎ ")
}

// HasEnv reports whether process pid's environment holds kv ("KEY=value"),
// as it was when the process started.
func HasEnv(pid int, kv string) bool {
	env, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return false
	}
	want := []byte(kv + "\x00")
	return bytes.HasPrefix(env, want) || bytes.Contains(env, append([]byte{0}, want...))
}

// Env returns the value of key in process pid's environment, and whether
// it is there.
func Env(pid int, key string) (string, bool) {
	env, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return "", false
	}
	for kv := range bytes.SplitSeq(env, []byte{0}) {
		if k, v, ok := bytes.Cut(kv, []byte("=")); ok && string(k) == key {
			return string(v), true
		}
	}
	return "", false
}

// WithEnv lists every process of the machine whose environment holds kv:
// a job's processes by a marker variable, wherever they were reparented.
func WithEnv(kv string) []int {
	var out []int
	for pid := range Parents() {
		if HasEnv(pid, kv) {
			out = append(out, pid)
		}
	}
	slices.Sort(out)
	return out
}

// LockedWriter serialises writes from several processes' output readers
// onto one writer (a console), a line at a time when they write lines.
type LockedWriter struct {
	mu sync.Mutex
	W  io.Writer
}

func (l *LockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.W.Write(p)
}
