package cgroup_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/cgrouptest"
	"github.com/gorunhq/gorun/launcher/cgroup"
)

// startInSlot starts sh -c script in slot s and returns it.
func startInSlot(t *testing.T, s *cgroup.Slot, script string) *os.Process {
	t.Helper()
	p, err := os.StartProcess("/bin/sh", []string{"sh", "-c", script}, &os.ProcAttr{
		Files: []*os.File{nil, os.Stdout, os.Stderr},
		Sys:   &syscall.SysProcAttr{Setpgid: true, UseCgroupFD: true, CgroupFD: s.FD()},
	})
	if err != nil {
		t.Fatal(err)
	}
	s.Started()
	t.Cleanup(func() { p.Kill(); p.Wait() })
	return p
}

// daemonScript starts a daemon the way a careless worker does (setsid, in
// the background), writes its pid to file and sleeps.
func daemonScript(file string) string {
	return `setsid sh -c 'echo $$ > ` + file + `.tmp; mv ` + file + `.tmp ` + file + `; exec sleep 300' </dev/null >/dev/null 2>&1 & exec sleep 300`
}

// readPid waits up to 10 s for file to hold a pid.
func readPid(t *testing.T, file string) int {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if b, err := os.ReadFile(file); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pid in %s", file)
		}
	}
}

// gone waits up to within for pid to be no process (or a zombie).
func gone(pid int, within time.Duration) bool {
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return true
		}
		if i := strings.LastIndexByte(string(b), ')'); i > 0 && len(b) > i+2 && b[i+2] == 'Z' {
			return true
		}
	}
	return false
}

