"""Keep a PyTorch job running on the survivors when ranks die, and grow it
back when gorun respawns them.

One file, nothing beyond torch. Under `gorun --on-failure shrink` gorun's
agents agree on who is gone and publish each change of membership as an
*epoch* in the worker store (gorun's package shrink, key layout below). This
helper watches for epochs and moves the worker's default process group to
each one.

A shrink epoch drops the ranks that died:

- with NCCL the watcher aborts the group when the epoch appears (so a
  collective stuck on a dead peer returns), and the group is destroyed and
  re-initialised among the survivors. PyTorch's ``shrink_group`` is not
  used: it needs the communicator not aborted, and a survivor's main thread
  is then stuck in the collective on the dead peer (in the CUDA
  synchronisation after it) with nothing to end it, since PyTorch (2.11,
  2.14) does not expose ncclCommRevoke. Seen on an H100 with PyTorch 2.11
  and NCCL 2.28.9: the survivors stayed there until the grow's abort, then
  hung in shrink_group on the aborted communicator;
- with gloo (PyTorch 1.13 included), which cannot be aborted and whose
  collectives fail on their own when a peer's connection breaks, the group
  is destroyed and initialised anew among the survivors, on a fresh
  PrefixStore, with the new rank and world size.

A grow epoch (heal) brings lost launch slots back: gorun starts a *newcomer*
in each (GORUN_SHRINK_NEWCOMER set), the survivors keep their ranks and the
newcomers take the next ones. Neither gloo nor PyTorch's NCCL (2.14
included) grows a group in place, so the grow's members form a fresh group.
With gloo the survivors do not stop for it: each builds the grown group
(``ProcessGroupGloo`` on the epoch's PrefixStore, a constructor that
releases the GIL) in a thread of its own while its steps go on in the group
it holds; each member says when it has built it; the leader (rank 0 of the
grow) then sets the step to switch at, SWITCH_AHEAD steps ahead of its own,
and the others read it once a step (one store round trip, only while a grow
builds). At that step's check() every survivor makes the built group the
default group (init_process_group through a backend plugin that hands it
over), so its stall is the switch and the resync. Newcomers, and a member
that holds no group to step on (its group failed), build it where they are
and wait for the switch; a leader among them sets it for at once. Any other
epoch that comes meanwhile abandons the build (a built group's connections
are shut down) and stops the group in use, as below. With NCCL every member
stops where it is (the watcher aborts) and forms a fresh communicator.
A newcomer says it is ready (a ``join`` notice) once its constructor
runs, so survivors never wait on its imports, and waits for the grow that
adds its slot. The grow is complete once every member has acknowledged it;
the member that counts last says so (a ``complete`` notice), which the
agents need before they grow again. A grow that does not complete within
the agents' grow timeout (a newcomer that never came) is followed by a
shrink that excludes its newcomers, from the group before the grow: its
members re-form a fresh group of themselves, and a newcomer still waiting
offers its slot again. Every formation of a fresh group waits first, in
short store waits, for every member to be there, and gives up when the next
epoch appears, so nobody waits on a member that will not come. A member
lost while a group's constructor runs (the first group's included: the
watcher runs from the start) would hold the others there, waiting for its
address or its connection, until the group's timeout: the epoch that
excludes it shuts the constructor's store connection and the connections
it opened, which fails it at once, and the members move on as from a
failed collective.

What is tested (examples/torch, in CI): with gloo, shrink and grow with
PyTorch 1.13 and 2.14 (the survivors stepping while the grown group forms),
a rank lost before the first group forms (1.13 and 2.14), and with 1.13 a
grow whose newcomer is killed before it joins and a newcomer that joins
again after a grow that did not complete, under a real coordinator of
gorun's. NCCL needs a GPU, which CI does not have:
scripts/gpu-check.sh runs shrink and grow on one (see its RESULT lines and
README's compatibility table for what ran where).

Use::

    import gorun_ft
    group = gorun_ft.ElasticGroup("gloo")   # a newcomer joins here
    resync = group.newcomer                 # it takes the survivors' state
    while step < steps:
        try:
            if resync:                    # first collective of a new group
                group.resync(model_state...); resync = False
            if group.check():             # an epoch came meanwhile: moved
                resync = True; continue
            ...the step's collectives...
        except RuntimeError as err:       # a peer died mid-collective
            group.recover(err)            # wait for the epoch, then move
            resync = True

A worker that gorun pre-started (``--spare-prestart``: a hot spare's
workers, started while its agent stands by) is parked until its agent has
a place for it; ``await_assignment()`` (which ElasticGroup calls) waits for
it, so a script's imports and set-up are done before the job needs it.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT as gorun (and
torchrun) set them; GORUN_AGREEMENT_TIMEOUT (seconds) bounds the wait for
an epoch; GORUN_SHRINK_NEWCOMER=n makes the worker a newcomer for slot RANK,
n being the last epoch decided before it started; GORUN_GROW_TIMEOUT
(seconds, default 30, the agents' default) bounds, on top of the agreement
timeout, the waits that a grow can make longer; GORUN_JOB_SECRET, with
TORCHELASTIC_RUN_ID and GORUN_GENERATION, authenticates the board (below).
With NCCL the helper sets TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (no handling)
before it forms a group: gorun, like torchrun, exports 1, under which
PyTorch's watchdog takes the whole process down when a peer fails (seen:
the survivors killed a minute after the failure), and the survivors are to
carry on; the helper aborts a failed group itself, and drops it with
PyTorch's _abort_process_group where it has one (2.5 and later), since
destroy_process_group waits for ever on a failed NCCL group. Unless the
job sets them, it also sets TORCH_NCCL_DUMP_ON_TIMEOUT=0,
TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0 and TORCH_NCCL_TRACE_BUFFER_SIZE=0:
PyTorch 2.x's watchdog otherwise waits 60 s for a flight-recorder dump
after a failed collective, and the abort of the failed group waits with
it (nccl_environment). On PyTorch 2.x
the helper's store waits that time out (its watcher's, each second) make
the C++ TCPStore client log two warnings each (``waitForInput ... timed out
after 1000ms``): noise, not failures; TORCH_CPP_LOG_LEVEL=ERROR in the
worker's environment silences them. GORUN_FT_STACKS=1 makes SIGUSR1 print
every thread's Python stack to stderr (faulthandler), to see where a worker
waits; GORUN_FT_DEBUG=1 prints each group's connections (local and peer
port) and those a stop shuts down.

Board layout (prefix ``gorun/shrink``), shared with gorun's Go side:
``epoch/<n>`` holds epoch n as JSON (``epoch``, ``excluded``, ``lost``,
``added``, ``ranks``, ``world_size``, ``action``, ``base``, ``reasons``);
``ack/<n>/<slot>`` says that launch slot moved to epoch n (``epoch``,
``slot``), and ``ack/<n>`` counts those acks (a hint of when to look at
them, never trusted); ``report/<i>`` holds notice i, JSON with one of
``join``, ``joined`` or ``complete`` (and ``failure``, the agents' own),
written once at the first free index by a create-only compare-set;
``respawns/<k>`` are the agents' respawn tickets;
``floor`` says where the history kept starts (``epoch``, ``notice``,
``swept_epoch``, ``swept_notice``): the agents collect the epochs below
``swept_epoch``, with the keys their groups formed under
``gorun_ft/attempt_<k>/epoch_<n>/``, so a worker that waits for one of those
(a newcomer that fell a heal cycle behind) follows on from the floor's
``epoch``.

Authenticated board: when the job has a secret (GORUN_JOB_SECRET, which
gorun puts in every worker's environment), every record on the board ends
with one more field, ``..., "mac":"<64 lowercase hex>"}``: HMAC-SHA256 under
the secret of ``"gorun/shrink/v1\0" + scope + "\0" + key + "\0" + body``,
where scope is ``TORCHELASTIC_RUN_ID + "/" + GORUN_GENERATION`` (this round of
this job), key is relative to the prefix (``epoch/3``, ``report/12``) and
body is the record without its mac field. The helper verifies every epoch
it reads (one that fails, forged or replayed from another key or round, is
logged once and ignored: it waits on for the genuine one), and every ack it
counts, and seals every notice and ack it files. Without a secret, records are neither sealed nor checked.
"""
import contextlib
import datetime
import faulthandler
import gc
import hashlib
import hmac
import inspect
import json
import os
import re
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

