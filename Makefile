# gorun — see README.md.
GO        ?= go
BIN       ?= bin
GOFLAGS   ?=
# urfave_cli_no_docs leaves out urfave/cli's man-page generator (and the
# markdown library under it): ~2 ms less start-up for every launch.
BUILDTAGS ?= urfave_cli_no_docs
# The launcher is one static binary.
export CGO_ENABLED ?= 0

.PHONY: all build example test test-deps test-short bench lint fuzz gpu-smoke gpu-bundle soak soak-kinds clean

all: build

# Two builds of cmd/gorun: bin/gorun leaves out the etcd backends (etcd's
# client and gRPC: about +4 ms start-up, +5 MiB on every launch) and hands
# an --rdzv-backend etcd job over to bin/gorun-etcd, which has everything.
build:
	$(GO) build $(GOFLAGS) -tags '$(BUILDTAGS) gorun_noetcd' -o $(BIN)/gorun ./cmd/gorun
	$(GO) build $(GOFLAGS) -tags '$(BUILDTAGS)' -o $(BIN)/gorun-etcd ./cmd/gorun

# example runs a real PyTorch job under gorun: 4 gloo workers on the
# embedded store. It installs PyTorch first if it is missing (root, Debian).
PYTHON_EXEC ?= /usr/bin/python3
export PYTHON_EXEC
example: build test-deps
	$(BIN)/gorun --standalone --nproc-per-node 4 examples/torch/allreduce.py

# test installs what the tests need (as root, from Debian) and runs them all.
# The bound is per package: examples/torch, real PyTorch jobs through faults,
# takes about 10 minutes on a quiet 2-core machine and more under load.
test: test-deps
	CGO_ENABLED=1 $(GO) test $(GOFLAGS) -race -timeout 25m ./...
	# pg/nccl without cgo: New must say it needs cgo.
	CGO_ENABLED=0 $(GO) test $(GOFLAGS) -timeout 2m ./pg/nccl/

test-deps:
	GO=$(GO) ./scripts/test-deps.sh

# test-short skips nothing but runs without the race detector.
test-short: test-deps
	$(GO) test $(GOFLAGS) -timeout 10m ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags gorun_noetcd ./launcher/ ./cmd/gorun/

# fuzz runs each fuzz target for FUZZTIME (the seeds also run in `make test`).
FUZZTIME ?= 60s
fuzz:
	$(GO) test ./rendezvous/tcpstore/ -run '^$$' -fuzz FuzzDecoder -fuzztime $(FUZZTIME)

# gpu-smoke checks pg/nccl on a machine with a GPU: a world-1 communicator
# through a store, an allreduce on device memory checked on the host, abort,
# async error none; one PASS or FAIL line. NCCL is NCCL_LIBRARY when set,
# else PyTorch's pip copy (site-packages/nvidia/nccl/lib/libnccl.so.2) when
# $(PYTHON_EXEC) finds one, else libnccl.so.2 from the loader's path.
NCCL_LIBRARY ?= $(shell $(PYTHON_EXEC) -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || echo libnccl.so.2)
gpu-smoke:
	CGO_ENABLED=1 $(GO) run $(GOFLAGS) ./pg/nccl/gpusmoke -nccl '$(NCCL_LIBRARY)'

# gpu-bundle builds what scripts/gpu-check.sh runs on a GPU machine that
# has no Go: gorun, the Go allreduce worker and gpusmoke (pg/nccl through
# cgo), and pg/nccl's test binary, in .gpu/.
GPU_BUNDLE ?= .gpu
gpu-bundle:
	$(GO) build $(GOFLAGS) -tags '$(BUILDTAGS) gorun_noetcd' -ldflags '-s -w' -o $(GPU_BUNDLE)/gorun ./cmd/gorun
	CGO_ENABLED=1 $(GO) build $(GOFLAGS) -ldflags '-s -w' -o $(GPU_BUNDLE)/allreduce ./examples/allreduce
	CGO_ENABLED=1 $(GO) build $(GOFLAGS) -ldflags '-s -w' -o $(GPU_BUNDLE)/gpusmoke ./pg/nccl/gpusmoke
	CGO_ENABLED=1 $(GO) test $(GOFLAGS) -c -ldflags '-s -w' -o $(GPU_BUNDLE)/nccl.test ./pg/nccl

# bench: see BENCHMARKS.md for what it measures and the recorded results.
bench: build test-deps
	./bench/run.sh

# soak runs issue 16's chaos soak (bench/chaos; root, iproute2, etcd): a
# 10-minute schedule of faults (MTBF 5 s: over 100 rank kills, exits, hangs
# and agent kills with a replacement agent) against gorun restart, heal and
# heal with a hot spare on 2 network-namespace hosts, c10d then etcd, and
# prints each table; it fails when a run breaks an invariant. About 1.5 h.
soak: build
	$(GO) build $(GOFLAGS) -o $(BIN)/allreduce ./examples/allreduce
	for backend in c10d etcd; do \
		$(GO) run ./bench/chaos -gorun $(BIN)/gorun-etcd -worker $(BIN)/allreduce -backend $$backend \
			-hosts 2 -nproc 2 -steps 12000 -step-ms 50 -baseline-steps 1200 -mtbf 5s -horizon 10m \
			-kinds rank-kill,rank-exit,rank-hang,agent-kill -rows 1,2,4,6 -row-timeout 45m || exit 1; \
	done

# soak-kinds runs every fault kind in one schedule (issue 16: over 100 of
# each at the default horizon): rank kills, exits and hangs, two ranks at
# once, a kill during a grow, agent kills with a replacement, link cuts,
# a spare killed while it stands by, the coordinator's host lost; against
# heal with a hot spare on 3 network-namespace hosts and etcd (which
# coordinator-lost needs). About 65 min; SOAK_HORIZON shortens it.
SOAK_HORIZON ?= 50m
soak-kinds: build
	$(GO) build $(GOFLAGS) -o $(BIN)/allreduce ./examples/allreduce
	$(GO) run ./bench/chaos -gorun $(BIN)/gorun-etcd -worker $(BIN)/allreduce -backend etcd \
		-hosts 3 -nproc 2 -steps 40000 -step-ms 50 -baseline-steps 1200 -mtbf 2750ms -cut-for 4s \
		-horizon $(SOAK_HORIZON) -seed 31 -rows 1,6 -row-timeout 100m -done-timeout 10 -shutdown-timeout 2 \
		-kinds rank-kill,rank-exit,rank-hang,agent-kill,two-ranks,grow-kill,link-cut,spare-kill,coordinator-lost

clean:
	rm -rf $(BIN)
