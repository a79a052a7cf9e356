package etcd_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous/etcd"
)

// startLiveness starts a Liveness for name in dir on its own client (a
// node of its own), closed by the test's cleanup.
func startLiveness(t *testing.T, cluster *etcdtest.Cluster, dir, name string, ttl time.Duration) (*etcd.Liveness, *clientv3.Client) {
	t.Helper()
	return startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: name, TTL: ttl})
}

func startLivenessConfig(t *testing.T, cluster *etcdtest.Cluster, cfg etcd.LivenessConfig) (*etcd.Liveness, *clientv3.Client) {
	t.Helper()
	cli := cluster.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := etcd.StartLiveness(ctx, cli, cfg)
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
	for !slices.Contains(a.Lost([]string{name}, since, since), name) {
		if time.Since(start) > within {
			t.Fatalf("%s not reported lost within %v", name, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

// TestLivenessLeaseExpires: a node that stops renewing its lease (its
// client is gone, as with a crashed agent) is reported lost by the others
// within about the TTL: its successor sees its key go and announces it.
func TestLivenessLeaseExpires(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, _ := startLiveness(t, cluster, dir, "a", time.Second)
	b, bcli := startLiveness(t, cluster, dir, "b", time.Second)
	if got := b.TTL(); got != time.Second {
		t.Fatalf("granted TTL %v; want 1s (the test cluster's minimum)", got)
	}
	since := a.Rev()
	// Both alive for several TTLs: renewals keep them.
	time.Sleep(2500 * time.Millisecond)
	if lost := a.Lost([]string{"a", "b", "c"}, since, since); len(lost) != 0 {
		t.Fatalf("lost %v while both renew (c never was)", lost)
	}
	bcli.Close() // b stops renewing, without revoking
	took := waitLost(t, a, "b", since, 5*time.Second)
	t.Logf("lease of 1s: node lost after %v", took)
	if lost := a.Lost([]string{"a"}, since, since); len(lost) != 0 {
		t.Fatalf("a lost itself: %v", lost)
	}
}

// TestLivenessRing: each node watches its own stretch of the directory;
// the node after a departed one in name order (wrapping around) is the
// one told (OnLapse), and every view hears of it. Two neighbours lost
// together (b deleted while c, its successor, hangs and cannot tell) are
// both told to d, which replays its wider stretch once c's key goes.
func TestLivenessRing(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	var mu sync.Mutex
	told := map[string][]string{} // by the node told: the departed
	views := map[string]*etcd.Liveness{}
	clients := map[string]*clientv3.Client{}
	for _, n := range []string{"b", "e", "d", "a", "c"} {
		views[n], clients[n] = startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: n, TTL: time.Second,
			OnLapse: func(name string) {
				mu.Lock()
				told[n] = append(told[n], name)
				mu.Unlock()
			}})
	}
	since := views["a"].Rev()
	waitTold := func(want map[string][]string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			mu.Lock()
			got := map[string][]string{}
			for k, v := range told {
				got[k] = slices.Sorted(slices.Values(v))
			}
			mu.Unlock()
			if fmt.Sprint(got) == fmt.Sprint(want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("told %v, want %v", got, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	ctx := testCtx(t, 30*time.Second)
	// a, the first in order: its successor is b.
	if err := views["a"].Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitTold(map[string][]string{"b": {"a"}})
	// e, the last: its successor wraps around to b, a being gone.
	if err := views["e"].Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitTold(map[string][]string{"b": {"a", "e"}})
	// c hangs (its client gone: no renewal, no watch), then b goes at
	// once: c cannot tell; d learns both once c's lease lapses.
	clients["c"].Close()
	if err := views["b"].Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitTold(map[string][]string{"b": {"a", "e"}, "d": {"b", "c"}})
	for _, n := range []string{"a", "b", "c", "e"} {
		waitLost(t, views["d"], n, since, 5*time.Second)
	}
	if lost := views["d"].Lost([]string{"d"}, since, since); len(lost) != 0 {
		t.Fatalf("d lost itself: %v", lost)
	}
}

// TestLivenessCostFlat: what a node's liveness receives does not grow
// with the number of nodes as a watch of the whole directory did (every
// node an event per later registration: n²/2 in all, n for the first).
// Nodes registering one after another, in a shuffled name order: the
// events a node gets grow with log n (how often a registration lands in
// its stretch of the ring), so 4 times the nodes may cost each a few
// more, never 4 times as many.
func TestLivenessCostFlat(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	perNode := map[int]float64{}
	for _, n := range []int{16, 64} {
		dir := fmt.Sprintf("/test/%s/%d/alive/", t.Name(), n)
		views := make([]*etcd.Liveness, n)
		for i, k := range rand.New(rand.NewPCG(1, uint64(n))).Perm(n) {
			views[i], _ = startLiveness(t, cluster, dir, fmt.Sprintf("node%03d", k), 5*time.Second)
		}
		time.Sleep(500 * time.Millisecond) // the last rings settle
		var total, most int64
		for _, v := range views {
			total += v.Events()
			most = max(most, v.Events())
		}
		perNode[n] = float64(total) / float64(n)
		t.Logf("%d nodes: %d ring and news events in all, %.1f a node, at most %d (a directory watch: about %d in all, at most %d)",
			n, total, perNode[n], most, n*n/2, n-1)
		if n == 64 && most >= int64(n/3) {
			t.Errorf("%d nodes: a node got %d events", n, most)
		}
	}
	if perNode[64] > 2*perNode[16]+1 {
		t.Errorf("events a node: %.1f at 16 nodes, %.1f at 64: growing with n", perNode[16], perNode[64])
	}
}

// TestLivenessCloseRevokes: a node that closes cleanly is gone at once
// for the others, not a TTL (20 s) later.
func TestLivenessCloseRevokes(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, _ := startLiveness(t, cluster, dir, "a", 20*time.Second)
	b, _ := startLiveness(t, cluster, dir, "b", 20*time.Second)
	ctx := testCtx(t, 30*time.Second)
	since := a.Rev()
	start := time.Now()
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// At once, not when the 20-s lease would lapse. The TTL is long so
	// that the bound can leave room for a loaded machine: with 5-s
	// leases and a 4-s bound, the revocation's news took longer than
	// the bound twice while other packages' tests ran beside this one
	// on two cores (CI's once took over 2 s to deliver the watch event).
	took := waitLost(t, a, "b", since, 15*time.Second)
	t.Logf("closed node seen gone %v after Close began", time.Since(start).Round(time.Millisecond))
	if took > 10*time.Second {
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
	since := b.Rev()
	old := a.LeaseID()
	if _, err := acli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	waitLost(t, b, "a", since, 5*time.Second)
	waitLost(t, a, "a", since, 5*time.Second)
	// a comes back under a new lease and says so: for a mark taken once
	// b has heard it, its return is forgiven.
	var now int64
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		now = b.Rev()
		if len(b.Lost([]string{"a"}, since, now)) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("b never heard a came back")
		}
	}
	if a.LeaseID() == old {
		t.Fatal("a back under its old lease")
	}
	if lost := b.Lost([]string{"a", "b"}, now, now); len(lost) != 0 {
		t.Fatalf("after a registered again: lost %v since the new mark", lost)
	}
	if lost := b.Lost([]string{"a"}, since, since); len(lost) != 1 {
		t.Fatalf("a not lost since the old mark: %v", lost)
	}
	if b.Departures(since, now) {
		t.Fatal("Departures(since, back): a departure not forgiven by its return")
	}
	if _, err := acli.Revoke(ctx, a.LeaseID()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(b.Lost([]string{"a"}, since, now)) != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a lapsed again after the mark back, and is not lost")
		}
	}
}

// TestLivenessQuiet: a node whose job is over tells of no departure (at a
// job's end every node leaves, and each departure told to all those still
// watching costs etcd O(N²) events); the news of others still reaches it.
func TestLivenessQuiet(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	told := make(chan string, 4)
	onLapse := func(name string) { told <- name }
	a, _ := startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: time.Second, OnLapse: onLapse})
	b, _ := startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: "b", TTL: time.Second, OnLapse: onLapse})
	c, _ := startLivenessConfig(t, cluster, etcd.LivenessConfig{Dir: dir, Name: "c", TTL: time.Second, OnLapse: onLapse})
	since := c.Rev()
	ctx := testCtx(t, 20*time.Second)
	b.Quiet() // a's successor
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-told:
		t.Fatalf("told of %s's departure by a quiet successor", n)
	case <-time.After(1500 * time.Millisecond):
	}
	if lost := c.Lost([]string{"a"}, since, since); len(lost) != 0 {
		t.Fatalf("a quiet node announced a's departure: %v", lost)
	}
	// c, not quiet, tells of b's departure.
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-told:
		if n != "b" {
			t.Fatalf("told of %s, want b", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("c never told of b's departure")
	}
	waitLost(t, c, "b", since, 5*time.Second)
}

