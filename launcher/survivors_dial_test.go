package launcher

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// slowStore is a worker store whose host answers a connection only after
// delay, as an overloaded host does: a proxy in front of a real server.
func slowStore(t *testing.T, delay time.Duration) string {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	upstream := srv.Addr().String()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			wg.Add(1)
			go func() {
				defer wg.Done()
				select {
				case <-time.After(delay):
				case <-stop:
					return
				}
				up, err := net.Dial("tcp", upstream)
				if err != nil {
					c.Close()
					return
				}
				track(up)
				go io.Copy(up, c)
				io.Copy(c, up)
			}()
		}
	}()
	t.Cleanup(func() {
		close(stop)
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		srv.Close()
		wg.Wait()
	})
	return ln.Addr().String()
}

// TestDialWorkerStore: the survivors' connection to a worker store whose
// host answers late waits for it up to the join timeout, saying so once
// the agreement timeout has passed, where it used to give up at the
// agreement timeout (and the agent ended); past the join timeout it fails.
func TestDialWorkerStore(t *testing.T) {
	const timeout = 100 * time.Millisecond
	for _, tc := range []struct {
		name    string
		delay   time.Duration
		wait    time.Duration
		ok      bool
		waiting bool // says it waits
	}{
		{name: "answers at once", delay: 0, wait: 5 * time.Second, ok: true},
		{name: "answers past the agreement timeout", delay: 500 * time.Millisecond, wait: 5 * time.Second, ok: true, waiting: true},
		{name: "no join timeout: the agreement timeout", delay: 500 * time.Millisecond, wait: 0},
		{name: "answers past the join timeout", delay: 2 * time.Second, wait: 300 * time.Millisecond, waiting: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := slowStore(t, tc.delay)
			core, logs := observer.New(zapcore.InfoLevel)
			c, err := dialWorkerStore(context.Background(), zap.New(core), addr, timeout, tc.wait)
			if c != nil {
				defer c.Close()
			}
			switch {
			case tc.ok && err != nil:
				t.Fatalf("dialWorkerStore: %v", err)
			case !tc.ok && !errors.Is(err, rendezvous.ErrTimeout):
				t.Fatalf("dialWorkerStore: %v, want a timeout", err)
			}
			if tc.ok {
				if err := c.Set(context.Background(), "k", []byte("v")); err != nil {
					t.Errorf("Set through the connection: %v", err)
				}
			}
			if got := logs.FilterMessage("waiting for the worker store").Len(); (got > 0) != tc.waiting {
				t.Errorf("%d \"waiting for the worker store\" lines, want them: %v", got, tc.waiting)
			}
		})
	}
}
