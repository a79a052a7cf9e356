package tcpstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// Byte-level tests: a scripted fake server checks exactly what the Client
// sends and answers what the test says. Expected bytes are written out by
// hand from spec/c10d-wire.md rather than built with the package's
// encoders, so the encoders are checked too.

// clFakeServer hands each accepted connection to the test.
type clFakeServer struct {
	addr  string
	conns chan net.Conn
}

func clFake(t testing.TB) *clFakeServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &clFakeServer{addr: ln.Addr().String(), conns: make(chan net.Conn, 16)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			f.conns <- nc
		}
	})
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
		close(f.conns)
		for nc := range f.conns {
			nc.Close()
		}
	})
	return f
}

// accept returns the next connection the client made.
func (f *clFakeServer) accept(t testing.TB) *clPeer {
	t.Helper()
	select {
	case nc := <-f.conns:
		t.Cleanup(func() { nc.Close() })
		return &clPeer{t: t, nc: nc}
	case <-time.After(5 * time.Second):
		t.Fatal("the client did not connect")
		return nil
	}
}

// clPeer is the fake server's end of one connection.
type clPeer struct {
	t  testing.TB
	nc net.Conn
}

// expect reads exactly the bytes of want (hex, spaces ignored) and fails
// the test if they differ.
func (p *clPeer) expect(want string) {
	p.t.Helper()
	w := clHex(p.t, want)
	got := make([]byte, len(w))
	p.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(p.nc, got); err != nil {
		p.t.Fatalf("reading %d bytes (want % x): %v; got % x", len(w), w, err, got)
	}
	if !bytes.Equal(got, w) {
		p.t.Fatalf("client sent\n  % x\nwant\n  % x", got, w)
	}
}

// expectClosed checks that the client closes the connection without
// sending anything more.
func (p *clPeer) expectClosed() {
	p.t.Helper()
	p.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	var b [1]byte
	if n, err := p.nc.Read(b[:]); err != io.EOF {
		p.t.Fatalf("read %d bytes (% x), %v; want the client to close", n, b[:n], err)
	}
}

func (p *clPeer) reply(h string) {
	p.t.Helper()
	if _, err := p.nc.Write(clHex(p.t, h)); err != nil {
		p.t.Fatal(err)
	}
}

// handshake expects the new generation's VALIDATE and PING and echoes the
// nonce.
func (p *clPeer) handshake() {
	p.t.Helper()
	p.expect("00 cef7853c 0d" + clPid())
	p.reply(clPid())
}

func clHex(t testing.TB, h string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(h, " ", ""))
	if err != nil {
		t.Fatalf("bad hex %q: %v", h, err)
	}
	return b
}

// clPid is the PING nonce: the pid as a little-endian u32, in hex.
func clPid() string {
	return hex.EncodeToString(binary.LittleEndian.AppendUint32(nil, uint32(os.Getpid())))
}

// clAsync runs fn beside the fake server's script.
func clAsync(fn func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	return done
}

func clDone(t testing.TB, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the client did not finish")
	}
}

// TestClientWireOld replays spec §2.1's captures of PyTorch 1.13's client.
func TestClientWireOld(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	done := clAsync(func() error {
		c, err := Dial(ctx, f.addr, ClientConfig{Wire: GenOld, WorldSize: 2})
		if err != nil {
			return err
		}
		defer c.Close()
		if err := c.Set(ctx, "k1", []byte("v1")); err != nil {
			return err
		}
		if v, err := c.Get(ctx, "k1"); err != nil || string(v) != "v1" {
			return errors.Join(errors.New("Get(k1) = "+string(v)), err)
		}
		if n, err := c.NumKeys(ctx); err != nil || n != 3 {
			return errors.Join(errors.New("NumKeys is wrong"), err)
		}
		if ok, err := c.Delete(ctx, "k1"); err != nil || !ok {
			return errors.Join(errors.New("Delete(k1) = false"), err)
		}
		return c.MultiSet(ctx, []string{"a", "b"}, [][]byte{[]byte("1"), []byte("2")})
	})
	p := f.accept(t)
	p.expect("03 0500000000000000 696e69742f 0100000000000000") // ADD init/ 1, no handshake
	p.reply("0200000000000000")
	p.expect("00 0300000000000000 2f6b31 0200000000000000 7631") // SET /k1 v1
	p.expect("05 0100000000000000 0300000000000000 2f6b31")      // WAIT 1 key /k1
	p.reply("00")                                                // STOP_WAITING
	p.expect("02 0300000000000000 2f6b31")                       // GET /k1
	p.reply("0200000000000000 7631")
	p.expect("06") // GETNUMKEYS
	p.reply("0300000000000000")
	p.expect("08 0300000000000000 2f6b31") // DELETE_KEY /k1
	p.reply("0100000000000000")
	// MULTI_SET emulated: two SETs.
	p.expect("00 0200000000000000 2f61 0100000000000000 31 00 0200000000000000 2f62 0100000000000000 32")
	clDone(t, done)
	p.expectClosed()
}

