package torch_test

import (
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/torchtest"
)

// TestTorchFTSwitchStep checks the agreement on the step at which the
// members of a grow switch to the group built in the background
// (gorun_ft's _switch_due), with a stand-in store and no process group:
// members step in lockstep (a member checks step k only once every member
// has checked step k-1, as a collective per step makes them), in random
// orders, and the leader's build completes at a random point. Every member
// must switch at the same step, and that step must come after the leader
// set it.
func TestTorchFTSwitchStep(t *testing.T) {
	out := torchtest.Run(t, time.Minute, nil, `
import random, sys, threading
sys.path.insert(0, sys.argv[1])
import gorun_ft

class Store:
    """The store as the members see it: one server, requests in order."""
    def __init__(self):
        self.kv = {}
    def add(self, k, n):
        self.kv[k] = int(self.kv.get(k, 0)) + n
        return self.kv[k]
    def get(self, k):
        return str(self.kv[k]).encode()
    def compare_set(self, k, old, new):
        if k not in self.kv and old == "":
            self.kv[k] = new
        return str(self.kv[k]).encode()

def member(store, g, grow):
    m = object.__new__(gorun_ft.ElasticGroup)
    m.store, m.global_rank, m._ns = store, g, "ns"
    m.epoch = gorun_ft.Epoch.initial(len(grow.ranks) - 1)
    m._published, m._ticks, m._due_at = grow.number, 0, None
    m._bg = gorun_ft._Build(grow, 0)
    m._bg.pg = object()  # built
    return m

bad = 0
for trial in range(300):
    rng = random.Random(trial)
    world = rng.randint(2, 5)
    grow = gorun_ft.Epoch(1, [], [], list(range(world + 1)), world + 1, "grow", added=[world])
    store = Store()
    ms = [member(store, g, grow) for g in range(world)]
    built_at = rng.randint(0, 6 * world)  # events before every member has built
    switched = {}
    events = 0
    while len(switched) < world:
        low = min(m._ticks for m in ms)
        ready = [m for m in ms if m.global_rank not in switched and m._ticks <= low]
        m = rng.choice(ready)
        if events == built_at:
            store.add("ns/epoch_1/built", world + 1)
        events += 1
        t = m._ticks
        due = m._due()
        m._ticks += 1
        if due:
            switched[m.global_rank] = t
            m._ticks = 10**9  # out of the old group's steps
        if t > 200:
            break
    steps = set(switched.values())
    set_at = store.kv.get("ns/epoch_1/switch")
    if len(switched) != world or len(steps) != 1:
        bad += 1
        print("trial", trial, "world", world, "switched at", switched, "set", set_at)
print("bad", bad)
`, thisDir())
	if !strings.Contains(out, "bad 0") {
		t.Errorf("members switched at different steps:\n%s", out)
	}
}
