package health

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestNodeTracker(t *testing.T) {
	t0 := time.Unix(100, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	type op struct {
		kind  string // "join", "dead", "left", "announce", "ack", "expect"
		ms    int
		node  string
		addr  string
		names []string // expect
		// want: the events, each "kind node @ms: reason substring".
		want []string
	}
	tests := []struct {
		name string
		ops  []op
	}{
		{"this member itself is never reported", []op{
			{kind: "join", node: "self", addr: "a:1"},
			{kind: "dead", node: "self", addr: "a:1"},
			{kind: "left", node: "self", addr: "a:1"},
		}},
		{"join, then a silent death with the last ack quoted", []op{
			{kind: "join", ms: 0, node: "b", addr: "b:1", want: []string{"node_joined b @0: joined the gossip"}},
			{kind: "ack", ms: 300, node: "b"},
			{kind: "dead", ms: 1000, node: "b", addr: "b:1",
				want: []string{"node_dead b @1000: no refutation within the suspicion timeout (400ms at 2 members); last ack to this member 700ms before"}},
		}},
		{"a graceful leave is not a death", []op{
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "left", ms: 50, node: "b", addr: "b:1", want: []string{"node_left b @50: left gracefully"}},
		}},
		{"a member that announced its departure left, whatever memberlist says", []op{
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "join", node: "c", addr: "c:1", want: []string{"node_joined c @0: joined"}},
			{kind: "announce", node: "b"},
			{kind: "announce", node: "self"},
			{kind: "dead", ms: 50, node: "b", addr: "b:1", want: []string{"node_left b @50: left gracefully"}},
			{kind: "dead", ms: 60, node: "c", addr: "c:1", want: []string{"node_dead c @60: unreachable"}},
			{kind: "join", ms: 70, node: "b", addr: "b:1", want: []string{"node_joined b @70: rejoined 20ms after leaving"}},
			{kind: "dead", ms: 90, node: "b", addr: "b:1", want: []string{"node_dead b @90: unreachable"}},
		}},
		{"repeated callbacks are reported once", []op{
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "join", ms: 10, node: "b", addr: "b:1"},
			{kind: "dead", ms: 20, node: "b", addr: "b:1", want: []string{"node_dead b @20: never acked"}},
			{kind: "dead", ms: 30, node: "b", addr: "b:1"},
			{kind: "left", ms: 40, node: "b", addr: "b:1"},
		}},
		{"a member declared dead that refutes comes back as joined", []op{
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "dead", ms: 1000, node: "b", addr: "b:1", want: []string{"node_dead b @1000: unreachable"}},
			{kind: "join", ms: 3500, node: "b", addr: "b:2", want: []string{"node_joined b @3500: rejoined 2.5s after being declared dead (it was at b:1)"}},
			{kind: "left", ms: 4000, node: "b", addr: "b:2", want: []string{"node_left b @4000: left"}},
		}},
		{"a death heard of before the join is reported", []op{
			{kind: "dead", ms: 5, node: "c", addr: "c:1", want: []string{"node_dead c @5: unreachable"}},
		}},
		{"the suspicion timeout quoted grows with the cluster", func() []op {
			var ops []op
			for i := range 20 {
				name := fmt.Sprintf("n%02d", i)
				ops = append(ops, op{kind: "join", node: name, addr: name + ":1", want: []string{"node_joined " + name + " @0: joined"}})
			}
			// 21 members: 2 × log10(21) × 200 ms.
			return append(ops, op{kind: "dead", node: "n07", addr: "n07:1", want: []string{"node_dead n07 @0: (528.8ms at 21 members)"}})
		}()},
		{"only the expected peers are reported", []op{
			{kind: "expect", names: []string{"b", "c"}},
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "join", node: "x", addr: "x:1"},
			{kind: "dead", ms: 10, node: "x", addr: "x:1"},
			{kind: "left", ms: 10, node: "b", addr: "b:1", want: []string{"node_left b @10: left"}},
		}},
		{"a new round hears of its losses that came before it", []op{
			{kind: "join", node: "b", addr: "b:1", want: []string{"node_joined b @0: joined"}},
			{kind: "join", node: "c", addr: "c:1", want: []string{"node_joined c @0: joined"}},
			{kind: "join", node: "d", addr: "d:1", want: []string{"node_joined d @0: joined"}},
			{kind: "expect", names: []string{"d"}},
			{kind: "dead", ms: 100, node: "b", addr: "b:1"},
			{kind: "left", ms: 200, node: "c", addr: "c:1"},
			{kind: "expect", ms: 900, names: []string{"self", "b", "c", "c", "d", "e"}, want: []string{
				"node_dead b @100: unreachable: no ack to direct, indirect or TCP probes, and no refutation within the suspicion timeout (400ms at 4 members); it never acked a probe of this member (before this round)",
				"node_left c @200: left gracefully (it announced its departure) (before this round)",
			}},
			{kind: "expect", names: nil},
			{kind: "dead", ms: 1000, node: "d", addr: "d:1", want: []string{"node_dead d @1000: 2 members"}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultNodeConfig()
			cfg.ProbeInterval, cfg.SuspicionMult = 200*time.Millisecond, 2
			tr := newNodeTracker("self", cfg)
			for i, o := range tt.ops {
				var got []Event
				switch o.kind {
				case "join":
					got = tr.joined(o.node, o.addr, at(o.ms))
				case "dead", "left":
					got = tr.gone(o.node, o.addr, o.kind == "left", at(o.ms))
				case "announce":
					tr.announcedLeave(o.node)
				case "ack":
					tr.acked(o.node, 250*time.Microsecond, at(o.ms))
				case "expect":
					got = tr.expect(o.names)
				default:
					t.Fatalf("op %d: kind %q", i, o.kind)
				}
				if len(got) != len(o.want) {
					t.Fatalf("op %d (%s %s): got %d events %v, want %d %v", i, o.kind, o.node, len(got), got, len(o.want), o.want)
				}
				for j, ev := range got {
					head, reason, _ := strings.Cut(o.want[j], ": ")
					var kind, node string
					var ms int
					if _, err := fmt.Sscanf(head, "%s %s @%d", &kind, &node, &ms); err != nil {
						t.Fatalf("bad want %q: %v", o.want[j], err)
					}
					if string(ev.Kind) != kind || ev.Node != node || !ev.SeenAt.Equal(at(ms)) ||
						ev.Addr == "" || !strings.Contains(ev.Reason, reason) {
						t.Errorf("op %d: event %d = %v, want %q", i, j, ev, o.want[j])
					}
				}
			}
		})
	}
}

