package main

import (
	"bufio"
	"bytes"
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/internal/testutil"
	"github.com/gorunhq/gorun/internal/torchtest"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// gorun runs the CLI in-process and returns its exit code and output.
func gorun(t *testing.T, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code = run(ctx, append([]string{"gorun"}, args...), strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

func TestStoreVerbsAgainstTCPStore(t *testing.T) {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	for _, wire := range []string{"new", "old"} {
		t.Run(wire, func(t *testing.T) {
			url := "tcp://" + srv.Addr().String()
			p := "w" + wire + "/"
			steps := []struct {
				args       []string
				stdin      string
				code       int
				stdout     string
				stderrHint string
			}{
				{args: []string{"set", p + "a", "hello"}},
				{args: []string{"get", p + "a"}, stdout: "hello"},
				{args: []string{"set", p + "b"}, stdin: "from\nstdin"},
				{args: []string{"get", p + "b"}, stdout: "from\nstdin"},
				{args: []string{"add", p + "n", "5"}, stdout: "5\n"},
				{args: []string{"add", p + "n", "-2"}, stdout: "3\n"},
				{args: []string{"cas", p + "c", "", "x"}, stdout: "x"},
				{args: []string{"cas", p + "c", "wrong", "y"}, stdout: "x"},
				{args: []string{"check", p + "a", p + "n"}, stdout: "true\n"},
				{args: []string{"check", p + "a", p + "missing"}, code: ExitFalse, stdout: "false\n"},
				{args: []string{"wait", p + "a"}},
				{args: []string{"delete", p + "a"}, stdout: "true\n"},
				{args: []string{"delete", p + "a"}, stdout: "false\n"},
				{args: []string{"get", "--timeout", "300ms", p + "a"}, code: ExitTimeout, stderrHint: "timeout"},
				{args: []string{"wait", "--timeout", "300ms", p + "never"}, code: ExitTimeout, stderrHint: "timeout"},
				{args: []string{"add", p + "n", "x"}, code: ExitUsage, stderrHint: "DELTA"},
				{args: []string{"get"}, code: ExitUsage, stderrHint: "want arguments"},
			}
			for _, st := range steps {
				args := append([]string{"store", st.args[0], "--store", url, "--wire", wire}, st.args[1:]...)
				code, out, errs := gorun(t, st.stdin, args...)
				if code != st.code || out != st.stdout {
					t.Fatalf("gorun %s: code %d stdout %q stderr %q; want code %d stdout %q",
						strings.Join(args, " "), code, out, errs, st.code, st.stdout)
				}
				if st.code != 0 && (!strings.Contains(strings.ToLower(errs), strings.ToLower(st.stderrHint)) || strings.Count(errs, "\n") != 1) {
					t.Fatalf("gorun %s: stderr %q should be one line mentioning %q", strings.Join(args, " "), errs, st.stderrHint)
				}
			}
		})
	}
	// keys and num-keys see both runs' keys.
	_, out, _ := gorun(t, "", "store", "keys", "--store", "tcp://"+srv.Addr().String())
	for _, k := range []string{"wnew/b", "wold/n", "wnew/c"} {
		if !strings.Contains(out, k+"\n") {
			t.Fatalf("keys output %q lacks %q", out, k)
		}
	}
	// num-keys counts the whole store even under --prefix, as c10d's
	// PrefixStore does: wnew/{b,n,c} and wold/{b,n,c}.
	_, out, _ = gorun(t, "", "store", "num-keys", "--store", "tcp://"+srv.Addr().String(), "--prefix", "wnew")
	if out != "6\n" {
		t.Fatalf("num-keys = %q, want 6", out)
	}
}

func TestStoreVerbsAgainstFileStore(t *testing.T) {
	path := filepath.Join(t.TempDir(), "store")
	url := "file://" + path
	if code, _, errs := gorun(t, "", "store", "set", "--store", url, "k", "v"); code != 0 {
		t.Fatalf("set: %d %s", code, errs)
	}
	if code, out, errs := gorun(t, "", "store", "add", "--store", url, "n", "7"); code != 0 || out != "7\n" {
		t.Fatalf("add: %d %q %s", code, out, errs)
	}
	if code, out, _ := gorun(t, "", "store", "get", "--store", url, "k"); code != 0 || out != "v" {
		t.Fatalf("get: %d %q", code, out)
	}
	// The toolbox must not add bookkeeping records (refcount/, cleanup/).
	if code, out, _ := gorun(t, "", "store", "num-keys", "--store", url); code != 0 || out != "2\n" {
		t.Fatalf("num-keys: %d %q, want 2", code, out)
	}
}

func TestStoreBadInput(t *testing.T) {
	cases := []struct {
		args []string
		code int
		hint string
	}{
		{[]string{"store", "get", "--store", "http://x:1", "k"}, ExitUsage, "unsupported scheme"},
		{[]string{"store", "get", "--store", "tcp://hostonly", "k"}, ExitUsage, "tcp://HOST:PORT"},
		{[]string{"store", "get", "--store", "file://relative/path", "k"}, ExitUsage, "file:///"},
		{[]string{"store", "get", "--store", "tcp://127.0.0.1:1", "--wire", "newest", "k"}, ExitUsage, "wire"},
		{[]string{"store", "get", "k"}, ExitUsage, "store"},
		{[]string{"store", "get", "--store", "tcp://127.0.0.1:1", "--timeout", "0s", "k"}, ExitUsage, "timeout"},
		{[]string{"store", "get", "--bogus-flag", "k"}, ExitUsage, "bogus"},
		{[]string{"store", "serve", "--max-key-size", "lots"}, ExitUsage, "max-key-size"},
		{[]string{"store", "serve", "--legacy-table", "3.0"}, ExitUsage, "legacy-table"},
		{[]string{"store", "serve", "--max-stored", "0"}, ExitUsage, "max-stored"},
		{[]string{"store", "serve", "--max-buffered", "lots"}, ExitUsage, "max-buffered"},
		{[]string{"--log-level", "loud", "store", "serve"}, ExitUsage, "log-level"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, _, errs := gorun(t, "", tc.args...)
			if code != tc.code || !strings.Contains(errs, tc.hint) {
				t.Fatalf("code %d stderr %q; want code %d mentioning %q", code, errs, tc.code, tc.hint)
			}
		})
	}
}

// TestStoreUnreachable: nothing listens; the verb retries until --timeout
// and then fails with one line and the timeout exit code.
func TestStoreUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	start := time.Now()
	code, _, errs := gorun(t, "", "store", "get", "--store", "tcp://"+addr, "--timeout", "500ms", "k")
	if code != ExitTimeout || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, addr) {
		t.Fatalf("code %d stderr %q; want %d and one line naming %s", code, errs, ExitTimeout, addr)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("took %v with a 500ms timeout", d)
	}
}

