package netns

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// tools are the paths of iproute2's programs.
type tools struct {
	ip, bridge string
}

var (
	checkOnce sync.Once
	found     tools
	missing   string // why this machine cannot hold a bed; "" when it can
)

// ErrUnavailable: this machine cannot hold a bed.
var ErrUnavailable = errors.New("netns: no test bed on this machine")

// Available returns nil when this machine can build a bed (root,
// iproute2's ip and bridge, network namespaces), and otherwise an error
// that matches ErrUnavailable and says what is missing. The check runs
// once per process.
func Available() error {
	checkOnce.Do(check)
	if missing != "" {
		return fmt.Errorf("%w: %s", ErrUnavailable, missing)
	}
	return nil
}

// Require returns when this machine can build a bed, and otherwise skips
// the test with one line saying why — or fails it when GORUN_CI=1, where
// nothing may be skipped silently.
func Require(t testing.TB) {
	t.Helper()
	if Available() != nil {
		if os.Getenv("GORUN_CI") == "1" {
			t.Fatalf("netns: %s", missing)
		}
		t.Skipf("netns tests skipped: %s", missing)
	}
}

func check() {
	if os.Geteuid() != 0 {
		missing = "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
		return
	}
	var t tools
	for _, tool := range []struct {
		name string
		path *string
	}{{"ip", &t.ip}, {"bridge", &t.bridge}} {
		p, err := exec.LookPath(tool.name)
		if err != nil {
			missing = fmt.Sprintf("no %s binary (install iproute2)", tool.name)
			return
		}
		*tool.path = p
	}
	if err := probeUnshare(); err != nil {
		missing = fmt.Sprintf("cannot create a network namespace: %v", err)
		return
	}
	found = t
}

// probeUnshare creates a network namespace and throws it away, to learn
// whether this kernel and container allow it, without leaving anything
// behind: the namespace belongs to a thread that is never unlocked, so the
// runtime ends the thread (and the namespace with it) when the goroutine
// returns.
func probeUnshare() error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		errc <- unix.Unshare(unix.CLONE_NEWNET)
	}()
	return <-errc
}