// TestLivenessAnnounceRetried: the successor's first announcement of a
// departure fails (etcd too slow to answer within the TTL, under load):
// it tries again, and every view reports the node lost. (One failed put
// left the node unreported for the rest of the job: the launcher's
// TestEtcdWatchAfterLeaseLapse failed so under CI's load.) Where the
// failed put had landed (only its reply lost), the view counts the
// departure once.
//
// A retry does not put the news again where it landed: with the view's
// watch slow (the answers of a swamped etcd), a retry whose view had not
// heard its landed news yet put it again, one more event to every node.
func TestLivenessAnnounceRetried(t *testing.T) {
	for _, tc := range []struct {
		name      string
		landed    bool          // the first put reaches etcd; its reply is lost
		slowWatch time.Duration // each of the announcer's watch answers this late
	}{
		{"put lost", false, 0},
		{"reply lost", true, 0},
		{"reply lost, heard late", true, 1500 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cluster := etcdtest.Start(t, 1, etcdtest.Options{})
			dir := fmt.Sprintf("/test/%s/alive/", t.Name())
			news := strings.TrimSuffix(dir, "/") + ".news"
			var puts, failed atomic.Int32
			unary := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				txn, ok := req.(*etcdserverpb.TxnRequest)
				if !ok || len(txn.Compare) != 1 || string(txn.Compare[0].Key) != news {
					return invoker(ctx, method, req, reply, cc, opts...)
				}
				if puts.Add(1) > 1 {
					return invoker(ctx, method, req, reply, cc, opts...)
				}
				failed.Add(1)
				if tc.landed {
					if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
						return err
					}
				}
				return status.Error(codes.DeadlineExceeded, "the first announcement fails (the test)")
			}
			stream := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				s, err := streamer(ctx, desc, cc, method, opts...)
				if err != nil || tc.slowWatch == 0 || !strings.HasSuffix(method, "/Watch") {
					return s, err
				}
				return &lateAnswers{ClientStream: s, late: new(atomic.Int32), by: tc.slowWatch, first: 1 << 30}, nil
			}
			cli, err := clientv3.New(clientv3.Config{
				Endpoints: cluster.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
				DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(unary), grpc.WithChainStreamInterceptor(stream)},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cli.Close() })
			a, _ := startLiveness(t, cluster, dir, "a", time.Second)
			ctx := testCtx(t, 20*time.Second)
			b, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: "b", TTL: time.Second}) // a's successor
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { b.Close(context.Background()) })
			c, _ := startLiveness(t, cluster, dir, "c", time.Second)
			since := c.Rev()
			if err := a.Close(ctx); err != nil {
				t.Fatal(err)
			}
			waitLost(t, c, "a", since, 5*time.Second)
			waitLost(t, b, "a", since, 5*time.Second)
			// Counted once: news told again after the view heard it
			// (or a retry whose first put had landed) is no new
			// departure for a mark taken since.
			mark := c.Rev()
			time.Sleep(4 * 250 * time.Millisecond) // past announce's next tries
			if lost := c.Lost([]string{"a"}, mark, mark); len(lost) != 0 {
				t.Fatalf("a lost again after the mark: %v", lost)
			}
			if failed.Load() != 1 {
				t.Fatalf("%d announcements failed, want the first one", failed.Load())
			}
			if !tc.landed && puts.Load() < 2 {
				t.Fatalf("a put lost, and %d announcements: not tried again", puts.Load())
			}
			if tc.slowWatch > 0 && puts.Load() < 2 {
				t.Fatalf("%d announcements: a retry before the news was heard, wanted", puts.Load())
			}
			resp, err := cli.Get(ctx, news)
			if err != nil || len(resp.Kvs) != 1 {
				t.Fatalf("the news key: %+v, %v", resp, err)
			}
			if v := resp.Kvs[0].Version; v != 1 {
				t.Fatalf("the news of a's departure put %d times (%d tries), want once", v, puts.Load())
			}
		})
	}
}

