package launcher

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// TestSweepHeartbeatDirs: an agent removes the heartbeat directories that
// killed agents left behind, and only those: not a live agent's, not one
// just made (its agent may be about to bind), not one holding what an
// agent does not make, not what is not a directory.
func TestSweepHeartbeatDirs(t *testing.T) {
	tmp := t.TempDir()
	now := time.Now()
	old := now.Add(-2 * staleHeartbeatAge)
	mkdir := func(name string, mtime time.Time, sock string) string {
		t.Helper()
		dir := filepath.Join(tmp, name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "hb.sock")
		switch sock {
		case "live", "dead":
			c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
			if err != nil {
				t.Fatal(err)
			}
			if sock == "live" {
				t.Cleanup(func() { c.Close() })
			} else {
				c.Close() // the file stays, as a SIGKILLed agent leaves it
			}
		case "file":
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chtimes(dir, mtime, mtime); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	killed := mkdir(heartbeatDirPrefix+"killed", old, "dead")
	unbound := mkdir(heartbeatDirPrefix+"unbound", old, "")
	live := mkdir(heartbeatDirPrefix+"live", old, "live")
	young := mkdir(heartbeatDirPrefix+"young", now, "dead")
	notSocket := mkdir(heartbeatDirPrefix+"notsocket", old, "file")
	other := mkdir("torchelastic_x", old, "dead")
	plain := filepath.Join(tmp, heartbeatDirPrefix+"plainfile")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(plain, old, old); err != nil {
		t.Fatal(err)
	}

	got := sweepHeartbeatDirs(tmp, now)
	slices.Sort(got)
	if want := []string{killed, unbound}; !slices.Equal(got, want) {
		t.Errorf("removed %v, want %v", got, want)
	}
	for _, p := range []string{live, young, notSocket, other, plain} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s: %v, want it kept", p, err)
		}
	}
	for _, p := range []string{killed, unbound} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s: %v, want it removed", p, err)
		}
	}
}