BOARD_PREFIX = "gorun/shrink"
# The job secret's variable (shrink.SecretEnv), and the MAC's domain and
# field, as package shrink seals records.
SECRET_ENV = "GORUN_JOB_SECRET"
MAC_DOMAIN = b"gorun/shrink/v1\x00"
_MAC_FIELD = b',"mac":"'
_SEALED_TAIL = len(_MAC_FIELD) + 64 + 2  # ,"mac":"<64 hex>"}  less the body's "}"
# How often a reader looks again at an epoch key that holds a forged record,
# for the genuine epoch that replaces it (only while under attack).
FORGED_POLL = 0.05
# How long the watcher's store wait lasts before it checks whether to stop;
# also the slice of the waits that give up when the next epoch appears.
WATCH_WAIT = datetime.timedelta(seconds=1)
# How often (seconds) the epoch watcher, while it waits, looks whether the
# epoch it waits for was collected below the board's floor.
FLOOR_LOOK = 5.0
# How long a survivor waits for the agents' next epoch, past the agreement
# timeout gorun passes (GORUN_AGREEMENT_TIMEOUT, seconds), for the agents to
# find the failure in the first place (a lost node takes about a second to
# be declared dead; a hung rank, the heartbeat timeout).
DETECTION_SLACK = 10.0
DEFAULT_AGREEMENT_TIMEOUT = 10.0
# PyTorch 2.x's NCCL watchdog settings the helper sets unless the job
# does (nccl_environment).
NCCL_NO_DUMP = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}
# The flight recorder's size, under its new name and its old: 0 unless the
# job sets either (set by the old name, which PyTorch 2.11 read on the
# H200 and earlier 2.x releases know).
FLIGHT_RECORDER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# The agents' grow timeout (shrink.DefaultGrowTimeout): how long a grow has
# to complete before they exclude its newcomers again.
DEFAULT_GROW_TIMEOUT = 30.0


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


class NoAssignment(Exception):
    """A pre-started worker's agent ended its wait without giving it a place
    (the agent stopped, or gave the worker up): exit."""


def nccl_environment(env):
    """Set, in env (os.environ), what the helper needs of PyTorch's NCCL
    watchdog before a group is formed.

    No handling (TORCH_NCCL_ASYNC_ERROR_HANDLING=0, whatever the job set):
    the watchdog leaves a failed communicator and the process to the
    helper, which aborts the group when the agents' epoch comes (see the
    module doc). And, unless the job sets them, no flight-recorder dump
    and no wait for one: on a failed collective PyTorch 2.x's watchdog
    signals a dump and then waits four times
    TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default) for it, and the
    abort of the failed group waits with it: the survivors stood still for
    a minute after every loss (PyTorch 2.11, NCCL 2.28.9, on an H200).
    Nor a flight recorder, unless the job sizes it: the watchdog spent 5 s
    on the failed collective's recorded stack before it let the aborted
    group go, and the survivors waited for that. A peer lost is what heal
    expects, not a hang to debug.
    """
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    for k, v in NCCL_NO_DUMP.items():
        env.setdefault(k, v)
    if not any(k in env for k in FLIGHT_RECORDER):
        env[FLIGHT_RECORDER[-1]] = "0"


def await_assignment():
    """Wait, if gorun pre-started this worker (--spare-prestart, or a
    standby under --respawn-standbys), for the round or the lost slot that
    gives it its place, and put that place in os.environ.

    A pre-started worker is parked before its first collective: it has done
    its start-up (imports, device set-up) while its agent waited as a spare
    or for its job to form, but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    TORCHELASTIC_RESTART_COUNT, GORUN_SHRINK_NEWCOMER … are not set yet (a
    standby lacks LOCAL_RANK too: pick the device after this returns).
    The agent writes them, as one JSON object ``{"env": {...}}``, on the
    inherited descriptor named in GORUN_ASSIGNMENT_FD and closes it (Go's
    package prestart is the other side). Returns True when the worker was
    parked, False at once when it was not, so a script can call it
    unconditionally, after its imports and before it reads its rank;
    ElasticGroup calls it too."""
    fd = os.environ.pop("GORUN_ASSIGNMENT_FD", None)
    if fd is None:
        return False
    if not fd.isdigit():
        raise ValueError("GORUN_ASSIGNMENT_FD=%r: not a file descriptor" % fd)
    with os.fdopen(int(fd), "rb") as f:
        raw = f.read(1 << 20)
    if not raw:
        raise NoAssignment("the agent ended the pre-started worker's wait without an assignment")
    for k, v in json.loads(raw)["env"].items():
        os.environ[k] = v
    return True


class RestartRequired(Exception):
    """The agents decided to restart the group instead of shrinking it (too
    few survivors left). Exit non-zero: the launcher restarts the workers."""


class Excluded(Exception):
    """This rank was excluded by an epoch: it must stop, not rejoin."""


class Epoch:
    """One agreed membership. Ranks are global ranks (the launch numbering,
    which a newcomer keeps: its RANK is the slot it fills)."""

    def __init__(self, number, excluded, lost, ranks, world_size, action, reasons=None, added=(), base=None):
        self.number = number
        self.excluded = sorted(excluded)
        self.lost = sorted(lost)
        self.added = sorted(added)
        self.ranks = list(ranks)  # ranks[g]: g's rank in this epoch's group, -1 if lost
        self.world_size = world_size
        self.action = action
        # The epoch whose group the members move from: the one before, or,
        # after a grow that did not complete, that grow's own base.
        self.base = number - 1 if base is None else base
        self.reasons = reasons or {}

    @classmethod
    def initial(cls, world):
        return cls(0, [], [], range(world), world, "shrink", base=0)

    @classmethod
    def decode(cls, raw):
        d = json.loads(raw)
        return cls(d["epoch"], d.get("excluded") or [], d.get("lost") or [], d["ranks"],
                   d["world_size"], d["action"], d.get("reasons"), d.get("added") or [], d.get("base"))

    def alive(self, g):
        return 0 <= g < len(self.ranks) and self.ranks[g] >= 0

    def newcomer(self, g):
        """Whether launch slot g joins this epoch's group as a newcomer."""
        return g in self.added

    def line(self):
        """What a member prints on moving to this epoch."""
        if self.action == "grow":
            return "grow epoch=%d world=%d added=%s" % (self.number, self.world_size, self.added)
        return "shrink epoch=%d world=%d excluded=%s" % (self.number, self.world_size, self.excluded)


