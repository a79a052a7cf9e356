package main

import (
	"context"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
)

var backends = map[string]backend{
	"cpu": {newGroup: newCPUGroup, newVector: newHostVector},
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
