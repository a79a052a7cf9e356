package etcd_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// startLiveness starts a Liveness for name in dir on its own client (a
// node of its own), closed by the test's cleanup.
func startLiveness(t *testing.T, cluster *etcdtest.Cluster, dir, name string, ttl time.Duration) (*etcd.Liveness, *clientv3.Client) {
	t.Helper()
	cli := cluster.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: name, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		l.Close(ctx)
	})
	return l, cli
}

// waitLost waits until a reports name lost since rev and returns how long
// that took.
func waitLost(t *testing.T, a *etcd.Liveness, name string, since int64, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for !slices.Contains(a.Lost([]string{name}, since, since, true), name) {
		if time.Since(start) > within {
			t.Fatalf("%s not reported lost within %v", name, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

// TestLivenessLeaseExpires: a node that stops renewing its lease (its
// client is gone, as with a crashed agent) is reported lost by the others
// within about the TTL, through their watch.
func TestLivenessLeaseExpires(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, _ := startLiveness(t, cluster, dir, "a", time.Second)
	b, bcli := startLiveness(t, cluster, dir, "b", time.Second)
	if got := b.TTL(); got != time.Second {
		t.Fatalf("granted TTL %v; want 1s (the test cluster's minimum)", got)
	}
	ctx := testCtx(t, 20*time.Second)
	since, err := a.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Both alive for several TTLs: renewals keep them.
	time.Sleep(2500 * time.Millisecond)
	if lost := a.Lost([]string{"a", "b"}, since, since, true); len(lost) != 0 {
		t.Fatalf("lost %v while both renew", lost)
	}
	if lost := a.Lost([]string{"c"}, since, since, true); !slices.Equal(lost, []string{"c"}) {
		t.Fatalf("a node never seen: lost %v, want [c]", lost)
	}
	if lost := a.Lost([]string{"c"}, since, since, false); len(lost) != 0 {
		t.Fatalf("a node never seen, absence not counted: lost %v, want none", lost)
	}
	bcli.Close() // b stops renewing, without revoking
	took := waitLost(t, a, "b", since, 5*time.Second)
	t.Logf("lease of 1s: node lost after %v", took)
	if lost := a.Lost([]string{"a"}, since, since, true); len(lost) != 0 {
		t.Fatalf("a lost itself: %v", lost)
	}
}

// TestLivenessSuccessor: the present node after a name, in name order,
// wrapping around, as every node's view names it; a node gone is skipped.
func TestLivenessSuccessor(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	views := map[string]*etcd.Liveness{}
	for _, n := range []string{"b", "d", "a", "c"} {
		views[n], _ = startLiveness(t, cluster, dir, n, 5*time.Second)
	}
	ctx := testCtx(t, 20*time.Second)
	for _, v := range views {
		if _, err := v.Sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	check := func(want map[string]string) {
		t.Helper()
		for name, v := range views {
			for of, w := range want {
				if got := v.Successor(of); got != w {
					t.Errorf("%s's view: Successor(%q) = %q, want %q", name, of, got, w)
				}
			}
		}
	}
	check(map[string]string{"a": "b", "b": "c", "c": "d", "d": "a", "bb": "c", "z": "a"})
	if err := views["c"].Close(ctx); err != nil {
		t.Fatal(err)
	}
	delete(views, "c")
	for _, v := range views {
		if _, err := v.Sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	check(map[string]string{"b": "d", "c": "d", "d": "a"})
}

// TestLivenessCloseRevokes: a node that closes cleanly is gone at once
// for the others, not a TTL later.
func TestLivenessCloseRevokes(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, _ := startLiveness(t, cluster, dir, "a", 5*time.Second)
	b, _ := startLiveness(t, cluster, dir, "b", 5*time.Second)
	ctx := testCtx(t, 20*time.Second)
	since, err := a.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if took := waitLost(t, a, "b", since, 2*time.Second); took > time.Second {
		t.Fatalf("closed node seen gone after %v; want at once", took)
	}
}

// TestLivenessLeaseLostAndBack: a node's lease is revoked under it (as when
// etcd expired it during a long pause): the node registers again with a
// new lease, but every view, its own included, reports it lost since
// before, so the round it was in ends.
func TestLivenessLeaseLostAndBack(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, acli := startLiveness(t, cluster, dir, "a", time.Second)
	b, _ := startLiveness(t, cluster, dir, "b", time.Second)
	ctx := testCtx(t, 20*time.Second)
	since, err := b.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	old := a.LeaseID()
	if _, err := acli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	waitLost(t, b, "a", since, 5*time.Second)
	waitLost(t, a, "a", since, 5*time.Second)
	// a comes back under a new lease: present again for a new mark.
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := acli.Get(ctx, dir+"a")
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Kvs) == 1 && clientv3.LeaseID(r.Kvs[0].Lease) != old {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a did not register again: %v", r.Kvs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	now, err := b.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if lost := b.Lost([]string{"a", "b"}, now, now, true); len(lost) != 0 {
		t.Fatalf("after a registered again: lost %v since the new mark", lost)
	}
	if lost := b.Lost([]string{"a"}, since, since, false); len(lost) != 1 {
		t.Fatalf("a not lost since the old mark: %v", lost)
	}
	// Marked back once it had returned (a round that formed while it
	// lapsed and came back): its return is forgiven, not a later lapse.
	if lost := b.Lost([]string{"a"}, since, now, false); len(lost) != 0 {
		t.Fatalf("a lost since the old mark though it was back by %d: %v", now, lost)
	}
	if deleted, present := b.Departures(since, now); deleted || present != 2 {
		t.Fatalf("Departures(since, back) = %v, %d; want none forgiven away and 2 present", deleted, present)
	}
	if _, err := acli.Revoke(ctx, a.LeaseID()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(b.Lost([]string{"a"}, since, now, false)) != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a lapsed again after the mark back, and is not lost")
		}
	}
}
