package tcpstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// Tests of the Client against the Go Server, for both wire generations.
// Helpers are prefixed "cl" to stay clear of the server's tests.

var clGens = []Generation{GenNew, GenOld}

// clServer starts a Server on a loopback port that the test's cleanup
// closes.
func clServer(t testing.TB) *Server {
	t.Helper()
	srv, err := Listen("127.0.0.1:0", ServerConfig{})
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

// clDial connects a Client that the test's cleanup closes. A zero
// cfg.Timeout becomes 10 s, so a broken test fails in seconds.
func clDial(t testing.TB, addr string, cfg ClientConfig) *Client {
	t.Helper()
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	c, err := Dial(clCtx(t, cfg.Timeout), addr, cfg)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// clCtx bounds one step of a test.
func clCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// clTimeoutWording checks that err, a call's timeout under a context of
// 100ms, is worded as c10d's: "<what> timeout after <d>ms<suffix>", d the
// time the call was given (the deadline less the moment the call began: a
// little under 100ms on a loaded machine).
func clTimeoutWording(t testing.TB, err error, what, suffix string) {
	t.Helper()
	m := regexp.MustCompile(what + ` timeout after (\d+)ms` + regexp.QuoteMeta(suffix)).FindStringSubmatch(err.Error())
	if m == nil {
		t.Fatalf("error %q is not worded as c10d's %q", err, what+" timeout after 100ms"+suffix)
	}
	if ms, _ := strconv.Atoi(m[1]); ms < 90 || ms > 100 {
		t.Fatalf("error %q: %dms, want the 100ms deadline less the call's start (90-100ms)", err, ms)
	}
}

// clMust returns v, failing the test on err: clMust(c.Add(ctx, "n", 1))(t).
func clMust[T any](v T, err error) func(testing.TB) T {
	return func(t testing.TB) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

func clOK(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// clIs fails the test unless err wraps every one of targets.
func clIs(t testing.TB, err error, targets ...error) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want one wrapping %v", targets)
	}
	for _, target := range targets {
		if !errors.Is(err, target) {
			t.Fatalf("error %q does not wrap %q", err, target)
		}
	}
}

func clWantValue(t testing.TB, c *Client, key, want string) {
	t.Helper()
	got, err := c.Get(clCtx(t, 5*time.Second), key)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	if string(got) != want {
		t.Fatalf("Get(%q) = %q, want %q", key, got, want)
	}
}

func TestClientSetGetAdd(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx := clCtx(t, 10*time.Second)

			clOK(t, c.Set(ctx, "k", []byte("v")))
			clWantValue(t, c, "k", "v")
			clOK(t, c.Set(ctx, "k", nil))
			clWantValue(t, c, "k", "")
			clOK(t, c.Set(ctx, "-key3", []byte("7"))) // a leading '-' is an ordinary key
			clWantValue(t, c, "-key3", "7")

			// test_store.py's add sequence: 1+2+3 reads back as "6".
			for i, want := range []int64{1, 3, 6} {
				if got := clMust(c.Add(ctx, "key", int64(i+1)))(t); got != want {
					t.Fatalf("Add #%d = %d, want %d", i+1, got, want)
				}
			}
			clWantValue(t, c, "key", "6")
			if got := clMust(c.Add(ctx, "key", -10))(t); got != -4 {
				t.Fatalf("Add(-10) = %d, want -4", got)
			}
			if got := clMust(c.Add(ctx, "key", 0))(t); got != -4 {
				t.Fatalf("Add(0) = %d, want -4 (an atomic read)", got)
			}

			if ok := clMust(c.Check(ctx, "k", "key"))(t); !ok {
				t.Fatal("Check(k, key) = false, want true")
			}
			if ok := clMust(c.Check(ctx, "k", "absent"))(t); ok {
				t.Fatal("Check(k, absent) = true, want false")
			}
		})
	}
}

