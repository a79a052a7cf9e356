package launcher

// This file holds the typed configuration, its defaults and its
// validation; Validate checks a Config before anything starts.

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/shrink"
)

// ErrInvalidConfig is matched (errors.Is) by every error from the parsers
// in this file and from Config.Validate: the user asked for something
// impossible, so the CLI exits with its usage code.
var ErrInvalidConfig = errors.New("invalid launcher configuration")

// configError is a bad value. Its text names the culprit and does not
// repeat ErrInvalidConfig's, so the message a user reads is one short
// clause; it still matches ErrInvalidConfig and whatever error it wraps.
type configError struct{ err error }

func (e *configError) Error() string   { return e.err.Error() }
func (e *configError) Unwrap() []error { return []error{ErrInvalidConfig, e.err} }

// invalidf builds a configError; %w in format wraps as fmt.Errorf does.
func invalidf(format string, args ...any) error {
	return &configError{err: fmt.Errorf(format, args...)}
}

// ErrLocalResource is matched by errors of this machine's resources, not
// of the job or its settings: a port in use (the rendezvous store's of a
// static node rank 0, the worker store's, --health-addr's), the log
// directory, starting a worker (fork, a pids limit). The CLI gives them
// their own exit code.
var ErrLocalResource = errors.New("a local resource failed")

// localError is a failed local resource; like configError its text is
// only the clause that names it.
type localError struct{ err error }

func (e *localError) Error() string   { return e.err.Error() }
func (e *localError) Unwrap() []error { return []error{ErrLocalResource, e.err} }

// localf builds a localError; %w in format wraps as fmt.Errorf does.
func localf(format string, args ...any) error {
	return &localError{err: fmt.Errorf(format, args...)}
}

// Std selects which of a worker's streams a rule applies to (torchrun's Std:
// 0 none, 1 stdout, 2 stderr, 3 both). It is a bit set: StdAll is
// StdOut|StdErr.
type Std uint8

const (
	StdNone Std = 0 // the console only
	StdOut  Std = 1 // stdout
	StdErr  Std = 2 // stderr
	StdAll  Std = 3 // both
)

// StdSpec is a --redirects or --tee value: one Std for every local rank
// ("3"), or per local rank ("0:1,1:2"; ranks not named get StdNone, as in
// torchrun's to_map).
type StdSpec struct {
	// Default applies to every local rank when PerRank is nil.
	Default Std
	// PerRank, when non-nil, decides every rank on its own.
	PerRank map[int]Std
}

// For returns the streams the spec selects for one local rank.
func (s StdSpec) For(localRank int) Std {
	if s.PerRank != nil {
		return s.PerRank[localRank] // absent: StdNone
	}
	return s.Default
}

// ParseStd reads a --redirects or --tee value: "" (none), a digit 0–3 for
// every rank, or LOCAL_RANK:STD pairs separated by commas.
//
// torchrun's pattern allows only one-digit local ranks in a mapping; gorun
// takes any non-negative rank, since nodes with more than ten workers
// exist. A rank named twice takes its last value, as torchrun's dict does.
func ParseStd(s string) (StdSpec, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return StdSpec{}, nil
	}
	if !strings.Contains(s, ":") {
		v, err := parseStdValue(s)
		if err != nil {
			return StdSpec{}, invalidf("%w", err)
		}
		return StdSpec{Default: v}, nil
	}
	spec := StdSpec{PerRank: map[int]Std{}}
	for _, part := range strings.Split(s, ",") {
		rank, val, ok := strings.Cut(strings.TrimSpace(part), ":")
		if !ok {
			return StdSpec{}, invalidf("%q: %q is not LOCAL_RANK:STD (e.g. 0:1,1:2)", s, part)
		}
		r, err := strconv.Atoi(strings.TrimSpace(rank))
		if err != nil || r < 0 {
			return StdSpec{}, invalidf("%q: local rank %q in %q is not a non-negative integer", s, rank, part)
		}
		v, err := parseStdValue(val)
		if err != nil {
			return StdSpec{}, invalidf("%q: %w", s, err)
		}
		spec.PerRank[r] = v
	}
	return spec, nil
}

func parseStdValue(s string) (Std, error) {
	s = strings.TrimSpace(s)
	if len(s) == 1 && s[0] >= '0' && s[0] <= '3' {
		return Std(s[0] - '0'), nil
	}
	return 0, fmt.Errorf("%q is not a stream selector (0 none, 1 stdout, 2 stderr, 3 both)", s)
}

