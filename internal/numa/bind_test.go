package numa

import (
	"errors"
	"strings"
	"testing"
)

// twoSockets is a 2-socket server with 2 NUMA nodes per socket, 4 cores
// per node, 2 threads per core (32 CPUs: core c has CPUs c and c+16), an
// L3 per 2 cores, and 2 GPUs per node. Node n holds cores 4n…4n+3.
var twoSockets = fakeMachine{sockets: 2, nodesPerSocket: 2, coresPerNode: 4, threads: 2, coresPerL3: 2,
	gpus: []fakeGPU{
		// Created out of order: device order is PCI address order.
		gpu("0000:db:00.0", 3), gpu("0000:18:00.0", 0), gpu("0000:2a:00.0", 0),
		gpu("0000:3a:00.0", 1), gpu("0000:5d:00.0", 1), gpu("0000:9a:00.0", 2),
		gpu("0000:ab:00.0", 2), gpu("0000:ba:00.0", 3),
		// Not GPUs: an NVSwitch bridge, the board's audio function, and
		// another vendor's VGA controller.
		{addr: "0000:05:00.0", vendor: "0x10de", class: "0x068000", numa: "0"},
		{addr: "0000:18:00.1", vendor: "0x10de", class: "0x040300", numa: "0"},
		{addr: "0000:03:00.0", vendor: "0x1a03", class: "0x030000", numa: "0"},
	}}

func TestBind(t *testing.T) {
	uneven := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 5, threads: 1, coresPerL3: 5,
		gpus: []fakeGPU{gpu("0000:01:00.0", 0), gpu("0000:02:00.0", 0)}}
	// Three GPUs on a node of two L3 domains of 4 cores (8 CPUs, no SMT).
	complexes := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 8, threads: 1, coresPerL3: 4,
		gpus: []fakeGPU{gpu("0000:01:00.0", 0), gpu("0000:02:00.0", 0), gpu("0000:03:00.0", 0)}}
	// One node whose PCI devices have no affinity (-1): node 0.
	single := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 2, coresPerL3: 2,
		gpus: []fakeGPU{gpu("0000:01:00.0", -1), gpu("0000:02:00.0", -1)}}
	// A socket with a memory-only node (CXL, HBM): it has no CPUs.
	memOnly := fakeMachine{sockets: 1, nodesPerSocket: 2, coresPerNode: 2, threads: 1, coresPerL3: 2,
		extraNodes: map[int]string{2: ""}, gpus: []fakeGPU{gpu("0000:01:00.0", 1)}}
	all := mustList(t, "0-63")
	cases := []struct {
		name    string
		m       *fakeMachine
		mode    Mode
		device  int
		allowed string // "" for all
		want    string
	}{
		{"node first GPU", &twoSockets, Node, 0, "", "0-3,16-19"},
		{"node last GPU", &twoSockets, Node, 7, "", "12-15,28-31"},
		{"node allowed only", &twoSockets, Node, 0, "1-2,17,40", "1-2,17"},
		{"socket of node 1", &twoSockets, Socket, 2, "", "0-7,16-23"},
		{"socket of node 2", &twoSockets, Socket, 5, "", "8-15,24-31"},
		{"socket allowed only", &twoSockets, Socket, 0, "0,9,20", "0,20"},
		{"exclusive first on node", &twoSockets, Exclusive, 0, "", "0-1,16-17"},
		{"exclusive second on node", &twoSockets, Exclusive, 1, "", "2-3,18-19"},
		{"exclusive on node 3", &twoSockets, Exclusive, 7, "", "14-15,30-31"},
		// A core with one allowed thread counts as a core; cores not
		// allowed at all are not shared out.
		{"exclusive allowed only", &twoSockets, Exclusive, 1, "0-2,16", "2"},
		{"exclusive uneven first", &uneven, Exclusive, 0, "", "0-2"},
		{"exclusive uneven second", &uneven, Exclusive, 1, "", "3-4"},
		{"core-complex first", &twoSockets, CoreComplex, 0, "", "0-1,16-17"},
		{"core-complex second", &twoSockets, CoreComplex, 1, "", "2-3,18-19"},
		{"core-complex wraps", &complexes, CoreComplex, 2, "", "0-3"},
		{"core-complex one domain", &complexes, CoreComplex, 1, "", "4-7"},
		// The larger domain (more allowed CPUs) comes first.
		{"core-complex largest first", &complexes, CoreComplex, 0, "0,4-7", "4-7"},
		{"core-complex smaller second", &complexes, CoreComplex, 1, "0,4-7", "0"},
		{"no affinity is node 0", &single, Node, 1, "", "0-3"},
		{"no affinity exclusive", &single, Exclusive, 1, "", "1,3"},
		{"socket skips memory-only node", &memOnly, Socket, 0, "", "0-3"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			topo := load(t, tc.m)
			allowed := all
			if tc.allowed != "" {
				allowed = mustList(t, tc.allowed)
			}
			got, err := topo.Bind(tc.mode, topo.GPUs, tc.device, allowed)
			if err != nil {
				t.Fatalf("Bind(%s, %d): %v", tc.mode, tc.device, err)
			}
			if FormatList(got) != tc.want {
				t.Fatalf("Bind(%s, %d) = %s, want %s", tc.mode, tc.device, FormatList(got), tc.want)
			}
		})
	}
}