// TestClientCompareSet runs test_store.py's four compare_set cases.
func TestClientCompareSet(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx := clCtx(t, 10*time.Second)
			clOK(t, c.Set(ctx, "cs_key0", []byte("value0")))
			for _, tc := range []struct {
				name, key, expected, desired, want, after string
			}{
				{"absent key, expected not empty", "absent", "wrong_old_value", "x", "wrong_old_value", ""},
				{"present key, wrong expected", "cs_key0", "wrong", "new_value0", "value0", "value0"},
				{"present key, right expected", "cs_key0", "value0", "new_value0", "new_value0", "new_value0"},
				{"absent key, empty expected", "cs_key1", "", "new_value1", "new_value1", "new_value1"},
			} {
				got := clMust(c.CompareSet(ctx, tc.key, []byte(tc.expected), []byte(tc.desired)))(t)
				if string(got) != tc.want {
					t.Errorf("%s: CompareSet = %q, want %q", tc.name, got, tc.want)
				}
				if tc.after == "" {
					if ok := clMust(c.Check(ctx, tc.key))(t); ok {
						t.Errorf("%s: the key was created", tc.name)
					}
				} else {
					clWantValue(t, c, tc.key, tc.after)
				}
			}
		})
	}
}

// TestClientNumKeysDelete follows test_store.py's TCP trace: the store
// starts with one key, "init/", that a client with a world size added.
func TestClientNumKeysDelete(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen, WorldSize: 1})
			ctx := clCtx(t, 10*time.Second)
			numKeys := func(want int64) {
				t.Helper()
				if got := clMust(c.NumKeys(ctx))(t); got != want {
					t.Fatalf("NumKeys = %d, want %d", got, want)
				}
			}
			numKeys(1)
			if got := clMust(c.JoinedClients(ctx))(t); got != 1 {
				t.Fatalf("JoinedClients = %d, want 1", got)
			}
			for range 3 {
				clMust(c.Add(ctx, "key", 1))(t)
			}
			clOK(t, c.Set(ctx, "key0", []byte("v")))
			clMust(c.Add(ctx, "key3", 1))(t)
			clOK(t, c.Set(ctx, "key1", []byte("v")))
			numKeys(5)
			if !clMust(c.Delete(ctx, "key"))(t) {
				t.Fatal("Delete(key) = false, want true")
			}
			numKeys(4)
			if clMust(c.Delete(ctx, "key"))(t) {
				t.Fatal("second Delete(key) = true, want false")
			}
			clMust(c.Delete(ctx, "key0"))(t)
			clMust(c.Delete(ctx, "key3"))(t)
			numKeys(2)
			clOK(t, c.Set(ctx, "key4", []byte("v")))
			numKeys(3)
		})
	}
}

// TestClientKeyPrefix checks what the server stores: "/"+key for user
// keys (even one named "init/", as in c10d), the join counter raw — the
// layout PyTorch's clients use.
func TestClientKeyPrefix(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen, WorldSize: 2})
			ctx := clCtx(t, 5*time.Second)
			clOK(t, c.Set(ctx, "foo", []byte("bar")))
			clOK(t, c.Set(ctx, "init/", []byte("user")))
			clMust(c.NumKeys(ctx))(t) // a round trip: the SETs were handled
			for key, want := range map[string]string{"/foo": "bar", "init/": "1", "/init/": "user"} {
				v, ok, err := srv.Storage().Get([]byte(key))
				if err != nil || !ok || string(v) != want {
					t.Errorf("server key %q = %q, %v, %v; want %q", key, v, ok, err, want)
				}
			}
		})
	}
}

func TestClientAppend(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx := clCtx(t, 10*time.Second)
			clOK(t, c.Set(ctx, "foo", []byte("po")))
			clOK(t, c.Append(ctx, "foo", []byte("tato")))
			clOK(t, c.Append(ctx, "bar", []byte("po")))
			clOK(t, c.Append(ctx, "bar", []byte("tato")))
			clOK(t, c.Append(ctx, "empty", nil))
			// c10d's fallback loses the second append here: the key
			// already holds exactly the value appended.
			clOK(t, c.Append(ctx, "twice", []byte("ab")))
			clOK(t, c.Append(ctx, "twice", []byte("ab")))
			clWantValue(t, c, "foo", "potato")
			clWantValue(t, c, "bar", "potato")
			clWantValue(t, c, "empty", "")
			clWantValue(t, c, "twice", "abab")
		})
	}
}

