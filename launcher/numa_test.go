package launcher

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/internal/numa"
)

// fakeGPURoot makes a root for the binding to read: this machine's real
// CPU and NUMA topology (a link to /sys/devices/system) with n fake
// NVIDIA GPUs on PCI whose numa_node is node. Tests run without a GPU;
// the CPUs they bind to are real.
func fakeGPURoot(t *testing.T, n, node int) string {
	t.Helper()
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "sys/devices"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/sys/devices/system", filepath.Join(root, "sys/devices/system")); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		dev := filepath.Join(root, "sys/bus/pci/devices", "0000:"+strconv.Itoa(10+i)+":00.0")
		if err := os.MkdirAll(dev, 0o755); err != nil {
			t.Fatal(err)
		}
		for name, content := range map[string]string{"vendor": "0x10de", "class": "0x030200", "numa_node": strconv.Itoa(node)} {
			if err := os.WriteFile(filepath.Join(dev, name), []byte(content+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return root
}

// useNUMARoot points the binding at root for the test, with the agent's
// CUDA_VISIBLE_DEVICES unset (every GPU visible).
func useNUMARoot(t *testing.T, root string) {
	t.Helper()
	old := numaRoot
	numaRoot = root
	t.Cleanup(func() { numaRoot = old })
	t.Setenv("CUDA_VISIBLE_DEVICES", "")
	os.Unsetenv("CUDA_VISIBLE_DEVICES")
}

// TestAgentNUMABinding runs two workers under each mode on this
// machine's real topology (two fake GPUs on the NUMA node of the agent's
// first CPU) and reads each worker's Cpus_allowed_list from /proc: it is
// what the mode computes, from the worker's first instruction on (the
// worker reads its own status, nothing set it after the start).
func TestAgentNUMABinding(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	allowed, err := ownCPUs()
	if err != nil {
		t.Fatal(err)
	}
	real, err := numa.Load("/")
	if err != nil {
		t.Fatal(err)
	}
	node := -1
	for n, cpus := range real.Nodes {
		if slices.Contains(cpus, allowed[0]) {
			node = n
		}
	}
	if node < 0 {
		t.Skip("no NUMA node in /sys/devices/system/node holds this process's CPUs")
	}
	useNUMARoot(t, fakeGPURoot(t, 2, node))
	topo, err := numa.Load(numaRoot)
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range numa.Modes {
		t.Run(string(mode), func(t *testing.T) {
			var want [2]string
			for rank := range want {
				cpus, err := topo.Bind(mode, topo.GPUs, rank, allowed)
				if errors.Is(err, numa.ErrTooFewCPUs) || errors.Is(err, numa.ErrNoNUMAInfo) {
					t.Skipf("this machine cannot host two GPUs' workers under %s: %v", mode, err)
				} else if err != nil {
					t.Fatal(err)
				}
				want[rank] = numa.FormatList(cpus)
			}
			if mode == numa.Exclusive && want[0] == want[1] {
				t.Fatalf("exclusive gives both ranks CPUs %s", want[0])
			}
			cfg := shConfig(t, 2, `sed -n 's/^Cpus_allowed_list:[[:space:]]*/cpus=/p' /proc/$$/status`)
			cfg.NUMABinding = string(mode)
			err, out, errs := runAgent(t, cfg, 30*time.Second)
			if err != nil {
				t.Fatalf("run: %v\n%s", err, errs)
			}
			got := strings.Join(sortedLines(out), "\n")
			if exp := "[default0]:cpus=" + want[0] + "\n[default1]:cpus=" + want[1]; got != exp {
				t.Fatalf("workers' CPUs:\n%s\nwant:\n%s", got, exp)
			}
		})
	}
}

// TestAgentNUMABindingCannot: a binding this machine cannot honour is a
// local-resource error, and no worker starts.
func TestAgentNUMABindingCannot(t *testing.T) {
	cases := []struct {
		name string
		gpus int
		mode string
		hint string
	}{
		{"no GPU", 0, "node", "no NVIDIA GPU is visible"},
		{"more ranks than GPUs", 1, "socket", "local rank 1 has no GPU: 1 visible"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			useNUMARoot(t, fakeGPURoot(t, tc.gpus, 0))
			ran := filepath.Join(t.TempDir(), "ran")
			cfg := shConfig(t, 2, "touch "+ran)
			cfg.NUMABinding = tc.mode
			err, _, _ := runAgent(t, cfg, 30*time.Second)
			if !errors.Is(err, ErrLocalResource) || !errors.Is(err, numa.ErrNoGPU) || !strings.Contains(err.Error(), tc.hint) ||
				!strings.Contains(err.Error(), "--numa-binding "+tc.mode) {
				t.Fatalf("err = %v; want a local-resource error naming --numa-binding %s and %q", err, tc.mode, tc.hint)
			}
			if _, err := os.Stat(ran); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("a worker ran (%v)", err)
			}
		})
	}
	cfg := shConfig(t, 1, "exit 0")
	cfg.NUMABinding = "everywhere"
	if err := cfg.Validate(); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "--numa-binding") {
		t.Fatalf("Validate = %v; want an invalid --numa-binding", err)
	}
}

// TestStartBoundRestoresThread: the fork runs on a thread narrowed to the
// worker's CPUs, and the thread has its old mask back afterwards.
func TestStartBoundRestoresThread(t *testing.T) {
	runtime.LockOSThread() // so that "this thread" is the one startBound uses
	defer runtime.UnlockOSThread()
	var before unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	allowed, err := ownCPUs()
	if err != nil {
		t.Fatal(err)
	}
	one := allowed[len(allowed)-1]
	var during unix.CPUSet
	err = startBound([]int{one}, func() error { return unix.SchedGetaffinity(0, &during) })
	if err != nil {
		t.Fatal(err)
	}
	if during.Count() != 1 || !during.IsSet(one) {
		t.Fatalf("during the start the thread had %d CPUs; want only CPU %d", during.Count(), one)
	}
	var after unix.CPUSet
	if err := unix.SchedGetaffinity(0, &after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("thread mask after startBound: %d CPUs, before: %d", after.Count(), before.Count())
	}
	if err := startBound([]int{1 << 20}, func() error { t.Fatal("started"); return nil }); err == nil {
		t.Fatal("a CPU beyond the mask was accepted")
	}
}
