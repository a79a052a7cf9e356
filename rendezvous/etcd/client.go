package etcd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
)

// DefaultPort is etcd's client port, taken for an endpoint given without
// one.
const DefaultPort = 2379

// Errors of Connect that callers branch on.
var (
	// ErrUnreachable: no endpoint answered before Connect's context ended.
	ErrUnreachable = errors.New("etcd unreachable")
	// ErrTLS: the TLS handshake with the cluster failed on a certificate
	// (an unknown CA, a name mismatch, a client certificate refused, TLS
	// on one side only). Retrying does not help, so Connect does not.
	ErrTLS = errors.New("etcd TLS handshake failed")
	// ErrAuth: the cluster refused the user name and password.
	ErrAuth = errors.New("etcd refused the credentials")
)

// ClientConfig says how to reach an etcd cluster. Start from
// DefaultClientConfig; every zero duration also means its default.
type ClientConfig struct {
	// Endpoints are the members' client addresses: "host", "host:port",
	// "[v6addr]:port", or URLs ("https://host:port"). A missing port is
	// DefaultPort. At least one is required; all must agree on the scheme.
	Endpoints []string
	// TLS speaks TLS to endpoints given without a scheme. It is implied by
	// an https:// endpoint and by any of the files below.
	TLS bool
	// CACertFile is a PEM bundle of the CAs that sign the members'
	// certificates. Default: the system's roots.
	CACertFile string
	// CertFile and KeyFile are a PEM client certificate and its key, for a
	// cluster that authenticates clients by certificate
	// (--client-cert-auth). Both or neither.
	CertFile, KeyFile string
	// Username and Password log in to a cluster with authentication
	// enabled. A password needs a user name.
	Username, Password string
	// AttemptTimeout bounds one attempt of Connect to get an answer from
	// the cluster. Default 2 s.
	AttemptTimeout time.Duration
	// ProgressInterval is how often Connect logs that it is still waiting
	// for the cluster. Default 2 s.
	ProgressInterval time.Duration
	// ReconnectBackoff is the longest pause between two attempts of the
	// client to (re)connect to a member. gRPC's own default grows to 120 s,
	// which would leave an agent deaf long after etcd is back; default 1 s.
	ReconnectBackoff time.Duration
	// KeepAliveTime and KeepAliveTimeout make the client ping an idle
	// connection and drop it when the ping is not answered, so that a
	// member that vanished without closing its connections (a host lost, a
	// link cut) is left for another. etcd closes the connection of a
	// client that pings more often than its --grpc-keepalive-min-time
	// (5 s by default). Defaults 10 s and 5 s.
	KeepAliveTime, KeepAliveTimeout time.Duration
	// Logger receives Connect's progress lines; the etcd client's own logs
	// go there at error level only. Default: none.
	Logger *zap.Logger
}

// Defaults of ClientConfig.
const (
	DefaultAttemptTimeout   = 2 * time.Second
	DefaultProgressInterval = 2 * time.Second
	DefaultReconnectBackoff = time.Second
	DefaultKeepAliveTime    = 10 * time.Second
	DefaultKeepAliveTimeout = 5 * time.Second
)

// DefaultClientConfig returns a config for endpoints with every default:
// plain HTTP, no credentials.
func DefaultClientConfig(endpoints ...string) ClientConfig {
	return ClientConfig{
		Endpoints:        endpoints,
		AttemptTimeout:   DefaultAttemptTimeout,
		ProgressInterval: DefaultProgressInterval,
		ReconnectBackoff: DefaultReconnectBackoff,
		KeepAliveTime:    DefaultKeepAliveTime,
		KeepAliveTimeout: DefaultKeepAliveTimeout,
	}
}

func (c ClientConfig) withDefaults() ClientConfig {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.AttemptTimeout, DefaultAttemptTimeout)
	def(&c.ProgressInterval, DefaultProgressInterval)
	def(&c.ReconnectBackoff, DefaultReconnectBackoff)
	def(&c.KeepAliveTime, DefaultKeepAliveTime)
	def(&c.KeepAliveTimeout, DefaultKeepAliveTimeout)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// usesTLS reports whether the config asks for TLS, before the endpoints'
// schemes are considered.
func (c ClientConfig) usesTLS() bool {
	return c.TLS || c.CACertFile != "" || c.CertFile != "" || c.KeyFile != ""
}

// Validate checks the config without touching the network: endpoints,
// credentials, and that the certificate files can be read and parsed. Its
// errors wrap rendezvous.ErrInvalidArgument and name the culprit.
func (c ClientConfig) Validate() error {
	_, err := c.Build()
	return err
}

