package netns

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/internal/etcdtest"
)

// echoOnGateway serves echo on the bed's gateway address, in the root
// namespace (the test's own process); the test's cleanup stops it.
func echoOnGateway(t *testing.T, b *Bed) string {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(b.Gateway.String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		conns  []net.Conn
		closed bool
	)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed { // accepted while the cleanup ran
				mu.Unlock()
				c.Close()
				return
			}
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { io.Copy(c, c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// serveOn starts an echo server on the host at addr and waits until it
// listens.
func serveOn(t *testing.T, h *Host, addr string) {
	t.Helper()
	p := startHelper(t, h, "serve", addr)
	if l := p.next(t, 30*time.Second); !strings.HasPrefix(l, "listening") {
		t.Fatalf("serve %s on %s: %q", addr, h.Name, l)
	}
}

func TestConnectivity(t *testing.T) {
	b := New(t, 2, Options{})
	h0, h1 := b.Hosts[0], b.Hosts[1]
	if !b.Subnet.Contains(b.Gateway) || !b.Subnet.Contains(h0.IP) || !b.Subnet.Contains(h1.IP) || h0.IP == h1.IP {
		t.Fatalf("addresses: subnet %s gateway %s hosts %s %s", b.Subnet, b.Gateway, h0.IP, h1.IP)
	}
	gw := echoOnGateway(t, b)
	for _, h := range b.Hosts {
		serveOn(t, h, ":7000")
	}
	// Only h1 listens on its loopback.
	serveOn(t, h1, "127.0.0.1:7001")

	tests := []struct {
		name string
		from *Host
		addr string
		dial string // the dial's reply
	}{
		{"h0 to h1", h0, net.JoinHostPort(h1.IP.String(), "7000"), "ok"},
		{"h1 to h0", h1, net.JoinHostPort(h0.IP.String(), "7000"), "ok"},
		{"h0 to gateway", h0, gw, "ok"},
		{"h1 to gateway", h1, gw, "ok"},
		{"h1 to its own loopback", h1, "127.0.0.1:7001", "ok"},
		{"h0's loopback is its own", h0, "127.0.0.1:7001", "err: dial tcp 127.0.0.1:7001: connect: connection refused"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := startHelper(t, tc.from, "client", tc.addr)
			if got := c.do(t, "dial 10s"); got != tc.dial {
				t.Fatalf("dial %s from %s: %q, want %q", tc.addr, tc.from.Name, got, tc.dial)
			}
			if tc.dial != "ok" {
				return
			}
			if got := c.do(t, "rt 10s"); got != "ok" {
				t.Fatalf("round trip to %s from %s: %q", tc.addr, tc.from.Name, got)
			}
		})
	}

	t.Run("root to hosts", func(t *testing.T) {
		for _, h := range b.Hosts {
			roundTrip(t, net.JoinHostPort(h.IP.String(), "7000"), 10*time.Second)
		}
	})

	t.Run("a host sees only its own addresses", func(t *testing.T) {
		for _, h := range b.Hosts {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			cmd := h.Command(ctx, os.Args[0], "addrs")
			cmd.Env = append(os.Environ(), envHelper+"=1")
			out, err := cmd.Output()
			cancel()
			if err != nil {
				t.Fatalf("addrs on %s: %v", h.Name, err)
			}
			got := strings.Fields(strings.ReplaceAll(string(out), " ", "="))
			slices.Sort(got)
			want := []string{"eth0=" + h.IP.String(), "lo=127.0.0.1"}
			if _, err := os.Stat("/proc/sys/net/ipv6"); err == nil {
				want = append(want, "lo=::1")
			}
			if !slices.Equal(got, want) {
				t.Errorf("addresses on %s: %q, want %q", h.Name, got, want)
			}
		}
	})
}

// roundTrip connects from the root namespace and echoes one line.
func roundTrip(t *testing.T, addr string, timeout time.Duration) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, "root\n"); err != nil {
		t.Fatal(err)
	}
	if l, err := bufio.NewReader(c).ReadString('\n'); err != nil || l != "root\n" {
		t.Fatalf("echo from %s: %q, %v", addr, l, err)
	}
}

