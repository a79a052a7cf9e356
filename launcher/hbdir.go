package launcher

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// heartbeatDirPrefix names the directories of the agents' heartbeat
// sockets under the system's temporary directory.
const heartbeatDirPrefix = "gorun-hb-"

// staleHeartbeatAge: a heartbeat directory younger than this may be one an
// agent has just made and not yet bound its socket in.
const staleHeartbeatAge = time.Minute

// sweepHeartbeatDirs removes the heartbeat directories under tmp that
// agents killed without a chance to clean up (SIGKILL, the OOM killer) left
// behind: this user's, older than staleHeartbeatAge, whose socket no one
// reads or that never got one. A node whose
// agent is killed and started again would otherwise gather one per kill.
// It returns the paths removed.
func sweepHeartbeatDirs(tmp string, now time.Time) []string {
	dirs, err := filepath.Glob(filepath.Join(tmp, heartbeatDirPrefix+"*"))
	if err != nil {
		return nil // only a malformed pattern, which this is not
	}
	var removed []string
	for _, dir := range dirs {
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() || now.Sub(fi.ModTime()) < staleHeartbeatAge {
			continue
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Getuid() {
			continue
		}
		if !heartbeatDirDead(dir) {
			continue
		}
		if os.RemoveAll(dir) == nil {
			removed = append(removed, dir)
		}
	}
	return removed
}

// heartbeatDirDead reports whether dir is what an agent gone left: empty,
// or its socket alone with no one reading it (a connect is refused; it
// sends nothing, so a live agent's monitor sees no datagram). Anything
// else in it is not ours to remove.
func heartbeatDirDead(dir string) bool {
	entries, err := os.ReadDir(dir)
	switch {
	case err != nil || len(entries) > 1:
		return false
	case len(entries) == 0:
		return true
	case entries[0].Name() != "hb.sock" || entries[0].Type() != fs.ModeSocket:
		return false
	}
	path := filepath.Join(dir, "hb.sock")
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}
