package rendezvous

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// peekMemStore is a memStore that peeks (Peeker), as etcd's Store does.
// It counts compare-sets and pushes per key, records who took the folder
// lock, and makes compare-sets of slowKey take slow while its round
// gathers.
type peekMemStore struct {
	*memStore
	slowKey string
	slow    time.Duration
	// dropKey: the first write of it that assigns ranks is lost, as
	// when a publisher that lost the folder lock overwrites a newer one.
	dropKey string

	cmu     sync.Mutex
	cas     map[string]int
	pmu     sync.Mutex // apart from cmu: CompareSet peeks holding cmu
	peeks   map[string]int
	pushes  int      // joins (keep-alives apart)
	holders []string // each holder that took the lock from free or lapsed
}

func newPeekMemStore() *peekMemStore {
	return &peekMemStore{memStore: newQueueMemStore(), cas: map[string]int{}, peeks: map[string]int{}}
}

func (p *peekMemStore) Peek(_ context.Context, keys ...string) ([][]byte, error) {
	p.pmu.Lock()
	for _, k := range keys {
		p.peeks[k]++
	}
	p.pmu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([][]byte, len(keys))
	for i, k := range keys {
		if v, ok := p.kv[k]; ok {
			out[i] = append([]byte{}, v...)
		}
	}
	return out, nil
}

func (p *peekMemStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	p.cmu.Lock()
	p.cas[k]++
	if strings.HasSuffix(k, lockSuffix) && (len(expected) == 0 || parseLock(expected).holder == lockFree) {
		if v := parseLock(desired); v.holder != lockFree {
			defer func() {
				p.cmu.Lock()
				if cur, _ := p.Peek(ctx, k); string(cur[0]) == string(desired) {
					p.holders = append(p.holders, v.holder)
				}
				p.cmu.Unlock()
			}()
		}
	}
	p.cmu.Unlock()
	// Slow until the round completes: past it, heartbeats folded this
	// slowly would outlast their TTL (15 s), which is another story.
	if k == p.slowKey && !strings.Contains(string(desired), `"complete":true`) {
		time.Sleep(p.slow)
	}
	return p.memStore.CompareSet(ctx, k, expected, desired)
}

func (p *peekMemStore) QueuePush(ctx context.Context, k string, v []byte) error {
	var r request
	if json.Unmarshal(v, &r) == nil && !r.KeepAlive {
		p.cmu.Lock()
		p.pushes++
		p.cmu.Unlock()
	}
	return p.memStore.QueuePush(ctx, k, v)
}

func (p *peekMemStore) MultiSet(ctx context.Context, keys []string, values [][]byte) error {
	p.cmu.Lock()
	var ks []string
	var vs [][]byte
	for i, k := range keys {
		if k == p.dropKey && strings.Contains(string(values[i]), `"rank":`) {
			p.dropKey = ""
			continue
		}
		ks, vs = append(ks, k), append(vs, values[i])
	}
	p.cmu.Unlock()
	return p.memStore.MultiSet(ctx, ks, vs)
}

func (p *peekMemStore) casOf(k string) int {
	p.cmu.Lock()
	defer p.cmu.Unlock()
	return p.cas[k]
}

// bubbleRound joins n nodes to run "job" in p at once, min = max = n,
// each given only its share of the round, and returns their handles once
// every node has its rank (node i rank i) within two minutes.
func bubbleRound(t *testing.T, p *peekMemStore, n int) []*Dynamic {
	t.Helper()
	return bubbleRoundOver(t, p, n)
}