// TestClientWireNew checks the new generation's handshake (spec §1.3:
// VALIDATE, PING with the pid, then ADD init/ 1) and opcodes.
func TestClientWireNew(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	done := clAsync(func() error {
		c, err := Dial(ctx, f.addr, ClientConfig{WorldSize: 4})
		if err != nil {
			return err
		}
		defer c.Close()
		if err := c.Set(ctx, "k1", []byte("v1")); err != nil {
			return err
		}
		if v, err := c.MultiGet(ctx, "k1", "k2"); err != nil || string(v[0]) != "v1" || string(v[1]) != "" {
			return errors.Join(errors.New("MultiGet is wrong"), err)
		}
		if err := c.Barrier(ctx, "b", 2); err != nil {
			return err
		}
		keys, err := c.ListKeys(ctx)
		if err != nil || len(keys) != 1 || keys[0] != "k1" {
			return errors.Join(errors.New("ListKeys = "+strings.Join(keys, ",")), err)
		}
		return nil
	})
	p := f.accept(t)
	p.expect("00 cef7853c")                                     // VALIDATE, magic 0x3C85F7CE
	p.expect("0d" + clPid())                                    // PING, nonce = pid
	p.reply(clPid())                                            // echo
	p.expect("04 0500000000000000 696e69742f 0100000000000000") // ADD init/ 1
	p.reply("0100000000000000")
	p.expect("01 0300000000000000 2f6b31 0200000000000000 7631") // SET
	p.expect("06 0200000000000000 0300000000000000 2f6b31 0300000000000000 2f6b32")
	p.reply("00")
	p.expect("0a 0200000000000000 0300000000000000 2f6b31 0300000000000000 2f6b32") // MULTI_GET
	p.reply("0200000000000000 7631 0000000000000000")
	p.expect("12 0200000000000000 2f62 0200000000000000") // BARRIER /b 2
	p.reply("00")
	p.expect("11") // LIST_KEYS
	p.reply("0200000000000000 0300000000000000 2f6b31 0500000000000000 696e69742f")
	clDone(t, done)
}

// TestClientCancelWait scripts the server's side of the CANCEL_WAIT dance
// (spec §1.7): the plain answer, the race where STOP_WAITING comes first,
// and a nonsense answer, after which the client must reconnect — without
// counting itself in init/ again.
var waitTimeoutText = regexp.MustCompile(`wait timeout after (100|[1-9][0-9])ms, keys: \[/k\]`)

func TestClientCancelWait(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	var client *Client
	dialed := clAsync(func() (err error) {
		client, err = Dial(ctx, f.addr, ClientConfig{WorldSize: 1})
		return err
	})
	p := f.accept(t)
	p.handshake()
	p.expect("04 0500000000000000 696e69742f 0100000000000000")
	p.reply("0100000000000000")
	clDone(t, dialed)
	defer client.Close()

	const waitK = "06 0100000000000000 0200000000000000 2f6b"
	timedOutWait := func() <-chan error {
		return clAsync(func() error {
			err := client.Wait(clCtx(t, 100*time.Millisecond), "k")
			// The time is what was left of the context at the call: under
			// load a little less than the 100 ms it was made with.
			if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) ||
				!waitTimeoutText.MatchString(err.Error()) {
				return errors.New("unexpected error: " + clErrString(err))
			}
			return nil
		})
	}
	numKeys := func(want int64) <-chan error {
		return clAsync(func() error {
			n, err := client.NumKeys(ctx)
			if err != nil || n != want {
				return errors.Join(errors.New("NumKeys is wrong"), err)
			}
			return nil
		})
	}

	for _, answer := range []string{"01", "00 01"} {
		done := timedOutWait()
		p.expect(waitK)
		p.expect("0c") // CANCEL_WAIT, once the 100 ms are up
		p.reply(answer)
		clDone(t, done)
		// The stream is in step: the next reply is read as the next
		// request's.
		done = numKeys(42)
		p.expect("07")
		p.reply("2a00000000000000")
		clDone(t, done)
	}

	// A nonsense answer to CANCEL_WAIT: the connection is dropped.
	done := timedOutWait()
	p.expect(waitK)
	p.expect("0c")
	p.reply("07")
	clDone(t, done)
	p.expectClosed()

	done = numKeys(7)
	p = f.accept(t)
	p.handshake() // and no ADD init/
	p.expect("07")
	p.reply("0700000000000000")
	clDone(t, done)
}

