"""A small, realistic training run that resumes bit for bit: the recipe, and the demo's and tests' workload.

    python -m ckptfmt.demo.training RUN_DIR --steps N [--kill-at K] [--non-blocking] [--final PATH]

What it trains: a GPT-like model (token and position embeddings, two transformer
blocks with causal self-attention, dropout and layer norm, output head tied to
the token embedding; about 250K parameters) on synthetic token sequences, with a
shuffling data loader, AdamW, a warm-up + cosine LR schedule, bf16 autocast with a
GradScaler and gradient clipping.  Every ``save_every`` steps it saves the whole
training state through a :class:`ckptfmt.CheckpointManager`; started again on the
same directory, it resumes from ``latest()``.

A resumed run is bit-identical to an uninterrupted one only if everything that
decides the next step is restored.  That is, after step ``s``:

==================  =======================================================================
state               why a bit-exact resume needs it
==================  =======================================================================
model               the weights (the tied head shares the embedding's tensor: stored once)
optimizer           AdamW's moments and per-parameter step counts (they set the update size)
scheduler           its step count; the learning rate of step ``s + 1`` is computed from it
scaler              the loss scale and its growth tracker (decides skipped steps and rescales)
sampler             the epoch and how many batches of it were consumed: the same next batch
step                the loop counter (also the checkpoint's name)
RNG (the manager)   the global generators: dropout masks of step ``s + 1`` onwards
==================  =======================================================================

Three things are not state but must still match: the code and hyper-parameters
(rebuilt from the same constants), the intra-op thread count (it can change the
order of floating-point reductions; fixed by ``threads``), and the order of
random draws between building the objects and the first step (see
:func:`_resume` and the DataLoader ``generator`` in :func:`build_run`).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..runs.manager import CheckpointManager

SEED = 1234
VOCAB = 256
CONTEXT = 32  # tokens per training sequence
WIDTH = 96
HEADS = 4
LAYERS = 2
DROPOUT = 0.1
SEQUENCES = 256  # dataset size: 16 batches of 16 per epoch, so short runs cross epochs
BATCH = 16
LR = 3e-3
WARMUP = 5
DECAY_STEPS = 200  # cosine decay length; runs may stop earlier
CLIP = 1.0
#: A small growth interval makes the scale change within a short run, so its state matters.
SCALER_GROWTH_INTERVAL = 8


# -- the model ---------------------------------------------------------------------


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.resid_drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        # Attention dropout draws from the global torch generator, like nn.Dropout.
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width),
            torch.nn.GELU(),
            torch.nn.Linear(4 * width, width),
            torch.nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        context: int = CONTEXT,
        width: int = WIDTH,
        heads: int = HEADS,
        layers: int = LAYERS,
        dropout: float = DROPOUT,
    ) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(context, width)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2: one tensor under two names
        torch.nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# -- the data ----------------------------------------------------------------------


def synthetic_tokens(seed: int, sequences: int = SEQUENCES, length: int = CONTEXT + 1) -> torch.Tensor:
    """Token sequences from a fixed random Markov chain: learnable, made from `seed` alone.

    Each token is followed by one of four successors picked for it, or (one time in
    ten) by any token.  Uses its own generator, so building the data moves no global RNG.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 4), generator=g)
    out = torch.empty(sequences, length, dtype=torch.long)
    out[:, 0] = torch.randint(VOCAB, (sequences,), generator=g)
    for i in range(1, length):
        pick = successors[out[:, i - 1], torch.randint(4, (sequences,), generator=g)]
        noise = torch.randint(VOCAB, (sequences,), generator=g)
        out[:, i] = torch.where(torch.rand(sequences, generator=g) < 0.1, noise, pick)
    return out


class TokenDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(input, target) pairs: a sequence and the same sequence shifted by one token."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.tokens[i]
        return seq[:-1], seq[1:]


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Shuffled batches of indices, reshuffled each epoch, that can stop and continue mid-epoch.

    The order of an epoch comes from a generator seeded from (seed, epoch) alone, so it
    does not depend on what else drew random numbers before, and can be rebuilt after a
    restart.  The state is (epoch, batches of it already handed out); an iterator started
    after load_state_dict() skips those batches and yields exactly the rest of the epoch.

    The count is of batches handed to the DataLoader.  With ``num_workers=0`` (as here)
    that is the number the training loop has taken; with workers, the loader prefetches
    ahead of the loop and the position must be counted by the loop instead.
    """

    def __init__(self, items: int, batch_size: int, seed: int) -> None:
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.items // self.batch_size  # the last partial batch is dropped

    def _order(self) -> list[int]:
        # (seed, epoch) -> one 64-bit seed; distinct for every epoch below 2**20
        g = torch.Generator().manual_seed((self.seed << 20) + self.epoch)
        return torch.randperm(self.items, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        if self.consumed >= len(self):  # the previous epoch ran out: start the next one
            self.epoch += 1
            self.consumed = 0
        order = self._order()
        while self.consumed < len(self):
            start = self.consumed * self.batch_size
            self.consumed += 1  # counted before the yield: the batch is handed out now
            yield order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Refuses (ValueError, changing nothing) a state that is not {"epoch": int, "consumed": int}
        within range: it comes from a file."""
        if not isinstance(state, dict) or set(state) != {"epoch", "consumed"}:
            raise ValueError("a sampler state is a dict of exactly epoch and consumed")
        epoch, consumed = state["epoch"], state["consumed"]
        for name, v, hi in (("epoch", epoch, 2**20 - 1), ("consumed", consumed, len(self))):
            # bool is an int, and an epoch from 2**20 on would reuse another epoch's seed
            if type(v) is not int or not 0 <= v <= hi:
                raise ValueError(f"sampler {name} must be an int in [0, {hi}]")
        self.epoch, self.consumed = epoch, consumed


