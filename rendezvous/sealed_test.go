package rendezvous_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// sealBed is a TCPStore on loopback and plain clients of it: the store any
// host of a job can reach.
type sealBed struct {
	t    *testing.T
	addr string
}

func newSealBed(t *testing.T) *sealBed {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &sealBed{t: t, addr: srv.Addr().String()}
}

// raw is a client without any sealing: the forger, or a look at the
// bytes. Its sets and pushes are done when they return (flushed).
func (b *sealBed) raw() rendezvous.Store { return flushed{b.client()} }

// flushed waits for an answer after each set and push, which have none on
// the wire: another connection could otherwise overtake them.
type flushed struct{ rendezvous.Store }

func (f flushed) Set(ctx context.Context, key string, v []byte) error {
	if err := f.Store.Set(ctx, key, v); err != nil {
		return err
	}
	_, err := f.Store.Get(ctx, key)
	return err
}

func (f flushed) QueuePush(ctx context.Context, key string, v []byte) error {
	if err := f.Store.QueuePush(ctx, key, v); err != nil {
		return err
	}
	_, err := f.Store.QueueLen(ctx, key)
	return err
}

func (b *sealBed) client() *tcpstore.Client {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := tcpstore.Dial(ctx, b.addr, tcpstore.ClientConfig{Timeout: 10 * time.Second})
	if err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { c.Close() })
	return c
}

// refusals collects what a SealedStore reports.
type refusals struct {
	mu sync.Mutex
	rs []rendezvous.Refusal
}

func (r *refusals) add(x rendezvous.Refusal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rs = append(r.rs, x)
}

func (r *refusals) list() []rendezvous.Refusal {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]rendezvous.Refusal(nil), r.rs...)
}

// sealCfg is the configuration of a job's agents: key k (its check
// derived from it here for the test's purposes), run scope.
func sealCfg(key, scope string, rs *refusals) rendezvous.SealConfig {
	cfg := rendezvous.SealConfig{
		Key: []byte(key), Scope: scope, Check: fmt.Sprintf("%x", key[:4]),
		Sealed: func(k string) bool { return k != "counter" },
		Fresh:  func(k string) bool { return k != "view" },
	}
	if rs != nil {
		cfg.OnRefused = rs.add
	}
	return cfg
}

// sealed is a SealedStore over its own client of bed.
func (b *sealBed) sealed(cfg rendezvous.SealConfig) *rendezvous.SealedStore {
	b.t.Helper()
	s, err := rendezvous.NewSealedStore(b.client(), cfg)
	if err != nil {
		b.t.Fatal(err)
	}
	return s
}

// setSync sets key and reads it back on the same connection: a set has
// no answer on the wire, so another connection could otherwise overtake
// it.
func setSync(ctx context.Context, s rendezvous.Store, key, v string) error {
	if err := s.Set(ctx, key, []byte(v)); err != nil {
		return err
	}
	_, err := s.Get(ctx, key)
	return err
}

func shortCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestSealedRoundTrip: what goes through a SealedStore is stored sealed
// (the raw bytes are not the payload and start with the header), and
// comes back as written through any agent's SealedStore of the job.
// Counters pass through as plain decimals.
func TestSealedRoundTrip(t *testing.T) {
	bed := newSealBed(t)
	a, b := bed.sealed(sealCfg("job-key-0123456789", "run", nil)), bed.sealed(sealCfg("job-key-0123456789", "run", nil))
	raw := bed.raw()
	ctx := shortCtx(t, 20*time.Second)
	for _, tc := range []struct {
		name  string
		write func(s rendezvous.Store) error
		read  func(s rendezvous.Store) ([]byte, error)
		key   string
		want  string
	}{
		{"set, get", func(s rendezvous.Store) error { return s.Set(ctx, "k1", []byte("v1")) },
			func(s rendezvous.Store) ([]byte, error) { return s.Get(ctx, "k1") }, "k1", "v1"},
		{"multi-set, multi-get", func(s rendezvous.Store) error {
			return s.MultiSet(ctx, []string{"k2", "k3"}, [][]byte{[]byte("v2"), []byte("v3")})
		}, func(s rendezvous.Store) ([]byte, error) {
			vs, err := s.MultiGet(ctx, "k2", "k3")
			if err != nil {
				return nil, err
			}
			return bytes.Join(vs, []byte(",")), nil
		}, "k3", "v2,v3"},
		{"compare-set creates, compare-set reads", func(s rendezvous.Store) error {
			got, err := s.CompareSet(ctx, "k4", nil, []byte("v4"))
			if err == nil && string(got) != "v4" {
				err = fmt.Errorf("created %q", got)
			}
			return err
		}, func(s rendezvous.Store) ([]byte, error) { return s.CompareSet(ctx, "k4", nil, []byte("other")) }, "k4", "v4"},
		{"compare-set swaps what another agent wrote", func(s rendezvous.Store) error {
			if err := setSync(ctx, s, "k5", "old"); err != nil {
				return err
			}
			got, err := b.CompareSet(ctx, "k5", []byte("old"), []byte("new"))
			if err == nil && string(got) != "new" {
				err = fmt.Errorf("swapped to %q", got)
			}
			return err
		}, func(s rendezvous.Store) ([]byte, error) { return s.Get(ctx, "k5") }, "k5", "new"},
		{"compare-set with a stale expected answers the current value", func(s rendezvous.Store) error {
			if err := setSync(ctx, s, "k6", "cur"); err != nil {
				return err
			}
			got, err := b.CompareSet(ctx, "k6", []byte("stale"), []byte("x"))
			if err == nil && string(got) != "cur" {
				err = fmt.Errorf("got %q", got)
			}
			return err
		}, func(s rendezvous.Store) ([]byte, error) { return s.Get(ctx, "k6") }, "k6", "cur"},
		{"compare-set on an absent key with an expected value answers it", func(s rendezvous.Store) error {
			got, err := s.CompareSet(ctx, "k7", []byte("e"), []byte("d"))
			if err == nil && string(got) != "e" {
				err = fmt.Errorf("got %q", got)
			}
			return s.Set(ctx, "k7", []byte("v7"))
		}, func(s rendezvous.Store) ([]byte, error) { return s.Get(ctx, "k7") }, "k7", "v7"},
		{"queue", func(s rendezvous.Store) error { return s.QueuePush(ctx, "q", []byte("e1")) },
			// A push has no answer on the wire: pop blocking, from another connection.
			func(s rendezvous.Store) ([]byte, error) { return s.QueuePop(ctx, "q", true) }, "", "e1"},
		{"counter", func(s rendezvous.Store) error { _, err := s.Add(ctx, "counter", 3); return err },
			func(s rendezvous.Store) ([]byte, error) { return s.Get(ctx, "counter") }, "counter", "3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.write(a); err != nil {
				t.Fatal(err)
			}
			got, err := tc.read(b)
			if err != nil || string(got) != tc.want {
				t.Fatalf("read %q, %v; want %q", got, err, tc.want)
			}
			if tc.key == "" {
				return
			}
			stored, err := raw.Get(ctx, tc.key)
			if err != nil {
				t.Fatal(err)
			}
			if tc.key == "counter" {
				if string(stored) != "3" {
					t.Fatalf("counter stored as %q", stored)
				}
				return
			}
			if !bytes.HasPrefix(stored, []byte("GRS1 ")) {
				t.Fatalf("stored unsealed: %q", stored)
			}
		})
	}
	if ok, err := b.Check(ctx, "k1", "k2", "counter"); err != nil || !ok {
		t.Errorf("Check of genuine keys: %v, %v", ok, err)
	}
}

