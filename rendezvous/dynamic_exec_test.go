package rendezvous_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// The executor against a real TCPStore on loopback, in real time with short
// timers. Every node has its own client, as every agent would.

// cluster is a TCPStore server and the nodes of one run.
type cluster struct {
	t    *testing.T
	addr string
	cfg  rendezvous.DynamicConfig
}

func newCluster(t *testing.T, cfg rendezvous.DynamicConfig) *cluster {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	if cfg.RunID == "" {
		cfg.RunID = "job"
	}
	return &cluster{t: t, addr: srv.Addr().String(), cfg: cfg}
}

// execNode returns node i's descriptor: node order is i's order.
func execNode(i int) rendezvous.NodeDesc {
	return rendezvous.NodeDesc{Addr: fmt.Sprintf("node%03d", i), Pid: 4000 - i}
}

// node dials a client and makes node i's handle; both close at cleanup.
func (c *cluster) node(i int) *rendezvous.Dynamic {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := tcpstore.Dial(ctx, c.addr, tcpstore.ClientConfig{Timeout: 30 * time.Second})
	if err != nil {
		c.t.Fatal(err)
	}
	d, err := rendezvous.NewDynamic(cl, execNode(i), []byte(fmt.Sprintf("lws=%d", i+1)), c.cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() {
		d.Close()
		cl.Close()
	})
	return d
}

func (c *cluster) nodes(n int) []*rendezvous.Dynamic {
	ds := make([]*rendezvous.Dynamic, n)
	for i := range ds {
		ds[i] = c.node(i)
	}
	return ds
}

// result is what one Next returned.
type result struct {
	r   rendezvous.Round
	err error
	at  time.Time
}

// nextAll runs Next on every node at once and collects the results.
func nextAll(ctx context.Context, ds []*rendezvous.Dynamic) []result {
	out := make([]result, len(ds))
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Go(func() {
			r, err := d.Next(ctx)
			out[i] = result{r, err, time.Now()}
		})
	}
	wg.Wait()
	return out
}

// nextAsync starts Next on d and delivers its result.
func nextAsync(ctx context.Context, d *rendezvous.Dynamic) <-chan result {
	ch := make(chan result, 1)
	go func() {
		r, err := d.Next(ctx)
		ch <- result{r, err, time.Now()}
	}()
	return ch
}

// checkRound verifies that results form one round numbered num whose
// members are the given nodes (indexes into execNode) in rank order, each
// with its own data, and that result i has rank i.
func checkRound(t *testing.T, res []result, num int, members []int) {
	t.Helper()
	for i, x := range res {
		if x.err != nil {
			t.Fatalf("result %d: %v", i, x.err)
		}
		if x.r.Number != num || x.r.Rank != i || len(x.r.Members) != len(members) {
			t.Fatalf("result %d: round %d rank %d with %d members, want round %d rank %d with %d",
				i, x.r.Number, x.r.Rank, len(x.r.Members), num, i, len(members))
		}
		for rank, m := range x.r.Members {
			n := members[rank]
			if m.Rank != rank || m.Node != execNode(n) || string(m.Data) != fmt.Sprintf("lws=%d", n+1) {
				t.Fatalf("result %d member %d = %+v, want node %v with lws=%d", i, rank, m, execNode(n), n+1)
			}
		}
	}
}

func TestDynamicFiveNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 5, MaxNodes: 5})
	ds := c.nodes(5)
	// Start them in reverse node order: ranks follow node order.
	slices.Reverse(ds)
	res := nextAll(ctx, ds)
	slices.Reverse(res)
	checkRound(t, res, 0, []int{0, 1, 2, 3, 4})
	st, err := ds[0].Status(ctx)
	if err != nil || st.Round != 0 || !st.Complete || st.Participants != 5 || st.Waiting != 0 || st.Lost != nil || st.Closed {
		t.Fatalf("status %+v, %v", st, err)
	}
	// The round's private store.
	rs := res[0].r.Store(nil, "job")
	if p, ok := rs.(*rendezvous.PrefixStore); !ok || p.Prefix() != "gorun.rendezvous.job.0" {
		t.Errorf("round store %#v", rs)
	}
}

