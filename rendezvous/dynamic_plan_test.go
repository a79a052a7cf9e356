package rendezvous

import (
	"encoding/json"
	"fmt"
	"reflect"
	"testing"
	"time"
)

// testTraits reads data written as {"w":WEIGHT,"c":"CHECK"}.
func testTraits(data []byte) (NodeTraits, error) {
	var v struct {
		W int    `json:"w"`
		C string `json:"c"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return NodeTraits{}, err
	}
	return NodeTraits{Weight: v.W, Check: v.C}, nil
}

func traitsData(w int, c string) []byte {
	return fmt.Appendf(nil, `{"w":%d,"c":%q}`, w, c)
}

// planMembers are members of ranks 0..len-1 with the given weights and
// checks.
func planMembers(weights []int, checks []string) []Member {
	ms := make([]Member, len(weights))
	for i, w := range weights {
		ms[i] = Member{Node: NodeDesc{Addr: fmt.Sprintf("n%02d", i), Pid: 1}, Rank: i, Data: traitsData(w, checks[i])}
	}
	return ms
}

func TestPlanOf(t *testing.T) {
	for _, tc := range []struct {
		name    string
		weights []int
		checks  []string
		offsets []int
		total   int
		dissent int // rank of the dissenting member; -1 for none
		err     bool
	}{
		{name: "one node", weights: []int{8}, checks: []string{""}, offsets: []int{0}, total: 8, dissent: -1},
		{name: "even", weights: []int{4, 4, 4}, checks: []string{"k", "k", "k"}, offsets: []int{0, 4, 8}, total: 12, dissent: -1},
		{name: "uneven, in rank order", weights: []int{1, 8, 0, 3, 2}, checks: []string{"", "", "", "", ""},
			offsets: []int{0, 1, 9, 9, 12}, total: 14, dissent: -1},
		{name: "a node with another secret", weights: []int{2, 2, 2, 2}, checks: []string{"a", "a", "b", "c"},
			offsets: []int{0, 2, 4, 6}, total: 8, dissent: 2},
		{name: "rank 0 the odd one", weights: []int{1, 1}, checks: []string{"", "a"}, offsets: []int{0, 1}, total: 2, dissent: 1},
		{name: "negative weight", weights: []int{1, -1}, checks: []string{"", ""}, err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ms := planMembers(tc.weights, tc.checks)
			p, err := planOf(5, ms, testTraits)
			if tc.err {
				if err == nil {
					t.Fatalf("planOf = %+v, want an error", p)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Round != 5 || p.Total != tc.total || !reflect.DeepEqual(p.Offsets, tc.offsets) {
				t.Fatalf("plan round %d total %d offsets %v, want 5 %d %v", p.Round, p.Total, p.Offsets, tc.total, tc.offsets)
			}
			for r := range ms {
				s := p.summary(r)
				if s.Offset != tc.offsets[r] || s.Total != tc.total || s.First.Node != ms[0].Node || string(s.First.Data) != string(ms[0].Data) {
					t.Fatalf("rank %d: summary %+v", r, s)
				}
				switch {
				case tc.dissent < 0 && s.Dissent != nil:
					t.Fatalf("rank %d: dissent %v, want none", r, s.Dissent.Node)
				case tc.dissent >= 0 && (s.Dissent == nil || s.Dissent.Node != ms[tc.dissent].Node):
					t.Fatalf("rank %d: dissent %+v, want %v", r, s.Dissent, ms[tc.dissent].Node)
				}
			}
			if p.summary(len(ms)) != nil || p.summary(-1) != nil {
				t.Fatal("a summary for a rank outside the round")
			}
		})
	}
}

func TestPlanOfRefuses(t *testing.T) {
	gap := planMembers([]int{1, 1, 1}, []string{"", "", ""})
	gap = append(gap[:1], gap[2:]...) // rank 1 lost
	bad := planMembers([]int{1, 1}, []string{"", ""})
	bad[1].Data = []byte("not json")
	for name, ms := range map[string][]Member{"a gap in the ranks": gap, "data it cannot read": bad, "no members": nil} {
		if p, err := planOf(0, ms, testTraits); err == nil {
			t.Errorf("%s: planOf = %+v, want an error", name, p)
		}
	}
}

// TestPlanRoundOutlivesALoss: the plan is made when the round completes
// and kept while it runs, so that a node admitted late in a lost member's
// place (a gap in the ranks, then the newcomer at that rank) gets the
// lost member's offset; a new round drops it.
func TestPlanRoundOutlivesALoss(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s := shareState(4, 1, t0)
	weights := []int{3, 1, 4, 1}
	for i := range s.Nodes {
		s.Nodes[i].Data = traitsData(2, "")
		if !s.Nodes[i].Waiting {
			s.Nodes[i].Data = traitsData(weights[s.Nodes[i].Rank], "")
		}
	}
	planRound(s, testTraits)
	if s.Plan == nil || !reflect.DeepEqual(s.Plan.Offsets, []int{0, 3, 4, 8}) || s.Plan.Total != 9 {
		t.Fatalf("plan %+v", s.Plan)
	}
	lost := s.Nodes[2] // rank 2
	s.Nodes = append(s.Nodes[:2], s.Nodes[3:]...)
	planRound(s, testTraits)
	admitted, err := s.admit(lost.Rank)
	if err != nil {
		t.Fatal(err)
	}
	newcomer := admitted[0]
	planRound(s, testTraits)
	r, ok := s.round(newcomer)
	if !ok || !r.Late || r.Summary == nil || r.Summary.Offset != 4 || r.Summary.Total != 9 {
		t.Fatalf("newcomer's round %+v (summary %+v)", r, r.Summary)
	}
	// Its share carries the same.
	nb := shareBuckets(16)
	v := viewOf(s.marker(DynamicConfig{}.withDefaults()), s.shares(nb)[bucketOf(newcomer, nb)], s.Plan.shared())
	vr, ok := v.viewRound(newcomer)
	if !ok || !reflect.DeepEqual(vr.Summary, r.Summary) {
		t.Fatalf("view's summary %+v, state's %+v", vr.Summary, r.Summary)
	}
	s.Complete, s.Round = false, s.Round+1
	planRound(s, testTraits)
	if s.Plan != nil {
		t.Fatalf("a gathering round kept plan %+v", s.Plan)
	}
	planRound(s, nil)
	if s.Plan != nil {
		t.Fatal("a plan without Describe")
	}
}
