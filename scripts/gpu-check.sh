#!/usr/bin/env bash
# gpu-check.sh: the checks that need a GPU, on a machine that has one.
#
# Build the bundle here first (make gpu-bundle: .gpu/ holds gorun, the Go
# allreduce worker on pg/nccl, gpusmoke and pg/nccl's test binary, built with
# cgo), then run this from the repository root on the GPU machine. It needs
# no Go there, only python3 with PyTorch (and PyTorch's NCCL, which the Go
# side loads too). Every step is bounded; the log goes to $OUT/gpu-check.log
# and each job's output to $OUT/logs/. One RESULT line per check:
#
#   gpusmoke            make gpu-smoke: world 1, allreduce, grow refused on one device, abort
#   pg-nccl-heal        TestGPUShrinkGrow: 3 rank processes, one SIGKILLed, shrink, a newcomer grown in
#   gorun-go-heal       gorun --on-failure shrink, 3 Go allreduce workers on pg/nccl, rank 2 SIGKILLed mid-run
#   gorun-go-heal-preform  the same, rank 2 killed before the first communicator forms
#   torch-nccl          gorun, 3 PyTorch NCCL workers (train_elastic.py), no fault
#   torch-nccl-heal     the same, rank 2 SIGKILLed mid-run: shrink, respawn, grow
#
# GPU_CHECKS="torch-nccl-heal gpusmoke" runs only those (a short lease).
# NCCL_LIBRARY runs the Go checks on another NCCL than PyTorch's (the
# torch checks keep PyTorch's own): scripts/gpu-nccl-pack.sh carries the
# sid bed's 2.29.7, which has ncclCommGrow.
#
# Several ranks share the machine's one GPU through scripts/gpu-hostid.sh
# (a NCCL host id per process).
set -u
OUT=${OUT:-/tmp/gpu-check}
B=${GPU_BUNDLE:-.gpu}
PY=${PYTHON_EXEC:-python3}
# A dry run of the mechanics on a machine without a GPU: GPU_CHECK_GO=cpu
# GPU_CHECK_TORCH=gloo (the GPU checks then fail, the jobs' checks pass).
GO_BACKEND=${GPU_CHECK_GO:-nccl}
TORCH_BACKEND=${GPU_CHECK_TORCH:-nccl}
mkdir -p "$OUT/logs"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

step() { echo; echo "=== $* ($(date -u +%T))"; }
# want CHECK: whether to run CHECK (GPU_CHECKS, names separated by spaces:
# the ones to run; unset: all).
want() { [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" $1 "* ]]; }
for c in ${GPU_CHECKS:-}; do
	case $c in
	gpusmoke | pg-nccl-heal | gorun-go-heal | gorun-go-heal-preform | torch-nccl | torch-nccl-heal) ;;
	*) echo "gpu-check.sh: GPU_CHECKS: unknown check '$c' (gpusmoke pg-nccl-heal gorun-go-heal gorun-go-heal-preform torch-nccl torch-nccl-heal)" >&2; exit 2 ;;
	esac
done
result() { echo "RESULT $1: $([ "$2" = 0 ] && echo PASS || echo "FAIL (rc $2)")${3:+ $3}"; }

# kill_rank RANK PATTERN LOG PROCESS DELAY: once LOG holds PATTERN, wait
# DELAY seconds, then SIGKILL the process matching PROCESS whose RANK is RANK.
kill_rank() {
	local rank=$1 pat=$2 log=$3 proc=$4 delay=$5 p
	for _ in $(seq 1200); do grep -q -- "$pat" "$log" && break; sleep 0.1; done
	sleep "$delay"
	for p in $(pgrep -f -- "$proc"); do
		if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$rank"; then
			echo "SIGKILL pid $p (RANK=$rank) at $(date -u +%T.%N)"
			kill -9 "$p"
			return 0
		fi
	done
	echo "no worker with RANK=$rank to kill"
	return 1
}