// TestClientAppendConcurrent makes the old generation's COMPARE_SET loop
// retry: every append must land exactly once.
func TestClientAppendConcurrent(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			const clients, appends = 8, 20
			var wg sync.WaitGroup
			errs := make(chan error, clients)
			for i := range clients {
				c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
				wg.Go(func() {
					ctx := clCtx(t, 10*time.Second)
					for range appends {
						if err := c.Append(ctx, "log", []byte{byte('a' + i)}); err != nil {
							errs <- err
							return
						}
					}
					// APPEND has no reply; a round trip on the same
					// connection makes sure the server has them all.
					if _, err := c.NumKeys(ctx); err != nil {
						errs <- err
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			got := clMust(c.Get(clCtx(t, 5*time.Second), "log"))(t)
			for i := range clients {
				if n := bytes.Count(got, []byte{byte('a' + i)}); n != appends {
					t.Errorf("client %d's byte appears %d times, want %d", i, n, appends)
				}
			}
		})
	}
}

func TestClientMulti(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx := clCtx(t, 10*time.Second)
			clOK(t, c.MultiSet(ctx, []string{"foo", "bar", "nil"}, [][]byte{[]byte("po"), []byte("tato"), nil}))
			got := clMust(c.MultiGet(ctx, "bar", "foo", "nil"))(t)
			if want := [][]byte{[]byte("tato"), []byte("po"), {}}; !slices.EqualFunc(got, want, bytes.Equal) {
				t.Fatalf("MultiGet = %q, want %q", got, want)
			}
			clIs(t, c.MultiSet(ctx, []string{"a"}, nil), rendezvous.ErrInvalidArgument)
			if got := clMust(c.MultiGet(ctx))(t); len(got) != 0 {
				t.Fatalf("MultiGet() = %q, want nothing", got)
			}

			// MultiGet waits for every key.
			done := make(chan error, 1)
			go func() {
				_, err := c.MultiGet(ctx, "foo", "late")
				done <- err
			}()
			other := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			time.Sleep(50 * time.Millisecond)
			select {
			case err := <-done:
				t.Fatalf("MultiGet returned before the key existed: %v", err)
			default:
			}
			clOK(t, other.Set(ctx, "late", []byte("x")))
			clOK(t, <-done)
		})
	}
}

func TestClientListKeys(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{WorldSize: 1})
	ctx := clCtx(t, 5*time.Second)
	clOK(t, c.MultiSet(ctx, []string{"a", "b/c", ""}, [][]byte{nil, nil, nil}))
	clOK(t, srv.Storage().Set([]byte("raw"), nil)) // not a c10d client key
	got := clMust(c.ListKeys(ctx))(t)
	slices.Sort(got)
	if want := []string{"", "a", "b/c"}; !slices.Equal(got, want) {
		t.Fatalf("ListKeys = %q, want %q (no init/, no raw)", got, want)
	}
}

// TestClientOldGenUnsupported: what PyTorch ≤2.0 servers lack fails at
// once, without touching the connection.
func TestClientOldGenUnsupported(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{Wire: GenOld})
	ctx := clCtx(t, 5*time.Second)
	for name, op := range map[string]func() error{
		"ListKeys":  func() error { _, err := c.ListKeys(ctx); return err },
		"QueuePush": func() error { return c.QueuePush(ctx, "q", nil) },
		"QueuePop":  func() error { _, err := c.QueuePop(ctx, "q", false); return err },
		"QueueLen":  func() error { _, err := c.QueueLen(ctx, "q"); return err },
		"Barrier":   func() error { return c.Barrier(ctx, "b", 1) },
	} {
		err := op()
		clIs(t, err, rendezvous.ErrNotSupported)
		if !strings.Contains(err.Error(), "old wire generation") {
			t.Errorf("%s: error %q does not name the generation", name, err)
		}
	}
	clOK(t, c.Set(ctx, "still", []byte("fine")))
	clWantValue(t, c, "still", "fine")
	if n := srv.Stats().Accepted; n != 1 {
		t.Fatalf("server accepted %d connections, want 1", n)
	}
}

