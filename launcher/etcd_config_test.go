//go:build !gorun_noetcd

package launcher

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// TestEtcdSettingsThroughValidate: Validate parses the etcd backends'
// settings (rendezvous/etcd's ParseRendezvousConf, tested there) with the
// agent's environment, and reports their problems as ErrInvalidConfig.
func TestEtcdSettingsThroughValidate(t *testing.T) {
	old := lookupEnv
	lookupEnv = func(k string) (string, bool) {
		v, ok := map[string]string{"GORUN_ETCD_USER": "u", "GORUN_ETCD_PASSWORD": "p"}[k]
		return v, ok
	}
	t.Cleanup(func() { lookupEnv = old })
	cfg := func(conf map[string]string) Config {
		c := DefaultConfig()
		c.Entrypoint.Program = "x"
		c.MinNodes, c.MaxNodes = 2, 2
		c.Rendezvous = RendezvousConfig{Backend: backendEtcdV2, Endpoint: "etcd0,etcd1:2381", RunID: "job", Conf: conf}
		return c
	}
	c := cfg(map[string]string{"lease_ttl": "2", "prefix": "/jobs"})
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	s := c.rdzv.etcd
	if s.Client.Username != "u" || s.Client.Password != "p" || s.LeaseTTL != 2*time.Second || s.JobDir("job") != "/jobs/job/" ||
		strings.Join(s.Client.Endpoints, ",") != "etcd0,etcd1:2381" {
		t.Errorf("settings %+v", s)
	}
	for conf, want := range map[string]map[string]string{
		"lease_ttl=0":        {"lease_ttl": "0"},
		"starting with /":    {"prefix": "gorun"},
		"use protocol=https": {"protocol": "http", "cacert": "/x.pem"},
	} {
		c := cfg(want)
		if err := c.Validate(); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), conf) {
			t.Errorf("Validate(%v) = %v; want ErrInvalidConfig saying %q", want, err, conf)
		}
	}
}
