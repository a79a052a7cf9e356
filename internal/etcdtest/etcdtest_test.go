package etcdtest

import (
	"context"
	"net/url"
	"testing"
	"time"
)

func TestSingleMember(t *testing.T) {
	c := Start(t, 1, Options{})
	cli := c.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	r, err := cli.Get(ctx, "k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "v" {
		t.Fatalf("get = %v, %v", r, err)
	}
}

// TestClusterLeaderKilled: a 3-member cluster survives its leader's crash,
// elects another, and the old leader comes back with the data.
func TestClusterLeaderKilled(t *testing.T) {
	c := Start(t, 3, Options{})
	cli := c.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "before"); err != nil {
		t.Fatal(err)
	}
	old, err := c.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	old.Kill()
	if old.Running() {
		t.Fatal("killed member still running")
	}
	nu, err := c.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if nu == old {
		t.Fatal("the killed member is still the leader")
	}
	if _, err := cli.Put(ctx, "k", "after"); err != nil {
		t.Fatalf("put without the old leader: %v", err)
	}
	if err := old.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Leader(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := cli.Get(ctx, "k")
	if err != nil || len(r.Kvs) != 1 || string(r.Kvs[0].Value) != "after" {
		t.Fatalf("get after restart = %v, %v", r, err)
	}
}

// TestListenIP: members listen on, and advertise, the address asked for
// (127.0.0.2: on Linux every 127/8 address is loopback's, so this runs
// anywhere etcd does).
func TestListenIP(t *testing.T) {
	const ip = "127.0.0.2"
	c := Start(t, 1, Options{ListenIP: ip})
	for _, u := range []string{c.Members[0].ClientURL, c.Members[0].PeerURL} {
		pu, err := url.Parse(u)
		if err != nil || pu.Hostname() != ip {
			t.Fatalf("url %q: host %q (%v), want %s", u, pu.Hostname(), err, ip)
		}
	}
	cli := c.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
}