// bubbleRoundOver is bubbleRound over s, p or a wrapper of it.
func bubbleRoundOver(t *testing.T, s Store, n int) []*Dynamic {
	t.Helper()
	ds := make([]*Dynamic, n)
	for i := range ds {
		d, err := NewDynamic(s, nd(i), []byte("x"), DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		ds[i] = d
	}
	start := time.Now()
	chs := make([]<-chan bubbleResult, n)
	for i, d := range ds {
		chs[i] = goNext(d, start)
	}
	for i, ch := range chs {
		if x := <-ch; x.err != nil || x.r.Rank != i || x.r.Size != n || x.at > 2*time.Minute {
			t.Fatalf("node %d: %+v (%v)", i, x, x.err)
		}
	}
	return ds
}

// TestBubblePeeks: on a store that peeks, a crowd's nodes read their
// views and the folder lock without a compare-set (on etcd one is a Raft
// proposal even when it fails): only the publishers compare-set the
// marker, and the lock is compare-set by its holders alone, where every
// node used to compare-set the marker, its share and the lock at each
// look. A slow state write (6 s: a read and a write of it outlast the lock's 5-s hold) does not
// let a second folder in: the holder renews its lock while it folds, and
// no node pushes its request twice. Behind the seal detector of an agent
// without a job secret (the default) the same holds: the detector used to
// hide the store's Peek, and every look became a compare-set.
func TestBubblePeeks(t *testing.T) {
	const n = 40
	for _, tc := range []struct {
		name     string
		slow     time.Duration
		detector bool
	}{
		{"fast", 0, false},
		{"slow state writes", 6 * time.Second, false},
		{"fast, behind a seal detector", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPeekMemStore()
				key := "gorun.rendezvous.job"
				if tc.slow > 0 {
					p.slowKey, p.slow = key, tc.slow
				}
				var s Store = p
				if tc.detector {
					s = NewSealDetector(p, nil)
				}
				ds := bubbleRoundOver(t, s, n)
				p.mu.Lock()
				writes := p.writes[key]
				p.mu.Unlock()
				if c := p.casOf(key + markerSuffix); c > writes {
					t.Errorf("%d compare-sets of the marker, %d writes of the state", c, writes)
				}
				if c := p.casOf(ds[0].shareKey(ds[0].bucket)); c != 0 {
					t.Errorf("%d compare-sets of a share", c)
				}
				p.cmu.Lock()
				defer p.cmu.Unlock()
				if c := p.cas[key+lockSuffix]; c > 40 {
					t.Errorf("%d compare-sets of the folder lock", c)
				}
				if p.pushes != n {
					t.Errorf("%d joins pushed by %d nodes", p.pushes, n)
				}
				if tc.slow > 0 && len(slices.Compact(slices.Clone(p.holders))) > 1 {
					t.Errorf("folders one after another while the first folded: %v", p.holders)
				}
			})
		})
	}
}

// TestBubbleStaleShareRepublished: the share that tells a bucket's nodes
// their ranks is lost (two publishers crossing can leave it older than
// the state). Its nodes must not take rank 0 from the bucket as it was
// before the round completed (they did), nor wait out the join timeout:
// a view whose bucket is not of the marker's round shows no node, and
// past settle (5 s) the node decides on the state itself.
func TestBubbleStaleShareRepublished(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 40
		p := newPeekMemStore()
		ds := bubbleNodes(t, p.memStore, n, DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true})
		for i := range ds { // the same handles, on the peeking store
			d, err := NewDynamic(p, nd(i), []byte("x"), ds[i].cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { d.Close() })
			ds[i] = d
		}
		p.dropKey = ds[5].shareKey(ds[5].bucket)
		start := time.Now()
		chs := make([]<-chan bubbleResult, n)
		for i, d := range ds {
			chs[i] = goNext(d, start)
		}
		for i, ch := range chs {
			if x := <-ch; x.err != nil || x.r.Rank != i || x.r.Size != n || x.at > 20*time.Second {
				t.Fatalf("node %d: %+v (%v)", i, x, x.err)
			}
		}
		if p.dropKey != "" {
			t.Fatal("no share was lost")
		}
	})
}

