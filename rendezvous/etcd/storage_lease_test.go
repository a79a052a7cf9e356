package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// tokenLeases returns the leases of the tokens under prefix, one per
// token.
func tokenLeases(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix string) []clientv3.LeaseID {
	t.Helper()
	r, err := cli.Get(ctx, prefix+"m/t/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var ids []clientv3.LeaseID
	for _, kv := range r.Kvs {
		ids = append(ids, clientv3.LeaseID(kv.Lease))
	}
	return ids
}

// leaseCount is how many leases etcd holds.
func leaseCount(t *testing.T, ctx context.Context, cli *clientv3.Client) int {
	t.Helper()
	r, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return len(r.Leases)
}

// waitLease waits until l is bound to a lease other than old (it has
// registered again) and returns it.
func waitLease(t *testing.T, l *etcd.Liveness, old clientv3.LeaseID, within time.Duration) clientv3.LeaseID {
	t.Helper()
	for deadline := time.Now().Add(within); l.LeaseID() == old; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the liveness did not register again within %v", within)
		}
	}
	return l.LeaseID()
}

// TestStorageTokensUnderTheLiveness: a Storage given an agent's liveness
// lease (StorageConfig.Lease) puts its tokens under it and grants no lease
// of its own, so an agent holds one lease, not one per Storage (issue 19:
// 512 agents on two cores could not keep three each renewed). Its tokens
// go with the lease, and a read-modify-write after the lease is lost
// succeeds under the lease the agent registers again with, whether it
// comes before the agent noticed the loss (etcd refuses the token's put,
// and the Storage asks again) or after.
func TestStorageTokensUnderTheLiveness(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	for _, tc := range []struct {
		name string
		// registered: the next read-modify-write waits for the agent to
		// have registered again; otherwise it is made at once.
		registered bool
	}{
		{"read-modify-write right after the loss", false},
		{"read-modify-write once registered again", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t, 30*time.Second)
			dir := fmt.Sprintf("/test/%s/alive/", t.Name())
			prefix := fmt.Sprintf("/test/%s/store/", t.Name())
			live, cli := startLiveness(t, cluster, dir, "a", 2*time.Second)
			if n := leaseCount(t, ctx, cli); n != 1 {
				t.Fatalf("%d leases before the Storage; want the liveness's", n)
			}
			st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, Lease: live.Lease})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })

			for i := range 8 {
				if _, err := st.Add([]byte(fmt.Sprint("n", i)), 1); err != nil {
					t.Fatal(err)
				}
			}
			if err := st.QueuePush([]byte("q"), []byte("x")); err != nil {
				t.Fatal(err)
			}
			if v, _, err := st.QueuePop([]byte("q")); err != nil || string(v) != "x" {
				t.Fatalf("queue pop = %q, %v", v, err)
			}
			old := live.LeaseID()
			ids := tokenLeases(t, ctx, cli, prefix)
			if len(ids) == 0 {
				t.Fatal("no token written: the test tests nothing")
			}
			for _, id := range ids {
				if id != old {
					t.Fatalf("a token under lease %x; want the liveness's %x", id, old)
				}
			}
			if n := leaseCount(t, ctx, cli); n != 1 {
				t.Fatalf("%d leases with the Storage in use; want the liveness's alone", n)
			}

			// The agent's lease ends (as when etcd expired it): its
			// tokens go with it.
			if _, err := cli.Revoke(ctx, old); err != nil {
				t.Fatal(err)
			}
			if ids := tokenLeases(t, ctx, cli, prefix); len(ids) != 0 {
				t.Fatalf("%d tokens left after the liveness's lease was revoked", len(ids))
			}
			if tc.registered {
				waitLease(t, live, old, 10*time.Second)
			}
			if n, err := st.Add([]byte("n0"), 1); err != nil || n != 2 {
				t.Fatalf("add after the lease was lost = %d, %v; want 2", n, err)
			}
			now := live.LeaseID()
			if now == old {
				t.Fatal("the add succeeded under the revoked lease")
			}
			for _, id := range tokenLeases(t, ctx, cli, prefix) {
				if id != now {
					t.Fatalf("a token under lease %x after the loss; want the liveness's new %x", id, now)
				}
			}
			if n := leaseCount(t, ctx, cli); n != 1 {
				t.Fatalf("%d leases after the liveness registered again; want its new one alone", n)
			}

			// Close deletes the tokens and leaves the agent's lease,
			// and its presence, alone.
			if err := st.Close(); err != nil {
				t.Fatal(err)
			}
			if ids := tokenLeases(t, ctx, cli, prefix); len(ids) != 0 {
				t.Fatalf("%d tokens left after Close", len(ids))
			}
			if r, err := cli.TimeToLive(ctx, now); err != nil || r.TTL <= 0 {
				t.Fatalf("the liveness's lease after the Storage's Close: TTL %v, %v; want it alive", r, err)
			}
		})
	}
}

