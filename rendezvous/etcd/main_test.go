package etcd_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any of them leaves a goroutine
// running: watches, keep-alives, servers and clients must all be gone. The
// test binary is also the large-value writer that
// TestStorageOrphanChunksSwept kills (writerEnv).
func TestMain(m *testing.M) {
	if spec := os.Getenv(writerEnv); spec != "" {
		os.Exit(runWriter(spec))
	}
	goleak.VerifyTestMain(m)
}
