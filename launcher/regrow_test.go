package launcher

import (
	"testing"
	"testing/synctest"
	"time"
)

// TestRespawnsBackoff: a slot is due after its backoff, which doubles with
// each respawn of that slot up to maxRespawnBackoff; a slot already waiting
// is not scheduled twice; cancel stops every wait; heal off is a nil
// policy that never has anything pending.
func TestRespawnsBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := newRespawns(true, time.Second, 4)
		start := time.Now()
		for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
			d, ok := r.schedule(2)
			if !ok || d != want {
				t.Fatalf("respawn %d: schedule = %v %v, want %v", i, d, ok, want)
			}
			if _, again := r.schedule(2); again {
				t.Fatal("a waiting slot was scheduled twice")
			}
			if !r.pending() {
				t.Fatal("nothing pending while slot 2 waits")
			}
			began := time.Now()
			if slot := <-r.dueC(); slot != 2 || time.Since(began) != want {
				t.Fatalf("due %d after %v, want slot 2 after %v", slot, time.Since(began), want)
			}
			r.fired(2)
		}
		if r.pending() || time.Since(start) != 7*time.Second {
			t.Fatalf("pending %v after %v", r.pending(), time.Since(start))
		}
		r.count[5] = 10
		if d := r.delay(5); d != maxRespawnBackoff {
			t.Errorf("backoff after 10 respawns = %v, want the cap %v", d, maxRespawnBackoff)
		}

		r.schedule(1)
		r.schedule(3)
		r.cancel()
		time.Sleep(time.Hour)
		select {
		case slot := <-r.dueC():
			t.Errorf("slot %d due after cancel", slot)
		default:
		}
		if r.pending() {
			t.Error("pending after cancel")
		}
	})
	var off *respawns = newRespawns(false, time.Second, 4)
	if off != nil || off.pending() || off.dueC() != nil {
		t.Error("heal off is not a nil policy")
	}
	off.cancel() // no-op
}
