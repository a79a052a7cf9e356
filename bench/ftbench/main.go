// Command ftbench measures how long a job takes to recover from a fault —
// a crashed rank (SIGKILL) or, on several hosts, a host cut off the network
// (blackhole) — to the survivors' first successful collective, under
// gorun's two failure modes and under torchrun 1.13. It prints a markdown
// table (median and p90 over -trials) for BENCHMARKS.md and, with -out,
// every trial as a JSON line.
//
// Rows (all in the same run, interleaved within each trial, the order
// rotated from trial to trial, so that the machine's noise hits all alike):
//
//  1. gorun --on-failure shrink, Go allreduce (examples/allreduce, pg/cpu):
//     the survivors move to epoch 1 and carry on.
//  2. gorun --on-failure restart --max-restarts 1, the same worker: every
//     rank is stopped and attempt 1 starts.
//  3. torchrun 1.13 --max-restarts 1 with a PyTorch gloo worker
//     (bench/gloo_resume.py): torchrun's full restart.
//  4. gorun --on-failure restart with that PyTorch worker: row 3 with gorun.
//  5. gorun --on-failure shrink with PyTorch gloo
//     (examples/torch/train_elastic.py on gorun_ft): the survivors
//     re-initialise gloo among themselves.
//  6. and 7. heal, gorun --on-failure shrink --regrow on, with the Go and
//     the PyTorch worker: the killed rank is respawned and grown back in
//     (after a cut-off host, a spare agent standing by on an extra host of
//     the bed takes its place); the value is the fault → every rank's first
//     collective at full size (epoch 2), and a second table splits it.
//
// Rows 3–5 and 7 need PyTorch (-python); without it they are skipped, with one
// line saying so.
//
// Every worker prints `first-collective attempt=A epoch=E unix_ns=T` after
// its first successful collective of each attempt (TORCHELASTIC_RESTART_
// COUNT) and shrink epoch. A trial starts the job (-hosts × -nproc ranks),
// waits until every rank has stamped attempt 0 epoch 0, lets it run -warmup
// more, reads the clock and brings the fault, then waits until every rank
// of the recovery has stamped: the survivors at attempt 0 epoch 1 (shrink),
// or the group at attempt 1 epoch 0 (restart) — every rank after a SIGKILL,
// the other hosts' after a cut. The trial's value is the last of those
// stamps minus the fault's time (the group works again when every member
// does); the first is recorded too. Stamps and fault time are the same
// machine's CLOCK_REALTIME. Each trial is bounded by -trial-timeout. At its
// end the launchers get SIGTERM (and their process groups SIGKILL if they
// have not stopped within 10 s), and the benchmark — a child subreaper —
// kills and reaps whatever they left, and counts that.
//
// With -hosts 1 there is one agent, started with --standalone. With -hosts
// H ≥ 2 (root, iproute2) the benchmark builds a network-namespace bed of H
// hosts (internal/netns) and runs agent i in host i with --nnodes H (1:H
// for a restart after a cut, so that the others carry on), its host's
// --local-addr, a fresh --rdzv-id per trial and -backend's rendezvous:
// c10d, the store hosted by host 0's agent, or etcd, one member that the
// benchmark starts in the root namespace on the bed's gateway (data under
// its temporary directory, stopped and removed at the end). -fault
// blackhole cuts the link of the host that runs rank -victim (its frames
// are dropped: no reset, no error); at the trial's end that host's
// processes are killed (they cannot learn that the job ended) and its link
// restored. -fault node SIGKILLs that host's agent instead, its workers
// dying with it (a crashed node: their connections are reset). After
// either, a heal row runs a spare agent on the bed's extra host, started
// once the job runs; with -spare-prestart the spare pre-starts its
// workers and the fault waits until they are parked. PyTorch workers on the bed get GLOO_SOCKET_IFNAME=eth0. The bed
// and etcd go at the end, on SIGINT too.
//
//	go run ./bench/ftbench -trials 10 -out bench/results/ft.jsonl
//	go run ./bench/ftbench -hosts 2 -nproc 4 -fault blackhole -backend etcd -victim 5 -rows 2
//
// gorun and the Go worker are built from this repository into a temporary
// directory unless -gorun and -worker name binaries.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/bench/internal/stats"
	"github.com/gorunhq/gorun/internal/netns"
)

