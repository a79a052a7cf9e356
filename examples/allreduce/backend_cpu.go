package main

import (
	"context"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
)

var backends = map[string]backend{
	"cpu": {newGroup: newCPUGroup, joinGroup: joinCPUGroup, newVector: newHostVector},
}

func joinCPUGroup(ctx context.Context, b pg.Bootstrap, spec pg.GrowSpec, _ workerEnv) (pg.ProcessGroup, error) {
	cfg := cpu.DefaultConfig()
	cfg.Bootstrap = b
	g, err := cpu.JoinGrow(ctx, cfg, spec)
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return g, nil
}

func newCPUGroup(ctx context.Context, b pg.Bootstrap, _ workerEnv) (pg.ProcessGroup, error) {
	cfg := cpu.DefaultConfig()
	cfg.Bootstrap = b
	return cpu.New(ctx, cfg)
}

// hostVector is a vector in host memory (pg/cpu).
type hostVector []float64

func newHostVector(_ pg.ProcessGroup, n int) (vector, error) { return make(hostVector, n), nil }

func (h hostVector) Buffer() pg.Buffer { return pg.Host([]float64(h)) }

func (h hostVector) Fill(v float64) error {
	for i := range h {
		h[i] = v
	}
	return nil
}

func (h hostVector) Read(dst []float64) error {
	copy(dst, h)
	return nil
}

func (h hostVector) Free() {}