// Entrypoint is what each worker runs.
type Entrypoint struct {
	// Program is the script, module or executable; Args follow it.
	Program string
	Args    []string
	// NoPython execs Program directly (torchrun's --no-python).
	NoPython bool
	// Module runs `python -m Program` (torchrun's -m).
	Module bool
	// RunPath is torchrun's --run-path. torchrun calls runpy.run_path in a
	// worker started through multiprocessing; gorun has no interpreter of
	// its own, so it runs `python -u Program`, which runpy.run_path
	// imitates. Like torchrun, it wins over NoPython and Module.
	RunPath bool
	// Python is the interpreter for everything but NoPython. torchrun uses
	// $PYTHON_EXEC, else the Python running torchrun; gorun uses
	// $PYTHON_EXEC (the CLI reads it), else "python3" from PATH. Empty
	// means "python3".
	Python string
}

// Argv returns the worker's full command line, built as torchrun's
// config_from_args does (PyTorch 1.13 to today):
//
//	script:       [python, -u, Program, Args…]
//	-m:           [python, -u, -m, Program, Args…]
//	--run-path:   [python, -u, Program, Args…]
//	--no-python:  [Program, Args…]
//
// -u keeps Python's stdout unbuffered, so tee'd and prefixed console lines
// appear as the worker prints them. torchrun never passes --local-rank
// (use_env is always on); workers read LOCAL_RANK from the environment.
func (e Entrypoint) Argv() []string {
	var argv []string
	switch {
	case e.NoPython && !e.RunPath:
		argv = []string{e.Program}
	case e.Module && !e.RunPath:
		argv = []string{e.python(), "-u", "-m", e.Program}
	default:
		argv = []string{e.python(), "-u", e.Program}
	}
	return append(argv, e.Args...)
}

func (e Entrypoint) python() string {
	if e.Python == "" {
		return defaultPython
	}
	return e.Python
}

// Rendezvous backend names, as torchrun's registry spells them. gorun runs
// both etcd names the same way: its dynamic rendezvous over etcd's v3 API
// (torchrun's "etcd" is its legacy EtcdRendezvousHandler, its "etcd-v2"
// the dynamic rendezvous over etcd's v2 API).
const (
	backendStatic = "static"
	backendC10d   = "c10d"
	backendEtcd   = "etcd"
	backendEtcdV2 = "etcd-v2"
)

// ErrEtcdNotLinked: the etcd backends are not in this build (see
// EtcdBackendLinked).
var ErrEtcdNotLinked = errors.New("this gorun is built without the etcd backends (tag gorun_noetcd)")

// IsEtcdBackend reports whether --rdzv-backend name is one of the etcd
// backends.
func IsEtcdBackend(name string) bool { return name == backendEtcd || name == backendEtcdV2 }

// defaultC10dPort is the port of a c10d endpoint given without one
// (torchrun's); etcd's is etcd.DefaultPort, 2379.
const defaultC10dPort = 29400

// RendezvousConfig is how agents find each other (torchrun's --rdzv-*
// flags and the static, caffe2-era --master-* and --node-rank).
type RendezvousConfig struct {
	// Backend is "static" (default), "c10d", "etcd" or "etcd-v2".
	Backend string
	// Endpoint is host[:port] (the c10d default port is 29400), a file
	// path for c10d with store_type=file, or for etcd a comma-separated
	// list of members, host[:port] (default port 2379) or
	// http(s)://host[:port]. For static, an empty Endpoint means
	// MasterAddr:MasterPort, as in torchrun.
	Endpoint string
	// RunID is the job id every node shares; default "none".
	RunID string
	// Conf is --rdzv-conf (torchrun's keys; rendezvousSettings says which
	// gorun reads). Keys gorun does not know are kept: torchrun passes them
	// through too.
	Conf map[string]string
	// Standalone is torchrun's --standalone: the agent hosts a c10d store
	// on localhost at a free port with a random run id, and Backend,
	// Endpoint and RunID are ignored.
	Standalone bool
	// MasterAddr and MasterPort locate node rank 0's store for the static
	// backend when Endpoint is empty; defaults 127.0.0.1 and 29500.
	MasterAddr string
	MasterPort int
	// NodeRank is this node's rank for the static backend (default 0);
	// other backends assign ranks themselves.
	NodeRank int
	// LocalAddr is the address this node advertises (--local-addr); empty
	// means look it up (torchrun uses the FQDN).
	LocalAddr string
}

