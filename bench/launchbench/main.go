// Command launchbench measures gorun's launcher beside torchrun 1.13 (Debian's
// PyTorch) and torchrun 2.14 (Debian sid's, in the sid bed: internal/sidbed),
// in the same run, with the same workers, and prints a markdown table of
// medians and ratios for BENCHMARKS.md.
//
// The launchers measured: gorun, torchrun 1.13 with --monitor_interval 0.1,
// torchrun 1.13 at its default (5 s), and, when the sid bed is built (or
// -python214 names an interpreter), torchrun 2.14 at its default (0.1 s).
// torchrun 2.14 and its workers run in the bed: its wall times include
// entering the bed (a mount namespace, a few mounts, chroot; see the
// "bed floor" row). All run single-node with
// --standalone, -nproc workers, --redirects 1 --tee 1 (Debian's torchrun 1.13
// on Python 3.11 crashes without them; gorun gets the same for fairness) and
// a fresh --log-dir per run. Launchers are interleaved within each
// repetition, so machine noise hits all alike.
//
// Benchmarks:
//   - launch: -nproc workers that are /bin/true (--no-python), wall time from
//     fork of the launcher to the reaping of its exit. In separate runs of the
//     same command, the agent's peak RSS: VmHWM of the launcher process,
//     read from /proc at its exit (see exitRSS).
//   - restart: -nproc `sh -c` workers with --max-restarts 1. "clean": every
//     worker exits 0. "restart": local rank 0 exits 3 when
//     TORCHELASTIC_RESTART_COUNT is 0, so the group runs twice. "added" is the
//     median over repetitions of (restart − clean) within one repetition.
//     Each worker leaves a marker file per attempt; the benchmark checks that
//     the restart really happened (and did not in the clean run).
//   - exec floor: this harness starting and reaping one /bin/true with no
//     launcher, the cost of one process start on this machine.
//
// Every run is bounded by -timeout (its process group is then SIGKILLed) and
// must exit 0. The benchmark is a child subreaper: after each run it kills
// and reaps any process the launcher left behind, and reports the count.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/procs"
	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/internal/sidbed"

	"golang.org/x/sys/unix"
)

type launcher struct {
	name    string // column label
	kind    string // "gorun", "torchrun" (1.13) or "torchrun214"
	monitor string // torchrun --monitor_interval; "" = its default
	bin     string // gorun's binary when not -gorun's (-baseline's)
}

type config struct {
	gorun, python   string
	baseline        string // another gorun binary measured beside -gorun ("": none)
	python214       string // Python with torch 2.14 ("": no torchrun 2.14 column)
	reps, nproc     int
	monitor         string
	timeout         time.Duration
	out, tmp, self  string
	launchers       []launcher
	torchrunVersion string
	torch214Version string
}

// torchrun214 is torchrun 2.14's column.
var torchrun214 = launcher{"torchrun 2.14 (default: monitor 0.1)", "torchrun214", "", ""}

// torchrunPort is where torchrun 1.13 --standalone always puts its
// rendezvous store (run.py: "localhost:29400").
const torchrunPort = 29400

