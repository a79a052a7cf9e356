package health

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The test binary re-executed is a gossip member in a process of its own
// (the frozen peer of TestNodesFrozenPeer) or a CPU hog. This is an init
// rather than a TestMain branch because the package's TestMain belongs to
// heartbeat_test.go.
const (
	envMember    = "HEALTH_TEST_MEMBER"    // the member's name
	envSeeds     = "HEALTH_TEST_SEEDS"     // comma-separated gossip addresses to join
	envSuspicion = "HEALTH_TEST_SUSPICION" // NodeConfig.SuspicionMult, if not the default
	envHog       = "HEALTH_TEST_HOG"
)

// testCluster labels the tests' gossip, so that a member of one test never
// joins another's through a reused port.
const testCluster = "gorun-health-test"

func init() {
	switch {
	case os.Getenv(envMember) != "":
		os.Exit(memberMain(os.Getenv(envMember), os.Getenv(envSeeds)))
	case os.Getenv(envHog) == "1":
		runtime.GOMAXPROCS(1)
		for {
		}
	}
}

// detectBound is the correctness bound on detection in these tests: far
// above the ≈1 s the defaults give (measured latencies are logged), for a
// machine busy with other builds.
const detectBound = 5 * time.Second

func testNodeConfig(name string) NodeConfig {
	cfg := DefaultNodeConfig()
	cfg.Name = name
	cfg.BindAddr = "127.0.0.1"
	cfg.Cluster = testCluster
	return cfg
}

// memberMain is a member process: it joins seeds, prints "addr <addr>",
// then one "event <kind> <node> <seen unix ns> <reason>" line per event,
// and "refuted" whenever it refutes a suspicion of itself, until its stdin
// closes.
func memberMain(name, seeds string) int {
	cfg := testNodeConfig(name)
	if v := os.Getenv(envSuspicion); v != "" {
		cfg.SuspicionMult, _ = strconv.Atoi(v)
	}
	var out sync.Mutex
	cfg.Logger = zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zapcore.EncoderConfig{}), zapcore.AddSync(io.Discard), zap.DebugLevel),
		zap.Hooks(func(e zapcore.Entry) error {
			if strings.HasPrefix(e.Message, "Refuting a suspect message") {
				out.Lock()
				defer out.Unlock()
				fmt.Println("refuted")
			}
			return nil
		}))
	n, err := StartNodes(cfg)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer n.Close()
	if _, err := n.Join(context.Background(), strings.Split(seeds, ",")); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("addr", n.Addr())
	events := make(chan Event)
	go n.Run(context.Background(), events)
	go func() {
		for ev := range events {
			out.Lock()
			fmt.Printf("event %s %s %d %s\n", ev.Kind, ev.Node, ev.SeenAt.UnixNano(), ev.Reason)
			out.Unlock()
		}
	}()
	io.Copy(io.Discard, os.Stdin)
	return 0
}

// eventLog is every event one member reported, as the test reads them.
type eventLog struct {
	who string
	ch  chan Event
	all []Event
}

func newEventLog(who string) *eventLog { return &eventLog{who: who, ch: make(chan Event, 1024)} }

// is matches events by kind and node name, and by a substring of the
// reason when reason is not empty.
func is(kind EventKind, node, reason string) func(Event) bool {
	return func(ev Event) bool {
		return ev.Kind == kind && ev.Node == node && strings.Contains(ev.Reason, reason)
	}
}

// wait returns the first event that matches, reported so far or within
// timeout; it fails the test otherwise.
func (l *eventLog) wait(t *testing.T, timeout time.Duration, match func(Event) bool) Event {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for i := 0; ; {
		for ; i < len(l.all); i++ {
			if match(l.all[i]) {
				return l.all[i]
			}
		}
		select {
		case ev := <-l.ch:
			l.all = append(l.all, ev)
		case <-timer.C:
			t.Fatalf("%s: no such event within %v; all: %v", l.who, timeout, l.all)
		}
	}
}

// only fails the test for each event reported so far that none of allowed
// matches. Joins always pass.
func (l *eventLog) only(t *testing.T, allowed ...func(Event) bool) {
	t.Helper()
	for {
		select {
		case ev := <-l.ch:
			l.all = append(l.all, ev)
			continue
		default:
		}
		break
	}
	for _, ev := range l.all {
		ok := ev.Kind == NodeJoined
		for _, match := range allowed {
			ok = ok || match(ev)
		}
		if !ok {
			t.Errorf("%s: unexpected %v", l.who, ev)
		}
	}
}