// TestBubbleCrowdLooksBounded: while a folder holds the lock (renewing
// it, applying nothing), the nodes whose requests wait look at the lock
// about CrowdRate times a second together, not each every settle (5 s):
// a crowd's looks on a loaded store are what starve the folder. Once the
// folder is gone, one of them takes the lock within a look period and the
// round completes. With CrowdRate negative (no stretch) the same crowd
// looks every settle, which the bound would refuse.
func TestBubbleCrowdLooksBounded(t *testing.T) {
	const (
		n    = 40
		held = 200 * time.Second
	)
	for _, tc := range []struct {
		name      string
		rate      int
		maxLooks  int // during held
		roundTook time.Duration
	}{
		// 40 nodes at 1 a second: a look period of 30–50 s; one lazy
		// look each after its push.
		{"stretched", 1, n + int(held/time.Second)*3/2, held + 5*time.Second + 50*time.Second + 10*time.Second},
		{"never stretched", -1, 1 << 30, held + 5*time.Second + 5*time.Second + 10*time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPeekMemStore()
				lockKey := "gorun.rendezvous.job" + lockSuffix
				start := time.Now()
				holdLockElsewhere(p, lockKey, start, held)
				ds := make([]*Dynamic, n)
				for i := range ds {
					d, err := NewDynamic(p, nd(i), []byte("x"), DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true, CrowdRate: tc.rate})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					ds[i] = d
				}
				chs := make([]<-chan bubbleResult, n)
				for i, d := range ds {
					chs[i] = goNext(d, start)
				}
				time.Sleep(held)
				looks := p.looksAt(lockKey)
				t.Logf("%d looks at the lock in %v by %d nodes", looks, held, n)
				if looks > tc.maxLooks {
					t.Errorf("%d looks at the lock in %v, want at most %d", looks, held, tc.maxLooks)
				}
				if tc.rate < 0 && looks < n*int(held/(5*time.Second))/2 {
					t.Errorf("without the stretch, %d looks in %v: the bound above tests nothing", looks, held)
				}
				awaitRanks(t, chs, tc.roundTook)
			})
		})
	}
}

// TestBubbleCrowdGathered: a crowd's joins reach the queue over seconds
// (here 40 nodes, one every 100 ms); beyond CrowdRate × KeepAliveInterval
// nodes the folder gathers them and writes the state once or twice for
// the round, where it wrote it whenever it found the queue empty: a
// write of O(N) bytes (and of every bucket's share) per few joins, so
// that the bytes written per node grew with N. The round still completes
// within the quiet wait of the last join.
func TestBubbleCrowdGathered(t *testing.T) {
	const (
		n      = 40
		spread = 100 * time.Millisecond
	)
	for _, tc := range []struct {
		name      string
		rate      int // CrowdRate: 1 makes 40 nodes a crowd; -1 never
		maxWrites int
		minWrites int
	}{
		{"crowd", 1, 2, 1},
		{"no crowd", -1, 1 << 30, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPeekMemStore()
				start := time.Now()
				chs := make([]<-chan bubbleResult, n)
				for i := range chs {
					d, err := NewDynamic(p, nd(i), []byte("x"), DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true, CrowdRate: tc.rate})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					chs[i] = goNext(d, start)
					time.Sleep(spread)
				}
				arrived := time.Since(start)
				var last time.Duration
				for i, ch := range chs {
					x := <-ch
					if x.err != nil || x.r.Size != n {
						t.Fatalf("node %d: %+v (%v), want a round of %d", i, x.r, x.err, n)
					}
					last = max(last, x.at)
				}
				writes := p.casOf("gorun.rendezvous.job")
				t.Logf("%d writes of the state; the last node assigned %v after the start, %v after the last join",
					writes, last, last-arrived)
				if writes > tc.maxWrites || writes < tc.minWrites {
					t.Errorf("%d writes of the state for %d joins, want %d to %d", writes, n, tc.minWrites, tc.maxWrites)
				}
				// The last join, then the quiet wait (lazyDelay ÷ 2), then
				// the write and the wake-up.
				if d := last - arrived; d > 2*time.Second {
					t.Errorf("the last node assigned %v after the last join, want within 2 s", d)
				}
			})
		})
	}
}

// TestBubbleCrowdNoLazyLook: a crowd's join whose fold right after its
// push finds another node folding makes no lazy look at the lock a second
// later (that folder sees the request in the queue should it let go), so
// while the folder holds the lock each node looks once, at its push; out
// of a crowd each looks again after lazyDelay. Either way the round
// completes once the folder is gone.
func TestBubbleCrowdNoLazyLook(t *testing.T) {
	const (
		n    = 40
		held = 4 * time.Second // past the lazy look (1 s), before settle (5 s)
	)
	for _, tc := range []struct {
		name               string
		rate               int // CrowdRate: 1 makes 40 nodes a crowd; -1 never
		minLooks, maxLooks int // during held
		roundTook          time.Duration
	}{
		{"crowd", 1, n, n, held + 5*time.Second + 50*time.Second + 10*time.Second},
		{"no crowd", -1, 2 * n, 2 * n, held + 5*time.Second + 5*time.Second + 10*time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPeekMemStore()
				lockKey := "gorun.rendezvous.job" + lockSuffix
				start := time.Now()
				holdLockElsewhere(p, lockKey, start, held)
				chs := make([]<-chan bubbleResult, n)
				for i := range chs {
					d, err := NewDynamic(p, nd(i), []byte("x"), DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true, CrowdRate: tc.rate})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					chs[i] = goNext(d, start)
				}
				time.Sleep(held)
				looks := p.looksAt(lockKey)
				t.Logf("%d looks at the lock in %v by %d nodes", looks, held, n)
				if looks < tc.minLooks || looks > tc.maxLooks {
					t.Errorf("%d looks at the lock in %v, want %d to %d", looks, held, tc.minLooks, tc.maxLooks)
				}
				awaitRanks(t, chs, tc.roundTook)
			})
		})
	}
}

