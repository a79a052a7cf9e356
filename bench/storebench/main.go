// Command storebench measures gorun's TCPStore server beside PyTorch's own
// C++ servers (1.13 on the host; 2.14's classic backend in the sid bed,
// internal/sidbed, when it is built), in the same run, with the same load client (bench/storeload),
// and prints a markdown table of medians and ratios for BENCHMARKS.md.
//
// Each measurement starts a fresh server process and a separate load
// process, so CPU and memory are attributed to the right side. Servers are
// interleaved within each repetition, so machine noise hits both alike.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/internal/sidbed"
)

type server struct {
	name string // row label
	kind string // "gorun", "gorun-baseline", "torch" (1.13 on the host) or "torch214" (the sid bed's)
	wire string // wire generation the load client speaks to it
}

// The servers measured, in this order; torch 2.14's joins when the sid bed
// (internal/sidbed) is there or -python214 names an interpreter.
var (
	servers = []server{
		{"gorun (old wire)", "gorun", "old"},
		{"gorun (new wire)", "gorun", "new"},
		{"torch 1.13 C++ server", "torch", "old"},
	}
	torch214 = server{"torch 2.14 C++ server (classic)", "torch214", "new"}
)

type config struct {
	gorun, gorunBaseline           string
	storeload, python, torchServer string
	// python214 runs torch 2.14's server: an interpreter that runs in the
	// sid bed, which sees only the temporary directory, so the server
	// script is copied there (torchServer214).
	python214, torchServer214 string
	reps                      int
	duration                  time.Duration
	conns, storms             []int
	idleConns                 int
	partialConns, partialSend int
	partialAnnounce           int64
	out                       string
}

func main() {
	var cfg config
	var conns, storms string
	flag.StringVar(&cfg.gorun, "gorun", "bin/gorun", "gorun binary")
	flag.StringVar(&cfg.gorunBaseline, "gorun-baseline", "", "another gorun binary (an earlier build) measured "+
		"beside the first in the same run, on the old wire (default: none)")
	flag.StringVar(&cfg.storeload, "storeload", "bin/storeload", "storeload binary")
	flag.StringVar(&cfg.python, "python", "/usr/bin/python3", "Python with torch")
	flag.StringVar(&cfg.torchServer, "torch-server", "bench/torch_store_server.py", "PyTorch server script")
	flag.StringVar(&cfg.python214, "python214", "auto", `Python with torch 2.14 for a second PyTorch server ("auto": the sid bed's, when built; "": none)`)
	flag.IntVar(&cfg.reps, "reps", 3, "repetitions (medians are reported)")
	flag.DurationVar(&cfg.duration, "duration", 5*time.Second, "length of each mixed-load run")
	flag.StringVar(&conns, "conns", "1,64,256", "connection counts for the mixed load")
	flag.StringVar(&storms, "storm", "4096,16384", "client counts for the connect storm")
	flag.IntVar(&cfg.idleConns, "idle", 4096, "idle connections for the RSS measurement")
	flag.IntVar(&cfg.partialConns, "partial", 16, "connections that announce a large value and send little (0: skip)")
	flag.Int64Var(&cfg.partialAnnounce, "partial-announce", 64<<20, "value length each partial connection announces "+
		"(PyTorch 1.13's server allocates it at once: mind the machine's memory)")
	flag.IntVar(&cfg.partialSend, "partial-send", 4<<10, "bytes each partial connection sends")
	flag.StringVar(&cfg.out, "out", "bench/results/store.jsonl", "raw results (JSON lines)")
	flag.Parse()
	cfg.conns, cfg.storms = ints(conns), ints(storms)
	if cfg.gorunBaseline != "" {
		torch := servers[len(servers)-1]
		servers = append(servers[:len(servers)-1], server{"gorun baseline (old wire)", "gorun-baseline", "old"}, torch)
	}
	py214, err := sidbed.ResolvePython(cfg.python214)
	if err != nil {
		fmt.Fprintf(os.Stderr, "storebench: no torch 2.14 row: %v\n", err)
	}
	cfg.python214 = py214
	if cfg.python214 != "" {
		script, err := copyToTemp(cfg.torchServer)
		if err != nil {
			fmt.Fprintln(os.Stderr, "storebench:", err)
			os.Exit(1)
		}
		defer os.Remove(script)
		cfg.torchServer214 = script
		servers = append(servers, torch214)
	}
	if err := runAll(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "storebench:", err)
		os.Exit(1)
	}
}

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			n, err := strconv.Atoi(f)
			if err != nil {
				fmt.Fprintf(os.Stderr, "storebench: %q is not a number\n", f)
				os.Exit(2)
			}
			out = append(out, n)
		}
	}
	return out
}

