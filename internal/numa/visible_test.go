package numa

import (
	"errors"
	"strings"
	"testing"
)

func TestVisible(t *testing.T) {
	gpus := []GPU{
		{Addr: "0000:18:00.0", UUID: "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"},
		{Addr: "0000:2a:00.0", UUID: "GPU-8933aaaa-0000-0000-0000-000000000000"},
		{Addr: "0000:3a:00.0", UUID: "GPU-1234bbbb-0000-0000-0000-000000000000"},
	}
	for _, tc := range []struct {
		value string
		set   bool
		want  string // addresses' buses, in device order
	}{
		{"", false, "18 2a 3a"},
		{"", true, ""},
		{"2,0", true, "3a 18"},
		{" 1 , 2", true, "2a 3a"},
		{"0,1,-1,2", true, "18 2a"}, // CUDA stops at the first invalid entry
		{"0,7,1", true, "18"},
		{"1,1,2", true, "2a"},
		{"x,0", true, ""},
		{"GPU-1234,0", true, "3a 18"},
		{"gpu-8932F937,2", true, "18 3a"},
		{"GPU-893,2", true, ""}, // an ambiguous prefix names no GPU
	} {
		got, err := Visible(gpus, tc.value, tc.set)
		if err != nil {
			t.Errorf("Visible(%q) = %v", tc.value, err)
			continue
		}
		var buses []string
		for _, g := range got {
			buses = append(buses, g.Addr[5:7])
		}
		if strings.Join(buses, " ") != tc.want {
			t.Errorf("Visible(%q, %v) = %v, want %s", tc.value, tc.set, buses, tc.want)
		}
	}
	if _, err := Visible(gpus, "MIG-4f2e1c7a-0000-0000-0000-000000000000", true); !errors.Is(err, ErrNoGPU) || !strings.Contains(err.Error(), "MIG") {
		t.Errorf("MIG entry: %v", err)
	}
	noUUIDs := []GPU{{Addr: "0000:18:00.0"}}
	if _, err := Visible(noUUIDs, "GPU-8932", true); !errors.Is(err, ErrNoGPU) || !strings.Contains(err.Error(), "/proc/driver/nvidia") {
		t.Errorf("UUID without driver information: %v", err)
	}
}

// TestLoadUUIDs: UUIDs come from the driver's information files.
func TestLoadUUIDs(t *testing.T) {
	m := fakeMachine{sockets: 1, nodesPerSocket: 1, coresPerNode: 1, threads: 1, gpus: []fakeGPU{gpu("0000:01:00.0", 0), gpu("0000:02:00.0", 0)}}
	m.gpus[1].uuid = "GPU-abcdef01-0000-0000-0000-000000000000"
	topo := load(t, &m)
	if topo.GPUs[0].UUID != "" || topo.GPUs[1].UUID != m.gpus[1].uuid {
		t.Fatalf("UUIDs %q %q", topo.GPUs[0].UUID, topo.GPUs[1].UUID)
	}
	got, err := Visible(topo.GPUs, "GPU-abcdef01", true)
	if err != nil || len(got) != 1 || got[0].Addr != "0000:02:00.0" {
		t.Fatalf("Visible by UUID = %v, %v", got, err)
	}
}
