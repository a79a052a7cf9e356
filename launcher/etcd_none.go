//go:build gorun_noetcd

package launcher

import (
	"context"

	"go.uber.org/zap"
)

// EtcdBackendLinked reports whether this build has the etcd backends: this
// one, built with the gorun_noetcd tag, has not (see etcd.go).
const EtcdBackendLinked = false

func newEtcdMembership(context.Context, *Config, *zap.Logger, string) (membership, error) {
	return nil, invalidf("%w", ErrEtcdNotLinked)
}

func (r RendezvousConfig) validateEtcd() error { return invalidf("%w", ErrEtcdNotLinked) }
