package torch_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// TestGorunShrinksTorchGloo is the whole of shrink mode with real PyTorch
// 1.13 gloo workers: gorun --on-failure shrink runs four ranks of
// train_elastic.py; the test SIGKILLs rank 2 mid-training; the agent
// reports it, decides and publishes epoch 1, the three survivors shrink
// and finish with the same model, and gorun exits 0 naming the lost rank.
func TestGorunShrinksTorchGloo(t *testing.T) {
	py := torchtest.Python(t)
	gorun := testutil.BuildGorun(t)
	_, self, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(self), "train_elastic.py")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	const steps = 150
	cmd := exec.CommandContext(ctx, gorun, "--standalone", "--nproc-per-node", "4", "--on-failure", "shrink",
		"--log-dir", t.TempDir(), script, "--steps", strconv.Itoa(steps), "--step-ms", "15")
	cmd.Env = append(os.Environ(), "PYTHON_EXEC="+py)
	var stdout, stderr testutil.SyncBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// exited is closed once gorun has been waited for; waitErr is valid
	// then. (A channel of the error could be drained only once, and the
	// cleanup must not block on a drained one.)
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	})

	for strings.Count(stdout.String(), ": training, world 4") < 4 {
		select {
		case <-exited:
			t.Fatalf("gorun exited before training: %v\n%s\n%s", waitErr, stdout.String(), stderr.String())
		case <-ctx.Done():
			t.Fatalf("workers never started training\n%s\n%s", stdout.String(), stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	time.Sleep(300 * time.Millisecond) // some steps in
	pid, err := testutil.ChildWithEnv(cmd.Process.Pid, "RANK", "2")
	if err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}

	select {
	case <-exited:
		if waitErr != nil {
			t.Fatalf("gorun: %v\nstdout:\n%s\nstderr:\n%s", waitErr, stdout.String(), stderr.String())
		}
	case <-ctx.Done():
		t.Fatalf("gorun did not finish\nstdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	}
	if took := time.Since(killed); took > 60*time.Second {
		t.Errorf("the job ended %v after the kill: recovery waited out a timeout", took.Round(time.Millisecond))
	}
	out := stdout.String()
	if n := strings.Count(out, "shrink epoch=1 world=3 excluded=[2]"); n != 3 {
		t.Errorf("%d survivors reported the shrink, want 3:\n%s", n, out)
	}
	dones := doneLine.FindAllStringSubmatch(out, -1)
	if len(dones) != 3 {
		t.Fatalf("%d done lines, want 3:\n%s\nstderr:\n%s", len(dones), out, stderr.String())
	}
	for _, m := range dones {
		if m[2] != "3" || m[3] != strconv.Itoa(steps) || m[4] != dones[0][4] {
			t.Errorf("%s: want world=3 steps=%d and the same loss as %s", m[0], steps, dones[0][0])
		}
	}
	if errs := stderr.String(); !strings.Contains(errs, "lost ranks [2] in 1 epoch(s), world 4 -> 3") {
		t.Errorf("gorun's log does not sum up the loss:\n%s", errs)
	}
}
