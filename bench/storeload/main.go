// Command storeload drives a c10d TCPStore server — gorun's or PyTorch's —
// with the same client (gorun's tcpstore.Client) so that the two can be
// compared side by side. It prints one JSON object per run.
//
//	storeload mixed -addr A -wire old -conns 64 -duration 10s
//	storeload storm -addr A -wire old -clients 16384
//	storeload idle  -addr A -conns 4096 -pid PID
//	storeload connect -addr A -clients 16384
//	storeload partial -addr A -conns 16 -announce 1073741824 -send 4096 -pid PID
//
// With -pid, every mode also reports the server process's CPU time.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: storeload mixed|storm|idle [flags]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	addr := fs.String("addr", "", "server HOST:PORT")
	wire := fs.String("wire", "old", "wire generation: old (PyTorch 1.13 servers) or new")
	conns := fs.Int("conns", 64, "connections (mixed, idle)")
	clients := fs.Int("clients", 1024, "clients (storm)")
	duration := fs.Duration("duration", 5*time.Second, "how long to run (mixed)")
	timeout := fs.Duration("timeout", 120*time.Second, "store timeout")
	pid := fs.Int("pid", 0, "server PID whose RSS to read (idle)")
	announce := fs.Int64("announce", 1<<30, "value length each connection announces (partial)")
	send := fs.Int("send", 4<<10, "bytes of the value each connection sends (partial)")
	label := fs.String("label", "", "free text copied into the result")
	cpuprofile := fs.String("cpuprofile", "", "write the load client's CPU profile here")
	fs.Parse(os.Args[2:])
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "storeload:", err)
			os.Exit(1)
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	gen, err := tcpstore.ParseGeneration(*wire)
	if err != nil || *addr == "" {
		fmt.Fprintln(os.Stderr, "storeload: need -addr and -wire old|new")
		os.Exit(2)
	}
	cfg := tcpstore.ClientConfig{Wire: gen, Timeout: *timeout}
	var cpu0 time.Duration
	if *pid != 0 {
		if cpu0, err = cpuTime(*pid); err != nil {
			fmt.Fprintln(os.Stderr, "storeload:", err)
			os.Exit(1)
		}
	}
	clientCPU0 := selfCPU()
	var res map[string]any
	switch os.Args[1] {
	case "mixed":
		res, err = mixed(*addr, cfg, *conns, *duration)
	case "storm":
		res, err = storm(*addr, cfg, *clients)
	case "idle":
		res, err = idle(*addr, gen, *conns, *pid)
	case "connect":
		res, err = connectFloor(*addr, *clients)
	case "partial":
		res, err = partial(*addr, gen, *conns, *announce, *send, *pid)
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "storeload:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
	res["mode"], res["wire"], res["label"] = os.Args[1], *wire, *label
	clientCPU := selfCPU() - clientCPU0
	res["client_cpu_s"] = clientCPU.Seconds()
	if ops, ok := res["ops"].(int); ok && ops > 0 {
		res["client_cpu_us_per_op"] = float64(clientCPU.Microseconds()) / float64(ops)
	}
	if *pid != 0 {
		if cpu1, err := cpuTime(*pid); err == nil {
			res["server_cpu_s"] = (cpu1 - cpu0).Seconds()
			if ops, ok := res["ops"].(int); ok && ops > 0 {
				res["server_cpu_us_per_op"] = float64((cpu1 - cpu0).Microseconds()) / float64(ops)
			}
		}
	}
	json.NewEncoder(os.Stdout).Encode(res)
}

