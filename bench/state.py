"""Realistic training states for the benchmark: a GPT-like model and its AdamW state.

The model has a token embedding tied to the output head, attention and MLP
linears and layer norms; its weights are drawn like trained ones (normal, std
0.02), and AdamW runs a few real steps so the moments are real too. The state
also holds the torch and Python RNG states and step counters. (numpy's RNG
state is left out: torch.load(weights_only=True) refuses it, and every peer
must be able to load the same state.)
"""

from __future__ import annotations

import random
from typing import Any

import torch
from common import walk_tensors


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def shape_for(total_bytes: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(vocab, width, layers) so that parameters plus two AdamW moments fill total_bytes."""
    itemsize = torch.finfo(dtype).bits // 8
    params = total_bytes // (3 * itemsize)
    vocab = 8192 if params >= 4_000_000 else 1024
    d = 64
    while 12 * (2 * d) ** 2 * 4 + vocab * 2 * d <= params and d < 4096:
        d *= 2
    layers = max(1, (params - vocab * d) // (12 * d * d))
    return vocab, d, int(layers)


def build(total_bytes: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[dict[str, Any], GPT]:
    torch.manual_seed(seed)
    random.seed(seed)
    vocab, d, layers = shape_for(total_bytes, dtype)
    model = GPT(vocab, d, layers).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    for _ in range(2):
        idx = torch.randint(0, vocab, (1, 8))
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "step": 2,
        "tokens_seen": 16,
    }
    return state, model


def tensor_bytes(obj: Any) -> int:
    """Bytes of distinct storages in a state (tied weights counted once)."""
    return sum(t.untyped_storage().nbytes() for t in tensors(obj))


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a state, one per distinct storage (tied weights once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in walk_tensors(obj):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())
