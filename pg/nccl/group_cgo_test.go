//go:build cgo && linux

package nccl

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

// nopStore is a rendezvous.Store that is never called.
type nopStore struct{ rendezvous.Store }

func TestLoadMissingNCCLLibrary(t *testing.T) {
	useDouble(t)
	cfg := testConfig(t, 0, 1)
	cfg.NCCLLibrary = "/nonexistent/libnccl.so.2"
	_, err := New(context.Background(), cfg)
	var le *LoadError
	if !errors.As(err, &le) {
		t.Fatalf("New: %v, want a *LoadError", err)
	}
	for _, want := range []string{"cannot load /nonexistent/libnccl.so.2", "No such file"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

func TestLoadLibraryWithoutRequiredSymbol(t *testing.T) {
	useDouble(t)
	// libc has no ncclGetVersion.
	_, err := openNCCL("libc.so.6")
	var le *LoadError
	if !errors.As(err, &le) || le.Symbol != "ncclGetVersion" {
		t.Fatalf("openNCCL(libc): %v, want a *LoadError for ncclGetVersion", err)
	}
}

func TestNoGPU(t *testing.T) {
	const msg = "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"
	tests := []struct {
		name    string
		control string
		cuda    string
		detail  string
	}{
		{"no driver library", "", "/nonexistent/libcuda.so.1", "cannot load /nonexistent/libcuda.so.1"},
		{"zero devices", "devices=0", "", "sees 0 devices"},
		{"cuInit says no device", "devices=-1", "", "cuInit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, tt.control)
			cfg := testConfig(t, 0, 1)
			if tt.cuda != "" {
				cfg.CUDALibrary = tt.cuda
			}
			_, err := New(context.Background(), cfg)
			if !errors.Is(err, ErrNoGPU) || !strings.HasPrefix(err.Error(), msg) || !strings.Contains(err.Error(), tt.detail) {
				t.Fatalf("New: %v, want %q (… %s …)", err, msg, tt.detail)
			}
			if got := calls(t, "ncclCommInit"); len(got) != 0 {
				t.Errorf("NCCL was used: %q", got)
			}
		})
	}
}

func TestLibraryPathsFromEnvironment(t *testing.T) {
	t.Setenv(EnvNCCLLibrary, "/x/libnccl.so.2")
	t.Setenv(EnvCUDALibrary, "/x/libcuda.so.1")
	c := DefaultConfig()
	if c.NCCLLibrary != "/x/libnccl.so.2" || c.CUDALibrary != "/x/libcuda.so.1" {
		t.Errorf("DefaultConfig libraries = %q, %q", c.NCCLLibrary, c.CUDALibrary)
	}
	t.Setenv(EnvNCCLLibrary, "")
	t.Setenv(EnvCUDALibrary, "")
	c, err := Config{Bootstrap: pg.Bootstrap{Store: nopStore{}, Size: 1}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if c.NCCLLibrary != DefaultNCCLLibrary || c.CUDALibrary != DefaultCUDALibrary ||
		c.WatchdogInterval != DefaultWatchdogInterval || c.MaxPollInterval != DefaultMaxPollInterval {
		t.Errorf("withDefaults = %+v", c)
	}
}

func TestVersionFromLibrary(t *testing.T) {
	useDouble(t, "version=22703")
	g := newTestGroup(t, testConfig(t, 0, 1))
	if got := g.Version(); got != (Version{2, 27, 3}) {
		t.Errorf("Version = %v, want 2.27.3", got)
	}
}

func TestShrinkAndRevokeGates(t *testing.T) {
	tests := []struct {
		name                 string
		lib                  string
		version              int
		shrinkErr, revokeErr string // "" means supported
	}{
		{"2.26.6 has neither", doubleLib, 22606, "needs NCCL ≥ 2.27.3", "needs NCCL ≥ 2.28.7"},
		{"2.27.2 has neither", doubleLib, 22702, "needs NCCL ≥ 2.27.3", "needs NCCL ≥ 2.28.7"},
		{"2.27.3 shrinks", doubleLib, 22703, "", "needs NCCL ≥ 2.28.7"},
		{"2.28.6 shrinks", doubleLib, 22806, "", "needs NCCL ≥ 2.28.7"},
		{"2.28.7 has both", doubleLib, 22807, "", ""},
		{"3.0.0 has both", doubleLib, 30000, "", ""},
		{"new version, entry points missing", oldDoubleLib, 22900, "without the entry point", "without the entry point"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, fmt.Sprintf("version=%d", tt.version))
			cfg := testConfig(t, 0, 2)
			cfg.NCCLLibrary, cfg.CUDALibrary = tt.lib, tt.lib
			g := newTestGroup(t, cfg)
			check := func(what string, err error, want string) {
				t.Helper()
				if want == "" {
					if err != nil {
						t.Errorf("%s: %v", what, err)
					}
					return
				}
				if !errors.Is(err, pg.ErrNotSupported) || !strings.Contains(err.Error(), want) {
					t.Errorf("%s: %v, want ErrNotSupported saying %q", what, err, want)
				}
			}
			check("shrinkSupported", g.shrinkSupported(), tt.shrinkErr)
			check("revokeSupported", g.revokeSupported(), tt.revokeErr)
			if tt.shrinkErr != "" {
				_, err := g.Shrink(context.Background(), []int{1}, pg.ShrinkAbort)
				check("Shrink", err, tt.shrinkErr)
				if got := calls(t, "ncclCommShrink"); len(got) != 0 {
					t.Errorf("ncclCommShrink called: %q", got)
				}
				if g.stopped.Load() != nil {
					t.Errorf("an unsupported shrink stopped the group")
				}
			}
			if tt.revokeErr != "" {
				check("Revoke", g.Revoke(context.Background()), tt.revokeErr)
			}
		})
	}
}

