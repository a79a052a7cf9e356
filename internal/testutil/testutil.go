// Package testutil holds small helpers shared by gorun's tests.
package testutil

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
)

// SyncBuffer is a bytes.Buffer that several goroutines (a process's output
// copier and the test) may use at once.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ChildWithEnv returns the PID of a child of parent whose environment holds
// key=value: how a test finds the worker of a given RANK among an agent's
// children.
func ChildWithEnv(parent int, key, value string) (int, error) {
	pids, err := ChildrenWithEnv(parent, key, value)
	if err != nil {
		return 0, err
	}
	if len(pids) == 0 {
		return 0, fmt.Errorf("no child of %d has %s=%s", parent, key, value)
	}
	return pids[0], nil
}

// ChildrenWithEnv returns the PIDs of every child of parent whose
// environment, as it started (/proc's environ), holds key=value.
func ChildrenWithEnv(parent int, key, value string) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	want := []byte(key + "=" + value + "\x00")
	var pids []int
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces: split after ')'.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) < 2 || fields[1] != strconv.Itoa(parent) {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil {
			continue
		}
		if bytes.HasPrefix(env, want) || bytes.Contains(env, append([]byte{0}, want...)) {
			pid, _ := strconv.Atoi(e.Name())
			pids = append(pids, pid)
		}
	}
	return pids, nil
}
