package etcd_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any of them leaves a goroutine
// running: watches, keep-alives, servers and clients must all be gone.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