# -- the run -----------------------------------------------------------------------


def lr_factor(step: int) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to a tenth over DECAY_STEPS."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, DECAY_STEPS - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Run:
    """Everything a training step reads or changes."""

    model: TinyGPT
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    sampler: ResumableBatchSampler
    loader: torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]]
    step: int = 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds (the manager adds the RNG states).  The manager saves
        stateful objects as their state_dict() and load_into() calls their load_state_dict()."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.sampler,
            "step": self.step,
        }


def build_run(seed: int = SEED) -> Run:
    """A fresh run, every object built from `seed` in a fixed order."""
    torch.manual_seed(seed)  # the model's initial weights (a resume overwrites them)
    model = TinyGPT()
    # No weight decay on biases and layer-norm gains (the 1-D parameters), as usual for GPTs.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    # LambdaLR stores its step count, not the function: the function is rebuilt from code.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler("cpu", growth_interval=SCALER_GROWTH_INTERVAL)
    sampler = ResumableBatchSampler(SEQUENCES, BATCH, seed)
    loader = torch.utils.data.DataLoader(
        TokenDataset(synthetic_tokens(seed)),
        batch_sampler=sampler,
        num_workers=0,
        # Each new iterator draws a base seed for worker processes from this generator.
        # Without one it draws from the global torch generator: an iterator made at a
        # resume (mid-epoch) would then move the global RNG at another point than the
        # uninterrupted run did (at the epoch start), and every later dropout mask differs.
        generator=torch.Generator().manual_seed(seed),
    )
    return Run(model, optimizer, scheduler, scaler, sampler, loader)


def train_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One optimizer step; returns the loss (a Python float, exactly the fp32 value)."""
    run.model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = run.model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.optimizer)  # clip the true gradients, not the scaled ones
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), CLIP)
    run.scaler.step(run.optimizer)  # skipped when a gradient is inf/nan
    run.scaler.update()
    run.scheduler.step()
    run.step += 1
    return float(loss.detach())


def _batches(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches without end: a new DataLoader iterator (a new epoch) whenever one runs out."""
    if len(run.sampler) == 0:
        raise ValueError("the dataset holds less than one batch")
    while True:
        yield from run.loader


def _resume(mgr: CheckpointManager, run: Run, restore_rng: bool, restore_data: bool) -> str | None:
    """Load the newest complete checkpoint into `run`; a line saying what happened, or None.

    This is the last thing before the first step: load_into() restores the RNG states
    last, and anything drawing random numbers after it (a model built later, a warm-up
    batch) would move the generators away from where the saved run had them.
    """
    if mgr.latest() is None:
        return None
    state = run.state()
    if not restore_data:  # only to show what goes wrong without the data position
        del state["sampler"]
    report = mgr.load_into(state, strict=restore_data, restore_rng=restore_rng)
    run.step = int(state["step"])  # a plain value: load_into put the saved one in the dict
    notes = "; ".join(report.differences)
    return f"resumed from step {report.step}" + (f" ({notes})" if notes else "")


