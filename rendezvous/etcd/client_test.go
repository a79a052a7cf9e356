package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

func TestClientConfigBuild(t *testing.T) {
	certs := etcdtest.NewCerts(t)
	notPEM := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := []struct {
		name   string
		mutate func(*etcd.ClientConfig)
		want   []string
		tls    bool
	}{
		{"host", func(c *etcd.ClientConfig) { c.Endpoints = []string{"etcd0"} }, []string{"http://etcd0:2379"}, false},
		{"hosts and ports", func(c *etcd.ClientConfig) { c.Endpoints = []string{"10.0.0.1:2381", " etcd1 "} },
			[]string{"http://10.0.0.1:2381", "http://etcd1:2379"}, false},
		{"ipv6", func(c *etcd.ClientConfig) { c.Endpoints = []string{"[::1]:2390", "[fd00::2]", "fd00::3"} },
			[]string{"http://[::1]:2390", "http://[fd00::2]:2379", "http://[fd00::3]:2379"}, false},
		{"urls", func(c *etcd.ClientConfig) { c.Endpoints = []string{"https://etcd0:2379/", "https://etcd1"} },
			[]string{"https://etcd0:2379", "https://etcd1:2379"}, true},
		{"tls by flag", func(c *etcd.ClientConfig) { c.TLS = true }, []string{"https://etcd0:2379"}, true},
		{"tls by files", func(c *etcd.ClientConfig) {
			c.CACertFile, c.CertFile, c.KeyFile = certs.CAFile, certs.ClientCert, certs.ClientKey
		}, []string{"https://etcd0:2379"}, true},
		{"user", func(c *etcd.ClientConfig) { c.Username, c.Password = "gorun", "secret" }, []string{"http://etcd0:2379"}, false},
		{"user without password", func(c *etcd.ClientConfig) { c.Username = "gorun" }, []string{"http://etcd0:2379"}, false},
	}
	for _, tc := range good {
		t.Run(tc.name, func(t *testing.T) {
			c := etcd.DefaultClientConfig("etcd0")
			tc.mutate(&c)
			got, err := c.Build()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got.Endpoints, tc.want) || (got.TLS != nil) != tc.tls {
				t.Fatalf("endpoints %q tls %v; want %q tls %v", got.Endpoints, got.TLS != nil, tc.want, tc.tls)
			}
			if got.Username != c.Username || got.Password != c.Password {
				t.Fatalf("credentials %q/%q", got.Username, got.Password)
			}
		})
	}

	bad := []struct {
		name   string
		mutate func(*etcd.ClientConfig)
		want   string // in the message
	}{
		{"no endpoint", func(c *etcd.ClientConfig) { c.Endpoints = nil }, "no etcd endpoint"},
		{"empty endpoint", func(c *etcd.ClientConfig) { c.Endpoints = []string{"etcd0", ""} }, "empty etcd endpoint"},
		{"bad port", func(c *etcd.ClientConfig) { c.Endpoints = []string{"etcd0:99999"} }, `port "99999"`},
		{"bad url", func(c *etcd.ClientConfig) { c.Endpoints = []string{"ftp://etcd0"} }, "not HOST[:PORT]"},
		{"url with a path", func(c *etcd.ClientConfig) { c.Endpoints = []string{"http://etcd0/v2"} }, "not HOST[:PORT]"},
		{"mixed schemes", func(c *etcd.ClientConfig) { c.Endpoints = []string{"http://a", "https://b"} }, "mix http and https"},
		{"http with tls", func(c *etcd.ClientConfig) { c.Endpoints, c.TLS = []string{"http://a"}, true }, "TLS is asked for"},
		{"password without user", func(c *etcd.ClientConfig) { c.Password = "secret" }, "password without a user"},
		{"cert without key", func(c *etcd.ClientConfig) { c.CertFile = certs.ClientCert }, "needs both cert and key"},
		{"missing ca", func(c *etcd.ClientConfig) { c.CACertFile = "/nonexistent/ca.pem" }, "/nonexistent/ca.pem"},
		{"ca not pem", func(c *etcd.ClientConfig) { c.CACertFile = notPEM }, "no PEM certificate"},
		{"missing key", func(c *etcd.ClientConfig) { c.CertFile, c.KeyFile = certs.ClientCert, "/nonexistent/key.pem" }, "/nonexistent/key.pem"},
		{"key of another cert", func(c *etcd.ClientConfig) { c.CertFile, c.KeyFile = certs.ClientCert, certs.ServerKey }, "private key does not match"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			c := etcd.DefaultClientConfig("etcd0")
			tc.mutate(&c)
			err := c.Validate()
			if !errors.Is(err, rendezvous.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v; want ErrInvalidArgument saying %q", err, tc.want)
			}
		})
	}
}

