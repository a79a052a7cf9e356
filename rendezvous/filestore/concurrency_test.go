package filestore

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// TestConcurrentAddsInProcess: several Stores on one file, each used by
// several goroutines, add concurrently. The flock serialises them: every add
// sees a distinct value, and none is lost.
func TestConcurrentAddsInProcess(t *testing.T) {
	const stores, goroutines, adds = 3, 2, 50
	path := tempPath(t)
	var (
		mu   sync.Mutex
		seen []int64
		wg   sync.WaitGroup
	)
	for range stores {
		s := openStore(t, path, testConfig())
		for range goroutines {
			wg.Go(func() {
				for range adds {
					n, err := s.Add(t.Context(), "counter", 1)
					if err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					seen = append(seen, n)
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	assertOneToN(t, seen, stores*goroutines*adds)
}

// TestConcurrentAddsAcrossProcesses: helper processes (this test binary,
// re-executed) and this process add to one counter at the same time.
func TestConcurrentAddsAcrossProcesses(t *testing.T) {
	const procs, adds = 3, helperAdds
	path := tempPath(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()

	cmds := make([]*exec.Cmd, procs)
	outs := make([]*bytes.Buffer, procs)
	for i := range cmds {
		cmds[i], outs[i] = helper(ctx, "add", path, strconv.Itoa(procs+1))
		check(t, cmds[i].Start())
	}
	s := openStore(t, path, helperConfig())
	// Start together, so that the adds overlap.
	check(t, s.Barrier(ctx, "start", procs+1))
	var seen []int64
	for range adds {
		n, err := s.Add(ctx, "counter", 1)
		check(t, err)
		seen = append(seen, n)
	}
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Fatalf("helper %d: %v", i, err)
		}
		sc := bufio.NewScanner(outs[i])
		for sc.Scan() {
			n, err := strconv.ParseInt(sc.Text(), 10, 64)
			check(t, err)
			seen = append(seen, n)
		}
	}
	assertOneToN(t, seen, (procs+1)*adds)
	if v := s.get("counter"); v != strconv.Itoa((procs+1)*adds) {
		t.Fatalf("counter = %q", v)
	}
}

// TestGetReleasedByAnotherProcess: a helper process blocks in Get until this
// process sets "ping", then answers with a Set that releases this process's
// Get.
func TestGetReleasedByAnotherProcess(t *testing.T) {
	path := tempPath(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd, _ := helper(ctx, "echo", path, "")
	check(t, cmd.Start())
	s := openStore(t, path, testConfig())
	time.Sleep(100 * time.Millisecond) // let the helper start waiting
	s.set("ping", "hi")
	v, err := s.Get(ctx, "pong")
	check(t, err)
	if string(v) != "hi!" {
		t.Fatalf("pong = %q, want hi!", v)
	}
	check(t, cmd.Wait())
}

// helper returns a command running this test binary as a helper (see
// runHelper), with its stdout collected.
func helper(ctx context.Context, mode, path, n string) (*exec.Cmd, *bytes.Buffer) {
	cmd := exec.CommandContext(ctx, os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+mode, helperPathEnv+"="+path, helperNEnv+"="+n)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	return cmd, &out
}

// assertOneToN checks that seen is exactly 1..n in some order: each add got
// its own value, and the last one saw every other.
func assertOneToN(t *testing.T, seen []int64, n int) {
	t.Helper()
	slices.Sort(seen)
	if len(seen) != n {
		t.Fatalf("%d results, want %d", len(seen), n)
	}
	for i, v := range seen {
		if v != int64(i+1) {
			t.Fatalf("results are not 1..%d: position %d holds %d", n, i, v)
		}
	}
}
