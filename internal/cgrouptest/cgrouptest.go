// Package cgrouptest gives tests a cgroup v2 directory they may write,
// with cgroup.kill: the test process's own cgroup v2, or a cgroup2 file
// system the test mounts itself where none is mounted (root only).
package cgrouptest

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/gorunhq/gorun/launcher/cgroup"
)

// V2 returns the directory of this process's cgroup v2, mounting a
// cgroup2 file system first if none shows it. It skips the test when
// there is no way to get one — or fails it when GORUN_CI=1, where the
// machine is known to allow it. A mount it made is unmounted at cleanup.
func V2(t testing.TB) string {
	t.Helper()
	self, err := cgroup.Locate()
	if err != nil {
		unavailable(t, "locate this process's cgroups: "+err.Error())
	}
	if self.V2 == "" {
		point := t.TempDir()
		if err := syscall.Mount("cgroup2", point, "cgroup2", 0, ""); err != nil {
			unavailable(t, "mount cgroup2: "+err.Error())
		}
		t.Cleanup(func() { syscall.Unmount(point, syscall.MNT_DETACH) })
		if self, err = cgroup.Locate(); err != nil || self.V2 == "" {
			unavailable(t, "a cgroup2 mount does not show this process's cgroup")
		}
	}
	probe := filepath.Join(self.V2, "gorun-probe-"+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(probe, 0o755); err != nil {
		unavailable(t, "cgroup v2 not writable: "+err.Error())
	}
	defer os.Remove(probe)
	if _, err := os.Stat(filepath.Join(probe, "cgroup.kill")); err != nil {
		unavailable(t, "cgroup v2 without cgroup.kill")
	}
	return self.V2
}

// V1Memory returns this process's v1 memory cgroup directory, writable,
// or skips (fails in CI) the test.
func V1Memory(t testing.TB) string {
	t.Helper()
	self, err := cgroup.Locate()
	if err != nil || self.V1Memory == "" {
		unavailable(t, "no v1 memory cgroup")
	}
	probe := filepath.Join(self.V1Memory, "gorun-probe-"+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(probe, 0o755); err != nil {
		unavailable(t, "v1 memory cgroup not writable: "+err.Error())
	}
	os.Remove(probe)
	return self.V1Memory
}

func unavailable(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("GORUN_CI") == "1" {
		t.Fatalf("GORUN_CI=1 and %s", why)
	}
	t.Skip(why)
}
