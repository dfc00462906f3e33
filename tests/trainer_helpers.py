"""Helpers the trainer integration tests share (Hugging Face Trainer, Lightning): a seeded
dataset of token rows, a tiny GPT-2 built from a config, a ban on pickle for the resumes
that must not unpickle anything, and the runner of a test file as its own child program.

transformers is imported only by tiny_gpt2, so a test file that skips without it can still
import this module first."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """`n` rows of `length` token ids below `vocab`, the same rows for the same `seed`; each
    row is its own label (a language model's next-token targets)."""

    def __init__(self, *, n: int, length: int, vocab: int, seed: int) -> None:
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def tiny_gpt2(**config: int) -> Any:
    """A GPT2LMHeadModel of `config` (GPT2Config's arguments), its weights drawn from seed 0:
    the same model in every process."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**config))


def ban_pickle() -> None:
    """Make pickle and torch.load raise in this process: a resume that calls either fails."""
    import pickle

    def banned(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle or torch.load was called while resuming")

    class BannedUnpickler(pickle.Unpickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            banned()

    pickle.load = pickle.loads = banned  # type: ignore[assignment]
    pickle.Unpickler = BannedUnpickler  # type: ignore[misc]
    torch.load = banned
    torch.serialization.load = banned


def run_child(script: str, *args: str, expect: int = 0) -> None:
    """Run the test file `script` as a child program with `args` (one thread, warnings off, this
    checkout first on the path); its exit status must be `expect`."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == expect, (
        f"child {args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