func TestDynamicElasticScaleUp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const lastCall = 300 * time.Millisecond
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 2, MaxNodes: 4, LastCallTimeout: lastCall})
	ds := c.nodes(4)

	start := time.Now()
	res := nextAll(ctx, ds[:3])
	checkRound(t, res, 0, []int{0, 1, 2})
	if took := time.Since(start); took < lastCall {
		t.Fatalf("3 of 2:4 completed in %v, before the last call (%v)", took, lastCall)
	} else {
		t.Logf("3 of 2:4 completed in %v (last call %v)", took, lastCall)
	}

	// A 4th node arrives: it waits, and the members see it waiting.
	late := nextAsync(ctx, ds[3])
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return st.Waiting == 1 })
	for _, d := range ds[:3] {
		st, err := d.Status(ctx)
		if err != nil || st.Waiting != 1 || st.Round != 0 || st.Lost != nil {
			t.Fatalf("status %+v, %v", st, err)
		}
	}
	// Everyone re-rendezvouses: round 1 with 4, complete at max (no last
	// call wait).
	start = time.Now()
	res = append(nextAll(ctx, ds[:3]), <-late)
	checkRound(t, res, 1, []int{0, 1, 2, 3})
	t.Logf("scale-up round completed %v after the members called Next", time.Since(start))
}

// waitFor polls d's Status until cond holds.
func waitFor(t *testing.T, ctx context.Context, d *rendezvous.Dynamic, cond func(rendezvous.Status) bool) rendezvous.Status {
	t.Helper()
	for {
		st, err := d.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if cond(st) {
			return st
		}
		select {
		case <-ctx.Done():
			t.Fatalf("gave up waiting; last status %+v", st)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func TestDynamicLostNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const interval, attempts = 50 * time.Millisecond, 3
	// A last call longer than the test: the survivors' round must not
	// wait for it (they are every member of round 0 still alive).
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 2, MaxNodes: 3,
		LastCallTimeout: time.Minute, KeepAliveInterval: interval, KeepAliveMaxAttempt: attempts})
	ds := c.nodes(3)
	checkRound(t, nextAll(ctx, ds), 0, []int{0, 1, 2})

	// Let the heartbeats run for a few TTLs: nobody is lost.
	time.Sleep(2 * interval * attempts)
	for _, d := range ds {
		if st, err := d.Status(ctx); err != nil || st.Lost != nil || st.Participants != 3 {
			t.Fatalf("alive: status %+v, %v", st, err)
		}
	}
	// Node 1 stops without a word.
	ds[1].Close()
	stopped := time.Now()
	st := waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return len(st.Lost) > 0 })
	took := time.Since(stopped)
	t.Logf("lost node seen after %v (ttl %v)", took, interval*attempts)
	if !slices.Equal(st.Lost, []rendezvous.NodeDesc{execNode(1)}) || st.Participants != 2 {
		t.Fatalf("status %+v", st)
	}
	// Its last heartbeat was at most an interval (and a little) before it
	// stopped.
	if took < interval*(attempts-2) {
		t.Fatalf("declared dead after %v, before its ttl", took)
	}
	// Node 2 sees the same (Status wrote the sanitized state back).
	if st, err := ds[2].Status(ctx); err != nil || !slices.Equal(st.Lost, []rendezvous.NodeDesc{execNode(1)}) {
		t.Fatalf("node 2 status %+v, %v", st, err)
	}
	// The survivors' next round leaves it out, and completes as soon as
	// both are in.
	rejoin := time.Now()
	res := nextAll(ctx, []*rendezvous.Dynamic{ds[0], ds[2]})
	checkRound(t, res, 1, []int{0, 2})
	t.Logf("survivors re-rendezvoused in %v", time.Since(rejoin))
	// Operations on a closed handle fail with ErrClosed.
	if _, err := ds[1].Next(ctx); !errors.Is(err, rendezvous.ErrClosed) {
		t.Errorf("Next after Close: %v", err)
	}
}

func TestDynamicLeave(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 3, MaxNodes: 3})
	ds := c.nodes(3)
	checkRound(t, nextAll(ctx, ds), 0, []int{0, 1, 2})
	if err := ds[2].Leave(ctx); err != nil {
		t.Fatal(err)
	}
	// No ttl to wait out: it is gone at once.
	st, err := ds[0].Status(ctx)
	if err != nil || !slices.Equal(st.Lost, []rendezvous.NodeDesc{execNode(2)}) || st.Participants != 2 || !st.Complete {
		t.Fatalf("status %+v, %v", st, err)
	}
	if err := ds[2].Leave(ctx); err != nil {
		t.Fatalf("second Leave: %v", err)
	}
}

