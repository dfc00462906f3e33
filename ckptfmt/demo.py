"""The main job: save, verify and resume a realistic training state, with timings.

    python -m ckptfmt.demo [--dir DIR] [--layers N] [--width D]

Builds a small GPT-like model (token embedding tied to the output head, attention
and MLP blocks, layer norms), trains it a few AdamW steps, then saves the whole
training state (model, optimizer, LR scheduler, grad scaler, every RNG) with and
without compression, verifies the files, loads them back, checks the resumed run
continues bit-identically, and prints sizes and timings next to torch.save.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Any

import numpy as np
import torch

import ckptfmt


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int = 8) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(128, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        torch.nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def train_steps(model: TinyGPT, opt: torch.optim.Optimizer, sched: object, steps: int, vocab: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        idx = torch.randint(0, vocab, (4, 32))
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
    return float(loss.detach())


def make_run(vocab: int, d: int, layers: int) -> tuple[TinyGPT, torch.optim.AdamW, object, object]:
    model = TinyGPT(vocab, d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, scaler


def training_state(
    model: TinyGPT, opt: torch.optim.Optimizer, sched: object, scaler: object, step: int
) -> dict:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),  # type: ignore[attr-defined]
        "scaler": scaler.state_dict(),  # type: ignore[attr-defined]
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "step": step,
    }


def restore(state: dict, vocab: int, d: int, layers: int) -> tuple[TinyGPT, torch.optim.AdamW, object]:
    model, opt, sched, scaler = make_run(vocab, d, layers)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])  # type: ignore[attr-defined]
    scaler.load_state_dict(state["scaler"])  # type: ignore[attr-defined]
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return model, opt, sched


def _timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to write the files (default: a temp dir under the current one)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    vocab, d, layers = args.vocab, args.width, args.layers

    model, opt, sched, scaler = make_run(vocab, d, layers)
    loss = train_steps(model, opt, sched, 3, vocab)
    state = training_state(model, opt, sched, scaler, step=3)
    n_params = sum(p.numel() for p in model.parameters())
    tensor_bytes = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(state)}.values()
    )
    print(
        f"ckptfmt {ckptfmt.__version__}: TinyGPT with {n_params / 1e6:.1f}M parameters, "
        f"AdamW state, scheduler, scaler, RNG states; loss after 3 steps {loss:.4f}"
    )
    print(f"state holds {_mib(tensor_bytes)} of tensors\n")

    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="ckptfmt-demo-") as tmp:
        raw_p, z_p, pt_p = (os.path.join(tmp, n) for n in ("state.ckpt", "state.zstd.ckpt", "state.pt"))
        _, t_save = _timed(ckptfmt.save, state, raw_p, metadata={"run": "demo", "step": "3"})
        _, t_zsave = _timed(ckptfmt.save, state, z_p, compression="zstd")
        _, t_ptsave = _timed(_torch_save_durable, state, pt_p)
        report, t_verify = _timed(ckptfmt.verify, raw_p)
        zreport = ckptfmt.verify(z_p)
        loaded, t_load = _timed(ckptfmt.load, raw_p)
        zloaded, t_zload = _timed(ckptfmt.load, z_p)
        try:
            _, t_ptload = _timed(torch.load, pt_p, weights_only=True)
            pt_note = "torch.load(weights_only=True)"
        except Exception as e:  # the numpy RNG state is not on torch's allow-list
            _, t_ptload = _timed(torch.load, pt_p, weights_only=False)
            pt_note = (
                f"torch.load(weights_only=True) refuses this state ({type(e).__name__}); "
                "timed with weights_only=False, which runs pickle"
            )

        print(f"{'':26}{'size':>12}{'save':>10}{'load':>10}")
        print(f"{'ckptfmt (raw)':26}{_mib(os.path.getsize(raw_p))}{t_save:9.2f}s{t_load:9.2f}s")
        print(f"{'ckptfmt (zstd+shuffle)':26}{_mib(os.path.getsize(z_p))}{t_zsave:9.2f}s{t_zload:9.2f}s")
        print(f"{'torch.save + fsync':26}{_mib(os.path.getsize(pt_p))}{t_ptsave:9.2f}s{t_ptload:9.2f}s")
        print(f"  ({pt_note})")
        print(
            f"\nverify {os.path.basename(raw_p)}: {'OK' if report.ok else report.problems} "
            f"({report.chunks} chunks, {t_verify:.2f}s); zstd file: {'OK' if zreport.ok else zreport.problems}"
        )
        with ckptfmt.open(raw_p) as r:
            print(f"open(): keys {r.keys()}, metadata {r.metadata}, written by torch {r.producer['torch']}")

        # resume from each file and check training continues exactly as the original run
        torch.manual_seed(1)
        expect = train_steps(model, opt, sched, 2, vocab)
        for name, st in (("raw", loaded), ("zstd", zloaded)):
            m2, o2, s2 = restore(st, vocab, d, layers)  # type: ignore[arg-type]
            torch.manual_seed(1)
            got = train_steps(m2, o2, s2, 2, vocab)
            same = all(
                torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values())
            )
            print(
                f"resume from {name}: loss {got:.6f} vs {expect:.6f} uninterrupted; "
                f"weights {'identical' if same else 'DIFFER'}"
            )
            if not same or got != expect:
                return 1
        damaged = bytearray(open(raw_p, "rb").read())
        damaged[os.path.getsize(raw_p) // 3] ^= 0x10
        with open(raw_p, "wb") as f:
            f.write(damaged)
        bad = ckptfmt.verify(raw_p)
        print(f"after flipping one bit: verify finds {len(bad.problems)} problem(s): {bad.problems[0]}")
    return 0 if report.ok and zreport.ok else 1


def _torch_save_durable(state: object, path: str) -> None:
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    raise SystemExit(main())
