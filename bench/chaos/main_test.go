package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain checks that a run leaves no goroutine behind: every job's output
// scanner and process waiter ends with it.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestSelectRows(t *testing.T) {
	tests := []struct {
		in      string
		want    []string
		wantErr bool
	}{
		{"", []string{rows[0].Name, rows[1].Name, rows[2].Name, rows[3].Name, rows[4].Name, rows[5].Name, rows[6].Name, rows[7].Name}, false},
		{"4,2,2", []string{rows[1].Name, rows[3].Name}, false},
		{"7,1", []string{"gorun, no faults", "torchrun 2.14 restart"}, false},
		{"0", nil, true},
		{"9", nil, true},
		{"8", []string{"gorun heal, a respawn standby"}, false},
		{"x", nil, true},
	}
	for _, tt := range tests {
		got, err := selectRows(tt.in)
		var names []string
		for _, r := range got {
			names = append(names, r.Name)
		}
		if (err != nil) != tt.wantErr || !slices.Equal(names, tt.want) {
			t.Errorf("selectRows(%q) = %v, %v; want %v, error %t", tt.in, names, err, tt.want, tt.wantErr)
		}
	}
}

// TestAgentArgv: each row's agent gets its failure mode, and every row the
// same worker with progress lines and a checkpoint.
func TestAgentArgv(t *testing.T) {
	j := Job{Gorun: "/g", Worker: "/w", Python: "/py", Nproc: 4, Steps: 10, StepMs: 5, WorkerTimeout: "15s", HeartbeatTimeout: "2", DoneTimeout: "10", RespawnBackoff: "0.1"}
	worker := "/w --steps 10 --step-ms 5 --progress --checkpoint /d/checkpoint --timeout 15s"
	tests := []struct {
		row  Row
		want []string // substrings of the command line
	}{
		{rows[1], []string{"/g --standalone --nproc-per-node 4", "--health-addr 127.0.0.1:9", "--heartbeat-timeout 2", "--done-timeout 10", "--on-failure restart", worker}},
		{rows[2], []string{"--on-failure shrink --regrow off", worker}},
		{rows[3], []string{"--on-failure shrink --regrow on --max-respawns 100000 --respawn-backoff 0.1", worker}},
		{rows[4], []string{"/py -m torch.distributed.run --redirects 1 --tee 1 --standalone --nproc_per_node 4 --max_restarts 100000", worker}},
		{rows[7], []string{"--on-failure shrink --regrow on --max-respawns 100000 --respawn-backoff 0.1 --respawn-standbys 1", worker}},
	}
	for _, tt := range tests {
		got := strings.Join(j.agentArgv(tt.row, "/d", "127.0.0.1:9", 0, false), " ")
		for _, w := range tt.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", tt.row.Name, got, w)
			}
		}
	}

	// On several hosts: the rendezvous, the host's address, and a spare
	// row's standby agents pre-start their workers.
	j.Hosts, j.HostIPs, j.RunID, j.EtcdEndpoint = 2, []string{"10.0.0.2", "10.0.0.3", "10.0.0.4"}, "id", "10.0.0.1:2379"
	hostTests := []struct {
		name    string
		backend string
		conf    string // the run's --rdzv-conf
		host    int
		standby bool
		want    []string
		not     string
	}{
		{"c10d", backendC10d, "join_timeout=9", 1, false, []string{"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.2:29400 --rdzv-id id --rdzv-conf join_timeout=9 --local-addr 10.0.0.3", "--health-addr 10.0.0.3:29401"}, "--spare-prestart"},
		{"etcd", backendEtcd, "join_timeout=9", 0, false, []string{"--rdzv-backend etcd --rdzv-endpoint 10.0.0.1:2379 --rdzv-id id --rdzv-conf join_timeout=9,lease_ttl=1 --local-addr 10.0.0.2"}, "--spare-prestart"},
		{"etcd, no conf of the run's", backendEtcd, "", 1, false, []string{"--rdzv-conf lease_ttl=1 --local-addr 10.0.0.3"}, ","},
		{"spare", backendC10d, "join_timeout=9", 2, true, []string{"--local-addr 10.0.0.4 --spare-prestart"}, "--standalone"},
	}
	for _, tt := range hostTests {
		j.Backend, j.RdzvConf = tt.backend, tt.conf
		got := strings.Join(j.agentArgv(rows[5], "/d", net.JoinHostPort(j.HostIPs[tt.host], "29401"), tt.host, tt.standby), " ")
		for _, w := range tt.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", tt.name, got, w)
			}
		}
		if strings.Contains(got, tt.not) {
			t.Errorf("%s: %q has %q", tt.name, got, tt.not)
		}
	}
}