// TestLivenessNewsTwice: the same departure told twice (an announcement
// tried again whose first put had landed) counts once: a node that came
// back in between is not lost a second time.
func TestLivenessNewsTwice(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	news := strings.TrimSuffix(dir, "/") + ".news"
	a, cli := startLiveness(t, cluster, dir, "a", time.Second)
	ctx := testCtx(t, 20*time.Second)
	put := func(v string) int64 {
		t.Helper()
		resp, err := cli.Put(ctx, news, v)
		if err != nil {
			t.Fatal(err)
		}
		rev := resp.Header.Revision
		for deadline := time.Now().Add(5 * time.Second); a.Rev() < rev; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the view never heard %q", v)
			}
		}
		return rev
	}
	before := a.Rev()
	put("lost z 5")
	put("back z 7")
	mark := a.Rev()
	if lost := a.Lost([]string{"z"}, before, mark); len(lost) != 0 {
		t.Fatalf("z lost and back before the mark: lost %v", lost)
	}
	put("lost z 5") // the first departure again
	if lost := a.Lost([]string{"z"}, mark, mark); len(lost) != 0 {
		t.Fatalf("a departure told twice lost z again after its return: %v", lost)
	}
	put("lost z 9") // a new one
	if lost := a.Lost([]string{"z"}, mark, mark); len(lost) != 1 {
		t.Fatalf("z's second departure not reported: %v", lost)
	}
}

