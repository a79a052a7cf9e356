package launcher

import "testing"

// TestAssign: global ranks go node after node in group-rank order, and
// nodes may run different numbers of workers.
func TestAssign(t *testing.T) {
	nodes := nodeRanks{{nproc: 2}, {nproc: 3}, {nproc: 1}}
	cases := []struct {
		group int
		ranks []int
	}{{0, []int{0, 1}}, {1, []int{2, 3, 4}}, {2, []int{5}}}
	for _, tc := range cases {
		as := assign(nodes, tc.group)
		if len(as) != len(tc.ranks) {
			t.Fatalf("group %d: %d assignments, want %d", tc.group, len(as), len(tc.ranks))
		}
		for i, a := range as {
			want := Assignment{
				LocalRank: i, Rank: tc.ranks[i], RoleRank: tc.ranks[i],
				LocalWorldSize: len(tc.ranks), WorldSize: 6, RoleWorldSize: 6,
				GroupRank: tc.group, GroupWorldSize: 3,
			}
			if a != want {
				t.Errorf("group %d local %d: %+v, want %+v", tc.group, i, a, want)
			}
		}
	}
}
