package main

import (
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestStopSignalInEveryState: a stop signal ends the agent promptly
// whatever it is waiting for, with exit code 128+N and a log line that says
// what it was doing — on c10d, static and etcd. torchrun 1.13 exits 143 in
// about 250 ms when SIGTERMed in a c10d join; gorun once ignored every
// signal there until its 600 s join timeout.
func TestStopSignalInEveryState(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	// A port nothing listens on: a store that never comes.
	absent := freePort(t)
	worker := []string{"--no-python", "sh", "-c", `[ "$GROUP_RANK" = 0 ] && exit 0; exec sleep 60`}
	type state struct {
		name string
		// start brings an agent to the state and returns it; the log
		// line it waits for shows the agent got there.
		start func(t *testing.T) *agentProc
		// says is what the agent's log says when the signal stops it.
		says string
	}
	join := func(args ...string) func(t *testing.T) *agentProc {
		return func(t *testing.T) *agentProc {
			p := startAgent(t, bin, append(args, "--log-dir", t.TempDir(), "--no-python", "true")...)
			waitStderr(t, p, "rendezvous in progress")
			return p
		}
	}
	states := []state{
		{"c10d/waiting for the store", func(t *testing.T) *agentProc {
			p := startAgent(t, bin, append(c10dArgs(absent, "2", "--rdzv-conf", "is_host=0,join_timeout=600"),
				"--log-dir", t.TempDir(), "--no-python", "true")...)
			waitStderr(t, p, "waiting for the rendezvous store")
			return p
		}, "while reaching the rendezvous store"},
		{"static/waiting for node rank 0", func(t *testing.T) *agentProc {
			p := startAgent(t, bin, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
				"--master-port", strconv.Itoa(absent), "--log-dir", t.TempDir(), "--no-python", "true")
			waitStderr(t, p, "waiting for the rendezvous store")
			return p
		}, "while reaching the rendezvous store"},
		{"etcd/waiting for etcd", func(t *testing.T) *agentProc {
			p := startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:"+strconv.Itoa(absent),
				"--rdzv-id", "job", "--rdzv-conf", "join_timeout=600", "--local-addr", "127.0.0.1", "--log-dir", t.TempDir(), "--no-python", "true")
			waitStderr(t, p, "waiting for etcd")
			return p
		}, "while reaching the rendezvous store"},
		{"c10d/joining", join(c10dArgs(freePort(t), "2")...), "while waiting for the rendezvous"},
		{"static/joining", join("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
			"--master-port", strconv.Itoa(freePort(t)), "--local-addr", "127.0.0.1"), "while waiting for the rendezvous"},
		{"etcd/joining", join(etcdArgs(cluster, "2", "join_timeout=600")...), "while waiting for the rendezvous"},
		{"c10d/exit barrier", func(t *testing.T) *agentProc {
			port := freePort(t)
			var agents []*agentProc
			for range 2 {
				agents = append(agents, startAgent(t, bin, append(c10dArgs(port, "2", "--log-dir", t.TempDir()), worker...)...))
			}
			// Group rank 0's workers succeed at once; the other node's
			// sleep, so rank 0 waits at the barrier.
			for {
				for _, p := range agents {
					if strings.Contains(p.stderr.String(), "waiting for the other nodes at the exit barrier") {
						return p
					}
				}
				time.Sleep(10 * time.Millisecond)
			}
		}, "at the exit barrier"},
		{"c10d/re-rendezvous", func(t *testing.T) *agentProc {
			port := freePort(t)
			var agents []*agentProc
			for range 2 {
				agents = append(agents, startAgent(t, bin, append(c10dArgs(port, "2", "--max-restarts", "3", "--log-dir", t.TempDir()),
					"--no-python", "sleep", "60")...))
			}
			for _, p := range agents {
				waitStderr(t, p, "starting workers")
			}
			// The node that does not host the rendezvous store dies; the
			// host re-rendezvouses and waits for a second node again.
			host, other := agents[0], agents[1]
			if !strings.Contains(host.stderr.String(), "hosting the rendezvous store") {
				host, other = other, host
			}
			other.cmd.Process.Signal(syscall.SIGKILL)
			waitStderr(t, host, "re-rendezvous without the lost node")
			return host
		}, "while waiting for the rendezvous"},
		{"shrink/respawn backoff", func(t *testing.T) *agentProc {
			// Rank 1 fails at once; its respawn waits a minute.
			p := startAgent(t, bin, "--standalone", "--nproc-per-node", "2", "--on-failure", "shrink",
				"--respawn-backoff", "60", "--log-dir", t.TempDir(),
				"--no-python", "sh", "-c", `[ "$RANK" = 1 ] && exit 3; exec sleep 60`)
			waitStderr(t, p, "rank will be respawned")
			return p
		}, "stopping workers on signal"},
		{"shrink/agreement under way", func(t *testing.T) *agentProc {
			// Rank 1 fails; rank 0, a shell, never acknowledges the
			// epoch, so the survivors' agreement stays open.
			p := startAgent(t, bin, "--standalone", "--nproc-per-node", "2", "--on-failure", "shrink", "--regrow", "off",
				"--log-dir", t.TempDir(), "--no-python", "sh", "-c", `[ "$RANK" = 1 ] && exit 3; exec sleep 60`)
			waitStderr(t, p, "reporting it to the survivors")
			return p
		}, "stopping workers on signal"},
		{"shrink/grow under way", func(t *testing.T) *agentProc {
			// Rank 1 fails once and is respawned at once; the newcomer, a
			// shell, never joins, so the grow stays open.
			dir := t.TempDir()
			p := startAgent(t, bin, "--standalone", "--nproc-per-node", "2", "--on-failure", "shrink", "--respawn-backoff", "0.01",
				"--log-dir", t.TempDir(), "--no-python", "sh", "-c",
				`[ "$RANK" = 1 ] && [ ! -e `+dir+`/once ] && touch `+dir+`/once && exit 3; exec sleep 60`)
			waitStderr(t, p, "it joins the running group by a grow")
			return p
		}, "stopping workers on signal"},
		{"c10d/spare waiting for room", func(t *testing.T) *agentProc {
			return spareStandingBy(t, bin)
		}, "while waiting for the rendezvous"},
		{"c10d/pre-started spare waiting for room", func(t *testing.T) *agentProc {
			// Its workers run, parked, while it stands by; the signal
			// stops them too (they are sleeps: they die of it).
			spare := spareStandingBy(t, bin, "--spare-prestart")
			waitStderr(t, spare, "pre-started the workers")
			return spare
		}, "stopping the pre-started workers"},
	}
	signals := []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT}
	for _, st := range states {
		for _, sig := range signals {
			t.Run(st.name+"/"+sig.String(), func(t *testing.T) {
				p := st.start(t)
				sent := time.Now()
				p.cmd.Process.Signal(sig)
				code := p.exitCode(t, 10*time.Second)
				took := time.Since(sent)
				if code != 128+int(sig) {
					t.Errorf("exit %d, want %d; stderr:\n%s", code, 128+int(sig), p.stderr)
				}
				if took > 3*time.Second {
					t.Errorf("took %v to stop; stderr:\n%s", took, p.stderr)
				}
				if !strings.Contains(p.stderr.String(), st.says) {
					t.Errorf("the log does not say it stopped %s:\n%s", st.says, p.stderr)
				}
			})
		}
	}
}

// spareStandingBy starts a two-node shrink-mode job of sleeps and a third
// agent (with extra flags) that finds the round full: a spare, in the
// rendezvous until a node is lost. It returns the spare.
func spareStandingBy(t *testing.T, bin string, extra ...string) *agentProc {
	t.Helper()
	port := freePort(t)
	args := append(c10dArgs(port, "2", "--on-failure", "shrink"), "--no-python", "sleep", "60")
	var members []*agentProc
	for range 2 {
		members = append(members, startAgent(t, bin, append([]string{"--log-dir", t.TempDir()}, args...)...))
	}
	for _, p := range members {
		waitStderr(t, p, "starting workers")
	}
	spare := startAgent(t, bin, append(append([]string{"--log-dir", t.TempDir()}, extra...), args...)...)
	waitStderr(t, spare, "rendezvous complete")
	return spare
}
