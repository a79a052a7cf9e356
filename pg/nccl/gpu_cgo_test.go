//go:build cgo && linux

package nccl

// TestGPUShrinkGrow runs heal's whole loop on real NCCL and a real GPU:
// three rank processes form a group, one is SIGKILLed, the survivors
// shrink it away while a collective is stuck on it, and a newcomer process
// is grown in; every step's allreduce is checked on the host. It needs a
// GPU: it runs when PGNCCL_GPU_NCCL names the NCCL library (make
// gpu-smoke's device script, scripts/gpu-check.sh, sets it), and is
// skipped otherwise.
//
// One GPU is enough. NCCL refuses two ranks of one host on one device
// ("Duplicate GPU detected"), so each rank process gets a host id of its
// own (NCCL_HOSTID): NCCL then takes the ranks for hosts apart and
// connects them through its socket transport on loopback. The collectives,
// the shrink and the grow are NCCL's own, on device memory.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Environment of TestGPUShrinkGrow and of its rank processes.
const (
	envGPUNCCL     = "PGNCCL_GPU_NCCL"     // the real NCCL library; unset: the test is skipped
	envGPUCUDA     = "PGNCCL_GPU_CUDA"     // the CUDA driver library (default libcuda.so.1)
	envGPURole     = "PGNCCL_GPU_ROLE"     // a rank process: "member" or "newcomer"
	envGPURank     = "PGNCCL_GPU_RANK"     // its rank
	envGPUStore    = "PGNCCL_GPU_STORE"    // the test's store
	envGPUBlocking = "PGNCCL_GPU_BLOCKING" // "0": non-blocking communicators
)

// The test's world: three members, rank 2 killed, one newcomer in its place.
const (
	gpuWorld  = 3
	gpuKilled = 2
	gpuElems  = 1 << 20
)

func TestGPUShrinkGrow(t *testing.T) {
	lib := os.Getenv(envGPUNCCL)
	if lib == "" {
		t.Skipf("needs a GPU and NCCL: set %s to the NCCL library (scripts/gpu-check.sh does)", envGPUNCCL)
	}
	for _, blocking := range []bool{true, false} {
		t.Run(map[bool]string{true: "blocking", false: "nonblocking"}[blocking], func(t *testing.T) {
			gpuShrinkGrow(t, blocking)
		})
	}
}

func gpuShrinkGrow(t *testing.T, blocking bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	store, addr := testStore(t, time.Minute)

	start := func(role string, rank int) *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(),
			envGPURole+"="+role, envGPURank+"="+strconv.Itoa(rank), envGPUStore+"="+addr,
			envGPUBlocking+"="+map[bool]string{true: "1", false: "0"}[blocking],
			// A host of its own per process: see the file's comment.
			fmt.Sprintf("NCCL_HOSTID=pgnccl-gpu-test-%s-%d", role, rank),
			"NCCL_SOCKET_IFNAME=lo")
		cmd.Stdout, cmd.Stderr = testWriter{t, role + strconv.Itoa(rank)}, testWriter{t, role + strconv.Itoa(rank)}
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
		return cmd
	}
	// await waits for every key of phase, failing at the first failure a
	// rank process reported.
	await := func(phase string, ranks ...int) {
		t.Helper()
		for _, r := range ranks {
			key := fmt.Sprintf("gpu/%s/%d", phase, r)
			for {
				wctx, wcancel := context.WithTimeout(ctx, time.Second)
				err := store.Wait(wctx, key)
				wcancel()
				if err == nil {
					break
				}
				if fail, ferr := store.Get(context.Background(), "gpu/fail"); ferr == nil && len(fail) > 0 {
					t.Fatalf("%s: %s", phase, fail)
				}
				if ctx.Err() != nil {
					t.Fatalf("%s: rank %d did not get there: %v", phase, r, ctx.Err())
				}
			}
			v, _ := store.Get(ctx, key)
			t.Logf("%s rank %d: %s", phase, r, v)
		}
	}
	// The fail key exists from the start, so that Get never waits on it.
	if err := store.Set(ctx, "gpu/fail", nil); err != nil {
		t.Fatal(err)
	}

	var members []*exec.Cmd
	for r := range gpuWorld {
		members = append(members, start("member", r))
	}
	await("formed", 0, 1, 2)
	killed := members[gpuKilled]
	if err := killed.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed.Wait()
	if err := store.Set(ctx, "gpu/killed", []byte("1")); err != nil {
		t.Fatal(err)
	}
	await("shrunk", 0, 1)
	start("newcomer", gpuKilled)
	await("grown", 0, 1, 2)
	for r, cmd := range members {
		if r == gpuKilled {
			continue
		}
		if err := cmd.Wait(); err != nil {
			t.Errorf("member %d: %v", r, err)
		}
	}
}

// gpuRankMain is one rank process of TestGPUShrinkGrow. It reports each
// phase under gpu/<phase>/<rank>, and the first failure under gpu/fail.
func gpuRankMain() int {
	role := os.Getenv(envGPURole)
	rank, _ := strconv.Atoi(os.Getenv(envGPURank))
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	store, err := tcpstore.Dial(ctx, os.Getenv(envGPUStore), tcpstore.ClientConfig{Timeout: time.Minute})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer store.Close()
	if err := gpuRank(ctx, store, role, rank); err != nil {
		fmt.Fprintf(os.Stderr, "%s %d: %v\n", role, rank, err)
		store.Set(context.Background(), "gpu/fail", []byte(fmt.Sprintf("%s %d: %v", role, rank, err)))
		return 1
	}
	return 0
}