// Build returns the clientv3.Config that c describes, with the certificate
// files loaded. Its errors are Validate's.
func (c ClientConfig) Build() (clientv3.Config, error) {
	c = c.withDefaults()
	urls, secure, err := c.endpointURLs()
	if err != nil {
		return clientv3.Config{}, err
	}
	if c.Password != "" && c.Username == "" {
		return clientv3.Config{}, invalid("an etcd password without a user name")
	}
	cfg := clientv3.Config{
		Endpoints:            urls,
		Username:             c.Username,
		Password:             c.Password,
		DialTimeout:          c.AttemptTimeout,
		DialKeepAliveTime:    c.KeepAliveTime,
		DialKeepAliveTimeout: c.KeepAliveTimeout,
		PermitWithoutStream:  true,
		Logger:               c.Logger.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.ErrorLevel)),
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  min(100*time.Millisecond, c.ReconnectBackoff),
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   c.ReconnectBackoff,
			},
			MinConnectTimeout: c.AttemptTimeout,
		})},
	}
	if secure {
		if cfg.TLS, err = c.tlsConfig(); err != nil {
			return clientv3.Config{}, err
		}
	}
	return cfg, nil
}

// endpointURLs turns the endpoints into URLs with a scheme and a port, and
// reports whether they use TLS.
func (c ClientConfig) endpointURLs() ([]string, bool, error) {
	if len(c.Endpoints) == 0 {
		return nil, false, invalid("no etcd endpoint")
	}
	scheme := ""
	out := make([]string, 0, len(c.Endpoints))
	for _, ep := range c.Endpoints {
		s, hostport, err := splitEtcdEndpoint(ep)
		if err != nil {
			return nil, false, err
		}
		if s == "" {
			s = "http"
			if c.usesTLS() {
				s = "https"
			}
		}
		switch {
		case scheme == "":
			scheme = s
		case s != scheme:
			return nil, false, invalid("etcd endpoints %q mix http and https", c.Endpoints)
		}
		out = append(out, s+"://"+hostport)
	}
	if scheme == "http" && c.usesTLS() {
		return nil, false, invalid("etcd endpoints %q are http:// but TLS is asked for (protocol=https, cacert, cert or key)", c.Endpoints)
	}
	return out, scheme == "https", nil
}

// splitEtcdEndpoint reads one endpoint: an optional http:// or https://
// scheme, a host (an IPv6 address in brackets when it has a port) and an
// optional port. It returns the scheme ("" when none) and host:port.
func splitEtcdEndpoint(ep string) (scheme, hostport string, err error) {
	e := strings.TrimSpace(ep)
	if e == "" {
		return "", "", invalid("an empty etcd endpoint")
	}
	if s, rest, ok := strings.Cut(e, "://"); ok {
		u, err := url.Parse(e)
		if err != nil || (s != "http" && s != "https") || (u.Path != "" && u.Path != "/") || u.Host == "" {
			return "", "", invalid("etcd endpoint %q is not HOST[:PORT] or an http(s)://HOST[:PORT] URL", ep)
		}
		scheme, e = s, strings.TrimSuffix(rest, "/")
	}
	host, port := e, strconv.Itoa(DefaultPort)
	switch {
	case strings.HasPrefix(e, "[") && strings.HasSuffix(e, "]"):
		host = e[1 : len(e)-1]
	case strings.HasPrefix(e, "[") || strings.Count(e, ":") == 1:
		if host, port, err = net.SplitHostPort(e); err != nil {
			return "", "", invalid("etcd endpoint %q is not HOST[:PORT]", ep)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return "", "", invalid("etcd endpoint %q: port %q is not a TCP port (1–65535)", ep, port)
		}
	}
	if host == "" || strings.ContainsAny(host, "/ ,@?#") {
		return "", "", invalid("etcd endpoint %q: %q is not a host name or IP address", ep, host)
	}
	return scheme, net.JoinHostPort(host, port), nil
}

