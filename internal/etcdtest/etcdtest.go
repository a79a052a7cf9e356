// Package etcdtest runs real etcd servers (Debian's etcd-server, 3.4) for
// gorun's tests: one member or a cluster on loopback (or on an address the
// test names, such as a network-namespace bed's gateway), free ports, data
// in a temporary directory (on /dev/shm when there is one, so fsync is
// cheap), with helpers to stop, kill and restart a member and to find the
// leader.
//
// Every process it starts dies with the test: it gets Pdeathsig=SIGKILL and
// the test's cleanup kills it and removes its data. Without an etcd binary a
// test is skipped with one line saying why, except in CI (GORUN_CI=1), where
// it fails.
package etcdtest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/testutil"
)

// StartTimeout bounds how long a member (or a whole cluster) may take to
// serve after it is started.
const StartTimeout = 30 * time.Second

var (
	findOnce sync.Once
	binary   string
	findErr  string
)

func find() {
	tried := []string{}
	if p := os.Getenv("GORUN_TEST_ETCD"); p != "" {
		if _, err := os.Stat(p); err == nil {
			binary = p
			return
		}
		tried = append(tried, p)
	}
	for _, p := range []string{"etcd", "/usr/bin/etcd", "/usr/local/bin/etcd"} {
		if full, err := exec.LookPath(p); err == nil {
			binary = full
			return
		}
		tried = append(tried, p)
	}
	findErr = "no etcd binary (tried " + strings.Join(tried, ", ") + "; install Debian's etcd-server or set GORUN_TEST_ETCD)"
}

// Binary returns the etcd binary, or skips the test (fails it in CI).
func Binary(t testing.TB) string {
	t.Helper()
	findOnce.Do(find)
	if binary == "" {
		if os.Getenv("GORUN_CI") == "1" {
			t.Fatalf("etcd: %s", findErr)
		}
		t.Skipf("etcd tests skipped: %s", findErr)
	}
	return binary
}

// TLS turns on TLS for the members' client URLs.
type TLS struct {
	CertFile, KeyFile string
	// TrustedCAFile, with ClientCertAuth, makes the members require client
	// certificates signed by that CA.
	TrustedCAFile  string
	ClientCertAuth bool
}

// Options configure a cluster. The zero value is a plain-HTTP cluster on
// loopback.
type Options struct {
	TLS *TLS
	// ListenIP is the address every member listens on, for clients and
	// peers, and advertises. Default 127.0.0.1. A test bed sets it to an
	// address other network namespaces reach (see internal/netns's
	// Bed.Gateway).
	ListenIP string
	// Args are extra etcd flags for every member.
	Args []string
}

// Cluster is a set of etcd members started for one test.
type Cluster struct {
	t       testing.TB
	opts    Options
	Members []*Member
}

// Member is one etcd process. Its ports and data survive Stop, so Restart
// brings the same member back.
type Member struct {
	c         *Cluster
	Name      string
	ClientURL string // http(s)://ListenIP:port
	PeerURL   string
	DataDir   string
	initial   string // --initial-cluster
	started   bool   // started before: restart with existing state

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	log  *testutil.SyncBuffer
}