// TestStorageOwnLeaseRevoked: a Storage with a lease of its own whose
// lease is gone (revoked here; expired while etcd was out of reach) takes
// another at its next read-modify-write, which succeeds, rather than
// failing it until the lease's renewals learn of the loss (a third of
// its TTL, 20 s by default).
func TestStorageOwnLeaseRevoked(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 20*time.Second)
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	st := testStorage(t, ctx, cli)
	if _, err := st.Add([]byte("n"), 1); err != nil {
		t.Fatal(err)
	}
	ids := tokenLeases(t, ctx, cli, prefix)
	if len(ids) != 1 {
		t.Fatalf("%d tokens after an add; want 1", len(ids))
	}
	if _, err := cli.Revoke(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 3; i++ {
		if n, err := st.Add([]byte("n"), 1); err != nil || n != int64(i) {
			t.Fatalf("add %d after the tokens' lease was revoked = %d, %v; want %d", i, n, err, i)
		}
	}
	if now := tokenLeases(t, ctx, cli, prefix); len(now) != 1 || now[0] == ids[0] {
		t.Fatalf("tokens under %x after the revoke; want one under a new lease", now)
	}
	if n := leaseCount(t, ctx, cli); n != 1 {
		t.Fatalf("%d leases; want the Storage's new one alone", n)
	}
}

// TestStorageLostReplyAndLeaseGone: etcd applies a read-modify-write, its
// answer is lost, and the tokens' lease ends before the request is sent
// again, taking the token that would tell the retry that its first sending
// was applied. The operation fails rather than risk applying twice, saying
// the outcome is unknown (the rendezvous then reads the state back); a
// lease that lives through the retry makes it succeed (TestStorageLostReply).
// With the agent's liveness lease (TTL lease_ttl, seconds) under the tokens,
// a lapse within a retry is no longer far-fetched.
func TestStorageLostReplyAndLeaseGone(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	prefix := fmt.Sprintf("/test/%s/store/", t.Name())
	live, lcli := startLiveness(t, cluster, dir, "a", 2*time.Second)
	var arm atomic.Bool
	var revoked atomic.Int64
	lose := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		// A token's put, not the start's sweep of orphan chunks (a
		// transaction too, whenever it comes on a loaded machine).
		if tx, ok := req.(*etcdserverpb.TxnRequest); err == nil && ok && putsUnderLease(tx) && arm.CompareAndSwap(true, false) {
			if _, err := lcli.Revoke(ctx, live.LeaseID()); err == nil {
				revoked.Add(1)
			}
			return status.Error(codes.Unavailable, "reply lost by the test")
		}
		return err
	}
	cli := interceptedClient(t, cluster, lose)
	ctx := testCtx(t, 30*time.Second)
	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, Lease: live.Lease})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if n, err := st.Add([]byte("n"), 1); err != nil || n != 1 {
		t.Fatalf("add = %d, %v; want 1", n, err)
	}
	arm.Store(true)
	n, err := st.Add([]byte("n"), 1)
	if revoked.Load() != 1 {
		t.Fatal("the lease was not revoked after the lost reply: the test tests nothing")
	}
	v, _, gerr := st.Get([]byte("n"))
	if !errors.Is(err, rendezvous.ErrUnavailable) || !errors.Is(err, rendezvous.ErrOutcomeUnknown) || gerr != nil || string(v) != "2" {
		t.Fatalf("add whose reply was lost and whose token's lease went = %d, %v, and the counter is %q, %v; want ErrUnavailable, ErrOutcomeUnknown and 2 (applied once)",
			n, err, v, gerr)
	}
}

// putsUnderLease reports whether tx, nested transactions included, puts a
// key under a lease.
func putsUnderLease(tx *etcdserverpb.TxnRequest) bool {
	for _, op := range append(tx.Success, tx.Failure...) {
		if p := op.GetRequestPut(); p != nil && p.Lease != 0 {
			return true
		}
		if t := op.GetRequestTxn(); t != nil && putsUnderLease(t) {
			return true
		}
	}
	return false
}

// TestLivenessLease: Lease answers the node's current lease, the new one
// once the node has registered again, and none once closed.
func TestLivenessLease(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	live, cli := startLiveness(t, cluster, dir, "a", time.Second)
	ctx := testCtx(t, 20*time.Second)
	old, err := live.Lease(ctx)
	if err != nil || old != live.LeaseID() || old == clientv3.NoLease {
		t.Fatalf("Lease = %x, %v; want the key's %x", old, err, live.LeaseID())
	}
	if _, err := cli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	now := waitLease(t, live, old, 5*time.Second)
	if got, err := live.Lease(ctx); err != nil || got != now {
		t.Fatalf("Lease after registering again = %x, %v; want %x", got, err, now)
	}
	if err := live.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := live.Lease(ctx); !errors.Is(err, rendezvous.ErrClosed) {
		t.Fatalf("Lease after Close = %x, %v; want ErrClosed", got, err)
	}
}