// ParseRdzvConf reads --rdzv-conf: "k=v,k2=v2". Like torchrun's
// _parse_rendezvous_config it trims spaces around keys and values, splits
// each pair at its first '=' (values may hold ':' and '='), lets a repeated
// key take its last value, and rejects a pair without a key or a value.
// An empty string gives an empty map.
func ParseRdzvConf(s string) (map[string]string, error) {
	conf := map[string]string{}
	if strings.TrimSpace(s) == "" {
		return conf, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(kv, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if k == "" {
			return nil, invalidf("%q: %q has no key; want KEY=VALUE,…", s, kv)
		}
		if v == "" {
			return nil, invalidf("%q: option %q has no value; want %s=VALUE", s, k, k)
		}
		conf[k] = v
	}
	return conf, nil
}

// Config is everything one agent needs. The zero value is not useful: start
// from DefaultConfig, whose values are torchrun's defaults.
type Config struct {
	Entrypoint Entrypoint
	// MinNodes and MaxNodes are --nnodes N (N:N) or MIN:MAX; default 1:1.
	// The job is elastic when they differ.
	MinNodes, MaxNodes int
	// NProcPerNode is the number of workers on this node, already resolved
	// from auto/cpu/gpu (ResolveNProc); default 1. Nodes may differ.
	NProcPerNode int
	// Role names the workers (ROLE_NAME, log prefixes); default "default".
	Role       string
	Rendezvous RendezvousConfig
	// MaxRestarts is how many times the worker group may be restarted after
	// a failure before the job fails; default 0. Membership changes do not
	// count.
	MaxRestarts int
	// MonitorInterval is torchrun's polling period (default 100ms). gorun
	// sees worker exits at once (its reaper gets SIGCHLD), so it uses this
	// only as the period of its health polls, not to notice exits.
	MonitorInterval time.Duration
	// StartMethod ("spawn", "fork" or "forkserver"; default "spawn") is
	// accepted for compatibility. torchrun uses it only for Python function
	// entrypoints; gorun always starts programs, so it has no effect.
	StartMethod string
	// LogDir is the base directory for worker logs; "" makes the agent
	// create a temporary one named like torchrun's (torchelastic_*).
	LogDir string
	// Redirects sends the selected streams to files only; Tee to files and
	// the console. Default: nothing for every rank.
	Redirects, Tee StdSpec
	// LocalRanksFilter lists the local ranks whose output reaches the
	// console (files are unaffected); nil means all.
	LocalRanksFilter []int
	// LogLinePrefixTemplate is the prefix of each worker line on the
	// console, torchrun 2.14's --log-line-prefix-template: ${role_name},
	// ${local_rank}, ${rank} and ${hostname} are replaced (Python's
	// string.Template, safe_substitute: $$ is $, an unknown name stays).
	// Empty means "[${role_name}${local_rank}]:".
	LogLinePrefixTemplate string
	// DuplicateStdoutFilters and DuplicateStderrFilters copy the lines of
	// tee'd streams that contain any of them, prefixed, to
	// filtered_stdout.log and filtered_stderr.log in the attempt's log
	// directory (torchrun 2.14's --duplicate-std*-filters). Empty: none.
	DuplicateStdoutFilters, DuplicateStderrFilters []string
	// VirtualLocalRank gives every worker LOCAL_RANK=0 and, as
	// CUDA_VISIBLE_DEVICES, the one GPU of its local rank (the agent's
	// CUDA_VISIBLE_DEVICES entry at that index, else the index itself):
	// each worker sees its GPU as device 0 (torchrun 2.14's
	// --virtual-local-rank).
	VirtualLocalRank bool
	// NUMABinding binds each worker's CPUs near its GPU, torchrun 2.14's
	// --numa-binding: "node", "socket", "exclusive" or "core-complex"
	// (package internal/numa says what each gives); "" (the default)
	// leaves workers unbound. Worker i is placed by GPU i. Only the CPU
	// affinity is set, no memory policy, as in torchrun: the kernel's
	// default policy then allocates on the node the worker runs on. A
	// binding this machine cannot honour fails the start of the workers
	// with ErrLocalResource.
	NUMABinding string
	// SignalsToHandle are the signals the agent catches and forwards to the
	// worker groups; default SIGTERM, SIGINT, SIGHUP, SIGQUIT.
	SignalsToHandle []syscall.Signal
	// ShutdownTimeout is how long stopped workers get between the signal
	// and SIGKILL; default 30s (torchrun's --shutdown-timeout, or
	// TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the CLI reads). 0 kills at once.
	ShutdownTimeout time.Duration
	// ExitBarrierTimeout bounds the wait for the other agents after this
	// node's workers succeed, so that an early finisher is not taken for a
	// lost node; default 300s.
	ExitBarrierTimeout time.Duration
	// Init makes the agent do a PID 1's duties (become a subreaper and reap
	// orphaned descendants) even when it is not PID 1, and fail if it
	// cannot; gorun's --init. ContainDescendants, on by default, does the
	// same but only warns when the agent cannot become a subreaper.
	Init bool
	// ContainDescendants makes the agent a child subreaper that kills what
	// its workers leave behind — their descendants re-parented to it, a
	// daemon that called setsid among them — whenever a worker group ends
	// and before the agent exits. Default true. The agent then takes every
	// child of its process that it did not start for such a leftover: a
	// program that runs the launcher in-process next to children of its
	// own turns it off.
	ContainDescendants bool
	// Cgroup is where the agent gives each worker a cgroup v2 of its own,
	// which holds the worker and all it starts, so that they end together
	// (cgroup.kill) however the worker ends — a setsid daemon included,
	// in shrink mode at once — and an OOM kill is told from another
	// SIGKILL. CgroupAuto (the default): under the agent's own cgroup v2
	// where it may write one and the kernel has cgroup.kill (5.14), else
	// none, said once in the log. CgroupOff: none. Anything else is a
	// cgroup v2 directory to make them under; failing that is an
	// ErrLocalResource. gorun's --cgroup.
	Cgroup string
	// CgroupGuard is the program started beside the agent, where there is
	// no /bin/sh, to empty the workers' cgroups if the agent dies
	// (SIGKILL): any program that links launcher/cgroup, such as gorun's
	// own binary, which the CLI names. Where /bin/sh exists the guard is a
	// shell script and this is not used. "" (the default) with no shell:
	// no guard (logged), and the cgroups of a SIGKILLed agent outlive it
	// with what is in them.
	CgroupGuard string
	// HealthAddr is where the agent serves /healthz, /readyz and /metrics
	// (see Health): "HOST:PORT", with an empty host for every interface
	// (":8080") and port 0 for a free one. "" (the default) serves no
	// endpoint. gorun's --health-addr; the CLI falls back to torchrun's
	// TORCHELASTIC_HEALTH_CHECK_PORT as ":PORT".
	HealthAddr string

	// OnFailure is what the job does when a rank fails: OnFailureRestart
	// (default, torchrun's way: stop every worker, re-rendezvous, restart
	// them all) or OnFailureShrink (the survivors shrink their groups to
	// the living and carry on; dead ranks are not restarted). gorun's
	// --on-failure.
	OnFailure string
	// MinWorldSize is the floor of shrink mode: a failure that would leave
	// fewer ranks falls back to a restart. Default 1. --min-world-size.
	MinWorldSize int
	// SettleWindow is how long shrink mode's coordinator gathers failure
	// reports before deciding, so that failures seen together (a host's
	// ranks) become one epoch. Default 100 ms (shrink.DefaultSettleWindow).
	// --settle-window.
	SettleWindow time.Duration
	// AgreementTimeout is how long a failure (or a grow not complete) may
	// wait for the survivors' agreement (an epoch on the board) before
	// shrink mode gives up and restarts the group; and how long a node
	// admitted late waits to read the agreement before it leaves the
	// round to be admitted again. Default 10 s
	// (shrink.DefaultAgreementTimeout).
	AgreementTimeout time.Duration
	// Regrow is heal, shrink mode's second half: a local rank an epoch
	// excluded after it died is started again (after RespawnBackoff) as a
	// newcomer (GORUN_SHRINK_NEWCOMER) and grown back into the running
	// group by a grow epoch; the survivors are never restarted. Default
	// true; it matters only under OnFailureShrink. --regrow on|off.
	Regrow bool
	// MaxRespawns is the job's budget of respawns (Regrow), counted across
	// every node in the worker store: once it is spent, a lost slot stays
	// out and the job runs on smaller. A slot that keeps failing spends it.
	// Default 3. --max-respawns.
	MaxRespawns int
	// RespawnBackoff is how long a lost slot waits before it is respawned;
	// it doubles with each respawn of the same slot, up to 30 s. Default
	// 1 s. --respawn-backoff.
	RespawnBackoff time.Duration
	// RespawnStandbys is how many workers heal keeps pre-started on this
	// node, parked beside the round's (as --spare-prestart parks them):
	// their start-up (interpreter, imports, a checkpoint read into host
	// memory) is over when a local rank is lost, and its respawn takes a
	// standby instead of starting cold; a new standby starts in its
	// place. The standby learns its slot (LOCAL_RANK and the round's
	// variables, GORUN_SHRINK_NEWCOMER among them) on its assignment
	// pipe, so it cannot pick its GPU before then. Its output is held
	// until it takes a slot, then goes where the slot's does. A standby
	// that exits while parked is not replaced until the next grow
	// completes.
	// Default 0: none. Shrink mode with Regrow only; not with
	// NUMABinding (a standby's CPUs depend on the slot it takes).
	// --respawn-standbys.
	RespawnStandbys int
	// GrowTimeout is how long the ranks of a grow epoch have to form the
	// grown group before the agents give it up: a newcomer that does not
	// come is excluded again and the survivors go on. Default 30 s
	// (shrink.DefaultGrowTimeout). --grow-timeout.
	GrowTimeout time.Duration
	// JobSecret is the secret every agent of the job holds (a Kubernetes
	// Secret mounted as a file, a Slurm job's environment): node liveness
	// gossip is encrypted and authenticated with a key derived from it,
	// and workers get it as GORUN_JOB_SECRET to check what they read from
	// the store. --standalone makes one when none is given. nil: none, and
	// a multi-node job says at start that nothing is authenticated.
	// --job-secret-file, GORUN_JOB_SECRET.
	JobSecret Secret
	// SparePrestart starts the local workers while the agent waits for
	// its first rendezvous round — a hot spare standing by, or any agent
	// whose job has not formed yet — so that their start-up (interpreter,
	// imports, device set-up) is over when the round needs them. They are
	// parked: the round's part of their environment (RANK, WORLD_SIZE,
	// MASTER_ADDR, GORUN_SHRINK_NEWCOMER, …) reaches them on an inherited
	// pipe once the agent has it, which the worker must read (package
	// prestart, gorun_ft.await_assignment). A parked worker that exits
	// ends the agent's wait with its failure. Default false.
	// --spare-prestart.
	SparePrestart bool
	// HeartbeatTimeout turns on hang detection: a worker that has sent a
	// heartbeat to GORUN_HEARTBEAT and then sends none for this long (hung,
	// deadlocked, SIGSTOPped) is killed and counts as failed. 0 (default)
	// leaves heartbeats off. --heartbeat-timeout.
	HeartbeatTimeout time.Duration
	// DoneTimeout bounds the teardown of a worker that said it was done
	// (a "done" heartbeat: gorun_ft's close(), Go's health.Done): one
	// that has not exited this long after is killed, and counts as a
	// success, its work being over. A teardown that hangs (a stopped
	// process, a library's shutdown deadlocked) would otherwise hold the
	// agent and the job for ever. Needs HeartbeatTimeout (the done beat
	// comes on the heartbeat socket). 0 (default) leaves it unbounded, as
	// a final checkpoint saved after close() may take any time.
	// --done-timeout.
	DoneTimeout time.Duration
	// NodeLiveness tunes the gossip among agents that finds a lost node in
	// a multi-node job, and says when it runs.
	NodeLiveness NodeLivenessConfig

	// gossip is this agent's gossip identity, set by the agent before the
	// rendezvous for the membership to publish.
	gossip gossipPeer
	// refused counts a record that failed its check under the job secret
	// (kind "rendezvous"), set by the agent before the rendezvous
	// for the membership's sealed store (nil: not counted).
	refused func(kind string)
	// rdzv are the rendezvous settings, parsed by Validate.
	rdzv rendezvousSettings
}

// NodeLivenessConfig tunes node liveness (package health, on memberlist).
// DefaultConfig takes health.DefaultNodeConfig's values (zero values mean
// the same): a probe every 100 ms and a
// suspicion of 4 probe intervals (scaled by log10 of the node count), which
// declares a silent node of 2–4 dead in about 0.6 s. A larger multiplier
// tolerates longer CPU starvation of an agent before a false verdict, at
// the cost of slower detection.
type NodeLivenessConfig struct {
	// Mode says when it runs (--node-liveness): NodeLivenessAuto (the
	// default; "" means the same) in multi-node shrink mode only,
	// NodeLivenessOn in every multi-node job, NodeLivenessOff never.
	// Restart mode keeps torchrun's keep-alive by default: a false verdict
	// there restarts the whole job, and agents starved of CPU (many on one
	// machine, as in benchmarks) are exactly what gossip mistakes for dead.
	Mode string
	// ProbeInterval is how often each agent probes a random other one
	// (--node-probe-interval); the probe timeout is half of it.
	ProbeInterval time.Duration
	// SuspicionMult is how many probe intervals a suspected agent has to
	// refute before it is declared dead (--node-suspicion-mult).
	SuspicionMult int
}

// The --node-liveness modes.
const (
	NodeLivenessAuto = "auto"
	NodeLivenessOn   = "on"
	NodeLivenessOff  = "off"
)

// runs reports whether node liveness runs for a job of maxNodes nodes
// under failure policy onFailure.
func (c NodeLivenessConfig) runs(maxNodes int, onFailure string) bool {
	switch {
	case maxNodes < 2, c.Mode == NodeLivenessOff:
		return false
	case c.Mode == NodeLivenessOn:
		return true
	}
	return onFailure == OnFailureShrink
}

// The --on-failure policies.
const (
	OnFailureRestart = "restart"
	OnFailureShrink  = "shrink"
)

// Defaults of heal (Config.Regrow), gorun's own.
const (
	DefaultMaxRespawns    = 3
	DefaultRespawnBackoff = time.Second
	// maxRespawnBackoff caps RespawnBackoff's doubling.
	maxRespawnBackoff = 30 * time.Second
)

// Defaults, torchrun's unless said otherwise.
const (
	defaultPython             = "python3" // gorun's: torchrun uses its own sys.executable
	defaultRunID              = "none"
	defaultRole               = "default"
	defaultMasterAddr         = "127.0.0.1"
	defaultMasterPort         = 29500
	defaultMonitorInterval    = 100 * time.Millisecond
	defaultStartMethod        = "spawn"
	defaultShutdownTimeout    = 30 * time.Second
	defaultExitBarrierTimeout = 300 * time.Second
)

// DefaultConfig returns torchrun's defaults: one node, one worker, static
// rendezvous at 127.0.0.1:29500 with run id "none", no restarts; and
// gorun's own (restart on failure, ContainDescendants on, the agreement's
// and node liveness's timings). It reads no environment; the CLI applies
// PET_*, PYTHON_EXEC and TORCH_ELASTIC_SHUTDOWN_TIMEOUT on top of it.
func DefaultConfig() Config {
	return Config{
		Entrypoint:   Entrypoint{Python: defaultPython},
		MinNodes:     1,
		MaxNodes:     1,
		NProcPerNode: 1,
		Role:         defaultRole,
		Rendezvous: RendezvousConfig{
			Backend:    backendStatic,
			RunID:      defaultRunID,
			Conf:       map[string]string{},
			MasterAddr: defaultMasterAddr,
			MasterPort: defaultMasterPort,
		},
		MonitorInterval:    defaultMonitorInterval,
		StartMethod:        defaultStartMethod,
		SignalsToHandle:    []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT},
		ShutdownTimeout:    defaultShutdownTimeout,
		ExitBarrierTimeout: defaultExitBarrierTimeout,
		OnFailure:          OnFailureRestart,
		MinWorldSize:       shrink.DefaultMinWorldSize,
		SettleWindow:       shrink.DefaultSettleWindow,
		AgreementTimeout:   shrink.DefaultAgreementTimeout,
		Regrow:             true,
		MaxRespawns:        DefaultMaxRespawns,
		RespawnBackoff:     DefaultRespawnBackoff,
		GrowTimeout:        shrink.DefaultGrowTimeout,
		NodeLiveness:       defaultNodeLiveness(),
		ContainDescendants: true,
		Cgroup:             CgroupAuto,
	}
}

