package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
)

// Multi-node jobs with the etcd backend: real etcd members started by the
// test, every agent a real gorun process with its own workers.

// etcdArgs are an agent's flags for a job of nnodes in cluster; conf is
// added to the rendezvous options.
func etcdArgs(cluster *etcdtest.Cluster, nnodes, conf string, extra ...string) []string {
	c := "last_call_timeout=1,join_timeout=30,lease_ttl=2"
	if conf != "" {
		c += "," + conf
	}
	return append([]string{
		"--nnodes", nnodes, "--rdzv-backend", "etcd", "--rdzv-endpoint", strings.Join(cluster.HostPorts(), ","),
		"--rdzv-id", "job", "--rdzv-conf", c, "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
	}, extra...)
}

// storeWorker is a worker that reports where it stands and which store it
// was given, puts a key for its rank in the store and waits for every
// rank's key: it ends only if all the job's workers, on every node, share
// one store.
func storeWorker(bin string) string {
	return fmt.Sprintf(`echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT store=$MASTER_ADDR:$MASTER_PORT"
		%[1]s store set "hello/$RANK" "$GROUP_RANK" || exit 10
		keys=""; r=0; while [ $r -lt $WORLD_SIZE ]; do keys="$keys hello/$r"; r=$((r+1)); done
		%[1]s store wait $keys || exit 11
		echo "rank $RANK saw$keys"`, bin)
}

var storeLine = regexp.MustCompile(`round=(\d+) rank=(\d+) world=(\d+) group=(\d+)/(\d+) restarts=(\d+) store=(\S+)`)

// TestEtcdTwoNodesOneStore: two agents meet through etcd; each serves the
// worker store on its own node (MASTER_ADDR:MASTER_PORT differ), and the
// four workers, two per node, see one store: every key a worker sets is
// seen by the workers of the other node. After the job, its worker stores
// and presence keys are gone from etcd. With a job secret the same holds,
// and the rendezvous records in etcd are sealed.
func TestEtcdTwoNodesOneStore(t *testing.T) {
	for _, secret := range []bool{false, true} {
		t.Run(fmt.Sprintf("secret=%v", secret), func(t *testing.T) {
			if secret {
				t.Setenv("GORUN_JOB_SECRET", "s3cr3t-of-the-etcd-test-0123")
			}
			etcdTwoNodesOneStore(t, secret)
		})
	}
}

func etcdTwoNodesOneStore(t *testing.T, secret bool) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	bin := testutil.BuildGorun(t)
	worker := storeWorker(bin)
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, etcdArgs(cluster, "2", "", "--nproc-per-node", "2",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...))
	}
	stores := map[string]string{} // group rank → store address
	ranks := map[string]bool{}
	for _, p := range agents {
		for range 2 {
			m := storeLine.FindStringSubmatch(p.expectLine(t, "round="))
			if m == nil || m[3] != "4" || m[5] != "2" {
				t.Fatalf("worker line %v; stderr:\n%s", m, p.stderr)
			}
			if prev, ok := stores[m[4]]; ok && prev != m[7] {
				t.Fatalf("group %s's workers got stores %s and %s", m[4], prev, m[7])
			}
			stores[m[4]], ranks[m[2]] = m[7], true
		}
	}
	if len(stores) != 2 || stores["0"] == stores["1"] || !strings.HasPrefix(stores["0"], "127.0.0.1:") {
		t.Fatalf("stores by group rank %v; want one local store per node", stores)
	}
	if len(ranks) != 4 {
		t.Fatalf("ranks %v; want 0..3 once each", ranks)
	}
	for _, p := range agents {
		for range 2 {
			p.expectLine(t, "saw hello/0 hello/1 hello/2 hello/3")
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
	cli := cluster.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, dir := range []string{"/gorun/job/store/", "/gorun/job/alive/"} {
		r, err := cli.Get(ctx, dir, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		if r.Count != 0 {
			t.Errorf("%d keys left under %s after the job", r.Count, dir)
		}
	}
	r, err := cli.Get(ctx, "/gorun/job/rdzv/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	sealed := 0
	for _, kv := range r.Kvs {
		if bytes.HasPrefix(kv.Value, []byte("GRS1 ")) {
			sealed++
		}
	}
	if secret != (sealed > 0) {
		t.Errorf("%d of %d rendezvous keys in etcd sealed; want some: %v", sealed, len(r.Kvs), secret)
	}
}

// TestEtcdTorchGloo: two agents meet through etcd, two PyTorch 1.13 workers
// each; every worker bootstraps gloo from its own node's store (etcd
// underneath) and the four all_reduce together.
func TestEtcdTorchGloo(t *testing.T) {
	t.Parallel()
	py := torchtest.Python(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	bin := testutil.BuildGorun(t)
	script, _ := filepath.Abs(filepath.Join("..", "..", "examples", "torch", "allreduce.py"))
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + py},
			etcdArgs(cluster, "2", "", "--nproc-per-node", "2", "--log-dir", t.TempDir(), script)...))
	}
	expectGlooAllreduce(t, agents, 2, nil)
}