// TestSealedRefuses: a record that fails (forged without the key, under
// another key, tampered with, copied from another key or run, an older
// genuine one written back) is reported once with its reason and treated
// as absent: Get waits past it (here until its deadline), Check says
// absent, and a compare-set that expects nothing writes over it. A reader
// that has read a newer genuine record there writes that back instead.
func TestSealedRefuses(t *testing.T) {
	const key, scope = "job-key-0123456789", "run"
	for _, tc := range []struct {
		name string
		// forge writes the bad record at "k" with raw, given a genuine
		// agent's store g (to copy records from).
		forge func(ctx context.Context, raw rendezvous.Store, g *rendezvous.SealedStore) error
		why   rendezvous.RefusalReason
		// reader has read "k" before the forgery (a replay needs it).
		readFirst bool
	}{
		{"plain JSON", func(ctx context.Context, raw rendezvous.Store, _ *rendezvous.SealedStore) error {
			return raw.Set(ctx, "k", []byte(`{"round":7}`))
		}, rendezvous.RefusedUnsealed, false},
		{"header out of shape", func(ctx context.Context, raw rendezvous.Store, _ *rendezvous.SealedStore) error {
			return raw.Set(ctx, "k", []byte("GRS1 12 abc nothex\n{}"))
		}, rendezvous.RefusedMalformed, false},
		{"under another secret", func(ctx context.Context, raw rendezvous.Store, _ *rendezvous.SealedStore) error {
			other, err := rendezvous.NewSealedStore(raw, sealCfg("another-key-0123456", scope, nil))
			if err != nil {
				return err
			}
			return other.Set(ctx, "k", []byte("theirs"))
		}, rendezvous.RefusedOtherKey, false},
		{"tampered payload", func(ctx context.Context, raw rendezvous.Store, g *rendezvous.SealedStore) error {
			if err := g.Set(ctx, "k", []byte(`{"excluded":[]}`)); err != nil {
				return err
			}
			v, err := raw.Get(ctx, "k")
			if err != nil {
				return err
			}
			return raw.Set(ctx, "k", bytes.Replace(v, []byte("[]"), []byte("[2]"), 1))
		}, rendezvous.RefusedBadMAC, false},
		{"copied from another key", func(ctx context.Context, raw rendezvous.Store, g *rendezvous.SealedStore) error {
			if err := g.Set(ctx, "other", []byte("genuine elsewhere")); err != nil {
				return err
			}
			v, err := raw.Get(ctx, "other")
			if err != nil {
				return err
			}
			return raw.Set(ctx, "k", v)
		}, rendezvous.RefusedBadMAC, false},
		{"another run's", func(ctx context.Context, raw rendezvous.Store, _ *rendezvous.SealedStore) error {
			other, err := rendezvous.NewSealedStore(raw, sealCfg(key, "another-run", nil))
			if err != nil {
				return err
			}
			return other.Set(ctx, "k", []byte("another run's"))
		}, rendezvous.RefusedBadMAC, false},
		{"replayed", func(ctx context.Context, raw rendezvous.Store, g *rendezvous.SealedStore) error {
			old, err := raw.Get(ctx, "k") // the genuine record the reader read
			if err != nil {
				return err
			}
			if err := g.Set(ctx, "k", []byte("newer")); err != nil {
				return err
			}
			if _, err := g.Get(ctx, "k"); err != nil {
				return err
			}
			return raw.Set(ctx, "k", old)
		}, rendezvous.RefusedReplayed, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bed := newSealBed(t)
			raw := bed.raw()
			var rs refusals
			r := bed.sealed(sealCfg(key, scope, &rs))
			ctx := shortCtx(t, 20*time.Second)
			if tc.readFirst {
				if err := r.Set(ctx, "k", []byte("first")); err != nil {
					t.Fatal(err)
				}
			}
			g := r
			if !tc.readFirst {
				g = bed.sealed(sealCfg(key, scope, nil))
			}
			if err := tc.forge(ctx, raw, g); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			v, err := r.Get(shortCtx(t, 300*time.Millisecond), "k")
			switch {
			case tc.readFirst:
				// The reader has read a newer genuine record there: it
				// writes it back over the replay and reads it.
				if err != nil || string(v) != "newer" {
					t.Errorf("Get: %q, %v; want the newest genuine record", v, err)
				}
			case !errors.Is(err, rendezvous.ErrTimeout):
				t.Errorf("Get: %q, %v; want a timeout (the record counts as absent)", v, err)
			}
			if el := time.Since(start); el > 2*time.Second {
				t.Errorf("Get took %v past a 300 ms deadline", el)
			}
			if ok, err := r.Check(ctx, "k"); ok != tc.readFirst || err != nil {
				t.Errorf("Check: %v, %v; want %v (mended, or absent)", ok, err, tc.readFirst)
			}
			got := rs.list()
			if len(got) != 1 || got[0].Key != "k" || got[0].Reason != tc.why {
				t.Fatalf("refusals %+v, want one at k, %q (reported once however often read)", got, tc.why)
			}
			if r.Refused() != 1 {
				t.Errorf("Refused() = %d", r.Refused())
			}
			if !tc.readFirst {
				// Nothing genuine to restore: a compare-set expecting
				// nothing takes the key as absent and writes.
				v, err := r.CompareSet(ctx, "k", nil, []byte("fresh"))
				if err != nil || string(v) != "fresh" {
					t.Fatalf("CompareSet over the refused record: %q, %v", v, err)
				}
			} else {
				// The compare-set goes on from the mended record.
				v, err := r.CompareSet(ctx, "k", []byte("newer"), []byte("newest"))
				if err != nil || string(v) != "newest" {
					t.Fatalf("CompareSet over the replayed record: %q, %v", v, err)
				}
			}
			if v, err := bed.sealed(sealCfg(key, scope, nil)).Get(ctx, "k"); err != nil {
				t.Errorf("another agent reads after the mend: %q, %v", v, err)
			}
		})
	}
}

