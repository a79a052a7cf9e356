package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/launcher"
	"github.com/gorunhq/gorun/rendezvous"
)

// cleanEnv hides every variable the launcher's flags read, so that the
// host's environment cannot leak into a test (t.Setenv restores them).
// Tests that use it cannot run in parallel.
func cleanEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		for _, p := range []string{"PET_", "GORUN_", "TORCH_ELASTIC_", "TORCHELASTIC_", "PYTHON_EXEC", "CUDA_VISIBLE_DEVICES"} {
			if strings.HasPrefix(k, p) {
				t.Setenv(k, "")
				os.Unsetenv(k)
			}
		}
	}
}

type launchResult struct {
	cfg    launcher.Config
	called bool // the root action ran, rather than a command
	code   int
	stderr string
}

// launch runs the CLI on args with the root action replaced by one that
// only builds the Config: the same flags, environment, dispatch and exit
// codes, but nothing is started.
func launch(t *testing.T, args ...string) launchResult {
	t.Helper()
	var res launchResult
	var errb bytes.Buffer
	app := newApp(strings.NewReader(""), io.Discard, &errb)
	app.Action = action(func(c *cli.Context) error {
		res.called = true
		var err error
		res.cfg, err = launchConfig(c)
		return err
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res.code = runApp(ctx, app, append([]string{"gorun"}, args...))
	res.stderr = errb.String()
	return res
}

// mustLaunch is launch for a command line that must give a Config.
func mustLaunch(t *testing.T, args ...string) launcher.Config {
	t.Helper()
	res := launch(t, args...)
	if res.code != ExitOK || !res.called {
		t.Fatalf("gorun %s: code %d, root action ran %v, stderr %q", strings.Join(args, " "), res.code, res.called, res.stderr)
	}
	return res.cfg
}

func TestLaunchDefaults(t *testing.T) {
	cleanEnv(t)
	got := mustLaunch(t, "train.py")
	want := launcher.DefaultConfig()
	want.Entrypoint.Program = "train.py"
	if err := want.Validate(); err != nil { // as launchConfig does
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("gorun train.py gave\n%+v\nwant torchrun's defaults\n%+v", got, want)
	}
	// The spelled-out torchrun defaults give the same Config.
	explicit := mustLaunch(t, "--nnodes", "1:1", "--nproc-per-node", "1", "--rdzv-backend", "static",
		"--rdzv-endpoint", "", "--rdzv-id", "none", "--rdzv-conf", "", "--max-restarts", "0",
		"--monitor-interval", "0.1", "--start-method", "spawn", "--event-log-handler", "null",
		"--role", "default", "-r", "0", "-t", "0", "--local-ranks-filter", "", "--node-rank", "0",
		"--master-addr", "127.0.0.1", "--master-port", "29500",
		"--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout", "30",
		"--exit-barrier-timeout", "300", "train.py")
	if !reflect.DeepEqual(explicit, want) {
		t.Fatalf("explicit defaults gave\n%+v\nwant\n%+v", explicit, want)
	}
}

// TestLaunchFlags: every flag, in every spelling and as --flag VALUE and
// --flag=VALUE, lands in its Config field.
func TestLaunchFlags(t *testing.T) {
	cleanEnv(t)
	c10d := []string{"--rdzv-backend", "c10d"}
	accepted := func(launcher.Config) any { return nil } // accepted, no Config field
	cases := []struct {
		names []string // every spelling
		value string   // "" for a switch
		extra []string // other flags the case needs to be valid
		get   func(launcher.Config) any
		want  any
	}{
		{[]string{"--nnodes"}, "2:4", c10d, func(c launcher.Config) any { return [2]int{c.MinNodes, c.MaxNodes} }, [2]int{2, 4}},
		{[]string{"--nproc-per-node", "--nproc_per_node"}, "3", nil, func(c launcher.Config) any { return c.NProcPerNode }, 3},
		{[]string{"--nproc-per-node", "--nproc_per_node"}, "cpu", nil, func(c launcher.Config) any { return c.NProcPerNode }, runtime.NumCPU()},
		{[]string{"--rdzv-backend", "--rdzv_backend"}, "c10d", nil, func(c launcher.Config) any { return c.Rendezvous.Backend }, "c10d"},
		{[]string{"--rdzv-endpoint", "--rdzv_endpoint"}, "node0:29400", c10d, func(c launcher.Config) any { return c.Rendezvous.Endpoint }, "node0:29400"},
		{[]string{"--rdzv-id", "--rdzv_id"}, "job7", nil, func(c launcher.Config) any { return c.Rendezvous.RunID }, "job7"},
		{[]string{"--rdzv-conf", "--rdzv_conf"}, "join_timeout=900,is_host=1", c10d, func(c launcher.Config) any { return c.Rendezvous.Conf },
			map[string]string{"join_timeout": "900", "is_host": "1"}},
		{[]string{"--standalone"}, "", nil, func(c launcher.Config) any { return c.Rendezvous.Standalone }, true},
		{[]string{"--max-restarts", "--max_restarts"}, "3", nil, func(c launcher.Config) any { return c.MaxRestarts }, 3},
		{[]string{"--monitor-interval", "--monitor_interval"}, "0.5", nil, func(c launcher.Config) any { return c.MonitorInterval }, 500 * time.Millisecond},
		{[]string{"--start-method", "--start_method"}, "fork", nil, func(c launcher.Config) any { return c.StartMethod }, "fork"},
		{[]string{"--event-log-handler", "--event_log_handler"}, "console", nil, accepted, nil},
		{[]string{"--role"}, "trainer", nil, func(c launcher.Config) any { return c.Role }, "trainer"},
		{[]string{"--on-failure"}, "shrink", nil, func(c launcher.Config) any { return c.OnFailure }, "shrink"},
		{[]string{"--regrow"}, "off", nil, func(c launcher.Config) any { return c.Regrow }, false},
		{[]string{"--max-respawns"}, "5", nil, func(c launcher.Config) any { return c.MaxRespawns }, 5},
		{[]string{"--respawn-standbys"}, "2", []string{"--on-failure", "shrink"}, func(c launcher.Config) any { return c.RespawnStandbys }, 2},
		{[]string{"--respawn-backoff"}, "0.25", nil, func(c launcher.Config) any { return c.RespawnBackoff }, 250 * time.Millisecond},
		{[]string{"--grow-timeout"}, "12", nil, func(c launcher.Config) any { return c.GrowTimeout }, 12 * time.Second},
		{[]string{"-m", "--module"}, "", nil, func(c launcher.Config) any { return c.Entrypoint.Module }, true},
		{[]string{"--no-python", "--no_python"}, "", nil, func(c launcher.Config) any { return c.Entrypoint.NoPython }, true},
		{[]string{"--run-path", "--run_path"}, "", nil, func(c launcher.Config) any { return c.Entrypoint.RunPath }, true},
		{[]string{"--log-dir", "--log_dir"}, "/var/log/job", nil, func(c launcher.Config) any { return c.LogDir }, "/var/log/job"},
		{[]string{"-r", "--redirects"}, "3", nil, func(c launcher.Config) any { return c.Redirects }, launcher.StdSpec{Default: launcher.StdAll}},
		{[]string{"-t", "--tee"}, "0:1,1:2", nil, func(c launcher.Config) any { return c.Tee },
			launcher.StdSpec{PerRank: map[int]launcher.Std{0: launcher.StdOut, 1: launcher.StdErr}}},
		{[]string{"--local-ranks-filter", "--local_ranks_filter"}, "2,0,2", nil, func(c launcher.Config) any { return c.LocalRanksFilter }, []int{0, 2}},
		{[]string{"--node-rank", "--node_rank"}, "1", []string{"--nnodes", "2"}, func(c launcher.Config) any { return c.Rendezvous.NodeRank }, 1},
		{[]string{"--master-addr", "--master_addr"}, "10.1.2.3", nil, func(c launcher.Config) any { return c.Rendezvous.MasterAddr }, "10.1.2.3"},
		{[]string{"--master-port", "--master_port"}, "23456", nil, func(c launcher.Config) any { return c.Rendezvous.MasterPort }, 23456},
		{[]string{"--local-addr", "--local_addr"}, "10.0.0.9", nil, func(c launcher.Config) any { return c.Rendezvous.LocalAddr }, "10.0.0.9"},
		{[]string{"--logs-specs", "--logs_specs"}, "my_specs", nil, accepted, nil},
		{[]string{"--numa-binding", "--numa_binding"}, "node", nil, func(c launcher.Config) any { return c.NUMABinding }, "node"},
		{[]string{"--numa-binding", "--numa_binding"}, "core-complex", nil, func(c launcher.Config) any { return c.NUMABinding }, "core-complex"},
		{[]string{"--log-line-prefix-template", "--log_line_prefix_template"}, "${hostname}:${rank}: ", nil,
			func(c launcher.Config) any { return c.LogLinePrefixTemplate }, "${hostname}:${rank}: "},
		{[]string{"--duplicate-stdout-filters", "--duplicate_stdout_filters"}, "apple,or,,ange", nil,
			func(c launcher.Config) any { return c.DuplicateStdoutFilters }, []string{"apple", "or,ange"}},
		{[]string{"--duplicate-stderr-filters", "--duplicate_stderr_filters"}, "loss", nil,
			func(c launcher.Config) any { return c.DuplicateStderrFilters }, []string{"loss"}},
		{[]string{"--virtual-local-rank", "--virtual_local_rank"}, "", nil, func(c launcher.Config) any { return c.VirtualLocalRank }, true},
		{[]string{"--signals-to-handle", "--signals_to_handle"}, "SIGTERM,SIGUSR1", nil, func(c launcher.Config) any { return c.SignalsToHandle },
			[]syscall.Signal{syscall.SIGTERM, syscall.SIGUSR1}},
		{[]string{"--shutdown-timeout", "--shutdown_timeout"}, "120", nil, func(c launcher.Config) any { return c.ShutdownTimeout }, 120 * time.Second},
		{[]string{"--exit-barrier-timeout", "--exit_barrier_timeout"}, "1.5", nil, func(c launcher.Config) any { return c.ExitBarrierTimeout }, 1500 * time.Millisecond},
		{[]string{"--init"}, "", nil, func(c launcher.Config) any { return c.Init }, true},
		{[]string{"--health-addr"}, ":8080", nil, func(c launcher.Config) any { return c.HealthAddr }, ":8080"},
		{[]string{"--health-addr"}, "[::1]:9100", nil, func(c launcher.Config) any { return c.HealthAddr }, "[::1]:9100"},
	}
	for _, tc := range cases {
		for _, name := range tc.names {
			forms := [][]string{{name}}
			if tc.value != "" {
				forms = [][]string{{name, tc.value}, {name + "=" + tc.value}}
			}
			for _, form := range forms {
				args := append(append(append([]string{}, tc.extra...), form...), "train.py")
				t.Run(strings.Join(args, " "), func(t *testing.T) {
					cfg := mustLaunch(t, args...)
					if got := tc.get(cfg); !reflect.DeepEqual(got, tc.want) {
						t.Fatalf("got %#v, want %#v", got, tc.want)
					}
					if cfg.Entrypoint.Program != "train.py" || cfg.Entrypoint.Args != nil {
						t.Fatalf("entrypoint %+v, want train.py without arguments", cfg.Entrypoint)
					}
				})
			}
		}
	}
}

// TestLaunchEnv: PET_* (and torchrun's other variables) fill the Config
// when the command line is silent, and lose to it otherwise.
func TestLaunchEnv(t *testing.T) {
	nodes := func(c launcher.Config) any { return [2]int{c.MinNodes, c.MaxNodes} }
	health := func(c launcher.Config) any { return c.HealthAddr }
	cases := []struct {
		name string
		env  map[string]string
		args []string
		get  func(launcher.Config) any
		want any
	}{
		{"nnodes", map[string]string{"PET_NNODES": "2:3", "PET_RDZV_BACKEND": "c10d"}, nil, nodes, [2]int{2, 3}},
		{"nproc", map[string]string{"PET_NPROC_PER_NODE": "4"}, nil, func(c launcher.Config) any { return c.NProcPerNode }, 4},
		{"endpoint", map[string]string{"PET_RDZV_ENDPOINT": "host:1234", "PET_RDZV_BACKEND": "c10d"}, nil,
			func(c launcher.Config) any { return c.Rendezvous.Endpoint + " " + c.Rendezvous.Backend }, "host:1234 c10d"},
		{"rdzv id", map[string]string{"PET_RDZV_ID": "job9"}, nil, func(c launcher.Config) any { return c.Rendezvous.RunID }, "job9"},
		{"rdzv conf", map[string]string{"PET_RDZV_CONF": "read_timeout=5"}, nil, func(c launcher.Config) any { return c.Rendezvous.Conf },
			map[string]string{"read_timeout": "5"}},
		{"standalone 1", map[string]string{"PET_STANDALONE": "1"}, nil, func(c launcher.Config) any { return c.Rendezvous.Standalone }, true},
		{"standalone true", map[string]string{"PET_STANDALONE": "true"}, nil, func(c launcher.Config) any { return c.Rendezvous.Standalone }, true},
		{"standalone 0", map[string]string{"PET_STANDALONE": "0"}, nil, func(c launcher.Config) any { return c.Rendezvous.Standalone }, false},
		{"max restarts", map[string]string{"PET_MAX_RESTARTS": "2"}, nil, func(c launcher.Config) any { return c.MaxRestarts }, 2},
		{"monitor interval", map[string]string{"PET_MONITOR_INTERVAL": "0.25"}, nil, func(c launcher.Config) any { return c.MonitorInterval }, 250 * time.Millisecond},
		{"start method", map[string]string{"PET_START_METHOD": "forkserver"}, nil, func(c launcher.Config) any { return c.StartMethod }, "forkserver"},
		{"role", map[string]string{"PET_ROLE": "worker"}, nil, func(c launcher.Config) any { return c.Role }, "worker"},
		{"module", map[string]string{"PET_MODULE": "1"}, nil, func(c launcher.Config) any { return c.Entrypoint.Module }, true},
		{"no python", map[string]string{"PET_NO_PYTHON": "1"}, nil, func(c launcher.Config) any { return c.Entrypoint.NoPython }, true},
		{"run path", map[string]string{"PET_RUN_PATH": "1"}, nil, func(c launcher.Config) any { return c.Entrypoint.RunPath }, true},
		{"log dir", map[string]string{"PET_LOG_DIR": "/logs"}, nil, func(c launcher.Config) any { return c.LogDir }, "/logs"},
		{"redirects", map[string]string{"PET_REDIRECTS": "2"}, nil, func(c launcher.Config) any { return c.Redirects }, launcher.StdSpec{Default: launcher.StdErr}},
		{"tee", map[string]string{"PET_TEE": "3"}, nil, func(c launcher.Config) any { return c.Tee }, launcher.StdSpec{Default: launcher.StdAll}},
		{"local ranks filter", map[string]string{"PET_LOCAL_RANKS_FILTER": "1"}, nil, func(c launcher.Config) any { return c.LocalRanksFilter }, []int{1}},
		{"node rank", map[string]string{"PET_NNODES": "4", "PET_NODE_RANK": "3"}, nil, func(c launcher.Config) any { return c.Rendezvous.NodeRank }, 3},
		{"master", map[string]string{"PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}, nil,
			func(c launcher.Config) any { return [2]any{c.Rendezvous.MasterAddr, c.Rendezvous.MasterPort} }, [2]any{"job-master-0", 23456}},
		{"local addr", map[string]string{"PET_LOCAL_ADDR": "10.0.0.5"}, nil, func(c launcher.Config) any { return c.Rendezvous.LocalAddr }, "10.0.0.5"},
		{"signals", map[string]string{"PET_SIGNALS_TO_HANDLE": "SIGUSR2"}, nil, func(c launcher.Config) any { return c.SignalsToHandle }, []syscall.Signal{syscall.SIGUSR2}},
		{"shutdown PET", map[string]string{"PET_SHUTDOWN_TIMEOUT": "45"}, nil, func(c launcher.Config) any { return c.ShutdownTimeout }, 45 * time.Second},
		{"shutdown TORCH_ELASTIC", map[string]string{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, nil, func(c launcher.Config) any { return c.ShutdownTimeout }, 120 * time.Second},
		{"shutdown PET beats TORCH_ELASTIC", map[string]string{"PET_SHUTDOWN_TIMEOUT": "45", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, nil,
			func(c launcher.Config) any { return c.ShutdownTimeout }, 45 * time.Second},
		{"exit barrier", map[string]string{"TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT": "60"}, nil, func(c launcher.Config) any { return c.ExitBarrierTimeout }, time.Minute},
		{"init", map[string]string{"GORUN_INIT": "1"}, nil, func(c launcher.Config) any { return c.Init }, true},
		{"numa binding", map[string]string{"PET_NUMA_BINDING": "exclusive"}, nil, func(c launcher.Config) any { return c.NUMABinding }, "exclusive"},
		{"flag beats PET_NUMA_BINDING", map[string]string{"PET_NUMA_BINDING": "exclusive"}, []string{"--numa-binding", "socket"},
			func(c launcher.Config) any { return c.NUMABinding }, "socket"},
		{"health addr", map[string]string{"GORUN_HEALTH_ADDR": "127.0.0.1:8080"}, nil, health, "127.0.0.1:8080"},
		{"torchrun health port", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "8080"}, nil, health, "127.0.0.1:8080"},
		{"torchrun health port spaces", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": " 9000 "}, nil, health, "127.0.0.1:9000"},
		{"empty torchrun health port", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": ""}, nil, health, ""},
		{"GORUN_HEALTH_ADDR beats torchrun's port", map[string]string{"GORUN_HEALTH_ADDR": "127.0.0.1:9", "TORCHELASTIC_HEALTH_CHECK_PORT": "8080"}, nil,
			health, "127.0.0.1:9"},
		{"empty GORUN_HEALTH_ADDR turns torchrun's port off", map[string]string{"GORUN_HEALTH_ADDR": "", "TORCHELASTIC_HEALTH_CHECK_PORT": "8080"}, nil,
			health, ""},
		{"python exec", map[string]string{"PYTHON_EXEC": "/opt/conda/bin/python"}, nil, func(c launcher.Config) any { return c.Entrypoint.Argv() },
			[]string{"/opt/conda/bin/python", "-u", "train.py"}},
		{"empty python exec", map[string]string{"PYTHON_EXEC": ""}, nil, func(c launcher.Config) any { return c.Entrypoint.Python }, "python3"},

		// The command line wins.
		{"flag beats PET_NPROC_PER_NODE", map[string]string{"PET_NPROC_PER_NODE": "4"}, []string{"--nproc_per_node", "2"},
			func(c launcher.Config) any { return c.NProcPerNode }, 2},
		{"flag beats PET_RDZV_BACKEND", map[string]string{"PET_RDZV_BACKEND": "c10d"}, []string{"--rdzv-backend", "static"},
			func(c launcher.Config) any { return c.Rendezvous.Backend }, "static"},
		{"switch beats PET_STANDALONE=0", map[string]string{"PET_STANDALONE": "0"}, []string{"--standalone"},
			func(c launcher.Config) any { return c.Rendezvous.Standalone }, true},
		{"flag beats PET_MAX_RESTARTS", map[string]string{"PET_MAX_RESTARTS": "7"}, []string{"--max-restarts", "1"},
			func(c launcher.Config) any { return c.MaxRestarts }, 1},
		{"flag beats TORCH_ELASTIC_SHUTDOWN_TIMEOUT", map[string]string{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, []string{"--shutdown-timeout", "5"},
			func(c launcher.Config) any { return c.ShutdownTimeout }, 5 * time.Second},
		{"flag beats bad PET_NNODES", map[string]string{"PET_NNODES": "0"}, []string{"--nnodes", "1"}, nodes, [2]int{1, 1}},
		{"flag beats torchrun's health port", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "8080"}, []string{"--health-addr", "127.0.0.1:7"},
			health, "127.0.0.1:7"},
		{"empty flag turns torchrun's health port off", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "8080"}, []string{"--health-addr="},
			health, ""},
		{"flag beats GORUN_HEALTH_ADDR", map[string]string{"GORUN_HEALTH_ADDR": ":1"}, []string{"--health-addr", ":2"}, health, ":2"},
		{"flag beats bad torchrun health port", map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "x"}, []string{"--health-addr", ":2"}, health, ":2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			cfg := mustLaunch(t, append(tc.args, "train.py")...)
			if got := tc.get(cfg); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %#v, want %#v", got, tc.want)
			}
		})
	}
}

func TestLaunchPassThrough(t *testing.T) {
	cleanEnv(t)
	cases := []struct {
		args    []string
		program string
		rest    []string
		module  bool
	}{
		{[]string{"--nproc-per-node", "2", "train.py", "--lr", "0.1", "-m", "x"}, "train.py", []string{"--lr", "0.1", "-m", "x"}, false},
		{[]string{"-m", "pkg.train", "--help", "--nnodes", "9"}, "pkg.train", []string{"--help", "--nnodes", "9"}, true},
		{[]string{"--", "train.py", "--", "--standalone"}, "train.py", []string{"--", "--standalone"}, false},
		{[]string{"--no-python", "./worker", "-r", "3", "-t=3", "store"}, "./worker", []string{"-r", "3", "-t=3", "store"}, false},
		{[]string{"train.py", ""}, "train.py", []string{""}, false},
	}
	for _, tc := range cases {
		cfg := mustLaunch(t, tc.args...)
		e := cfg.Entrypoint
		if e.Program != tc.program || !reflect.DeepEqual(e.Args, tc.rest) || e.Module != tc.module {
			t.Errorf("gorun %q: program %q args %q module %v; want %q %q %v", tc.args, e.Program, e.Args, e.Module, tc.program, tc.rest, tc.module)
		}
		// Nothing after the program reached gorun's own flags.
		if cfg.NProcPerNode > 2 || cfg.MinNodes != 1 || !reflect.DeepEqual(cfg.Redirects, launcher.StdSpec{}) || cfg.Rendezvous.Standalone {
			t.Errorf("gorun %q: the program's arguments changed gorun's config: %+v", tc.args, cfg)
		}
	}
}

// TestLaunchDispatch: `gorun store …` is still the store toolbox, and
// after "--" even a program named like a command is a program.
func TestLaunchDispatch(t *testing.T) {
	cleanEnv(t)
	dir := t.TempDir()
	storeURL := "file://" + filepath.Join(dir, "s1")

	res := launch(t, "store", "set", "--store", storeURL, "k", "v")
	if res.called || res.code != ExitOK {
		t.Fatalf("gorun store set: root action ran %v, code %d, stderr %q; want the store command", res.called, res.code, res.stderr)
	}
	if code, out, errs := gorun(t, "", "store", "get", "--store", storeURL, "k"); code != 0 || out != "v" {
		t.Fatalf("gorun store get: %d %q %q", code, out, errs)
	}

	progURL := "file://" + filepath.Join(dir, "s2")
	programs := []struct {
		args []string
		prog string
		rest []string
	}{
		{[]string{"--", "store", "set", "--store", progURL, "k", "v"}, "store", []string{"set", "--store", progURL, "k", "v"}},
		{[]string{"--log-level", "debug", "--", "store"}, "store", nil},
		{[]string{"--standalone", "--nproc_per_node=2", "--", "store", "serve"}, "store", []string{"serve"}},
		{[]string{"--", "help"}, "help", nil},
		{[]string{"--", "h", "store"}, "h", []string{"store"}},
	}
	for _, tc := range programs {
		cfg := mustLaunch(t, tc.args...)
		if cfg.Entrypoint.Program != tc.prog || !reflect.DeepEqual(cfg.Entrypoint.Args, tc.rest) {
			t.Errorf("gorun %q: program %q args %q; want %q %q", tc.args, cfg.Entrypoint.Program, cfg.Entrypoint.Args, tc.prog, tc.rest)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "s2")); !os.IsNotExist(err) {
		t.Fatalf("gorun -- store set … ran the store command (stat: %v)", err)
	}

	// A "--" that is a flag's value ends nothing: here store is the command.
	if res := launch(t, "--role", "--", "store", "get", "k"); res.called || res.code != ExitUsage || !strings.Contains(res.stderr, "store") {
		t.Fatalf("gorun --role -- store get k: root action ran %v, code %d, stderr %q; want store get's usage error", res.called, res.code, res.stderr)
	}
	// Help and version still work on the root.
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}, {"--version"}} {
		if res := launch(t, args...); res.called || res.code != ExitOK {
			t.Errorf("gorun %q: root action ran %v, code %d, stderr %q", args, res.called, res.code, res.stderr)
		}
	}
}

