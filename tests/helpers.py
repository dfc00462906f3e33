"""Shared test helpers: bit-exact deep comparison and generated states."""

from __future__ import annotations

import collections
import gc
import struct
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from ckptfmt.format import dtypes


def storage_bytes(t: torch.Tensor) -> bytes:
    s = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
    return bytes(flat.cpu().numpy())


class SameChecker:
    """Deep, bit-exact equality with types, strides and storage sharing."""

    def __init__(self, check_sharing: bool = True) -> None:
        self.pairs: dict[int, int] = {}
        self.reverse: dict[int, int] = {}
        self.check_sharing = check_sharing

    def __call__(self, a: Any, b: Any, path: str = "state") -> None:
        assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
        if isinstance(a, torch.Tensor):
            self.tensor(a, b, path)
        elif isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert a.tobytes(order="A") == b.tobytes(order="A"), path
            assert a.flags.f_contiguous == b.flags.f_contiguous, path
        elif isinstance(a, np.generic):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
        elif isinstance(a, float):
            assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
        elif isinstance(a, complex):
            self(a.real, b.real, path + ".real")
            self(a.imag, b.imag, path + ".imag")
        elif isinstance(a, dict):
            assert len(a) == len(b), f"{path}: {len(a)} keys != {len(b)}"
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):
                self(ka, kb, f"{path} key")
                self(va, vb, f"{path}[{ka!r}]")
            if isinstance(a, collections.OrderedDict):
                ma, mb = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
                assert (ma is None) == (mb is None), f"{path}._metadata"
                if ma is not None:
                    self(ma, mb, f"{path}._metadata")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
            for i, (x, y) in enumerate(zip(a, b)):
                self(x, y, f"{path}[{i}]")
        else:
            assert a == b, f"{path}: {a!r} != {b!r}"

    def tensor(self, a: torch.Tensor, b: torch.Tensor, path: str) -> None:
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert a.storage_offset() == b.storage_offset(), f"{path}: storage offset"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad"
        assert a.is_conj() == b.is_conj(), f"{path}: conj"
        assert storage_bytes(a) == storage_bytes(b), f"{path}: bytes differ"
        if not self.check_sharing:
            return
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
        if a.untyped_storage().nbytes() == 0:
            return
        assert self.pairs.setdefault(pa, pb) == pb, f"{path}: sharing not preserved"
        assert self.reverse.setdefault(pb, pa) == pa, f"{path}: storages merged that were separate"


def assert_same(a: Any, b: Any, check_sharing: bool = True) -> None:
    SameChecker(check_sharing)(a, b)


def read_bytes(path: str) -> bytearray:
    with open(path, "rb") as fh:
        return bytearray(fh.read())


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


_SMALL_FILES: dict[str, bytes] = {}


def small_file_bytes(name: str, **save_kw: Any) -> bytes:
    """The bytes of a small zstd file (3 storages, a few chunks) saved once per `name` with
    `save_kw` (a signing or encryption key): for tests that flip every bit of a file."""
    if name not in _SMALL_FILES:
        import os
        import tempfile

        import ckptfmt

        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "s.ckpt")
            s = {"w": torch.arange(3000, dtype=torch.float32), "z": torch.zeros(2000), "n": "x"}
            ckptfmt.save(s, p, compression="zstd", **save_kw)
            with open(p, "rb") as f:
                _SMALL_FILES[name] = f.read()
    return _SMALL_FILES[name]


def use_backend(monkeypatch: Any, backend: str) -> None:
    """Run the rest of a test on the engine `backend` ("c" or "python")."""
    if backend == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    else:
        monkeypatch.delenv("CKPTFMT_BACKEND", raising=False)


# -- hypothesis strategies --------------------------------------------------

ALL_DTYPES = sorted(dtypes.TORCH_DTYPES)
NUMPY_DTYPES = [
    "<f2",
    "<f4",
    "<f8",
    ">f4",
    "<c8",
    "<c16",
    "|b1",
    "|i1",
    "<i2",
    "<i4",
    ">i8",
    "|u1",
    "<u2",
    "<u4",
    "<u8",
]

floats_any = st.integers(0, 2**64 - 1).map(lambda bits: struct.unpack("<d", bits.to_bytes(8, "little"))[0])
key_scalars = st.one_of(st.none(), st.booleans(), st.integers(), floats_any, st.text(max_size=8))
keys = st.one_of(key_scalars, st.tuples(key_scalars, key_scalars))
scalars = st.one_of(
    key_scalars,
    st.integers(min_value=-(2**200), max_value=2**200),
    st.builds(complex, floats_any, floats_any),
    st.binary(max_size=16),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
)


