package cpu_test

import (
	"context"
	"testing"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/pg/pgtest"
)

func factory(base cpu.Config) pgtest.Factory {
	base.ListenAddr = "127.0.0.1:0"
	return pgtest.Factory{
		New: func(ctx context.Context, b pg.Bootstrap) (pg.ProcessGroup, error) {
			cfg := base
			cfg.Bootstrap = b
			return cpu.New(ctx, cfg)
		},
		JoinGrow: func(ctx context.Context, b pg.Bootstrap, spec pg.GrowSpec) (pg.ProcessGroup, error) {
			cfg := base
			cfg.Bootstrap = b
			g, err := cpu.JoinGrow(ctx, cfg, spec)
			if err != nil {
				return nil, err // not a typed nil in the interface
			}
			return g, nil
		},
		Caps: pgtest.Capabilities{
			Unsupported: []pg.DType{pg.Float16, pg.BFloat16},
			Shrink:      true,
			Grow:        true,
			SmallBytes:  base.SmallBytes,
		},
	}
}

// TestConformance runs the suite with small thresholds, so that the ring
// runs on buffers of a few chunks, uneven segments and empty ones, over
// every way peers on one host connect (the ranks here share a host): unix
// sockets, shared memory, and TCP as ranks on different hosts use.
func TestConformance(t *testing.T) {
	for _, transport := range []string{cpu.TransportUnix, cpu.TransportShm, cpu.TransportTCP} {
		t.Run(transport, func(t *testing.T) {
			cfg := cpu.DefaultConfig()
			cfg.SmallBytes = 256
			cfg.ChunkBytes = 1000
			cfg.LocalTransport = transport
			pgtest.Run(t, factory(cfg))
		})
	}
}

// TestConformanceDefaults runs it with the defaults.
func TestConformanceDefaults(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	pgtest.Run(t, factory(cpu.DefaultConfig()))
}

// TestConformanceRingOnly runs it with the ring for every size.
func TestConformanceRingOnly(t *testing.T) {
	cfg := cpu.DefaultConfig()
	cfg.SmallBytes = -1
	cfg.ChunkBytes = 24
	f := factory(cfg)
	f.Caps.LargeBytes = 4096
	pgtest.Run(t, f)
}
