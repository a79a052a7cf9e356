package reaper

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("REAPER_TEST_ORPHANS") == "1" {
		os.Exit(orphanHelper())
	}
	if os.Getenv("REAPER_TEST_KILL_ORPHANS") == "1" {
		os.Exit(killOrphansHelper())
	}
	goleak.VerifyTestMain(m)
}

func start(t *testing.T, r *Reaper, argv ...string) (*os.Process, <-chan Exit) {
	t.Helper()
	path, err := exec.LookPath(argv[0])
	if err != nil {
		t.Fatal(err)
	}
	p, ch, err := r.Start(path, argv, &os.ProcAttr{Files: []*os.File{nil, os.Stdout, os.Stderr}})
	if err != nil {
		t.Fatal(err)
	}
	return p, ch
}

func await(t *testing.T, ch <-chan Exit) Exit {
	t.Helper()
	select {
	case e := <-ch:
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("no exit reported within 10s")
	}
	return Exit{}
}

func TestExitCodesAndSignals(t *testing.T) {
	r := New(Config{})
	defer r.Close()
	cases := []struct {
		argv []string
		kill syscall.Signal
		code int
		str  string
	}{
		{[]string{"true"}, 0, 0, "exited with code 0"},
		{[]string{"sh", "-c", "exit 3"}, 0, 3, "exited with code 3"},
		{[]string{"sleep", "30"}, syscall.SIGKILL, -9, "killed by signal 9 (SIGKILL)"},
		{[]string{"sleep", "30"}, syscall.SIGTERM, -15, "killed by signal 15 (SIGTERM)"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.argv, " "), func(t *testing.T) {
			p, ch := start(t, r, tc.argv...)
			if tc.kill != 0 {
				time.Sleep(20 * time.Millisecond)
				p.Signal(tc.kill)
			}
			e := await(t, ch)
			if e.Pid != p.Pid || e.Code() != tc.code || !strings.Contains(e.String(), tc.str) {
				t.Fatalf("exit %+v (%s), want pid %d code %d %q", e, e, p.Pid, tc.code, tc.str)
			}
		})
	}
}

// TestExitSeenAtOnce: the reaper reports an exit when it happens, not at a
// polling interval.
func TestExitSeenAtOnce(t *testing.T) {
	r := New(Config{})
	defer r.Close()
	p, ch := start(t, r, "sleep", "30")
	time.Sleep(50 * time.Millisecond)
	killed := time.Now()
	p.Signal(syscall.SIGKILL)
	e := await(t, ch)
	if lag := e.Time.Sub(killed); lag > 50*time.Millisecond {
		t.Fatalf("exit seen %v after the kill", lag)
	}
}

// TestManyChildrenAtOnce: SIGCHLD coalesces, yet every one of many
// simultaneous exits is reported, including children that die before
// Start returns.
func TestManyChildrenAtOnce(t *testing.T) {
	r := New(Config{})
	defer r.Close()
	const n = 64
	var chans []<-chan Exit
	for i := range n {
		_, ch := start(t, r, "sh", "-c", "exit "+strconv.Itoa(i%7))
		chans = append(chans, ch)
	}
	for i, ch := range chans {
		if e := await(t, ch); e.Code() != i%7 {
			t.Fatalf("child %d: code %d, want %d", i, e.Code(), i%7)
		}
	}
}

// TestCoexistsWithExec: without ReapOrphans the reaper leaves other
// children of the process alone, so os/exec keeps working beside it.
func TestCoexistsWithExec(t *testing.T) {
	r := New(Config{})
	defer r.Close()
	_, ch := start(t, r, "sleep", "0.2")
	for range 20 {
		if err := exec.Command("sh", "-c", "exit 0").Run(); err != nil {
			t.Fatalf("os/exec child lost its status to the reaper: %v", err)
		}
	}
	await(t, ch)
}

func TestStartAfterClose(t *testing.T) {
	r := New(Config{})
	r.Close()
	r.Close() // idempotent
	if _, _, err := r.Start("/bin/true", []string{"true"}, &os.ProcAttr{}); err != ErrClosed {
		t.Fatalf("Start after Close: %v, want ErrClosed", err)
	}
}

// TestOrphansReaped runs a helper process that becomes a subreaper, starts
// a shell that leaves orphaned grandchildren behind, and reports how many
// of its children are zombies afterwards: none may be.
func TestOrphansReaped(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "REAPER_TEST_ORPHANS=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, out)
	}
	got := strings.TrimSpace(string(out))
	if got != "orphans=3 zombies=0" {
		t.Fatalf("helper reported %q, want orphans=3 zombies=0", got)
	}
}