# summary LOG: the lines that say what a job did.
summary() {
	grep -E 'shrink epoch|grow epoch|restart epoch|done rank|lost ranks|newcomer|excluded|Error|error|FAIL|Traceback|exited|exit code|abort' "$1" |
		grep -v -E '^\s*$|socket\.cpp|frame #|^\[default[0-9]\]:(Last error|Exception raised)' | head -40
}

step environment
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
uname -r
$PY -c 'import sys, torch, torch.distributed as dist; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "shrink_group", hasattr(dist, "shrink_group"))'
NCCL=${NCCL_LIBRARY:-$($PY - <<'PYEOF'
import glob, os, site, sys
for root in site.getsitepackages():
    for p in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnccl.so*"), recursive=True)):
        print(p)
        sys.exit()
PYEOF
)}
echo "NCCL library: ${NCCL:=libnccl.so.2}"

if want gpusmoke; then
step gpusmoke
timeout -k 5 30 "$B/gpusmoke" -probe -nccl "$NCCL"
timeout -k 5 90 "$B/gpusmoke" -nccl "$NCCL"
result gpusmoke $?
fi

if want pg-nccl-heal; then
step "pg/nccl: TestGPUShrinkGrow"
(cd pg/nccl && PGNCCL_GPU_NCCL=$NCCL timeout -k 5 100 "../../$B/nccl.test" -test.run '^TestGPUShrinkGrow$' -test.v -test.timeout 95s) >"$OUT/logs/pg-nccl-heal.log" 2>&1
rc=$?
grep -E '^(=== RUN|--- |\s+gpu_cgo_test.go:[0-9]+: (formed|shrunk|grown|.*FAIL|[a-z]+: ))|FAIL|PASS|panic' "$OUT/logs/pg-nccl-heal.log" | head -60
result pg-nccl-heal $rc
fi

if want gorun-go-heal; then
step "gorun heal: Go allreduce on pg/nccl, rank 2 SIGKILLed mid-run"
L=$OUT/logs/gorun-go-heal.log
GORUN_NCCL_LIBRARY=$NCCL timeout -k 5 60 "$B/gorun" --standalone --nproc-per-node 3 --on-failure shrink --respawn-backoff 0.1 \
	--no-python scripts/gpu-hostid.sh "$B/allreduce" -backend "$GO_BACKEND" -steps 800 -step-ms 10 -progress -timestamps >"$L" 2>&1 &
g=$!
kill_rank 2 'step=150 ' "$L" "$B/allreduce" 0
wait $g
rc=$?
summary "$L"
n=$(grep -c 'done rank=[0-9]* world=3 steps=800' "$L")
if [ "$rc" = 0 ] && { [ "$n" != 3 ] || ! grep -q 'the lost ones grown back in' "$L"; }; then rc=99; fi
result gorun-go-heal $rc "($n of 3 ranks done at world 3)"
fi

if want gorun-go-heal-preform; then
step "gorun heal: Go allreduce on pg/nccl, rank 2 lost before the first communicator forms"
# Rank 2 sleeps before it execs the worker (a newcomer does not), so ranks 0
# and 1 sit in the first formation waiting for it; it is killed there.
L=$OUT/logs/gorun-go-heal-preform.log
GORUN_NCCL_LIBRARY=$NCCL timeout -k 5 60 "$B/gorun" --standalone --nproc-per-node 3 --on-failure shrink --respawn-backoff 0.1 \
	--no-python scripts/gpu-hostid.sh sh -c 'if [ "$RANK" = 2 ] && [ -z "${GORUN_SHRINK_NEWCOMER:-}" ]; then sleep 60; fi; exec "$@"' gpu-slow-rank \
	"$B/allreduce" -backend "$GO_BACKEND" -steps 400 -step-ms 10 -timestamps >"$L" 2>&1 &