// config is the benchmark's settings, from the flags.
type config struct {
	trials       int
	hosts, nproc int
	victim       int           // the global rank killed, or whose host is cut off
	fault        string        // faultKill or faultBlackhole
	backend      string        // the rendezvous of several hosts: backendC10d or backendEtcd
	warmup       time.Duration // run time between every rank's first collective and the fault
	stepMs       int           // the workers' pause between steps
	trialTimeout time.Duration
	rows         string // which rows, by number; "" for all
	settleWindow string // gorun --settle-window in shrink rows; "" for its default
	// respawnBackoff is gorun's --respawn-backoff in the heal rows.
	respawnBackoff string
	gorunFlags     string // more gorun flags for every gorun agent, space-separated
	// sparePrestart: the heal rows' spare agent pre-starts its workers
	// (--spare-prestart), and the fault waits until they are parked.
	sparePrestart bool
	// rdzvConf is every multi-host agent's --rdzv-conf; c10dConf and
	// etcdConf are added to gorun's for its backend.
	rdzvConf, c10dConf, etcdConf string

	gorun, worker string // binaries; built when empty
	python        string // Python with torch 1.13, for torchrun and the Python workers
	etcd          string // the etcd binary, for -backend etcd
	root          string // the repository: bench/gloo_resume.py, examples/torch/…
	out, logs     string // JSON lines; a directory for every trial's console output

	tmp          string // removed at the end
	torchVersion string // "" when -python cannot import torch

	// The multi-host mode's bed (nil with -hosts 1), and what the
	// agents' command lines need of it.
	bed          *netns.Bed
	hostIPs      []string // by host
	hostNames    []string // by host: its namespace's name, its host name for torchrun
	hostsFile    string   // an /etc/hosts that names every host
	etcdEndpoint string   // host:port of the etcd member, with -backend etcd
	// spare are children of the benchmark that outlive trials (etcd):
	// not a launcher's leftovers.
	spare []int
}

