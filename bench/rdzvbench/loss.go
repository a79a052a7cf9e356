package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// With -lose-one, once every worker has started one agent is killed (its
// process group: the agent and its worker, as a node lost), and the
// survivors' logs tell how long they took to carry on without it:
//
//   - the loss known: the first survivor's line saying it acts on the loss
//     (knownMsgs: shrink mode's report of the lost ranks, restart mode's
//     stop of its workers), after the kill;
//   - the survivors' next epoch (shrink mode: "shrink epoch=…", each
//     survivor's adoption of the epoch that excludes the lost node's
//     ranks) or next round (restart mode: its workers started again).
//
// What is timed is the issue's "loss known → every survivor's next epoch
// or round"; how long the loss took to be known (the rendezvous
// keep-alive's lapse, etcd's lease, node liveness) is reported apart.

// knownMsgs are the agents' log messages that say they act on a lost node.
var knownMsgs = []string{
	"nodes lost; reporting their ranks",                      // shrink mode
	"stopping workers: the job changed",                      // restart mode, the rendezvous
	"stopping workers: node liveness declared a node dead",   // restart mode, node liveness
	"node's etcd lease expired: taken out of the rendezvous", // etcd: the lapsed node's successor
}

// adopted reports whether msg is a survivor carrying on after the loss.
func adopted(msg string) bool {
	return strings.HasPrefix(msg, "shrink epoch=") || msg == "workers started"
}

// lossClock gathers, from log lines after the kill, when the loss was
// first known and when each survivor carried on.
type lossClock struct {
	kill    time.Time
	victim  int
	known   time.Time
	adopted map[int]time.Time // agent → its first adoption after the kill
	epochs  int               // adoptions that were shrink epochs (the rest: rounds)
}

func newLossClock(kill time.Time, victim int) *lossClock {
	return &lossClock{kill: kill, victim: victim, adopted: make(map[int]time.Time)}
}

// line takes one of agent's log lines; lines from before the kill and
// the victim's are ignored.
func (c *lossClock) line(agent int, msg string, ts time.Time) {
	if agent == c.victim || ts.Before(c.kill) {
		return
	}
	for _, k := range knownMsgs {
		if msg == k && (c.known.IsZero() || ts.Before(c.known)) {
			c.known = ts
		}
	}
	if _, ok := c.adopted[agent]; !ok && adopted(msg) {
		c.adopted[agent] = ts
		if msg != "workers started" {
			c.epochs++
		}
	}
}

// lossResult is what one loss measured.
type lossResult struct {
	detect    time.Duration // the kill → the loss first known
	carryOn   time.Duration // the loss known → the last survivor's adoption
	survivors int           // survivors that carried on
	epochs    int           // of them, by a shrink epoch (the rest by a new round)
}

func (c *lossClock) result() (lossResult, error) {
	r := lossResult{survivors: len(c.adopted), epochs: c.epochs}
	if c.known.IsZero() {
		return r, fmt.Errorf("no survivor said it knew of the loss (%d adopted something)", len(c.adopted))
	}
	r.detect = c.known.Sub(c.kill)
	var last time.Time
	for _, t := range c.adopted {
		if t.After(last) {
			last = t
		}
	}
	if !last.IsZero() {
		r.carryOn = last.Sub(c.known)
	}
	return r, nil
}

// logTail reads the agents' JSON logs as they grow, whole lines only.
type logTail struct {
	dir  string
	offs []int64
	rest [][]byte
}

func newLogTail(dir string, agents int) *logTail {
	return &logTail{dir: dir, offs: make([]int64, agents), rest: make([][]byte, agents)}
}

// feed hands every new complete line of each agent's log to fn.
func (t *logTail) feed(fn func(agent int, msg string, ts time.Time)) {
	for i := range t.offs {
		f, err := os.Open(filepath.Join(t.dir, fmt.Sprintf("agent%d.log", i)))
		if err != nil {
			continue
		}
		f.Seek(t.offs[i], io.SeekStart)
		b, _ := io.ReadAll(f)
		f.Close()
		t.offs[i] += int64(len(b))
		b = append(t.rest[i], b...)
		end := bytes.LastIndexByte(b, '\n')
		if end < 0 {
			t.rest[i] = b
			continue
		}
		t.rest[i] = append([]byte(nil), b[end+1:]...)
		for _, ln := range bytes.Split(b[:end], []byte{'\n'}) {
			if msg, ts, ok := parseLine(ln); ok {
				fn(i, msg, ts)
			}
		}
	}
}

// parseLine reads a zap JSON line's message and time.
func parseLine(ln []byte) (string, time.Time, bool) {
	var e struct {
		Msg string `json:"msg"`
		TS  string `json:"ts"`
	}
	if json.Unmarshal(ln, &e) != nil || e.Msg == "" {
		return "", time.Time{}, false
	}
	ts, err := time.Parse(time.RFC3339Nano, e.TS)
	if err != nil {
		return "", time.Time{}, false
	}
	return e.Msg, ts, true
}

// victimOf picks the agent to lose: the last that does not host the c10d
// rendezvous store (losing that ends the job, not a node).
func victimOf(dir string, agents int) int {
	for i := agents - 1; i > 0; i-- {
		b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("agent%d.log", i)))
		if !bytes.Contains(b, []byte(`"msg":"hosting the rendezvous store"`)) {
			return i
		}
	}
	return 0
}

// loseOne kills one agent's process group and follows the survivors'
// logs until each has carried on or wait has passed.
func loseOne(dir string, pids []int, wait time.Duration) (lossResult, error) {
	victim := victimOf(dir, len(pids))
	tail := newLogTail(dir, len(pids))
	tail.feed(func(int, string, time.Time) {}) // what was before the kill
	kill := time.Now()
	syscall.Kill(-pids[victim], syscall.SIGKILL)
	c := newLossClock(kill, victim)
	for deadline := kill.Add(wait); ; {
		time.Sleep(200 * time.Millisecond)
		tail.feed(c.line)
		if len(c.adopted) == len(pids)-1 && !c.known.IsZero() {
			break
		}
		if time.Now().After(deadline) {
			r, _ := c.result()
			return r, fmt.Errorf("agent %d lost: %d of %d survivors carried on in %v (loss known: %v)",
				victim, len(c.adopted), len(pids)-1, wait, !c.known.IsZero())
		}
	}
	fmt.Fprintf(os.Stderr, "rdzvbench: lost agent %d (pid %d)\n", victim, pids[victim])
	return c.result()
}
