package launcher

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/testutil"
)

// runWithMembership runs the agent's loop as Run does, on membership m
// (a fake standing for the other nodes) with real local workers.
func runWithMembership(t *testing.T, cfg Config, m *fakeMembership, limit time.Duration) (error, string, *observer.ObservedLogs) {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	var out testutil.SyncBuffer
	a, err := newAgent(cfg, zap.New(core), &out, &out)
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	m.t, m.cfg = t, &a.cfg
	a.m, a.multiNode = m, true
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	err = a.run(ctx, nil)
	if ctx.Err() != nil {
		t.Fatalf("agent did not finish within %v\n%s\nlog:\n%s", limit, out.String(), logText(logs))
	}
	return err, out.String(), logs
}

// TestMultiNodeLoopRestartOnLostNode: in restart mode a node the
// rendezvous reports lost stops the local workers mid-run; the failure is
// counted for the job and the next round runs to success.
func TestMultiNodeLoopRestartOnLostNode(t *testing.T) {
	cfg := shConfig(t, 2, `[ "$GORUN_GENERATION" = 0 ] && exec sleep 60; echo "rank $RANK of $WORLD_SIZE in round $GORUN_GENERATION"`)
	cfg.MonitorInterval = 20 * time.Millisecond
	m := &fakeMembership{nodes: nodeRanks{{nproc: 2}, {nproc: 2}}, restartsLeft: 1,
		changes: []*change{nil, nil, {lost: []string{"node1"}}}}
	began := time.Now()
	err, out, logs := runWithMembership(t, cfg, m, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s\nlog:\n%s", err, out, logText(logs))
	}
	if took := time.Since(began); took > 20*time.Second {
		t.Errorf("took %v: the lost node did not stop the sleeping workers", took)
	}
	want := []string{"next", "failed: lost node(s) [node1]", "next", "finish ok, 2 at the barrier"}
	if got := m.recorded(); !slices.Equal(got, want) {
		t.Errorf("membership calls %q, want %q", got, want)
	}
	if n := strings.Count(out, "in round 1"); n != 2 {
		t.Errorf("%d workers ran round 1, want 2:\n%s", n, out)
	}
	if len(logs.FilterMessage("stopping workers: the job changed").All()) != 1 {
		t.Errorf("the log does not say why the workers stopped:\n%s", logText(logs))
	}
}

// TestMultiNodeLoopShrinkOnLostNode: in shrink mode the same lost node is
// reported to the survivors' agreement, which this node leads (group rank
// 0): the local workers run on, see the epoch that excludes the lost
// node's ranks, and finish; the job succeeds without a restart and the
// exit barrier counts one node.
func TestMultiNodeLoopShrinkOnLostNode(t *testing.T) {
	gorun := testutil.BuildGorun(t)
	cfg := shConfig(t, 2, awaitEpochScript(gorun))
	cfg.OnFailure = OnFailureShrink
	cfg.MonitorInterval = 20 * time.Millisecond
	m := &fakeMembership{nodes: nodeRanks{{nproc: 2}, {nproc: 2}}, changes: []*change{nil, {lost: []string{"node1"}}}}
	err, out, logs := runWithMembership(t, cfg, m, 60*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s\nlog:\n%s", err, out, logText(logs))
	}
	es := epochsPrinted(t, out)
	if len(es) != 2 {
		t.Fatalf("%d workers printed epoch 1, want 2\n%s", len(es), out)
	}
	for _, e := range es {
		if !slices.Equal(e.Excluded, []int{2, 3}) || e.WorldSize != 2 {
			t.Errorf("epoch 1 = %+v, want ranks 2 and 3 excluded", e)
		}
	}
	if want, got := []string{"next", "finish ok, 1 at the barrier"}, m.recorded(); !slices.Equal(got, want) {
		t.Errorf("membership calls %q, want %q", got, want)
	}
	if len(logs.FilterMessage("the surviving workers succeeded").All()) != 1 {
		t.Errorf("no summary of the shrink:\n%s", logText(logs))
	}
}

// TestTwoAgentsInProcess: two agents of one c10d job run in this process
// (told apart by their addresses), so that the dynamic rendezvous's paths
// through the launcher — hosting or joining the store, the round's plan,
// the worker store of group rank 0, the exit barrier and the closing — are
// exercised in-package, not only through gorun processes.
func TestTwoAgentsInProcess(t *testing.T) {
	port := etcdtest.FreePorts(t, 1)[0]
	cfgFor := func(addr string) Config {
		cfg := shConfig(t, 2, `echo "rank $RANK of $WORLD_SIZE group $GROUP_RANK store $MASTER_ADDR"`)
		cfg.Rendezvous = RendezvousConfig{Backend: backendC10d, Endpoint: "127.0.0.1:" + strconv.Itoa(port), RunID: "inproc",
			LocalAddr: addr, Conf: map[string]string{"join_timeout": "30", "last_call_timeout": "1"}}
		cfg.MinNodes, cfg.MaxNodes = 2, 2
		// Two agents in one process: each would take the other's
		// workers for leftovers of its own.
		cfg.ContainDescendants = false
		return cfg
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	type result struct {
		err error
		out string
	}
	results := make(chan result, 2)
	for _, addr := range []string{"127.0.0.1", "127.0.0.2"} {
		go func() {
			var out testutil.SyncBuffer
			err := run(ctx, cfgFor(addr), zap.NewNop(), &out, &out)
			results <- result{err, out.String()}
		}()
	}
	var all string
	for range 2 {
		r := <-results
		if r.err != nil {
			t.Fatalf("agent: %v\n%s", r.err, r.out)
		}
		all += r.out
	}
	for r := range 4 {
		if !strings.Contains(all, "rank "+strconv.Itoa(r)+" of 4 group "+strconv.Itoa(r/2)) {
			t.Errorf("no worker of rank %d in group %d:\n%s", r, r/2, all)
		}
	}
	if ctx.Err() != nil {
		t.Fatal("the agents did not finish in time")
	}
}
