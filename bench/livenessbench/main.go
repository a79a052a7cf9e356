// Command livenessbench measures node liveness among gorun agents
// (health.Nodes, hashicorp/memberlist underneath) on one machine, every
// member a process of its own, and prints a markdown table.
//
// Benchmarks:
//   - freeze: a cluster of -members forms; one member is SIGSTOPped (its
//     kernel keeps its sockets, so probes go unanswered: a blackhole). The
//     latency is from the signal to the SeenAt of the NodeDead event, for
//     the first survivor to report it and for the last. -trials fresh
//     clusters.
//   - link cut (root, iproute2): the victim runs in a network namespace of
//     the benchmark's own, joined to the others by a veth pair; the cut
//     sets the namespace's end down, so packets to it vanish. Same
//     latencies. Skipped with a line saying why when namespaces are
//     unavailable.
//   - pauses: in one cluster, a random member is frozen for -pause (shorter
//     than the silence a verdict needs: ProbeInterval + SuspicionTimeout −
//     GossipInterval) and continued, -pauses times, one second apart. Each
//     pause long enough to get the member suspected must end in its
//     refutation reaching every member, never in a verdict.
//   - false positives: -members members run for -fp-duration while -hogs
//     processes spin on the CPUs (at nice -hog-nice: 0 competes with the
//     members as equals, 10 is workers run below their agent); every
//     NodeDead or NodeLeft any member reports is a false positive (the
//     issue's goal: zero in 5 minutes with both cores saturated). Members
//     also count the suspicions they refuted: near misses.
//
// The timers are health.DefaultNodeConfig's unless flags change them; the
// table quotes them. Every process the benchmark starts gets
// Pdeathsig=SIGKILL and is killed and reaped when its run ends; the
// namespace is deleted at exit.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/health"
)

