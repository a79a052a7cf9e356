"""A small real job for gorun (or torchrun).

Every rank joins the default process group over gloo through env:// (the
store gorun's agent serves), contributes rank+1 to an all_reduce, and checks
the sum: 1+2+…+WORLD_SIZE. Exit status 0 when the sum is right.

    gorun --standalone --nproc-per-node 4 examples/torch/allreduce.py
"""
import datetime
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    want = world * (world + 1) // 2
    ok = t.item() == want
    print(f"rank {rank}/{world}: all_reduce sum={t.item():g} (want {want}) {'ok' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
