"""Hostile DCP checkpoint directories (spec/FORMAT.md 13.5), run through every public path.

Each case is a small builder that damages a valid checkpoint: ckptfmt's own layout (a
``COMMIT`` whose ``dcp`` member is rewritten, rank files rewritten or removed) or DCP's
FileSystemWriter format (``.metadata`` and ``.distcp`` files).  EXPECT says what ``cdcp.load``
and ``consolidate`` raise for each; every case also goes through ``ckptfmt verify``,
``ckptfmt convert`` and ``ckptfmt ls``.  The rules: the error is the expected ckptfmt class
(never torch's, never a KeyError, IndexError, TypeError, MemoryError), and ``verify`` fails
exactly where ``load`` fails: verify runs load's checks, over every item.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.cli import main as cli
from ckptfmt.errors import CheckpointError, CorruptError, IncompleteError, LimitError, UnsupportedError
from ckptfmt.files import multifile

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state() -> dict[str, Any]:
    """Nested, so that planner data has dict keys and list indices to damage."""
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
            "b": torch.ones(5, dtype=torch.bfloat16),
        },
        "layers": [torch.full((3,), 2.0), torch.full((2, 2), 3.0)],
        "lr": 0.5,
        "names": ["a", "b"],
    }


def fresh(value: Any) -> Any:
    """Destinations of the saved state's structure: zeros for tensors, None for values."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
        return [fresh(v) for v in value]
    return None


# -- editing the `dcp` member (also used by test_dcp.py) ---------------------------------------------