func TestNodeConfigArithmetic(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	lifeguard := DefaultNodeConfig() // memberlist's own suspicion scheme
	lifeguard.SuspicionMult, lifeguard.SuspicionMaxTimeoutMult = 4, 6
	tests := []struct {
		name             string
		cfg              NodeConfig
		n                int
		suspicion, bound time.Duration
	}{
		{"defaults, alone", DefaultNodeConfig(), 1, ms(400), ms(100 + 100 + 400 + 20)},
		{"defaults, 2", DefaultNodeConfig(), 2, ms(400), ms(100 + 100 + 400 + 20)},
		{"defaults, 4", DefaultNodeConfig(), 4, ms(400), ms(300 + 100 + 400 + 20)},
		{"defaults, 10", DefaultNodeConfig(), 10, ms(400), ms(900 + 100 + 400 + 20)},
		// 4 × log10(64) × 100 ms
		{"defaults, 64", DefaultNodeConfig(), 64, ms(722) + 400*time.Microsecond, ms(6300+100+722+20) + 400*time.Microsecond},
		{"defaults, 100", DefaultNodeConfig(), 100, ms(800), ms(9900 + 100 + 800 + 20)},
		// Two confirmations expected from 4 members on: the timer starts at 6×.
		{"confirmations, too few members", lifeguard, 3, ms(400), ms(200 + 100 + 400 + 20)},
		{"confirmations expected", lifeguard, 4, ms(2400), ms(300 + 100 + 2400 + 20)},
	}
	for _, tt := range tests {
		if got := tt.cfg.SuspicionTimeout(tt.n); got != tt.suspicion {
			t.Errorf("%s: SuspicionTimeout(%d) = %v, want %v", tt.name, tt.n, got, tt.suspicion)
		}
		if got := tt.cfg.DetectionBound(tt.n); got != tt.bound {
			t.Errorf("%s: DetectionBound(%d) = %v, want %v", tt.name, tt.n, got, tt.bound)
		}
	}
	// The goal the defaults are for: a node declared dead within 1 s, even
	// in the worst case, up to 5 agents.
	if b := DefaultNodeConfig().DetectionBound(5); b >= time.Second {
		t.Errorf("default detection bound at 5 agents %v, want under 1 s", b)
	}
}