def _agent_store():
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _connect_store(timeout, serve=False):
    """A connection to the worker store: the agent's
    (TORCHELASTIC_USE_AGENT_STORE=True), or rank 0's, as env:// would have
    it; with serve, rank 0 serves it (its first connection only)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = None if _agent_store() else int(os.environ["WORLD_SIZE"])
    return dist.TCPStore(host, port, world, serve, timeout, wait_for_workers=False)


def _rel(*parts):
    """A board key relative to the prefix, as records are sealed for."""
    return "/".join(str(p) for p in parts)


def _key(*parts):
    return BOARD_PREFIX + "/" + _rel(*parts)


class Forged(ValueError):
    """A record on the board failed authentication."""

    def __init__(self, key, reason):
        super().__init__("%s: forged record: %s" % (key, reason))
        self.key, self.reason = key, reason


def board_mac(secret, scope, key, body):
    """The MAC of record body (bytes, without its mac field) at board key
    key (relative to the prefix), for round scope, under secret (bytes):
    lowercase hex, as package shrink computes it."""
    msg = MAC_DOMAIN + scope + b"\x00" + key + b"\x00" + body
    return hmac.new(secret, msg, hashlib.sha256).hexdigest().encode("ascii")


def seal_record(secret, scope, key, body):
    """body, a JSON object (bytes), with its mac field spliced in last."""
    if len(body) < 3 or body[:1] != b"{" or body[-1:] != b"}":
        raise ValueError("seal %r: want a non-empty JSON object" % key)
    return body[:-1] + _MAC_FIELD + board_mac(secret, scope, key, body) + b'"}'


def open_record(secret, scope, key, rec):
    """The body of sealed record rec read at key, or Forged: no MAC, a MAC
    out of shape, or one that does not match (forged, or replayed from
    another key or round)."""
    n = len(rec)
    if n < _SEALED_TAIL + 2 or rec[-2:] != b'"}' or rec[n - _SEALED_TAIL:n - _SEALED_TAIL + len(_MAC_FIELD)] != _MAC_FIELD:
        raise Forged(key.decode(errors="replace"), "malformed MAC" if b'"mac"' in rec else "no MAC")
    digits = rec[n - _SEALED_TAIL + len(_MAC_FIELD):n - 2]
    if any(c not in b"0123456789abcdef" for c in digits):
        raise Forged(key.decode(errors="replace"), "malformed MAC")
    body = rec[:n - _SEALED_TAIL] + b"}"
    if not hmac.compare_digest(digits, board_mac(secret, scope, key, body)):
        raise Forged(key.decode(errors="replace"), "bad MAC")
    return body


class BoardAuth:
    """The job secret and this round's scope, from the environment: seals
    the records this worker files and opens those it reads, logging each
    distinct forgery once (the watcher and the main thread both read)."""

    def __init__(self, secret, scope, log):
        self._secret, self._scope, self._log = secret, scope, log
        self._lock = threading.Lock()
        self._seen = set()
        self.forgeries = 0

    @classmethod
    def from_env(cls, log):
        """The environment's BoardAuth, None when the job has no secret. The
        variables are read as bytes, as Go reads them."""
        env = os.environb
        secret = env.get(SECRET_ENV.encode())
        if not secret:
            return None
        scope = env.get(b"TORCHELASTIC_RUN_ID", b"") + b"/" + env.get(b"GORUN_GENERATION", b"")
        return cls(secret, scope, log)

    def seal(self, key, body):
        return seal_record(self._secret, self._scope, key.encode(), body)

    def open(self, key, rec):
        if isinstance(rec, str):
            rec = rec.encode("utf-8", "surrogateescape")
        try:
            return open_record(self._secret, self._scope, key.encode(), rec)
        except Forged as f:
            seen = (key, hashlib.sha256(rec).digest())
            with self._lock:
                new = seen not in self._seen
                if new:
                    self._seen.add(seen)
                    self.forgeries += 1
            if new:
                self._log("ignored a forged record at %s: %s" % (key, f.reason))
            raise


def _now():
    """The time as RFC 3339, which Go's time.Time reads."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(name, default):
    v = os.environ.get(name)
    return float(v) if v else default


class _Beats:
    """Heartbeats to the agent, when it asks for them (GORUN_HEARTBEAT, with
    --heartbeat-timeout): a progress beat once a step, and wait beats, a few
    a heartbeat timeout (GORUN_HEARTBEAT_TIMEOUT), from a thread of their
    own while the worker is blocked on its peers. A rank that hangs stops
    its peers at their next collective; their wait beats tell the agent
    they are alive, so that it declares the silent one alone hung."""

    def __init__(self):
        self._path = os.environ.get("GORUN_HEARTBEAT", "")
        self._rank = os.environ.get("LOCAL_RANK", "0")
        timeout = float(os.environ.get("GORUN_HEARTBEAT_TIMEOUT", "") or 0)
        self._every = min(max(timeout / 4, 0.01), 1.0) if timeout > 0 else 0.25
        self._sock = None
        if self._path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._depth = 0
        self._lock = threading.Lock()
        self._on = threading.Event()
        self._thread = None

    def _send(self, msg):
        try:
            self._sock.sendto(msg, self._path)
        except OSError:
            pass  # a beat lost is the agent's to judge

    def progress(self):
        """A step is done."""
        if self._sock is not None:
            self._send(self._rank.encode())

    def done(self):
        """Training is over: the agent no longer watches this worker, so its
        teardown, however long, is no hang."""
        if self._sock is not None:
            self._send((self._rank + " done").encode())

    @contextlib.contextmanager
    def blocked(self):
        """Wait beats for as long as the block runs."""
        if self._sock is None:
            yield
            return
        with self._lock:
            self._depth += 1
            self._on.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gorun-ft-beats", daemon=True)
                self._thread.start()
        self._send((self._rank + " wait").encode())
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._on.clear()

    def _run(self):
        msg = (self._rank + " wait").encode()
        while True:
            self._on.wait()
            time.sleep(self._every)
            if self._on.is_set():
                self._send(msg)


class _KeyWaiter:
    """Waits for keys with a timeout on a store connection of its own, which
    it drops after a timeout unless the client withdraws the wait on the
    wire (see WAIT_CANCELS): a connection that a timed-out wait left behind
    is never asked anything again."""

    def __init__(self, timeout):
        self._timeout = timeout
        self._store = None

    def open(self):
        """Connect now rather than at the first wait; returns the waiter."""
        if self._store is None:
            self._store = _connect_store(self._timeout)
        return self

    def wait(self, keys, seconds):
        """True once every key exists, False if seconds passed first. Raises
        RuntimeError when the store cannot be reached."""
        if self._store is None:
            self._store = _connect_store(self._timeout)
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(seconds, 0.001)))
            return True
        except RuntimeError as e:
            if not WAIT_CANCELS or "timeout" not in str(e).lower():
                self._store = None  # closes the connection
            if "timeout" in str(e).lower():
                return False
            raise

    def get(self, key):
        """key's value; call it only after wait([key]) returned True."""
        return self._store.get(key)

    def peek(self, key):
        """key's value, or None while it does not exist, without waiting
        (see _probe)."""
        if self._store is None:
            self._store = _connect_store(self._timeout)
        return _probe(self._store, key)

    def close(self):
        self._store = None


# What _probe compare-sets: a value no writer of the board ever stores.
PEEK_PROBE = "gorun_ft: a probe, never stored"


def _probe(store, key):
    """key's value on store, or None while it does not exist, at once: a
    compare-set that never matches (c10d answers one on an absent key with
    the expected value, and writes nothing). A timed wait would not do:
    1.13 has no check(), and a short wait may time out on a key that is
    there, on a loaded machine (it did: a grow then completed only through
    the leader's look at its timeout)."""
    got = store.compare_set(key, PEEK_PROBE, PEEK_PROBE + " (never stored)")
    return None if got == PEEK_PROBE.encode("ascii") else got

