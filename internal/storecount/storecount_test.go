package storecount

import (
	"context"
	"testing"

	"github.com/gorunhq/gorun/rendezvous"
)

// fake is a Store of nothing but canned answers: enough to count.
type fake struct{ rendezvous.Store }

func (fake) Set(context.Context, string, []byte) error { return nil }
func (fake) Get(context.Context, string) ([]byte, error) {
	return []byte("12345"), nil
}
func (fake) QueuePush(context.Context, string, []byte) error { return nil }

// TestBreakdown: with Detail the requests are tallied by operation and
// key class (digits as "#"), beside the totals; without, nothing is kept.
func TestBreakdown(t *testing.T) {
	ctx := context.Background()
	for _, detail := range []bool{false, true} {
		c := &Counts{Detail: detail}
		s := New(fake{}, c)
		s.Set(ctx, "run/wake/1", []byte("ab"))
		s.Set(ctx, "run/wake/22", nil)
		s.Get(ctx, "run/share/3")
		s.QueuePush(ctx, "run/requests", []byte("xyz"))
		if c.Requests.Load() != 4 || c.Written.Load() != int64(len("run/wake/1ab")+len("run/wake/22")+len("run/requestsxyz")) || c.Received.Load() != 5 {
			t.Fatalf("detail %v: totals %d requests, %d written, %d received", detail, c.Requests.Load(), c.Written.Load(), c.Received.Load())
		}
		b := c.Breakdown()
		if !detail {
			if len(b) != 0 {
				t.Errorf("without Detail: %d tallies", len(b))
			}
			continue
		}
		want := map[Kind][3]int64{
			{"set", "run/wake/#"}:          {2, int64(len("run/wake/1ab") + len("run/wake/22")), 0},
			{"get", "run/share/#"}:         {1, int64(len("run/share/3")), 5},
			{"queue_push", "run/requests"}: {1, int64(len("run/requestsxyz")), 0},
		}
		if len(b) != len(want) {
			t.Errorf("%d kinds, want %d: %v", len(b), len(want), b)
		}
		for k, w := range want {
			got, ok := b[k]
			if !ok {
				t.Errorf("no tally for %v", k)
				continue
			}
			if g := [3]int64{got.Requests.Load(), got.Sent.Load(), got.Received.Load()}; g != w {
				t.Errorf("%v: %v, want %v", k, g, w)
			}
		}
	}
}
