package shrink

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/filestore"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// stores returns the backends a Board must work on: gorun's TCPStore (new
// and old wire) and a FileStore. Each call returns a fresh store and a
// function that opens another client of the same store.
func stores(t *testing.T) map[string]func() rendezvous.Store {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	path := filepath.Join(t.TempDir(), "store")
	dial := func(wire tcpstore.Generation) func() rendezvous.Store {
		return func() rendezvous.Store {
			c, err := tcpstore.Dial(context.Background(), srv.Addr().String(), tcpstore.ClientConfig{Wire: wire, Timeout: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			return c
		}
	}
	return map[string]func() rendezvous.Store{
		"tcpstore": dial(tcpstore.GenNew),
		"tcpstore-old-wire": func() rendezvous.Store {
			return rendezvous.NewPrefixStore("old", dial(tcpstore.GenOld)())
		},
		"filestore": func() rendezvous.Store {
			cfg := filestore.DefaultConfig()
			cfg.Timeout = 10 * time.Second
			s, err := filestore.Open(context.Background(), path, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		},
	}
}

func TestBoard(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			t.Run("racing coordinators agree", func(t *testing.T) { testRace(t, open) })
			t.Run("await is released by publish", func(t *testing.T) { testAwait(t, open) })
			t.Run("acks and reports", func(t *testing.T) { testAcksReports(t, open) })
		})
	}
}

// testRace: several coordinators publish different decisions for epoch 1
// at once; exactly one wins and every one of them ends up holding it.
func testRace(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const rivals = 6
	type outcome struct {
		held Epoch
		won  bool
		err  error
	}
	outs := make([]outcome, rivals)
	var wg sync.WaitGroup
	for i := range rivals {
		b := NewBoard(open(), "race")
		e := mustNext(t, Initial(8), i) // each rival excludes a different rank
		e.Coordinator = fmt.Sprint("agent", i)
		wg.Go(func() {
			held, won, err := b.Publish(ctx, e)
			outs[i] = outcome{held, won, err}
		})
	}
	wg.Wait()
	winners := 0
	for i, o := range outs {
		if o.err != nil {
			t.Fatalf("rival %d: %v", i, o.err)
		}
		if o.won {
			winners++
		}
		if o.held.Coordinator != outs[0].held.Coordinator || !slices.Equal(o.held.Excluded, outs[0].held.Excluded) {
			t.Errorf("rival %d holds %v (by %s), rival 0 holds %v (by %s)", i, o.held, o.held.Coordinator, outs[0].held, outs[0].held.Coordinator)
		}
	}
	if winners != 1 {
		t.Errorf("%d rivals won the publication, want exactly 1", winners)
	}
}