// defaultNodeLiveness is health.DefaultNodeConfig's probe interval and
// suspicion multiplier.
func defaultNodeLiveness() NodeLivenessConfig {
	d := health.DefaultNodeConfig()
	return NodeLivenessConfig{Mode: NodeLivenessAuto, ProbeInterval: d.ProbeInterval, SuspicionMult: d.SuspicionMult}
}

// ParseNNodes reads --nnodes: "N" means N:N, "MIN:MAX" an elastic range,
// with 1 <= MIN <= MAX (torchrun asserts the same).
func ParseNNodes(s string) (min, max int, err error) {
	lo, hi, ranged := strings.Cut(strings.TrimSpace(s), ":")
	if !ranged {
		hi = lo
	}
	if min, err = strconv.Atoi(strings.TrimSpace(lo)); err != nil {
		return 0, 0, invalidf("%q is not N or MIN:MAX (%q is not an integer)", s, lo)
	}
	if max, err = strconv.Atoi(strings.TrimSpace(hi)); err != nil {
		return 0, 0, invalidf("%q is not N or MIN:MAX (%q is not an integer)", s, hi)
	}
	switch {
	case min < 1:
		return 0, 0, invalidf("%q: a job needs at least 1 node", s)
	case max < min:
		return 0, 0, invalidf("%q: the maximum %d is below the minimum %d", s, max, min)
	}
	return min, max, nil
}

