#!/usr/bin/env bash
# Installs what gorun's tests need from Debian's archive, when it is missing
# and we are root: Debian's python3-torch (PyTorch 1.13.1, importable only
# under /usr/bin/python3) for the interop tests, etcd-server (3.4) for the
# etcd backend's tests, iproute2 (`ip netns`) for the multi-host test bed,
# and debootstrap for the sid bed. Then it builds the sid bed
# (internal/sidbed: a Debian sid chroot with PyTorch 2.14 and NCCL 2.29,
# cached in /var/cache/gorun/sid-bed; a few minutes once, then a stamp
# check). Without root it says what is missing and leaves the tests to skip
# (or, in CI, to fail) with one line each.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
if ! /usr/bin/python3 -c 'import torch.distributed' >/dev/null 2>&1; then
  missing+=(python3-torch)
fi
if ! command -v etcd >/dev/null 2>&1; then
  missing+=(etcd-server)
fi
if ! command -v ip >/dev/null 2>&1; then
  missing+=(iproute2)
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  missing+=(debootstrap)
fi

root=0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  root=1
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ $root -eq 0 ]; then
    echo "test-deps: missing ${missing[*]} (not root or no apt-get); tests that need them will skip" >&2
  else
    echo "test-deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    /usr/bin/python3 -c 'import torch, torch.distributed as d; print("test-deps: torch", torch.__version__, "gloo", d.is_gloo_available())' >&2
  fi
fi

if [ $root -eq 1 ]; then
  ${GO:-go} run ./internal/sidbed/cmd/sidbed build >&2
else
  echo "test-deps: the sid bed (PyTorch 2.14, NCCL 2.29) is built as root; tests that need it will skip" >&2
fi