// result is one storeload JSON object plus where it came from.
type result map[string]any

func (r result) num(k string) float64 {
	v, _ := r[k].(float64)
	return v
}

func runAll(cfg config) error {
	if err := os.MkdirAll(filepath.Dir(cfg.out), 0o755); err != nil {
		return err
	}
	raw, err := os.Create(cfg.out)
	if err != nil {
		return err
	}
	defer raw.Close()
	// results[benchmark][server] = one result per repetition
	results := map[string]map[string][]result{}
	record := func(bench string, s server, r result) {
		if results[bench] == nil {
			results[bench] = map[string][]result{}
		}
		r["bench"], r["server"] = bench, s.name
		results[bench][s.name] = append(results[bench][s.name], r)
		json.NewEncoder(raw).Encode(r)
	}
	for rep := 1; rep <= cfg.reps; rep++ {
		for _, n := range cfg.conns {
			for _, s := range servers {
				r, err := measure(cfg, s, "mixed", "-conns", strconv.Itoa(n), "-duration", cfg.duration.String())
				if err != nil {
					return err
				}
				record(fmt.Sprintf("mixed %d", n), s, r)
			}
		}
		for _, n := range cfg.storms {
			for _, s := range servers {
				r, err := measure(cfg, s, "storm", "-clients", strconv.Itoa(n))
				if err != nil {
					return err
				}
				record(fmt.Sprintf("storm %d", n), s, r)
			}
		}
		for _, n := range cfg.storms {
			// The kernel's share: bare connects, no requests (one server
			// kind suffices; the cost is the TCP handshake).
			r, err := measure(cfg, servers[0], "connect", "-clients", strconv.Itoa(n))
			if err != nil {
				return err
			}
			record(fmt.Sprintf("connect floor %d", n), servers[0], r)
		}
		if cfg.idleConns > 0 {
			for _, s := range servers {
				r, err := measure(cfg, s, "idle", "-conns", strconv.Itoa(cfg.idleConns))
				if err != nil {
					return err
				}
				record("idle", s, r)
			}
		}
		if cfg.partialConns > 0 {
			for _, s := range servers {
				r, err := measure(cfg, s, "partial", "-conns", strconv.Itoa(cfg.partialConns),
					"-announce", strconv.FormatInt(cfg.partialAnnounce, 10), "-send", strconv.Itoa(cfg.partialSend))
				if err != nil {
					return err
				}
				record("partial", s, r)
			}
		}
		fmt.Fprintf(os.Stderr, "storebench: repetition %d/%d done\n", rep, cfg.reps)
	}
	printTable(cfg, results)
	return nil
}

// measure starts a fresh server of kind s, runs one storeload mode against
// it and stops the server.
func measure(cfg config, s server, mode string, args ...string) (result, error) {
	addr, pid, stop, err := startServer(cfg, s.kind)
	if err != nil {
		return nil, err
	}
	defer stop()
	argv := append([]string{mode, "-addr", addr, "-wire", s.wire, "-label", s.name, "-pid", strconv.Itoa(pid)}, args...)
	cmd := exec.Command(cfg.storeload, argv...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s %s against %s: %w", cfg.storeload, strings.Join(argv, " "), s.name, err)
	}
	var r result
	if err := json.Unmarshal(out, &r); err != nil {
		return nil, fmt.Errorf("storeload printed %q: %w", out, err)
	}
	fmt.Fprintf(os.Stderr, "storebench: %s %v %s: %s", mode, args, s.name, out)
	return r, nil
}

// startServer starts a server process and returns its address and PID.
func startServer(cfg config, kind string) (addr string, pid int, stop func(), err error) {
	var cmd *exec.Cmd
	switch kind {
	case "gorun", "gorun-baseline":
		bin := cfg.gorun
		if kind == "gorun-baseline" {
			bin = cfg.gorunBaseline
		}
		cmd = exec.Command(bin, "--log-level", "error", "store", "serve", "--listen", "127.0.0.1:0")
	case "torch":
		cmd = exec.Command(cfg.python, cfg.torchServer)
	case "torch214":
		cmd = exec.Command(cfg.python214, cfg.torchServer214)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", 0, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", 0, nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return "", 0, nil, err
	}
	stop = func() {
		stdin.Close()
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	go io.Copy(io.Discard, stdout)
	if err != nil {
		stop()
		return "", 0, nil, fmt.Errorf("%s server printed no address: %w", kind, err)
	}
	line = strings.TrimSpace(line)
	switch kind {
	case "gorun", "gorun-baseline":
		return line, cmd.Process.Pid, stop, nil
	default:
		var port int
		if _, err := fmt.Sscan(line, &port, &pid); err != nil {
			stop()
			return "", 0, nil, fmt.Errorf("torch server printed %q: %w", line, err)
		}
		return "127.0.0.1:" + strconv.Itoa(port), pid, stop, nil
	}
}

// copyToTemp copies path into the temporary directory (which the sid bed
// sees) and returns the copy.
func copyToTemp(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	f, err := os.CreateTemp("", "storebench-*-"+filepath.Base(path))
	if err != nil {
		return "", err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return "", err
	}
	return f.Name(), f.Close()
}

func median(rs []result, key string) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = r.num(key)
	}
	return stats.Median(v)
}

