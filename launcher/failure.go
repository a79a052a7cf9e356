package launcher

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/launcher/reaper"
)

// Failure is one worker that failed.
type Failure struct {
	LocalRank int
	Rank      int
	Pid       int
	// ExitCode is the worker's exit code, or -N if signal N killed it
	// (torchrun's convention).
	ExitCode int
	// Time is when it failed: the error file's timestamp when the worker
	// wrote one, else when the agent saw it exit.
	Time time.Time
	Host string
	// ErrorFile is the worker's TORCHELASTIC_ERROR_FILE if the worker
	// wrote it, else "".
	ErrorFile string
	// Message says what went wrong: the error file's message, or the
	// signal, or a pointer to how to get a traceback.
	Message string
	// Traceback is the Python call stack from the error file, if any.
	Traceback string
	// Since is the shrink epoch after which the worker was started: 0 for
	// a round's workers, the epoch a newcomer followed (heal).
	Since int
}

// noTraceback is torchrun's message when a worker left no error file.
const noTraceback = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

// newFailure describes worker local rank lr (global rank r) that ended
// with e, reading its error file when it wrote one.
func newFailure(lr, r int, e reaper.Exit, errorFile, host string) Failure {
	f := Failure{LocalRank: lr, Rank: r, Pid: e.Pid, ExitCode: e.Code(), Time: e.Time, Host: host}
	if s := e.Signal(); s != 0 {
		f.Message = fmt.Sprintf("Signal %d (%s) received by PID %d", int(s), reaper.SignalName(s), e.Pid)
	} else {
		f.Message = noTraceback
	}
	if ef, err := readErrorFile(errorFile); err == nil {
		f.ErrorFile = errorFile
		if ef.message != "" {
			f.Message = ef.message
		}
		f.Traceback = ef.traceback
		if !ef.time.IsZero() {
			f.Time = ef.time
		}
	}
	return f
}

type errorFile struct {
	message, traceback string
	time               time.Time
}

// readErrorFile reads a TORCHELASTIC_ERROR_FILE in either form PyTorch
// writes or reads (spec/c10d-wire.md §6.2): nested, from @record,
//
//	{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
//
// or flat, {"message": "...", "timestamp": 1700000000}.
func readErrorFile(path string) (errorFile, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return errorFile{}, err
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(b, &top); err != nil {
		return errorFile{}, fmt.Errorf("%s: %w", path, err)
	}
	var ef errorFile
	var nested struct {
		Message   string `json:"message"`
		ExtraInfo struct {
			PyCallstack string          `json:"py_callstack"`
			Timestamp   json.RawMessage `json:"timestamp"`
		} `json:"extraInfo"`
	}
	var flat string
	switch {
	case json.Unmarshal(top["message"], &nested) == nil:
		ef.message, ef.traceback = nested.Message, nested.ExtraInfo.PyCallstack
		ef.time = unixTime(nested.ExtraInfo.Timestamp)
	case json.Unmarshal(top["message"], &flat) == nil:
		ef.message, ef.time = flat, unixTime(top["timestamp"])
	default:
		return errorFile{}, fmt.Errorf("%s: no message", path)
	}
	return ef, nil
}

// unixTime reads seconds since the epoch given as a number or a string.
func unixTime(raw json.RawMessage) time.Time {
	s := strings.Trim(string(raw), `"`)
	if s == "" {
		return time.Time{}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}
	}
	return time.Unix(n, 0)
}

// rootCause returns the index of the earliest failure: torchrun's root
// cause is the first failure observed, not the first reported.
func rootCause(fs []Failure) int {
	best := 0
	for i, f := range fs {
		if f.Time.Before(fs[best].Time) {
			best = i
		}
	}
	return best
}

// WorkersFailedError is returned by Run when workers failed and no restart
// is left. gorun exits with code 1, as torchrun does.
type WorkersFailedError struct {
	Name     string // what ran (the script or program)
	Failures []Failure
	Restarts int // restarts that were made before giving up
}

func (e *WorkersFailedError) Error() string {
	rc := e.Failures[rootCause(e.Failures)]
	return fmt.Sprintf("%s failed: rank %d (local rank %d) exited with %s after %d restart(s)",
		e.Name, rc.Rank, rc.LocalRank, describeExit(rc.ExitCode), e.Restarts)
}

func describeExit(code int) string {
	if code < 0 {
		s := syscall.Signal(-code)
		return fmt.Sprintf("signal %d (%s)", -code, reaper.SignalName(s))
	}
	return fmt.Sprintf("code %d", code)
}

// Summary renders the failure table torchrun prints (ChildFailedError),
// with the root cause last.
func (e *WorkersFailedError) Summary() string {
	const rule = "============================================================"
	const thin = "------------------------------------------------------------"
	root := rootCause(e.Failures)
	var others []Failure
	for i, f := range e.Failures {
		if i != root {
			others = append(others, f)
		}
	}
	slices.SortFunc(others, func(a, b Failure) int { return a.Time.Compare(b.Time) })
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n%s FAILED\n%s\nFailures:\n", rule, e.Name, thin)
	if len(others) == 0 {
		b.WriteString("  <NO_OTHER_FAILURES>\n")
	}
	for i, f := range others {
		writeFailure(&b, i+1, f)
	}
	fmt.Fprintf(&b, "%s\nRoot Cause (first observed failure):\n", thin)
	writeFailure(&b, 0, e.Failures[root])
	b.WriteString(rule + "\n")
	return b.String()
}

func writeFailure(b *strings.Builder, idx int, f Failure) {
	errFile := f.ErrorFile
	if errFile == "" {
		errFile = "<N/A>"
	}
	fmt.Fprintf(b, "[%d]:\n", idx)
	fmt.Fprintf(b, "  time      : %s\n", f.Time.Format("2006-01-02_15:04:05"))
	fmt.Fprintf(b, "  host      : %s\n", f.Host)
	fmt.Fprintf(b, "  rank      : %d (local_rank: %d)\n", f.Rank, f.LocalRank)
	fmt.Fprintf(b, "  exitcode  : %d (pid: %d)\n", f.ExitCode, f.Pid)
	fmt.Fprintf(b, "  error_file: %s\n", errFile)
	fmt.Fprintf(b, "  traceback : %s\n", indent(f.Message))
	if f.Traceback != "" {
		fmt.Fprintf(b, "  %s\n", indent(f.Traceback))
	}
}

func indent(s string) string {
	return strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ")
}

// SignalError is returned by Run when a signal stopped the agent. gorun
// exits with 128+N.
type SignalError struct{ Signal syscall.Signal }

func (e *SignalError) Error() string {
	return fmt.Sprintf("stopped by signal %d (%s)", int(e.Signal), reaper.SignalName(e.Signal))
}
