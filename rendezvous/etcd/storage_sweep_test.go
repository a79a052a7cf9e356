package etcd_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/rendezvous/etcd"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// writerEnv makes the test binary a writer process: "ENDPOINT PREFIX KEY
// MIB" sets KEY to MIB MiB through a Storage of its own (WriteLeaseTTL 2
// s), and is killed by the test while it writes the chunks; with MIB 0 it
// adds 1 to KEY (OpTimeout 2 s: its tokens' lease lives 4 s), says
// "added", and waits to be killed.
const writerEnv = "GORUN_ETCD_TEST_WRITER"

func runWriter(spec string) int {
	f := strings.Fields(spec)
	if len(f) != 4 {
		fmt.Fprintf(os.Stderr, "%s=%q: want ENDPOINT PREFIX KEY MIB\n", writerEnv, spec)
		return 2
	}
	mib, err := strconv.Atoi(f[3])
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: MIB: %v\n", writerEnv, spec, err)
		return 2
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{f[0]}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cli.Close()
	cfg := etcd.StorageConfig{Prefix: f[1], WriteLeaseTTL: 2 * time.Second}
	if mib == 0 {
		cfg.OpTimeout = 2 * time.Second
	}
	st, err := etcd.NewStorage(context.Background(), cli, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer st.Close()
	if mib == 0 {
		if _, err := st.Add([]byte(f[2]), 1); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("added")
		select {}
	}
	if err := st.Set([]byte(f[2]), bytes.Repeat([]byte("o"), mib<<20)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// count is how many etcd keys start with prefix.
func count(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix string) int64 {
	t.Helper()
	r, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	return r.Count
}

// killMidWrite starts a writer process setting key to a 64 MiB value and
// SIGKILLs it once it has put 3 of its 64 chunks: a writer dead between
// its chunks and its head.
func killMidWrite(t *testing.T, ctx context.Context, cli *clientv3.Client, endpoint, prefix, key string) {
	t.Helper()
	wch := cli.Watch(ctx, prefix+"c/", clientv3.WithPrefix())
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %s 64", writerEnv, endpoint, prefix, key))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	puts := 0
	for resp := range wch {
		for _, ev := range resp.Events {
			if ev.Type == clientv3.EventTypePut {
				puts++
			}
		}
		if puts >= 3 {
			break
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
		t.Fatalf("the writer was to be killed mid-write; it ended with %v after %d chunk puts\n%s", err, puts, stderr.Bytes())
	}
}

// TestStorageOrphanChunksSwept: a writer process SIGKILLed between a
// large value's chunks and its head leaves chunks no head names. While its
// lease lives they are taken for a write in flight and kept; once it has
// lapsed, the next large write of the key sweeps them, and so does a
// Storage that starts later (an agent restarted, a replacement node). A
// value that was stored whole is never touched.
func TestStorageOrphanChunksSwept(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 90*time.Second)
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	open := func() *etcd.Storage {
		st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix, WriteLeaseTTL: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	}
	st := open()
	kept := bytes.Repeat([]byte("k"), 3<<20)
	if err := st.Set([]byte("/kept"), kept); err != nil {
		t.Fatal(err)
	}
	chunks := func() int64 { return count(t, ctx, cli, prefix+"c/") }
	marks := func() int64 { return count(t, ctx, cli, prefix+"m/w/") }
	awaitZeroMarks := func() {
		for marks() != 0 {
			if ctx.Err() != nil {
				t.Fatal("the killed writer's mark never lapsed")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if n := marks(); n != 0 {
		t.Fatalf("%d marks in flight after a complete write; want 0", n)
	}

	// The next large write of the key sweeps.
	killMidWrite(t, ctx, cli, cluster.Endpoints()[0], prefix, "/orphan")
	left := chunks() - 3
	if left < 3 || marks() != 1 {
		t.Fatalf("after the kill: %d chunks of the killed write, %d marks; want ≥ 3 and 1", left, marks())
	}
	if _, ok, err := st.Get([]byte("/orphan")); err != nil || ok {
		t.Fatalf("the killed write is readable: %v, %v", ok, err)
	}
	// Marked in flight: a write of the key now keeps them.
	small := bytes.Repeat([]byte("s"), 2<<20)
	if err := st.Set([]byte("/orphan"), small); err != nil {
		t.Fatal(err)
	}
	if n := chunks(); n != 3+left+2 {
		t.Fatalf("%d chunks while the killed writer's lease lives; want %d (kept, its, the new value's)", n, 3+left+2)
	}
	awaitZeroMarks()
	if err := st.Set([]byte("/orphan"), small); err != nil {
		t.Fatal(err)
	}
	if n := chunks(); n != 3+2 {
		t.Fatalf("%d chunks after a large write once the lease lapsed; want 5 (kept's 3, orphan's 2)", n)
	}

	// A Storage that starts sweeps, and sweeps again once a mark lapses.
	killMidWrite(t, ctx, cli, cluster.Endpoints()[0], prefix, "/orphan2")
	open() // the killed writer's lease still lives
	for chunks() != 5 {
		if ctx.Err() != nil {
			t.Fatalf("a starting Storage left %d chunks; want 5", chunks())
		}
		time.Sleep(100 * time.Millisecond)
	}
	for key, want := range map[string][]byte{"/kept": kept, "/orphan": small} {
		if v, ok, err := st.Get([]byte(key)); err != nil || !ok || !bytes.Equal(v, want) {
			t.Fatalf("%s after the sweeps: %d bytes, %v, %v; want %d", key, len(v), ok, err, len(want))
		}
	}
	if n := marks(); n != 0 {
		t.Fatalf("%d marks left", n)
	}
}

// TestStorageSweepsKeepConcurrentWrites: two nodes set one key to large
// values at once, each write sweeping the key after it: neither sweep takes
// the other's write in flight (every Set succeeds, every read is whole),
// and once both stop only the last value's chunks are left.
func TestStorageSweepsKeepConcurrentWrites(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 2)
	ctx := testCtx(t, 60*time.Second)
	values := [][]byte{bytes.Repeat([]byte("a"), 2<<20+1), bytes.Repeat([]byte("b"), 3<<20)}
	var wg sync.WaitGroup
	for i, n := range ns {
		wg.Go(func() {
			for range 6 {
				if err := n.st.Set([]byte("/hot"), values[i]); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	v, ok, err := ns[0].st.Get([]byte("/hot"))
	if err != nil || !ok || !(bytes.Equal(v, values[0]) || bytes.Equal(v, values[1])) {
		t.Fatalf("read %d bytes, %v, %v: no value written whole", len(v), ok, err)
	}
	want := int64((len(v) + 1<<20 - 1) >> 20) // 1 MiB chunks
	prefix := ns[0].st.Prefix()
	if n := count(t, ctx, cli, prefix+"c/"); n != want {
		t.Fatalf("%d chunks left; want the last value's %d", n, want)
	}
	if n := count(t, ctx, cli, prefix+"m/w/"); n != 0 {
		t.Fatalf("%d marks left", n)
	}
}

// TestStorageWatchLargeValues: WATCH_KEY registrations see the values of
// a large key's changes, not their heads: created, updated large over
// large, small over large, large over small, deleted.
func TestStorageWatchLargeValues(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ns := startNodes(t, cli, 2)
	ctx := testCtx(t, 30*time.Second)
	evs := make(chan tcpstore.WatchEvent, 10)
	cancel, err := ns[0].st.Watch([]byte("/w"), func(ev tcpstore.WatchEvent) { evs <- ev })
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	a, b, c, d := bytes.Repeat([]byte("a"), 2<<20+1), bytes.Repeat([]byte("b"), 3<<20), []byte("c"), bytes.Repeat([]byte("d"), 1<<20+7)
	for _, v := range [][]byte{a, b, c, d} {
		if err := ns[1].cli.Set(ctx, "w", v); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ns[1].cli.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	want := []tcpstore.WatchEvent{
		{Type: tcpstore.KeyCreated, Key: []byte("/w"), New: a},
		{Type: tcpstore.KeyUpdated, Key: []byte("/w"), Old: a, New: b},
		{Type: tcpstore.KeyUpdated, Key: []byte("/w"), Old: b, New: c},
		{Type: tcpstore.KeyUpdated, Key: []byte("/w"), Old: c, New: d},
		{Type: tcpstore.KeyDeleted, Key: []byte("/w"), Old: d},
	}
	for i, w := range want {
		select {
		case ev := <-evs:
			if ev.Type != w.Type || !bytes.Equal(ev.Key, w.Key) || !bytes.Equal(ev.Old, w.Old) || !bytes.Equal(ev.New, w.New) {
				t.Fatalf("event %d: %v %s old %d bytes %.8q new %d bytes %.8q; want %v old %d new %d",
					i, ev.Type, ev.Key, len(ev.Old), ev.Old, len(ev.New), ev.New, w.Type, len(w.Old), len(w.New))
			}
		case <-ctx.Done():
			t.Fatalf("no event %d", i)
		}
	}
}

// TestStorageTokensOfAKilledAgentLapse: a read-modify-write stamps a token
// key of its Storage's; an agent SIGKILLed never closes its Storage, and
// its tokens go with their lease's TTL (OpTimeout plus WriteLeaseTTL)
// rather than staying for the rest of the round. A Storage closed deletes
// its own at once.
func TestStorageTokensOfAKilledAgentLapse(t *testing.T) {
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	cli := cluster.Client(t, nil)
	ctx := testCtx(t, 60*time.Second)
	prefix := fmt.Sprintf("/test/%s/", t.Name())
	tokens := func() int64 { return count(t, ctx, cli, prefix+"m/t/") }

	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s /n 0", writerEnv, cluster.Endpoints()[0], prefix))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := make([]byte, len("added\n"))
	if _, err := io.ReadFull(out, line); err != nil || string(line) != "added\n" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("the agent process said %q, %v", line, err)
	}
	if n := tokens(); n != 1 {
		t.Fatalf("%d tokens after an add; want 1", n)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	killed := time.Now()
	for tokens() != 0 {
		if time.Since(killed) > 15*time.Second {
			t.Fatalf("the killed agent's token is still there %v after its death (its lease lives 4 s)", time.Since(killed))
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("the killed agent's token went %v after its death", time.Since(killed).Round(100*time.Millisecond))

	st, err := etcd.NewStorage(ctx, cli, etcd.StorageConfig{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := st.Add([]byte("/n"), 1); err != nil || n != 2 {
		t.Fatalf("add = %d, %v; want 2", n, err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if n := tokens(); n != 0 {
		t.Fatalf("%d tokens after Close; want 0", n)
	}
	r, err := cli.Leases(ctx)
	if err != nil || len(r.Leases) != 0 {
		t.Fatalf("%d leases left (%v); want none", len(r.Leases), err)
	}
}