// tlsConfig loads the certificate files.
func (c ClientConfig) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.CACertFile != "" {
		pem, err := os.ReadFile(c.CACertFile)
		if err != nil {
			return nil, invalid("etcd cacert: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, invalid("etcd cacert %s: no PEM certificate in it", c.CACertFile)
		}
		cfg.RootCAs = pool
	}
	switch {
	case c.CertFile == "" && c.KeyFile == "":
	case c.CertFile == "" || c.KeyFile == "":
		return nil, invalid("etcd client certificate needs both cert and key (got cert=%q key=%q)", c.CertFile, c.KeyFile)
	default:
		for _, f := range []string{c.CertFile, c.KeyFile} {
			if _, err := os.Stat(f); err != nil {
				return nil, invalid("etcd client certificate: %v", err)
			}
		}
		pair, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, invalid("etcd client certificate %s with key %s: %v", c.CertFile, c.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// Connect returns a client of the cluster once the cluster answers a
// linearizable read (it has a leader and a quorum). Until then it retries,
// logging a progress line every ProgressInterval, until ctx ends: then it
// fails with an error wrapping ErrUnreachable and the last problem seen.
// A certificate problem fails at once with ErrTLS, refused credentials
// with ErrAuth, and a bad config with rendezvous.ErrInvalidArgument.
func Connect(ctx context.Context, cfg ClientConfig) (*clientv3.Client, error) {
	cfg = cfg.withDefaults()
	ccfg, err := cfg.Build()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	nextLog := start.Add(cfg.ProgressInterval)
	pause := 50 * time.Millisecond
	attempt := cfg.AttemptTimeout
	var cli *clientv3.Client
	defer func() {
		if cli != nil && err != nil {
			cli.Close()
		}
	}()
	for {
		if ccfg.TLS != nil {
			if err = probeTLS(ctx, ccfg.Endpoints, ccfg.TLS, cfg.AttemptTimeout); err != nil {
				return nil, err
			}
		}
		if cli == nil {
			cli, err = clientv3.New(ccfg)
		}
		if cli != nil {
			err = check(ctx, cli, attempt)
			if err == nil {
				return cli, nil
			}
			ready := cli.ActiveConnection().GetState() == connectivity.Ready
			attempt = nextAttempt(attempt, cfg.AttemptTimeout, ready, err)
		}
		if isAuthError(err) {
			err = fmt.Errorf("%w: user %q at %v: %w", ErrAuth, cfg.Username, cfg.Endpoints, err)
			return nil, err
		}
		if ccfg.TLS == nil {
			if perr := probePlain(ctx, ccfg.Endpoints, cfg.AttemptTimeout); perr != nil {
				err = perr
				return nil, err
			}
		}
		waited := time.Since(start)
		if ctx.Err() != nil {
			err = fmt.Errorf("%w: no answer from %v in %v: %w", ErrUnreachable, strings.Join(ccfg.Endpoints, ","),
				waited.Round(time.Millisecond), err)
			return nil, err
		}
		if now := time.Now(); !now.Before(nextLog) {
			cfg.Logger.Info("waiting for etcd", zap.Strings("endpoints", ccfg.Endpoints),
				zap.Duration("waited", waited.Round(100*time.Millisecond)), zap.Error(err))
			nextLog = now.Add(cfg.ProgressInterval)
		}
		select {
		case <-ctx.Done():
		case <-time.After(pause):
		}
		pause = min(2*pause, 500*time.Millisecond)
	}
}

// maxAttemptGrowth bounds how far Connect lengthens its attempts.
const maxAttemptGrowth = 8

// nextAttempt is the timeout of Connect's next attempt after one of cur
// that failed with err, its connection to a member up (connected) or not.
// A probe that ran out of time may be queued at a cluster that answers,
// only slowly: dropping it and sending another every AttemptTimeout never
// gets an answer from a member that takes longer than that (1,024 agents
// starting on two cores: thousands of probes, agents unconnected after
// minutes, BENCHMARKS.md). So an attempt that timed out on a connection
// that is up (or that the member timed out itself) doubles the next one's
// time, up to maxAttemptGrowth × base. Any other failure (refused, no
// leader yet), and a timeout with no connection (nobody listening: the
// progress lines keep their pace), start again from base.
func nextAttempt(cur, base time.Duration, connected bool, err error) time.Duration {
	if !connected || !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, rpctypes.ErrTimeout) {
		return base
	}
	return min(2*cur, maxAttemptGrowth*base)
}

// check does one linearizable read through cli. A key the user may not
// read still proves that the cluster answers.
func check(ctx context.Context, cli *clientv3.Client, timeout time.Duration) error {
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, err := cli.Get(actx, "gorun-connect-probe", clientv3.WithCountOnly())
	if errors.Is(err, rpctypes.ErrPermissionDenied) {
		return nil
	}
	return err
}

func isAuthError(err error) bool {
	for _, e := range []error{rpctypes.ErrAuthFailed, rpctypes.ErrInvalidAuthToken, rpctypes.ErrUserEmpty,
		rpctypes.ErrInvalidAuthMgmt, rpctypes.ErrAuthOldRevision} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