func TestProgramAfterDashDash(t *testing.T) {
	flags := newApp(nil, io.Discard, io.Discard).Flags
	cases := []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"train.py"}, false},
		{[]string{"store", "serve"}, false},
		{[]string{"--", "store"}, true},
		{[]string{"--nnodes", "2", "--", "store"}, true},
		{[]string{"--nnodes=2", "-m", "--", "x"}, true},
		{[]string{"--standalone", "--", "x"}, true},
		{[]string{"-h", "--", "x"}, true},
		{[]string{"--", "--", "x"}, true},
		{[]string{"--"}, true},
		{[]string{"--nnodes", "--", "store"}, false}, // "--" is --nnodes' value
		{[]string{"--role", "--", "--", "x"}, true},  // the second "--" ends the flags
		{[]string{"train.py", "--", "x"}, false},     // the program came first
		{[]string{"--bogus", "--", "x"}, false},      // left to urfave/cli to report
		{[]string{"--nnodes=--", "store"}, false},
	}
	for _, tc := range cases {
		if got := programAfterDashDash(flags, tc.args); got != tc.want {
			t.Errorf("programAfterDashDash(%q) = %v, want %v", tc.args, got, tc.want)
		}
	}
}

// TestLaunchBadInput runs the real CLI: each bad command line fails before
// anything starts, with the usage exit code and one line naming the
// culprit.
func TestLaunchBadInput(t *testing.T) {
	cases := []struct {
		env  map[string]string
		args []string
		hint string
	}{
		{nil, nil, "no program to run (usage: gorun [flags] PROGRAM [ARGS…])"},
		{nil, []string{"--nproc-per-node", "2"}, "no program to run"},
		{nil, []string{"--"}, "no program to run"},
		{nil, []string{"--nnodes", "0", "train.py"}, `--nnodes: "0"`},
		{nil, []string{"--nnodes", "3:2", "train.py"}, `--nnodes: "3:2"`},
		{nil, []string{"--nnodes", "1:2:3", "train.py"}, `--nnodes: "1:2:3"`},
		{nil, []string{"--nnodes", "1:4", "train.py"}, "static rendezvous is not elastic"},
		{nil, []string{"--nproc-per-node", "zero", "train.py"}, `--nproc-per-node: "zero"`},
		{nil, []string{"--nproc_per_node", "0", "train.py"}, `--nproc-per-node: "0"`},
		{nil, []string{"--redirects", "7", "train.py"}, `--redirects: "7"`},
		{nil, []string{"-t", "0:1,x:2", "train.py"}, `--tee: "0:1,x:2"`},
		{nil, []string{"--rdzv-conf", "x", "train.py"}, `--rdzv-conf: "x"`},
		{nil, []string{"--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=soon", "train.py"}, "join_timeout=soon"},
		{nil, []string{"--rdzv-backend", "zookeeper", "train.py"}, `--rdzv-backend "zookeeper"`},
		{nil, []string{"--rdzv-backend", "c10d", "--rdzv-endpoint", "host:99999", "train.py"}, "--rdzv-endpoint"},
		{nil, []string{"--signals-to-handle", "SIGFOO", "train.py"}, `unknown signal "SIGFOO"`},
		{nil, []string{"--signals-to-handle", "SIGTERM,SIGKILL", "train.py"}, "SIGKILL cannot be caught"},
		{nil, []string{"--local-ranks-filter", "0,x", "train.py"}, "--local-ranks-filter"},
		{nil, []string{"--numa-binding", "everywhere", "train.py"}, `--numa-binding: "everywhere" is not a NUMA binding mode; want one of node, socket, exclusive, core-complex`},
		{map[string]string{"PET_NUMA_BINDING": "sockets"}, []string{"train.py"}, `--numa-binding (from $PET_NUMA_BINDING): "sockets"`},
		{nil, []string{"--start-method", "thread", "train.py"}, "--start-method"},
		{nil, []string{"--max-restarts", "-1", "train.py"}, "--max-restarts -1"},
		{nil, []string{"--on-failure", "shrink", "--regrow", "maybe", "train.py"}, `--regrow "maybe": want on or off`},
		{map[string]string{"GORUN_REGROW": "sometimes"}, []string{"train.py"}, `--regrow "sometimes"`},
		{nil, []string{"--max-respawns", "-2", "train.py"}, "--max-respawns -2"},
		{nil, []string{"--respawn-standbys", "1", "train.py"}, "needs --on-failure shrink with --regrow on"},
		{map[string]string{"GORUN_RESPAWN_STANDBYS": "-1"}, []string{"--on-failure", "shrink", "train.py"}, "--respawn-standbys -1"},
		{nil, []string{"--respawn-backoff", "-1", "train.py"}, "--respawn-backoff"},
		{nil, []string{"--grow-timeout", "0", "train.py"}, "--grow-timeout"},
		{nil, []string{"--max-restarts", "many", "train.py"}, "max-restarts"},
		{nil, []string{"--monitor-interval", "0", "train.py"}, "--monitor-interval"},
		{nil, []string{"--monitor-interval", "NaN", "train.py"}, "--monitor-interval"},
		{nil, []string{"--shutdown-timeout", "-5", "train.py"}, "--shutdown-timeout"},
		{nil, []string{"--master-port", "70000", "train.py"}, "--master-port 70000"},
		{nil, []string{"--nnodes", "2", "--node-rank", "2", "train.py"}, "--node-rank 2"},
		{nil, []string{"--no-python", "-m", "train"}, "--no-python and --module"},
		{nil, []string{"--role", "", "train.py"}, "--role"},
		{nil, []string{"--bogus-flag", "train.py"}, "bogus-flag"},
		{nil, []string{"--log-level", "loud", "train.py"}, "log-level"},
		{map[string]string{"PET_NNODES": "0"}, []string{"train.py"}, `--nnodes (from $PET_NNODES): "0"`},
		{map[string]string{"PET_MAX_RESTARTS": "abc"}, []string{"train.py"}, "PET_MAX_RESTARTS"},
		{map[string]string{"PET_STANDALONE": "yes"}, []string{"train.py"}, "PET_STANDALONE"},
		{map[string]string{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, []string{"train.py"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"},
		{nil, []string{"--health-addr", "8080", "train.py"}, `--health-addr "8080" is not HOST:PORT`},
		{nil, []string{"--health-addr", ":http", "train.py"}, `--health-addr ":http": port "http"`},
		{map[string]string{"GORUN_HEALTH_ADDR": ":99999"}, []string{"train.py"}, `--health-addr ":99999"`},
		{map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "abc"}, []string{"train.py"}, `$TORCHELASTIC_HEALTH_CHECK_PORT "abc" is not a TCP port`},
		{map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "70000"}, []string{"train.py"}, "TORCHELASTIC_HEALTH_CHECK_PORT"},
		{map[string]string{"TORCHELASTIC_HEALTH_CHECK_PORT": "-1"}, []string{"train.py"}, "TORCHELASTIC_HEALTH_CHECK_PORT"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			cleanEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			code, out, errs := gorun(t, "", tc.args...)
			if code != ExitUsage || out != "" {
				t.Fatalf("code %d stdout %q stderr %q; want code %d", code, out, errs, ExitUsage)
			}
			if !strings.Contains(errs, tc.hint) || strings.Count(errs, "\n") != 1 || !strings.HasPrefix(errs, "gorun: ") {
				t.Fatalf("stderr %q should be one gorun: line mentioning %q", errs, tc.hint)
			}
		})
	}
}

