package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gorunhq/gorun/pg"
)

// errWrongSum: an allreduce returned a value other than the expected sum.
var errWrongSum = errors.New("wrong allreduce result")

// result is what a rank reports at the end.
type result struct {
	rank, world, steps int
	sum                float64 // the last step's value (every element)
}

// backend forms a group and makes buffers in the memory that group works on.
type backend struct {
	newGroup  func(ctx context.Context, b pg.Bootstrap, e workerEnv) (pg.ProcessGroup, error)
	newVector func(g pg.ProcessGroup, n int) (vector, error)
}

// vector is a float64 buffer a group can reduce, with host-side access.
type vector interface {
	Buffer() pg.Buffer
	// Fill sets every element to v.
	Fill(v float64) error
	// Read copies the elements into dst (len(dst) elements).
	Read(dst []float64) error
	Free()
}

// train forms the group and runs the steps. Rank r contributes r+1, so
// every element of every step's result must be 1+2+…+W.
func train(ctx context.Context, e workerEnv, be backend, opt options) (result, error) {
	res := result{rank: e.rank, world: e.world}
	setupCtx, cancel := context.WithTimeout(ctx, opt.timeout)
	defer cancel()
	store, closeStore, err := connectStore(setupCtx, e, opt.timeout)
	if err != nil {
		return res, fmt.Errorf("worker store: %w", err)
	}
	defer closeStore()
	g, err := be.newGroup(setupCtx, pg.Bootstrap{
		Store: store, Namespace: e.namespace(), Rank: e.rank, Size: e.world, Timeout: opt.timeout,
	}, e)
	if err != nil {
		return res, fmt.Errorf("form the %s group: %w", opt.backend, err)
	}
	defer g.Close()

	vec, err := be.newVector(g, opt.elems)
	if err != nil {
		return res, err
	}
	defer vec.Free()
	host := make([]float64, opt.elems)
	want := float64(e.world) * float64(e.world+1) / 2

	for step := range opt.steps {
		if step > 0 && opt.stepGap > 0 {
			select {
			case <-ctx.Done():
				return res, fmt.Errorf("stopped after %d steps: %w", res.steps, context.Cause(ctx))
			case <-time.After(opt.stepGap):
			}
		}
		if err := vec.Fill(float64(e.rank + 1)); err != nil {
			return res, err
		}
		stepCtx, cancel := context.WithTimeout(ctx, opt.timeout)
		err := g.AllReduce(stepCtx, vec.Buffer(), pg.Sum)
		cancel()
		if err != nil {
			return res, fmt.Errorf("step %d: allreduce: %w", step, err)
		}
		if err := vec.Read(host); err != nil {
			return res, err
		}
		res.steps, res.sum = step+1, host[0]
		for i, v := range host {
			if v != want {
				return res, fmt.Errorf("%w: step %d element %d = %g, want %g", errWrongSum, step, i, v, want)
			}
		}
	}
	return res, nil
}
