package rendezvous_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// TestPrefixStoreKeyLayout checks, on a real TCPStore, the keys c10d's
// PrefixStore produces: prefix + "/" + key, nested prefixes composed
// outward in, and (with the client's own "/") e.g. "/b/a/k" on the wire.
func TestPrefixStoreKeyLayout(t *testing.T) {
	srv, err := tcpstore.Listen("127.0.0.1:0", tcpstore.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := tcpstore.Dial(ctx, srv.Addr().String(), tcpstore.ClientConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	b := rendezvous.NewPrefixStore("b", c)
	ab := rendezvous.NewPrefixStore("a", b)
	must(t, ab.Set(ctx, "k", []byte("v")))
	must(t, b.Set(ctx, "k2", []byte("v2")))
	must(t, c.Set(ctx, "top", []byte("t")))
	if n, err := ab.Add(ctx, "n", 3); err != nil || n != 3 {
		t.Fatalf("Add = %d, %v", n, err)
	}
	must(t, ab.MultiSet(ctx, []string{"m1", "m2"}, [][]byte{[]byte("1"), []byte("2")}))
	if v, err := ab.MultiGet(ctx, "m2", "k"); err != nil || string(v[0]) != "2" || string(v[1]) != "v" {
		t.Fatalf("MultiGet = %q, %v", v, err)
	}
	if ok, err := ab.Check(ctx, "k", "n"); err != nil || !ok {
		t.Fatalf("Check = %v, %v", ok, err)
	}

	// What the server holds.
	for _, key := range []string{"/b/a/k", "/b/k2", "/top", "/b/a/n", "/b/a/m1"} {
		if _, ok, _ := srv.Storage().Get([]byte(key)); !ok {
			t.Errorf("server has no key %q", key)
		}
	}
	// ListKeys filters to the prefix and strips it; NumKeys does not filter.
	keys, err := ab.ListKeys(ctx)
	must(t, err)
	slices.Sort(keys)
	if !slices.Equal(keys, []string{"k", "m1", "m2", "n"}) {
		t.Fatalf("ListKeys under b/a = %q", keys)
	}
	if n, err := ab.NumKeys(ctx); err != nil || n != 6 {
		t.Fatalf("NumKeys = %d, %v; want 6 (the whole store)", n, err)
	}
	if ab.Prefix() != "a" || ab.Underlying() != rendezvous.Store(b) || ab.Key("x") != "a/x" {
		t.Fatalf("Prefix %q Key %q", ab.Prefix(), ab.Key("x"))
	}
	// Closing a view leaves the underlying store open.
	must(t, ab.Close())
	if _, err := c.Get(ctx, "top"); err != nil {
		t.Fatalf("underlying store unusable after closing a PrefixStore: %v", err)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
