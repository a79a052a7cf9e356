package launcher

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// fakeMembership is a membership whose job the test scripts: the plans
// next hands out, the changes watch reports, how many restarts are left.
// It records every call, so that tests pin down what the agent's loop and
// decide ask of a membership without other agents or a rendezvous store
// (memberlist's MockNetwork and raft's testing.go are the models).
type fakeMembership struct {
	t     *testing.T
	cfg   *Config   // the agent's
	nodes nodeRanks // the job's nodes; this one is group rank 0
	// restartsLeft is how many failed rounds may still restart.
	restartsLeft int
	// changes are handed out by watch, one per call, then nil.
	changes []*change
	// failedErr, when set, is what failed returns.
	failedErr error
	// waiting are the nodes waiting to be admitted: admit takes the
	// first of them, one for each place, or fails as the rendezvous does
	// when fewer wait.
	waiting []string
	// prepare, when set, edits each plan next hands out.
	prepare func(*plan)

	mu    sync.Mutex
	calls []string // "next", "failed: <cause>", "finish ok, N at the barrier", "finish failed", "leave", "expel <node>", "sawClosed"
	round int
}

func (f *fakeMembership) record(call string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call)
}

func (f *fakeMembership) recorded() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

// next hands out a round run by f.nodes, its worker store served here.
func (f *fakeMembership) next(context.Context) (*plan, error) {
	f.record("next")
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		return nil, err
	}
	env := workerEnv(f.cfg, "fake", "127.0.0.1", srv.Addr().(*net.TCPAddr).Port, 0, f.round)
	p := &plan{round: f.round, assignments: assign(f.nodes, 0), env: env, store: srv, nodes: f.nodes}
	for g := range f.nodes {
		id := "node" + string(rune('0'+g))
		p.members, p.nodeIDs, p.gossip = append(p.members, id), append(p.nodeIDs, id), append(p.gossip, gossipPeer{})
	}
	if f.prepare != nil {
		f.prepare(p)
	}
	f.round++
	return p, nil
}

func (f *fakeMembership) watch(context.Context) (*change, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.changes) == 0 {
		return nil, nil
	}
	c := f.changes[0]
	f.changes = f.changes[1:]
	return c, nil
}

func (f *fakeMembership) watchEvery(monitor time.Duration) time.Duration { return monitor }

func (f *fakeMembership) failed(_ context.Context, _ *plan, cause string) (bool, error) {
	f.record("failed: " + cause)
	if f.failedErr != nil {
		return false, f.failedErr
	}
	if f.restartsLeft == 0 {
		return false, nil
	}
	f.restartsLeft--
	return true, nil
}

func (f *fakeMembership) finish(_ context.Context, p *plan, ok bool) error {
	if ok {
		f.record(fmt.Sprintf("finish ok, %d at the barrier", p.atBarrier()))
	} else {
		f.record("finish failed")
	}
	return nil
}

func (f *fakeMembership) leave(context.Context) { f.record("leave") }
func (f *fakeMembership) expel(_ context.Context, node string) error {
	f.record("expel " + node)
	return nil
}

func (f *fakeMembership) admit(_ context.Context, groupRanks []int) ([]string, error) {
	f.record(fmt.Sprintf("admit %v", groupRanks))
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.waiting) < len(groupRanks) {
		return nil, fmt.Errorf("%d place(s) to fill, %d node(s) waiting: %w", len(groupRanks), len(f.waiting), rendezvous.ErrNoWaitingNode)
	}
	ids := f.waiting[:len(groupRanks):len(groupRanks)]
	f.waiting = f.waiting[len(groupRanks):]
	return ids, nil
}
func (f *fakeMembership) sawClosed(context.Context) { f.record("sawClosed") }
func (f *fakeMembership) close()                    {}
