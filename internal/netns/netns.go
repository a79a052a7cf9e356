// Package netns builds a multi-host test bed on one Linux machine: every
// host is a network namespace with its own eth0, IP and loopback, the hosts
// share one Ethernet segment (a bridge), and the root namespace reaches them
// through a gateway address on that segment, so a test can run etcd or a
// store in the root namespace and agents "on" the hosts.
//
// Bed N has the N-th /24 of 198.18.0.0/15 and these parts:
//
//	root namespace     gorun<N>gw: Gateway (.1)
//	                       │ veth
//	gorun-b<N>-sw      gw ── br0 ── h0, h1, …  (the bridge and its ports)
//	                                │ veth, one per host
//	gorun-b<N>-h<I>    eth0: Hosts[I].IP (.I+2); lo; default route via Gateway
//
// The bridge lives in a namespace of its own rather than in the root
// namespace: netfilter hooks and the bridge-nf-call-iptables switches are
// per namespace, so frames bridged between hosts never meet the root
// namespace's firewall (Docker's FORWARD drop policy, br_netfilter), and the
// bed works the same on a laptop and on a CI runner. (Traffic between the
// root namespace and a host is the root's own and passes its INPUT and
// OUTPUT chains, as on any machine.)
//
// Blackhole disables the host's port on the bridge: the bridge then drops
// every frame from and to the host without a word — no RST, no ICMP, no
// carrier change, no error for a sender — so connections stall as they do
// when a real host's cable is cut. (tc drop filters would do the same but
// need cls_matchall and act_gact, which not every kernel has; the bridge
// port state needs nothing beyond the bridge.)
//
// A test that needs a store reachable from every host runs it in the root
// namespace on Gateway (internal/etcdtest's Options.ListenIP does so for
// etcd), and the programs that play the hosts with Host.Command.
//
// Tests that need a bed skip with one line when they cannot have one (not
// root, no iproute2, no network namespaces) and fail instead when
// GORUN_CI=1. Every process in a host and every namespace and link of a bed
// is removed by the test's cleanup, whether the test passed or failed; beds
// left behind by a killed test binary are swept by the next New.
//
// Programs that are not tests (benchmarks) use Available and Create, and
// Close the bed themselves.
package netns

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Options configure a bed. The zero value is a bed with the defaults.
type Options struct {
	// KillTimeout bounds how long Kill (and the cleanup) waits for a
	// host's processes to be gone after SIGKILL: a process in
	// uninterruptible sleep may take a while. Default 10 s.
	KillTimeout time.Duration
}

// DefaultKillTimeout is Options.KillTimeout's default.
const DefaultKillTimeout = 10 * time.Second

func (o Options) withDefaults() Options {
	if o.KillTimeout == 0 {
		o.KillTimeout = DefaultKillTimeout
	}
	return o
}

// MaxHosts is the most hosts one bed holds: a /24 less the network,
// gateway and broadcast addresses.
const MaxHosts = 253

// Bed is a set of hosts on one bridge. Its fields are read-only.
type Bed struct {
	// Index tells beds that exist at the same time apart; names and the
	// subnet derive from it.
	Index int
	// Subnet holds the gateway and every host.
	Subnet netip.Prefix
	// Gateway is the root namespace's address on the bed: a process in
	// the root namespace that listens on it is reachable from every host.
	Gateway netip.Addr
	// GatewayLink is the root namespace's interface that carries Gateway.
	GatewayLink string
	// Hosts are the bed's hosts, in order.
	Hosts []*Host

	opts  Options
	tools tools
	sw    string // the switch namespace, which holds the bridge
	state string // the state file that marks the bed as owned

	closeOnce sync.Once
	closeErr  error
}

// Host is one network namespace of a bed. Its fields are read-only.
type Host struct {
	// Name is the host's network namespace, as `ip netns` names it.
	Name string
	// IP is the host's address on eth0, its only interface besides lo.
	IP netip.Addr

	bed  *Bed
	port string // the host's bridge port, in the switch namespace
}

// ErrStillRunning: processes were still in a namespace when Kill's time
// ran out.
var ErrStillRunning = errors.New("netns: processes still running")

