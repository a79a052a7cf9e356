package rendezvous

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// lostAnswerStore is a memStore whose next compare-set of the state (a
// create-only one if creates, else a replacing one) loses its answer:
// applied or not (apply), it fails wrapping ErrOutcomeUnknown, as etcd's
// Storage does when the lease of the token that would tell ended while
// the request was sent again.
type lostAnswerStore struct {
	*memStore
	key     string
	creates bool
	apply   bool
	lose    int // compare-sets whose answer to lose; 0: one
	lost    int // compare-sets that lost their answer
}

func (s *lostAnswerStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	if k != s.key || (len(expected) == 0) != s.creates || s.lost >= max(s.lose, 1) {
		return s.memStore.CompareSet(ctx, k, expected, desired)
	}
	s.lost++
	if s.apply {
		s.memStore.CompareSet(ctx, k, expected, desired)
	}
	return nil, fmt.Errorf("%w: test: %w", ErrUnavailable, ErrOutcomeUnknown)
}

// TestCommitOutcomeUnknown: a write of the state whose outcome the store
// cannot tell is settled by reading the state back: won when it holds the
// write, a race lost otherwise, and Next goes on either way. It used to
// fail Next, and a spare's agent whose link was cut for 4 s (its etcd
// lease lapsed meanwhile) exited (bench/chaos, link-cut: its read of the
// state, a create-only compare-set, lost its answer: TestReadOutcomeUnknown).
func TestCommitOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m := &lostAnswerStore{memStore: newMemStore(), apply: apply}
			d, err := NewDynamic(m, nd(0), nil, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			m.key = d.key
			snap, err := d.read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			st := snap.st.clone()
			st.apply(actAddToParticipants, nd(0), nil, time.Now(), d.cfg)
			won, err := d.commit(ctx, snap, st, time.Time{})
			if err != nil || won != apply || m.lost != 1 {
				t.Fatalf("commit: won %v, %v (answers lost %d); want won %v, no error", won, err, m.lost, apply)
			}
			if joined := len(snap.st.Nodes) == 1; joined != apply {
				t.Errorf("the snapshot after the commit has %d nodes; want the store's state (%d)", len(snap.st.Nodes), map[bool]int{true: 1}[apply])
			}
			if r, err := d.Next(ctx); err != nil || len(r.Members) != 1 {
				t.Fatalf("Next: %+v, %v", r, err)
			}
		})
	}
}

// TestCreateOnceOutcomeUnknown: a create-only compare-set whose outcome
// the store cannot tell is sent again until it is told (here three
// answers lost in a row), and the key holds the value, once, whether the
// first sending applied or not. The job's restart counter is created so
// (launcher); its error used to end the agent (three of 512 on etcd, and
// the round never completed; again with one retry, when the answer was
// lost twice).
func TestCreateOnceOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m := &lostAnswerStore{memStore: newMemStore(), key: "gorun.job.restarts", creates: true, apply: apply, lose: 3}
			if v, err := CreateOnce(ctx, m, m.key, []byte("0")); err != nil || m.lost != 3 || string(v) != "0" {
				t.Fatalf("CreateOnce: %q, %v (answers lost %d)", v, err, m.lost)
			}
			m.mu.Lock()
			v := m.kv[m.key]
			m.mu.Unlock()
			if string(v) != "0" {
				t.Fatalf("the key holds %q; want 0", v)
			}
		})
	}
}

// TestCreateOnceReadsWhatExists: where the store peeks, CreateOnce reads
// a key that exists and compare-sets only an absent one (or where the peek
// fails): on etcd each compare-set is a Raft proposal whatever its
// outcome, and every agent of a crowd sent one for the restart counter the
// first agent had created.
func TestCreateOnceReadsWhatExists(t *testing.T) {
	const key = "gorun.job.restarts"
	for _, tc := range []struct {
		name     string
		preset   []byte // nil: absent
		peekFail bool
		want     string
		wantCAS  int
	}{
		{name: "absent", want: "0", wantCAS: 1},
		{name: "present", preset: []byte("3"), want: "3", wantCAS: 0},
		{name: "present, the peek fails", preset: []byte("3"), peekFail: true, want: "3", wantCAS: 1},
		{name: "absent, the peek fails", peekFail: true, want: "0", wantCAS: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			p := newPeekMemStore()
			if tc.preset != nil {
				if err := p.Set(ctx, key, tc.preset); err != nil {
					t.Fatal(err)
				}
			}
			var s Store = p
			if tc.peekFail {
				s = failingPeek{p}
			}
			v, err := CreateOnce(ctx, s, key, []byte("0"))
			if err != nil || string(v) != tc.want {
				t.Fatalf("CreateOnce: %q, %v; want %q", v, err, tc.want)
			}
			p.cmu.Lock()
			n := p.cas[key]
			p.cmu.Unlock()
			if n != tc.wantCAS {
				t.Errorf("%d compare-sets of the key; want %d", n, tc.wantCAS)
			}
		})
	}
}