// TestSealedCompareSetMendsForgery: an agent that compare-sets a record it
// read, which a forger has overwritten since, writes its genuine record
// back and completes its compare-set on it; another agent's compare-set
// then sees the result. A forger rewriting the key slows the agents (a
// pause per refusal), it does not make them act on its record.
func TestSealedCompareSetMendsForgery(t *testing.T) {
	bed := newSealBed(t)
	raw := bed.raw()
	cfg := sealCfg("job-key-0123456789", "run", nil)
	a, b := bed.sealed(cfg), bed.sealed(cfg)
	ctx := shortCtx(t, 20*time.Second)
	if _, err := a.CompareSet(ctx, "state", nil, []byte("s1")); err != nil {
		t.Fatal(err)
	}
	if v, err := b.CompareSet(ctx, "state", nil, []byte("empty")); err != nil || string(v) != "s1" {
		t.Fatalf("b reads %q, %v", v, err)
	}
	if err := raw.Set(ctx, "state", []byte(`{"forged":true}`)); err != nil {
		t.Fatal(err)
	}
	if v, err := a.CompareSet(ctx, "state", []byte("s1"), []byte("s2")); err != nil || string(v) != "s2" {
		t.Fatalf("a's compare-set over the forgery: %q, %v", v, err)
	}
	if v, err := b.CompareSet(ctx, "state", []byte("s1"), []byte("s2b")); err != nil || string(v) != "s2" {
		t.Fatalf("b's stale compare-set: %q, %v; want s2", v, err)
	}
	// An older genuine record written back is refused by whoever read a
	// newer one, and mended the same way.
	old, err := raw.Get(ctx, "state")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.CompareSet(ctx, "state", []byte("s2"), []byte("s3")); err != nil {
		t.Fatal(err)
	}
	if err := raw.Set(ctx, "state", old); err != nil {
		t.Fatal(err)
	}
	if v, err := a.CompareSet(ctx, "state", nil, []byte("empty")); err != nil || string(v) != "s3" {
		t.Fatalf("a reads %q, %v after the replay; want s3", v, err)
	}
}

