package launcher

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestSlowStoreLogger: the first slow operation of the rendezvous is
// logged at once, the next ones at most once an interval, each line
// counting the timeouts since the last.
// TestLogDrop: a drop's line names the judge's operation, how many it
// dropped (the first 8 by name), their beats' ages and how far behind now
// it judged.
func TestLogDrop(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	var nodes []rendezvous.NodeDesc
	for i := range 20 {
		nodes = append(nodes, rendezvous.NodeDesc{Addr: "10.0.0.1", Pid: 100 + i})
	}
	logDrop(zap.New(core), rendezvous.Drop{Op: "fold", Nodes: nodes, Newest: 15200 * time.Millisecond, Oldest: 31 * time.Second, Behind: 4 * time.Second, Kept: 490})
	all := logs.All()
	if len(all) != 1 {
		t.Fatalf("%d lines, want 1", len(all))
	}
	m := all[0].ContextMap()
	names, _ := m["nodes"].([]interface{})
	if m["op"] != "fold" || m["dropped"] != int64(20) || len(names) != 8 || names[0] != "10.0.0.1_100_0" ||
		m["newest_beat_age"] != 15200*time.Millisecond || m["oldest_beat_age"] != 31*time.Second || m["judged_behind"] != 4*time.Second || m["kept"] != int64(490) {
		t.Errorf("logged %v", m)
	}
}

// TestKeepAliveLogger: the first failed heartbeat is said at once, the
// rest at most once an interval, with their count.
func TestKeepAliveLogger(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	failed := keepAliveLogger(zap.New(core), 50*time.Millisecond)
	refused := fmt.Errorf("%w: QUEUE_PUSH: connection refused", rendezvous.ErrUnavailable)
	for range 4 {
		failed(refused)
	}
	time.Sleep(60 * time.Millisecond)
	failed(refused)
	var got []string
	for _, e := range logs.All() {
		got = append(got, fmt.Sprintf("%v %v", e.ContextMap()["failures"], e.ContextMap()["error"]))
	}
	if want := []string{"1 " + refused.Error(), "4 " + refused.Error()}; !slices.Equal(got, want) {
		t.Errorf("logged %q, want %q", got, want)
	}
}

func TestSlowStoreLogger(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	onSlow := slowStoreLogger(zap.New(core), 50*time.Millisecond)
	timeout := fmt.Errorf("%w: COMPARE_SET timeout after 2s", rendezvous.ErrTimeout)
	for range 3 {
		onSlow("next", timeout)
	}
	time.Sleep(60 * time.Millisecond)
	onSlow("keep-alive", timeout)
	var got []string
	for _, e := range logs.All() {
		got = append(got, fmt.Sprintf("%v %v", e.ContextMap()["op"], e.ContextMap()["timeouts"]))
	}
	if want := []string{"next 1", "keep-alive 3"}; !slices.Equal(got, want) {
		t.Errorf("logged %q, want %q", got, want)
	}
}

// TestLogProgress: a node waiting in the wait list while a round is
// complete without it says so, rather than "rendezvous complete" alone
// (at 512 agents restarting, every survivor that left the round early
// logged that while it waited for the next).
func TestLogProgress(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    rendezvous.Progress
		want string
	}{
		{"gathering", rendezvous.Progress{Round: 1, NumParticipants: 3}, "rendezvous in progress"},
		{"this node's round complete", rendezvous.Progress{Round: 1, Complete: true, NumParticipants: 4}, "rendezvous complete"},
		{"complete without this node", rendezvous.Progress{Round: 1, Complete: true, NumParticipants: 4, NumWaiting: 1, InWaitList: true},
			"rendezvous complete without this node; waiting for the next round"},
	} {
		core, logs := observer.New(zapcore.InfoLevel)
		logProgress(zap.New(core), 2, 4, tc.p)
		if got := logs.All(); len(got) != 1 || got[0].Message != tc.want {
			t.Errorf("%s: logged %v, want one line %q", tc.name, got, tc.want)
		}
	}
}