func TestClientQueues(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{})
	ctx := clCtx(t, 10*time.Second)

	for _, v := range []string{"1", "2", "3"} {
		clOK(t, c.QueuePush(ctx, "q", []byte(v)))
	}
	if n := clMust(c.QueueLen(ctx, "q"))(t); n != 3 {
		t.Fatalf("QueueLen = %d, want 3", n)
	}
	for _, want := range []string{"1", "2", "3"} {
		if got := clMust(c.QueuePop(ctx, "q", false))(t); string(got) != want {
			t.Fatalf("QueuePop = %q, want %q", got, want)
		}
	}
	_, err := c.QueuePop(ctx, "q", false)
	clIs(t, err, rendezvous.ErrQueueEmpty)
	if n := clMust(c.QueueLen(ctx, "unknown"))(t); n != 0 {
		t.Fatalf("QueueLen(unknown) = %d, want 0", n)
	}

	// A blocking pop is released by another client's push.
	got := make(chan string, 1)
	go func() {
		v, err := c.QueuePop(ctx, "jobs", true)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(v)
	}()
	time.Sleep(50 * time.Millisecond)
	other := clDial(t, srv.Addr().String(), ClientConfig{})
	clOK(t, other.QueuePush(ctx, "jobs", []byte("job-1")))
	select {
	case v := <-got:
		if v != "job-1" {
			t.Fatalf("blocking QueuePop = %q, want job-1", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("blocking QueuePop not released by a push")
	}

	// A blocking pop on an empty queue times out like a wait, and the
	// client goes on working.
	_, err = c.QueuePop(clCtx(t, 100*time.Millisecond), "jobs", true)
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	clOK(t, c.QueuePush(ctx, "jobs", []byte("job-2")))
	if v := clMust(c.QueuePop(ctx, "jobs", true))(t); string(v) != "job-2" {
		t.Fatalf("QueuePop after a timeout = %q, want job-2", v)
	}
}

func TestClientBarrier(t *testing.T) {
	srv := clServer(t)
	const n = 4
	clients := make([]*Client, n)
	for i := range clients {
		clients[i] = clDial(t, srv.Addr().String(), ClientConfig{})
	}
	ctx := clCtx(t, 10*time.Second)
	errs := make(chan error, n)
	for _, c := range clients[:n-1] {
		go func() { errs <- c.Barrier(ctx, "b", n) }()
	}
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-errs:
		t.Fatalf("Barrier returned with %d of %d clients: %v", n-1, n, err)
	default:
	}
	clOK(t, clients[n-1].Barrier(ctx, "b", n))
	for range n - 1 {
		clOK(t, <-errs)
	}
	// The counter keeps its value: the same barrier passes at once.
	clOK(t, clients[0].Barrier(clCtx(t, time.Second), "b", n))
	clWantValue(t, clients[0], "b", "5")

	err := clients[0].Barrier(clCtx(t, 100*time.Millisecond), "lonely", 2)
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	clTimeoutWording(t, err, "barrier", "")
	clIs(t, clients[0].Barrier(ctx, "x", 0), rendezvous.ErrInvalidArgument)
}

func TestClientWaitReleasedBySet(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			waiter := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			setter := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx := clCtx(t, 10*time.Second)
			got := make(chan []byte, 1)
			errc := make(chan error, 1)
			go func() {
				v, err := waiter.Get(ctx, "key1")
				errc <- err
				got <- v
			}()
			time.Sleep(50 * time.Millisecond)
			clOK(t, setter.Set(ctx, "key1", []byte("value1")))
			clOK(t, <-errc)
			if v := <-got; string(v) != "value1" {
				t.Fatalf("Get = %q, want value1", v)
			}
			clOK(t, waiter.Wait(ctx, "key1"))
			clOK(t, waiter.Wait(ctx))
		})
	}
}

// TestClientWaitTimeout: a wait that runs out of time reports c10d's
// message and leaves the client usable — on the same connection on the new
// generation (PyTorch's test_tcp_store_timeout_doest_break_client), on a
// new one on the old generation, which has no CANCEL_WAIT.
func TestClientWaitTimeout(t *testing.T) {
	for _, tc := range []struct {
		gen         Generation
		connections int64
	}{{GenNew, 1}, {GenOld, 2}} {
		t.Run(tc.gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: tc.gen, WorldSize: 1})

			// Bounded by the context's deadline.
			start := time.Now()
			err := c.Wait(clCtx(t, 100*time.Millisecond), "the_key", "other")
			clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
			if d := time.Since(start); d > time.Second {
				t.Fatalf("Wait took %v with a 100ms deadline", d)
			}
			clTimeoutWording(t, err, "wait", ", keys: [/the_key /other]")

			// The abandoned wait must not answer a later request.
			ctx := clCtx(t, 5*time.Second)
			clOK(t, c.Set(ctx, "the_key", []byte("v")))
			clOK(t, c.Set(ctx, "other", []byte("w")))
			clWantValue(t, c, "the_key", "v")
			if n := clMust(c.Add(ctx, "n", 7))(t); n != 7 {
				t.Fatalf("Add after a timed-out wait = %d, want 7", n)
			}
			if got := srv.Stats().Accepted; got != tc.connections {
				t.Fatalf("server accepted %d connections, want %d", got, tc.connections)
			}
			// A reconnect does not count the client in init/ again.
			if n := clMust(c.JoinedClients(ctx))(t); n != 1 {
				t.Fatalf("init/ = %d after a reconnect, want 1", n)
			}
		})
	}
}