// TestStoreServeProcess runs `gorun store serve` as a real process: port 0
// prints the chosen address, clients work, and SIGTERM stops it with 0.
func TestStoreServeProcess(t *testing.T) {
	bin := testutil.BuildGorun(t)
	cmd := exec.Command(bin, "store", "serve", "--listen", "127.0.0.1:0")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("no address printed: %v; stderr %s", err, &stderr)
	}
	addr := strings.TrimSpace(line)
	if _, p, _ := net.SplitHostPort(addr); p == "0" || p == "" {
		t.Fatalf("printed %q, want a real port", addr)
	}
	if code, out, errs := gorun(t, "", "store", "add", "--store", "tcp://"+addr, "n", "41"); code != 0 || out != "41\n" {
		t.Fatalf("add against the served store: %d %q %s", code, out, errs)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve exited with %v after SIGTERM; stderr %s", err, &stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop on SIGTERM")
	}
}

func TestParseSize(t *testing.T) {
	cases := map[string]int{"8192": 8192, "8KiB": 8 << 10, "8 MiB": 8 << 20, "1GiB": 1 << 30, "5B": 5}
	for in, want := range cases {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "-1", "lots", "8TiB", "1.5MiB"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) accepted", bad)
		}
	}
	for _, n := range []int{8 << 10, 8 << 20, 64 << 20, 1000} {
		if got, _ := parseSize(formatSize(n)); got != n {
			t.Errorf("formatSize(%d) = %q does not round-trip", n, formatSize(n))
		}
	}
}