g=$!
kill_rank 2 '.' "$L" gpu-slow-rank 4
wait $g
rc=$?
summary "$L"
n=$(grep -c 'done rank=[0-9]* world=3 steps=400' "$L")
if [ "$rc" = 0 ] && { [ "$n" != 3 ] || ! grep -q 'the lost ones grown back in' "$L"; }; then rc=99; fi
result gorun-go-heal-preform $rc "($n of 3 ranks done at world 3)"
fi

if want torch-nccl; then
step "gorun, PyTorch NCCL (train_elastic.py), no fault"
L=$OUT/logs/torch-nccl.log
timeout -k 5 90 "$B/gorun" --standalone --nproc-per-node 3 --on-failure shrink \
	--no-python scripts/gpu-hostid.sh "$PY" examples/torch/train_elastic.py --backend "$TORCH_BACKEND" --steps 200 --step-ms 5 --timestamps >"$L" 2>&1
rc=$?
summary "$L"
n=$(grep -c 'done rank=[0-9]* world=3 steps=200' "$L")
if [ "$rc" = 0 ] && [ "$n" != 3 ]; then rc=99; fi
result torch-nccl $rc "($n of 3 ranks done at world 3)"
fi

torch_heal() { # name, the kill's pattern and delay, then env assignments for the job
	local name=$1 L=$OUT/logs/$1.log pat=$2 delay=$3 g rc n stacks
	shift 3
	env "$@" timeout -k 5 75 "$B/gorun" --standalone --nproc-per-node 3 --on-failure shrink --respawn-backoff 0.1 \
		--no-python scripts/gpu-hostid.sh "$PY" examples/torch/train_elastic.py --backend "$TORCH_BACKEND" --steps 600 --step-ms 20 --timestamps >"$L" 2>&1 &
	g=$!
	kill_rank 2 "$pat" "$L" train_elastic.py "$delay"
	# Where every worker is 15 s later (GORUN_FT_STACKS: faulthandler).
	(sleep 15; for p in $(pgrep -f train_elastic.py); do
		tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^RANK=' && kill -USR1 "$p"
	done) &
	stacks=$!
	wait $g
	rc=$?
	kill $stacks 2>/dev/null
	summary "$L"
	n=$(grep -c 'done rank=[0-9]* world=3 steps=600' "$L")
	# Whether the survivors ran at world 2 while the newcomer started.
	shrunk=$(grep -c 'first-collective attempt=0 epoch=1 ' "$L")
	# Healed, not restarted: gorun's closing line says so.
	if [ "$rc" = 0 ] && { [ "$n" != 3 ] || ! grep -q 'the lost ones grown back in' "$L"; }; then rc=99; fi
	result "$name" $rc "($n of 3 ranks done at world 3; $shrunk of 2 survivors ran the shrunk group)"
	return $rc
}
if want torch-nccl-heal; then
step "gorun heal, PyTorch NCCL, rank 2 SIGKILLed 3 s into its steps"
# TORCH_CPP_LOG_LEVEL=INFO: PyTorch logs when an abort starts and ends.
if ! torch_heal torch-nccl-heal 'first-collective attempt=0 epoch=0' 3 GORUN_FT_STACKS=1 TORCH_CPP_LOG_LEVEL=INFO; then
	step "the same without PyTorch's monitoring thread"
	torch_heal torch-nccl-heal-nomonitor 'first-collective attempt=0 epoch=0' 3 GORUN_FT_STACKS=1 TORCH_CPP_LOG_LEVEL=INFO \
		TORCH_NCCL_ENABLE_MONITORING=0
elif [ "$SECONDS" -lt 240 ]; then
	step "gorun heal, PyTorch NCCL, rank 2 SIGKILLed as the job starts its steps"
	torch_heal torch-nccl-heal-early 'first-collective attempt=0 epoch=0' 0 GORUN_FT_STACKS=1
fi
fi

step done
pkill -9 -f "$B/" 2>/dev/null
grep '^RESULT' "$OUT/gpu-check.log"