// TestClientTimeoutConfig: with no deadline on the context, the
// configured Timeout bounds a Get (PyTorch's test_tcp_store_timeout_set).
func TestClientTimeoutConfig(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{})
	c2, err := Dial(clCtx(t, 5*time.Second), srv.Addr().String(), ClientConfig{Timeout: 100 * time.Millisecond})
	clOK(t, err)
	defer c2.Close()
	_, err = c2.Get(context.Background(), "nonexistent key")
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	if want := "wait timeout after 100ms, keys: [/nonexistent key]"; !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not contain %q", err, want)
	}
	clOK(t, c.Set(clCtx(t, time.Second), "nonexistent key", []byte("now")))
	clWantValue(t, c2, "nonexistent key", "now")
}

// TestClientCancelUnblocks: cancelling the context of a blocked operation
// returns it promptly.
func TestClientCancelUnblocks(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			ctx, cancel := context.WithCancel(t.Context())
			errc := make(chan error, 1)
			go func() { errc <- c.Wait(ctx, "never") }()
			time.Sleep(50 * time.Millisecond)
			cancel()
			cancelled := time.Now()
			select {
			case err := <-errc:
				if d := time.Since(cancelled); d > 100*time.Millisecond {
					t.Errorf("Wait returned %v after the cancel", d)
				}
				clIs(t, err, rendezvous.ErrTimeout, context.Canceled)
			case <-time.After(2 * time.Second):
				t.Fatal("Wait not unblocked by cancel")
			}
			clOK(t, c.Set(clCtx(t, time.Second), "after", nil))

			// A call queued behind a blocked one gives up with its own
			// context.
			blocked, stop := context.WithCancel(t.Context())
			go func() { errc <- c.Wait(blocked, "never") }()
			time.Sleep(20 * time.Millisecond)
			_, err := c.NumKeys(clCtx(t, 50*time.Millisecond))
			clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
			stop()
			clIs(t, <-errc, context.Canceled)

			// A context that is already done fails before any I/O.
			_, err = c.Add(ctx, "x", 1)
			clIs(t, err, rendezvous.ErrTimeout, context.Canceled)
		})
	}
}

// TestClientQueuedCallTimesOut: a call queued behind a blocked one is
// bounded by Timeout when its context has no deadline.
func TestClientQueuedCallTimesOut(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{Timeout: 200 * time.Millisecond})
	blocked, stop := context.WithTimeout(t.Context(), 5*time.Second) // overrides Timeout
	errc := make(chan error, 1)
	go func() { errc <- c.Wait(blocked, "never") }()
	time.Sleep(20 * time.Millisecond)
	start := time.Now()
	_, err := c.NumKeys(context.Background())
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	if d := time.Since(start); d < 150*time.Millisecond || d > time.Second {
		t.Errorf("queued NumKeys gave up after %v, want about 200ms", d)
	}
	stop()
	clIs(t, <-errc, context.Canceled)
	clMust(c.NumKeys(context.Background()))(t)
}

