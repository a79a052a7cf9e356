// Package prestart hands a pre-started worker its place in the job.
//
// Under gorun --spare-prestart an agent starts its workers before it has a
// rendezvous round (a hot spare standing by, or any agent waiting for its
// first round), so that their start-up (the interpreter, imports, device
// initialisation) is over by the time the job needs them. Such a worker is
// parked: its environment lacks what only the round decides (RANK,
// WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, the restart count,
// GORUN_SHRINK_NEWCOMER, …) and instead names, in GORUN_ASSIGNMENT_FD, an
// inherited pipe on which the agent writes the rest once the round is
// known. The worker calls Await after its start-up and before it reads its
// environment; a worker that is not parked returns from Await at once.
//
// The wire format, one JSON object, is shared with examples/torch's
// gorun_ft.py (await_assignment):
//
//	{"env": {"RANK": "2", "WORLD_SIZE": "4", …}}
//
// The agent writes it once and closes the pipe. End of file without an
// object means the agent is gone or gave the worker up: the worker must
// exit.
package prestart

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
)

// EnvFD names the environment variable that holds the number of the
// inherited file descriptor a parked worker reads its assignment from.
const EnvFD = "GORUN_ASSIGNMENT_FD"

// ErrNoAssignment: the pipe ended before an assignment came (the agent
// stopped, or gave the parked worker up).
var ErrNoAssignment = errors.New("the agent ended the pre-started worker's wait without an assignment")

// maxAssignment bounds what a worker reads: an environment, not a stream.
const maxAssignment = 1 << 20

// Assignment is what a parked worker receives: the environment variables
// the round adds to or changes in its environment.
type Assignment struct {
	Env map[string]string `json:"env"`
}

// Write sends a to a parked worker (the agent's side). The caller closes w
// afterwards.
func Write(w io.Writer, a Assignment) error {
	b, err := json.Marshal(a)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// Read reads one assignment from r, waiting for the agent to write it.
func Read(r io.Reader) (Assignment, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxAssignment+1))
	switch {
	case err != nil:
		return Assignment{}, fmt.Errorf("reading the assignment: %w", err)
	case len(b) == 0:
		return Assignment{}, ErrNoAssignment
	case len(b) > maxAssignment:
		return Assignment{}, fmt.Errorf("the assignment is over %d bytes", maxAssignment)
	}
	var a Assignment
	if err := json.Unmarshal(b, &a); err != nil {
		return Assignment{}, fmt.Errorf("the assignment %q: %w", b, err)
	}
	return a, nil
}

// Await makes this process, if it was pre-started, wait for its
// assignment and lays it over its environment (os.Setenv); it reports
// whether the process was parked. A process that was not (no EnvFD in
// its environment) returns false, nil at once, so a worker can call it
// unconditionally. It blocks until the agent writes: the agent stops a
// parked worker by a signal, as any other. On ErrNoAssignment the worker
// should exit.
func Await() (bool, error) {
	v, ok := os.LookupEnv(EnvFD)
	if !ok {
		return false, nil
	}
	// Children of this worker must not think themselves parked.
	os.Unsetenv(EnvFD)
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 0 {
		return true, fmt.Errorf("%s=%q: not a file descriptor", EnvFD, v)
	}
	f := os.NewFile(uintptr(fd), "gorun-assignment")
	if f == nil {
		return true, fmt.Errorf("%s=%d: not an open file descriptor", EnvFD, fd)
	}
	defer f.Close()
	a, err := Read(f)
	if err != nil {
		return true, err
	}
	for k, v := range a.Env {
		if err := os.Setenv(k, v); err != nil {
			return true, fmt.Errorf("the assignment's %s: %w", k, err)
		}
	}
	return true, nil
}
