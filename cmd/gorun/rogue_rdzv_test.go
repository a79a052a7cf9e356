package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/netns"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestHostsRogueRendezvous: issue 18's attack on the rendezvous store,
// from a host of the network-namespace bed that reaches the c10d store of
// a two-host shrink-mode job (2 × 4 Go allreduce ranks, a third agent
// standing by as a spare: the round is full, so it waits) but lacks its
// secret. It reads the rendezvous state and writes it back with a spare
// assignment: the second node gone and the spare admitted into the
// running round in its place (what an agent writes when it admits a spare
// for a lost node). Later it writes back the state it read first, whose
// heartbeats have expired by then (every node "lost"). Without a job
// secret the first forgery works — the control, which shows the test can
// fail: the first agent reports the second node's ranks lost. With one,
// both are refused (a bad MAC, then a replay of a genuine but older
// record): the job neither shrinks, restarts, takes the spare in nor
// stalls, and the agents log and count what they ignored.
func TestHostsRogueRendezvous(t *testing.T) {
	for _, secret := range []bool{false, true} {
		name := map[bool]string{false: "without a job secret the forgery works", true: "with a job secret forgery and replay are ignored"}[secret]
		t.Run(name, func(t *testing.T) {
			if secret {
				t.Setenv("GORUN_JOB_SECRET", "s3cr3t-of-the-rogue-test-0123")
			}
			const nodes, nproc, steps, healthPort = 2, 4, 1400, "29991"
			at, bed := onBed(t, nodes+2)
			rogue := bed.Hosts[nodes+1]
			j := startShrinkJobAt(t, at, nodes, nproc, steps, "--health-addr", ":"+healthPort)
			j.await(t, "start rank=", nodes*nproc, 60*time.Second)
			// The spare: a third agent of the job; the bed's cleanup ends it.
			spare := startAgentCmd(t, j.command(nodes))
			waitStderr(t, spare, "rendezvous complete") // it has seen the running round
			store := "tcp://" + rdzvEndpoint(t, at.rdzv(0, "2"))
			bin := testutil.BuildGorun(t)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			const stateKey = "gorun.rendezvous.job"

			first := rogueGet(ctx, t, rogue, bin, store, stateKey)
			// 1. The state without the second node.
			cur := rogueGet(ctx, t, rogue, bin, store, stateKey)
			header, payload := splitSealed(cur)
			if secret != (header != nil) {
				t.Fatalf("the rendezvous state is stored %q: sealed %v, want %v", cur[:min(len(cur), 80)], header != nil, secret)
			}
			var st map[string]any
			if err := json.Unmarshal(payload, &st); err != nil {
				t.Fatalf("state %q: %v", payload, err)
			}
			// The spare assignment: node 1 gone, the spare in its place
			// (rank 1, late), with node 1's record but the spare's
			// identity and address.
			var kept []any
			for _, n := range st["nodes"].([]any) {
				e := n.(map[string]any)
				if e["addr"] != bed.Hosts[1].IP.String() {
					kept = append(kept, e)
					continue
				}
				data, err := base64.StdEncoding.DecodeString(e["data"].(string))
				if err != nil {
					t.Fatal(err)
				}
				spareIP := bed.Hosts[nodes].IP.String()
				data = bytes.ReplaceAll(data, []byte(bed.Hosts[1].IP.String()), []byte(spareIP))
				e["addr"], e["pid"], e["late"] = spareIP, spare.cmd.Process.Pid, true
				e["data"] = base64.StdEncoding.EncodeToString(data)
				kept = append(kept, e)
			}
			if len(kept) != 2 {
				t.Fatalf("state %s: want two nodes, one on %s", payload, bed.Hosts[1].IP)
			}
			st["nodes"] = kept
			forged, err := json.Marshal(st)
			if err != nil {
				t.Fatal(err)
			}
			// With the secret the rogue keeps the genuine header: it
			// cannot make a MAC, so it tries the one it has.
			rogueSet(ctx, t, rogue, bin, store, stateKey, append(header, forged...))
			if !secret {
				waitStderr(t, j.agents[0], "nodes lost; reporting their ranks")
				// The spare takes the place: it finds itself in the round.
				for deadline := time.Now().Add(20 * time.Second); !spareJoined(bed, spare); time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("the spare did not take the place:\n%s", spare.stderr)
					}
				}
				return // the bed's cleanup ends the job
			}

			// 2. The first state again, once its heartbeats have expired
			// (keep-alive 0.25 s × 8 attempts).
			time.Sleep(2500 * time.Millisecond)
			rogueSet(ctx, t, rogue, bin, store, stateKey, first)

			// Every agent reads the state (status polls): some agent
			// refused and counted each forgery.
			awaitRefused(t, j, bed, healthPort, "rendezvous", 2)
			j.expectFullRun(t, nodes, nproc, steps)
			all := spare.stderr.String()
			for _, p := range j.agents {
				all += p.stderr.String()
			}
			if spareJoined(bed, spare) {
				t.Errorf("the spare took the forged assignment:\n%s", spare.stderr)
			}
			for _, acted := range []string{"admitted into", "a node takes a lost node's place"} {
				if strings.Contains(all, acted) {
					t.Errorf("an agent acted on the forged spare assignment (%q):\n%s\nspare:\n%s", acted, j.report(), spare.stderr)
				}
			}
			for _, why := range []string{`"why": "bad MAC"`, `"why": "replayed`} {
				if !strings.Contains(all, "ignored a rendezvous record that fails the job secret's check") || !strings.Contains(all, why) {
					t.Errorf("no agent logged a refusal %s:\n%s", why, j.report())
				}
			}
		})
	}
}

// spareJoined reports whether the spare's log shows it among a round's
// members (it took a place), not merely waiting for the next round.
func spareJoined(bed *netns.Bed, spare *agentProc) bool {
	id := bed.Hosts[2].IP.String() + "_" + strconv.Itoa(spare.cmd.Process.Pid) + "_0"
	return regexp.MustCompile(`"joined": \[[^\]]*"` + regexp.QuoteMeta(id) + `"`).MatchString(spare.stderr.String())
}

// rdzvEndpoint is --rdzv-endpoint's value in an agent's arguments.
func rdzvEndpoint(t *testing.T, args []string) string {
	for i, a := range args {
		if a == "--rdzv-endpoint" && i+1 < len(args) {
			return args[i+1]
		}
	}
	t.Fatalf("no --rdzv-endpoint in %q", args)
	return ""
}

func rogueGet(ctx context.Context, t *testing.T, rogue *netns.Host, bin, store, key string) []byte {
	t.Helper()
	out, err := rogue.Command(ctx, bin, "store", "get", "--store", store, key).Output()
	if err != nil {
		t.Fatalf("the rogue's gorun store get %s: %v", key, err)
	}
	return out
}

func rogueSet(ctx context.Context, t *testing.T, rogue *netns.Host, bin, store, key string, v []byte) {
	t.Helper()
	cmd := rogue.Command(ctx, bin, "store", "set", "--store", store, key)
	cmd.Stdin = bytes.NewReader(v)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the rogue's gorun store set %s: %v\n%s", key, err, out)
	}
}

// splitSealed splits a sealed record into its header line (newline
// included) and payload; an unsealed one has no header.
func splitSealed(rec []byte) (header, payload []byte) {
	if !bytes.HasPrefix(rec, []byte("GRS1 ")) {
		return nil, rec
	}
	i := bytes.IndexByte(rec, '\n')
	return bytes.Clone(rec[:i+1]), rec[i+1:]
}