// TestClientOldWaitTimeout: the old generation has no CANCEL_WAIT, so a
// timed-out wait costs the connection (a later STOP_WAITING would
// desynchronise it, spec §2.3); the next operation reconnects without
// ADD init/.
func TestClientOldWaitTimeout(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	done := clAsync(func() error {
		c, err := Dial(ctx, f.addr, ClientConfig{Wire: GenOld, WorldSize: 1})
		if err != nil {
			return err
		}
		defer c.Close()
		err = c.Wait(clCtx(t, 100*time.Millisecond), "k")
		if !errors.Is(err, rendezvous.ErrTimeout) {
			return errors.New("Wait: " + clErrString(err))
		}
		return c.Set(ctx, "k", nil)
	})
	p := f.accept(t)
	p.expect("03 0500000000000000 696e69742f 0100000000000000")
	p.reply("0100000000000000")
	p.expect("05 0100000000000000 0200000000000000 2f6b")
	p.expectClosed()
	p = f.accept(t)
	p.expect("00 0200000000000000 2f6b 0000000000000000") // SET, not ADD init/
	clDone(t, done)
}

// TestClientInterruptedRequest: a request whose reply never comes is cut
// short by its context; the stream is then unknown, so the next operation
// uses a new connection.
func TestClientInterruptedRequest(t *testing.T) {
	f := clFake(t)
	var client *Client
	dialed := clAsync(func() (err error) {
		client, err = Dial(clCtx(t, 5*time.Second), f.addr, ClientConfig{})
		return err
	})
	p := f.accept(t)
	p.handshake()
	clDone(t, dialed)
	defer client.Close()

	ctx, cancel := context.WithCancel(t.Context())
	done := clAsync(func() error {
		_, err := client.NumKeys(ctx)
		if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.Canceled) {
			return errors.New("NumKeys: " + clErrString(err))
		}
		return nil
	})
	p.expect("07")
	time.Sleep(20 * time.Millisecond)
	cancel()
	clDone(t, done)
	p.expectClosed()

	done = clAsync(func() error {
		_, err := client.Add(clCtx(t, 5*time.Second), "n", 1)
		return err
	})
	p = f.accept(t)
	p.handshake()
	p.expect("04 0200000000000000 2f6e 0100000000000000")
	p.reply("0100000000000000")
	clDone(t, done)
}

// TestClientBadReplies: replies outside the protocol fail the operation
// with ErrUnavailable and drop the connection.
func TestClientBadReplies(t *testing.T) {
	for _, tc := range []struct {
		name    string
		op      func(*Client) error
		request string
		reply   string
	}{
		{"CHECK answers 2", func(c *Client) error { _, err := c.Check(t.Context(), "k"); return err },
			"05 0100000000000000 0200000000000000 2f6b", "02"},
		{"WAIT answers 1", func(c *Client) error { return c.Wait(t.Context(), "k") },
			"06 0100000000000000 0200000000000000 2f6b", "01"},
		{"COMPARE_SET reply announces 2 GiB", func(c *Client) error { _, err := c.CompareSet(t.Context(), "k", nil, nil); return err },
			"02 0200000000000000 2f6b 0000000000000000 0000000000000000", "0000008000000000"},
		{"server hangs up", func(c *Client) error { _, err := c.NumKeys(t.Context()); return err },
			"07", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := clFake(t)
			done := clAsync(func() error {
				c, err := Dial(clCtx(t, 5*time.Second), f.addr, ClientConfig{Timeout: 5 * time.Second})
				if err != nil {
					return err
				}
				defer c.Close()
				if err := tc.op(c); !errors.Is(err, rendezvous.ErrUnavailable) {
					return errors.New("got " + clErrString(err) + ", want ErrUnavailable")
				}
				return nil
			})
			p := f.accept(t)
			p.handshake()
			p.expect(tc.request)
			if tc.reply == "" {
				p.nc.Close()
			} else {
				p.reply(tc.reply)
				p.expectClosed()
			}
			clDone(t, done)
		})
	}
}