// TestLivenessFirstRenewalFromTheGrant: a registration whose put of the
// presence key answers late (a busy etcd) has spent part of its lease's
// TTL by then; the first renewal is due a third of the TTL after the
// grant was asked for, not after the registration returned, and the lease
// lives on. (Renewing a third of the TTL after the return let 45 of 512
// agents' leases expire before their first renewal.)
func TestLivenessFirstRenewalFromTheGrant(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	const ttl = 4 * time.Second
	var delayed atomic.Bool
	cli := interceptedClient(t, cluster, func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if _, ok := req.(*etcdserverpb.TxnRequest); ok && delayed.CompareAndSwap(false, true) {
			time.Sleep(ttl * 8 / 10) // the presence key's first put (the registration's txn) answers late
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	ctx := testCtx(t, 20*time.Second)
	l, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close(context.Background()) })
	if l.TTL() != ttl {
		t.Skipf("etcd granted a TTL of %v, not %v", l.TTL(), ttl)
	}
	first := l.LeaseID()
	time.Sleep(ttl + ttl/2)
	if !delayed.Load() {
		t.Fatal("the registration was not delayed")
	}
	if got := l.LeaseID(); got != first {
		t.Fatalf("the lease %x expired before its first renewal (now %x)", first, got)
	}
}

// TestLivenessRegistersThroughASlowEtcd: a node whose registration etcd
// cannot settle (here, a member without a quorum: its requests time out,
// as a member swamped by 1,024 starting agents timed out 28 of their
// presence keys, each of which then ended its agent) registers once etcd
// answers again, within its context; one whose context ends first fails.
func TestLivenessRegistersThroughASlowEtcd(t *testing.T) {
	cluster := etcdtest.Start(t, 3, etcdtest.Options{})
	m := cluster.Members[0]
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{m.ClientURL}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := testCtx(t, 60*time.Second)
	for _, o := range cluster.Members[1:] {
		o.Stop()
	}
	// A short context: the quorum is not back before it ends.
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = etcd.StartLiveness(sctx, cli, etcd.LivenessConfig{Dir: "/slow/", Name: "early", TTL: 2 * time.Second})
	cancel()
	if err == nil {
		t.Fatal("registered without a quorum")
	}
	type result struct {
		l   *etcd.Liveness
		err error
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		l, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: "/slow/", Name: "a", TTL: 2 * time.Second})
		done <- result{l, err}
	}()
	// Past the member's own request timeout (5 s and two elections: 6 s
	// on this cluster), so that it answers "request timed out".
	time.Sleep(8 * time.Second)
	select {
	case r := <-done:
		t.Fatalf("StartLiveness returned without a quorum: %v", r.err)
	default:
	}
	for _, o := range cluster.Members[1:] {
		if err := o.Restart(ctx); err != nil {
			t.Fatal(err)
		}
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("StartLiveness after %v, the quorum back: %v", time.Since(start).Round(time.Millisecond), r.err)
	}
	defer r.l.Close(ctx)
	resp, err := cli.Get(ctx, "/slow/a")
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("the presence key after the registration: %+v, %v", resp, err)
	}
}

