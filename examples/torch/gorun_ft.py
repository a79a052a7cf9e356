"""Keep a PyTorch job running on the survivors when ranks die.

One file, nothing beyond torch. Under `gorun --on-failure shrink` gorun's
agents agree on who is gone and publish each change of membership as an
*epoch* in the worker store (gorun's package shrink, key layout below). This
helper watches for epochs and moves the worker's default process group to
each one:

- with NCCL on a PyTorch that has ``dist.shrink_group`` (NCCL >= 2.27) it
  calls ``shrink_group(excluded, SHRINK_ABORT)``: NCCL itself terminates the
  operations stuck on the dead peer, then shrinks. The communicator must not
  be aborted first (ncclCommAbort frees it, leaving nothing to shrink);
- with NCCL on an older PyTorch, the watcher aborts the group when the
  epoch appears (so a collective stuck on a dead peer returns), and the
  group is destroyed and re-initialised among the survivors;
- with gloo (PyTorch 1.13 included), which cannot be aborted and whose
  collectives fail on their own when a peer's connection breaks, the group
  is destroyed and initialised anew among the survivors, on a fresh
  PrefixStore, with the new rank and world size.

Only the gloo path is tested (with PyTorch 1.13 and 2.14, in CI); the NCCL paths need
a GPU and have not run yet.

Use::

    import gorun_ft
    group = gorun_ft.ElasticGroup("gloo")
    while step < steps:
        try:
            if resync:                    # first collective of a new group
                group.resync(model_state...); resync = False
            if group.check():             # an epoch came meanwhile: moved
                resync = True; continue
            ...the step's collectives...
        except RuntimeError as err:       # a peer died mid-collective
            group.recover(err)            # wait for the epoch, then shrink
            resync = True

Board layout (prefix ``gorun/shrink``), shared with gorun's Go side:
``epoch/<n>`` holds epoch n as JSON (``epoch``, ``excluded``, ``lost``,
``ranks``, ``world_size``, ``action``, ``reasons``); ``ack/<n>`` counts the
survivors that moved to epoch n.
"""
import datetime
import gc
import json
import os
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

BOARD_PREFIX = "gorun/shrink"
# How long the watcher's store wait lasts before it checks whether to stop.
WATCH_WAIT = datetime.timedelta(seconds=1)
# How long a survivor waits for the agents' next epoch, past the agreement
# timeout gorun passes (GORUN_AGREEMENT_TIMEOUT, seconds), for the agents to
# find the failure in the first place (a lost node takes about a second to
# be declared dead; a hung rank, the heartbeat timeout).
DETECTION_SLACK = 10.0
DEFAULT_AGREEMENT_TIMEOUT = 10.0


def _torch_version():
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# PyTorch 2.1 and later withdraw a timed-out wait on the wire (CANCEL_WAIT)
# and may go on using the connection. 1.13 to 2.0 only stop reading: the
# server still holds the wait and, when the key appears, answers it into
# whatever the connection is asked next; a server that answers every
# abandoned wait (gorun's did) makes the next wait return at once, for a
# key that does not exist. After a timed-out wait on those versions the
# connection is dropped.
WAIT_CANCELS = _torch_version() >= (2, 1)


class RestartRequired(Exception):
    """The agents decided to restart the group instead of shrinking it (too
    few survivors left). Exit non-zero: the launcher restarts the workers."""


class Excluded(Exception):
    """This rank was excluded by an epoch: it must stop, not rejoin."""


class Epoch:
    """One agreed membership. Ranks are global ranks (the launch numbering)."""

    def __init__(self, number, excluded, lost, ranks, world_size, action, reasons=None):
        self.number = number
        self.excluded = sorted(excluded)
        self.lost = sorted(lost)
        self.ranks = list(ranks)  # ranks[g]: g's rank in this epoch's group, -1 if lost
        self.world_size = world_size
        self.action = action
        self.reasons = reasons or {}

    @classmethod
    def initial(cls, world):
        return cls(0, [], [], range(world), world, "shrink")

    @classmethod
    def decode(cls, raw):
        d = json.loads(raw)
        return cls(d["epoch"], d.get("excluded") or [], d.get("lost") or [], d["ranks"],
                   d["world_size"], d["action"], d.get("reasons"))

    def alive(self, g):
        return 0 <= g < len(self.ranks) and self.ranks[g] >= 0

    def shrink_list(self, prev):
        """This epoch's excluded ranks in prev's numbering: what shrink_group takes."""
        return sorted(prev.ranks[g] for g in self.excluded if prev.alive(g))


