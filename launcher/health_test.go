package launcher

import (
	"errors"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// noLeaks fails t if goroutines started during it outlive it and its
// cleanups (registered first, it runs last).
func noLeaks(t *testing.T) {
	t.Helper()
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, opt) })
}

// serveHealth starts h on a free loopback port and returns its base URL
// and a client that keeps no connections (so nothing outlives the test).
func serveHealth(t *testing.T, h *Health) (string, *http.Client) {
	t.Helper()
	addr, err := h.Serve("127.0.0.1:0", zaptest.NewLogger(t))
	if err != nil {
		t.Fatalf("Serve: %v", err)
	}
	t.Cleanup(func() { h.Close() })
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	return "http://" + addr.String(), client
}

// get fetches url and returns the status code and body.
func get(t *testing.T, c *http.Client, url string) (int, string) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading the body: %v", url, err)
	}
	return resp.StatusCode, string(b)
}

func TestPhaseString(t *testing.T) {
	want := map[Phase]string{
		PhaseStarting: "starting", PhaseRendezvous: "rendezvous", PhaseRunning: "running",
		PhaseStopping: "stopping", PhaseSucceeded: "succeeded", PhaseFailed: "failed",
		Phase(-1): "Phase(-1)", Phase(6): "Phase(6)",
	}
	for p, s := range want {
		if got := p.String(); got != s {
			t.Errorf("Phase(%d).String() = %q, want %q", int(p), got, s)
		}
	}
}

// TestHealthProbes: the phases drive /healthz and /readyz over real HTTP.
func TestHealthProbes(t *testing.T) {
	noLeaks(t)
	h := NewHealth()
	base, c := serveHealth(t, h)

	steps := []struct {
		phase             Phase
		healthz, readyz   int
		healthzB, readyzB string
	}{
		{PhaseStarting, 200, 503, "ok", "starting"},
		{PhaseRendezvous, 200, 503, "ok", "rendezvous"},
		{PhaseRunning, 200, 200, "ok", "ok"},
		{PhaseStopping, 200, 503, "ok", "stopping"},
		{PhaseRendezvous, 200, 503, "ok", "rendezvous"}, // a restart
		{PhaseRunning, 200, 200, "ok", "ok"},
		{PhaseSucceeded, 200, 503, "ok", "succeeded"},
		{PhaseFailed, 503, 503, "failed", "failed"},
	}
	for i, s := range steps {
		if i > 0 { // the first step is the initial phase, set by NewHealth
			h.SetPhase(s.phase)
		}
		if got := h.Phase(); got != s.phase {
			t.Fatalf("step %d: Phase() = %v, want %v", i, got, s.phase)
		}
		if code, body := get(t, c, base+"/healthz"); code != s.healthz || body != s.healthzB+"\n" {
			t.Errorf("%v: /healthz = %d %q, want %d %q", s.phase, code, body, s.healthz, s.healthzB)
		}
		if code, body := get(t, c, base+"/readyz"); code != s.readyz || body != s.readyzB+"\n" {
			t.Errorf("%v: /readyz = %d %q, want %d %q", s.phase, code, body, s.readyz, s.readyzB)
		}
	}

	// An unknown phase changes nothing.
	h.SetPhase(Phase(42))
	if h.Phase() != PhaseFailed {
		t.Errorf("SetPhase(42) changed the phase to %v", h.Phase())
	}

	// HEAD works for probes; other methods and paths do not.
	resp, err := c.Head(base + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Cache-Control") != "no-store" ||
		!strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Errorf("HEAD /healthz: %d %v", resp.StatusCode, resp.Header)
	}
	resp, err = c.Post(base+"/readyz", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /readyz: %d, want 405", resp.StatusCode)
	}
	if code, _ := get(t, c, base+"/nope"); code != http.StatusNotFound {
		t.Errorf("GET /nope: %d, want 404", code)
	}
}

// metricValue finds one sample in a Prometheus text exposition: name with
// exactly the labels given (`{a="b"}`, or "" for none).
func metricValue(t *testing.T, text, name, labels string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name+labels) + ` (\S+)$`)
	m := re.FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("no sample %s%s in /metrics:\n%s", name, labels, text)
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatalf("%s%s: %v", name, labels, err)
	}
	return v
}

