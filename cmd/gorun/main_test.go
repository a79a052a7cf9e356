package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/hashicorp/go-msgpack/v2/codec"
	"github.com/hashicorp/memberlist"

	"github.com/gorunhq/gorun/internal/testutil"
)

// TestMain runs the tests with one build of each binary they start
// (testutil.Shared), and lets the test binary serve as a rogue host's gossip sender
// (rogueDeadEnv). (It serves as the cgroup guard of the agents the tests
// run in-process through launcher/cgroup's init.)
func TestMain(m *testing.M) {
	if spec := os.Getenv(rogueDeadEnv); spec != "" {
		if err := sendRogueDead(spec); err != nil {
			fmt.Fprintln(os.Stderr, "rogue:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(testutil.Shared(m).Run())
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
