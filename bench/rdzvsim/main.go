// Command rdzvsim measures the dynamic rendezvous's cost against N:
// N agents as goroutines, each with its own store connection (a tcpstore
// client of gorun's server, in a process of its own, or its own etcd Storage and watch on
// a real etcd), all calling Next at once on a fresh run with --nnodes N.
// Per N it reports the time until every agent has its rank, the store
// requests and bytes per agent (counted at the Store API), the process's
// CPU (c10d: the agents and the server together) and, for etcd, the
// growth of etcd's data directory (WAL and database) per agent and
// etcd's CPU.
package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/storecount"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

var (
	loss      bool         // -loss
	members   bool         // -members
	plans     bool         // -plan
	progress  bool         // -progress
	breakdown bool         // -breakdown
	assigned  atomic.Int64 // agents whose Next has returned, for -progress

	etcdProfile  string // -etcd-cpuprofile
	phaseProfile string // -phase-cpuprofile
	profileTag   string // N.REP of the run in progress
)

// watchProgress prints the rendezvous's marker and the requests so far
// every second, on stderr.
func watchProgress(ctx context.Context, s rendezvous.Store, c *storecount.Counts) {
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		m, _ := s.CompareSet(ctx, "gorun.rendezvous.sim/marker", nil, []byte("{}"))
		n, _ := s.QueueLen(ctx, "gorun.rendezvous.sim/requests")
		fmt.Fprintf(os.Stderr, "%5.1f s: %d assigned, %d requests, queue %d, marker %s\n", time.Since(start).Seconds(), assigned.Load(), c.Requests.Load(), n, m)
	}
}

type result struct {
	n        int
	done     int // agents that got their round
	elapsed  time.Duration
	reqs     float64 // per agent, and the rest likewise
	sent     float64
	recv     float64
	written  float64
	cpu      time.Duration // this process
	etcdCPU  time.Duration
	etcdGrow float64 // bytes per agent
	err      error
	// With -loss: one agent dies after round 0, a survivor expels it (as
	// the launcher does once it sees the loss), and the others rendezvous
	// again: the time from the expulsion to every survivor's new round,
	// and the requests per survivor in that time.
	lossDone    int
	lossElapsed time.Duration
	lossReqs    float64
}

func main() {
	backend := flag.String("backend", "c10d", "c10d or etcd")
	ns := flag.String("n", "64,256,1024", "agent counts, comma-separated")
	timeout := flag.Duration("timeout", 120*time.Second, "give up on one N after this long")
	etcdBin := flag.String("etcd-bin", "etcd", "etcd binary (Debian's etcd-server)")
	etcdClients := flag.Int("etcd-clients", 0, "etcd client connections shared by the agents (0: one per agent)")
	dataLen := flag.Int("data", 60, "bytes of data each agent publishes with its join (an agent's is ~60)")
	flag.BoolVar(&members, "members", false, "every agent also reads the round's members, as the launcher did before it planned from summaries "+
		"(and still does in shrink mode, with node liveness, and with static rendezvous)")
	flag.BoolVar(&plans, "plan", false, "every agent plans its round from its summary, as the launcher does in restart mode "+
		"(the folder computes each agent's rank offset, the world size and rank 0 from every agent's nproc; checked)")
	flag.BoolVar(&breakdown, "breakdown", false, "after each N's row, the requests and bytes per agent by operation and key (stderr)")
	flag.BoolVar(&progress, "progress", false, "print the marker and the requests so far every second (stderr)")
	flag.BoolVar(&loss, "loss", false, "after the first round, lose one agent and time the survivors' next round (--nnodes N-1:N)")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to `FILE`")
	flag.StringVar(&etcdProfile, "etcd-cpuprofile", "", "etcd: start etcd with --enable-pprof and write its CPU profile of each first round to `FILE`.N.REP (merged 5-s samples)")
	flag.StringVar(&phaseProfile, "phase-cpuprofile", "", "write a CPU profile of each first round (from the agents' Next to the last one assigned) to `FILE`.N.REP")
	reps := flag.Int("reps", 1, "repetitions per N; the one with the median time is reported")
	serve := flag.Bool("serve", false, "internal: serve gorun's store on loopback and print its address (the c10d server's process)")
	flag.Parse()
	if *serve {
		serveStore()
		return
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	fmt.Printf("Command: %s\n", strings.Join(os.Args, " "))
	fmt.Printf("GOMAXPROCS %d, %s; each row is the repetition with the median time of %d\n\n", runtime.GOMAXPROCS(0), time.Now().UTC().Format(time.RFC3339), *reps)
	fmt.Println("| agents | all assigned | requests/agent | sent B/agent | received B/agent | written B/agent | CPU (this process) | etcd data growth/agent | etcd CPU | one lost: expulsion → survivors' round | requests/survivor |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|")
	for _, f := range strings.Split(*ns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "bad -n %q\n", f)
			os.Exit(2)
		}
		var rs []result
		for rep := 1; rep <= *reps; rep++ {
			var r result
			profileTag = fmt.Sprintf("%d.%d", n, rep)
			switch *backend {
			case "c10d":
				r = runC10d(n, *dataLen, *timeout)
			case "etcd":
				r = runEtcd(n, *dataLen, *timeout, *etcdBin, *etcdClients)
			default:
				fmt.Fprintf(os.Stderr, "unknown -backend %q\n", *backend)
				os.Exit(2)
			}
			fmt.Fprintf(os.Stderr, "rdzvsim: %s, %d agents, rep %d: %d assigned in %.2f s (%v)\n", *backend, n, rep, r.done, r.elapsed.Seconds(), r.err)
			rs = append(rs, r)
			runtime.GC()
		}
		// The repetition with the median time stands for all.
		slices.SortFunc(rs, func(a, b result) int { return cmp.Compare(a.elapsed, b.elapsed) })
		print(rs[len(rs)/2])
	}
}