def train(
    run_dir: str | os.PathLike[str],
    total_steps: int,
    *,
    save_every: int = 1,
    keep_last: int | None = 3,
    blocking: bool = True,
    stop_after: int | None = None,
    log: Callable[[str], None] | None = None,
    final_path: str | os.PathLike[str] | None = None,
    threads: int = 1,
    seed: int = SEED,
    restore_rng: bool = True,
    restore_data: bool = True,
    on_step: Callable[[int], None] | None = None,
    archive: str | None = None,
) -> list[float]:
    """Train to `total_steps`, resuming from the newest checkpoint in `run_dir` if there is one.

    Returns the losses of the steps this call ran, in order (the first is the step after
    the resumed one).  `log` gets one line per step, ``step N loss HEX`` with the loss as
    ``float.hex()`` so runs can be compared bit for bit, plus a ``resumed from step N``
    line.  `stop_after` ends the call after that step (a clean stop, for tests).
    `final_path` receives the final training state as a ckptfmt file.  `on_step(step)`
    runs after each step's save.  `restore_rng=False` and `restore_data=False` resume
    without the RNG states or the data position: they exist to show that a resume
    without them is not exact.  `archive`: an object-store URL where every committed step
    is also copied (keeping as many steps as `keep_last`); a run whose local directory is
    lost resumes from there.
    """
    torch.set_num_threads(threads)
    say = log or (lambda line: None)
    run = build_run(seed)
    tiers: dict[str, Any] = {} if archive is None else {"archive": archive, "archive_keep_last": keep_last}
    mgr = CheckpointManager(run_dir, keep_last=keep_last, blocking=blocking, **tiers)
    resumed = _resume(mgr, run, restore_rng, restore_data)
    if resumed:
        say(resumed)
    end = total_steps if stop_after is None else min(total_steps, stop_after)
    losses: list[float] = []
    batches = _batches(run)
    while run.step < end:
        inputs, targets = next(batches)
        loss = train_step(run, inputs, targets)
        losses.append(loss)
        say(f"step {run.step} loss {loss.hex()}")
        if run.step % save_every == 0 or run.step == total_steps:
            mgr.save(run.step, run.state(), metrics={"loss": loss})
        if on_step is not None:
            on_step(run.step)
    mgr.wait()  # the last non-blocking saves are committed before the call returns
    if final_path is not None:
        save_final(run, final_path)
    return losses


def save_final(run: Run, path: str | os.PathLike[str]) -> None:
    """The run's final training state as one ckptfmt file (state dicts, no RNG)."""
    from ..files.save import save
    from ..runs.resume import to_storable

    save(to_storable(run.state()), os.fspath(path))


# -- a run in a child process (the demo and the tests kill it) ------------------------------


@dataclass
class ChildRun:
    """What a ``python -m ckptfmt.demo.training`` child printed, and how it ended."""

    losses: dict[int, str] = field(default_factory=dict)  # step -> loss as float.hex()
    resumed_from: int | None = None
    killed_after: int | None = None  # the last step it reported before we killed it
    pid: int = 0
    returncode: int = 0
    stderr: str = ""
    seconds: float = 0.0


def child_command(run_dir: str, steps: int, args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "ckptfmt.demo.training", run_dir, "--steps", str(steps), *args]


def run_child(
    run_dir: str,
    steps: int,
    args: Sequence[str] = (),
    *,
    kill_after: int | None = None,
    timeout: float = 300.0,
) -> ChildRun:
    """Run training in a fresh process; with `kill_after`, SIGKILL it once it reports that step.

    The kill comes from outside, at whatever point the child has reached by then (it may
    be inside the next step or the middle of a save), as a crash or a pre-emption would.
    """
    out = ChildRun()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(
            child_command(run_dir, steps, args), stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        assert proc.stdout is not None
        out.pid = proc.pid
        try:
            for line in proc.stdout:
                _parse_line(line, out)
                if kill_after is not None and out.losses and max(out.losses) >= kill_after:
                    os.kill(proc.pid, signal.SIGKILL)
                    out.killed_after = max(out.losses)
                    break
            out.returncode = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        finally:
            if proc.poll() is None:  # a timeout, or an error here: leave no child behind
                proc.kill()
                proc.wait()
            proc.stdout.close()
        err.seek(0)
        out.stderr = err.read()
    out.seconds = time.monotonic() - start
    return out


def _parse_line(line: str, out: ChildRun) -> None:
    words = line.split()
    if len(words) == 4 and words[0] == "step" and words[2] == "loss":
        out.losses[int(words[1])] = words[3]
    elif len(words) >= 4 and words[:3] == ["resumed", "from", "step"]:
        out.resumed_from = int(words[3])


# -- command line ------------------------------------------------------------------------


def _print_now(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--steps", type=int, required=True, help="train up to this step")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--non-blocking", action="store_true", help="save in the background")
    ap.add_argument("--kill-at", type=int, help="SIGKILL this process right after step K's save call returns")
    ap.add_argument("--stop-after", type=int, help="stop cleanly after this step")
    ap.add_argument("--final", help="write the final training state to this ckptfmt file")
    ap.add_argument("--archive", help="also copy every step to this s3:// URL (AWS_* environment)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (must match across a resume)")
    ap.add_argument("--no-restore-rng", action="store_true", help="resume without the RNG states (inexact)")
    ap.add_argument(
        "--no-restore-data", action="store_true", help="resume without the data position (inexact)"
    )
    args = ap.parse_args(argv)

    def kill_self(step: int) -> None:
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train(
        args.run_dir,
        args.steps,
        save_every=args.save_every,
        keep_last=args.keep_last,
        blocking=not args.non_blocking,
        stop_after=args.stop_after,
        log=_print_now,
        final_path=args.final,
        threads=args.threads,
        restore_rng=not args.no_restore_rng,
        restore_data=not args.no_restore_data,
        on_step=kill_self if args.kill_at is not None else None,
        archive=args.archive,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