// TestSealedQueueDropsForgeries: forged elements of a queue are dropped,
// the genuine ones come in order.
func TestSealedQueueDropsForgeries(t *testing.T) {
	bed := newSealBed(t)
	raw := bed.raw()
	var rs refusals
	cfg := sealCfg("job-key-0123456789", "run", &rs)
	a := bed.sealed(cfg)
	ctx := shortCtx(t, 20*time.Second)
	push := func(s rendezvous.Store, v string) {
		if err := s.QueuePush(ctx, "q", []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	push(raw, "forged-0")
	push(a, "g1")
	push(raw, "forged-1")
	push(raw, "forged-2")
	push(a, "g2")
	push(raw, "forged-3")
	var got []string
	for {
		v, err := a.QueuePop(ctx, "q", false)
		if errors.Is(err, rendezvous.ErrQueueEmpty) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(v))
	}
	if fmt.Sprint(got) != "[g1 g2]" || len(rs.list()) != 4 {
		t.Fatalf("popped %v, refused %d; want [g1 g2], 4", got, len(rs.list()))
	}
}

// TestSealedViewsNotFresh: a key Fresh leaves out (several writers Set it
// without reading, by their own clocks) accepts an older record; Append
// is refused on sealed keys.
func TestSealedViewsNotFresh(t *testing.T) {
	bed := newSealBed(t)
	raw := bed.raw()
	cfg := sealCfg("job-key-0123456789", "run", nil)
	cfg.Now = func() time.Time { return time.Unix(2000, 0) } // this writer's clock is ahead
	ahead := bed.sealed(cfg)
	cfg.Now = func() time.Time { return time.Unix(1000, 0) }
	behind := bed.sealed(cfg)
	reader := bed.sealed(sealCfg("job-key-0123456789", "run", nil))
	ctx := shortCtx(t, 20*time.Second)
	if err := setSync(ctx, ahead, "view", "v1"); err != nil {
		t.Fatal(err)
	}
	if _, err := reader.Get(ctx, "view"); err != nil {
		t.Fatal(err)
	}
	if err := setSync(ctx, behind, "view", "v2"); err != nil {
		t.Fatal(err)
	}
	if v, err := reader.Get(ctx, "view"); err != nil || string(v) != "v2" {
		t.Fatalf("view %q, %v; want v2", v, err)
	}
	if err := reader.Append(ctx, "view", []byte("x")); !errors.Is(err, rendezvous.ErrNotSupported) {
		t.Errorf("Append on a sealed key: %v", err)
	}
	if err := raw.Set(ctx, "x", nil); err != nil {
		t.Fatal(err)
	}
}

// TestSealDetector: an agent without a secret that reads a sealed record
// fails with ErrSealedRecord; plain records pass. Over a store that peeks
// the detector peeks too (and checks what it peeks); over one that does
// not, it is no Peeker, which the rendezvous reads as "reads only by
// waiting or by a compare-set".
func TestSealDetector(t *testing.T) {
	bed := newSealBed(t)
	ctx := shortCtx(t, 20*time.Second)
	a := bed.sealed(sealCfg("job-key-0123456789", "run", nil))
	if _, ok := rendezvous.NewSealDetector(bed.raw(), nil).(rendezvous.Peeker); ok {
		t.Error("the detector of a store that cannot peek is a Peeker")
	}
	d := rendezvous.NewSealDetector(peekable{bed.raw()}, nil)
	p, ok := d.(rendezvous.Peeker)
	if !ok {
		t.Fatal("the detector of a store that peeks is no Peeker")
	}
	if err := d.Set(ctx, "plain", []byte("p")); err != nil {
		t.Fatal(err)
	}
	if v, err := d.Get(ctx, "plain"); err != nil || string(v) != "p" {
		t.Fatalf("plain: %q, %v", v, err)
	}
	if vs, err := p.Peek(ctx, "plain", "absent"); err != nil || len(vs) != 2 || string(vs[0]) != "p" || vs[1] != nil {
		t.Fatalf("peek plain and absent: %q, %v", vs, err)
	}
	if err := setSync(ctx, a, "sealed", "s"); err != nil { // else d's compare-set may overtake it and create the key
		t.Fatal(err)
	}
	for name, op := range map[string]func() error{
		"get":         func() error { _, err := d.Get(ctx, "sealed"); return err },
		"multi-get":   func() error { _, err := d.MultiGet(ctx, "plain", "sealed"); return err },
		"compare-set": func() error { _, err := d.CompareSet(ctx, "sealed", nil, []byte("x")); return err },
		"peek":        func() error { _, err := p.Peek(ctx, "plain", "sealed"); return err },
	} {
		if err := op(); !errors.Is(err, rendezvous.ErrSealedRecord) {
			t.Errorf("%s: %v, want ErrSealedRecord", name, err)
		}
	}
}

// TestSealedDynamicRendezvous: the dynamic rendezvous runs unchanged over
// sealed stores, direct and queued, while a forger writes a state, a
// marker, a share and requests of its own: every node gets the same
// genuine round, with no forged node in it.
func TestSealedDynamicRendezvous(t *testing.T) {
	for _, queued := range []bool{false, true} {
		t.Run(fmt.Sprintf("queued=%v", queued), func(t *testing.T) {
			bed := newSealBed(t)
			raw := bed.raw()
			const n = 3
			cfg := rendezvous.DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n,
				JoinTimeout: 20 * time.Second, LastCallTimeout: 100 * time.Millisecond,
				KeepAliveInterval: 500 * time.Millisecond, KeepAliveTimeout: 2 * time.Second}
			if queued {
				cfg.QueueMinNodes = 1
			} else {
				cfg.QueueMinNodes = -1
			}
			state := "gorun.rendezvous.job"
			var rs refusals
			scfg := sealCfg("job-key-0123456789", "job", &rs)
			scfg.Sealed, scfg.Fresh = nil, func(k string) bool { return !rendezvous.DynamicViews("job")(k) }
			ctx := shortCtx(t, 30*time.Second)
			// The forger moves first: a state with its own node, complete.
			forged := []byte(`{"round":0,"complete":true,"size":1,"nodes":[{"addr":"rogue","pid":1,"local_id":0,"rank":0,"heartbeat":"2099-01-01T00:00:00Z"}]}`)
			if err := raw.Set(ctx, state, forged); err != nil {
				t.Fatal(err)
			}
			if err := raw.Set(ctx, state+"/marker", []byte(`{"pub":99,"round":0,"complete":true,"size":1,"wake":1,"participants":1}`)); err != nil {
				t.Fatal(err)
			}
			if queued {
				if err := raw.QueuePush(ctx, state+"/requests", []byte(`{"node":{"addr":"rogue","pid":2,"local_id":0},"call":1,"deadline":"2099-01-01T00:00:00Z"}`)); err != nil {
					t.Fatal(err)
				}
			}
			type result struct {
				r   rendezvous.Round
				err error
			}
			results := make(chan result, n)
			var ds []*rendezvous.Dynamic
			for i := range n {
				s := bed.sealed(scfg)
				d, err := rendezvous.NewDynamic(s, rendezvous.NodeDesc{Addr: fmt.Sprintf("node%d", i), Pid: 100 + i}, []byte("data"), cfg)
				if err != nil {
					t.Fatal(err)
				}
				ds = append(ds, d)
				t.Cleanup(func() { d.Close() })
			}
			for _, d := range ds {
				go func() {
					r, err := d.Next(ctx)
					results <- result{r, err}
				}()
			}
			var rounds []rendezvous.Round
			for range n {
				res := <-results
				if res.err != nil {
					t.Fatal(res.err)
				}
				rounds = append(rounds, res.r)
			}
			for _, r := range rounds {
				if r.Number != rounds[0].Number || len(r.Members) != n {
					t.Fatalf("rounds %+v", rounds)
				}
				for _, m := range r.Members {
					if m.Node.Addr == "rogue" {
						t.Fatalf("a forged node is in the round: %+v", r.Members)
					}
				}
			}
			if len(rs.list()) == 0 {
				t.Error("no refusal reported")
			}
		})
	}
}

