package etcd

import (
	"fmt"
	"strings"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// The etcd backends' --rdzv-conf keys, besides the dynamic rendezvous's
// timeouts (rendezvous.ParseDynamicConfig) and read_timeout:
//
//	protocol=http|https  TLS for endpoints given without a scheme (http)
//	cacert=PATH          CA bundle that signs the members' certificates
//	cert=PATH, key=PATH  client certificate and key (--client-cert-auth)
//	user=NAME            etcd user; else $GORUN_ETCD_USER
//	password=SECRET      its password; better password_env=VAR, naming the
//	                     variable that holds it, or $GORUN_ETCD_PASSWORD,
//	                     so that no secret sits on a command line
//	prefix=/gorun        where the jobs' keys go: <prefix>/<run id>/
//	lease_ttl=5          seconds an agent stays alive without renewing
//	start_lease_ttl=S    the same until its workers first run (see
//	                     StartLeaseTTL); default 50 ms per node of
//	                     --nnodes's MAX, no less than lease_ttl and no
//	                     more than 120
const (
	// EnvUser and EnvPassword hold etcd's credentials when --rdzv-conf
	// names none.
	EnvUser     = "GORUN_ETCD_USER"
	EnvPassword = "GORUN_ETCD_PASSWORD"
	// DefaultPrefix is where the jobs' keys go when prefix is not given.
	DefaultPrefix = "/gorun"
)

// RendezvousSettings are the etcd backends' settings, from
// --rdzv-endpoint, --rdzv-conf and the environment.
type RendezvousSettings struct {
	Client ClientConfig
	// Prefix is where the jobs' keys go (JobDir).
	Prefix string
	// LeaseTTL is each agent's lease TTL as asked (etcd grants whole
	// seconds, and no less than 1.5 election timeouts).
	LeaseTTL time.Duration
	// StartLeaseTTL is start_lease_ttl: the TTL of an agent's first lease,
	// until its workers first run (LivenessConfig.StartTTL). Zero: not
	// given, StartTTL's default.
	StartLeaseTTL time.Duration
	// PasswordOnCommandLine: the password came from --rdzv-conf, where any
	// user of the machine can read it.
	PasswordOnCommandLine bool
}

// JobDir is the directory of job runID's keys: "<prefix>/<run id>/".
func (s RendezvousSettings) JobDir(runID string) string {
	return strings.TrimRight(s.Prefix, "/") + "/" + runID + "/"
}

// The start lease's default (StartTTL): while a crowd of agents starts,
// etcd's apply ran behind its log, renewing no lease, for about 26 ms per
// agent (1,024 agents on two cores: about nine proposals each at 300-400
// applied a second; leases went unrenewed for up to 32 s). Twice that,
// capped: beyond the cap the rendezvous state's own heartbeats are the
// slower backstop anyway.
const (
	startLeasePerNode = 50 * time.Millisecond
	maxStartLeaseTTL  = 120 * time.Second
)

// StartTTL is the first lease's TTL for a job of up to maxNodes nodes:
// start_lease_ttl when given, else 50 ms per node up to 120 s; never less
// than LeaseTTL. At the defaults it is longer than LeaseTTL from 101
// nodes on: a smaller job keeps one lease throughout.
func (s RendezvousSettings) StartTTL(maxNodes int) time.Duration {
	d := s.StartLeaseTTL
	if d <= 0 {
		d = min(time.Duration(maxNodes)*startLeasePerNode, maxStartLeaseTTL)
	}
	return max(d, s.LeaseTTL)
}

// String describes the settings for a log line, without the password.
func (s RendezvousSettings) String() string {
	return fmt.Sprintf("endpoints %v, keys under %s, lease TTL %v", s.Client.Endpoints, s.Prefix, s.LeaseTTL)
}

// ParseRendezvousConf reads the etcd backends' settings from endpoint (a
// comma-separated list; empty is localhost, torchrun's default host), conf
// and the environment (lookupEnv, os.LookupEnv outside tests), and checks
// them without touching the network (certificate files are read). Errors
// match rendezvous.ErrInvalidArgument.
func ParseRendezvousConf(endpoint string, conf rendezvous.Conf, lookupEnv func(string) (string, bool)) (RendezvousSettings, error) {
	var s RendezvousSettings
	if strings.TrimSpace(endpoint) == "" {
		endpoint = "localhost"
	}
	c := DefaultClientConfig(strings.Split(endpoint, ",")...)
	protocol, err := conf.OneOf("protocol", "http", "http", "https")
	if err != nil {
		return s, err
	}
	_, explicitHTTP := conf["protocol"]
	c.TLS = protocol == "https"
	c.CACertFile, c.CertFile, c.KeyFile = conf["cacert"], conf["cert"], conf["key"]
	if explicitHTTP && !c.TLS && (c.CACertFile != "" || c.CertFile != "" || c.KeyFile != "") {
		return s, invalid("--rdzv-conf protocol=http with certificates (cacert, cert, key): use protocol=https")
	}
	c.Username = conf["user"]
	if c.Username == "" {
		c.Username, _ = lookupEnv(EnvUser)
	}
	switch name, byEnv := conf["password_env"]; {
	case conf["password"] != "" && byEnv:
		return s, invalid("--rdzv-conf: give password or password_env, not both")
	case conf["password"] != "":
		c.Password, s.PasswordOnCommandLine = conf["password"], true
	case byEnv:
		v, ok := lookupEnv(name)
		if !ok {
			return s, invalid("--rdzv-conf password_env=%s: $%s is not set", name, name)
		}
		c.Password = v
	default:
		c.Password, _ = lookupEnv(EnvPassword)
	}
	if c.Password != "" && c.Username == "" {
		return s, invalid("--rdzv-conf: an etcd password needs a user (user=NAME or $%s)", EnvUser)
	}
	if _, err := c.Build(); err != nil {
		return s, invalid("--rdzv-endpoint %q, --rdzv-conf: %w", endpoint, err)
	}
	s.Client = c

	s.Prefix = DefaultPrefix
	if p, ok := conf["prefix"]; ok {
		s.Prefix = p
	}
	if !strings.HasPrefix(s.Prefix, "/") {
		return s, invalid("--rdzv-conf prefix=%s: want a key prefix starting with / (default %s)", s.Prefix, DefaultPrefix)
	}
	if s.LeaseTTL, err = conf.Seconds("lease_ttl", DefaultLeaseTTL); err != nil {
		return s, err
	}
	if s.StartLeaseTTL, err = conf.Seconds("start_lease_ttl", 0); err != nil {
		return s, err
	}
	return s, nil
}

// invalid is a bad setting: an error matching rendezvous.ErrInvalidArgument
// whose text is only the message.
func invalid(format string, args ...any) error {
	return &settingError{err: fmt.Errorf(format, args...)}
}

type settingError struct{ err error }

func (e *settingError) Error() string   { return e.err.Error() }
func (e *settingError) Unwrap() []error { return []error{rendezvous.ErrInvalidArgument, e.err} }
