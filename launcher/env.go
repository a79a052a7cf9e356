package launcher

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/health"
	"github.com/gorunhq/gorun/prestart"
)

// Assignment is where one worker stands in the job, as a rendezvous round
// decided it.
type Assignment struct {
	LocalRank      int
	Rank           int // global rank
	GroupRank      int // this agent's rank among the agents
	RoleRank       int
	LocalWorldSize int
	WorldSize      int
	GroupWorldSize int // number of agents
	RoleWorldSize  int
}

// WorkerEnv describes one attempt of the local worker group: what every
// worker's environment is built from.
type WorkerEnv struct {
	Role         string
	RunID        string
	MasterAddr   string // the worker store's address
	MasterPort   int
	RestartCount int
	MaxRestarts  int
	// StoreURL is gorun's own name for the worker store
	// (GORUN_STORE=tcp://MASTER_ADDR:MASTER_PORT).
	StoreURL string
	// Generation numbers rendezvous rounds (GORUN_GENERATION).
	Generation int
	// OnFailure is the job's --on-failure policy (GORUN_ON_FAILURE), so a
	// worker knows whether to follow shrink epochs.
	OnFailure string
	// AgreementTimeout is shrink mode's agreement timeout
	// (GORUN_AGREEMENT_TIMEOUT, in seconds, set in shrink mode only), so a
	// survivor waiting for an epoch knows when the agents have given up
	// and never waits without end.
	AgreementTimeout time.Duration
	// GrowTimeout is heal's grow timeout (GORUN_GROW_TIMEOUT, in seconds,
	// shrink mode only), so a worker sizes its waits on a grow by the
	// agents'.
	GrowTimeout time.Duration
	// Heartbeat is the socket workers send heartbeats to (GORUN_HEARTBEAT),
	// "" when heartbeats are off; HeartbeatTimeout the agent's timeout
	// (GORUN_HEARTBEAT_TIMEOUT, in seconds), which paces a blocked
	// worker's wait beats (health.Blocked).
	Heartbeat        string
	HeartbeatTimeout time.Duration
	// OMPThreads is set when torchrun would set OMP_NUM_THREADS ("1" when
	// more than one worker runs per node and the user set none).
	OMPThreads string
	// SignalsToHandle is TORCHELASTIC_SIGNALS_TO_HANDLE, the signals the
	// agent handles ("SIGTERM,SIGINT,SIGHUP,SIGQUIT"), which torchrun 2.14
	// exports and its worker-side code reads.
	SignalsToHandle string
	// VirtualLocalRank: LOCAL_RANK=0 and one GPU in CUDA_VISIBLE_DEVICES
	// per worker (Config.VirtualLocalRank).
	VirtualLocalRank bool
	// NewcomerAfter, when positive, makes the worker a newcomer: heal
	// respawned it into a lost slot of a running group, and it joins by
	// the grow epoch after epoch NewcomerAfter, the last decided when it
	// started (GORUN_SHRINK_NEWCOMER). 0 for the workers a round starts
	// (an epoch that lost a slot is at least 1).
	NewcomerAfter int
	// JobSecret is the job secret (GORUN_JOB_SECRET), for the worker-side
	// helpers to check what they read from the store; nil for none.
	JobSecret Secret
}

// Environ returns the environment of the worker with assignment a: the
// agent's own environment (base, usually os.Environ()) with torchrun's
// variables and gorun's extras laid over it, as torchrun's subprocess
// handler lays its dict over os.environ. errorFile is the worker's
// TORCHELASTIC_ERROR_FILE.
func (w WorkerEnv) Environ(base []string, a Assignment, errorFile string) []string {
	return overlay(base, w.vars(lookup(base), a, errorFile), nil)
}

// roundVars are the variables only a rendezvous round decides: a parked
// worker (Config.SparePrestart) starts without them, whatever the agent's
// own environment holds, and receives them with its assignment.
var roundVars = []string{
	"RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
	"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
	"GORUN_STORE", "GORUN_GENERATION", "GORUN_SHRINK_NEWCOMER",
}