// orphanHelper is the subreaper side of TestOrphansReaped.
func orphanHelper() int {
	if err := BecomeSubreaper(); err != nil {
		fmt.Println("subreaper:", err)
		return 1
	}
	orphans := make(chan Exit, 16)
	r := New(Config{ReapOrphans: true, OnOrphan: func(e Exit) { orphans <- e }})
	defer r.Close()
	sh, _ := exec.LookPath("sh")
	// The shell exits at once; its three sleeps are re-parented to us.
	_, ch, err := r.Start(sh, []string{"sh", "-c", "sleep 0.1 & sleep 0.2 & sleep 0.3 & exit 0"}, &os.ProcAttr{})
	if err != nil {
		fmt.Println("start:", err)
		return 1
	}
	<-ch
	n := 0
	timeout := time.After(10 * time.Second)
	for n < 3 {
		select {
		case <-orphans:
			n++
		case <-timeout:
			fmt.Printf("orphans=%d (timed out)\n", n)
			return 1
		}
	}
	fmt.Printf("orphans=%d zombies=%d\n", n, zombies())
	return 0
}

// zombies counts this process's children in state Z.
func zombies() int {
	me := strconv.Itoa(os.Getpid())
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	n := 0
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so split
		// after the last ')'.
		s := string(b)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(fields) > 1 && fields[0] == "Z" && fields[1] == me {
			n++
		}
	}
	return n
}

// TestKillOrphans: a child that leaves daemons behind (two in sessions of
// their own, a background job) exits; KillOrphans kills every one, leaves
// alone the started child that still runs, and leaves no zombie.
func TestKillOrphans(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "REAPER_TEST_KILL_ORPHANS=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, out)
	}
	// Three processes at least: a shell that has not exec'd its sleep yet
	// when the sweep comes is one more.
	var killed, left, zombies int
	var alive bool
	got := strings.TrimSpace(string(out))
	if _, err := fmt.Sscanf(got, "killed=%d left=%d zombies=%d started-alive=%t", &killed, &left, &zombies, &alive); err != nil ||
		killed < 3 || left != 0 || zombies != 0 || !alive {
		t.Fatalf("helper reported %q; want killed>=3 left=0 zombies=0 started-alive=true", got)
	}
}

// killOrphansHelper is the subreaper side of TestKillOrphans.
func killOrphansHelper() int {
	if err := BecomeSubreaper(); err != nil {
		fmt.Println("subreaper:", err)
		return 1
	}
	r := New(Config{ReapOrphans: true})
	defer r.Close()
	sh, _ := exec.LookPath("sh")
	setsid, _ := exec.LookPath("setsid")
	// A worker that outlives the sweep, and one that leaves three
	// processes behind: two in sessions of their own, a background job.
	keeper, keeperExit, err := r.Start(sh, []string{"sh", "-c", "exec sleep 60"}, &os.ProcAttr{})
	if err != nil {
		fmt.Println("start:", err)
		return 1
	}
	_, ch, err := r.Start(sh, []string{"sh", "-c", setsid + " sleep 60 & " + setsid + " sh -c 'sleep 60' & sleep 60 & exit 0"}, &os.ProcAttr{})
	if err != nil {
		fmt.Println("start:", err)
		return 1
	}
	<-ch
	// Let the daemons be re-parented to us.
	for deadline := time.Now().Add(5 * time.Second); len(r.lockedAdopted()) < 3 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	killed := r.KillOrphans(5 * time.Second)
	time.Sleep(100 * time.Millisecond) // the loop reaps them
	alive := syscall.Kill(keeper.Pid, 0) == nil
	fmt.Printf("killed=%d left=%d zombies=%d started-alive=%v\n", killed, len(r.lockedAdopted()), zombies(), alive)
	keeper.Kill()
	<-keeperExit
	return 0
}

func (r *Reaper) lockedAdopted() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.adopted()
}

// TestThreadChildren: the children files of the process's threads list
// what a scan of every /proc/PID/stat finds, children started from
// several threads included.
func TestThreadChildren(t *testing.T) {
	var cmds []*exec.Cmd
	done := make(chan *exec.Cmd)
	for range 4 {
		go func() {
			// Each on a thread of its own: the child hangs off it.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			c := exec.Command("sleep", "30")
			if err := c.Start(); err != nil {
				done <- nil
				return
			}
			done <- c
		}()
	}
	for range 4 {
		if c := <-done; c != nil {
			cmds = append(cmds, c)
		}
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			c.Process.Kill()
			c.Wait()
		}
	})
	if len(cmds) != 4 {
		t.Fatal("could not start the children")
	}
	self := os.Getpid()
	got, ok := threadChildren(self)
	if !ok {
		t.Skip("no /proc/PID/task/TID/children on this kernel")
	}
	var want []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, ok := procStat(pid); ok && ppid == self {
			want = append(want, pid)
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("thread children %v, /proc scan %v", got, want)
	}
	for _, c := range cmds {
		if !slices.Contains(got, c.Process.Pid) {
			t.Fatalf("child %d not listed in %v", c.Process.Pid, got)
		}
	}
}
