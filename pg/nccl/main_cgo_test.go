//go:build cgo && linux

package nccl

// The tests run pg/nccl against a test double: testdata/fakenccl.c, built
// here with gcc into a temporary directory. It is NOT NCCL and not the CUDA
// driver; it exports their entry points with single-process behaviour and
// injectable faults (see the file's comment). Nothing here needs a GPU.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// The test double, built once by TestMain.
var (
	doubleLib    string // testdata/fakenccl.c: a recent library
	oldDoubleLib string // the same with -DFAKENCCL_OLD: no config init, shrink, revoke, grow
	noGrowLib    string // the same with -DFAKENCCL_NO_GROW: no ncclCommGrow, ncclCommGetUniqueId
	doubleCtl    string // its control file ($FAKENCCL_CONTROL)
	doubleLog    string // its call log ($FAKENCCL_LOG)
	buildErr     error
)

// Environment of a rank process (the test binary re-executed).
const (
	envChildRank  = "PGNCCL_TEST_CHILD_RANK"
	envChildSize  = "PGNCCL_TEST_CHILD_SIZE"
	envChildStore = "PGNCCL_TEST_CHILD_STORE"
	envChildLib   = "PGNCCL_TEST_CHILD_LIB"
)

func TestMain(m *testing.M) {
	if os.Getenv(envChildRank) != "" {
		os.Exit(rankMain())
	}
	if os.Getenv(envGPURole) != "" {
		os.Exit(gpuRankMain())
	}
	dir, err := os.MkdirTemp("", "pgnccl-testdouble-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	doubleLib = filepath.Join(dir, "libtestdouble-nccl.so")
	oldDoubleLib = filepath.Join(dir, "libtestdouble-nccl-old.so")
	noGrowLib = filepath.Join(dir, "libtestdouble-nccl-nogrow.so")
	doubleCtl = filepath.Join(dir, "control")
	doubleLog = filepath.Join(dir, "calls.log")
	buildErr = buildDouble(doubleLib)
	if buildErr == nil {
		buildErr = buildDouble(oldDoubleLib, "-DFAKENCCL_OLD")
	}
	if buildErr == nil {
		buildErr = buildDouble(noGrowLib, "-DFAKENCCL_NO_GROW")
	}
	// The double reads these with getenv; with cgo, os.Setenv reaches C.
	os.Setenv("FAKENCCL_CONTROL", doubleCtl)
	os.Setenv("FAKENCCL_LOG", doubleLog)
	os.Unsetenv("LOCAL_RANK")
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func buildDouble(out string, flags ...string) error {
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", out, filepath.Join("testdata", "fakenccl.c")}, flags...)
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("gcc %v: %v\n%s", args, err, b)
	}
	return nil
}

// useDouble sets the double's control file (key=value lines) and empties
// its call log; the control file is emptied again when the test ends.
func useDouble(t *testing.T, control ...string) {
	t.Helper()
	if buildErr != nil {
		t.Skipf("cannot build the test double: %v", buildErr)
	}
	setControl(t, control...)
	if err := os.WriteFile(doubleLog, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Registered first, so it runs after the test's other cleanups
		// (groups closed, buffers freed).
		if !t.Skipped() {
			checkBalanced(t)
		}
		setControl(t)
	})
}

// setControl replaces the double's control file while a test runs.
func setControl(t *testing.T, control ...string) {
	t.Helper()
	// Write and rename: the double reads the file while groups run, and
	// must never see it half-written.
	tmp := doubleCtl + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(control, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, doubleCtl); err != nil {
		t.Fatal(err)
	}
}

// calls returns the double's call log, one call a line, optionally only
// the lines starting with prefix.
func calls(t *testing.T, prefix string) []string {
	t.Helper()
	return readLog(t, doubleLog, prefix)
}

func readLog(t *testing.T, path, prefix string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), prefix) {
			out = append(out, sc.Text())
		}
	}
	return out
}

// testStore starts a tcpstore server and returns a client of it; both are
// closed when the test ends.
func testStore(t *testing.T, timeout time.Duration) (*tcpstore.Client, string) {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	addr := srv.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := tcpstore.Dial(ctx, addr, tcpstore.ClientConfig{Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, addr
}

// testConfig is a Config on the double for rank of size over a fresh
// store.
func testConfig(t *testing.T, rank, size int) Config {
	t.Helper()
	store, _ := testStore(t, 5*time.Second)
	cfg := DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "job", Rank: rank, Size: size, Timeout: 5 * time.Second}
	cfg.NCCLLibrary, cfg.CUDALibrary = doubleLib, doubleLib
	cfg.WatchdogInterval = 5 * time.Millisecond
	if rank != 0 {
		// Play rank 0's part of the id exchange.
		if err := store.Set(context.Background(), "job/0", make([]byte, uniqueIDBytes)); err != nil {
			t.Fatal(err)
		}
	}
	return cfg
}

// newTestGroup forms a group on the double, closed when the test ends.
func newTestGroup(t *testing.T, cfg Config) *Group {
	t.Helper()
	g, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}

// checkBalanced checks that every allocation, stream and context retain
// the double saw was given back.
func checkBalanced(t *testing.T) {
	t.Helper()
	for _, pair := range [][2]string{
		{"cuMemAlloc", "cuMemFree"},
		{"cuStreamCreate", "cuStreamDestroy"},
		{"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease"},
	} {
		if a, b := len(calls(t, pair[0])), len(calls(t, pair[1])); a != b {
			t.Errorf("%d %s but %d %s", a, pair[0], b, pair[1])
		}
	}
	// Every non-blocking shrink's or grow's slot is freed once its
	// communicator completed or was aborted or destroyed.
	loadMu.Lock()
	defer loadMu.Unlock()
	for name, n := range loadedNCCL {
		if p := n.pendingChildren(); p != 0 {
			t.Errorf("%s: %d child slots still held after every group closed", name, p)
		}
	}
}

// rankMain is one rank of TestUniqueIDExchangeAcrossProcesses: it forms a
// group through the store and closes it.
func rankMain() int {
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "rank %s: %v\n", os.Getenv(envChildRank), err)
		return 1
	}
	var rank, size int
	if _, err := fmt.Sscan(os.Getenv(envChildRank)+" "+os.Getenv(envChildSize), &rank, &size); err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	store, err := tcpstore.Dial(ctx, os.Getenv(envChildStore), tcpstore.ClientConfig{Timeout: 20 * time.Second})
	if err != nil {
		return fail(err)
	}
	defer store.Close()
	cfg := DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "job", Rank: rank, Size: size, Timeout: 20 * time.Second}
	cfg.NCCLLibrary, cfg.CUDALibrary = os.Getenv(envChildLib), os.Getenv(envChildLib)
	g, err := New(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	if g.Rank() != rank || g.Size() != size {
		return fail(fmt.Errorf("group is rank %d of %d", g.Rank(), g.Size()))
	}
	if err := g.Close(); err != nil {
		return fail(err)
	}
	return 0
}