// TestBindDisjoint: exclusive mode gives the GPUs of a machine disjoint
// CPU sets that together cover every allowed core of their nodes.
func TestBindDisjoint(t *testing.T) {
	topo := load(t, &twoSockets)
	owner := map[int]int{}
	for dev := range topo.GPUs {
		cpus, err := topo.Bind(Exclusive, topo.GPUs, dev, mustList(t, "0-31"))
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cpus {
			if prev, taken := owner[c]; taken {
				t.Fatalf("CPU %d given to devices %d and %d", c, prev, dev)
			}
			owner[c] = dev
		}
	}
	if len(owner) != 32 {
		t.Fatalf("%d CPUs given out, want all 32", len(owner))
	}
}

func TestBindCannot(t *testing.T) {
	noCache := twoSockets
	noCache.coresPerL3 = 0
	noNodes := twoSockets
	noNodes.noNodes = true
	noNUMAFile := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 1,
		gpus: []fakeGPU{{addr: "0000:01:00.0", vendor: "0x10de", class: "0x030000"}}}
	crowded := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 2, coresPerL3: 2,
		gpus: []fakeGPU{gpu("0000:01:00.0", 0), gpu("0000:02:00.0", 0), gpu("0000:03:00.0", 0)}}
	noGPU := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 1}
	farGPU := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 1,
		gpus: []fakeGPU{gpu("0000:01:00.0", 5)}}
	cases := []struct {
		name    string
		m       *fakeMachine
		mode    Mode
		device  int
		allowed string
		want    error
		hint    string
	}{
		{"no GPU at all", &noGPU, Node, 0, "0-63", ErrNoGPU, "no NVIDIA GPU"},
		{"more ranks than GPUs", &twoSockets, Node, 8, "0-63", ErrNoGPU, "local rank 8 has no GPU: 8 visible"},
		{"no NUMA nodes", &noNodes, Node, 0, "0-63", ErrNoNUMAInfo, "no NUMA nodes"},
		{"GPU without numa_node", &noNUMAFile, Node, 0, "0-63", ErrNoNUMAInfo, "0000:01:00.0 has no numa_node"},
		{"GPU on a node sysfs lacks", &farGPU, Node, 0, "0-63", ErrNoNUMAInfo, "NUMA node 5"},
		{"no cache information", &noCache, CoreComplex, 0, "0-63", ErrNoNUMAInfo, "cache"},
		{"more GPUs than cores", &crowded, Exclusive, 0, "0-63", ErrTooFewCPUs, "2 physical cores this process may run on, for 3 GPUs"},
		{"node outside the allowed CPUs", &twoSockets, Node, 0, "8-15", ErrTooFewCPUs, "NUMA node 0 has no CPU"},
		{"socket outside the allowed CPUs", &twoSockets, Socket, 0, "8-15", ErrTooFewCPUs, "NUMA node 0 has no CPU"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			topo := load(t, tc.m)
			got, err := topo.Bind(tc.mode, topo.GPUs, tc.device, mustList(t, tc.allowed))
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.hint) {
				t.Fatalf("Bind = %v, %v; want an error matching %v, mentioning %q", got, err, tc.want, tc.hint)
			}
		})
	}
	// Without cache information the other modes still bind.
	topo := load(t, &noCache)
	if got, err := topo.Bind(Exclusive, topo.GPUs, 0, mustList(t, "0-63")); err != nil || FormatList(got) != "0-1,16-17" {
		t.Fatalf("exclusive without caches = %v, %v", got, err)
	}
	if _, err := topo.Bind("everywhere", topo.GPUs, 0, nil); err == nil || !strings.Contains(err.Error(), "want one of node, socket, exclusive, core-complex") {
		t.Fatalf("unknown mode: %v", err)
	}
}

func TestLoadGPUs(t *testing.T) {
	topo := load(t, &twoSockets)
	var addrs []string
	for _, g := range topo.GPUs {
		addrs = append(addrs, g.Addr)
	}
	want := "0000:18:00.0 0000:2a:00.0 0000:3a:00.0 0000:5d:00.0 0000:9a:00.0 0000:ab:00.0 0000:ba:00.0 0000:db:00.0"
	if strings.Join(addrs, " ") != want {
		t.Fatalf("GPUs %v, want %s", addrs, want)
	}
	if topo.GPUs[7].Node != 3 || topo.GPUs[0].Node != 0 {
		t.Fatalf("GPU nodes: %+v", topo.GPUs)
	}
}

// TestLoadMalformed: a file that exists but does not parse is an error,
// not a silently unknown field.
func TestLoadMalformed(t *testing.T) {
	root := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 2, threads: 1}.write(t)
	writeFile(t, root, "sys/devices/system/node/node0/cpulist", "0-x")
	if _, err := Load(root); err == nil || !strings.Contains(err.Error(), "cpulist") {
		t.Fatalf("Load = %v; want an error naming cpulist", err)
	}
}

func TestParseMode(t *testing.T) {
	for _, m := range []string{"node", "socket", "exclusive", "core-complex"} {
		if got, err := ParseMode(m); err != nil || string(got) != m {
			t.Errorf("ParseMode(%q) = %q, %v", m, got, err)
		}
	}
	for _, bad := range []string{"", "Node", "core_complex", "numa"} {
		if _, err := ParseMode(bad); err == nil {
			t.Errorf("ParseMode(%q) accepted", bad)
		}
	}
}