type config struct {
	trials     int
	members    int
	fpDuration time.Duration
	pauses     int
	pause      time.Duration
	hogs       int
	hogNice    int
	netns      bool
	timeout    time.Duration
	node       health.NodeConfig
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "member" {
		os.Exit(memberMain(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "hog" {
		runtime.GOMAXPROCS(1)
		for {
		}
	}
	cfg := config{node: health.DefaultNodeConfig()}
	flag.IntVar(&cfg.trials, "trials", 20, "clusters formed and broken per blackhole benchmark")
	flag.IntVar(&cfg.members, "members", 4, "members per cluster, the victim included")
	flag.DurationVar(&cfg.fpDuration, "fp-duration", 5*time.Minute, "length of the false-positive run (0 skips it)")
	flag.IntVar(&cfg.pauses, "pauses", 30, "members frozen and continued in the pause benchmark (0 skips it)")
	flag.DurationVar(&cfg.pause, "pause", 300*time.Millisecond, "how long each is frozen")
	flag.IntVar(&cfg.hogs, "hogs", 2*runtime.NumCPU(), "CPU-spinning processes during the false-positive run")
	flag.IntVar(&cfg.hogNice, "hog-nice", 0, "nice value of the hogs: 0 competes with the members as equals; 10 is workers run below their agent")
	flag.BoolVar(&cfg.netns, "netns", true, "also cut a link between network namespaces (needs root and iproute2)")
	flag.DurationVar(&cfg.timeout, "timeout", 15*time.Second, "bound on forming a cluster and on each detection")
	timerFlags(flag.CommandLine, &cfg.node)
	flag.Parse()
	if cfg.members < 2 || cfg.trials < 1 {
		fmt.Fprintln(os.Stderr, "livenessbench: need -members ≥ 2 and -trials ≥ 1")
		os.Exit(2)
	}
	if err := run(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "livenessbench:", err)
		os.Exit(1)
	}
}

// timerFlags binds the detection timers to flags, defaulting to c's.
func timerFlags(fs *flag.FlagSet, c *health.NodeConfig) {
	fs.DurationVar(&c.ProbeInterval, "probe-interval", c.ProbeInterval, "NodeConfig.ProbeInterval")
	fs.DurationVar(&c.ProbeTimeout, "probe-timeout", c.ProbeTimeout, "NodeConfig.ProbeTimeout")
	fs.IntVar(&c.SuspicionMult, "suspicion-mult", c.SuspicionMult, "NodeConfig.SuspicionMult")
	fs.IntVar(&c.SuspicionMaxTimeoutMult, "suspicion-max-mult", c.SuspicionMaxTimeoutMult, "NodeConfig.SuspicionMaxTimeoutMult")
	fs.DurationVar(&c.GossipInterval, "gossip-interval", c.GossipInterval, "NodeConfig.GossipInterval")
	fs.IntVar(&c.IndirectChecks, "indirect-checks", c.IndirectChecks, "NodeConfig.IndirectChecks")
	fs.IntVar(&c.RetransmitMult, "retransmit-mult", c.RetransmitMult, "NodeConfig.RetransmitMult")
}

func timerArgs(c health.NodeConfig) []string {
	return []string{
		"-probe-interval=" + c.ProbeInterval.String(), "-probe-timeout=" + c.ProbeTimeout.String(),
		"-suspicion-mult=" + strconv.Itoa(c.SuspicionMult), "-suspicion-max-mult=" + strconv.Itoa(c.SuspicionMaxTimeoutMult),
		"-gossip-interval=" + c.GossipInterval.String(),
		"-indirect-checks=" + strconv.Itoa(c.IndirectChecks), "-retransmit-mult=" + strconv.Itoa(c.RetransmitMult),
	}
}

// row is one blackhole benchmark: per trial, the latency to the first and
// to the last survivor's verdict; note says why it was skipped.
type row struct {
	name        string
	first, last []time.Duration
	note        string
}

func run(cfg config) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	b := &bench{cfg: cfg, self: self}
	var rows []row

	r, err := b.blackhole(ctx, "SIGSTOP", nil)
	if err != nil {
		return fmt.Errorf("freeze: %w", err)
	}
	rows = append(rows, r)

	if cfg.netns {
		ns, err := newNetns()
		if err != nil {
			rows = append(rows, row{name: "link cut", note: "skipped: " + err.Error()})
		} else {
			r, err := b.blackhole(ctx, "link cut", ns)
			ns.delete()
			if err != nil {
				return fmt.Errorf("link cut: %w", err)
			}
			rows = append(rows, r)
		}
	}

	var pr *pauseResult
	if cfg.pauses > 0 {
		if pr, err = b.pauses(ctx); err != nil {
			return fmt.Errorf("pauses: %w", err)
		}
	}

	var fp *fpResult
	if cfg.fpDuration > 0 {
		if fp, err = b.falsePositives(ctx); err != nil {
			return fmt.Errorf("false positives: %w", err)
		}
	}
	printTable(cfg, rows, pr, fp)
	return nil
}

type bench struct {
	cfg  config
	self string
}

// blackhole runs cfg.trials trials: form a cluster, cut the victim off
// (SIGSTOP, or its link when ns is set), time the survivors' verdicts.
func (b *bench) blackhole(ctx context.Context, name string, ns *netns) (row, error) {
	r := row{name: name}
	for trial := range b.cfg.trials {
		first, last, err := b.trial(ctx, trial, ns)
		if err != nil {
			return r, fmt.Errorf("trial %d: %w", trial, err)
		}
		r.first = append(r.first, first)
		r.last = append(r.last, last)
	}
	return r, nil
}

func (b *bench) trial(ctx context.Context, trial int, ns *netns) (first, last time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, 3*b.cfg.timeout)
	defer cancel()
	bind := "127.0.0.1"
	if ns != nil {
		bind = ns.hostAddr
		if err := ns.link(true); err != nil {
			return 0, 0, err
		}
	}
	n := b.cfg.members
	var ms []*memberProc
	defer func() {
		for _, m := range ms {
			m.kill()
		}
	}()
	var seeds []string
	for i := range n {
		name := fmt.Sprintf("t%d-m%d", trial, i)
		var m *memberProc
		var err error
		if i == n-1 && ns != nil {
			m, err = b.startMember(ctx, name, ns.nsAddr, seeds, []string{"ip", "netns", "exec", ns.name})
		} else {
			m, err = b.startMember(ctx, name, bind, seeds, nil)
		}
		if err != nil {
			return 0, 0, err
		}
		ms = append(ms, m)
		seeds = append(seeds, m.addr)
	}
	for _, m := range ms {
		for _, peer := range ms {
			if peer != m {
				if _, err := m.wait(ctx, health.NodeJoined, peer.name); err != nil {
					return 0, 0, fmt.Errorf("forming: %w", err)
				}
			}
		}
	}
	victim, survivors := ms[n-1], ms[:n-1]
	cut := time.Now()
	if ns != nil {
		err = ns.link(false)
	} else {
		err = victim.cmd.Process.Signal(syscall.SIGSTOP)
	}
	if err != nil {
		return 0, 0, err
	}
	first = time.Duration(math.MaxInt64)
	for _, m := range survivors {
		ev, err := m.wait(ctx, health.NodeDead, victim.name)
		if err != nil {
			return 0, 0, err
		}
		d := ev.SeenAt.Sub(cut)
		first, last = min(first, d), max(last, d)
	}
	for _, m := range survivors {
		if bad := m.failures(victim.name); len(bad) > 0 {
			return 0, 0, fmt.Errorf("false positive during the trial: %v", bad)
		}
	}
	return first, last, nil
}

