package storecount

import (
	"context"
	"errors"
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

// pushPeeker looks at a key with a push, creating it once.
type pushPeeker struct {
	fake
	kv map[string][]byte
}

func (p *pushPeeker) QueuePushPeek(_ context.Context, _ string, _ []byte, look string, create []byte) ([]byte, error) {
	if v, ok := p.kv[look]; ok || create == nil {
		return v, nil
	}
	p.kv[look] = create
	return create, nil
}

// TestQueuePushPeek: a push with a look is one request, which sends the
// look and the value it may create and writes the push, and the value
// only when it created the key; a Store without it says so and counts
// nothing.
func TestQueuePushPeek(t *testing.T) {
	ctx := context.Background()
	c := &Counts{Detail: true}
	s := New(&pushPeeker{kv: map[string][]byte{}}, c)
	push, look := len("run/requests")+len("xyz"), len("run/folder")
	for i, tc := range []struct {
		create              string
		want                string
		sent, written, recv int
	}{
		{"", "", push + look, push, 0},
		{"mine", "mine", push + look + 4, push + look + 4, 4},
		{"again", "mine", push + look + 5, push, 4},
	} {
		var create []byte
		if tc.create != "" {
			create = []byte(tc.create)
		}
		r0, s0, w0, v0 := c.Requests.Load(), c.Sent.Load(), c.Written.Load(), c.Received.Load()
		v, err := s.QueuePushPeek(ctx, "run/requests", []byte("xyz"), "run/folder", create)
		if err != nil || string(v) != tc.want {
			t.Fatalf("%d: %q, %v; want %q", i, v, err, tc.want)
		}
		if got := [4]int64{c.Requests.Load() - r0, c.Sent.Load() - s0, c.Written.Load() - w0, c.Received.Load() - v0}; got != [4]int64{1, int64(tc.sent), int64(tc.written), int64(tc.recv)} {
			t.Errorf("%d: requests, sent, written, received %v; want 1, %d, %d, %d", i, got, tc.sent, tc.written, tc.recv)
		}
	}
	if got := c.Breakdown()[Kind{"queue_push", "run/requests"}]; got == nil || got.Requests.Load() != 3 {
		t.Errorf("breakdown: %v", got)
	}
	if _, err := New(fake{}, c).QueuePushPeek(ctx, "q", nil, "k", nil); !errors.Is(err, rendezvous.ErrNotSupported) {
		t.Errorf("a Store without it: %v", err)
	}
}