// Create builds a bed of hosts hosts, for a program that is not a test (a
// benchmark); tests use New. The caller must Close the bed, whatever
// happens next: its namespaces outlive the process otherwise, until the
// next Create or New on the machine sweeps them. When this machine cannot
// hold a bed, the error matches ErrUnavailable and says why (Available).
// A bed that fails half-way is removed before Create returns.
func Create(hosts int, opts Options) (*Bed, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	if hosts < 1 || hosts > MaxHosts {
		return nil, fmt.Errorf("netns: %d hosts; a bed holds 1 to %d", hosts, MaxHosts)
	}
	b := &Bed{opts: opts.withDefaults(), tools: found}
	idx, state, err := allocate(found.ip)
	if err != nil {
		return nil, fmt.Errorf("netns: %w", err)
	}
	b.Index, b.state = idx, state
	b.Subnet = subnet(idx)
	b.Gateway = b.Subnet.Addr().Next()
	b.GatewayLink = gatewayLink(idx)
	b.sw = switchNS(idx)
	addr := b.Gateway
	for i := range hosts {
		addr = addr.Next()
		b.Hosts = append(b.Hosts, &Host{
			Name: hostNS(idx, i),
			IP:   addr,
			bed:  b,
			port: fmt.Sprintf("h%d", i),
		})
	}
	if err := b.build(); err != nil {
		// Close removes whatever part of the bed exists.
		return nil, errors.Join(fmt.Errorf("netns: build bed %d: %w", idx, err), b.Close())
	}
	return b, nil
}

// New builds a bed of hosts hosts for a test, or skips the test when this
// machine cannot (fails it when GORUN_CI=1). The test's cleanup kills
// every process in the hosts and removes the bed.
func New(t testing.TB, hosts int, opts Options) *Bed {
	t.Helper()
	Require(t)
	b, err := Create(hosts, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("netns: cleanup: %v", err)
		}
	})
	return b
}

// build creates the namespaces, links and addresses: one ip batch in the
// root namespace, one in the switch and one in each host.
func (b *Bed) build() error {
	bits := b.Subnet.Bits()
	// No IPv6 link-local addresses (where the kernel has IPv6): a host's
	// only addresses are its IP and loopback's, and nothing chatters on
	// the segment (router solicitations, DAD) that a test did not send.
	noV6 := func(dev string) []string { return nil }
	if _, err := os.Stat("/proc/sys/net/ipv6"); err == nil {
		noV6 = func(dev string) []string { return []string{"link set dev " + dev + " addrgenmode none"} }
	}
	var root, sw []string
	root = append(root, "netns add "+b.sw)
	for _, h := range b.Hosts {
		root = append(root, "netns add "+h.Name)
	}
	root = append(root, fmt.Sprintf("link add name %s type veth peer name gw netns %s", b.GatewayLink, b.sw))
	root = append(root, noV6(b.GatewayLink)...)
	root = append(root,
		fmt.Sprintf("addr add %s/%d dev %s", b.Gateway, bits, b.GatewayLink),
		"link set dev "+b.GatewayLink+" up",
	)
	// STP stays off (the default), so ports forward as soon as they are up.
	sw = append(sw, "link add name br0 type bridge")
	sw = append(sw, noV6("br0")...)
	sw = append(sw, noV6("gw")...)
	sw = append(sw, "link set dev gw master br0 up")
	for _, h := range b.Hosts {
		// Created in place: eth0 never exists in the root namespace, where
		// the name may be taken.
		root = append(root, fmt.Sprintf("link add name eth0 netns %s type veth peer name %s netns %s", h.Name, h.port, b.sw))
		sw = append(sw, noV6(h.port)...)
		sw = append(sw, fmt.Sprintf("link set dev %s master br0 up", h.port))
	}
	sw = append(sw, "link set dev br0 up")
	if err := b.ipBatch("", root); err != nil {
		return err
	}
	if err := b.ipBatch(b.sw, sw); err != nil {
		return err
	}
	for _, h := range b.Hosts {
		cmds := []string{"link set dev lo up"}
		cmds = append(cmds, noV6("eth0")...)
		cmds = append(cmds,
			fmt.Sprintf("addr add %s/%d dev eth0", h.IP, bits),
			"link set dev eth0 up",
			"route add default via "+b.Gateway.String(),
		)
		if err := b.ipBatch(h.Name, cmds); err != nil {
			return err
		}
	}
	return nil
}

// ipBatch runs ip commands in one ip process, in namespace ns ("" for the
// root namespace).
func (b *Bed) ipBatch(ns string, cmds []string) error {
	return ipBatch(b.tools.ip, ns, cmds)
}