// mixed runs conns clients, each looping set, get, add on its own keys, for
// d. An op is one store call as a PyTorch user makes it (get = WAIT + GET on
// the wire, as c10d's client does).
func mixed(addr string, cfg tcpstore.ClientConfig, conns int, d time.Duration) (map[string]any, error) {
	ctx := context.Background()
	cls := make([]*tcpstore.Client, conns)
	for i := range cls {
		c, err := tcpstore.Dial(ctx, addr, cfg)
		if err != nil {
			return nil, err
		}
		defer c.Close()
		cls[i] = c
	}
	lat := make([][]time.Duration, conns)
	var failures atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	value := []byte(strings.Repeat("v", 32))
	for i, c := range cls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, 1<<16)
			key := "load/" + strconv.Itoa(i) + "/"
			for n := 0; ; n++ {
				t0 := time.Now()
				if t0.After(deadline) {
					break
				}
				k := key + strconv.Itoa(n%64)
				var err error
				switch n % 3 {
				case 0:
					err = c.Set(ctx, k, value)
				case 1:
					_, err = c.Get(ctx, key+strconv.Itoa((n-1)%64))
				case 2:
					_, err = c.Add(ctx, key+"counter", 1)
				}
				if err != nil {
					failures.Add(1)
					firstErr.CompareAndSwap(nil, err)
					return
				}
				mine = append(mine, time.Since(t0))
			}
			lat[i] = mine
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	all := slices.Concat(lat...)
	slices.Sort(all)
	res := map[string]any{
		"conns":      conns,
		"ops":        len(all),
		"seconds":    elapsed.Seconds(),
		"ops_per_s":  float64(len(all)) / elapsed.Seconds(),
		"p50_us":     pct(all, 0.50),
		"p99_us":     pct(all, 0.99),
		"p999_us":    pct(all, 0.999),
		"failed_ops": failures.Load(),
	}
	if e := firstErr.Load(); e != nil {
		res["first_error"] = e.(error).Error()
	}
	return res, nil
}

func pct(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[int(float64(len(sorted)-1)*p)].Microseconds())
}

// storm is the rendezvous pattern of a large job: every client connects,
// ADDs a counter, the one that brings it to N SETs a release key, and all
// WAIT for that key. It reports the time from the first connect to the
// last client released.
func storm(addr string, cfg tcpstore.ClientConfig, n int) (map[string]any, error) {
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := time.Now()
	var connected atomic.Int64
	var connectDone atomic.Int64 // ns since start when the last client connected
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := tcpstore.Dial(ctx, addr, cfg)
			if err != nil {
				errs <- fmt.Errorf("dial: %w", err)
				return
			}
			defer c.Close()
			if connected.Add(1) == int64(n) {
				connectDone.Store(int64(time.Since(start)))
			}
			v, err := c.Add(ctx, "storm/count", 1)
			if err != nil {
				errs <- fmt.Errorf("add: %w", err)
				return
			}
			if v == int64(n) {
				if err := c.Set(ctx, "storm/release", []byte("go")); err != nil {
					errs <- fmt.Errorf("set: %w", err)
					return
				}
			}
			if err := c.Wait(ctx, "storm/release"); err != nil {
				errs <- fmt.Errorf("wait: %w", err)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	var failed int
	var first error
	for err := range errs {
		failed++
		if first == nil {
			first = err
		}
	}
	res := map[string]any{
		"clients":            n,
		"seconds":            elapsed.Seconds(),
		"all_connected_secs": time.Duration(connectDone.Load()).Seconds(),
		"failed_clients":     failed,
	}
	if first != nil {
		res["first_error"] = first.Error()
	}
	return res, nil
}

// idle opens conns connections that then say nothing — like PyTorch 1.13's
// second socket, or any client between requests — and reports how much the
// server's resident memory grew per connection.
func idle(addr string, gen tcpstore.Generation, conns, pid int) (map[string]any, error) {
	var first []byte
	if gen == tcpstore.GenNew {
		// VALIDATE, then idle: the server has seen one request.
		first = []byte{0, 0xce, 0xf7, 0x85, 0x3c}
	}
	before, after, release, err := holdConns(addr, pid, conns, first, false)
	if err != nil {
		return nil, err
	}
	defer release()
	return map[string]any{
		"conns":             conns,
		"rss_before_kib":    before >> 10,
		"rss_after_kib":     after >> 10,
		"bytes_per_conn":    float64(after-before) / float64(conns),
		"kib_per_conn":      float64(after-before) / float64(conns) / 1024,
		"server_pid":        pid,
		"measured_with_gen": gen.String(),
	}, nil
}

// holdConns opens conns connections to addr and writes first on each, lets
// the server settle, and returns the server's RSS before and after and a
// function that closes the connections. With lenient, a write the server
// does not take within a second is left unfinished (a server that is stuck
// on another connection reads nothing).
func holdConns(addr string, pid, conns int, first []byte, lenient bool) (before, after int64, release func(), err error) {
	if pid == 0 {
		return 0, 0, nil, errors.New("needs -pid of the server")
	}
	if before, err = rss(pid); err != nil {
		return 0, 0, nil, err
	}
	var held []net.Conn
	release = func() {
		for _, c := range held {
			c.Close()
		}
	}
	for range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			release()
			return 0, 0, nil, err
		}
		held = append(held, c)
		if len(first) == 0 {
			continue
		}
		if lenient {
			c.SetWriteDeadline(time.Now().Add(time.Second))
		}
		if _, err := c.Write(first); err != nil && !lenient {
			release()
			return 0, 0, nil, err
		}
	}
	time.Sleep(2 * time.Second) // let the server settle (accepts, reads, GC)
	if after, err = rss(pid); err != nil {
		release()
		return 0, 0, nil, err
	}
	return before, after, release, nil
}

