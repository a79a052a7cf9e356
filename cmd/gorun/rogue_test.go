package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/netns"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestHostsRogueHost: issue 18's attacks from a third host of the
// network-namespace bed, one that reaches every port of a two-host job
// (2 × 4 Go allreduce ranks, shrink mode) but lacks its secret. It
// forges an epoch that excludes the healthy rank 5 (`gorun store set` on
// the worker store) and a memberlist "dead" message for each agent, sent
// to the other. Without a job secret both work — the control, which shows
// the test can fail; with one, the job neither shrinks nor stalls, the
// agents say what they ignored, and /metrics counts it. (Replays of a
// genuine epoch are refused by the same check: shrink's TestAuthBoard.)
func TestHostsRogueHost(t *testing.T) {
	for _, secret := range []bool{false, true} {
		name := map[bool]string{false: "without a job secret the attacks work", true: "with a job secret they are ignored"}[secret]
		t.Run(name, func(t *testing.T) {
			if secret {
				t.Setenv("GORUN_JOB_SECRET", "s3cr3t-of-the-rogue-test-0123")
			}
			const nodes, nproc, steps, healthPort = 2, 4, 1400, "29990"
			at, bed := onBed(t, nodes+1)
			rogue := bed.Hosts[nodes]
			j := startShrinkJobAt(t, at, nodes, nproc, steps, "--health-addr", ":"+healthPort)
			j.await(t, "start rank=", nodes*nproc, 60*time.Second)
			store := workerStore(t, j.agents[0].cmd.Process.Pid)
			bin := testutil.BuildGorun(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			// 1. The forged epoch.
			forged := `{"epoch":1,"excluded":[5],"lost":[5],"ranks":[0,1,2,3,4,-1,5,6],"world_size":7,"action":"shrink","base":0,"coordinator":"rogue"}`
			if out, err := rogue.Command(ctx, bin, "store", "set", "--store", store, "gorun/shrink/epoch/1", forged).CombinedOutput(); err != nil {
				t.Fatalf("the rogue's gorun store set: %v\n%s", err, out)
			}
			if !secret {
				// The healthy rank 5 goes: its agent stops it, or (on a
				// loaded machine) the rank reads the forgery first and
				// exits; either way the agent adopts the forged epoch.
				waitStderr(t, j.agents[1], "shrink epoch=1 world=7 excluded=[5]")
			}
			// 2. The forged "dead" messages: each agent told the other is
			// dead.
			exe, err := os.Executable()
			if err != nil {
				t.Fatal(err)
			}
			for i := range nodes {
				target, other := j.agents[i], j.agents[1-i]
				addr := bed.Hosts[i].IP.String() + ":" + strconv.Itoa(gossipPort(t, target.cmd.Process.Pid))
				victim := bed.Hosts[1-i].IP.String() + "-" + strconv.Itoa(other.cmd.Process.Pid)
				cmd := rogue.Command(ctx, exe)
				cmd.Env = append(os.Environ(), rogueDeadEnv+"="+addr+" job "+victim)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("the rogue's dead message: %v\n%s", err, out)
				}
			}
			if !secret {
				waitStderr(t, j.agents[0], "nodes lost; reporting their ranks")
				if !regexp.MustCompile(`nodes lost; reporting their ranks.*node liveness`).MatchString(j.agents[0].stderr.String()) {
					t.Fatalf("a node was lost, but not by node liveness:\n%s", j.agents[0].stderr)
				}
				return // the bed's cleanup ends the job
			}

			// With the secret: each agent saw and counted what it ignored,
			// while the job runs on.
			for i, p := range j.agents {
				waitStderr(t, p, "ignored gossip that fails the job secret's check")
				m := metrics(t, "http://"+bed.Hosts[i].IP.String()+":"+healthPort+"/metrics")
				if n := metricValue(m, `gorun_records_refused_total{kind="gossip"}`); n < 1 {
					t.Errorf("agent %d counts %v gossip refusals, want at least 1:\n%s", i, n, grepLines(m, "refused"))
				}
			}
			// The forged epoch: whichever agents read the board ignore it.
			awaitRefused(t, j, bed, healthPort, "epoch", 1)
			j.expectFullRun(t, nodes, nproc, steps)
			all := j.agents[0].stderr.String() + j.agents[1].stderr.String()
			if !strings.Contains(all, "ignored a record that fails the job secret's check") {
				t.Errorf("no agent said it ignored the forged epoch:\n%s", j.report())
			}
		})
	}
}