def _connect_store(timeout):
    """The worker store: the agent's (TORCHELASTIC_USE_AGENT_STORE=True), or
    rank 0's, as env:// would have it."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    master = not agent and int(os.environ["RANK"]) == 0
    world = None if agent else int(os.environ["WORLD_SIZE"])
    return dist.TCPStore(host, port, world, master, timeout, wait_for_workers=False)


def _key(*parts):
    return "/".join((BOARD_PREFIX,) + tuple(str(p) for p in parts))


class _KeyWaiter:
    """Waits for keys with a timeout on a store connection of its own, which
    it drops after a timeout unless the client withdraws the wait on the
    wire (see WAIT_CANCELS): a connection that a timed-out wait left behind
    is never asked anything again."""

    def __init__(self, timeout):
        self._timeout = timeout
        self._store = None

    def wait(self, key, seconds):
        """True once key exists, False if seconds passed first. Raises
        RuntimeError when the store cannot be reached."""
        if self._store is None:
            self._store = _connect_store(self._timeout)
        try:
            self._store.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except RuntimeError as e:
            if not WAIT_CANCELS or "timeout" not in str(e).lower():
                self._store = None  # closes the connection
            if "timeout" in str(e).lower():
                return False
            raise

    def get(self, key):
        """key's value; call it only after wait(key) returned True."""
        return self._store.get(key)

    def close(self):
        self._store = None


