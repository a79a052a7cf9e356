package health

import (
	"slices"
	"testing"
	"time"
)

func TestHangDetector(t *testing.T) {
	t0 := time.Unix(100, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	type op struct {
		kind   string // "beat", "wait", "done", "forget", "expect", "expire"
		ranks  []int  // expect
		ms     int
		rank   int
		want   []int // expire: ranks reported
		nextMs int   // expire: Next() afterwards, -1 for none
	}
	tests := []struct {
		name   string
		ops    []op
		doneMs int // the done timeout; 0: none
	}{
		{"a worker that never beats is not watched", []op{
			{kind: "expire", ms: 10_000, want: nil, nextMs: -1},
		}, 0},
		{"beats keep a worker alive; silence reports it once", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 400, rank: 0},
			{kind: "expire", ms: 900, want: nil, nextMs: 1400},
			{kind: "expire", ms: 1400, want: []int{0}, nextMs: -1},
			{kind: "expire", ms: 5000, want: nil, nextMs: -1},
		}, 0},
		{"a new beat re-arms a reported worker", []op{
			{kind: "beat", ms: 0, rank: 2},
			{kind: "expire", ms: 1000, want: []int{2}, nextMs: -1},
			{kind: "beat", ms: 1100, rank: 2},
			{kind: "expire", ms: 2100, want: []int{2}, nextMs: -1},
		}, 0},
		{"several workers, reported in rank order", []op{
			{kind: "beat", ms: 0, rank: 3},
			{kind: "beat", ms: 0, rank: 1},
			{kind: "beat", ms: 500, rank: 0},
			{kind: "expire", ms: 1000, want: []int{1, 3}, nextMs: 1500},
		}, 0},
		{"a forgotten worker is not reported", []op{
			{kind: "beat", ms: 0, rank: 1},
			{kind: "forget", rank: 1},
			{kind: "expire", ms: 2000, want: nil, nextMs: -1},
		}, 0},
		{"a late, out-of-order beat does not move time back", []op{
			{kind: "beat", ms: 800, rank: 0},
			{kind: "beat", ms: 100, rank: 0},
			{kind: "expire", ms: 1200, want: nil, nextMs: 1800},
		}, 0},
		// A rank hangs after its step; its peers, blocked on it in their
		// next collective, say so: only the silent one is reported.
		{"a hung rank among peers blocked on it", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 5, rank: 1},
			{kind: "beat", ms: 10, rank: 2},
			{kind: "wait", ms: 20, rank: 0},
			{kind: "wait", ms: 25, rank: 2},
			{kind: "wait", ms: 270, rank: 0},
			{kind: "wait", ms: 275, rank: 2},
			{kind: "wait", ms: 520, rank: 0},
			{kind: "wait", ms: 525, rank: 2},
			{kind: "wait", ms: 770, rank: 0},
			{kind: "wait", ms: 775, rank: 2},
			{kind: "expire", ms: 1005, want: []int{1}, nextMs: 1770},
		}, 0},
		{"wait beats end: the rank is hung from its last one", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "wait", ms: 100, rank: 0},
			{kind: "wait", ms: 600, rank: 0},
			{kind: "expire", ms: 1000, want: nil, nextMs: 1600},
			{kind: "expire", ms: 1600, want: []int{0}, nextMs: -1},
		}, 0},
		{"blocked for BlockedFactor timeouts without progress", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "wait", ms: 9500, rank: 0},
			{kind: "expire", ms: 9999, want: nil, nextMs: 10000},
			{kind: "wait", ms: 9999, rank: 0},
			{kind: "expire", ms: 10000, want: []int{0}, nextMs: -1},
		}, 0},
		{"a progress beat ends the wait", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "wait", ms: 500, rank: 0},
			{kind: "beat", ms: 700, rank: 0},
			{kind: "wait", ms: 650, rank: 0}, // late: before the progress
			{kind: "expire", ms: 1600, want: nil, nextMs: 1700},
			{kind: "expire", ms: 1700, want: []int{0}, nextMs: -1},
		}, 0},
		// Rank 1 hangs before its first beat; ranks 0 and 2 block on it
		// in their first collective.
		{"a rank started with others that never beats", []op{
			{kind: "expect", ranks: []int{0, 1, 2}},
			{kind: "wait", ms: 100, rank: 0},
			{kind: "wait", ms: 150, rank: 2},
			{kind: "wait", ms: 600, rank: 0},
			{kind: "wait", ms: 650, rank: 2},
			{kind: "wait", ms: 1100, rank: 0},
			{kind: "wait", ms: 1150, rank: 2},
			{kind: "wait", ms: 1600, rank: 0},
			{kind: "wait", ms: 1650, rank: 2},
			{kind: "expire", ms: 2099, want: nil, nextMs: 2100},
			{kind: "expire", ms: 2100, want: []int{1}, nextMs: 2600},
		}, 0},
		{"a rank started with others that beats late, within two timeouts", []op{
			{kind: "expect", ranks: []int{0, 1}},
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 900, rank: 0},
			{kind: "beat", ms: 1800, rank: 0},
			{kind: "beat", ms: 1900, rank: 1},
			{kind: "expire", ms: 2000, want: nil, nextMs: 2800},
			{kind: "expire", ms: 2800, want: []int{0}, nextMs: 2900},
		}, 0},
		{"a respawn, not expected, is watched from its own first beat", []op{
			{kind: "expect", ranks: []int{0}},
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 900, rank: 0},
			{kind: "expire", ms: 1899, want: nil, nextMs: 1900},
		}, 0},
		{"a first wait beat starts the watch", []op{
			{kind: "wait", ms: 100, rank: 3},
			{kind: "expire", ms: 1099, want: nil, nextMs: 1100},
			{kind: "expire", ms: 1100, want: []int{3}, nextMs: -1},
		}, 0},
		{"a worker that said done is not watched, however long its teardown", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "done", ms: 500, rank: 0},
			{kind: "expire", ms: 100_000, want: nil, nextMs: -1},
		}, 0},
		{"with a done timeout, one that has not exited by then is reported once", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 0, rank: 1},
			{kind: "done", ms: 500, rank: 0},
			{kind: "beat", ms: 900, rank: 1},
			{kind: "expire", ms: 1500, want: nil, nextMs: 1900},
			{kind: "forget", rank: 1},
			{kind: "expire", ms: 3499, want: nil, nextMs: 3500},
			{kind: "expire", ms: 3500, want: []int{0}, nextMs: -1},
			{kind: "expire", ms: 9000, want: nil, nextMs: -1},
		}, 3000},
		{"a done worker that exits in time is not reported", []op{
			{kind: "beat", ms: 0, rank: 2},
			{kind: "done", ms: 500, rank: 2},
			{kind: "forget", rank: 2},
			{kind: "expire", ms: 9000, want: nil, nextMs: -1},
		}, 3000},
		{"a beat after done watches it for beats again", []op{
			{kind: "done", ms: 500, rank: 1},
			{kind: "beat", ms: 600, rank: 1},
			{kind: "expire", ms: 1599, want: nil, nextMs: 1600},
			{kind: "expire", ms: 1600, want: []int{1}, nextMs: -1},
		}, 3000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewHangDetector(time.Second)
			d.SetDoneTimeout(time.Duration(tt.doneMs) * time.Millisecond)
			for i, o := range tt.ops {
				switch o.kind {
				case "done":
					d.Done(o.rank, at(o.ms))
				case "beat":
					d.Beat(o.rank, at(o.ms))
				case "wait":
					d.Wait(o.rank, at(o.ms))
				case "expect":
					d.Expect(o.ranks)
				case "forget":
					d.Forget(o.rank)
				case "expire":
					var got []int
					for _, ev := range d.Expired(at(o.ms)) {
						if ev.Kind != WorkerHung || !ev.SeenAt.Equal(at(o.ms)) || ev.Reason == "" {
							t.Errorf("op %d: event %+v", i, ev)
						}
						got = append(got, ev.Rank)
					}
					if !slices.Equal(got, o.want) {
						t.Errorf("op %d: Expired(%d ms) = %v, want %v", i, o.ms, got, o.want)
					}
					next, ok := d.Next()
					if o.nextMs < 0 && ok {
						t.Errorf("op %d: Next() = %v, want none", i, next.Sub(t0))
					}
					if o.nextMs >= 0 && (!ok || !next.Equal(at(o.nextMs))) {
						t.Errorf("op %d: Next() = %v %v, want %d ms", i, next.Sub(t0), ok, o.nextMs)
					}
				}
			}
		})
	}
}

func TestParseBeat(t *testing.T) {
	type beat struct {
		rank int
		kind beatKind
	}
	for in, want := range map[string]beat{"0": {0, beatProgress}, "7": {7, beatProgress}, "3 pid=42": {3, beatProgress},
		" 12\n": {12, beatProgress}, "2 wait": {2, beatWait}, "5 wait step=9\n": {5, beatWait}, "4 waiting": {4, beatProgress},
		"1 done": {1, beatDone}} {
		if rank, kind, err := parseBeat([]byte(in)); err != nil || (beat{rank, kind}) != want {
			t.Errorf("parseBeat(%q) = %d %v, %v; want %+v", in, rank, kind, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "1.5", "wait"} {
		if _, _, err := parseBeat([]byte(in)); err == nil {
			t.Errorf("parseBeat(%q) accepted", in)
		}
	}
}
