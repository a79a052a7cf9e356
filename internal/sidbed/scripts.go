package sidbed

// The files the bed writes next to (enter, bin/*) and into (apt settings,
// sitecustomize) its chroot. They belong to the test bed, never to gorun.

// enterScript runs a program inside the chroot next to it, in a private
// mount namespace of its own (unshare -m), so that /proc, /dev, /sys, the
// host's /etc/hosts and the host's temporary directory are mounted for that
// program only and vanish with the namespace's last process, even when it
// is killed. unshare, sh and chroot each exec the next, so the program
// keeps the PID the caller started: signals reach it directly.
const enterScript = `#!/bin/sh
# enter: run a program inside gorun's Debian sid test bed (internal/sidbed).
# usage: enter PROGRAM [ARG...]
# A private mount namespace per run: nothing is mounted on the host, and
# nothing is left mounted when the run ends or is killed.
set -eu
here=$(cd "$(dirname "$0")" && pwd -P)
if [ "${GORUN_SID_BED_NS:-}" != "$here" ]; then
	GORUN_SID_BED_NS=$here exec unshare --mount --propagation private -- "$here/enter" "$@"
fi
unset GORUN_SID_BED_NS
root=$here/root
tmp=$(cd "${TMPDIR:-/tmp}" && pwd -P)
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount --bind /etc/hosts "$root/etc/hosts"
mkdir -p "$root$tmp"
mount --rbind "$tmp" "$root$tmp"
cwd=$(pwd -P)
exec chroot "$root" /bin/sh -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' enter "$cwd" "$@"
`

// pythonWrapper and torchrunWrapper are host-side executables for the bed's
// interpreter and torchrun (what PYTHON_EXEC or a test names).
const pythonWrapper = `#!/bin/sh
# python3 of gorun's sid test bed (internal/sidbed): runs inside the chroot.
exec "$(dirname "$0")/../enter" /usr/bin/python3 "$@"
`

const torchrunWrapper = `#!/bin/sh
# torchrun of gorun's sid test bed (internal/sidbed): runs inside the chroot.
exec "$(dirname "$0")/../enter" /usr/bin/python3 -m torch.distributed.run "$@"
`

// aptConf: the mirror's sid Release is past its Valid-Until date (the
// mirror is a dated snapshot), and the bed wants nothing but what it names.
const aptConf = `// gorun sid test bed (internal/sidbed)
Acquire::Check-Valid-Until "false";
APT::Install-Recommends "false";
APT::Install-Suggests "false";
`

// classicHook (the module gorun_sid_bed_classic, imported at start-up by a
// .pth file: Debian's own sitecustomize takes that name) makes TCPStore's
// classic backend the default inside the bed. Debian builds torch without libuv, yet TCPStore defaults to
// use_libuv=True, and the agent store torchrun 2.x creates (and the path in
// torch/distributed/rendezvous.py that workers take with an agent store)
// ignores USE_LIBUV: without this, torchrun 2.14 fails in the bed. The hook
// costs nothing until torch.distributed is imported: it then replaces
// torch._C._distributed_c10d.TCPStore, before torch.distributed binds the
// name, by a subclass whose use_libuv defaults to False. An explicit
// use_libuv=True still asks for libuv (and fails, as Debian's torch does).
const classicHook = `# gorun sid test bed (internal/sidbed), never part of gorun: Debian's
# torch has no libuv, so make TCPStore's classic backend the default.
import sys as _sys
from importlib.machinery import PathFinder as _PathFinder


def _classic(c10d):
    base = c10d.TCPStore
    if getattr(base, "_gorun_bed_classic", False):
        return

    class TCPStore(base):
        _gorun_bed_classic = True

        def __init__(self, *args, **kwargs):
            if len(args) < 9:
                kwargs.setdefault("use_libuv", False)
            super().__init__(*args, **kwargs)

    TCPStore.__module__ = base.__module__
    TCPStore.__qualname__ = base.__qualname__
    TCPStore.__doc__ = base.__doc__
    c10d.TCPStore = TCPStore
    for name, mod in list(_sys.modules.items()):
        if name.startswith("torch") and getattr(mod, "TCPStore", None) is base:
            mod.TCPStore = TCPStore


class _Finder:
    # torch.distributed creates torch._C._distributed_c10d (_c10d_init) as
    # it runs, so the class is replaced right after that module has run,
    # in every torch module that bound the name by then.
    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed":
            return None
        spec = _PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            c10d = getattr(_sys.modules.get("torch._C"), "_distributed_c10d", None)
            if c10d is not None and hasattr(c10d, "TCPStore"):
                _classic(c10d)

        spec.loader.exec_module = exec_module
        return spec


_sys.meta_path.insert(0, _Finder())
`

// classicPth makes every interpreter in the bed import classicHook.
const classicPth = "import gorun_sid_bed_classic\n"
