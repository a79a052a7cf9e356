package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain checks that the tests leave no goroutine behind: the in-process
// store servers and clients, and the waits on worker processes. The
// binaries the tests start are built once (testutil.Shared).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(testutil.Shared(m))
}

func TestReadEnv(t *testing.T) {
	full := map[string]string{
		"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
		"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3", "GORUN_ON_FAILURE": "Shrink",
	}
	with := func(k, v string) map[string]string {
		m := make(map[string]string, len(full))
		for kk, vv := range full {
			m[kk] = vv
		}
		if v == "" {
			delete(m, k)
		} else {
			m[k] = v
		}
		return m
	}
	tests := []struct {
		name    string
		env     map[string]string
		wantErr string
	}{
		{"torchrun's full set", full, ""},
		{"no RANK", with("RANK", ""), "RANK expected"},
		{"no WORLD_SIZE", with("WORLD_SIZE", ""), "WORLD_SIZE expected"},
		{"no MASTER_ADDR", with("MASTER_ADDR", ""), "MASTER_ADDR expected"},
		{"no MASTER_PORT", with("MASTER_PORT", ""), "MASTER_PORT expected"},
		{"rank out of range", with("RANK", "4"), "RANK=4 out of range for WORLD_SIZE=4"},
		{"not a number", with("WORLD_SIZE", "four"), `WORLD_SIZE="four" is not an integer`},
		{"unknown failure mode", with("GORUN_ON_FAILURE", "retry"), `GORUN_ON_FAILURE="retry": want restart or shrink`},
		{"newcomer", with("GORUN_SHRINK_NEWCOMER", "3"), ""},
		{"job secret", func() map[string]string {
			m := with("GORUN_JOB_SECRET", "s3cret")
			m["TORCHELASTIC_RUN_ID"], m["GORUN_GENERATION"] = "job-7", "2"
			return m
		}(), ""},
		{"newcomer's epoch not a number", with("GORUN_SHRINK_NEWCOMER", "x"), `GORUN_SHRINK_NEWCOMER="x": want the number of the last epoch decided`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, err := readEnv(func(k string) string { return tt.env[k] })
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("readEnv error = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := workerEnv{rank: 2, world: 4, masterAddr: "10.0.0.1", masterPort: 29500, agentStore: true, attempt: 3, onFailure: "shrink"}
			if n := tt.env["GORUN_SHRINK_NEWCOMER"]; n != "" {
				want.newcomer, want.after = true, 3
			}
			if tt.env["GORUN_JOB_SECRET"] != "" {
				want.secret, want.scope = "s3cret", "job-7/2"
			}
			if e != want {
				t.Errorf("readEnv = %+v, want %+v", e, want)
			}
			if e.namespace() != "allreduce/attempt_3" {
				t.Errorf("namespace = %q", e.namespace())
			}
			// A store of rank 0's is new with every group: no attempt in
			// the namespace (torchrun's agents count restarts apart).
			e.agentStore = false
			if e.namespace() != "allreduce" {
				t.Errorf("namespace without the agent store = %q, want allreduce", e.namespace())
			}
		})
	}
}

// buildExample builds this command, once for the package's tests
// (testutil.Shared), with the race detector when the tests have it, so that
// a race in a worker process ends it (exit 66) and fails the test.
func buildExample(t *testing.T) string {
	t.Helper()
	var args []string
	if raceEnabled {
		args = append(args, "-race")
	}
	return testutil.Build(t, ".", "allreduce", nil, args...)
}

var doneRE = regexp.MustCompile(`done rank=(\d+) world=(\d+) steps=(\d+) sum=(\S+)`)

// checkDone asserts one correct done line per rank in out.
func checkDone(t *testing.T, out string, world, steps int) {
	t.Helper()
	want := fmt.Sprint(world * (world + 1) / 2)
	var ranks []int
	for _, m := range doneRE.FindAllStringSubmatch(out, -1) {
		r, _ := strconv.Atoi(m[1])
		ranks = append(ranks, r)
		if m[2] != strconv.Itoa(world) || m[3] != strconv.Itoa(steps) || m[4] != want {
			t.Errorf("rank %s reported world=%s steps=%s sum=%s, want world=%d steps=%d sum=%s", m[1], m[2], m[3], m[4], world, steps, want)
		}
	}
	slices.Sort(ranks)
	if !slices.Equal(ranks, []int{0, 1, 2, 3}[:world]) {
		t.Errorf("done lines from ranks %v, want 0..%d\n%s", ranks, world-1, out)
	}
}

