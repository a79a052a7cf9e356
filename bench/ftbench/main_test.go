package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/bench/internal/hostbed"
	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/netns"
)

func TestParseStamp(t *testing.T) {
	tests := []struct {
		line string
		want stamp
		ok   bool
	}{
		{"[default3]:first-collective attempt=1 epoch=0 unix_ns=1700000000123456789",
			stamp{agent: 2, prefix: "[default3]:", kind: stampFirst, attempt: 1, ns: 1700000000123456789}, true},
		{"first-collective attempt=0 epoch=2 unix_ns=5", stamp{agent: 2, kind: stampFirst, epoch: 2, ns: 5}, true},
		{"[default0]:first-collective attempt=0 epoch=1 unix_ns=42 \r", stamp{agent: 2, prefix: "[default0]:", kind: stampFirst, epoch: 1, ns: 42}, true},
		{"[default2]:started attempt=0 unix_ns=7", stamp{agent: 2, prefix: "[default2]:", kind: stampStarted, ns: 7}, true},
		{"[default1]:stopped attempt=0 epoch=1 unix_ns=8", stamp{agent: 2, prefix: "[default1]:", kind: stampStopped, epoch: 1, ns: 8}, true},
		{"[default3]:ready attempt=0 unix_ns=9", stamp{agent: 2, prefix: "[default3]:", kind: stampReady, ns: 9}, true},
		{"[default1]:parked unix_ns=6", stamp{agent: 2, prefix: "[default1]:", kind: stampParked, ns: 6}, true},
		{"parked attempt=0 unix_ns=6", stamp{}, false},           // a parked worker has no attempt yet
		{"started unix_ns=6", stamp{}, false},                    // every other stamp has one
		{"ready attempt=0 epoch=2 unix_ns=9", stamp{}, false},    // readiness has no epoch
		{"started attempt=0 epoch=1 unix_ns=7", stamp{}, false},  // a start has no epoch
		{"stopped attempt=0 unix_ns=8", stamp{}, false},          // a stop has one
		{"first-collective attempt=0 unix_ns=8", stamp{}, false}, // so has a first collective
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
		{kind: stampFirst, agent: 0, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 3_000_000},
		{kind: stampFirst, agent: 0, prefix: "[default2]:", attempt: 0, epoch: 1, ns: 1_500_000},
		{kind: stampFirst, agent: 0, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 9_000_000}, // repeated: first kept
		{kind: stampFirst, agent: 1, prefix: "[default1]:", attempt: 0, epoch: 1, ns: 2_000_000}, // another agent's local rank 1
		{kind: stampFirst, agent: 0, prefix: "[default4]:", attempt: 0, epoch: 0, ns: 1},         // another epoch
		{kind: stampFirst, agent: 0, prefix: "[default5]:", attempt: 1, epoch: 1, ns: 1},         // another attempt
	} {
		tl.add(s)
	}
	if got, want := tl.since(1_000_000), []float64{0.5, 1, 2}; !slices.Equal(got, want) {
		t.Errorf("since = %v, want %v", got, want)
	}

	// The cut-off host's agent's ranks do not count.
	cut := newTally(1, 0)
	cut.skip = 1
	cut.add(stamp{kind: stampFirst, agent: 1, prefix: "[default0]:", attempt: 1, ns: 5})
	cut.add(stamp{kind: stampFirst, agent: 0, prefix: "[default0]:", attempt: 1, ns: 7})
	if got := cut.since(0); !slices.Equal(got, []float64{7e-6}) {
		t.Errorf("a tally that skips agent 1 holds %v", got)
	}
}