// TestSeededSchedule is the CI soak: a seeded schedule of rank faults
// (SIGKILL, exit 1, SIGSTOP, two ranks at once, a kill during a grow) with
// a 4-s MTBF against the gorun rows — real agents, real workers — and
// every invariant checked: each job completes with the exact sum, no step
// lost, no process left, the agent's fds, goroutines, RSS and store keys
// back near their start. The schedule covers a minute; each row runs its
// prefix until its 250 steps are done. Bounded at 3 minutes; about 80 s on
// a 2-core box.
func TestSeededSchedule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gorun and runs real jobs through a minute of faults")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := &config{
		// --shutdown-timeout 2: a restart that stops a hung rank waits
		// that long, not 30 s, for it to take SIGTERM (it cannot).
		job: Job{Gorun: testutil.BuildGorun(t), Python: "/usr/bin/python3", Hosts: 1, Nproc: 4, Steps: 250, StepMs: 40, WorkerTimeout: "15s",
			HeartbeatTimeout: "2", RespawnBackoff: "0.1", ShutdownTimeout: "2"},
		// Its first five faults, within 9 s, are one of each kind: every
		// row, however fast, meets them all (those a row can take).
		sched:   ScheduleConfig{Seed: 591, MTBF: 4 * time.Second},
		kinds:   "rank-kill,rank-exit,rank-hang,two-ranks,grow-kill",
		horizon: time.Minute,
		// The fault-free row measures the step rate: a short run does.
		baselineSteps: 100,
		rows:          "1,2,3,4",
		rowTimeout:    time.Minute,
		root:          "../..",
	}
	results, _ := runRows(ctx, t, c, 4)
	kinds := map[Kind]int{}
	for _, r := range results {
		for _, v := range r.Violations {
			t.Errorf("%s: %s", r.Row.Name, v)
		}
		if !r.Exact {
			t.Errorf("%s: the result is not exact", r.Row.Name)
		}
		for _, a := range r.Faults {
			if a.Skipped == "" {
				kinds[a.Kind]++
			}
		}
		if !r.Row.FaultFree && r.Brought() < 2 {
			t.Errorf("%s: %d faults brought, want at least 2: %v", r.Row.Name, r.Brought(), r.Faults)
		}
	}
	for _, k := range []Kind{RankKill, RankExit, RankHang, TwoRanks, GrowKill} {
		if kinds[k] == 0 {
			t.Errorf("no %s fault was brought in any row: %v", k, kinds)
		}
	}
}

