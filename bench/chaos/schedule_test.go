package main

import (
	"errors"
	"reflect"
	"slices"
	"testing"
	"time"
)

func TestScheduleDeterministic(t *testing.T) {
	c := ScheduleConfig{Seed: 7, MTBF: 10 * time.Second, Horizon: 10 * time.Minute, World: 4, Hosts: 2,
		Kinds: []Kind{RankKill, RankExit, RankHang, AgentKill}}
	a, err := NewSchedule(c)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := NewSchedule(c)
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("the same seed gave two schedules:\n%v\n%v", a, b)
	}
	c.Seed = 8
	other, _ := NewSchedule(c)
	if reflect.DeepEqual(a, other) {
		t.Errorf("seeds 7 and 8 gave the same schedule")
	}
}

// TestScheduleShape checks what every schedule promises, over many seeds:
// faults in time order, within the horizon, MinGap apart and from the
// start, targets in range (host faults never host 0), every kind drawn,
// and the mean gap near MTBF.
func TestScheduleShape(t *testing.T) {
	tests := []struct {
		name string
		c    ScheduleConfig
	}{
		{"rank kinds, one host", ScheduleConfig{MTBF: 30 * time.Second, Horizon: time.Hour, World: 8}},
		{"every kind but the coordinator's, 2 hosts", ScheduleConfig{MTBF: 5 * time.Second, MinGap: 2 * time.Second, Horizon: time.Hour, World: 4, Hosts: 2,
			Kinds: slices.DeleteFunc(slices.Clone(allKinds), func(k Kind) bool { return k == CoordinatorLost })}},
		{"every kind, 3 hosts", ScheduleConfig{MTBF: 5 * time.Second, MinGap: 2 * time.Second, Horizon: time.Hour, World: 6, Hosts: 3, Kinds: allKinds}},
		{"the coordinator's host, 2 hosts", ScheduleConfig{MTBF: 5 * time.Second, Horizon: time.Hour, World: 4, Hosts: 2, Kinds: []Kind{CoordinatorLost, RankKill}}},
		{"no min gap", ScheduleConfig{MTBF: time.Second, MinGap: -0, Horizon: 10 * time.Minute, World: 2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := tt.c.withDefaults()
			var gaps, n float64
			kinds := map[Kind]int{}
			for seed := range uint64(20) {
				tt.c.Seed = seed
				fs, err := NewSchedule(tt.c)
				if err != nil {
					t.Fatal(err)
				}
				prev := time.Duration(0)
				for _, f := range fs {
					if f.At-prev < c.MinGap || f.At >= c.Horizon {
						t.Fatalf("seed %d: %v after %v: want ≥ %v later and before %v", seed, f, prev, c.MinGap, c.Horizon)
					}
					var want bool
					switch f.Kind {
					case SpareKill: // the bed's extra host, Hosts
						want = f.Target == c.Hosts
					case CoordinatorLost:
						want = f.Target == 0
					case AgentKill, LinkCut: // neither host 0 nor the witness
						want = f.Target >= 1 && f.Target < c.Hosts && f.Target != c.Witness()
					default:
						want = f.Target >= 0 && f.Target < c.World
					}
					if !want {
						t.Fatalf("seed %d: %v: target out of range (witness host %d)", seed, f, c.Witness())
					}
					kinds[f.Kind]++
					prev = f.At
				}
				gaps += float64(prev)
				n += float64(len(fs))
			}
			if mean := time.Duration(gaps / n); mean < c.MTBF*8/10 || mean > c.MTBF*12/10 {
				t.Errorf("mean gap %v, want about %v", mean, c.MTBF)
			}
			for _, k := range c.Kinds {
				if kinds[k] == 0 {
					t.Errorf("kind %s never drawn", k)
				}
			}
		})
	}
}

// TestScheduleHostTargetsUniform: with the witness moved to the last host
// (coordinator-lost), an agent kill still strikes each remaining host
// about as often.
func TestScheduleHostTargetsUniform(t *testing.T) {
	c := ScheduleConfig{MTBF: time.Second, Horizon: time.Hour, World: 8, Hosts: 4, Kinds: []Kind{CoordinatorLost, AgentKill}}
	count := map[int]int{}
	for seed := range uint64(10) {
		c.Seed = seed
		fs, err := NewSchedule(c)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fs {
			if f.Kind == AgentKill {
				count[f.Target]++
			}
		}
	}
	if len(count) != 2 || count[1] == 0 || count[2] == 0 {
		t.Fatalf("agent kills by host %v, want hosts 1 and 2 only (host 3 is the witness)", count)
	}
	if r := float64(count[1]) / float64(count[2]); r < 0.85 || r > 1.15 {
		t.Errorf("agent kills by host %v: hosts 1 and 2 should be struck about equally", count)
	}
}

func TestScheduleErrors(t *testing.T) {
	tests := []struct {
		name string
		c    ScheduleConfig
	}{
		{"no horizon", ScheduleConfig{World: 2}},
		{"no world", ScheduleConfig{Horizon: time.Minute}},
		{"gap beyond mtbf", ScheduleConfig{Horizon: time.Minute, World: 2, MTBF: time.Second, MinGap: 2 * time.Second}},
		{"host fault on one host", ScheduleConfig{Horizon: time.Minute, World: 2, Kinds: []Kind{AgentKill}}},
		{"unknown kind", ScheduleConfig{Horizon: time.Minute, World: 2, Kinds: []Kind{"meteor"}}},
		// Host 0 is the coordinator's, host 1 the witness: no host left.
		{"agent kills beside the coordinator's loss on 2 hosts", ScheduleConfig{Horizon: time.Minute, World: 2, Hosts: 2, Kinds: []Kind{CoordinatorLost, AgentKill}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewSchedule(tt.c); !errors.Is(err, ErrSchedule) {
				t.Errorf("NewSchedule = %v, want ErrSchedule", err)
			}
		})
	}
}

func TestParseKinds(t *testing.T) {
	got, err := ParseKinds([]string{"rank-kill", "agent-kill"})
	if err != nil || !reflect.DeepEqual(got, []Kind{RankKill, AgentKill}) {
		t.Errorf("ParseKinds = %v, %v", got, err)
	}
	if _, err := ParseKinds([]string{"rank-kill", "flood"}); !errors.Is(err, ErrSchedule) {
		t.Errorf("ParseKinds(flood) = %v, want ErrSchedule", err)
	}
}

// TestPickRank: a rank fault strikes its target, or the next running rank
// after it (wrapping around), never the one excluded (a two-rank fault's
// first).
func TestPickRank(t *testing.T) {
	workers := map[int]int{0: 100, 2: 102, 3: 103}
	for _, tt := range []struct {
		target, not, rank, pid int
	}{
		{0, -1, 0, 100},
		{1, -1, 2, 102},
		{3, -1, 3, 103},
		{3, 3, 0, 100},
		{4, -1, 0, 100}, // the second of a two-rank fault on the last rank
		{2, 2, 3, 103},
	} {
		if rank, pid := pickRank(workers, tt.target, 4, tt.not); rank != tt.rank || pid != tt.pid {
			t.Errorf("pickRank(target %d, not %d) = %d, %d; want %d, %d", tt.target, tt.not, rank, pid, tt.rank, tt.pid)
		}
	}
	if rank, pid := pickRank(map[int]int{1: 101}, 1, 4, 1); pid != 0 || rank != -1 {
		t.Errorf("the only running rank excluded: got %d, %d; want none", rank, pid)
	}
}
