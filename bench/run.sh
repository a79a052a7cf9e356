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