// Start starts a cluster of n members and waits until it serves. The test's
// cleanup stops every member and removes the data.
func Start(t testing.TB, n int, opts Options) *Cluster {
	t.Helper()
	Binary(t)
	root := tempRoot(t)
	c := &Cluster{t: t, opts: opts}
	scheme := "http"
	if opts.TLS != nil {
		scheme = "https"
	}
	ip := opts.ListenIP
	if ip == "" {
		ip = DefaultListenIP
	}
	ports := freePorts(t, ip, 2*n)
	var initial []string
	for i := range n {
		m := &Member{
			c:         c,
			Name:      fmt.Sprintf("m%d", i),
			ClientURL: scheme + "://" + net.JoinHostPort(ip, strconv.Itoa(ports[2*i])),
			PeerURL:   "http://" + net.JoinHostPort(ip, strconv.Itoa(ports[2*i+1])),
			DataDir:   filepath.Join(root, fmt.Sprintf("m%d", i)),
		}
		c.Members = append(c.Members, m)
		initial = append(initial, m.Name+"="+m.PeerURL)
	}
	for _, m := range c.Members {
		m.initial = strings.Join(initial, ",")
	}
	t.Cleanup(func() {
		for _, m := range c.Members {
			m.Kill()
		}
	})
	for _, m := range c.Members {
		if err := m.start(); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), StartTimeout)
	defer cancel()
	for _, m := range c.Members {
		if err := m.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// tempRoot makes a directory for the members' data, on /dev/shm if it is a
// writable tmpfs, removed by the test's cleanup.
func tempRoot(t testing.TB) string {
	t.Helper()
	for _, base := range []string{"/dev/shm", ""} {
		if base != "" {
			if st, err := os.Stat(base); err != nil || !st.IsDir() {
				continue
			}
		}
		dir, err := os.MkdirTemp(base, "gorun-etcdtest-")
		if err != nil {
			continue
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		return dir
	}
	t.Fatal("etcdtest: no temporary directory")
	return ""
}

// DefaultListenIP is where members listen unless Options.ListenIP says
// otherwise.
const DefaultListenIP = "127.0.0.1"

// FreePorts returns n distinct TCP ports that were free on 127.0.0.1 a
// moment ago.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	return freePorts(t, DefaultListenIP, n)
}

// freePorts returns n distinct TCP ports that were free on ip a moment ago.
func freePorts(t testing.TB, ip string, n int) []int {
	t.Helper()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports
}

// Endpoints returns every member's client URL.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, m := range c.Members {
		eps = append(eps, m.ClientURL)
	}
	return eps
}

// HostPorts returns every member's client address as host:port.
func (c *Cluster) HostPorts() []string {
	var eps []string
	for _, m := range c.Members {
		eps = append(eps, m.HostPort())
	}
	return eps
}

// HostPort returns the member's client address as host:port.
func (m *Member) HostPort() string {
	_, hp, _ := strings.Cut(m.ClientURL, "://")
	return hp
}

// Client returns a client of the whole cluster, closed by the test's
// cleanup. tlsCfg may be nil.
func (c *Cluster) Client(t testing.TB, tlsCfg *tls.Config) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.Endpoints(),
		DialTimeout: 5 * time.Second,
		TLS:         tlsCfg,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func (m *Member) start() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil {
		return fmt.Errorf("etcdtest: member %s already running", m.Name)
	}
	args := []string{
		"--name", m.Name,
		"--data-dir", m.DataDir,
		"--listen-client-urls", m.ClientURL,
		"--advertise-client-urls", m.ClientURL,
		"--listen-peer-urls", m.PeerURL,
		"--initial-advertise-peer-urls", m.PeerURL,
		"--initial-cluster", m.initial,
		"--initial-cluster-token", "gorun-test",
		// Fast elections, so leader-loss tests take a second, not ten.
		"--heartbeat-interval", "50",
		"--election-timeout", "500",
		"--logger", "zap",
		"--log-outputs", "stderr",
	}
	if m.started {
		args = append(args, "--initial-cluster-state", "existing")
	} else {
		args = append(args, "--initial-cluster-state", "new")
	}
	if tl := m.c.opts.TLS; tl != nil {
		args = append(args, "--cert-file", tl.CertFile, "--key-file", tl.KeyFile)
		if tl.TrustedCAFile != "" {
			args = append(args, "--trusted-ca-file", tl.TrustedCAFile)
		}
		if tl.ClientCertAuth {
			args = append(args, "--client-cert-auth")
		}
	}
	args = append(args, m.c.opts.Args...)
	cmd := exec.Command(Binary(m.c.t), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	m.log = &testutil.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = m.log, m.log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("etcdtest: start %s: %w", m.Name, err)
	}
	m.cmd, m.done, m.started = cmd, make(chan struct{}), true
	done := m.done
	go func() { cmd.Wait(); close(done) }()
	return nil
}