def rewrite(directory: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite the commit record with `change` applied to its `dcp` member."""
    record = read_record(directory)
    change(record.layout_data)
    multifile.write_commit(str(directory), record)


def read_record(directory: Path) -> multifile.CommitRecord:
    """The commit record, its dcp member's columns (read as their stored bytes) as numpy arrays
    to edit."""
    record = multifile.read_commit(str(directory))
    columns = record.layout_data["tensors"]
    for name in ("props", "sizes", "chunks"):
        a = columns[name]
        columns[name] = np.frombuffer(a.data, dtype=a.dtype).reshape(a.shape, order=a.order).copy()
    return record


def entries(t: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensors member's columns as one entry per tensor (to edit them in tests)."""
    out: dict[str, dict[str, Any]] = {}
    size_at = row_at = 0
    for fqn, (dt, grad, ndim, rows) in zip(t["keys"], t["props"].tolist()):
        width = 2 * ndim + 2
        out[fqn] = {
            "dtype": t["dtypes"][dt],
            "size": t["sizes"][size_at : size_at + ndim].tolist(),
            "requires_grad": grad,
            "chunks": t["chunks"][row_at : row_at + rows * width].reshape(rows, width),
        }
        size_at += ndim
        row_at += rows * width
    return out


def columns(items: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The inverse of entries, keeping whatever an edit put in (a wrong type, a bad width)."""
    names = list(dict.fromkeys(e["dtype"] for e in items.values()))
    chunks = [np.asarray(e["chunks"]) for e in items.values()]
    return {
        "keys": list(items),
        "dtypes": names,
        "props": np.array(
            [
                [names.index(e["dtype"]), e["requires_grad"], len(e["size"]), len(c)]
                for e, c in zip(items.values(), chunks)
            ],
            dtype=np.int64,
        ).reshape(len(items), 4),
        "sizes": np.array([d for e in items.values() for d in e["size"]], dtype=np.int64),
        "chunks": np.concatenate([c.reshape(-1) for c in chunks]),
    }


def edit(v: dict[str, Any], key: str, **changes: Any) -> None:
    items = entries(v["tensors"])
    items[key].update(changes)
    v["tensors"] = columns(items)


def set_chunks(
    v: dict[str, Any], key: str, rows: list[list[int]] | np.ndarray, dtype: Any = np.int64
) -> None:
    edit(v, key, chunks=np.array(rows, dtype=dtype))


def _column(v: dict[str, Any], name: str, value: Any) -> None:
    v["tensors"][name] = value


def _item(v: dict[str, Any], fqn: str) -> int:
    """The rank-file key of a tensor's (first) chunk."""
    return int(entries(v["tensors"])[fqn]["chunks"][0, -1])


def _planner(**paths: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(v: dict[str, Any]) -> None:
        v["planner_data"].update({k.replace("__", "."): p for k, p in paths.items()})

    return change


def _rekey(old: str, path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    """Rename the tensor or value `old` to the key `path` spells, with `path` as its planner data."""

    def change(v: dict[str, Any]) -> None:
        new = ".".join(map(str, path))
        t = v["tensors"]
        t["keys"] = [new if k == old else k for k in t["keys"]]
        if old in v["bytes"]:
            v["bytes"][new] = v["bytes"].pop(old)
        del v["planner_data"][old]
        v["planner_data"][new] = path

    return change


def _record(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    return lambda d: rewrite(d, change)


# -- rank files -------------------------------------------------------------------------------------------

RANK0 = "rank-00000.ckpt"


def _recommit(directory: Path, change: Callable[[dict[str, Any]], Any] | None = None) -> None:
    """A new commit record naming the rank files as they are now (and `change` applied)."""
    record = read_record(directory)
    if change is not None:
        change(record.layout_data)
    parts = tuple(multifile.describe_part(str(directory / p.name), p.name) for p in record.files)
    multifile.write_commit(
        str(directory), multifile.CommitRecord(record.step, "dcp", parts, layout_data=record.layout_data)
    )


def _rank_root(change: Callable[[dict[Any, Any]], Any]) -> Callable[[Path], None]:
    """Rewrite rank 0's root dict with `change`, and commit the new file."""

    def build(directory: Path) -> None:
        root = ckptfmt.load(str(directory / RANK0))
        root = change(root) or root
        ckptfmt.save(root, str(directory / RANK0))
        _recommit(directory)

    return build


def _rank_dtype(fqn: str, dtype: torch.dtype) -> Callable[[Path], None]:
    """The rank file holds `fqn` as `dtype`; the record still says what was saved."""

    def build(directory: Path) -> None:
        key = _item(read_record(directory).layout_data, fqn)
        _rank_root(lambda root: root.__setitem__(key, root[key].to(dtype)))(directory)

    return build


def _huge_but_held(directory: Path) -> None:
    """A valid 4 TiB tensor over 4 bytes (stride 0): load and verify accept it, consolidate
    would allocate 4 TiB."""
    root = ckptfmt.load(str(directory / RANK0))
    root[99] = torch.zeros(1).expand(1 << 40)
    ckptfmt.save(root, str(directory / RANK0))

    def change(v: dict[str, Any]) -> None:
        items = entries(v["tensors"])
        items["big"] = {
            "dtype": "float32",
            "size": [1 << 40],
            "requires_grad": 0,
            "chunks": np.array([[0, 1 << 40, 0, 99]]),
        }
        v["tensors"] = columns(items)

    _recommit(directory, change)


def _swap_rank_file(directory: Path) -> None:
    ckptfmt.save(ckptfmt.load(str(directory / RANK0)), str(directory / RANK0))


def _flip_data(directory: Path) -> None:
    data = bytearray((directory / RANK0).read_bytes())
    data[100] ^= 0x01  # in the first chunk's data (the prologue is 64 bytes)
    (directory / RANK0).write_bytes(bytes(data))


# -- DCP's own format (.metadata + .distcp) -----------------------------------------------------------


def _metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_metadata(directory: Path, md: Any) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(md))


def _md(change: Callable[[Any, Path], Any]) -> Callable[[Path], None]:
    def build(directory: Path) -> None:
        md = _metadata(directory)
        md = change(md, directory) or md
        _write_metadata(directory, md)

    return build


def _raw_metadata(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / ".metadata").write_bytes(data)


def _w_info(md: Any) -> Any:
    return next(v for k, v in md.storage_data.items() if k.fqn == "model.w")


def _outside(md: Any, directory: Path) -> None:
    info = _w_info(md)
    shutil.copy(directory / info.relative_path, directory.parent / "outside.distcp")
    info.relative_path = "../outside.distcp"


def _md_dtype(md: Any, directory: Path) -> None:
    sm = md.state_dict_metadata["model.w"]
    sm.properties.dtype = torch.int32


def _md_huge(md: Any, directory: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    sm = md.state_dict_metadata["model.w"]
    info = _w_info(md)
    big = torch.Size([1 << 20, 1 << 20])
    sm.size = big
    sm.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=big)]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "model.w"}
    md.storage_data[MetadataIndex("model.w", torch.Size([0, 0]))] = info


def _md_overlap(md: Any, directory: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    sm = md.state_dict_metadata["model.w"]
    info = _w_info(md)
    sm.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 6])),
        ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([1, 6])),
    ]
    md.storage_data[MetadataIndex("model.w", torch.Size([1, 0]))] = info