func TestSelectRows(t *testing.T) {
	tests := []struct {
		flag    string
		want    []int // row numbers
		wantErr string
	}{
		{"", []int{1, 2, 3, 4, 5, 6, 7}, ""},
		{"5,1", []int{1, 5}, ""},
		{"2, 2", []int{2}, ""},
		{"8", nil, `"8" is not a row number 1..7`},
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

func TestRecovery(t *testing.T) {
	tests := []struct {
		row                   int // 1-based
		fault                 string
		hosts, nproc          int
		attempt, epoch, ranks int
	}{
		{1, faultKill, 1, 8, 0, 1, 7},      // shrink: the survivors, epoch 1
		{2, faultKill, 1, 8, 1, 0, 8},      // restart: every rank, attempt 1
		{3, faultKill, 2, 4, 1, 0, 8},      // torchrun restarts every rank of both hosts
		{5, faultKill, 2, 4, 0, 1, 7},      // PyTorch shrink
		{1, faultBlackhole, 2, 4, 0, 1, 4}, // shrink: the other host's ranks
		{2, faultBlackhole, 2, 4, 1, 0, 4}, // restart: the other host's ranks, in a smaller group
		{2, faultBlackhole, 3, 4, 1, 0, 8},
		{1, faultBlackhole, 3, 2, 0, 1, 4},
		{1, faultNode, 2, 4, 0, 1, 4}, // a lost node: like a cut host
		{2, faultNode, 2, 4, 1, 0, 4},
		{6, faultNode, 2, 4, 0, 2, 8}, // heal: a spare takes its place
		{6, faultKill, 1, 8, 0, 2, 8}, // heal: every rank, at full size in epoch 2
		{6, faultKill, 2, 4, 0, 2, 8},
		{7, faultKill, 1, 8, 0, 2, 8},
	}
	for _, tt := range tests {
		a, e, n := rows[tt.row-1].recovery(tt.fault, tt.hosts, tt.nproc)
		if a != tt.attempt || e != tt.epoch || n != tt.ranks {
			t.Errorf("row %d, %s, %d×%d: attempt %d epoch %d ranks %d; want %d %d %d",
				tt.row, tt.fault, tt.hosts, tt.nproc, a, e, n, tt.attempt, tt.epoch, tt.ranks)
		}
	}
}

// TestHealMeasures: a heal trial's stamps give the shrink (the last
// survivor at epoch 1), the newcomer's start (the first start after the
// kill), its start → full size, and the longest stall of a survivor for the
// grow (its first collective of epoch 2 after epoch 2 stopped its steps).
func TestHealMeasures(t *testing.T) {
	const ms = int64(time.Millisecond)
	kill := int64(1_000) * ms
	st := func(kind, prefix string, epoch int, at int64) stamp {
		return stamp{kind: kind, prefix: prefix, epoch: epoch, ns: kill + at*ms}
	}
	seen := []stamp{
		st(stampStarted, "[default0]:", 0, -900), // the launch, before the kill
		st(stampStarted, "[default1]:", 0, -900),
		st(stampStopped, "[default0]:", 0, 20),
		st(stampFirst, "[default0]:", 1, 110),
		st(stampFirst, "[default2]:", 1, 130),
		st(stampStarted, "[default1]:", 0, 240), // the newcomer
		st(stampReady, "[default1]:", 0, 250),
		st(stampStopped, "[default0]:", 1, 350),
		st(stampStopped, "[default2]:", 1, 352),
		st(stampFirst, "[default2]:", 2, 360),
		st(stampFirst, "[default0]:", 2, 361),
		st(stampFirst, "[default1]:", 2, 362),
	}
	res := result{KillUnixNs: kill, LastMs: 362}
	if err := res.heal(seen, -1); err != nil {
		t.Fatal(err)
	}
	if res.ShrinkMs != 130 || res.NewcomerMs != 240 || res.FromNewcomerMs != 122 || res.GrowStallMs != 11 ||
		res.ReadyMs != 250 || res.FromReadyMs != 112 {
		t.Errorf("heal measures: shrink %v newcomer %v from newcomer %v stall %v ready %v from ready %v; want 130 240 122 11 250 112",
			res.ShrinkMs, res.NewcomerMs, res.FromNewcomerMs, res.GrowStallMs, res.ReadyMs, res.FromReadyMs)
	}
	if err := (&result{KillUnixNs: kill}).heal(seen[:5], -1); err == nil {
		t.Error("no error without the newcomer's start")
	}
	// Epoch 1 never formed (the grow came first): no shrink, no stall.
	var skipped []stamp
	for _, s := range seen {
		if s.epoch != 1 {
			skipped = append(skipped, s)
		}
	}
	res = result{KillUnixNs: kill, LastMs: 362}
	if err := res.heal(skipped, -1); err != nil || res.ShrinkMs != 0 || res.GrowStallMs != 0 || res.FromReadyMs != 112 {
		t.Errorf("without epoch 1: %v, shrink %v stall %v from ready %v; want nil, 0, 0, 112", err, res.ShrinkMs, res.GrowStallMs, res.FromReadyMs)
	}

	// A pre-started spare (agent 2): its workers started before the cut,
	// and that start counts, though it precedes the fault.
	spare := slices.Clone(seen)
	spare[5] = stamp{agent: 2, kind: stampStarted, prefix: "[default1]:", ns: kill - 5000*ms}
	res = result{KillUnixNs: kill, LastMs: 362}
	if err := res.heal(spare, 2); err != nil {
		t.Fatal(err)
	}
	if res.NewcomerMs != -5000 || res.ReadyMs != 250 || res.FromReadyMs != 112 {
		t.Errorf("pre-started spare: newcomer %v ready %v from ready %v; want -5000 250 112", res.NewcomerMs, res.ReadyMs, res.FromReadyMs)
	}
	if err := (&result{KillUnixNs: kill}).heal(spare, -1); err == nil {
		t.Error("a start before the fault counted without a spare")
	}
}

func TestValidate(t *testing.T) {
	ok := config{trials: 1, hosts: 1, nproc: 8, victim: 3, fault: faultKill, backend: backendC10d}
	tests := []struct {
		name    string
		edit    func(*config)
		wantErr string // "" for valid
	}{
		{"defaults", func(*config) {}, ""},
		{"no trials", func(c *config) { c.trials = 0 }, "-trials must be at least 1"},
		{"one rank", func(c *config) { c.nproc = 1 }, "-nproc at least 2"},
		{"no hosts", func(c *config) { c.hosts = 0 }, "-hosts 0: want 1 to"},
		{"victim out of range", func(c *config) { c.victim = 8 }, "-victim 8 is not a rank of 8"},
		{"victim of the second host", func(c *config) { c.hosts, c.victim = 2, 15 }, ""},
		{"unknown fault", func(c *config) { c.fault = "freeze" }, `-fault "freeze": want kill, blackhole or node`},
		{"unknown backend", func(c *config) { c.hosts, c.backend = 2, "static" }, `-backend "static": want c10d or etcd`},
		{"blackhole on one host", func(c *config) { c.fault = faultBlackhole }, "it needs -hosts 2 or more"},
		{"etcd on one host", func(c *config) { c.backend = backendEtcd }, "-backend etcd needs -hosts 2 or more"},
		{"blackhole of the c10d store's host", func(c *config) { c.hosts, c.fault = 2, faultBlackhole },
			"rank 3 runs on host 0, which holds the c10d rendezvous store"},
		{"blackhole of another host, c10d", func(c *config) { c.hosts, c.fault, c.victim = 2, faultBlackhole, 8 }, ""},
		{"blackhole of host 0, etcd", func(c *config) { c.hosts, c.fault, c.backend = 2, faultBlackhole, backendEtcd }, ""},
		{"node lost on one host", func(c *config) { c.fault = faultNode }, "it needs -hosts 2 or more"},
		{"node lost: the c10d store's host", func(c *config) { c.hosts, c.fault = 2, faultNode }, "runs on host 0"},
		{"node lost: another host", func(c *config) { c.hosts, c.fault, c.victim = 2, faultNode, 8 }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ok
			tt.edit(&c)
			err := c.validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("error %v, want none", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("error %v, want %q", err, tt.wantErr)
			}
		})
	}
}

// TestAgentCommands checks the command lines the rows run on one host: the
// flags each launcher spells its own way, the failure mode, and the worker.
func TestAgentCommands(t *testing.T) {
	c := &config{hosts: 1, nproc: 8, stepMs: 5, fault: faultKill, backend: backendC10d, respawnBackoff: "0.1",
		gorun: "/b/gorun", worker: "/b/allreduce", python: "/usr/bin/python3", root: "/repo"}
	want := []string{
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink --regrow off --no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure restart --max-restarts 1 --no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps",
		"/usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --standalone --nproc_per_node 8 --max_restarts 1 --log_dir /d/logs /repo/bench/gloo_resume.py --step-ms 5",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure restart --max-restarts 1 /repo/bench/gloo_resume.py --step-ms 5",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink --regrow off /repo/examples/torch/train_elastic.py --steps 1000000 --step-ms 5 --timestamps",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink --regrow on --respawn-backoff 0.1 --no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps",
		"/b/gorun --standalone --nproc-per-node 8 --log-dir /d/logs --on-failure shrink --regrow on --respawn-backoff 0.1 /repo/examples/torch/train_elastic.py --steps 1000000 --step-ms 5 --timestamps",
	}
	for i, r := range rows {
		specs, err := c.agents(r, "/d", "run")
		if err != nil || len(specs) != 1 {
			t.Fatalf("row %d: %d agents, %v", i+1, len(specs), err)
		}
		if got := strings.Join(specs[0].argv, " "); got != want[i] {
			t.Errorf("row %d:\n got %s\nwant %s", i+1, got, want[i])
		}
		if specs[0].host != -1 || !slices.Equal(specs[0].env, []string{"PYTHON_EXEC=/usr/bin/python3"}) {
			t.Errorf("row %d: host %d, env %q; want the root namespace, PYTHON_EXEC only", i+1, specs[0].host, specs[0].env)
		}
		cmd := c.command(specs[0])
		if !slices.Equal(cmd.Args, specs[0].argv) || !slices.Contains(cmd.Env, "PYTHON_EXEC=/usr/bin/python3") {
			t.Errorf("row %d: command %q, env set: %v", i+1, cmd.Args, slices.Contains(cmd.Env, "PYTHON_EXEC=/usr/bin/python3"))
		}
		if sp := cmd.SysProcAttr; sp == nil || !sp.Setpgid || sp.Pdeathsig == 0 {
			t.Errorf("row %d: not in a process group of its own that dies with the benchmark: %+v", i+1, sp)
		}
	}

	c.settleWindow = "0.01"
	specs, err := c.agents(rows[0], "/d", "run")
	if err != nil || !strings.Contains(strings.Join(specs[0].argv, " "), "--on-failure shrink --regrow off --settle-window 0.01 ") {
		t.Errorf("-settle-window not passed to a shrink row: %v %v", specs, err)
	}
	specs, err = c.agents(rows[1], "/d", "run")
	if err != nil || slices.Contains(specs[0].argv, "--settle-window") {
		t.Errorf("-settle-window passed to a restart row: %v %v", specs, err)
	}
}

// TestAgentCommandsHosts checks the multi-host command lines: one agent per
// host with its address, the rendezvous of -backend, --nnodes by failure
// mode and fault, per-host log directories, gloo's interface for PyTorch
// workers, and torchrun given its host's name.
func TestAgentCommandsHosts(t *testing.T) {
	base := config{hosts: 2, nproc: 4, stepMs: 5, fault: faultKill, backend: backendC10d,
		rdzvConf: "join_timeout=30,last_call_timeout=1", c10dConf: "keep_alive_interval=0.5", etcdConf: "lease_ttl=1",
		gorun: "/b/gorun", worker: "/b/allreduce", python: "/py", root: "/repo",
		hostIPs: []string{"198.18.0.2", "198.18.0.3"}, hostNames: []string{"gorun-b0-h0", "gorun-b0-h1"},
		hostsFile: "/t/hosts", etcdEndpoint: "198.18.0.1:2379"}
	const (
		c10d   = "--rdzv-backend c10d --rdzv-endpoint 198.18.0.2:29400 --rdzv-id run --rdzv-conf join_timeout=30,last_call_timeout=1,keep_alive_interval=0.5"
		etcd   = "--rdzv-backend etcd --rdzv-endpoint 198.18.0.1:2379 --rdzv-id run --rdzv-conf join_timeout=30,last_call_timeout=1,lease_ttl=1"
		goWork = "--no-python /b/allreduce --steps 1000000 --step-ms 5 --timestamps"
	)
	tests := []struct {
		name    string
		row     int
		edit    func(*config)
		want    [2]string // argv of host 0's agent, host 1's
		gloo    bool      // GLOO_SOCKET_IFNAME=eth0 set
		wantErr string
	}{
		{"shrink, c10d, kill", 1, func(*config) {}, [2]string{
			"/b/gorun --nnodes 2 " + c10d + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure shrink --regrow off " + goWork,
			"/b/gorun --nnodes 2 " + c10d + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure shrink --regrow off " + goWork,
		}, false, ""},
		{"restart, c10d, kill: every host", 2, func(*config) {}, [2]string{
			"/b/gorun --nnodes 2 " + c10d + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure restart --max-restarts 1 " + goWork,
			"/b/gorun --nnodes 2 " + c10d + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure restart --max-restarts 1 " + goWork,
		}, false, ""},
		{"restart, etcd, blackhole: the survivors may carry on", 2, func(c *config) { c.backend, c.fault = backendEtcd, faultBlackhole }, [2]string{
			"/b/gorun --nnodes 1:2 " + etcd + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure restart --max-restarts 1 " + goWork,
			"/b/gorun --nnodes 1:2 " + etcd + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure restart --max-restarts 1 " + goWork,
		}, false, ""},
		{"restart, etcd, blackhole, gorun's liveness slowed: -gorun-flags", 2, func(c *config) {
			c.backend, c.fault, c.gorunFlags = backendEtcd, faultBlackhole, "--node-suspicion-mult  200"
		}, [2]string{
			"/b/gorun --nnodes 1:2 " + etcd + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure restart --max-restarts 1 --node-suspicion-mult 200 " + goWork,
			"/b/gorun --nnodes 1:2 " + etcd + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure restart --max-restarts 1 --node-suspicion-mult 200 " + goWork,
		}, false, ""},
		{"shrink, etcd, blackhole: no re-rendezvous", 1, func(c *config) { c.backend, c.fault = backendEtcd, faultBlackhole }, [2]string{
			"/b/gorun --nnodes 2 " + etcd + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure shrink --regrow off " + goWork,
			"/b/gorun --nnodes 2 " + etcd + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure shrink --regrow off " + goWork,
		}, false, ""},
		{"torchrun, c10d: as its host", 3, func(*config) {}, [2]string{
			"unshare --uts sh -c " + hostbed.AsHostScript + " sh /t/hosts gorun-b0-h0 /py -m torch.distributed.run --redirects 1 --tee 1 --nnodes 2 --rdzv_backend c10d --rdzv_endpoint 198.18.0.2:29400 --rdzv_id run --rdzv_conf join_timeout=30,last_call_timeout=1 --nproc_per_node 4 --max_restarts 1 --log_dir /d/logs/h0 /repo/bench/gloo_resume.py --step-ms 5",
			"unshare --uts sh -c " + hostbed.AsHostScript + " sh /t/hosts gorun-b0-h1 /py -m torch.distributed.run --redirects 1 --tee 1 --nnodes 2 --rdzv_backend c10d --rdzv_endpoint 198.18.0.2:29400 --rdzv_id run --rdzv_conf join_timeout=30,last_call_timeout=1 --nproc_per_node 4 --max_restarts 1 --log_dir /d/logs/h1 /repo/bench/gloo_resume.py --step-ms 5",
		}, true, ""},
		{"torchrun, c10d, blackhole", 3, func(c *config) { c.fault = faultBlackhole }, [2]string{
			"unshare --uts sh -c " + hostbed.AsHostScript + " sh /t/hosts gorun-b0-h0 /py -m torch.distributed.run --redirects 1 --tee 1 --nnodes 1:2 --rdzv_backend c10d --rdzv_endpoint 198.18.0.2:29400 --rdzv_id run --rdzv_conf join_timeout=30,last_call_timeout=1 --nproc_per_node 4 --max_restarts 1 --log_dir /d/logs/h0 /repo/bench/gloo_resume.py --step-ms 5",
			"unshare --uts sh -c " + hostbed.AsHostScript + " sh /t/hosts gorun-b0-h1 /py -m torch.distributed.run --redirects 1 --tee 1 --nnodes 1:2 --rdzv_backend c10d --rdzv_endpoint 198.18.0.2:29400 --rdzv_id run --rdzv_conf join_timeout=30,last_call_timeout=1 --nproc_per_node 4 --max_restarts 1 --log_dir /d/logs/h1 /repo/bench/gloo_resume.py --step-ms 5",
		}, true, ""},
		{"torchrun, etcd", 3, func(c *config) { c.backend = backendEtcd }, [2]string{}, false, "python-etcd"},
		{"gorun restart, PyTorch, etcd", 4, func(c *config) { c.backend = backendEtcd }, [2]string{
			"/b/gorun --nnodes 2 " + etcd + " --local-addr 198.18.0.2 --nproc-per-node 4 --log-dir /d/logs/h0 --on-failure restart --max-restarts 1 /repo/bench/gloo_resume.py --step-ms 5",
			"/b/gorun --nnodes 2 " + etcd + " --local-addr 198.18.0.3 --nproc-per-node 4 --log-dir /d/logs/h1 --on-failure restart --max-restarts 1 /repo/bench/gloo_resume.py --step-ms 5",
		}, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := base
			tt.edit(&c)
			specs, err := c.agents(rows[tt.row-1], "/d", "run")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || len(specs) != 2 {
				t.Fatalf("%d agents, %v; want 2", len(specs), err)
			}
			for i, s := range specs {
				if s.host != i {
					t.Errorf("agent %d runs in host %d", i, s.host)
				}
				if got := strings.Join(s.argv, " "); got != tt.want[i] {
					t.Errorf("host %d:\n got %s\nwant %s", i, got, tt.want[i])
				}
				if got := slices.Contains(s.env, "GLOO_SOCKET_IFNAME=eth0"); got != tt.gloo {
					t.Errorf("host %d: GLOO_SOCKET_IFNAME=eth0 set: %v, want %v", i, got, tt.gloo)
				}
			}
		})
	}
}

