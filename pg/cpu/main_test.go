package cpu_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/pg/cpu"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// Environment of a rank process: the test binary re-executes itself as
// the ranks of a group (see TestPeerKilled).
const (
	envRank  = "PGCPU_TEST_RANK"
	envSize  = "PGCPU_TEST_SIZE"
	envStore = "PGCPU_TEST_STORE"
	envNS    = "PGCPU_TEST_NAMESPACE"
	envTrans = "PGCPU_TEST_TRANSPORT"
)

func TestMain(m *testing.M) {
	if os.Getenv(envRank) != "" {
		os.Exit(rankMain())
	}
	goleak.VerifyTestMain(m)
}

// rankMain is a rank process: it forms the group, says "formed", then runs
// AllReduces until one fails. It reports the failure as
// "failed peer=<rank> at=<unix ns> err=<error>" and exits 0 when the
// failure is a *pg.PeerError, 1 otherwise.
func rankMain() int {
	rank, _ := strconv.Atoi(os.Getenv(envRank))
	size, _ := strconv.Atoi(os.Getenv(envSize))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	store, err := tcpstore.Dial(ctx, os.Getenv(envStore), tcpstore.ClientConfig{})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer store.Close()
	cfg := cpu.DefaultConfig()
	cfg.ListenAddr = "127.0.0.1:0"
	cfg.LocalTransport = os.Getenv(envTrans)
	cfg.Bootstrap = pg.Bootstrap{Store: store, Namespace: os.Getenv(envNS), Rank: rank, Size: size}
	g, err := cpu.New(ctx, cfg)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer g.Close()
	fmt.Println("formed")
	buf := make([]float32, 1<<20) // 4 MiB: the ring, several chunks
	for {
		err := g.AllReduce(ctx, pg.Host(buf), pg.Sum)
		if err == nil {
			continue
		}
		at := time.Now().UnixNano()
		var pe *pg.PeerError
		if !errors.As(err, &pe) {
			fmt.Printf("failed peer=-1 at=%d err=%v\n", at, err)
			return 1
		}
		fmt.Printf("failed peer=%d at=%d err=%v async=%v\n", pe.Rank, at, err, g.AsyncError())
		return 0
	}
}
