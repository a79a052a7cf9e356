package torch_test

import (
	"strings"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/torchtest"
)

// TestTorchFTSeversItsGroup: what gorun_ft does to a gloo group whose
// epoch is over (a peer's host may have gone silent: no reset will come).
// The connections opened while the group formed are shut down, so their
// peers read end of file at once; a connection to the worker store
// (MASTER_PORT) opened meanwhile, one the program opened before, and the
// group's listener are left alone. The peers are another process, as a
// group's are.
func TestTorchFTSeversItsGroup(t *testing.T) {
	out := torchtest.Run(t, time.Minute, nil, `
import os, socket, subprocess, sys
sys.path.insert(0, sys.argv[1])
import gorun_ft

peer = subprocess.Popen([sys.executable, "-c", r'''
import socket, sys
store = socket.create_server(("127.0.0.1", 0))
other = socket.create_server(("127.0.0.1", 0))
print(store.getsockname()[1], other.getsockname()[1], flush=True)
conns = {}
for l in (other, store, other):
    s, _ = l.accept()
    conns[s.recv(5).decode()] = s
sys.stdin.readline()  # the parent has severed
for name in ("group", "store", "mine_"):
    s = conns[name]
    s.settimeout(0.5)
    try:
        got = "eof" if s.recv(1) == b"" else "data"
    except socket.timeout:
        got = "open"
    print(name.strip("_"), got, flush=True)
'''], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
store_port, other_port = map(int, peer.stdout.readline().split())
os.environ["MASTER_PORT"] = str(store_port)

def dial(port, name):
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(name.encode())
    return c

mine = dial(other_port, "mine_")     # the program's own, before the group
before = gorun_ft._socket_inodes()
store = dial(store_port, "store")    # a store connection opened meanwhile
group = dial(other_port, "group")    # the group's
listener = socket.create_server(("127.0.0.1", 0))  # the group's too: gloo's own
opened = {i for i, fd in gorun_ft._socket_inodes().items() if i not in before and not gorun_ft._to_store(fd)}
gorun_ft._sever(opened)
# The listener is left listening (gloo 2.x aborts when its accept fails).
late = socket.create_connection(listener.getsockname())
listener.settimeout(5)
print("listener", "accepts" if listener.accept() else "refuses")
out, _ = peer.communicate("severed\n", timeout=30)
print(out)
`, thisDir())
	for _, want := range []string{"group eof", "store open", "mine open", "listener accepts"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
}
