#!/usr/bin/env bash
# `make bench`: gorun's store beside PyTorch 1.13's (and 2.14's, from the sid bed
# built by `make test-deps`), same machine, same run,
# same load client. Writes raw results to bench/results/ and prints the
# tables that BENCHMARKS.md records. Knobs (env): REPS, DURATION, CONNS,
# STORM, IDLE, PARTIAL, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bin bench/results
go build -o bin/storeload ./bench/storeload
go build -o bin/storebench ./bench/storebench

echo "## Server allocations per request (go test -bench, in-process, no sockets)"
go test ./rendezvous/tcpstore/ -run '^$' -bench 'BenchmarkServerHandle' -benchmem -count 5 | tee bench/results/allocs.txt

echo
echo "## TCPStore: gorun vs torch 1.13, and 2.14 when the sid bed is built ($(nproc) cores, $(date -u +%F))"
bin/storebench -reps "${REPS:-3}" -duration "${DURATION:-5s}" -conns "${CONNS:-1,64,256}" \
  -storm "${STORM:-4096,16384}" -idle "${IDLE:-4096}" -partial "${PARTIAL:-16}" -python "${PYTHON:-/usr/bin/python3}" \
  -out bench/results/store.jsonl | tee bench/results/store.md

# The launcher: gorun vs torchrun 1.13, side by side (bench/launchbench).
# Knob (env): LAUNCH_REPS. Uses bin/gorun (`make bench` builds it).
go build -o bin/launchbench ./bench/launchbench
echo
echo "## Launcher: gorun vs torchrun 1.13, and 2.14 when the sid bed is built ($(nproc) cores, $(date -u +%F))"
bin/launchbench -reps "${LAUNCH_REPS:-5}" -python "${PYTHON:-/usr/bin/python3}" \
  -out bench/results/launch.jsonl | tee bench/results/launch.md

# Multi-node rendezvous on loopback: gorun at RDZV_AGENTS agents, and gorun
# beside torchrun at RDZV_TORCH_AGENTS (torchrun imports torch in every
# agent: ~240 MB each) (bench/rdzvbench).
go build -o bin/rdzvbench ./bench/rdzvbench
echo
echo "## Rendezvous: gorun vs torchrun 1.13 ($(nproc) cores, $(date -u +%F))"
bin/rdzvbench -reps "${RDZV_REPS:-3}" -agents "${RDZV_AGENTS:-64}" -torch-agents "${RDZV_TORCH_AGENTS:-16}" \
  -python "${PYTHON:-/usr/bin/python3}" | tee bench/results/rdzv.md

# The rendezvous at scale (issue 19): RDZVSIM_N goroutine agents, each with
# its own connection to gorun's store server (and to etcd, when there is
# one), counting store requests and bytes per agent (bench/rdzvsim).
go build -o bin/rdzvsim ./bench/rdzvsim
echo
echo "## Rendezvous at scale, simulated agents ($(nproc) cores, $(date -u +%F))"
bin/rdzvsim -backend c10d -n "${RDZVSIM_N:-64,256,1024}" -reps "${RDZV_REPS:-3}" | tee bench/results/rdzvsim.md
if command -v etcd >/dev/null; then
  bin/rdzvsim -backend etcd -n "${RDZVSIM_N:-64,256,1024}" -reps "${RDZV_REPS:-3}" | tee bench/results/rdzvsim-etcd.md
fi

# The etcd-backed worker store (bench/etcdstore) beside the in-memory one,
# the same mixed load at ETCD_CONNS connections. Needs an etcd binary
# (Debian's etcd-server); skipped without one. The single etcd member keeps
# its data on /dev/shm and is stopped at the end.
if command -v etcd >/dev/null 2>&1; then
  go build -o bin/etcdstore ./bench/etcdstore
  go build -o bin/storeload ./bench/storeload
  edir=$(mktemp -d /dev/shm/gorun-bench-etcd.XXXXXX 2>/dev/null || mktemp -d)
  etcd_pid='' es_pid='' mem_pid=''
  etcd_cleanup() {
    for p in $es_pid $mem_pid $etcd_pid; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$edir" "$edir".*
  }
  trap etcd_cleanup EXIT
  etcd --data-dir "$edir" --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 \
    --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
    --initial-cluster default=http://127.0.0.1:23800 >"$edir.log" 2>&1 &
  etcd_pid=$!
  bin/etcdstore -etcd 127.0.0.1:23790 -listen 127.0.0.1:0 >"$edir.addr" &
  es_pid=$!
  bin/gorun store serve --listen 127.0.0.1:0 >"$edir.mem" &
  mem_pid=$!
  for _ in $(seq 50); do [ -s "$edir.addr" ] && [ -s "$edir.mem" ] && break; sleep 0.2; done
  echo
  echo "## Worker store: etcd-backed vs in-memory ($(nproc) cores, $(date -u +%F))"
  for c in ${ETCD_CONNS:-64}; do
    bin/storeload mixed -addr "$(head -1 "$edir.addr")" -wire new -conns "$c" -duration "${DURATION:-5s}" -label etcd
    bin/storeload mixed -addr "$(head -1 "$edir.mem")" -wire new -conns "$c" -duration "${DURATION:-5s}" -label memory
  done | tee bench/results/etcdstore.jsonl
  echo
  echo "## Rendezvous through etcd: 64 gorun agents ($(nproc) cores, $(date -u +%F))"
  bin/rdzvbench -etcd 127.0.0.1:23790 -reps "${RDZV_REPS:-3}" -agents "${RDZV_AGENTS:-64}" -torch-agents 0 \
    | tee bench/results/rdzv-etcd.md
  etcd_cleanup
  trap - EXIT