func TestShellQuote(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"--rdzv-conf", "--rdzv-conf"},
		{"join_timeout=30,last_call_timeout=1", "join_timeout=30,last_call_timeout=1"},
		{"/tmp/a b", "'/tmp/a b'"},
		{`exec "$@"`, `'exec "$@"'`},
		{"it's", `'it'\''s'`},
		{"", "''"},
	} {
		if got := shellQuote(tt.in); got != tt.want {
			t.Errorf("shellQuote(%q) = %s, want %s", tt.in, got, tt.want)
		}
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
	c := &config{trials: 1, hosts: 1, nproc: 4, victim: 2, fault: faultKill, backend: backendC10d, warmup: 100 * time.Millisecond, stepMs: 5,
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

// TestRunHosts runs the multi-host mode end to end, one trial of a row on
// a bed of two hosts × two ranks: real gorun agents in network namespaces,
// a real link cut, and real etcd for the second case. The survivors (the
// other host's ranks) must recover at the right attempt and epoch, the
// cut-off host's processes must not count as left behind, and the bed and
// etcd must be gone afterwards.
func TestRunHosts(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gorun and runs real jobs on a network-namespace bed")
	}
	netns.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Built once for both cases.
	bins := &config{tmp: t.TempDir(), root: "../.."}
	if err := bins.build(ctx); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		backend string
		rows    string
	}{
		{"c10d, shrink", backendC10d, "1"},
		{"etcd, restart", backendEtcd, "2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			etcd := ""
			if tt.backend == backendEtcd {
				etcd = etcdtest.Binary(t)
			}
			dir := t.TempDir()
			c := &config{gorun: bins.gorun, worker: bins.worker, trials: 1, hosts: 2, nproc: 2, victim: 2, fault: faultBlackhole, backend: tt.backend,
				warmup: 100 * time.Millisecond, stepMs: 5, trialTimeout: time.Minute, rows: tt.rows,
				rdzvConf: "join_timeout=30,last_call_timeout=1", c10dConf: "keep_alive_interval=0.5,keep_alive_max_attempt=2",
				etcdConf: "lease_ttl=1", etcd: etcd, python: "/usr/bin/python3", root: "../..", out: filepath.Join(dir, "ft.jsonl")}
			var table strings.Builder
			if err := run(ctx, c, &table); err != nil {
				t.Fatalf("run: %v\n%s", err, table.String())
			}
			raw, err := os.ReadFile(c.out)
			if err != nil {
				t.Fatal(err)
			}
			var r result
			if err := json.Unmarshal(raw, &r); err != nil {
				t.Fatalf("%s: %v", raw, err)
			}
			switch {
			case r.Error != "":
				t.Errorf("%s: %s", r.Row, r.Error)
			case len(r.SurvivorsMs) != 2 || r.FirstMs <= 0 || r.LastMs < r.FirstMs:
				t.Errorf("%+v; want the other host's 2 ranks' times after the cut", r)
			case r.CutHost != c.hostNames[1] || r.Backend != tt.backend || r.World != 4:
				t.Errorf("cut host %q, backend %q, world %d; want %s, %s, 4", r.CutHost, r.Backend, r.World, c.hostNames[1], tt.backend)
			case r.LeftBehind != 0:
				t.Errorf("%d processes left behind", r.LeftBehind)
			}
			if len(r.Commands) != 2 || !strings.Contains(r.Commands[1], "netns exec "+c.hostNames[1]+" ") {
				t.Errorf("commands %q; want host 1's agent in its namespace", r.Commands)
			}
			for _, want := range []string{"2 hosts", "backend " + tt.backend, "fault: blackhole", "| 1/1 |"} {
				if !strings.Contains(table.String(), want) {
					t.Errorf("the table lacks %q:\n%s", want, table.String())
				}
			}
			for _, h := range c.hostNames {
				if _, err := os.Stat(filepath.Join("/run/netns", h)); err == nil {
					t.Errorf("host %s left behind", h)
				}
			}
			for _, pid := range c.spare {
				if syscall.Kill(pid, 0) == nil {
					t.Errorf("etcd (pid %d) left running", pid)
				}
			}
		})
	}
}