// TestLivenessRenewsOnOneStream: a node renews its lease on one
// LeaseKeepAlive stream, not one per renewal (820 streams opened a second
// at 1,024 agents, a quarter of etcd's CPU). Counted by etcd itself.
func TestLivenessRenewsOnOneStream(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	before := keepAliveStreams(t, cluster)
	a, cli := startLiveness(t, cluster, dir, "a", time.Second)
	ctx := testCtx(t, 10*time.Second)
	first, err := a.Lease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // a renewal every third of a second: 9
	opened := keepAliveStreams(t, cluster) - before
	if opened < 1 || opened > 2 {
		t.Fatalf("%d LeaseKeepAlive streams opened in 3 s of 1-s leases, want 1 (2 if one was given up)", opened)
	}
	// Renewed all along: the first lease, three TTLs on.
	if now, err := a.Lease(ctx); err != nil || now != first {
		t.Fatalf("lease %x (%v), registered with %x", now, err, first)
	}
	if ttl, err := cli.TimeToLive(ctx, first); err != nil || ttl.TTL < 0 || ttl.GrantedTTL == 0 { // TTL: whole seconds left, -1 when gone
		t.Fatalf("lease %x: time to live %+v (%v)", first, ttl, err)
	}
}

// TestLivenessKeepsTheStreamThroughLateAnswers: renewals whose answers
// come later than a renewal waits (a swamped etcd) keep their stream, and
// the late answers renew the lease: a renewer that gave up the stream at
// each late answer opened a stream per renewal on a slow etcd.
func TestLivenessKeepsTheStreamThroughLateAnswers(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	const ttl = time.Second
	var late atomic.Int32 // answers delayed so far
	cli := lateAnswersClient(t, cluster, func(s grpc.ClientStream) grpc.ClientStream {
		return &lateAnswers{ClientStream: s, late: &late, by: ttl / 2, first: 6}
	})
	ctx := testCtx(t, 20*time.Second)
	before := keepAliveStreams(t, cluster)
	a, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: "a", TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(context.Background()) })
	if a.TTL() != ttl {
		t.Skipf("etcd granted a TTL of %v, not %v", a.TTL(), ttl)
	}
	first := a.LeaseID()
	for late.Load() < 6 { // half a TTL each, more than the third a renewal waits
		if ctx.Err() != nil {
			t.Fatalf("%d answers delayed", late.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(ttl)
	if opened := keepAliveStreams(t, cluster) - before; opened != 1 {
		t.Fatalf("%d LeaseKeepAlive streams opened through 6 late answers, want 1", opened)
	}
	if got := a.LeaseID(); got != first {
		t.Fatalf("the lease %x was taken for lost through late answers (now %x)", first, got)
	}
}

// lateAnswersClient is a client of cluster whose LeaseKeepAlive streams
// are wrapped by wrap (in a lateAnswers), closed by the test's cleanup.
func lateAnswersClient(t *testing.T, cluster *etcdtest.Cluster, wrap func(grpc.ClientStream) grpc.ClientStream) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: cluster.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainStreamInterceptor(
			func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				s, err := streamer(ctx, desc, cc, method, opts...)
				if err != nil || !strings.HasSuffix(method, "/LeaseKeepAlive") {
					return s, err
				}
				return wrap(s), nil
			})},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// lateAnswers delays the first answers of a stream (less when the stream
// ends meanwhile); holding counts those being delayed now.
type lateAnswers struct {
	grpc.ClientStream
	late    *atomic.Int32
	holding *atomic.Int32 // may be nil
	by      time.Duration
	first   int32
}

func (s *lateAnswers) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil && s.late.Load() < s.first {
		if s.holding != nil {
			s.holding.Add(1)
			defer s.holding.Add(-1)
		}
		select {
		case <-time.After(s.by):
		case <-s.Context().Done():
		}
		s.late.Add(1)
	}
	return err
}