// The restart worker. $1: the local rank that fails on attempt 0 (-1: none);
// $2: the marker directory. `: >` is a shell builtin, so a worker is one
// sh process and nothing else.
const restartScript = `: > "$2/attempt$TORCHELASTIC_RESTART_COUNT.rank$LOCAL_RANK"
[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$LOCAL_RANK" = "$1" ] && exit 3
exit 0`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "exitrss" {
		// Internal helper mode, see exitRSS.
		if err := exitRSS(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "launchbench exitrss:", err)
			os.Exit(1)
		}
		return
	}
	var cfg config
	flag.StringVar(&cfg.gorun, "gorun", "bin/gorun", "gorun binary")
	flag.StringVar(&cfg.baseline, "baseline", "", "another gorun binary (an earlier build) measured beside -gorun, interleaved, in a column of its own")
	flag.StringVar(&cfg.python, "python", "/usr/bin/python3", "Python with torch 1.13 (torchrun is `PYTHON -m torch.distributed.run`; \"\": no torchrun columns)")
	flag.IntVar(&cfg.reps, "reps", 5, "repetitions (medians are reported)")
	flag.IntVar(&cfg.nproc, "nproc", 4, "workers per launch")
	flag.StringVar(&cfg.monitor, "monitor", "0.1", "torchrun's --monitor_interval for its fast column")
	flag.DurationVar(&cfg.timeout, "timeout", 60*time.Second, "bound on each run; then its process group is killed")
	flag.StringVar(&cfg.out, "out", "bench/results/launch.jsonl", "raw results (JSON lines)")
	flag.StringVar(&cfg.python214, "python214", "auto", `Python with torch 2.14 for torchrun 2.14's column ("auto": the sid bed's, when built; "": none)`)
	flag.Parse()
	cfg.launchers = []launcher{{"gorun", "gorun", "", ""}}
	if cfg.baseline != "" {
		cfg.launchers = append(cfg.launchers, launcher{"gorun (baseline)", "gorun", "", cfg.baseline})
	}
	if cfg.python != "" {
		cfg.launchers = append(cfg.launchers,
			launcher{"torchrun (monitor " + cfg.monitor + ")", "torchrun", cfg.monitor, ""},
			launcher{"torchrun (default)", "torchrun", "", ""})
	} else {
		cfg.python214 = ""
	}
	py214, err := sidbed.ResolvePython(cfg.python214)
	if err != nil {
		fmt.Fprintf(os.Stderr, "launchbench: no torchrun 2.14 column: %v\n", err)
	}
	cfg.python214 = py214
	if cfg.python214 != "" {
		cfg.launchers = append(cfg.launchers, torchrun214)
	}
	if err := runAll(&cfg); err != nil {
		fmt.Fprintln(os.Stderr, "launchbench:", err)
		os.Exit(1)
	}
}

// result is one run of one launcher.
type result struct {
	Bench    string  `json:"bench"`
	Launcher string  `json:"launcher"`
	Rep      int     `json:"rep"`
	Argv     string  `json:"argv"`
	WallMS   float64 `json:"wall_ms,omitempty"`
	// Agent peak RSS: VmHWM of the launcher process at its exit.
	AgentHWMKiB int64 `json:"agent_vmhwm_kib,omitempty"`
	// wait4's ru_maxrss for the launcher: the largest of the launcher and
	// the descendants it reaped. A cross-check only.
	Wait4MaxRSSKiB int64  `json:"wait4_maxrss_kib,omitempty"`
	LeftBehind     int    `json:"left_behind,omitempty"`
	Error          string `json:"error,omitempty"`
}

