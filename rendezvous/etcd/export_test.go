package etcd

import clientv3 "go.etcd.io/etcd/client/v3"

// LeaseID returns the lease the node's key is bound to now.
func (l *Liveness) LeaseID() clientv3.LeaseID {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lease
}

// Events counts the watch events the node's liveness received.
func (l *Liveness) Events() int64 { return l.events.Load() }

// NextAttempt is Connect's timeout for the attempt after one that failed.
var NextAttempt = nextAttempt