// partial opens conns connections that each start a SET announcing a value
// of announce bytes and send only send bytes of it, and reports how much
// the server's resident memory grew per connection, and whether it still
// answers a fresh client (a GETNUMKEYS within 3 s).
func partial(addr string, gen tcpstore.Generation, conns int, announce int64, send, pid int) (map[string]any, error) {
	var req []byte
	if gen == tcpstore.GenNew {
		req = append(req, 0, 0xce, 0xf7, 0x85, 0x3c) // VALIDATE
		req = append(req, 1)                         // SET
	} else {
		req = append(req, 0) // SET
	}
	req = binary.LittleEndian.AppendUint64(req, 4)
	req = append(req, "/big"...)
	req = binary.LittleEndian.AppendUint64(req, uint64(announce))
	req = append(req, make([]byte, send)...)
	before, after, release, err := holdConns(addr, pid, conns, req, true)
	if err != nil {
		return nil, err
	}
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	answers := false
	if c, err := tcpstore.Dial(ctx, addr, tcpstore.ClientConfig{Wire: gen, Timeout: 3 * time.Second}); err == nil {
		_, err = c.NumKeys(ctx)
		answers = err == nil
		c.Close()
	}
	return map[string]any{
		"conns":          conns,
		"announced":      announce,
		"sent":           send,
		"rss_before_kib": before >> 10,
		"rss_after_kib":  after >> 10,
		"kib_per_conn":   float64(after-before) / float64(conns) / 1024,
		"server_answers": answers,
		"server_pid":     pid,
	}, nil
}

// connectFloor measures what the kernel alone costs: n blocking
// socket+connect calls from one thread, no request sent, then close. No
// store client can open n connections faster on this machine.
func connectFloor(addr string, n int) (map[string]any, error) {
	tcp, err := net.ResolveTCPAddr("tcp4", addr)
	if err != nil {
		return nil, err
	}
	sa := &unix.SockaddrInet4{Port: tcp.Port}
	copy(sa.Addr[:], tcp.IP.To4())
	fds := make([]int, 0, n)
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	start := time.Now()
	for range n {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		fds = append(fds, fd)
		if err := unix.Connect(fd, sa); err != nil {
			return nil, err
		}
	}
	elapsed := time.Since(start)
	return map[string]any{"clients": n, "seconds": elapsed.Seconds()}, nil
}

// selfCPU is this process's user+system CPU time so far.
func selfCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuTime reads the user+system CPU time of pid from /proc/PID/stat.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	// After the command: state(0) ppid … utime(11) stime(12), in clock
	// ticks of 1/100 s on Linux.
	if len(f) < 13 {
		return 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("bad /proc/%d/stat", pid)
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

// rss reads VmRSS of pid in bytes.
func rss(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no VmRSS in /proc/" + strconv.Itoa(pid) + "/status")
}