func TestDynamicSetClosed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 2, MaxNodes: 2})
	ds := c.nodes(2)
	waiting := nextAsync(ctx, ds[0]) // alone of 2: it waits
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	if err := ds[1].SetClosed(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-waiting
	if !errors.Is(x.err, rendezvous.ErrRendezvousClosed) {
		t.Fatalf("waiting Next: %v", x.err)
	}
	t.Logf("a waiting Next saw the close after %v", x.at.Sub(start))
	if x.at.Sub(start) > time.Second {
		t.Errorf("close took %v to reach a waiter: it should be woken, not poll", x.at.Sub(start))
	}
	if _, err := ds[1].Next(ctx); !errors.Is(err, rendezvous.ErrRendezvousClosed) {
		t.Fatalf("Next after close: %v", err)
	}
	if st, err := ds[1].Status(ctx); err != nil || !st.Closed {
		t.Fatalf("status %+v, %v", st, err)
	}
	if err := ds[0].SetClosed(ctx); err != nil {
		t.Fatalf("closing twice: %v", err)
	}
}

func TestDynamicJoinTimeout(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const joinTimeout = 300 * time.Millisecond
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 3, MaxNodes: 3, JoinTimeout: joinTimeout})
	ds := c.nodes(2)
	start := time.Now()
	for i, x := range nextAll(ctx, ds) {
		if !errors.Is(x.err, rendezvous.ErrRendezvousTimeout) || !errors.Is(x.err, rendezvous.ErrTimeout) {
			t.Fatalf("node %d: %v", i, x.err)
		}
		if took := x.at.Sub(start); took < joinTimeout || took > joinTimeout+2*time.Second {
			t.Errorf("node %d timed out after %v (join timeout %v)", i, took, joinTimeout)
		}
		t.Logf("node %d: %v", i, x.err)
	}
	// Both rolled themselves back out of the state.
	if st, err := ds[0].Status(ctx); err != nil || st.Participants != 0 || st.Waiting != 0 {
		t.Fatalf("after the timeout: %+v, %v", st, err)
	}
}

func TestDynamicCloseEndsNext(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 2, MaxNodes: 2})
	d := c.node(0)
	ch := nextAsync(ctx, d)
	time.Sleep(50 * time.Millisecond)
	d.Close()
	if x := <-ch; !errors.Is(x.err, rendezvous.ErrClosed) {
		t.Fatalf("Next interrupted by Close: %v", x.err)
	}
}

func TestDynamicProgress(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var mu sync.Mutex
	var seen []rendezvous.Progress
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 3, MaxNodes: 3})
	watched := c.cfg
	watched.OnProgress = func(p rendezvous.Progress) {
		mu.Lock()
		seen = append(seen, p)
		mu.Unlock()
	}
	c0 := &cluster{t: t, addr: c.addr, cfg: watched}
	ds := []*rendezvous.Dynamic{c0.node(0), c.node(1), c.node(2)}
	ch := nextAsync(ctx, ds[0])
	time.Sleep(20 * time.Millisecond)
	rest := nextAll(ctx, ds[1:])
	checkRound(t, append([]result{<-ch}, rest...), 0, []int{0, 1, 2})
	mu.Lock()
	defer mu.Unlock()
	// It saw itself alone first and the complete round last.
	if len(seen) < 2 || len(seen[0].Participants) > 1 || !seen[len(seen)-1].Complete || len(seen[len(seen)-1].Participants) != 3 {
		t.Fatalf("progress %+v", seen)
	}
}

// countingStore counts the compare-sets a node sends.
type countingStore struct {
	rendezvous.Store
	n *atomic.Int64
}

func (c countingStore) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	c.n.Add(1)
	return c.Store.CompareSet(ctx, key, expected, desired)
}