func TestOldLibraryInitAndNonBlocking(t *testing.T) {
	useDouble(t, "version=21304")
	cfg := testConfig(t, 0, 1)
	cfg.NCCLLibrary, cfg.CUDALibrary = oldDoubleLib, oldDoubleLib
	g := newTestGroup(t, cfg)
	if got := calls(t, "ncclCommInit"); len(got) != 1 || !strings.HasPrefix(got[0], "ncclCommInitRank nranks=1 rank=0 ") {
		t.Errorf("init calls %q, want one ncclCommInitRank", got)
	}
	g.Close()

	cfg = testConfig(t, 0, 1)
	cfg.NCCLLibrary, cfg.CUDALibrary = oldDoubleLib, oldDoubleLib
	cfg.NonBlocking = true
	if _, err := New(context.Background(), cfg); !errors.Is(err, pg.ErrNotSupported) || !strings.Contains(err.Error(), "2.14.0") {
		t.Errorf("non-blocking New on 2.13: %v, want ErrNotSupported naming 2.14.0", err)
	}
}

func TestErrorMapping(t *testing.T) {
	v := Version{2, 27, 3}
	tests := []struct {
		r         Result
		invalid   bool
		timeout   bool
		peer      bool // through peerLost
		wantNames string
	}{
		{UnhandledCudaError, false, false, false, "ncclUnhandledCudaError"},
		{SystemError, false, false, true, "ncclSystemError"},
		{InternalError, false, false, false, "ncclInternalError"},
		{InvalidArgument, true, false, false, "ncclInvalidArgument"},
		{InvalidUsage, true, false, false, "ncclInvalidUsage"},
		{RemoteError, false, false, true, "ncclRemoteError"},
		{Timeout, false, true, false, "ncclTimeout"},
		{Result(42), false, false, false, "ncclResult_t(42)"},
	}
	for _, tt := range tests {
		t.Run(tt.wantNames, func(t *testing.T) {
			e := &Error{Op: "ncclAllReduce", Result: tt.r, Text: "text", Detail: "detail", Version: v}
			want := "nccl: ncclAllReduce: text (" + tt.wantNames + ", NCCL version 2.27.3): detail"
			if e.Error() != want {
				t.Errorf("Error() = %q, want %q", e.Error(), want)
			}
			if got := errors.Is(e, pg.ErrInvalidArgument); got != tt.invalid {
				t.Errorf("Is ErrInvalidArgument = %v", got)
			}
			if got := errors.Is(e, pg.ErrTimeout); got != tt.timeout {
				t.Errorf("Is ErrTimeout = %v", got)
			}
			err := peerLost(e)
			var pe *pg.PeerError
			if got := errors.As(err, &pe); got != tt.peer {
				t.Errorf("peerLost gives a PeerError: %v", got)
			}
			if tt.peer && (pe.Rank != -1 || !errors.Is(err, pg.ErrPeerLost) || !errors.Is(err, e)) {
				t.Errorf("peerLost = %#v", pe)
			}
		})
	}
}

