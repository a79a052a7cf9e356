package numa

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Visible returns the GPUs that CUDA shows a process whose
// CUDA_VISIBLE_DEVICES is value, in CUDA's device order (device i is
// the i-th); set is false when the variable is unset, which shows every
// GPU in gpus.
//
// CUDA's rules: entries are separated by commas, each a device index or
// a GPU UUID ("GPU-…", a unique prefix is enough); enumeration stops at
// the first entry that is malformed, names no GPU or repeats an earlier
// one, so "0,1,-1,2" shows two devices and "" none. MIG instances
// ("MIG-…") cannot be placed without the driver's library and are an
// error.
func Visible(gpus []GPU, value string, set bool) ([]GPU, error) {
	if !set {
		return gpus, nil
	}
	var out []GPU
	for _, entry := range strings.Split(value, ",") {
		entry = strings.TrimSpace(entry)
		g, ok, err := visibleEntry(gpus, entry)
		if err != nil {
			return nil, fmt.Errorf("CUDA_VISIBLE_DEVICES=%q: %w", value, err)
		}
		if !ok || slices.Contains(out, g) {
			break
		}
		out = append(out, g)
	}
	return out, nil
}

// visibleEntry resolves one CUDA_VISIBLE_DEVICES entry; ok is false when
// CUDA would stop there.
func visibleEntry(gpus []GPU, entry string) (g GPU, ok bool, err error) {
	switch {
	case hasPrefixFold(entry, "MIG-"):
		return g, false, cannot(ErrNoGPU, "MIG instance %s cannot be placed on a NUMA node without NVML; name its GPU instead", entry)
	case hasPrefixFold(entry, "GPU-"):
		if !slices.ContainsFunc(gpus, func(g GPU) bool { return g.UUID != "" }) {
			return g, false, cannot(ErrNoGPU, "%s is a GPU UUID, but the driver gives none (/proc/driver/nvidia/gpus/*/information)", entry)
		}
		var found []GPU
		for _, g := range gpus {
			if hasPrefixFold(g.UUID, entry) {
				found = append(found, g)
			}
		}
		if len(found) != 1 {
			return g, false, nil // none, or an ambiguous prefix
		}
		return found[0], true, nil
	}
	i, err := strconv.Atoi(entry)
	if err != nil || i < 0 || i >= len(gpus) {
		return g, false, nil
	}
	return gpus[i], true, nil
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}