// TestStoreExitCodes: every exit code a store verb can return, each from
// the situation the README's table names, on both wire generations.
func TestStoreExitCodes(t *testing.T) {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	// A server with c10d's libuv key limit (8 KiB): the 8,192-character key
	// is over it once the client prepends "/".
	small, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{Limits: tcpstore.Limits{MaxKeySize: 8 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	full, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{MaxStored: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer full.Close()
	key8k := strings.Repeat("k", 8192)
	for _, wire := range []string{"new", "old"} {
		url, smallURL, fullURL := "tcp://"+srv.Addr().String(), "tcp://"+small.Addr().String(), "tcp://"+full.Addr().String()
		p := "codes-" + wire + "/"
		cases := []struct {
			name  string
			store string
			args  []string
			code  int
			hint  string // in stderr when code != 0
		}{
			{"set stores", url, []string{"set", p + "s", "abc"}, ExitOK, ""},
			{"an 8,192-character key within the default limits", url, []string{"set", p + key8k, "v"}, ExitOK, ""},
			{"check with a key missing", url, []string{"check", p + "missing"}, ExitFalse, "not every key exists"},
			{"a DELTA that is not a number", url, []string{"add", p + "n", "x"}, ExitUsage, "DELTA"},
			{"get of a key that never comes", url, []string{"get", "--timeout", "300ms", p + "never"}, ExitTimeout, "timeout"},
			{"add on a value that is not an integer", url, []string{"add", p + "s", "1"}, ExitStoreError, "refused"},
			{"set of a key over the server's limit", smallURL, []string{"set", p + key8k, "v"}, ExitStoreError, "refused"},
			{"delete of a key over the server's limit", smallURL, []string{"delete", p + key8k}, ExitStoreError, "refused"},
			{"cas of a key over the server's limit", smallURL, []string{"cas", p + key8k, "", "v"}, ExitStoreError, "refused"},
			{"set past the store's --max-stored", fullURL, []string{"set", p + "big", strings.Repeat("v", 2<<10)}, ExitStoreError, "refused"},
		}
		if wire == "old" {
			cases = append(cases, struct {
				name, store string
				args        []string
				code        int
				hint        string
			}{"keys, which the old wire has not", url, []string{"keys"}, ExitStoreError, "not supported"})
		}
		for _, tc := range cases {
			t.Run(wire+"/"+tc.name, func(t *testing.T) {
				args := append([]string{"store", tc.args[0], "--store", tc.store, "--wire", wire}, tc.args[1:]...)
				code, _, errs := gorun(t, "", args...)
				if code != tc.code {
					t.Fatalf("exit %d, want %d; stderr %q", code, tc.code, errs)
				}
				if code != 0 && (!strings.Contains(errs, tc.hint) || strings.Count(errs, "\n") != 1) {
					t.Fatalf("stderr %q should be one line mentioning %q", errs, tc.hint)
				}
			})
		}
		// What was refused was not stored; what exited 0 was.
		if small.Stats().Rejected == 0 {
			t.Fatal("the small server rejected nothing")
		}
		if keys, _ := small.Storage().Keys(); len(keys) != 0 {
			t.Fatalf("the refusing server stored %d keys", len(keys))
		}
		if code, out, errs := gorun(t, "", "store", "get", "--store", url, "--wire", wire, p+key8k); code != 0 || out != "v" {
			t.Fatalf("get of the 8,192-character key: exit %d %q %s", code, out, errs)
		}
	}
	t.Run("a store that drops the connection and goes away", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			ln.Close()
			nc.Read(make([]byte, 64))
			nc.Close()
		}()
		defer ln.Close()
		start := time.Now()
		code, _, errs := gorun(t, "", "store", "add", "--store", "tcp://"+ln.Addr().String(), "--wire", "old", "n", "1")
		if code != ExitUnavailable || !strings.Contains(errs, "connection closed by the server") || strings.Count(errs, "\n") != 1 {
			t.Fatalf("exit %d stderr %q; want %d, one line saying the server closed the connection", code, errs, ExitUnavailable)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("took %v", d)
		}
	})
}

// TestStoreExitCodesOnTorchServer: against PyTorch 1.13's own server, a
// refused ADD (the value is not an integer: the server closes the
// connection) exits 5 as on gorun's, and a confirmed SET exits 0.
func TestStoreExitCodesOnTorchServer(t *testing.T) {
	torchtest.Python(t)
	p := torchtest.Start(t, nil, `
import datetime, sys
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
import time; time.sleep(300)
`)
	var port string
	deadline := time.Now().Add(60 * time.Second)
	for port == "" {
		port = strings.TrimSpace(p.Stdout())
		if time.Now().After(deadline) {
			t.Fatalf("the torch server printed no port; stderr %s", p.Stderr())
		}
		time.Sleep(20 * time.Millisecond)
	}
	url := "tcp://127.0.0.1:" + port
	steps := []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"set", "s", "abc"}, ExitOK, ""},
		{[]string{"add", "s", "1"}, ExitStoreError, ""},
		{[]string{"get", "s"}, ExitOK, "abc"},
		{[]string{"add", "n", "2"}, ExitOK, "2\n"},
	}
	for _, st := range steps {
		args := append([]string{"store", st.args[0], "--store", url, "--wire", "old"}, st.args[1:]...)
		code, out, errs := gorun(t, "", args...)
		if code != st.code || out != st.out {
			t.Fatalf("gorun %s: exit %d stdout %q stderr %q; want %d %q", strings.Join(args, " "), code, out, errs, st.code, st.out)
		}
	}
}