// TestClientPingMismatch: a server that echoes the wrong nonce is not a
// TCPStore; Dial fails at once instead of retrying.
func TestClientPingMismatch(t *testing.T) {
	f := clFake(t)
	start := time.Now()
	done := clAsync(func() error {
		_, err := Dial(t.Context(), f.addr, ClientConfig{Timeout: 5 * time.Second})
		if !errors.Is(err, rendezvous.ErrUnavailable) || !strings.Contains(err.Error(), "ping failed") {
			return errors.New("Dial: " + clErrString(err))
		}
		return nil
	})
	p := f.accept(t)
	p.expect("00 cef7853c 0d" + clPid())
	p.reply("deadbeef")
	clDone(t, done)
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Dial took %v; a failed ping must not be retried", d)
	}
}

// TestClientHandshakeRetry: a server that hangs up during the handshake —
// what a PyTorch ≤2.0 server does to a new-generation client — is retried
// until the deadline, and the error says what probably went wrong.
func TestClientHandshakeRetry(t *testing.T) {
	f := clFake(t)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case nc := <-f.conns:
				io.ReadFull(nc, make([]byte, 10))
				nc.Close()
			case <-stop:
				return
			}
		}
	})
	defer wg.Wait()
	defer close(stop)
	_, err := Dial(t.Context(), f.addr, ClientConfig{Timeout: 500 * time.Millisecond, ConnectBackoffMin: 20 * time.Millisecond})
	clIs(t, err, rendezvous.ErrTimeout, context.DeadlineExceeded)
	if !strings.Contains(err.Error(), "PyTorch ≤2.0 servers") {
		t.Fatalf("error %q does not hint at the wire generation", err)
	}
}

