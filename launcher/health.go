package launcher

// The agent's operations endpoint (gorun's --health-addr): probes for
// Kubernetes and the like, and Prometheus metrics.
//
//	GET /healthz  200 "ok" while the agent lives and has not failed;
//	              503 "failed" once it is in PhaseFailed (it is about to exit).
//	              Rendezvous does not make it fail: a large job can take
//	              minutes to gather, and a liveness probe must not kill it.
//	GET /readyz   200 "ok" only in PhaseRunning: the workers are running
//	              after a completed rendezvous. Otherwise 503 and the phase
//	              name ("rendezvous", "stopping", …).
//	GET /metrics  Prometheus text format, from a registry of the Health's
//	              own (never the global one).
//
// Metrics (all gauges and counters start at 0, every label value below
// exists from the start so that queries see zeros rather than nothing):
//
//	gorun_agent_phase{phase}              gauge: 1 for the current phase, 0 for the
//	                                      others; phase is starting, rendezvous,
//	                                      running, stopping, succeeded or failed.
//	gorun_restarts_total                  counter: restarts of the local worker
//	                                      group after a failure (Restarted);
//	                                      membership changes are not restarts.
//	gorun_rendezvous_duration_seconds     histogram: how long each completed
//	                                      rendezvous took, join to result; buckets
//	                                      from 1 ms to 10 min.
//	gorun_rendezvous_round                gauge: the round of the last completed
//	                                      rendezvous.
//	gorun_workers{state}                  gauge: the current worker group by state:
//	                                      running, succeeded, failed, stopped
//	                                      (stopped: ended by the agent itself, e.g.
//	                                      the rest of the group after a failure,
//	                                      or on SIGTERM). WorkersStarted resets it.
//	gorun_worker_failures_total{reason}   counter: worker failures by reason:
//	                                      exit_code (exited non-zero), signal
//	                                      (killed by a signal the agent did not
//	                                      send); workers the agent stopped are
//	                                      not failures.
//
// plus the Go runtime's go_* and the process's process_* metrics (RSS, open
// files, CPU), from client_golang's standard collectors.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/shrink"
)

// Phase is where an agent is in its life. The agent moves through
// Starting → Rendezvous → Running, back to Rendezvous (via Stopping) on a
// restart or a membership change, and ends in Succeeded or Failed.
type Phase int

const (
	// PhaseStarting: configured, nothing started yet.
	PhaseStarting Phase = iota
	// PhaseRendezvous: waiting for the other agents (the first round or a
	// later one).
	PhaseRendezvous
	// PhaseRunning: the workers are running after a completed rendezvous.
	PhaseRunning
	// PhaseStopping: stopping the workers (a failure, a signal, a new
	// round).
	PhaseStopping
	// PhaseSucceeded: every worker succeeded; the agent is finishing.
	PhaseSucceeded
	// PhaseFailed: the job failed on this node; the agent is exiting
	// non-zero.
	PhaseFailed

	numPhases = iota
)

var phaseNames = [numPhases]string{"starting", "rendezvous", "running", "stopping", "succeeded", "failed"}

// String is the phase's name as /readyz and the phase label spell it.
func (p Phase) String() string {
	if p.valid() {
		return phaseNames[p]
	}
	return "Phase(" + strconv.Itoa(int(p)) + ")"
}

func (p Phase) valid() bool { return p >= 0 && p < numPhases }

// Reasons for WorkerExited. Other strings are accepted and become label
// values as given (keep them few: each is a time series); "" is "unknown".
const (
	// ReasonExitCode: the worker exited with a non-zero code.
	ReasonExitCode = "exit_code"
	// ReasonSignal: a signal the agent did not send killed the worker.
	ReasonSignal = "signal"
	// ReasonOOM: the kernel's OOM killer killed the worker (its cgroup's,
	// or the agent's, oom_kill count went up as it died of SIGKILL).
	ReasonOOM = "oom"
	// ReasonStopped: the agent stopped the worker itself (the rest of the
	// group after another worker failed, a signal to the agent, a new
	// rendezvous round). Not a failure: it counts in
	// gorun_workers{state="stopped"} and not in
	// gorun_worker_failures_total.
	ReasonStopped = "stopped"
)

