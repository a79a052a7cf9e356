package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestLossClock(t *testing.T) {
	kill := time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return kill.Add(time.Duration(ms) * time.Millisecond) }
	type line struct {
		agent int
		msg   string
		ms    int
	}
	const victim = 3
	tests := []struct {
		name      string
		lines     []line
		detect    time.Duration
		carryOn   time.Duration
		survivors int
		epochs    int
		wantErr   bool
	}{
		{
			name: "shrink mode: the first report starts the clock, the last epoch stops it",
			lines: []line{
				{0, "nodes lost; reporting their ranks", 1500},
				{1, "nodes lost; reporting their ranks", 1400},
				{0, "shrink epoch=1 world=3 excluded=[3]", 1700},
				{1, "shrink epoch=1 world=3 excluded=[3]", 1650},
				{2, "shrink epoch=1 world=3 excluded=[3]", 1900},
				{2, "shrink epoch=2 world=3 excluded=[3]", 5000}, // a later epoch: not the first adoption
			},
			detect: 1400 * time.Millisecond, carryOn: 500 * time.Millisecond, survivors: 3, epochs: 3,
		},
		{
			name: "lines before the kill and the victim's own do not count",
			lines: []line{
				{0, "workers started", -2000},
				{0, "nodes lost; reporting their ranks", -10},
				{victim, "nodes lost; reporting their ranks", 100},
				{victim, "shrink epoch=1 world=3 excluded=[]", 100},
				{0, "node's etcd lease expired: taken out of the rendezvous", 5200},
				{0, "shrink epoch=1 world=3 excluded=[3]", 5300},
			},
			detect: 5200 * time.Millisecond, carryOn: 100 * time.Millisecond, survivors: 1, epochs: 1,
		},
		{
			name: "restart mode: the stop of the workers, then their start in the next round",
			lines: []line{
				{1, "stopping workers: the job changed", 15000},
				{0, "stopping workers: the job changed", 15100},
				{0, "workers started", 15600},
				{1, "workers started", 15800},
			},
			detect: 15 * time.Second, carryOn: 800 * time.Millisecond, survivors: 2, epochs: 0,
		},
		{
			name:      "nobody knew of the loss",
			lines:     []line{{0, "workers started", 100}, {1, "rendezvous in progress", 200}},
			survivors: 1, wantErr: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newLossClock(kill, victim)
			for _, l := range tt.lines {
				c.line(l.agent, l.msg, at(l.ms))
			}
			r, err := c.result()
			if (err != nil) != tt.wantErr {
				t.Fatalf("result: err %v, want an error: %v", err, tt.wantErr)
			}
			if r.survivors != tt.survivors || r.epochs != tt.epochs {
				t.Errorf("survivors %d (%d by epochs), want %d (%d)", r.survivors, r.epochs, tt.survivors, tt.epochs)
			}
			if err == nil && (r.detect != tt.detect || r.carryOn != tt.carryOn) {
				t.Errorf("detect %v, carry on %v; want %v, %v", r.detect, r.carryOn, tt.detect, tt.carryOn)
			}
		})
	}
}

// The tail hands over every complete line once, a partly written line
// only once it is whole, and skips what is not a zap JSON line.
func TestLogTail(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "agent0.log")
	ts := "2026-12-01T20:00:01.5Z"
	write := func(s string) {
		f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprint(f, s)
		f.Close()
	}
	tail := newLogTail(dir, 2) // agent1.log does not exist
	var got []string
	feed := func() {
		tail.feed(func(agent int, msg string, at time.Time) {
			if want, _ := time.Parse(time.RFC3339Nano, ts); agent != 0 || !at.Equal(want) {
				t.Errorf("agent %d at %v", agent, at)
			}
			got = append(got, msg)
		})
	}
	write(`{"level":"info","ts":"` + ts + `","msg":"a"}` + "\n" + "gorun: not json\n" + `{"level":"info","ts":"` + ts + `","ms`)
	feed()
	if len(got) != 1 || got[0] != "a" {
		t.Fatalf("first feed: %q, want [a]", got)
	}
	write(`g":"b"}` + "\n")
	feed()
	feed()
	if len(got) != 2 || got[1] != "b" {
		t.Fatalf("after the line was completed: %q, want [a b]", got)
	}
}

func TestVictimOf(t *testing.T) {
	dir := t.TempDir()
	for i, s := range []string{"", `{"msg":"x"}`, `{"msg":"hosting the rendezvous store"}`} {
		os.WriteFile(filepath.Join(dir, fmt.Sprintf("agent%d.log", i)), []byte(s), 0o644)
	}
	if v := victimOf(dir, 3); v != 1 {
		t.Errorf("victim %d, want 1 (agent 2 hosts the store)", v)
	}
}

// firstLines takes each agent's first JSON line, after lines that are
// not JSON, and the latest of them.
func TestFirstLines(t *testing.T) {
	dir := t.TempDir()
	t0 := time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC)
	logs := []string{
		`{"ts":"2026-12-01T20:00:00.5Z","msg":"a"}` + "\n" + `{"ts":"2026-12-01T20:00:09Z","msg":"later"}` + "\n",
		"gorun: something\n" + `{"ts":"2026-12-01T20:00:02.25Z","msg":"b"}` + "\n",
		"", // never logged
	}
	for i, s := range logs {
		os.WriteFile(filepath.Join(dir, fmt.Sprintf("agent%d.log", i)), []byte(s), 0o644)
	}
	if ms, n := firstLines(dir, len(logs), t0); ms != 2250 || n != 2 {
		t.Errorf("last first line %.1f ms, %d agents; want 2250 ms, 2", ms, n)
	}
}
