package launcher

// This file binds workers to CPUs near their GPUs (--numa-binding):
// package internal/numa computes each worker's CPUs, and startBound
// makes the worker start with them.

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/internal/numa"
)

// numaRoot is where the binding reads sysfs and procfs; tests point it at
// a tree of their own (a fake GPU next to the real CPU topology).
var numaRoot = "/"

func (c Config) validateNUMA() error {
	if c.NUMABinding == "" {
		return nil
	}
	if _, err := numa.ParseMode(c.NUMABinding); err != nil {
		return invalidf("--numa-binding: %w", err)
	}
	return nil
}

// numaCPUs returns the CPUs of each assignment's worker under
// cfg.NUMABinding, by local rank; nil when binding is off. They are
// computed for the whole group before any worker starts, so that a
// binding this machine cannot honour starts none.
//
// As in torchrun, local rank i is placed by CUDA device i of the agent's
// own CUDA_VISIBLE_DEVICES (also under --virtual-local-rank, which only
// renumbers the device inside the worker), and only CPUs the agent may
// run on are given out. A binding that cannot be honoured (no GPU for a
// local rank, no NUMA information, more GPUs than cores in exclusive
// mode) is an error of this machine, ErrLocalResource (exit code 8):
// torchrun fails to start the workers too, and never runs them unbound
// unless its Python-only should_fall_back_if_binding_fails is set.
func numaCPUs(cfg *Config, as []Assignment) (map[int][]int, error) {
	if cfg.NUMABinding == "" {
		return nil, nil
	}
	fail := func(err error) error { return localf("--numa-binding %s: %w", cfg.NUMABinding, err) }
	topo, err := numa.Load(numaRoot)
	if err != nil {
		return nil, fail(err)
	}
	value, set := os.LookupEnv("CUDA_VISIBLE_DEVICES")
	gpus, err := numa.Visible(topo.GPUs, value, set)
	if err != nil {
		return nil, fail(err)
	}
	allowed, err := ownCPUs()
	if err != nil {
		return nil, fail(err)
	}
	out := make(map[int][]int, len(as))
	for _, a := range as {
		cpus, err := topo.Bind(numa.Mode(cfg.NUMABinding), gpus, a.LocalRank, allowed)
		if err != nil {
			return nil, fail(fmt.Errorf("local rank %d: %w", a.LocalRank, err))
		}
		out[a.LocalRank] = cpus
	}
	return out, nil
}

// ownCPUs are the CPUs the agent may run on: the mask of the calling
// thread, which is every agent thread's (only startBound changes one,
// while it is locked to its goroutine).
func ownCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("the agent's CPU affinity: %w", err)
	}
	var cpus []int
	for c := range len(set) * 64 {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// startBound runs start, which forks one worker, so that the worker is
// bound to cpus from its first instruction; nil cpus leaves it as the
// agent is.
//
// A child created by clone(2) copies the CPU mask of the thread that
// called it, and keeps it across execve. So the agent narrows the mask
// of its own thread for the duration of the fork: the goroutine is
// locked to its OS thread, which gets cpus, forks (os.StartProcess runs
// clone on the calling thread), and gets its old mask back. The worker,
// and every thread and child it makes, is bound before it runs; nothing
// runs unbound for a moment, as it would if the agent set the worker's
// affinity by PID after the start (which also moves only the main
// thread, not threads started by then). PyTorch reaches the same by
// exec'ing `numactl --physcpubind=CPUS worker…` (torch/numa/binding.py),
// which needs numactl installed and changes the worker's argv.
//
// Two things this relies on. While the goroutine is locked, the Go
// runtime starts new threads from its template thread, never from this
// one, so the narrowed mask spreads to no other thread. And the thread is
// restored and unlocked, not left to die with a goroutine that returns
// locked: Pdeathsig (the worker's SIGKILL when the agent dies) fires
// when the thread that forked the worker exits, so that thread must live
// as long as the agent.
func startBound(cpus []int, start func() error) error {
	if cpus == nil {
		return start()
	}
	var want unix.CPUSet
	for _, c := range cpus {
		if c >= len(want)*64 {
			return fmt.Errorf("--numa-binding: CPU %d is beyond the %d CPUs an affinity mask holds here", c, len(want)*64)
		}
		want.Set(c)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var old unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		return fmt.Errorf("--numa-binding: the agent's CPU affinity: %w", err)
	}
	if err := unix.SchedSetaffinity(0, &want); err != nil {
		return fmt.Errorf("--numa-binding: binding to CPUs %s: %w", numa.FormatList(cpus), err)
	}
	defer func() {
		// Restoring can fail only if the agent's cpuset shrank meanwhile
		// to none of its old CPUs; every CPU then lets the kernel pick
		// what the cpuset allows (the intersection is never empty). The
		// thread would otherwise run other goroutines on the narrow mask:
		// slower, never wrong.
		if unix.SchedSetaffinity(0, &old) != nil {
			var all unix.CPUSet
			for c := range len(all) * 64 {
				all.Set(c)
			}
			_ = unix.SchedSetaffinity(0, &all)
		}
	}()
	return start()
}