// awaitRefused waits until the job's agents (hosts 0.. of bed, /metrics on
// port) count at least n refused records of kind between them.
func awaitRefused(t *testing.T, j *shrinkJob, bed *netns.Bed, port, kind string, n float64) {
	t.Helper()
	series := `gorun_records_refused_total{kind="` + kind + `"}`
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		m := ""
		for i := range j.agents {
			m += metrics(t, "http://"+bed.Hosts[i].IP.String()+":"+port+"/metrics")
		}
		if metricValue(m, series) >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agents count %v %s refusals, want %v or more:\n%s\n%s", metricValue(m, series), kind, n, grepLines(m, "refused"), j.report())
		}
	}
}

// expectFullRun checks that a job attacked by a rogue host ended as if it
// had not been: every agent exits 0, every rank of the full world did
// every step with the full sum, and no agent acted on a forgery (shrank,
// found a node lost, re-rendezvoused).
func (j *shrinkJob) expectFullRun(t *testing.T, nodes, nproc, steps int) {
	t.Helper()
	j.expectExit0(t, j.agents)
	sum := 0
	for r := range nodes * nproc {
		sum += r + 1
	}
	var done int
	for _, m := range doneRE.FindAllStringSubmatch(j.output(), -1) {
		done++
		if m[2] != strconv.Itoa(nodes*nproc) || m[3] != strconv.Itoa(steps) || m[4] != strconv.Itoa(sum) {
			t.Errorf("%s: want world=%d steps=%d sum=%d", m[0], nodes*nproc, steps, sum)
		}
	}
	if done != nodes*nproc {
		t.Errorf("%d done lines, want %d\n%s", done, nodes*nproc, j.report())
	}
	for i, p := range j.agents {
		log := p.stderr.String()
		for _, acted := range []string{"stopping a worker the epoch excludes", "nodes lost; reporting their ranks", "re-rendezvous"} {
			if strings.Contains(log, acted) {
				t.Errorf("agent %d acted on a forgery (%q):\n%s", i, acted, log)
			}
		}
	}
}

// workerStore is GORUN_STORE of the rank-0 worker under agent pid.
func workerStore(t *testing.T, agent int) string {
	t.Helper()
	pid, err := testutil.ChildWithEnv(agent, "LOCAL_RANK", "0")
	if err != nil {
		t.Fatal(err)
	}
	environ, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range strings.Split(string(environ), "\x00") {
		if v, ok := strings.CutPrefix(kv, "GORUN_STORE="); ok {
			return v
		}
	}
	t.Fatalf("worker %d has no GORUN_STORE", pid)
	return ""
}

// gossipPort finds the UDP port process pid listens on (its memberlist
// member's; the agent has no other unconnected UDP socket) from its
// network namespace's /proc/PID/net/udp{,6} and its descriptors.
func gossipPort(t *testing.T, pid int) int {
	t.Helper()
	fds, err := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	if err != nil {
		t.Fatal(err)
	}
	sockets := map[string]bool{}
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil {
			if inode, ok := strings.CutPrefix(l, "socket:["); ok {
				sockets[strings.TrimSuffix(inode, "]")] = true
			}
		}
	}
	// Go listens on a wildcard address dual-stack: udp6 where it can.
	var lines []string
	for _, table := range []string{"udp", "udp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, strings.Split(string(b), "\n")[1:]...)
	}
	for _, line := range lines {
		f := strings.Fields(line)
		// sl local_address rem_address st tx:rx tr:tm retrnsmt uid timeout inode
		if len(f) < 10 || !sockets[f[9]] || strings.Trim(f[2], "0:") != "" {
			continue
		}
		port := f[1][strings.LastIndexByte(f[1], ':')+1:]
		p, err := hex.DecodeString(port)
		if err == nil && len(p) == 2 {
			return int(p[0])<<8 | int(p[1])
		}
	}
	t.Fatalf("agent %d listens on no UDP port", pid)
	return 0
}

// metrics fetches a /metrics page.
func metrics(t *testing.T, url string) string {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// metricValue sums the samples of series (name and labels, exactly) in a
// Prometheus page; 0 when there is none.
func metricValue(page, series string) float64 {
	var sum float64
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	for _, m := range re.FindAllStringSubmatch(page, -1) {
		if v, err := strconv.ParseFloat(m[1], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// grepLines returns the lines of s that hold sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