func TestInitErrorFromLibrary(t *testing.T) {
	useDouble(t, "init_error=5")
	_, err := New(context.Background(), testConfig(t, 0, 1))
	var ne *Error
	if !errors.As(err, &ne) || ne.Result != InvalidUsage || ne.Op != "ncclCommInitRankConfig" {
		t.Fatalf("New: %v, want ncclInvalidUsage from ncclCommInitRankConfig", err)
	}
	for _, want := range []string{"test double: invalid usage", "test double: last error detail", "NCCL version 2.28.7"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if !errors.Is(err, pg.ErrInvalidArgument) {
		t.Errorf("error does not wrap ErrInvalidArgument")
	}
	checkBalanced(t)
}

// TestUniqueIDExchangeAcrossProcesses runs 4 ranks as 4 processes (this
// test binary, re-executed) that meet through a tcpstore server: rank 0
// publishes the 128 bytes of its unique id under "job/0", and every rank
// must initialise its communicator with exactly those bytes.
func TestUniqueIDExchangeAcrossProcesses(t *testing.T) {
	useDouble(t)
	const size = 4
	store, addr := testStore(t, 20*time.Second)
	dir := t.TempDir()
	cmds := make([]*exec.Cmd, size)
	outs := make([]strings.Builder, size)
	for r := range size {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(),
			fmt.Sprintf("%s=%d", envChildRank, r), fmt.Sprintf("%s=%d", envChildSize, size),
			envChildStore+"="+addr, envChildLib+"="+doubleLib,
			"FAKENCCL_LOG="+filepath.Join(dir, fmt.Sprintf("rank%d.log", r)))
		cmd.Stdout, cmd.Stderr = &outs[r], &outs[r]
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds[r] = cmd
	}
	done := make(chan error, size)
	for _, cmd := range cmds {
		go func() { done <- cmd.Wait() }()
	}
	received := 0
	// Every process the test started, the test ends.
	defer func() {
		for _, cmd := range cmds {
			_ = cmd.Process.Kill()
		}
		for ; received < size; received++ {
			<-done
		}
	}()
	timeout := time.After(60 * time.Second)
	for received < size {
		select {
		case err := <-done:
			received++
			if err != nil {
				t.Errorf("a rank failed: %v", err)
			}
		case <-timeout:
			t.Fatal("ranks did not finish in 60 s")
		}
	}
	if t.Failed() {
		for r := range size {
			t.Logf("rank %d output:\n%s", r, outs[r].String())
		}
		t.FailNow()
	}

	gen := readLog(t, filepath.Join(dir, "rank0.log"), "ncclGetUniqueId ")
	if len(gen) != 1 {
		t.Fatalf("rank 0 generated %d ids: %q", len(gen), gen)
	}
	id := strings.TrimPrefix(gen[0], "ncclGetUniqueId id=")
	if len(id) != 2*uniqueIDBytes {
		t.Fatalf("id %q is not %d bytes", id, uniqueIDBytes)
	}
	for r := range size {
		log := filepath.Join(dir, fmt.Sprintf("rank%d.log", r))
		if r != 0 {
			if got := readLog(t, log, "ncclGetUniqueId"); len(got) != 0 {
				t.Errorf("rank %d generated an id: %q", r, got)
			}
		}
		want := fmt.Sprintf("ncclCommInitRankConfig nranks=%d rank=%d blocking=1 id=%s", size, r, id)
		if got := readLog(t, log, "ncclCommInit"); len(got) != 1 || got[0] != want {
			t.Errorf("rank %d init %q, want %q", r, got, want)
		}
	}
	v, err := store.Get(context.Background(), "job/0")
	if err != nil || hex.EncodeToString(v) != id {
		t.Errorf("store job/0 = %x, %v; want the 128 raw bytes of %s", v, err, id)
	}
}

func TestUniqueIDWrongSize(t *testing.T) {
	useDouble(t)
	cfg := testConfig(t, 1, 2)
	if err := cfg.Bootstrap.Store.Set(context.Background(), "job/0", []byte("short")); err != nil {
		t.Fatal(err)
	}
	_, err := New(context.Background(), cfg)
	if !errors.Is(err, pg.ErrInvalidArgument) || !strings.Contains(err.Error(), "has 5 bytes, want NCCL_UNIQUE_ID_BYTES (128)") {
		t.Fatalf("New: %v", err)
	}
	checkBalanced(t)
}

func TestUniqueIDGetFails(t *testing.T) {
	useDouble(t)
	store, _ := testStore(t, 100*time.Millisecond)
	cfg := DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "gen2", Rank: 3, Size: 4, Timeout: 100 * time.Millisecond}
	cfg.NCCLLibrary, cfg.CUDALibrary = doubleLib, doubleLib
	_, err := New(context.Background(), cfg)
	want := "[3] is setting up NCCL communicator and retreiving ncclUniqueId from [0] via c10d key-value store by key '0', but store->get('0') got error: "
	if err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("New: %v\nwant prefix %q", err, want)
	}
	if !errors.Is(err, pg.ErrTimeout) {
		t.Errorf("error does not wrap pg.ErrTimeout")
	}
	checkBalanced(t)
}

func TestNonBlockingInit(t *testing.T) {
	useDouble(t, "init_polls=3")
	cfg := testConfig(t, 0, 1)
	cfg.NonBlocking = true
	g := newTestGroup(t, cfg)
	if got := calls(t, "ncclCommInit"); len(got) != 1 || !strings.HasPrefix(got[0], "ncclCommInitRankConfig nranks=1 rank=0 blocking=0 ") {
		t.Errorf("init calls %q, want a non-blocking ncclCommInitRankConfig", got)
	}
	if err := g.Barrier(context.Background()); err != nil {
		t.Errorf("Barrier: %v", err)
	}
}

