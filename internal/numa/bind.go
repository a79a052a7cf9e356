package numa

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Mode is a --numa-binding mode (PyTorch's AffinityMode).
type Mode string

// The modes, as torch/numa/binding.py defines them. In every mode the
// worker of local rank i is placed by GPU i (its CUDA device index), and
// only CPUs the launcher itself may run on are used.
const (
	// Node: every CPU of the GPU's NUMA node.
	Node Mode = "node"
	// Socket: every CPU of every NUMA node on the GPU's socket.
	Socket Mode = "socket"
	// Exclusive: a disjoint share of the physical cores (with all their
	// hardware threads) of the GPU's node, split evenly among the GPUs
	// on that node, the first ones getting one more when it does not
	// divide.
	Exclusive Mode = "exclusive"
	// CoreComplex: the CPUs of one L3 cache domain of the GPU's node, a
	// different one per GPU on that node while there are enough (largest
	// domains first), then shared round-robin.
	CoreComplex Mode = "core-complex"
)

// Modes lists the modes in torchrun's order.
var Modes = []Mode{Node, Socket, Exclusive, CoreComplex}

// ParseMode reads a --numa-binding value.
func ParseMode(s string) (Mode, error) {
	if m := Mode(s); slices.Contains(Modes, m) {
		return m, nil
	}
	names := make([]string, len(Modes))
	for i, m := range Modes {
		names[i] = string(m)
	}
	return "", fmt.Errorf("%q is not a NUMA binding mode; want one of %s", s, strings.Join(names, ", "))
}

// Bind returns the sorted CPUs the worker using device (an index into
// gpus, the GPUs Visible shows; torchrun's device index is the local
// rank) is bound to under mode. allowed are the CPUs the launcher may
// run on (its own affinity): PyTorch intersects every node's CPUs with
// them, so that a launcher confined by taskset or a cpuset never binds a
// worker outside its bounds.
//
// The result is never empty: a binding that cannot be honoured is an
// error matching ErrNoGPU, ErrNoNUMAInfo or ErrTooFewCPUs.
func (t *Topology) Bind(mode Mode, gpus []GPU, device int, allowed []int) ([]int, error) {
	if _, err := ParseMode(string(mode)); err != nil {
		return nil, err
	}
	switch {
	case len(gpus) == 0:
		return nil, cannot(ErrNoGPU, "no NVIDIA GPU is visible (PCI vendor 0x10de under /sys/bus/pci/devices, then CUDA_VISIBLE_DEVICES)")
	case device < 0 || device >= len(gpus):
		return nil, cannot(ErrNoGPU, "local rank %d has no GPU: %d visible", device, len(gpus))
	case gpus[device].Node < 0:
		return nil, cannot(ErrNoNUMAInfo, "GPU %s has no numa_node in sysfs", gpus[device].Addr)
	}
	node := gpus[device].Node
	switch mode {
	case Node:
		return t.nodeCPUs(node, allowed)
	case Socket:
		return t.socketCPUs(node, allowed)
	}
	// The device's place among the visible GPUs on its node.
	var peers []int
	for i, g := range gpus {
		if g.Node == node {
			peers = append(peers, i)
		}
	}
	rel := slices.Index(peers, device)
	if mode == Exclusive {
		return t.exclusiveCPUs(node, allowed, rel, len(peers))
	}
	return t.coreComplexCPUs(node, allowed, rel)
}

// nodeCPUs are node's CPUs that are allowed; none is an error.
func (t *Topology) nodeCPUs(node int, allowed []int) ([]int, error) {
	cpus, ok := t.Nodes[node]
	switch {
	case len(t.Nodes) == 0:
		return nil, cannot(ErrNoNUMAInfo, "no NUMA nodes under /sys/devices/system/node (a kernel without NUMA support?)")
	case !ok:
		return nil, cannot(ErrNoNUMAInfo, "NUMA node %d is not under /sys/devices/system/node", node)
	}
	in := intersect(cpus, allowed)
	if len(in) == 0 {
		return nil, cannot(ErrTooFewCPUs, "NUMA node %d has no CPU this process may run on (node: %q, allowed: %q)",
			node, FormatList(cpus), FormatList(allowed))
	}
	return in, nil
}

// socketCPUs are the allowed CPUs of every node on the socket of node.
// A node's socket is that of its lowest allowed CPU, as in PyTorch;
// nodes without an allowed CPU (memory-only nodes, or outside the
// launcher's cpuset) belong to no socket here, where PyTorch fails on
// them.
func (t *Topology) socketCPUs(node int, allowed []int) ([]int, error) {
	own, err := t.nodeCPUs(node, allowed)
	if err != nil {
		return nil, err
	}
	socket := t.CPUs[own[0]].Package
	if socket < 0 {
		return nil, cannot(ErrNoNUMAInfo, "CPU %d has no topology/physical_package_id", own[0])
	}
	var out []int
	for _, n := range slices.Sorted(maps.Keys(t.Nodes)) {
		cpus := intersect(t.Nodes[n], allowed)
		if len(cpus) > 0 && t.CPUs[cpus[0]].Package == socket {
			out = append(out, cpus...)
		}
	}
	slices.Sort(out)
	return out, nil
}

// exclusiveCPUs gives the rel-th of n GPUs on node its share of the
// node's allowed physical cores, in core order: n shares of
// cores/n, the first cores%n one core larger.
func (t *Topology) exclusiveCPUs(node int, allowed []int, rel, n int) ([]int, error) {
	cores, err := t.nodeGroups(node, allowed, "topology/thread_siblings_list", func(c CPU) int { return c.Core })
	if err != nil {
		return nil, err
	}
	keys := slices.Sorted(maps.Keys(cores))
	per, extra := len(keys)/n, len(keys)%n
	if per < 1 {
		return nil, cannot(ErrTooFewCPUs, "NUMA node %d has %d physical cores this process may run on, for %d GPUs",
			node, len(keys), n)
	}
	start := rel*per + min(rel, extra)
	end := start + per
	if rel < extra {
		end++
	}
	var out []int
	for _, k := range keys[start:end] {
		out = append(out, cores[k]...)
	}
	slices.Sort(out)
	return out, nil
}

// coreComplexCPUs gives the rel-th GPU on node one of the node's L3
// domains (its allowed CPUs): domains with more allowed CPUs first, then
// by lowest CPU; wrapping around when there are more GPUs than domains.
func (t *Topology) coreComplexCPUs(node int, allowed []int, rel int) ([]int, error) {
	caches, err := t.nodeGroups(node, allowed, "a data or unified cache (cache/index*)", func(c CPU) int { return c.Cache })
	if err != nil {
		return nil, err
	}
	keys := slices.SortedFunc(maps.Keys(caches), func(a, b int) int {
		return cmp.Or(cmp.Compare(len(caches[b]), len(caches[a])), cmp.Compare(a, b))
	})
	return caches[keys[rel%len(keys)]], nil
}

// nodeGroups splits node's allowed CPUs by key(CPU) (their core, their
// cache); each group is sorted. A CPU whose key is unknown (-1) is an
// error naming what sysfs lacks.
func (t *Topology) nodeGroups(node int, allowed []int, what string, key func(CPU) int) (map[int][]int, error) {
	cpus, err := t.nodeCPUs(node, allowed)
	if err != nil {
		return nil, err
	}
	out := map[int][]int{}
	for _, c := range cpus {
		cpu, ok := t.CPUs[c]
		k := key(cpu)
		if !ok || k < 0 {
			return nil, cannot(ErrNoNUMAInfo, "CPU %d has no %s", c, what)
		}
		out[k] = append(out[k], c)
	}
	return out, nil
}