// Worker states, the values of gorun_workers' state label.
const (
	workersRunning   = "running"
	workersSucceeded = "succeeded"
	workersFailed    = "failed"
	workersStopped   = "stopped"
)

// rendezvousBuckets span 1 ms (a single node on loopback) to 10 min (a
// large job gathering, torchrun's default join timeout), roughly ×2.5 a
// step.
var rendezvousBuckets = []float64{
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 30, 60, 120, 300, 600,
}

// Health is one agent's state as its operations endpoint reports it. The
// agent reports through SetPhase, RendezvousDone, WorkersStarted,
// WorkerExited and Restarted; Serve exposes the result over HTTP. All
// methods are safe for concurrent use, and the reporting methods are
// no-ops on a nil *Health, so an agent without --health-addr can call them
// unconditionally.
type Health struct {
	reg       *prometheus.Registry
	phase     *prometheus.GaugeVec
	restarts  prometheus.Counter
	rdzvTime  prometheus.Histogram
	rdzvRound prometheus.Gauge
	workers   *prometheus.GaugeVec
	failures  *prometheus.CounterVec
	reported  *prometheus.CounterVec
	epochs    *prometheus.CounterVec
	epochWait prometheus.Histogram
	world     prometheus.Gauge
	respawns  *prometheus.CounterVec
	growTime  prometheus.Histogram
	refused   *prometheus.CounterVec

	mu      sync.Mutex
	current Phase
	counts  map[string]int // by worker state
	srv     *http.Server
	done    chan struct{} // closed when srv.Serve has returned
}

// NewHealth returns a Health in PhaseStarting with every metric at zero.
func NewHealth() *Health {
	h := &Health{
		reg: prometheus.NewRegistry(),
		phase: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gorun_agent_phase",
			Help: "1 for the agent's current phase (starting, rendezvous, running, stopping, succeeded, failed), 0 for the others.",
		}, []string{"phase"}),
		restarts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gorun_restarts_total",
			Help: "Restarts of the local worker group after a worker failure.",
		}),
		rdzvTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "gorun_rendezvous_duration_seconds",
			Help:    "Time each completed rendezvous took, from joining to the result.",
			Buckets: rendezvousBuckets,
		}),
		rdzvRound: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gorun_rendezvous_round",
			Help: "Round number of the last completed rendezvous.",
		}),
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gorun_workers",
			Help: "Workers of the current group by state (running, succeeded, failed, stopped by the agent).",
		}, []string{"state"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gorun_worker_failures_total",
			Help: "Worker failures by reason (exit_code: non-zero exit; signal: killed by a signal the agent did not send).",
		}, []string{"reason"}),
		reported: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gorun_failures_reported_total",
			Help: "Failures this agent reported to the survivors' agreement (--on-failure shrink), by kind (worker: a local worker failed or hung; node: another node was lost).",
		}, []string{"kind"}),
		epochs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gorun_shrink_epochs_total",
			Help: "Epochs the agent adopted under --on-failure shrink, by action (shrink: survivors carried on; grow: lost slots grown back in; restart: fell back to a restart).",
		}, []string{"action"}),
		epochWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "gorun_shrink_epoch_latency_seconds",
			Help:    "From this agent reporting a failure to the epoch that excludes it reaching the agent: detection to agreement.",
			Buckets: rendezvousBuckets,
		}),
		world: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gorun_world_size",
			Help: "Ranks in the job's group: as launched, then as each epoch under --on-failure shrink leaves it.",
		}),
		respawns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gorun_respawns_total",
			Help: "Lost local ranks under --on-failure shrink --regrow on, by outcome (started: respawned to be grown back in; refused: the job's --max-respawns budget was spent).",
		}, []string{"outcome"}),
		growTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "gorun_grow_duration_seconds",
			Help:    "From a grow epoch's decision to its last rank arriving in the grown group: the job back at that size.",
			Buckets: rendezvousBuckets,
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gorun_records_refused_total",
			Help: "Records that failed their check under the job secret (forged, replayed, or written without it) and were ignored, by kind (epoch, notice: read from the shrink board; gossip: node liveness packets and streams, also another job's; rendezvous: the rendezvous store's records, spare assignments included).",
		}, []string{"kind"}),
		current: PhaseStarting,
		counts:  map[string]int{},
	}
	h.reg.MustRegister(h.phase, h.restarts, h.rdzvTime, h.rdzvRound, h.workers, h.failures,
		h.reported, h.epochs, h.epochWait, h.world, h.respawns, h.growTime, h.refused,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for p := range Phase(numPhases) {
		h.phase.WithLabelValues(p.String()).Set(0)
	}
	h.phase.WithLabelValues(PhaseStarting.String()).Set(1)
	for _, s := range []string{workersRunning, workersSucceeded, workersFailed, workersStopped} {
		h.workers.WithLabelValues(s).Set(0)
	}
	for _, r := range []string{ReasonExitCode, ReasonSignal} {
		h.failures.WithLabelValues(r)
	}
	for _, k := range []string{ReportWorker, ReportNode} {
		h.reported.WithLabelValues(k)
	}
	for _, a := range []shrink.Action{shrink.ActionShrink, shrink.ActionRestart} {
		h.epochs.WithLabelValues(string(a))
	}
	return h
}