func TestNonBlockingInitTimesOut(t *testing.T) {
	useDouble(t, "init_polls=-1")
	cfg := testConfig(t, 0, 1)
	cfg.NonBlocking = true
	cfg.Bootstrap.Timeout = 50 * time.Millisecond
	start := time.Now()
	_, err := New(context.Background(), cfg)
	if !errors.Is(err, pg.ErrTimeout) || !strings.Contains(err.Error(), "ncclCommInitRankConfig") {
		t.Fatalf("New: %v, want a timeout naming ncclCommInitRankConfig", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("New took %v", d)
	}
	if got := calls(t, "ncclCommAbort"); len(got) != 1 {
		t.Errorf("abort calls %q, want the half-made communicator aborted", got)
	}
	checkBalanced(t)
}

// A blocking init returns only when every rank has come, and NCCL gives
// no communicator to abort until then; a rank lost before the group forms
// never comes. New must still end at its deadline, or at once when its
// context is cancelled (an epoch that supersedes the formation), and the
// abandoned init's communicator is aborted, and the device released, when
// the init returns at last.
func TestBlockingInitAbandoned(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cancel bool
		want   error
	}{
		{name: "deadline", want: pg.ErrTimeout},
		{name: "cancelled", cancel: true, want: context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			useDouble(t, "init_block=1")
			cfg := testConfig(t, 0, 2)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancel {
				time.AfterFunc(100*time.Millisecond, cancel)
			} else {
				cfg.Bootstrap.Timeout = 100 * time.Millisecond
			}
			start := time.Now()
			_, err := New(ctx, cfg)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), "ncclCommInitRankConfig") {
				t.Fatalf("New: %v, want %v naming ncclCommInitRankConfig", err, tc.want)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("New returned %v after its start, want about 100ms", d.Round(time.Millisecond))
			}
			if got := calls(t, "ncclCommAbort"); len(got) != 0 {
				t.Fatalf("abort calls %q while the init is still in NCCL", got)
			}
			setControl(t) // the missing rank comes: the init returns
			deadline := time.Now().Add(5 * time.Second)
			for {
				aborts := calls(t, "ncclCommAbort")
				retained, released := len(calls(t, "cuDevicePrimaryCtxRetain")), len(calls(t, "cuDevicePrimaryCtxRelease"))
				if len(aborts) == 1 && retained == released {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after the init returned: abort calls %q, %d retains and %d releases; want its communicator aborted and the device released",
						aborts, retained, released)
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

func TestCollectivesWorldOne(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	ctx := context.Background()
	up := func(h pg.HostBuffer) *DeviceBuffer {
		t.Helper()
		b, err := g.Upload(h)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Free() })
		return b
	}
	down := func(b *DeviceBuffer) pg.HostBuffer {
		t.Helper()
		h := pg.NewHost(b.DType(), b.Len())
		if err := b.CopyToHost(h); err != nil {
			t.Fatal(err)
		}
		return h
	}

	in := []float32{1, 2, 3, 4}
	b := up(pg.Host(in))
	for _, op := range []pg.ReduceOp{pg.Sum, pg.Prod, pg.Max, pg.Min, pg.Avg} {
		if err := g.AllReduce(ctx, b, op); err != nil {
			t.Fatalf("AllReduce %v: %v", op, err)
		}
	}
	if got := pg.HostSlice[float32](down(b)); fmt.Sprint(got) != fmt.Sprint(in) {
		t.Errorf("allreduce of one rank = %v, want %v", got, in)
	}
	for _, dt := range []pg.DType{pg.Float16, pg.BFloat16} {
		h, _ := pg.HostBytes(dt, []byte{0x00, 0x3c, 0x00, 0x40}) // 1.0, 2.0 in float16
		hb := up(h)
		if err := g.AllReduce(ctx, hb, pg.Sum); err != nil {
			t.Fatalf("AllReduce %v: %v", dt, err)
		}
		if got := down(hb).Bytes(); string(got) != string(h.Bytes()) {
			t.Errorf("%v allreduce = %x", dt, got)
		}
	}
	if err := g.Broadcast(ctx, b, 0); err != nil {
		t.Errorf("Broadcast: %v", err)
	}
	out := up(pg.NewHost(pg.Float32, 4))
	if err := g.AllGather(ctx, out, b); err != nil {
		t.Errorf("AllGather: %v", err)
	}
	if err := g.ReduceScatter(ctx, out, b, pg.Sum); err != nil {
		t.Errorf("ReduceScatter: %v", err)
	}
	recv := up(pg.NewHost(pg.Float32, 4))
	if err := g.Send(ctx, b, 0); err != nil {
		t.Errorf("Send: %v", err)
	}
	if err := g.Recv(ctx, recv, 0); err != nil {
		t.Errorf("Recv: %v", err)
	}
	if got := pg.HostSlice[float32](down(recv)); fmt.Sprint(got) != fmt.Sprint(in) {
		t.Errorf("recv = %v, want %v", got, in)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Errorf("Barrier: %v", err)
	}

	// Bad arguments, before anything is enqueued.
	n := len(calls(t, "nccl"))
	bad := []struct {
		name string
		err  error
	}{
		{"host buffer", g.AllReduce(ctx, pg.Host(in), pg.Sum)},
		{"bad op", g.AllReduce(ctx, b, pg.ReduceOp(9))},
		{"root out of range", g.Broadcast(ctx, b, 1)},
		{"allgather lengths", g.AllGather(ctx, up(pg.NewHost(pg.Float32, 3)), b)},
		{"reducescatter lengths", g.ReduceScatter(ctx, b, up(pg.NewHost(pg.Float32, 3)), pg.Sum)},
		{"dtypes differ", g.AllGather(ctx, up(pg.NewHost(pg.Int64, 4)), b)},
		{"peer out of range", g.Send(ctx, b, -1)},
	}
	for _, tt := range bad {
		if !errors.Is(tt.err, pg.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", tt.name, tt.err)
		}
	}
	if got := calls(t, "nccl"); len(got) != n {
		t.Errorf("bad arguments reached the library: %q", got[n:])
	}
	if g.AsyncError() != nil {
		t.Errorf("AsyncError = %v", g.AsyncError())
	}
}

