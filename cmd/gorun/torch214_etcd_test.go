package main

import (
	"testing"

	"github.com/gorunhq/gorun/internal/etcdtest"
	"github.com/gorunhq/gorun/internal/sidbed"
	"github.com/gorunhq/gorun/internal/testutil"
)

// TestTorch214GlooEtcd: two agents meet through etcd, two PyTorch 2.14
// workers each (the sid bed's python); every worker bootstraps gloo from
// its own node's store (etcd underneath) and the four all_reduce together.
func TestTorch214GlooEtcd(t *testing.T) {
	t.Parallel()
	bed := sidbed.Require(t)
	cluster := etcdtest.Start(t, 1, etcdtest.Options{})
	bin, script := testutil.BuildGorun(t), bedScript(t, bed, "allreduce.py") // with the etcd backend
	var agents []*agentProc
	for range 2 {
		agents = append(agents, startAgentEnv(t, bin, []string{"PYTHON_EXEC=" + bed.Python()},
			etcdArgs(cluster, "2", "", "--nproc-per-node", "2", "--log-dir", t.TempDir(), script)...))
	}
	expectGlooAllreduce(t, agents, 2, nil)
}
