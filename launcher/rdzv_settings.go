package launcher

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gorunhq/gorun/internal/suggest"
	"github.com/gorunhq/gorun/rendezvous"
)

// rendezvousSettings are the rendezvous flags and --rdzv-conf in the typed
// form the memberships run with, parsed once by Config.Validate.
type rendezvousSettings struct {
	// dynamic is the dynamic rendezvous's configuration (multi-node
	// c10d, static and etcd jobs; zero otherwise).
	dynamic rendezvous.DynamicConfig
	// readTimeout bounds one store operation (read_timeout; torchrun's
	// 60 s).
	readTimeout time.Duration
	// fileStore: c10d with store_type=file; the endpoint is a path.
	fileStore bool
	// host and port are the rendezvous TCPStore's endpoint (c10d, static).
	host string
	port int
	// isHost is is_host when given (isHostGiven): host the store here, and
	// fail rather than join as a client when the port is taken. Without
	// it the agent infers it from the endpoint, as torchrun does.
	isHost, isHostGiven bool
	// etcd are the etcd backends' settings.
	etcd etcdSettings
}

// defaultReadTimeout is read_timeout's default (torchrun's).
const defaultReadTimeout = 60 * time.Second

// settings checks the rendezvous settings for a job of minNodes to maxNodes
// nodes and returns them parsed. With Standalone the backend, endpoint and
// run id the user gave are ignored (as torchrun does), so they are not
// checked; --rdzv-conf always is.
func (r RendezvousConfig) settings(minNodes, maxNodes int) (rendezvousSettings, error) {
	var s rendezvousSettings
	conf := rendezvous.Conf(r.Conf)
	if err := checkConf(conf); err != nil {
		return s, err
	}
	if r.LocalAddr != "" && !validAddr(r.LocalAddr) {
		return s, invalidf("--local-addr %q is not a host name or IP address", r.LocalAddr)
	}
	if r.Standalone {
		if maxNodes > 1 {
			return s, invalidf("--standalone runs one node (its store is on localhost at a random port); for --nnodes %d:%d use --rdzv-backend c10d with --rdzv-endpoint", minNodes, maxNodes)
		}
		return s, nil
	}
	if r.RunID == "" {
		return s, invalidf("--rdzv-id is empty; every node of a job needs the same non-empty id")
	}
	var err error
	s.readTimeout, _ = conf.Seconds("read_timeout", defaultReadTimeout) // checked above
	if s.isHost, err = conf.Bool("is_host", false); err != nil {
		return s, invalidf("%w", err)
	}
	_, s.isHostGiven = conf["is_host"]
	if maxNodes > 1 {
		if s.dynamic, err = rendezvous.ParseDynamicConfig(r.RunID, minNodes, maxNodes, conf); err != nil {
			return s, invalidf("%w", err)
		}
	}
	switch r.Backend {
	case backendStatic:
		if err := r.validateStatic(minNodes, maxNodes); err != nil {
			return s, err
		}
		s.host, s.port = r.MasterAddr, r.MasterPort
		if r.Endpoint != "" {
			s.host, s.port, _ = splitEndpoint(r.Endpoint, -1) // checked by validateStatic
		}
		s.isHost = s.isHost || (!s.isHostGiven && r.NodeRank == 0)
		return s, nil
	case backendC10d:
		storeType, _ := conf.OneOf("store_type", "tcp", "tcp", "file") // checked above
		if s.fileStore = storeType == "file"; s.fileStore {
			return s, nil // the endpoint is a path
		}
		if s.host, s.port, err = splitEndpoint(r.Endpoint, defaultC10dPort); err != nil {
			return s, invalidf("--rdzv-endpoint: %w", err)
		}
		return s, nil
	case backendEtcd, backendEtcdV2:
		s.etcd, err = parseEtcdSettings(r)
		return s, err
	}
	return s, invalidf("--rdzv-backend %q is not a rendezvous backend (static, c10d, etcd-v2, etcd)", r.Backend)
}

// checkConf checks the values of every --rdzv-conf key gorun knows,
// whichever backend reads it: a bad value is refused even where it would
// not be used.
func checkConf(conf rendezvous.Conf) error {
	for _, k := range []string{"join_timeout", "last_call_timeout", "close_timeout",
		"heartbeat_timeout", "keep_alive_interval", "read_timeout", "timeout", "lease_ttl", "start_lease_ttl"} {
		if _, err := conf.Seconds(k, 0); err != nil {
			return invalidf("%w", err)
		}
	}
	if _, err := conf.Count("keep_alive_max_attempt", 0); err != nil {
		return invalidf("%w", err)
	}
	for _, k := range []string{"is_host", "use_libuv"} {
		if _, err := conf.Bool(k, false); err != nil {
			return invalidf("%w", err)
		}
	}
	for _, e := range []struct {
		key     string
		allowed []string
	}{
		{"store_type", []string{"tcp", "file"}},
		{"protocol", []string{"http", "https"}}, // etcd, etcd-v2
	} {
		if _, err := conf.OneOf(e.key, "", e.allowed...); err != nil {
			return invalidf("%w", err)
		}
	}
	return nil
}

// knownConfKeys are the --rdzv-conf keys gorun reads, whichever backend
// reads them (torchrun's, and etcd's: rendezvous/etcd's conf.go).
var knownConfKeys = []string{
	"join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
	"keep_alive_max_attempt", "read_timeout", "timeout", "is_host", "store_type", "use_libuv",
	"protocol", "cacert", "cert", "key", "user", "password", "password_env", "prefix", "lease_ttl",
	"start_lease_ttl",
}

// warnings are what Validate lets through but a user should hear of: a
// --rdzv-conf key nobody reads (torchrun passes unknown keys through, so
// gorun does too, but a misspelled timeout is otherwise silently the
// default), and --local-ranks-filter ranks this node does not run.
func (c *Config) warnings() []string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(c.Rendezvous.Conf)) {
		if slices.Contains(knownConfKeys, k) {
			continue
		}
		msg := fmt.Sprintf("--rdzv-conf %s: gorun reads no such key; it is ignored", k)
		if near := suggest.Nearest(k, knownConfKeys); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		out = append(out, msg)
	}
	var missing []int
	for _, r := range c.LocalRanksFilter {
		if r >= c.NProcPerNode {
			missing = append(missing, r)
		}
	}
	if len(missing) > 0 {
		msg := fmt.Sprintf("--local-ranks-filter %v: this node runs local ranks 0–%d only", missing, c.NProcPerNode-1)
		if len(missing) == len(c.LocalRanksFilter) {
			msg += "; no worker's output reaches the console (the log files have it)"
		}
		out = append(out, msg)
	}
	return out
}
