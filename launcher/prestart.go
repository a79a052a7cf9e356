package launcher

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"go.uber.org/zap"
)

// This file is --spare-prestart (Config.SparePrestart): the local workers
// start before the agent's first round and wait, parked, for the round
// that gives them their place (package prestart). An attempt's log
// directory (round.go) is made for them before the round says which
// attempt it is, and renamed then.

// parked is a group of pre-started workers waiting for their round.
type parked struct {
	g  *group
	at *attempt
	// exited is a parked worker's exit, once one is seen before the round.
	exited *workerExit
}

// prestart starts the local workers, parked: each knows its local rank and
// whatever does not depend on a round, and waits on its assignment pipe.
func (a *agent) prestart() (*parked, error) {
	at, err := a.openAttempt(a.attemptDir(0))
	if err != nil {
		return nil, err
	}
	env := workerEnv(&a.cfg, a.runID, "", 0, 0, 0)
	if a.heartbeats != nil {
		env.Heartbeat, env.HeartbeatTimeout = a.heartbeats.Path(), a.cfg.HeartbeatTimeout
	}
	spec := spawnSpec{path: a.path, argv: a.argv, contain: &a.containment, env: env, base: environ(), dir: at.dir, prefix: a.linePrefix,
		filtered: at.filtered, parked: true}
	as := make([]Assignment, a.cfg.NProcPerNode)
	for i := range as {
		as[i] = Assignment{LocalRank: i, Rank: -1, GroupRank: -1, LocalWorldSize: len(as)}
	}
	g, err := startGroup(a.reaper, a.con, &a.cfg, spec, as)
	if err != nil {
		at.close()
		return nil, localf("pre-starting the workers: %w", err)
	}
	a.log.Info("pre-started the workers; they wait for this node's round (--spare-prestart)",
		zap.Ints("pids", g.pids()), zap.String("log_dir", at.dir))
	return &parked{g: g, at: at}, nil
}

// errParkedExited ends the wait for a round when a parked worker exits.
var errParkedExited = errors.New("a pre-started worker exited before its round")

// nextRound is the membership's next round, with pk's workers, if any,
// watched while it is awaited: one that exits ends the wait
// (errParkedExited, the exit in pk.exited), so that a spare whose workers
// cannot run says so at once instead of standing by broken.
func (a *agent) nextRound(ctx context.Context, pk *parked) (*plan, error) {
	if pk == nil {
		return a.m.next(ctx)
	}
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		select {
		case x := <-pk.g.exits:
			pk.exited = &x
			cancel(errParkedExited)
		case <-stop:
		}
	}()
	p, err := a.m.next(wctx)
	close(stop)
	<-done
	switch {
	case pk.exited == nil:
		return p, err
	case err == nil:
		// The round came as the worker exited: the exit is the round's.
		pk.g.exits <- *pk.exited
		pk.exited = nil
		return p, nil
	}
	if p != nil {
		p.release()
	}
	return nil, errParkedExited
}

// parkedFailed reports a parked worker that exited before its round: the
// failure table, and the job's end with it.
func (a *agent) parkedFailed(pk *parked) error {
	x := *pk.exited
	pk.g.record(x)
	f := a.failure(x)
	a.log.Error("a pre-started worker exited before this node's round; leaving the rendezvous",
		zap.Int("local_rank", f.LocalRank), zap.Int("pid", f.Pid), zap.String("exit", describeExit(f.ExitCode)))
	e := &WorkersFailedError{Name: a.cfg.Entrypoint.Program, Failures: []Failure{f}}
	io.WriteString(a.con.stderr, e.Summary())
	return e
}

// stopParked stops the parked workers that were never given a round (pk
// may be nil: none): with the signal that stopped the agent (SIGTERM if
// none did), the shutdown timeout, then SIGKILL.
func (a *agent) stopParked(ctx context.Context, pk *parked, sigs <-chan os.Signal) {
	if pk == nil {
		return
	}
	sig := stoppedBy(ctx)
	if sig == 0 {
		sig = syscall.SIGTERM
	}
	if pk.g.running > 0 {
		a.log.Info("stopping the pre-started workers", zap.Stringer("signal", sig), zap.Ints("pids", pk.g.pids()))
	}
	pk.g.stop(sig, a.cfg.ShutdownTimeout, sigs, nil)
	pk.at.close()
	a.killLeftovers()
}

// adopt gives the parked workers the round of p, moving their logs to the
// round's attempt directory (spec.dir), and returns them as the round's
// group.
func (pk *parked) adopt(spec spawnSpec, p *plan) (*group, error) {
	if err := pk.at.moveTo(spec.dir); err != nil {
		return nil, err
	}
	if err := pk.g.assign(spec, p.assignments); err != nil {
		return nil, fmt.Errorf("assigning the pre-started workers: %w", err)
	}
	return pk.g, nil
}