// ParkedEnviron returns the environment of a parked worker of local rank
// localRank: Environ's without roundVars, and prestart.EnvFD naming the
// inherited descriptor fd its assignment comes on. w need hold only what
// does not depend on the round.
func (w WorkerEnv) ParkedEnviron(base []string, localRank int, errorFile string, fd int) []string {
	set := w.vars(lookup(base), Assignment{LocalRank: localRank}, errorFile)
	for _, k := range roundVars {
		delete(set, k)
	}
	set[prestart.EnvFD] = strconv.Itoa(fd)
	return overlay(base, set, roundVars)
}

// slotVars are the variables a standby (Config.RespawnStandbys) starts
// without, beside roundVars: they depend on the slot it will take.
var slotVars = []string{"LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"}

// StandbyEnviron returns the environment of a standby: ParkedEnviron's
// without the slot's variables either (slotVars; with VirtualLocalRank,
// CUDA_VISIBLE_DEVICES too, which the slot narrows to its GPU). They come
// with its assignment.
func (w WorkerEnv) StandbyEnviron(base []string, fd int) []string {
	drop := slices.Concat(roundVars, slotVars)
	if w.VirtualLocalRank {
		drop = append(drop, "CUDA_VISIBLE_DEVICES")
	}
	set := w.vars(lookup(base), Assignment{}, "")
	for _, k := range drop {
		delete(set, k)
	}
	set[prestart.EnvFD] = strconv.Itoa(fd)
	return overlay(base, set, drop)
}

// Assigned returns what a parked worker receives once its round is known:
// every variable Environ would have set for it.
func (w WorkerEnv) Assigned(base []string, a Assignment, errorFile string) prestart.Assignment {
	return prestart.Assignment{Env: w.vars(lookup(base), a, errorFile)}
}

// vars are the variables gorun sets for the worker with assignment a;
// inherited is the agent's own environment.
func (w WorkerEnv) vars(inherited map[string]string, a Assignment, errorFile string) map[string]string {
	set := map[string]string{
		"RANK":                         strconv.Itoa(a.Rank),
		"LOCAL_RANK":                   strconv.Itoa(a.LocalRank),
		"GROUP_RANK":                   strconv.Itoa(a.GroupRank),
		"ROLE_RANK":                    strconv.Itoa(a.RoleRank),
		"ROLE_NAME":                    w.Role,
		"LOCAL_WORLD_SIZE":             strconv.Itoa(a.LocalWorldSize),
		"WORLD_SIZE":                   strconv.Itoa(a.WorldSize),
		"GROUP_WORLD_SIZE":             strconv.Itoa(a.GroupWorldSize),
		"ROLE_WORLD_SIZE":              strconv.Itoa(a.RoleWorldSize),
		"MASTER_ADDR":                  w.MasterAddr,
		"MASTER_PORT":                  strconv.Itoa(w.MasterPort),
		"TORCHELASTIC_RESTART_COUNT":   strconv.Itoa(w.RestartCount),
		"TORCHELASTIC_MAX_RESTARTS":    strconv.Itoa(w.MaxRestarts),
		"TORCHELASTIC_RUN_ID":          w.RunID,
		"TORCHELASTIC_USE_AGENT_STORE": "True", // the agent always hosts the workers' store
		"TORCHELASTIC_ERROR_FILE":      errorFile,
		"GORUN_STORE":                  w.StoreURL,
		"GORUN_RUN_ID":                 w.RunID,
		"GORUN_GENERATION":             strconv.Itoa(w.Generation),
	}
	if w.OnFailure != "" {
		set["GORUN_ON_FAILURE"] = w.OnFailure
	}
	if w.OnFailure == OnFailureShrink && w.AgreementTimeout > 0 {
		set["GORUN_AGREEMENT_TIMEOUT"] = strconv.FormatFloat(w.AgreementTimeout.Seconds(), 'g', -1, 64)
	}
	if w.OnFailure == OnFailureShrink && w.GrowTimeout > 0 {
		set["GORUN_GROW_TIMEOUT"] = strconv.FormatFloat(w.GrowTimeout.Seconds(), 'g', -1, 64)
	}
	if w.NewcomerAfter > 0 {
		set["GORUN_SHRINK_NEWCOMER"] = strconv.Itoa(w.NewcomerAfter)
	}
	if w.Heartbeat != "" {
		set[health.HeartbeatEnv] = w.Heartbeat
		if w.HeartbeatTimeout > 0 {
			set[health.HeartbeatTimeoutEnv] = strconv.FormatFloat(w.HeartbeatTimeout.Seconds(), 'g', -1, 64)
		}
	}
	if w.JobSecret != nil {
		set[JobSecretEnv] = string(w.JobSecret)
	}
	if w.SignalsToHandle != "" {
		set["TORCHELASTIC_SIGNALS_TO_HANDLE"] = w.SignalsToHandle
	}
	if w.VirtualLocalRank {
		set["LOCAL_RANK"] = "0"
		set["CUDA_VISIBLE_DEVICES"] = virtualDevice(inherited, a.LocalRank)
	}
	// torchrun keeps the user's value, else enables it (1.13 names it
	// NCCL_ASYNC_ERROR_HANDLING; both are set so either generation of
	// PyTorch sees it).
	for _, k := range []string{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"} {
		if v, ok := inherited[k]; ok {
			set[k] = v
		} else {
			set[k] = "1"
		}
	}
	if _, ok := inherited["OMP_NUM_THREADS"]; !ok && w.OMPThreads != "" {
		set["OMP_NUM_THREADS"] = w.OMPThreads
	}
	return set
}

