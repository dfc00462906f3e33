"""Helper for test_manager_crash: forks trainers on request so each kill costs no torch import.

Usage: ``manager_crash_child.py RUN_DIR PROGRESS_FILE``.  For each line read on
stdin, the server forks a worker, prints the worker's pid, waits for it to be
killed and prints "reaped".  A worker resumes from the newest complete
checkpoint in RUN_DIR (or starts from scratch), then trains one step at a time
forever, saving every step through a non-blocking CheckpointManager with
``keep_last=KEEP_LAST``, at most IN_FLIGHT saves in flight.

It tells the parent what it did by appending lines to PROGRESS_FILE (one
``write`` on an O_APPEND descriptor per line, so lines never interleave or tear;
no fsync, since SIGKILL does not lose the page cache):

* ``begin <step> <pid>`` right before ``save(step)`` is called;
* ``done <step> <pid>`` once that save's handle has been waited for, i.e. the
  step is committed and its rotation has run;
* ``warn <pid> <text>`` for any warning other than the expected one about the
  previous worker's unfinished step directory.

The trainer is deterministic: the same seed, data drawn from a generator seeded
by the step, dropout from the global torch RNG (which the manager captures and
``load_into`` restores).  So :class:`Trainer` run from scratch in the parent
yields, bit for bit, the state every checkpoint must hold, and a resume that
lost any of model, optimizer, step or RNG would show up as a mismatch.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from typing import Any

import torch

import ckptfmt
from ckptfmt.runs.rng import capture_rng

KEEP_LAST = 2
#: saves a worker lets run at once: it waits for the oldest before starting another
IN_FLIGHT = 2
SEED = 20240601


class Trainer:
    """A tiny model, its AdamW optimizer and its step counter."""

    def __init__(self) -> None:
        torch.manual_seed(SEED)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(32, 4)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.step = 0

    def state(self) -> dict[str, Any]:
        """What is saved (and what load_into fills): "data" records the data position."""
        return {"model": self.model, "optim": self.opt, "step": self.step, "data": {"batch": self.step}}

    def resume(self, mgr: ckptfmt.CheckpointManager) -> None:
        state = self.state()
        report = mgr.load_into(state)
        self.step = state["step"]
        assert report.step == self.step and state["data"]["batch"] == self.step, (report.step, state)

    def train_step(self) -> float:
        """One step; the batch depends only on the step, dropout on the global RNG."""
        self.step += 1
        g = torch.Generator().manual_seed(self.step)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()


def flat_state(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a model and an optimizer state dict, by a flat name (for comparisons)."""
    out = {f"model.{k}": v for k, v in model_state.items()}
    for pid, per_param in optim_state["state"].items():
        for k, v in per_param.items():
            out[f"optim.{pid}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def worker(run_dir: str, progress: str) -> None:
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    pid = os.getpid()

    def record(what: str, step: int) -> None:
        os.write(fd, f"{what} {step} {pid}\n".encode())

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        # "skipping <the previous worker's unfinished step>" is expected after a kill;
        # any other warning (a failed rotation, say) goes to the parent, which fails on it.
        text = " ".join(str(message).split())
        if not (issubclass(category, ckptfmt.CheckpointWarning) and text.startswith("skipping ")):
            os.write(fd, f"warn {pid} {category.__name__}: {text}\n".encode())

    warnings.showwarning = show
    warnings.simplefilter("always")

    trainer = Trainer()
    mgr = ckptfmt.CheckpointManager(run_dir, keep_last=KEEP_LAST, blocking=False)
    if mgr.latest() is not None:
        trainer.resume(mgr)
    pending: collections.deque[tuple[int, ckptfmt.SaveHandle]] = collections.deque()
    while True:
        loss = trainer.train_step()  # overlaps with the saves in flight, as in real training
        while len(pending) >= IN_FLIGHT:
            step, oldest = pending.popleft()
            oldest.wait()
            record("done", step)
        record("begin", trainer.step)
        handle = mgr.save(trainer.step, trainer.state(), metrics={"loss": loss})
        assert handle is not None  # blocking=False
        pending.append((trainer.step, handle))


def main() -> None:
    torch.set_num_threads(1)
    run_dir, progress = sys.argv[1], sys.argv[2]
    # Warm up here, once: the first optimizer step of a process imports and
    # initialises much of torch (over a second), which each worker would repeat.
    # No save here: it would start threads, and fork keeps only the calling one.
    Trainer().train_step()
    capture_rng()
    ckptfmt.CheckpointManager  # noqa: B018  (the public API is imported on first use: here, once)
    for _line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                worker(run_dir, progress)
            except BaseException:
                traceback.print_exc()
            os._exit(1)  # never return into the server's loop (a worker only ends by a kill or an error)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)


if __name__ == "__main__":
    main()
