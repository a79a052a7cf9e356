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

// etcdSettings has nothing to hold in this build.
type etcdSettings struct{}

func parseEtcdSettings(RendezvousConfig) (etcdSettings, error) {
	return etcdSettings{}, invalidf("%w", ErrEtcdNotLinked)
}
