package launcher

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// signalAliases are the second names Python's signal module knows and
// x/sys's table (one name per number) does not.
var signalAliases = map[string]syscall.Signal{
	"SIGIOT":  syscall.SIGABRT,
	"SIGPOLL": syscall.SIGIO,
	"SIGCLD":  syscall.SIGCHLD,
}

// unhandleable are the signals the agent must not take over: SIGKILL and
// SIGSTOP cannot be caught, the reaper owns SIGCHLD, and the Go runtime
// preempts goroutines with SIGURG.
var unhandleable = map[syscall.Signal]string{
	syscall.SIGKILL: "cannot be caught",
	syscall.SIGSTOP: "cannot be caught",
	syscall.SIGCHLD: "is how the agent learns of worker exits",
	syscall.SIGURG:  "is used by the Go runtime for preemption",
}

// ParseSignals reads --signals-to-handle: a comma-separated list of signal
// names, with or without the SIG prefix and in any case ("SIGTERM",
// "usr1"), or numbers. Repeats are dropped. An empty string gives an empty
// list (torchrun then installs no handlers). torchrun only warns about a
// name it does not know; gorun refuses it, and refuses the signals in
// unhandleable.
func ParseSignals(s string) ([]syscall.Signal, error) {
	var sigs []syscall.Signal
	if strings.TrimSpace(s) == "" {
		return sigs, nil
	}
	for _, part := range strings.Split(s, ",") {
		sig, err := parseSignal(part)
		if err != nil {
			return nil, invalidf("%q: %w", s, err)
		}
		if !slices.Contains(sigs, sig) {
			sigs = append(sigs, sig)
		}
	}
	return sigs, nil
}

func parseSignal(s string) (syscall.Signal, error) {
	name := strings.ToUpper(strings.TrimSpace(s))
	var sig syscall.Signal
	if n, err := strconv.Atoi(name); err == nil {
		sig = syscall.Signal(n)
		if n < 1 || n > maxSignal {
			return 0, fmt.Errorf("%q is not a signal number (1–%d)", s, maxSignal)
		}
	} else {
		if !strings.HasPrefix(name, "SIG") {
			name = "SIG" + name
		}
		if sig = unix.SignalNum(name); sig == 0 {
			if sig = signalAliases[name]; sig == 0 {
				return 0, fmt.Errorf("unknown signal %q", strings.TrimSpace(s))
			}
		}
	}
	if why, bad := unhandleable[sig]; bad {
		return 0, fmt.Errorf("%s %s", signalString(sig), why)
	}
	return sig, nil
}

// maxSignal is the highest signal number on Linux (SIGRTMAX).
const maxSignal = 64

// signalString names a signal as the user would write it: SIGTERM, or the
// number for one without a name.
func signalString(sig syscall.Signal) string {
	if name := unix.SignalName(sig); name != "" {
		return name
	}
	return strconv.Itoa(int(sig))
}

// stopSignals end the agent, torchrun's defaults; other handled signals
// (SIGUSR1, SIGUSR2: SLURM's warnings) are only passed on to the workers.
var stopSignals = map[syscall.Signal]bool{
	syscall.SIGTERM: true, syscall.SIGINT: true, syscall.SIGHUP: true, syscall.SIGQUIT: true,
}