type fpResult struct {
	events  []health.Event
	refuted int // suspicions the suspects refuted: near misses
	members int
	hogs    int
	nice    int
	dur     time.Duration
	load    string
}

// falsePositives runs cfg.members members beside cfg.hogs CPU hogs for
// cfg.fpDuration and collects every death or departure they report.
func (b *bench) falsePositives(ctx context.Context) (*fpResult, error) {
	res := &fpResult{members: b.cfg.members, hogs: b.cfg.hogs, nice: b.cfg.hogNice, dur: b.cfg.fpDuration}
	var hogs []*exec.Cmd
	defer func() {
		for _, h := range hogs {
			h.Process.Kill()
			h.Wait()
		}
	}()
	for range b.cfg.hogs {
		h := exec.Command(b.self, "hog")
		h.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := h.Start(); err != nil {
			return nil, err
		}
		hogs = append(hogs, h)
		if err := syscall.Setpriority(syscall.PRIO_PROCESS, h.Process.Pid, b.cfg.hogNice); err != nil {
			return nil, fmt.Errorf("nice %d: %w", b.cfg.hogNice, err)
		}
	}
	ms, err := b.formCluster(ctx, "fp")
	defer killAll(ms)
	if err != nil {
		return nil, fmt.Errorf("forming under load: %w", err)
	}
	fmt.Fprintf(os.Stderr, "false-positive run: %d members, %d hogs, %v\n", len(ms), len(hogs), b.cfg.fpDuration)
	select {
	case <-time.After(b.cfg.fpDuration):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if l, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.load = strings.Join(strings.Fields(string(l))[:3], " ")
	}
	res.events, res.refuted = verdicts(ms)
	return res, nil
}

// verdicts returns the deaths and departures members reported and the
// number of suspicions they refuted.
func verdicts(ms []*memberProc) (events []health.Event, refuted int) {
	for _, m := range ms {
		events = append(events, m.failures("")...)
		m.mu.Lock()
		refuted += m.refuted
		m.mu.Unlock()
	}
	return events, refuted
}

type pauseResult struct {
	pauses  int
	pause   time.Duration
	refuted int
	events  []health.Event
}

func (b *bench) pauses(ctx context.Context) (*pauseResult, error) {
	ms, err := b.formCluster(ctx, "pause")
	defer killAll(ms)
	if err != nil {
		return nil, err
	}
	for i := range b.cfg.pauses {
		victim := ms[i%len(ms)]
		if err := victim.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			return nil, err
		}
		time.Sleep(b.cfg.pause)
		if err := victim.cmd.Process.Signal(syscall.SIGCONT); err != nil {
			return nil, err
		}
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	res := &pauseResult{pauses: b.cfg.pauses, pause: b.cfg.pause}
	res.events, res.refuted = verdicts(ms)
	return res, nil
}

// formCluster starts cfg.members members on loopback, each joining those
// before it, and waits until each has seen every other join.
func (b *bench) formCluster(ctx context.Context, prefix string) ([]*memberProc, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*b.cfg.timeout)
	defer cancel()
	var ms []*memberProc
	var seeds []string
	for i := range b.cfg.members {
		m, err := b.startMember(ctx, fmt.Sprintf("%s-m%d", prefix, i), "127.0.0.1", seeds, nil)
		if err != nil {
			return ms, err
		}
		ms = append(ms, m)
		seeds = append(seeds, m.addr)
	}
	for _, m := range ms {
		for _, peer := range ms {
			if peer != m {
				if _, err := m.wait(ctx, health.NodeJoined, peer.name); err != nil {
					return ms, err
				}
			}
		}
	}
	return ms, nil
}

func killAll(ms []*memberProc) {
	for _, m := range ms {
		m.kill()
	}
}

// memberProc is a member process (memberMain) and the events it printed.
type memberProc struct {
	name string
	addr string
	cmd  *exec.Cmd

	mu      sync.Mutex
	events  []health.Event
	refuted int           // suspicions of itself it refuted
	grew    chan struct{} // capacity 1: events grew
	exited  chan struct{} // its output ended
}