// startMethods are the values torchrun's --start-method accepts.
var startMethods = []string{"spawn", "fork", "forkserver"}

// Validate checks the whole configuration and returns the first problem,
// naming the torchrun flag a user would fix. The error matches
// ErrInvalidConfig.
//
// It also parses the rendezvous settings (--rdzv-endpoint, --rdzv-conf)
// into the typed form the agent runs with, once: nothing reads
// Rendezvous.Conf again.
func (c *Config) Validate() error {
	for _, check := range []func() error{
		c.Entrypoint.validate,
		c.validateSizes,
		func() (err error) {
			c.rdzv, err = c.Rendezvous.settings(c.MinNodes, c.MaxNodes)
			return err
		},
		c.validateSupervision,
		c.validateLogs,
		c.validateHealth,
		c.validateFaultTolerance,
		c.validateNUMA,
	} {
		if err := check(); err != nil {
			return err
		}
	}
	return nil
}

func (e Entrypoint) validate() error {
	switch {
	case e.Program == "":
		return invalidf("no program to run")
	case e.NoPython && e.Module && !e.RunPath:
		return invalidf("--no-python and --module (-m) exclude each other")
	}
	return nil
}

func (c Config) validateSizes() error {
	switch {
	case c.MinNodes < 1:
		return invalidf("--nnodes %d:%d: a job needs at least 1 node", c.MinNodes, c.MaxNodes)
	case c.MaxNodes < c.MinNodes:
		return invalidf("--nnodes %d:%d: the maximum is below the minimum", c.MinNodes, c.MaxNodes)
	case c.NProcPerNode < 1:
		return invalidf("--nproc-per-node %d: a node needs at least 1 worker", c.NProcPerNode)
	case c.Role == "":
		return invalidf("--role is empty; workers need a role name (default %q)", defaultRole)
	}
	return nil
}