// TestAgentCommandsHealSpare: a heal row after a cut-off host runs a spare
// agent on the bed's extra host, with the job's command (so it finds the
// round full and waits for room) and its own address; after a killed rank
// there is no spare (the rank is respawned in place).
func TestAgentCommandsHealSpare(t *testing.T) {
	c := config{hosts: 2, nproc: 4, stepMs: 5, fault: faultBlackhole, backend: backendC10d, respawnBackoff: "0.1",
		rdzvConf: "join_timeout=30", gorun: "/b/gorun", worker: "/b/allreduce", python: "/py", root: "/repo",
		hostIPs: []string{"198.18.0.2", "198.18.0.3", "198.18.0.4"}, hostNames: []string{"h0", "h1", "h2"}}
	heal := rows[5]
	specs, err := c.agents(heal, "/d", "run")
	if err != nil || len(specs) != 3 {
		t.Fatalf("%d agents, %v; want 2 and a spare", len(specs), err)
	}
	for i, sp := range specs {
		argv := strings.Join(sp.argv, " ")
		if sp.host != i || !strings.Contains(argv, "--nnodes 2 ") || !strings.Contains(argv, "--local-addr "+c.hostIPs[i]+" ") ||
			!strings.Contains(argv, "--on-failure shrink --regrow on") {
			t.Errorf("agent %d on host %d: %s", i, sp.host, argv)
		}
	}
	c.fault = faultKill
	if specs, err := c.agents(heal, "/d", "run"); err != nil || len(specs) != 2 {
		t.Errorf("after a kill: %d agents, %v; want 2, no spare", len(specs), err)
	}
}