// blockedOp starts an allreduce on a stream that never drains (the
// double's hang=1) and returns its result channel.
func blockedOp(t *testing.T, g *Group, ctx context.Context) <-chan error {
	t.Helper()
	b, err := g.Alloc(pg.Float32, 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free() })
	setControl(t, "hang=1")
	res := make(chan error, 1)
	go func() { res <- g.AllReduce(ctx, b, pg.Sum) }()
	// It is blocked once the double saw the enqueue.
	for deadline := time.Now().Add(5 * time.Second); len(calls(t, "ncclAllReduce count=8")) == 0; {
		if time.Now().After(deadline) {
			t.Fatal("allreduce never reached the library")
		}
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-res:
		t.Fatalf("allreduce on a hung stream returned %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	return res
}

func within(t *testing.T, res <-chan error, d time.Duration) error {
	t.Helper()
	select {
	case err := <-res:
		return err
	case <-time.After(d):
		t.Fatalf("blocked operation did not return within %v", d)
		return nil
	}
}

func TestWatchdogAbortsOnAsyncError(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	res := blockedOp(t, g, context.Background())
	setControl(t, "hang=1", "async_error=6") // ncclRemoteError: a peer died

	err := within(t, res, 2*time.Second)
	var ae *pg.AbortedError
	if !errors.As(err, &ae) || !errors.Is(err, pg.ErrPeerLost) {
		t.Fatalf("blocked allreduce: %v, want an AbortedError wrapping ErrPeerLost", err)
	}
	async := g.AsyncError()
	var pe *pg.PeerError
	if !errors.As(async, &pe) || pe.Rank != -1 || !strings.Contains(async.Error(), "ncclRemoteError") {
		t.Fatalf("AsyncError = %v, want a PeerError naming ncclRemoteError", async)
	}
	// The communicator is revoked, not freed: the survivors may shrink it.
	if got := calls(t, "ncclCommRevoke"); len(got) != 1 || len(calls(t, "ncclCommAbort")) != 0 {
		t.Errorf("after the watchdog: revoke %q, abort %q; want one revoke, no abort", got, calls(t, "ncclCommAbort"))
	}
	// Later operations fail at once with the same reason.
	if err := g.Barrier(context.Background()); !errors.As(err, &ae) || !errors.Is(err, pg.ErrPeerLost) {
		t.Errorf("Barrier after the watchdog aborted: %v", err)
	}
	g.Close()
	if got := calls(t, "ncclComm"); strings.Count(strings.Join(got, "\n"), "ncclCommAbort") != 1 || len(calls(t, "ncclCommDestroy")) != 0 {
		t.Errorf("after Close: %q, want the one abort and no destroy", got)
	}
}

// TestShrinkAfterPeerLost is heal's first half as NCCL 2.28.9 does it on a
// GPU (seen on an H100): a peer dies mid-allreduce, the watchdog revokes
// the communicator, and the communicator goes on reporting ncclRemoteError
// once the revoke is done. NCCL will not shrink it (ncclCommShrink's
// ncclCommEnsureReady returns the recorded error), and only the survivors
// connected to the dead peer have the error: the survivors agree, and
// every one forms a fresh communicator when any one cannot shrink, or
// shrinks with NCCL when all can.
func TestShrinkAfterPeerLost(t *testing.T) {
	for _, tt := range []struct {
		name     string
		blocking bool
		lost     bool   // this rank's communicator recorded the peer's loss
		others   string // what the other survivor says
		inPlace  bool
	}{
		{"lost here", true, true, "1", false},
		{"lost here, non-blocking", false, true, "1", false},
		{"lost at the other survivor", true, false, "0", false},
		{"lost nowhere", true, false, "1", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t)
			cfg := testConfig(t, 0, 3)
			cfg.NonBlocking = !tt.blocking
			g := newTestGroup(t, cfg)
			if tt.lost {
				res := blockedOp(t, g, context.Background())
				// ncclRemoteError: a peer died; the shrunk group's
				// communicator (2 ranks) has no error of its own.
				setControl(t, "hang=1", "async_error=6", "async_error_nranks=3")
				if err := within(t, res, 2*time.Second); !errors.Is(err, pg.ErrPeerLost) {
					t.Fatalf("blocked allreduce: %v, want ErrPeerLost", err)
				}
				if got := calls(t, "ncclCommRevoke"); len(got) != 1 {
					t.Fatalf("revoke calls %q, want the watchdog's one", got)
				}
			}
			otherSurvivorsSay(t, g, []int{2}, 0, 2, tt.others)
			child, err := g.Shrink(context.Background(), []int{2}, pg.ShrinkAbort)
			if err != nil {
				t.Fatalf("Shrink: %v", err)
			}
			defer child.Close()
			if child.Rank() != 0 || child.Size() != 2 {
				t.Errorf("child is rank %d of %d, want 0 of 2", child.Rank(), child.Size())
			}
			shrinks, inits := calls(t, "ncclCommShrink"), calls(t, "ncclCommInitRank")
			if tt.inPlace {
				if len(shrinks) != 1 || len(inits) != 1 {
					t.Errorf("shrink calls %q, init calls %q; want one shrink and only the parent's init", shrinks, inits)
				}
			} else if len(shrinks) != 0 || len(inits) != 2 || !strings.Contains(inits[1], "nranks=2 rank=0") {
				t.Errorf("shrink calls %q, init calls %q; want no shrink and a fresh init of rank 0 of 2", shrinks, inits)
			}
			if got := calls(t, "ncclCommAbort"); len(got) != 1 || !strings.Contains(got[0], "nranks=3") {
				t.Errorf("abort calls %q, want the parent's", got)
			}
			setControl(t) // the double's hang ends
			if err := child.Barrier(context.Background()); err != nil {
				t.Errorf("Barrier on the shrunk group: %v", err)
			}
		})
	}
}

