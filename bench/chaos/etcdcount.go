package main

import (
	"context"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// etcdCounter counts what a run leaves in etcd (-backend etcd): the keys
// under the job's prefix and etcd's leases. The bed's etcd member serves
// this harness alone, so every lease is the job's: one per agent's
// liveness, and a worker store's writes in flight.
type etcdCounter struct {
	cli    *clientv3.Client
	prefix string
}

// newEtcdCounter returns a counter of the keys of run id on the member at
// endpoint; nil when it cannot connect (the columns then read –).
func newEtcdCounter(endpoint, runID string) *etcdCounter {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil
	}
	// gorun's etcd layout: <prefix>/<run id>/…, prefix /gorun by default.
	return &etcdCounter{cli: cli, prefix: "/gorun/" + runID + "/"}
}

// count returns the job's keys and etcd's leases, -1 each when etcd does
// not answer.
func (c *etcdCounter) count(ctx context.Context) (keys, leases int) {
	if c == nil {
		return -1, -1
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	keys, leases = -1, -1
	if r, err := c.cli.Get(ctx, c.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly()); err == nil {
		keys = int(r.Count)
	}
	if r, err := c.cli.Leases(ctx); err == nil {
		leases = len(r.Leases)
	}
	return keys, leases
}

func (c *etcdCounter) close() {
	if c != nil {
		c.cli.Close()
	}
}

// dirs counts the job's keys in etcd by their first two directories under
// the job's prefix (rdzv/…, alive/, a round's store/<n>/k/…): where keys
// that outlive their epochs would be.
func (c *etcdCounter) dirs(ctx context.Context) map[string]int {
	if c == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := c.cli.Get(ctx, c.prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil
	}
	out := map[string]int{}
	for _, kv := range r.Kvs {
		parts := strings.SplitN(strings.TrimPrefix(string(kv.Key), c.prefix), "/", 4)
		out[strings.Join(parts[:min(len(parts), 3)], "/")]++
	}
	return out
}