// Phase returns the current phase (PhaseStarting for a nil Health).
func (h *Health) Phase() Phase {
	if h == nil {
		return PhaseStarting
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.current
}

// SetPhase records the agent's new phase. A value that is not one of the
// Phase constants is ignored.
func (h *Health) SetPhase(p Phase) {
	if h == nil || !p.valid() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if p == h.current {
		return
	}
	h.phase.WithLabelValues(h.current.String()).Set(0)
	h.phase.WithLabelValues(p.String()).Set(1)
	h.current = p
}

// RendezvousDone records a completed rendezvous: its round and how long it
// took.
func (h *Health) RendezvousDone(round int, d time.Duration) {
	if h == nil {
		return
	}
	h.rdzvTime.Observe(d.Seconds())
	h.rdzvRound.Set(float64(round))
}

// WorkersStarted records that a new worker group of n workers started: n
// running, and the previous group's succeeded, failed and stopped counts
// cleared. Call it once per group, after the workers were spawned.
func (h *Health) WorkersStarted(n int) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.counts)
	h.counts[workersRunning] = max(n, 0)
	h.publishWorkers()
}

// WorkerExited records that one worker of the current group ended: ok for
// success (exit code 0); otherwise reason says why (ReasonExitCode,
// ReasonSignal, or ReasonStopped for a worker the agent stopped itself,
// which is not counted as a failure).
func (h *Health) WorkerExited(ok bool, reason string) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.counts[workersRunning] > 0 {
		h.counts[workersRunning]--
	}
	switch {
	case ok:
		h.counts[workersSucceeded]++
	case reason == ReasonStopped:
		h.counts[workersStopped]++
	default:
		h.counts[workersFailed]++
		if reason == "" {
			reason = "unknown"
		}
		h.failures.WithLabelValues(reason).Inc()
	}
	h.publishWorkers()
}

// publishWorkers copies the counts into the gauge; h.mu is held.
func (h *Health) publishWorkers() {
	for _, s := range []string{workersRunning, workersSucceeded, workersFailed, workersStopped} {
		h.workers.WithLabelValues(s).Set(float64(h.counts[s]))
	}
}

// Kinds of failure reports, the values of gorun_failures_reported_total's
// kind label.
const (
	ReportWorker = "worker"
	ReportNode   = "node"
)

// FailureReported counts failures reported to the survivors' agreement.
func (h *Health) FailureReported(kind string, n int) {
	if h == nil {
		return
	}
	h.reported.WithLabelValues(kind).Add(float64(n))
}

// EpochAdopted counts a shrink epoch; since, when not zero, is when this
// agent reported the first failure the epoch settles.
func (h *Health) EpochAdopted(e shrink.Epoch, since time.Time) {
	if h == nil {
		return
	}
	h.epochs.WithLabelValues(string(e.Action)).Inc()
	h.world.Set(float64(e.WorldSize))
	if !since.IsZero() {
		h.epochWait.Observe(time.Since(since).Seconds())
	}
}

