package launcher

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/internal/netcut"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestStatusSlowStoreIsNotLost: while workers run, a rendezvous store that
// stops answering counts as lost (its host gone) after the keep-alive
// window when its connection breaks, but only after read_timeout while the
// connection stands and answers are only late: at 512 agents on two cores
// the host was swamped, and every agent, the host's own included, took it
// for gone and ended the job.
func TestStatusSlowStoreIsNotLost(t *testing.T) {
	const drop, readTimeout = 600 * time.Millisecond, 2 * time.Second
	for _, tc := range []struct {
		name     string
		hangUp   bool // the host goes away (its server closes) rather than falls silent
		lostFrom time.Duration
	}{
		{name: "silent", lostFrom: readTimeout},
		{name: "gone", hangUp: true, lostFrom: drop},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			// A silent store is one behind a cut link; a gone one is
			// reached directly, so that its closing refuses.
			addr, link := srv.Addr().String(), (*netcut.Link)(nil)
			if !tc.hangUp {
				link = netcut.New(t, addr)
				addr = link.Addr()
			}
			c, err := tcpstore.Dial(ctx, addr, tcpstore.ClientConfig{Timeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			dcfg := rendezvous.DynamicConfig{RunID: "job", MinNodes: 1, MaxNodes: 1,
				KeepAliveInterval: drop / 3, KeepAliveTimeout: drop / 3, KeepAliveMaxAttempt: 3}
			dyn, err := rendezvous.NewDynamic(c, rendezvous.NodeDesc{Addr: "10.0.0.1", Pid: 1}, nil, dcfg)
			if err != nil {
				t.Fatal(err)
			}
			defer dyn.Close()
			if _, err := dyn.Next(ctx); err != nil {
				t.Fatal(err)
			}
			cfg := &Config{}
			cfg.rdzv.readTimeout = readTimeout
			core, logs := observer.New(zap.WarnLevel)
			j := &jobNode{cfg: cfg, log: zap.New(core), runID: "job", dcfg: dyn.Config(), dyn: dyn, lastSeen: time.Now()}
			if ch, err := j.status(ctx); ch != nil || err != nil {
				t.Fatalf("status with the store up: %v, %v", ch, err)
			}
			silentAt := time.Now()
			if tc.hangUp {
				srv.Close()
			} else {
				link.Cut()
			}
			for {
				ch, _ := j.status(ctx)
				silent := time.Since(silentAt)
				if ch != nil {
					if !ch.storeLost {
						t.Fatalf("status: %v, want the store lost or nothing", ch)
					}
					if silent < tc.lostFrom || silent > tc.lostFrom+3*time.Second {
						t.Fatalf("the store counted lost %v after it fell silent, want from %v", silent, tc.lostFrom)
					}
					break
				}
				if ctx.Err() != nil {
					t.Fatal("the store never counted lost")
				}
				time.Sleep(50 * time.Millisecond)
			}
			if late := logs.FilterMessageSnippet("answers late").Len(); (late > 0) == tc.hangUp {
				t.Errorf("%d lines say the store answers late; want them only while it is silent", late)
			}
		})
	}
}
