package etcd_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

func TestParseRendezvousConf(t *testing.T) {
	certs := etcdtest.NewCerts(t)
	type want struct {
		endpoints      []string
		tls            bool
		user, password string
		base           string
		ttl            time.Duration
		onCommandLine  bool
	}
	defaults := want{endpoints: []string{"etcd0:2379"}, base: "/gorun/job/", ttl: 5 * time.Second}
	cases := []struct {
		name     string
		endpoint string
		conf     map[string]string
		env      map[string]string
		want     func(*want)
	}{
		{"defaults", "etcd0:2379", nil, nil, func(*want) {}},
		{"no endpoint is localhost", "", nil, nil, func(w *want) { w.endpoints = []string{"localhost"} }},
		{"several endpoints", "etcd0:2379,etcd1,etcd2:2381", nil, nil,
			func(w *want) { w.endpoints = []string{"etcd0:2379", "etcd1", "etcd2:2381"} }},
		{"https", "etcd0:2379", map[string]string{"protocol": "https", "cacert": certs.CAFile,
			"cert": certs.ClientCert, "key": certs.ClientKey}, nil, func(w *want) { w.tls = true }},
		{"prefix and ttl", "etcd0:2379", map[string]string{"prefix": "/jobs/", "lease_ttl": "1.5"}, nil,
			func(w *want) { w.base, w.ttl = "/jobs/job/", 1500*time.Millisecond }},
		{"user and password in conf", "etcd0:2379", map[string]string{"user": "u", "password": "s3cr3t"}, nil,
			func(w *want) { w.user, w.password, w.onCommandLine = "u", "s3cr3t", true }},
		{"user and password from env", "etcd0:2379", nil,
			map[string]string{"GORUN_ETCD_USER": "u", "GORUN_ETCD_PASSWORD": "p"},
			func(w *want) { w.user, w.password = "u", "p" }},
		{"password_env", "etcd0:2379", map[string]string{"user": "u", "password_env": "MY_PW"},
			map[string]string{"MY_PW": "p", "GORUN_ETCD_PASSWORD": "other"},
			func(w *want) { w.user, w.password = "u", "p" }},
		{"conf user wins over env", "etcd0:2379", map[string]string{"user": "u"},
			map[string]string{"GORUN_ETCD_USER": "envuser"}, func(w *want) { w.user = "u" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := etcd.ParseRendezvousConf(tc.endpoint, tc.conf, envOf(tc.env))
			if err != nil {
				t.Fatal(err)
			}
			w := defaults
			tc.want(&w)
			c := s.Client
			got := want{c.Endpoints, c.TLS, c.Username, c.Password, s.JobDir("job"), s.LeaseTTL, s.PasswordOnCommandLine}
			if !reflect.DeepEqual(got, w) {
				t.Fatalf("got %+v\nwant %+v", got, w)
			}
			if strings.Contains(s.String(), "s3cr3t") {
				t.Fatalf("String() shows the password: %s", s)
			}
		})
	}

	bad := []struct {
		name     string
		endpoint string
		conf     map[string]string
		env      map[string]string
		want     string
	}{
		{"bad endpoint", "etcd0:http", nil, nil, `port "http"`},
		{"empty endpoint in list", "etcd0,,etcd1", nil, nil, "empty etcd endpoint"},
		{"password without user", "", map[string]string{"password": "p"}, nil, "needs a user"},
		{"env password without user", "", nil, map[string]string{"GORUN_ETCD_PASSWORD": "p"}, "needs a user"},
		{"password and password_env", "", map[string]string{"user": "u", "password": "p", "password_env": "X"}, nil, "not both"},
		{"password_env unset", "", map[string]string{"user": "u", "password_env": "X"}, nil, "$X is not set"},
		{"unreadable cacert", "", map[string]string{"cacert": "/nonexistent/ca.pem"}, nil, "/nonexistent/ca.pem"},
		{"cert without key", "", map[string]string{"cert": certs.ClientCert}, nil, "both cert and key"},
		{"http with certificates", "", map[string]string{"protocol": "http", "cacert": certs.CAFile}, nil, "use protocol=https"},
		{"relative prefix", "", map[string]string{"prefix": "gorun"}, nil, "starting with /"},
		{"zero ttl", "", map[string]string{"lease_ttl": "0"}, nil, "lease_ttl=0"},
		{"bad start ttl", "", map[string]string{"start_lease_ttl": "soon"}, nil, "start_lease_ttl=soon"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			_, err := etcd.ParseRendezvousConf(tc.endpoint, tc.conf, envOf(tc.env))
			if !errors.Is(err, rendezvous.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v; want ErrInvalidArgument saying %q", err, tc.want)
			}
		})
	}
}

// envOf is a lookupEnv that sees env only.
func envOf(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := env[k]; return v, ok }
}

// TestStartTTL: the first lease's TTL grows with the job, 50 ms a node
// up to 120 s, never below lease_ttl (a job of up to 100 nodes keeps one
// lease at the defaults), and start_lease_ttl overrides the default.
func TestStartTTL(t *testing.T) {
	for _, tc := range []struct {
		name     string
		conf     map[string]string
		maxNodes int
		want     time.Duration
	}{
		{"small job: lease_ttl", nil, 64, 5 * time.Second},
		{"100 nodes: lease_ttl still", nil, 100, 5 * time.Second},
		{"512 nodes", nil, 512, 25600 * time.Millisecond},
		{"1,024 nodes", nil, 1024, 51200 * time.Millisecond},
		{"10,000 nodes: capped", nil, 10000, 120 * time.Second},
		{"a longer lease_ttl wins", map[string]string{"lease_ttl": "60"}, 512, 60 * time.Second},
		{"start_lease_ttl given", map[string]string{"start_lease_ttl": "7"}, 2, 7 * time.Second},
		{"start_lease_ttl below lease_ttl", map[string]string{"start_lease_ttl": "2", "lease_ttl": "3"}, 2048, 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := etcd.ParseRendezvousConf("", tc.conf, envOf(nil))
			if err != nil {
				t.Fatal(err)
			}
			if got := s.StartTTL(tc.maxNodes); got != tc.want {
				t.Fatalf("StartTTL(%d) = %v, want %v", tc.maxNodes, got, tc.want)
			}
		})
	}
}
