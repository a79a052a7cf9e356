//go:build !gorun_noetcd

package launcher

import (
	"context"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// etcdNodes makes the memberships of a job of len(addrs) nodes in cluster,
// one per address (in one process, nodes differ by address), closed by the
// test's cleanup.
func etcdNodes(t *testing.T, cluster *etcdtest.Cluster, addrs ...string) []*etcdNode {
	t.Helper()
	return etcdNodesOf(t, cluster, len(addrs), addrs...)
}

// etcdNodesOf is etcdNodes for a job of nnodes nodes: a node beyond them
// waits to join.
func etcdNodesOf(t *testing.T, cluster *etcdtest.Cluster, nnodes int, addrs ...string) []*etcdNode {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out []*etcdNode
	for _, addr := range addrs {
		cfg := DefaultConfig()
		cfg.Entrypoint.Program = "true"
		cfg.MinNodes, cfg.MaxNodes = nnodes, nnodes
		cfg.Rendezvous = RendezvousConfig{
			Backend: backendEtcd, Endpoint: strings.Join(cluster.HostPorts(), ","), RunID: "job", LocalAddr: addr,
			Conf: map[string]string{"last_call_timeout": "1", "join_timeout": "20", "lease_ttl": "2"},
		}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		m, err := newMembership(ctx, &cfg, zaptest.NewLogger(t).Named(addr), "job")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(m.close)
		out = append(out, m.(*etcdNode))
	}
	return out
}

// nextAll runs a round on every node at once.
func nextAll(t *testing.T, nodes []*etcdNode) []*plan {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	plans := make([]*plan, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() {
			p, err := n.next(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			plans[i] = p
			t.Cleanup(p.release)
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return plans
}

// TestEtcdMembership runs two nodes' memberships in one process: a round
// gives each node its own worker store, and the two stores are one; a new
// round deletes the old round's store from etcd once its workers run; a
// node whose lease goes
// is reported lost by the other's watch; nothing outlives the memberships.
func TestEtcdMembership(t *testing.T) {
	noLeaks(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	nodes := etcdNodes(t, cluster, "127.0.0.1", "localhost")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	plans := nextAll(t, nodes)
	var groups []int
	for i, p := range plans {
		env, port := p.env, p.store.Addr().(*net.TCPAddr).Port
		// Its own store, on loopback: only its workers and agent use it.
		if env.MasterAddr != "127.0.0.1" || env.MasterPort != port || !p.store.Addr().(*net.TCPAddr).IP.IsLoopback() {
			t.Fatalf("node %s: MASTER %s:%d, store on %v; want its own store at 127.0.0.1:%d", nodes[i].job.addr, env.MasterAddr, env.MasterPort,
				p.store.Addr(), port)
		}
		groups = append(groups, p.assignments[0].GroupRank)
	}
	if slices.Sort(groups); !slices.Equal(groups, []int{0, 1}) {
		t.Fatalf("group ranks %v", groups)
	}
	var clients []*tcpstore.Client
	for _, p := range plans {
		c, err := tcpstore.Dial(ctx, p.store.Addr().String(), tcpstore.ClientConfig{Timeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	if err := clients[0].Set(ctx, "k", []byte("from node 0")); err != nil {
		t.Fatal(err)
	}
	if v, err := clients[1].Get(ctx, "k"); err != nil || string(v) != "from node 0" {
		t.Fatalf("node 1's store has k = %q, %v", v, err)
	}
	for _, n := range nodes {
		if c, err := n.watch(ctx); c != nil || err != nil {
			t.Fatalf("watch of a healthy round = %v, %v", c, err)
		}
	}

	// A failed round: both count it and meet again in round 1, which
	// starts with an empty store and deletes round 0's.
	for i, n := range nodes {
		if _, err := n.failed(ctx, plans[i], "test"); err != nil {
			t.Fatal(err)
		}
		plans[i].release()
	}
	plans = nextAll(t, nodes)
	if plans[0].round != 1 || plans[0].env.RestartCount != 1 {
		t.Fatalf("round %d restarts %d; want round 1 after one restart", plans[0].round, plans[0].env.RestartCount)
	}
	for _, n := range nodes { // the workers run: the agents watch
		if c, err := n.watch(ctx); c != nil || err != nil {
			t.Fatalf("watch of round 1 = %v, %v", c, err)
		}
	}
	cli := cluster.Client(t, nil)
	for round, want := range map[string]int64{"0000000000": 0, "0000000001": 1} {
		r, err := cli.Get(ctx, "/gorun/job/store/"+round+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		if round == "0000000001" {
			c, err := tcpstore.Dial(ctx, plans[1].store.Addr().String(), tcpstore.ClientConfig{Timeout: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if ok, err := c.Check(ctx, "k"); err != nil || ok {
				t.Fatalf("round 1's store has round 0's key: %v, %v", ok, err)
			}
			if _, err := c.Add(ctx, "k2", 1); err != nil { // answered, unlike a set
				t.Fatal(err)
			}
			c.Close()
			if r, err = cli.Get(ctx, "/gorun/job/store/"+round+"/k/", clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil {
				t.Fatal(err)
			}
		}
		if r.Count != want {
			t.Fatalf("%d keys in round %s's store; want %d", r.Count, round, want)
		}
	}

	// Node 1 goes: its lease is revoked. Node 0 sees it lost at once.
	start := time.Now()
	nodes[1].closeLiveness()
	for {
		c, err := nodes[0].watch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c != nil {
			if !slices.Equal(c.lost, []string{nodes[1].job.me.String()}) {
				t.Fatalf("change %v; want node 1 lost", c)
			}
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatal("node 1's departure not seen")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("revoked lease seen after %v", time.Since(start))
	// Node 0 took node 1 out of the rendezvous state, where its heartbeat
	// would have kept it for keep_alive_interval × max_attempt (15 s).
	for {
		st, err := nodes[0].job.dyn.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(st.Lost, nodes[1].job.me) {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("node 1 still in the rendezvous state: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("and out of the rendezvous state after %v", time.Since(start))
}

// TestEtcdWatchAfterLeaseLapse: once the liveness view has reported a
// member lost (its lease lapsed), the survivor's watch still reads the
// rendezvous state, where a replacement that came after the loss waits:
// heal admits it in the lost node's place. (The watch used to report the
// lost member on every call and never read the state again, so a
// replacement that came after the lease lapsed waited for the end of the
// job: TestMultiNodeHeal's etcd case failed about one run in two.)
func TestEtcdWatchAfterLeaseLapse(t *testing.T) {
	noLeaks(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	nodes := etcdNodes(t, cluster, "127.0.0.1", "localhost")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nextAll(t, nodes)
	var survivor, lost *etcdNode
	for _, n := range nodes {
		if n.job.round.Rank == 0 {
			survivor = n
		} else {
			lost = n
		}
	}

	// The workers run: the survivor watches (and reads the presence keys
	// once). Then the lost node's lease goes; the watch reports it, and
	// the survivor takes the node out of the rendezvous state.
	if c, err := survivor.watch(ctx); c != nil || err != nil {
		t.Fatalf("watch of a healthy round = %v, %v", c, err)
	}
	lost.closeLiveness()
	lostID := lost.job.me.String()
	within := func(what string, limit time.Duration, done func(*change) bool) {
		t.Helper()
		start := time.Now()
		for {
			c, err := survivor.watch(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c != nil && done(c) {
				t.Logf("%s after %v", what, time.Since(start).Round(time.Millisecond))
				return
			}
			if time.Since(start) > limit {
				t.Fatalf("%s: not within %v (last change %v)", what, limit, c)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	within("lost node reported", 5*time.Second, func(c *change) bool { return slices.Contains(c.lost, lostID) })

	// A replacement comes after the loss and waits for room.
	replacement := etcdNodesOf(t, cluster, 2, "127.0.0.3")[0]
	type result struct {
		p   *plan
		err error
	}
	joined := make(chan result, 1)
	go func() {
		p, err := replacement.next(ctx)
		joined <- result{p, err}
	}()
	// The state is read every fifth of a keep-alive interval (1 s).
	within("replacement seen waiting", 10*time.Second, func(c *change) bool { return c.waiting > 0 })
	ids, err := survivor.admit(ctx, []int{lost.job.round.Rank})
	if err != nil {
		t.Fatal(err)
	}
	id := ids[0]
	r := <-joined
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.p.release()
	if id != replacement.job.me.String() || !r.p.late || r.p.round != 0 || r.p.assignments[0].GroupRank != lost.job.round.Rank {
		t.Fatalf("admitted %s into round %d as group rank %d (late %v); want %s late into round 0 as group rank %d",
			id, r.p.round, r.p.assignments[0].GroupRank, r.p.late, replacement.job.me, lost.job.round.Rank)
	}
}

// TestEtcdOneLeasePerAgent: an agent keeps one etcd lease alive, its
// liveness's, under which both its stores put the tokens of their
// read-modify-writes (the rendezvous store's joins and the worker store's
// adds); it used to hold three, more than 512 agents on two cores could
// keep renewed (BENCHMARKS.md, issue 19).
func TestEtcdOneLeasePerAgent(t *testing.T) {
	noLeaks(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	nodes := etcdNodes(t, cluster, "127.0.0.1", "localhost")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	plans := nextAll(t, nodes)
	for _, p := range plans {
		c, err := tcpstore.Dial(ctx, p.store.Addr().String(), tcpstore.ClientConfig{Timeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Add(ctx, "counter", 1); err != nil {
			t.Fatal(err)
		}
	}
	leases := make(map[clientv3.LeaseID]bool)
	for _, n := range nodes {
		id, err := n.live.Lease(ctx)
		if err != nil {
			t.Fatal(err)
		}
		leases[id] = true
	}
	r, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Leases) != len(nodes) {
		t.Fatalf("%d etcd leases for %d agents; want one each", len(r.Leases), len(nodes))
	}
	kvs, err := cli.Get(ctx, nodes[0].base, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var rdzv, worker int
	for _, kv := range kvs.Kvs {
		k := string(kv.Key)
		if !strings.Contains(k, "/m/t/") {
			continue
		}
		if !leases[clientv3.LeaseID(kv.Lease)] {
			t.Errorf("token %s under lease %x, not an agent's liveness lease", k, kv.Lease)
		}
		if strings.HasPrefix(k, nodes[0].base+"rdzv/") {
			rdzv++
		} else {
			worker++
		}
	}
	if rdzv == 0 || worker == 0 {
		t.Fatalf("%d rendezvous tokens, %d worker store tokens: the test tests too little", rdzv, worker)
	}
}

func TestParseNodeDesc(t *testing.T) {
	for _, n := range []rendezvous.NodeDesc{
		{Addr: "node0", Pid: 12, LocalID: 0},
		{Addr: "my_host_name", Pid: 1, LocalID: 3},
		{Addr: "fd00::1", Pid: 99999},
	} {
		got, ok := parseNodeDesc(n.String())
		if !ok || got != n {
			t.Errorf("parseNodeDesc(%q) = %+v, %v", n.String(), got, ok)
		}
	}
	for _, bad := range []string{"", "node0", "node0_12", "_1_2", "node0_x_0", "node0_1_y"} {
		if got, ok := parseNodeDesc(bad); ok {
			t.Errorf("parseNodeDesc(%q) = %+v; want no node", bad, got)
		}
	}
}

// TestEtcdQueueModeLazyMembers: 32 nodes (queue mode) plan their round
// from their summaries, with no member list; their watches of a healthy
// round read none either, and once a node's lease goes a survivor reads
// the list (then only) and reports that node lost.
func TestEtcdQueueModeLazyMembers(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	const n = 32
	addrs := make([]string, n)
	for i := range addrs {
		addrs[i] = "127.0.0." + strconv.Itoa(i+1)
	}
	nodes := etcdNodes(t, cluster, addrs...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	plans := nextAll(t, nodes)
	for i, p := range plans {
		if p.members != nil || !nodes[i].lazyMembers || p.atBarrier() != n {
			t.Fatalf("node %d: members %v, lazy %v", i, p.members, nodes[i].lazyMembers)
		}
	}
	for _, nd := range nodes {
		if c, err := nd.watch(ctx); c != nil || err != nil || !nd.lazyMembers {
			t.Fatalf("watch of a healthy round = %v, %v (lazy %v)", c, err, nd.lazyMembers)
		}
	}
	lost, survivor := nodes[n-1], nodes[0]
	lost.closeLiveness()
	start := time.Now()
	for {
		c, err := survivor.watch(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c != nil {
			if !slices.Equal(c.lost, []string{lost.job.me.String()}) || survivor.lazyMembers || len(survivor.members) != n {
				t.Fatalf("change %v (members %d, lazy %v); want the node lost", c, len(survivor.members), survivor.lazyMembers)
			}
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the lost node not seen")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