// member is a Nodes in the test process.
type member struct {
	*Nodes
	*eventLog
}

func startMember(t *testing.T, name string, seeds ...string) *member {
	t.Helper()
	return startMemberConfig(t, testNodeConfig(name), seeds...)
}

func startMemberConfig(t *testing.T, cfg NodeConfig, seeds ...string) *member {
	t.Helper()
	name := cfg.Name
	n, err := StartNodes(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m := &member{Nodes: n, eventLog: newEventLog(name)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- n.Run(ctx, m.ch) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("%s: Run: %v", name, err)
		}
		n.Close()
	})
	if len(seeds) > 0 {
		if _, err := n.Join(context.Background(), seeds); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

func startMembers(t *testing.T, count int) []*member {
	t.Helper()
	return startMembersConfig(t, count, func(*NodeConfig) {})
}

// startMembersConfig starts members m0, m1, … from testNodeConfig changed
// by change, each joining those before it.
func startMembersConfig(t *testing.T, count int, change func(*NodeConfig)) []*member {
	t.Helper()
	var ms []*member
	for i := range count {
		var seeds []string
		for _, m := range ms {
			seeds = append(seeds, m.Addr())
		}
		cfg := testNodeConfig(fmt.Sprintf("m%d", i))
		change(&cfg)
		ms = append(ms, startMemberConfig(t, cfg, seeds...))
	}
	return ms
}

// converge waits until every member sees want members.
func converge(t *testing.T, ms []*member, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, m := range ms {
		for len(m.Members()) != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s sees %v, want %d members", m.Name(), m.Members(), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

func TestNodesJoin(t *testing.T) {
	ms := startMembers(t, 3)
	converge(t, ms, 3)
	for _, m := range ms {
		for _, peer := range ms {
			if peer == m {
				continue
			}
			ev := m.wait(t, detectBound, is(NodeJoined, peer.Name(), ""))
			if ev.Addr != peer.Addr() || ev.Reason != "joined the gossip" || ev.SeenAt.IsZero() {
				t.Errorf("%s: %v", m.Name(), ev)
			}
		}
		m.only(t)
		if len(m.all) != 2 {
			t.Errorf("%s: events %v, want one join per peer", m.Name(), m.all)
		}
		got := m.Members()
		if len(got) != 3 || got[0].Name != "m0" || got[2].Name != "m2" || got[1].Addr != ms[1].Addr() {
			t.Errorf("%s: Members() = %v", m.Name(), got)
		}
	}
}

func TestNodesJoinErrors(t *testing.T) {
	m := startMember(t, "alone")
	// Only itself: nothing to join, no error.
	if n, err := m.Join(context.Background(), []string{m.Addr()}); n != 0 || err != nil {
		t.Errorf("Join(self) = %d, %v", n, err)
	}
	// A port nobody listens on: closed at once, so this is quick.
	dead := startMember(t, "dead")
	deadAddr := dead.Addr()
	dead.Close()
	if _, err := m.Join(context.Background(), []string{deadAddr}); !errors.Is(err, ErrNoSeedReached) {
		t.Errorf("Join(closed port) = %v, want ErrNoSeedReached", err)
	}
	// A member of another cluster does not let it in.
	cfg := testNodeConfig("other")
	cfg.Cluster = "another-job"
	other, err := StartNodes(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := m.Join(context.Background(), []string{other.Addr()}); !errors.Is(err, ErrNoSeedReached) {
		t.Errorf("Join(other cluster) = %v, want ErrNoSeedReached", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := m.Join(ctx, []string{deadAddr}); !errors.Is(err, context.Canceled) {
		t.Errorf("Join(cancelled) = %v", err)
	}
	m.Close()
	if _, err := m.Join(context.Background(), []string{deadAddr}); !errors.Is(err, ErrNodesClosed) {
		t.Errorf("Join after Close = %v", err)
	}
	if err := m.Leave(time.Second); !errors.Is(err, ErrNodesClosed) {
		t.Errorf("Leave after Close = %v", err)
	}
}

func TestStartNodesInvalidConfig(t *testing.T) {
	cfg := testNodeConfig("x")
	cfg.ProbeTimeout = time.Second
	if _, err := StartNodes(cfg); err == nil || !strings.Contains(err.Error(), "ProbeTimeout") {
		t.Errorf("StartNodes = %v", err)
	}
}

// TestNodesSilentDeath: a member stops without leaving (its process would
// have crashed); every other member declares it dead, in about a second.
func TestNodesSilentDeath(t *testing.T) {
	ms := startMembers(t, 4)
	converge(t, ms, 4)
	victim, survivors := ms[3], ms[:3]
	// Each survivor probes the victim at least once every 2 × 3 intervals;
	// wait for that, so that the verdicts quote a last ack.
	time.Sleep(10 * DefaultNodeConfig().ProbeInterval)
	killed := time.Now()
	victim.Close()
	for _, m := range survivors {
		ev := m.wait(t, detectBound, is(NodeDead, victim.Name(), ""))
		m.only(t, is(NodeDead, victim.Name(), ""))
		latency := ev.SeenAt.Sub(killed)
		if latency <= 0 || ev.Addr != victim.Addr() || !strings.Contains(ev.Reason, "unreachable") ||
			!strings.Contains(ev.Reason, "last ack to this member") {
			t.Errorf("%s: %v (%v after the kill)", m.Name(), ev, latency)
		}
		t.Logf("%s: declared dead %v after the kill (goal 1 s, worst case %v): %s",
			m.Name(), latency.Round(time.Millisecond), DefaultNodeConfig().DetectionBound(4), ev.Reason)
	}
	for _, m := range survivors {
		for _, mm := range m.Members() {
			if mm.Name == victim.Name() {
				t.Errorf("%s still lists %v", m.Name(), mm)
			}
		}
	}
}

// TestNodesExpect: deaths outside the round are not reported; a round
// that names an agent already dead hears of it at once.
func TestNodesExpect(t *testing.T) {
	ms := startMembers(t, 3)
	converge(t, ms, 3)
	ms[0].Expect([]string{"m1"})
	ms[2].Close()
	// memberlist drops m2 from Members under the lock it calls the
	// EventDelegate with: once m2 is gone from there, m0 has seen it die.
	deadline := time.Now().Add(detectBound)
	for len(ms[0].Members()) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("m0 still sees %v", ms[0].Members())
		}
		time.Sleep(10 * time.Millisecond)
	}
	ms[0].only(t)
	ms[0].Expect([]string{"m1", "m2"})
	ms[0].wait(t, detectBound, is(NodeDead, "m2", "(before this round)"))
}

// TestNodesRun: events wait for a Run, survive a cancelled one, and Close
// ends one.
func TestNodesRun(t *testing.T) {
	n, err := StartNodes(testNodeConfig("runner"))
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	peer := startMember(t, "peer")
	if _, err := n.Join(context.Background(), []string{peer.Addr()}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := n.Run(ctx, make(chan Event)); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run(cancelled) = %v", err)
	}
	events := make(chan Event, 8)
	done := make(chan error, 1)
	go func() { done <- n.Run(context.Background(), events) }()
	select {
	case ev := <-events:
		if ev.Kind != NodeJoined || ev.Node != "peer" {
			t.Errorf("first event %v, want peer's join", ev)
		}
	case <-time.After(detectBound):
		t.Fatal("no event from the second Run")
	}
	n.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after Close = %v", err)
		}
	case <-time.After(detectBound):
		t.Fatal("Close did not end Run")
	}
}

// TestNodesGracefulLeave: a member that leaves is reported as left, never
// as dead.
func TestNodesGracefulLeave(t *testing.T) {
	ms := startMembers(t, 3)
	converge(t, ms, 3)
	leaver, stayers := ms[2], ms[:2]
	if err := leaver.Leave(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	leaver.Close()
	for _, m := range stayers {
		m.wait(t, detectBound, is(NodeLeft, leaver.Name(), "left gracefully"))
	}
	// Well past the time a death would take to be declared: nothing more.
	time.Sleep(2 * DefaultNodeConfig().DetectionBound(3))
	for _, m := range stayers {
		m.only(t, is(NodeLeft, leaver.Name(), ""))
	}
}

// child is a member process (memberMain).
type child struct {
	*eventLog
	cmd     *exec.Cmd
	addr    string
	refuted atomic.Int32 // suspicions of itself it refuted
}

// startChild starts a member process named name joining seeds; env adds
// to its environment.
func startChild(t *testing.T, name string, seeds []string, env ...string) *child {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), envMember+"="+name, envSeeds+"="+strings.Join(seeds, ","))
	cmd.Env = append(cmd.Env, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, eventLog: newEventLog(name)}
	addr := make(chan string, 1)
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			if a, ok := strings.CutPrefix(line, "addr "); ok {
				addr <- a
				continue
			}
			if line == "refuted" {
				c.refuted.Add(1)
				continue
			}
			f := strings.SplitN(line, " ", 5)
			if len(f) < 5 || f[0] != "event" {
				t.Logf("%s: %s", name, line)
				continue
			}
			ns, _ := strconv.ParseInt(f[3], 10, 64)
			select {
			case c.ch <- Event{Kind: EventKind(f[1]), Node: f[2], SeenAt: time.Unix(0, ns), Reason: f[4]}:
			default:
				t.Errorf("%s: event dropped: %s", name, line)
			}
		}
	}()
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		<-read
		cmd.Wait()
	})
	select {
	case c.addr = <-addr:
	case <-read:
		t.Fatalf("member process %s exited before it joined", name)
	case <-time.After(10 * time.Second):
		t.Fatalf("member process %s did not join within 10 s", name)
	}
	return c
}