# How many steps ahead of the leader's current step the switch to a grow's
# group is set. The leader publishes it in its check() of step t, before
# that step's collective. Members step in lockstep (every step's
# collective needs all of them), so another member's check of step t+1
# comes after it finished step t's collective, which the leader entered
# after publishing: that check reads the switch for sure. Its check of
# step t may come before the publication: one is the least that is safe
# (TestTorchFTSwitchStep fails with 0).
SWITCH_AHEAD = 1
# The backend name under which a group built ahead of its switch is made
# the default group: a plugin whose creator hands over the built gloo
# group, so that init_process_group does its bookkeeping (and, on 1.13,
# its barrier) without connecting anything.
PREBUILT_BACKEND = "gorun_prebuilt"
_prebuilt = []  # the group init_process_group is to take


def _take_prebuilt(store, rank, size, timeout):
    pg = _prebuilt.pop()
    if pg.rank() != rank or pg.size() != size:
        raise RuntimeError("prebuilt group is rank %d of %d, wanted %d of %d" % (pg.rank(), pg.size(), rank, size))
    return pg


def _register_prebuilt():
    if hasattr(dist.Backend, PREBUILT_BACKEND.upper()):
        return
    # 2.x asks which devices a plugin serves (and warns when not told).
    kw = {"devices": ["cpu"]} if "devices" in inspect.signature(dist.Backend.register_backend).parameters else {}
    dist.Backend.register_backend(PREBUILT_BACKEND, _take_prebuilt, **kw)


def _backend_of_default_group():
    """The default group's gloo backend object. Holding it keeps its
    connections open after destroy_process_group (both 1.13 and 2.x)."""
    pg = dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")) if hasattr(pg, "_get_backend") else pg


def _construct(e, timeout):
    """A store connection of its own for epoch e's group, and the
    _Construction that will track the group's constructor."""
    before = _socket_inodes()
    store = _connect_store(timeout)
    mine = {i for i, fd in _socket_inodes().items() if i not in before and _to_store(fd)}
    return store, _Construction(e, mine)


class _Construction:
    """A group's constructor at work (init_process_group, or a grow's
    ProcessGroupGloo), which a later epoch may make moot. A constructor
    waits on every member, for its address in the store and then its
    connection, up to the group's timeout: one whose member died before
    the group formed would hold the survivors a minute. Shutting down the
    group's store connection and the connections opened since the
    constructor began fails it at once (a RuntimeError), as _sever fails a
    formed group's collectives."""

    def __init__(self, e, store_sockets):
        self.epoch = e
        self.store_sockets = store_sockets  # inodes of the group's store connection
        self.before = None  # the sockets open when the constructor began

    def begin(self):
        """Mark the constructor's start: sockets opened from here on are the
        group's."""
        self.before = set(_socket_inodes())
        return self

    def opened(self):
        """The connections opened since begin(), less any to the store (another
        thread's): inode → descriptor."""
        return {i: fd for i, fd in _socket_inodes().items() if i not in self.before and not _to_store(fd)}

    def sever(self):
        _debug("rank %s: epoch %d's group is moot before it formed" % (os.environ.get("RANK"), self.epoch.number))
        _sever(self.store_sockets | set(self.opened()))


class _Build:
    """A grow's gloo group under construction, not yet the default group:
    built in a thread of its own while the survivors step on the group the
    grow builds on, or in the caller's thread (a newcomer; a member that
    stopped)."""

    def __init__(self, e, ticks):
        self.epoch = e
        self.done = threading.Event()  # set once the build has ended, either way
        self.pg = None  # the built group
        self.store = None  # its store connection
        self.construction = None  # the _Construction, while its constructor runs
        self.sockets = set()  # inodes of the connections it opened
        self.error = None  # a RestartRequired for the main thread to raise
        self.abandoned = False  # a later epoch came: never switch to it
        self.switch = None  # the step to switch at (-1: at once), once known
        self.thread = None
        self.started = time.monotonic()
        self.ticks = ticks  # the member's step count when it began, or None
        self.before = None  # ms the member had stepped in its group by then