func TestWatchdogIdleGroup(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	setControl(t, "async_error=2") // ncclSystemError
	deadline := time.Now().Add(2 * time.Second)
	for g.AsyncError() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the watchdog did not notice the async error")
		}
		time.Sleep(time.Millisecond)
	}
	checkFailed(t, g, pg.ErrPeerLost)
}

// TestAsyncErrorPollsSerialized: the watchdog and an operation waiting on
// the group poll ncclCommGetAsyncError at once, which NCCL does not allow
// on one communicator (a non-blocking operation's group job is joined and
// freed by the first call to see it done, and again by a second one in
// between: a crash on an H200 with NCCL 2.29.7). The double takes 300 µs
// per call and logs any overlap.
func TestAsyncErrorPollsSerialized(t *testing.T) {
	useDouble(t)
	cfg := testConfig(t, 0, 1)
	cfg.WatchdogInterval = 100 * time.Microsecond
	cfg.MaxPollInterval = 100 * time.Microsecond
	g := newTestGroup(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	res := blockedOp(t, g, ctx) // the allreduce polls until its deadline
	setControl(t, "hang=1", "async_error_us=300")
	if err := within(t, res, 5*time.Second); !errors.Is(err, pg.ErrTimeout) {
		t.Errorf("allreduce on a hung stream: %v, want an error wrapping pg.ErrTimeout", err)
	}
	if polls := calls(t, "ncclCommGetAsyncError called concurrently"); len(polls) != 0 {
		t.Errorf("%d concurrent ncclCommGetAsyncError calls on one communicator, the first: %s", len(polls), polls[0])
	}
}

// checkFailed checks that g failed on its own with an error wrapping want,
// and that it takes no more collectives.
func checkFailed(t *testing.T, g *Group, want error) {
	t.Helper()
	if !errors.Is(g.AsyncError(), want) {
		t.Errorf("AsyncError = %v, want one wrapping %v", g.AsyncError(), want)
	}
	if err := g.Barrier(context.Background()); !errors.Is(err, pg.ErrAborted) || !errors.Is(err, want) {
		t.Errorf("Barrier after the failure: %v", err)
	}
}

func TestAbortIsIdempotent(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	res := blockedOp(t, g, context.Background())
	first := errors.New("first reason")
	start := time.Now()
	g.Abort(first)
	err := within(t, res, time.Second)
	t.Logf("blocked allreduce returned %v after Abort", time.Since(start))
	var ae *pg.AbortedError
	if !errors.As(err, &ae) || ae.Reason != first {
		t.Fatalf("blocked allreduce: %v, want an AbortedError with the first reason", err)
	}
	g.Abort(errors.New("second reason"))
	g.Abort(nil)
	if err := g.Barrier(context.Background()); !errors.As(err, &ae) || ae.Reason != first {
		t.Errorf("Barrier after Abort: %v", err)
	}
	if g.AsyncError() != nil {
		t.Errorf("an Abort by the caller is an async error: %v", g.AsyncError())
	}
	if err := g.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := g.Barrier(context.Background()); !errors.Is(err, pg.ErrClosed) {
		t.Errorf("Barrier after Close: %v", err)
	}
	if got := calls(t, "ncclCommAbort"); len(got) != 1 || len(calls(t, "ncclCommDestroy")) != 0 || len(calls(t, "ncclCommRevoke")) != 1 {
		t.Errorf("abort calls %q, revoke calls %q; want one of each (revoke at Abort, abort at Close) and no destroy", got, calls(t, "ncclCommRevoke"))
	}
}

func TestDeadlineAbortsGroup(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := within(t, blockedOp(t, g, ctx), 2*time.Second)
	if !errors.Is(err, pg.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("allreduce past its deadline: %v", err)
	}
	checkFailed(t, g, pg.ErrTimeout)
}

func TestCloseDestroysHealthyGroup(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 0, 1))
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if got := calls(t, "ncclCommDestroy"); len(got) != 1 || len(calls(t, "ncclCommAbort")) != 0 {
		t.Errorf("Close of a healthy group: destroy %q, abort %q", got, calls(t, "ncclCommAbort"))
	}
	checkBalanced(t)
}