class ElasticGroup:
    """The worker's default process group, moved from epoch to epoch."""

    def __init__(self, backend="gloo", timeout=datetime.timedelta(seconds=60), log=None):
        self.backend = backend
        self.timeout = timeout
        self.global_rank = int(os.environ["RANK"])
        self.epoch = Epoch.initial(int(os.environ["WORLD_SIZE"]))
        self._log = log or (lambda msg: print(msg, flush=True))
        # Each restart of the job bootstraps under its own namespace.
        self._ns = "gorun_ft/attempt_" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agreement = float(os.environ.get("GORUN_AGREEMENT_TIMEOUT") or DEFAULT_AGREEMENT_TIMEOUT)
        self._epoch_wait = agreement + DETECTION_SLACK
        # The main connection never waits with a timeout (see WAIT_CANCELS);
        # waits for epochs go through _KeyWaiters.
        self.store = _connect_store(timeout)
        self._awaiter = _KeyWaiter(timeout)
        self._seen = threading.Event()  # the watcher saw epoch n+1
        self._moved = threading.Event()  # recover() has moved past it
        self._stop = threading.Event()
        # Held while the epoch changes, so the watcher never aborts a group
        # that recover() has just built.
        self._lock = threading.Lock()
        self._init_group()
        self._watcher = threading.Thread(target=self._watch, name="gorun-ft-watch", daemon=True)
        self._watcher.start()

    @property
    def rank(self):
        return self.epoch.ranks[self.global_rank]

    @property
    def world_size(self):
        return self.epoch.world_size

    def _init_group(self):
        prefix = "%s/epoch_%d" % (self._ns, self.epoch.number)
        dist.init_process_group(self.backend, store=dist.PrefixStore(prefix, self.store),
                                rank=self.rank, world_size=self.world_size, timeout=self.timeout)

    def _watch(self):
        """Wait on the next epoch's key through a store connection of its own
        (a store wait, not polling); when it appears, flag it and, unless the
        group will be shrunk in place, abort it where the backend can, so a
        collective stuck on a dead peer returns to the training loop."""
        waiter = _KeyWaiter(self.timeout)
        while not self._stop.is_set():
            n = self.epoch.number + 1
            try:
                # Short waits, so that close() can join this thread soon.
                if not waiter.wait(_key("epoch", n), WATCH_WAIT.total_seconds()):
                    continue  # ask again
            except RuntimeError:
                # The store is unreachable: pause rather than spin;
                # recover() will report it when the worker needs it.
                self._stop.wait(1.0)
                continue
            with self._lock:
                if n != self.epoch.number + 1:
                    continue  # recover() moved on meanwhile
                self._seen.set()
                if not self._shrinks():
                    _abort_default_group()
            while not self._moved.wait(0.5) and not self._stop.is_set():
                pass
            self._moved.clear()
        waiter.close()

    def check(self):
        """Move to the next epoch if the watcher has seen one, and say whether
        it did. Call it once a step, before the step's collectives."""
        if self._seen.is_set():
            self.recover()
            return True
        return False

    def recover(self, err=None):
        """Wait for the next epoch and move the group to it. Raises Excluded if
        this rank is out, RestartRequired if the agents chose a restart."""
        if err is not None:
            self._log("rank %d: collective failed, awaiting the agents' decision: %s"
                      % (self.global_rank, str(err).splitlines()[0]))
            # The traceback holds the failed collective's frames, and through
            # them the backend's connections: let them go with the group.
            err.__traceback__ = None
        if not self._shrinks():
            # Tear the broken group down now, not after the decision: closing
            # our connections fails the collectives of peers still blocked
            # on us (ULFM's revoke), instead of leaving them to the group's
            # timeout.
            self._destroy()
        nxt = self._await(self.epoch.number + 1)
        with self._lock:
            prev, self.epoch = self.epoch, nxt
            if self._seen.is_set():
                self._seen.clear()
                self._moved.set()
        if not nxt.alive(self.global_rank):
            self.close()
            raise Excluded("rank %d excluded in epoch %d" % (self.global_rank, nxt.number))
        if nxt.action == "restart":
            self.close()
            raise RestartRequired("epoch %d: %d ranks left, below the floor: restart" % (nxt.number, nxt.world_size))
        if self._shrinks():
            flags = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)
            dist.shrink_group(nxt.shrink_list(prev), shrink_flags=flags)
        else:
            self._destroy()
            self._init_group()
        self.store.add(_key("ack", nxt.number), 1)
        self._log("shrink epoch=%d world=%d excluded=%s" % (nxt.number, nxt.world_size, nxt.excluded))
        return nxt

    def _shrinks(self):
        """Whether the group shrinks in place (NCCL with PyTorch's shrink_group)
        rather than being re-initialised among the survivors."""
        return self.backend == "nccl" and hasattr(dist, "shrink_group")

    @staticmethod
    def _destroy():
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass  # a broken group may refuse a clean teardown
        # Collect now: a failed collective's objects sit in reference cycles
        # (frames, exceptions), and its connections close only when they go.
        gc.collect()

    def _await(self, n):
        """Epoch n, once the agents publish it. A survivor never waits without
        end: past the agreement timeout (and the time to detect a failure)
        the agents have fallen back to a restart, or cannot decide; either
        way this worker stops as for a restart."""
        key = _key("epoch", n)
        deadline = time.monotonic() + self._epoch_wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RestartRequired("no epoch %d within %.0f s (GORUN_AGREEMENT_TIMEOUT plus %.0f s to detect "
                                      "the failure): restart" % (n, self._epoch_wait, DETECTION_SLACK))
            if self._awaiter.wait(key, min(left, 5.0)):
                return Epoch.decode(self._awaiter.get(key))

    def resync(self, *tensors):
        """Copy the new rank 0's tensors to every survivor: after a failure some
        survivors may have finished the failed step and others not."""
        for t in tensors:
            dist.broadcast(t, 0)

    def close(self):
        self._stop.set()
        # Join the watcher before the interpreter exits: a daemon thread
        # still inside a C++ store wait when Python finalizes is killed by
        # forced unwinding on its way back, and the process dies with
        # "terminate called without an active exception" (SIGABRT) after a
        # successful run.
        if self._watcher is not threading.current_thread():
            self._watcher.join(WATCH_WAIT.total_seconds() * 2)
        self._awaiter.close()
        self._destroy()


def _abort_default_group():
    """Abort the default group's communicators where the backend supports it
    (NCCL); gloo has no abort, and its collectives fail on their own when a
    peer's connection breaks. Never before shrink_group: see the module doc."""
    if not dist.is_initialized():
        return
    try:
        pg = dist.distributed_c10d._get_default_group()
        if torch.cuda.is_available() and hasattr(pg, "_get_backend"):
            backend = pg._get_backend(torch.device("cuda"))
            if hasattr(backend, "abort"):
                backend.abort()
    except (RuntimeError, AttributeError, ValueError):
        pass


def run(main):
    """Run main(); map the helper's outcomes to exit codes: 0 for an excluded
    rank (it is not restarted), 1 for RestartRequired."""
    try:
        return main()
    except Excluded as e:
        print(str(e), file=sys.stderr, flush=True)
        return 0
    except RestartRequired as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
