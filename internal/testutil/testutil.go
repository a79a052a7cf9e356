// Package testutil holds small helpers shared by gorun's tests.
package testutil

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

// SyncBuffer is a bytes.Buffer that several goroutines (a process's output
// copier and the test) may use at once.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// BuildGorun builds the static gorun binary into the test's temporary
// directory and returns its path.
func BuildGorun(t testing.TB) string {
	t.Helper()
	_, self, _, _ := runtime.Caller(0)
	pkg := filepath.Join(filepath.Dir(self), "..", "..", "cmd", "gorun")
	bin := filepath.Join(t.TempDir(), "gorun")
	cmd := exec.Command("go", "build", "-o", bin, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build gorun: %v\n%s", err, out)
	}
	return bin
}