// TestEtcdUnreachable: no etcd answers: the agent says it is waiting, with
// the endpoints, then gives up after join_timeout with the rendezvous
// timeout's exit code. No worker ever starts.
func TestEtcdUnreachable(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	ports := closingPorts(t, 2)
	endpoints := fmt.Sprintf("127.0.0.1:%d,127.0.0.1:%d", ports[0], ports[1])
	start := time.Now()
	p := startAgent(t, bin, "--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoints,
		"--rdzv-conf", "join_timeout=3", "--local-addr", "127.0.0.1", "--log-dir", t.TempDir(), "--no-python", "echo", "worker ran")
	if code := p.exitCode(t, 20*time.Second); code != ExitRendezvousTimeout {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitRendezvousTimeout, p.stderr)
	}
	took := time.Since(start)
	errs := p.stderr.String()
	if n := strings.Count(errs, "waiting for etcd"); n < 1 || !strings.Contains(errs, strconv.Itoa(ports[1])) {
		t.Fatalf("%d progress lines naming the endpoints; stderr:\n%s", n, errs)
	}
	if !strings.Contains(errs, "etcd unreachable") || !strings.Contains(errs, "gorun speaks etcd's v3 API") {
		t.Fatalf("stderr does not say why, or does not note etcd-v2's alias:\n%s", errs)
	}
	if took < 3*time.Second || took > 15*time.Second {
		t.Fatalf("gave up after %v; want about join_timeout (3s)", took)
	}
	if l, ok := <-p.lines; ok {
		t.Fatalf("a worker ran: %q", l)
	}
}

// closingPorts returns n ports on 127.0.0.1 where no etcd answers: each
// holds a listener, until the test ends, that closes every connection it
// accepts. A port that was merely free a moment ago (etcdtest.FreePorts)
// can be taken by a parallel test's etcd: TestEtcdUnreachable's agent then
// joined that cluster and waited there past its deadline.
func closingPorts(t *testing.T, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		ports[i] = ln.Addr().(*net.TCPAddr).Port
	}
	return ports
}