@st.composite
def tensor_groups(draw: st.DrawFn) -> list[torch.Tensor]:
    """One storage filled with random bytes and several views of it."""
    dt = dtypes.TORCH_DTYPES[draw(st.sampled_from(ALL_DTYPES))]
    n = draw(st.integers(0, 40))
    size = dtypes.torch_itemsize(dtypes.TORCH_NAMES[dt])
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt) if n else torch.empty(0, dtype=dt)
    views = []
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["whole", "reshape", "strided", "scalar"]))
        if how == "whole" or n == 0:
            v = base
        elif how == "reshape" and n % 2 == 0:
            v = base.view(2, n // 2).t()
        elif how == "scalar":
            v = base[draw(st.integers(0, n - 1))]
        else:
            start = draw(st.integers(0, n - 1))
            step = draw(st.integers(1, 3))
            v = base[start::step]
        views.append(v)
    if dt.is_floating_point and draw(st.booleans()):
        views[0] = views[0].clone().requires_grad_(True)
    if dt.is_complex and draw(st.booleans()):
        views.append(base.conj())
    if dt.is_floating_point and draw(st.booleans()):
        views.append(torch.nn.Parameter(base.clone(), requires_grad=draw(st.booleans())))
    return views


@st.composite
def ndarrays(draw: st.DrawFn) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    a = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if a.ndim > 1 and draw(st.booleans()):
        a = np.asfortranarray(a)
    return a


@st.composite
def np_scalars(draw: st.DrawFn) -> np.generic:
    dt = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    raw = draw(st.binary(min_size=dt.itemsize, max_size=dt.itemsize))
    return np.frombuffer(raw, dtype=dt)[0]


leaves = st.one_of(scalars, ndarrays(), np_scalars())


def states(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(st.text(max_size=6), children, max_size=4).map(collections.OrderedDict),
        )

    tree = st.recursive(leaves, extend, max_leaves=max_leaves)
    return st.tuples(tree, st.lists(tensor_groups(), max_size=3)).map(
        lambda p: {"tree": p[0], "tensors": p[1]}
    )


def run_ranks(target: Any, world: int, where: Any, *args: Any) -> list[dict[str, Any]]:
    """Run ``target(rank, world, *args)`` (a module-level function returning a JSON-able dict)
    on `world` spawned processes joined in a gloo group, and return each rank's dict; a rank
    whose target raised returns ``{"error": "<type>: <message> <traceback>"}``.  `where`: a
    directory for the group's store and the results."""
    import os
    import uuid

    import torch.multiprocessing as mp

    tag = uuid.uuid4().hex[:8]
    mp.start_processes(
        _rank_entry,
        args=(target, world, str(where), tag, args),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    import json

    out = []
    for rank in range(world):
        with open(os.path.join(str(where), f"ranks-{tag}.{rank}.json")) as fh:
            out.append(json.load(fh))
    return out


def _rank_entry(rank: int, target: Any, world: int, where: str, tag: str, args: tuple[Any, ...]) -> None:
    import json
    import os
    import traceback

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(where, f"store-{tag}"), world), rank=rank, world_size=world
    )
    try:
        result = target(rank, world, *args)
    except Exception as e:  # reported to the test, which prints it
        result = {"error": f"{type(e).__name__}: {e} {traceback.format_exc()}"}
    finally:
        gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
        dist.destroy_process_group()
    with open(os.path.join(where, f"ranks-{tag}.{rank}.json"), "w") as fh:
        json.dump(result, fh)


def forge_state_file(run_dir: str, step: int, mutate: Any) -> None:
    """Rewrite step `step`'s state file of a manager's run with mutate(payload), and its commit
    record to name it: a damaged step as someone else would make one."""
    import dataclasses
    import os

    import ckptfmt
    from ckptfmt.files import multifile
    from ckptfmt.runs.steps import STATE_NAME, step_dirname

    step_dir = os.path.join(run_dir, step_dirname(step))
    state_path = os.path.join(step_dir, STATE_NAME)
    payload = ckptfmt.load(state_path)
    mutate(payload)
    ckptfmt.save(payload, state_path)
    record = multifile.read_commit(step_dir)
    files = tuple(
        multifile.describe_part(state_path, STATE_NAME) if p.name == STATE_NAME else p for p in record.files
    )
    multifile.write_commit(step_dir, dataclasses.replace(record, files=files))
