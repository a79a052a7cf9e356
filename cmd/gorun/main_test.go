package main

import (
	"os"
	"testing"

	"github.com/gorunhq/gorun/launcher/cgroup"
)

// TestMain lets the test binary serve as the cgroup guard of the agents
// the tests run in-process (the CLI names its own executable).
func TestMain(m *testing.M) {
	cgroup.RunGuardIfAsked()
	os.Exit(m.Run())
}