// TestEtcdLeaderKilledMidRendezvous: a 3-member cluster loses its leader
// while one agent has joined and the other has not: both complete the
// round, each with its own group rank.
func TestEtcdLeaderKilledMidRendezvous(t *testing.T) {
	t.Parallel()
	cluster := etcdtest.Start(t, 3, etcdtest.Options{})
	bin := testutil.BuildGorun(t)
	worker := worldWorker(0)
	args := func() []string {
		return etcdArgs(cluster, "2", "lease_ttl=3", "--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)
	}
	a := startAgent(t, bin, args()...)
	waitStderr(t, a, "rendezvous in progress")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	leader, err := cluster.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	leader.Kill()
	b := startAgent(t, bin, args()...)
	groups := map[string]bool{}
	for _, p := range []*agentProc{a, b} {
		m := roundLine.FindStringSubmatch(p.expectLine(t, "round="))
		if m == nil || m[1] != "0" || m[3] != "2" {
			t.Fatalf("worker line %v; stderr:\n%s", m, p.stderr)
		}
		groups[m[4]] = true
	}
	if !groups["0"] || !groups["1"] {
		t.Fatalf("group ranks %v; want 0 and 1", groups)
	}
	for _, p := range []*agentProc{a, b} {
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
}

// TestEtcdLeaderKilledMidRun: the leader of a 3-member cluster dies while
// the workers of two nodes hammer their node-local stores with atomic
// increments: every increment counts exactly once, and the job completes
// without a restart. Each increment is a process (`gorun store add`, about
// 0.1 s with four at once on two cores), so the kill lands a few into
// each worker's 20.
func TestEtcdLeaderKilledMidRun(t *testing.T) {
	t.Parallel()
	cluster := etcdtest.Start(t, 3, etcdtest.Options{})
	bin := testutil.BuildGorun(t)
	const adds = 20
	worker := fmt.Sprintf(`echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT pid=$$"
		i=0; while [ $i -lt %[2]d ]; do %[1]s store add count 1 >/dev/null || exit 10; i=$((i+1)); done
		%[1]s store add finished 1 >/dev/null || exit 11
		until [ "$(%[1]s store add finished 0)" = "$WORLD_SIZE" ]; do sleep 0.05; done
		echo "rank $RANK count=$(%[1]s store add count 0)"`, bin, adds)
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, etcdArgs(cluster, "2", "lease_ttl=3", "--nproc-per-node", "2",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...))
	}
	for _, p := range agents {
		for range 2 {
			p.expectLine(t, "round=0")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	leader, err := cluster.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // into the increments
	leader.Kill()
	want := fmt.Sprintf("count=%d", 4*adds)
	for _, p := range agents {
		for range 2 {
			if l := p.expectLine(t, "count="); !strings.HasSuffix(l, want) {
				t.Fatalf("%q; want %s", l, want)
			}
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
		if strings.Contains(p.stderr.String(), "restarting") {
			t.Fatalf("the job restarted:\n%s", p.stderr)
		}
	}
}

// TestEtcdNodeLost: one agent of an elastic job (--nnodes 1:2) is SIGKILLed
// with its workers. The other sees its lease expire, counts a restart and,
// as torchrun would, re-rendezvouses and carries on alone once the last
// call ends. With a start lease longer than lease_ttl, the agents shorten
// their leases once their workers run, and the loss is seen within about
// lease_ttl, not start_lease_ttl.
func TestEtcdNodeLost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, conf string }{
		{"one lease", "lease_ttl=1"},
		{"shortened once the workers run", "lease_ttl=1,start_lease_ttl=8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testEtcdNodeLost(t, tc.conf)
		})
	}
}

func testEtcdNodeLost(t *testing.T, conf string) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	bin := testutil.BuildGorun(t)
	worker := worldWorker(1)
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, etcdArgs(cluster, "1:2", conf, "--max-restarts", "1",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...))
	}
	for _, p := range agents {
		if world, restarts := p.expectRound(t, 0); world != 2 || restarts != 0 {
			t.Fatalf("round 0: world %d restarts %d; stderr:\n%s", world, restarts, p.stderr)
		}
	}
	waitShortLeases(t, cluster, "/gorun/job/alive/", 2, 1, 10*time.Second)
	survivor, lost := agents[0], agents[1]
	lostAt := time.Now()
	lost.cmd.Process.Signal(syscall.SIGKILL)
	lost.exitCode(t, 5*time.Second)
	waitStderr(t, survivor, "lost node(s)")
	seen := time.Since(lostAt)
	if world, restarts := survivor.expectRound(t, 1); world != 1 || restarts != 1 {
		t.Fatalf("round 1: world %d restarts %d; stderr:\n%s", world, restarts, survivor.stderr)
	}
	t.Logf("%s: node lost seen after %v, survivor's round 1 after %v (last_call_timeout=1)", conf, seen, time.Since(lostAt))
	if seen > 4*time.Second {
		t.Fatalf("lost node seen after %v; want about the 1s lease TTL", seen)
	}
	if code := survivor.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, survivor.stderr)
	}
}

