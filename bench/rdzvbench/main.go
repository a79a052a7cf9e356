// Command rdzvbench measures multi-node rendezvous on loopback: N agents
// with the c10d backend (or gorun's etcd backend, -etcd), the time from the
// last agent's start (its join) to every worker of every agent started. gorun and torchrun run the same
// job, interleaved within each repetition; medians are reported.
//
// N-1 agents start first and are given time to settle into the
// rendezvous; then the clock starts and the last agent is launched. With
// -from-first every agent is started at once and the clock starts with
// the first: a whole job's bring-up. Each worker (sh, one per agent)
// records when it started.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/stats"
)

var (
	fromFirst bool          // -from-first
	waitFor   time.Duration // -wait
	loseAfter time.Duration // -lose-one: how long after every worker started
	loseOneOn bool          // -lose-one
)

type launcher struct {
	name   string
	agents int
	settle time.Duration // how long the first N-1 agents get to join
	argv   func(port int, logDir string) []string
}

func main() {
	gorun := flag.String("gorun", "bin/gorun", "gorun binary")
	python := flag.String("python", "/usr/bin/python3", "Python with torch (torchrun = PYTHON -m torch.distributed.run)")
	reps := flag.Int("reps", 3, "repetitions (medians are reported)")
	gorunAgents := flag.Int("agents", 64, "gorun agents")
	torchAgents := flag.Int("torch-agents", 16, "torchrun agents (each imports torch: ~240 MB and ~2 s of CPU)")
	etcdEndpoints := flag.String("etcd", "", "gorun agents meet through etcd at these `HOST:PORT,…` instead of c10d (a fresh run id each time)")
	flag.BoolVar(&fromFirst, "from-first", false, "start every agent at once and time from the first start (a job's whole bring-up), not from the last agent's join after the others settled")
	flag.DurationVar(&waitFor, "wait", 120*time.Second, "give up on a job whose workers have not all started this long after the clock started")
	flag.BoolVar(&loseOneOn, "lose-one", false, "once every worker has started, kill one agent (its process group) and time the survivors' next epoch (--on-failure shrink) or round: "+
		"from the loss first known to every survivor's adoption (workers then run until the end)")
	flag.DurationVar(&loseAfter, "lose-after", 3*time.Second, "with -lose-one: how long after every worker started the agent is killed")
	standalone := flag.Bool("standalone", false, "every agent a job of its own (--standalone, one node): no rendezvous at all, the floor that starting the processes and their workers sets")
	agentFlags := flag.String("gorun-flags", "", "more flags for every gorun agent, space-separated (e.g. \"--on-failure shrink\": the survivors' agreement and node liveness at scale)")
	flag.Parse()
	fmt.Printf("Command: %s\n\n", strings.Join(os.Args, " "))

	worker := []string{"sh", "-c", `date +%s%N > "$RDZVBENCH_OUT/$RANK"`}
	if *standalone {
		// Every worker is rank 0 of its own job.
		worker[2] = `date +%s%N > "$RDZVBENCH_OUT/$RDZVBENCH_AGENT"`
	}
	if loseOneOn {
		// The survivors' workers must outlive the loss.
		worker[2] += `; exec sleep 3600`
	}
	gorunArgv := func(n int) func(int, string) []string {
		return func(port int, logDir string) []string {
			backend, endpoint, id := "c10d", "127.0.0.1:"+strconv.Itoa(port), "bench"
			if *etcdEndpoints != "" {
				// The port is free, so unused by earlier runs: a run id
				// whose state etcd does not hold yet.
				backend, endpoint, id = "etcd", *etcdEndpoints, "bench"+strconv.Itoa(port)
			}
			if *standalone {
				return append([]string{*gorun, "--log-level", "debug", "--log-format", "json", "--standalone", "--nproc-per-node", "1",
					"--log-dir", logDir, "--no-python"}, worker...)
			}
			argv := append([]string{*gorun, "--log-level", "debug", "--log-format", "json", "--nnodes", strconv.Itoa(n), "--nproc-per-node", "1",
				"--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", id,
				"--local-addr", "127.0.0.1", "--log-dir", logDir}, strings.Fields(*agentFlags)...)
			return append(append(argv, "--no-python"), worker...)
		}
	}
	torchArgv := func(n int) func(int, string) []string {
		return func(port int, logDir string) []string {
			return append([]string{*python, "-m", "torch.distributed.run", "--nnodes", strconv.Itoa(n), "--nproc_per_node", "1",
				"--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:" + strconv.Itoa(port), "--rdzv_id", "bench",
				"--redirects", "1", "--tee", "1", "--log_dir", logDir, "--no_python"}, worker...)
		}
	}
	launchers := []launcher{
		{fmt.Sprintf("gorun, %d agents", *gorunAgents), *gorunAgents, 3 * time.Second, gorunArgv(*gorunAgents)},
	}
	if *torchAgents > 0 { // -torch-agents 0: gorun alone
		launchers = append(launchers,
			launcher{fmt.Sprintf("gorun, %d agents", *torchAgents), *torchAgents, 2 * time.Second, gorunArgv(*torchAgents)},
			launcher{fmt.Sprintf("torchrun, %d agents", *torchAgents), *torchAgents, time.Duration(*torchAgents) * 1500 * time.Millisecond, torchArgv(*torchAgents)})
	}
	results := map[string][]float64{}
	execd := map[string][]float64{}
	cpu := map[string][]float64{}
	var detect, carryOn []float64
	for rep := 1; rep <= *reps; rep++ {
		for _, l := range launchers {
			m, err := measure(l)
			if err != nil {
				fmt.Fprintf(os.Stderr, "rdzvbench: %s: %v\n", l.name, err)
				os.Exit(1)
			}
			fmt.Fprintf(os.Stderr, "rdzvbench: rep %d %s: workers' first line %.1f ms, agents exec'd %.1f ms\n", rep, l.name, m.workers, m.execd)
			if loseOneOn {
				fmt.Fprintf(os.Stderr, "rdzvbench: rep %d %s: one agent lost: known after %.1f ms; every survivor carried on %.1f ms after that (%d survivors, %d by a shrink epoch)\n",
					rep, l.name, ms(m.loss.detect), ms(m.loss.carryOn), m.loss.survivors, m.loss.epochs)
				detect, carryOn = append(detect, ms(m.loss.detect)), append(carryOn, ms(m.loss.carryOn))
			}
			results[l.name] = append(results[l.name], m.workers)
			cpu[l.name] = append(cpu[l.name], m.cpu)
			if m.execd > 0 {
				execd[l.name] = append(execd[l.name], m.execd)
			}
		}
	}
	backend := "c10d backend"
	if *etcdEndpoints != "" {
		backend = "gorun's etcd backend (" + *etcdEndpoints + ")"
	}
	fmt.Printf("Medians of %d repetitions, %d CPUs. One worker per agent, %s on loopback.\n\n", *reps, runtime.NumCPU(), backend)
	if fromFirst {
		fmt.Println("| launcher | first start → every agent has exec'd its workers (ms) | first start → every worker's first line (ms) | CPU, agents + workers, to exit (ms) |")
	} else {
		fmt.Println("| launcher | last join → every agent has exec'd its workers (ms) | last join → every worker's first line (ms) | CPU after the last join, agents + workers, to exit (ms) |")
	}
	fmt.Println("|---|---|---|---|")
	for _, l := range launchers {
		a := "n/a (no such log line)"
		if v := execd[l.name]; len(v) > 0 {
			a = fmt.Sprintf("%.1f", stats.Median(v))
		}
		fmt.Printf("| %s | %s | %.1f | %.0f |\n", l.name, a, stats.Median(results[l.name]), stats.Median(cpu[l.name]))
	}
	if loseOneOn {
		fmt.Printf("\nOne agent lost %v after every worker started (medians; the runs: %s):\n\n", loseAfter, fmtRuns(carryOn))
		fmt.Println("| the kill → the loss known (ms) | the loss known → every survivor's next epoch or round (ms) |")
		fmt.Println("|---|---|")
		fmt.Printf("| %.1f | %.1f |\n", stats.Median(detect), stats.Median(carryOn))
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }

func fmtRuns(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprintf("%.1f ms", x)
	}
	return strings.Join(s, ", ")
}

