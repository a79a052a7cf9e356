package tcpstore

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any of them leaves a goroutine
// running: every connection, server and AfterFunc must be gone at the end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
