#!/usr/bin/env bash
# Installs what gorun's tests need from Debian's archive, when it is missing
# and we are root: Debian's python3-torch (PyTorch 1.13.1, importable only
# under /usr/bin/python3) for the interop tests, etcd-server (3.4) for the
# etcd backend's tests, and iproute2 (`ip netns`) for the multi-host test
# bed. Without root it says what is missing and leaves the tests to skip (or,
# in CI, to fail) with one line each.
set -euo pipefail

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

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: missing ${missing[*]} (not root or no apt-get); tests that need them will skip" >&2
  exit 0
fi
echo "test-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
/usr/bin/python3 -c 'import torch, torch.distributed as d; print("test-deps: torch", torch.__version__, "gloo", d.is_gloo_available())' >&2
