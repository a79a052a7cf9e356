#!/usr/bin/env bash
# gpu-nccl-pack.sh: packs the sid bed's NCCL (2.29.7, with ncclCommGrow)
# and the GPU bundle for a device machine whose own NCCL is older
# (PyTorch 2.11's pip NCCL is 2.28.9). The library is 215 MiB, 95 MiB
# under xz, and a device call carries at most 64 MiB, so it goes in two
# parts, one per call, on the same warm machine (it stays warm 30 s after
# a call):
#
#   scripts/gpu-nccl-pack.sh                      # here: .nccl/a, .nccl/b
#   call 1, carry .nccl/a:  cp .nccl/a/nccl.xz.aa /tmp/
#   call 2, carry .nccl/b:  scripts/gpu-nccl-pack.sh unpack &&
#       NCCL_LIBRARY=/tmp/libnccl.so.2 GPU_CHECKS="gpusmoke pg-nccl-heal gorun-go-heal" scripts/gpu-check.sh
#
# .nccl/ is ignored (.gitignore), as .gpu/ is.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = unpack ]; then
	cat /tmp/nccl.xz.aa .nccl/b/nccl.xz.ab | xz -T0 -d >/tmp/libnccl.so.2
	echo "$(cat .nccl/b/sha256)  /tmp/libnccl.so.2" | sha256sum -c
	mkdir -p .gpu
	tar -C .gpu -xJf .nccl/b/gpu.tar.xz
	exit 0
fi
lib=${NCCL_LIBRARY:-/var/cache/gorun/sid-bed/root/usr/lib/x86_64-linux-gnu/libnccl.so.2}
[ -f "$lib" ] || { echo "gpu-nccl-pack.sh: no $lib (make test-deps builds the sid bed)" >&2; exit 2; }
make gpu-bundle >/dev/null
rm -rf .nccl && mkdir -p .nccl/a .nccl/b
sha256sum <"$lib" | cut -c1-64 >.nccl/b/sha256
xz -T0 -6 -c "$lib" | split -b 60000000 - .nccl/part.
[ ! -e .nccl/part.ac ] || { echo "gpu-nccl-pack.sh: $lib needs more than two 60-MB parts" >&2; exit 1; }
mv .nccl/part.aa .nccl/a/nccl.xz.aa
mv .nccl/part.ab .nccl/b/nccl.xz.ab
tar -C .gpu -cJf .nccl/b/gpu.tar.xz .
du -sh .nccl/a .nccl/b