func main() {
	var c config
	flag.IntVar(&c.trials, "trials", 10, "trials per row")
	flag.IntVar(&c.hosts, "hosts", 1, "hosts the ranks are spread over: 1 (--standalone), or 2 or more network-namespace hosts (needs root and iproute2)")
	flag.IntVar(&c.nproc, "nproc", 8, "ranks per host")
	flag.IntVar(&c.victim, "victim", 3, "the global rank SIGKILLed (-fault kill), or whose host is cut off (-fault blackhole), in every trial")
	flag.StringVar(&c.fault, "fault", faultKill, "kill: SIGKILL rank -victim; blackhole: cut the link of the host that runs it; node: SIGKILL that host's agent, its workers dying with it (-hosts 2 or more for both)")
	flag.StringVar(&c.backend, "backend", backendC10d, "the rendezvous of several hosts: c10d (the store on host 0) or etcd (a member started in the root namespace)")
	flag.StringVar(&c.rdzvConf, "rdzv-conf", "join_timeout=30,last_call_timeout=1", "every multi-host agent's --rdzv-conf (gorun's and torchrun's)")
	flag.StringVar(&c.c10dConf, "c10d-conf", "", "added to gorun's --rdzv-conf with -backend c10d (default none: gorun's keep-alive, 5 s × 3, behind node liveness)")
	flag.StringVar(&c.etcdConf, "etcd-conf", "lease_ttl=1", "added to gorun's --rdzv-conf with -backend etcd")
	flag.StringVar(&c.etcd, "etcd", "etcd", "etcd binary, for -backend etcd")
	flag.DurationVar(&c.warmup, "warmup", 500*time.Millisecond, "run time after every rank's first collective before the fault")
	flag.IntVar(&c.stepMs, "step-ms", 5, "the workers' pause between collectives, in milliseconds")
	flag.DurationVar(&c.trialTimeout, "trial-timeout", 3*time.Minute, "bound on one trial, start to recovery")
	flag.StringVar(&c.rows, "rows", "", "rows to run, by number, comma-separated (default all)")
	flag.StringVar(&c.settleWindow, "settle-window", "", "gorun's --settle-window (SECONDS) in the shrink rows (default: gorun's, 0.1)")
	flag.StringVar(&c.respawnBackoff, "respawn-backoff", "0.1", "gorun's --respawn-backoff (SECONDS) in the heal rows")
	flag.StringVar(&c.gorunFlags, "gorun-flags", "", "more flags for every gorun agent, space-separated (e.g. \"--node-suspicion-mult 200\", to leave a lost node to the rendezvous's own detection)")
	flag.BoolVar(&c.sparePrestart, "spare-prestart", false, "heal rows with a spare (-fault blackhole): the spare agent runs with --spare-prestart, and the fault waits until its workers are parked (imports done)")
	flag.StringVar(&c.gorun, "gorun", "", "gorun binary (default: build ./cmd/gorun)")
	flag.StringVar(&c.worker, "worker", "", "examples/allreduce binary (default: build it)")
	flag.StringVar(&c.python, "python", "/usr/bin/python3", "Python with PyTorch 1.13: torchrun, the Python workers")
	flag.StringVar(&c.root, "root", ".", "the repository's root")
	flag.StringVar(&c.out, "out", "", "write every trial as a JSON line to this file")
	flag.StringVar(&c.logs, "logs", "", "keep every trial's console output in this directory")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, &c, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "ftbench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c *config, stdout io.Writer) (err error) {
	selected, err := c.selectRows()
	if err != nil {
		return err
	}
	if err := c.validate(); err != nil {
		return err
	}
	// Orphans of a launcher are reparented to us, so none escapes.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become a subreaper: %w", err)
	}
	if c.tmp, err = os.MkdirTemp("", "ftbench-"); err != nil {
		return err
	}
	defer os.RemoveAll(c.tmp)
	if err := c.build(ctx); err != nil {
		return err
	}
	if c.hosts > 1 {
		tearDown, err := c.setUpHosts(ctx)
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, tearDown()) }()
	}
	if c.logs != "" {
		if err := os.MkdirAll(c.logs, 0o755); err != nil {
			return err
		}
	}
	var raw io.Writer = io.Discard
	if c.out != "" {
		if err := os.MkdirAll(filepath.Dir(c.out), 0o755); err != nil {
			return err
		}
		f, err := os.Create(c.out)
		if err != nil {
			return err
		}
		defer f.Close()
		raw = f
	}

	c.torchVersion = torchVersion(ctx, c.python)
	var skipped []string
	skip := func(drop func(row) bool, why string) {
		if slices.ContainsFunc(selected, drop) {
			skipped = append(skipped, why)
			fmt.Fprintln(os.Stderr, "ftbench:", why)
			selected = slices.DeleteFunc(selected, drop)
		}
	}
	if c.torchVersion == "" {
		skip(row.torch, fmt.Sprintf("PyTorch rows skipped: %s cannot import torch.", c.python))
	}
	if why := c.torchrunMissing(); why != "" {
		skip(func(r row) bool { return r.launcher == torchrunLauncher }, "torchrun row skipped: "+why+".")
	}

	var all []result
	for trial := 1; trial <= c.trials && ctx.Err() == nil; trial++ {
		for i := range selected {
			r := selected[(i+trial-1)%len(selected)] // rotated, trial by trial
			if ctx.Err() != nil {
				break
			}
			res := runTrial(ctx, c, r, trial)
			all = append(all, res)
			if err := json.NewEncoder(raw).Encode(res); err != nil {
				return err
			}
			progress(res)
		}
	}
	printTable(stdout, c, selected, all, skipped)
	return ctx.Err()
}