// overlay returns base with set laid over it and the variables named in
// drop left out, set's in sorted order after base's.
func overlay(base []string, set map[string]string, drop []string) []string {
	out := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, over := set[k]; !over && !slices.Contains(drop, k) {
			out = append(out, kv)
		}
	}
	keys := make([]string, 0, len(set))
	for k := range set {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		out = append(out, k+"="+set[k])
	}
	return out
}

func lookup(env []string) map[string]string {
	m := make(map[string]string, len(env))
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

// ompThreads returns torchrun's OMP_NUM_THREADS default for nproc workers
// per node: "1" when nproc > 1, else nothing.
func ompThreads(nproc int) string {
	if nproc > 1 {
		return "1"
	}
	return ""
}

// environ is the agent's environment; a variable so tests can pin it.
var environ = os.Environ

// virtualDevice is the GPU of local rank lr under --virtual-local-rank: the
// lr-th entry of the agent's CUDA_VISIBLE_DEVICES, or lr when that is not
// set (checkVirtualDevices made sure the list is long enough).
func virtualDevice(env map[string]string, lr int) string {
	list, ok := env["CUDA_VISIBLE_DEVICES"]
	if !ok {
		return strconv.Itoa(lr)
	}
	return strings.TrimSpace(strings.Split(list, ",")[lr])
}

// checkVirtualDevices refuses --virtual-local-rank when the agent's
// CUDA_VISIBLE_DEVICES lists fewer GPUs than it runs workers (torchrun
// fails its worker start there).
func checkVirtualDevices(env []string, nproc int) error {
	list, ok := lookup(env)["CUDA_VISIBLE_DEVICES"]
	if !ok {
		return nil
	}
	if n := len(strings.Split(list, ",")); n < nproc {
		return invalidf("--virtual-local-rank: %d workers, but CUDA_VISIBLE_DEVICES=%s lists %d GPU(s)", nproc, list, n)
	}
	return nil
}

// signalList is --signals-to-handle as torchrun writes it: names joined by
// commas.
func signalList(sigs []syscall.Signal) string {
	names := make([]string, len(sigs))
	for i, s := range sigs {
		names[i] = signalString(s)
	}
	return strings.Join(names, ",")
}