func runAll(cfg *config) error {
	var err error
	if cfg.self, err = os.Executable(); err != nil {
		return err
	}
	if _, err := os.Stat(cfg.gorun); err != nil {
		return fmt.Errorf("gorun binary: %w (run `make build`)", err)
	}
	if cfg.baseline != "" {
		if _, err := os.Stat(cfg.baseline); err != nil {
			return fmt.Errorf("-baseline: %w", err)
		}
	}
	if cfg.python != "" {
		v, err := exec.Command(cfg.python, "-c", "import sys, torch; print('torch', torch.__version__, 'on Python', sys.version.split()[0])").Output()
		if err != nil {
			return fmt.Errorf("%s cannot import torch: %w", cfg.python, err)
		}
		cfg.torchrunVersion = strings.TrimSpace(string(v))
	}
	if cfg.python214 != "" {
		v, err := exec.Command(cfg.python214, "-c", "import sys, torch; print('torch', torch.__version__, 'on Python', sys.version.split()[0])").Output()
		if err != nil {
			return fmt.Errorf("%s cannot import torch: %w", cfg.python214, err)
		}
		cfg.torch214Version = strings.TrimSpace(string(v))
	}
	// Orphans of a launcher are reparented to us, so none escapes the count.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become a subreaper: %w", err)
	}
	if cfg.tmp, err = os.MkdirTemp("", "launchbench-"); err != nil {
		return err
	}
	defer os.RemoveAll(cfg.tmp)
	if err := os.MkdirAll(filepath.Dir(cfg.out), 0o755); err != nil {
		return err
	}
	raw, err := os.Create(cfg.out)
	if err != nil {
		return err
	}
	defer raw.Close()

	var all []result
	report := func(r result) {
		all = append(all, r)
		json.NewEncoder(raw).Encode(r)
		fmt.Fprintf(os.Stderr, "launchbench: rep %d %s / %s:", r.Rep, r.Bench, r.Launcher)
		if r.WallMS > 0 {
			fmt.Fprintf(os.Stderr, " %.1f ms", r.WallMS)
		}
		if r.AgentHWMKiB > 0 {
			fmt.Fprintf(os.Stderr, " agent VmHWM %d KiB (wait4 maxrss %d KiB)", r.AgentHWMKiB, r.Wait4MaxRSSKiB)
		}
		if r.Error != "" {
			fmt.Fprintf(os.Stderr, " FAILED: %s", r.Error)
		}
		fmt.Fprintln(os.Stderr)
	}
	for rep := 1; rep <= cfg.reps; rep++ {
		// The machine's floor (this harness starting and reaping one
		// /bin/true, no launcher) and gorun's own start-up (the binary
		// started and exiting at once). Each runs back to back a few
		// times after one unrecorded run: the first comes right after the
		// previous repetition's torchrun agents exit, while the kernel is
		// still tearing down their ~240 MB each, and measured that instead.
		for _, m := range []struct {
			l     launcher
			bench string
		}{{floor, "floor"}, {gorunStartup, "startup"}, {baselineStartup(cfg), "startup"}, {bedFloor, "bed floor"}} {
			if m.l.kind == "bed" && cfg.python214 == "" || m.l.kind == "" {
				continue
			}
			for i := 0; i <= startupRuns; i++ {
				r := runOnce(cfg, m.l, m.bench, trueWorker, 0, false)
				if i == 0 {
					continue // the warm-up
				}
				r.Rep = rep
				report(r)
			}
		}
		for _, b := range []struct {
			bench       string
			worker      func(markers string) []string
			maxRestarts int
			traced      bool
		}{
			{"launch", trueWorker, 0, false},
			{"launch rss", trueWorker, 0, true},
			{"clean", shWorker("-1"), 1, false},
			{"restart", shWorker("0"), 1, false},
		} {
			for _, l := range cfg.launchers {
				r := runOnce(cfg, l, b.bench, b.worker, b.maxRestarts, b.traced)
				r.Rep = rep
				report(r)
			}
		}
	}
	printTable(cfg, all)
	return nil
}

// startupRuns is how many times each repetition measures the floor and
// gorun's start-up, back to back after one warm-up run.
const startupRuns = 5

// floor is no launcher: the worker command alone.
var floor = launcher{"exec floor", "none", "", ""}

// bedFloor is /bin/true run in the sid bed (its enter script: a mount
// namespace, a few mounts, chroot), what every torchrun 2.14 run pays on top.
var bedFloor = launcher{"bed floor", "bed", "", ""}

// gorunStartup is `gorun --version`: the binary's start-up (process
// creation, runtime and package initialisation) and nothing else.
var gorunStartup = launcher{"gorun start-up", "version", "", ""}

// baselineStartup is -baseline's start-up, if there is one.
func baselineStartup(cfg *config) launcher {
	if cfg.baseline == "" {
		return launcher{}
	}
	return launcher{"gorun start-up (baseline)", "version", "", cfg.baseline}
}

func trueWorker(string) []string { return []string{"/bin/true"} }