def _md_bad_properties(md: Any, directory: Path) -> None:
    md.state_dict_metadata["model.w"].properties = 5


def _md_long_slice(md: Any, directory: Path) -> None:
    _w_info(md).length = 1 << 40


def _md_planner(md: Any, directory: Path) -> None:
    md.planner_data["layers.0"] = ("layers", -1)


def _value_needs_pickle(directory: Path) -> None:
    """A value torch.load(weights_only=True) refuses: consolidate never unpickles it."""
    import datetime

    shutil.rmtree(directory)
    changed = {**state(), "lr": datetime.date(2020, 1, 1)}
    dcp.save(changed, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)


def _distcp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.distcp"))


def _garbage_distcp(directory: Path) -> None:
    for p in _distcp_files(directory):
        p.write_bytes(b"\x00" * p.stat().st_size)


def _no_distcp(directory: Path) -> None:
    for p in _distcp_files(directory):
        p.unlink()


# 13 bytes: PROTO 4, BINBYTES8 declaring 2^36 bytes, then 2 of them (the audit's 14-byte file)
_BYTES8_HUGE = b"\x80\x04\x8e" + struct.pack("<Q", 1 << 36) + b"ab"
# EMPTY_LIST, LONG_BINPUT 2^32 - 1: C's unpickler sizes its memo table by the index
_MEMO_HUGE = b"\x80\x04]r\xff\xff\xff\xff."
# FRAME declaring 2^40 bytes
_FRAME_HUGE = b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N."


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/ckptfmt-hostile-dcp-pwned",))


# -- the corpus ---------------------------------------------------------------------------------------------

SAME = "same"  # consolidate raises what load raises


@dataclass(frozen=True)
class Case:
    """A hostile directory: how to build it from a valid one, and what each path must answer."""

    build: Callable[[Path], None]
    load: type[CheckpointError] | None  # None: load succeeds
    consolidate: type[CheckpointError] | str | None = SAME
    dcp_format: bool = False  # built from DCP's own FileSystemWriter format
    ls_sees: bool = True  # ls (index only, no data) reports it


