package cpu

import (
	"errors"
	"testing"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

func TestParseAddr(t *testing.T) {
	tests := []struct {
		in      string
		want    addrRecord
		wantErr bool
	}{
		{"10.0.0.7:4321 ff", addrRecord{tcp: "10.0.0.7:4321", nonce: 0xff}, false},
		{"[::1]:80 1a bootid/4026531840 @gorun-pgcpu-1a-3", addrRecord{tcp: "[::1]:80", nonce: 0x1a, hostKey: "bootid/4026531840", unix: "@gorun-pgcpu-1a-3"}, false},
		{"10.0.0.7:4321", addrRecord{}, true},
		{"10.0.0.7:4321 zz", addrRecord{}, true},
		{"[::1]:80 1a bootid/4026531840 @gorun-pgcpu-1a-3 shm", addrRecord{tcp: "[::1]:80", nonce: 0x1a, hostKey: "bootid/4026531840", unix: "@gorun-pgcpu-1a-3", shm: true}, false},
		{"10.0.0.7:4321 ff key", addrRecord{}, true},
		{"[::1]:80 1a bootid/4026531840 @gorun-pgcpu-1a-3 rdma", addrRecord{}, true},
	}
	for _, tt := range tests {
		got, err := parseAddr([]byte(tt.in))
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("parseAddr(%q) = %+v, %v; want %+v, error %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestHostKey(t *testing.T) {
	k := hostKey()
	if k == "" {
		t.Skip("no /proc boot id or network namespace here: pg/cpu uses TCP only")
	}
	if k != hostKey() {
		t.Errorf("hostKey is not stable: %q then %q", k, hostKey())
	}
}

func TestConfigLocalTransport(t *testing.T) {
	cfg := DefaultConfig()
	if cfg.LocalTransport != TransportShm {
		t.Errorf("default local transport %q, want shm", cfg.LocalTransport)
	}
	// Any store will do: validate only checks that there is one.
	cfg.Bootstrap = pg.Bootstrap{Store: rendezvous.NewPrefixStore("x", nil), Size: 1}
	if err := cfg.validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	for _, tr := range []string{TransportUnix, TransportShm, TransportTCP} {
		cfg.LocalTransport = tr
		if err := cfg.validate(); err != nil {
			t.Errorf("local transport %q: %v", tr, err)
		}
	}
	cfg.LocalTransport = "rdma"
	if err := cfg.validate(); !errors.Is(err, pg.ErrInvalidArgument) {
		t.Errorf("local transport \"rdma\": %v, want ErrInvalidArgument", err)
	}
}
