"""A sharded training job that torchrun restarts after a crash, resuming from its checkpoint.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        examples/torchrun_restart.py --ckpt-dir /tmp/run --steps 6 --crash-after 3

Every rank trains an FSDP2-sharded model (gloo on CPU) and calls
``CheckpointManager.save`` after each step: each rank writes its shard, and a commit
record written last makes the step a checkpoint.  With ``--crash-after N``, rank 1 kills
itself just after step N is saved, in the first attempt only; torchrun then stops the
other rank and starts both again, and the new attempt resumes from the newest complete
checkpoint (step N), RNG included, and trains to the end.  Rank 0 prints one line per
save and one on resume, with a digest of the full weights: the digest on resume is the
one saved at step N.

Options make it the job people run at scale: ``--archive s3://bucket/run`` keeps every
step on an object store too (credentials and endpoint from the ``AWS_*`` environment),
``--key-file`` encrypts every rank file, ``--incremental`` writes only what changed since
the previous step, ``--non-blocking`` returns from each save once the shards are staged,
and ``--fresh-node`` deletes the local checkpoint directory before the restart resumes,
as on a new machine: the new attempt resumes from the archive.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is needed for the restart: torch 2.13's torchrun
hands its workers the rendezvous's own TCP store, which outlives them, so a restarted
worker can read the dead attempt's gloo addresses there, and its ``init_process_group``
fails with "Connection refused" or hangs (pytorch/pytorch#135712).  With the variable set,
rank 0 of each attempt hosts a store of its own.  The script warns when it is not set.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptfmt


def build_model(world: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every attempt
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    """The data of a step: a function of the step, so a resumed run sees what an
    uninterrupted one would have."""
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the full weights (every rank takes part in gathering the shards)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def warn_about_shared_store() -> None:
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(
            "warning: torchrun shares its rendezvous store with the workers; a restart may fail "
            "with 'Connection refused' (run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="the run's checkpoint directory")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--crash-after", type=int, default=None, help="rank 1 dies after saving this step")
    parser.add_argument("--archive", default=None, help="an object-store URL every step is also copied to")
    parser.add_argument("--key-file", default=None, help="encrypt every rank file with this key file")
    parser.add_argument("--incremental", action="store_true", help="write only the chunks that changed")
    parser.add_argument("--non-blocking", action="store_true", help="return from a save after the snapshot")
    parser.add_argument("--fresh-node", action="store_true", help="a restart loses the local directory")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        warn_about_shared_store()
        if attempt > 0 and args.fresh_node and os.path.isdir(args.ckpt_dir):
            shutil.rmtree(args.ckpt_dir)  # a new machine: only the archive holds the run
    if args.fresh_node:
        dist.barrier()  # no rank opens the directory before rank 0 has removed it
    model = build_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    manager = ckptfmt.CheckpointManager(
        args.ckpt_dir,
        keep_last=2,
        archive=args.archive,
        archive_keep_last=2 if args.archive else None,
        encrypt_with=args.key_file,
        incremental=args.incremental,
        blocking=not args.non_blocking,
    )

    start = 0
    if manager.latest() is not None:
        start = manager.load_into(state).step
        digest = weights_digest(model)
        if rank == 0:
            print(f"attempt {attempt}: resumed from step {start} weights {digest}", flush=True)

    for step in range(start + 1, args.steps + 1):
        loss = model(batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        manager.save(step, state, metrics={"loss": loss.item()})
        digest = weights_digest(model)
        if rank == 0:
            print(f"attempt {attempt}: saved step {step} weights {digest}", flush=True)
        if attempt == 0 and step == args.crash_after:
            if args.non_blocking or args.archive:
                manager.wait()  # committed (and, on rank 0, archived) before the crash
                dist.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash just after a committed save
    if args.non_blocking or args.archive:
        manager.wait()
    # FSDP keeps the process group in the model: free the model first, so that destroying the
    # group ends its gloo threads now.  A gloo thread still releasing a collective's tensors
    # while the interpreter exits aborts the process ("terminate called without an active
    # exception"), which torchrun would take for a failed worker.
    del state, opt, model, manager
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