func (r RendezvousConfig) validateStatic(minNodes, maxNodes int) error {
	switch {
	case minNodes != maxNodes:
		return invalidf("--nnodes %d:%d: static rendezvous is not elastic; give one node count or use --rdzv-backend c10d", minNodes, maxNodes)
	case r.NodeRank < 0 || r.NodeRank >= maxNodes:
		return invalidf("--node-rank %d is outside [0, %d) for --nnodes %d", r.NodeRank, maxNodes, maxNodes)
	case r.Endpoint != "":
		// torchrun: "Port is missing in endpoint … Try specifying --master-port".
		_, port, err := splitEndpoint(r.Endpoint, -1)
		if err != nil {
			return invalidf("--rdzv-endpoint: %w", err)
		}
		if port < 0 {
			return invalidf("--rdzv-endpoint %q: static rendezvous needs HOST:PORT", r.Endpoint)
		}
		return nil
	case r.MasterAddr == "":
		return invalidf("--master-addr is empty; static rendezvous needs node rank 0's address")
	case !validAddr(r.MasterAddr):
		return invalidf("--master-addr %q is not a host name or IP address", r.MasterAddr)
	case r.MasterPort < 0 || r.MasterPort > 65535:
		return invalidf("--master-port %d is not a TCP port (0–65535)", r.MasterPort)
	case r.MasterPort == 0 && maxNodes > 1:
		return invalidf("--master-port 0 picks a random port, which the other %d nodes cannot know", maxNodes-1)
	}
	return nil
}

