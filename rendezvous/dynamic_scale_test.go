package rendezvous_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/storecount"
	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// crowdCost runs n fresh nodes' Next at once against a TCPStore server,
// each with its own client, and returns the store requests and the bytes
// written per node. Every node must get the same round of n.
func crowdCost(t *testing.T, n int) (reqs, written float64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := newCluster(t, rendezvous.DynamicConfig{RunID: fmt.Sprint("crowd", n), MinNodes: n, MaxNodes: n})
	var counts storecount.Counts
	ds := make([]*rendezvous.Dynamic, n)
	for i := range ds {
		cl, err := tcpstore.Dial(ctx, c.addr, tcpstore.ClientConfig{})
		if err != nil {
			t.Fatal(err)
		}
		d, err := rendezvous.NewDynamic(storecount.New(cl, &counts), execNode(i), []byte(fmt.Sprintf("lws=%d", i+1)), c.cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			d.Close()
			cl.Close()
		})
		ds[i] = d
	}
	res := make([]result, n)
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Go(func() {
			r, err := d.Next(ctx)
			res[i] = result{r, err, time.Now()}
		})
	}
	wg.Wait()
	members := make([]int, n)
	for i := range members {
		members[i] = i
	}
	checkRound(t, res, 0, members)
	return float64(counts.Requests.Load()) / float64(n), float64(counts.Written.Load()) / float64(n)
}

// TestDynamicCostFlat: a node's share of a crowd's rendezvous (store
// requests, bytes written) does not grow with the crowd: 256 nodes cost
// each within 1.5× of what 16 do. (Before requests were queued, every
// join rewrote the whole state, losing O(N) races: 256 nodes cost each
// about 40 requests and 1 MB written, 16 about 15 and 30 KB.)
func TestDynamicCostFlat(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	r16, w16 := crowdCost(t, 16)
	r256, w256 := crowdCost(t, 256)
	t.Logf("per node: 16 nodes %.1f requests, %.0f bytes written; 256 nodes %.1f, %.0f", r16, w16, r256, w256)
	if r256 > 1.5*r16 || w256 > 1.5*w16 {
		t.Errorf("256 nodes cost %.1f requests and %.0f bytes written each, 16 nodes %.1f and %.0f", r256, w256, r16, w16)
	}
}
