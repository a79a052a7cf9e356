package launcher

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// shConfig runs `sh -c script` as every worker (torchrun's --no-python).
func shConfig(t *testing.T, nproc int, script string) Config {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Entrypoint = Entrypoint{Program: "sh", Args: []string{"-c", script}, NoPython: true, Python: "python3"}
	cfg.NProcPerNode = nproc
	cfg.Rendezvous.Standalone = true
	cfg.Rendezvous.Backend = "c10d"
	cfg.LogDir = t.TempDir()
	cfg.ShutdownTimeout = 5 * time.Second
	// Shell workers do not join by a grow: heal is a test's own choice.
	cfg.Regrow = false
	return cfg
}

// runAgent runs the agent with a deadline and returns its error and output.
func runAgent(t *testing.T, cfg Config, limit time.Duration) (err error, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var out, errb testutil.SyncBuffer
	err = run(ctx, cfg, zap.NewNop(), &out, &errb)
	if ctx.Err() != nil {
		t.Fatalf("agent did not finish within %v\nstdout:\n%s\nstderr:\n%s", limit, out.String(), errb.String())
	}
	return err, out.String(), errb.String()
}

func sortedLines(s string) []string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	sort.Strings(lines)
	return lines
}

func TestAgentRunsWorkersWithTorchrunEnvironment(t *testing.T) {
	cfg := shConfig(t, 3, `echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE role=$ROLE_NAME:$ROLE_RANK/$ROLE_WORLD_SIZE local_world=$LOCAL_WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT/$TORCHELASTIC_MAX_RESTARTS agent_store=$TORCHELASTIC_USE_AGENT_STORE omp=$OMP_NUM_THREADS nccl=$TORCH_NCCL_ASYNC_ERROR_HANDLING"`)
	err, out, errs := runAgent(t, cfg, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, errs)
	}
	want := []string{
		"[default0]:rank=0 local=0 world=3 group=0/1 role=default:0/3 local_world=3 restart=0/0 agent_store=True omp=1 nccl=1",
		"[default1]:rank=1 local=1 world=3 group=0/1 role=default:1/3 local_world=3 restart=0/0 agent_store=True omp=1 nccl=1",
		"[default2]:rank=2 local=2 world=3 group=0/1 role=default:2/3 local_world=3 restart=0/0 agent_store=True omp=1 nccl=1",
	}
	if got := sortedLines(out); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stdout:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestAgentWorkerStoreServesEveryAttempt: MASTER_ADDR:MASTER_PORT is a live
// store, and GORUN_STORE names it.
func TestAgentWorkerStoreIsLive(t *testing.T) {
	gorun := testutil.BuildGorun(t)
	cfg := shConfig(t, 2, fmt.Sprintf(`
		test "$GORUN_STORE" = "tcp://$MASTER_ADDR:$MASTER_PORT" || { echo "GORUN_STORE=$GORUN_STORE"; exit 5; }
		%[1]s store add --store "$GORUN_STORE" joined 1 >/dev/null || exit 6
		%[1]s store wait --store "$GORUN_STORE" --timeout 10s joined || exit 7
		n=$(%[1]s store add --store "$GORUN_STORE" joined 0); echo "seen=$n"`, gorun))
	err, out, errs := runAgent(t, cfg, 60*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s%s", err, out, errs)
	}
	if !strings.Contains(out, "seen=") {
		t.Fatalf("stdout: %s", out)
	}
}

// TestOneNodeWorkerStore: a one-node job serves its workers' store where
// a TCP store's endpoint says (c10d: torchrun's one node hosts its store
// there), and on loopback at a free port where the endpoint is not a TCP
// store's: etcd's (the job bound etcd's own address and failed: "worker
// store on 127.0.0.1:2379: address already in use") or a file store's
// path.
func TestOneNodeWorkerStore(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0") // etcd's port, say
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	heldPort := held.Addr().(*net.TCPAddr).Port
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	freePort := free.Addr().(*net.TCPAddr).Port
	free.Close()
	for _, tc := range []struct {
		name, backend, endpoint string
		conf                    map[string]string
		port                    int // the store's, or 0: any but heldPort
	}{
		{"etcd", "etcd", held.Addr().String(), nil, 0},
		{"etcd-v2", "etcd-v2", held.Addr().String(), nil, 0},
		{"c10d file store", "c10d", filepath.Join(t.TempDir(), "store"), map[string]string{"store_type": "file"}, 0},
		{"c10d", "c10d", fmt.Sprintf("127.0.0.1:%d", freePort), nil, freePort},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := shConfig(t, 1, `echo "$MASTER_ADDR $MASTER_PORT"`)
			cfg.Rendezvous = RendezvousConfig{Backend: tc.backend, Endpoint: tc.endpoint, RunID: "one", Conf: tc.conf}
			cfg.MinNodes, cfg.MaxNodes = 1, 1
			err, out, errs := runAgent(t, cfg, 30*time.Second)
			if err != nil {
				t.Fatalf("run: %v\n%s", err, errs)
			}
			var addr string
			var port int
			if _, err := fmt.Sscanf(strings.TrimPrefix(strings.TrimSpace(out), "[default0]:"), "%s %d", &addr, &port); err != nil {
				t.Fatalf("stdout %q: %v", out, err)
			}
			if addr != "127.0.0.1" || port == heldPort || tc.port != 0 && port != tc.port {
				t.Errorf("the workers' store at %s:%d (the held port %d, want %d)", addr, port, heldPort, tc.port)
			}
		})
	}
}

