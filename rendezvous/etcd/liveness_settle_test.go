package etcd_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// grantedTTL is the TTL etcd granted lease id (0: etcd knows it no more).
func grantedTTL(t *testing.T, ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID) int64 {
	t.Helper()
	r, err := cli.TimeToLive(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if r.TTL < 0 { // -1: not found (0 is under a second left)
		return 0
	}
	return r.GrantedTTL
}

// keyLease is the lease etcd key k is bound to (0: no such key).
func keyLease(t *testing.T, ctx context.Context, cli *clientv3.Client, k string) clientv3.LeaseID {
	t.Helper()
	r, err := cli.Get(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Kvs) == 0 {
		return 0
	}
	return clientv3.LeaseID(r.Kvs[0].Lease)
}

// waitNewLease waits until l's lease is other than old and returns it.
func waitNewLease(t *testing.T, l *etcd.Liveness, old clientv3.LeaseID, within time.Duration) clientv3.LeaseID {
	t.Helper()
	for deadline := time.Now().Add(within); l.LeaseID() == old; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("lease still %x after %v", old, within)
		}
	}
	return l.LeaseID()
}

// TestLivenessSettleShortens: a node starts on its long lease (StartTTL)
// and Settle moves its key and order index entry onto a lease of TTL,
// within a tenth of StartTTL, quietly: no news, no departure in any view,
// and the old lease left to expire (the tokens under it outlive any
// retry). From then on a node that stops renewing is found lost within
// about TTL, not StartTTL.
func TestLivenessSettleShortens(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	ctx := testCtx(t, 30*time.Second)
	a, acli := startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: time.Second, StartTTL: 4 * time.Second})
	b, bcli := startLiveness(t, cluster, dir, "b", time.Second)
	if got := a.TTL(); got != 4*time.Second {
		t.Fatalf("TTL before Settle %v, want the StartTTL 4s", got)
	}
	long := a.LeaseID()
	if got := grantedTTL(t, ctx, bcli, long); got != 4 {
		t.Fatalf("etcd granted the first lease %d s, want 4", got)
	}
	news := strings.TrimSuffix(dir, "/") + ".news"
	since := b.Rev()
	start := time.Now()
	a.Settle()
	a.Settle()                                       // idempotent
	short := waitNewLease(t, a, long, 2*time.Second) // the delay: up to 0.4 s
	t.Logf("lease shortened %v after Settle", time.Since(start).Round(time.Millisecond))
	if got := a.TTL(); got != time.Second {
		t.Fatalf("TTL after Settle %v, want 1s", got)
	}
	if got := grantedTTL(t, ctx, bcli, short); got != 1 {
		t.Fatalf("etcd granted the short lease %d s, want 1", got)
	}
	if got := keyLease(t, ctx, bcli, dir+"a"); got != short {
		t.Fatalf("a's key on lease %x, want the short %x", got, short)
	}
	order, err := bcli.Get(ctx, strings.TrimSuffix(dir, "/")+".order/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	onShort := 0
	for _, kv := range order.Kvs {
		if clientv3.LeaseID(kv.Lease) == short {
			onShort++
		}
	}
	if onShort != 1 {
		t.Fatalf("%d order index entries on the short lease, want a's one", onShort)
	}
	if grantedTTL(t, ctx, bcli, long) == 0 {
		t.Fatal("the long lease was revoked; it is to be left to expire")
	}
	// Two short TTLs on: the short lease is renewed, and nobody heard of
	// a departure.
	time.Sleep(2 * time.Second)
	if lost := b.Lost([]string{"a"}, since, since); len(lost) != 0 {
		t.Fatalf("a lost after shortening its lease: %v", lost)
	}
	if r, err := bcli.Get(ctx, news); err != nil || len(r.Kvs) != 0 {
		t.Fatalf("news after a quiet shortening: %v %v", r.Kvs, err)
	}
	acli.Close() // a stops renewing, without revoking
	took := waitLost(t, b, "a", since, 4*time.Second)
	t.Logf("after Settle, a node that stopped renewing was lost in %v (TTL 1s, StartTTL 4s)", took)
}