// TestEtcdTLS: etcd serves clients over TLS and requires client
// certificates. A job with protocol=https and the right files completes; an
// agent given another CA, or a client certificate etcd did not sign, fails
// at once with one clear error and the usage exit code, and runs nothing.
func TestEtcdTLS(t *testing.T) {
	t.Parallel()
	certs, other := etcdtest.NewCerts(t), etcdtest.NewCerts(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{TLS: certs.ServerTLS(true)})
	bin := testutil.BuildGorun(t)
	tlsConf := func(ca, cert, key string) string {
		return fmt.Sprintf("protocol=https,cacert=%s,cert=%s,key=%s", ca, cert, key)
	}
	good := tlsConf(certs.CAFile, certs.ClientCert, certs.ClientKey)
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgent(t, bin, etcdArgs(cluster, "2", good,
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worldWorker(0))...))
	}
	for _, p := range agents {
		if world, _ := p.expectRound(t, 0); world != 2 {
			t.Fatalf("world %d; stderr:\n%s", world, p.stderr)
		}
		if code := p.exitCode(t, 30*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}

	for _, tc := range []struct{ name, conf, want string }{
		{"wrong ca", tlsConf(other.CAFile, certs.ClientCert, certs.ClientKey), "not signed by a CA in cacert"},
		{"wrong client cert", tlsConf(certs.CAFile, other.ClientCert, other.ClientKey), "refused this client's certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			p := startAgent(t, bin, etcdArgs(cluster, "2", tc.conf, "--log-dir", t.TempDir(), "--no-python", "echo", "worker ran")...)
			if code := p.exitCode(t, 20*time.Second); code != ExitUsage {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitUsage, p.stderr)
			}
			errs := p.stderr.String()
			if !strings.Contains(errs, "etcd TLS handshake failed") || !strings.Contains(errs, tc.want) {
				t.Fatalf("stderr does not name the certificate problem (%q):\n%s", tc.want, errs)
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Fatalf("failed after %v; a certificate problem is not retried", took)
			}
			if l, ok := <-p.lines; ok {
				t.Fatalf("a worker ran: %q", l)
			}
		})
	}
}

// TestEtcdBadConfig: etcd settings that cannot work are refused before
// anything is reached, each with one line naming the culprit.
func TestEtcdBadConfig(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	for _, tc := range []struct {
		name string
		conf string
		env  []string
		want string
	}{
		{"unreadable cacert", "protocol=https,cacert=/nonexistent/ca.pem", nil, "/nonexistent/ca.pem"},
		{"password without user", "password_env=ETCD_PW", []string{"ETCD_PW=secret", "GORUN_ETCD_USER="}, "needs a user"},
		{"password variable unset", "user=u,password_env=NO_SUCH_VAR", nil, "$NO_SUCH_VAR is not set"},
		{"bad lease ttl", "lease_ttl=0", nil, "lease_ttl=0"},
		{"relative prefix", "prefix=gorun", nil, "prefix=gorun"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startAgentEnv(t, bin, tc.env, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1",
				"--rdzv-conf", tc.conf, "--log-dir", t.TempDir(), "--no-python", "true")
			if code := p.exitCode(t, 10*time.Second); code != ExitUsage {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, ExitUsage, p.stderr)
			}
			if errs := p.stderr.String(); !strings.Contains(errs, tc.want) {
				t.Fatalf("stderr does not say %q:\n%s", tc.want, errs)
			}
		})
	}
}