// validate checks the flags that do not depend on each other's rows.
func (c *config) validate() error {
	switch {
	case c.trials < 1 || c.nproc < 2:
		return errors.New("-trials must be at least 1 and -nproc at least 2")
	case c.hosts < 1 || c.hosts > netns.MaxHosts:
		return fmt.Errorf("-hosts %d: want 1 to %d", c.hosts, netns.MaxHosts)
	case c.victim < 0 || c.victim >= c.hosts*c.nproc:
		return fmt.Errorf("-victim %d is not a rank of %d", c.victim, c.hosts*c.nproc)
	case c.fault != faultKill && !hostLost(c.fault):
		return fmt.Errorf("-fault %q: want %s, %s or %s", c.fault, faultKill, faultBlackhole, faultNode)
	case c.backend != backendC10d && c.backend != backendEtcd:
		return fmt.Errorf("-backend %q: want %s or %s", c.backend, backendC10d, backendEtcd)
	case c.hosts == 1 && hostLost(c.fault):
		return fmt.Errorf("-fault %s takes a host from the others: it needs -hosts 2 or more", c.fault)
	case c.hosts == 1 && c.backend != backendC10d:
		return fmt.Errorf("-backend %s needs -hosts 2 or more (-hosts 1 runs --standalone)", c.backend)
	case hostLost(c.fault) && c.backend == backendC10d && c.victim < c.nproc:
		// Ranks follow the hosts' addresses: host 0 runs the first
		// -nproc. (runTrial checks where the rank really runs.)
		return fmt.Errorf("-fault %s -backend c10d: rank %d runs on host 0, which holds the c10d rendezvous store: "+
			"losing it ends the job rather than a part of it; choose a rank of another host (-victim %d or more) or -backend etcd",
			c.fault, c.victim, c.nproc)
	}
	return nil
}

// torchrunMissing says why the torchrun row cannot run here, or "".
func (c *config) torchrunMissing() string {
	if c.hosts == 1 {
		return ""
	}
	if c.backend != backendC10d {
		return torchrunEtcd
	}
	for _, tool := range []string{"unshare", "mount", "hostname"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Sprintf("no %s binary (util-linux), which gives each host's torchrun its own host name", tool)
		}
	}
	return ""
}

// selectRows returns the rows -rows names (all by default), in table order.
func (c *config) selectRows() ([]row, error) {
	if c.rows == "" {
		return slices.Clone(rows), nil
	}
	var out []row
	for f := range strings.SplitSeq(c.rows, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > len(rows) {
			return nil, fmt.Errorf("-rows: %q is not a row number 1..%d", f, len(rows))
		}
		if !slices.Contains(out, rows[n-1]) {
			out = append(out, rows[n-1])
		}
	}
	slices.SortFunc(out, func(a, b row) int { return slices.Index(rows, a) - slices.Index(rows, b) })
	return out, nil
}

// build builds gorun and the Go worker from the repository into the
// temporary directory, unless -gorun and -worker name binaries.
func (c *config) build(ctx context.Context) error {
	for _, b := range []struct {
		path *string
		pkg  string
	}{{&c.gorun, "./cmd/gorun"}, {&c.worker, "./examples/allreduce"}} {
		if *b.path != "" {
			if _, err := os.Stat(*b.path); err != nil {
				return err
			}
			continue
		}
		*b.path = filepath.Join(c.tmp, filepath.Base(b.pkg))
		cmd := exec.CommandContext(ctx, "go", "build", "-o", *b.path, b.pkg)
		cmd.Dir = c.root
		cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0") // gorun ships static
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s: %w\n%s", b.pkg, err, out)
		}
	}
	// The launchers run the workers from their own directories: absolute
	// paths, then.
	for _, p := range []*string{&c.gorun, &c.worker, &c.root} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	return nil
}

