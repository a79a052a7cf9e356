package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
	"github.com/gorunhq/gorun/shrink"
)

// workerEnv is what a launcher (gorun or torchrun) tells a worker, read from
// the environment PyTorch's env:// reads.
type workerEnv struct {
	rank, world, localRank int
	masterAddr             string
	masterPort             int
	// agentStore: the launcher serves the store (TORCHELASTIC_USE_AGENT_STORE
	// =True); otherwise rank 0 hosts it, as PyTorch's env:// does.
	agentStore bool
	// attempt is TORCHELASTIC_RESTART_COUNT: each restart of the group
	// bootstraps under its own namespace, like PyTorch 1.13's
	// /worker/attempt_<n> prefix, so a restart never reads the previous
	// attempt's keys from a store that outlived it.
	attempt int
	// onFailure is GORUN_ON_FAILURE, lower-cased: "shrink" when gorun runs
	// the job with --on-failure shrink, so that survivors follow its shrink
	// epochs; "restart" or "" otherwise.
	onFailure string
	// newcomer: gorun started this worker to fill a lost slot of a running
	// job (a respawned rank), GORUN_SHRINK_NEWCOMER set: it joins the
	// survivors' group by a grow epoch instead of forming the group.
	// after is that variable's value, the last epoch decided before it
	// started.
	newcomer bool
	after    int
	// secret is the job secret (GORUN_JOB_SECRET), "" when the job has
	// none; scope names this round of the job (TORCHELASTIC_RUN_ID and
	// GORUN_GENERATION). With a secret, the worker's shrink Boards are
	// authenticated: it acts only on epochs the agents sealed, and seals
	// the notices it files. The secret is never printed.
	secret, scope string
}

func readEnv(getenv func(string) string) (workerEnv, error) {
	var e workerEnv
	ints := []struct {
		name     string
		dst      *int
		required bool
	}{
		{"RANK", &e.rank, true},
		{"WORLD_SIZE", &e.world, true},
		{"MASTER_PORT", &e.masterPort, true},
		{"LOCAL_RANK", &e.localRank, false},
		{"TORCHELASTIC_RESTART_COUNT", &e.attempt, false},
	}
	for _, v := range ints {
		s := getenv(v.name)
		if s == "" {
			if v.required {
				// PyTorch's env:// messages: "RANK expected", …
				return e, fmt.Errorf("%s expected (run under gorun or torchrun, or set it)", v.name)
			}
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil {
			return e, fmt.Errorf("%s=%q is not an integer", v.name, s)
		}
		*v.dst = n
	}
	if e.masterAddr = getenv("MASTER_ADDR"); e.masterAddr == "" {
		return e, fmt.Errorf("MASTER_ADDR expected (run under gorun or torchrun, or set it)")
	}
	if e.world < 1 || e.rank < 0 || e.rank >= e.world {
		return e, fmt.Errorf("RANK=%d out of range for WORLD_SIZE=%d", e.rank, e.world)
	}
	if v := getenv("GORUN_SHRINK_NEWCOMER"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return e, fmt.Errorf("GORUN_SHRINK_NEWCOMER=%q: want the number of the last epoch decided", v)
		}
		e.newcomer, e.after = true, n
	}
	e.agentStore = strings.EqualFold(getenv("TORCHELASTIC_USE_AGENT_STORE"), "true")
	if e.secret = getenv(shrink.SecretEnv); e.secret != "" {
		e.scope = shrink.Scope(getenv("TORCHELASTIC_RUN_ID"), getenv("GORUN_GENERATION"))
	}
	switch e.onFailure = strings.ToLower(getenv("GORUN_ON_FAILURE")); e.onFailure {
	case "", onFailureRestart, onFailureShrink:
	default:
		return e, fmt.Errorf("GORUN_ON_FAILURE=%q: want %s or %s", e.onFailure, onFailureRestart, onFailureShrink)
	}
	return e, nil
}

// GORUN_ON_FAILURE's values: gorun's --on-failure modes.
const (
	onFailureRestart = "restart"
	onFailureShrink  = "shrink"
)

// boardAuth returns the Auth of the worker's shrink Boards, nil when the
// job has no secret. Each forged record it refuses is reported once on out.
func (e workerEnv) boardAuth(out io.Writer) (*shrink.Auth, error) {
	if e.secret == "" {
		return nil, nil
	}
	return shrink.NewAuth([]byte(e.secret), e.scope, func(f shrink.Forgery) {
		fmt.Fprintf(out, "ignored a forged record at %s: %s\n", f.Key, f.Reason)
	})
}

// namespace is where this attempt's group bootstraps in the store. A
// launcher's store outlives attempts, so each has its own namespace. A
// store rank 0 hosts (torchrun's c10d jobs) is new with every group, and
// needs none; the attempt must not be in it there: torchrun's restart
// count is each agent's own, and a replacement agent's differs from the
// others', so ranks under it would bootstrap where no peer ever comes.
func (e workerEnv) namespace() string {
	if !e.agentStore {
		return "allreduce"
	}
	return "allreduce/attempt_" + strconv.Itoa(e.attempt)
}

// storeAddr is the worker store's address, MASTER_ADDR:MASTER_PORT.
func (e workerEnv) storeAddr() string {
	return net.JoinHostPort(e.masterAddr, strconv.Itoa(e.masterPort))
}

// connectStore reaches the worker store: the launcher's, or one rank 0 hosts
// at MASTER_ADDR:MASTER_PORT when no launcher serves one. The returned
// function closes the connection and any server.
func connectStore(ctx context.Context, e workerEnv, timeout time.Duration) (rendezvous.Store, func(), error) {
	var srv *tcpstore.Server
	if !e.agentStore && e.rank == 0 {
		var err error
		if srv, err = tcpstore.Listen(net.JoinHostPort("", strconv.Itoa(e.masterPort)), tcpstore.ServerConfig{}); err != nil {
			return nil, nil, fmt.Errorf("host the store on port %d: %w", e.masterPort, err)
		}
	}
	c, err := dialStore(ctx, e, timeout)
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return nil, nil, err
	}
	return c, func() {
		c.Close()
		if srv != nil {
			srv.Close()
		}
	}, nil
}

// dialStore opens a connection to the worker store.
func dialStore(ctx context.Context, e workerEnv, timeout time.Duration) (*tcpstore.Client, error) {
	return tcpstore.Dial(ctx, e.storeAddr(), tcpstore.ClientConfig{Timeout: timeout})
}