// holdLockElsewhere has a folder elsewhere hold the run's lock (lockKey)
// from start and renew it each second with a 5-s hold, until held has
// passed.
func holdLockElsewhere(p *peekMemStore, lockKey string, start time.Time, held time.Duration) {
	hold := func() {
		v := lockValue{holder: "elsewhere 1", expiry: time.Now().Add(5 * time.Second), start: start}
		p.memStore.Set(context.Background(), lockKey, v.bytes())
	}
	hold()
	go func() {
		for time.Since(start) < held {
			time.Sleep(time.Second)
			hold()
		}
	}()
}

// looksAt returns how many times key was peeked at.
func (p *peekMemStore) looksAt(key string) int {
	p.pmu.Lock()
	defer p.pmu.Unlock()
	return p.peeks[key]
}

// awaitRanks waits for every node's Next (chs, in node order) and fails
// the test unless node i got rank i of len(chs) within took.
func awaitRanks(t *testing.T, chs []<-chan bubbleResult, took time.Duration) {
	t.Helper()
	for i, ch := range chs {
		if x := <-ch; x.err != nil || x.r.Rank != i || x.r.Size != len(chs) || x.at > took {
			t.Fatalf("node %d: %+v (%v), want its rank by %v", i, x, x.err, took)
		}
	}
}

// pushPeekStore is a peekMemStore that pushes and looks in one request
// (PushPeeker), as etcd's Store does; with refuse, it says it cannot
// after all (a wrapper of a store that cannot). It counts its calls, and
// the compare-sets that try to take an absent lock.
type pushPeekStore struct {
	*peekMemStore
	refuse bool

	mu          sync.Mutex
	pushPeeks   int
	lockLooked  int // of them, looks at the folder lock
	created     int // the lock created by a push
	absentTakes int // compare-sets expecting the lock absent
}

func (s *pushPeekStore) QueuePushPeek(ctx context.Context, k string, v []byte, look string, create []byte) ([]byte, error) {
	if s.refuse {
		return nil, ErrNotSupported
	}
	if err := s.peekMemStore.QueuePush(ctx, k, v); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.pushPeeks++
	if strings.HasSuffix(look, lockSuffix) {
		s.lockLooked++
	}
	s.mu.Unlock()
	s.peekMemStore.mu.Lock()
	defer s.peekMemStore.mu.Unlock()
	cur, ok := s.peekMemStore.kv[look]
	if !ok && create != nil {
		s.peekMemStore.kv[look] = append([]byte{}, create...)
		s.mu.Lock()
		s.created++
		s.mu.Unlock()
		return create, nil
	}
	if !ok {
		return nil, nil
	}
	return append([]byte{}, cur...), nil
}

func (s *pushPeekStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	if strings.HasSuffix(k, lockSuffix) && expected == nil {
		s.mu.Lock()
		s.absentTakes++
		s.mu.Unlock()
	}
	return s.peekMemStore.CompareSet(ctx, k, expected, desired)
}