func shWorker(failRank string) func(string) []string {
	return func(markers string) []string {
		return []string{"sh", "-c", restartScript, "sh", failRank, markers}
	}
}

// gorunBin is the gorun binary a gorun launcher runs.
func (l launcher) gorunBin(cfg *config) string {
	if l.bin != "" {
		return l.bin
	}
	return cfg.gorun
}

// argv is the launcher's command line.
func (l launcher) argv(cfg *config, logDir string, maxRestarts int, worker []string) []string {
	n := strconv.Itoa(cfg.nproc)
	var a []string
	switch l.kind {
	case "gorun":
		a = []string{l.gorunBin(cfg), "--standalone", "--nproc-per-node", n, "--redirects", "1", "--tee", "1", "--log-dir", logDir}
		if maxRestarts > 0 {
			a = append(a, "--max-restarts", strconv.Itoa(maxRestarts))
		}
		a = append(a, "--no-python")
	case "torchrun", "torchrun214":
		py := cfg.python
		if l.kind == "torchrun214" {
			py = cfg.python214
		}
		a = []string{py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", n, "--redirects", "1", "--tee", "1", "--log_dir", logDir}
		if l.monitor != "" {
			a = append(a, "--monitor_interval", l.monitor)
		}
		if maxRestarts > 0 {
			a = append(a, "--max_restarts", strconv.Itoa(maxRestarts))
		}
		a = append(a, "--no_python")
	case "version":
		return []string{l.gorunBin(cfg), "--version"}
	case "bed":
		// The bed's python3 wrapper is bin/python3 next to its enter script.
		a = []string{filepath.Join(filepath.Dir(filepath.Dir(cfg.python214)), "enter")}
	case "none":
	}
	return append(a, worker...)
}

// runOnce runs one launcher once, in a fresh directory for its logs and
// markers, and checks the outcome.
func runOnce(cfg *config, l launcher, bench string, worker func(string) []string, maxRestarts int, traced bool) (r result) {
	r = result{Bench: bench, Launcher: l.name}
	dir, err := os.MkdirTemp(cfg.tmp, "run-")
	if err != nil {
		r.Error = err.Error()
		return r
	}
	defer os.RemoveAll(dir)
	markers := filepath.Join(dir, "markers")
	console := filepath.Join(dir, "console.log")
	os.Mkdir(markers, 0o755)
	argv := l.argv(cfg, filepath.Join(dir, "logs"), maxRestarts, worker(markers))
	r.Argv = strings.Join(argv, " ")
	defer func() { r.LeftBehind = procs.ReapOrphans() }()

	if l.kind == "torchrun" || l.kind == "torchrun214" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := procs.WaitPortFree(ctx, torchrunPort)
		cancel()
		if err != nil {
			r.Error = err.Error()
			return r
		}
	}
	logf, err := os.Create(console)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	defer logf.Close()
	var stdout bytes.Buffer
	var cmd *exec.Cmd
	if traced {
		cmd = exec.Command(cfg.self, append([]string{"exitrss"}, argv...)...)
		cmd.Stdout = &stdout // the helper's JSON; the launcher writes to logf
	} else {
		cmd = exec.Command(argv[0], argv[1:]...)
		cmd.Stdout = logf
	}
	cmd.Stderr = logf
	// Its own process group, so a timeout kills the whole tree; and it dies
	// with us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}

	start := time.Now()
	if err := cmd.Start(); err != nil {
		r.Error = err.Error()
		return r
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(cfg.timeout):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		err = fmt.Errorf("timed out after %v, killed", cfg.timeout)
	}
	wall := time.Since(start)
	if err != nil {
		r.Error = fmt.Sprintf("%v; console tail: %s", err, procs.Tail(console, 400))
		return r
	}
	if traced {
		var h helperResult
		if err := json.Unmarshal(stdout.Bytes(), &h); err != nil {
			r.Error = fmt.Sprintf("exitrss printed %q: %v", stdout.String(), err)
			return r
		}
		if h.Exit != 0 {
			r.Error = fmt.Sprintf("launcher exited %d; console tail: %s", h.Exit, procs.Tail(console, 400))
			return r
		}
		if h.AgentHWMKiB == 0 {
			r.Error = "no exit stop seen: VmHWM not sampled"
			return r
		}
		r.AgentHWMKiB, r.Wait4MaxRSSKiB = h.AgentHWMKiB, h.Wait4MaxRSSKiB
		return r
	}
	r.WallMS = float64(wall.Microseconds()) / 1e3
	switch bench {
	case "clean", "restart":
		if err := checkMarkers(markers, cfg.nproc, bench == "restart"); err != nil {
			r.Error = err.Error()
		}
	}
	return r
}