// TestClientAllocs keeps the request path allocation-free: requests are
// built in a reused buffer and fixed-size replies read into a reused
// array, so only the values handed back allocate. The fake server answers
// from fixed buffers, so it adds no allocations of its own.
func TestClientAllocs(t *testing.T) {
	value := []byte("value")
	for _, tc := range []struct {
		name  string
		max   float64
		op    func(*Client) error
		steps []clStep
	}{
		{"Set", 0, func(c *Client) error { return c.Set(context.Background(), "k", value) },
			[]clStep{{24, ""}}},
		{"Add", 0, func(c *Client) error { _, err := c.Add(context.Background(), "n", 1); return err },
			[]clStep{{19, "0100000000000000"}}},
		{"Get", 1, func(c *Client) error { _, err := c.Get(context.Background(), "k"); return err },
			[]clStep{{19, "00"}, {11, "0500000000000000 76616c7565"}}},
		{"Add with a cancellable context", 3, func(c *Client) error { _, err := c.Add(t.Context(), "n", 1); return err },
			[]clStep{{19, "0100000000000000"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := clFake(t)
			var client *Client
			dialed := clAsync(func() (err error) {
				client, err = Dial(clCtx(t, 5*time.Second), f.addr, ClientConfig{})
				return err
			})
			p := f.accept(t)
			p.handshake()
			clDone(t, dialed)
			served := clAsync(func() error { return p.serve(t, tc.steps) })
			if got := testing.AllocsPerRun(200, func() {
				if err := tc.op(client); err != nil {
					t.Fatal(err)
				}
			}); got > tc.max {
				t.Errorf("%.1f allocations per op, want ≤ %v", got, tc.max)
			}
			client.Close()
			<-served
		})
	}
}

// clStep is one request of a fixed size and its canned reply.
type clStep struct {
	size  int
	reply string
}

// serve answers the steps over and over until the client hangs up.
func (p *clPeer) serve(t testing.TB, steps []clStep) error {
	replies := make([][]byte, len(steps))
	for i, s := range steps {
		replies[i] = clHex(t, s.reply)
	}
	buf := make([]byte, 256)
	p.nc.SetReadDeadline(time.Time{})
	for {
		for i, s := range steps {
			if _, err := io.ReadFull(p.nc, buf[:s.size]); err != nil {
				return nil
			}
			if len(replies[i]) > 0 {
				if _, err := p.nc.Write(replies[i]); err != nil {
					return nil
				}
			}
		}
	}
}

func clErrString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

// TestClientOldAppendKeyDeleted scripts the old generation's APPEND
// emulation through a key deleted mid-way: COMPARE_SET then answers with
// expected itself, c10d's sign of an absent key, and the loop must start
// over instead of spinning.
func TestClientOldAppendKeyDeleted(t *testing.T) {
	f := clFake(t)
	done := clAsync(func() error {
		c, err := Dial(clCtx(t, 5*time.Second), f.addr, ClientConfig{Wire: GenOld})
		if err != nil {
			return err
		}
		defer c.Close()
		return c.Append(clCtx(t, 5*time.Second), "k", []byte("v"))
	})
	probe := hex.EncodeToString([]byte("\x00gorun-append-probe\x00"))
	p := f.accept(t)
	p.expect("01 0200000000000000 2f6b 1400000000000000" + probe + "1400000000000000" + probe) // read
	p.reply("0300000000000000 616263")                                                         // "abc"
	p.expect("01 0200000000000000 2f6b 0300000000000000 616263 0400000000000000 61626376")     // abc → abcv
	p.reply("0300000000000000 616263")                                                         // expected back: deleted
	p.expect("01 0200000000000000 2f6b 0000000000000000 0100000000000000 76")                  // "" → v
	p.reply("0100000000000000 76")
	clDone(t, done)
}

func TestClientBackoff(t *testing.T) {
	b := backoff{next: 100 * time.Millisecond, max: time.Second}
	nominal := 100 * time.Millisecond
	for i := range 12 {
		d := b.delay()
		if d < nominal/2 || d >= nominal*3/2 {
			t.Fatalf("delay #%d = %v, want in [%v, %v)", i, d, nominal/2, nominal*3/2)
		}
		nominal = min(nominal*3/2, time.Second)
	}
}

// TestClientWireConfirmWrites: with ConfirmWrites a SET goes out with a
// GETNUMKEYS in the same write, and the SET returns only once it is
// answered; a server that hangs up instead fails it with ErrHungUp.
func TestClientWireConfirmWrites(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	errs := make(chan error, 2)
	go func() {
		c, err := Dial(ctx, f.addr, ClientConfig{Wire: GenOld, ConfirmWrites: true})
		if err != nil {
			errs <- err
			return
		}
		defer c.Close()
		errs <- c.Set(ctx, "k1", []byte("v1"))
		errs <- c.Set(ctx, "k2", []byte("v2"))
	}()
	p := f.accept(t)
	p.expect("00 0300000000000000 2f6b31 0200000000000000 7631 06") // SET /k1 v1, GETNUMKEYS
	select {
	case err := <-errs:
		t.Fatalf("Set returned %v before its confirmation", err)
	case <-time.After(50 * time.Millisecond):
	}
	p.reply("0100000000000000")
	if err := <-errs; err != nil {
		t.Fatalf("confirmed Set: %v", err)
	}
	p.expect("00 0300000000000000 2f6b32 0200000000000000 7632 06")
	p.nc.Close() // refused
	clIs(t, <-errs, ErrHungUp, rendezvous.ErrUnavailable)
}

// TestClientWireHugeReplyLength: a reply that announces 512 MiB and then
// ends costs the client what arrived, not what was announced.
func TestClientWireHugeReplyLength(t *testing.T) {
	f := clFake(t)
	ctx := clCtx(t, 10*time.Second)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	errs := make(chan error, 1)
	go func() {
		c, err := Dial(ctx, f.addr, ClientConfig{Wire: GenOld})
		if err != nil {
			errs <- err
			return
		}
		defer c.Close()
		_, err = c.CompareSet(ctx, "k", nil, []byte("v"))
		runtime.ReadMemStats(&after)
		errs <- err
	}()
	p := f.accept(t)
	p.expect("01 0200000000000000 2f6b 0000000000000000 0100000000000000 76")
	p.reply("0000002000000000 7631") // 512 MiB announced, 2 bytes sent
	p.nc.Close()
	clIs(t, <-errs, ErrHungUp)
	if grew := int64(after.TotalAlloc - before.TotalAlloc); grew > 64<<20 {
		t.Fatalf("the client allocated %d bytes for a reply that announced 512 MiB and sent 2", grew)
	}
}
