package sidbed

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestMirrorIn(t *testing.T) {
	cases := []struct {
		name, body, want string
	}{
		{"deb822 with a security archive after", "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n", "http://deb.debian.org/debian"},
		{"deb822 security only", "Types: deb\nURIs: http://deb.debian.org/debian-security/\n", ""},
		{"one-line with options", "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n", "http://mirror.example/debian"},
		{"one-line other archive", "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n", ""},
		{"commented out", "# deb http://deb.debian.org/debian bookworm main\n", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "sources")
			if err := os.WriteFile(p, []byte(tc.body), 0o644); err != nil {
				t.Fatal(err)
			}
			if got := mirrorIn(p); got != tc.want {
				t.Fatalf("mirrorIn = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestUpstreamVersion(t *testing.T) {
	for in, want := range map[string]string{
		"2.29.7-1-1":    "2.29.7",
		"2.14.1+dfsg-1": "2.14.1",
		"1:2.4.6+ds-5":  "2.4.6",
		"3.0":           "3.0",
	} {
		if got := upstreamVersion(in); got != want {
			t.Errorf("upstreamVersion(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestFindAtRefusesOtherFormats(t *testing.T) {
	d := t.TempDir()
	if _, err := FindAt(d); err == nil {
		t.Fatal("FindAt found a bed in an empty directory")
	}
	if err := os.WriteFile(filepath.Join(d, "stamp.json"), []byte(`{"format": 0}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := FindAt(d); err == nil || !strings.Contains(err.Error(), "format 0") {
		t.Fatalf("FindAt with an old stamp: %v, want a format error", err)
	}
}

// bedMounts returns the host's mounts under the bed.
func bedMounts(t *testing.T, bed *Bed) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], bed.Dir) {
			out = append(out, f[4])
		}
	}
	return out
}

// TestBedRuns: a program in the bed sees the host's /etc/hosts and temp
// directory (same path, same working directory), the bed's own Debian sid,
// torch with the classic TCPStore backend as its default, and the host has
// no mount of the bed afterwards, even when a run is killed.
func TestBedRuns(t *testing.T) {
	bed := Require(t)
	if m := bedMounts(t, bed); len(m) > 0 {
		t.Fatalf("mounts under the bed before the test: %q", m)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "in"), []byte("from the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := bed.Command(ctx, "/usr/bin/python3", "-c", `
import os, socket, torch.distributed as d
print(open("in").read())
print(os.getcwd())
print(open("/etc/hosts").read() == open(os.environ["HOSTS_COPY"]).read())
print(open("/etc/debian_version").read().strip())
s = d.TCPStore("127.0.0.1", 0, None, True)
print("libuv", s.libuvBackend)
open("out", "w").write("from the bed")
`)
	hosts, err := os.ReadFile("/etc/hosts")
	if err != nil {
		t.Fatal(err)
	}
	hostsCopy := filepath.Join(dir, "hosts")
	if err := os.WriteFile(hostsCopy, hosts, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "HOSTS_COPY="+hostsCopy)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python in the bed: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 5 || lines[0] != "from the host" || lines[1] != dir || lines[2] != "True" ||
		!strings.Contains(lines[3], "sid") || lines[4] != "libuv False" {
		t.Fatalf("python in the bed printed %q", lines)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "out")); err != nil || string(b) != "from the bed" {
		t.Fatalf("file written in the bed: %q, %v", b, err)
	}

	// A run killed while it holds its mounts leaves none behind.
	sleeper := bed.Command(ctx, "/bin/sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	// enter, unshare, sh and chroot each exec the next: the PID the caller
	// started becomes the program's, so signals reach it.
	comm := filepath.Join("/proc", strconv.Itoa(sleeper.Process.Pid), "comm")
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(comm)
		if strings.TrimSpace(string(b)) == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			_ = sleeper.Process.Kill()
			_ = sleeper.Wait()
			t.Fatalf("the started PID runs %q, not sleep", b)
		}
	}
	if len(bedMounts(t, bed)) > 0 {
		t.Errorf("the running program's mounts are visible on the host")
	}
	_ = sleeper.Process.Signal(syscall.SIGKILL)
	_ = sleeper.Wait()
	if m := bedMounts(t, bed); len(m) > 0 {
		t.Fatalf("mounts under the bed after a killed run: %q", m)
	}
}