// TestSealedWriterMendsItsRecord: a record its writer sets once (a node's
// worker store address), overwritten by a forger while another agent
// waits to read it: the other agent does not take the forgery, and gets
// the genuine record once the writer reads its own key, which writes it
// back.
func TestSealedWriterMendsItsRecord(t *testing.T) {
	bed := newSealBed(t)
	raw := bed.raw()
	cfg := sealCfg("job-key-0123456789", "run", nil)
	writer, reader := bed.sealed(cfg), bed.sealed(cfg)
	ctx := shortCtx(t, 20*time.Second)
	if err := setSync(ctx, writer, "addr", "10.0.0.1:1234"); err != nil {
		t.Fatal(err)
	}
	if err := raw.Set(ctx, "addr", []byte("10.6.6.6:1234")); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		v, err := reader.Get(ctx, "addr")
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(v)
	}()
	select {
	case v := <-got:
		t.Fatalf("the reader read %q before the writer mended its record", v)
	case <-time.After(200 * time.Millisecond):
	}
	if v, err := writer.Get(ctx, "addr"); err != nil || string(v) != "10.0.0.1:1234" {
		t.Fatalf("the writer reads %q, %v", v, err)
	}
	if v := <-got; v != "10.0.0.1:1234" {
		t.Fatalf("the reader reads %q", v)
	}
}