func (b *bench) startMember(ctx context.Context, name, bind string, seeds []string, wrap []string) (*memberProc, error) {
	args := append(slices.Clone(wrap), b.self, "member", "-name", name, "-bind", bind, "-seeds", strings.Join(seeds, ","))
	args = append(args, timerArgs(b.cfg.node)...)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	m := &memberProc{name: name, cmd: cmd, grew: make(chan struct{}, 1), exited: make(chan struct{})}
	addr := make(chan string, 1)
	go m.read(out, addr)
	select {
	case m.addr = <-addr:
		return m, nil
	case <-m.exited:
		m.kill()
		return nil, fmt.Errorf("member %s exited before it joined", name)
	case <-ctx.Done():
		m.kill()
		return nil, fmt.Errorf("member %s did not join: %w", name, ctx.Err())
	}
}

// read parses the member's output: "addr A" once, then event lines.
func (m *memberProc) read(out io.Reader, addr chan<- string) {
	defer close(m.exited)
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		if a, ok := strings.CutPrefix(line, "addr "); ok {
			addr <- a
			continue
		}
		if line == "refuted" {
			m.mu.Lock()
			m.refuted++
			m.mu.Unlock()
			continue
		}
		ev, err := parseEvent(line)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %s\n", m.name, line)
			continue
		}
		m.mu.Lock()
		m.events = append(m.events, ev)
		m.mu.Unlock()
		select {
		case m.grew <- struct{}{}:
		default:
		}
	}
}

// wait returns the member's first event of kind about node.
func (m *memberProc) wait(ctx context.Context, kind health.EventKind, node string) (health.Event, error) {
	for {
		m.mu.Lock()
		i := slices.IndexFunc(m.events, func(ev health.Event) bool { return ev.Kind == kind && ev.Node == node })
		var ev health.Event
		if i >= 0 {
			ev = m.events[i]
		}
		m.mu.Unlock()
		if i >= 0 {
			return ev, nil
		}
		select {
		case <-m.grew:
		case <-m.exited:
			return ev, fmt.Errorf("member %s exited", m.name)
		case <-ctx.Done():
			return ev, fmt.Errorf("%s: no %s about %s: %w", m.name, kind, node, ctx.Err())
		}
	}
}

// failures returns the deaths and departures the member reported, except
// about except.
func (m *memberProc) failures(except string) []health.Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []health.Event
	for _, ev := range m.events {
		if ev.Kind != health.NodeJoined && ev.Node != except {
			out = append(out, ev)
		}
	}
	return out
}

func (m *memberProc) kill() {
	m.cmd.Process.Kill()
	<-m.exited
	m.cmd.Wait()
}

