package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestParseStamp(t *testing.T) {
	tests := []struct {
		line string
		want stamp
		ok   bool
	}{
		{"[default3]:first-collective attempt=1 epoch=0 unix_ns=1700000000123456789",
			stamp{agent: 2, prefix: "[default3]:", attempt: 1, ns: 1700000000123456789}, true},
		{"first-collective attempt=0 epoch=2 unix_ns=5", stamp{agent: 2, epoch: 2, ns: 5}, true},
		{"[default0]:first-collective attempt=0 epoch=1 unix_ns=42 \r", stamp{agent: 2, prefix: "[default0]:", epoch: 1, ns: 42}, true},
		{"[default0]:shrink epoch=1 world=7 excluded=[3]", stamp{}, false},
		{"first-collective attempt=0 epoch=1 unix_ns=", stamp{}, false},
		{"first-collective attempt=0 epoch=1 unix_ns=99999999999999999999", stamp{}, false}, // overflows int64
	}
	for _, tt := range tests {
		got, ok := parseStamp(2, tt.line)
		if ok != tt.ok || ok && got != tt.want {
			t.Errorf("parseStamp(%q) = %+v, %v; want %+v, %v", tt.line, got, ok, tt.want, tt.ok)
		}
	}
}

func TestTally(t *testing.T) {
	tl := newTally(0, 1)
	for _, s := range []stamp{
		{agent: 0, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 3_000_000},
		{agent: 0, prefix: "[default2]:", attempt: 0, epoch: 1, ns: 1_500_000},
		{agent: 0, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 9_000_000}, // repeated: first kept
		{agent: 1, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 2_000_000}, // another agent's local rank 1
		{agent: 0, prefix: "[default4]:", attempt: 0, epoch: 0, ns: 1},         // another epoch
		{agent: 0, prefix: "[default5]:", attempt: 1, epoch: 1, ns: 1},         // another attempt
	} {
		tl.add(s)
	}
	if got, want := tl.since(1_000_000), []float64{0.5, 1, 2}; !slices.Equal(got, want) {
		t.Errorf("since = %v, want %v", got, want)
	}
}

func TestQuantile(t *testing.T) {
	ten := []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}
	tests := []struct {
		v    []float64
		q    float64
		want float64
	}{
		{ten, 0.9, 9},
		{ten, 0.5, 5},
		{ten, 1, 10},
		{[]float64{7}, 0.9, 7},
		{[]float64{1, 2, 3}, 0.9, 3},
		{nil, 0.9, 0},
	}
	for _, tt := range tests {
		if got := quantile(tt.v, tt.q); got != tt.want {
			t.Errorf("quantile(%v, %g) = %g, want %g", tt.v, tt.q, got, tt.want)
		}
	}
	if !slices.Equal(ten, []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}) {
		t.Error("quantile sorted its argument")
	}
}

func TestSelectRows(t *testing.T) {
	tests := []struct {
		flag    string
		want    []int // row numbers
		wantErr string
	}{
		{"", []int{1, 2, 3, 4, 5}, ""},
		{"5,1", []int{1, 5}, ""},
		{"2, 2", []int{2}, ""},
		{"6", nil, `"6" is not a row number 1..5`},
		{"one", nil, `"one" is not a row number`},
	}
	for _, tt := range tests {
		c := config{rows: tt.flag}
		got, err := c.selectRows()
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("-rows %q: error %v, want %q", tt.flag, err, tt.wantErr)
			}
			continue
		}
		var nums []int
		for _, r := range got {
			nums = append(nums, slices.Index(rows, r)+1)
		}
		if err != nil || !slices.Equal(nums, tt.want) {
			t.Errorf("-rows %q = %v, %v; want %v", tt.flag, nums, err, tt.want)
		}
	}
}

