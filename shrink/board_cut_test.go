package shrink

import (
	"context"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/netcut"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestAwaitThroughACut: a reader awaiting an epoch (the Coordinator's
// epoch watcher, for the round's life) through a link cut for several of
// the store's timeouts reads the epoch once the link heals. Its look at
// the Floor timed out and ended the wait, the agreement with it, and the
// node's ranks restarted (bench/chaos, a 4-s cut, "await epoch 1: read the
// board's floor: … CHECK: timeout after 10s"). A store that is gone still
// ends the wait at once.
func TestAwaitThroughACut(t *testing.T) {
	const timeout = 100 * time.Millisecond
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	// No deadline: the store's timeout bounds each call, as in the
	// watchers (a deadline would bound a wait instead).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dial := func(addr string) *tcpstore.Client {
		c, err := tcpstore.Dial(ctx, addr, tcpstore.ClientConfig{Timeout: timeout})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	link := netcut.New(t, srv.Addr().String())
	reader, writer := NewBoard(dial(link.Addr()), ""), NewBoard(dial(srv.Addr().String()), "")

	type result struct {
		e   Epoch
		err error
	}
	got := make(chan result, 1)
	go func() {
		e, err := reader.Await(ctx, 1)
		got <- result{e, err}
	}()
	time.Sleep(2 * timeout) // waiting on the key, its waits timing out and renewed
	// Cut as the reader next looks (a CHECK of the Floor, after a wait
	// that timed out), not in a wait.
	link.CutOnFirst(byte(tcpstore.OpCheck))
	select {
	case r := <-got:
		t.Fatalf("Await ended during the cut: %v, %v", r.e, r.err)
	case <-time.After(6 * timeout):
	}
	if link.Cuts() != 1 {
		t.Fatalf("the link was cut %d times, want once", link.Cuts())
	}
	if _, won, err := writer.Publish(ctx, mustNext(t, Initial(4), 1)); err != nil || !won {
		t.Fatalf("Publish: %v %v", won, err)
	}
	link.Heal()
	select {
	case r := <-got:
		if r.err != nil || r.e.Number != 1 {
			t.Fatalf("Await after the heal: %v, %v; want epoch 1", r.e, r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Await did not return the epoch after the link healed")
	}

	// The store gone: an answer, not a slow store's timeout, and at once.
	// Behind the link, which still accepts, the server's death shows as a
	// hang-up or a reset, on the wait's connection or reconnecting (then
	// wrapped in the reconnect's timeout, which still is not slow).
	go func() {
		_, err := reader.Await(ctx, 2)
		got <- result{err: err}
	}()
	time.Sleep(2 * timeout)
	srv.Close()
	select {
	case r := <-got:
		if r.err == nil || rendezvous.SlowStore(r.err) {
			t.Fatalf("Await with the store gone: %v; want the store's error", r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Await went on with the store gone")
	}
}