func openJail(t *testing.T) *cgroup.Jail {
	t.Helper()
	parent := cgrouptest.V2(t)
	j, err := cgroup.Open(parent, fmt.Sprintf("gorun-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close(5 * time.Second) })
	return j
}

// TestSlotRemoveKillsDaemons: removing a worker's slot ends what it
// started, a setsid daemon too, which a process-group kill misses.
func TestSlotRemoveKillsDaemons(t *testing.T) {
	j := openJail(t)
	s, err := j.NewSlot("w0")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	w := startInSlot(t, s, daemonScript(filepath.Join(dir, "daemon")))
	daemon := readPid(t, filepath.Join(dir, "daemon"))
	procs, _ := os.ReadFile(filepath.Join(s.Dir(), "cgroup.procs"))
	if !strings.Contains(" "+strings.Join(strings.Fields(string(procs)), " ")+" ", fmt.Sprintf(" %d ", daemon)) {
		t.Fatalf("the daemon %d is not in the slot: cgroup.procs %q", daemon, procs)
	}
	// The worker's own process group goes first, as the agent does it.
	syscall.Kill(-w.Pid, syscall.SIGKILL)
	w.Wait()
	if gone(daemon, 200*time.Millisecond) {
		t.Fatal("the daemon died with the worker's process group: the test proves nothing")
	}
	if err := s.Remove(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if !gone(daemon, 5*time.Second) {
		t.Fatalf("daemon %d outlived its slot", daemon)
	}
	if _, err := os.Stat(s.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the slot's directory is still there: %v", err)
	}
}

// TestJailCloseKillsEverySlot: closing the jail ends every slot's
// processes and removes every directory.
func TestJailCloseKillsEverySlot(t *testing.T) {
	j := openJail(t)
	dir := t.TempDir()
	var daemons []int
	for i := range 3 {
		s, err := j.NewSlot(fmt.Sprintf("w%d", i))
		if err != nil {
			t.Fatal(err)
		}
		startInSlot(t, s, daemonScript(filepath.Join(dir, fmt.Sprint(i))))
		daemons = append(daemons, readPid(t, filepath.Join(dir, fmt.Sprint(i))))
	}
	if err := j.Close(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	for _, pid := range daemons {
		if !gone(pid, 5*time.Second) {
			t.Errorf("daemon %d outlived the jail", pid)
		}
	}
	if _, err := os.Stat(j.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the jail's directory is still there: %v", err)
	}
}

// TestGuardEmptiesJailWhenAgentGoes: the guard's lifeline closing without
// a Close first — the agent SIGKILLed — ends every process in the jail
// and removes it.
func TestGuardEmptiesJailWhenAgentGoes(t *testing.T) {
	for _, tc := range []struct{ name, shell string }{
		{"shell", "/bin/sh"},
		{"the agent's binary, without a shell", "/nonexistent/sh"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old := cgroup.SetShell(tc.shell)
			defer cgroup.SetShell(old)
			testGuard(t)
		})
	}
}

func testGuard(t *testing.T) {
	j := openJail(t)
	s, err := j.NewSlot("w0")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	startInSlot(t, s, daemonScript(filepath.Join(dir, "daemon")))
	daemon := readPid(t, filepath.Join(dir, "daemon"))
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	g, err := j.StartGuard(exe, func(name string, argv []string, attr *os.ProcAttr) (*os.Process, error) {
		return os.StartProcess(name, argv, attr)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Process.Kill(); g.Process.Wait() })
	// The guard ignores stop signals: only its agent's end counts.
	g.AwaitReady()
	g.Process.Signal(syscall.SIGTERM)
	if gone(daemon, 300*time.Millisecond) {
		t.Fatal("a SIGTERM to the guard ended the job")
	}
	g.Release()
	st, err := g.Process.Wait()
	if err != nil || !st.Success() {
		t.Fatalf("guard: %v %v", st, err)
	}
	if !gone(daemon, 5*time.Second) {
		t.Fatalf("daemon %d outlived its agent", daemon)
	}
	if _, err := os.Stat(j.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the jail's directory is still there: %v", err)
	}
}

// TestOpenUnavailable: a directory that is no cgroup, and none at all,
// say so with ErrUnavailable.
func TestOpenUnavailable(t *testing.T) {
	for _, parent := range []string{"", t.TempDir()} {
		if _, err := cgroup.Open(parent, "x"); !errors.Is(err, cgroup.ErrUnavailable) {
			t.Errorf("Open(%q): %v, want ErrUnavailable", parent, err)
		}
	}
}

// TestOOMCounterCountsARealOOMKill: a process over its memory cgroup's
// limit is killed by the kernel, and the cgroup's counter says so (v1
// memory here; the v2 file is read the same way).
func TestOOMCounterCountsARealOOMKill(t *testing.T) {
	parent := cgrouptest.V1Memory(t)
	dir := filepath.Join(parent, fmt.Sprintf("gorun-oom-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(filepath.Join(dir, "memory.force_empty"), []byte("0"), 0)
		os.Remove(dir)
	})
	if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte("33554432"), 0); err != nil {
		t.Fatal(err)
	}
	c, ok := cgroup.OwnOOMCounter(cgroup.Self{V1Memory: dir})
	if !ok {
		t.Fatal("no OOM counter in a v1 memory cgroup")
	}
	before, _ := c.Read()
	// tail keeps a line with no end in memory: 512 MiB of zeros.
	p, err := os.StartProcess("/bin/sh", []string{"sh", "-c", "echo $$ > " + dir + "/cgroup.procs && head -c 536870912 /dev/zero | tail >/dev/null"},
		&os.ProcAttr{Files: []*os.File{nil, os.Stdout, os.Stderr}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan *os.ProcessState, 1)
	go func() { st, _ := p.Wait(); done <- st }()
	select {
	case st := <-done:
		if st.Success() {
			t.Fatal("512 MiB fit in a 32 MiB cgroup: no OOM kill happened")
		}
	case <-time.After(60 * time.Second):
		p.Kill()
		t.Fatal("no OOM kill within 60 s")
	}
	after, _ := c.Read()
	if after <= before {
		t.Fatalf("oom_kill %d → %d, want it to go up", before, after)
	}
}

// TestSweepStale: a jail named for a process that is gone is emptied and
// removed; one named for a live process, or under another prefix, stays.
func TestSweepStale(t *testing.T) {
	parent := cgrouptest.V2(t)
	gonePid := func() int {
		p, err := os.StartProcess("/bin/true", []string{"true"}, &os.ProcAttr{})
		if err != nil {
			t.Fatal(err)
		}
		p.Wait()
		return p.Pid
	}()
	prefix := fmt.Sprintf("gorun-sweeptest%d-", os.Getpid())
	dead, err := cgroup.Open(parent, fmt.Sprintf("%s%d-a", prefix, gonePid))
	if err != nil {
		t.Fatal(err)
	}
	live, err := cgroup.Open(parent, fmt.Sprintf("%s%d-b", prefix, os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	other, err := cgroup.Open(parent, fmt.Sprintf("gorun-other%d-%d-c", os.Getpid(), gonePid))
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range []*cgroup.Jail{dead, live, other} {
		t.Cleanup(func() { j.Close(5 * time.Second) })
	}
	s, err := dead.NewSlot("w0")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	startInSlot(t, s, daemonScript(filepath.Join(dir, "daemon")))
	daemon := readPid(t, filepath.Join(dir, "daemon"))
	removed, err := cgroup.SweepStale(parent, prefix, 5*time.Second)
	if err != nil || len(removed) != 1 || removed[0] != dead.Dir() {
		t.Fatalf("SweepStale = %v, %v; want only %s", removed, err, dead.Dir())
	}
	if !gone(daemon, 5*time.Second) {
		t.Fatalf("the dead agent's daemon %d survived the sweep", daemon)
	}
	for _, j := range []*cgroup.Jail{live, other} {
		if _, err := os.Stat(j.Dir()); err != nil {
			t.Errorf("%s was swept: %v", j.Dir(), err)
		}
	}
}

// TestSweepDeadNamespaces: from the initial PID namespace, a jail named
// for a PID namespace with no process left is removed; one named for a
// namespace that still has a process stays.
func TestSweepDeadNamespaces(t *testing.T) {
	parent := cgrouptest.V2(t)
	self, _ := os.Readlink("/proc/self/ns/pid")
	if self != "pid:[4026531836]" {
		t.Skip("not in the initial PID namespace: it cannot see every namespace's processes")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("no unshare")
	}
	// A namespace with a process in it for the test's length.
	cmd := exec.Command(unshare, "--pid", "--fork", "sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Skipf("unshare --pid: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var liveNS string
	for deadline := time.Now().Add(5 * time.Second); liveNS == ""; time.Sleep(10 * time.Millisecond) {
		// unshare's child, sleep, is in the new namespace.
		kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		for _, k := range strings.Fields(string(kids)) {
			if l, err := os.Readlink("/proc/" + k + "/ns/pid"); err == nil && l != self {
				liveNS = strings.TrimSuffix(strings.TrimPrefix(l, "pid:["), "]")
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the unshared namespace never showed")
		}
	}
	family := fmt.Sprintf("gorun-nstest%d-", os.Getpid())
	dead, err := cgroup.Open(parent, family+"123-1-a")
	if err != nil {
		t.Fatal(err)
	}
	live, err := cgroup.Open(parent, family+liveNS+"-1-b")
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range []*cgroup.Jail{dead, live} {
		t.Cleanup(func() { j.Close(5 * time.Second) })
	}
	removed, err := cgroup.SweepDeadNamespaces(parent, family, 5*time.Second)
	if err != nil || len(removed) != 1 || removed[0] != dead.Dir() {
		t.Fatalf("SweepDeadNamespaces = %v, %v; want only %s", removed, err, dead.Dir())
	}
	if _, err := os.Stat(live.Dir()); err != nil {
		t.Fatalf("the live namespace's jail was swept: %v", err)
	}
}
