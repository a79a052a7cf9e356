package launcher

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// lostAnswerStore loses the answers of its first lose compare-sets of
// key, applied or not (apply), failing them with ErrOutcomeUnknown as etcd's
// Storage does when the lease of the token that would tell ended while
// the request was sent again.
type lostAnswerStore struct {
	rendezvous.Store
	key   string
	apply bool
	lose  int
	lost  int
}

func (s *lostAnswerStore) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	if key != s.key || s.lost >= s.lose {
		return s.Store.CompareSet(ctx, key, expected, desired)
	}
	s.lost++
	if s.apply {
		s.Store.CompareSet(ctx, key, expected, desired)
	}
	return nil, fmt.Errorf("%w: test: %w", rendezvous.ErrUnavailable, rendezvous.ErrOutcomeUnknown)
}

// TestCreateOnceOutcomeUnknown: the job's restart counter is created by
// a create-only compare-set; one whose outcome the store cannot tell is
// sent again until it is told (here three answers lost in a row), and the
// counter exists, once, whether the first applied or not. The error used
// to end the agent (three of 512 on etcd, and the round never completed;
// again with one retry, when the answer was lost twice).
func TestCreateOnceOutcomeUnknown(t *testing.T) {
	for _, apply := range []bool{true, false} {
		t.Run(fmt.Sprintf("applied=%v", apply), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			dial := storeServer(ctx, t)
			s := &lostAnswerStore{Store: dial(), key: "gorun.job.restarts", apply: apply, lose: 3}
			if err := createOnce(ctx, s, s.key, []byte("0")); err != nil || s.lost != 3 {
				t.Fatalf("createOnce: %v (answers lost %d)", err, s.lost)
			}
			if v, err := dial().Get(ctx, s.key); err != nil || string(v) != "0" {
				t.Fatalf("the counter holds %q, %v; want 0", v, err)
			}
		})
	}
}
