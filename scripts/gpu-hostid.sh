#!/bin/sh
# gpu-hostid.sh PROGRAM ARGS...: run a worker as a host of its own in NCCL's
# eyes, so that several ranks can share one GPU (scripts/gpu-check.sh).
#
# NCCL refuses two ranks of one host on one device ("Duplicate GPU
# detected"); it tells hosts apart by NCCL_HOSTID when that is set. With a
# host id per process the ranks reach each other through NCCL's socket
# transport on loopback. This is for checking on a one-GPU machine, never
# for a real job.
NCCL_HOSTID="gpu-check-${RANK:-x}-$$"
NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_HOSTID NCCL_SOCKET_IFNAME
exec "$@"
