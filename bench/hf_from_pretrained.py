"""What keeping a Hugging Face checkpoint's weights in the layout ``from_pretrained`` reads
would cost, against today's ``checkpoint-N`` folders (``model.ckpt`` only, read by
``from_pretrained`` through ``ckptfmt.integrations.transformers.enable()``).

One GPT-2 (random weights, float32) and its AdamW state after one step; per save, the median
of `--repeats` runs of: ``model.ckpt`` (ckptfmt.save, blocking, fsynced), a
``model.safetensors`` beside it (safetensors.torch.save_file, then fsync: a commit record
would have to cover it, so it must be durable before the record), and the whole folder's
ckptfmt files.  Usage::

    PYTHONPATH=. python bench/hf_from_pretrained.py [--layers 6] [--width 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def _timed(write: Callable[[str], None], path: str, repeats: int) -> tuple[float, int]:
    times = []
    for _ in range(repeats):
        if os.path.exists(path):
            os.unlink(path)
        start = time.perf_counter()
        write(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times), os.path.getsize(path)


def _fsynced_safetensors(state: dict[str, torch.Tensor]) -> Callable[[str], None]:
    from safetensors.torch import save_file

    def write(path: str) -> None:
        save_file(state, path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    import ckptfmt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=a.layers, n_embd=a.width, n_head=8, vocab_size=8192, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 8192, (2, 64)), labels=torch.randint(0, 8192, (2, 64))).loss.backward()
    optimizer.step()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    with tempfile.TemporaryDirectory(dir=".") as d:
        ckpt_s, ckpt_b = _timed(lambda p: ckptfmt.save(state, p), os.path.join(d, "model.ckpt"), a.repeats)
        opt_s, opt_b = _timed(
            lambda p: ckptfmt.save(optimizer.state_dict(), p), os.path.join(d, "optimizer.ckpt"), a.repeats
        )
        st_s, st_b = _timed(_fsynced_safetensors(state), os.path.join(d, "model.safetensors"), a.repeats)
    params = sum(v.numel() for v in state.values())
    folder_b, folder_s = ckpt_b + opt_b, ckpt_s + opt_s
    print(f"GPT-2 {a.layers}x{a.width}: {params / 1e6:.1f}M parameters, median of {a.repeats}")
    print(f"  model.ckpt         {ckpt_b / 1e6:8.1f} MB  {ckpt_s * 1e3:7.1f} ms")
    print(f"  optimizer.ckpt     {opt_b / 1e6:8.1f} MB  {opt_s * 1e3:7.1f} ms")
    print(f"  model.safetensors  {st_b / 1e6:8.1f} MB  {st_s * 1e3:7.1f} ms  (fsynced)")
    print(
        f"  safetensors beside model.ckpt: +{st_b / folder_b:.0%} bytes, +{st_s / folder_s:.0%} save time "
        "of the folder's ckptfmt files"
    )


if __name__ == "__main__":
    main()