// failingPeek is a peekMemStore whose Peek fails, as a wrapper's whose
// inner store cannot peek does.
type failingPeek struct{ *peekMemStore }

func (failingPeek) Peek(context.Context, ...string) ([][]byte, error) {
	return nil, fmt.Errorf("peek: %w", ErrNotSupported)
}

// TestReadOutcomeUnknown: the state's read is a create-only compare-set of
// the empty state; one whose outcome the store cannot tell is sent again
// until it is told (three answers lost in a row here), and Next goes on,
// whether the first created the state or not.
func TestReadOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m := &lostAnswerStore{memStore: newMemStore(), creates: true, apply: apply, lose: 3}
			d, err := NewDynamic(m, nd(0), nil, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			m.key = d.key
			if r, err := d.Next(ctx); err != nil || m.lost != 3 || len(r.Members) != 1 {
				t.Fatalf("Next: %+v, %v (answers lost %d); want a round of one after three lost answers", r, err, m.lost)
			}
		})
	}
}

// TestMarkerReadOutcomeUnknown: in queue mode a node reads the marker,
// where the store cannot peek, with a create-only compare-set of the
// empty marker; one whose outcome the store cannot tell is sent again
// until it is told, and Next goes on. At 1,024 agents on etcd three Nexts
// ended on it, and at 512 one that lost the answer twice.
func TestMarkerReadOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m := &lostAnswerStore{memStore: newQueueMemStore(), creates: true, apply: apply, lose: 3}
			d, err := NewDynamic(m, nd(0), nil, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1, QueueMinNodes: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			m.key = d.key + markerSuffix
			if r, err := d.Next(ctx); err != nil || m.lost != 3 || r.Size != 1 {
				t.Fatalf("Next: %+v, %v (answers lost %d); want a round of one after three lost answers", r, err, m.lost)
			}
		})
	}
}

// TestLockOutcomeUnknown: a compare-set of the folder lock whose outcome
// the store cannot tell is settled by reading the lock back: held when
// it holds this node's value; otherwise a take goes on as after any look
// that found the lock free (and takes it), and a renewal is not held. It
// used to fail the node's
// Next: at 512 agents on etcd one agent exited on "folder lock: …
// whether the write was applied is unknown", and the job never started
// its worker.
func TestLockOutcomeUnknown(t *testing.T) {
	for _, renew := range []bool{false, true} {
		for _, apply := range []bool{true, false} {
			t.Run(fmt.Sprintf("renew=%v/applied=%v", renew, apply), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				m := &lostAnswerStore{memStore: newMemStore(), creates: !renew, apply: apply}
				d, err := NewDynamic(m, nd(0), nil, DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 64})
				if err != nil {
					t.Fatal(err)
				}
				defer d.Close()
				var mine []byte
				if renew {
					if mine, _, err = d.lock(ctx, nil, nil); err != nil || mine == nil {
						t.Fatalf("taking the lock: %q, %v", mine, err)
					}
				}
				m.key = d.key + lockSuffix
				got, held, err := d.lock(ctx, mine, nil)
				if want := apply || !renew; err != nil || held != want || m.lost != 1 {
					t.Fatalf("lock: held %v, %v (answers lost %d); want held %v, no error", held, err, m.lost, want)
				}
				cur, err := d.readLock(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if held != bytes.Equal(cur, got) {
					t.Fatalf("the lock holds %q; the node says it holds it (%v) with %q", cur, held, got)
				}
				if !held && !bytes.Equal(cur, mine) {
					t.Fatalf("a renewal not applied: the lock holds %q, want the old value %q", cur, mine)
				}
			})
		}
	}
}

// lostPopStore is a memStore with queues whose first pop of a request
// loses its answer: applied or not (apply), it fails wrapping
// ErrOutcomeUnknown, and an applied one's request is gone with it.
type lostPopStore struct {
	*memStore
	apply bool
	lost  atomic.Int32 // pops that lost their answer
}

