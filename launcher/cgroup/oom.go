package cgroup

import "path/filepath"

// OOMCounter reads how many processes the kernel's OOM killer has killed
// in a cgroup and below it: memory.events' oom_kill on v2,
// memory.oom_control's on v1 (Linux 4.13 and later). The agent reads its
// own, where it cannot give each worker a memory cgroup (a container's
// read-only cgroup file system): a worker that died of SIGKILL while the
// count went up was, as far as anyone can tell, the OOM killer's.
type OOMCounter struct {
	path string
}

// OwnOOMCounter is the counter of the memory cgroup s holds: v2's where
// it has memory.events, else v1's; ok is false where neither is readable.
func OwnOOMCounter(s Self) (c OOMCounter, ok bool) {
	for _, path := range []string{
		cgroupFile(s.V2, "memory.events"),
		cgroupFile(s.V1Memory, "memory.oom_control"),
	} {
		if path == "" {
			continue
		}
		if _, err := readCounter(path, "oom_kill"); err == nil {
			return OOMCounter{path}, true
		}
	}
	return OOMCounter{}, false
}

func cgroupFile(dir, file string) string {
	if dir == "" {
		return ""
	}
	return filepath.Join(dir, file)
}

// Path is the file the counter reads.
func (c OOMCounter) Path() string { return c.path }

// Read returns the count; 0 and false when it cannot be read.
func (c OOMCounter) Read() (int64, bool) {
	if c.path == "" {
		return 0, false
	}
	n, err := readCounter(c.path, "oom_kill")
	return n, err == nil
}