// checkMarkers verifies from the workers' marker files that every rank ran
// attempt 0, and that all ranks ran attempt 1 exactly when a restart was
// expected.
func checkMarkers(dir string, nproc int, restarted bool) error {
	for rank := 0; rank < nproc; rank++ {
		_, err := os.Stat(filepath.Join(dir, fmt.Sprintf("attempt1.rank%d", rank)))
		if restarted && err != nil {
			return fmt.Errorf("rank %d did not run attempt 1: no restart happened", rank)
		}
		if !restarted && err == nil {
			return fmt.Errorf("rank %d ran attempt 1 in a run without failure", rank)
		}
	}
	// Attempt 0 of rank 0 must have run in both; other ranks may have been
	// stopped before they wrote their marker when rank 0 failed.
	if _, err := os.Stat(filepath.Join(dir, "attempt0.rank0")); err != nil {
		return errors.New("rank 0 did not run attempt 0")
	}
	return nil
}

// helperResult is what exitrss prints.
type helperResult struct {
	Exit           int   `json:"exit"` // exit code, or 128+signal
	AgentHWMKiB    int64 `json:"agent_vmhwm_kib"`
	Wait4MaxRSSKiB int64 `json:"wait4_maxrss_kib"`
}

// exitRSS runs argv as a ptrace tracee and samples its peak RSS at exit:
// with PTRACE_O_TRACEEXIT each of its threads (PTRACE_O_TRACECLONE follows
// them; forked children such as the workers are not traced) stops on its way
// out, before its memory is released, and /proc/PID/task/TID/status VmHWM
// is read there. The thread that calls exit_group always stops (the others
// may be killed past the stop), so the last sample is the process's peak
// over its whole life. It is the launcher's own memory only: VmHWM belongs
// to its address space, unlike wait4's ru_maxrss, which is the largest of
// the process and the children it reaped. Signals the tracee receives are
// passed on unchanged. It prints a helperResult as JSON.
func exitRSS(argv []string) error {
	if len(argv) == 0 {
		return errors.New("usage: launchbench exitrss PROGRAM [ARGS...]")
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return err
	}
	// ptrace requests must come from the thread that started the tracee.
	runtime.LockOSThread()
	pid, err := syscall.ForkExec(path, argv, &syscall.ProcAttr{
		Env:   os.Environ(),
		Files: []uintptr{0, 2, 2}, // the launcher's output goes where ours does
		Sys:   &syscall.SysProcAttr{Ptrace: true, Pdeathsig: syscall.SIGKILL},
	})
	if err != nil {
		return err
	}
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, syscall.WALL, nil); err != nil {
		return err
	}
	if !ws.Stopped() || ws.StopSignal() != syscall.SIGTRAP {
		return fmt.Errorf("tracee did not stop at exec: status %#x", ws)
	}
	if err := unix.PtraceSetOptions(pid, unix.PTRACE_O_TRACEEXIT|unix.PTRACE_O_TRACECLONE|unix.PTRACE_O_EXITKILL); err != nil {
		return err
	}
	if err := unix.PtraceCont(pid, 0); err != nil {
		return err
	}
	var h helperResult
	for {
		var ru syscall.Rusage
		tid, err := syscall.Wait4(-1, &ws, syscall.WALL, &ru)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		switch {
		case ws.Exited() || ws.Signaled():
			if tid != pid {
				continue // one of its threads
			}
			h.Exit = ws.ExitStatus()
			if ws.Signaled() {
				h.Exit = 128 + int(ws.Signal())
			}
			h.Wait4MaxRSSKiB = int64(ru.Maxrss) // Linux: KiB; int32 on 32-bit
			return json.NewEncoder(os.Stdout).Encode(h)
		case ws.Stopped():
			inject := 0
			switch sig := ws.StopSignal(); {
			case sig == syscall.SIGTRAP && ws.TrapCause() == syscall.PTRACE_EVENT_EXIT:
				if kib, err := vmHWM(pid, tid); err == nil && kib > h.AgentHWMKiB {
					h.AgentHWMKiB = kib
				}
			case sig == syscall.SIGTRAP: // clone events
			case sig == syscall.SIGSTOP: // a new thread's first stop
			default:
				inject = int(sig)
			}
			unix.PtraceCont(tid, inject) // ESRCH: the thread is gone
		}
	}
}

