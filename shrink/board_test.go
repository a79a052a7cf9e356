package shrink

import (
	"bytes"
	"context"
	"encoding/json"
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
	e := Epoch{Number: 1, Ranks: []int{0, -1, 1, 2}, WorldSize: 3, Action: ActionShrink}
	for _, g := range []int{0, 2, 3} {
		if all, err := b.Arrived(ctx, e); err != nil || all {
			t.Fatalf("Arrived before slot %d = %v, %v", g, all, err)
		}
		if err := b.Arrive(ctx, e, g); err != nil {
			t.Fatalf("Arrive(slot %d) = %v", g, err)
		}
	}
	if all, err := b.Arrived(ctx, e); err != nil || !all {
		t.Fatalf("Arrived after every member = %v, %v", all, err)
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

// TestNoticeLogHasNoHoles: filers racing on their own connections, with
// nothing but the log to go by, take every index once: the log reads
// 1..N with no gap and no notice lost, and a reader of the next index
// waits for it.
func TestNoticeLogHasNoHoles(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	const filers, each = 6, 5
	var wg sync.WaitGroup
	idx := make(chan int, filers*each)
	for f := range filers {
		b := NewBoard(dial(), "")
		wg.Go(func() {
			for k := range each {
				i, err := b.File(ctx, Report{Ranks: []int{f*each + k}, Reason: "exited"})
				if err != nil {
					t.Error(err)
					return
				}
				idx <- i
			}
		})
	}
	wg.Wait()
	close(idx)
	var got []int
	for i := range idx {
		got = append(got, i)
	}
	slices.Sort(got)
	for k, i := range got {
		if i != k+1 {
			t.Fatalf("indices filed %v, want 1..%d each once", got, filers*each)
		}
	}
	b := NewBoard(dial(), "")
	ns, last, err := b.Notices(ctx, 0)
	if err != nil || last != filers*each || len(ns) != filers*each {
		t.Fatalf("Notices = %d notices, last %d, %v; want %d", len(ns), last, err, filers*each)
	}
	ranks := map[int]bool{}
	for _, n := range ns {
		ranks[n.Failure.Ranks[0]] = true
	}
	if len(ranks) != filers*each {
		t.Fatalf("%d distinct notices, want %d", len(ranks), filers*each)
	}
	next := make(chan error, 1)
	go func() {
		n, err := b.AwaitNotice(ctx, filers*each+1)
		if err == nil && n.Join == nil {
			err = fmt.Errorf("notice %+v, want the join", n)
		}
		next <- err
	}()
	select {
	case err := <-next:
		t.Fatalf("AwaitNotice of the next index returned before it was filed: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := NewBoard(dial(), "").FileJoin(ctx, Join{Slots: []int{1}}); err != nil {
		t.Fatal(err)
	}
	if err := <-next; err != nil {
		t.Fatal(err)
	}
}

// raceFloor is a store on which, the moment a notice is filed and before
// its filer looks at the Floor again, raise runs (a leader raising the
// Floor) once.
type raceFloor struct {
	rendezvous.Store
	raise  func(ctx context.Context, i int) error
	raised int // the notice raise ran at
	// early: raise runs before the compare-set of the first notice tried,
	// as if the filer had been descheduled just before it.
	early bool
}

func (s *raceFloor) CompareSet(ctx context.Context, key string, old, new []byte) ([]byte, error) {
	var i int
	_, scan := fmt.Sscanf(key, DefaultPrefix+"/report/%d", &i)
	if scan == nil && s.early && s.raise != nil {
		raise := s.raise
		s.raise, s.raised = nil, i
		if err := raise(ctx, i); err != nil {
			return nil, err
		}
	}
	got, err := s.Store.CompareSet(ctx, key, old, new)
	if scan == nil && err == nil && s.raise != nil && bytes.Equal(got, new) {
		raise := s.raise
		s.raise, s.raised = nil, i
		if err := raise(ctx, i); err != nil {
			return nil, err
		}
	}
	return got, err
}

// TestNoticeSettledByTheFloorIsFiledOnce: a notice the Floor is raised to
// between its filing and its filer's look at the Floor was read (a leader
// raises it to notices it read), so it is not filed again; a second copy
// of a Complete said the grow completed twice (CI's
// TestBoardKeysBoundedOverEpochs: "complete 10, want 12"). A notice that
// a sweep collects before its filer looks is filed again above.
func TestNoticeSettledByTheFloorIsFiledOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	b := NewBoard(dial(), "")
	if _, err := b.File(ctx, Report{Ranks: []int{1}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	settling := &raceFloor{Store: dial(), raise: func(ctx context.Context, i int) error {
		return b.Raise(ctx, Floor{Epoch: 3, Notice: i})
	}}
	if i, err := NewBoard(settling, "").file(ctx, Notice{Complete: &Complete{Epoch: 2}}); err != nil || i != 2 || settling.raised != 2 {
		t.Fatalf("file = %d, %v (floor raised at notice %d); want notice 2, raised at 2", i, err, settling.raised)
	}
	if ok, err := b.store.Check(ctx, reportKey(3)); err != nil || ok {
		t.Fatalf("notice 3 exists (%v, %v): the Complete was filed again", ok, err)
	}

	sweeping := &raceFloor{Store: dial(), raise: func(ctx context.Context, i int) error {
		if err := b.Raise(ctx, Floor{Epoch: 5, Notice: i}); err != nil {
			return err
		}
		return b.Raise(ctx, Floor{Epoch: 7, Notice: i}) // sweeps notice i
	}}
	i, err := NewBoard(sweeping, "").file(ctx, Notice{Join: &Join{Slots: []int{1}}})
	if err != nil || i != 4 || sweeping.raised != 3 {
		t.Fatalf("file = %d, %v; want notice 3 swept and the join filed again as 4", i, err)
	}
	if n, err := b.readNotice(ctx, 4); err != nil || n.Join == nil {
		t.Fatalf("notice 4 = %+v, %v; want the join", n, err)
	}

	// A slot a sweep emptied just before the filer's compare-set took
	// it: the copy below the floor is withdrawn, no sweep would reach it.
	emptied := &raceFloor{Store: dial(), early: true, raise: func(ctx context.Context, i int) error {
		if err := b.Raise(ctx, Floor{Epoch: 9, Notice: i}); err != nil {
			return err
		}
		return b.Raise(ctx, Floor{Epoch: 11, Notice: i}) // sweeps up to i
	}}
	if i, err := NewBoard(emptied, "").file(ctx, Notice{Join: &Join{Slots: []int{2}}}); err != nil || i != 5 || emptied.raised != 4 {
		t.Fatalf("file = %d, %v (swept up to %d first); want slot 4 swept, the join filed as 5", i, err, emptied.raised)
	}
	if ok, err := b.store.Check(ctx, reportKey(4)); err != nil || ok {
		t.Fatalf("notice 4 still there (%v, %v): its copy below the floor would never be collected", ok, err)
	}
}

// TestPythonNoticeSettledByTheFloorIsFiledOnce is
// TestNoticeSettledByTheFloorIsFiledOnce for gorun_ft.py's filing: the
// same two floors raised between the filing and the filer's look. torch
// is stubbed and the store is a double with c10d's compare-set (the real
// stores are under the heal tests of examples/torch); the filing logic
// is what is checked.
func TestPythonNoticeSettledByTheFloorIsFiledOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := gorunFT(ctx, t, `
import json

class Store:
    """c10d's compare_set on a dict; raise runs once, after the first
    notice it creates (early: before the first notice's compare_set)."""
    def __init__(self, raise_, early=False):
        self.d, self.raise_, self.raised, self.early = {}, raise_, 0, early
    def compare_set(self, key, expected, desired):
        report = gorun_ft._key("report", "")
        if self.early and self.raise_ and key.startswith(report):
            i = int(key[len(report):])
            self.raise_(self, i)
            self.raise_, self.raised = None, i
        expected, desired = expected.encode(), desired.encode()
        cur = self.d.get(key)
        if (cur is None and expected == b"") or (cur is not None and cur == expected):
            self.d[key] = got = desired
        else:
            got = expected if cur is None else cur
        report = gorun_ft._key("report", "")
        if self.raise_ and got == desired and key.startswith(report):
            i = int(key[len(report):])
            self.raise_(self, i)
            self.raise_, self.raised = None, i
        return got

    def delete_key(self, key):
        return self.d.pop(key, None) is not None

def group(store):
    g = gorun_ft.ElasticGroup.__new__(gorun_ft.ElasticGroup)
    g.store, g._auth, g._notice_hint = store, None, 0
    return g

def floor(store, notice, swept):
    store.d[gorun_ft._key("floor")] = json.dumps({"epoch": 3, "notice": notice, "swept_notice": swept}).encode()

out = {}
s = Store(lambda s, i: floor(s, i, 0))
s.d[gorun_ft._key("report", 1)] = b'{"failure": {}}'
out["settled"] = [group(s)._file({"complete": {"epoch": 2}}), s.raised, gorun_ft._key("report", 3) in s.d]
def sweep(s, i):
    floor(s, i, i)
    del s.d[gorun_ft._key("report", i)]
s = Store(sweep)
s.d[gorun_ft._key("report", 1)] = b'{"failure": {}}'
out["swept"] = [group(s)._file({"join": {"slots": [1]}}), s.raised, json.loads(s.d[gorun_ft._key("report", 3)])]
def emptied(s, i):
    floor(s, i, i)
    s.d.pop(gorun_ft._key("report", i), None)
s = Store(emptied, early=True)
s.d[gorun_ft._key("report", 1)] = b'{"failure": {}}'
out["emptied"] = [group(s)._file({"join": {"slots": [2]}}), s.raised, gorun_ft._key("report", 1) in s.d]
print(json.dumps(out))
`)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	var got struct{ Settled, Swept, Emptied []any }
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("python said %s: %v", out, err)
	}
	if want := []any{2.0, 2.0, false}; !slices.Equal(got.Settled, want) {
		t.Errorf("a notice the floor settled at once: filed at, raised at, filed again = %v, want %v", got.Settled, want)
	}
	if len(got.Swept) != 3 || got.Swept[0] != 3.0 || got.Swept[1] != 2.0 || fmt.Sprint(got.Swept[2]) != "map[join:map[slots:[1]]]" {
		t.Errorf("a notice swept before its filer looked: filed at, raised at, notice 3 = %v, want 3, 2, the join", got.Swept)
	}
	if want := []any{2.0, 1.0, false}; !slices.Equal(got.Emptied, want) {
		t.Errorf("a slot swept just before the filing took it: filed at, swept at, copy left below = %v, want %v", got.Emptied, want)
	}
}