func (c Config) validateSupervision() error {
	switch {
	case c.MaxRestarts < 0:
		return invalidf("--max-restarts %d: want 0 or more", c.MaxRestarts)
	case c.MonitorInterval <= 0:
		return invalidf("--monitor-interval %v: want a positive interval", c.MonitorInterval)
	case !slices.Contains(startMethods, c.StartMethod):
		return invalidf("--start-method %q: want one of %s", c.StartMethod, strings.Join(startMethods, ", "))
	case c.ShutdownTimeout < 0:
		return invalidf("--shutdown-timeout %v: want 0 or more", c.ShutdownTimeout)
	case c.ExitBarrierTimeout <= 0:
		return invalidf("--exit-barrier-timeout %v: want a positive timeout", c.ExitBarrierTimeout)
	case c.Cgroup != "" && c.Cgroup != CgroupAuto && c.Cgroup != CgroupOff && !filepath.IsAbs(c.Cgroup):
		return invalidf("--cgroup %q: want %s, %s or the absolute path of a cgroup v2 directory", c.Cgroup, CgroupAuto, CgroupOff)
	}
	for _, sig := range c.SignalsToHandle {
		if sig < 1 || sig > maxSignal {
			return invalidf("--signals-to-handle: %d is not a signal number (1–%d)", int(sig), maxSignal)
		}
		if why, bad := unhandleable[sig]; bad {
			return invalidf("--signals-to-handle: %s %s", signalString(sig), why)
		}
	}
	return nil
}