// TestStoreVerbStoppedBySignal: a verb waiting on the store and stopped by
// SIGTERM or SIGINT exits 128+N, as the README's table says, not with the
// timeout code.
func TestStoreVerbStoppedBySignal(t *testing.T) {
	t.Parallel()
	bin := testutil.BuildGorun(t)
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	for _, tc := range []struct {
		sig  syscall.Signal
		code int
	}{{syscall.SIGTERM, 143}, {syscall.SIGINT, 130}} {
		t.Run(unix.SignalName(tc.sig), func(t *testing.T) {
			before := srv.Stats().Requests
			cmd := exec.Command(bin, "store", "wait", "--store", "tcp://"+srv.Addr().String(), "--timeout", "60s", "never")
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			exited := false
			defer func() {
				if !exited {
					cmd.Process.Kill()
					<-done
				}
			}()
			// VALIDATE, PING and the WAIT have arrived: the verb is waiting.
			deadline := time.Now().Add(10 * time.Second)
			for srv.Stats().Requests < before+3 {
				if time.Now().After(deadline) {
					t.Fatalf("the verb never reached its WAIT; stderr %s", &stderr)
				}
				time.Sleep(5 * time.Millisecond)
			}
			start := time.Now()
			cmd.Process.Signal(tc.sig)
			select {
			case <-done:
				exited = true
			case <-time.After(10 * time.Second):
				t.Fatal("the verb did not stop")
			}
			if code := cmd.ProcessState.ExitCode(); code != tc.code || !strings.Contains(stderr.String(), "stopped by SIG") {
				t.Fatalf("exit %d, stderr %q; want %d and the signal named", code, &stderr, tc.code)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Fatalf("stopping took %v", d)
			}
		})
	}
}