// keepAliveStreams is how many LeaseKeepAlive streams etcd has opened
// (its own metric, grpc_server_started_total).
func keepAliveStreams(t *testing.T, cluster *etcdtest.Cluster) int {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(cluster.Endpoints()[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, "grpc_server_started_total{") && strings.Contains(line, `grpc_method="LeaseKeepAlive"`) {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err != nil {
				t.Fatalf("etcd metric %q: %v", line, err)
			}
			n += int(v)
		}
	}
	return n
}

// TestLivenessReturnTellsDeparture: a node whose lease was lost tells its
// return in one news event, which every view takes for its departure as
// well: at 1,024 agents each lapse's "lost" and "back" were two events to
// every agent. Its successor here is quiet, so the return is all the
// news there is.
func TestLivenessReturnTellsDeparture(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	a, acli := startLiveness(t, cluster, dir, "a", time.Second)
	b, _ := startLiveness(t, cluster, dir, "b", time.Second)
	b.Quiet() // a's successor: a tells its departure alone
	ctx := testCtx(t, 20*time.Second)
	head, err := acli.Get(ctx, "/")
	if err != nil {
		t.Fatal(err)
	}
	news := acli.Watch(ctx, strings.TrimSuffix(dir, "/")+".news", clientv3.WithRev(head.Header.Revision+1))
	since := b.Rev()
	if _, err := acli.Revoke(ctx, a.LeaseID()); err != nil {
		t.Fatal(err)
	}
	waitLost(t, b, "a", since, 5*time.Second)
	waitLost(t, a, "a", since, 5*time.Second)
	var told []string
	for quiet := time.After(time.Second); ; {
		select {
		case resp := <-news:
			for _, ev := range resp.Events {
				told = append(told, string(ev.Kv.Value))
			}
			continue
		case <-quiet:
		}
		break
	}
	if len(told) != 1 || !strings.HasPrefix(told[0], "back a ") {
		t.Fatalf("news of a's lapse: %q, want one return", told)
	}
	if lost := b.Lost([]string{"a"}, b.Rev(), b.Rev()); len(lost) != 0 {
		t.Fatalf("a lost since its return: %v", lost)
	}
}

// TestLivenessReadsAreBounded: every range a node's liveness reads is one
// that etcd answers by reading at most what it returns: no sorted range
// (etcd reads every key of one before it applies the limit) and none
// without a limit. Its predecessor read was a descending range of the
// directory: half of it read at every ring change, by every node. Then
// the ring it finds is the right one, in name order, wrapping around.
func TestLivenessReadsAreBounded(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := fmt.Sprintf("/test/%s/alive/", t.Name())
	var mu sync.Mutex
	var unbounded []string
	cli := interceptedClient(t, cluster, func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*etcdserverpb.RangeRequest); ok && len(r.RangeEnd) > 0 && (r.SortOrder != etcdserverpb.RangeRequest_NONE || r.Limit == 0) {
			mu.Lock()
			unbounded = append(unbounded, fmt.Sprintf("%q..%q sort %v limit %d", r.Key, r.RangeEnd, r.SortOrder, r.Limit))
			mu.Unlock()
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	var told sync.Map // the departed → the node told
	start := func(name string) *etcd.Liveness {
		ctx := testCtx(t, 10*time.Second)
		l, err := etcd.StartLiveness(ctx, cli, etcd.LivenessConfig{Dir: dir, Name: name, TTL: time.Second,
			OnLapse: func(gone string) { told.Store(gone, name) }})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close(context.Background()) })
		return l
	}
	// Names one of which begins another: "ab" comes before "abc".
	views := map[string]*etcd.Liveness{}
	for _, n := range []string{"abc", "b", "ab", "a"} {
		views[n] = start(n)
	}
	time.Sleep(300 * time.Millisecond) // the rings settle
	for _, tt := range []struct{ gone, successor string }{{"ab", "abc"}, {"b", "a"}, {"abc", "a"}} {
		if err := views[tt.gone].Close(testCtx(t, 5*time.Second)); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			if who, ok := told.Load(tt.gone); ok {
				if who != tt.successor {
					t.Fatalf("%s's departure told to %v, want %s", tt.gone, who, tt.successor)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s's departure told to no one", tt.gone)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(unbounded) > 0 {
		t.Fatalf("ranges etcd reads whole: %v", unbounded)
	}
}