// TestUnderGorun runs the example as the README shows it: four ranks under
// gorun --standalone.
func TestUnderGorun(t *testing.T) {
	gorun, bin := testutil.BuildGorun(t), buildExample(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, gorun, "--standalone", "--nproc-per-node", "4", "--no-python",
		bin, "--steps", "20", "--step-ms", "1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("gorun: %v\n%s", err, out)
	}
	checkDone(t, string(out), 4, 20)
}

// TestWithoutLauncher sets the env:// variables by hand: rank 0 hosts the
// store, as PyTorch's rank 0 does when no agent serves one.
func TestWithoutLauncher(t *testing.T) {
	bin := buildExample(t)
	port := freePort(t)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const world = 3
	outs := make([]*testutil.SyncBuffer, world)
	cmds := make([]*exec.Cmd, world)
	for r := range world {
		outs[r] = new(testutil.SyncBuffer)
		cmds[r] = exec.CommandContext(ctx, bin, "--steps", "5", "--step-ms", "0", "--elems", "100000")
		cmds[r].Env = append(os.Environ(), "RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(world),
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port), "TORCHELASTIC_USE_AGENT_STORE=")
		cmds[r].Stdout, cmds[r].Stderr = outs[r], outs[r]
		cmds[r].SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmds[r].Start(); err != nil {
			t.Fatal(err)
		}
	}
	var all strings.Builder
	for r, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Errorf("rank %d: %v\n%s", r, err, outs[r])
		}
		all.WriteString(outs[r].String())
	}
	checkDone(t, all.String(), world, 5)
}

func TestUsageErrors(t *testing.T) {
	bin := buildExample(t)
	tests := []struct {
		name string
		args []string
		env  []string
		want string
	}{
		{"no launcher env", nil, []string{"RANK=", "WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="}, "RANK expected"},
		{"unknown backend", []string{"--backend", "mpi"}, nil, `unknown --backend "mpi"`},
		{"zero steps", []string{"--steps", "0"}, nil, "--steps, --elems and --checkpoint-every must be at least 1"},
		{"zero checkpoint interval", []string{"--checkpoint-every", "0"}, nil, "--checkpoint-every must be at least 1"},
		{"stray argument", []string{"extra"}, nil, "unexpected arguments"},
		{"unknown failure mode", nil, []string{"RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=1", "GORUN_ON_FAILURE=retry"}, `GORUN_ON_FAILURE="retry"`},
		{"help lists the exit codes", []string{"-h"}, nil, "4  shrink mode: a shrink epoch excluded this rank"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, tt.args...)
			cmd.Env = append(os.Environ(), tt.env...)
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != exitUsage {
				t.Fatalf("exit = %v, want code %d\n%s", err, exitUsage, out)
			}
			if !strings.Contains(string(out), tt.want) {
				t.Errorf("output %q does not say %q", out, tt.want)
			}
		})
	}
}

// TestNCCLWithoutGPU: on a machine without a GPU (CI), --backend nccl fails
// with one clear line — PyTorch's message, or pg/nccl's without cgo.
func TestNCCLWithoutGPU(t *testing.T) {
	if _, err := os.Stat("/dev/nvidia0"); err == nil {
		t.Skip("this machine has a GPU; make gpu-smoke covers it")
	}
	bin := buildExample(t)
	port := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "--backend", "nccl", "--steps", "1")
	cmd.Env = append(os.Environ(), "RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1",
		"MASTER_PORT="+strconv.Itoa(port), "TORCHELASTIC_USE_AGENT_STORE=", "GORUN_NCCL_LIBRARY=", "GORUN_CUDA_LIBRARY=")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitFail {
		t.Fatalf("exit = %v, want code %d\n%s", err, exitFail, out)
	}
	if !strings.Contains(string(out), "only supported with GPUs, no GPUs found!") && !strings.Contains(string(out), "needs cgo") {
		t.Errorf("output does not say why:\n%s", out)
	}
	if n := strings.Count(strings.TrimSpace(string(out)), "\n"); n != 0 {
		t.Errorf("want one line, got %d:\n%s", n+1, out)
	}
}

// freePort returns a loopback port that was free a moment ago, for rank 0
// to host the store on when no launcher serves one.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