// TestAgentRestartsThenSucceeds: a worker fails on attempt 0; with one
// restart allowed the job succeeds, and workers see the restart count.
func TestAgentRestartsThenSucceeds(t *testing.T) {
	cfg := shConfig(t, 2, `if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$LOCAL_RANK" = 1 ]; then exit 3; fi
		[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && sleep 30
		echo "attempt=$TORCHELASTIC_RESTART_COUNT"`)
	cfg.MaxRestarts = 1
	start := time.Now()
	err, out, errs := runAgent(t, cfg, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, errs)
	}
	if got := sortedLines(out); strings.Join(got, ",") != "[default0]:attempt=1,[default1]:attempt=1" {
		t.Fatalf("stdout %q", out)
	}
	// Rank 0 was sleeping 30 s on attempt 0: it must have been stopped at
	// once when rank 1 failed, not waited for.
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("restart took %v", d)
	}
}

// TestAgentFailsAfterRestarts: every attempt fails; the error names the
// root cause, the summary is torchrun's, restarts were counted.
func TestAgentFailsAfterRestarts(t *testing.T) {
	cfg := shConfig(t, 3, `[ "$LOCAL_RANK" = 2 ] && exit 7; sleep 30`)
	cfg.MaxRestarts = 2
	err, _, errs := runAgent(t, cfg, 60*time.Second)
	var wf *WorkersFailedError
	if !errors.As(err, &wf) {
		t.Fatalf("err = %v, want *WorkersFailedError", err)
	}
	if wf.Restarts != 2 || len(wf.Failures) != 1 || wf.Failures[0].Rank != 2 || wf.Failures[0].ExitCode != 7 {
		t.Fatalf("failure = %+v", wf)
	}
	for _, want := range []string{"sh FAILED", "Root Cause (first observed failure):", "rank      : 2 (local_rank: 2)",
		"exitcode  : 7 (pid: ", "<NO_OTHER_FAILURES>", "error_file: <N/A>", noTraceback} {
		if !strings.Contains(errs, want) {
			t.Fatalf("summary lacks %q:\n%s", want, errs)
		}
	}
}

// TestAgentSignalDeathIsNamed: a worker killed by a signal is reported as
// torchrun reports it.
func TestAgentSignalDeathIsNamed(t *testing.T) {
	cfg := shConfig(t, 1, `kill -9 $$`)
	err, _, errs := runAgent(t, cfg, 30*time.Second)
	var wf *WorkersFailedError
	if !errors.As(err, &wf) || wf.Failures[0].ExitCode != -9 {
		t.Fatalf("err = %v", err)
	}
	if !regexp.MustCompile(`traceback : Signal 9 \(SIGKILL\) received by PID \d+`).MatchString(errs) {
		t.Fatalf("summary:\n%s", errs)
	}
	if !strings.Contains(err.Error(), "signal 9 (SIGKILL)") {
		t.Fatalf("error %q does not name the signal", err)
	}
}

// TestAgentRootCauseFromErrorFiles: workers that write error files (as
// @record does) are reported with their messages, and the root cause is
// the earliest timestamp, not the first exit.
func TestAgentRootCauseFromErrorFiles(t *testing.T) {
	cfg := shConfig(t, 2, `
		if [ "$LOCAL_RANK" = 0 ]; then
			printf '{"message": {"message": "RuntimeError: late", "extraInfo": {"py_callstack": "Traceback: late", "timestamp": "2000000000"}}}' > "$TORCHELASTIC_ERROR_FILE"
			exit 1
		fi
		sleep 0.3
		printf '{"message": "ValueError: early", "timestamp": 1000000000}' > "$TORCHELASTIC_ERROR_FILE"
		exit 1`)
	// Rank 1 must get to fail before the agent stops it: make it ignore
	// SIGTERM for its short life.
	cfg.Entrypoint.Args[1] = "trap '' TERM; " + cfg.Entrypoint.Args[1]
	cfg.ShutdownTimeout = 3 * time.Second
	err, _, errs := runAgent(t, cfg, 30*time.Second)
	var wf *WorkersFailedError
	if !errors.As(err, &wf) {
		t.Fatalf("err = %v", err)
	}
	root := wf.Failures[rootCause(wf.Failures)]
	if len(wf.Failures) == 2 && root.Message != "ValueError: early" {
		t.Fatalf("root cause %+v", root)
	}
	if !strings.Contains(errs, "RuntimeError: late") || !strings.Contains(errs, "error_file: "+filepath.Dir(cfg.LogDir)) {
		t.Fatalf("summary:\n%s", errs)
	}
}

