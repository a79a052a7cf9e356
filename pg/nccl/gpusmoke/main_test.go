//go:build cgo && linux

package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
)

// gpusmoke built into the temporary directory, where the sid bed sees it.
func build(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "gpusmoke")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// TestProbeRealNCCL: -probe against the sid bed's NCCL 2.29.7, inside the
// bed (the library needs a newer glibc than Debian 12's), with no GPU and
// no CUDA driver: one line and exit 0. Without -probe the same machine
// fails with one clear line.
func TestProbeRealNCCL(t *testing.T) {
	bed := sidbed.Require(t)
	bin := build(t)
	for _, tc := range []struct {
		name     string
		args     []string
		wantCode int
		want     string
	}{
		{"probe", []string{"-probe", "-nccl", "/usr/lib/x86_64-linux-gnu/libnccl.so.2"}, 0,
			"nccl version=" + bed.Stamp.NCCL + " symbols=21/21 shrink=yes revoke=yes grow=yes uniqueid=ok"},
		{"probe, default library", []string{"-probe"}, 0,
			"nccl version=" + bed.Stamp.NCCL + " symbols=21/21 shrink=yes revoke=yes grow=yes uniqueid=ok"},
		{"probe, no such library", []string{"-probe", "-nccl", "/nonexistent/libnccl.so.2"}, 1,
			"FAIL nccl probe: pg/nccl: cannot load /nonexistent/libnccl.so.2: "},
		{"smoke without a GPU", nil, 1,
			"FAIL gpu-smoke: ProcessGroupNCCL is only supported with GPUs, no GPUs found! (pg/nccl: cannot load libcuda.so.1: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
			defer cancel()
			cmd := bed.Command(ctx, bin, tc.args...)
			cmd.Env = append(os.Environ(), "GORUN_NCCL_LIBRARY=", "GORUN_CUDA_LIBRARY=")
			out, err := cmd.CombinedOutput()
			code := 0
			if err != nil {
				ee, ok := err.(*exec.ExitError)
				if !ok {
					t.Fatalf("%v\n%s", err, out)
				}
				code = ee.ExitCode()
			}
			lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
			if code != tc.wantCode || len(lines) != 1 || !strings.HasPrefix(lines[0], tc.want) {
				t.Fatalf("exit %d, printed\n%s\nwant exit %d and one line starting %q", code, out, tc.wantCode, tc.want)
			}
		})
	}
}