class ElasticGroup:
    """The worker's default process group, moved from epoch to epoch.

    A worker that gorun started as a newcomer (GORUN_SHRINK_NEWCOMER) joins
    the running group here, by the grow epoch that brings its slot back;
    ``newcomer`` is then True, and the worker takes the model from the
    survivors with resync() before its first step."""

    def __init__(self, backend="gloo", timeout=datetime.timedelta(seconds=60), log=None, on_ready=None):
        """on_ready, if given, is called once a newcomer has said it is
        ready (filed its first join): its start-up is over."""
        await_assignment()
        self.backend = backend
        if backend == "nccl":
            nccl_environment(os.environ)
        if os.environ.get("GORUN_FT_STACKS") and hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        self._on_ready = on_ready
        self.timeout = timeout
        self.global_rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        after = os.environ.get("GORUN_SHRINK_NEWCOMER", "")
        self.newcomer = after != ""
        if self.newcomer and not after.isdigit():
            raise ValueError("GORUN_SHRINK_NEWCOMER=%r: want the number of the last epoch decided" % after)
        self._log = log or (lambda msg: print(msg, flush=True))
        # The job secret, when there is one: epochs are verified, notices
        # sealed.
        self._auth = BoardAuth.from_env(self._log)
        # Each restart of the job bootstraps under its own namespace.
        self._ns = "gorun_ft/attempt_" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agreement = _seconds("GORUN_AGREEMENT_TIMEOUT", DEFAULT_AGREEMENT_TIMEOUT)
        self._epoch_wait = agreement + DETECTION_SLACK
        self._grow_wait = _seconds("GORUN_GROW_TIMEOUT", DEFAULT_GROW_TIMEOUT)
        # The main connection never waits with a timeout (see WAIT_CANCELS);
        # waits for epochs and members go through _KeyWaiters, and each
        # group gets a connection of its own (its formation waits, and a
        # formation can time out).
        self.store = _connect_store(timeout, serve=not _agent_store() and self.global_rank == 0 and not self.newcomer)
        self._awaiter = _KeyWaiter(timeout)
        self._beats = _Beats()
        self._group = None  # the epoch whose group is the default group
        self._group_store = None
        self._group_sockets = set()  # inodes of the connections the group opened
        self._constructing = None  # the _Construction of the group _init forms
        # Whether this worker's state is the job's: a newcomer's is not
        # until its first resync.
        self._synced = not self.newcomer
        self._published = 0  # the highest epoch the watcher has seen
        self._notice_hint = 0  # the last notice this helper filed
        self._latest = None  # that epoch
        # A grow's group being built (_Build), until the switch to it.
        self._bg = None
        # Calls of check() since the group in use formed: the members'
        # common step count, on which the switch to a grow's group is set.
        self._ticks = 0
        self._formed_at = time.monotonic()  # when the group in use formed
        self._due_at, self._due_val = None, False  # check()'s verdict, per step
        # The group before the last switch, held (its connections open)
        # until every member has reached the switch: see _switch.
        self._retired = None
        self._stop = threading.Event()
        # Held while the epoch changes, so the watcher never aborts a group
        # that recover() has just built.
        self._lock = threading.Lock()
        if self.newcomer:
            self.epoch = Epoch(int(after), [], [], [-1] * world, 0, "shrink")
        else:
            self.epoch = Epoch.initial(world)
        # Watching from the start: a member lost before the first group
        # forms leaves the others in its construction until the epoch
        # that excludes it comes. Its connection is made here, before the
        # group's, which a moot construction shuts down (_construct tells
        # them apart by when they were opened).
        self._watcher = threading.Thread(target=self._watch, args=(self.epoch.number + 1, _KeyWaiter(timeout).open()),
                                         name="gorun-ft-watch", daemon=True)
        self._watcher.start()
        if self.newcomer:
            self._enter()
            return
        try:
            self._init(self.epoch, "%s/epoch_0" % self._ns)
        except RuntimeError as err:
            # As for a failed collective: the agents decide.
            self.recover(err)

    @property
    def rank(self):
        return self.epoch.ranks[self.global_rank]

    @property
    def world_size(self):
        return self.epoch.world_size

    def _init(self, e, prefix):
        """Initialise epoch e's group as the default group, on a store
        connection of its own under prefix. Raises RuntimeError when the
        group does not form, at once when a later epoch makes it moot (see
        _Construction)."""
        store, c = _construct(e, self.timeout)
        with self._lock:
            self._constructing = c.begin()
            if self._published > e.number:
                self._react(self._latest)
        _debug("rank %d: constructing epoch %d's group" % (self.global_rank, e.number))
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(prefix, store),
                                    rank=e.ranks[self.global_rank], world_size=e.world_size, timeout=self.timeout,
                                    **self._device_kw())
        except Exception:
            with self._lock:
                self._constructing = None
            raise
        # The connections the group opened (gloo connects every pair in
        # its constructor), less any to the store another thread opened
        # meanwhile: what _sever breaks when the group must stop.
        opened = c.opened()
        _debug("rank %d: epoch %d's group holds %s" % (self.global_rank, e.number, " ".join(_ends(fd) for fd in opened.values())))
        with self._lock:
            self._constructing = None
            self._group, self._group_store, self._group_sockets = e, store, set(opened)
            self._ticks, self._due_at, self._formed_at = 0, None, time.monotonic()
            if self._published > e.number:
                # The next epoch came while the group formed: the watcher
                # had no group to act on then. A grow of this group is
                # built beside it; else a member that moves on without
                # this group must not leave the others waiting in its
                # first collective.
                self._react(self._latest)

    def _device_kw(self):
        """init_process_group's device binding: for NCCL on a PyTorch that
        takes device_id (2.3 and later), the current CUDA device, so that
        the communicator forms at once (eager): a member that cannot form
        it fails here, in the formation, not in its first collective."""
        if self.backend != "nccl" or not torch.cuda.is_available():
            return {}
        if "device_id" not in inspect.signature(dist.init_process_group).parameters:
            return {}
        return {"device_id": torch.device("cuda", torch.cuda.current_device())}

    def _watch(self, n, waiter):
        """Wait on each next epoch's key through a store connection of its own
        (a store wait, not polling); when epoch n appears, record it and,
        unless the group will be shrunk in place, abort the group in use
        where the backend can, so a collective stuck on a dead peer returns
        to the training loop and, for a grow, every member stops at once.
        waiter is its own connection."""
        floor_seen = time.monotonic()
        while not self._stop.is_set():
            key = _key("epoch", n)
            try:
                # Short waits, so that close() can join this thread soon.
                if not waiter.wait([key], WATCH_WAIT.total_seconds()):
                    if time.monotonic() - floor_seen > FLOOR_LOOK:
                        # A newcomer's watcher starts where it was started
                        # from: the board may have collected that epoch.
                        floor_seen = time.monotonic()
                        floor = self._floor_epoch(n, waiter)
                        if floor is not None:
                            n = floor
                    continue  # ask again
                e = self._epoch(n, waiter.get(key))
            except Forged:
                # Not acted on: wait for the genuine epoch to replace it.
                self._stop.wait(FORGED_POLL)
                continue
            except (RuntimeError, ValueError, KeyError):
                # The store is unreachable (or the record unreadable):
                # pause rather than spin; recover() will report it when
                # the worker needs it.
                self._stop.wait(1.0)
                continue
            with self._lock:
                self._published, self._latest = n, e
                if n > self.epoch.number:
                    self._react(e)
            n += 1
        waiter.close()

    def _react(self, e):
        """What a newly published epoch e (beyond the current one) does to
        the group in use; under self._lock. A grow of that group (gloo) is
        built in the background while the members go on stepping; anything
        else stops the group at once, and abandons a grow being built."""
        c = self._constructing
        if c is not None and not (self.backend == "gloo" and e.action == "grow" and e.base == c.epoch.number):
            # The group being initialised will not be used (a grow of it
            # is built once it has formed: see _init).
            c.sever()
        if e.number == self.epoch.number + 1 and self._grows_ahead(e):
            self._bg = _Build(e, self._ticks)
            self._bg.before = (self._bg.started - self._formed_at) * 1000
            self._bg.thread = threading.Thread(target=self._build, args=(self._bg,), name="gorun-ft-grow", daemon=True)
            self._bg.thread.start()
            return
        if self._bg is not None and self._bg.epoch.number < e.number:
            self._abandon(self._bg)
        _abort_default_group()
        if self.backend == "gloo":
            # gloo has no abort, and a collective waiting on a peer whose
            # host went silent (cut off: nothing resets the connection)
            # would wait for the group's timeout. Shutting the group's
            # connections down fails it at once, here and, through the
            # peers' ends, at every member still connected.
            _sever(self._group_sockets)

    def _grows_ahead(self, e):
        """Whether grow e's group is built in the background while this
        member steps on the group e grows (gloo, which cannot grow a group
        in place; this member holds e's base group)."""
        return (self.backend == "gloo" and e.action == "grow" and self._group is not None
                and self._group.number == e.base and (self._bg is None or self._bg.abandoned)
                and not self._stop.is_set())

    def _abandon(self, b):
        """Give build b up, under self._lock: a later epoch supersedes its
        grow. A group built already has its connections shut down at once
        (its members may be cut off from each other); so are those of one
        under construction, whose constructor would otherwise wait out the
        group's timeout on a member that died (every member of a sealed
        formation constructs it, see _formation, and every one that lives
        abandons it for the same epoch). It stays self._bg, so that this member never builds that
        epoch's group a second time (the store holds the first one's
        addresses)."""
        b.abandoned = True
        if b.pg is not None:
            _sever(b.sockets)
            b.pg = None
        elif b.construction is not None:
            b.construction.sever()

    def _build(self, b):
        """Form grow b.epoch's group (the formation rules of _form) and
        construct its gloo group on a store connection of its own, without
        making it the default group. It says it is built (a key per rank),
        which the leader waits for before setting the switch. Never
        raises: the outcome is in b."""
        e = b.epoch
        ns = "%s/epoch_%d" % (self._ns, e.number)
        rank = e.ranks[self.global_rank]
        waiter = _KeyWaiter(self.timeout)
        try:
            store, c = _construct(e, self.timeout)
            b.store = store
            if not self._formation(e, store, waiter):
                return
            with self._lock:
                if b.abandoned:
                    return
                b.construction = c.begin()
            try:
                pg = dist.ProcessGroupGloo(dist.PrefixStore(ns + "/pg", store), rank, e.world_size, self.timeout)
            finally:
                with self._lock:
                    b.construction = None
            # As in _init: the connections it opened, less the store's.
            opened = c.opened()
            _debug("rank %d: epoch %d's group (built) holds %s" % (self.global_rank, e.number, " ".join(_ends(fd) for fd in opened.values())))
            opened = set(opened)
            with self._lock:
                if b.abandoned:
                    _sever(opened)
                    return
                b.pg, b.sockets = pg, opened
            # A key per member for the waits of _grow, a count for the
            # leader's look once a step.
            store.set("%s/built/%d" % (ns, rank), str(self.global_rank))
            store.add(ns + "/built", 1)
        except RestartRequired as err:
            b.error = err
        except RuntimeError as err:
            self._log("rank %d: the group of epoch %d did not form: %s"
                      % (self.global_rank, e.number, str(err).splitlines()[0]))
            err.__traceback__ = None
            with self._lock:
                if b.pg is not None:
                    _sever(b.sockets)
                b.pg = None
        finally:
            waiter.close()
            b.done.set()

    def pending(self):
        """Whether check() would move to the next epoch now: the watcher has
        seen it and, for a grow built in the background, this is the step
        its members switch at."""
        return self._due()

    def check(self):
        """Move to the next epoch if it is due, and say whether it did. Call
        it once a step, before the step's collectives: a grow's group is
        built while the members step, and they switch to it together at the
        check of a step agreed by count."""
        self._beats.progress()
        due = self._due()
        self._ticks += 1
        # check() is called after the first collective of a group switched
        # to (resync): every member has left the group before, which can go.
        self._retired = None
        if not due:
            return False
        b = self._bg
        if b is not None and b.switch is not None and self._published == b.epoch.number:
            e = b.epoch
            steps, ms = self._ticks - 1 - b.ticks, (time.monotonic() - b.started) * 1000
            if self._switch(b):
                self._arrive(e)
                # With the steps before it, to show what the build cost
                # the steps (the group's first steps include a resync).
                self._log("grow epoch=%d formed in the background: %d steps in %.0f ms meanwhile "
                          "(before it: %d steps in %.0f ms)" % (e.number, steps, ms, b.ticks, b.before))
                self._log(e.line())
                return True
        self.recover()
        return True

    def _due(self):
        """check()'s verdict for this step, computed once a step (it may ask
        the store)."""
        if self._due_at != self._ticks:
            b = self._bg
            if b is not None and self._published == b.epoch.number and b.error is None and not (
                    b.done.is_set() and b.pg is None):
                due = self._switch_due(b)
            else:
                due = self._published > self.epoch.number
            self._due_at, self._due_val = self._ticks, due
        return self._due_val

    def _switch_due(self, b):
        """For a member stepping while grow b builds: whether this step is
        the one to switch at. The leader (rank 0 of the grow) sets it, once
        every member has built the group, SWITCH_AHEAD steps ahead; the
        others look for it once a step (a store round trip, only while a
        grow builds). Counters are read with add(key, 0): 1.13's store has
        no non-blocking check for a key."""
        if b.switch is None:
            e = b.epoch
            ns = "%s/epoch_%d" % (self._ns, e.number)
            if e.ranks[self.global_rank] == 0:
                if b.pg is not None and self.store.add(ns + "/built", 0) >= e.world_size:
                    b.switch = self._set_switch(ns, self._ticks + SWITCH_AHEAD)
            elif self.store.add(ns + "/switch_set", 0) > 0:
                b.switch = int(self.store.get(ns + "/switch"))
        return b.switch is not None and self._ticks >= b.switch

    def _set_switch(self, ns, step):
        """Set the step at which the members switch (the leader's, once);
        the value that holds."""
        v = int(self.store.compare_set(ns + "/switch", "", str(step)))
        self.store.add(ns + "/switch_set", 1)
        return v

    def blocked(self):
        """A context manager for a collective (or any wait on the peers): with
        --heartbeat-timeout the agent then takes this worker for alive and
        blocked, not hung, however long a hung peer holds it (up to ten
        heartbeat timeouts). ``with group.blocked(): dist.all_reduce(t)``."""
        return self._beats.blocked()

    def recover(self, err=None):
        """Wait for the next epoch and move the group to it. Raises Excluded if
        this rank is out, RestartRequired if the agents chose a restart. An
        epoch whose group cannot be formed (a grow that does not complete)
        is followed to the next one, which settles it."""
        with self._beats.blocked():
            return self._recover(err)

    def _recover(self, err):
        """recover(), the agent told meanwhile that this worker is blocked."""
        if err is not None:
            self._log("rank %d: %s failed, awaiting the agents' decision: %s"
                      % (self.global_rank, "the group" if self._group is None else "a collective",
                         str(err).splitlines()[0]))
            # The traceback holds the failed collective's frames, and through
            # them the backend's connections: let them go with the group.
            err.__traceback__ = None
        # Tear the broken group down now, not after the decision: closing
        # our connections fails the collectives of peers still blocked on us
        # (ULFM's revoke), instead of leaving them to the group's timeout.
        # For a grow it stops every member where it is.
        self._destroy()
        while True:
            nxt = self._await(self.epoch.number + 1, grow=self.epoch.action == "grow")
            with self._lock:
                self.epoch = nxt
            if not nxt.alive(self.global_rank):
                self._close(failed=True)
                raise Excluded("rank %d excluded in epoch %d" % (self.global_rank, nxt.number))
            if nxt.action == "restart":
                raise self._restart(nxt)
            if self._move(nxt):
                break
            self._log("%s epoch=%d did not complete: awaiting the next epoch" % (nxt.action, nxt.number))
        self._arrive(nxt)
        self._log(nxt.line())
        return nxt

    def _enter(self):
        """A newcomer's way in: say the slot is ready, wait for the grow that
        adds it, and join that epoch's group; when the grow does not
        complete, offer the slot again and wait for the next one."""
        slot = self.global_rank
        self._log("newcomer slot=%d after epoch=%d" % (slot, self.epoch.number))
        self._file_join()
        if self._on_ready is not None:
            self._on_ready()
        while True:
            nxt = self._await(self.epoch.number + 1, grow=True)
            behind = nxt.number != self.epoch.number + 1
            with self._lock:
                self.epoch = nxt
            if nxt.action == "restart":
                raise self._restart(nxt)
            if behind:
                # The epochs it missed did not bring its slot back for
                # good: offer it again, in case one took its join.
                self._file_join()
            if not nxt.newcomer(slot):
                continue
            if self._grow(nxt) if self._grows_afresh(nxt) else self._form(nxt):
                break
            self._log("grow epoch=%d did not complete: joining again" % nxt.number)
            self._file_join()
        self._file({"joined": {"epoch": nxt.number, "slot": slot, "at": _now()}})
        self._arrive(nxt)
        self._log(nxt.line())

    def _restart(self, e):
        """Stop for restart epoch e: the error to raise."""
        self._close(failed=True)
        return RestartRequired("epoch %d: %d ranks left, below the floor: restart" % (e.number, e.world_size))

    def _move(self, e):
        """Move to epoch e's group, formed afresh. False when the group could
        not be formed."""
        self._destroy()
        if self._grows_afresh(e):
            return self._grow(e)
        return self._form(e)

    def _grows_afresh(self, e):
        """Whether e is a grow joined through a _Build (gloo): in the
        background, or, for a member that holds no group to step on, here."""
        return self.backend == "gloo" and e.action == "grow"

    def _grow(self, e):
        """Join grow e from outside any group: a newcomer, or a member that
        stopped (its group failed, or it never held the group e grows).
        The build runs here unless it is under way in the background; then
        the member waits for the switch, or, leading, sets it for at once
        when every member has built. False when the grow is given up (a
        later epoch came, or its group did not form)."""
        with self._lock:
            b = self._bg
            if b is None or b.epoch.number != e.number:
                if b is not None:
                    self._abandon(b)
                b = self._bg = _Build(e, None)
        if b.thread is None and not b.done.is_set():
            self._build(b)
        bound = self._epoch_wait + self._grow_wait
        deadline = time.monotonic() + bound

        def past():
            self._close(failed=True)
            return RestartRequired("epoch %d: its group did not form within %.0f s, and no epoch "
                                   "followed: restart" % (e.number, bound))

        while not b.done.wait(min(max(deadline - time.monotonic(), 0), WATCH_WAIT.total_seconds())):
            if time.monotonic() >= deadline:
                raise past()
        if b.error is not None:
            self._close(failed=True)
            raise b.error
        ns = "%s/epoch_%d" % (self._ns, e.number)
        lead = e.ranks[self.global_rank] == 0
        keys = ["%s/built/%d" % (ns, r) for r in range(e.world_size)] if lead else [ns + "/switch"]
        while True:
            with self._lock:
                if self._published > e.number or b.pg is None:
                    self._abandon(b)
                    return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise past()
            if self._awaiter.wait(keys, min(left, WATCH_WAIT.total_seconds())):
                break
        if lead:
            self._set_switch(ns, -1)
        return self._switch(b)

    def _switch(self, b):
        """Make build b's group the default group. The group before is held,
        its connections open, until the next check(): a member reaching the
        switch may still be sending the last collective of the old group to
        a member that has not finished it. False when b was abandoned
        meanwhile."""
        e = b.epoch
        pg = b.pg
        if pg is None:
            return False
        old = None
        if dist.is_initialized():
            old = _backend_of_default_group()
            dist.destroy_process_group()
        _register_prebuilt()
        _prebuilt[:] = [pg]
        try:
            dist.init_process_group(PREBUILT_BACKEND, store=dist.PrefixStore("%s/epoch_%d/switch" % (self._ns, e.number), b.store),
                                    rank=e.ranks[self.global_rank], world_size=e.world_size, timeout=self.timeout)
        finally:
            _prebuilt.clear()
        with self._lock:
            self.epoch = e
            self._group, self._group_store, self._group_sockets = e, b.store, b.sockets
            self._retired = old
            self._bg = None
            self._ticks, self._due_at, self._formed_at = 0, None, time.monotonic()
            if self._published > e.number:
                self._react(self._latest)
        return True

    def _form(self, e):
        """Form epoch e's group afresh among its members (see _formation). A
        formation the backend fails is given up too: the next epoch settles
        it. Returns whether the group was formed."""
        ns = "%s/epoch_%d" % (self._ns, e.number)
        try:
            if not self._formation(e, self.store, self._awaiter):
                return False
        except RestartRequired:
            self._close(failed=True)
            raise
        try:
            self._init(e, ns + "/pg")
        except RuntimeError as err:
            self._log("rank %d: the group of epoch %d did not form: %s"
                      % (self.global_rank, e.number, str(err).splitlines()[0]))
            err.__traceback__ = None
            self._destroy()
            return False
        return True

    def _formation(self, e, store, waiter):
        """Whether epoch e's group is to be formed, decided once for all its
        members. The members first wait, in short waits (waiter), until
        every one of them is there, and give up when the next epoch appears,
        since every member moves on to it. Raises RestartRequired when the
        members are not all there in time and no epoch follows."""
        ns = "%s/epoch_%d" % (self._ns, e.number)
        rank = e.ranks[self.global_rank]
        store.set("%s/member/%d" % (ns, rank), str(self.global_rank))
        members = ["%s/member/%d" % (ns, r) for r in range(e.world_size)]
        # A member may still be in the old group's collective: the sever
        # fails it at once as a rule, but not always (seen under load on
        # 1.13: a member's own connections shut down, its collective held
        # to the group's timeout), and then the collective ends at the
        # group's timeout. Wait for it that long: a member that died
        # instead is excluded by the next epoch, which ends this wait at
        # once.
        bound = max(self._epoch_wait, self.timeout.total_seconds() + DETECTION_SLACK)
        bound += self._grow_wait if e.action == "grow" else 0
        deadline = time.monotonic() + bound
        # Whether the group is formed is decided once, for every member:
        # the first to find every member there seals the formation, the
        # first to see the next epoch first abandons it (a compare-set that
        # only creates). A member that gave up while another had begun
        # init_process_group would leave that one blocked in gloo's
        # connect until its timeout (a minute), and every later epoch
        # waiting on it.
        state = "%s/formation" % ns
        while True:
            if self._published > e.number:
                return store.compare_set(state, "", "abandoned") == b"sealed"  # sealed already: every member forms it
            left = deadline - time.monotonic()
            if left <= 0:
                raise RestartRequired("epoch %d: its members were not all there within %.0f s, and no epoch "
                                      "followed: restart" % (e.number, bound))
            if waiter.wait(members, min(left, WATCH_WAIT.total_seconds())):
                # False: another member abandoned it first.
                return store.compare_set(state, "", "sealed") == b"sealed"

    def _arrive(self, e):
        """Acknowledge epoch e for this slot: a sealed ack under
        ``ack/<n>/<slot>``, then the ``ack/<n>`` count beside it, which only
        says when to look (see shrink.Board.Arrive). Whoever counts up to a
        grow's world size reads every member's ack and, when all are there
        and genuine, files the ``complete`` notice."""
        slot = self.global_rank
        rec = json.dumps({"epoch": e.number, "slot": slot})
        if self._auth is not None:
            rec = self._auth.seal(_rel("ack", e.number, slot), rec.encode("ascii")).decode("ascii")
        self.store.set(_key("ack", e.number, slot), rec)
        n = self.store.add(_key("ack", e.number), 1)
        if e.action == "grow" and n >= e.world_size and self._arrived(e):
            self._file({"complete": {"epoch": e.number, "at": _now()}})

    def _arrived(self, e):
        """Whether every member of epoch e has a genuine ack on the board."""
        for g in range(len(e.ranks)):
            if not e.alive(g):
                continue
            rec = self._peek(_key("ack", e.number, g))
            if rec is None:
                return False
            if self._auth is not None:
                try:
                    self._auth.open(_rel("ack", e.number, g), rec)
                except Forged:
                    return False
        return True

    def _file_join(self):
        # "after": the latest epoch this newcomer knows of (shrink.Join's
        # After): a grow later than it that added the slot answered the
        # offer, and a coordinator that reads it late does not grow the
        # slot back again for it.
        slot = self.global_rank
        self._file({"join": {"slots": [slot], "from": "slot %d" % slot, "seen_at": _now(),
                             "after": self.epoch.number}})

    def _file(self, notice):
        """Add a notice to the board's log, sealed when the job has a secret,
        at the first free index: a compare-set that only creates, so the log
        has no holes and no counter anyone could tamper with; an index that
        holds a forgery is passed over (see shrink.Board's file). The search
        starts above the floor's notice. A notice found, by the floor read
        after it, in the stretch the floor says is swept was filed in a slot
        a sweep had emptied, which readers skip: it is filed again above.
        One at or below the floor's notice but not swept was read by the
        leader before it raised the floor (the floor may even be this
        notice, a Complete): filing it again would say it twice."""
        body = json.dumps(notice)
        i = max(self._notice_hint, self._floor()[0]) + 1
        while True:
            rec = body
            if self._auth is not None:
                rec = self._auth.seal(_rel("report", i), body.encode("ascii")).decode("ascii")
            if self.store.compare_set(_key("report", i), "", rec) != rec.encode("ascii"):
                i += 1  # taken
                continue
            floor, swept = self._floor()
            if i <= swept:
                # The copy left below goes: no later sweep reaches it.
                self.store.delete_key(_key("report", i))
                i = floor + 1
                continue
            self._notice_hint = i
            return i

    def _peek(self, key):
        """key's value, or None while it does not exist, on the main
        connection (see _probe)."""
        return _probe(self.store, key)

    def _floor(self):
        """The board floor's notice and swept notice ((0, 0) without a
        floor, or with one that fails the job secret's check)."""
        rec = self._peek(_key("floor"))
        if rec is None:
            return 0, 0
        if self._auth is not None:
            try:
                rec = self._auth.open(_rel("floor"), rec)
            except Forged:
                return 0, 0
        f = json.loads(rec)
        return f.get("notice", 0), f.get("swept_notice", 0)

    def _epoch(self, n, rec):
        """Epoch n from the record at its key; Forged when the job has a
        secret and the record fails it."""
        if self._auth is not None:
            rec = self._auth.open(_rel("epoch", n), rec)
        return Epoch.decode(rec)

    def _destroy(self, failed=True):
        """Tear the default group down; failed: it stopped (a peer failed,
        an epoch came), not a clean end."""
        with self._lock:
            # Its sockets' inodes may be reused once they close: forget them.
            self._group, self._group_store, self._group_sockets = None, None, set()
            self._retired = None
        if dist.is_initialized():
            try:
                if failed and self.backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                    # destroy_process_group's shutdown of a failed NCCL
                    # group waits for ever (PyTorch 2.11, NCCL 2.28.9, seen
                    # on an H100): abort it and drop it, as PyTorch's
                    # _abort_process_group does.
                    dist.distributed_c10d._abort_process_group()
                else:
                    dist.destroy_process_group()
            except RuntimeError:
                pass  # a broken group may refuse a clean teardown
        # Collect now: a failed collective's objects sit in reference cycles
        # (frames, exceptions), and its connections close only when they go.
        gc.collect()

    def _await(self, n, grow=False):
        """Epoch n, once the agents publish it. A worker never waits without
        end: past the agreement timeout and the time to detect a failure
        (and the grow timeout, with grow: a grow is under way, or awaited)
        the agents have fallen back to a restart, or cannot decide; either
        way this worker stops as for a restart."""
        key = _key("epoch", n)
        bound = self._epoch_wait + (self._grow_wait if grow else 0)
        deadline = time.monotonic() + bound
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._close(failed=True)
                why = "GORUN_AGREEMENT_TIMEOUT plus %.0f s to detect the failure" % DETECTION_SLACK
                if grow:
                    why += ", plus the grow timeout"
                raise RestartRequired("no epoch %d within %.0f s (%s): restart" % (n, bound, why))
            if self._awaiter.wait([key], min(left, FLOOR_LOOK)):
                try:
                    return self._epoch(n, self._awaiter.get(key))
                except Forged:
                    # Not acted on: wait for the genuine epoch to replace it.
                    time.sleep(min(FORGED_POLL, max(left, 0)))
                continue
            floor = self._floor_epoch(n, self._awaiter)
            if floor is not None:
                # Epoch n was collected: this worker fell a heal cycle
                # behind (a newcomer slow to start). The agents' floor says
                # where the board's history now starts.
                self._log("epoch %d was collected below the board's floor: following on from epoch %d" % (n, floor))
                n, key = floor, _key("epoch", floor)

    def _floor_epoch(self, n, waiter):
        """The board floor's epoch if epoch n was collected below it (see
        shrink.Floor: epochs below its swept_epoch are gone), else None,
        read through waiter's connection. A floor that fails the job
        secret's check counts as none."""
        rec = waiter.peek(_key("floor"))
        if rec is None:
            return None
        if self._auth is not None:
            try:
                rec = self._auth.open(_rel("floor"), rec)
            except Forged:
                return None
        f = json.loads(rec)
        return f["epoch"] if n < f.get("swept_epoch", 0) else None

    def resync(self, *tensors):
        """Copy the tensors of the lowest rank whose state is the job's to
        every member: after a failure some survivors may have finished the
        failed step and others not, and a newcomer has no state yet. The
        members first agree on that rank (a newcomer's state counts once it
        has been resynced), then it broadcasts."""
        device = tensors[0].device if tensors else None  # NCCL reduces on the GPU
        src = torch.tensor([self.rank if self._synced else self.world_size], dtype=torch.int64, device=device)
        dist.all_reduce(src, op=dist.ReduceOp.MIN)
        src = int(src.item())
        if src >= self.world_size:
            raise RuntimeError("resync: no member of epoch %d holds the job's state" % self.epoch.number)
        for t in tensors:
            dist.broadcast(t, src)
        self._synced = True

    def close(self):
        """End: stop the watcher and tear the group down."""
        self._close(failed=False)

    def _close(self, failed):
        # Training is over here: the teardown below (joins, the group's
        # destruction) is no hang. Not said after a failure: a worker that
        # said it was done counts as a success if its teardown has to be
        # killed (gorun --done-timeout).
        if not failed:
            self._beats.done()
        self._stop.set()
        with self._lock:
            b = self._bg
            if b is not None:
                self._abandon(b)
        if b is not None and b.thread is not None and b.thread is not threading.current_thread():
            # Bounded: a member that died while the group was constructed
            # leaves the constructor waiting for the group's timeout.
            b.thread.join(WATCH_WAIT.total_seconds() * 2)
        # Join the watcher before the interpreter exits: a daemon thread
        # still inside a C++ store wait when Python finalizes is killed by
        # forced unwinding on its way back, and the process dies with
        # "terminate called without an active exception" (SIGABRT) after a
        # successful run.
        if self._watcher is not threading.current_thread():
            self._watcher.join(WATCH_WAIT.total_seconds() * 2)
        self._awaiter.close()
        self._destroy(failed=failed)


