"""A tiny deterministic training job that keeps going when ranks die.

Linear regression, y = x·w*, trained by data-parallel SGD: each rank computes
the gradient on its own samples (drawn from a generator seeded by its global
rank and the step), the gradients are summed with all_reduce and divided by
the world size. Under gorun --on-failure shrink, when a rank dies the
survivors move to the agents' next epoch (gorun_ft), re-sync the model and
the step from the lowest rank and carry on. When gorun respawns the lost
rank (heal), the newcomer joins the survivors' group by a grow epoch, takes
the model and the step from them the same way, and trains with its launch
slot's samples. Every member ends with

    done rank=R world=W steps=S loss=X pid=P

where loss is measured on a fixed evaluation set, so all members print the
same X, and P is the process's id (a survivor is never restarted). With
--timestamps every rank also prints, after its first successful collective
of each attempt and epoch (bench/ftbench measures recovery so),

    first-collective attempt=A epoch=E unix_ns=T

and, as the process starts, when a newcomer has said it is ready (its
start-up over), and when a new epoch stops its steps in epoch E,

    started attempt=A unix_ns=T
    ready attempt=A unix_ns=T
    stopped attempt=A epoch=E unix_ns=T

and a worker that gorun pre-started (--spare-prestart) prints, once its
imports are done and it waits for its place,

    parked unix_ns=T

With --progress every member prints, after every step S (from 0), what
bench/chaos measures goodput from (the format of examples/allreduce's):

    progress attempt=A epoch=E step=S rank=R world=W unix_ns=T

With --checkpoint FILE the group's rank 0 saves the model and the step count
to FILE after every step, and a worker that starts (a restart) resumes from
it: a restarted job redoes only the step it was in, as a training job that
checkpoints does. A newcomer takes the survivors' state all the same.

    gorun --standalone --nproc-per-node 4 --on-failure shrink examples/torch/train_elastic.py --steps 200
"""
import time

STARTED_NS = time.time_ns()  # before the imports: a newcomer's start-up counts from here

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gorun_ft  # noqa: E402

DIM = 8


def batch(global_rank, step, n=32):
    g = torch.Generator().manual_seed(1_000_003 * global_rank + step)
    x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    return x, x @ true_weights()


def true_weights():
    return torch.arange(1, DIM + 1, dtype=torch.float64) / DIM


def eval_loss(w):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, DIM, generator=g, dtype=torch.float64)
    return float(((x @ w - x @ true_weights()) ** 2).mean())


def save_checkpoint(path, w, step):
    """Saves the model and the steps done whole: a reader never sees half a
    file, however the writer dies."""
    tmp = "%s.%d" % (path, os.getpid())
    torch.save({"w": w.cpu(), "step": step}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timestamps", action="store_true",
                    help="print 'first-collective attempt=A epoch=E unix_ns=T' after the first "
                         "successful collective of each attempt and epoch")
    ap.add_argument("--progress", action="store_true",
                    help="print 'progress attempt=A epoch=E step=S rank=R world=W unix_ns=T' after every step")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="the process group's timeout in seconds: how long a collective waits on a silent peer "
                         "(under torchrun, which has no hang detection, what ends a hang)")
    ap.add_argument("--checkpoint", default="",
                    help="file where the group's rank 0 saves the model and step after every step, and that a "
                         "(re)started worker resumes from (default: none)")
    args = ap.parse_args()
    if args.timeout <= 0:
        ap.error("--timeout %g: want seconds above 0" % args.timeout)
    # A pre-started worker (gorun --spare-prestart) waits here, its imports
    # done, for its agent's round: its rank and the rest.
    if args.timestamps and "GORUN_ASSIGNMENT_FD" in os.environ:
        print("parked unix_ns=%d" % time.time_ns(), flush=True)
    gorun_ft.await_assignment()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stamped = -1  # the last epoch whose first collective was stamped
    if args.timestamps:
        print("started attempt=%d unix_ns=%d" % (attempt, STARTED_NS), flush=True)

    def stopped():
        if args.timestamps:
            print("stopped attempt=%d epoch=%d unix_ns=%d" % (attempt, group.epoch.number, time.time_ns()), flush=True)

    def collective_done():
        nonlocal stamped
        if args.timestamps and group.epoch.number > stamped:
            stamped = group.epoch.number
            print("first-collective attempt=%d epoch=%d unix_ns=%d" % (attempt, stamped, time.time_ns()), flush=True)

    def ready():
        if args.timestamps:
            print("ready attempt=%d unix_ns=%d" % (attempt, time.time_ns()), flush=True)

    # NCCL reduces on the GPU: this local rank's, as PyTorch picks it
    # without a device_id (LOCAL_RANK modulo the GPUs).
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    group = gorun_ft.ElasticGroup(args.backend, timeout=datetime.timedelta(seconds=args.timeout), on_ready=ready)
    me = group.global_rank
    w = torch.zeros(DIM, dtype=torch.float64, device=dev)
    step = torch.zeros(1, dtype=torch.float64, device=dev)  # a tensor, so resync can broadcast it
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        w.copy_(saved["w"])
        step.fill_(saved["step"])
    print("rank %d: training, world %d%s" % (me, group.world_size, " (newcomer)" if group.newcomer else ""),
          flush=True)
    # A newcomer's first collective takes the model and the step from the
    # survivors.
    resync = group.newcomer
    while int(step.item()) < args.steps:
        try:
            if resync:
                # After a change of membership some survivors may have
                # finished the failed step and others not, and a newcomer
                # has nothing: every member takes the lowest survivor's
                # model and step count, as its first collective in the new
                # group.
                with group.blocked():
                    group.resync(w, step)
                collective_done()
                resync = False
            if group.pending():
                stopped()
            if group.check():
                resync = True
                continue
            x, y = (t.to(dev) for t in batch(me, int(step.item())))
            grad = 2 * x.t() @ (x @ w - y) / len(x)
            with group.blocked():  # a hung peer holds us here: say we are alive
                dist.all_reduce(grad)
            collective_done()
            w -= args.lr * grad / group.world_size
            step += 1
            if args.progress:
                print("progress attempt=%d epoch=%d step=%d rank=%d world=%d unix_ns=%d"
                      % (attempt, group.epoch.number, int(step.item()) - 1, group.rank, group.world_size,
                         time.time_ns()), flush=True)
            if args.checkpoint and group.rank == 0:
                save_checkpoint(args.checkpoint, w, int(step.item()))
        except RuntimeError as err:
            stopped()
            group.recover(err)
            resync = True
            continue
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
    loss = eval_loss(w.cpu())
    print("done rank=%d world=%d steps=%d loss=%.9g pid=%d"
          % (group.rank, group.world_size, int(step.item()), loss, os.getpid()), flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(gorun_ft.run(main))
