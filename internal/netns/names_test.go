package netns

import (
	"net/netip"
	"os"
	"regexp"
	"testing"
)

func TestSubnet(t *testing.T) {
	for _, tc := range []struct {
		idx  int
		want string
	}{
		{0, "198.18.0.0/24"},
		{255, "198.18.255.0/24"},
		{256, "198.19.0.0/24"},
		{maxBeds - 1, "198.19.255.0/24"},
	} {
		if got := subnet(tc.idx); got != netip.MustParsePrefix(tc.want) {
			t.Errorf("subnet(%d) = %s, want %s", tc.idx, got, tc.want)
		}
	}
}

func TestMatchIndex(t *testing.T) {
	for _, tc := range []struct {
		re   *regexp.Regexp
		name string
		idx  int
		ok   bool
	}{
		{stateRE, "b0", 0, true},
		{stateRE, "b511", 511, true},
		{stateRE, "b512", 0, false}, // beyond 198.18.0.0/15
		{stateRE, "lock", 0, false},
		{stateRE, "b12x", 0, false},
		{nsRE, hostNS(7, 3), 7, true},
		{nsRE, switchNS(42), 42, true},
		{nsRE, "gorun-b", 0, false},
		{nsRE, "gorun-b7", 0, false},
		{nsRE, "other-b7-h0", 0, false},
		{linkRE, gatewayLink(300), 300, true},
		{linkRE, "gorun3gwx", 0, false},
		{linkRE, "eth0", 0, false},
	} {
		idx, ok := matchIndex(tc.re, tc.name)
		if idx != tc.idx || ok != tc.ok {
			t.Errorf("matchIndex(%s, %q) = %d, %v, want %d, %v", tc.re, tc.name, idx, ok, tc.idx, tc.ok)
		}
	}
}

func TestOwner(t *testing.T) {
	me, err := self()
	if err != nil {
		t.Fatal(err)
	}
	got, err := parseOwner(me.String())
	if err != nil || got != me {
		t.Fatalf("parseOwner(%q) = %v, %v", me.String(), got, err)
	}
	if !me.alive() {
		t.Error("this process is not alive")
	}
	// The same PID with another start time is another process.
	if (owner{me.pid, me.start + 1}).alive() {
		t.Error("a reused PID counts as the owner")
	}
	if _, err := parseOwner("garbage"); err == nil {
		t.Error("parseOwner accepted garbage")
	}
	if os.Getpid() != me.pid {
		t.Errorf("self().pid = %d", me.pid)
	}
}