// vmHWM reads a thread's VmHWM (the peak RSS of its address space) in KiB.
func vmHWM(pid, tid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/task/%d/status", pid, tid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		}
	}
	return 0, errors.New("no VmHWM")
}

func printTable(cfg *config, all []result) {
	// values(bench, launcher, f): f of each successful run, in rep order.
	values := func(bench, name string, f func(result) float64) []float64 {
		var v []float64
		for _, r := range all {
			if r.Bench == bench && r.Launcher == name && r.Error == "" {
				v = append(v, f(r))
			}
		}
		return v
	}
	wall := func(r result) float64 { return r.WallMS }
	hwm := func(r result) float64 { return float64(r.AgentHWMKiB) / 1024 }
	// added: per repetition, restart minus clean of the same repetition.
	added := func(name string) []float64 {
		var v []float64
		for rep := 1; rep <= cfg.reps; rep++ {
			var c, x *result
			for i := range all {
				r := &all[i]
				if r.Rep == rep && r.Launcher == name && r.Error == "" {
					switch r.Bench {
					case "clean":
						c = r
					case "restart":
						x = r
					}
				}
			}
			if c != nil && x != nil {
				v = append(v, x.WallMS-c.WallMS)
			}
		}
		return v
	}

	g := cfg.launchers[0]
	var ratios []launcher
	for _, l := range cfg.launchers {
		if l.kind == "torchrun" {
			ratios = append(ratios, l)
			break
		}
	}
	if cfg.python214 != "" {
		ratios = append(ratios, torchrun214)
	}
	fmt.Printf("Command: `%s`\n\n", strings.Join(os.Args, " "))
	fmt.Printf("gorun: %s.", cfg.gorun)
	if cfg.baseline != "" {
		fmt.Printf(" gorun (baseline): %s.", cfg.baseline)
	}
	if cfg.python != "" {
		fmt.Printf(" torchrun: `%s -m torch.distributed.run`, %s.", cfg.python, cfg.torchrunVersion)
	}
	fmt.Printf(" %d CPUs.\n", runtime.NumCPU())
	if cfg.python214 != "" {
		fmt.Printf("torchrun 2.14: `%s -m torch.distributed.run` (the sid bed), %s.\n", cfg.python214, cfg.torch214Version)
	}
	fmt.Printf("All launchers: `--standalone`, %d workers, `--redirects 1 --tee 1` (torchrun 1.13 needs it on Python 3.11; gorun gets the same).\n", cfg.nproc)
	fmt.Printf("Medians of %d repetitions, launchers interleaved within each.\n\n", cfg.reps)
	fmt.Printf("| benchmark | metric |")
	for _, l := range cfg.launchers {
		fmt.Printf(" %s |", l.name)
	}
	for _, r := range ratios {
		fmt.Printf(" gorun ÷ %s |", r.name)
	}
	fmt.Printf("\n|---|---|%s\n", strings.Repeat("---|", len(cfg.launchers)+len(ratios)))
	medians := map[string]float64{} // "row/launcher" → median, for the goals
	row := func(bench, metric string, get func(name string) []float64, format string) {
		fmt.Printf("| %s | %s |", bench, metric)
		for _, l := range cfg.launchers {
			v := get(l.name)
			medians[metric+"/"+l.name] = stats.Median(v)
			if len(v) == 0 {
				fmt.Printf(" failed |")
				continue
			}
			fmt.Printf(" "+format+" |", stats.Median(v))
		}
		for _, r := range ratios {
			gv, tv := medians[metric+"/"+g.name], medians[metric+"/"+r.name]
			if tv != 0 && len(get(g.name)) > 0 {
				fmt.Printf(" %.3f× |", gv/tv)
			} else {
				fmt.Printf(" — |")
			}
		}
		fmt.Println()
	}
	blank := strings.Repeat(" |", len(cfg.launchers)-1+len(ratios))
	launch := fmt.Sprintf("launch: %d × /bin/true", cfg.nproc)
	restart := fmt.Sprintf("restart: %d × sh, --max-restarts 1", cfg.nproc)
	row(launch, "wall, start to exit (ms)", func(n string) []float64 { return values("launch", n, wall) }, "%.1f")
	row(launch, "agent peak RSS (MiB, VmHWM at exit)", func(n string) []float64 { return values("launch rss", n, hwm) }, "%.1f")
	row(restart, "wall, no failure (ms)", func(n string) []float64 { return values("clean", n, wall) }, "%.1f")
	row(restart, "wall, rank 0 exits 3 on attempt 0 (ms)", func(n string) []float64 { return values("restart", n, wall) }, "%.1f")
	row(restart, "added by the restart (ms)", added, "%.1f")
	fmt.Printf("| exec floor | one /bin/true started and reaped by this harness, no launcher (ms) | %.1f |%s\n",
		stats.Median(values("floor", floor.name, wall)), blank)
	fmt.Printf("| gorun start-up | `gorun --version` started and reaped: the binary's own start-up (ms) | %.1f |%s\n",
		stats.Median(values("startup", gorunStartup.name, wall)), blank)
	if b := baselineStartup(cfg); b.kind != "" {
		fmt.Printf("| gorun (baseline) start-up | `gorun --version` of -baseline (ms) | %.1f |%s\n",
			stats.Median(values("startup", b.name, wall)), blank)
	}
	if cfg.python214 != "" {
		fmt.Printf("| bed floor | one /bin/true run in the sid bed (mount namespace, mounts, chroot), no launcher (ms) | %.1f |%s\n",
			stats.Median(values("bed floor", bedFloor.name, wall)), blank)
	}

	left, failed := 0, []string{}
	for _, r := range all {
		left += r.LeftBehind
		if r.Error != "" {
			failed = append(failed, fmt.Sprintf("%s / %s / rep %d: %s", r.Bench, r.Launcher, r.Rep, r.Error))
		}
	}
	fmt.Printf("\nProcesses left behind by the launchers (killed and reaped by the benchmark), all runs: %d.\n", left)
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "not met"
	}
	w := medians["wall, start to exit (ms)/"+g.name]
	m := medians["agent peak RSS (MiB, VmHWM at exit)/"+g.name]
	a := medians["added by the restart (ms)/"+g.name]
	fmt.Printf("\nGoals (issue 3), gorun: launch ≤ 20 ms: %.1f ms, %s; agent RSS ≤ 20 MB: %.1f MB, %s; restart adds ≤ 50 ms: %.1f ms, %s.\n",
		w, verdict(w <= 20), m*1.048576, verdict(m*1.048576 <= 20), a, verdict(a <= 50))
	for _, f := range failed {
		fmt.Printf("\nfailure: %s", f)
	}
	fmt.Println()
}