// measured is one job's figures.
type measured struct {
	workers float64 // ms to the last worker's first line
	execd   float64 // ms to the last agent's "workers started" (0: not every agent logged one)
	cpu     float64 // ms of CPU, agents and workers (0 with -lose-one)
	loss    lossResult
}

// measure runs one job and returns the milliseconds from the last agent's
// start to the last worker's first line (the worker records the time); for
// gorun, to the last agent having exec'd its worker (its "workers started"
// log line; 0 for torchrun, which logs no such line); and the CPU
// milliseconds all agents and their workers spent after the last join,
// start to exit.
func measure(l launcher) (measured, error) {
	dir, err := os.MkdirTemp("", "rdzvbench")
	if err != nil {
		return measured{}, err
	}
	defer func() {
		if os.Getenv("RDZVBENCH_KEEP") == "" {
			os.RemoveAll(dir)
		} else {
			fmt.Fprintln(os.Stderr, "kept", dir)
		}
	}()
	out := filepath.Join(dir, "started")
	os.Mkdir(out, 0o755)
	port, err := freePort()
	if err != nil {
		return measured{}, err
	}
	var cmds []*exec.Cmd
	defer func() {
		// Every group killed before any is waited for: one by one, a
		// thousand agents starving each other took minutes to end.
		for _, c := range cmds {
			if c.Process != nil {
				syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
			}
		}
		for _, c := range cmds {
			if c.Process != nil {
				c.Wait()
			}
		}
	}()
	start := func() (*exec.Cmd, error) {
		argv := l.argv(port, filepath.Join(dir, "logs"))
		c := exec.Command(argv[0], argv[1:]...)
		c.Env = append(os.Environ(), "RDZVBENCH_OUT="+out, "RDZVBENCH_AGENT="+strconv.Itoa(len(cmds)))
		c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		logf, err := os.Create(filepath.Join(dir, fmt.Sprintf("agent%d.log", len(cmds))))
		if err != nil {
			return nil, err
		}
		defer logf.Close()
		c.Stdout, c.Stderr = logf, logf
		if err := c.Start(); err != nil {
			return nil, err
		}
		cmds = append(cmds, c)
		return c, nil
	}
	var before time.Duration
	t0 := time.Now()
	if !fromFirst {
		for range l.agents - 1 {
			if _, err := start(); err != nil {
				return measured{}, err
			}
		}
		time.Sleep(l.settle)
		// CPU already spent by each waiting agent, so that what the job
		// costs after the last join can be told apart.
		for _, c := range cmds {
			before += schedCPU(c.Process.Pid)
		}
		t0 = time.Now()
	} else {
		for range l.agents - 1 {
			if _, err := start(); err != nil {
				return measured{}, err
			}
		}
	}
	if _, err := start(); err != nil {
		return measured{}, err
	}
	// A worker's file exists before date has written it: count the
	// files that hold a time.
	deadline := t0.Add(waitFor)
	var last int64
	for {
		n := 0
		last = 0
		entries, _ := os.ReadDir(out)
		if len(entries) < l.agents {
			// Not every worker has even created its file: do not spend
			// the machine's CPU reading the others.
			time.Sleep(5 * time.Millisecond)
			if time.Now().After(deadline) {
				return measured{}, fmt.Errorf("%d of %d workers started in %v", len(entries), l.agents, waitFor)
			}
			continue
		}
		for _, e := range entries {
			b, _ := os.ReadFile(filepath.Join(out, e.Name()))
			if ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
				n++
				last = max(last, ns)
			}
		}
		if n == l.agents {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "agent0.log"))
			return measured{}, fmt.Errorf("%d of %d workers started in %v; agent 0 said:\n%s", n, l.agents, waitFor, b)
		}
		time.Sleep(5 * time.Millisecond)
	}
	m := measured{workers: float64(last-t0.UnixNano()) / 1e6, execd: agentsStarted(dir, l.agents, t0)}
	if fl, n := firstLines(dir, l.agents, t0); n > 0 {
		fmt.Fprintf(os.Stderr, "rdzvbench: %d of %d agents logged a first line, the last %.1f ms after the clock started\n", n, l.agents, fl)
	}
	if loseOneOn {
		time.Sleep(loseAfter)
		pids := make([]int, len(cmds))
		for i, c := range cmds {
			pids[i] = c.Process.Pid
		}
		m.loss, err = loseOne(dir, pids, waitFor)
		return m, err
	}
	var total time.Duration // agents' and their workers' whole CPU
	allStarted := time.Unix(0, last)
	var ended time.Time // when the last agent was seen to have exited
	killed := 0
	for _, c := range cmds {
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case <-done:
			ended = time.Now()
		case <-time.After(60 * time.Second):
			syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
			killed++
			<-done
		}
		if ru, ok := c.ProcessState.SysUsage().(*syscall.Rusage); ok {
			total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
		c.Process = nil
	}
	m.cpu = float64((total - before).Microseconds()) / 1e3
	// The job's end: from every worker started (each exits at once) to
	// the last agent's exit, the exit barrier and the closing included.
	fmt.Fprintf(os.Stderr, "rdzvbench: the last agent exited %.1f ms after every worker started; %d of %d killed after a 60-s wait\n",
		float64(ended.Sub(allStarted).Microseconds())/1e3, killed, len(cmds))
	return m, nil
}

