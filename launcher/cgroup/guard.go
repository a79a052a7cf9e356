package cgroup

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// guardEnv, in a process's environment, makes it the guard of the jail
// whose directory it names (runGuardIfAsked).
const guardEnv = "GORUN_CGROUP_GUARD"

// guardDrainTimeout bounds how long a guard waits for the jail's killed
// processes to be gone before it gives up removing it.
const guardDrainTimeout = 10 * time.Second

// Starter starts a process as os.StartProcess does (an agent passes its
// reaper's, which must own every child).
type Starter func(name string, argv []string, attr *os.ProcAttr) (*os.Process, error)

// Guard is a process that empties and removes a jail once its agent is
// gone. The agent holds the only write end of a pipe the guard reads, so
// the guard learns of the agent's end however it comes — SIGKILL
// included, which no handler of the agent's could catch.
type Guard struct {
	Process  *os.Process
	lifeline *os.File
	ready    *os.File // the guard writes a byte once it ignores stop signals
}

// guardShell is the guard where /bin/sh exists: a POSIX shell starts much
// faster than a Go program (see BENCHMARKS, launcher), on the CPUs the
// agent and its workers are starting on. It does what runGuardIfAsked does, for a
// jail of slots one level deep (what Jail makes): $1 is the jail.
const guardShell = `trap '' INT TERM HUP QUIT PIPE
printf r; exec 1>&-
while read -r _; do :; done
[ -d "$1" ] || exit 0
echo 1 > "$1/cgroup.kill" 2>/dev/null
i=0
while [ -d "$1" ] && [ $i -lt 1000 ]; do
	for d in "$1"/*/; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done
	rmdir "$1" 2>/dev/null || sleep 0.01
	i=$((i+1))
done
[ ! -d "$1" ] || { echo "gorun: cgroup guard: cannot remove $1" >&2; exit 1; }`

// shell is the POSIX shell the guard runs on, where there is one (a
// distroless image has none); a variable for the tests of the other way.
var shell = "/bin/sh"

// StartGuard starts the jail's guard: a shell script where /bin/sh exists,
// else exe, a program that links this package (the agent's own binary).
// It runs in a session of its own, so that a terminal's Ctrl-C, which
// reaches the agent's process group, leaves it in place until the agent
// is gone.
func (j *Jail) StartGuard(exe string, start Starter) (*Guard, error) {
	name, argv := exe, []string{"gorun-cgroup-guard", j.dir}
	if _, err := os.Stat(shell); err == nil {
		name, argv = shell, []string{"gorun-cgroup-guard", "-c", guardShell, "gorun-cgroup-guard", j.dir}
	} else if exe == "" {
		return nil, fmt.Errorf("cgroup guard: no %s and no program named", shell)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("cgroup guard: %w", err)
	}
	defer r.Close()
	readyR, readyW, err := os.Pipe()
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("cgroup guard: %w", err)
	}
	defer readyW.Close()
	attr := &os.ProcAttr{
		Env:   []string{guardEnv + "=" + j.dir},
		Files: []*os.File{r, readyW, os.Stderr},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	}
	p, err := start(name, argv, attr)
	if err != nil {
		w.Close()
		readyR.Close()
		return nil, fmt.Errorf("cgroup guard: %w", err)
	}
	return &Guard{Process: p, lifeline: w, ready: readyR}, nil
}

// AwaitReady waits until the guard ignores stop signals (a few
// milliseconds after its start), or it has exited; an agent need not
// wait, a test that signals the guard must.
func (g *Guard) AwaitReady() {
	if g.ready != nil {
		g.ready.Read(make([]byte, 1))
		g.ready.Close()
		g.ready = nil
	}
}

// Release lets the guard go: it removes the jail if the agent has not
// (Jail.Close first, for a clean end) and exits.
func (g *Guard) Release() {
	if g.lifeline != nil {
		g.lifeline.Close()
		g.lifeline = nil
	}
	if g.ready != nil {
		g.ready.Close()
		g.ready = nil
	}
}

// init makes a process started as a guard (StartGuard) one at once, before
// the packages initialised after this one (by import path: most of a
// program's, zap's, urfave/cli's and Prometheus's among them) spend its
// start-up: a guard starts beside every agent, on its CPUs. Any program
// that links this package, a test binary included, so serves as its own
// guard; nothing else needs calling.
func init() { runGuardIfAsked() }

// runGuardIfAsked returns at once unless this process was started as a
// guard (StartGuard); a guard waits for its agent to be gone, empties and
// removes the jail, and exits.
func runGuardIfAsked() {
	dir, ok := os.LookupEnv(guardEnv)
	if !ok {
		return
	}
	// Only the agent's end matters: stop signals meant for the job (a
	// pkill, a process group's) must not take the guard first.
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	os.Stdout.Write([]byte{1})
	os.Stdout.Close()
	io.Copy(io.Discard, os.Stdin) // end of file: the agent is gone
	if err := Remove(dir, guardDrainTimeout); err != nil {
		fmt.Fprintf(os.Stderr, "gorun: cgroup guard: %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}
