#!/usr/bin/env bash
# `make bench`: gorun's store beside PyTorch 1.13's, same machine, same run,
# same load client. Writes raw results to bench/results/ and prints the
# tables that BENCHMARKS.md records. Knobs (env): REPS, DURATION, CONNS,
# STORM, IDLE, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bin bench/results
go build -o bin/storeload ./bench/storeload
go build -o bin/storebench ./bench/storebench

echo "## Server allocations per request (go test -bench, in-process, no sockets)"
go test ./rendezvous/tcpstore/ -run '^$' -bench 'BenchmarkServerHandle' -benchmem -count 5 | tee bench/results/allocs.txt

echo
echo "## TCPStore: gorun vs torch 1.13 ($(nproc) cores, $(date -u +%F))"
bin/storebench -reps "${REPS:-3}" -duration "${DURATION:-5s}" -conns "${CONNS:-1,64,256}" \
  -storm "${STORM:-4096,16384}" -idle "${IDLE:-4096}" -python "${PYTHON:-/usr/bin/python3}" \
  -out bench/results/store.jsonl | tee bench/results/store.md

# The launcher: gorun vs torchrun 1.13, side by side (bench/launchbench).
# Knob (env): LAUNCH_REPS. Uses bin/gorun (`make bench` builds it).
go build -o bin/launchbench ./bench/launchbench
echo
echo "## Launcher: gorun vs torchrun 1.13 ($(nproc) cores, $(date -u +%F))"
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