// TestEtcdJobRole: on an etcd with authentication on, a job runs as a user
// whose role reaches its own keys only (README: "A role for the job"): two
// agents meet and their workers share the store. An agent of another job
// with that user is refused by etcd, with one clear error.
func TestEtcdJobRole(t *testing.T) {
	t.Parallel()
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	admin := cluster.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	steps := []func() error{
		func() error { _, err := admin.RoleAdd(ctx, "root"); return err },
		func() error { _, err := admin.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.RoleAdd(ctx, "gorun-job"); return err },
		func() error {
			_, err := admin.RoleGrantPermission(ctx, "gorun-job", "/gorun/job/", clientv3.GetPrefixRangeEnd("/gorun/job/"),
				clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := admin.UserAdd(ctx, "gorun-job", "jobpw"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "gorun-job", "gorun-job"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	bin := testutil.BuildGorun(t)
	env := []string{"GORUN_ETCD_USER=gorun-job", "GORUN_ETCD_PASSWORD=jobpw"}
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgentEnv(t, bin, env, etcdArgs(cluster, "2", "", "--nproc-per-node", "2",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", storeWorker(bin))...))
	}
	for _, p := range agents {
		if code := p.exitCode(t, 60*time.Second); code != 0 {
			t.Fatalf("exit %d; stderr:\n%s", code, p.stderr)
		}
	}
	args := etcdArgs(cluster, "2", "", "--log-dir", t.TempDir(), "--no-python", "true")
	for i, a := range args {
		if a == "--rdzv-id" {
			args[i+1] = "another-job"
		}
	}
	other := startAgentEnv(t, bin, env, args...)
	code := other.exitCode(t, 30*time.Second)
	if code != 2 || !strings.Contains(other.stderr.String(), `user "gorun-job" may not write the job's keys under /gorun/another-job/`) {
		t.Errorf("another job's agent: exit %d; want 2 and a refusal naming the user and the prefix:\n%s", code, other.stderr)
	}
	// The refusal is its presence key's put: the lease granted for it is
	// revoked, and nothing of the refused job stays in etcd.
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	root, err := clientv3.New(clientv3.Config{Endpoints: cluster.Endpoints(), DialTimeout: 5 * time.Second,
		Username: "root", Password: "rootpw", Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	if r, err := root.Get(ctx, "/gorun/another-job/", clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || r.Count != 0 {
		t.Errorf("the refused job's keys: %v, %v; want none", r, err)
	}
	if r, err := root.Leases(ctx); err != nil || len(r.Leases) != 0 {
		t.Errorf("leases once every agent exited: %v, %v; want none", r, err)
	}
}

// TestEtcdLapseWhileTheRoundForms: a node's lease lapses while the round
// forms (revoked here, as etcd expires it when a starved agent misses its
// renewals: 512 agents on 2 cores did) and the node takes a new one and is
// in the round when it completes. It is the round's member in its new
// life: nobody counts it lost for the lapse before the round began, and
// the job runs its one round (--max-restarts 0) to the end.
func TestEtcdLapseWhileTheRoundForms(t *testing.T) {
	t.Parallel()
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	bin := testutil.BuildGorun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const alive = "/gorun/job/alive/"
	presence := func() map[string]clientv3.LeaseID {
		t.Helper()
		r, err := cli.Get(ctx, alive, clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]clientv3.LeaseID{}
		for _, kv := range r.Kvs {
			out[string(kv.Key)] = clientv3.LeaseID(kv.Lease)
		}
		return out
	}
	awaitKeys := func(n int) map[string]clientv3.LeaseID {
		t.Helper()
		for {
			if p := presence(); len(p) >= n {
				return p
			}
			if ctx.Err() != nil {
				t.Fatalf("fewer than %d presence keys under %s", n, alive)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// The round completes last_call_timeout (3 s) after the second node
	// joins: the lapse falls in that window.
	worker := `echo "round=$GORUN_GENERATION rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK/$GROUP_WORLD_SIZE restarts=$TORCHELASTIC_RESTART_COUNT"; sleep 2`
	start := func() *agentProc {
		return startAgent(t, bin, etcdArgs(cluster, "2:3", "last_call_timeout=3,lease_ttl=2", "--max-restarts", "0",
			"--log-dir", t.TempDir(), "--no-python", "sh", "-c", worker)...)
	}
	a := start()
	first := awaitKeys(1)
	b := start()
	var key string
	var lease clientv3.LeaseID
	for k, l := range awaitKeys(2) {
		if _, ok := first[k]; !ok {
			key, lease = k, l
		}
	}
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	for presence()[key] == 0 || presence()[key] == lease {
		if ctx.Err() != nil {
			t.Fatalf("%s did not take a new lease", key)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, p := range []*agentProc{a, b} {
		if world, restarts := p.expectRound(t, 0); world != 2 || restarts != 0 {
			t.Fatalf("round 0: world %d restarts %d; stderr:\n%s", world, restarts, p.stderr)
		}
	}
	for i, p := range []*agentProc{a, b} {
		if code := p.exitCode(t, 30*time.Second); code != 0 || strings.Contains(p.stderr.String(), "lost node(s)") {
			t.Fatalf("agent %d: exit %d; want 0 and no node lost:\n%s", i, code, p.stderr)
		}
	}
}

// waitShortLeases waits until n presence keys under dir are each bound to
// a lease granted for ttl seconds.
func waitShortLeases(t *testing.T, cluster *etcdtest.Cluster, dir string, n int, ttl int64, within time.Duration) {
	t.Helper()
	cli := cluster.Client(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for {
		short := 0
		if r, err := cli.Get(ctx, dir, clientv3.WithPrefix()); err == nil {
			for _, kv := range r.Kvs {
				if l, err := cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease)); err == nil && l.GrantedTTL == ttl {
					short++
				}
			}
		}
		if short == n {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%d of %d presence keys under %s on leases of %d s after %v", short, n, dir, ttl, within)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