// TestBubblePushPeeksLock: where the store pushes and looks in one request
// (PushPeeker: etcd), a join's push reads the folder lock with it, and the
// fold after the push looks no more: while another node folds, the crowd's
// nodes make no Peek of the lock at all, one request each where they made
// two. With no lock yet, the first push creates it and its node folds:
// none of the crowd tries to take an absent lock with a compare-set, which
// on etcd is a Raft proposal each (a crowd that starts together found it
// absent, every node of it). A store that cannot after all is pushed to
// and peeked at as before. Every round completes.
func TestBubblePushPeeksLock(t *testing.T) {
	const (
		n    = 40
		held = 4 * time.Second // before the look period (30–50 s at CrowdRate 1)
	)
	for _, tc := range []struct {
		name        string
		pushPeek    bool // the store is a PushPeeker
		refuse      bool // that cannot after all
		noLock      bool // no folder elsewhere: the lock is absent
		peeks       int  // Peeks of the lock during held
		pushPeeks   int
		created     int
		absentTakes int // at most
	}{
		{"push and peek", true, false, false, 0, n, 0, 0},
		{"push and peek, no lock yet", true, false, true, -1, n, 1, 0},
		{"peeker only", false, false, false, n, 0, 0, 0},
		{"push and peek refused", true, true, false, n, 0, 0, 0},
		{"push and peek refused, no lock yet", true, true, true, -1, 0, 0, n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				p := newPeekMemStore()
				pp := &pushPeekStore{peekMemStore: p, refuse: tc.refuse}
				var store Store = p
				if tc.pushPeek {
					store = pp
				}
				lockKey := "gorun.rendezvous.job" + lockSuffix
				start := time.Now()
				if !tc.noLock {
					holdLockElsewhere(p, lockKey, start, held)
				}
				chs := make([]<-chan bubbleResult, n)
				for i := range chs {
					d, err := NewDynamic(store, nd(i), []byte("x"), DynamicConfig{RunID: "job", MinNodes: n, MaxNodes: n, ShareOnly: true, CrowdRate: 1})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { d.Close() })
					chs[i] = goNext(d, start)
				}
				time.Sleep(held)
				p.pmu.Lock()
				peeks := p.peeks[lockKey]
				p.pmu.Unlock()
				pp.mu.Lock()
				pushPeeks, looked, created, absentTakes := pp.pushPeeks, pp.lockLooked, pp.created, pp.absentTakes
				pp.mu.Unlock()
				p.cmu.Lock()
				pushes := p.pushes
				p.cmu.Unlock()
				t.Logf("%d peeks at the lock, %d pushes (%d with a look at it), the lock created by %d, %d compare-sets taking it absent",
					peeks, pushes, pushPeeks, created, absentTakes)
				if tc.peeks >= 0 && peeks != tc.peeks || pushPeeks != tc.pushPeeks || looked != tc.pushPeeks || pushes < n ||
					created != tc.created || absentTakes > tc.absentTakes {
					t.Errorf("%d peeks at the lock, %d pushes of which %d pushed and looked (%d at the lock), created %d, %d absent takes; "+
						"want %d, %d, %d, %d, at most %d", peeks, pushes, pushPeeks, looked, created, absentTakes,
						tc.peeks, n, tc.pushPeeks, tc.created, tc.absentTakes)
				}
				if tc.noLock && tc.refuse && absentTakes == 0 {
					t.Errorf("without the push's look, no compare-set took the absent lock: the bound above tests nothing")
				}
				for i, ch := range chs {
					if x := <-ch; x.err != nil || x.r.Rank != i || x.r.Size != n || x.at > held+70*time.Second {
						t.Fatalf("node %d: %+v (%v)", i, x, x.err)
					}
				}
			})
		})
	}
}

// TestBubbleCloseReadsTheMarker: at a job's end every node closes the
// run. Once one has, the others find it closed in the marker and leave
// the state alone: 512 agents each reading the whole state (on etcd a
// compare-set, a Raft proposal with an O(N) answer) at the job's end let
// hundreds of their leases lapse. The run is closed for all of them all
// the same.
func TestBubbleCloseReadsTheMarker(t *testing.T) {
	const n = 40
	synctest.Test(t, func(t *testing.T) {
		p := newPeekMemStore()
		key := "gorun.rendezvous.job"
		ds := bubbleRound(t, p, n)
		ctx := t.Context()
		before := p.casOf(key)
		if err := ds[0].SetClosed(ctx); err != nil {
			t.Fatal(err)
		}
		first := p.casOf(key) - before
		if first == 0 {
			t.Fatal("the first close did not write the state")
		}
		for i, d := range ds[1:] {
			if err := d.SetClosed(ctx); err != nil {
				t.Fatalf("node %d: %v", i+1, err)
			}
		}
		if c := p.casOf(key) - before - first; c != 0 {
			t.Errorf("%d compare-sets of the state by %d nodes closing a closed run", c, n-1)
		}
		for i, d := range ds {
			if _, err := d.Next(ctx); !errors.Is(err, ErrRendezvousClosed) {
				t.Fatalf("node %d: Next after the close: %v", i, err)
			}
		}
	})
}
