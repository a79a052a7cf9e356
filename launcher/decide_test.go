package launcher

import (
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/launcher/reaper"
)

// TestDecide pins down how a round's outcome ends: the next round, a
// restart counted for the job, or the end of the job with its error, and
// what the membership is told on the way.
func TestDecide(t *testing.T) {
	failure := func(rank int) Failure {
		return newFailure(rank, rank, reaper.Exit{Pid: 100 + rank, Status: 3 << 8, Time: time.Unix(int64(rank), 0)}, "", "host")
	}
	errBoom := errors.New("boom")
	cases := []struct {
		name   string
		out    outcome
		left   int   // restarts left
		fail   error // what failed returns
		done   bool
		err    func(error) bool
		calls  []string
		stderr string // in the console's stderr
	}{
		{name: "signal", out: outcome{signal: syscall.SIGTERM}, done: true,
			err: func(err error) bool {
				var s *SignalError
				return errors.As(err, &s) && s.Signal == syscall.SIGTERM
			}, calls: []string{"leave"}},
		{name: "context ended", out: outcome{err: context.Canceled}, done: true,
			err: func(err error) bool { return errors.Is(err, context.Canceled) }, calls: []string{"leave"}},
		{name: "closed elsewhere, success", out: outcome{change: &change{closed: true, ok: true}}, done: true,
			err: isNil, calls: []string{"sawClosed"}},
		{name: "closed elsewhere, failure", out: outcome{change: &change{closed: true}}, done: true,
			err: jobFailed("the job failed on another node"), calls: []string{"sawClosed"}},
		{name: "store host lost", out: outcome{change: &change{closed: true, storeLost: true}}, done: true,
			err: jobFailed("the rendezvous store stopped answering"), calls: nil},
		{name: "node lost, restart left", out: outcome{change: &change{lost: []string{"n1"}}}, left: 1,
			err: isNil, calls: []string{"failed: lost node(s) [n1]"}},
		{name: "node lost, no restart left", out: outcome{change: &change{lost: []string{"n1"}}}, done: true,
			err:   jobFailed("lost node(s) [n1], and no restart is left"),
			calls: []string{"failed: lost node(s) [n1]", "finish failed"}},
		{name: "scale-up is not a restart", out: outcome{change: &change{waiting: 1}}, err: isNil},
		{name: "workers failed, restart left", out: outcome{failures: []Failure{failure(1)}}, left: 1,
			err: isNil, calls: []string{"failed: rank 1: code 3"}},
		{name: "workers failed, no restart left", out: outcome{failures: []Failure{failure(2), failure(1)}}, done: true,
			err: func(err error) bool {
				var w *WorkersFailedError
				return errors.As(err, &w) && len(w.Failures) == 2
			}, calls: []string{"failed: rank 1: code 3", "finish failed"}, stderr: "Root Cause"},
		{name: "counting the restart fails", out: outcome{failures: []Failure{failure(0)}}, fail: errBoom, done: true,
			err: func(err error) bool { return errors.Is(err, errBoom) }, calls: []string{"failed: rank 0: code 3"}},
		{name: "shrink fell back, restart left", out: outcome{fallback: "no agreement", lost: []Failure{failure(1)}}, left: 1,
			err: isNil, calls: []string{"failed: shrink mode fell back to restart: no agreement"}},
		{name: "shrink fell back, none left, with losses", out: outcome{fallback: "too few", lost: []Failure{failure(1)}, failures: []Failure{failure(2)}}, done: true,
			err: func(err error) bool {
				var w *WorkersFailedError
				return errors.As(err, &w) && len(w.Failures) == 2
			}, calls: []string{"failed: shrink mode fell back to restart: too few", "finish failed"}, stderr: "Root Cause"},
		{name: "shrink fell back, none left, nothing failed here", out: outcome{fallback: "too few"}, done: true,
			err:   jobFailed("shrink mode fell back to restart: too few, and no restart is left"),
			calls: []string{"failed: shrink mode fell back to restart: too few", "finish failed"}},
		{name: "success", out: outcome{}, done: true, err: isNil, calls: []string{"finish ok, 0 at the barrier"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := &fakeMembership{t: t, restartsLeft: tc.left, failedErr: tc.fail}
			var stderr testutil.SyncBuffer
			a := &agent{cfg: DefaultConfig(), log: zap.NewNop(), con: &console{stdout: &stderr, stderr: &stderr}, m: m}
			a.cfg.Entrypoint.Program = "train.py"
			done, err := a.decide(context.Background(), &plan{}, tc.out, nil)
			if done != tc.done || !tc.err(err) {
				t.Errorf("decide = %v, %v; want done=%v", done, err, tc.done)
			}
			if got := m.recorded(); !slices.Equal(got, tc.calls) {
				t.Errorf("membership calls %q, want %q", got, tc.calls)
			}
			if !strings.Contains(stderr.String(), tc.stderr) || (tc.stderr == "" && stderr.String() != "") {
				t.Errorf("stderr %q, want %q", stderr.String(), tc.stderr)
			}
		})
	}
}

func isNil(err error) bool { return err == nil }

func jobFailed(reason string) func(error) bool {
	return func(err error) bool {
		var j *JobFailedError
		return errors.As(err, &j) && strings.Contains(j.Reason, reason)
	}
}