func TestNodeConfigValidate(t *testing.T) {
	tests := []struct {
		name   string
		change func(*NodeConfig)
		want   string // substring of the error; "" for valid
	}{
		{"defaults", func(*NodeConfig) {}, ""},
		{"loopback, fixed port", func(c *NodeConfig) { c.BindAddr, c.BindPort = "127.0.0.1", 7946 }, ""},
		{"bind address not an IP", func(c *NodeConfig) { c.BindAddr = "localhost" }, "BindAddr"},
		{"advertise address not an IP", func(c *NodeConfig) { c.AdvertiseAddr = "host:1" }, "AdvertiseAddr"},
		{"port out of range", func(c *NodeConfig) { c.BindPort = 70000 }, "BindPort"},
		{"probe timeout not below interval", func(c *NodeConfig) { c.ProbeTimeout = c.ProbeInterval }, "ProbeTimeout"},
		{"zero probe interval", func(c *NodeConfig) { c.ProbeInterval = 0 }, "ProbeInterval"},
		{"zero suspicion", func(c *NodeConfig) { c.SuspicionMult = 0 }, "SuspicionMult"},
		{"zero gossip interval", func(c *NodeConfig) { c.GossipInterval = 0 }, "GossipInterval"},
		{"label too long", func(c *NodeConfig) { c.Cluster = strings.Repeat("x", 256) }, "Cluster"},
		{"several at once", func(c *NodeConfig) { c.TCPTimeout, c.GossipNodes = 0, 0 }, "TCPTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultNodeConfig()
			tt.change(&c)
			err := c.validate()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("validate: %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("validate = %v, want an error about %s", err, tt.want)
			}
		})
	}
}

func TestParseMemberlistLog(t *testing.T) {
	tests := []struct{ in, level, msg string }{
		{"[DEBUG] memberlist: Failed UDP ping: b (timeout reached)\n", "DEBUG", "Failed UDP ping: b (timeout reached)"},
		{"[ERR] Failed to shutdown transport: x", "ERR", "Failed to shutdown transport: x"},
		{"no level here", "", "no level here"},
		{"[unterminated", "", "[unterminated"},
	}
	for _, tt := range tests {
		if level, msg := parseMemberlistLog(tt.in); level != tt.level || msg != tt.msg {
			t.Errorf("parseMemberlistLog(%q) = %q, %q; want %q, %q", tt.in, level, msg, tt.level, tt.msg)
		}
	}
}

// TestNodeTrackerDeadAddrs: what a reconnect tries is the round's peers
// declared dead: not those alive, not those that left, not those of
// another round, not this member.
func TestNodeTrackerDeadAddrs(t *testing.T) {
	now := time.Unix(0, 0)
	tr := newNodeTracker("self", DefaultNodeConfig())
	for i, name := range []string{"a", "b", "c", "d"} {
		tr.joined(name, fmt.Sprintf("10.0.0.%d:1", i+1), now)
	}
	tr.gone("a", "10.0.0.1:1", false, now) // declared dead
	tr.announcedLeave("b")
	tr.gone("b", "10.0.0.2:1", false, now) // left
	tr.gone("d", "10.0.0.4:1", false, now) // dead, but not of the round
	tr.expect([]string{"self", "a", "b", "c"})
	if got, want := tr.deadAddrs(), []string{"10.0.0.1:1"}; !slices.Equal(got, want) {
		t.Errorf("deadAddrs = %v, want %v", got, want)
	}
	tr.joined("a", "10.0.0.1:1", now.Add(time.Second)) // back
	if got := tr.deadAddrs(); len(got) != 0 {
		t.Errorf("deadAddrs after a rejoined = %v, want none", got)
	}
}
