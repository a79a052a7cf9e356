package main

import (
	"context"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestUnderGorunShrink is shrink mode end to end on one node: gorun
// --on-failure shrink runs eight ranks; the test SIGKILLs global rank 3 in
// mid-run; gorun reports it and publishes the epoch, and the seven
// survivors renumber densely and finish with the sum over the surviving
// original ranks (1+…+8 − 4 = 32). gorun exits 0. Heal is off here
// (--regrow off): TestUnderGorunHeal grows the rank back.
func TestUnderGorunShrink(t *testing.T) {
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const world, victim, steps = 8, 3, 400
	g := testutil.StartGorun(t, gorun, nil, "--standalone", "--nproc-per-node", strconv.Itoa(world),
		"--on-failure", "shrink", "--regrow", "off", "--no-python", bin, "--steps", strconv.Itoa(steps), "--step-ms", "5")
	g.AwaitLines(ctx, t, "start rank=", world)
	time.Sleep(300 * time.Millisecond) // some steps in
	g.KillRank(t, victim)
	g.Wait(ctx, t)
	text := g.Stdout.String() + g.Stderr.String()
	if n := strings.Count(text, "]:shrink epoch=1 world=7 excluded=[3]"); n != world-1 {
		t.Errorf("%d survivors printed the shrink line, want %d\n%s", n, world-1, text)
	}
	var ranks []int
	for _, m := range doneRE.FindAllStringSubmatch(text, -1) {
		r, _ := strconv.Atoi(m[1])
		ranks = append(ranks, r)
		if m[2] != "7" || m[3] != strconv.Itoa(steps) || m[4] != "32" {
			t.Errorf("%s: want world=7 steps=%d sum=32", m[0], steps)
		}
	}
	slices.Sort(ranks)
	if !slices.Equal(ranks, []int{0, 1, 2, 3, 4, 5, 6}) {
		t.Errorf("done lines from ranks %v, want 0..6\n%s", ranks, text)
	}
	if !regexp.MustCompile(`lost ranks \[3\] in 1 epoch\(s\), world 8 -> 7`).MatchString(text) {
		t.Errorf("gorun's log does not sum up the loss:\n%s", text)
	}
}
