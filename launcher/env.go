package launcher

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/health"
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
	// Heartbeat is the socket workers send heartbeats to (GORUN_HEARTBEAT),
	// "" when heartbeats are off.
	Heartbeat string
	// OMPThreads is set when torchrun would set OMP_NUM_THREADS ("1" when
	// more than one worker runs per node and the user set none).
	OMPThreads string
}

// Environ returns the environment of the worker with assignment a: the
// agent's own environment (base, usually os.Environ()) with torchrun's
// variables and gorun's extras laid over it, as torchrun's subprocess
// handler lays its dict over os.environ. errorFile is the worker's
// TORCHELASTIC_ERROR_FILE.
func (w WorkerEnv) Environ(base []string, a Assignment, errorFile string) []string {
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
	if w.Heartbeat != "" {
		set[health.HeartbeatEnv] = w.Heartbeat
	}
	inherited := lookup(base)
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
	out := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, over := set[k]; !over {
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
