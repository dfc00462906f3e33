"""How each tool saves and loads the benchmark state, the way a user would do it.

Every save is durable: peers that do not fsync get an fsync added (noted in the
report). "load" materialises every tensor in memory and reads every byte of it; "lazy" (mmap without touching) is reported separately; "load_into" fills
tensors that already exist, as model.load_state_dict / optimizer.load_state_dict
would.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import ckptfmt


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir_of(path: str) -> None:
    fsync_path(os.path.dirname(os.path.abspath(path)))


def touch(obj: Any) -> int:
    """Read every byte of every tensor (forces mmapped data in and pays for reading it)."""
    total = 0
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            t = obj.detach()
            flat = (
                t.reshape(-1).view(torch.uint8)
                if t.is_contiguous()
                else t.contiguous().view(-1).view(torch.uint8)
            )
            a = flat.numpy()
            n8 = a.size // 8 * 8
            total += int(a[:n8].view(np.uint64).sum(dtype=np.uint64)) + int(a[n8:].sum())
    elif isinstance(obj, dict):
        for v in obj.values():
            total += touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            total += touch(v)
    return total


def copy_into(dst: Any, src: Any) -> None:
    """What load_state_dict does for our purposes: copy every tensor into the existing one."""
    if isinstance(dst, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            copy_into(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            copy_into(a, b)


def empty_like_state(obj: Any, device: str | None = None) -> Any:
    """The state with every tensor replaced by zeros like it (on `device`: default, its own)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj, device=device)
    if isinstance(obj, dict):
        return type(obj)((k, empty_like_state(v, device)) for k, v in obj.items())
    if isinstance(obj, list):
        return [empty_like_state(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(empty_like_state(v, device) for v in obj)
    return obj


# -- safetensors: flatten the way a user has to ----------------------------------


def flatten_for_safetensors(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}

    def walk(o: Any, key: str) -> None:
        if isinstance(o, torch.Tensor):
            ident = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape))
            if ident in seen:  # safetensors refuses tensors that share memory: keep one
                aliases[key] = seen[ident]
                return
            seen[ident] = key
            tensors[key] = o.contiguous()
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            extras[key] = repr(o)  # non-tensor values go into the string metadata

    walk(state, "")
    return tensors, {"extras": json.dumps(extras)[:1_000_000], "aliases": json.dumps(aliases)}


# -- the tools ------------------------------------------------------------------


class Tool:
    name = ""
    note = ""
    ops: tuple[str, ...] = ("save", "load", "load_into")

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"state.{self.name}")

    def save(self, state: Any, path: str) -> None:
        raise NotImplementedError

    def load(self, path: str) -> Any:
        raise NotImplementedError

    def load_into(self, path: str, template: Any) -> None:
        copy_into(template, self.load(path))

    def size(self, path: str) -> int:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        return os.path.getsize(path)

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)


class Ckptfmt(Tool):
    name = "ckptfmt"
    note = (
        "ckptfmt.save (fsync + atomic rename built in); load, load(mmap=True) and load_into verify every "
        "chunk; lazy = load(mmap=True, verify=False)"
    )
    ops = ("save", "load", "load_mmap", "lazy", "load_into", "verify")
    compression: str | None = None

    def save(self, state: Any, path: str) -> None:
        ckptfmt.save(state, path, compression=self.compression)

    def load(self, path: str) -> Any:
        out = ckptfmt.load(path)
        touch(out)
        return out

    def load_mmap(self, path: str) -> Any:
        out = ckptfmt.load(path, mmap=True)
        touch(out)
        return out

    def lazy(self, path: str) -> Any:
        return ckptfmt.load(path, mmap=True, verify=False)

    def load_into(self, path: str, template: Any) -> None:
        ckptfmt.load_into(path, template)

    def verify(self, path: str) -> None:
        report = ckptfmt.verify(path)
        if not report.ok:
            raise RuntimeError(f"verify failed: {report.problems[:3]}")


class CkptfmtZstd(Ckptfmt):
    name = "ckptfmt-zstd"
    note = "ckptfmt.save(compression='zstd'), level 1 with byte-shuffle"
    ops = ("save", "load", "verify")
    compression = "zstd"


class TorchSave(Tool):
    name = "torch"
    note = "torch.save + fsync added; torch.load(weights_only=True)"
    ops = ("save", "load", "load_mmap", "lazy", "load_into")

    def save(self, state: Any, path: str) -> None:
        torch.save(state, path)
        fsync_path(path)

    def load(self, path: str) -> Any:
        out = torch.load(path, weights_only=True)
        touch(out)
        return out

    def load_mmap(self, path: str) -> Any:
        out = torch.load(path, weights_only=True, mmap=True)
        touch(out)
        return out

    def lazy(self, path: str) -> Any:
        return torch.load(path, weights_only=True, mmap=True)


class Safetensors(Tool):
    name = "safetensors"
    note = "save_file on the flattened state (shared tensors deduplicated, non-tensors as JSON metadata) + fsync added"
    ops = ("save", "load", "lazy", "load_into")

    def save(self, state: Any, path: str) -> None:
        from safetensors.torch import save_file

        tensors, meta = flatten_for_safetensors(state)
        save_file(tensors, path, metadata=meta)
        fsync_path(path)

    def load(self, path: str) -> Any:
        from safetensors.torch import load_file

        out = load_file(path)
        touch(out)
        return out

    def lazy(self, path: str) -> Any:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return list(f.keys())

    def load_into(self, path: str, template: Any) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        flat = load_file(path)
        with safe_open(path, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        tensors, _ = flatten_for_safetensors(template)
        for k, t in tensors.items():
            with torch.no_grad():
                t.copy_(flat[k] if k in flat else flat[aliases[k]])


class DCP(Tool):
    name = "dcp"
    note = "torch.distributed.checkpoint FileSystemWriter/Reader, thread_count = cores, sync_files=True; loads in place only, so 'load' includes allocating the template"
    ops = ("save", "load", "load_into")

    def save(self, state: Any, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path, thread_count=os.cpu_count() or 1, sync_files=True),
        )

    def load_into(self, path: str, template: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(template, storage_reader=dcp.FileSystemReader(path))

    def load(self, path: str) -> Any:
        raise NotImplementedError  # needs a template: handled by the worker


TOOLS: dict[str, Callable[[], Tool]] = {
    "ckptfmt": Ckptfmt,
    "ckptfmt-zstd": CkptfmtZstd,
    "torch": TorchSave,
    "safetensors": Safetensors,
    "dcp": DCP,
}


def available() -> list[str]:
    names = ["ckptfmt", "ckptfmt-zstd", "torch"]
    try:
        import safetensors  # noqa: F401

        names.append("safetensors")
    except ImportError:
        pass
    try:
        import torch.distributed.checkpoint  # noqa: F401

        names.append("dcp")
    except ImportError:
        pass
    return names
