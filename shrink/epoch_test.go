package shrink

import (
	"slices"
	"testing"
	"time"
)

func TestEpochNext(t *testing.T) {
	now := time.Unix(1000, 0)
	tests := []struct {
		name      string
		from      Epoch
		exclude   []int
		minWorld  int
		wantExcl  []int
		wantLost  []int
		wantRanks []int
		wantWorld int
		wantAct   Action
	}{
		{
			name: "one rank of eight", from: Initial(8), exclude: []int{5}, minWorld: 1,
			wantExcl: []int{5}, wantLost: []int{5}, wantRanks: []int{0, 1, 2, 3, 4, -1, 5, 6}, wantWorld: 7, wantAct: ActionShrink,
		},
		{
			name: "middle ranks, unsorted input", from: Initial(8), exclude: []int{6, 2, 4}, minWorld: 1,
			wantExcl: []int{2, 4, 6}, wantLost: []int{2, 4, 6}, wantRanks: []int{0, 1, -1, 2, -1, 3, -1, 4}, wantWorld: 5, wantAct: ActionShrink,
		},
		{
			name: "below the floor is a restart", from: Initial(4), exclude: []int{0, 1}, minWorld: 3,
			wantExcl: []int{0, 1}, wantLost: []int{0, 1}, wantRanks: []int{-1, -1, 0, 1}, wantWorld: 2, wantAct: ActionRestart,
		},
		{
			name: "at the floor is a shrink", from: Initial(4), exclude: []int{0}, minWorld: 3,
			wantExcl: []int{0}, wantLost: []int{0}, wantRanks: []int{-1, 0, 1, 2}, wantWorld: 3, wantAct: ActionShrink,
		},
		{
			name: "an already lost rank is ignored", from: mustNext(t, Initial(4), 1), exclude: []int{1, 3}, minWorld: 1,
			wantExcl: []int{3}, wantLost: []int{1, 3}, wantRanks: []int{0, -1, 1, -1}, wantWorld: 2, wantAct: ActionShrink,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ex := map[int]string{}
			for _, g := range tt.exclude {
				ex[g] = "exit code 1"
			}
			got, err := tt.from.next(ex, tt.minWorld, tt.from.Number, "agent0", now)
			if err != nil {
				t.Fatal(err)
			}
			if got.Number != tt.from.Number+1 || !slices.Equal(got.Excluded, tt.wantExcl) || !slices.Equal(got.Lost, tt.wantLost) ||
				!slices.Equal(got.Ranks, tt.wantRanks) || got.WorldSize != tt.wantWorld || got.Action != tt.wantAct {
				t.Errorf("next = %+v\nwant epoch %d excluded %v lost %v ranks %v world %d action %s",
					got, tt.from.Number+1, tt.wantExcl, tt.wantLost, tt.wantRanks, tt.wantWorld, tt.wantAct)
			}
			if got.Coordinator != "agent0" || !got.DecidedAt.Equal(now) || len(got.Reasons) != len(tt.wantExcl) {
				t.Errorf("next: coordinator %q decided %v reasons %v", got.Coordinator, got.DecidedAt, got.Reasons)
			}
		})
	}
}

func mustNext(t *testing.T, e Epoch, exclude ...int) Epoch {
	t.Helper()
	ex := map[int]string{}
	for _, g := range exclude {
		ex[g] = "test"
	}
	n, err := e.next(ex, 1, e.Number, "test", time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestEpochNextEveryoneOrNobody: excluding every rank is a restart epoch
// of world 0 (every agent reads it); excluding only ranks already lost
// forms no epoch.
func TestEpochNextEveryoneOrNobody(t *testing.T) {
	if e, err := Initial(3).next(map[int]string{0: "", 1: "", 2: ""}, 1, 0, "", time.Time{}); err != nil || e.Action != ActionRestart || e.WorldSize != 0 {
		t.Errorf("excluding everyone: %v, %v; want a restart epoch of world 0", e, err)
	}
	lost := mustNext(t, Initial(3), 2)
	if _, err := lost.next(map[int]string{2: "again"}, 1, lost.Number, "", time.Time{}); err == nil {
		t.Error("an epoch excluding only already-lost ranks was formed")
	}
}

// TestShrinkListAcrossEpochs checks the translation from global ranks to
// the group-relative list Shrink takes, over repeated shrinks (PyTorch's
// multiple-iterations test: the second shrink is in the first's numbering).
func TestShrinkListAcrossEpochs(t *testing.T) {
	e0 := Initial(8)
	e1 := mustNext(t, e0, 7, 3)
	if got := e1.ShrinkList(e0); !slices.Equal(got, []int{3, 7}) {
		t.Errorf("epoch 1 ShrinkList = %v, want [3 7]", got)
	}
	// Global 6 is rank 5 in epoch 1 (0 1 2 4→3 5→4 6→5); global 0 stays 0.
	e2 := mustNext(t, e1, 6, 0)
	if got := e2.ShrinkList(e1); !slices.Equal(got, []int{0, 5}) {
		t.Errorf("epoch 2 ShrinkList = %v, want [0 5]", got)
	}
	if want := []int{-1, 0, 1, -1, 2, 3, -1, -1}; !slices.Equal(e2.Ranks, want) {
		t.Errorf("epoch 2 ranks = %v, want %v", e2.Ranks, want)
	}
	if !slices.Equal(e2.Lost, []int{0, 3, 6, 7}) || e2.WorldSize != 4 {
		t.Errorf("epoch 2 lost %v world %d", e2.Lost, e2.WorldSize)
	}
}