// TestNoteIgnoredFlags: flags gorun accepts without acting on them are
// logged, and a plain command line logs nothing.
func TestNoteIgnoredFlags(t *testing.T) {
	cleanEnv(t)
	cases := []struct {
		args  []string
		level zapcore.Level
		hint  string // "" for no log at all
	}{
		{[]string{"train.py"}, 0, ""},
		{[]string{"--rdzv-backend", "c10d", "--rdzv-id", "x", "train.py"}, 0, ""},
		{[]string{"--logs-specs", "custom", "train.py"}, zapcore.WarnLevel, "--logs-specs"},
		{[]string{"--numa_binding", "socket", "train.py"}, 0, ""}, // it binds: nothing to note
		{[]string{"--standalone", "--rdzv-id", "x", "train.py"}, zapcore.WarnLevel, "--standalone ignores"},
		{[]string{"--rdzv-backend", "c10d", "--master-addr", "h", "train.py"}, zapcore.WarnLevel, "--master-addr"},
		{[]string{"--event-log-handler", "console", "train.py"}, zapcore.DebugLevel, "--event-log-handler"},
		{[]string{"--start-method", "fork", "train.py"}, zapcore.DebugLevel, "--start-method"},
	}
	for _, tc := range cases {
		core, logs := observer.New(zapcore.DebugLevel)
		app := newApp(nil, io.Discard, io.Discard)
		app.Action = func(c *cli.Context) error { noteIgnoredFlags(c, zap.New(core)); return nil }
		if err := app.Run(append([]string{"gorun"}, tc.args...)); err != nil {
			t.Fatal(err)
		}
		all := logs.All()
		switch {
		case tc.hint == "" && len(all) != 0:
			t.Errorf("gorun %q logged %q; want nothing", tc.args, all[0].Message)
		case tc.hint != "" && (len(all) != 1 || all[0].Level != tc.level || !strings.Contains(all[0].Message, tc.hint)):
			t.Errorf("gorun %q logged %+v; want one %v line mentioning %q", tc.args, all, tc.level, tc.hint)
		}
	}
}

