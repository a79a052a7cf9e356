package main

import (
	"fmt"
	"strings"
	"testing"
)

// TestCheckSamples: the agent's resources are judged at the least of the
// last three samples against the first, store keys against the store
// after 2 epochs.
func TestCheckSamples(t *testing.T) {
	s := func(fds, gor, keys, epochs int) Sample {
		return Sample{FDs: fds, Goroutines: gor, RSSKiB: 1000, Keys: keys, Epochs: epochs}
	}
	e := func(keys, leases, epochs int) Sample {
		return Sample{FDs: 40, Goroutines: 30, RSSKiB: 1000, EtcdKeys: keys, EtcdLeases: leases, Epochs: epochs}
	}
	lim := Limits{}.withDefaults().perRank(4) // 32 store keys
	tests := []struct {
		name    string
		samples []Sample
		want    []string // substrings, one per violation
	}{
		{"steady", []Sample{s(40, 30, 4, 1), s(41, 31, 4, 2), s(40, 30, 4, 3)}, nil},
		{"a restart's moment at the end", []Sample{s(40, 30, 4, 1), s(40, 30, 4, 2), s(40, 30, 4, 3), s(60, 70, 4, 3)}, nil},
		{"fds leak", []Sample{s(40, 30, 4, 1), s(60, 30, 4, 2), s(61, 30, 4, 3), s(62, 30, 4, 4)}, []string{"open fds grew from 40 to 60"}},
		{"goroutine leak", []Sample{s(40, 30, 4, 1), s(40, 90, 4, 2), s(40, 90, 4, 3), s(40, 91, 4, 4)}, []string{"goroutines grew from 30 to 90"}},
		{"keys after 2 epochs are the base", []Sample{s(40, 30, 0, 1), s(40, 30, 20, 3), s(40, 30, 40, 9)}, nil},
		{"keys grow with epochs", []Sample{s(40, 30, 0, 1), s(40, 30, 10, 3), s(40, 30, 60, 20), s(40, 30, 70, 30), s(40, 30, 80, 40)}, []string{"store keys grew from 10 to 60 by epoch 40"}},
		{"keys grow by the last sample", []Sample{s(40, 30, 0, 1), s(40, 30, 10, 3), s(40, 30, 80, 40)}, []string{"store keys grew from 10 to 80 by epoch 40"}},
		{"keys of epochs in flight at the end", []Sample{s(40, 30, 0, 1), s(40, 30, 10, 3), s(40, 30, 30, 20), s(40, 30, 70, 30), s(40, 30, 60, 40)}, nil},
		{"keys that every late sample holds", []Sample{s(40, 30, 0, 1), s(40, 30, 10, 3), s(40, 30, 50, 20), s(40, 30, 70, 30), s(40, 30, 60, 40)}, []string{"store keys grew from 10 to 50 by epoch 40"}},
		{"etcd steady", []Sample{e(20, 2, 1), e(60, 2, 3), e(70, 3, 40), e(65, 2, 41), e(66, 2, 42)}, nil},
		{"etcd keys grow with epochs", []Sample{e(20, 2, 1), e(60, 2, 3), e(200, 2, 40), e(210, 2, 41), e(220, 2, 42)}, []string{"etcd keys grew from 60 to 200"}},
		{"a lease per epoch", []Sample{e(20, 2, 1), e(60, 2, 3), e(60, 30, 40), e(60, 31, 41), e(60, 32, 42)}, []string{"etcd leases grew from 2 to 30"}},
		{"no go_goroutines", []Sample{s(40, -1, 4, 1), s(40, -1, 4, 2)}, []string{"no go_goroutines"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := RowResult{Samples: tt.samples}
			var got []string
			checkSamples(&res, rows[1], lim, func(f string, a ...any) { got = append(got, fmt.Sprintf(f, a...)) })
			if len(got) != len(tt.want) {
				t.Fatalf("violations %q, want %d: %q", got, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("violation %q lacks %q", got[i], w)
				}
			}
		})
	}
}

// TestLimitsByWorker: the store-key limit grows with the world (the
// agreement's records a rank); the torch worker's store-key and fd limits
// add its kept groups and store connections per rank; an etcd job's add
// only etcd's share.
func TestLimitsByWorker(t *testing.T) {
	def := Limits{}.withDefaults()
	tests := []struct {
		name      string
		lim       Limits
		keys, fds int
	}{
		{"go, world 4", def.perRank(4), 32, 8},
		{"go, world 6", def.perRank(6), 40, 8},
		{"torch, world 4", def.perRank(4).torchGroups(4), 32 + 4*torchKeysPerRank, 8 + 4*torchFDsPerRank},
		{"torch, world 8", def.perRank(8).torchGroups(8), 48 + 8*torchKeysPerRank, 8 + 8*torchFDsPerRank},
		{"etcd leaves store keys and fds alone", def.perRank(4).perHost(2), 32, 8},
	}
	for _, tt := range tests {
		if tt.lim.Keys != tt.keys || tt.lim.FDs != tt.fds {
			t.Errorf("%s: key limit %d, fd limit %d; want %d, %d", tt.name, tt.lim.Keys, tt.lim.FDs, tt.keys, tt.fds)
		}
	}
}
