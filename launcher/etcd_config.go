//go:build !gorun_noetcd

package launcher

import (
	"os"

	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// etcdSettings are the etcd backends' settings (their --rdzv-conf keys:
// rendezvous/etcd's ParseRendezvousConf).
type etcdSettings = etcd.RendezvousSettings

// lookupEnv reads the agent's environment; a variable so tests can pin it.
var lookupEnv = os.LookupEnv

// parseEtcdSettings reads the etcd backends' settings from r and the
// environment, without touching the network. Errors match
// ErrInvalidConfig.
func parseEtcdSettings(r RendezvousConfig) (etcdSettings, error) {
	s, err := etcd.ParseRendezvousConf(r.Endpoint, r.Conf, lookupEnv)
	if err != nil {
		return s, invalidf("%w", err)
	}
	return s, nil
}
