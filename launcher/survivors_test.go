package launcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/shrink"
)

// runAgentLogged is runAgent with the agent's log kept for inspection.
func runAgentLogged(t *testing.T, cfg Config, limit time.Duration) (err error, stdout, stderr string, logs *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var out, errb testutil.SyncBuffer
	err = run(ctx, cfg, zap.New(core), &out, &errb)
	if ctx.Err() != nil {
		t.Fatalf("agent did not finish within %v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", limit, out.String(), errb.String(), logText(logs))
	}
	return err, out.String(), errb.String(), logs
}

func logText(logs *observer.ObservedLogs) string {
	var b strings.Builder
	for _, e := range logs.All() {
		fmt.Fprintf(&b, "%s %s", e.Level, e.Message)
		for k, v := range e.ContextMap() {
			fmt.Fprintf(&b, " %s=%v", k, v)
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// awaitEpochScript is a worker that waits for shrink epoch 1 in the worker
// store and prints it.
func awaitEpochScript(gorun string) string {
	return fmt.Sprintf(`%[1]s store wait --store "$GORUN_STORE" --timeout 30s gorun/shrink/epoch/1 || exit 6
		echo "epoch1=$(%[1]s store get --store "$GORUN_STORE" gorun/shrink/epoch/1)"`, gorun)
}

// epochsPrinted decodes the epoch lines the workers printed.
func epochsPrinted(t *testing.T, out string) []shrink.Epoch {
	t.Helper()
	var es []shrink.Epoch
	for _, m := range regexp.MustCompile(`epoch1=(\{.*\})`).FindAllStringSubmatch(out, -1) {
		var e shrink.Epoch
		if err := json.Unmarshal([]byte(m[1]), &e); err != nil {
			t.Fatalf("epoch %q: %v", m[1], err)
		}
		es = append(es, e)
	}
	return es
}

// TestShrinkModeSurvivorsCarryOn: under --on-failure shrink a failed
// worker does not stop the others; the agent publishes an epoch excluding
// it, the survivors see it and finish, and the job succeeds with a summary
// naming the lost rank.
func TestShrinkModeSurvivorsCarryOn(t *testing.T) {
	gorun := testutil.BuildGorun(t)
	cfg := shConfig(t, 4, `test "$GORUN_ON_FAILURE" = shrink || exit 9
		test "$GORUN_AGREEMENT_TIMEOUT" = 10 && test "$GORUN_GROW_TIMEOUT" = 30 || exit 9
		[ "$RANK" = 2 ] && { sleep 0.3; exit 3; }
		`+awaitEpochScript(gorun))
	cfg.OnFailure = OnFailureShrink
	err, out, errs, logs := runAgentLogged(t, cfg, 60*time.Second)
	if err != nil {
		t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errs, logText(logs))
	}
	es := epochsPrinted(t, out)
	if len(es) != 3 {
		t.Fatalf("%d survivors printed epoch 1; want 3\n%s", len(es), out)
	}
	for _, e := range es {
		if e.Number != 1 || !slices.Equal(e.Excluded, []int{2}) || e.WorldSize != 3 || e.Action != shrink.ActionShrink ||
			!slices.Equal(e.Ranks, []int{0, 1, -1, 2}) {
			t.Fatalf("epoch 1 = %+v", e)
		}
	}
	lines := logs.FilterMessageSnippet("shrink epoch=1 world=3 excluded=[2]").All()
	if len(lines) != 1 {
		t.Fatalf("no epoch line in the log:\n%s", logText(logs))
	}
	done := logs.FilterMessage("the surviving workers succeeded").All()
	if len(done) != 1 || !strings.Contains(fmt.Sprint(done[0].ContextMap()["shrink"]), "lost ranks [2] in 1 epoch(s), world 4 -> 3") {
		t.Fatalf("summary:\n%s", logText(logs))
	}
}

// TestShrinkModeBelowFloorRestarts: a failure that would leave fewer ranks
// than --min-world-size gives a restart epoch; the group restarts as in
// restart mode, and the restart is counted.
func TestShrinkModeBelowFloorRestarts(t *testing.T) {
	cfg := shConfig(t, 3, `if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
			[ "$RANK" = 1 ] && exit 3
			sleep 30
		fi
		echo "attempt=$TORCHELASTIC_RESTART_COUNT"`)
	cfg.OnFailure = OnFailureShrink
	cfg.MinWorldSize = 3
	cfg.MaxRestarts = 1
	start := time.Now()
	err, out, errs, logs := runAgentLogged(t, cfg, 60*time.Second)
	if err != nil {
		t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errs, logText(logs))
	}
	if got := sortedLines(out); strings.Join(got, ",") != "[default0]:attempt=1,[default1]:attempt=1,[default2]:attempt=1" {
		t.Fatalf("stdout %q", out)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("the fallback took %v: survivors were not stopped at once", d)
	}
	if len(logs.FilterMessageSnippet("shrink epoch=1 world=2 excluded=[1]").All()) != 1 ||
		len(logs.FilterMessageSnippet("shrink mode fell back to restart").All()) == 0 {
		t.Fatalf("log:\n%s", logText(logs))
	}
}

// heartbeatOnce is shell that sends this worker's heartbeat once.
const heartbeatOnce = `python3 -c 'import os, socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(os.environ["LOCAL_RANK"].encode(), os.environ["GORUN_HEARTBEAT"])'`

// waitBeats is shell that sends this worker's wait beats (blocked on its
// peers, alive) five times a second until killed.
const waitBeats = `python3 -c 'import os, socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
while True:
    s.sendto((os.environ["LOCAL_RANK"] + " wait").encode(), os.environ["GORUN_HEARTBEAT"]); time.sleep(0.2)'`

// TestHungWorker: a worker that beats once and then stops itself
// (SIGSTOP) is declared hung after --heartbeat-timeout and killed, its
// peers, blocked, sending wait beats: in shrink mode the survivors carry
// on without it; in restart mode the job fails with the hang named.
func TestHungWorker(t *testing.T) {
	gorun := testutil.BuildGorun(t)
	for _, tt := range []struct {
		name, rank1, why string
	}{
		{"shrink", heartbeatOnce + ` || exit 8; kill -STOP $$; exit 0`, "hung (no heartbeat for"},
		// Rank 1 hangs before its first beat; its peers, blocked on it,
		// send only wait beats: rank 1 is found from their first beat.
		{"shrink, hung before its first beat", `kill -STOP $$; exit 0`, "no heartbeat at all"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := shConfig(t, 3, `[ "$RANK" = 1 ] && { `+tt.rank1+`; }
				`+waitBeats+` &
				beats=$!
				`+awaitEpochScript(gorun)+`
				kill $beats`)
			cfg.OnFailure = OnFailureShrink
			cfg.HeartbeatTimeout = time.Second
			err, out, errs, logs := runAgentLogged(t, cfg, 60*time.Second)
			if err != nil {
				t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errs, logText(logs))
			}
			es := epochsPrinted(t, out)
			if len(es) != 2 || !slices.Equal(es[0].Excluded, []int{1}) || !strings.Contains(es[0].Reasons[1], tt.why) {
				t.Fatalf("epochs %+v\n%s\n%s", es, out, logText(logs))
			}
		})
	}
	t.Run("restart", func(t *testing.T) {
		cfg := shConfig(t, 2, `[ "$RANK" = 0 ] && { `+heartbeatOnce+` || exit 8; kill -STOP $$; exit 0; }
			sleep 30`)
		cfg.HeartbeatTimeout = time.Second
		start := time.Now()
		err, _, errs, _ := runAgentLogged(t, cfg, 60*time.Second)
		var wf *WorkersFailedError
		if !errors.As(err, &wf) || len(wf.Failures) != 1 || wf.Failures[0].Rank != 0 ||
			!strings.Contains(wf.Failures[0].Message, "hung (no heartbeat for") {
			t.Fatalf("err = %v\n%s", err, errs)
		}
		if d := time.Since(start); d > 15*time.Second {
			t.Fatalf("took %v", d)
		}
	})
}