func (c Config) validateLogs() error {
	for _, f := range []struct {
		flag string
		spec StdSpec
	}{{"--redirects", c.Redirects}, {"--tee", c.Tee}} {
		if f.spec.Default > StdAll {
			return invalidf("%s: %d is not a stream selector (0–3)", f.flag, f.spec.Default)
		}
		for rank, v := range f.spec.PerRank {
			if rank < 0 || v > StdAll {
				return invalidf("%s: %d:%d is not LOCAL_RANK:STD with STD in 0–3", f.flag, rank, v)
			}
		}
	}
	for _, r := range c.LocalRanksFilter {
		if r < 0 {
			return invalidf("--local-ranks-filter: %d is not a local rank", r)
		}
	}
	return nil
}

// validateHealth checks HealthAddr: empty, or HOST:PORT with a numeric
// port (a service name such as "http" is refused: probes need the number)
// and a host that is empty, a host name or an IP address ("[::1]:8080").
func (c Config) validateHealth() error {
	if c.HealthAddr == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(c.HealthAddr)
	if err != nil {
		return invalidf("--health-addr %q is not HOST:PORT (e.g. :8080 or 127.0.0.1:8080)", c.HealthAddr)
	}
	if n, err := strconv.Atoi(port); err != nil || !isDigits(port) || len(port) > 5 || n > 65535 {
		return invalidf("--health-addr %q: port %q is not a TCP port (0–65535)", c.HealthAddr, port)
	}
	if host != "" && !validHost(host) {
		return invalidf("--health-addr %q: %q is not a host name or IP address", c.HealthAddr, host)
	}
	return nil
}

func (c Config) validateFaultTolerance() error {
	switch {
	case c.OnFailure != OnFailureRestart && c.OnFailure != OnFailureShrink:
		return invalidf("--on-failure %q: want %s or %s", c.OnFailure, OnFailureRestart, OnFailureShrink)
	case c.MinWorldSize < 1:
		return invalidf("--min-world-size %d: want 1 or more", c.MinWorldSize)
	case c.SettleWindow < 0:
		return invalidf("--settle-window %v: want 0 or more", c.SettleWindow)
	case c.AgreementTimeout <= 0:
		return invalidf("agreement timeout %v: want a positive timeout", c.AgreementTimeout)
	case c.MaxRespawns < 0:
		return invalidf("--max-respawns %d: want 0 or more", c.MaxRespawns)
	case c.RespawnBackoff < 0:
		return invalidf("--respawn-backoff %v: want 0 or more", c.RespawnBackoff)
	case c.GrowTimeout <= 0:
		return invalidf("--grow-timeout %v: want a positive timeout", c.GrowTimeout)
	case c.RespawnStandbys < 0:
		return invalidf("--respawn-standbys %d: want 0 or more", c.RespawnStandbys)
	case c.RespawnStandbys > 0 && (c.OnFailure != OnFailureShrink || !c.Regrow):
		return invalidf("--respawn-standbys %d: standbys take lost ranks' places in heal: it needs --on-failure shrink with --regrow on", c.RespawnStandbys)
	case c.RespawnStandbys > 0 && c.NUMABinding != "":
		return invalidf("--respawn-standbys %d with --numa-binding %s: a standby starts before its slot, and so its CPUs, is known", c.RespawnStandbys, c.NUMABinding)
	case c.HeartbeatTimeout < 0:
		return invalidf("--heartbeat-timeout %v: want 0 (off) or more", c.HeartbeatTimeout)
	case c.DoneTimeout < 0:
		return invalidf("--done-timeout %v: want 0 (unbounded) or more", c.DoneTimeout)
	case c.DoneTimeout > 0 && c.HeartbeatTimeout == 0:
		return invalidf("--done-timeout %v: needs --heartbeat-timeout (the done heartbeat comes on its socket)", c.DoneTimeout)
	case c.NodeLiveness.Mode != "" && c.NodeLiveness.Mode != NodeLivenessAuto && c.NodeLiveness.Mode != NodeLivenessOn && c.NodeLiveness.Mode != NodeLivenessOff:
		return invalidf("--node-liveness %q: want auto, on or off", c.NodeLiveness.Mode)
	case c.NodeLiveness.ProbeInterval < 0:
		return invalidf("--node-probe-interval %v: want a positive interval", c.NodeLiveness.ProbeInterval)
	case c.NodeLiveness.SuspicionMult < 0:
		return invalidf("--node-suspicion-mult %d: want 1 or more", c.NodeLiveness.SuspicionMult)
	case c.JobSecret != nil && len(c.JobSecret) < MinSecretLen:
		return invalidf("the job secret is %d bytes: want at least %d", len(c.JobSecret), MinSecretLen)
	}
	return nil
}