func TestBlackholeStallsAndHeals(t *testing.T) {
	b := New(t, 2, Options{})
	h0, h1 := b.Hosts[0], b.Hosts[1]
	gw := echoOnGateway(t, b)
	serveOn(t, h1, ":7000")
	h1addr := net.JoinHostPort(h1.IP.String(), "7000")

	c := startHelper(t, h0, "client", h1addr)
	if got := c.do(t, "dial 10s"); got != "ok" {
		t.Fatalf("dial: %q", got)
	}
	if got := c.do(t, "rt 10s"); got != "ok" {
		t.Fatalf("round trip before the cut: %q", got)
	}
	// A connection from the root namespace, through the gateway's port.
	rc, err := net.DialTimeout("tcp", h1addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	rr := bufio.NewReader(rc)

	if err := h1.Blackhole(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if got := c.do(t, "rt 1s"); got != "timeout" {
		t.Fatalf("round trip over a cut link: %q, want a stall (timeout, no error)", got)
	}
	if el := time.Since(start); el < time.Second {
		t.Fatalf("round trip over a cut link ended after %v, before its 1 s deadline", el)
	}
	if got := c.do(t, "write 1s"); got != "ok" {
		t.Fatalf("write over a cut link: %q, want it buffered without error", got)
	}
	c2 := startHelper(t, h0, "client", h1addr)
	if got := c2.do(t, "dial 1s"); got != "timeout" {
		t.Fatalf("new connection over a cut link: %q, want a stall (no RST, no ICMP)", got)
	}
	rc.SetDeadline(time.Now().Add(time.Second))
	if _, err := io.WriteString(rc, "root\n"); err != nil {
		t.Fatalf("root write over a cut link: %v", err)
	}
	if _, err := rr.ReadString('\n'); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("root read over a cut link: %v, want a stall", err)
	}
	// Only h1 is cut: h0 still reaches the gateway, h1 its own loopback.
	g := startHelper(t, h0, "client", gw)
	if got := g.do(t, "dial 10s"); got != "ok" {
		t.Fatalf("h0 to gateway while h1 is cut: %q", got)
	}
	l := startHelper(t, h1, "client", "127.0.0.1:7000")
	if got := l.do(t, "dial 10s"); got != "ok" {
		t.Fatalf("loopback inside a cut host: %q", got)
	}
	if got := l.do(t, "rt 10s"); got != "ok" {
		t.Fatalf("loopback inside a cut host: %q", got)
	}

	if err := h1.Heal(); err != nil {
		t.Fatal(err)
	}
	// The stalled connections carry on at their next retransmission.
	if got := c.do(t, "rt 20s"); got != "ok" {
		t.Fatalf("round trip after heal: %q", got)
	}
	rc.SetDeadline(time.Now().Add(20 * time.Second))
	if l, err := rr.ReadString('\n'); err != nil || l != "root\n" {
		t.Fatalf("root read after heal: %q, %v", l, err)
	}
	if got := c2.do(t, "dial 10s"); got != "ok" {
		t.Fatalf("new connection after heal: %q", got)
	}
}

// alive reports whether pid is a process that has not exited (zombies
// have).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// gone reports whether orphan pid has exited, and reaps it if it has (it
// is this process's child: see TestMain).
func gone(pid int) bool {
	if alive(pid) {
		return false
	}
	unix.Wait4(pid, nil, unix.WNOHANG, nil)
	return true
}

// startSleep starts a long sleep on h, waits until it runs there, and
// returns it and its exit.
func startSleep(t *testing.T, h *Host) (*exec.Cmd, <-chan error) {
	t.Helper()
	cmd := h.Command(context.Background(), "sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	// ip enters the namespace and then execs sleep, in the process Start
	// made: the PID a test holds is the program's own, not a wrapper's.
	want, err := statNS(nsPath(h.Name))
	if err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	for deadline := time.Now().Add(10 * time.Second); ; {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		id, err := statNS(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err == nil && id == want && string(comm) == "sleep\n" {
			return cmd, done
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d is %q in %v, want sleep in %s", pid, comm, id, h.Name)
		}
		time.Sleep(time.Millisecond)
	}
}

// startOrphan starts a sleep on h whose parent exits at once, so that only
// a namespace-wide kill can end it, and returns its PID.
func startOrphan(t *testing.T, h *Host) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := h.Command(ctx, "sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & echo $!").Output()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil || !alive(pid) {
		t.Fatalf("orphan %q: %v", out, err)
	}
	return pid
}

// waitKilled waits for a process's exit and checks SIGKILL ended it.
func waitKilled(t *testing.T, what string, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Errorf("%s: exit %v, want killed by SIGKILL", what, err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("%s: still running 10 s after the kill", what)
	}
}

func TestKill(t *testing.T) {
	b := New(t, 2, Options{})
	h0, h1 := b.Hosts[0], b.Hosts[1]
	s0, done0 := startSleep(t, h0)
	orphan := startOrphan(t, h0)
	s1, done1 := startSleep(t, h1)
	pids, err := h0.PIDs()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(pids)
	if want := []int{s0.Process.Pid, orphan}; !slices.Equal(pids, slices.Sorted(slices.Values(want))) {
		t.Fatalf("h0.PIDs() = %v, want %v", pids, want)
	}

	if err := h0.Kill(); err != nil {
		t.Fatal(err)
	}
	waitKilled(t, "sleep on h0", done0)
	if !gone(orphan) {
		t.Error("orphan on h0 survived Kill")
	}
	if pids, err := h0.PIDs(); err != nil || len(pids) != 0 {
		t.Errorf("h0.PIDs() after Kill = %v, %v", pids, err)
	}
	if !alive(s1.Process.Pid) {
		t.Fatal("h0.Kill killed a process on h1")
	}
	if pids, err := h1.PIDs(); err != nil || !slices.Equal(pids, []int{s1.Process.Pid}) {
		t.Fatalf("h1.PIDs() = %v, %v, want [%d]", pids, err, s1.Process.Pid)
	}
	if err := h1.Kill(); err != nil {
		t.Fatal(err)
	}
	waitKilled(t, "sleep on h1", done1)
}

// leftovers describes a bed as it was, to check that it is gone.
type leftovers struct {
	Namespaces map[string]nsID // name → identity
	Link       string
	LinkIndex  int
	State      string
	Owner      int // the PID that made the bed
	Orphans    []int
}

// record notes a bed's parts and starts an orphan on each host.
func record(t *testing.T, b *Bed) leftovers {
	t.Helper()
	l := leftovers{Namespaces: map[string]nsID{}, Link: b.GatewayLink, State: b.state, Owner: os.Getpid()}
	for _, ns := range b.namespaces() {
		id, err := statNS(nsPath(ns))
		if err != nil {
			t.Fatal(err)
		}
		l.Namespaces[ns] = id
	}
	l.LinkIndex = linkIndex(b.GatewayLink)
	for _, h := range b.Hosts {
		l.Orphans = append(l.Orphans, startOrphan(t, h))
	}
	return l
}

// linkIndex returns the root namespace's interface index of link, or 0.
func linkIndex(link string) int {
	ifc, err := net.InterfaceByName(link)
	if err != nil {
		return 0
	}
	return ifc.Index
}

// checkGone fails the test if any part of the bed l describes is left: a
// name may be taken again by a newer bed, so identities are compared.
func checkGone(t *testing.T, l leftovers) {
	t.Helper()
	for ns, id := range l.Namespaces {
		if now, err := statNS(nsPath(ns)); err == nil && now == id {
			t.Errorf("namespace %s left behind", ns)
		}
	}
	if idx := linkIndex(l.Link); idx != 0 && idx == l.LinkIndex {
		t.Errorf("link %s left behind", l.Link)
	}
	if b, err := os.ReadFile(l.State); err == nil {
		if o, err := parseOwner(string(b)); err != nil || o.pid == l.Owner {
			t.Errorf("state file %s left behind (%q)", l.State, b)
		}
	}
	for _, pid := range l.Orphans {
		if !gone(pid) {
			t.Errorf("process %d left behind", pid)
		}
	}
}

// checkPresent fails the test unless every part of the bed l describes is
// still there.
func checkPresent(t *testing.T, l leftovers) {
	t.Helper()
	for ns, id := range l.Namespaces {
		if now, err := statNS(nsPath(ns)); err != nil || now != id {
			t.Fatalf("namespace %s: %v", ns, err)
		}
	}
	if linkIndex(l.Link) != l.LinkIndex {
		t.Fatalf("link %s gone", l.Link)
	}
	if _, err := os.Stat(l.State); err != nil {
		t.Fatal(err)
	}
	for _, pid := range l.Orphans {
		if !alive(pid) {
			t.Fatalf("process %d gone", pid)
		}
	}
}

func TestCleanupLeavesNothing(t *testing.T) {
	Require(t) // here too, or the subtests' skips would leave nothing to check
	for _, hosts := range []int{1, 4} {
		t.Run(fmt.Sprintf("hosts=%d", hosts), func(t *testing.T) {
			var l leftovers
			var done []<-chan error
			t.Run("bed", func(t *testing.T) {
				b := New(t, hosts, Options{})
				l = record(t, b)
				for _, h := range b.Hosts {
					_, d := startSleep(t, h)
					done = append(done, d)
				}
				if err := b.Hosts[0].Blackhole(); err != nil { // a cut host goes too
					t.Fatal(err)
				}
			})
			checkGone(t, l)
			for _, d := range done {
				waitKilled(t, "sleep", d)
			}
		})
	}
}

// TestCreate: Create, the constructor for programs that are not tests,
// refuses host counts a bed cannot hold without building anything, and a
// bed it builds is the caller's to close: Close leaves nothing behind.
func TestCreate(t *testing.T) {
	Require(t)
	if err := Available(); err != nil {
		t.Fatalf("Require passed but Available says %v", err)
	}
	for _, hosts := range []int{0, -1, MaxHosts + 1} {
		if b, err := Create(hosts, Options{}); err == nil || b != nil {
			if b != nil {
				b.Close()
			}
			t.Errorf("Create(%d) = %v, %v; want an error and no bed", hosts, b, err)
		}
	}
	b, err := Create(2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	l := record(t, b)
	checkPresent(t, l)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	checkGone(t, l)
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// envHelperBed makes TestHelperBed build a bed, print it and then fail
// ("fail") or wait to be killed ("hang").
const envHelperBed = "GORUN_NETNS_HELPER_BED"

// TestHelperBed is not a test on its own: TestCleanupAfterFailure and
// TestStaleBedSwept run it in a child test binary.
func TestHelperBed(t *testing.T) {
	mode := os.Getenv(envHelperBed)
	if mode == "" {
		t.Skip("helper for TestCleanupAfterFailure and TestStaleBedSwept")
	}
	b := New(t, 2, Options{})
	l := record(t, b)
	js, _ := json.Marshal(l)
	fmt.Printf("BED %s\n", js)
	if mode == "fail" {
		t.Fatal("failing on purpose")
	}
	time.Sleep(time.Minute) // until killed
}

// child is a child test binary.
type child struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited; then err is its exit
	err  error
}

// wait waits up to timeout for the child's exit.
func (c *child) wait(t *testing.T, timeout time.Duration) error {
	t.Helper()
	select {
	case <-c.done:
		return c.err
	case <-time.After(timeout):
		t.Fatalf("child test still running after %v", timeout)
		return nil
	}
}

// childBed runs TestHelperBed in a child test binary in mode and returns
// the bed it printed, and the child, still running. The test's cleanup
// kills the child.
func childBed(t *testing.T, mode string) (leftovers, *child) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperBed$", "-test.v")
	cmd.Env = append(os.Environ(), envHelperBed+"="+mode)
	lines := newLineWriter()
	cmd.Stdout, cmd.Stderr = lines, lines
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	go func() { c.err = cmd.Wait(); close(c.done) }()
	t.Cleanup(func() { cancel(); <-c.done })
	var out []string
	for {
		select {
		case line := <-lines.c:
			out = append(out, line)
			js, ok := strings.CutPrefix(line, "BED ")
			if !ok {
				continue
			}
			var l leftovers
			if err := json.Unmarshal([]byte(js), &l); err != nil {
				t.Fatal(err)
			}
			return l, c
		case <-c.done:
			t.Fatalf("child exited before building its bed: %v\n%s", c.err, strings.Join(out, "\n"))
		case <-time.After(30 * time.Second):
			t.Fatalf("child built no bed in 30 s\n%s", strings.Join(out, "\n"))
		}
	}
}

// TestCleanupAfterFailure: a test that fails still removes its bed.
func TestCleanupAfterFailure(t *testing.T) {
	Require(t)
	l, c := childBed(t, "fail")
	if err := c.wait(t, 30*time.Second); err == nil {
		t.Fatal("child test passed; it should have failed")
	}
	checkGone(t, l)
}

// TestStaleBedSwept: a bed whose test binary was killed (no cleanup ran)
// is removed, processes and all, by the next New.
func TestStaleBedSwept(t *testing.T) {
	Require(t)
	l, c := childBed(t, "hang")
	// Under the lock, so that no bed made meanwhile (by another package's
	// tests) sweeps the leftovers before they are seen.
	func() {
		unlock, err := lockState()
		if err != nil {
			t.Fatal(err)
		}
		defer unlock()
		c.cmd.Process.Kill()
		c.wait(t, 30*time.Second)
		checkPresent(t, l)
	}()
	New(t, 1, Options{})
	checkGone(t, l)
}

// TestEtcdOnGateway: an etcd listening on the gateway serves the hosts.
func TestEtcdOnGateway(t *testing.T) {
	b := New(t, 2, Options{})
	c := etcdtest.Start(t, 1, etcdtest.Options{ListenIP: b.Gateway.String()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.Client(t, nil).Put(ctx, "netns-probe", "from the root namespace"); err != nil {
		t.Fatal(err)
	}
	for _, h := range b.Hosts {
		cmd := h.Command(ctx, os.Args[0], "etcd-get", c.Endpoints()[0], "netns-probe")
		cmd.Env = append(os.Environ(), envHelper+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "from the root namespace" {
			t.Errorf("etcd from %s: %q, %v", h.Name, out, err)
		}
	}
}

// BenchmarkBed measures building and removing a bed.
func BenchmarkBed(b *testing.B) {
	for _, hosts := range []int{2, 4} {
		b.Run(fmt.Sprintf("hosts=%d", hosts), func(b *testing.B) {
			var setup, teardown time.Duration
			for b.Loop() {
				t0 := time.Now()
				bed := New(b, hosts, Options{})
				t1 := time.Now()
				if err := bed.Close(); err != nil {
					b.Fatal(err)
				}
				setup += t1.Sub(t0)
				teardown += time.Since(t1)
			}
			b.ReportMetric(float64(setup.Microseconds())/float64(b.N)/1000, "setup-ms/op")
			b.ReportMetric(float64(teardown.Microseconds())/float64(b.N)/1000, "teardown-ms/op")
		})
	}
}
