package numa

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
)

// fakeGPU is one PCI function of a fake machine.
type fakeGPU struct {
	addr, vendor, class string
	numa                string // "" for no numa_node file
	uuid                string // "" for no driver information file
}

func gpu(addr string, node int) fakeGPU {
	return fakeGPU{addr: addr, vendor: "0x10de", class: "0x030200", numa: strconv.Itoa(node)}
}

// fakeMachine describes a sysfs tree. Its CPUs are numbered as Linux
// numbers them on x86 servers: the first hardware thread of every core
// (cores in node order), then the second threads in the same order.
type fakeMachine struct {
	sockets, nodesPerSocket, coresPerNode, threads int
	coresPerL3                                     int // 0: no cache directories
	noNodes                                        bool
	extraNodes                                     map[int]string // node → cpulist, e.g. memory-only nodes
	gpus                                           []fakeGPU
}

func (m fakeMachine) cores() int { return m.sockets * m.nodesPerSocket * m.coresPerNode }

// cpu is the logical CPU of thread th of core c.
func (m fakeMachine) cpu(c, th int) int { return th*m.cores() + c }

// write lays the machine out under a new temporary root.
func (m fakeMachine) write(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	put := func(path, content string) {
		t.Helper()
		p := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	list := func(c0, n int) string { // the threads of cores c0 … c0+n-1
		var xs []int
		for th := range m.threads {
			for c := c0; c < c0+n; c++ {
				xs = append(xs, m.cpu(c, th))
			}
		}
		return FormatList(sortedCopy(xs))
	}
	for node := range m.sockets * m.nodesPerSocket {
		if !m.noNodes {
			put("sys/devices/system/node/node"+strconv.Itoa(node)+"/cpulist", list(node*m.coresPerNode, m.coresPerNode))
		}
	}
	for node, cpus := range m.extraNodes {
		put("sys/devices/system/node/node"+strconv.Itoa(node)+"/cpulist", cpus)
	}
	for c := range m.cores() {
		socket := c / (m.nodesPerSocket * m.coresPerNode)
		for th := range m.threads {
			dir := "sys/devices/system/cpu/cpu" + strconv.Itoa(m.cpu(c, th))
			put(dir+"/topology/physical_package_id", strconv.Itoa(socket))
			put(dir+"/topology/thread_siblings_list", list(c, 1))
			if m.coresPerL3 == 0 {
				continue
			}
			l3 := c / m.coresPerL3 * m.coresPerL3
			for i, idx := range []struct{ typ, level, shared string }{
				{"Data", "1", list(c, 1)},
				{"Instruction", "1", list(c, 1)},
				{"Unified", "2", list(c, 1)},
				{"Unified", "3", list(l3, m.coresPerL3)},
			} {
				k := dir + "/cache/index" + strconv.Itoa(i)
				put(k+"/type", idx.typ)
				put(k+"/level", idx.level)
				put(k+"/shared_cpu_list", idx.shared)
			}
		}
	}
	for _, g := range m.gpus {
		dir := "sys/bus/pci/devices/" + g.addr
		put(dir+"/vendor", g.vendor)
		put(dir+"/class", g.class)
		if g.numa != "" {
			put(dir+"/numa_node", g.numa)
		}
		if g.uuid != "" {
			put("proc/driver/nvidia/gpus/"+g.addr+"/information",
				"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t "+g.uuid+"\nVideo BIOS: \t ??.??.??.??.??")
		}
	}
	return root
}

func sortedCopy(xs []int) []int {
	out := slices.Clone(xs)
	slices.Sort(out)
	return slices.Compact(out)
}

func mustList(t *testing.T, s string) []int {
	t.Helper()
	xs, err := ParseList(s)
	if err != nil {
		t.Fatal(err)
	}
	return xs
}

// loaded caches each machine's Topology: writing a tree of hundreds of
// files is what makes these tests slow, and a Topology is read-only.
var loaded = map[*fakeMachine]*Topology{}

// load writes m and loads it, once per machine.
func load(t *testing.T, m *fakeMachine) *Topology {
	t.Helper()
	if topo := loaded[m]; topo != nil {
		return topo
	}
	topo, err := Load(m.write(t))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	loaded[m] = topo
	return topo
}
