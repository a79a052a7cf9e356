package etcd

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestRetriable: what a retry policy sends again. etcd's "too many
// requests" (it sheds load while its applied index lags) is retried, as a
// lost leader and a member's own deadline are; a full database or a
// refused request is not, and nothing is once the caller's context ended.
func TestRetriable(t *testing.T) {
	live := context.Background()
	ended, cancel := context.WithCancel(live)
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"too many requests", live, rpctypes.ErrTooManyRequests, true},
		{"too many requests, as clientv3 hands it", live, rpctypes.Error(rpctypes.ErrGRPCRequestTooManyRequests), true},
		{"too many requests, wrapped", live, fmt.Errorf("queue_push: %w", rpctypes.ErrTooManyRequests), true},
		{"no leader", live, rpctypes.Error(rpctypes.ErrGRPCNoLeader), true},
		{"unavailable", live, status.Error(codes.Unavailable, "connection refused"), true},
		{"database full", live, rpctypes.ErrNoSpace, false},
		{"request too large", live, rpctypes.ErrRequestTooLarge, false},
		{"plain error", live, errors.New("no"), false},
		{"too many requests, context ended", ended, rpctypes.ErrTooManyRequests, false},
		{"request timed out (a put's)", live, rpctypes.Error(rpctypes.ErrGRPCTimeout), true},
		{"member's deadline (a grant's, etcd 3.4)", live, fmt.Errorf("lease: %w", status.Error(codes.Unknown, "context deadline exceeded")), true},
		{"member's deadline, context ended", ended, status.Error(codes.Unknown, "context deadline exceeded"), false},
		{"unknown, another message", live, status.Error(codes.Unknown, "context deadline exceeded: no"), false},
	} {
		if got := retriable(tc.ctx, tc.err); got != tc.want {
			t.Errorf("%s: retriable = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestRetryTooManyRequests: an operation refused while etcd sheds load is
// made again, after a pause, until it goes through; one that fails for
// good is not.
func TestRetryTooManyRequests(t *testing.T) {
	s := &Storage{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	calls := 0
	start := time.Now()
	err := s.retry(ctx, func(context.Context) error {
		if calls++; calls < 3 {
			return rpctypes.ErrTooManyRequests
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("retry: %v after %d calls", err, calls)
	}
	// Pauses of 50–150 ms, then 100–300 ms.
	if took := time.Since(start); took < 150*time.Millisecond {
		t.Errorf("3 calls in %v: no back-off", took)
	}
	calls = 0
	if err := s.retry(ctx, func(context.Context) error { calls++; return rpctypes.ErrNoSpace }); !errors.Is(err, rpctypes.ErrNoSpace) || calls != 1 {
		t.Errorf("database full: %v after %d calls, want it at once", err, calls)
	}
}

// TestRetryOutwaitsAStuckRequest: a request that gets no answer within
// its attempt's deadline (one a dead leader took) is sent again at once,
// each time with twice the patience, until one is answered; the
// operation's own deadline still ends it.
func TestRetryOutwaitsAStuckRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &Storage{attempt: time.Second}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var patience []time.Duration
		start := time.Now()
		err := s.retry(ctx, func(ctx context.Context) error {
			d, _ := ctx.Deadline()
			patience = append(patience, d.Sub(time.Now()))
			if len(patience) < 3 {
				<-ctx.Done() // no answer
				return ctx.Err()
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second}
		if fmt.Sprint(patience) != fmt.Sprint(want) {
			t.Errorf("attempts' patience %v, want %v", patience, want)
		}
		if took := time.Since(start); took != 3*time.Second {
			t.Errorf("answered after %v, want 3s (no pause after an attempt that waited out its deadline)", took)
		}

		ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		calls := 0
		err = s.retry(ctx, func(ctx context.Context) error { calls++; <-ctx.Done(); return ctx.Err() })
		if !errors.Is(err, context.DeadlineExceeded) || calls != 3 {
			t.Errorf("never answered: %v after %d calls, want the deadline after 3 (1 s, 2 s, then the 2 s left)", err, calls)
		}
	})
}

// TestPatiently: what an agent's start-up waits out on a slow etcd (its
// presence key, its access check). A request the member timed out, by
// either of its words for it, is sent again until it succeeds, and so is
// one whose new lease expired before it; a refusal ends at once; and so
// does the caller's context, with the last failure.
func TestPatiently(t *testing.T) {
	timedOut := rpctypes.Error(rpctypes.ErrGRPCTimeout)                                           // "etcdserver: request timed out", a put's
	deadline := fmt.Errorf("lease: %w", status.Error(codes.Unknown, "context deadline exceeded")) // a grant's, etcd 3.4
	for _, tc := range []struct {
		name      string
		errs      []error // op's answers, in order; then success
		wantCalls int
		wantErr   error
	}{
		{"answered at once", nil, 1, nil},
		{"timed out twice, then answered", []error{timedOut, deadline}, 3, nil},
		{"refused", []error{rpctypes.ErrPermissionDenied}, 1, rpctypes.ErrPermissionDenied},
		{"timed out, then refused", []error{timedOut, rpctypes.ErrNoSpace}, 2, rpctypes.ErrNoSpace},
		// The lease granted expired before the key's put landed: op
		// grants another.
		{"lease gone before the put", []error{fmt.Errorf("presence key: %w", rpctypes.ErrLeaseNotFound)}, 2, nil},
	} {
		synctest.Test(t, func(t *testing.T) {
			calls, retries := 0, 0
			err := patiently(context.Background(), func(context.Context) error {
				calls++
				if calls <= len(tc.errs) {
					return tc.errs[calls-1]
				}
				return nil
			}, func(error) { retries++ })
			if !errors.Is(err, tc.wantErr) || calls != tc.wantCalls || retries != calls-1 {
				t.Errorf("%s: %v after %d calls (%d retries); want %v after %d", tc.name, err, calls, retries, tc.wantErr, tc.wantCalls)
			}
		})
	}
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		calls := 0
		err := patiently(ctx, func(context.Context) error { calls++; return timedOut }, nil)
		if !errors.Is(err, rpctypes.ErrTimeout) || calls < 5 {
			t.Errorf("a member that never answers: %v after %d calls; want its timeout, after several", err, calls)
		}
	})
}
