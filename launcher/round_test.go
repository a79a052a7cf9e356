package launcher

import (
	"testing"
	"testing/synctest"
	"time"
)

// TestRoundWatchPace: the job's polls go at the rendezvous's pace, four
// times faster (never faster than the monitor interval) on the node that
// leads the survivors' agreement, and every monitor interval while heal
// has a place to fill; the ticker ticks at the pace set.
func TestRoundWatchPace(t *testing.T) {
	for _, tc := range []struct {
		name           string
		every, monitor time.Duration
		soon, leading  bool
		want           time.Duration
	}{
		{"member", time.Second, 100 * time.Millisecond, false, false, time.Second},
		{"leader", time.Second, 100 * time.Millisecond, false, true, 250 * time.Millisecond},
		{"leader, a place to fill", time.Second, 100 * time.Millisecond, true, true, 100 * time.Millisecond},
		{"leader, no faster than the monitor", 200 * time.Millisecond, 100 * time.Millisecond, false, true, 100 * time.Millisecond},
		{"a slow monitor", time.Second, 2 * time.Second, false, true, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := &roundWatch{a: &agent{cfg: Config{MonitorInterval: tc.monitor}}, pollEvery: tc.every,
					ticker: time.NewTicker(tc.every), paced: tc.every}
				defer w.ticker.Stop()
				w.pace(tc.soon, tc.leading)
				start := time.Now()
				<-w.ticker.C
				<-w.ticker.C
				if got := time.Since(start); got != 2*tc.want || w.paced != tc.want {
					t.Errorf("two ticks in %v (paced %v), want %v each", got, w.paced, tc.want)
				}
				w.pace(false, false) // back to the usual pace
				start = time.Now()
				<-w.ticker.C
				if got := time.Since(start); got != tc.every {
					t.Errorf("after the lead: a tick in %v, want %v", got, tc.every)
				}
			})
		})
	}
}
