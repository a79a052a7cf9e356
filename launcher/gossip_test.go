package launcher

import (
	"slices"
	"testing"
)

func TestSeedsAfter(t *testing.T) {
	peers := []gossipPeer{{"a", "a:1"}, {"b", "b:1"}, {"c", "c:1"}, {"d", "d:1"}, {"e", "e:1"}}
	for _, tc := range []struct {
		name  string
		self  string
		peers []gossipPeer
		k     int
		want  []string
	}{
		{name: "the first joins its successors", self: "a", peers: peers, k: 3, want: []string{"b:1", "c:1", "d:1"}},
		{name: "in the middle", self: "c", peers: peers, k: 3, want: []string{"d:1", "e:1", "a:1"}},
		{name: "the last wraps round", self: "e", peers: peers, k: 3, want: []string{"a:1", "b:1", "c:1"}},
		{name: "fewer peers than seeds", self: "b", peers: peers[:3], k: 3, want: []string{"c:1", "a:1"}},
		{name: "alone", self: "a", peers: peers[:1], k: 3, want: []string{}},
		{name: "not among them: from the first", self: "x", peers: peers, k: 2, want: []string{"a:1", "b:1"}},
		{name: "peers without gossip are skipped", self: "a", peers: []gossipPeer{{"a", "a:1"}, {}, {"c", "c:1"}}, k: 3, want: []string{"c:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := seedsAfter(tc.self, tc.peers, tc.k); !slices.Equal(got, tc.want) {
				t.Errorf("seedsAfter(%q, …, %d) = %q, want %q", tc.self, tc.k, got, tc.want)
			}
		})
	}
	// Every agent is the seed of exactly k others: no agent is everybody's.
	counts := map[string]int{}
	for _, p := range peers {
		for _, s := range seedsAfter(p.Name, peers, 3) {
			counts[s]++
		}
	}
	for _, p := range peers {
		if counts[p.Addr] != 3 {
			t.Errorf("%s is the seed of %d agents, want 3", p.Name, counts[p.Addr])
		}
	}
}