func TestShrink(t *testing.T) {
	tests := []struct {
		name        string
		nonBlocking bool
		flags       pg.ShrinkFlags
		parentEnd   string // the parent's last call
	}{
		{"abort", false, pg.ShrinkAbort, "ncclCommAbort"},
		{"default", false, pg.ShrinkDefault, "ncclCommDestroy"},
		{"abort, non-blocking", true, pg.ShrinkAbort, "ncclCommAbort"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, "shrink_polls=2")
			cfg := testConfig(t, 2, 5)
			cfg.NonBlocking = tt.nonBlocking
			g := newTestGroup(t, cfg)
			child := shrinkTo(t, g, []int{4, 0, 3}, tt.flags, 1, 2)
			want := fmt.Sprintf("ncclCommShrink exclude=0,3,4 flags=%d config=NULL newrank=1 newnranks=2", tt.flags)
			if got := calls(t, "ncclCommShrink"); len(got) != 1 || got[0] != want {
				t.Errorf("shrink calls %q, want %q", got, want)
			}
			if err := g.Barrier(context.Background()); !errors.Is(err, pg.ErrAborted) {
				t.Errorf("parent Barrier after Shrink: %v", err)
			}
			if err := child.Barrier(context.Background()); err != nil {
				t.Errorf("child Barrier: %v", err)
			}
			g.Close()
			parent := calls(t, "ncclComm")
			if last := parent[len(parent)-1]; !strings.HasPrefix(last, tt.parentEnd+" rank=2 nranks=5") {
				t.Errorf("parent calls %q, want it to end with %s", parent, tt.parentEnd)
			}
			child.Close()
			if got := calls(t, "ncclCommDestroy rank=1 nranks=2"); len(got) != 1 {
				t.Errorf("child was not destroyed: %q", calls(t, "ncclComm"))
			}
			checkBalanced(t)
		})
	}
}

// shrinkTo shrinks g, the other survivors saying that their communicators
// can be shrunk, and checks the child's rank and size; the child is closed
// when the test ends.
func shrinkTo(t *testing.T, g *Group, exclude []int, flags pg.ShrinkFlags, rank, size int) pg.ProcessGroup {
	t.Helper()
	otherSurvivorsSay(t, g, exclude, rank, size, "1")
	child, err := g.Shrink(context.Background(), exclude, flags)
	if err != nil {
		t.Fatalf("Shrink(%v, %v): %v", exclude, flags, err)
	}
	t.Cleanup(func() { child.Close() })
	if child.Rank() != rank || child.Size() != size {
		t.Errorf("child is rank %d of %d, want %d of %d", child.Rank(), child.Size(), rank, size)
	}
	return child
}

// otherSurvivorsSay plays the part of the survivors of a shrink of g other
// than new rank rank in the agreement on how to shrink (see agreeShrink):
// each says say.
func otherSurvivorsSay(t *testing.T, g *Group, exclude []int, rank, size int, say string) {
	t.Helper()
	sorted := slices.Sorted(slices.Values(exclude))
	store := rendezvous.NewPrefixStore(shrinkNamespace(g.cfg.Bootstrap.Namespace, sorted), g.cfg.Bootstrap.Store)
	for r := range size {
		if r == rank {
			continue
		}
		if err := store.Set(context.Background(), shrinkAgreeKey(r), []byte(say)); err != nil {
			t.Fatal(err)
		}
	}
}

func TestShrinkValidatesFirst(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 1, 4))
	for _, tt := range []struct {
		exclude []int
		flags   pg.ShrinkFlags
		want    string
	}{
		{nil, pg.ShrinkDefault, "ranks_to_exclude cannot be empty"},
		{[]int{2, 2}, pg.ShrinkDefault, "Duplicate rank 2"},
		{[]int{5}, pg.ShrinkAbort, "out of bounds for group size 4"},
		{[]int{1}, pg.ShrinkAbort, "Current rank 1 is in the exclusion list"},
		{[]int{0, 2, 3, 1}, pg.ShrinkDefault, "Cannot exclude all 4 ranks"},
		{[]int{0}, pg.ShrinkFlags(7), "Invalid shrink_flags value: 7"},
	} {
		_, err := g.Shrink(context.Background(), tt.exclude, tt.flags)
		if !errors.Is(err, pg.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Shrink(%v, %v): %v, want %q", tt.exclude, tt.flags, err, tt.want)
		}
	}
	if got := calls(t, "ncclCommShrink"); len(got) != 0 {
		t.Errorf("invalid shrinks reached the library: %q", got)
	}
	if err := g.Barrier(context.Background()); err != nil {
		t.Errorf("group unusable after invalid shrinks: %v", err)
	}
}

