package cgroup

import (
	"strings"
	"testing"
)

func TestResolve(t *testing.T) {
	const hybrid = `25 1 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
31 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
`
	cases := []struct {
		name, cgroup, mountinfo string
		want                    Self
	}{
		{"hybrid, v1 memory in a child", "4:memory:/process_api/abc\n2:cpu,cpuacct:/\n0::/\n", hybrid,
			Self{V2: "/sys/fs/cgroup/unified", V1Memory: "/sys/fs/cgroup/memory/process_api/abc"}},
		{"pure v2", "0::/system.slice/job.service\n",
			"22 1 0:20 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
			Self{V2: "/sys/fs/cgroup/system.slice/job.service"}},
		{"a container's cgroup namespace: the mount's root is its own", "0::/\n",
			"700 600 0:20 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n",
			Self{V2: "/sys/fs/cgroup"}},
		{"a bind mount of a subtree", "0::/kubepods/pod1/c1\n",
			"700 600 0:20 /kubepods/pod1 /cg rw - cgroup2 cgroup rw\n",
			Self{V2: "/cg/c1"}},
		{"a mount that does not hold the path", "0::/a/b\n",
			"700 600 0:20 /c /cg rw - cgroup2 cgroup rw\n",
			Self{}},
		{"no v2 hierarchy holds it", "4:memory:/\n", hybrid,
			Self{V1Memory: "/sys/fs/cgroup/memory"}},
		{"an escaped space in the mount point", "0::/x\n",
			`700 600 0:20 / /mnt/with\040space rw - cgroup2 cgroup rw` + "\n",
			Self{V2: "/mnt/with space/x"}},
		{"optional fields before the separator", "0::/x\n",
			"700 600 0:20 / /cg rw shared:1 master:2 - cgroup2 cgroup rw\n",
			Self{V2: "/cg/x"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			paths, err := parseCgroupFile(strings.NewReader(tc.cgroup))
			if err != nil {
				t.Fatal(err)
			}
			mounts, err := parseMountinfo(strings.NewReader(tc.mountinfo))
			if err != nil {
				t.Fatal(err)
			}
			if got := resolve(paths, mounts); got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestParseMalformed(t *testing.T) {
	if _, err := parseCgroupFile(strings.NewReader("garbage\n")); err == nil {
		t.Error("a cgroup line without colons parsed")
	}
	if _, err := parseMountinfo(strings.NewReader("1 2 3:4 / /x rw no separator here\n")); err == nil {
		t.Error("a mountinfo line without the separator parsed")
	}
}

func TestParseCounter(t *testing.T) {
	cases := []struct {
		name, in, key string
		want          int64
		ok            bool
	}{
		{"v2 memory.events", "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n", "oom_kill", 2, true},
		{"v1 memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n", "oom_kill", 7, true},
		{"a key that is a prefix of another", "oom_kill_disable 0\n", "oom_kill", 0, false},
		{"missing", "low 0\n", "oom_kill", 0, false},
		{"not a number", "oom_kill x\n", "oom_kill", 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseCounter([]byte(tc.in), tc.key)
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("got %d, %v; want %d, ok %v", got, err, tc.want, tc.ok)
			}
		})
	}
}
