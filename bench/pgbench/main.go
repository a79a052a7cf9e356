// Command pgbench measures pg/cpu's AllReduce beside PyTorch 1.13's gloo
// (bench/gloo_allreduce.py) on the same machine, in the same run, and
// prints a markdown table of medians and ratios.
//
// AllReduce: -nproc rank processes (this program, re-executed) on
// loopback, float32, at each of -sizes: -warmup untimed iterations, then
// timed ones, each after a Barrier; rank 0's median latency and bus
// bandwidth (size/time × 2(n-1)/n). gloo is measured the same way.
//
// Abort: 4 ranks (goroutines of this process) of which 3 block in an
// AllReduce waiting for the fourth; time from Abort on one of them to the
// return of its AllReduce. Shrink: 8 ranks blocked on rank 3; time from
// the survivors' ShrinkAbort to the slowest one holding its 7-rank group.
// Both repeated -reps times; medians.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Environment of a rank process.
const (
	envRank  = "PGBENCH_RANK"
	envSize  = "PGBENCH_SIZE"
	envStore = "PGBENCH_STORE"
	envPlan  = "PGBENCH_PLAN"
)

type plan struct {
	Sizes     []int  `json:"sizes"`
	Iters     []int  `json:"iters"`
	Warmup    int    `json:"warmup"`
	Chunk     int    `json:"chunk"`
	Transport string `json:"transport"` // pg/cpu's LocalTransport
	SockBuf   int    `json:"sockbuf"`   // pg/cpu's SocketBufferBytes
}

type result struct {
	Bytes   int     `json:"bytes"`
	Median  float64 `json:"median_s"`
	BusBW   float64 `json:"busbw_gbs"`
	Iters   int     `json:"iters"`
	Backend string  `json:"backend,omitempty"`
}

func main() {
	if os.Getenv(envRank) != "" {
		if err := rankMain(); err != nil {
			fmt.Fprintln(os.Stderr, "pgbench rank:", err)
			os.Exit(1)
		}
		return
	}
	var (
		nproc   = flag.Int("nproc", 4, "ranks")
		sizes   = flag.String("sizes", "4096,1048576,16777216,67108864", "AllReduce sizes in bytes")
		iters   = flag.String("iters", "200,50,15,7", "timed iterations per size")
		warmup  = flag.Int("warmup", 3, "untimed iterations per size")
		chunk   = flag.Int("chunk", 0, "pg/cpu ChunkBytes (0: default)")
		sockbuf = flag.Int("sockbuf", 0, "pg/cpu SocketBufferBytes (0: default)")
		trans   = flag.String("transports", "shm,unix,tcp", "pg/cpu LocalTransports to measure, each beside gloo")
		rounds  = flag.Int("rounds", 3, "rounds; each runs every pg/cpu transport and gloo once, interleaved; medians across rounds are reported")
		python  = flag.String("python", "/usr/bin/python3", "Python with torch 1.13; empty: skip gloo")
		gloo    = flag.String("gloo", "bench/gloo_allreduce.py", "the gloo script")
		reps    = flag.Int("reps", 5, "repetitions of the abort and shrink measurements")
		out     = flag.String("out", "", "raw results (JSON lines); empty: none")
		timeout = flag.Duration("timeout", 5*time.Minute, "bound on each side's AllReduce run")
	)
	flag.Parse()
	base := plan{Sizes: ints(*sizes), Iters: ints(*iters), Warmup: *warmup, Chunk: *chunk, SockBuf: *sockbuf}
	if len(base.Sizes) != len(base.Iters) {
		fail(errors.New("-sizes and -iters differ in length"))
	}
	transports := strings.Split(*trans, ",")
	// runs[name][round] holds one run's results, a result per size.
	runs := map[string][][]result{}
	names := []string{}
	for _, t := range transports {
		names = append(names, "pg/cpu "+t)
	}
	if *python != "" {
		names = append(names, "gloo")
	}
	for range *rounds {
		for _, t := range transports {
			p := base
			p.Transport = t
			res, err := runOurs(*nproc, p, *timeout)
			if err != nil {
				fail(fmt.Errorf("pg/cpu %s: %w", t, err))
			}
			runs["pg/cpu "+t] = append(runs["pg/cpu "+t], res)
		}
		if *python != "" {
			res, err := runGloo(*python, *gloo, *nproc, base, *timeout)
			if err != nil {
				fail(err)
			}
			runs["gloo"] = append(runs["gloo"], res)
		}
	}
	abort, shrink, err := faults(*reps)
	if err != nil {
		fail(err)
	}
	med := map[string][]result{}
	for _, n := range names {
		med[n] = medianRuns(runs[n])
	}
	if *out != "" {
		f, err := os.Create(*out)
		if err != nil {
			fail(err)
		}
		enc := json.NewEncoder(f)
		for _, n := range names {
			for round, rs := range runs[n] {
				for _, r := range rs {
					r.Backend = n
					enc.Encode(struct {
						result
						Round int `json:"round"`
					}{r, round})
				}
			}
		}
		enc.Encode(map[string]any{"abort_median_s": abort.Seconds(), "shrink_8to7_median_s": shrink.Seconds()})
		f.Close()
	}
	fmt.Printf("%d ranks, float32 AllReduce, loopback, %d cores. Each value: the median over %d interleaved rounds of each run's median\n", *nproc, runtime.NumCPU(), *rounds)
	fmt.Printf("(timed iterations after a barrier). pg/cpu shm: same-host peers through shared-memory rings with unix-socket doorbells (the default); pg/cpu unix: over abstract unix sockets alone; pg/cpu tcp: over loopback TCP.\n\n")
	printTable("latency", names, base.Sizes, med, func(r result) float64 { return r.Median }, dur, true)
	fmt.Println()
	printTable("bus bandwidth", names, base.Sizes, med, func(r result) float64 { return r.BusBW }, gbs, false)
	fmt.Printf("\nAbort (blocked AllReduce → error), 4 ranks in-process: median %s over %d\n", dur(abort.Seconds()), *reps)
	fmt.Printf("Shrink 8 → 7 (ShrinkAbort while blocked → every survivor holds the new group), in-process: median %s over %d\n", dur(shrink.Seconds()), *reps)
}