// WaitReady waits until the member answers a linearizable read as part of
// a cluster with a leader.
func (m *Member) WaitReady(ctx context.Context) error {
	var last error
	for {
		err := m.probe(ctx)
		if err == nil {
			return nil
		}
		last = err
		m.mu.Lock()
		done := m.done
		m.mu.Unlock()
		select {
		case <-done:
			return fmt.Errorf("etcdtest: member %s exited while starting: %v\n%s", m.Name, last, m.Log())
		case <-ctx.Done():
			return fmt.Errorf("etcdtest: member %s not ready: %v (%w)\n%s", m.Name, last, ctx.Err(), m.Log())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// probe does one Get through this member only.
func (m *Member) probe(ctx context.Context) error {
	cli, err := m.c.memberClient(m)
	if err != nil {
		return err
	}
	defer cli.Close()
	pctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = cli.Get(pctx, "gorun-etcdtest-probe")
	return err
}

// memberClient is a client of one member, for probes.
func (c *Cluster) memberClient(m *Member) (*clientv3.Client, error) {
	var tlsCfg *tls.Config
	if c.opts.TLS != nil {
		// Probes check that the member serves, not who it is.
		tlsCfg = &tls.Config{InsecureSkipVerify: true}
		if c.opts.TLS.ClientCertAuth {
			cert, err := tls.LoadX509KeyPair(c.opts.TLS.CertFile, c.opts.TLS.KeyFile)
			if err != nil {
				return nil, err
			}
			tlsCfg.Certificates = []tls.Certificate{cert}
		}
	}
	return clientv3.New(clientv3.Config{
		Endpoints:   []string{m.ClientURL},
		DialTimeout: time.Second,
		TLS:         tlsCfg,
		Logger:      zap.NewNop(),
	})
}

// Running reports whether the member's process is running.
func (m *Member) Running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cmd != nil
}

// Kill ends the member at once with SIGKILL (a crash) and waits for it.
func (m *Member) Kill() { m.stop(syscall.SIGKILL) }

// Stop ends the member with SIGTERM (a clean shutdown) and waits for it,
// killing it after 10 s.
func (m *Member) Stop() { m.stop(syscall.SIGTERM) }

func (m *Member) stop(sig syscall.Signal) {
	m.mu.Lock()
	cmd, done := m.cmd, m.done
	m.cmd = nil
	m.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
}

// Restart starts a stopped member again with its data and waits until it
// serves.
func (m *Member) Restart(ctx context.Context) error {
	if err := m.start(); err != nil {
		return err
	}
	return m.WaitReady(ctx)
}

// Log returns what the member has logged so far.
func (m *Member) Log() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.log == nil {
		return ""
	}
	return m.log.String()
}

// ErrNoLeader: no running member reports a leader.
var ErrNoLeader = errors.New("etcdtest: no leader")

// Leader returns the member that is the leader now, asking the running
// members until one answers or ctx ends.
func (c *Cluster) Leader(ctx context.Context) (*Member, error) {
	for {
		for _, m := range c.Members {
			if !m.Running() {
				continue
			}
			id, leader, err := c.status(ctx, m)
			if err != nil || leader == 0 {
				continue
			}
			if id == leader {
				return m, nil
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", ErrNoLeader, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// status returns the member's own id and the leader it knows.
func (c *Cluster) status(ctx context.Context, m *Member) (id, leader uint64, err error) {
	cli, err := c.memberClient(m)
	if err != nil {
		return 0, 0, err
	}
	defer cli.Close()
	sctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	st, err := cli.Status(sctx, m.ClientURL)
	if err != nil {
		return 0, 0, err
	}
	return st.Header.MemberId, st.Leader, nil
}
