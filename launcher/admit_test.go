package launcher

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// TestAdmitWaitingFillsEveryPlace: the leader fills every vacant place in
// one admission, or none. It used to admit one place at a time: a lone
// spare after two nodes lost was admitted beside the other empty place,
// which a late node does not take (the rendezvous hands it only a whole
// round), went back to waiting, and was admitted again at the next read
// of the rendezvous state, every second, its workers never joining
// (bench/chaos: "admitted a waiting node in a lost node's place", one
// node, one place, for 14 s). Short of waiting nodes it says so once, not
// at every read.
func TestAdmitWaitingFillsEveryPlace(t *testing.T) {
	ids := []string{"node0", "node1", "node2"}
	tests := []struct {
		name    string
		leading bool
		dead    []int // group ranks found lost
		out     []int // of them, those whose ranks are all out
		waiting []string
		calls   []string
		// admitted are the "node@group rank" the admission logs; vacant,
		// whether it says the places stay vacant.
		admitted []string
		vacant   bool
	}{
		{"one place, one waiting", true, []int{1}, []int{1}, []string{"spare"},
			[]string{"expel node1", "admit [1]"}, []string{"spare@1"}, false},
		{"two places, two waiting: one admission", true, []int{1, 2}, []int{1, 2}, []string{"spare", "new"},
			[]string{"expel node1", "expel node2", "admit [1 2]"}, []string{"spare@1", "new@2"}, false},
		{"two places, one waiting: none admitted", true, []int{1, 2}, []int{1, 2}, []string{"spare"},
			[]string{"expel node1", "expel node2", "admit [1 2]"}, nil, true},
		{"a lost node's ranks not all out yet: not its place", true, []int{1, 2}, []int{2}, []string{"spare"},
			[]string{"expel node2", "admit [2]"}, []string{"spare@2"}, false},
		{"no place vacant", true, []int{1}, nil, []string{"spare"}, nil, nil, false},
		{"not leading", false, []int{1}, []int{1}, []string{"spare"}, nil, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.InfoLevel)
			log := zap.New(core)
			nodes := nodeRanks{{nproc: 2}, {nproc: 2}, {nproc: 2}}
			e := shrink.Initial(nodes.world())
			for _, g := range tt.out {
				for _, r := range nodes.ranksOf(g) {
					e.Ranks[r] = -1
				}
			}
			sv := &survivors{log: log, nodeIDs: slices.Clone(ids), nodes: nodes, dead: map[int]bool{}, leading: tt.leading, epoch: e}
			for _, g := range tt.dead {
				sv.dead[g] = true
			}
			m := &fakeMembership{t: t, nodes: nodes, waiting: slices.Clone(tt.waiting)}
			a := &agent{cfg: Config{Regrow: true}, log: log, m: m}
			w := &roundWatch{a: a, p: &plan{nodeIDs: sv.nodeIDs}}

			// Twice: the leader tries at every read of the state while
			// places are vacant and nodes wait; the read between shows
			// the nodes admitted, as the rendezvous would.
			a.admitWaiting(context.Background(), w, sv)
			for _, l := range logs.FilterMessage("admitted a waiting node in a lost node's place").All() {
				c := l.ContextMap()
				sv.replaced(int(c["group_rank"].(int64)), c["node"].(string))
			}
			a.admitWaiting(context.Background(), w, sv)

			if got := m.recorded(); len(tt.calls) > 0 && !slices.Equal(got[:len(tt.calls)], tt.calls) || len(tt.calls) == 0 && len(got) > 0 {
				t.Errorf("calls %q, want %q first", got, tt.calls)
			}
			var admitted []string
			for _, l := range logs.FilterMessage("admitted a waiting node in a lost node's place").All() {
				c := l.ContextMap()
				admitted = append(admitted, fmt.Sprintf("%v@%v", c["node"], c["group_rank"]))
			}
			if !slices.Equal(admitted, tt.admitted) {
				t.Errorf("admitted %q, want %q", admitted, tt.admitted)
			}
			if n := logs.FilterMessage("lost nodes' places stay vacant for now").Len(); tt.vacant && n != 1 || !tt.vacant && n != 0 {
				t.Errorf("said %d time(s) that the places stay vacant, want %v once", n, tt.vacant)
			}
		})
	}
}

// TestNewcomerGoneReportedForTheGrow: a grow that adds a local slot whose
// newcomer has exited is reported at once, as news of the slot's life in
// that grow. The report named the newcomer's own life (the epoch after
// which it started), and when an epoch since had excluded that newcomer
// (a coordinator that read its Join late grew the slot back for it) the
// report was stale to every decider: the survivors waited out the grow
// timeout and the job restarted (bench/chaos, coordinator-lost).
func TestNewcomerGoneReportedForTheGrow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	board := func() *shrink.Board {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return shrink.NewBoard(c, "")
	}
	read := board()
	coord := shrink.NewCoordinator(shrink.CoordinatorConfig{World: 6, Name: "node2"}, board(), board(), board())
	defer coord.Close()
	// Epoch 4 grows slot 5 back; its newcomer started after epoch 1 and
	// was excluded by epoch 3, which a decider knows.
	grow := shrink.Epoch{Number: 4, Action: shrink.ActionGrow, Base: 3, Added: []int{5},
		Ranks: []int{0, 1, 2, 3, -1, 4}, WorldSize: 5}
	sv := &survivors{log: zap.NewNop(), coord: coord, me: 2, nodeIDs: []string{"node0", "node1", "node2"},
		nodes: nodeRanks{{nproc: 2}, {nproc: 2}, {nproc: 2}}, dead: map[int]bool{}, pending: map[int]string{}, epoch: grow}
	g := &group{workers: []*worker{
		{a: Assignment{Rank: 4, LocalRank: 0}, exited: true, since: 3},
		{a: Assignment{Rank: 5, LocalRank: 1}, exited: true, since: 1, newcomer: true},
	}}
	a := &agent{log: zap.NewNop(), host: "node2"}
	var out outcome
	if err := a.newcomersGone(ctx, g, sv, grow, &out); err != nil {
		t.Fatal(err)
	}
	if len(out.failures) != 1 || out.failures[0].Rank != 5 {
		t.Fatalf("failures %+v, want slot 5's alone", out.failures)
	}
	n, err := read.AwaitNotice(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if f := n.Failure; f == nil || !slices.Equal(f.Ranks, []int{5}) || f.Epoch == nil || *f.Epoch != grow.Number-1 {
		t.Fatalf("notice %+v, want slot 5's failure in the life epoch %d expects (Epoch %d)", n, grow.Number, grow.Number-1)
	}
}