// WorldSize records the job's world size as a round launches it.
func (h *Health) WorldSize(n int) {
	if h == nil {
		return
	}
	h.world.Set(float64(n))
}

// Respawned counts a lost local rank started again to be grown back in
// (started true), or refused because the job's budget was spent.
func (h *Health) Respawned(started bool) {
	if h == nil {
		return
	}
	outcome := "refused"
	if started {
		outcome = "started"
	}
	h.respawns.WithLabelValues(outcome).Inc()
}

// RecordRefused counts a record of kind (epoch, notice, gossip, rendezvous) that
// failed its check under the job secret and was ignored.
func (h *Health) RecordRefused(kind string) {
	if h == nil {
		return
	}
	h.refused.WithLabelValues(kind).Inc()
}

// GrowComplete records that a grow decided at decided completed at done.
func (h *Health) GrowComplete(decided, done time.Time) {
	if h == nil {
		return
	}
	h.growTime.Observe(done.Sub(decided).Seconds())
}

// Restarted counts one restart of the worker group after a failure.
func (h *Health) Restarted() {
	if h == nil {
		return
	}
	h.restarts.Inc()
}

// Serve listens on addr ("host:port"; ":8080" is every interface, port 0
// picks a free one) and serves /healthz, /readyz and /metrics in the
// background until Close. It returns the address it listens on. A Health
// serves on one address at a time; after Close it may Serve again.
func (h *Health) Serve(addr string, log *zap.Logger) (net.Addr, error) {
	if h == nil {
		return nil, errors.New("health endpoint: nil Health")
	}
	if log == nil {
		log = zap.NewNop()
	}
	log = log.Named("health")
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.srv != nil {
		return nil, errors.New("health endpoint: already serving")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("health endpoint on %s: %w", addr, err)
	}
	errLog, _ := zap.NewStdLogAt(log, zap.WarnLevel) // only fails for a bad level
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", h.serveHealthz)
	mux.HandleFunc("GET /readyz", h.serveReadyz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(h.reg, promhttp.HandlerOpts{ErrorLog: errLog}))
	srv := &http.Server{
		Handler: mux,
		// Probes and scrapes are small; these keep a stuck or hostile
		// client from holding a connection open for ever.
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          errLog,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("health endpoint stopped", zap.Error(err))
		}
	}()
	h.srv, h.done = srv, done
	log.Info("serving /healthz, /readyz and /metrics", zap.Stringer("addr", ln.Addr()))
	return ln.Addr(), nil
}

// closeGrace is how long Close lets requests in flight finish before it
// cuts their connections.
const closeGrace = time.Second

// Close stops serving: the port is free and the server's goroutines have
// ended when it returns. Requests in flight get a moment to finish. Close
// without Serve, or twice, does nothing.
func (h *Health) Close() error {
	if h == nil {
		return nil
	}
	h.mu.Lock()
	srv, done := h.srv, h.done
	h.srv, h.done = nil, nil
	h.mu.Unlock()
	if srv == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeGrace)
	defer cancel()
	err := srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = srv.Close() // a slow client: cut it off
	}
	<-done
	return err
}

func (h *Health) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	if p := h.Phase(); p == PhaseFailed {
		reply(w, http.StatusServiceUnavailable, p.String())
		return
	}
	reply(w, http.StatusOK, "ok")
}

func (h *Health) serveReadyz(w http.ResponseWriter, _ *http.Request) {
	if p := h.Phase(); p != PhaseRunning {
		reply(w, http.StatusServiceUnavailable, p.String())
		return
	}
	reply(w, http.StatusOK, "ok")
}

// reply writes a one-line plain-text answer that nothing caches.
func reply(w http.ResponseWriter, code int, body string) {
	hd := w.Header()
	hd.Set("Content-Type", "text/plain; charset=utf-8")
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	fmt.Fprintln(w, body)
}
