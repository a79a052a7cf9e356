//go:build !cgo

package nccl

import (
	"context"
	"strings"
	"testing"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous"
)

type nopStore struct{ rendezvous.Store }

func TestNewWithoutCgo(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: nopStore{}, Size: 1}
	_, err := New(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "pg/nccl needs cgo") {
		t.Fatalf("New without cgo: %v", err)
	}
}
