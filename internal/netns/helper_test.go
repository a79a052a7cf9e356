package netns

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/internal/testutil"
)

// envHelper makes the test binary a helper program (helperMain) instead of
// a test run: tests start it inside a host to act there.
const envHelper = "GORUN_NETNS_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(envHelper) == "1" {
		os.Exit(helperMain(os.Args[1:]))
	}
	// The tests' orphans (processes whose parent exits at once, which only
	// a namespace-wide kill ends) become this process's children, so that
	// gone can reap them: an init that does not reap (some containers')
	// would otherwise collect a zombie for each.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, "netns tests: PR_SET_CHILD_SUBREAPER:", err)
		os.Exit(1)
	}
	goleak.VerifyTestMain(m)
}

// helperMain runs one helper program:
//
//	serve ADDR          echo every byte back on each connection; prints "listening"
//	client ADDR         act on commands from stdin, one reply line each:
//	                      dial TIMEOUT   connect to ADDR
//	                      rt TIMEOUT     send a numbered line, wait for its echo
//	                      write TIMEOUT  send 1 KiB without waiting for anything
//	                    replies: "ok", "timeout" (a deadline passed, no error
//	                    came) or "err: …"
//	addrs               print "name addr" for every interface address
//	etcd-get URL KEY    print KEY's value, read through etcd's JSON gateway
func helperMain(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "helper: no mode")
		return 2
	}
	var err error
	switch args[0] {
	case "serve":
		err = serve(args[1])
	case "client":
		err = client(args[1], os.Stdin, os.Stdout)
	case "addrs":
		err = printAddrs()
	case "etcd-get":
		err = etcdGet(args[1], args[2])
	default:
		err = fmt.Errorf("unknown mode %q", args[0])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 1
	}
	return 0
}

func serve(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening", ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() { io.Copy(c, c); c.Close() }()
	}
}

func client(addr string, in io.Reader, out io.Writer) error {
	var (
		conn    net.Conn
		r       *bufio.Reader
		pending string // a line cut off by a deadline
		seq     int
	)
	reply := func(err error) {
		switch {
		case err == nil:
			fmt.Fprintln(out, "ok")
		case errors.Is(err, os.ErrDeadlineExceeded):
			fmt.Fprintln(out, "timeout")
		default:
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				fmt.Fprintln(out, "timeout")
				return
			}
			fmt.Fprintln(out, "err:", err)
		}
	}
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		verb, arg, _ := strings.Cut(sc.Text(), " ")
		timeout, err := time.ParseDuration(arg)
		if err != nil {
			return fmt.Errorf("command %q: %w", sc.Text(), err)
		}
		if verb != "dial" && conn == nil {
			reply(errors.New("not connected"))
			continue
		}
		deadline := time.Now().Add(timeout)
		switch verb {
		case "dial":
			c, err := net.DialTimeout("tcp", addr, timeout)
			if err == nil {
				conn, r = c, bufio.NewReader(c)
			}
			reply(err)
		case "rt":
			seq++
			want := fmt.Sprintf("seq %d\n", seq)
			conn.SetDeadline(deadline)
			if _, err := io.WriteString(conn, want); err != nil {
				reply(err)
				continue
			}
			// Echoes of earlier lines (a stalled rt, a write) come first.
			for {
				line, err := r.ReadString('\n')
				pending += line
				if err != nil {
					reply(err)
					break
				}
				got := pending
				pending = ""
				if got == want {
					reply(nil)
					break
				}
			}
		case "write":
			conn.SetWriteDeadline(deadline)
			_, err := io.WriteString(conn, "fill "+strings.Repeat("x", 1024)+"\n")
			reply(err)
		default:
			return fmt.Errorf("unknown command %q", sc.Text())
		}
	}
	return sc.Err()
}

func printAddrs() error {
	ifs, err := net.Interfaces()
	if err != nil {
		return err
	}
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			return err
		}
		for _, a := range addrs {
			fmt.Println(ifc.Name, a.(*net.IPNet).IP)
		}
	}
	return nil
}

func etcdGet(endpoint, key string) error {
	body, _ := json.Marshal(map[string]string{"key": base64.StdEncoding.EncodeToString([]byte(key))})
	hc := http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Post(endpoint+"/v3/kv/range", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var rr struct {
		Kvs []struct {
			Value []byte `json:"value"` // base64 in JSON, decoded by encoding/json
		} `json:"kvs"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rr); err != nil {
		return fmt.Errorf("%s: %w", resp.Status, err)
	}
	if len(rr.Kvs) != 1 {
		return fmt.Errorf("%d values for %q", len(rr.Kvs), key)
	}
	fmt.Println(string(rr.Kvs[0].Value))
	return nil
}

// helper is a helper program running on a host.
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines *lineWriter
	errs  *testutil.SyncBuffer
}

// startHelper starts the helper program on h; the test's cleanup ends it.
func startHelper(t *testing.T, h *Host, args ...string) *helper {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	cmd := h.Command(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), envHelper+"=1")
	p := &helper{cmd: cmd, lines: newLineWriter(), errs: &testutil.SyncBuffer{}}
	cmd.Stdout, cmd.Stderr = p.lines, p.errs
	var err error
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		cmd.Process.Kill()
		cmd.Wait()
	})
	return p
}

// do sends a command and returns the helper's reply line.
func (p *helper) do(t *testing.T, command string) string {
	t.Helper()
	if _, err := io.WriteString(p.stdin, command+"\n"); err != nil {
		t.Fatalf("helper %q: %v\n%s", command, err, p.errs)
	}
	return p.next(t, 30*time.Second)
}

// next returns the helper's next output line.
func (p *helper) next(t *testing.T, timeout time.Duration) string {
	t.Helper()
	select {
	case l := <-p.lines.c:
		return l
	case <-time.After(timeout):
		t.Fatalf("helper %v: no output in %v\nstderr: %s", p.cmd.Args, timeout, p.errs)
		return ""
	}
}

// lineWriter hands a process's output to the test line by line: exec's own
// copying goroutine writes, so there is no reader of ours to end.
type lineWriter struct {
	mu  sync.Mutex
	buf []byte
	c   chan string
}

func newLineWriter() *lineWriter { return &lineWriter{c: make(chan string, 1024)} }

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		select {
		case w.c <- string(w.buf[:i]):
		default: // nobody reads this much; drop rather than block the process
		}
		w.buf = w.buf[i+1:]
	}
}
