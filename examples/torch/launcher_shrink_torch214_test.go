package torch_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestGorunShrinksTorch214Gloo is shrink mode with PyTorch 2.14 gloo
// workers (the sid bed's python, internal/sidbed): gorun --on-failure
// shrink runs four ranks of train_elastic.py, rank 2 is SIGKILLed early or
// late (after the helper's watcher has timed out its store waits a few
// times: 2.14 cancels them with CANCEL_WAIT), and the three survivors
// shrink and finish with the same model. The bed sees only the temporary
// directory, so the script and its helper are copied there.
func TestGorunShrinksTorch214Gloo(t *testing.T) {
	bed := sidbed.Require(t)
	gorun := testutil.BuildGorun(t)
	_, self, _, _ := runtime.Caller(0)
	dir := t.TempDir()
	for _, name := range []string{"train_elastic.py", "gorun_ft.py"} {
		b, err := os.ReadFile(filepath.Join(filepath.Dir(self), name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	script := filepath.Join(dir, "train_elastic.py")
	for _, tc := range []struct {
		name  string
		after time.Duration // from every rank training to the kill
		steps int
	}{
		{"early", 300 * time.Millisecond, 150},
		{"late", 3500 * time.Millisecond, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			g := testutil.StartGorun(t, gorun, []string{"PYTHON_EXEC=" + bed.Python()}, "--standalone", "--nproc-per-node", "4",
				"--on-failure", "shrink", "--log-dir", t.TempDir(), script, "--steps", strconv.Itoa(tc.steps), "--step-ms", "15")
			g.AwaitLines(ctx, t, ": training, world 4", 4)
			time.Sleep(tc.after)
			if strings.Contains(g.Stdout.String(), "done rank=") {
				t.Fatal("a rank finished before the kill: the run is too short")
			}
			killed := time.Now()
			g.KillRank(t, 2)
			g.Wait(ctx, t)
			if took := time.Since(killed); took > 60*time.Second {
				t.Errorf("the job ended %v after the kill: recovery waited out a timeout", took.Round(time.Millisecond))
			}
			out := g.Stdout.String()
			if n := strings.Count(out, "shrink epoch=1 world=3 excluded=[2]"); n != 3 {
				t.Errorf("%d survivors reported the shrink, want 3:\n%s", n, g.Output())
			}
			dones := doneLine.FindAllStringSubmatch(out, -1)
			if len(dones) != 3 {
				t.Fatalf("%d done lines, want 3:\n%s", len(dones), g.Output())
			}
			for _, m := range dones {
				if m[2] != "3" || m[3] != strconv.Itoa(tc.steps) || m[4] != dones[0][4] {
					t.Errorf("%s: want world=3 steps=%d and the same loss as %s", m[0], tc.steps, dones[0][0])
				}
			}
		})
	}
}
