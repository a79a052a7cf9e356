//go:build cgo && linux

package nccl

// Tests against the real NCCL of the sid bed (internal/sidbed: Debian sid's
// libnccl2 2.29.7), no GPU needed. That library needs glibc 2.38, newer
// than a Debian 12 host's, so the host cannot dlopen it: TestRealNCCL runs
// this test binary again inside the bed (the binary is in the temporary
// directory, which the bed sees), where TestRealNCCLInBed does the work.

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Environment of the run inside the bed.
const (
	envBedNCCL    = "PGNCCL_TEST_BED_NCCL"    // the library, a path inside the bed
	envBedVersion = "PGNCCL_TEST_BED_VERSION" // the version the bed's stamp records
	envBedDouble  = "PGNCCL_TEST_BED_DOUBLE"  // the test double, for its CUDA driver half
)

// bedNCCL is libnccl2's library inside the bed.
const bedNCCL = "/usr/lib/x86_64-linux-gnu/libnccl.so.2"

// TestRealNCCL runs TestRealNCCLInBed inside the sid bed and checks that it
// ran and passed.
func TestRealNCCL(t *testing.T) {
	bed := sidbed.Require(t)
	if buildErr != nil {
		t.Fatalf("cannot build the test double (its CUDA driver half stands in for a GPU's): %v", buildErr)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := bed.Command(ctx, os.Args[0], "-test.run=^TestRealNCCLInBed$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envBedNCCL+"="+bedNCCL, envBedVersion+"="+bed.Stamp.NCCL, envBedDouble+"="+doubleLib)
	cmd.Dir = os.TempDir()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("inside the bed: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "--- PASS: TestRealNCCLInBed") {
		t.Fatalf("TestRealNCCLInBed did not pass inside the bed:\n%s", out)
	}
	t.Logf("inside the bed:\n%s", out)
}

// TestRealNCCLInBed is TestRealNCCL's part inside the bed.
func TestRealNCCLInBed(t *testing.T) {
	lib := os.Getenv(envBedNCCL)
	if lib == "" {
		t.Skip("runs inside the sid bed, started by TestRealNCCL")
	}
	want := os.Getenv(envBedVersion)

	t.Run("symbol table", func(t *testing.T) {
		syms, err := probeSymbols(lib)
		if err != nil {
			t.Fatal(err)
		}
		var f ncclFuncs
		if len(syms) != len(ncclEntries(&f)) {
			t.Fatalf("%d symbols probed, the table has %d", len(syms), len(ncclEntries(&f)))
		}
		for _, s := range syms {
			if !s.Found {
				t.Errorf("NCCL %s lacks %s (optional %v)", want, s.Name, s.Optional)
			}
		}
	})

	t.Run("probe", func(t *testing.T) {
		rep, err := Probe(lib)
		if err != nil {
			t.Fatal(err)
		}
		line := "nccl version=" + want + " symbols=21/21 shrink=yes revoke=yes grow=yes uniqueid=ok"
		if rep.String() != line {
			t.Fatalf("probe: %q, want %q", rep, line)
		}
		again, err := Probe(lib)
		if err != nil {
			t.Fatal(err)
		}
		if again.UniqueID == rep.UniqueID {
			t.Error("two ncclGetUniqueId calls returned the same id")
		}
	})

	t.Run("version gates", func(t *testing.T) {
		n, err := openNCCL(lib)
		if err != nil {
			t.Fatal(err)
		}
		code, r := n.getVersion()
		if r != Success {
			t.Fatalf("ncclGetVersion: %v", r)
		}
		v := DecodeVersion(code)
		if v.String() != want || v.Code() != code {
			t.Fatalf("ncclGetVersion = %d, decoded %v (code %d), want %s", code, v, v.Code(), want)
		}
		for _, g := range []struct {
			name   string
			since  Version
			symbol string
		}{
			{"config init", VersionInitConfig, "ncclCommInitRankConfig"},
			{"shrink", VersionShrink, "ncclCommShrink"},
			{"revoke", VersionRevoke, "ncclCommRevoke"},
			{"grow", VersionGrow, "ncclCommGrow"},
			{"grow id", VersionGrow, "ncclCommGetUniqueId"},
		} {
			if !v.AtLeast(g.since) || !n.has(g.symbol) {
				t.Errorf("%s: NCCL %v at least %v: %v, has %s: %v", g.name, v, g.since, v.AtLeast(g.since), g.symbol, n.has(g.symbol))
			}
		}
		if !n.has("ncclGetLastError") || !n.has("ncclCommGrow") {
			t.Error("ncclGetLastError or ncclCommGrow not found")
		}
	})

	t.Run("unique id through a store", func(t *testing.T) {
		n, err := openNCCL(lib)
		if err != nil {
			t.Fatal(err)
		}
		srv, ctx := realStore(t)
		const world = 3
		ids := make([]uniqueID, world)
		errs := make([]error, world)
		var wg sync.WaitGroup
		for r := range world {
			wg.Go(func() {
				c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
				if err != nil {
					errs[r] = err
					return
				}
				defer c.Close()
				g := &Group{nccl: n, rank: r, size: world,
					cfg: Config{Bootstrap: pg.Bootstrap{Store: c, Namespace: "real", Rank: r, Size: world, Timeout: 20 * time.Second}}}
				ids[r], errs[r] = g.exchangeID(ctx)
			})
		}
		wg.Wait()
		for r, err := range errs {
			if err != nil {
				t.Fatalf("rank %d: %v", r, err)
			}
		}
		if ids[0] == (uniqueID{}) || ids[1] != ids[0] || ids[2] != ids[0] {
			t.Fatalf("ranks got different (or zero) ids:\n%x\n%x\n%x", ids[0][:16], ids[1][:16], ids[2][:16])
		}
		raw, ok, err := srv.Storage().Get([]byte("/real/0"))
		if err != nil || !ok || string(raw) != string(ids[0][:]) {
			t.Fatalf("the store holds %x under /real/0 (%v, %v), want rank 0's id", raw, ok, err)
		}
	})

	// ncclCommInitRankConfig fails for real without a device, and New says
	// so with NCCL's own words. The CUDA driver is the test double's (a
	// DOUBLE: there is no GPU and no libcuda.so.1 here), so that New gets
	// past finding a device to the real library's init.
	t.Run("init without a device", func(t *testing.T) {
		double := os.Getenv(envBedDouble)
		if double == "" {
			t.Fatal("no test double path")
		}
		for _, nonBlocking := range []bool{false, true} {
			t.Run(map[bool]string{false: "blocking", true: "non-blocking"}[nonBlocking], func(t *testing.T) {
				srv, ctx := realStore(t)
				c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				cfg := DefaultConfig()
				cfg.NCCLLibrary, cfg.CUDALibrary, cfg.Device, cfg.NonBlocking = lib, double, 0, nonBlocking
				cfg.Bootstrap = pg.Bootstrap{Store: c, Namespace: "init", Rank: 0, Size: 1, Timeout: 20 * time.Second}
				start := time.Now()
				g, err := New(ctx, cfg)
				if err == nil {
					g.Close()
					t.Fatal("New formed a group without a device")
				}
				var ne *Error
				if !errors.As(err, &ne) || ne.Op != "ncclCommInitRankConfig" || ne.Result == Success || ne.Text == "" {
					t.Fatalf("New: %v (%#v), want an *Error from ncclCommInitRankConfig with NCCL's text", err, ne)
				}
				if ne.Version.String() != want || !strings.Contains(err.Error(), ne.Text) {
					t.Errorf("the error %q does not carry NCCL %s's version and text", err, want)
				}
				t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
			})
		}
	})

	// The grow entry points with the arguments nccl.h rules out: the real
	// library checks them before it needs a device, so these calls say
	// that pg/nccl's C signatures reach NCCL's checks.
	t.Run("grow argument checks", func(t *testing.T) {
		n, err := openNCCL(lib)
		if err != nil {
			t.Fatal(err)
		}
		var id uniqueID
		for _, c := range []struct {
			name         string
			nranks, rank int
			id           *uniqueID
		}{
			{"newcomer without an id", 2, 1, nil},
			{"newcomer with rank -1", 2, -1, &id},
			{"newcomer rank beyond nRanks", 2, 2, &id},
		} {
			comm, r := n.commGrow(0, 0, c.nranks, c.id, c.rank, nil)
			if r != InvalidArgument || comm != 0 {
				t.Errorf("%s: ncclCommGrow = %v, comm %#x; want ncclInvalidArgument and none", c.name, r, comm)
			}
		}
		if _, r := n.commGetUniqueID(0, 0); r != InvalidArgument {
			t.Errorf("ncclCommGetUniqueId(NULL) = %v, want ncclInvalidArgument", r)
		}
	})

	// A newcomer joins a grow for real, the root member played by the
	// test through the store: NCCL's ncclCommGrow runs and fails without a
	// device, and JoinGrow reports it as an *Error naming ncclCommGrow and
	// gives everything back. The CUDA driver is the test double's, as in
	// "init without a device".
	t.Run("join grow without a device", func(t *testing.T) {
		double := os.Getenv(envBedDouble)
		if double == "" {
			t.Fatal("no test double path")
		}
		n, err := openNCCL(lib)
		if err != nil {
			t.Fatal(err)
		}
		id, r := n.getUniqueID()
		if r != Success {
			t.Fatalf("ncclGetUniqueId: %v", r)
		}
		srv, ctx := realStore(t)
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.MultiSet(ctx, []string{"grow/method", "grow/0"}, [][]byte{[]byte("ncclCommGrow"), id[:]}); err != nil {
			t.Fatal(err)
		}
		cfg := DefaultConfig()
		cfg.NCCLLibrary, cfg.CUDALibrary, cfg.Device = lib, double, 0
		cfg.Bootstrap = pg.Bootstrap{Store: c, Rank: 1, Size: 2, Timeout: 20 * time.Second}
		g, err := JoinGrow(ctx, cfg, pg.GrowSpec{Added: 1, Namespace: "grow"})
		if err == nil {
			g.Close()
			t.Fatal("JoinGrow formed a group without a device")
		}
		var ne *Error
		if !errors.As(err, &ne) || ne.Op != "ncclCommGrow" || ne.Result == Success || ne.Text == "" || ne.Version.String() != want {
			t.Fatalf("JoinGrow: %v, want an *Error from NCCL %s's ncclCommGrow", err, want)
		}
		if ok, err := c.Check(ctx, "grow/newcomer/1"); err != nil || !ok {
			t.Errorf("the newcomer did not announce itself: %v, %v", ok, err)
		}
		t.Logf("%v", err)
	})
}

// realStore starts a store server
// context bounding the test's store use.
func realStore(t *testing.T) (*tcpstore.Server, context.Context) {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return srv, ctx
}

// TestConfigLayoutMatchesNCCLHeader compiles testdata/config_layout.c
// against the bed's real nccl.h: the ncclConfig_t prefix pg/nccl passes
// (gr_config.h) must have NCCL's field offsets and sizes, magic and
// undefined markers, or the compile fails. nccl.h includes CUDA headers the
// bed lacks; testdata/cuda-standin declares the little it needs.
func TestConfigLayoutMatchesNCCLHeader(t *testing.T) {
	bed := sidbed.Require(t)
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatalf("gcc: %v", err)
	}
	_, self, _, _ := runtime.Caller(0)
	dir := filepath.Dir(self)
	bin := filepath.Join(t.TempDir(), "config_layout")
	out, err := exec.Command(gcc, "-std=c11", "-Wall", "-Werror", "-o", bin,
		"-I", dir, "-I", filepath.Join(dir, "testdata", "cuda-standin"), "-I", bed.Path("/usr/include"),
		filepath.Join(dir, "testdata", "config_layout.c")).CombinedOutput()
	if err != nil {
		t.Fatalf("the ncclConfig_t prefix does not match %s's nccl.h:\n%s", bed.Stamp.NCCL, out)
	}
	// The program prints what it checked: NCCL's version and its
	// ncclConfig_t's size.
	got, err := exec.Command(bin).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, got)
	}
	if line := strings.TrimSpace(string(got)); !strings.HasPrefix(line, "nccl.h "+bed.Stamp.NCCL+": ncclConfig_t ") {
		t.Fatalf("config_layout printed %q", line)
	}
	t.Log(strings.TrimSpace(string(got)))
}
