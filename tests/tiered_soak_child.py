"""Helper for test_tiered_soak: forks tiered trainers on request so each kill costs no torch import.

Usage: ``tiered_soak_child.py RUN_DIR PROGRESS_FILE ARCHIVE_URL ENDPOINT MODE``.  For each
line read on stdin the server forks a worker, prints its pid, waits for it to end and prints
"reaped <status>".  A line "finish N" instead runs a worker that saves up to step N, waits
for its saves and archive copies, and exits 0 (the clean end).

A worker resumes from the tiers' newest complete step (``load_into``; a fresh node, whose
run directory was deleted, from the archive), then trains one step at a time forever
(manager_crash_child.Trainer), saving every step through
``CheckpointManager(RUN_DIR, **tiered_options(MODE))`` with at most IN_FLIGHT saves in flight.
It appends to PROGRESS_FILE (one O_APPEND write a line): ``resume <step> <pid>`` (0: from
scratch), ``begin``/``done <step> <pid>`` around each save, and ``warn <pid> <text>`` for a
warning that a kill cannot explain.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from typing import Any

import torch
from manager_crash_child import IN_FLIGHT, Trainer

import ckptfmt
from ckptfmt.runs.rng import capture_rng

KEEP_LAST = 2
ARCHIVE_KEEP_LAST = 4
ARCHIVE_KEEP_EVERY = 25
MODES = ("plain", "signed", "encrypted", "zstd")
#: a frozen tensor saved with every step, large enough (128 KiB) that an incremental step
#: refers to the previous step's copy of it: the archive then holds objects of steps it keeps
#: only for a later step's sake
FROZEN = torch.arange(32768, dtype=torch.float32)
#: warnings a kill explains: the previous worker's unfinished step, a copy it cut short
EXPECTED = ("skipping ",)


def _keys() -> tuple[Any, bytes]:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32))), bytes(range(32, 64))


def tiered_options(mode: str, archive: str, endpoint: str) -> dict[str, Any]:
    """The CheckpointManager arguments of a soak run in `mode` (besides its directory)."""
    sign, kek = _keys()
    options = {
        "endpoint_url": endpoint,
        "aws_access_key_id": "ckptfmt-test-access-key",
        "aws_secret_access_key": "ckptfmt-test-secret-key",
        "region": "us-east-1",
    }
    kw: dict[str, Any] = dict(
        keep_last=KEEP_LAST,
        archive=archive,
        archive_keep_last=ARCHIVE_KEEP_LAST,
        archive_keep_every=ARCHIVE_KEEP_EVERY,
        storage_options=options,
        blocking=False,
        incremental=mode != "encrypted",  # encrypted runs are not incremental in this version
    )
    if mode == "signed":
        kw |= dict(sign_with=sign, trusted_keys=[sign.public_key()])
    elif mode == "encrypted":
        kw |= dict(encrypt_with=kek)
    elif mode == "zstd":
        kw |= dict(compression="zstd")
    else:
        assert mode == "plain", mode
    return kw


def worker(run_dir: str, progress: str, kw: dict[str, Any], until: int | None) -> None:
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    pid = os.getpid()

    def record(what: str, step: int) -> None:
        os.write(fd, f"{what} {step} {pid}\n".encode())

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        text = " ".join(str(message).split())
        if not (issubclass(category, ckptfmt.CheckpointWarning) and text.startswith(EXPECTED)):
            os.write(fd, f"warn {pid} {category.__name__}: {text[:500]}\n".encode())

    warnings.showwarning = show
    warnings.simplefilter("always")
    trainer = Trainer()
    mgr = ckptfmt.CheckpointManager(run_dir, **kw)
    if mgr.latest() is not None:
        state = trainer.state() | {"frozen": torch.zeros_like(FROZEN)}
        report = mgr.load_into(state)
        trainer.step = state["step"]
        assert report.step == trainer.step and state["data"]["batch"] == trainer.step
        assert torch.equal(state["frozen"], FROZEN)
    record("resume", trainer.step)
    pending: collections.deque[tuple[int, ckptfmt.SaveHandle]] = collections.deque()
    while until is None or trainer.step < until:
        loss = trainer.train_step()
        while len(pending) >= IN_FLIGHT:
            step, oldest = pending.popleft()
            oldest.wait()
            record("done", step)
        record("begin", trainer.step)
        handle = mgr.save(trainer.step, trainer.state() | {"frozen": FROZEN}, metrics={"loss": loss})
        assert handle is not None
        pending.append((trainer.step, handle))
    mgr.wait()
    for step, _ in pending:
        record("done", step)


def main() -> None:
    torch.set_num_threads(1)
    run_dir, progress, archive, endpoint, mode = sys.argv[1:6]
    kw = tiered_options(mode, archive, endpoint)
    Trainer().train_step()  # warm up torch once, in the server (see manager_crash_child)
    capture_rng()
    import boto3  # noqa: F401  (imported once here, not in every worker)

    ckptfmt.CheckpointManager  # noqa: B018  (the public API is imported on first use: here, once)

    for line in sys.stdin:
        words = line.split()
        until = int(words[1]) if words[:1] == ["finish"] else None
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                worker(run_dir, progress, kw, until)
                code = 0
            except BaseException:
                traceback.print_exc()
            os._exit(code)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)


if __name__ == "__main__":
    main()