// TestLaunchNUMABindingNoGPU: --numa-binding with no GPU visible fails
// with the local-resource code and says why, as torchrun fails ("No
// accelerator available for NUMA binding"); the worker never runs.
// CUDA_VISIBLE_DEVICES="" hides any GPU this machine has.
func TestLaunchNUMABindingNoGPU(t *testing.T) {
	cleanEnv(t)
	t.Setenv("CUDA_VISIBLE_DEVICES", "")
	ran := filepath.Join(t.TempDir(), "ran")
	code, out, errs := gorun(t, "", "--standalone", "--log-dir", t.TempDir(), "--numa-binding", "node",
		"--no-python", "touch", ran)
	lines := strings.Split(strings.TrimSpace(errs), "\n")
	last := lines[len(lines)-1]
	if code != ExitLocalResource || out != "" || !strings.HasPrefix(last, "gorun: ") ||
		!strings.Contains(last, "--numa-binding node: local rank 0: no NVIDIA GPU is visible") {
		t.Fatalf("code %d, stdout %q, stderr %q; want code %d and a last line naming the missing GPU", code, out, errs, ExitLocalResource)
	}
	if _, err := os.Stat(ran); !os.IsNotExist(err) {
		t.Fatalf("the worker ran (%v)", err)
	}
}