// TestAgentLogDirLayout: torchrun's layout, --redirects, --tee and
// --local-ranks-filter.
func TestAgentLogDirLayout(t *testing.T) {
	cfg := shConfig(t, 3, `echo "out$LOCAL_RANK"; echo "err$LOCAL_RANK" >&2`)
	cfg.Rendezvous.Standalone = false
	cfg.Rendezvous.Backend = "static"
	cfg.Rendezvous.RunID = "job7"
	cfg.Rendezvous.MasterPort = 0
	var err error
	if cfg.Redirects, err = ParseStd("0:3"); err != nil { // rank 0: both streams to files only
		t.Fatal(err)
	}
	if cfg.Tee, err = ParseStd("1:1"); err != nil { // rank 1: stdout to file and console
		t.Fatal(err)
	}
	cfg.LocalRanksFilter = []int{0, 1} // rank 2 never reaches the console
	err, out, errs := runAgent(t, cfg, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, errs)
	}
	if got := sortedLines(out); strings.Join(got, ",") != "[default1]:out1" {
		t.Fatalf("console stdout %q", out)
	}
	if !strings.Contains(errs, "[default1]:err1") || strings.Contains(errs, "err0") || strings.Contains(errs, "err2") {
		t.Fatalf("console stderr %q", errs)
	}
	runs, _ := filepath.Glob(filepath.Join(cfg.LogDir, "job7_*", "attempt_0"))
	if len(runs) != 1 {
		t.Fatalf("no <log_dir>/job7_*/attempt_0 in %s", cfg.LogDir)
	}
	files := map[string]string{"0/stdout.log": "out0\n", "0/stderr.log": "err0\n", "1/stdout.log": "out1\n"}
	for f, want := range files {
		b, err := os.ReadFile(filepath.Join(runs[0], f))
		if err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", f, b, err, want)
		}
	}
	for _, f := range []string{"1/stderr.log", "2/stdout.log"} {
		if _, err := os.Stat(filepath.Join(runs[0], f)); err == nil {
			t.Errorf("%s exists; only redirected or teed streams get files", f)
		}
	}
}

// TestAgentStopsOnContext: cancelling the agent stops workers with SIGTERM,
// and one that ignores it is killed after the shutdown timeout.
func TestAgentStopsOnContext(t *testing.T) {
	cfg := shConfig(t, 2, `trap '' TERM; echo started; sleep 60`)
	cfg.ShutdownTimeout = 500 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	var out, errb testutil.SyncBuffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, cfg, zap.NewNop(), &out, &errb) }()
	for !strings.Contains(out.String(), "[default1]:started") || !strings.Contains(out.String(), "[default0]:started") {
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not stop")
	}
	if d := time.Since(start); d < 400*time.Millisecond || d > 5*time.Second {
		t.Fatalf("stopped after %v; want about the 500ms shutdown timeout", d)
	}
}