func print(r result) {
	t := fmt.Sprintf("%.2f s", r.elapsed.Seconds())
	if r.done < r.n {
		t = fmt.Sprintf("**never**: %d of %d after %.0f s", r.done, r.n, r.elapsed.Seconds())
	}
	if r.err != nil {
		t += fmt.Sprintf(" (%v)", r.err)
	}
	grow, ecpu := "", ""
	if r.etcdCPU > 0 {
		grow, ecpu = fmt.Sprintf("%.0f B", r.etcdGrow), fmt.Sprintf("%.1f s", r.etcdCPU.Seconds())
	}
	lt, lr := "", ""
	if loss {
		lt, lr = fmt.Sprintf("%.2f s", r.lossElapsed.Seconds()), fmt.Sprintf("%.1f", r.lossReqs)
		if r.lossDone < r.n-1 {
			lt = fmt.Sprintf("**never**: %d of %d", r.lossDone, r.n-1)
		}
	}
	fmt.Printf("| %d | %s | %.1f | %.0f | %.0f | %.0f | %.1f s | %s | %s | %s | %s |\n",
		r.n, t, r.reqs, r.sent, r.recv, r.written, r.cpu.Seconds(), grow, ecpu, lt, lr)
}

func config(n int) rendezvous.DynamicConfig {
	c := rendezvous.DynamicConfig{RunID: "sim", MinNodes: n, MaxNodes: n, ShareOnly: !members}
	if plans {
		c.Describe = describe
	}
	if loss && n > 1 {
		c.MinNodes = n - 1
	}
	return c
}

func node(i int) rendezvous.NodeDesc {
	return rendezvous.NodeDesc{Addr: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), Pid: 1000 + i}
}