func ipBatch(ipPath, ns string, cmds []string) error {
	args := []string{}
	if ns != "" {
		args = append(args, "-n", ns)
	}
	args = append(args, "-batch", "-")
	return run(ipPath, args, strings.Join(cmds, "\n")+"\n")
}

// run runs a short-lived tool with stdin and returns its output as the
// error when it fails.
func run(path string, args []string, stdin string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", filepath.Base(path), strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Close kills every process in the bed's namespaces and removes the
// namespaces, links and the bridge. The test's cleanup calls it; a test may
// call it earlier. Calls after the first return the first one's result.
func (b *Bed) Close() error {
	b.closeOnce.Do(func() { b.closeErr = teardown(b.tools.ip, b.namespaces(), b.GatewayLink, b.state, b.opts.KillTimeout) })
	return b.closeErr
}

// namespaces returns the names of every namespace of the bed.
func (b *Bed) namespaces() []string {
	ns := []string{b.sw}
	for _, h := range b.Hosts {
		ns = append(ns, h.Name)
	}
	return ns
}

// teardown removes a bed, or what there is of one: it is Close's body and
// the sweeper's. Missing parts are not errors.
func teardown(ipPath string, namespaces []string, gwLink, state string, killTimeout time.Duration) error {
	var paths []string
	for _, ns := range namespaces {
		if _, err := os.Stat(nsPath(ns)); err == nil {
			paths = append(paths, nsPath(ns))
		}
	}
	// Processes first: a namespace that still has one outlives `netns del`
	// (and keeps its links) until the process dies.
	err := killAll(paths, killTimeout)
	var cmds []string
	if _, serr := os.Stat(filepath.Join("/sys/class/net", gwLink)); serr == nil {
		// Deleting the root end deletes the pair at once; the rest go with
		// their namespaces.
		cmds = append(cmds, "link del dev "+gwLink)
	}
	for _, p := range paths {
		cmds = append(cmds, "netns del "+filepath.Base(p))
	}
	if len(cmds) > 0 {
		err = errors.Join(err, run(ipPath, []string{"-force", "-batch", "-"}, strings.Join(cmds, "\n")+"\n"))
	}
	if err == nil {
		if rerr := os.Remove(state); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = rerr
		}
	}
	return err
}

// nsPath is where `ip netns` keeps a namespace's handle.
func nsPath(name string) string { return filepath.Join(netnsDir, name) }

const netnsDir = "/run/netns"

// Command returns a command that runs name inside the host's network
// namespace (through `ip netns exec`, which sets the namespace and then
// execs name: the started process's PID is name's own, so a test can signal
// it). Inside, the program sees the host's eth0 and lo, and /sys/class/net
// shows them. The process enters the namespace a moment after Start
// returns (ip's setns comes first): PIDs and Kill see it from then on. It
// gets Pdeathsig=SIGKILL, so it dies with the test binary even if no
// cleanup runs; replace SysProcAttr to change that.
func (h *Host) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, h.bed.tools.ip, append([]string{"netns", "exec", h.Name, name}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// PIDs returns the processes in the host's network namespace.
func (h *Host) PIDs() ([]int, error) { return pidsIn(nsPath(h.Name)) }

// Kill sends SIGKILL to every process in the host's namespace, again until
// none is left (a process may fork while it is being killed), and returns
// once they are gone, or ErrStillRunning after Options.KillTimeout. Killed
// children of the test stay zombies until the test waits for them.
func (h *Host) Kill() error { return killAll([]string{nsPath(h.Name)}, h.bed.opts.KillTimeout) }

// Blackhole cuts the host's link: from now on the bridge silently drops
// every frame from and to the host, in both directions, and connections
// through it stall rather than fail. Loopback traffic inside the host is
// untouched.
func (h *Host) Blackhole() error { return h.setPortState(portDisabled) }

// Heal restores a link cut by Blackhole. Connections that stalled carry on
// at their next retransmission.
func (h *Host) Heal() error { return h.setPortState(portForwarding) }

// Bridge port states (IFLA_BRPORT_STATE, as in the kernel's br_private.h).
const (
	portDisabled   = 0
	portForwarding = 3
)

// setPortState sets the state of the host's bridge port. It takes the
// bridge tool: `ip link set … type bridge_slave state N` is accepted by
// iproute2 6.1 and silently has no effect.
func (h *Host) setPortState(state int) error {
	return run(h.bed.tools.bridge, []string{"-n", h.bed.sw, "link", "set", "dev", h.port, "state", strconv.Itoa(state)}, "")
}