func TestParseLocalRanks(t *testing.T) {
	good := map[string][]int{"": nil, " ": nil, "0": {0}, "3,1, 2": {1, 2, 3}, "1,1": {1}}
	for in, want := range good {
		if got, err := parseLocalRanks(in); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("parseLocalRanks(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"x", "0,", "-1", "0;1", "1.5"} {
		if _, err := parseLocalRanks(bad); err == nil || exitCode(err) != ExitUsage {
			t.Errorf("parseLocalRanks(%q) = %v; want a usage error", bad, err)
		}
	}
}

func TestExitCodeForLauncherErrors(t *testing.T) {
	for _, err := range []error{
		func() error { c := launcher.DefaultConfig(); return c.Validate() }(), // no program
		func() error { _, err := launcher.ParseStd("9"); return err }(),
	} {
		if got := exitCode(err); got != ExitUsage {
			t.Errorf("exitCode(%v) = %d, want %d", err, got, ExitUsage)
		}
	}
	for _, tc := range []struct {
		err  error
		want int
	}{
		{fmt.Errorf("get: %w: timeout after 300ms", rendezvous.ErrTimeout), ExitTimeout},
		// A store reachable once whose reconnection timed out no longer
		// answers: its host is gone.
		{fmt.Errorf("COMPARE_SET: %w: reconnect: %w", rendezvous.ErrUnavailable, rendezvous.ErrTimeout), ExitUnavailable},
	} {
		if got := exitCode(tc.err); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// TestUnknownFlagSuggests: an unknown flag is named with two dashes, with
// the nearest known flag when one is close.
func TestUnknownFlagSuggests(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--nproc-per-nod", "2", "train.py"}, "gorun: unknown flag --nproc-per-nod (did you mean --nproc-per-node?)"},
		{[]string{"--rdzv_endpont", "x", "train.py"}, "gorun: unknown flag --rdzv_endpont (did you mean --rdzv-endpoint?)"},
		{[]string{"--zzz", "train.py"}, "gorun: unknown flag --zzz (gorun --help lists them)"},
		{[]string{"store", "get", "--stor", "tcp://x:1", "k"}, "gorun: unknown flag --stor (did you mean --store?)"},
	} {
		res := launch(t, tc.args...)
		if res.code != ExitUsage || strings.TrimSpace(res.stderr) != tc.want {
			t.Errorf("gorun %v: code %d, stderr %q; want %d, %q", tc.args, res.code, res.stderr, ExitUsage, tc.want)
		}
	}
}

// TestPrintCompletion: --print-completion writes a script for bash, zsh
// or tcsh and runs nothing; bash's completes gorun's flags.
func TestPrintCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "tcsh"} {
		var out, errb bytes.Buffer
		code := run(context.Background(), []string{"gorun", "--print-completion", shell}, strings.NewReader(""), &out, &errb)
		if code != ExitOK || !strings.Contains(out.String(), "nproc") || !strings.Contains(out.String(), shell) {
			t.Errorf("%s: code %d, script %q, stderr %q", shell, code, out.String(), errb.String())
		}
		if shell != "bash" {
			continue
		}
		bash, err := exec.LookPath("bash")
		if err != nil {
			t.Fatalf("bash: %v", err)
		}
		script := out.String() + `COMP_WORDS=(gorun --nproc); COMP_CWORD=1; _gorun; echo "${COMPREPLY[@]}"`
		got, err := exec.Command(bash, "-c", script).Output()
		if err != nil || strings.TrimSpace(string(got)) != "--nproc-per-node --nproc_per_node" {
			t.Errorf("bash completes --nproc to %q (%v)", got, err)
		}
	}
	var errb bytes.Buffer
	code := run(context.Background(), []string{"gorun", "--print-completion", "fish"}, strings.NewReader(""), io.Discard, &errb)
	if code != ExitUsage || !strings.Contains(errb.String(), "want one of bash, zsh, tcsh") {
		t.Errorf("fish: code %d, stderr %q", code, errb.String())
	}
}