func (c *child) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

// TestNodesFrozenPeer: a member process is SIGSTOPped — its kernel still
// holds its sockets, so probes are not refused but go unanswered, a
// blackhole for its peers. They declare it dead; once it is continued it
// refutes and they report it as joined again.
func TestNodesFrozenPeer(t *testing.T) {
	ms := startMembers(t, 3)
	c := startChild(t, "frozen", []string{ms[0].Addr(), ms[1].Addr(), ms[2].Addr()})
	converge(t, ms, 4)
	c.signal(t, syscall.SIGSTOP)
	stopped := time.Now()
	for _, m := range ms {
		ev := m.wait(t, detectBound, is(NodeDead, "frozen", ""))
		m.only(t, is(NodeDead, "frozen", ""))
		latency := ev.SeenAt.Sub(stopped)
		if latency <= 0 || ev.Addr != c.addr || !strings.Contains(ev.Reason, "unreachable") {
			t.Errorf("%s: %v (%v after SIGSTOP)", m.Name(), ev, latency)
		}
		t.Logf("%s: declared dead %v after SIGSTOP (goal 1 s, worst case %v)",
			m.Name(), latency.Round(time.Millisecond), DefaultNodeConfig().DetectionBound(4))
	}
	c.signal(t, syscall.SIGCONT)
	for _, m := range ms {
		m.wait(t, detectBound, is(NodeJoined, "frozen", "after being declared dead"))
	}
}

