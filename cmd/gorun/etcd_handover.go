package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/gorunhq/gorun/launcher"
)

// etcd's client and its gRPC stack are a quarter of gorun's binary and cost
// every launch about 4 ms of start-up and 5 MiB of memory, so `make build`
// builds two programs from this package: bin/gorun without the etcd
// backends (the gorun_noetcd tag) and bin/gorun-etcd with everything. The
// first hands a job with --rdzv-backend etcd over to the second by exec:
// same process, same arguments and environment, as if the user had run
// gorun-etcd. A plain `go build ./cmd/gorun` has everything and never
// hands over.

// etcdBuildName is the full build's file name.
const etcdBuildName = "gorun-etcd"

// handOverEnv is set for the full build by the hand-over: a gorun-etcd
// that was itself built without etcd would otherwise hand over to itself
// forever. The full build clears it (see main), so workers never see it.
const handOverEnv = "GORUN_ETCD_HANDOVER"

// argvKey is where runApp leaves the command line in the app's metadata:
// the hand-over passes it on unchanged.
const argvKey = "argv"

// handOverToEtcdBuild replaces this process with gorun-etcd, run with
// argv's arguments. It returns only when it cannot: no gorun-etcd next to
// this executable or on PATH, or one that would hand over again.
func handOverToEtcdBuild(argv []string) error {
	if prev := os.Getenv(handOverEnv); prev != "" {
		return usageErrorf("--rdzv-backend etcd: %s, which %s started for it, has no etcd backends either: rebuild it (make build)", prev, etcdBuildName)
	}
	path, err := findEtcdBuild()
	if err != nil {
		return usageErrorf("--rdzv-backend etcd: %v, and it hands etcd jobs to %s: %v (make build builds both)", launcher.ErrEtcdNotLinked, etcdBuildName, err)
	}
	if len(argv) == 0 {
		argv = os.Args
	}
	env := append(os.Environ(), handOverEnv+"="+path)
	err = syscall.Exec(path, append([]string{path}, argv[1:]...), env)
	return usageErrorf("--rdzv-backend etcd: running %s: %v", path, err)
}

// findEtcdBuild looks for gorun-etcd next to this executable, then on
// PATH.
func findEtcdBuild() (string, error) {
	var next string
	if self, err := os.Executable(); err == nil {
		next = filepath.Join(filepath.Dir(self), etcdBuildName)
		if st, err := os.Stat(next); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return next, nil
		}
	}
	if p, err := exec.LookPath(etcdBuildName); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("none at %s or on PATH", next)
}