// memberMain is a member process: it joins the seeds, prints "addr A",
// then an event line per event, and "refuted" whenever it refutes a
// suspicion of itself, until killed.
func memberMain(args []string) int {
	fs := flag.NewFlagSet("member", flag.ExitOnError)
	cfg := health.DefaultNodeConfig()
	fs.StringVar(&cfg.Name, "name", "", "member name")
	fs.StringVar(&cfg.BindAddr, "bind", "127.0.0.1", "bind address")
	seeds := fs.String("seeds", "", "comma-separated gossip addresses to join")
	timerFlags(fs, &cfg)
	fs.Parse(args)
	cfg.Cluster = "livenessbench"
	var out sync.Mutex
	// memberlist logs each refutation (at debug level, through the Logger).
	cfg.Logger = zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zapcore.EncoderConfig{}), zapcore.AddSync(io.Discard), zap.DebugLevel),
		zap.Hooks(func(e zapcore.Entry) error {
			if strings.HasPrefix(e.Message, "Refuting a suspect message") || strings.HasPrefix(e.Message, "Refuting a dead message") {
				out.Lock()
				fmt.Println("refuted")
				out.Unlock()
			}
			return nil
		}))
	n, err := health.StartNodes(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer n.Close()
	if *seeds != "" {
		if _, err := n.Join(context.Background(), strings.Split(*seeds, ",")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	fmt.Println("addr", n.Addr())
	events := make(chan health.Event, 64)
	go n.Run(context.Background(), events)
	for ev := range events {
		out.Lock()
		fmt.Println(formatEvent(ev))
		out.Unlock()
	}
	return 0
}

func formatEvent(ev health.Event) string {
	return fmt.Sprintf("event %s %s %d %s", ev.Kind, ev.Node, ev.SeenAt.UnixNano(), ev.Reason)
}

func parseEvent(line string) (health.Event, error) {
	f := strings.SplitN(line, " ", 5)
	if len(f) < 5 || f[0] != "event" {
		return health.Event{}, errors.New("not an event line")
	}
	ns, err := strconv.ParseInt(f[3], 10, 64)
	if err != nil {
		return health.Event{}, err
	}
	return health.Event{Kind: health.EventKind(f[1]), Node: f[2], SeenAt: time.Unix(0, ns), Reason: f[4]}, nil
}

// netns is a network namespace joined to the root one by a veth pair:
// hostAddr on the root side, nsAddr inside.
type netns struct {
	name, hostDev, nsDev string
	hostAddr, nsAddr     string
}

func newNetns() (*netns, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("needs root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, errors.New("needs iproute2's ip")
	}
	id := os.Getpid() % 100000
	ns := &netns{
		name:    fmt.Sprintf("gorun-lb-%d", id),
		hostDev: fmt.Sprintf("glb%dh", id), nsDev: fmt.Sprintf("glb%dn", id),
		hostAddr: "10.213.0.1", nsAddr: "10.213.0.2",
	}
	steps := [][]string{
		{"netns", "add", ns.name},
		{"link", "add", ns.hostDev, "type", "veth", "peer", "name", ns.nsDev},
		{"link", "set", ns.nsDev, "netns", ns.name},
		{"addr", "add", ns.hostAddr + "/30", "dev", ns.hostDev},
		{"link", "set", ns.hostDev, "up"},
		{"-n", ns.name, "addr", "add", ns.nsAddr + "/30", "dev", ns.nsDev},
		{"-n", ns.name, "link", "set", "lo", "up"},
		{"-n", ns.name, "link", "set", ns.nsDev, "up"},
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			ns.delete()
			return nil, err
		}
	}
	return ns, nil
}

// link sets the namespace's end of the pair up or down: down, packets the
// root side sends into the pair are dropped without a word.
func (ns *netns) link(up bool) error {
	return ipCmd("-n", ns.name, "link", "set", ns.nsDev, map[bool]string{true: "up", false: "down"}[up])
}

// delete removes the namespace and with it the pair.
func (ns *netns) delete() {
	ipCmd("link", "del", ns.hostDev)
	ipCmd("netns", "del", ns.name)
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func printTable(cfg config, rows []row, pr *pauseResult, fp *fpResult) {
	c := cfg.node
	fmt.Printf("Node liveness (%d cores, %s): %d members; ProbeInterval %v, ProbeTimeout %v, SuspicionMult %d "+
		"(suspicion %v), GossipInterval %v; model worst case %v\n\n",
		runtime.NumCPU(), time.Now().UTC().Format("2006-01-02"), cfg.members, c.ProbeInterval, c.ProbeTimeout,
		c.SuspicionMult, c.SuspicionTimeout(cfg.members), c.GossipInterval, c.DetectionBound(cfg.members))
	fmt.Println("| blackhole → declared dead | trials | first survivor: median | p90 | max | last survivor: median | p90 | max | ≤ 1 s (last) |")
	fmt.Println("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range rows {
		if r.note != "" {
			fmt.Printf("| %s | %s | | | | | | | |\n", r.name, r.note)
			continue
		}
		within := 0
		for _, d := range r.last {
			if d <= time.Second {
				within++
			}
		}
		fmt.Printf("| %s | %d | %s | %s | %s | %s | %s | %s | %d/%d |\n", r.name, len(r.first),
			ms(median(r.first)), ms(stats.Quantile(r.first, 0.9)), ms(slices.Max(r.first)),
			ms(median(r.last)), ms(stats.Quantile(r.last, 0.9)), ms(slices.Max(r.last)), within, len(r.last))
	}
	if pr != nil {
		fmt.Println()
		fmt.Println("| pauses (frozen, then continued) | members | pause | suspicions refuted | deaths or departures reported |")
		fmt.Println("|---|---:|---:|---:|---:|")
		fmt.Printf("| %d | %d | %v | %d | %d |\n", pr.pauses, cfg.members, pr.pause, pr.refuted, len(pr.events))
		for _, ev := range pr.events {
			fmt.Println("  false positive:", ev)
		}
	}
	if fp != nil {
		fmt.Println()
		fmt.Println("| false-positive run | members | CPU hogs (nice) | load (1/5/15 min) | suspicions refuted | deaths or departures reported |")
		fmt.Println("|---|---:|---:|---|---:|---:|")
		fmt.Printf("| %v | %d | %d (%d) | %s | %d | %d |\n", fp.dur, fp.members, fp.hogs, fp.nice, fp.load, fp.refuted, len(fp.events))
		for _, ev := range fp.events {
			fmt.Println("  false positive:", ev)
		}
	}
}

func ms(d time.Duration) string {
	return fmt.Sprintf("%d ms", d.Round(time.Millisecond).Milliseconds())
}

func median(v []time.Duration) time.Duration {
	f := make([]float64, len(v))
	for i, d := range v {
		f[i] = float64(d)
	}
	return time.Duration(stats.Median(f))
}