// schedCPU is the time pid's threads have spent on a CPU so far
// (/proc/PID/task/*/schedstat, nanoseconds).
func schedCPU(pid int) time.Duration {
	stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var ns int64
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if fs := strings.Fields(string(b)); len(fs) > 0 {
			v, _ := strconv.ParseInt(fs[0], 10, 64)
			ns += v
		}
	}
	return time.Duration(ns)
}

// firstLines returns the milliseconds from t0 to the last agent's first
// JSON log line (the process started and running gorun's code), and how
// many agents logged one.
func firstLines(dir string, agents int, t0 time.Time) (float64, int) {
	var last time.Time
	n := 0
	for i := range agents {
		b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("agent%d.log", i)))
		for _, ln := range bytes.Split(b, []byte{'\n'}) {
			if _, ts, ok := parseLine(ln); ok {
				n++
				if ts.After(last) {
					last = ts
				}
				break
			}
		}
	}
	return float64(last.Sub(t0).Microseconds()) / 1e3, n
}

// agentsStarted reads the agents' JSON logs for their "workers started"
// lines and returns the milliseconds from t0 to the last of them, or 0 if
// not every agent logged one.
func agentsStarted(dir string, agents int, t0 time.Time) float64 {
	var last time.Time
	n := 0
	for i := range agents {
		b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("agent%d.log", i)))
		for _, line := range strings.Split(string(b), "\n") {
			var e struct {
				Msg string `json:"msg"`
				TS  string `json:"ts"`
			}
			if json.Unmarshal([]byte(line), &e) != nil || e.Msg != "workers started" {
				continue
			}
			if ts, err := time.Parse(time.RFC3339Nano, e.TS); err == nil {
				n++
				if ts.After(last) {
					last = ts
				}
			}
		}
	}
	if n != agents {
		return 0
	}
	return float64(last.Sub(t0).Microseconds()) / 1e3
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