// TestClientConcurrentAdds: many clients, and many goroutines sharing
// one client, add to one counter; the total is exact.
func TestClientConcurrentAdds(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			const goroutines, adds = 64, 50
			shared := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			var wg sync.WaitGroup
			errs := make(chan error, goroutines)
			for i := range goroutines {
				c := shared
				if i%2 == 0 {
					c = clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
				}
				wg.Go(func() {
					ctx := clCtx(t, 20*time.Second)
					for range adds {
						if _, err := c.Add(ctx, "counter", 1); err != nil {
							errs <- err
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			if n := clMust(shared.Add(clCtx(t, time.Second), "counter", 0))(t); n != goroutines*adds {
				t.Fatalf("counter = %d, want %d", n, goroutines*adds)
			}
		})
	}
}

func TestClientClose(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen})
			errc := make(chan error, 1)
			go func() { errc <- c.Wait(clCtx(t, 10*time.Second), "never") }()
			time.Sleep(50 * time.Millisecond)
			clOK(t, c.Close())
			select {
			case err := <-errc:
				clIs(t, err, rendezvous.ErrClosed)
			case <-time.After(2 * time.Second):
				t.Fatal("Close did not interrupt a blocked Wait")
			}
			clOK(t, c.Close())
			clIs(t, c.Set(clCtx(t, time.Second), "k", nil), rendezvous.ErrClosed)
			_, err := c.Get(clCtx(t, time.Second), "k")
			clIs(t, err, rendezvous.ErrClosed)
		})
	}
}

// TestClientServerRestart: a server that goes away fails the operation in
// flight with ErrUnavailable; once it is back, the next operation
// reconnects.
func TestClientServerRestart(t *testing.T) {
	for _, gen := range clGens {
		t.Run(gen.String(), func(t *testing.T) {
			srv := clServer(t)
			addr := srv.Addr().String()
			c := clDial(t, addr, ClientConfig{Wire: gen, ConnectBackoffMin: 10 * time.Millisecond})
			errc := make(chan error, 1)
			go func() { errc <- c.Wait(clCtx(t, 10*time.Second), "never") }()
			time.Sleep(50 * time.Millisecond)
			srv.Close()
			select {
			case err := <-errc:
				clIs(t, err, rendezvous.ErrUnavailable)
			case <-time.After(2 * time.Second):
				t.Fatal("Wait not failed by the server going away")
			}

			srv2, err := Listen(addr, ServerConfig{})
			if err != nil {
				t.Skipf("cannot listen on %s again: %v", addr, err)
			}
			defer srv2.Close()
			ctx := clCtx(t, 5*time.Second)
			clOK(t, c.Set(ctx, "back", []byte("yes")))
			clWantValue(t, c, "back", "yes")
		})
	}
}

// TestClientDialRetry: Dial keeps trying until the server exists.
func TestClientDialRetry(t *testing.T) {
	addr := clFreeAddr(t)
	time.AfterFunc(300*time.Millisecond, func() {
		srv, err := Listen(addr, ServerConfig{})
		if err != nil {
			t.Errorf("Listen: %v", err)
			return
		}
		t.Cleanup(func() { srv.Close() })
	})
	start := time.Now()
	c, err := Dial(clCtx(t, 5*time.Second), addr, ClientConfig{WorldSize: 1})
	clOK(t, err)
	defer c.Close()
	if d := time.Since(start); d < 250*time.Millisecond || d > 2*time.Second {
		t.Fatalf("Dial returned after %v, want soon after the server started at 300ms", d)
	}
	if n := clMust(c.JoinedClients(clCtx(t, time.Second)))(t); n != 1 {
		t.Fatalf("init/ = %d, want 1", n)
	}
}

