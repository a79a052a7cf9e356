//go:build !gorun_noetcd

package launcher

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// The etcd backends' --rdzv-conf keys, besides the dynamic rendezvous's
// timeouts (join_timeout, last_call_timeout, close_timeout,
// keep_alive_interval, keep_alive_max_attempt, read_timeout):
//
//	protocol=http|https  TLS for endpoints given without a scheme (http)
//	cacert=PATH          CA bundle that signs the members' certificates
//	cert=PATH, key=PATH  client certificate and key (--client-cert-auth)
//	user=NAME            etcd user; else $GORUN_ETCD_USER
//	password=SECRET      its password; better password_env=VAR, naming the
//	                     variable that holds it, or $GORUN_ETCD_PASSWORD,
//	                     so that no secret sits on a command line
//	prefix=/gorun        where the job's keys go: <prefix>/<run id>/
//	lease_ttl=5          seconds an agent stays alive without renewing
const (
	envEtcdUser     = "GORUN_ETCD_USER"
	envEtcdPassword = "GORUN_ETCD_PASSWORD"

	defaultEtcdPrefix = "/gorun"
)

// lookupEnv reads the agent's environment; a variable so tests can pin it.
var lookupEnv = os.LookupEnv

// etcdSettings are the etcd backends' settings, typed.
type etcdSettings struct {
	client etcd.ClientConfig
	// base is where the job's keys go: "<prefix>/<run id>/".
	base string
	// leaseTTL is each agent's lease TTL as asked (etcd grants whole
	// seconds).
	leaseTTL time.Duration
	// passwordOnCommandLine: the password came from --rdzv-conf, where
	// any user of the machine can read it.
	passwordOnCommandLine bool
}

// etcdSettings reads the etcd backends' settings from --rdzv-endpoint,
// --rdzv-conf and the environment, and checks them without touching the
// network (the certificate files are read). Errors match ErrInvalidConfig.
func (r RendezvousConfig) etcdSettings(runID string) (etcdSettings, error) {
	var s etcdSettings
	endpoint := r.Endpoint
	if strings.TrimSpace(endpoint) == "" {
		endpoint = "localhost" // torchrun's default host
	}
	c := etcd.DefaultClientConfig(strings.Split(endpoint, ",")...)
	conf := r.Conf
	c.TLS = strings.EqualFold(strings.TrimSpace(conf["protocol"]), "https")
	c.CACertFile, c.CertFile, c.KeyFile = conf["cacert"], conf["cert"], conf["key"]
	if strings.EqualFold(strings.TrimSpace(conf["protocol"]), "http") && (c.CACertFile != "" || c.CertFile != "" || c.KeyFile != "") {
		return s, invalidf("--rdzv-conf protocol=http with certificates (cacert, cert, key): use protocol=https")
	}
	c.Username = conf["user"]
	if c.Username == "" {
		c.Username, _ = lookupEnv(envEtcdUser)
	}
	switch name, byEnv := conf["password_env"]; {
	case conf["password"] != "" && byEnv:
		return s, invalidf("--rdzv-conf: give password or password_env, not both")
	case conf["password"] != "":
		c.Password, s.passwordOnCommandLine = conf["password"], true
	case byEnv:
		v, ok := lookupEnv(name)
		if !ok {
			return s, invalidf("--rdzv-conf password_env=%s: $%s is not set", name, name)
		}
		c.Password = v
	default:
		c.Password, _ = lookupEnv(envEtcdPassword)
	}
	if c.Password != "" && c.Username == "" {
		return s, invalidf("--rdzv-conf: an etcd password needs a user (user=NAME or $%s)", envEtcdUser)
	}
	if _, err := c.Build(); err != nil {
		return s, invalidf("--rdzv-endpoint %q, --rdzv-conf: %w", r.Endpoint, err)
	}
	s.client = c

	prefix := defaultEtcdPrefix
	if p, ok := conf["prefix"]; ok {
		prefix = p
	}
	if !strings.HasPrefix(prefix, "/") {
		return s, invalidf("--rdzv-conf prefix=%s: want a key prefix starting with / (default %s)", prefix, defaultEtcdPrefix)
	}
	s.base = strings.TrimRight(prefix, "/") + "/" + runID + "/"

	ttl, err := confSeconds(conf, "lease_ttl", etcd.DefaultLeaseTTL)
	if err != nil {
		return s, err
	}
	s.leaseTTL = ttl
	return s, nil
}

// String describes the settings for a log line, without the password.
func (s etcdSettings) String() string {
	return fmt.Sprintf("endpoints %v, keys under %s, lease TTL %v", s.client.Endpoints, s.base, s.leaseTTL)
}
