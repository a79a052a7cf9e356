package launcher

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestExitTree: the exit barrier of n nodes ends for every node once the
// last arrives, not before, and no counter of its tree is added to by
// more than exitFanIn nodes (one counter every node added to cost a
// 512-agent job on etcd 2.5 minutes of failed compare-sets). The node
// that ends it calls its ending once, before it writes the end (so that
// the others find the job closed when they wake). A node outside the
// barrier's group waits for the end without counting. With a job secret
// the same holds, arrivals sealed.
func TestExitTree(t *testing.T) {
	for _, secret := range []Secret{nil, Secret("s3cr3t-of-the-tree-test")} {
		for _, n := range []int{1, 2, 8, 9, 65, 130} {
			t.Run(fmt.Sprintf("secret %v/%d", secret != nil, n), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				dial := storeServer(ctx, t)
				round := rendezvous.Round{Number: 3}
				node := func() *jobNode {
					j := &jobNode{cfg: &Config{JobSecret: secret}, log: zap.NewNop(), runID: "job", store: dial(), round: round}
					if err := j.seal(); err != nil {
						t.Fatal(err)
					}
					return j
				}
				var endings atomic.Int32
				var endedEarly atomic.Bool
				probe := node()
				ending := func(ctx context.Context) {
					endings.Add(1)
					if ended, err := round.Store(probe.store, "job").Check(ctx, exitBarrierEnd); err != nil || ended {
						endedEarly.Store(true)
					}
				}
				arrive := func(g int) <-chan error {
					done := make(chan error, 1)
					j := node()
					p := &plan{assignments: []Assignment{{GroupRank: g, GroupWorldSize: n}}}
					go func() { done <- j.exitBarrier(ctx, p, ending) }()
					return done
				}
				// A node that left the group (shrink mode's barrierRanks).
				outside := make(chan error, 1)
				j := node()
				go func() {
					outside <- j.exitBarrier(ctx, &plan{barrierRanks: []int{}, assignments: []Assignment{{GroupRank: n, GroupWorldSize: n + 1}}}, ending)
				}()
				var waiting []<-chan error
				for g := range n - 1 {
					waiting = append(waiting, arrive(g))
				}
				select {
				case err := <-outside:
					t.Fatalf("a node outside the group left before the group arrived: %v", err)
				case <-time.After(200 * time.Millisecond):
				}
				for g, c := range waiting {
					select {
					case err := <-c:
						t.Fatalf("node %d left the barrier with %d of %d arrived: %v", g, n-1, n, err)
					default:
					}
				}
				if endings.Load() != 0 {
					t.Fatalf("ended with %d of %d arrived", n-1, n)
				}
				allLeave(ctx, t, append(waiting, arrive(n-1), outside)...)
				if e := endings.Load(); e != 1 || endedEarly.Load() {
					t.Errorf("the barrier's ending ran %d times (want 1), after the end: %v", e, endedEarly.Load())
				}
				// Every counter is full, and none holds more than exitFanIn.
				s := dial()
				prefix := exitTreePrefix("job", round.Number)
				for level, size := 0, n; size > 1; level, size = level+1, (size+exitFanIn-1)/exitFanIn {
					for group := 0; group*exitFanIn < size; group++ {
						key := prefix + fmt.Sprintf("%d/%d", level, group)
						v, err := s.Get(ctx, key)
						if err != nil {
							t.Fatal(err)
						}
						want := min(exitFanIn, size-group*exitFanIn)
						if got, _ := strconv.Atoi(string(v)); got != want {
							t.Errorf("%s = %s, want %d", key, v, want)
						}
					}
				}
			})
		}
	}
}