// observed returns a logger whose Info lines the test can read.
func observed() (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.InfoLevel)
	return zap.New(core), logs
}

// TestConnectUnreachable: nobody serves the endpoints: Connect logs
// progress lines naming them, then gives up with ErrUnreachable when its
// context ends, not before and not much after.
func TestConnectUnreachable(t *testing.T) {
	ports := etcdtest.FreePorts(t, 2)
	log, logs := observed()
	cfg := etcd.DefaultClientConfig("127.0.0.1:"+strconv.Itoa(ports[0]), "127.0.0.1:"+strconv.Itoa(ports[1]))
	cfg.ProgressInterval, cfg.AttemptTimeout, cfg.Logger = 300*time.Millisecond, 200*time.Millisecond, log
	const wait = 1500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	start := time.Now()
	cli, err := etcd.Connect(ctx, cfg)
	took := time.Since(start)
	if cli != nil || !errors.Is(err, etcd.ErrUnreachable) {
		t.Fatalf("Connect = %v, %v; want ErrUnreachable", cli, err)
	}
	if took < wait || took > wait+3*time.Second {
		t.Fatalf("gave up after %v; want about %v", took, wait)
	}
	lines := logs.FilterMessage("waiting for etcd").All()
	if len(lines) < 2 {
		t.Fatalf("%d progress lines in %v; want one every 300ms", len(lines), took)
	}
	if eps := lines[0].ContextMap()["endpoints"]; !strings.Contains(strings.Join(toStrings(eps), ","), strconv.Itoa(ports[1])) {
		t.Fatalf("progress line names endpoints %v", eps)
	}
}

func toStrings(v any) []string {
	var out []string
	if vs, ok := v.([]any); ok {
		for _, x := range vs {
			out = append(out, x.(string))
		}
	}
	return out
}