// torchVersion is "torch V on Python P" when python can import torch, else "".
func torchVersion(ctx context.Context, python string) string {
	out, err := exec.CommandContext(ctx, python, "-c",
		"import sys, torch; print('torch', torch.__version__, 'on Python', sys.version.split()[0])").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// progress reports a trial on stderr as it ends.
func progress(r result) {
	if r.Error != "" {
		fmt.Fprintf(os.Stderr, "ftbench: trial %d, %s: FAILED: %s\n", r.Trial, r.Row, r.Error)
		return
	}
	fmt.Fprintf(os.Stderr, "ftbench: trial %d, %s: %.1f ms (first survivor %.1f ms)\n", r.Trial, r.Row, r.LastMs, r.FirstMs)
}

func printTable(w io.Writer, c *config, selected []row, all []result, skipped []string) {
	fmt.Fprintf(w, "Command: `%s`\n\n", strings.Join(os.Args, " "))
	fmt.Fprintln(w, header(c))
	for _, s := range skipped {
		fmt.Fprintf(w, "\n%s\n", s)
	}
	fmt.Fprintf(w, "\n| # | launcher, mode, worker | trials ok | median (ms) | p90 (ms) | min (ms) | max (ms) | first survivor, median (ms) |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|\n")
	var failures []string
	left := 0
	for _, r := range selected {
		var last, first []float64
		n := 0
		for _, res := range all {
			if res.Row != r.name {
				continue
			}
			n++
			left += res.LeftBehind
			if res.Error != "" {
				failures = append(failures, fmt.Sprintf("trial %d, %s: %s", res.Trial, res.Row, res.Error))
				continue
			}
			last, first = append(last, res.LastMs), append(first, res.FirstMs)
		}
		num := slices.Index(rows, r) + 1
		if len(last) == 0 {
			fmt.Fprintf(w, "| %d | %s | 0/%d | failed | | | | |\n", num, r.name, n)
			continue
		}
		fmt.Fprintf(w, "| %d | %s | %d/%d | %.1f | %.1f | %.1f | %.1f | %.1f |\n", num, r.name, len(last), n,
			stats.Median(last), stats.Quantile(last, 0.9), slices.Min(last), slices.Max(last), stats.Median(first))
	}
	printHeal(w, selected, all)
	fmt.Fprintf(w, "\nProcesses left behind by the launchers once they had stopped on SIGTERM (killed and reaped by the benchmark), all trials: %d.\n", left)
	printCommands(w, selected, all)
	for _, f := range failures {
		fmt.Fprintf(w, "\nfailure: %s\n", f)
	}
}

// printHeal adds the heal rows' own measures: the row's value above is the
// kill → every rank at full size (the grow's epoch); here that from the
// newcomer's start, and the survivors' stall for the grow.
func printHeal(w io.Writer, selected []row, all []result) {
	var heal []row
	for _, r := range selected {
		if r.mode == modeHeal {
			heal = append(heal, r)
		}
	}
	if len(heal) == 0 {
		return
	}
	fmt.Fprintf(w, "\nHeal rows (the killed rank respawned and grown back in): medians, p90 in parentheses, ms.\n\n")
	fmt.Fprintf(w, "| # | row | trials ok | kill → shrunk (epoch 1) | kill → newcomer started | newcomer started → full size | newcomer ready → full size | survivors' stall for the grow (longest) |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|\n")
	for _, r := range heal {
		var shrink, start, from, fromReady, stall []float64
		for _, res := range all {
			if res.Row == r.name && res.Error == "" {
				start, from = append(start, res.NewcomerMs), append(from, res.FromNewcomerMs)
				fromReady = append(fromReady, res.FromReadyMs)
				// A trial whose survivors went straight to the grow
				// (their own epoch never formed) has neither.
				if res.ShrinkMs > 0 {
					shrink = append(shrink, res.ShrinkMs)
				}
				if res.GrowStallMs > 0 {
					stall = append(stall, res.GrowStallMs)
				}
			}
		}
		if len(from) == 0 {
			continue
		}
		mp := func(v []float64) string {
			if len(v) == 0 {
				return "–"
			}
			return fmt.Sprintf("%.1f (%.1f)", stats.Median(v), stats.Quantile(v, 0.9))
		}
		fmt.Fprintf(w, "| %d | %s | %d | %s | %s | %s | %s | %s |\n", slices.Index(rows, r)+1, r.name, len(from),
			mp(shrink), mp(start), mp(from), mp(fromReady), mp(stall))
	}
}

// header is the line under the command that says what was measured.
func header(c *config) string {
	var b strings.Builder
	if c.hosts == 1 {
		fmt.Fprintf(&b, "%d host × %d ranks on %d CPUs; rank %d SIGKILLed %v after every rank's first collective; workers pause %d ms between collectives. ",
			c.hosts, c.nproc, runtime.NumCPU(), c.victim, c.warmup, c.stepMs)
		fmt.Fprintf(&b, "Kill → the last survivor's first successful collective (the recovered group's), and the first survivor's; %d trials, rows interleaved within each.", c.trials)
	} else {
		fmt.Fprintf(&b, "%d hosts (network namespaces on one bridge, one machine) × %d ranks on %d CPUs; ", c.hosts, c.nproc, runtime.NumCPU())
		switch c.backend {
		case backendC10d:
			fmt.Fprintf(&b, "backend c10d, the store on host 0 (%s); ", c.c10dEndpoint())
		case backendEtcd:
			fmt.Fprintf(&b, "backend etcd, one member in the root namespace on the bed's gateway (%s); ", c.etcdEndpoint)
		}
		fault := "SIGKILL"
		switch c.fault {
		case faultKill:
			fmt.Fprintf(&b, "fault: rank %d SIGKILLed", c.victim)
		case faultBlackhole:
			fault = "cut"
			fmt.Fprintf(&b, "fault: blackhole, the link of the host that runs rank %d cut (the bridge drops its frames)", c.victim)
		case faultNode:
			fault = "node lost"
			fmt.Fprintf(&b, "fault: the agent of the host that runs rank %d SIGKILLed, its workers dying with it (their connections reset)", c.victim)
		}
		fmt.Fprintf(&b, " %v after every rank's first collective; workers pause %d ms between collectives. ", c.warmup, c.stepMs)
		fmt.Fprintf(&b, "%s → the last survivor's first successful collective (the recovered group's), and the first survivor's; %d trials, rows interleaved within each.", fault, c.trials)
	}
	if c.gorunFlags != "" {
		fmt.Fprintf(&b, " gorun's rows: %s.", c.gorunFlags)
	}
	if c.sparePrestart && hostLost(c.fault) && c.hosts > 1 {
		b.WriteString(" The heal rows' spare runs with --spare-prestart; the fault waits until its workers are parked, and \"newcomer started\" is then before the fault.")
	}
	if c.settleWindow != "" {
		fmt.Fprintf(&b, " gorun's shrink rows: --settle-window %s.", c.settleWindow)
	}
	if c.torchVersion != "" {
		fmt.Fprintf(&b, " torchrun: `%s -m torch.distributed.run --redirects 1 --tee 1` (%s), its default --monitor-interval (5 s).", c.python, c.torchVersion)
	}
	return b.String()
}

// printCommands prints each row's agents' command lines, as its first
// trial ran them.
func printCommands(w io.Writer, selected []row, all []result) {
	fmt.Fprintf(w, "\nCommands (each row's first trial; paths are the run's own):\n")
	for _, r := range selected {
		for _, res := range all {
			if res.Row != r.name || len(res.Commands) == 0 {
				continue
			}
			fmt.Fprintf(w, "\n%d. %s:\n", slices.Index(rows, r)+1, r.name)
			for _, cmd := range res.Commands {
				fmt.Fprintf(w, "   `%s`\n", cmd)
			}
			break
		}
	}
}
