package launcher

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestExitTree: the unsealed exit barrier of n nodes ends for every node
// once the last arrives, not before, and no counter of its tree is added
// to by more than exitFanIn nodes (one counter every node added to cost
// a 512-agent job on etcd 2.5 minutes of failed compare-sets). A node
// outside the barrier's group waits for the end without counting.
func TestExitTree(t *testing.T) {
	for _, n := range []int{1, 2, 8, 9, 65, 130} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dial := storeServer(ctx, t)
			round := rendezvous.Round{Number: 3}
			arrive := func(g int) <-chan error {
				done := make(chan error, 1)
				j := &jobNode{cfg: &Config{}, log: zap.NewNop(), runID: "job", store: dial(), round: round}
				p := &plan{assignments: []Assignment{{GroupRank: g, GroupWorldSize: n}}}
				go func() { done <- j.exitBarrier(ctx, p) }()
				return done
			}
			// A node that left the group (shrink mode's barrierRanks).
			outside := make(chan error, 1)
			j := &jobNode{cfg: &Config{}, log: zap.NewNop(), runID: "job", store: dial(), round: round}
			go func() {
				outside <- j.exitBarrier(ctx, &plan{barrierRanks: []int{}, assignments: []Assignment{{GroupRank: n, GroupWorldSize: n + 1}}})
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
			waiting = append(waiting, arrive(n-1), outside)
			for g, c := range waiting {
				select {
				case err := <-c:
					if err != nil {
						t.Fatalf("node %d: %v", g, err)
					}
				case <-ctx.Done():
					t.Fatalf("node %d still waits after every node arrived", g)
				}
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
