package launcher

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/internal/netcut"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// boardWithEpochs serves a worker store whose board holds epochs 1 to n.
func boardWithEpochs(t *testing.T, n int) string {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	c, err := tcpstore.Dial(context.Background(), srv.Addr().String(), tcpstore.ClientConfig{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := shrink.NewBoard(c, shrink.DefaultPrefix)
	for i := 1; i <= n; i++ {
		e := shrink.Initial(4)
		e.Number = i
		if _, _, err := b.Publish(context.Background(), e); err != nil {
			t.Fatal(err)
		}
	}
	return srv.Addr().String()
}

// TestLateReadThroughACut: a node admitted late reads the latest epoch
// through a link cut at that first read. A cut shorter than the wait costs
// tries, not the node (one 5-s try ended a spare's agent in bench/chaos);
// one that outlasts it fails with errAgreementUnanswered, about when the
// wait ends; a stop ends the wait at once; what a retry cannot mend (a
// floor that does not parse) fails on the first try.
func TestLateReadThroughACut(t *testing.T) {
	const attempt, window = 200 * time.Millisecond, time.Second
	for _, tc := range []struct {
		name      string
		healAfter time.Duration // 0: never
		cancelAt  time.Duration // 0: never
		badFloor  bool
		cut       bool
		want      error  // nil (and no wantText): epoch 2
		wantText  string // the error is the store's own, not a wait's, and says this
		retried   bool
	}{
		{name: "no cut"},
		{name: "cut for one and a half tries", cut: true, healAfter: 300 * time.Millisecond, retried: true},
		{name: "cut past the wait", cut: true, want: errAgreementUnanswered, retried: true},
		{name: "stopped while cut", cut: true, cancelAt: 300 * time.Millisecond, want: context.Canceled, retried: true},
		{name: "a floor that does not parse", badFloor: true, wantText: "the board's floor"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server := boardWithEpochs(t, 2)
			if tc.badFloor {
				c, err := tcpstore.Dial(context.Background(), server, tcpstore.ClientConfig{Timeout: 5 * time.Second})
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				ps := rendezvous.NewPrefixStore(shrink.DefaultPrefix, c)
				if err := ps.Set(context.Background(), "floor", []byte("{not json")); err != nil {
					t.Fatal(err)
				}
				// A SET has no reply (c10d's protocol): a read on the same
				// connection is what says the server holds the key before
				// the node's own connection looks for it.
				if ok, err := ps.Check(context.Background(), "floor"); err != nil || !ok {
					t.Fatalf("the bad floor is not in the store: %v, %v", ok, err)
				}
			}
			// The link stands for the node's to the worker store's
			// host, cut at the node's first read (its first CHECK).
			link := netcut.New(t, server)
			if tc.cut {
				link.CutOnFirst(byte(tcpstore.OpCheck))
			}
			c, err := tcpstore.Dial(context.Background(), link.Addr(), tcpstore.ClientConfig{Timeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			core, logs := observer.New(zapcore.WarnLevel)
			sv := &survivors{log: zap.New(core), board: shrink.NewBoard(c, shrink.DefaultPrefix)}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.healAfter > 0 {
				time.AfterFunc(tc.healAfter, link.Heal)
			}
			if tc.cancelAt > 0 {
				time.AfterFunc(tc.cancelAt, cancel)
			}
			began := time.Now()
			n, err := sv.latest(ctx, attempt, window)
			took := time.Since(began)
			switch {
			case tc.wantText != "":
				if err == nil || errors.Is(err, errAgreementUnanswered) || !strings.Contains(err.Error(), tc.wantText) {
					t.Fatalf("latest: %d, %v; want the store's own error, %q", n, err, tc.wantText)
				}
			case tc.want != nil:
				if !errors.Is(err, tc.want) {
					t.Fatalf("latest: %d, %v; want %v", n, err, tc.want)
				}
			case err != nil || n != 2:
				t.Fatalf("latest: %d, %v; want epoch 2", n, err)
			}
			if tc.cut && link.Cuts() != 1 {
				t.Errorf("the link was cut %d times, want once: the read did not go through the cut", link.Cuts())
			}
			retries := logs.FilterMessageSnippet("did not answer the read of the latest epoch; trying again").Len()
			if (retries > 0) != tc.retried {
				t.Errorf("%d retries logged, want some: %v", retries, tc.retried)
			}
			bound := attempt // a stop, or what no retry mends: at once
			if tc.want == errAgreementUnanswered {
				bound = window + attempt
				if took < window-attempt {
					t.Errorf("gave up after %v, before the wait (%v) was over", took, window)
				}
			} else if tc.healAfter > 0 || tc.cancelAt > 0 {
				bound = max(tc.healAfter, tc.cancelAt) + attempt
			}
			if took > bound {
				t.Errorf("took %v, want at most %v", took, bound)
			}
		})
	}
}

// dialBoards returns n Boards on the worker store at server, each on a
// connection of its own (closed when the test ends).
func dialBoards(t *testing.T, server string, n int) []*shrink.Board {
	t.Helper()
	var boards []*shrink.Board
	for range n {
		c, err := tcpstore.Dial(context.Background(), server, tcpstore.ClientConfig{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		boards = append(boards, shrink.NewBoard(c, shrink.DefaultPrefix))
	}
	return boards
}

// TestFileThroughACut: a survivor files a failure through a link to the
// worker store that is cut at its first compare-set (the filing). A cut
// shorter than the agreement timeout costs tries, and the report is on the
// board; one that outlasts it fails with errAgreementUnanswered about when
// the timeout ends. At 512 agents the one 5-s try of each filing timed out
// for all but 3 survivors, and each fell back to restarting the job.
func TestFileThroughACut(t *testing.T) {
	const window = time.Second // the agreement timeout: tries of 0.5 s
	for _, tc := range []struct {
		name      string
		healAfter time.Duration // 0: never
	}{
		{name: "cut for a try and a half", healAfter: 750 * time.Millisecond},
		{name: "cut past the agreement timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			server := boardWithEpochs(t, 0)
			link := netcut.New(t, server)
			link.CutOnFirst(byte(tcpstore.OpCompareSet))
			c, err := tcpstore.Dial(context.Background(), link.Addr(), tcpstore.ClientConfig{Timeout: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			// The watchers' connections, and one to read the board by,
			// go round the cut: each watcher holds its connection in a wait.
			direct := dialBoards(t, server, 3)
			watch := direct[2]
			coord := shrink.NewCoordinator(shrink.CoordinatorConfig{Name: "node0", World: 4, AgreementTimeout: window},
				shrink.NewBoard(c, shrink.DefaultPrefix), direct[0], direct[1])
			defer coord.Close()
			core, logs := observer.New(zapcore.WarnLevel)
			sv := &survivors{log: zap.New(core), coord: coord, agreementTimeout: window}
			if tc.healAfter > 0 {
				time.AfterFunc(tc.healAfter, link.Heal)
			}
			began := time.Now()
			err = sv.file(context.Background(), shrink.Report{Ranks: []int{3}, Reason: "rank 3 exited", SeenAt: time.Now()})
			took := time.Since(began)
			if link.Cuts() != 1 {
				t.Errorf("the link was cut %d times, want once: the filing did not go through the cut", link.Cuts())
			}
			if n := logs.FilterMessageSnippet("did not answer the filing of the failure of ranks [3]; trying again").Len(); n == 0 {
				t.Error("no retry logged")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			notices, _, nerr := watch.Notices(ctx, 0)
			if nerr != nil {
				t.Fatal(nerr)
			}
			if tc.healAfter == 0 {
				if !errors.Is(err, errAgreementUnanswered) || took < window-200*time.Millisecond || took > window+time.Second {
					t.Fatalf("file: %v after %v; want errAgreementUnanswered after about %v", err, took, window)
				}
				return
			}
			if err != nil || took > tc.healAfter+time.Second {
				t.Fatalf("file: %v after %v; want it filed soon after the link heals (%v)", err, took, tc.healAfter)
			}
			// A try whose answer the cut held may have landed too: the
			// report is on the board once or twice, never lost.
			if len(notices) == 0 || len(notices) > 2 || notices[0].Failure == nil || !slices.Equal(notices[0].Failure.Ranks, []int{3}) {
				t.Errorf("the board holds %+v; want the report of rank 3", notices)
			}
		})
	}
}

// TestLateAdmittedNodeRejoinsWhenTheAgreementIsCut: a node admitted late
// (a hot spare in a lost node's place) whose link to the round's worker
// store is cut at its first read of the agreement, for longer than it
// waits: it leaves that round, waits to be admitted again, and runs the
// next round it is given, counting no failure and calling no leave (its
// agent exited code 3 on the one read that timed out, bench/chaos's
// all-kinds soak).
func TestLateAdmittedNodeRejoinsWhenTheAgreementIsCut(t *testing.T) {
	cfg := shConfig(t, 2, `echo "rank $RANK of $WORLD_SIZE in round $GORUN_GENERATION"`)
	cfg.OnFailure = OnFailureShrink
	cfg.MonitorInterval = 20 * time.Millisecond
	cfg.AgreementTimeout = 600 * time.Millisecond
	var link *netcut.Link
	m := &fakeMembership{nodes: nodeRanks{{nproc: 2}, {nproc: 2}}, prepare: func(p *plan) {
		if p.round != 0 {
			return
		}
		// Round 0: admitted late into group rank 1, the worker store
		// reached through the link that is cut at the first read.
		link = netcut.New(t, net.JoinHostPort(p.env.MasterAddr, strconv.Itoa(p.env.MasterPort)))
		link.CutOnFirst(byte(tcpstore.OpCheck))
		host, port, _ := net.SplitHostPort(link.Addr())
		p.env.MasterAddr, p.env.MasterPort = host, mustAtoi(t, port)
		p.late, p.assignments = true, assign(p.nodes, 1)
	}}
	began := time.Now()
	err, out, logs := runWithMembership(t, cfg, m, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s\nlog:\n%s", err, out, logText(logs))
	}
	if link == nil || link.Cuts() != 1 {
		t.Fatalf("the late round's link was not cut at the first read\nlog:\n%s", logText(logs))
	}
	if want, got := []string{"next", "next", "finish ok, 2 at the barrier"}, m.recorded(); !slices.Equal(got, want) {
		t.Errorf("membership calls %q, want %q", got, want)
	}
	if n := logs.FilterMessageSnippet("leaving the round this node was admitted into").Len(); n != 1 {
		t.Errorf("%d lines say the node leaves the round it was admitted into, want 1\nlog:\n%s", n, logText(logs))
	}
	if n := strings.Count(out, "in round 1"); n != 2 || strings.Contains(out, "in round 0") {
		t.Errorf("want both workers in round 1 and none in round 0:\n%s", out)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("took %v: the wait for the cut agreement is the agreement timeout (%v)", took, cfg.AgreementTimeout)
	}
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSharedLossFiledByTheLeaderOnly: a node loss every survivor sees alike
// (the rendezvous state's lapsed keep-alives) is filed by the agreement's
// leader alone, with every such loss it has not filed yet once the losses
// make it the leader; a loss from this node's own gossip view is filed at
// once, leader or not. At 512 agents every survivor filed the same loss,
// O(N²) compare-sets on the worker store, and 508 of 511 gave up.
func TestSharedLossFiledByTheLeaderOnly(t *testing.T) {
	server := boardWithEpochs(t, 0)
	boards := dialBoards(t, server, 4)
	nodes := nodeRanks{{2}, {2}, {2}, {2}, {2}}
	coord := shrink.NewCoordinator(shrink.CoordinatorConfig{Name: "n2", World: nodes.world()}, boards[0], boards[1], boards[2])
	defer coord.Close()
	sv := &survivors{log: zap.NewNop(), coord: coord, me: 2, nodeIDs: []string{"n0", "n1", "n2", "n3", "n4"}, nodes: nodes,
		dead: map[int]bool{}, epoch: shrink.Initial(nodes.world()), agreementTimeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	filed := func() [][]int {
		t.Helper()
		notices, _, err := boards[3].Notices(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		var out [][]int
		for _, n := range notices {
			out = append(out, n.Failure.Ranks)
		}
		return out
	}
	for _, step := range []struct {
		lost   string
		shared bool
		want   string // the board's reports after the step
	}{
		{"n3", true, "[]"},                     // n0 leads
		{"n0", true, "[]"},                     // n1 leads now
		{"n1", true, "[[0 1 2 3 6 7]]"},        // this node leads: n3, n0 and n1 at once
		{"n4", false, "[[0 1 2 3 6 7] [8 9]]"}, // its own view: filed at once
	} {
		if n, err := sv.nodesLost(ctx, []string{step.lost}, "test", step.shared); err != nil || n != 1 {
			t.Fatalf("%s lost: %d, %v", step.lost, n, err)
		}
		if got := fmt.Sprint(filed()); got != step.want {
			t.Errorf("after %s lost (shared %v): the board holds %s, want %s", step.lost, step.shared, got, step.want)
		}
	}
}
