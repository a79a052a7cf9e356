package numa

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Errors a binding that cannot be honoured matches (errors.Is).
var (
	// ErrNoGPU: no GPU for a local rank (none at all, or fewer visible
	// than local ranks).
	ErrNoGPU = errors.New("no GPU for the local rank")
	// ErrNoNUMAInfo: the kernel does not say where a GPU or CPU sits
	// (no NUMA nodes in sysfs, no numa_node for the GPU, no core or
	// cache topology for a CPU).
	ErrNoNUMAInfo = errors.New("no NUMA topology")
	// ErrTooFewCPUs: the mode leaves a worker no CPU (exclusive mode with
	// more GPUs on a node than physical cores this process may use, or a
	// node with none it may use).
	ErrTooFewCPUs = errors.New("too few CPUs")
)

// cannotError is a binding that cannot be honoured: its text says why in
// full and does not repeat the sentinel's, which errors.Is still finds.
type cannotError struct {
	kind error
	msg  string
}

func (e *cannotError) Error() string { return e.msg }
func (e *cannotError) Unwrap() error { return e.kind }

// cannot builds a cannotError of kind (ErrNoGPU, ErrNoNUMAInfo or
// ErrTooFewCPUs).
func cannot(kind error, format string, args ...any) error {
	return &cannotError{kind: kind, msg: fmt.Sprintf(format, args...)}
}

// nvidiaVendor is NVIDIA's PCI vendor id, and gpuClasses the PCI classes
// (class code and subclass) of a GPU's function: VGA-compatible or 3D
// controller. NVSwitches (bridges), the boards' audio and USB functions
// share the vendor and are left out by class.
const nvidiaVendor = "0x10de"

var gpuClasses = []string{"0x0300", "0x0302"}

// GPU is one NVIDIA GPU's PCI function.
type GPU struct {
	// Addr is its PCI address, as sysfs names it: "0000:17:00.0".
	Addr string
	// Node is its NUMA node from numa_node; the kernel's -1 (no
	// affinity, usual on a single-node machine) is taken for node 0, as
	// PyTorch does. -1 here means the file is missing: unknown.
	Node int
	// UUID is the driver's "GPU-…" id, "" when the driver does not say
	// (no /proc/driver/nvidia).
	UUID string
}

// CPU is where a logical CPU sits. Each field is -1 when sysfs does not
// say; a mode that needs it then fails with ErrNoNUMAInfo.
type CPU struct {
	// Package is its socket (topology/physical_package_id).
	Package int
	// Core names its physical core: the lowest logical CPU among its
	// thread siblings (topology/thread_siblings_list).
	Core int
	// Cache names its largest data or unified cache (the L3 a core
	// complex shares): the lowest logical CPU sharing it.
	Cache int
}

// Topology is what a binding is computed from.
type Topology struct {
	// Nodes maps each NUMA node with a sysfs directory to its CPUs
	// (empty for a memory-only node).
	Nodes map[int][]int
	// CPUs describes every CPU of Nodes.
	CPUs map[int]CPU
	// GPUs are the machine's NVIDIA GPUs in PCI address order.
	GPUs []GPU
}

// Load reads the topology under root ("/" for this machine). Missing
// files are not errors here: they leave the fields unknown, and only a
// mode that needs one fails. A file that exists but cannot be read or
// parsed is an error.
func Load(root string) (*Topology, error) {
	t := &Topology{Nodes: map[int][]int{}, CPUs: map[int]CPU{}}
	if err := t.loadNodes(root); err != nil {
		return nil, err
	}
	for _, cpus := range t.Nodes {
		for _, c := range cpus {
			cpu, err := loadCPU(root, c)
			if err != nil {
				return nil, err
			}
			t.CPUs[c] = cpu
		}
	}
	gpus, err := loadGPUs(root)
	if err != nil {
		return nil, err
	}
	t.GPUs = gpus
	return t, nil
}

func (t *Topology) loadNodes(root string) error {
	dir := filepath.Join(root, "sys/devices/system/node")
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // a kernel without NUMA: Bind says so
	} else if err != nil {
		return fmt.Errorf("NUMA nodes: %w", err)
	}
	for _, e := range entries {
		n, ok := numbered(e.Name(), "node")
		if !ok {
			continue
		}
		cpus, _, err := readList(filepath.Join(dir, e.Name(), "cpulist"))
		if err != nil {
			return err
		}
		t.Nodes[n] = cpus
	}
	return nil
}