func gpuRank(ctx context.Context, store *tcpstore.Client, role string, rank int) error {
	cfg := DefaultConfig()
	cfg.NCCLLibrary = os.Getenv(envGPUNCCL)
	if c := os.Getenv(envGPUCUDA); c != "" {
		cfg.CUDALibrary = c
	}
	cfg.NonBlocking = os.Getenv(envGPUBlocking) == "0"
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "job", Rank: rank, Size: gpuWorld, Timeout: time.Minute}
	report := func(phase, format string, args ...any) error {
		return store.Set(ctx, fmt.Sprintf("gpu/%s/%d", phase, rank), []byte(fmt.Sprintf(format, args...)))
	}
	grow := pg.GrowSpec{Added: 1, Namespace: "grow-1"}
	if role == "newcomer" {
		began := time.Now()
		g, err := JoinGrow(ctx, cfg, grow)
		if err != nil {
			return err
		}
		defer g.Close()
		took := time.Since(began)
		if err := gpuCheckSum(ctx, g, float32(rank+1), 6); err != nil {
			return fmt.Errorf("grown group: %w", err)
		}
		return report("grown", "rank %d of %d, NCCL %v, joined in %v", g.Rank(), g.Size(), g.Version(), took.Round(time.Millisecond))
	}

	began := time.Now()
	g, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	defer g.Close()
	formed := time.Since(began)
	if err := gpuCheckSum(ctx, g, float32(rank+1), 6); err != nil {
		return fmt.Errorf("full group: %w", err)
	}
	if err := report("formed", "NCCL %v, device %d, formed in %v", g.Version(), g.Device(), formed.Round(time.Millisecond)); err != nil {
		return err
	}
	if rank == gpuKilled {
		<-ctx.Done() // the test SIGKILLs this one
		return ctx.Err()
	}

	// A collective on the dead rank: stuck, or failed, until the shrink.
	if err := store.Wait(ctx, "gpu/killed"); err != nil {
		return err
	}
	stuck, err := g.Upload(pg.Host(make([]float32, gpuElems)))
	if err != nil {
		return err
	}
	defer stuck.Free()
	stuckErr := make(chan error, 1)
	go func() { stuckErr <- g.AllReduce(ctx, stuck, pg.Sum) }()
	time.Sleep(500 * time.Millisecond)

	began = time.Now()
	sg, err := g.Shrink(ctx, []int{gpuKilled}, pg.ShrinkAbort)
	if err != nil {
		return fmt.Errorf("shrink: %w", err)
	}
	shrank := time.Since(began)
	s := sg.(*Group)
	defer s.Close()
	select {
	case err := <-stuckErr:
		if err == nil {
			return errors.New("the allreduce with the dead rank succeeded")
		}
	case <-time.After(30 * time.Second):
		return errors.New("the allreduce with the dead rank still runs 30 s after the shrink")
	}
	if s.Rank() != rank || s.Size() != gpuWorld-1 {
		return fmt.Errorf("shrunk group: rank %d of %d, want %d of %d", s.Rank(), s.Size(), rank, gpuWorld-1)
	}
	if err := gpuCheckSum(ctx, s, float32(rank+1), 3); err != nil {
		return fmt.Errorf("shrunk group: %w", err)
	}
	if err := report("shrunk", "shrunk in %v", shrank.Round(time.Millisecond)); err != nil {
		return err
	}

	began = time.Now()
	gg, err := s.Grow(ctx, grow)
	if err != nil {
		return fmt.Errorf("grow: %w", err)
	}
	grew := time.Since(began)
	defer gg.Close()
	method := "a fresh communicator"
	if s.growsInPlace() {
		method = "ncclCommGrow"
	}
	if err := gpuCheckSum(ctx, gg.(*Group), float32(rank+1), 6); err != nil {
		return fmt.Errorf("grown group: %w", err)
	}
	return report("grown", "rank %d of %d by %s in %v (from the newcomer's start)", gg.Rank(), gg.Size(), method, grew.Round(time.Millisecond))
}

// gpuCheckSum allreduces gpuElems copies of mine on the device and checks
// every element of the sum on the host.
func gpuCheckSum(ctx context.Context, g *Group, mine, want float32) error {
	host := make([]float32, gpuElems)
	for i := range host {
		host[i] = mine
	}
	buf, err := g.Upload(pg.Host(host))
	if err != nil {
		return err
	}
	defer buf.Free()
	if err := g.AllReduce(ctx, buf, pg.Sum); err != nil {
		return err
	}
	if err := buf.CopyToHost(pg.Host(host)); err != nil {
		return err
	}
	for i, v := range host {
		if v != want {
			return fmt.Errorf("element %d of the sum is %v, want %v", i, v, want)
		}
	}
	return nil
}

// testWriter sends a rank process's output to the test's log, line by line.
type testWriter struct {
	t    *testing.T
	name string
}

func (w testWriter) Write(p []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Logf("[%s] %s", w.name, l)
	}
	return len(p), nil
}