// TestShrinkAfterAbort: the survivors' sequence — Abort (or the watchdog),
// then Shrink with pg.ShrinkAbort — works whether or not the library can
// revoke; under FreeOnAbort (PyTorch's free-at-once behaviour) the
// survivors form a fresh communicator instead.
func TestShrinkAfterAbort(t *testing.T) {
	tests := []struct {
		name       string
		version    string
		free       bool
		wantRevoke int
	}{
		{"revoke available", "version=22807", false, 1},
		{"no revoke: the communicator is held", "version=22703", false, 0},
		{"FreeOnAbort", "version=22807", true, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, tt.version)
			cfg := testConfig(t, 0, 3)
			cfg.FreeOnAbort = tt.free
			g := newTestGroup(t, cfg)
			res := blockedOp(t, g, context.Background())
			g.Abort(errors.New("peer 2 died"))
			if err := within(t, res, time.Second); !errors.Is(err, pg.ErrAborted) {
				t.Fatalf("blocked allreduce: %v", err)
			}
			setControl(t, tt.version) // release the double's hang
			if got := calls(t, "ncclCommRevoke"); len(got) != tt.wantRevoke {
				t.Errorf("revoke calls %q, want %d", got, tt.wantRevoke)
			}
			if tt.free {
				if got := calls(t, "ncclCommAbort"); len(got) != 1 || !strings.Contains(got[0], "nranks=3") {
					t.Fatalf("Abort did not free the communicator: %q", got)
				}
				otherSurvivorsSay(t, g, []int{2}, 0, 2, "1") // they could shrink theirs in place; this rank cannot
				child, err := g.Shrink(context.Background(), []int{2}, pg.ShrinkAbort)
				if err != nil {
					t.Fatalf("Shrink after a freeing Abort: %v", err)
				}
				defer child.Close()
				inits := calls(t, "ncclCommInitRank")
				if len(calls(t, "ncclCommShrink")) != 0 || len(inits) != 2 || !strings.Contains(inits[1], "nranks=2 rank=0") {
					t.Errorf("init calls %q after the shrink, want a fresh init of rank 0 of 2 and no ncclCommShrink", inits)
				}
				if err := child.Barrier(context.Background()); err != nil {
					t.Errorf("Barrier on the fresh survivors' group: %v", err)
				}
				return
			}
			if len(calls(t, "ncclCommAbort")) != 0 {
				t.Fatalf("Abort freed the communicator: %q", calls(t, "ncclCommAbort"))
			}
			if tt.wantRevoke == 0 {
				// A held communicator may still run the stuck operation:
				// only an abortive shrink may take it.
				if _, err := g.Shrink(context.Background(), []int{2}, pg.ShrinkDefault); err == nil || !strings.Contains(err.Error(), "use pg.ShrinkAbort") {
					t.Errorf("default shrink of a held communicator: %v", err)
				}
			}
			shrinkTo(t, g, []int{2}, pg.ShrinkAbort, 0, 2)
			if got := calls(t, "ncclCommAbort"); len(got) != 1 || !strings.Contains(got[0], "nranks=3") {
				t.Errorf("parent not aborted after the shrink: %q", got)
			}
		})
	}
}

func TestRevoke(t *testing.T) {
	useDouble(t)
	g := newTestGroup(t, testConfig(t, 1, 3))
	if err := g.Revoke(context.Background()); err != nil {
		t.Fatalf("Revoke: %v", err)
	}
	if got := calls(t, "ncclCommRevoke"); len(got) != 1 || got[0] != "ncclCommRevoke rank=1 flags=0" {
		t.Errorf("revoke calls %q", got)
	}
	if err := g.Barrier(context.Background()); !errors.Is(err, pg.ErrAborted) {
		t.Errorf("Barrier after Revoke: %v", err)
	}
	shrinkTo(t, g, []int{0}, pg.ShrinkDefault, 0, 2)
	if got := calls(t, "ncclCommAbort rank=1 nranks=3"); len(got) != 1 {
		t.Errorf("revoked parent not aborted after the shrink: %q", calls(t, "ncclComm"))
	}
}

func TestDeviceSelection(t *testing.T) {
	useDouble(t, "devices=4")
	for _, tt := range []struct {
		device, rank int
		localRank    string
		want         int
	}{
		{DeviceFromRank, 5, "", 1},
		{DeviceFromRank, 5, "2", 2},
		{3, 0, "1", 3},
	} {
		t.Setenv("LOCAL_RANK", tt.localRank)
		cfg := testConfig(t, tt.rank, 8)
		cfg.Device = tt.device
		g := newTestGroup(t, cfg)
		if g.Device() != tt.want {
			t.Errorf("device %d rank %d LOCAL_RANK %q: got device %d, want %d", tt.device, tt.rank, tt.localRank, g.Device(), tt.want)
		}
		g.Close()
	}
	cfg := testConfig(t, 0, 1)
	cfg.Device = 4
	if _, err := New(context.Background(), cfg); !errors.Is(err, pg.ErrInvalidArgument) {
		t.Errorf("device 4 of 4: %v", err)
	}
}
