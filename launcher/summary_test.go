package launcher

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// readLog is a tcpstore.Client that records the keys read through it.
type readLog struct {
	*tcpstore.Client
	mu    sync.Mutex
	reads []string
}

func (r *readLog) read(keys ...string) {
	r.mu.Lock()
	r.reads = append(r.reads, keys...)
	r.mu.Unlock()
}

func (r *readLog) Get(ctx context.Context, key string) ([]byte, error) {
	r.read(key)
	return r.Client.Get(ctx, key)
}

func (r *readLog) MultiGet(ctx context.Context, keys ...string) ([][]byte, error) {
	r.read(keys...)
	return r.Client.MultiGet(ctx, keys...)
}

func (r *readLog) CompareSet(ctx context.Context, key string, expected, desired []byte) ([]byte, error) {
	r.read(key)
	return r.Client.CompareSet(ctx, key, expected, desired)
}

// TestQueueModePlansFromSummaries: 33 agents' memberships (c10d, restart
// mode, uneven worker counts) complete a round in queue mode; each plans
// it from its summary, with the ranks, world size and rank 0's worker
// store that the member list gives, and no node but the one that folded
// the round reads its member list or the state.
func TestQueueModePlansFromSummaries(t *testing.T) {
	const n = 33 // queue mode from 32
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	type node struct {
		d     *dynamicNode
		log   *readLog
		nproc int
		addr  string
	}
	nodes := make([]node, n)
	for i := range nodes {
		addr := "127.0.0." + strconv.Itoa(i+1)
		nproc := 1 + i%3
		cfg := shConfig(t, nproc, "true")
		cfg.Rendezvous = RendezvousConfig{Backend: backendC10d, Endpoint: srv.Addr().String(), RunID: "summaries",
			LocalAddr: addr, Conf: map[string]string{"join_timeout": "50", "last_call_timeout": "1"}}
		cfg.MinNodes, cfg.MaxNodes = n, n
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		if cfg.needsMembers() {
			t.Fatal("a c10d job in restart mode needs every member")
		}
		j, err := newJobNode(&cfg, zap.NewNop(), "summaries")
		if err != nil {
			t.Fatal(err)
		}
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		rl := &readLog{Client: c}
		j.store = rl
		if err := j.start(ctx); err != nil {
			t.Fatal(err)
		}
		nodes[i] = node{d: &dynamicNode{job: j}, log: rl, nproc: nproc, addr: addr}
		defer nodes[i].d.close()
	}
	plans := make([]*plan, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() { plans[i], errs[i] = nodes[i].d.next(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	// Ranks follow the nodes' addresses (compareNodes): what the member
	// list would give.
	order := slices.Clone(nodes)
	slices.SortFunc(order, func(a, b node) int { return cmp.Compare(a.addr, b.addr) })
	offset, world := 0, 0
	for _, x := range order {
		world += x.nproc
	}
	var master string
	folders := 0
	for g, x := range order {
		i := slices.IndexFunc(nodes, func(y node) bool { return y.addr == x.addr })
		p := plans[i]
		defer p.release()
		if want := assignAt(offset, world, g, n, x.nproc); !slices.Equal(p.assignments, want) {
			t.Errorf("node %s: assignments %+v, want %+v", x.addr, p.assignments, want)
		}
		offset += x.nproc
		if p.members != nil || p.nodeIDs != nil || p.atBarrier() != n {
			t.Errorf("node %s: members %v, ids %v, %d at the barrier", x.addr, p.members, p.nodeIDs, p.atBarrier())
		}
		m := net.JoinHostPort(p.env.MasterAddr, strconv.Itoa(p.env.MasterPort))
		if g == 0 {
			master = m
			if p.store == nil || p.store.Addr().(*net.TCPAddr).Port != p.env.MasterPort || p.env.MasterAddr != x.addr {
				t.Errorf("group rank 0 (%s) does not keep its worker store at %s", x.addr, m)
			}
		} else if m != master {
			t.Errorf("node %s: MASTER %s, group rank 0's store is at %s", x.addr, m, master)
		}
		x.log.mu.Lock()
		state := slices.Contains(x.log.reads, "gorun.rendezvous.summaries")
		membersRead := slices.ContainsFunc(x.log.reads, func(k string) bool { return strings.HasSuffix(k, "/members") })
		x.log.mu.Unlock()
		if membersRead {
			t.Errorf("node %s read the round's member list", x.addr)
		}
		if state {
			folders++
		}
	}
	// A folder reads the state (O(N)); the others their share. A fold
	// that hands over the lock midway makes two.
	if folders == 0 || folders > 3 {
		t.Errorf("%d of %d nodes read the state", folders, n)
	}
}

// TestSummaryView: a round's summary gives the plan's sizes and rank 0,
// and says when a node's job secret differs from the round's, with the
// error the member list gives.
func TestSummaryView(t *testing.T) {
	secret, other := Secret("s3cr3t-aaaaaaaaaaaaaa"), Secret("s3cr3t-bbbbbbbbbbbbbb")
	data := func(check string) []byte {
		b, err := json.Marshal(nodeInfo{NProc: 2, Addr: "h", SecretCheck: check})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	n0 := rendezvous.NodeDesc{Addr: "h0", Pid: 1}
	n5 := rendezvous.NodeDesc{Addr: "h5", Pid: 1}
	for _, tc := range []struct {
		name            string
		mine            Secret
		first, dissent  Secret
		hasDissent      bool
		wantErr, naming string
	}{
		{name: "all alike", mine: secret, first: secret},
		{name: "none anywhere", first: nil},
		{name: "rank 0 holds another", mine: secret, first: other, wantErr: "holds another job secret", naming: n0.String()},
		{name: "rank 0 holds none", mine: secret, first: nil, wantErr: "holds no job secret", naming: n0.String()},
		{name: "a node holds none", mine: secret, first: secret, hasDissent: true, wantErr: "holds no job secret", naming: n5.String()},
		{name: "this node holds none", first: nil, hasDissent: true, dissent: secret, wantErr: "this node none", naming: n5.String()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.JobSecret = tc.mine
			j := &jobNode{cfg: &cfg, log: zap.NewNop(), runID: "r"}
			s := &rendezvous.Summary{Offset: 10, Total: 64, First: rendezvous.Member{Node: n0, Data: data(tc.first.check("r"))}}
			if tc.hasDissent {
				s.Dissent = &rendezvous.Member{Node: n5, Rank: 5, Data: data(tc.dissent.check("r"))}
			}
			v, err := j.view(context.Background(), rendezvous.Round{Number: 2, Rank: 5, Size: 32, Summary: s})
			if err != nil {
				t.Fatal(err)
			}
			if v.groupRank != 5 || v.size != 32 || v.offset != 10 || v.world != 64 || v.rank0 != n0 || v.infos != nil {
				t.Fatalf("view %+v", v)
			}
			switch {
			case tc.wantErr == "" && v.mixed != nil:
				t.Fatalf("mixed secrets: %v", v.mixed)
			case tc.wantErr != "" && (v.mixed == nil || !errors.Is(v.mixed, ErrInvalidConfig) ||
				!strings.Contains(v.mixed.Error(), tc.wantErr) || !strings.Contains(v.mixed.Error(), tc.naming)):
				t.Fatalf("mixed secrets: %v, want %q naming %s", v.mixed, tc.wantErr, tc.naming)
			}
		})
	}
}
