package main

import (
	"fmt"
	"io"
	"runtime"
	"strings"
)

// printTable prints the results as markdown: the goodput table, then the
// invariants' table.
func printTable(w io.Writer, c *config, results []RowResult, notes []string) {
	var base float64
	for _, r := range results {
		if r.Row.FaultFree {
			base = r.Report.Goodput
		}
	}
	where := fmt.Sprintf("%d ranks on one host (--standalone)", c.job.Nproc)
	if c.job.Hosts > 1 {
		where = fmt.Sprintf("%d hosts (network namespaces on one machine) × %d ranks, rendezvous %s, a killed agent replaced on its host %v later", c.job.Hosts, c.job.Nproc, c.job.Backend, c.replace)
	}
	fmt.Fprintf(w, "%s, %d CPUs; %d steps (the fault-free row %d), each %d ms apart (%s); schedule: seed %d, MTBF %v, kinds %s, within %v.\n\n",
		where, runtime.NumCPU(), c.job.Steps, c.baselineSteps, c.job.StepMs, workerDesc(c.job), c.sched.Seed, c.sched.MTBF, c.kinds, c.sched.Horizon)
	fmt.Fprintln(w, "| row | wall (s) | goodput (rank-steps/s/rank) | vs fault-free | faults (skipped) | lost per fault, median (p90) s | steps redone | epochs | result | exact | invariants |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range results {
		ratio := "–"
		if base > 0 {
			ratio = fmt.Sprintf("%.1f%%", 100*r.Report.Goodput/base)
		}
		lost := "–"
		if len(r.Report.Lost) > 0 {
			lost = fmt.Sprintf("%.2f (%.2f)", r.Report.LostMedian.Seconds(), r.Report.LostP90.Seconds())
		}
		inv := "ok"
		if len(r.Violations) > 0 {
			inv = "**" + strings.Join(r.Violations, "; ") + "**"
		}
		exact := fmt.Sprint(r.Exact)
		if r.ExactHow != "" {
			exact += " (" + r.ExactHow + ")"
		}
		fmt.Fprintf(w, "| %s | %.1f | %.2f | %s | %d (%d) | %s | %d | %d | %.9g | %s | %s |\n", r.Row.Name, r.Wall.Seconds(),
			r.Report.Goodput, ratio, r.Brought(), len(r.Faults)-r.Brought(), lost, r.Report.Redone, r.Epochs, r.Result, exact, inv)
	}
	fmt.Fprintln(w, "\nThe agent, first sample → last (once a second; fds and RSS from /proc, goroutines from its /metrics, keys of the workers' store by `gorun store num-keys`, the job's keys in etcd and etcd's leases with -backend etcd; – where the launcher has none):")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| row | open fds | goroutines | RSS (MiB) | store keys | etcd keys | etcd leases | processes left |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
	for _, r := range results {
		if len(r.Samples) == 0 {
			continue
		}
		f, l := r.Samples[0], r.Samples[len(r.Samples)-1]
		pair := func(a, b int) string {
			if a < 0 || b < 0 {
				return "–"
			}
			return fmt.Sprintf("%d → %d", a, b)
		}
		rss := "–"
		if f.RSSKiB >= 0 && l.RSSKiB >= 0 {
			rss = fmt.Sprintf("%.1f → %.1f", float64(f.RSSKiB)/1024, float64(l.RSSKiB)/1024)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %d |\n", r.Row.Name, pair(f.FDs, l.FDs), pair(f.Goroutines, l.Goroutines), rss,
			pair(f.Keys, l.Keys), pair(f.EtcdKeys, l.EtcdKeys), pair(f.EtcdLeases, l.EtcdLeases), r.Left)
	}
	for _, n := range notes {
		fmt.Fprintf(w, "\n%s.\n", n)
	}
}

// workerDesc names the job's workers for the table's heading.
func workerDesc(j Job) string {
	startup := ""
	if j.Startup > 0 {
		startup = fmt.Sprintf(", start-up cost %v", j.Startup)
	}
	if j.WorkerKind == workerTorch {
		return fmt.Sprintf("PyTorch gloo train_elastic.py --lr %s, result: its loss (the fault-free reference %.9g), checkpoint every step%s", j.LR, j.RefLoss, startup)
	}
	return "Go allreduce, pg/cpu, result: the sum, checkpoint every step" + startup
}
