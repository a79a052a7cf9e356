package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/procs"
	"github.com/gorunhq/gorun/internal/netns"
)

// The multi-host mode (-hosts 2 or more) runs every agent in a host of a
// network-namespace bed (internal/netns): each host has its own address
// and loopback, the hosts share a bridge, and a host can be cut off.

// Faults (-fault).
const (
	faultKill      = "kill"      // SIGKILL rank -victim
	faultBlackhole = "blackhole" // cut the link of the host that runs it
	faultNode      = "node"      // SIGKILL the agent of that host: its workers die with it
)

// hostLost reports whether fault takes a whole host out (its agent and
// every rank on it), not one rank.
func hostLost(fault string) bool { return fault == faultBlackhole || fault == faultNode }

// Rendezvous backends of several hosts (-backend).
const (
	backendC10d = "c10d" // the store hosted by host 0's agent
	backendEtcd = "etcd" // an etcd member in the root namespace, on the bed's gateway
)

// etcdStartTimeout bounds the wait for the etcd member to serve.
const etcdStartTimeout = 30 * time.Second

// setUpHosts builds the bed (and, with -backend etcd, starts etcd on its
// gateway) and fills in what the agents' command lines need. tearDown
// stops etcd and removes the bed, every process in it included.
func (c *config) setUpHosts(ctx context.Context) (tearDown func() error, err error) {
	if c.backend == backendEtcd {
		// Before the bed: a missing binary is a usage error, not a bed
		// to build and remove.
		if c.etcd, err = exec.LookPath(c.etcd); err != nil {
			return nil, fmt.Errorf("-backend etcd: %w (install Debian's etcd-server, or name the binary with -etcd)", err)
		}
	}
	n := c.hosts
	if hostLost(c.fault) {
		n++ // a host for the heal rows' spare (config.hasSpare)
	}
	bed, err := netns.Create(n, netns.Options{})
	if err != nil {
		return nil, fmt.Errorf("-hosts %d: %w", c.hosts, err)
	}
	c.bed = bed
	var hosts strings.Builder
	hosts.WriteString("127.0.0.1 localhost\n::1 localhost\n")
	for _, h := range bed.Hosts {
		c.hostIPs = append(c.hostIPs, h.IP.String())
		c.hostNames = append(c.hostNames, h.Name)
		fmt.Fprintf(&hosts, "%s %s\n", h.IP, h.Name)
	}
	c.hostsFile = filepath.Join(c.tmp, "hosts")
	if err := os.WriteFile(c.hostsFile, []byte(hosts.String()), 0o644); err != nil {
		return nil, errors.Join(err, bed.Close())
	}
	if c.backend != backendEtcd {
		return bed.Close, nil
	}
	e, err := startEtcd(ctx, c.etcd, bed.Gateway.String(), filepath.Join(c.tmp, "etcd"))
	if err != nil {
		return nil, errors.Join(err, bed.Close())
	}
	c.etcdEndpoint = e.endpoint
	c.spare = append(c.spare, e.cmd.Process.Pid)
	return func() error { return errors.Join(e.stop(), bed.Close()) }, nil
}

// etcdServer is one etcd member that the benchmark runs.
type etcdServer struct {
	cmd      *exec.Cmd
	done     chan struct{} // closed when cmd has been waited for
	dir      string        // its data directory and log
	endpoint string        // host:port of its client URL
}

// startEtcd starts a one-member etcd cluster listening on ip (both URLs)
// with its data and log under dir, and waits until it serves.
func startEtcd(ctx context.Context, bin, ip, dir string) (*etcdServer, error) {
	ports, err := freePorts(ip, 2)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	client := "http://" + net.JoinHostPort(ip, strconv.Itoa(ports[0]))
	peer := "http://" + net.JoinHostPort(ip, strconv.Itoa(ports[1]))
	log, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return nil, err
	}
	defer log.Close() // the child holds its own descriptor
	cmd := exec.Command(bin,
		"--name", "ftbench",
		"--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "ftbench="+peer, "--initial-cluster-state", "new",
		// etcd grants no lease shorter than 1.5 election timeouts (3.4:
		// minTTL, rounded up to whole seconds): with its default of 1 s
		// a lease_ttl=1 lease would last 2 s. These (internal/etcdtest's)
		// make it 0.75 s.
		"--heartbeat-interval", "50", "--election-timeout", "500",
		"--logger", "zap", "--log-outputs", "stderr")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start etcd: %w", err)
	}
	e := &etcdServer{cmd: cmd, done: make(chan struct{}), dir: dir, endpoint: strings.TrimPrefix(client, "http://")}
	go func() { cmd.Wait(); close(e.done) }()
	if err := e.waitReady(ctx); err != nil {
		return nil, errors.Join(err, e.stop())
	}
	return e, nil
}

// waitReady polls etcd's /health until it reports a healthy member.
func (e *etcdServer) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, etcdStartTimeout)
	defer cancel()
	url := "http://" + e.endpoint + "/health"
	// No connection outlives the wait.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(body), `"health":"true"`) {
				return nil
			}
			err = fmt.Errorf("%s: %s", resp.Status, body)
		}
		last = err
		select {
		case <-e.done:
			return fmt.Errorf("etcd exited while starting (%v); its log: %s", e.cmd.ProcessState, procs.Tail(filepath.Join(e.dir, "etcd.log"), 600))
		case <-ctx.Done():
			return fmt.Errorf("etcd did not serve within %v: %v", etcdStartTimeout, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// stop ends etcd (SIGTERM, then SIGKILL after stopGrace) and removes its
// data.
func (e *etcdServer) stop() error {
	syscall.Kill(-e.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-e.done:
	case <-time.After(stopGrace):
		syscall.Kill(-e.cmd.Process.Pid, syscall.SIGKILL)
		<-e.done
	}
	return os.RemoveAll(e.dir)
}

// freePorts returns n distinct TCP ports that were free on ip a moment ago.
func freePorts(ip string, n int) ([]int, error) {
	var ports []int
	for range n {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			return nil, err
		}
		defer ln.Close() // held until all are chosen: distinct
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
