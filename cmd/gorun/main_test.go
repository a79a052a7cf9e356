package main

import (
	"bytes"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/hashicorp/memberlist"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain runs the tests with one build of each binary they start
// (testutil.Shared), testParallel of them at once, and lets the test binary
// serve as a rogue host's gossip sender (rogueDeadEnv). (It serves as the
// cgroup guard of the agents the tests run in-process through
// launcher/cgroup's init.)
func TestMain(m *testing.M) {
	if spec := os.Getenv(rogueDeadEnv); spec != "" {
		if err := sendRogueDead(spec); err != nil {
			fmt.Fprintln(os.Stderr, "rogue:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	flag.Parse()
	raiseParallel()
	os.Exit(testutil.Shared(m).Run())
}

// testParallel is how many of this package's parallel tests run at once
// unless -test.parallel says otherwise. They spend most of their time
// waiting (for agents to meet, for a keep-alive to lapse, for a signal to
// be answered) rather than computing, so more of them than the machine's
// cores (go test's default, 2 on CI's machine) run at once with profit.
// Not parallel, so run before the others: the tests that set the
// process's environment (t.Setenv); those that run the CLI in this process
// (urfave/cli's help and version flags are shared globals); those whose
// agents bind a fixed port (a single-node static job's worker store is on
// 29500 by default, torchrun 1.13's --standalone store on 29400); and the
// heal tests, whose grows a false node-liveness verdict about an agent
// starved of CPU derails (seen at 4 at once beside other jobs).
const testParallel = 3

func raiseParallel() {
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	p := flag.Lookup("test.parallel")
	if n, err := strconv.Atoi(p.Value.String()); !given && err == nil && n < testParallel {
		p.Value.Set(strconv.Itoa(testParallel))
	}
}

// rogueDeadEnv makes the test binary send one forged memberlist "dead"
// message and exit: "TARGET_ADDR LABEL NODE", NODE the member to declare
// dead, sent to the member at TARGET_ADDR (UDP) under the cluster label
// LABEL, unencrypted: what a host without the job secret can send.
const rogueDeadEnv = "GORUN_TEST_ROGUE_DEAD"

// deadMsg is memberlist's "dead" message (its net.go, type 5): encoded
// with msgpack after a byte of its type.
type deadMsg struct {
	Incarnation uint32
	Node        string
	From        string
}

func sendRogueDead(spec string) error {
	f := strings.Fields(spec)
	if len(f) != 3 {
		return fmt.Errorf("%s=%q: want TARGET_ADDR LABEL NODE", rogueDeadEnv, spec)
	}
	var buf bytes.Buffer
	buf.WriteByte(5) // deadMsg
	// An incarnation far above any the node has had: memberlist takes it
	// over its own record of the node.
	if err := codec.NewEncoder(&buf, &codec.MsgpackHandle{}).Encode(deadMsg{Incarnation: 1 << 30, Node: f[2], From: "rogue"}); err != nil {
		return err
	}
	pkt, err := memberlist.AddLabelHeaderToPacket(buf.Bytes(), f[1])
	if err != nil {
		return err
	}
	conn, err := net.Dial("udp", f[0])
	if err != nil {
		return err
	}
	defer conn.Close()
	// A few copies: UDP may drop one.
	for range 3 {
		if _, err := conn.Write(pkt); err != nil {
			return err
		}
	}
	return nil
}