// medianRuns returns, per size, the result whose median is the median
// across runs.
func medianRuns(runs [][]result) []result {
	if len(runs) == 0 {
		return nil
	}
	out := make([]result, len(runs[0]))
	for i := range out {
		var col []result
		for _, rs := range runs {
			if i < len(rs) {
				col = append(col, rs[i])
			}
		}
		sort.Slice(col, func(a, b int) bool { return col[a].Median < col[b].Median })
		out[i] = col[len(col)/2]
	}
	return out
}

// printTable prints one metric for every backend, with each pg/cpu
// column's ratio to gloo (lowerBetter: gloo ÷ pg/cpu, else pg/cpu ÷ gloo).
func printTable(metric string, names []string, sizes []int, med map[string][]result, get func(result) float64, format func(float64) string, lowerBetter bool) {
	head, sep := "| size |", "|---:|"
	for _, n := range names {
		head += " " + n + " " + metric + " |"
		sep += "---:|"
	}
	for _, n := range names {
		if n == "gloo" || med["gloo"] == nil {
			continue
		}
		if lowerBetter {
			head += " gloo ÷ " + n + " |"
		} else {
			head += " " + n + " ÷ gloo |"
		}
		sep += "---:|"
	}
	fmt.Println(head)
	fmt.Println(sep)
	for i, size := range sizes {
		row := "| " + human(size) + " |"
		val := func(n string) float64 {
			if i < len(med[n]) {
				return get(med[n][i])
			}
			return 0
		}
		for _, n := range names {
			row += " " + format(val(n)) + " |"
		}
		for _, n := range names {
			if n == "gloo" || med["gloo"] == nil {
				continue
			}
			if lowerBetter {
				row += " " + ratio(val("gloo"), val(n)) + " |"
			} else {
				row += " " + ratio(val(n), val("gloo")) + " |"
			}
		}
		fmt.Println(row)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "pgbench:", err)
	os.Exit(1)
}

func ints(s string) []int {
	var v []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			fail(fmt.Errorf("%q: %w", s, err))
		}
		v = append(v, n)
	}
	return v
}

func human(b int) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%d MiB", b>>20)
	case b >= 1<<10:
		return fmt.Sprintf("%d KiB", b>>10)
	}
	return fmt.Sprintf("%d B", b)
}

func dur(s float64) string {
	if s == 0 {
		return "–"
	}
	if s < 1e-3 {
		return fmt.Sprintf("%.0f µs", s*1e6)
	}
	return fmt.Sprintf("%.2f ms", s*1e3)
}

