"""PyTorch 1.13's gloo AllReduce, measured as bench/pgbench measures pg/cpu.

NPROC processes on loopback (torch.distributed, backend gloo, TCP
init_method); for each size, float32: WARMUP untimed iterations, then ITERS
timed ones, each after a barrier; rank 0's median is printed as one JSON
line per size: {"bytes": B, "median_s": T, "busbw_gbs": G}.

Usage: gloo_allreduce.py NPROC PORT SIZES ITERS WARMUP
(SIZES in bytes and ITERS per size, both comma-separated)
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, nproc, port, sizes, iters, warmup):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        n = iters[sizes.index(size)]
        for _ in range(warmup):
            dist.all_reduce(t)
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            med = statistics.median(times)
            bus = size / med * 2 * (nproc - 1) / nproc / 1e9
            print(json.dumps({"bytes": size, "median_s": med, "busbw_gbs": bus, "iters": n}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    nproc, port = int(sys.argv[1]), int(sys.argv[2])
    sizes = [int(s) for s in sys.argv[3].split(",")]
    iters, warmup = [int(s) for s in sys.argv[4].split(",")], int(sys.argv[5])
    mp.start_processes(worker, args=(nproc, port, sizes, iters, warmup), nprocs=nproc, start_method="fork")
