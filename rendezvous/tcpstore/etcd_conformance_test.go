package tcpstore_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestEtcdStorageConformance runs every storage-independent server test on
// the etcd storage, against a real etcd, each server on a fresh prefix.
func TestEtcdStorageConformance(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	var n atomic.Int64
	tcpstore.RunServerSuite(t, func(t testing.TB) tcpstore.Storage {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{
			Prefix:    fmt.Sprintf("/conformance/%d/", n.Add(1)),
			OpTimeout: 20 * time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	})
}