func testAwait(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	worker, coord := NewBoard(open(), "await"), NewBoard(open(), "await")
	got := make(chan Epoch, 1)
	errc := make(chan error, 1)
	go func() {
		e, err := worker.Await(ctx, 1)
		errc <- err
		got <- e
	}()
	select {
	case err := <-errc:
		t.Fatalf("Await returned before any publication: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	e1 := mustNext(t, Initial(4), 2)
	if _, won, err := coord.Publish(ctx, e1); err != nil || !won {
		t.Fatalf("Publish: won=%v %v", won, err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if e := <-got; e.Number != 1 || !slices.Equal(e.Excluded, []int{2}) || !slices.Equal(e.ShrinkList(Initial(4)), []int{2}) {
		t.Errorf("Await = %v", e)
	}
	if e, ok, err := worker.Lookup(ctx, 1); err != nil || !ok || e.Number != 1 {
		t.Errorf("Lookup(1) = %v %v %v", e, ok, err)
	}
	if _, ok, err := worker.Lookup(ctx, 2); err != nil || ok {
		t.Errorf("Lookup(2) before publication = %v %v", ok, err)
	}

	short, cancelShort := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancelShort()
	if _, err := worker.Await(short, 2); !errors.Is(err, rendezvous.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Await of an unpublished epoch past the deadline: %v", err)
	}
}

func testAcksReports(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b := NewBoard(open(), "acks")
	for want := int64(1); want <= 3; want++ {
		if n, err := b.Ack(ctx, 1); err != nil || n != want {
			t.Fatalf("Ack #%d = %d, %v", want, n, err)
		}
	}
	if n, err := b.Acks(ctx, 1); err != nil || n != 3 {
		t.Errorf("Acks(1) = %d %v, want 3", n, err)
	}
	if n, err := b.Acks(ctx, 2); err != nil || n != 0 {
		t.Errorf("Acks(2) = %d %v, want 0", n, err)
	}

	if ns, last, err := b.Notices(ctx, 0); err != nil || len(ns) != 0 || last != 0 {
		t.Fatalf("Notices on an empty board = %v %d %v", ns, last, err)
	}
	seen := time.Unix(1700000000, 0).UTC()
	for i, r := range []Report{{Ranks: []int{3}, Reason: "exit code 1", From: "node1", SeenAt: seen}, {Ranks: []int{4, 5}, Reason: "node lost", From: "node0"}} {
		if idx, err := b.File(ctx, r); err != nil || idx != i+1 {
			t.Fatalf("File #%d = %d %v", i+1, idx, err)
		}
	}
	if idx, err := b.FileJoin(ctx, Join{Slots: []int{3}, From: "node1"}); err != nil || idx != 3 {
		t.Fatalf("FileJoin = %d %v", idx, err)
	}
	if idx, err := b.FileJoined(ctx, Joined{Epoch: 2, Slot: 3}); err != nil || idx != 4 {
		t.Fatalf("FileJoined = %d %v", idx, err)
	}
	ns, last, err := b.Notices(ctx, 0)
	if err != nil || last != 4 || len(ns) != 4 || !slices.Equal(ns[1].Failure.Ranks, []int{4, 5}) || !ns[0].Failure.SeenAt.Equal(seen) ||
		ns[0].Failure.From != "node1" || !slices.Equal(ns[2].Join.Slots, []int{3}) || *ns[3].Joined != (Joined{Epoch: 2, Slot: 3}) {
		t.Fatalf("Notices(0) = %+v %d %v", ns, last, err)
	}
	if ns, last, err := b.Notices(ctx, 4); err != nil || len(ns) != 0 || last != 4 {
		t.Errorf("Notices(4) = %v %d %v, want none after 4", ns, last, err)
	}
	if n, err := b.AwaitNotice(ctx, 3); err != nil || n.Join == nil || n.Failure != nil {
		t.Errorf("AwaitNotice(3) = %+v %v, want the join", n, err)
	}
}

func TestPublishRejectsEpochZero(t *testing.T) {
	b := NewBoard(stores(t)["tcpstore"](), "")
	if _, _, err := b.Publish(context.Background(), Initial(3)); err == nil {
		t.Error("Publish(epoch 0) succeeded")
	}
}

// TestAwaitNoticePastAbandoned: a filer that took index 1 and died before
// writing its notice (a newcomer killed as it said it was ready) does not
// hold the log: once a later notice is filed, AwaitNotice(1) says
// ErrAbandoned, and notice 2 is read. While no later index is taken it
// waits on.
func TestAwaitNoticePastAbandoned(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	b := NewBoard(dial(), "")
	raw := rendezvous.NewPrefixStore(DefaultPrefix, dial())
	if _, err := raw.Add(ctx, reportNext, 1); err != nil { // index 1 taken, never written
		t.Fatal(err)
	}
	early, stop := context.WithTimeout(ctx, 2*time.Second)
	defer stop()
	if _, err := b.AwaitNotice(early, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("AwaitNotice(1) with no later index: %v, want it to wait until its context ends", err)
	}
	if _, err := b.File(ctx, Report{Ranks: []int{0}, Reason: "killed"}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := b.AwaitNotice(ctx, 1); !errors.Is(err, ErrAbandoned) {
		t.Fatalf("AwaitNotice(1) after notice 2 was filed: %v, want ErrAbandoned", err)
	}
	if d := time.Since(start); d > noticeLook+2*noticeGrace {
		t.Errorf("abandoned after %v, want within %v", d, noticeLook+2*noticeGrace)
	}
	n, err := b.AwaitNotice(ctx, 2)
	if err != nil || n.Failure == nil || n.Failure.Ranks[0] != 0 {
		t.Fatalf("notice 2: %+v, %v", n, err)
	}
}
