package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// Each `go build` of a test's helper binary costs a link: about 2 s of CPU
// for gorun, on machines with two cores, and cmd/gorun's tests asked for
// some sixty. A package whose TestMain runs its tests through Shared gets
// each binary built once, shared by all its tests (none writes to one) and
// removed at the end; elsewhere each test builds its own, as before.

// Shared wraps m so that Build and BuildGorun build once per test binary:
// a TestMain calls os.Exit(testutil.Shared(m).Run()), or hands it to
// goleak.VerifyTestMain.
func Shared(m *testing.M) SharedM { return SharedM{m} }

// SharedM runs the tests with shared builds; see Shared.
type SharedM struct{ m *testing.M }

// Run runs the tests and removes the binaries they shared.
func (s SharedM) Run() int {
	shared.Lock()
	shared.on = true
	shared.Unlock()
	defer func() {
		shared.Lock()
		defer shared.Unlock()
		if shared.dir != "" {
			os.RemoveAll(shared.dir)
		}
		shared.on, shared.dir, shared.builds = false, "", nil
	}()
	return s.m.Run()
}

var shared struct {
	sync.Mutex
	on     bool   // under SharedM.Run
	dir    string // where the shared binaries are, made on first use
	builds map[string]*build
}

// build is one binary of the shared set; done is closed once it is built.
type build struct {
	done chan struct{}
	path string
	err  error
}

// Build builds the Go package in directory pkg into a binary named name,
// with extra `go build` arguments (tags, -race) and environment, and
// returns its path: shared by the whole test binary under Shared, else in
// the test's temporary directory. Tests must not change the file.
func Build(t testing.TB, pkg, name string, env []string, args ...string) string {
	t.Helper()
	shared.Lock()
	if !shared.on {
		shared.Unlock()
		path := filepath.Join(t.TempDir(), name)
		if err := goBuild(pkg, path, env, args); err != nil {
			t.Fatal(err)
		}
		return path
	}
	key := strings.Join(append([]string{pkg, name, strings.Join(env, "\x00")}, args...), "\x00")
	b, ok := shared.builds[key]
	if !ok {
		if shared.dir == "" {
			dir, err := os.MkdirTemp("", "gorun-testbin-")
			if err != nil {
				shared.Unlock()
				t.Fatal(err)
			}
			shared.dir = dir
		}
		if shared.builds == nil {
			shared.builds = map[string]*build{}
		}
		b = &build{done: make(chan struct{}), path: filepath.Join(shared.dir, fmt.Sprint(len(shared.builds)), name)}
		shared.builds[key] = b
		shared.Unlock()
		if b.err = os.Mkdir(filepath.Dir(b.path), 0o755); b.err == nil {
			b.err = goBuild(pkg, b.path, env, args)
		}
		close(b.done)
	} else {
		shared.Unlock()
		<-b.done
	}
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

func goBuild(pkg, path string, env, args []string) error {
	cmd := exec.Command("go", append(append([]string{"build"}, args...), "-o", path, pkg)...)
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s %s: %v\n%s", strings.Join(args, " "), pkg, err, out)
	}
	return nil
}

// BuildGorun builds the static gorun binary (the full build, etcd
// included) and returns its path (see Build).
func BuildGorun(t testing.TB) string {
	t.Helper()
	return buildGorun(t)
}

// BuildGorunAs puts the static gorun binary at path, built with build tags
// (e.g. gorun_noetcd, as `make build` builds bin/gorun), and returns path.
// Under Shared, path is a hard link to the shared build (a copy where a
// link cannot be made).
func BuildGorunAs(t testing.TB, path string, tags ...string) string {
	t.Helper()
	src := buildGorun(t, tags...)
	if err := os.Link(src, path); err != nil {
		if err := copyFile(src, path); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

func buildGorun(t testing.TB, tags ...string) string {
	t.Helper()
	_, self, _, _ := runtime.Caller(0)
	pkg := filepath.Join(filepath.Dir(self), "..", "..", "cmd", "gorun")
	return Build(t, pkg, "gorun", []string{"CGO_ENABLED=0"}, "-tags", strings.Join(tags, ","))
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}