func (s *lostPopStore) QueuePop(ctx context.Context, k string, block bool) ([]byte, error) {
	if n, _ := s.memStore.QueueLen(ctx, k); n == 0 || !s.lost.CompareAndSwap(0, 1) {
		return s.memStore.QueuePop(ctx, k, block)
	}
	if s.apply {
		s.memStore.QueuePop(ctx, k, block)
	}
	return nil, fmt.Errorf("%w: test: %w", ErrUnavailable, ErrOutcomeUnknown)
}

// TestPopOutcomeUnknown: a folder's pop whose outcome the store cannot
// tell does not end its Next; the round completes, a request the pop took
// with it once its node pushes it again (at settle, KeepAliveTimeout
// after the push). It used to fail Next: at 512 agents on etcd, a folder
// whose lease lapsed exited so, and the job waited for its worker.
func TestPopOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := &lostPopStore{memStore: newQueueMemStore(), apply: apply}
				cfg := DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, QueueMinNodes: 1}
				ds := make([]*Dynamic, 3)
				for i := range ds {
					d, err := NewDynamic(m, nd(i), nil, cfg)
					if err != nil {
						t.Fatal(err)
					}
					defer d.Close()
					ds[i] = d
				}
				start := time.Now()
				var chs []<-chan bubbleResult
				for _, d := range ds {
					chs = append(chs, goNext(d, start))
				}
				for i, ch := range chs {
					x := <-ch
					if x.err != nil || len(x.r.Members) != 3 || x.r.Rank != i {
						t.Fatalf("node %d: %+v (%v)", i, x.r, x.err)
					}
					if x.at > cfg.withDefaults().KeepAliveTimeout+time.Second {
						t.Errorf("node %d: round complete at %v; want within settle (%v) and a fold", i, x.at, cfg.withDefaults().KeepAliveTimeout)
					}
				}
				if m.lost.Load() != 1 {
					t.Errorf("%d pops lost their answer; want the test's one", m.lost.Load())
				}
			})
		})
	}
}

// lostCASStore is a memStore with queues whose first compare-set that
// match picks loses its answer: applied or not (apply), it fails wrapping
// ErrOutcomeUnknown.
type lostCASStore struct {
	*memStore
	match func(k string, expected, desired []byte) bool
	apply bool
	lost  atomic.Int32
}

func (s *lostCASStore) CompareSet(ctx context.Context, k string, expected, desired []byte) ([]byte, error) {
	if !s.match(k, expected, desired) || !s.lost.CompareAndSwap(0, 1) {
		return s.memStore.CompareSet(ctx, k, expected, desired)
	}
	if s.apply {
		s.memStore.CompareSet(ctx, k, expected, desired)
	}
	return nil, fmt.Errorf("%w: test: %w", ErrUnavailable, ErrOutcomeUnknown)
}

// TestFoldWritesOutcomeUnknown: the folder's other writes whose outcome
// the store cannot tell, the lock's release and the marker's publication,
// are settled by reading the key back, and every node's Next completes;
// either used to end the folder's Next, as its pop did
// (TestPopOutcomeUnknown).
func TestFoldWritesOutcomeUnknown(t *testing.T) {
	const key = "gorun.rendezvous.job"
	for _, tc := range []struct {
		name  string
		match func(k string, expected, desired []byte) bool
	}{
		{"lock release", func(k string, _, desired []byte) bool {
			return k == key+lockSuffix && parseLock(desired).holder == lockFree
		}},
		{"marker", func(k string, expected, _ []byte) bool { return k == key+markerSuffix && len(expected) != 0 }},
	} {
		for _, apply := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s, applied=%v", tc.name, apply), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					m := &lostCASStore{memStore: newQueueMemStore(), match: tc.match, apply: apply}
					cfg := DynamicConfig{RunID: "job", MinNodes: 3, MaxNodes: 3, QueueMinNodes: 1}
					start := time.Now()
					var chs []<-chan bubbleResult
					for i := range 3 {
						d, err := NewDynamic(m, nd(i), nil, cfg)
						if err != nil {
							t.Fatal(err)
						}
						defer d.Close()
						if d.key != key {
							t.Fatalf("the rendezvous key is %q, not %q", d.key, key)
						}
						chs = append(chs, goNext(d, start))
					}
					for i, ch := range chs {
						if x := <-ch; x.err != nil || len(x.r.Members) != 3 || x.r.Rank != i || x.at > time.Minute {
							t.Fatalf("node %d: %+v at %v (%v)", i, x.r, x.at, x.err)
						}
					}
					if m.lost.Load() != 1 {
						t.Errorf("%d compare-sets lost their answer; want the test's one", m.lost.Load())
					}
				})
			})
		}
	}
}