// describe reads an agent's nproc from its data, as the launcher's
// Describe reads its nodeInfo.
func describe(b []byte) (rendezvous.NodeTraits, error) {
	var v struct {
		NProc int `json:"nproc"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return rendezvous.NodeTraits{}, err
	}
	return rendezvous.NodeTraits{Weight: v.NProc}, nil
}

func data(i, size int) []byte {
	b := []byte(fmt.Sprintf(`{"nproc":8,"addr":"10.%d.%d.%d","i":%d`, i>>16&255, i>>8&255, i&255, i))
	for len(b) < size-1 {
		b = append(b, ' ')
	}
	return append(b, '}')
}

// rendezvousAll makes one handle per store and runs Next on all of them
// at once, filling in r's time and count of agents assigned; with -loss it
// then loses the last agent and times the survivors' next round.
//
// first runs after the first round: it measures what that cost.
func rendezvousAll(r *result, stores []rendezvous.Store, c *storecount.Counts, size int, timeout time.Duration, first func()) {
	n := len(stores)
	cfg := config(n)
	ds := make([]*rendezvous.Dynamic, n)
	for i := range ds {
		d, err := rendezvous.NewDynamic(stores[i], node(i), data(i, size), cfg)
		if err != nil {
			r.err = err
			return
		}
		ds[i] = d
	}
	defer func() {
		for _, d := range ds {
			d.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if progress {
		pctx, stop := context.WithCancel(ctx)
		defer stop()
		go watchProgress(pctx, stores[0], c)
	}
	assigned.Store(0)
	stopProfile := startPhaseProfile()
	r.done, r.elapsed, r.err = nextAll(ctx, ds, 0)
	stopProfile()
	perAgent(r, c)
	first()
	if !loss || r.done < n || n < 2 {
		return
	}
	reqs0 := c.Requests.Load()
	ds[n-1].Close() // dies: no Leave
	start := time.Now()
	h, err := rendezvous.NewDynamic(stores[0], node(n-1), nil, cfg)
	if err == nil {
		err = h.Leave(ctx)
		h.Close()
	}
	if err != nil {
		r.err = fmt.Errorf("expel: %w", err)
		return
	}
	r.lossDone, _, err = nextAll(ctx, ds[:n-1], 1)
	r.lossElapsed = time.Since(start)
	r.lossReqs = float64(c.Requests.Load()-reqs0) / float64(n-1)
	r.err = cmpErr(r.err, err)
}

// nextAll runs Next on every handle at once and returns how many got
// round number round with every handle a member (each rank once; with
// -members, each agent's members all of them), and when the last did.
func nextAll(ctx context.Context, ds []*rendezvous.Dynamic, round int) (int, time.Duration, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	done, last := 0, time.Duration(0)
	var firstErr error
	ranks := make([]bool, len(ds))
	start := time.Now()
	for i, d := range ds {
		wg.Go(func() {
			r, err := d.Next(ctx)
			assigned.Add(1)
			mu.Lock()
			defer mu.Unlock()
			ok := err == nil && r.Number == round && r.Size == len(ds) && r.Rank >= 0 && r.Rank < len(ds) && !ranks[r.Rank]
			if ok && members {
				ok = len(r.Members) == len(ds) && r.Members[r.Rank].Node == node(i)
			}
			if s := r.Summary; ok && plans {
				// What the launcher's plan takes from it (every agent
				// runs 8 workers).
				ok = s != nil && s.Offset == 8*r.Rank && s.Total == 8*len(ds) && s.First.Rank == 0 && s.Dissent == nil &&
					describeOK(s.First.Data)
			}
			switch {
			case ok:
				ranks[r.Rank] = true
				done++
				last = max(last, time.Since(start))
			case err == nil:
				firstErr = cmpErr(firstErr, fmt.Errorf("agent %d: bad round %d: rank %d of %d", i, r.Number, r.Rank, len(r.Members)))
			case !errors.Is(err, context.DeadlineExceeded):
				firstErr = cmpErr(firstErr, err)
			}
		})
	}
	if progress {
		// Where the stragglers are, should the timeout end the run.
		go func() {
			<-ctx.Done()
			if assigned.Load() < int64(len(ds)) {
				pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
			}
		}()
	}
	wg.Wait()
	if done < len(ds) {
		last = time.Since(start)
	}
	return done, last, firstErr
}

// startPhaseProfile starts -phase-cpuprofile's profile, if asked for,
// and returns what stops it.
func startPhaseProfile() (stop func()) {
	if phaseProfile == "" {
		return func() {}
	}
	f, err := os.Create(phaseProfile + "." + profileTag)
	if err == nil {
		err = pprof.StartCPUProfile(f)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rdzvsim: -phase-cpuprofile:", err)
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}
}

// profileEtcd samples etcd's CPU profile in 5-s pieces until stop closes
// and writes them to -etcd-cpuprofile's FILE.N.REP.K (merge them with
// go tool pprof -proto FILE.N.REP.*).
func profileEtcd(endpoint string, stop <-chan struct{}) (wait func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		hc := &http.Client{Timeout: 30 * time.Second}
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			resp, err := hc.Get("http://" + endpoint + "/debug/pprof/profile?seconds=5")
			if err != nil {
				fmt.Fprintln(os.Stderr, "rdzvsim: etcd profile:", err)
				return
			}
			f, err := os.Create(fmt.Sprintf("%s.%s.%d", etcdProfile, profileTag, k))
			if err == nil {
				_, err = io.Copy(f, resp.Body)
				f.Close()
			}
			resp.Body.Close()
			if err != nil {
				fmt.Fprintln(os.Stderr, "rdzvsim: etcd profile:", err)
				return
			}
		}
	}()
	return func() { <-done }
}

func describeOK(b []byte) bool {
	t, err := describe(b)
	return err == nil && t.Weight == 8
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func perAgent(r *result, c *storecount.Counts) {
	n := float64(r.n)
	r.reqs = float64(c.Requests.Load()) / n
	r.sent = float64(c.Sent.Load()) / n
	r.recv = float64(c.Received.Load()) / n
	r.written = float64(c.Written.Load()) / n
	if breakdown {
		printBreakdown(os.Stderr, r.n, c)
	}
}

// printBreakdown writes c's tallies per agent, the costliest first: the
// requests a per-agent figure is made of.
func printBreakdown(w io.Writer, agents int, c *storecount.Counts) {
	type row struct {
		k storecount.Kind
		t *storecount.Tally
	}
	var rows []row
	for k, t := range c.Breakdown() {
		rows = append(rows, row{k, t})
	}
	slices.SortFunc(rows, func(a, b row) int {
		return cmp.Compare(b.t.Sent.Load()+b.t.Received.Load(), a.t.Sent.Load()+a.t.Received.Load())
	})
	n := float64(agents)
	fmt.Fprintf(w, "%d agents, per agent: requests, sent B, received B, by operation and key\n", agents)
	for _, r := range rows {
		fmt.Fprintf(w, "  %8.2f %10.1f %10.1f  %s %s\n", float64(r.t.Requests.Load())/n,
			float64(r.t.Sent.Load())/n, float64(r.t.Received.Load())/n, r.k.Op, r.k.Key)
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// serveStore serves gorun's store until stdin closes: the c10d server
// runs in a process of its own, so that 10,000 agents' connections and
// the server's fit one process's file limit each.
func serveStore() {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(srv.Addr().String())
	io.Copy(io.Discard, os.Stdin)
	srv.Close()
}

// storeProc is the c10d server's process.
type storeProc struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	addr string
}

func startStoreProc() (*storeProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "-serve")
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the store's process: %w", err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("the store's process: %w", err)
	}
	return &storeProc{cmd: cmd, in: in, addr: strings.TrimSpace(line)}, nil
}

func (p *storeProc) cpu() time.Duration { return procCPU(p.cmd.Process.Pid) }

func (p *storeProc) stop() {
	p.in.Close()
	p.cmd.Wait()
}

func runC10d(n, size int, timeout time.Duration) result {
	r := result{n: n}
	srv, err := startStoreProc()
	if err != nil {
		r.err = err
		return r
	}
	defer srv.stop()
	c := storecount.Counts{Detail: breakdown}
	stores := make([]rendezvous.Store, n)
	for i := range stores {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cl, err := tcpstore.Dial(ctx, srv.addr, tcpstore.ClientConfig{Timeout: timeout})
		cancel()
		if err != nil {
			r.err = err
			return r
		}
		defer cl.Close()
		stores[i] = storecount.New(cl, &c)
	}
	cpu0, scpu0 := cpuTime(), srv.cpu()
	rendezvousAll(&r, stores, &c, size, timeout, func() { r.cpu = cpuTime() - cpu0 + srv.cpu() - scpu0 })
	return r
}

func runEtcd(n, size int, timeout time.Duration, bin string, clients int) result {
	r := result{n: n}
	dir, err := os.MkdirTemp(shm(), "rdzvsim-etcd-")
	if err != nil {
		r.err = err
		return r
	}
	defer os.RemoveAll(dir)
	e, err := startEtcd(bin, dir)
	if err != nil {
		r.err = err
		return r
	}
	defer e.stop()
	if clients <= 0 || clients > n {
		clients = n
	}
	clis := make([]*clientv3.Client, clients)
	for i := range clis {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.endpoint}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			r.err = err
			return r
		}
		defer cli.Close()
		clis[i] = cli
	}
	c := storecount.Counts{Detail: breakdown}
	stores := make([]rendezvous.Store, n)
	for i := range stores {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		st, err := etcd.NewStorage(ctx, clis[i%clients], etcd.StorageConfig{
			Prefix: "/gorun/sim/rdzv/", Unwatched: rendezvous.DynamicUnwatched("sim"),
		})
		cancel()
		if err != nil {
			r.err = err
			return r
		}
		s := etcd.NewStore(st, timeout)
		defer s.Close()
		stores[i] = storecount.New(s, &c)
	}
	size0, cpu0, ecpu0 := dirSize(dir), cpuTime(), e.cpu()
	stopEtcdProfile := func() {}
	if etcdProfile != "" {
		stop := make(chan struct{})
		wait := profileEtcd(e.endpoint, stop)
		stopEtcdProfile = func() { close(stop); wait() }
	}
	rendezvousAll(&r, stores, &c, size, timeout, func() {
		r.cpu, r.etcdCPU = cpuTime()-cpu0, e.cpu()-ecpu0
		r.etcdGrow = float64(dirSize(dir)-size0) / float64(n)
		stopEtcdProfile()
	})
	return r
}

func shm() string {
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// dirSize is the bytes of the files under dir (etcd's WAL preallocates
// 64 MB segments: their allocated size would say nothing; the WAL's
// written length is what grows, and the database's size).
func dirSize(dir string) int64 {
	var total int64
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if strings.HasSuffix(p, ".wal") {
			total += walWritten(p)
			return nil
		}
		if fi, err := d.Info(); err == nil {
			total += fi.Size()
		}
		return nil
	})
	return total
}

// walWritten is the length of a WAL segment's written prefix: etcd
// preallocates segments with zeros, so the last non-zero 8-byte frame
// ends it.
func walWritten(p string) int64 {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	end := len(b)
	for end >= 8 {
		zero := true
		for _, c := range b[end-8 : end] {
			if c != 0 {
				zero = false
				break
			}
		}
		if !zero {
			break
		}
		end -= 8
	}
	return int64(end)
}

type etcdServer struct {
	cmd      *exec.Cmd
	done     chan struct{}
	endpoint string
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startEtcd starts a one-member etcd with its data under dir and waits
// until it serves.
func startEtcd(bin, dir string) (*etcdServer, error) {
	cp, err := freePort()
	if err != nil {
		return nil, err
	}
	pp, err := freePort()
	if err != nil {
		return nil, err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(cp)
	peer := "http://127.0.0.1:" + strconv.Itoa(pp)
	log, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(bin, "--name", "sim", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "sim="+peer, "--initial-cluster-state", "new",
		"--quota-backend-bytes", strconv.Itoa(8<<30), "--logger", "zap", "--log-outputs", "stderr")
	if etcdProfile != "" {
		cmd.Args = append(cmd.Args, "--enable-pprof")
	}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start etcd: %w", err)
	}
	e := &etcdServer{cmd: cmd, done: make(chan struct{}), endpoint: "127.0.0.1:" + strconv.Itoa(cp)}
	go func() { cmd.Wait(); close(e.done) }()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Second}
	for deadline := time.Now().Add(20 * time.Second); ; {
		resp, err := hc.Get(client + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return e, nil
			}
		}
		select {
		case <-e.done:
			return nil, fmt.Errorf("etcd exited at start (see %s)", filepath.Join(dir, "etcd.log"))
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			e.stop()
			return nil, errors.New("etcd did not serve within 20 s")
		}
	}
}

func (e *etcdServer) stop() {
	e.cmd.Process.Kill()
	<-e.done
}

// cpu is etcd's user and system CPU so far, from /proc.
func (e *etcdServer) cpu() time.Duration { return procCPU(e.cmd.Process.Pid) }

// procCPU is process pid's user and system CPU so far, from /proc.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ
}
