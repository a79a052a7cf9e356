"""A PyTorch gloo worker for bench/ftbench's restart rows.

Joins the default process group over gloo from the launcher's environment
(env://), then allreduces a small tensor in a loop, --step-ms apart, checking
the sum. After its first successful allreduce of each attempt it prints

    first-collective attempt=A epoch=0 unix_ns=T

(A is TORCHELASTIC_RESTART_COUNT, T the wall clock). When a peer dies the
allreduce raises and the worker exits 1, so that the launcher (torchrun or
gorun --on-failure restart) restarts the group: the full-restart recovery
that ftbench measures.

    torchrun --standalone --nproc-per-node 8 --max-restarts 1 bench/gloo_resume.py
"""
import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=0, help="allreduces to run; 0: until stopped")
    ap.add_argument("--step-ms", type=int, default=5, help="pause between allreduces")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = dist.get_world_size()
    t = torch.empty(16)
    step = 0
    while args.steps == 0 or step < args.steps:
        t.fill_(1.0)
        dist.all_reduce(t)
        if step == 0:
            print("first-collective attempt=%d epoch=0 unix_ns=%d" % (attempt, time.time_ns()), flush=True)
        if t[0].item() != world:
            print("allreduce sum %g, want %d" % (t[0].item(), world), file=sys.stderr, flush=True)
            return 3
        step += 1
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
