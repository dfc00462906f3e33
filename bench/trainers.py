"""Trainer checkpointing: Lightning's and the Hugging Face Trainer's own saves against ckptfmt's.

    python bench/trainers.py                       # both trainers, 5 rounds (about 5 minutes on 2 cores)
    python bench/trainers.py --trainers hf --rounds 3 --every 4

A GPT-2-shaped model (random weights from a config; 6 layers, width 384,
vocabulary 8192: 13.8M parameters, a 158 MiB checkpoint with AdamW's moments)
trains on CPU, on half the cores by default (the others stand for the host
cores an accelerator leaves free), with a checkpoint every N steps.  Each
checkpoint is made by one of five methods, in turn, in the same training run
(so every method meets the same machine load, round after round):

* ``none``: no checkpoint (the baseline);
* ``stock``: the trainer's own checkpointing (torch.save / safetensors; no fsync);
* ``stock+fsync``: the same, plus an fsync of what it wrote (what a durable
  save costs that way);
* ``ckptfmt``: ckptfmt, blocking (every file fsync'd, then the commit);
* ``ckptfmt-nb``: ckptfmt, non-blocking (the loop waits for the snapshot only).

Measured per method: the stall (the trainer's whole save call, during which
training is stopped) and the segment: from the start of the save to the start
of the next one, i.e. the save plus the N training steps after it (during
which a non-blocking save is written) plus any wait for that write to finish.
Steps per second are N / segment; "vs no checkpoint" is the ratio of segment
times to the ``none`` segment of the same round, median over rounds.  Writes
results/trainers.json and results/trainers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import fsync_tree, machine_state, tree_size  # noqa: E402

METHODS = ("none", "stock", "stock+fsync", "ckptfmt", "ckptfmt-nb")
BATCH = 4
MODEL = "GPT-2 shape, 6 layers, width 384, vocabulary 8192 (13.8M parameters, fp32, AdamW)"


def _model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=64, n_embd=384, n_layer=6, n_head=6))


def _dataset(n: int) -> Any:
    import torch

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.data = torch.randint(0, 8192, (n, 64), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.data[i], "labels": self.data[i]}

    return Tokens()


class Schedule:
    """Runs each save event with the next method and times stalls and segments.

    `save(method, target)` does the save; `settle()` waits for background work;
    `target` is where the save writes (removed before the next save, untimed).
    """

    def __init__(self, rounds: int) -> None:
        self.plan = ["warm-up", *(list(METHODS) * rounds), "end"]
        self.index = 0
        self.stalls: dict[str, list[float]] = {m: [] for m in METHODS}
        self.segments: dict[str, list[float]] = {m: [] for m in METHODS}
        self.sizes: dict[str, int] = {}
        self.start = 0.0
        self.previous: tuple[str, str] | None = None

    @property
    def events(self) -> int:
        return len(self.plan)

    def event(self, target: str, save: Any, settle: Any) -> None:
        settle()  # a non-blocking save's remaining work belongs to its segment
        now = time.perf_counter()
        if self.previous is not None:
            method, written = self.previous
            if method in self.segments:
                self.segments[method].append(now - self.start)
            if os.path.exists(written):
                self.sizes.setdefault(method, tree_size(written))
                shutil.rmtree(written) if os.path.isdir(written) else os.unlink(written)
        method = self.plan[min(self.index, len(self.plan) - 1)]
        self.index += 1
        self.start = time.perf_counter()
        if method in METHODS and method != "none":
            save(method)
            if method == "stock+fsync":
                fsync_tree(target)
            self.stalls[method].append(time.perf_counter() - self.start)
        self.previous = (method, target)

    def result(self) -> dict[str, Any]:
        return {"stalls": self.stalls, "segments": self.segments, "sizes": self.sizes}


def run_hf(out: str, every: int, rounds: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    hf_logging.set_verbosity_error()
    schedule = Schedule(rounds)
    steps = every * schedule.events
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=every,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    model = _model()
    ours = CkptfmtTrainer(model=model, args=args, train_dataset=_dataset(BATCH * steps))
    stock = Trainer(model=model, args=args)
    ours_save = ours._save_checkpoint

    def save(method: str, model: Any, trial: Any) -> None:
        if method.startswith("stock"):
            stock.state, stock.optimizer, stock.lr_scheduler = ours.state, ours.optimizer, ours.lr_scheduler
            stock._save_checkpoint(model, trial)
        else:
            ours.ckptfmt_blocking = method == "ckptfmt"
            ours_save(model, trial)

    def hook(model: Any, trial: Any) -> None:
        target = os.path.join(out, f"checkpoint-{ours.state.global_step}")
        schedule.event(target, lambda m: save(m, model, trial), ours.wait_for_checkpoints)

    ours._save_checkpoint = hook
    ours.train()
    return schedule.result()


def run_lightning(out: str, every: int, rounds: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.utils.data import DataLoader

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = _model()

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return self.lm(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    schedule = Schedule(rounds)
    steps = every * schedule.events
    io = {
        "stock": TorchCheckpointIO(),
        "ckptfmt": CkptfmtCheckpointIO(),
        "nb": CkptfmtCheckpointIO(blocking=False),
    }
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        plugins=[io["ckptfmt"]],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    inner = trainer.save_checkpoint

    def save(method: str, filepath: str, *a: Any, **k: Any) -> None:
        key = "stock" if method.startswith("stock") else ("ckptfmt" if method == "ckptfmt" else "nb")
        trainer.strategy.checkpoint_io = io[key]
        inner(filepath, *a, **k)

    def hook(filepath: str, *a: Any, **k: Any) -> None:
        schedule.event(filepath, lambda m: save(m, filepath, *a, **k), io["nb"].wait)

    trainer.save_checkpoint = hook  # type: ignore[method-assign]
    trainer.fit(LM(), DataLoader(_dataset(BATCH * steps), batch_size=BATCH, shuffle=True))
    return schedule.result()


def child(argv: list[str]) -> None:
    trainer, out, every, rounds, threads, result_path = argv
    import warnings

    import torch

    torch.set_num_threads(int(threads))
    warnings.filterwarnings("ignore")
    runner = run_hf if trainer == "hf" else run_lightning
    result = runner(out, int(every), int(rounds))
    with open(result_path, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------
# the driver


def _run(trainer: str, work: str, every: int, rounds: int, threads: int) -> dict[str, Any]:
    out = os.path.join(work, trainer)
    result_path = os.path.join(work, f"{trainer}.json")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, os.path.abspath(__file__), "--child", trainer, out, str(every), str(rounds)]
    proc = subprocess.run([*cmd, str(threads), result_path], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{trainer} failed:\n{proc.stderr[-4000:]}")
    with open(result_path) as f:
        result: dict[str, Any] = json.load(f)
    return result


def summarize(result: dict[str, Any], every: int) -> dict[str, dict[str, float]]:
    """Per method: stall median, min, max and first; measured steps/s (median, min, max over
    rounds); and steps/s derived from the stall: every / (every * t + stall), t being the
    median step time of the segments without a checkpoint."""
    step = statistics.median(result["segments"]["none"]) / every
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        segs = result["segments"][method]
        stalls = result["stalls"][method] or [0.0]
        rates = [every / s for s in segs]
        stall = statistics.median(stalls)
        out[method] = {
            "stall": stall,
            "stall_min": min(stalls),
            "stall_max": max(stalls),
            "first_stall": stalls[0],
            "steps_per_s": statistics.median(rates),
            "steps_per_s_min": min(rates),
            "steps_per_s_max": max(rates),
            "derived_steps_per_s": every / (every * step + stall),
            "derived_steps_per_s_50": 50 / (50 * step + stall),
            "size": result["sizes"].get(method, 0),
        }
    return out


LABELS = {
    "none": "no checkpoint",
    "stock": "the trainer's own (no fsync)",
    "stock+fsync": "the trainer's own + fsync",
    "ckptfmt": "**ckptfmt**, blocking",
    "ckptfmt-nb": "**ckptfmt**, non-blocking",
}


def report(results: dict[str, Any]) -> str:
    every = results["every"]
    lines = [
        f"# Trainer checkpoints: {MODEL}",
        "",
        f"A checkpoint every {every} steps (batch {BATCH} x 64 tokens), the five methods in turn in one "
        f"training run, {results['rounds']} rounds; {results['machine']}.",
        "",
        "* Stall: training stopped by a save (the trainer's whole save call), median (min-max); the "
        "first non-blocking save also allocates its staging memory, later ones reuse it.",
        f"* Measured steps/s: {every} / (the save, the {every} steps after it and, non-blocking, any wait "
        "for its write), median (min-max) over rounds.  On a shared machine the spread between rounds "
        "can exceed the cost of a save: read the stall and the derived columns first.",
        f"* Derived steps/s: n / (n x t + stall) for a save every n = {every} and n = 50 steps, t being "
        "the median step time without checkpoints.  It leaves out what a background write takes from "
        "training (here, CPU time on the same cores; with an accelerator, mostly host cores it leaves "
        "free).",
        "",
    ]
    for trainer, summary in results["summary"].items():
        name = {"hf": "Hugging Face Trainer", "lightning": "Lightning"}[trainer]
        lines += [
            f"## {name}",
            "",
            f"| method | checkpoint | stall (s) | first stall (s) | steps/s measured | "
            f"steps/s derived, every {every} | every 50 |",
            "|---|---|---|---|---|---|---|",
        ]
        for method in METHODS:
            s = summary[method]
            size = f"{s['size'] / 2**20:.0f} MiB" if s["size"] else ""
            if method == "none":
                stall = " | "
            else:
                stall = (
                    f"{s['stall']:.3f} ({s['stall_min']:.3f}-{s['stall_max']:.3f}) | {s['first_stall']:.3f}"
                )
            measured = f"{s['steps_per_s']:.2f} ({s['steps_per_s_min']:.2f}-{s['steps_per_s_max']:.2f})"
            derived = f"{s['derived_steps_per_s']:.2f} | {s['derived_steps_per_s_50']:.3f}"
            lines.append(f"| {LABELS[method]} | {size} | {stall} | {measured} | {derived} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default="hf,lightning")
    ap.add_argument("--every", type=int, default=5, help="training steps between checkpoints")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads for training (default: half the cores)",
    )
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir in /tmp)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--report-only", action="store_true", help="rewrite trainers.md from trainers.json")
    args = ap.parse_args()
    if args.report_only:
        with open(os.path.join(args.out, "trainers.json")) as f:
            saved = json.load(f)
        saved["summary"] = {t: summarize(raw, saved["every"]) for t, raw in saved["raw"].items()}
        text = report(saved)
        with open(os.path.join(args.out, "trainers.md"), "w") as f:
            f.write(text + "\n")
        print(text)
        return
    work = tempfile.mkdtemp(prefix="ckptfmt-bench-trainers-", dir=args.dir)
    results: dict[str, Any] = {
        "model": MODEL,
        "every": args.every,
        "rounds": args.rounds,
        "machine": f"{os.cpu_count()} cores ({args.threads} torch threads for training), "
        f"{platform.machine()}, python {platform.python_version()}",
        "machine_state": machine_state({"work": args.dir or tempfile.gettempdir()}),
        "raw": {},
        "summary": {},
    }
    try:
        for trainer in args.trainers.split(","):
            raw = _run(trainer, work, args.every, args.rounds, args.threads)
            results["raw"][trainer] = raw
            results["summary"][trainer] = summarize(raw, args.every)
            print(trainer, json.dumps(results["summary"][trainer]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "trainers.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results)
    with open(os.path.join(args.out, "trainers.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
