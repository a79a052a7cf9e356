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
		kind   string // "beat", "forget", "expire"
		ms     int
		rank   int
		want   []int // expire: ranks reported
		nextMs int   // expire: Next() afterwards, -1 for none
	}
	tests := []struct {
		name string
		ops  []op
	}{
		{"a worker that never beats is not watched", []op{
			{kind: "expire", ms: 10_000, want: nil, nextMs: -1},
		}},
		{"beats keep a worker alive; silence reports it once", []op{
			{kind: "beat", ms: 0, rank: 0},
			{kind: "beat", ms: 400, rank: 0},
			{kind: "expire", ms: 900, want: nil, nextMs: 1400},
			{kind: "expire", ms: 1400, want: []int{0}, nextMs: -1},
			{kind: "expire", ms: 5000, want: nil, nextMs: -1},
		}},
		{"a new beat re-arms a reported worker", []op{
			{kind: "beat", ms: 0, rank: 2},
			{kind: "expire", ms: 1000, want: []int{2}, nextMs: -1},
			{kind: "beat", ms: 1100, rank: 2},
			{kind: "expire", ms: 2100, want: []int{2}, nextMs: -1},
		}},
		{"several workers, reported in rank order", []op{
			{kind: "beat", ms: 0, rank: 3},
			{kind: "beat", ms: 0, rank: 1},
			{kind: "beat", ms: 500, rank: 0},
			{kind: "expire", ms: 1000, want: []int{1, 3}, nextMs: 1500},
		}},
		{"a forgotten worker is not reported", []op{
			{kind: "beat", ms: 0, rank: 1},
			{kind: "forget", rank: 1},
			{kind: "expire", ms: 2000, want: nil, nextMs: -1},
		}},
		{"a late, out-of-order beat does not move time back", []op{
			{kind: "beat", ms: 800, rank: 0},
			{kind: "beat", ms: 100, rank: 0},
			{kind: "expire", ms: 1200, want: nil, nextMs: 1800},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewHangDetector(time.Second)
			for i, o := range tt.ops {
				switch o.kind {
				case "beat":
					d.Beat(o.rank, at(o.ms))
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
	for in, want := range map[string]int{"0": 0, "7": 7, "3 pid=42": 3, " 12\n": 12} {
		if got, err := parseBeat([]byte(in)); err != nil || got != want {
			t.Errorf("parseBeat(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "1.5"} {
		if _, err := parseBeat([]byte(in)); err == nil {
			t.Errorf("parseBeat(%q) accepted", in)
		}
	}
}