func TestAgentBadInput(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*Config)
		want   error
	}{
		{"missing program", func(c *Config) { c.Entrypoint.Program = "/nonexistent/prog" }, ErrInvalidConfig},
		{"missing script", func(c *Config) {
			c.Entrypoint = Entrypoint{Program: "/nonexistent/train.py", Python: "sh"}
		}, ErrInvalidConfig},
		{"missing interpreter", func(c *Config) {
			c.Entrypoint = Entrypoint{Program: "x.py", Python: "/nonexistent/python"}
		}, ErrInvalidConfig},
		{"standalone with two nodes", func(c *Config) { c.MinNodes, c.MaxNodes = 2, 2 }, ErrInvalidConfig},
		{"etcd password without user", func(c *Config) {
			c.MinNodes, c.MaxNodes = 2, 2
			c.Rendezvous.Standalone = false
			c.Rendezvous.Backend = "etcd-v2"
			c.Rendezvous.Endpoint = "127.0.0.1:2379"
			c.Rendezvous.Conf = map[string]string{"password": "secret"}
		}, ErrInvalidConfig},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := shConfig(t, 1, "exit 0")
			tc.mutate(&cfg)
			if err, _, _ := runAgent(t, cfg, 10*time.Second); !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

// TestAgentTorchGlooJob runs the README's example under the agent: four
// real PyTorch workers, init_process_group("gloo") over env:// against the
// agent's store, an all_reduce whose sum each checks.
func TestAgentTorchGlooJob(t *testing.T) {
	py := torchtest.Python(t)
	cfg := DefaultConfig()
	cfg.Entrypoint = Entrypoint{Program: filepath.Join("..", "examples", "torch", "allreduce.py"), Python: py}
	cfg.NProcPerNode = 4
	cfg.Rendezvous.Standalone = true
	cfg.Rendezvous.Backend = "c10d"
	cfg.LogDir = t.TempDir()
	err, out, errs := runAgent(t, cfg, 120*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s\n%s", err, out, errs)
	}
	for r := range 4 {
		want := fmt.Sprintf("[default%d]:rank %d/4: all_reduce sum=10 (want 10) ok", r, r)
		if !strings.Contains(out, want) {
			t.Fatalf("stdout lacks %q:\n%s\n%s", want, out, errs)
		}
	}
}

func TestIsLocalHost(t *testing.T) {
	h, err := os.Hostname()
	if err != nil {
		t.Skip(err)
	}
	for host, want := range map[string]bool{
		"localhost": true, "127.0.0.1": true, h: true, h + ".svc": true,
		"192.0.2.1": false, "nonexistent.invalid": false, h + "x.svc": false,
	} {
		if got := isLocalHost(host); got != want {
			t.Errorf("isLocalHost(%q) = %v, want %v", host, got, want)
		}
	}
}

// TestAgentHealthEndpoint: with HealthAddr the agent reports its phases
// and workers while it runs.
func TestAgentHealthEndpoint(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	release := filepath.Join(t.TempDir(), "release")
	cfg := shConfig(t, 2, fmt.Sprintf(`while [ ! -e %s ]; do sleep 0.02; done`, release))
	cfg.HealthAddr = addr
	done := make(chan error, 1)
	go func() {
		var out, errb testutil.SyncBuffer
		done <- run(context.Background(), cfg, zap.NewNop(), &out, &errb)
	}()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if code, _ := get("/readyz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("/readyz never became ready while the workers ran")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code, body := get("/metrics"); code != http.StatusOK ||
		!strings.Contains(body, `gorun_workers{state="running"} 2`) ||
		!strings.Contains(body, `gorun_agent_phase{phase="running"} 1`) {
		t.Fatalf("/metrics %d:\n%s", code, body)
	}
	if err := os.WriteFile(release, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("agent did not finish")
	}
	if code, _ := get("/healthz"); code != 0 {
		t.Fatalf("the endpoint still answers (%d) after the agent returned", code)
	}
}

// TestFailuresTogetherAreAllListed: two workers that fail within a monitor
// interval of each other are both in the failure table (torchrun lists
// both); a worker stopped because of them is not.
func TestFailuresTogetherAreAllListed(t *testing.T) {
	cfg := shConfig(t, 3, `case $LOCAL_RANK in 0) sleep 0.3; exit 3;; 1) sleep 0.33; exit 4;; *) exec sleep 60;; esac`)
	cfg.MonitorInterval = 200 * time.Millisecond
	err, _, stderr := runAgent(t, cfg, 30*time.Second)
	var wf *WorkersFailedError
	if !errors.As(err, &wf) {
		t.Fatalf("run: %v, want *WorkersFailedError\n%s", err, stderr)
	}
	var ranks []int
	for _, f := range wf.Failures {
		ranks = append(ranks, f.Rank)
	}
	sort.Ints(ranks)
	if fmt.Sprint(ranks) != "[0 1]" {
		t.Errorf("failure table lists ranks %v, want [0 1]:\n%s", ranks, stderr)
	}
}

// TestConfigWarnings: what Validate lets through but a user should hear
// of.
func TestConfigWarnings(t *testing.T) {
	c := DefaultConfig()
	c.NProcPerNode = 2
	c.Rendezvous.Conf = map[string]string{"join_timout": "5", "zzz": "1", "read_timeout": "3"}
	c.LocalRanksFilter = []int{1, 5}
	got := strings.Join(c.warnings(), "\n")
	for _, want := range []string{
		"--rdzv-conf join_timout: gorun reads no such key; it is ignored (did you mean join_timeout?)",
		"--rdzv-conf zzz: gorun reads no such key; it is ignored\n",
		"--local-ranks-filter [5]: this node runs local ranks 0–1 only",
	} {
		if !strings.Contains(got+"\n", want) {
			t.Errorf("warnings %q lack %q", got, want)
		}
	}
	if strings.Contains(got, "read_timeout") || strings.Contains(got, "no worker's output") {
		t.Errorf("warnings %q: a known key, or rank 1 shown, warned of", got)
	}
	c.LocalRanksFilter = []int{7}
	if w := c.warnings(); !strings.Contains(strings.Join(w, "\n"), "no worker's output reaches the console") {
		t.Errorf("warnings %q: a filter that shows nothing is not called out", w)
	}
}