// TestDynamic64 measures 64-node rendezvous on loopback, every node on its
// own connection, min = max = 64, in three shapes.
func TestDynamic64(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n = 64
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: n, MaxNodes: n})
	var cas atomic.Int64
	handles := func(runID string) []*rendezvous.Dynamic {
		cfg := c.cfg
		cfg.RunID = runID
		ds := make([]*rendezvous.Dynamic, n)
		for i := range ds {
			cl, err := tcpstore.Dial(ctx, c.addr, tcpstore.ClientConfig{})
			if err != nil {
				t.Fatal(err)
			}
			d, err := rendezvous.NewDynamic(countingStore{cl, &cas}, execNode(i), []byte(fmt.Sprintf("lws=%d", i+1)), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				d.Close()
				cl.Close()
			})
			ds[i] = d
		}
		return ds
	}
	members := make([]int, n)
	for i := range members {
		members[i] = i
	}
	var wg sync.WaitGroup
	// together runs Next on every handle at once and returns the time from
	// the last call to the last return.
	together := func(ds []*rendezvous.Dynamic, round int) time.Duration {
		cas.Store(0)
		var mu sync.Mutex
		var lastCall time.Time
		res := make([]result, n)
		for i, d := range ds {
			wg.Go(func() {
				mu.Lock()
				if now := time.Now(); now.After(lastCall) {
					lastCall = now
				}
				mu.Unlock()
				r, err := d.Next(ctx)
				res[i] = result{r, err, time.Now()}
			})
		}
		wg.Wait()
		checkRound(t, res, round, members)
		return latest(lastCall, res).Sub(lastCall)
	}

	// 1. Fresh nodes, all at once: 64 writers race for one key.
	ds := handles("fresh")
	took := together(ds, 0)
	t.Logf("64 fresh nodes calling Next at once: %v from the last call to the last return (%d compare-sets)", took, cas.Load())

	// 2. The whole job restarts: everyone leaves round 0 and joins round 1.
	took = together(ds, 1)
	t.Logf("64 nodes re-rendezvousing at once: %v from the last call to the last return (%d compare-sets)", took, cas.Load())

	// 3. The measure: 63 nodes have joined and wait; from the
	// 64th's Next to the last return.
	ds = handles("last")
	res := make([]result, n)
	for i, d := range ds[:n-1] {
		wg.Go(func() {
			r, err := d.Next(ctx)
			res[i] = result{r, err, time.Now()}
		})
	}
	waitFor(t, ctx, ds[n-1], func(st rendezvous.Status) bool { return st.Participants == n-1 })
	time.Sleep(20 * time.Millisecond) // let the last joiner settle into its wait
	cas.Store(0)
	call := time.Now()
	r, err := ds[n-1].Next(ctx)
	res[n-1] = result{r, err, time.Now()}
	wg.Wait()
	checkRound(t, res, 0, members)
	t.Logf("64 nodes, 63 waiting: %v from the last node's Next to the last return (%d compare-sets)", latest(call, res).Sub(call), cas.Load())
}

// latest returns the latest of t and the results' return times.
func latest(t time.Time, res []result) time.Time {
	for _, x := range res {
		if x.at.After(t) {
			t = x.at
		}
	}
	return t
}

// TestDynamicAdmit: a member of a running round dies; a new node comes and
// waits for the next round; a survivor admits it in the dead member's
// place: the newcomer's Next returns the running round with the dead
// member's rank (Late), and every survivor's next Status lists it once,
// after which its own loss shows as Lost. Admit refuses a rank that has a
// member, and says when nobody waits.
func TestDynamicAdmit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const interval, attempts = 50 * time.Millisecond, 3
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 3, MaxNodes: 3,
		LastCallTimeout: time.Minute, KeepAliveInterval: interval, KeepAliveMaxAttempt: attempts})
	ds := c.nodes(3)
	checkRound(t, nextAll(ctx, ds), 0, []int{0, 1, 2})
	ds[1].Close()
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return len(st.Lost) > 0 })
	if _, err := ds[0].Admit(ctx, 1); !errors.Is(err, rendezvous.ErrNoWaitingNode) {
		t.Fatalf("Admit with nobody waiting: %v, want ErrNoWaitingNode", err)
	}

	newcomer := c.node(3)
	joined := nextAsync(ctx, newcomer)
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return st.Waiting == 1 })
	if _, err := ds[0].Admit(ctx, 2); err == nil {
		t.Fatal("Admit into rank 2, which has a live member, succeeded")
	}
	n, err := ds[2].Admit(ctx, 1)
	if err != nil || !slices.Equal(n, []rendezvous.NodeDesc{execNode(3)}) {
		t.Fatalf("Admit = %v, %v; want node 3", n, err)
	}
	var res result
	select {
	case res = <-joined:
	case <-ctx.Done():
		t.Fatal("the admitted node's Next did not return")
	}
	if res.err != nil || res.r.Number != 0 || res.r.Rank != 1 || !res.r.Late || len(res.r.Members) != 3 ||
		res.r.Members[1].Node != execNode(3) || res.r.Members[0].Node != execNode(0) {
		t.Fatalf("admitted node's round %+v, %v; want round 0, rank 1, late, with nodes 0 3 2", res.r, res.err)
	}
	for _, d := range []*rendezvous.Dynamic{ds[0], ds[2]} {
		st, err := d.Status(ctx)
		if err != nil || len(st.Admitted) != 1 || st.Admitted[0].Node != execNode(3) || st.Admitted[0].Rank != 1 ||
			len(st.Lost) != 0 || st.Waiting != 0 || st.Participants != 3 {
			t.Fatalf("status after the admission: %+v, %v", st, err)
		}
		if st, err := d.Status(ctx); err != nil || len(st.Admitted) != 0 {
			t.Fatalf("the admission shows twice: %+v, %v", st, err)
		}
	}
	// The admitted node is a member like any: its loss is seen.
	newcomer.Close()
	st := waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return len(st.Lost) > 0 })
	if !slices.Equal(st.Lost, []rendezvous.NodeDesc{execNode(3)}) {
		t.Fatalf("lost %v, want node 3", st.Lost)
	}
}

