"""Check and time ckptfmt's accelerator paths end to end, on this machine's accelerator.

    python bench/gpu_check.py                      # torch.accelerator's device (CUDA, XPU, ...), 256 MiB
    python bench/gpu_check.py --size 4G --dir /mnt/nvme/tmp
    python bench/gpu_check.py --npu --size 16M     # no GPU: the npu test backend of tests/npu

Every check saves or loads a state made of random bits (float32, bfloat16, int64,
uint8, bool, views that share storage, a CPU `step` among device tensors) and
compares what comes back with the CPU state it was made from, bit for bit, devices
included.  One line per check: its name, ok or FAIL, the seconds it took and the
GB/s that makes over the state's bytes.  The non-blocking saves overwrite their
source on the device (a kernel queued right after save() returns) and must still
hold the values at call time.

Exit status: 1 when any check fails, 0 when all pass; 0 too, after saying so, when
there is no accelerator and --npu was not given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout: this ckptfmt, not an installed one

import ckptfmt  # noqa: E402
from ckptfmt.background import staging  # noqa: E402

sys.path.insert(0, HERE)

from common import parse_size  # noqa: E402

# -- states ---------------------------------------------------------------------------------


def random_bits(nbytes: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def make_state(size: int, seed: int = 0) -> dict[str, Any]:
    """A training-like CPU state of about `size` bytes, all of it random bits (NaN payloads and all)."""
    g = torch.Generator().manual_seed(seed)
    cols = 1024

    def floats(share: float, dtype: torch.dtype) -> torch.Tensor:
        width = torch.empty(0, dtype=dtype).element_size()
        rows = max(1, int(size * share) // (cols * width))
        return random_bits(rows * cols * width, g).view(dtype).view(rows, cols)

    w = floats(0.35, torch.float32)
    state: dict[str, Any] = {
        "model": {
            "w": w,
            "w_t": w.t(),  # a view: the file holds the storage once, and the load shares it again
            "w_row": w[w.shape[0] // 2],
            "emb": floats(0.15, torch.bfloat16),
            "ids": floats(0.05, torch.int64).flatten(),
            "mask": (random_bits(max(1, size // 100), g) & 1).bool(),
        },
        "opt": {
            i: {"step": torch.tensor(float(i + 1)), "exp_avg": floats(0.1, torch.float32).flatten()}
            for i in range(3)
        },
        "bytes": random_bits(max(1, size // 20), g),
        "epoch": 3,
    }
    return state


def tensors(obj: Any, key: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{key}.{i}")


def moved(state: Any, where: Callable[[str], str]) -> Any:
    """A copy of `state` with each tensor on `where(key)`; tensors that share a storage still do."""
    storages: dict[tuple[int, str], torch.UntypedStorage] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            dev = torch.device(where(key))
            src = obj.untyped_storage()
            k = (src.data_ptr(), str(dev))
            if k not in storages:
                flat = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)  # type: ignore[call-overload]
                storages[k] = flat.to(dev, copy=True).untyped_storage()
            out = torch.empty(0, dtype=obj.dtype, device=dev)
            return out.set_(storages[k], obj.storage_offset(), obj.shape, obj.stride())  # type: ignore[call-overload]
        if isinstance(obj, dict):
            return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{key}.{i}") for i, v in enumerate(obj))
        return obj

    return walk(state, "")


def nbytes(state: Any) -> int:
    seen = {}
    for _, t in tensors(state):
        s = t.untyped_storage()
        seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def differences(want: Any, got: Any, where: Callable[[str], str] | None = None) -> list[str]:
    """What differs between two states, bit for bit (and the devices, when `where` is given)."""
    a, b = dict(tensors(want)), dict(tensors(got))
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}"]
    out = []
    for k, x in a.items():
        y = b[k]
        if where is not None and y.device != torch.device(where(k)):
            out.append(f"{k} is on {y.device}, expected {where(k)}")
        elif x.dtype != y.dtype or x.shape != y.shape or x.stride() != y.stride():
            out.append(f"{k}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(_bits(x), _bits(y.cpu())):
            out.append(f"{k}: bytes differ")
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def overwrite(state: Any) -> None:
    """Flip every bit of every device storage of `state`, on its device (twice restores it)."""
    seen = set()
    for _, t in tensors(state):
        s = t.untyped_storage()
        if s.device.type != "cpu" and (str(s.device), s.data_ptr()) not in seen:
            seen.add((str(s.device), s.data_ptr()))
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).bitwise_not_()  # type: ignore[call-overload]


# -- running checks -------------------------------------------------------------------------


class Checks:
    def __init__(self, device_bytes: int) -> None:
        self.failed = 0
        self.bytes = device_bytes

    def run(
        self,
        name: str,
        fn: Callable[[], tuple[float, list[str]] | tuple[float, list[str], str]],
        nbytes: int | None = None,
    ) -> None:
        try:
            result = fn()
            secs, problems = result[0], result[1]
            note = result[2] if len(result) > 2 else ""  # type: ignore[misc]
        except Exception as e:  # a crash is a failed check; the others still run
            secs, problems, note = float("nan"), [f"{type(e).__name__}: {e}"], ""
            traceback.print_exc(limit=4)
        ok = not problems
        self.failed += not ok
        moved_bytes = self.bytes if nbytes is None else nbytes
        rate = moved_bytes / secs / 1e9 if secs == secs and secs > 0 else float("nan")
        line = f"{name:<52} {'ok' if ok else 'FAIL':<4} {secs:8.3f} s {rate:8.2f} GB/s"
        if note:
            line += f"  {note}"
        print(line, flush=True)
        for p in problems[:8]:
            print(f"    {p}", flush=True)


def synchronize_all() -> None:
    for i in range(torch.accelerator.device_count()):
        torch.accelerator.synchronize(i)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    synchronize_all()
    t = time.perf_counter()
    out = fn()
    synchronize_all()
    return time.perf_counter() - t, out


def run_checks(kind: str, size: int, folder: str, index: int, compression: str | None) -> int:
    count = torch.accelerator.device_count()
    dev = f"{kind}:{index}"
    last = f"{kind}:{count - 1}"
    torch.accelerator.set_device_index(index)
    ref = make_state(size)
    on_dev = moved(ref, lambda k: dev)
    total = nbytes(ref)
    print(
        f"gpu_check: {count} {kind} device(s), checking on {dev}; state {total / 2**20:.1f} MiB; "
        f"files in {folder}; compression {compression or 'none'}; engine {ckptfmt.backend()}",
        flush=True,
    )
    checks = Checks(total)
    p = os.path.join(folder, "state.ckpt")

    def path(name: str) -> str:
        return os.path.join(folder, name)

    def save_blocking() -> tuple[float, list[str]]:
        secs, _ = timed(lambda: ckptfmt.save(on_dev, p, compression=compression))
        with ckptfmt.open(p) as r:
            if r.source_devices != [dev]:
                return secs, [f"source_devices {r.source_devices}"]
        return secs, differences(ref, ckptfmt.load(p), lambda k: "cpu")

    checks.run(f"save from {dev} (blocking)", save_blocking)

    def load_to(map_location: Any, where: Callable[[str], str]) -> Callable[[], tuple[float, list[str]]]:
        def check() -> tuple[float, list[str]]:
            secs, out = timed(lambda: ckptfmt.load(p, map_location=map_location))
            return secs, differences(ref, out, where)

        return check

    checks.run(f"load map_location={dev!r}", load_to(dev, lambda k: dev))
    checks.run("load map_location='cpu'", load_to("cpu", lambda k: "cpu"))
    checks.run("load saved locations (callable)", load_to(lambda s, loc: None, lambda k: dev))
    if count > 1:
        checks.run(f"load map_location={{{dev!r}: {last!r}}}", load_to({dev: last}, lambda k: last))

    budget = max(4 << 20, size // 16)

    def streamed() -> tuple[float, list[str], str]:
        saved = staging.POOL.limit
        ckptfmt.configure_staging(budget)
        try:
            secs, problems = load_to(last, lambda k: last)()
        finally:
            ckptfmt.configure_staging(saved)
        return secs, problems, f"(staging budget {budget >> 20} MiB)"

    checks.run(f"load streamed onto {last}, small budget", streamed)

    def save_nonblocking(state: Any, want: Any, name: str) -> tuple[float, list[str], str]:
        synchronize_all()
        t = time.perf_counter()
        h = ckptfmt.save(state, path(name), blocking=False, compression=compression)
        snap = time.perf_counter() - t
        overwrite(state)  # queued after the snapshot's copies: the file must not see it
        h.wait()
        secs = time.perf_counter() - t
        overwrite(state)  # back to the reference values
        problems = differences(want, ckptfmt.load(path(name)), lambda k: "cpu")
        if staging.POOL.in_use:
            problems.append(f"{staging.POOL.in_use} bytes of staging slabs not returned")
        return secs, problems, f"(save() returned after {snap:.3f} s)"

    checks.run(
        f"save from {dev} (blocking=False), then overwrite", lambda: save_nonblocking(on_dev, ref, "nb.ckpt")
    )

    def mixed_where(k: str) -> str:
        return "cpu" if k.endswith("step") or k == "bytes" else (last if k.startswith("opt") else dev)

    mixed = moved(ref, mixed_where)
    name = f"save cpu+{dev}" + (f"+{last}" if count > 1 else "") + " (blocking=False)"
    checks.run(name, lambda: save_nonblocking(mixed, ref, "mixed.ckpt"))

    def mixed_back() -> tuple[float, list[str]]:
        secs, out = timed(lambda: ckptfmt.load(path("mixed.ckpt"), map_location=lambda s, loc: None))
        return secs, differences(ref, out, mixed_where)

    checks.run("load mixed state to its saved devices", mixed_back)

    busy_n = 2048 if kind != "npu" else 128

    def behind_busy_stream() -> tuple[float, list[str]]:
        """The source is produced at the end of a long queue of kernels on the last device, which
        is not the current one: the snapshot's copy must wait for them (test_nonblocking.py)."""
        src = torch.device(last)
        g = torch.Generator().manual_seed(1)
        n = busy_n
        busy = torch.randn(n, n, generator=g).to(src)
        synchronize_all()
        for _ in range(200 if kind != "npu" else 3):  # tens of milliseconds of kernels on a GPU
            busy = torch.tanh(busy @ busy / (n**0.5))
        state = {"y": busy.flatten().clone(), "host": torch.arange(10)}
        t = time.perf_counter()
        ckptfmt.save(state, path("busy.ckpt"), blocking=False).wait()
        secs = time.perf_counter() - t
        want = {"y": state["y"].cpu(), "host": state["host"]}
        return secs, differences(want, ckptfmt.load(path("busy.ckpt")))

    checks.run(f"save behind a busy stream on {last}", behind_busy_stream, busy_n * busy_n * 4)

    def load_into() -> tuple[float, list[str]]:
        targets = moved(ref, lambda k: last)
        overwrite(targets)
        ptrs = {k: t.data_ptr() for k, t in tensors(targets)}
        secs, _ = timed(lambda: ckptfmt.load_into(p, targets))
        problems = differences(ref, targets, lambda k: last)
        moved_away = [k for k, t in tensors(targets) if t.data_ptr() != ptrs[k]]
        return secs, problems + [f"{k} was replaced, not filled" for k in moved_away]

    checks.run(f"load_into targets on {last}", load_into)

    def manager() -> tuple[float, list[str]]:
        run_dir = path("run")
        mgr = ckptfmt.CheckpointManager(run_dir, blocking=False)
        t = time.perf_counter()
        h = mgr.save(1, {"state": on_dev})
        overwrite(on_dev)
        assert h is not None
        h.wait()
        mgr.wait()
        overwrite(on_dev)
        targets = {"state": moved(ref, lambda k: dev)}
        overwrite(targets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
            mgr.load_into(targets, restore_rng=False)
        secs = time.perf_counter() - t
        shutil.rmtree(run_dir, ignore_errors=True)
        return secs, differences(ref, targets["state"], lambda k: dev)

    checks.run("CheckpointManager save (blocking=False) + load_into", manager)
    print(f"gpu_check: {'all checks passed' if not checks.failed else f'{checks.failed} check(s) FAILED'}")
    return 1 if checks.failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--size", default=None, help="bytes of state, e.g. 64M, 4G (default 256M, 16M with --npu)"
    )
    ap.add_argument("--dir", default=None, help="where to write files (default: a temporary directory)")
    ap.add_argument("--device", type=int, default=0, help="the device index to check on (default 0)")
    ap.add_argument("--compression", choices=["none", "zstd"], default="none")
    ap.add_argument(
        "--npu",
        action="store_true",
        help="use the npu test backend (tests/npu, built with torch.utils.cpp_extension) as the accelerator",
    )
    args = ap.parse_args(argv)
    if args.npu:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import npu  # type: ignore[import-not-found]

        try:
            npu.load()
        except Exception as e:
            print(f"gpu_check: the npu test backend is not available: {e}", file=sys.stderr)
            return 2
        npu.set_delay(200e-6)  # every asynchronous copy lands late: a missing fence shows
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None:
        print(
            "gpu_check: no accelerator available (torch.accelerator.is_available() is False); nothing to check."
        )
        print("gpu_check: run with --npu to check the paths on the npu test backend instead.")
        return 0
    if not 0 <= args.device < torch.accelerator.device_count():
        print(f"gpu_check: there is no {acc.type}:{args.device}", file=sys.stderr)
        return 2
    size = parse_size(args.size or ("16M" if args.npu else "256M"))
    folder = tempfile.mkdtemp(prefix="ckptfmt-gpu-check-", dir=args.dir)
    try:
        return run_checks(acc.type, size, folder, args.device, None if args.compression == "none" else "zstd")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