def _socket_inodes():
    """This process's sockets: inode → descriptor, from /proc/self/fd."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _to_store(fd):
    """Whether descriptor fd is a TCP connection to the worker store
    (MASTER_PORT): those are the helper's, not the group's."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        peer = s.getpeername()
        return isinstance(peer, tuple) and str(peer[1]) == os.environ.get("MASTER_PORT")
    except OSError:
        return False
    finally:
        s.close()  # the duplicate only


# GORUN_FT_DEBUG=1: say which connections each group holds and which a
# sever shuts down (stderr), to tell a collective that waits on a peer
# nobody cut off from one the cut did not reach.
_DEBUG = bool(os.environ.get("GORUN_FT_DEBUG"))


def _debug(msg):
    if _DEBUG:
        print("gorun_ft[%d]: %s" % (os.getpid(), msg), file=sys.stderr, flush=True)


def _ends(fd):
    """'local port->peer port' of socket fd, for debug lines."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return "closed"
    try:
        return "%s->%s" % (s.getsockname()[1], s.getpeername()[1])
    except (OSError, IndexError, TypeError):
        return "unconnected"
    finally:
        s.close()


def _sever(inodes):
    """Shut down (both ways) the connected sockets with these inodes that
    are still open: the process group's connections, not its listener. Its
    pending and later collectives fail at once, where they would wait for a
    silent peer until the group's timeout; the descriptors stay the group's,
    to close when it is destroyed."""
    if not inodes:
        return
    shut = []
    for inode, fd in _socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            # Not a listener: gloo (2.x) treats a failed accept as fatal
            # and aborts the process; a listener fails no collective.
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                if _DEBUG:
                    shut.append(_ends(fd))
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already down
        finally:
            s.close()
    _debug("severed %d of %d connections: %s" % (len(shut), len(inodes), " ".join(shut)))


def _abort_default_group():
    """Abort the default group's communicators where the backend supports it
    (NCCL); gloo has no abort, and its collectives fail on their own when a
    peer's connection breaks."""
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
    except (RestartRequired, NoAssignment) as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