// beatThenDone is shell that sends one heartbeat and then says this worker
// is done (its training is over), from one interpreter: two start-ups of
// pyenv's python3 in a row took longer than a 1-s heartbeat timeout on a
// loaded machine, and the worker was killed as hung before its done beat.
const beatThenDone = `python3 -c 'import os, socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); r = os.environ["LOCAL_RANK"]; s.sendto(r.encode(), os.environ["GORUN_HEARTBEAT"]); s.sendto((r + " done").encode(), os.environ["GORUN_HEARTBEAT"])'`

// TestDoneTimeout: a worker that said it was done and then hangs in its
// teardown (it stops itself) is killed --done-timeout later, and the job
// succeeds, its work being over, in restart and in shrink mode. Without
// the bound the agent waits for the stopped worker: the control, ended by
// the test after 6 s, shows that the bound is what ends the others.
func TestDoneTimeout(t *testing.T) {
	worker := beatThenDone + ` || exit 8
		[ "$RANK" = 0 ] && kill -STOP $$
		exit 0`
	for _, mode := range []string{OnFailureRestart, OnFailureShrink} {
		t.Run(mode, func(t *testing.T) {
			cfg := shConfig(t, 2, worker)
			cfg.OnFailure = mode
			cfg.MaxRestarts = 0
			cfg.HeartbeatTimeout = time.Second
			cfg.DoneTimeout = 2 * time.Second
			start := time.Now()
			err, out, errs, logs := runAgentLogged(t, cfg, 60*time.Second)
			if err != nil {
				t.Fatalf("run: %v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errs, logText(logs))
			}
			if d := time.Since(start); d < 2*time.Second || d > 15*time.Second {
				t.Errorf("the job ended after %v, want the 2-s done timeout and little more", d)
			}
			if n := len(logs.FilterMessageSnippet("teardown hung").All()); n != 1 {
				t.Errorf("%d teardowns killed, want rank 0's\n%s", n, logText(logs))
			}
		})
	}
	t.Run("unbounded", func(t *testing.T) {
		cfg := shConfig(t, 2, worker)
		cfg.HeartbeatTimeout = time.Second
		ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
		defer cancel()
		var out, errb testutil.SyncBuffer
		err := run(ctx, cfg, zap.NewNop(), &out, &errb)
		if ctx.Err() == nil {
			t.Fatalf("the agent returned (%v) while a worker that said done was stopped: nothing bounds its teardown by default", err)
		}
	})
}

// TestDoneTimeoutNeedsHeartbeats: --done-timeout without
// --heartbeat-timeout is refused (the done beat comes on its socket).
func TestDoneTimeoutNeedsHeartbeats(t *testing.T) {
	cfg := shConfig(t, 1, "exit 0")
	cfg.DoneTimeout = time.Second
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "--done-timeout") {
		t.Fatalf("Validate = %v", err)
	}
	cfg.HeartbeatTimeout = time.Second
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Validate with heartbeats = %v", err)
	}
}