// TestAgentCommands checks the command lines the rows run: the flags each
// launcher spells its own way, the failure mode, and the worker.
func TestAgentCommands(t *testing.T) {
	c := &config{hosts: 1, nproc: 8, stepMs: 5, gorun: "/b/gorun", worker: "/b/allreduce", python: "/usr/bin/python3", root: "/repo"}
	want := []string{
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink --no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure restart --max-restarts 1 --no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps",
		"/usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --standalone --nproc_per_node 8 --max_restarts 1 --log_dir /d/logs /repo/bench/gloo_resume.py --step-ms 5",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure restart --max-restarts 1 /repo/bench/gloo_resume.py --step-ms 5",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink /repo/examples/torch/train_elastic.py --steps 1000000 --step-ms 5 --timestamps",
	}
	for i, r := range rows {
		cmds, err := c.agentCommands(r, "/d")
		if err != nil || len(cmds) != 1 {
			t.Fatalf("row %d: %d commands, %v", i+1, len(cmds), err)
		}
		if got := strings.Join(cmds[0].Args, " "); got != want[i] {
			t.Errorf("row %d:\n got %s\nwant %s", i+1, got, want[i])
		}
		if !slices.Contains(cmds[0].Env, "PYTHON_EXEC=/usr/bin/python3") {
			t.Errorf("row %d: PYTHON_EXEC not set", i+1)
		}
		if sp := cmds[0].SysProcAttr; sp == nil || !sp.Setpgid || sp.Pdeathsig == 0 {
			t.Errorf("row %d: not in a process group of its own that dies with the benchmark: %+v", i+1, sp)
		}
	}

	c.settleWindow = "0.01"
	cmds, err := c.agentCommands(rows[0], "/d")
	if err != nil || !strings.Contains(strings.Join(cmds[0].Args, " "), "--on-failure shrink --settle-window 0.01 ") {
		t.Errorf("-settle-window not passed to a shrink row: %v %v", cmds[0].Args, err)
	}
	cmds, err = c.agentCommands(rows[1], "/d")
	if err != nil || slices.Contains(cmds[0].Args, "--settle-window") {
		t.Errorf("-settle-window passed to a restart row: %v %v", cmds[0].Args, err)
	}

	c.hosts = 2
	if _, err := c.agentCommands(rows[0], "/d"); err == nil {
		t.Error("-hosts 2 accepted")
	}
}

// TestMain checks that a run leaves no goroutine behind: every job's output
// readers and process waiters end with it.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestRunGoRows runs the benchmark end to end on the Go rows, one trial of
// four ranks: real gorun, real workers, a real SIGKILL. Each row must
// recover, with the survivors' times after the kill, and the table must
// show both rows.
func TestRunGoRows(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gorun and runs real jobs")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	c := &config{trials: 1, hosts: 1, nproc: 4, victim: 2, warmup: 100 * time.Millisecond, stepMs: 5,
		trialTimeout: time.Minute, rows: "1,2", python: "/usr/bin/python3", root: "../..",
		out: filepath.Join(dir, "ft.jsonl")}
	var table strings.Builder
	if err := run(ctx, c, &table); err != nil {
		t.Fatalf("run: %v\n%s", err, table.String())
	}
	raw, err := os.ReadFile(c.out)
	if err != nil {
		t.Fatal(err)
	}
	var got []result
	for line := range strings.Lines(string(raw)) {
		var r result
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		got = append(got, r)
	}
	if len(got) != 2 {
		t.Fatalf("%d results, want 2\n%s", len(got), raw)
	}
	for _, r := range got {
		wantSurvivors := 4 // restart: every rank starts again
		if strings.Contains(r.Row, "shrink") {
			wantSurvivors = 3
		}
		switch {
		case r.Error != "":
			t.Errorf("%s: %s", r.Row, r.Error)
		case len(r.SurvivorsMs) != wantSurvivors || r.FirstMs <= 0 || r.LastMs < r.FirstMs || r.KillUnixNs == 0:
			t.Errorf("%s: %+v, want %d survivors' times after the kill", r.Row, r, wantSurvivors)
		case r.LeftBehind != 0:
			t.Errorf("%s: gorun left %d processes behind", r.Row, r.LeftBehind)
		}
	}
	for _, want := range []string{"| 1 | gorun shrink, Go allreduce (pg/cpu) | 1/1 |", "| 2 | gorun restart, Go allreduce (pg/cpu) | 1/1 |"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, table.String())
		}
	}
}