// TestConnectWaitsForEtcd: etcd is down when Connect starts and comes up a
// second later; Connect returns a working client soon after.
func TestConnectWaitsForEtcd(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	m := cluster.Members[0]
	m.Stop()
	ctx := testCtx(t, 30*time.Second)
	up := make(chan time.Time, 1)
	go func() {
		time.Sleep(time.Second)
		if err := m.Restart(ctx); err != nil {
			t.Error(err)
		}
		up <- time.Now()
	}()
	cli, err := etcd.Connect(ctx, etcd.DefaultClientConfig(cluster.HostPorts()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ready := <-up
	if late := time.Since(ready); late > 3*time.Second {
		t.Fatalf("connected %v after etcd was ready", late)
	}
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
}

// TestConnectTLS runs etcd with TLS and client certificates: the right
// files connect; a wrong CA, a client certificate from another CA, or TLS
// to a plain-HTTP member fail at once with ErrTLS and a message naming the
// certificate to check.
func TestConnectTLS(t *testing.T) {
	certs, other := etcdtest.NewCerts(t), etcdtest.NewCerts(t)
	secure := etcdtest.Start(t, 1, etcdtest.Options{TLS: certs.ServerTLS(true)})
	plain := etcdtest.Start(t, 1, etcdtest.Options{})
	ctx := testCtx(t, 60*time.Second)

	cfg := etcd.DefaultClientConfig(secure.HostPorts()...)
	cfg.CACertFile, cfg.CertFile, cfg.KeyFile = certs.CAFile, certs.ClientCert, certs.ClientKey
	cli, err := etcd.Connect(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	cli.Close()

	cases := []struct {
		name   string
		mutate func(*etcd.ClientConfig)
		want   string
	}{
		{"wrong ca", func(c *etcd.ClientConfig) { c.CACertFile = other.CAFile }, "not signed by a CA in cacert"},
		{"client cert of another ca", func(c *etcd.ClientConfig) { c.CertFile, c.KeyFile = other.ClientCert, other.ClientKey },
			"refused this client's certificate"},
		{"no client cert", func(c *etcd.ClientConfig) { c.CertFile, c.KeyFile = "", "" }, "asks for a client certificate"},
		{"tls to plain http", func(c *etcd.ClientConfig) { c.Endpoints = plain.HostPorts() }, "speaks plain HTTP, not TLS"},
		{"plain http to tls", func(c *etcd.ClientConfig) {
			*c = etcd.DefaultClientConfig(secure.HostPorts()...)
		}, "speaks TLS, not plain HTTP"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			tc.mutate(&c)
			start := time.Now()
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			cli, err := etcd.Connect(ctx, c)
			if cli != nil {
				cli.Close()
			}
			if !errors.Is(err, etcd.ErrTLS) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v; want ErrTLS saying %q", err, tc.want)
			}
			t.Log(err)
			if took := time.Since(start); took > 5*time.Second {
				t.Fatalf("took %v to fail; a certificate problem is not retried", took)
			}
		})
	}
}

// TestConnectAuth: with authentication on, the right password connects and
// a wrong one fails at once with ErrAuth.
func TestConnectAuth(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	admin := cluster.Client(t, nil)
	ctx := testCtx(t, 30*time.Second)
	if _, err := admin.RoleAdd(ctx, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.UserAdd(ctx, "root", "rootpw"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	cfg := etcd.DefaultClientConfig(cluster.HostPorts()...)
	cfg.Username, cfg.Password = "root", "rootpw"
	cli, err := etcd.Connect(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	cli.Close()

	cfg.Password = "wrong"
	start := time.Now()
	cli, err = etcd.Connect(ctx, cfg)
	if cli != nil || !errors.Is(err, etcd.ErrAuth) {
		t.Fatalf("Connect with a wrong password = %v, %v; want ErrAuth", cli, err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("took %v to fail; refused credentials are not retried", took)
	}
}

// A probe that ran out of time on a live connection makes the next one
// wait longer, up to 8× the base; any other failure, and a timeout with no
// connection, start again from the base.
func TestConnectAttemptGrows(t *testing.T) {
	const base = 2 * time.Second
	timedOut := fmt.Errorf("etcd probe: %w", context.DeadlineExceeded)
	tests := []struct {
		name      string
		cur       time.Duration
		connected bool
		err       error
		want      time.Duration
	}{
		{"timed out once", base, true, timedOut, 2 * base},
		{"timed out again", 2 * base, true, timedOut, 4 * base},
		{"the member timed it out", 4 * base, true, rpctypes.ErrTimeout, 8 * base},
		{"capped", 8 * base, true, timedOut, 8 * base},
		{"timed out with no connection: the base", 4 * base, false, timedOut, base},
		{"refused: back to the base", 8 * base, true, errors.New("connection refused"), base},
		{"no leader: back to the base", 4 * base, true, rpctypes.ErrNoLeader, base},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := etcd.NextAttempt(tt.cur, base, tt.connected, tt.err); got != tt.want {
				t.Errorf("next attempt after %v (connected %v, %v): %v, want %v", tt.cur, tt.connected, tt.err, got, tt.want)
			}
		})
	}
}