// peekable gives a store without Peek one, from Check and Get: what an
// etcd store's read-only requests do.
type peekable struct{ rendezvous.Store }

func (p peekable) Peek(ctx context.Context, keys ...string) ([][]byte, error) {
	out := make([][]byte, len(keys))
	for i, k := range keys {
		ok, err := p.Check(ctx, k)
		if err != nil || !ok {
			if err != nil {
				return nil, err
			}
			continue
		}
		if out[i], err = p.Get(ctx, k); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// TestSealedPeek: a SealedStore peeks through an inner store that can,
// opening each record: a genuine one reads as written, a forged one as
// absent (a read that does not wait finds no genuine record); over a
// store that cannot peek it says ErrNotSupported.
func TestSealedPeek(t *testing.T) {
	bed := newSealBed(t)
	ctx := shortCtx(t, 20*time.Second)
	a := bed.sealed(sealCfg("job-key-0123456789", "run", nil))
	if err := setSync(ctx, a, "genuine", "v"); err != nil {
		t.Fatal(err)
	}
	if err := setSync(ctx, bed.raw(), "forged", "GRS1 1 x y\nnot sealed"); err != nil {
		t.Fatal(err)
	}
	b, err := rendezvous.NewSealedStore(peekable{bed.client()}, sealCfg("job-key-0123456789", "run", nil))
	if err != nil {
		t.Fatal(err)
	}
	vs, err := b.Peek(ctx, "genuine", "forged", "absent")
	if err != nil || len(vs) != 3 || string(vs[0]) != "v" || vs[1] != nil || vs[2] != nil {
		t.Errorf("Peek = %q, %v; want [v <absent> <absent>]", vs, err)
	}
	if _, err := a.Peek(ctx, "genuine"); !errors.Is(err, rendezvous.ErrNotSupported) {
		t.Errorf("Peek over a store that cannot: %v, want ErrNotSupported", err)
	}
}