// TestHealthMetrics: every reporting call shows up in /metrics.
func TestHealthMetrics(t *testing.T) {
	noLeaks(t)
	h := NewHealth()
	base, c := serveHealth(t, h)
	scrape := func() string {
		t.Helper()
		code, body := get(t, c, base+"/metrics")
		if code != 200 {
			t.Fatalf("/metrics: %d %q", code, body)
		}
		return body
	}
	type sample struct {
		name, labels string
		want         float64
	}
	check := func(what string, samples ...sample) {
		t.Helper()
		text := scrape()
		for _, s := range samples {
			if got := metricValue(t, text, s.name, s.labels); got != s.want {
				t.Errorf("%s: %s%s = %v, want %v", what, s.name, s.labels, got, s.want)
			}
		}
	}
	phase := func(p string) string { return `{phase="` + p + `"}` }
	state := func(s string) string { return `{state="` + s + `"}` }
	reason := func(r string) string { return `{reason="` + r + `"}` }

	// Everything exists, at zero, from the start.
	check("fresh",
		sample{"gorun_agent_phase", phase("starting"), 1},
		sample{"gorun_agent_phase", phase("rendezvous"), 0},
		sample{"gorun_agent_phase", phase("running"), 0},
		sample{"gorun_agent_phase", phase("stopping"), 0},
		sample{"gorun_agent_phase", phase("succeeded"), 0},
		sample{"gorun_agent_phase", phase("failed"), 0},
		sample{"gorun_restarts_total", "", 0},
		sample{"gorun_rendezvous_round", "", 0},
		sample{"gorun_rendezvous_duration_seconds_count", "", 0},
		sample{"gorun_workers", state("running"), 0},
		sample{"gorun_workers", state("succeeded"), 0},
		sample{"gorun_workers", state("failed"), 0},
		sample{"gorun_workers", state("stopped"), 0},
		sample{"gorun_worker_failures_total", reason("exit_code"), 0},
		sample{"gorun_worker_failures_total", reason("signal"), 0},
	)
	if text := scrape(); !strings.Contains(text, "# TYPE gorun_rendezvous_duration_seconds histogram") ||
		!strings.Contains(text, "process_resident_memory_bytes") || !strings.Contains(text, "go_goroutines") {
		t.Errorf("/metrics lacks the histogram type or the standard collectors:\n%s", text)
	}

	// Attempt 0: rendezvous round 1 takes 3 ms, four workers start, rank 2
	// dies of SIGSEGV, the agent stops the other three.
	h.SetPhase(PhaseRendezvous)
	h.RendezvousDone(1, 3*time.Millisecond)
	h.SetPhase(PhaseRunning)
	h.WorkersStarted(4)
	check("running",
		sample{"gorun_agent_phase", phase("running"), 1},
		sample{"gorun_agent_phase", phase("rendezvous"), 0},
		sample{"gorun_agent_phase", phase("starting"), 0},
		sample{"gorun_rendezvous_round", "", 1},
		sample{"gorun_rendezvous_duration_seconds_count", "", 1},
		sample{"gorun_rendezvous_duration_seconds_sum", "", 0.003},
		sample{"gorun_rendezvous_duration_seconds_bucket", `{le="0.0025"}`, 0},
		sample{"gorun_rendezvous_duration_seconds_bucket", `{le="0.005"}`, 1},
		sample{"gorun_workers", state("running"), 4},
	)
	h.WorkerExited(false, ReasonSignal)
	h.SetPhase(PhaseStopping)
	for range 3 {
		h.WorkerExited(false, ReasonStopped)
	}
	check("after a failure",
		sample{"gorun_agent_phase", phase("stopping"), 1},
		sample{"gorun_workers", state("running"), 0},
		sample{"gorun_workers", state("failed"), 1},
		sample{"gorun_workers", state("stopped"), 3},
		sample{"gorun_worker_failures_total", reason("signal"), 1},
		sample{"gorun_worker_failures_total", reason("exit_code"), 0},
	)

	// Attempt 1: a restart, round 2 takes 90 s, two workers (a smaller
	// group), one exits 1, one succeeds.
	h.Restarted()
	h.SetPhase(PhaseRendezvous)
	h.RendezvousDone(2, 90*time.Second)
	h.SetPhase(PhaseRunning)
	h.WorkersStarted(2)
	check("restarted",
		sample{"gorun_restarts_total", "", 1},
		sample{"gorun_rendezvous_round", "", 2},
		sample{"gorun_rendezvous_duration_seconds_count", "", 2},
		sample{"gorun_rendezvous_duration_seconds_bucket", `{le="60"}`, 1},
		sample{"gorun_rendezvous_duration_seconds_bucket", `{le="120"}`, 2},
		sample{"gorun_rendezvous_duration_seconds_bucket", `{le="600"}`, 2},
		sample{"gorun_workers", state("running"), 2},
		sample{"gorun_workers", state("failed"), 0}, // a new group
		sample{"gorun_workers", state("stopped"), 0},
		sample{"gorun_worker_failures_total", reason("signal"), 1}, // counters keep counting
	)
	h.WorkerExited(true, "")
	h.WorkerExited(false, ReasonExitCode)
	h.WorkerExited(false, "")           // no reason: "unknown"
	h.WorkerExited(false, "hang")       // a reason of the caller's
	h.WorkerExited(true, ReasonStopped) // ok wins over the reason
	h.SetPhase(PhaseFailed)
	check("failed",
		sample{"gorun_agent_phase", phase("failed"), 1},
		sample{"gorun_agent_phase", phase("running"), 0},
		sample{"gorun_workers", state("running"), 0}, // never below zero
		sample{"gorun_workers", state("succeeded"), 2},
		sample{"gorun_workers", state("failed"), 3},
		sample{"gorun_worker_failures_total", reason("exit_code"), 1},
		sample{"gorun_worker_failures_total", reason("unknown"), 1},
		sample{"gorun_worker_failures_total", reason("hang"), 1},
	)

	// Exactly one phase is 1, whatever happened.
	text := scrape()
	sum := 0.0
	for p := range Phase(numPhases) {
		sum += metricValue(t, text, "gorun_agent_phase", phase(p.String()))
	}
	if sum != 1 {
		t.Errorf("gorun_agent_phase sums to %v, want 1", sum)
	}
}