// TestNodesBriefFreeze: a member process frozen for less than the silence
// a verdict needs (ProbeInterval + SuspicionTimeout − GossipInterval,
// 480 ms at the defaults) gets suspected and refutes: no verdict.
func TestNodesBriefFreeze(t *testing.T) {
	const pause, pauses = 250 * time.Millisecond, 5
	ms := startMembers(t, 3)
	c := startChild(t, "napper", []string{ms[0].Addr(), ms[1].Addr(), ms[2].Addr()})
	converge(t, ms, 4)
	cfg := DefaultNodeConfig()
	for range pauses {
		c.signal(t, syscall.SIGSTOP)
		time.Sleep(pause)
		c.signal(t, syscall.SIGCONT)
		// Past the suspicion timeout of any suspicion the pause raised.
		time.Sleep(cfg.SuspicionTimeout(4) + 2*cfg.ProbeInterval)
	}
	for _, m := range ms {
		m.only(t)
	}
	t.Logf("%d pauses of %v: %d suspicions refuted", pauses, pause, c.refuted.Load())
	// Each pause leaves 150 ms in which a probe of it fails; about one
	// probe of it is sent every ProbeInterval.
	if c.refuted.Load() == 0 {
		t.Errorf("no suspicion in %d pauses of %v: the freezes did not test refutation", pauses, pause)
	}
}

// TestNodesNoFalsePositivesUnderLoad: members run for 10 s while CPU hogs
// (two per core, in processes of their own) saturate the machine, probing
// as fast as the defaults do; no member is declared dead.
//
// The suspicion timeout is 2 s rather than the default 400 ms: a shared
// machine also busy with other jobs can starve this process for longer
// than the defaults' 480 ms of tolerated silence (a Go process was seen
// waking 470 ms late there). What this tests is the machinery under load:
// probes failing for slowness must end in refutations, never in verdicts,
// and memberlist must never wait on this package. bench/livenessbench
// measures the defaults.
func TestNodesNoFalsePositivesUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s under load: skipped with -short")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for range 2 * runtime.NumCPU() {
		hog := exec.Command(self, "-test.run=^$")
		hog.Env = append(os.Environ(), envHog+"=1")
		hog.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { hog.Process.Kill(); hog.Wait() })
	}
	const suspicionMult = 20
	ms := startMembersConfig(t, 3, func(c *NodeConfig) { c.SuspicionMult = suspicionMult })
	c := startChild(t, "busy", []string{ms[0].Addr()}, fmt.Sprintf("%s=%d", envSuspicion, suspicionMult))
	converge(t, ms, 4)
	time.Sleep(10 * time.Second)
	for _, m := range ms {
		m.only(t)
	}
	c.only(t)
	t.Logf("the member process refuted %d suspicions", c.refuted.Load())
}

