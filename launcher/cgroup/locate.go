// Package cgroup confines each worker, and everything it starts, to a
// cgroup v2 of its own, so that the agent can end all of it at once
// (cgroup.kill) — a daemon that called setsid, or one re-parented past the
// agent, included — and can tell an OOM kill from any other SIGKILL.
//
// The layout is a Jail per agent (a directory under a cgroup the agent
// may write, by default its own) holding a Slot per worker start. A
// worker is cloned straight into its slot (CLONE_INTO_CGROUP), so there is
// no moment at which a child of it could start outside. A Guard, a small
// process of the agent's own binary, holds a pipe from the agent and kills
// the jail when the agent dies without cleaning up (SIGKILL, a crash).
//
// Only cgroup v2 has cgroup.kill (Linux 5.14); on a machine with v1
// hierarchies alone, or where no v2 cgroup is writable (a container's
// read-only /sys/fs/cgroup), there is no jail, and OOM kills are still
// recognised from the agent's own memory cgroup, v2 or v1 (OOMCounter).
package cgroup

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Self is where this process sits in the cgroup hierarchies.
type Self struct {
	// V2 is the directory of its cgroup v2 ("" when no cgroup2 file system
	// holding it is mounted).
	V2 string
	// V1Memory is the directory of its cgroup in a v1 memory hierarchy
	// ("" when there is none).
	V1Memory string
}

// Locate finds this process's cgroups from /proc/self/cgroup and
// /proc/self/mountinfo.
func Locate() (Self, error) {
	cg, err := os.Open("/proc/self/cgroup")
	if err != nil {
		return Self{}, err
	}
	defer cg.Close()
	paths, err := parseCgroupFile(cg)
	if err != nil {
		return Self{}, err
	}
	mi, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return Self{}, err
	}
	defer mi.Close()
	mounts, err := parseMountinfo(mi)
	if err != nil {
		return Self{}, err
	}
	return resolve(paths, mounts), nil
}

// cgroupPaths is /proc/self/cgroup: the v2 path ("0::/x") and each v1
// controller's.
type cgroupPaths struct {
	v2    string // "" when the process is in no v2 hierarchy
	hasV2 bool
	v1    map[string]string // controller → path
}

// parseCgroupFile reads /proc/PID/cgroup: "ID:CONTROLLERS:PATH" lines,
// ID 0 with no controllers for v2.
func parseCgroupFile(r io.Reader) (cgroupPaths, error) {
	out := cgroupPaths{v1: map[string]string{}}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			return cgroupPaths{}, fmt.Errorf("cgroup file: malformed line %q", line)
		}
		if f[0] == "0" && f[1] == "" {
			out.v2, out.hasV2 = f[2], true
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			out.v1[c] = f[2]
		}
	}
	return out, sc.Err()
}

// mount is one line of mountinfo, the fields this package reads.
type mount struct {
	root, point, fstype string
	superOpts           []string
}

// parseMountinfo reads /proc/PID/mountinfo (proc(5)): "ID PARENT MAJ:MIN
// ROOT POINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS".
func parseMountinfo(r io.Reader) ([]mount, error) {
	var out []mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 6 || sep < 0 || sep+3 > len(f) {
			return nil, fmt.Errorf("mountinfo: malformed line %q", sc.Text())
		}
		out = append(out, mount{
			root:      unescapeMount(f[3]),
			point:     unescapeMount(f[4]),
			fstype:    f[sep+1],
			superOpts: strings.Split(f[sep+3], ","),
		})
	}
	return out, sc.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space, \011,
// \012, \134).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1:i+4]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(s string) bool {
	if len(s) != 3 {
		return false
	}
	for i := 0; i < 3; i++ {
		if s[i] < '0' || s[i] > '7' {
			return false
		}
	}
	return true
}

// resolve maps the process's cgroup paths to directories through the
// mounts that show them: a mount whose root is the path or above it.
func resolve(p cgroupPaths, mounts []mount) Self {
	var s Self
	if p.hasV2 {
		s.V2 = under(mounts, p.v2, func(m mount) bool { return m.fstype == "cgroup2" })
	}
	if path, ok := p.v1["memory"]; ok {
		s.V1Memory = under(mounts, path, func(m mount) bool {
			return m.fstype == "cgroup" && slices.Contains(m.superOpts, "memory")
		})
	}
	return s
}

// under returns the directory that shows cgroup path in the first mount
// that matches and holds it.
func under(mounts []mount, path string, match func(mount) bool) string {
	for _, m := range mounts {
		if !match(m) {
			continue
		}
		rel, err := filepath.Rel(m.root, path)
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		return filepath.Join(m.point, rel)
	}
	return ""
}

// ErrUnavailable is returned when no writable cgroup v2 with cgroup.kill
// can hold a jail.
var ErrUnavailable = errors.New("no writable cgroup v2 with cgroup.kill")
