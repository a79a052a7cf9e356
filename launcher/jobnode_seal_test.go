package launcher

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestJobNodeSeal: with a job secret the rendezvous store's records are
// sealed, the restart count included (the seen-closed counter stays a
// plain decimal), and a refused record is
// counted each time (kind "rendezvous") and logged once per source (why,
// and the secret check claimed), never with the secret. Without one the
// records stay plain, and a sealed record met is ErrSealedRecord.
func TestJobNodeSeal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dial := storeServer(ctx, t)
	raw := dial()
	node := func(secret Secret, refused func(string)) (*jobNode, *observer.ObservedLogs) {
		core, logs := observer.New(zap.WarnLevel)
		cfg := &Config{JobSecret: secret, refused: refused}
		j := &jobNode{cfg: cfg, log: zap.New(core), runID: "job", store: dial()}
		if err := j.seal(); err != nil {
			t.Fatal(err)
		}
		return j, logs
	}
	var mu sync.Mutex
	kinds := map[string]int{}
	count := func(kind string) { mu.Lock(); kinds[kind]++; mu.Unlock() }
	secret := Secret("s3cr3t-of-the-seal-test")
	j, logs := node(secret, count)

	if err := j.store.Set(ctx, "gorun.rendezvous.job", []byte(`{"round":1}`)); err != nil {
		t.Fatal(err)
	}
	if _, err := j.store.CompareSet(ctx, j.restartsKey(), nil, []byte("0")); err != nil {
		t.Fatal(err)
	}
	if n, counted, err := countRestart(ctx, j.store, j.restartsKey(), 0, "me"); err != nil || n != 1 || !counted {
		t.Fatalf("restart count: %d, %v, %v", n, counted, err)
	}
	if n, err := j.store.Add(ctx, j.seenClosedKey(), 2); err != nil || n != 2 {
		t.Fatalf("seen-closed counter: %d, %v", n, err)
	}
	for key, sealed := range map[string]bool{"gorun.rendezvous.job": true, j.restartsKey(): true, j.seenClosedKey(): false} {
		v, err := raw.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(string(v), "GRS1 ") != sealed {
			t.Errorf("%s stored as %q, want sealed %v", key, v, sealed)
		}
	}

	// Three forgeries: two unsealed (one source), one under another secret.
	other, _ := node(Secret("another-secret-of-the-seal-test"), nil)
	for _, forge := range []func(){
		func() { raw.Set(ctx, "a", []byte("forged 1")) },
		func() { raw.Set(ctx, "b", []byte("forged 2")) },
		func() { other.store.Set(ctx, "c", []byte("theirs")) },
	} {
		forge()
	}
	// A set has no answer on the wire: read back on the same connections,
	// so that the checks below come after the writes.
	if _, err := raw.MultiGet(ctx, "a", "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := other.store.Get(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c"} {
		if ok, err := j.store.Check(ctx, k); ok || err != nil {
			t.Errorf("Check(%s) = %v, %v; want a refused record absent", k, ok, err)
		}
	}
	if kinds["rendezvous"] != 3 || len(kinds) != 1 {
		t.Errorf("counted %v, want 3 of kind rendezvous", kinds)
	}
	var whys []string
	for _, e := range logs.All() {
		f := e.ContextMap()
		whys = append(whys, fmt.Sprint(f["why"]))
		if strings.Contains(fmt.Sprint(e.Message, f), "s3cr3t") {
			t.Errorf("the log shows a secret: %v", e)
		}
	}
	if strings.Join(whys, ",") != "not sealed,sealed under another job secret" {
		t.Errorf("logged %q, want one line per source", whys)
	}

	// Without a secret: plain records, and a sealed one is an error.
	plain, _ := node(nil, nil)
	if err := plain.store.Set(ctx, "p", []byte("plain")); err != nil {
		t.Fatal(err)
	}
	if v, err := raw.Get(ctx, "p"); err != nil || string(v) != "plain" {
		t.Errorf("without a secret stored %q, %v", v, err)
	}
	if _, err := plain.store.Get(ctx, "gorun.rendezvous.job"); !errors.Is(err, rendezvous.ErrSealedRecord) {
		t.Errorf("without a secret, a sealed record read: %v", err)
	}
}

// TestExitBarrierForgedArrival: three nodes of a round meet at the exit
// barrier, and someone who reaches the store writes its end. Without a
// job secret that ends the barrier early (the control: the attack is
// real); with one the first two nodes wait on until the third arrives.
func TestExitBarrierForgedArrival(t *testing.T) {
	for _, secret := range []Secret{nil, Secret("s3cr3t-of-the-barrier-test")} {
		t.Run(fmt.Sprintf("secret %v", secret != nil), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dial := storeServer(ctx, t)
			round := rendezvous.Round{Number: 2}
			node := func() *jobNode {
				j := &jobNode{cfg: &Config{JobSecret: secret}, log: zap.NewNop(), runID: "job", store: dial(), round: round}
				if err := j.seal(); err != nil {
					t.Fatal(err)
				}
				return j
			}
			arrive := func(g int) <-chan error {
				done := make(chan error, 1)
				j := node()
				p := &plan{assignments: []Assignment{{GroupRank: g, GroupWorldSize: 3}}}
				go func() { done <- j.exitBarrier(ctx, p, nil) }()
				return done
			}
			first, second := arrive(0), arrive(1)
			time.Sleep(100 * time.Millisecond)
			// A forged end of the barrier, from a client without the
			// secret.
			if err := round.Store(dial(), "job").Set(ctx, exitBarrierEnd, []byte("every node arrived")); err != nil {
				t.Fatal(err)
			}
			if early := leftWithin(t, first, 500*time.Millisecond); early != (secret == nil) {
				t.Fatalf("the forged increment ended the barrier early: %v; want %v", early, secret == nil)
			}
			if secret == nil {
				return
			}
			if err := <-arrive(2); err != nil {
				t.Fatal(err)
			}
			allLeave(ctx, t, first, second)
		})
	}
}

// storeServer starts a gorun store server for the test and returns how to
// dial a client of it (closed at cleanup, as the server is).
func storeServer(ctx context.Context, t *testing.T) func() rendezvous.Store {
	t.Helper()
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return func() rendezvous.Store {
		c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
}