func loadCPU(root string, c int) (CPU, error) {
	dir := filepath.Join(root, "sys/devices/system/cpu", "cpu"+strconv.Itoa(c))
	cpu := CPU{Package: -1, Core: -1, Cache: -1}
	pkg, ok, err := readInt(filepath.Join(dir, "topology/physical_package_id"))
	if err != nil {
		return cpu, err
	} else if ok {
		cpu.Package = pkg
	}
	if sib, ok, err := readList(filepath.Join(dir, "topology/thread_siblings_list")); err != nil {
		return cpu, err
	} else if ok && len(sib) > 0 {
		cpu.Core = sib[0]
	}
	shared, err := largestCache(filepath.Join(dir, "cache"))
	if err != nil {
		return cpu, err
	}
	if len(shared) > 0 {
		cpu.Cache = shared[0]
	}
	return cpu, nil
}

// largestCache returns the CPUs sharing the highest-level data or
// unified cache under dir (a CPU's cache directory), nil when none is
// listed. At equal levels the lowest index wins, as PyTorch's scan in
// directory order keeps the first.
func largestCache(dir string) ([]int, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("CPU caches: %w", err)
	}
	type index struct{ k, level int }
	var idx []index
	for _, e := range entries {
		k, ok := numbered(e.Name(), "index")
		if !ok {
			continue
		}
		typ, err := os.ReadFile(filepath.Join(dir, e.Name(), "type"))
		if err != nil {
			return nil, fmt.Errorf("CPU cache: %w", err)
		}
		// Instruction caches are not where a worker's data lives.
		if t := strings.TrimSpace(string(typ)); t != "Unified" && t != "Data" {
			continue
		}
		level, _, err := readInt(filepath.Join(dir, e.Name(), "level"))
		if err != nil {
			return nil, err
		}
		idx = append(idx, index{k, level})
	}
	if len(idx) == 0 {
		return nil, nil
	}
	best := slices.MinFunc(idx, func(a, b index) int {
		if a.level != b.level {
			return b.level - a.level // higher level first
		}
		return a.k - b.k
	})
	shared, _, err := readList(filepath.Join(dir, "index"+strconv.Itoa(best.k), "shared_cpu_list"))
	return shared, err
}

func loadGPUs(root string) ([]GPU, error) {
	dir := filepath.Join(root, "sys/bus/pci/devices")
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("PCI devices: %w", err)
	}
	var gpus []GPU
	for _, e := range entries {
		dev := filepath.Join(dir, e.Name())
		vendor, err := os.ReadFile(filepath.Join(dev, "vendor"))
		if err != nil || strings.TrimSpace(string(vendor)) != nvidiaVendor {
			continue // not NVIDIA's, or a device gone meanwhile
		}
		class, err := os.ReadFile(filepath.Join(dev, "class"))
		if err != nil || !slices.ContainsFunc(gpuClasses, func(p string) bool {
			return strings.HasPrefix(strings.TrimSpace(string(class)), p)
		}) {
			continue
		}
		g := GPU{Addr: e.Name(), Node: -1}
		node, ok, err := readInt(filepath.Join(dev, "numa_node"))
		if err != nil {
			return nil, err
		}
		if ok {
			g.Node = max(node, 0)
		}
		g.UUID = gpuUUID(filepath.Join(root, "proc/driver/nvidia/gpus", e.Name(), "information"))
		gpus = append(gpus, g)
	}
	// Fixed-width lower-case hex: text order is PCI bus order.
	slices.SortFunc(gpus, func(a, b GPU) int { return strings.Compare(a.Addr, b.Addr) })
	return gpus, nil
}

// gpuUUID reads the "GPU UUID:" line of the driver's information file;
// "" when there is none.
func gpuUUID(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "GPU UUID" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// numbered parses names like "node3" or "index2".
func numbered(name, prefix string) (int, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok || rest == "" || strings.TrimLeft(rest, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil
}

// readList reads a list file; ok is false when it does not exist.
func readList(path string) (xs []int, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	} else if err != nil {
		return nil, false, err
	}
	if xs, err = ParseList(string(b)); err != nil {
		return nil, false, fmt.Errorf("%s: %w", path, err)
	}
	return xs, true, nil
}

// readInt reads a file holding one integer; ok is false when it does not
// exist.
func readInt(path string) (n int, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, false, nil
	} else if err != nil {
		return 0, false, err
	}
	if n, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
		return 0, false, fmt.Errorf("%s: %w", path, err)
	}
	return n, true, nil
}