// TestLivenessSettleAfterALapse: a node whose long lease is gone when it
// settles registers again, and on a short lease: it settled.
func TestLivenessSettleAfterALapse(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	ctx := testCtx(t, 30*time.Second)
	a, acli := startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: time.Second, StartTTL: 4 * time.Second})
	long := a.LeaseID()
	if _, err := acli.Revoke(ctx, long); err != nil {
		t.Fatal(err)
	}
	a.Settle()
	next := waitNewLease(t, a, long, 5*time.Second)
	if got := grantedTTL(t, ctx, acli, next); got != 1 {
		t.Fatalf("registered again on a lease of %d s, want the short 1", got)
	}
	for deadline := time.Now().Add(3 * time.Second); keyLease(t, ctx, acli, dir+"a") != next; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a's key not on its new lease %x", next)
		}
	}
}

// TestLivenessOwnKeyDeleted: a node whose key is deleted while its lease
// lives (by an operator, or a shortening whose outcome was lost) hears
// its successor announce it lost and registers again, rather than renew
// a lease that holds no key for the rest of the job. The delete leaves
// the key's order index entry: a successor that reads its predecessor
// only after the delete (5 of 8 runs on a loaded machine) finds it in
// the index and must announce it all the same.
func TestLivenessOwnKeyDeleted(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	ctx := testCtx(t, 30*time.Second)
	a, acli := startLiveness(t, cluster, dir, "a", time.Second)
	b, _ := startLiveness(t, cluster, dir, "b", time.Second)
	since := b.Rev()
	old := a.LeaseID()
	if _, err := acli.Delete(ctx, dir+"a"); err != nil {
		t.Fatal(err)
	}
	waitLost(t, b, "a", since, 3*time.Second)
	next := waitNewLease(t, a, old, 3*time.Second)
	for deadline := time.Now().Add(3 * time.Second); keyLease(t, ctx, acli, dir+"a") != next; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a's key not back on its new lease %x", next)
		}
	}
	// Its return heard: a mark taken now finds it present.
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		now := b.Rev()
		if len(b.Lost([]string{"a"}, since, now)) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("b never heard a came back")
		}
	}
}

// TestLivenessCloseAtOnce: Close returns at once while a renewal waits
// for its answer: it does not wait out the third of the (start) TTL that
// a renewal may wait, 5 s here.
func TestLivenessCloseAtOnce(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	var late, holding atomic.Int32
	cli := lateAnswersClient(t, cluster, func(s grpc.ClientStream) grpc.ClientStream {
		return &lateAnswers{ClientStream: s, late: &late, holding: &holding, by: time.Minute, first: 1}
	})
	ctx := testCtx(t, 30*time.Second)
	a, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: time.Second, StartTTL: 15 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for holding.Load() == 0 { // the first renewal, due 5 s after the grant, answered late
		if ctx.Err() != nil {
			t.Fatal("no renewal's answer held")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	if err := a.Close(cctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Close took %v while a renewal waited for its answer; want at once", took)
	}
}

// TestLivenessSettleWaitsForPromptRenewals: the lease is shortened only
// after a renewal that etcd answered promptly (etcd keeps up): while the
// renewals' answers come late, as from an etcd whose apply lags, the long
// lease stays, and no grant is added to the load.
func TestLivenessSettleWaitsForPromptRenewals(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	var late atomic.Int32
	const lateAnswered = 3
	cli := lateAnswersClient(t, cluster, func(s grpc.ClientStream) grpc.ClientStream {
		return &lateAnswers{ClientStream: s, late: &late, by: 500 * time.Millisecond, first: lateAnswered}
	})
	ctx := testCtx(t, 30*time.Second)
	a, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: time.Second, StartTTL: 6 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(context.Background()) })
	long := a.LeaseID()
	a.Settle()
	waitNewLease(t, a, long, 20*time.Second)
	if n := late.Load(); n != lateAnswered {
		t.Fatalf("shortened after %d late answers; want after all %d, at the first prompt one", n, lateAnswered)
	}
	if got := a.TTL(); got != time.Second {
		t.Fatalf("TTL after shortening %v, want 1s", got)
	}
}