// TestLaunchJobSecret: the job secret comes from --job-secret-file (or
// GORUN_JOB_SECRET_FILE) or from GORUN_JOB_SECRET, white space trimmed;
// both at once, a missing file or one too short is a usage error (exit
// 2) that never shows the secret.
func TestLaunchJobSecret(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", "s3cr3t-0123456789abcdef\n")
	short := write("short", "tiny-s3cr3t\n")
	cases := []struct {
		name string
		env  map[string]string
		args []string
		want string // the secret, or "" for none
		err  string // a usage error, when set
	}{
		{name: "none"},
		{name: "env", env: map[string]string{"GORUN_JOB_SECRET": " s3cr3t-0123456789abcdef "}, want: "s3cr3t-0123456789abcdef"},
		{name: "file", args: []string{"--job-secret-file", good}, want: "s3cr3t-0123456789abcdef"},
		{name: "file from env", env: map[string]string{"GORUN_JOB_SECRET_FILE": good}, want: "s3cr3t-0123456789abcdef"},
		{name: "both", env: map[string]string{"GORUN_JOB_SECRET": "s3cr3t-0123456789abcdef"}, args: []string{"--job-secret-file", good},
			err: "both give a job secret"},
		{name: "missing file", args: []string{"--job-secret-file", filepath.Join(dir, "absent")}, err: "no such file"},
		{name: "short file", args: []string{"--job-secret-file", short}, err: "is 11 bytes: want at least 16"},
		{name: "short env", env: map[string]string{"GORUN_JOB_SECRET": "tiny-s3cr3t"}, err: "is 11 bytes: want at least 16"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			res := launch(t, append(tc.args, "train.py")...)
			if tc.err != "" {
				if res.code != ExitUsage || !strings.Contains(res.stderr, tc.err) {
					t.Fatalf("code %d, stderr %q; want %d and %q", res.code, res.stderr, ExitUsage, tc.err)
				}
				if strings.Contains(res.stderr, "s3cr3t") {
					t.Errorf("the error shows the secret: %q", res.stderr)
				}
				return
			}
			if res.code != ExitOK {
				t.Fatalf("code %d, stderr %q", res.code, res.stderr)
			}
			if got := string(res.cfg.JobSecret); got != tc.want {
				t.Errorf("secret %q, want %q", got, tc.want)
			}
			if s := fmt.Sprintf("%v %+v %#v %s", res.cfg.JobSecret, res.cfg, res.cfg, res.cfg.JobSecret); tc.want != "" && strings.Contains(s, tc.want) {
				t.Errorf("formatting the config shows the secret: %s", s)
			}
		})
	}
}
