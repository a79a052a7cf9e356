package main

import (
	"context"
	"fmt"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/nccl"
)

func init() {
	backends["nccl"] = backend{newGroup: newNCCLGroup, joinGroup: joinNCCLGroup, newVector: newDeviceVector}
}

// joinNCCLGroup is a newcomer's side of a grow, on the GPU of this local
// rank.
func joinNCCLGroup(ctx context.Context, b pg.Bootstrap, spec pg.GrowSpec, _ workerEnv) (pg.ProcessGroup, error) {
	cfg := nccl.DefaultConfig()
	cfg.Bootstrap = b
	g, err := nccl.JoinGrow(ctx, cfg, spec)
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return g, nil
}

// newNCCLGroup forms a pg/nccl group on the GPU of this local rank
// (PyTorch's choice without a device_id: LOCAL_RANK modulo the GPUs).
func newNCCLGroup(ctx context.Context, b pg.Bootstrap, _ workerEnv) (pg.ProcessGroup, error) {
	cfg := nccl.DefaultConfig()
	cfg.Bootstrap = b
	return nccl.New(ctx, cfg)
}

// deviceVector is a vector in device memory, staged through a host copy.
type deviceVector struct {
	dev  *nccl.DeviceBuffer
	host []float64
}

func newDeviceVector(g pg.ProcessGroup, n int) (vector, error) {
	ng, ok := g.(*nccl.Group)
	if !ok {
		return nil, fmt.Errorf("nccl vector on a %s group", g.Backend())
	}
	dev, err := ng.Alloc(pg.Float64, n)
	if err != nil {
		return nil, err
	}
	return &deviceVector{dev: dev, host: make([]float64, n)}, nil
}

func (d *deviceVector) Buffer() pg.Buffer { return d.dev }

func (d *deviceVector) Fill(v float64) error {
	for i := range d.host {
		d.host[i] = v
	}
	return d.dev.CopyFromHost(pg.Host(d.host))
}

func (d *deviceVector) Read(dst []float64) error { return d.dev.CopyToHost(pg.Host(dst)) }

func (d *deviceVector) Free() { d.dev.Free() }