// TestNodesLogToZap: memberlist's own log lines reach the configured zap
// logger at debug level, never above it.
func TestNodesLogToZap(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	cfg := testNodeConfig("logged")
	cfg.Logger = zap.New(core)
	n, err := StartNodes(cfg)
	if err != nil {
		t.Fatal(err)
	}
	peer := startMember(t, "peer")
	if _, err := n.Join(context.Background(), []string{peer.Addr()}); err != nil {
		t.Fatal(err)
	}
	n.Close()
	fromMemberlist := logs.FilterLoggerName("memberlist").All()
	if len(fromMemberlist) == 0 {
		t.Fatalf("no memberlist log entries; all: %v", logs.All())
	}
	for _, e := range fromMemberlist {
		if e.Level != zap.DebugLevel || strings.HasPrefix(e.Message, "[") || e.ContextMap()["node"] != "logged" {
			t.Errorf("memberlist entry %v %q %v", e.Level, e.Message, e.ContextMap())
		}
	}
}

// TestNodesSecretKey: members that share a SecretKey gossip (encrypted,
// every packet verified); a member without it, or with another key, can
// neither join them nor be heard: the members report nothing about it, and
// nobody is declared dead. A bad key length is refused at start.
func TestNodesSecretKey(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	var refused atomic.Int64
	ms := startMembersConfig(t, 3, func(c *NodeConfig) {
		c.SecretKey = key
		c.OnRefused = func(string, string) { refused.Add(1) }
	})
	converge(t, ms, 3)
	for _, outsider := range []struct {
		name string
		key  []byte
	}{
		{"no-key", nil},
		{"other-key", []byte("fedcba9876543210fedcba9876543210")},
	} {
		cfg := testNodeConfig(outsider.name)
		cfg.SecretKey = outsider.key
		o := startMemberConfig(t, cfg)
		if _, err := o.Join(context.Background(), []string{ms[0].Addr(), ms[1].Addr()}); !errors.Is(err, ErrNoSeedReached) {
			t.Errorf("%s: Join = %v, want ErrNoSeedReached", outsider.name, err)
		}
		if got := o.Members(); len(got) != 1 {
			t.Errorf("%s sees %v, want only itself", outsider.name, got)
		}
	}
	// Several probe rounds: an outsider's packets, were any accepted,
	// would show as a join or a suspicion by now.
	time.Sleep(10 * DefaultNodeConfig().ProbeInterval)
	for _, m := range ms {
		m.only(t)
		if got := m.Members(); len(got) != 3 {
			t.Errorf("%s sees %v, want the 3 keyed members", m.Name(), got)
		}
	}
	// The members said what they refused: the outsiders' joins, and their
	// probes.
	if refused.Load() == 0 {
		t.Error("no refusal reported to OnRefused")
	}
	cfg := testNodeConfig("short")
	cfg.SecretKey = []byte("short")
	if _, err := StartNodes(cfg); err == nil || !strings.Contains(err.Error(), "SecretKey is 5 bytes") {
		t.Errorf("StartNodes with a 5-byte key = %v", err)
	}
}

func TestRefusal(t *testing.T) {
	for _, tc := range []struct {
		msg  string
		want bool
		from string
	}{
		{"Decrypt packet failed: Unsupported encryption version 5 from=10.0.0.9:7946", true, "10.0.0.9"},
		{`discarding packet with unacceptable label "other": from=10.0.0.9:7946`, true, "10.0.0.9"},
		{"failed to receive: encryption is configured but remote state is not encrypted from=[::1]:5501", true, "::1"},
		{"failed to receive: No installed keys could decrypt the message from=<unknown address>", true, "<unknown address>"},
		{"Failed to send ping: write udp: connection refused", false, ""},
		{"Suspect node-1 has failed, no acks received", false, ""},
	} {
		if got := refusal(tc.msg); got != tc.want {
			t.Errorf("refusal(%q) = %v, want %v", tc.msg, got, tc.want)
		}
		if got := refusedFrom(tc.msg); got != tc.from {
			t.Errorf("refusedFrom(%q) = %q, want %q", tc.msg, got, tc.from)
		}
	}
}
