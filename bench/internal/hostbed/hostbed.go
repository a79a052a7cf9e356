// Package hostbed is the benchmarks' bed of hosts on one machine: a
// network-namespace bed (internal/netns: each host its own address and
// loopback, on one bridge, and a host can be cut off), an /etc/hosts that
// names its hosts, and, for the etcd rendezvous, one etcd member on the
// bed's gateway (the root namespace). It needs root and iproute2.
package hostbed

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

// Config is a bed to build.
type Config struct {
	Hosts int
	// Etcd is the etcd binary (looked up on PATH) for an etcd member on
	// the gateway; "" for none.
	Etcd string
	// Dir holds the hosts file and etcd's data; the caller removes it.
	Dir string
}

// Bed is a built bed and what command lines need of it.
type Bed struct {
	*netns.Bed
	IPs       []string // by host
	Names     []string // by host: its namespace's name, its host name
	HostsFile string   // an /etc/hosts that names every host
	Etcd      *Etcd    // nil without
}

// Create builds the bed of cfg. Close removes it, every process in it
// included, and stops etcd.
func Create(ctx context.Context, cfg Config) (*Bed, error) {
	etcd := ""
	if cfg.Etcd != "" {
		// Before the bed: a missing binary is a usage error, not a bed
		// to build and remove.
		var err error
		if etcd, err = exec.LookPath(cfg.Etcd); err != nil {
			return nil, fmt.Errorf("etcd: %w (install Debian's etcd-server, or name the binary)", err)
		}
	}
	nb, err := netns.Create(cfg.Hosts, netns.Options{})
	if err != nil {
		return nil, fmt.Errorf("%d hosts: %w", cfg.Hosts, err)
	}
	b := &Bed{Bed: nb, HostsFile: filepath.Join(cfg.Dir, "hosts")}
	var hosts strings.Builder
	hosts.WriteString("127.0.0.1 localhost\n::1 localhost\n")
	for _, h := range nb.Hosts {
		b.IPs = append(b.IPs, h.IP.String())
		b.Names = append(b.Names, h.Name)
		fmt.Fprintf(&hosts, "%s %s\n", h.IP, h.Name)
	}
	if err := os.WriteFile(b.HostsFile, []byte(hosts.String()), 0o644); err != nil {
		return nil, errors.Join(err, nb.Close())
	}
	if etcd != "" {
		if b.Etcd, err = StartEtcd(ctx, etcd, nb.Gateway.String(), filepath.Join(cfg.Dir, "etcd")); err != nil {
			return nil, errors.Join(err, nb.Close())
		}
	}
	return b, nil
}

// AsHostScript takes a hosts file and a host name, installs them (in the
// program's own mount and UTS namespaces) and runs the rest of its
// arguments.
const AsHostScript = `mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"`

// AsHost is the prefix of a command line that runs the rest as host name,
// in a UTS namespace of its own, seeing hostsFile as /etc/hosts (a host
// of the bed runs in the mount namespace `ip netns exec` makes). The bed's
// hosts share the machine's host name, which resolves to loopback: a
// program that finds its address by its host name (torchrun 1.13) needs
// its host's own, as real hosts have.
func AsHost(hostsFile, name string) []string {
	return []string{"unshare", "--uts", "sh", "-c", AsHostScript, "sh", hostsFile, name}
}

// Close stops etcd and removes the bed.
func (b *Bed) Close() error {
	var err error
	if b.Etcd != nil {
		err = b.Etcd.Stop()
	}
	return errors.Join(err, b.Bed.Close())
}

// etcdStartTimeout bounds the wait for the etcd member to serve.
const etcdStartTimeout = 30 * time.Second

// stopGrace is how long etcd gets to stop on SIGTERM.
const stopGrace = 10 * time.Second

// Etcd is one etcd member that a benchmark runs.
type Etcd struct {
	cmd      *exec.Cmd
	done     chan struct{} // closed when cmd has been waited for
	dir      string        // its data directory and log
	Endpoint string        // host:port of its client URL
}

// PID is the member's process: a benchmark's child that is no job's
// leftover.
func (e *Etcd) PID() int { return e.cmd.Process.Pid }

// StartEtcd starts a one-member etcd cluster listening on ip (both URLs)
// with its data and log under dir, and waits until it serves.
func StartEtcd(ctx context.Context, bin, ip, dir string) (*Etcd, error) {
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
		"--name", "bench",
		"--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "bench="+peer, "--initial-cluster-state", "new",
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
	e := &Etcd{cmd: cmd, done: make(chan struct{}), dir: dir, Endpoint: strings.TrimPrefix(client, "http://")}
	go func() { cmd.Wait(); close(e.done) }()
	if err := e.waitReady(ctx); err != nil {
		return nil, errors.Join(err, e.Stop())
	}
	return e, nil
}

// waitReady polls etcd's /health until it reports a healthy member.
func (e *Etcd) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, etcdStartTimeout)
	defer cancel()
	url := "http://" + e.Endpoint + "/health"
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

// Stop ends etcd (SIGTERM, then SIGKILL after stopGrace) and removes its
// data.
func (e *Etcd) Stop() error {
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