func TestClientDialTimeout(t *testing.T) {
	addr := clFreeAddr(t)
	for _, tc := range []struct {
		name string
		dial func() error
	}{
		{"Timeout", func() error {
			_, err := Dial(t.Context(), addr, ClientConfig{Timeout: time.Second})
			return err
		}},
		{"ctx deadline", func() error {
			_, err := Dial(clCtx(t, time.Second), addr, ClientConfig{})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			err := tc.dial()
			if d := time.Since(start); d > 1500*time.Millisecond {
				t.Errorf("Dial took %v with a 1s timeout", d)
			}
			clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
			for _, want := range []string{"connect to " + addr, "timeout after 1s", "connection refused"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
		})
	}
}

func TestClientDialBadAddress(t *testing.T) {
	_, err := Dial(t.Context(), "no-port", ClientConfig{Timeout: time.Second})
	clIs(t, err, rendezvous.ErrInvalidArgument)
	_, err = Dial(t.Context(), "127.0.0.1:1", ClientConfig{Wire: Generation(7)})
	clIs(t, err, rendezvous.ErrInvalidArgument)

	// A failed name lookup is retried, as c10d does, and the error says so.
	_, err = Dial(t.Context(), "store.invalid:29500", ClientConfig{Timeout: 300 * time.Millisecond})
	clIs(t, err, rendezvous.ErrTimeout)
	if !strings.Contains(err.Error(), "name lookup") {
		t.Errorf("error %q does not mention the name lookup", err)
	}
}

// clFreeAddr returns a loopback address that nothing listens on (at the
// moment).
func clFreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func BenchmarkClient(b *testing.B) {
	srv := clServer(b)
	c := clDial(b, srv.Addr().String(), ClientConfig{})
	ctx := context.Background()
	value := []byte("value")
	for _, bc := range []struct {
		name string
		op   func() error
	}{
		{"Set", func() error { return c.Set(ctx, "k", value) }},
		{"Add", func() error { _, err := c.Add(ctx, "n", 1); return err }},
		{"Get", func() error { _, err := c.Get(ctx, "k"); return err }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := bc.op(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func ExampleDial() {
	srv, err := Listen("127.0.0.1:0", ServerConfig{})
	if err != nil {
		panic(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, srv.Addr().String(), ClientConfig{WorldSize: 1})
	if err != nil {
		panic(err)
	}
	defer c.Close()
	n, _ := c.Add(ctx, "counter", 2)
	_ = c.Set(ctx, "greeting", []byte("hello"))
	v, _ := c.Get(ctx, "greeting")
	fmt.Println(n, string(v))
	// Output: 2 hello
}

// TestClientCloseDuringReconnect: Close ends a reconnect's backoff at
// once.
func TestClientCloseDuringReconnect(t *testing.T) {
	srv := clServer(t)
	c := clDial(t, srv.Addr().String(), ClientConfig{Timeout: 30 * time.Second, ConnectBackoffMin: time.Second})
	srv.Close()
	_, err := c.NumKeys(clCtx(t, 5*time.Second)) // finds the connection gone
	clIs(t, err, rendezvous.ErrUnavailable)
	errc := make(chan error, 1)
	go func() { _, err := c.NumKeys(context.Background()); errc <- err }()
	time.Sleep(100 * time.Millisecond)
	c.Close()
	select {
	case err := <-errc:
		clIs(t, err, rendezvous.ErrClosed)
	case <-time.After(time.Second):
		t.Fatal("Close did not end the reconnect")
	}
}

// TestClientConfirmWrites: with ConfirmWrites a write the server refuses
// (it closes the connection: here a key over its 1 KiB limit) fails with
// ErrHungUp instead of returning nil; an accepted one returns nil and is
// stored; and the client reconnects for the next operation.
func TestClientConfirmWrites(t *testing.T) {
	srv, err := Listen("127.0.0.1:0", ServerConfig{Limits: Limits{MaxKeySize: 1 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	long := strings.Repeat("k", 2<<10)
	writes := []struct {
		name string
		new  bool // new wire generation only
		fn   func(ctx context.Context, c *Client, key string) error
	}{
		{"set", false, func(ctx context.Context, c *Client, key string) error { return c.Set(ctx, key, []byte("v")) }},
		{"multi_set", false, func(ctx context.Context, c *Client, key string) error {
			return c.MultiSet(ctx, []string{key + "/m"}, [][]byte{[]byte("v")})
		}},
		{"append", true, func(ctx context.Context, c *Client, key string) error { return c.Append(ctx, key, []byte("v")) }},
		{"queue_push", true, func(ctx context.Context, c *Client, key string) error { return c.QueuePush(ctx, key, []byte("v")) }},
	}
	for _, gen := range clGens {
		for _, w := range writes {
			if w.new && gen != GenNew {
				continue
			}
			t.Run(gen.String()+"/"+w.name, func(t *testing.T) {
				c := clDial(t, srv.Addr().String(), ClientConfig{Wire: gen, ConfirmWrites: true})
				ctx := clCtx(t, 10*time.Second)
				clIs(t, w.fn(ctx, c, long), ErrHungUp, rendezvous.ErrUnavailable)
				key := "ok/" + gen.String() + "/" + w.name
				clOK(t, w.fn(ctx, c, key))
				if w.name != "queue_push" {
					if w.name == "multi_set" {
						key += "/m"
					}
					clWantValue(t, c, key, "v")
				} else if n := clMust(c.QueueLen(ctx, key))(t); n != 1 {
					t.Fatalf("queue length %d after a confirmed push", n)
				}
			})
		}
	}
}