// TestDynamicAdmitTwoPlaces: two members of a running round die. One node
// waiting is refused a single place (ErrPlacesLeft) and stays waiting:
// admitted beside the other empty place it would not take its own (its
// Next takes only a whole round), went back to the wait list and was
// admitted again by the leader's next poll, every second (bench/chaos, a
// spare after two nodes lost). Both places asked with one node waiting is
// ErrNoWaitingNode, and nothing changes; once a second node waits, one
// Admit takes both in, and both Nexts return the whole round.
func TestDynamicAdmitTwoPlaces(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const interval, attempts = 50 * time.Millisecond, 3
	c := newCluster(t, rendezvous.DynamicConfig{MinNodes: 3, MaxNodes: 3,
		LastCallTimeout: time.Minute, KeepAliveInterval: interval, KeepAliveMaxAttempt: attempts})
	ds := c.nodes(3)
	checkRound(t, nextAll(ctx, ds), 0, []int{0, 1, 2})
	ds[1].Close()
	ds[2].Close()
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return len(st.Lost) == 2 })

	first := nextAsync(ctx, c.node(3))
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return st.Waiting == 1 })
	for _, tt := range []struct {
		ranks []int
		want  error
	}{
		{[]int{1}, rendezvous.ErrPlacesLeft},
		{[]int{2}, rendezvous.ErrPlacesLeft},
		{[]int{1, 2}, rendezvous.ErrNoWaitingNode},
	} {
		if n, err := ds[0].Admit(ctx, tt.ranks...); !errors.Is(err, tt.want) {
			t.Fatalf("Admit%v with one node waiting = %v, %v; want %v", tt.ranks, n, err, tt.want)
		}
	}
	// Given the time to bounce, the waiting node would be out of the
	// wait list and back; it is still there, and nobody is admitted.
	time.Sleep(4 * interval)
	if st, err := ds[0].Status(ctx); err != nil || st.Waiting != 1 || st.Participants != 1 || len(st.Admitted) != 0 {
		t.Fatalf("status after the refused admissions: %+v, %v; want 1 waiting, 1 participant", st, err)
	}

	second := nextAsync(ctx, c.node(4))
	waitFor(t, ctx, ds[0], func(st rendezvous.Status) bool { return st.Waiting == 2 })
	n, err := ds[0].Admit(ctx, 2, 1)
	if err != nil || !slices.Equal(n, []rendezvous.NodeDesc{execNode(4), execNode(3)}) {
		t.Fatalf("Admit(2, 1) = %v, %v; want nodes 4 and 3", n, err)
	}
	for i, joined := range []<-chan result{first, second} {
		var res result
		select {
		case res = <-joined:
		case <-ctx.Done():
			t.Fatalf("admitted node %d's Next did not return", 3+i)
		}
		if res.err != nil || res.r.Number != 0 || res.r.Rank != 1+i || !res.r.Late || len(res.r.Members) != 3 {
			t.Fatalf("admitted node %d's round %+v, %v; want round 0, rank %d, late, 3 members", 3+i, res.r, res.err, 1+i)
		}
	}
	st, err := ds[0].Status(ctx)
	if err != nil || len(st.Admitted) != 2 || len(st.Lost) != 0 || st.Waiting != 0 || st.Participants != 3 {
		t.Fatalf("status after the admission: %+v, %v", st, err)
	}
}
