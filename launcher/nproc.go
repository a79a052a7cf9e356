package launcher

import (
	"errors"
	"os"
	"runtime"
	"strconv"
	"strings"
)

// ResolveNProc turns --nproc-per-node into a count, as torchrun's
// determine_local_world_size does: an integer >= 1; "cpu" is
// runtime.NumCPU() (the CPUs this process may run on, where torchrun's
// os.cpu_count() counts every CPU of the machine); "gpu" is the number of
// NVIDIA GPUs, an error if there are none; "auto" is the GPUs if there are
// any, else the CPUs.
//
// GPUs are counted without linking CUDA: the /dev/nvidia<N> device nodes,
// narrowed by CUDA_VISIBLE_DEVICES as torch.cuda.device_count() would be
// (see visibleGPUs). NVML, loaded at run time, could replace this later.
// torchrun's xpu and custom-backend names are not supported.
func ResolveNProc(s string) (int, error) {
	visible, set := os.LookupEnv("CUDA_VISIBLE_DEVICES")
	return resolveNProc(s, func() (int, error) { return visibleGPUs("/dev", visible, set) }, runtime.NumCPU())
}

// resolveNProc is ResolveNProc with the GPU count and the CPU count given,
// so tests need neither GPUs nor a particular machine.
func resolveNProc(s string, gpus func() (int, error), cpus int) (int, error) {
	v := strings.TrimSpace(s)
	if n, err := strconv.Atoi(v); err == nil {
		if n < 1 {
			return 0, invalidf("%q: a node needs at least 1 worker", s)
		}
		return n, nil
	}
	switch v {
	case "cpu":
		return cpus, nil
	case "gpu", "auto":
		n, err := gpus()
		if err != nil {
			return 0, invalidf("%q: counting GPUs: %w", s, err)
		}
		if n > 0 {
			return n, nil
		}
		if v == "auto" {
			return cpus, nil
		}
		return 0, invalidf("%q: no NVIDIA GPU found (no /dev/nvidia<N>, or CUDA_VISIBLE_DEVICES hides them all)", s)
	}
	return 0, invalidf("%q is not a worker count: want an integer >= 1, auto, cpu or gpu", s)
}

// countGPUs counts NVIDIA device nodes (nvidia0, nvidia1, …) in dir. The
// driver creates one per GPU; nvidiactl, nvidia-uvm and the like are not
// GPUs. A missing dir counts as no GPU.
func countGPUs(dir string) (int, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		if num, ok := strings.CutPrefix(e.Name(), "nvidia"); ok && num != "" && isDigits(num) {
			n++
		}
	}
	return n, nil
}

// visibleGPUs is the number of GPUs CUDA would show: the device nodes in
// dir, narrowed by CUDA_VISIBLE_DEVICES when set. CUDA reads that list up
// to its first invalid entry: an index out of range, a negative one,
// anything else that is neither an index nor a GPU-/MIG- UUID. "" hides
// every GPU. UUIDs are taken on trust (checking them needs NVML).
func visibleGPUs(dir, visible string, set bool) (int, error) {
	n, err := countGPUs(dir)
	if err != nil || !set || n == 0 {
		return n, err
	}
	count := 0
	for _, entry := range strings.Split(visible, ",") {
		entry = strings.TrimSpace(entry)
		if i, err := strconv.Atoi(entry); err == nil {
			if i < 0 || i >= n {
				break
			}
		} else if !strings.HasPrefix(entry, "GPU-") && !strings.HasPrefix(entry, "MIG-") {
			break
		}
		count++
	}
	return min(count, n), nil
}

func isDigits(s string) bool {
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}