// TestTwoHostFaults runs host faults on two network-namespace hosts (root,
// iproute2), the fault-free row and one other, each case with a schedule
// that brings the faults it names.
//
// "link cut and healed": host 1's link cut for 6 s at 8 s, then healed,
// under gorun heal. The cut-off host is excluded; once its link is back
// its agent must neither take the others for lost (its own isolation:
// shrink.Report.Holds) nor leave its ranks out: its workers, excluded,
// are respawned and grown back in, and the job ends at full size in its
// first round (epochs 0, 1 and 2 of attempt 0), the result exact, every
// agent exiting 0. Before the fencing, the healed agent filed the other
// host as lost and the job fell back to a restart; before the liveness
// reconnect (health.NodeConfig.ReconnectInterval), the cut-off host held
// the other dead to the end and one run in five its agent failed at the
// exit; before a node-loss report that cannot reach the store was let go,
// the cut-off host restarted and never came back. About 40 s.
//
// "spare lost": the hot spare's agent SIGKILLed three times while it
// stands by (its pre-started workers with it), a new spare started each
// time: the job must not notice (one epoch, exact) and nothing of the lost
// spares may be left. About 35 s.
//
// "coordinator lost" (etcd): host 0's agent, the job's first and the
// survivors' coordinator, SIGKILLed at 8 s and replaced 1 s later: host 1
// takes the agreement over and shrinks, the replacement is grown in, the
// job ends at full size, exact (host 1 the witness). The first run found
// a replacement agent admitted more than the agreement timeout after the
// loss giving shrink mode up at once: it replayed the loss's reports
// before the epoch that settled them, past their deadline
// (TestCoordinatorLateReplay). About 40 s.
func TestTwoHostFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gorun and runs real jobs on a network-namespace bed")
	}
	for _, tt := range []struct {
		name    string
		sched   ScheduleConfig
		kinds   string
		cutFor  time.Duration
		horizon time.Duration
		row     string
		faults  int // brought
		epochs  int // distinct (attempt, epoch) pairs the workers ran
		backend string
	}{
		// Seed 7 draws one fault within 12 s: at 8.0 s, host 1.
		{"link cut and healed", ScheduleConfig{Seed: 7, MTBF: 8 * time.Second, MinGap: 6 * time.Second},
			"link-cut", 6 * time.Second, 12 * time.Second, "4", 1, 3, backendC10d},
		// Seed 11 draws three faults within 20 s.
		{"spare lost", ScheduleConfig{Seed: 11, MTBF: 6 * time.Second, MinGap: 4 * time.Second},
			"spare-kill", 0, 20 * time.Second, "6", 3, 1, backendC10d},
		// Seed 7 again: the coordinator's host at 8.0 s (etcd: with c10d
		// it holds the store). Host 1 leads on, its ranks shrink to
		// world 2, and the replacement agent on host 0 is grown in.
		{"coordinator lost", ScheduleConfig{Seed: 7, MTBF: 8 * time.Second, MinGap: 6 * time.Second},
			"coordinator-lost", 0, 12 * time.Second, "4", 1, 3, backendEtcd},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			j := twoHostJob(t)
			j.Backend = tt.backend
			c := &config{
				job: j, sched: tt.sched, kinds: tt.kinds, cutFor: tt.cutFor, replace: time.Second, etcd: "etcd",
				horizon: tt.horizon, baselineSteps: 100, rows: "1," + tt.row, rowTimeout: 2 * time.Minute, root: "../..",
			}
			results, progress := runRows(ctx, t, c, 2)
			r := results[1]
			for _, v := range r.Violations {
				t.Errorf("%s: %s", r.Row.Name, v)
			}
			if r.Brought() != tt.faults || !r.Exact || r.Epochs != tt.epochs || r.Left != 0 {
				t.Errorf("%s: %d faults brought, exact %v, %d epochs, %d processes left; want %d, exact, %d, none: %v\n%s",
					r.Row.Name, r.Brought(), r.Exact, r.Epochs, r.Left, tt.faults, tt.epochs, r.Faults, progress)
			}
		})
	}
}

// runRows runs c's rows, logs the table and checks that want rows ran; it
// returns their results and the progress output.
func runRows(ctx context.Context, t *testing.T, c *config, want int) ([]RowResult, string) {
	t.Helper()
	if c.logs == "" {
		c.logs = t.TempDir()
		t.Cleanup(func() { logConsolesOnFailure(t, c.logs) })
	}
	var table, progress strings.Builder
	results, err := run(ctx, c, &table, &progress)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, progress.String())
	}
	t.Logf("\n%s", table.String())
	if len(results) != want {
		t.Fatalf("%d rows ran, want %d\n%s", len(results), want, progress.String())
	}
	return results, progress.String()
}

// logConsolesOnFailure logs the end of every row's console kept in dir
// when t failed: a fault that went wrong under CI's load is then explained
// by the agents' own lines.
func logConsolesOnFailure(t *testing.T, dir string) {
	if !t.Failed() {
		return
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Logf("%s: %v", f, err)
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		const keep = 400
		if len(lines) > keep {
			lines = append([]string{fmt.Sprintf("… %d lines left out", len(lines)-keep)}, lines[len(lines)-keep:]...)
		}
		t.Logf("console %s:\n%s", filepath.Base(f), strings.Join(lines, "\n"))
	}
}

// twoHostJob is the job of the two-host tests: 2 network-namespace hosts
// × 2 Go allreduce ranks, c10d, 600 steps 40 ms apart.
func twoHostJob(t *testing.T) Job {
	return Job{Gorun: testutil.BuildGorun(t), Python: "/usr/bin/python3", Hosts: 2, Nproc: 2, Backend: backendC10d,
		Steps: 600, StepMs: 40, WorkerTimeout: "15s", HeartbeatTimeout: "2", RespawnBackoff: "0.1", ShutdownTimeout: "2"}
}