EXPECT: dict[str, Case] = {
    # the record's dcp member: types and ranges
    "member-emptied": Case(_record(lambda v: v.clear()), CorruptError),
    "unknown-field": Case(_record(lambda v: v.update(extra=1)), CorruptError),
    "world-size-zero": Case(_record(lambda v: v.update(world_size=0)), CorruptError),
    "world-size-huge": Case(_record(lambda v: v.update(world_size=1 << 25)), CorruptError),
    "tensors-not-dict": Case(_record(lambda v: v.update(tensors=[])), CorruptError),
    "tensors-column-missing": Case(_record(lambda v: v["tensors"].pop("props")), CorruptError),
    "keys-twice": Case(
        _record(lambda v: _column(v, "keys", [v["tensors"]["keys"][0]] * len(v["tensors"]["keys"]))),
        CorruptError,
    ),
    "keys-not-str": Case(
        _record(lambda v: _column(v, "keys", [1] * len(v["tensors"]["keys"]))), CorruptError
    ),
    "dtype-unknown": Case(_record(lambda v: edit(v, "model.w", dtype="float7")), UnsupportedError),
    "dtype-not-str": Case(_record(lambda v: edit(v, "model.w", dtype=3)), CorruptError),
    "dtype-index-outside": Case(
        _record(lambda v: v["tensors"]["props"].__setitem__((0, 0), 9)), CorruptError
    ),
    "requires-grad-not-0-or-1": Case(
        _record(lambda v: v["tensors"]["props"].__setitem__((0, 1), 2)), CorruptError
    ),
    "ndim-negative": Case(_record(lambda v: v["tensors"]["props"].__setitem__((0, 2), -1)), CorruptError),
    "props-wrong-shape": Case(
        _record(lambda v: _column(v, "props", v["tensors"]["props"][:, :3].copy())), CorruptError
    ),
    "props-float": Case(
        _record(lambda v: _column(v, "props", v["tensors"]["props"].astype(np.float64))), CorruptError
    ),
    "size-negative": Case(_record(lambda v: edit(v, "model.w", size=[-4, 6])), CorruptError),
    "size-over-the-limit": Case(_record(lambda v: edit(v, "model.w", size=[1 << 40, 1 << 40])), LimitError),
    "sizes-too-long": Case(
        _record(lambda v: _column(v, "sizes", np.append(v["tensors"]["sizes"], 7))), CorruptError
    ),
    "sizes-too-short": Case(
        _record(lambda v: _column(v, "sizes", v["tensors"]["sizes"][:-1].copy())), CorruptError
    ),
    # chunk rows
    "chunks-float": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 0, 0]], np.float64)), CorruptError
    ),
    "chunks-wrong-width": Case(_record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 0]])), CorruptError),
    "chunks-too-long": Case(
        _record(lambda v: _column(v, "chunks", np.append(v["tensors"]["chunks"], 0))), CorruptError
    ),
    "chunks-empty": Case(_record(lambda v: set_chunks(v, "model.w", np.zeros((0, 6)))), CorruptError),
    "chunks-negative": Case(_record(lambda v: set_chunks(v, "model.w", [[0, -1, 4, 6, 0, 0]])), CorruptError),
    "chunk-outside": Case(_record(lambda v: set_chunks(v, "model.w", [[1, 0, 4, 6, 0, 0]])), CorruptError),
    "chunk-hole": Case(_record(lambda v: set_chunks(v, "model.w", [[0, 0, 2, 6, 0, 0]])), CorruptError),
    "chunks-overlap": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 3, 6, 0, 0], [1, 0, 1, 6, 0, 0]])), CorruptError
    ),
    "empty-chunk-at-a-chunks-offsets": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 0, 0], [0, 0, 0, 6, 0, 5]])), CorruptError
    ),
    "chunk-file-out-of-range": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 5, 0]])), CorruptError
    ),
    "key-both-kinds": Case(_record(lambda v: v["bytes"].update({"model.w": [0, 0]})), CorruptError),
    "value-location-bad": Case(_record(lambda v: v["bytes"].update(lr=[0])), CorruptError),
    "value-file-out-of-range": Case(_record(lambda v: v["bytes"].update(lr=[3, 0])), CorruptError),
    "storage-meta-bad": Case(
        _record(lambda v: v.update(storage_meta={"checkpoint_id": 1, "save_id": None, "modules": []})),
        CorruptError,
    ),
    # planner data: types, ranges, conflicts (only consolidate uses it; every path checks it)
    "planner-data-not-tuple": Case(_record(lambda v: v.update(planner_data={"model.w": "w"})), CorruptError),
    "planner-index-negative": Case(_record(_planner(layers__0=("layers", -1))), CorruptError),
    "planner-index-huge": Case(_record(_planner(layers__0=("layers", 1 << 40))), CorruptError),
    "planner-index-bool": Case(_record(_planner(layers__0=("layers", True))), CorruptError),
    "planner-first-is-int": Case(_record(_planner(lr=(0,))), CorruptError),
    "planner-path-empty": Case(_record(_planner(lr=())), CorruptError),
    "planner-path-too-deep": Case(_record(_planner(lr=("x",) * 300)), CorruptError),
    "planner-path-spells-another-key": Case(_record(_planner(model__b=("model", "w"))), CorruptError),
    "planner-leaf-is-a-container": Case(_record(_rekey("lr", ("model", "w", "x"))), CorruptError),
    "planner-container-is-a-leaf": Case(_record(_rekey("lr", ("model",))), CorruptError),
    "planner-list-and-dict": Case(_record(_rekey("layers.1", ("layers", "x"))), CorruptError),
    "planner-lists-too-long": Case(
        _record(
            lambda v: [
                _rekey("layers.0", ("a", (1 << 24) - 1))(v),
                _rekey("layers.1", ("b", (1 << 24) - 1))(v),
            ]
        ),
        LimitError,
    ),
    # the rank files' agreement with the record (load checks the items it reads, verify all)
    "chunk-key-absent": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 0, 999]])), CorruptError
    ),
    "chunk-names-a-value": Case(
        _record(lambda v: set_chunks(v, "model.w", [[0, 0, 4, 6, 0, v["bytes"]["lr"][1]]])), CorruptError
    ),
    "value-key-absent": Case(_record(lambda v: v["bytes"].update(lr=[0, 777])), CorruptError),
    "dtype-disagrees-float-as-int": Case(_record(lambda v: edit(v, "model.w", dtype="int32")), CorruptError),
    "dtype-disagrees-same-width": Case(_record(lambda v: edit(v, "model.b", dtype="float16")), CorruptError),
    "rank-file-dtype-disagrees": Case(_rank_dtype("model.w", torch.float64), CorruptError),
    "shape-disagrees": Case(
        _record(
            lambda v: set_chunks(
                v, "model.w", [[0, 0, 2, 6, 0, _item(v, "model.w")], [2, 0, 2, 6, 0, _item(v, "model.w")]]
            )
        ),
        CorruptError,
    ),
    # a 4 TiB tensor the rank file does not hold: the user's 4x6 tensor makes DCP's planner
    # refuse the load (a CheckpointError naming the rank); consolidate must not allocate it
    "huge-declared-shape": Case(
        _record(
            lambda v: edit(
                v,
                "model.w",
                size=[1 << 20, 1 << 20],
                chunks=np.array([[0, 0, 1 << 20, 1 << 20, 0, _item(v, "model.w")]]),
            )
        ),
        CheckpointError,
        CorruptError,
    ),
    "huge-but-held-stride-0": Case(_huge_but_held, None, LimitError),
    "rank-root-str-keys": Case(_rank_root(lambda root: {str(k): v for k, v in root.items()}), CorruptError),
    "rank-file-replaced": Case(_swap_rank_file, CorruptError),
    "rank-file-missing": Case(lambda d: (d / RANK0).unlink(), IncompleteError),
    "rank-file-data-flipped": Case(_flip_data, CorruptError, ls_sees=False),
    # DCP's own format: cdcp.load and verify need a commit record, consolidate/convert read it
    "dcp-bytes8-declares-2^36": Case(_raw_metadata(_BYTES8_HUGE), IncompleteError, CorruptError, True),
    "dcp-memo-index-2^32": Case(_raw_metadata(_MEMO_HUGE), IncompleteError, CorruptError, True),
    "dcp-frame-declares-2^40": Case(_raw_metadata(_FRAME_HUGE), IncompleteError, CorruptError, True),
    "dcp-metadata-runs-code": Case(_raw_metadata(pickle.dumps(_Evil())), IncompleteError, CorruptError, True),
    "dcp-metadata-truncated": Case(
        lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:40]),
        IncompleteError,
        CorruptError,
        True,
    ),
    "dcp-metadata-bad-properties": Case(_md(_md_bad_properties), IncompleteError, CorruptError, True),
    "dcp-path-outside": Case(_md(_outside), IncompleteError, CorruptError, True),
    "dcp-slice-beyond-file": Case(_md(_md_long_slice), IncompleteError, CorruptError, True),
    "dcp-dtype-disagrees": Case(_md(_md_dtype), IncompleteError, CorruptError, True, ls_sees=False),
    "dcp-huge-declared-shape": Case(_md(_md_huge), IncompleteError, LimitError, True, ls_sees=False),
    "dcp-chunks-overlap": Case(_md(_md_overlap), IncompleteError, CorruptError, True),
    "dcp-planner-index-negative": Case(_md(_md_planner), IncompleteError, CorruptError, True),
    "dcp-distcp-garbage": Case(_garbage_distcp, IncompleteError, CorruptError, True, ls_sees=False),
    "dcp-value-needs-unpickling": Case(
        _value_needs_pickle, IncompleteError, UnsupportedError, True, ls_sees=False
    ),
    "dcp-distcp-missing": Case(_no_distcp, IncompleteError, IncompleteError, True),
}


