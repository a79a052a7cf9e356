package procs

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDescendantsAndReap: a shell and the sleep it started are both found
// under this process; ReapOrphans kills and reaps them, sparing none.
func TestDescendantsAndReap(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 100 & echo $!; wait")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 32)
	n, _ := out.Read(buf)
	pid, err := strconv.Atoi(strings.TrimSpace(string(buf[:n])))
	if err != nil {
		t.Fatal(err)
	}
	under := Descendants(os.Getpid())
	if !slices.Contains(under, cmd.Process.Pid) || !slices.Contains(under, pid) {
		t.Fatalf("descendants %v lack the shell %d or its sleep %d", under, cmd.Process.Pid, pid)
	}
	if !slices.Contains(Children(cmd.Process.Pid), pid) {
		t.Fatalf("the sleep %d is not the shell's child", pid)
	}
	// The shell is our child: ReapOrphans kills and reaps it (the sleep,
	// reparented to init here, is killed with the test's cleanup).
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if got := ReapOrphans(); got < 1 {
		t.Fatalf("reaped %d", got)
	}
	if slices.Contains(Children(os.Getpid()), cmd.Process.Pid) {
		t.Fatal("the shell is still a child")
	}
}

func TestWaitPortFree(t *testing.T) {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := WaitPortFree(ctx, port); err == nil || !strings.Contains(err.Error(), "stays busy") {
		t.Fatalf("busy port: %v", err)
	}
	ln.Close()
	if err := WaitPortFree(context.Background(), port); err != nil {
		t.Fatalf("free port: %v", err)
	}
}

func TestTail(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log")
	os.WriteFile(p, []byte("one\ntwo\nthree\n"), 0o644)
	if got := Tail(p, 10); got != "two ⏎ three" {
		t.Fatalf("Tail = %q", got)
	}
}

// TestEnv: a child started with a marker variable is found by it, and its
// variables read back; a process without it is not found.
func TestEnv(t *testing.T) {
	marker := "PROCS_TEST_MARKER=" + strconv.Itoa(os.Getpid())
	cmd := exec.Command("sleep", "100")
	cmd.Env = append(os.Environ(), marker, "PROCS_TEST_OTHER=a=b")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	// Until the child has exec'd, its environ is this process's (the fork's
	// copy): wait for sleep's command line, as a caller of HasEnv finds a
	// job's processes long after they started.
	cmdline := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/cmdline"
	for deadline := time.Now().Add(10 * time.Second); ; {
		if b, _ := os.ReadFile(cmdline); strings.HasPrefix(string(b), "sleep\x00") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the child never exec'd sleep")
		}
		time.Sleep(time.Millisecond)
	}
	tests := []struct {
		name string
		got  any
		want any
	}{
		{"HasEnv marker", HasEnv(cmd.Process.Pid, marker), true},
		{"HasEnv a prefix of a value", HasEnv(cmd.Process.Pid, "PROCS_TEST_OTHER=a"), false},
		{"HasEnv of this process", HasEnv(os.Getpid(), marker), false},
		{"WithEnv", slices.Equal(WithEnv(marker), []int{cmd.Process.Pid}), true},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %v, want %v", tt.name, tt.got, tt.want)
		}
	}
	if v, ok := Env(cmd.Process.Pid, "PROCS_TEST_OTHER"); !ok || v != "a=b" {
		t.Errorf("Env = %q, %v; want \"a=b\", true", v, ok)
	}
	if _, ok := Env(cmd.Process.Pid, "PROCS_TEST_NONE"); ok {
		t.Errorf("Env found a variable that is not there")
	}
}