// ratio is a column of quotients of two servers' medians.
type ratio struct{ label, num, den string }

func printTable(cfg config, results map[string]map[string][]result) {
	named := func(kind, wire string) string {
		for _, sv := range servers {
			if sv.kind == kind && sv.wire == wire {
				return sv.name
			}
		}
		return ""
	}
	ratios := []ratio{{"gorun old wire ÷ torch 1.13", named("gorun", "old"), named("torch", "old")}}
	if cfg.python214 != "" {
		ratios = append(ratios, ratio{"gorun new wire ÷ torch 2.14", named("gorun", "new"), torch214.name})
	}
	fmt.Printf("Medians of %d repetitions; mixed runs last %v each.\n\n", cfg.reps, cfg.duration)
	fmt.Printf("| benchmark | metric |")
	for _, s := range servers {
		fmt.Printf(" %s |", s.name)
	}
	for _, r := range ratios {
		fmt.Printf(" %s |", r.label)
	}
	fmt.Printf("\n|---|---|%s\n", strings.Repeat("---|", len(servers)+len(ratios)))
	row := func(bench, metric, key, format string, scale float64) {
		fmt.Printf("| %s | %s |", bench, metric)
		for _, s := range servers {
			fmt.Printf(" "+format+" |", median(results[bench][s.name], key)*scale)
		}
		for _, r := range ratios {
			g, t := median(results[bench][r.num], key), median(results[bench][r.den], key)
			if t != 0 {
				fmt.Printf(" %.2f× |", g/t)
			} else {
				fmt.Printf(" — |")
			}
		}
		fmt.Println()
	}
	for _, n := range cfg.conns {
		b := fmt.Sprintf("mixed %d", n)
		row(b, "ops/s", "ops_per_s", "%.0f", 1)
		row(b, "p99 (ms)", "p99_us", "%.2f", 1e-3)
		row(b, "server CPU per op (µs)", "server_cpu_us_per_op", "%.1f", 1)
		row(b, "load client CPU per op (µs)", "client_cpu_us_per_op", "%.1f", 1)
	}
	for _, n := range cfg.storms {
		b := fmt.Sprintf("storm %d", n)
		row(b, "seconds", "seconds", "%.2f", 1)
		row(b, "server CPU (s)", "server_cpu_s", "%.2f", 1)
		fmt.Printf("| connect floor %d | seconds for %d bare connects (no requests, one thread) | %.2f |%s\n",
			n, n, median(results[fmt.Sprintf("connect floor %d", n)][servers[0].name], "seconds"),
			strings.Repeat(" |", len(servers)-1+len(ratios)))
	}
	if cfg.idleConns > 0 {
		row("idle", fmt.Sprintf("KiB RSS per idle connection (%d)", cfg.idleConns), "kib_per_conn", "%.1f", 1)
	}
	if cfg.partialConns > 0 {
		row("partial", fmt.Sprintf("KiB RSS per connection announcing %d MiB, sending %d KiB (%d)",
			cfg.partialAnnounce>>20, cfg.partialSend>>10, cfg.partialConns), "kib_per_conn", "%.1f", 1)
		fmt.Printf("| partial | still answers a new client within 3 s (repetitions) |")
		for _, s := range servers {
			n := 0
			for _, r := range results["partial"][s.name] {
				if ok, _ := r["server_answers"].(bool); ok {
					n++
				}
			}
			fmt.Printf(" %d of %d |", n, len(results["partial"][s.name]))
		}
		fmt.Printf(" |\n")
	}
	var failures []string
	for bench, bySrv := range results {
		for srv, rs := range bySrv {
			for _, r := range rs {
				if r.num("failed_ops") > 0 || r.num("failed_clients") > 0 {
					failures = append(failures, fmt.Sprintf("%s / %s: %v", bench, srv, r["first_error"]))
				}
			}
		}
	}
	slices.Sort(failures)
	for _, f := range failures {
		fmt.Printf("\nfailures: %s", f)
	}
	fmt.Println()
}