else
  echo "## Worker store on etcd: skipped (no etcd binary; install etcd-server)"
fi

# Process groups: pg/cpu's AllReduce beside gloo (PyTorch 1.13), 4 rank
# processes on one host, over each same-host transport — shm (the
# default), unix, tcp — interleaved with gloo round by round, plus abort
# and shrink latency (bench/pgbench, bench/gloo_allreduce.py). Knobs (env):
# PG_NPROC, PG_SIZES, PG_ITERS, PG_REPS, PG_TRANSPORTS, PG_ROUNDS.
go build -o bin/pgbench ./bench/pgbench
echo
echo "## Process groups: pg/cpu vs gloo 1.13 ($(nproc) cores, $(date -u +%F))"
bin/pgbench -nproc "${PG_NPROC:-4}" -sizes "${PG_SIZES:-4096,1048576,16777216,67108864}" \
  -iters "${PG_ITERS:-200,50,15,7}" -reps "${PG_REPS:-5}" -python "${PYTHON:-/usr/bin/python3}" \
  -transports "${PG_TRANSPORTS:-shm,unix,tcp}" -rounds "${PG_ROUNDS:-3}" \
  -out bench/results/pg.jsonl | tee bench/results/pg.md

# Fault recovery: one of 8 ranks SIGKILLed → the survivors' first successful
# collective, gorun --on-failure shrink and restart beside torchrun 1.13's
# full restart, Go (pg/cpu) and PyTorch gloo workers, rows interleaved trial
# by trial (bench/ftbench, bench/gloo_resume.py). Knob (env): FT_TRIALS.
go build -o bin/ftbench ./bench/ftbench
go build -o bin/allreduce ./examples/allreduce
echo
echo "## Fault recovery: gorun vs torchrun 1.13 ($(nproc) cores, $(date -u +%F))"
bin/ftbench -trials "${FT_TRIALS:-10}" -gorun bin/gorun -worker bin/allreduce -python "${PYTHON:-/usr/bin/python3}" \
  -out bench/results/ft.jsonl | tee bench/results/ft.md

# Fault recovery on several hosts: 2 network-namespace hosts × 4 ranks
# (internal/netns; needs root and iproute2), a crashed rank (c10d), then the
# link of the host that runs rank 5 cut (blackhole) with the c10d store on
# host 0 and with etcd in the root namespace (lease_ttl=1). Knob (env):
# FT_HOSTS_TRIALS (default FT_TRIALS).
ft_hosts() { # NAME, then ftbench's flags
  local name=$1
  shift
  echo
  echo "## Fault recovery, 2 hosts: $name ($(nproc) cores, $(date -u +%F))"
  bin/ftbench -hosts 2 -nproc 4 -trials "${FT_HOSTS_TRIALS:-${FT_TRIALS:-10}}" -gorun bin/gorun -worker bin/allreduce \
    -python "${PYTHON:-/usr/bin/python3}" -out "bench/results/ft-hosts-$name.jsonl" "$@" | tee "bench/results/ft-hosts-$name.md"
}
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1 && command -v bridge >/dev/null 2>&1; then
  ft_hosts kill-c10d -fault kill -backend c10d -rows 1,2,3
  ft_hosts blackhole-c10d -fault blackhole -backend c10d -victim 5 -rows 1,2
  if command -v etcd >/dev/null 2>&1; then
    ft_hosts blackhole-etcd -fault blackhole -backend etcd -victim 5 -rows 1,2
  else
    echo "## Fault recovery, 2 hosts, etcd: skipped (no etcd binary; install etcd-server)"
  fi
else
  echo "## Fault recovery, 2 hosts: skipped (network namespaces need root and iproute2's ip and bridge)"
fi