func gbs(v float64) string {
	if v == 0 {
		return "–"
	}
	return fmt.Sprintf("%.3f GB/s", v)
}

func ratio(a, b float64) string {
	if a == 0 || b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// runOurs starts nproc rank processes around an in-process store and
// returns rank 0's results.
func runOurs(nproc int, p plan, timeout time.Duration) ([]result, error) {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		return nil, err
	}
	defer srv.Close()
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	pj, _ := json.Marshal(p)
	cmds := make([]*exec.Cmd, nproc)
	var res []result
	var scanErr error
	var wg sync.WaitGroup
	for r := range nproc {
		cmd := exec.Command(self)
		cmd.Env = append(os.Environ(), envRank+"="+strconv.Itoa(r), envSize+"="+strconv.Itoa(nproc),
			envStore+"="+srv.Addr().String(), envPlan+"="+string(pj))
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		cmd.Stderr = os.Stderr
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		cmds[r] = cmd
		if r == 0 {
			wg.Go(func() {
				sc := bufio.NewScanner(stdout)
				for sc.Scan() {
					var x result
					if err := json.Unmarshal(sc.Bytes(), &x); err != nil {
						scanErr = fmt.Errorf("rank 0 said %q", sc.Text())
						continue
					}
					res = append(res, x)
				}
			})
		}
	}
	timer := time.AfterFunc(timeout, func() {
		for _, c := range cmds {
			c.Process.Kill()
		}
	})
	defer timer.Stop()
	var firstErr error
	for r, c := range cmds {
		if err := c.Wait(); err != nil && firstErr == nil {
			firstErr = fmt.Errorf("rank %d: %w", r, err)
		}
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = scanErr
	}
	return res, firstErr
}

func rankMain() error {
	rank, _ := strconv.Atoi(os.Getenv(envRank))
	size, _ := strconv.Atoi(os.Getenv(envSize))
	var p plan
	if err := json.Unmarshal([]byte(os.Getenv(envPlan)), &p); err != nil {
		return err
	}
	ctx := context.Background()
	store, err := tcpstore.Dial(ctx, os.Getenv(envStore), tcpstore.ClientConfig{})
	if err != nil {
		return err
	}
	defer store.Close()
	cfg := cpu.DefaultConfig()
	cfg.ListenAddr = "127.0.0.1:0"
	if p.Chunk > 0 {
		cfg.ChunkBytes = p.Chunk
	}
	if p.Transport != "" {
		cfg.LocalTransport = p.Transport
	}
	if p.SockBuf > 0 {
		cfg.SocketBufferBytes = p.SockBuf
	}
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: "pgbench", Rank: rank, Size: size}
	g, err := cpu.New(ctx, cfg)
	if err != nil {
		return err
	}
	defer g.Close()
	for i, bytes := range p.Sizes {
		buf := make([]float32, bytes/4)
		for j := range buf {
			buf[j] = 1
		}
		b := pg.Host(buf)
		for range p.Warmup {
			if err := g.AllReduce(ctx, b, pg.Sum); err != nil {
				return err
			}
		}
		times := make([]float64, 0, p.Iters[i])
		for range p.Iters[i] {
			if err := g.Barrier(ctx); err != nil {
				return err
			}
			start := time.Now()
			if err := g.AllReduce(ctx, b, pg.Sum); err != nil {
				return err
			}
			times = append(times, time.Since(start).Seconds())
		}
		if rank == 0 {
			med := stats.Median(times)
			bus := float64(bytes) / med * 2 * float64(size-1) / float64(size) / 1e9
			out, _ := json.Marshal(result{Bytes: bytes, Median: med, BusBW: bus, Iters: len(times)})
			fmt.Println(string(out))
		}
	}
	return g.Barrier(ctx)
}

// runGloo runs the gloo script and returns its results.
func runGloo(python, script string, nproc int, p plan, timeout time.Duration) ([]result, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	join := func(v []int) string {
		s := make([]string, len(v))
		for i, x := range v {
			s[i] = strconv.Itoa(x)
		}
		return strings.Join(s, ",")
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, script, strconv.Itoa(nproc), strconv.Itoa(port), join(p.Sizes), join(p.Iters), strconv.Itoa(p.Warmup))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("gloo: %w", err)
	}
	var res []result
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var x result
		if err := json.Unmarshal([]byte(line), &x); err != nil {
			return nil, fmt.Errorf("gloo said %q", line)
		}
		res = append(res, x)
	}
	return res, nil
}
