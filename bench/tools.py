"""How each tool saves the benchmark state, the way a user would do it.

Every save is durable: peers that do not fsync get an fsync added (noted in the
report).  Each tool imports its library when it is first used, so a measurement
process holds only the library it measures, and its prepare() imports everything its save
calls before the clock starts (every tool must define it).  Loads are bench/loads.py's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import common


def flatten_for_safetensors(state: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The flat name -> tensor dict safetensors takes; shared tensors kept once, the rest as metadata."""
    import torch

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


class Tool:
    name = ""
    note = ""
    suffix = ""

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"state.{self.suffix or self.name}")

    def prepare(self) -> None:
        """Import the save function and what it imports on first use, before the clock starts,
        so no tool's first timed save pays for its imports (as bench/loads.py does for loads).
        `import ckptfmt` imports the package alone and its save path on first use (about 20
        ms of CPU quiet, 30-60 ms of clock on the busy machine); `from safetensors.torch import
        save_file` imports its module whole (1.5 ms)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its save imports")

    def save(self, state: Any, path: str) -> None:
        raise NotImplementedError

    def size(self, path: str) -> int:
        return common.tree_size(path)

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)


class Ckptfmt(Tool):
    name = "ckptfmt"
    suffix = "ckpt"
    note = "ckptfmt.save (fsync + atomic rename built in); also non-blocking, staging pool warmed once"
    compression: str | None = None

    def prepare(self) -> None:
        from ckptfmt import save  # noqa: F401
        from ckptfmt.engine import bytesview  # noqa: F401  (the tensors' byte views, imported on first use)

    def save(self, state: Any, path: str) -> None:
        import ckptfmt

        ckptfmt.save(state, path, compression=self.compression)


class CkptfmtZstd(Ckptfmt):
    name = "ckptfmt-zstd"
    suffix = "zstd.ckpt"
    note = "ckptfmt.save(compression='zstd'), level 1 with byte-shuffle"
    compression = "zstd"


class CkptfmtOneThread(Ckptfmt):
    name = "ckptfmt-1thread"
    suffix = "1thread.ckpt"
    note = "ckptfmt.save with CKPTFMT_THREADS=1 (one engine thread: the thread count's effect)"

    def save(self, state: Any, path: str) -> None:
        os.environ["CKPTFMT_THREADS"] = "1"  # read by each engine call
        super().save(state, path)


class CkptfmtAllThreads(Ckptfmt):
    name = "ckptfmt-allthreads"
    suffix = "allthreads.ckpt"
    note = (
        "ckptfmt.save with CKPTFMT_THREADS = the cores (every engine thread writing, even to tmpfs, "
        "as before 2026-12-07: the one-writer choice's effect)"
    )

    def save(self, state: Any, path: str) -> None:
        os.environ["CKPTFMT_THREADS"] = str(os.cpu_count() or 1)  # read by each engine call
        super().save(state, path)


class CkptfmtHugePages(Ckptfmt):
    name = "ckptfmt-hugepages"
    suffix = "hugepages.ckpt"
    note = (
        "ckptfmt.save with CKPTFMT_HUGE_PAGES=on (a new tmpfs file given 2 MiB pages before it is "
        "written even where the host takes free 2 MiB blocks back, as on this VM)"
    )

    def save(self, state: Any, path: str) -> None:
        os.environ["CKPTFMT_HUGE_PAGES"] = "on"  # read by each save
        super().save(state, path)


class TorchSave(Tool):
    name = "torch"
    suffix = "pt"
    note = "torch.save + fsync added"

    def prepare(self) -> None:
        from torch.utils.serialization import config  # noqa: F401  (torch.save reads it on first use)

    def save(self, state: Any, path: str) -> None:
        import torch

        torch.save(state, path)
        common.fsync_path(path)


class Safetensors(Tool):
    name = "safetensors"
    note = "save_file on the flattened state (shared tensors deduplicated, non-tensors as JSON metadata) + fsync added"

    def prepare(self) -> None:
        import numpy.ctypeslib  # noqa: F401  (save_file views each tensor's bytes through it)
        from safetensors.torch import save_file  # noqa: F401

    def save(self, state: Any, path: str) -> None:
        from safetensors.torch import save_file

        tensors, meta = flatten_for_safetensors(state)
        save_file(tensors, path, metadata=meta)
        common.fsync_path(path)


class DCP(Tool):
    name = "dcp"
    note = "torch.distributed.checkpoint FileSystemWriter, thread_count = cores, sync_files=True"

    def prepare(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.utils.serialization import config  # noqa: F401  (read by its first save)

    def save(self, state: Any, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path, thread_count=os.cpu_count() or 1, sync_files=True),
        )


TOOLS: dict[str, Callable[[], Tool]] = {
    "ckptfmt": Ckptfmt,
    "ckptfmt-zstd": CkptfmtZstd,
    "ckptfmt-1thread": CkptfmtOneThread,
    "ckptfmt-allthreads": CkptfmtAllThreads,
    "ckptfmt-hugepages": CkptfmtHugePages,
    "torch": TorchSave,
    "safetensors": Safetensors,
    "dcp": DCP,
}