// TestExitTreeForgedCount: someone who reaches the store adds to the exit
// barrier's counters (they cannot be sealed), filling a group of the
// tree and the root before its nodes arrive. Without a job secret that
// ends the barrier early (the control: the attack is real). With one, the
// barrier ends neither early nor never: the node the forged counts carry
// to the root finds arrivals missing and waits, and the last genuine
// arrival still completes the tree and ends it.
func TestExitTreeForgedCount(t *testing.T) {
	const n = 20 // three groups of the first level, one root
	for _, secret := range []Secret{nil, Secret("s3cr3t-of-the-forged-count")} {
		t.Run(fmt.Sprintf("secret %v", secret != nil), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dial := storeServer(ctx, t)
			round := rendezvous.Round{Number: 1}
			arrive := func(g int) <-chan error {
				done := make(chan error, 1)
				j := &jobNode{cfg: &Config{JobSecret: secret}, log: zap.NewNop(), runID: "job", store: dial(), round: round}
				if err := j.seal(); err != nil {
					t.Fatal(err)
				}
				p := &plan{assignments: []Assignment{{GroupRank: g, GroupWorldSize: n}}}
				go func() { done <- j.exitBarrier(ctx, p, nil) }()
				return done
			}
			// The forger fills the root but for one group, and group 0
			// but for one node.
			forger := dial()
			prefix := exitTreePrefix("job", round.Number)
			if _, err := forger.Add(ctx, prefix+"1/0", 2); err != nil {
				t.Fatal(err)
			}
			if _, err := forger.Add(ctx, prefix+"0/0", exitFanIn-1); err != nil {
				t.Fatal(err)
			}
			first := arrive(0)
			if early := leftWithin(t, first, 500*time.Millisecond); early != (secret == nil) {
				t.Fatalf("the forged counts ended the barrier early: %v; want %v", early, secret == nil)
			}
			if secret == nil {
				return
			}
			var rest []<-chan error
			for g := 1; g < n; g++ {
				rest = append(rest, arrive(g))
			}
			allLeave(ctx, t, append(rest, first)...)
		})
	}
}

// leftWithin reports whether a node at the exit barrier left it (c, its
// barrier's result, answered) within d, failing t if it left on an error.
func leftWithin(t *testing.T, c <-chan error, d time.Duration) bool {
	t.Helper()
	select {
	case err := <-c:
		if err != nil {
			t.Fatal(err)
		}
		return true
	case <-time.After(d):
		return false
	}
}

// allLeave fails t unless every node at the exit barrier (each c, its
// barrier's result) leaves it without an error before ctx ends.
func allLeave(ctx context.Context, t *testing.T, cs ...<-chan error) {
	t.Helper()
	for i, c := range cs {
		select {
		case err := <-c:
			if err != nil {
				t.Fatalf("node %d: %v", i, err)
			}
		case <-ctx.Done():
			t.Fatalf("node %d still waits after every node arrived", i)
		}
	}
}

// peekingStore is a Store that peeks (by Check and Get, as no c10d
// server can in one request) and counts its compare-sets: the shape of
// etcd's Store, where a compare-set is a Raft proposal and a peek is not.
type peekingStore struct {
	rendezvous.Store
	compareSets atomic.Int32
}

func (s *peekingStore) Peek(ctx context.Context, keys ...string) ([][]byte, error) {
	vs := make([][]byte, len(keys))
	for i, k := range keys {
		if ok, err := s.Check(ctx, k); err != nil || !ok {
			if err != nil {
				return nil, err
			}
			continue
		}
		v, err := s.Get(ctx, k)
		if err != nil {
			return nil, err
		}
		vs[i] = v
	}
	return vs, nil
}

func (s *peekingStore) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	s.compareSets.Add(1)
	return s.Store.CompareSet(ctx, key, expected, desired)
}

// TestRecordOutcomeReadsWhatExists: the first outcome recorded stays, and
// a node that finds one recorded (every node but the one that ended the
// exit barrier) reads it where the store peeks: no compare-set, which on
// etcd was a Raft proposal of every agent at the job's end.
func TestRecordOutcomeReadsWhatExists(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dial := storeServer(ctx, t)
	stores := make([]*peekingStore, 4)
	for i := range stores {
		stores[i] = &peekingStore{Store: dial()}
		j := &jobNode{cfg: &Config{}, log: zap.NewNop(), runID: "job", store: stores[i]}
		outcome := outcomeSucceeded
		if i > 0 {
			outcome = outcomeFailed // too late: the first stays
		}
		if err := j.recordOutcome(ctx, outcome); err != nil {
			t.Fatal(err)
		}
		if ok, known := j.outcome(ctx); !ok || !known {
			t.Fatalf("node %d reads the outcome as ok %v, known %v; want the first, a success", i, ok, known)
		}
	}
	if n := stores[0].compareSets.Load(); n != 1 {
		t.Errorf("the first node compare-set the outcome %d times, want 1 (it creates it)", n)
	}
	for i, s := range stores[1:] {
		if n := s.compareSets.Load(); n != 0 {
			t.Errorf("node %d compare-set an outcome already recorded %d times, want 0", i+1, n)
		}
	}
}
