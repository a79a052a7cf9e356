package cpu_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestPeerKilled runs a group of 4 real processes (this test binary, re-
// executed), SIGKILLs rank 2 while they are in the middle of AllReduces,
// and checks that every survivor's AllReduce fails at once with a
// *pg.PeerError naming rank 2 — over every local transport.
func TestPeerKilled(t *testing.T) {
	for _, transport := range []string{cpu.TransportUnix, cpu.TransportShm, cpu.TransportTCP} {
		t.Run(transport, func(t *testing.T) { testPeerKilled(t, transport) })
	}
}

func testPeerKilled(t *testing.T, transport string) {
	const size, victim = 4, 2
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	type rankProc struct {
		cmd   *exec.Cmd
		lines chan string
	}
	procs := make([]rankProc, size)
	for r := range size {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(),
			envRank+"="+strconv.Itoa(r), envSize+"="+strconv.Itoa(size),
			envStore+"="+srv.Addr().String(), envNS+"=killed", envTrans+"="+transport)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		p := rankProc{cmd: cmd, lines: make(chan string, 16)}
		procs[r] = p
		t.Cleanup(func() {
			p.cmd.Process.Kill()
			p.cmd.Wait()
		})
		go func() {
			defer close(p.lines)
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				p.lines <- sc.Text()
			}
		}()
	}
	line := func(r int, within time.Duration) string {
		select {
		case l, ok := <-procs[r].lines:
			if !ok {
				t.Fatalf("rank %d: exited without a word", r)
			}
			return l
		case <-time.After(within):
			t.Fatalf("rank %d: silent for %v", r, within)
		}
		return ""
	}
	for r := range size {
		if l := line(r, 20*time.Second); l != "formed" {
			t.Fatalf("rank %d: %s", r, l)
		}
	}
	time.Sleep(300 * time.Millisecond) // AllReduces of 4 MiB, back to back
	killedAt := time.Now()
	if err := procs[victim].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var worst time.Duration
	for r := range size {
		if r == victim {
			continue
		}
		l := line(r, 10*time.Second)
		var peer int
		var at int64
		if _, err := fmt.Sscanf(l, "failed peer=%d at=%d", &peer, &at); err != nil {
			t.Fatalf("rank %d: %q", r, l)
		}
		took := time.Unix(0, at).Sub(killedAt)
		worst = max(worst, took)
		t.Logf("rank %d: failed %v after the kill: %s", r, took, l[strings.Index(l, "err="):])
		if peer != victim {
			t.Errorf("rank %d: the error names rank %d, want %d", r, peer, victim)
		}
		if !strings.Contains(l, "async=") || strings.Contains(l, "async=<nil>") {
			t.Errorf("rank %d: AsyncError is empty: %s", r, l)
		}
		if err := procs[r].cmd.Wait(); err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	t.Logf("slowest survivor failed %v after the kill", worst)
	if worst > 2*time.Second {
		t.Errorf("survivors took %v to fail", worst)
	}
}
