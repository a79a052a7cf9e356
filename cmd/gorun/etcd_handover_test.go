package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestLightBuildLinksNoEtcd: `make build`'s bin/gorun (tag gorun_noetcd)
// links neither etcd's client nor gRPC, which are what made every launch
// slower and bigger.
func TestLightBuildLinksNoEtcd(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "-tags", "gorun_noetcd", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if strings.HasPrefix(pkg, "go.etcd.io/") || strings.HasPrefix(pkg, "google.golang.org/grpc") {
			t.Errorf("the gorun_noetcd build links %s", pkg)
		}
	}
}

// TestEtcdHandOver: the light gorun hands an etcd job to gorun-etcd, found
// next to it, by exec: the job runs as if gorun-etcd had been started, and
// the workers do not see the hand-over's marker. Without gorun-etcd, or
// with a light build in its place, it is one clear usage error (exit 2).
func TestEtcdHandOver(t *testing.T) {
	t.Parallel()
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	dir := t.TempDir()
	light := testutil.BuildGorunAs(t, filepath.Join(dir, "gorun"), "gorun_noetcd")
	args := etcdArgs(cluster, "1:2", "", "--log-dir", t.TempDir(), "--no-python",
		"sh", "-c", `echo "worker ran; marker=[$GORUN_ETCD_HANDOVER]"`)
	// Only the directory of the test's own tools on PATH: no gorun-etcd
	// there.
	noGorunOnPath := "PATH=" + filepath.Dir(mustLookPath(t, "sh"))

	t.Run("none", func(t *testing.T) {
		p := startAgentEnv(t, light, []string{noGorunOnPath}, args...)
		if code := p.exitCode(t, 30*time.Second); code != ExitUsage {
			t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitUsage, p.stderr)
		}
		if log := p.stderr.String(); !strings.Contains(log, "gorun-etcd") || strings.Count(strings.TrimSpace(log), "\n") > 0 {
			t.Errorf("want one line naming gorun-etcd, got:\n%s", log)
		}
	})
	t.Run("light build in its place", func(t *testing.T) {
		if err := os.Link(light, filepath.Join(dir, "gorun-etcd")); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(filepath.Join(dir, "gorun-etcd"))
		p := startAgentEnv(t, light, []string{noGorunOnPath}, args...)
		if code := p.exitCode(t, 30*time.Second); code != ExitUsage {
			t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitUsage, p.stderr)
		}
		if !strings.Contains(p.stderr.String(), "has no etcd backends either") {
			t.Errorf("stderr:\n%s", p.stderr)
		}
	})
	t.Run("full build next to it", func(t *testing.T) {
		testutil.BuildGorunAs(t, filepath.Join(dir, "gorun-etcd"))
		p := startAgentEnv(t, light, []string{noGorunOnPath}, args...)
		if l := p.expectLine(t, "worker ran"); !strings.HasSuffix(l, "marker=[]") {
			t.Errorf("worker line %q: the hand-over's marker reached the worker", l)
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
		if !strings.Contains(p.stderr.String(), "rendezvous in etcd") {
			t.Errorf("the job did not meet in etcd:\n%s", p.stderr)
		}
	})
}

func mustLookPath(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
