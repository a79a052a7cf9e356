package rendezvous_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any of them leaves a goroutine
// running: heartbeats, waits and connections must all be gone at the end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