// TestHealthPrivateRegistry: two Healths do not share metrics, and
// neither touches the global registry.
func TestHealthPrivateRegistry(t *testing.T) {
	noLeaks(t)
	a, b := NewHealth(), NewHealth() // MustRegister would panic on a shared registry
	a.Restarted()
	a.Restarted()
	baseA, c := serveHealth(t, a)
	baseB, _ := serveHealth(t, b)
	_, textA := get(t, c, baseA+"/metrics")
	_, textB := get(t, c, baseB+"/metrics")
	if got := metricValue(t, textA, "gorun_restarts_total", ""); got != 2 {
		t.Errorf("a: gorun_restarts_total = %v, want 2", got)
	}
	if got := metricValue(t, textB, "gorun_restarts_total", ""); got != 0 {
		t.Errorf("b: gorun_restarts_total = %v, want 0", got)
	}
}

// TestHealthClose: Close stops the server, frees the port and ends every
// goroutine; Close is idempotent and Serve works again after it.
func TestHealthClose(t *testing.T) {
	noLeaks(t)
	h := NewHealth()
	if err := h.Close(); err != nil { // before Serve: nothing to do
		t.Fatalf("Close before Serve: %v", err)
	}
	addr, err := h.Serve("127.0.0.1:0", zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Serve("127.0.0.1:0", zap.NewNop()); err == nil {
		t.Fatal("a second Serve while serving succeeded")
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	url := "http://" + addr.String() + "/healthz"
	if code, _ := get(t, c, url); code != 200 {
		t.Fatalf("/healthz before Close: %d", code)
	}

	// A client holding an idle keep-alive connection does not keep the
	// server (or Close) alive.
	kc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{}}
	defer kc.CloseIdleConnections()
	if code, _ := get(t, kc, url); code != 200 {
		t.Fatalf("/healthz with keep-alive: %d", code)
	}

	start := time.Now()
	if err := h.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if d := time.Since(start); d > closeGrace/2 {
		t.Errorf("Close took %v with only idle connections", d)
	}
	if err := h.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := c.Get(url); err == nil {
		t.Fatal("GET after Close succeeded")
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Logf("GET after Close: %v", err)
	}
	// The port is free: it can be bound again at once.
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("port %s still taken after Close: %v", addr, err)
	}
	ln.Close()

	// Serve again on the same port after Close.
	addr2, err := h.Serve(addr.String(), nil)
	if err != nil {
		t.Fatalf("Serve after Close: %v", err)
	}
	if addr2.String() != addr.String() {
		t.Errorf("Serve(%s) listens on %s", addr, addr2)
	}
	if code, _ := get(t, c, url); code != 200 {
		t.Fatalf("/healthz after re-Serve: %d", code)
	}
	kc.CloseIdleConnections()
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestHealthCloseSlowClient: a client stuck in the middle of a request
// delays Close by at most closeGrace, then is cut off.
func TestHealthCloseSlowClient(t *testing.T) {
	noLeaks(t)
	h := NewHealth()
	addr, err := h.Serve("127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /healthz HTTP/1.1\r\nHost: x\r\n")); err != nil { // no blank line: unfinished
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // let the server start reading it
	start := time.Now()
	if err := h.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if d := time.Since(start); d > closeGrace+time.Second {
		t.Errorf("Close took %v, want about %v", d, closeGrace)
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := conn.Read(make([]byte, 1)); err == nil {
		t.Errorf("the slow client's connection is still open (read %d bytes)", n)
	}
}

// TestHealthServeErrors: a taken port or a bad address is an error, and
// leaves the Health able to serve elsewhere.
func TestHealthServeErrors(t *testing.T) {
	noLeaks(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	h := NewHealth()
	for _, addr := range []string{taken.Addr().String(), "127.0.0.1:99999", "no-port"} {
		if a, err := h.Serve(addr, nil); err == nil {
			h.Close()
			t.Fatalf("Serve(%q) = %v, want an error", addr, a)
		} else if !strings.Contains(err.Error(), addr) {
			t.Errorf("Serve(%q): error %q does not name the address", addr, err)
		}
	}
	base, c := serveHealth(t, h)
	if code, _ := get(t, c, base+"/healthz"); code != 200 {
		t.Fatalf("/healthz: %d", code)
	}
}

// TestHealthNil: an agent without --health-addr holds a nil *Health and
// reports to it freely.
func TestHealthNil(t *testing.T) {
	var h *Health
	h.SetPhase(PhaseRunning)
	h.RendezvousDone(1, time.Second)
	h.WorkersStarted(2)
	h.WorkerExited(false, ReasonSignal)
	h.Restarted()
	if h.Phase() != PhaseStarting {
		t.Errorf("nil Phase() = %v", h.Phase())
	}
	if err := h.Close(); err != nil {
		t.Errorf("nil Close: %v", err)
	}
	if _, err := h.Serve("127.0.0.1:0", nil); err == nil {
		t.Error("nil Serve succeeded")
	}
}

// TestHealthConcurrent: reporting from many goroutines while clients
// probe and scrape (run with -race).
func TestHealthConcurrent(t *testing.T) {
	noLeaks(t)
	h := NewHealth()
	base, c := serveHealth(t, h)
	var wg sync.WaitGroup
	const n = 8
	for i := range n {
		wg.Go(func() {
			for j := range 50 {
				h.SetPhase(Phase((i + j) % int(numPhases)))
				h.WorkersStarted(4)
				h.WorkerExited(j%2 == 0, ReasonExitCode)
				h.Restarted()
				h.RendezvousDone(j, time.Duration(j)*time.Millisecond)
			}
		})
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		wg.Go(func() {
			for range 20 {
				resp, err := c.Get(base + path)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	_, text := get(t, c, base+"/metrics")
	if got := metricValue(t, text, "gorun_restarts_total", ""); got != n*50 {
		t.Errorf("gorun_restarts_total = %v, want %d", got, n*50)
	}
	sum := 0.0
	for p := range Phase(numPhases) {
		sum += metricValue(t, text, "gorun_agent_phase", `{phase="`+p.String()+`"}`)
	}
	if sum != 1 {
		t.Errorf("gorun_agent_phase sums to %v after concurrent SetPhase, want 1", sum)
	}
}
