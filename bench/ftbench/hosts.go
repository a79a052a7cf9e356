package main

import (
	"context"
	"fmt"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
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

// setUpHosts builds the bed (and, with -backend etcd, starts etcd on its
// gateway: bench/internal/hostbed) and fills in what the agents' command
// lines need. tearDown stops etcd and removes the bed, every process in it
// included.
func (c *config) setUpHosts(ctx context.Context) (tearDown func() error, err error) {
	cfg := hostbed.Config{Hosts: c.hosts, Dir: c.tmp}
	if hostLost(c.fault) {
		cfg.Hosts++ // a host for the heal rows' spare (config.hasSpare)
	}
	if c.backend == backendEtcd {
		cfg.Etcd = c.etcd
	}
	bed, err := hostbed.Create(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("-hosts %d: %w", c.hosts, err)
	}
	c.bed, c.hostIPs, c.hostNames, c.hostsFile = bed.Bed, bed.IPs, bed.Names, bed.HostsFile
	if bed.Etcd != nil {
		c.etcdEndpoint = bed.Etcd.Endpoint
		c.spare = append(c.spare, bed.Etcd.PID())
	}
	return bed.Close, nil
}
