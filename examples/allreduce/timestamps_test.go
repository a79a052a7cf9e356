package main

import (
	"context"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"
)

func TestFirstCollectiveLine(t *testing.T) {
	at := time.Unix(1700000000, 123456789)
	if got, want := firstCollectiveLine(2, 1, at), "first-collective attempt=2 epoch=1 unix_ns=1700000000123456789"; got != want {
		t.Errorf("firstCollectiveLine = %q, want %q", got, want)
	}
}

var (
	firstRE   = regexp.MustCompile(`(?m)^first-collective attempt=(\d+) epoch=(\d+) unix_ns=(\d+)$`)
	startedRE = regexp.MustCompile(`(?m)^started attempt=0 unix_ns=(\d+)$`)
	stoppedRE = regexp.MustCompile(`(?m)^stopped attempt=0 epoch=0 unix_ns=(\d+)$`)
)

// stampsOf returns the times of re's lines in out (the first group, Unix
// nanoseconds).
func stampsOf(re *regexp.Regexp, out string) []time.Time {
	var ts []time.Time
	for _, m := range re.FindAllStringSubmatch(out, -1) {
		ns, _ := strconv.ParseInt(m[1], 10, 64)
		ts = append(ts, time.Unix(0, ns))
	}
	return ts
}

// TestTimestamps runs three ranks in shrink mode with --timestamps, kills
// rank 1 and publishes the epoch that excludes it: every rank prints one
// first-collective line for epoch 0, stamped after the test started them,
// and each survivor one for epoch 1, stamped after the kill — the moment
// bench/ftbench measures recovery to. Every rank also stamps its start, and
// each survivor the moment the epoch stopped its steps, after the kill and
// before its first collective of epoch 1.
func TestTimestamps(t *testing.T) {
	bin := buildExample(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const world, victim = 3, 1
	started := time.Now()
	j := startJob(ctx, t, bin, world, nil, "shrink",
		[]string{"--steps", "100", "--step-ms", "10", "--elems", "64", "--timeout", "60s", "--timestamps"})
	j.waitStarted(ctx)
	time.Sleep(100 * time.Millisecond) // some steps in

	killed := time.Now()
	if err := j.procs[victim].Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	j.wait(ctx, victim)
	e := epochOf(t, world, []int{victim}, 1)
	if _, won, err := j.board.Publish(ctx, e); err != nil || !won {
		t.Fatalf("Publish: %v %v", won, err)
	}
	for r := range world {
		if r != victim {
			if code := j.wait(ctx, r); code != exitOK {
				t.Fatalf("rank %d exited %d\n%s", r, code, j.output())
			}
		}
	}
	ended := time.Now()

	for r := range world {
		// stamps[epoch]: the times rank r printed for that epoch.
		stamps := map[int][]time.Time{}
		for _, m := range firstRE.FindAllStringSubmatch(j.outs[r].String(), -1) {
			if m[1] != "0" {
				t.Errorf("rank %d: %q, want attempt=0", r, m[0])
			}
			epoch, _ := strconv.Atoi(m[2])
			ns, _ := strconv.ParseInt(m[3], 10, 64)
			stamps[epoch] = append(stamps[epoch], time.Unix(0, ns))
		}
		wantEpochs := map[int]time.Time{0: started, 1: killed} // epoch → stamped after
		if r == victim {
			delete(wantEpochs, 1)
		}
		if len(stamps) != len(wantEpochs) {
			t.Errorf("rank %d stamped epochs %v, want %d epoch(s)\n%s", r, stamps, len(wantEpochs), j.outs[r])
		}
		if got := stampsOf(startedRE, j.outs[r].String()); len(got) != 1 || got[0].Before(started) || got[0].After(ended) {
			t.Errorf("rank %d: started stamps %v, want one within [%v, %v]", r, got, started, ended)
		}
		if r != victim {
			got := stampsOf(stoppedRE, j.outs[r].String())
			if len(got) != 1 || got[0].Before(killed) || len(stamps[1]) == 1 && got[0].After(stamps[1][0]) {
				t.Errorf("rank %d: stopped stamps %v, want one after the kill (%v), before epoch 1's first collective %v",
					r, got, killed, stamps[1])
			}
		}
		for epoch, after := range wantEpochs {
			got := stamps[epoch]
			if len(got) != 1 {
				t.Errorf("rank %d: %d first-collective lines for epoch %d, want 1\n%s", r, len(got), epoch, j.outs[r])
				continue
			}
			if got[0].Before(after) || got[0].After(ended) {
				t.Errorf("rank %d: epoch %d stamped at %v, want within [%v, %v]", r, epoch, got[0], after, ended)
			}
		}
	}
}