def _consolidate_error(case: Case) -> type[CheckpointError] | None:
    return case.load if case.consolidate == SAME else case.consolidate  # type: ignore[return-value]


# -- running a case through every path -------------------------------------------------------------------


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("originals")
    cdcp.save(state(), str(base / "ckptfmt"))
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(base / "dcp")), no_dist=True)
    return {"ckptfmt": base / "ckptfmt", "dcp": base / "dcp"}


def _built(originals: dict[str, Path], tmp_path: Path, case: Case) -> Path:
    directory = tmp_path / "ck"
    shutil.copytree(originals["dcp" if case.dcp_format else "ckptfmt"], directory)
    case.build(directory)
    return directory


def _raises(expected: type[CheckpointError] | None, fn: Callable[[], Any]) -> CheckpointError | None:
    """Run fn; its error must be exactly `expected` (None: no error)."""
    try:
        fn()
    except CheckpointError as e:
        assert type(e) is expected, f"raised {type(e).__name__}: {e}"
        assert "\n" not in str(e), f"a message of several lines: {e!r}"
        return e
    assert expected is None, f"no error, expected {expected.__name__}"
    return None


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_hostile_directory(
    originals: dict[str, Path], tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    case = EXPECT[name]
    directory = _built(originals, tmp_path, case)
    _raises(case.load, lambda: cdcp.load(fresh(state()), str(directory)))

    # verify fails exactly where load fails
    code = cli(["verify", str(directory)])
    out = capsys.readouterr()
    assert code == (0 if case.load is None else 1), out

    expected = _consolidate_error(case)
    _raises(expected, lambda: cdcp.consolidate(str(directory), str(tmp_path / "full.ckpt")))
    code = cli(["convert", str(directory), str(tmp_path / "converted.ckpt")])
    out = capsys.readouterr()
    assert code == (0 if expected is None else 1), out
    if expected is not None:
        assert out.err.startswith("error: ") and out.err.count("\n") == 1, out.err

    # ls checks what load (ours) or consolidate (DCP's format) checks before reading data
    assert cli(["ls", str(directory)]) == 0
    listing = capsys.readouterr().out
    fails = expected is not None if case.dcp_format else case.load is not None
    if fails and case.ls_sees:
        assert "DCP checkpoint, incomplete" in listing, listing
    elif not fails:
        assert "DCP checkpoint, complete" in listing, listing
    assert not os.path.exists("/tmp/ckptfmt-hostile-dcp-pwned")


def test_the_originals_are_fine(originals: dict[str, Path], tmp_path: Path) -> None:
    for kind, directory in originals.items():
        out = tmp_path / f"{kind}.ckpt"
        cdcp.consolidate(str(directory), str(out))
        full = ckptfmt.load(str(out))
        assert torch.equal(full["model"]["w"], state()["model"]["w"])
        assert torch.equal(full["layers"][1], state()["layers"][1])
        assert full["names"] == ["a", "b"]
    back = fresh(state())
    cdcp.load(back, str(originals["ckptfmt"]))
    assert torch.equal(back["model"]["b"], state()["model"]["b"]) and back["lr"] == 0.5
    assert cli(["verify", str(originals["ckptfmt"])]) == 0


def test_dtype_error_names_key_rank_file_and_both_dtypes(originals: dict[str, Path], tmp_path: Path) -> None:
    directory = _built(originals, tmp_path, EXPECT["dtype-disagrees-float-as-int"])
    with pytest.raises(CorruptError) as info:
        cdcp.load(fresh(state()), str(directory))
    text = str(info.value)
    for part in ("model.w", "rank-00000.ckpt", "rank 0", "float32", "int32"):
        assert part in text, text


# -- column lengths are checked before their values are read ------------------------------------


def _with_columns(member: dict[str, Any], **columns: Any) -> dict[str, Any]:
    return {**member, "tensors": {**member["tensors"], **columns}}


def _checked_within(member: dict[str, Any], files: list[str]) -> tuple[BaseException | None, float, int]:
    """check_value of `member`: (its error, seconds, peak bytes allocated while checking)."""
    from ckptfmt.dcp.metadata import check_value

    tracemalloc.start()
    start = time.perf_counter()
    try:
        check_value(member, files, "COMMIT")
        error: BaseException | None = None
    except CheckpointError as e:
        error = e
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, seconds, peak


@pytest.mark.parametrize("column", ["sizes", "chunks"])
def test_a_huge_column_is_refused_before_its_values_are_read(originals: dict[str, Path], column: str) -> None:
    """A record whose sizes or chunks column holds 2^23 values (64 MiB, within the record's
    size cap) where its props call for a few dozen is refused at once, naming the column,
    without building millions of Python ints; the sound record still checks."""
    from ckptfmt.format.arrays import INT64, StoredArray

    record = multifile.read_commit(str(originals["ckptfmt"]))
    files = [p.name for p in record.files]
    assert _checked_within(record.layout_data, files)[0] is None
    huge = StoredArray(INT64, (1 << 23,), "C", bytes(8 << 23))
    error, seconds, peak = _checked_within(_with_columns(record.layout_data, **{column: huge}), files)
    assert seconds < 0.5, seconds  # reading the column took seconds
    assert peak < 4 << 20, peak  # and 128 MiB or more
    assert type(error) is CorruptError, error
    assert f"tensors.{column} holds {1 << 23} values" in str(error) and error.path == "COMMIT"


def test_chunk_rows_past_the_records_limit_are_refused_from_props_alone(originals: dict[str, Path]) -> None:
    """props calling for more chunk rows than MAX_RECORD_ROWS in all: a LimitError before the
    chunks column is read; rows that cannot lie at distinct offsets in their tensor: corrupt."""
    from ckptfmt.dcp.metadata import MAX_RECORD_ROWS
    from ckptfmt.format.arrays import StoredArray

    record = multifile.read_commit(str(originals["ckptfmt"]))
    files = [p.name for p in record.files]
    member = record.layout_data
    n = len(member["tensors"]["keys"])
    rows = MAX_RECORD_ROWS // n + 1
    props = StoredArray.of_ints([v for _ in range(n) for v in (0, 0, 1, rows)], (n, 4))
    sizes = StoredArray.of_ints([1 << 40] * n)
    error = _checked_within(_with_columns(member, props=props, sizes=sizes), files)[0]
    assert type(error) is LimitError and f"more than {MAX_RECORD_ROWS}" in str(error), error
    sizes = StoredArray.of_ints([3] * n)
    props = StoredArray.of_ints([v for _ in range(n) for v in (0, 0, 1, 5)], (n, 4))
    error = _checked_within(_with_columns(member, props=props, sizes=sizes), files)[0]
    assert type(error) is CorruptError and "distinct offsets" in str(error), error


# -- random mangling of the columns: load and verify agree ------------------------------------------------


_VALUES = st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 1 << 20, 1 << 40, (1 << 63) - 1, -(1 << 63)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    column=st.sampled_from(["props", "sizes", "chunks"]),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), _VALUES), min_size=1, max_size=3),
)
def test_mangled_columns_load_and_verify_agree(
    originals: dict[str, Path], column: str, edits: list[tuple[int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ck"
        shutil.copytree(originals["ckptfmt"], directory)

        def change(v: dict[str, Any]) -> None:
            array = v["tensors"][column].reshape(-1)
            for at, value in edits:
                array[at % len(array)] = value

        rewrite(directory, change)
        try:
            cdcp.load(fresh(state()), str(directory))
            loaded = True
        except CheckpointError as e:
            assert "\n" not in str(e)
            loaded = False
        assert (cli(["verify", "--json", str(directory)]) == 0) == loaded
        try:
            cdcp.consolidate(str(directory), str(Path(tmp) / "full.ckpt"))
        except CheckpointError:
            pass


# -- a checkpoint manager's step of layout "dcp" -----------------------------------------------------------

MANAGER_CASES = {
    "huge-declared-shape": CorruptError,
    "dtype-disagrees-float-as-int": CorruptError,
    "planner-index-huge": CorruptError,
    "chunk-key-absent": CorruptError,
    "rank-file-data-flipped": CorruptError,
    "huge-but-held-stride-0": LimitError,
}


def _under_state(v: dict[str, Any], under: bool) -> None:
    """Move every key of the dcp member `v` under "state" (a manager's step), or back."""
    t = v["tensors"]
    name = (lambda k: f"state.{k}") if under else (lambda k: k.removeprefix("state."))
    t["keys"] = [name(k) for k in t["keys"]]
    v["bytes"] = {name(k): loc for k, loc in v["bytes"].items()}
    paths = {name(k): ("state", *p) if under else p[1:] for k, p in v["planner_data"].items()}
    if under:  # keys a builder added without planner data sit under "state" too
        paths.update({k: ("state", k[6:]) for k in [*t["keys"], *v["bytes"]] if k not in paths})
    v["planner_data"] = paths


@pytest.mark.parametrize("name", sorted(MANAGER_CASES))
def test_manager_step_of_a_dcp_run(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """CheckpointManager.load assembles a "dcp" step (what several ranks saved) in this process:
    the same checks and bounds as consolidate, and ckptfmt's errors, never DCP's own."""
    from ckptfmt.runs.manager import CheckpointManager

    step = tmp_path / "run" / "step-000000001"
    cdcp.save({"state": state()}, str(step), step=1)
    assert torch.equal(CheckpointManager(str(tmp_path / "run")).load(1)["model"]["w"], state()["model"]["w"])
    # the builders name the keys of a bare state; the step saved them under "state"
    rewrite(step, lambda v: _under_state(v, False))
    EXPECT[name].build(step)
    rewrite(step, lambda v: _under_state(v, True))
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(str(tmp_path / "run")).load(1)
    assert type(info.value) is MANAGER_CASES[name], info.value
    assert cli(["verify", str(tmp_path / "run")]) == (0 if EXPECT[name].load is None else 1)
    capsys.readouterr()


_PATH_KEYS = st.one_of(
    st.sampled_from(["model", "w", "b", "layers", "x"]),
    st.sampled_from([-1, 0, 1, 2, (1 << 24) - 1, 1 << 24, 1 << 40, True]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    paths=st.dictionaries(
        st.sampled_from(["model.w", "model.b", "layers.0", "layers.1", "lr", "names"]),
        st.lists(_PATH_KEYS, min_size=0, max_size=4).map(tuple),
        min_size=1,
    )
)
def test_random_planner_data_is_checked_alike_everywhere(
    originals: dict[str, Path], paths: dict[str, tuple[Any, ...]]
) -> None:
    """Random paths: load and verify agree, and consolidate either rebuilds the state or
    raises a CheckpointError (never IndexError, TypeError or a hang in DCP's unflattening)."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ck"
        shutil.copytree(originals["ckptfmt"], directory)
        rewrite(directory, lambda v: v["planner_data"].update(paths))
        try:
            cdcp.load(fresh(state()), str(directory))
            loaded = True
        except CheckpointError:
            loaded = False
        assert (cli(["verify", "--json", str(directory)]) == 0) == loaded
        try:
            cdcp.consolidate(str(directory), str(Path(tmp) / "full.ckpt"))
            assert loaded
        except CheckpointError:
            assert not loaded
