"""save(): arguments, unsupported objects, determinism, the commit protocol."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import ckptfmt
from ckptfmt.engine import commit
from ckptfmt.format import layout as fmt


class Thing:
    pass


@pytest.mark.parametrize(
    "state, where",
    [
        (
            {"sched": {"lr_lambdas": [lambda e: 1.0]}},
            "state['sched']['lr_lambdas'][0]: cannot store <function",
        ),
        ({"obj": Thing()}, "state['obj']: cannot store <"),
        ({"s": {1, 2}}, "state['s']: cannot store {1, 2}"),
        ([torch.randn(4, 4).to_sparse()], "state[0]: cannot store"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)}, "state['q']: cannot store"),
        ({"m": torch.empty(3, device="meta")}, "state['m']: cannot store"),
        ({(1, b"x"): 3}, "state[(1, b'x')] (key)[1]: cannot store b'x' (dict keys must be"),
        ({"nt": collections.namedtuple("P", "x")(1)}, "state['nt']: cannot store P(x=1)"),
        ({"subclass_int": type("MyInt", (int,), {})(3)}, "state['subclass_int']: cannot store 3"),
    ],
)
def test_unsupported_objects_name_their_path(tmp_path, state, where):
    p = tmp_path / "x.ckpt"
    with pytest.raises(ckptfmt.UnsupportedObjectError) as info:
        ckptfmt.save(state, p)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ckptfmt.CheckpointError)
    assert str(info.value).startswith(where), str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temp file


def test_nested_tensor_rejected(tmp_path):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(ckptfmt.UnsupportedObjectError, match=r"state\['n'\]"):
        ckptfmt.save({"n": nt}, tmp_path / "x")


def test_cycle_rejected(tmp_path):
    a: list = []
    a.append(a)
    with pytest.raises(ckptfmt.UnsupportedObjectError, match="nesting deeper"):
        ckptfmt.save(a, tmp_path / "x")


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"compression": "gzip"}, ValueError),
        ({"level": 3}, ValueError),
        ({"compression": "zstd", "level": 99}, ValueError),
        ({"compression": "zstd", "level": "3"}, ValueError),
        ({"metadata": {"a": 1}}, TypeError),
        ({"metadata": ["a"]}, TypeError),
        ({"chunk_size": 1000}, ValueError),
    ],
)
def test_bad_arguments(tmp_path, kw, exc):
    with pytest.raises(exc):
        ckptfmt.save({"a": 1}, tmp_path / "x", **kw)
    assert os.listdir(tmp_path) == []


def test_save_options_are_checked_once_into_one_frozen_value(tmp_path):
    """save()'s keywords become one immutable value the writers below take whole: a save made
    from it writes what the keywords asked, and the value cannot be changed in between."""
    import dataclasses

    from ckptfmt.files.save import save_file, save_options

    options = save_options(compression="zstd", level=3, metadata={"run": "a"}, chunk_size=1 << 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.write.level = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.write.metadata["run"] = "b"  # type: ignore[index]
    with pytest.raises(ValueError, match="compression"):
        save_options(compression="gzip")
    save_file({"w": torch.zeros(1 << 12)}, tmp_path / "x.ckpt", options)
    with ckptfmt.open(tmp_path / "x.ckpt") as r:
        assert r.metadata == {"run": "a"}
        assert r._file.chunk_size == 1 << 12
        assert {c.codec for c in r._file.chunks} == {fmt.CODEC_ZSTD}


def test_save_to_directory_fails(tmp_path):
    with pytest.raises(IsADirectoryError):
        ckptfmt.save({}, tmp_path)


def test_save_to_missing_directory_names_path(tmp_path):
    target = tmp_path / "nope" / "x.ckpt"
    with pytest.raises(FileNotFoundError) as info:
        ckptfmt.save({}, target)
    assert "nope" in str(info.value)


def test_load_missing_file_is_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckptfmt.load(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_deterministic_bytes_when_pinned(tmp_path, monkeypatch, compression):
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    torch.manual_seed(0)
    state = {"w": torch.randn(100, 100), "opt": {"step": torch.tensor(3.0)}, "lr": 0.1}
    ckptfmt.save(state, tmp_path / "a", compression=compression)
    ckptfmt.save(state, tmp_path / "b", compression=compression)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    with ckptfmt.open(tmp_path / "a") as r:
        assert r.producer["created"] == "2023-11-14T22:13:20Z"


def test_unpinned_saves_get_fresh_file_ids(tmp_path):
    ckptfmt.save({"a": 1}, tmp_path / "a")
    ckptfmt.save({"a": 1}, tmp_path / "b")
    assert (tmp_path / "a").read_bytes()[16:32] != (tmp_path / "b").read_bytes()[16:32]


def test_overwrite_makes_a_new_inode_and_leaves_no_temp(tmp_path):
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"v": 1}, p)
    ino = os.stat(p).st_ino
    ckptfmt.save({"v": 2}, p)
    assert os.stat(p).st_ino != ino
    assert ckptfmt.load(p) == {"v": 2}
    assert os.listdir(tmp_path) == ["x.ckpt"]


def test_stale_temp_files_are_removed_but_live_ones_kept(tmp_path):
    import fcntl

    p = tmp_path / "x.ckpt"
    stale = tmp_path / ".x.ckpt.ckptfmt-tmp.1.deadbeef"
    stale.write_bytes(b"\0" * 100)
    live = tmp_path / ".x.ckpt.ckptfmt-tmp.2.cafecafe"
    live.write_bytes(b"")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        ckptfmt.save({"v": 1}, p)
        assert sorted(os.listdir(tmp_path)) == sorted(["x.ckpt", live.name])
    finally:
        os.close(fd)
    # another target's abandoned temp goes too (a run saving step-N.ckpt never repeats a name);
    # tests/test_commit.py has the rules for temps whose owner may be alive
    other = tmp_path / ".y.ckpt.ckptfmt-tmp.1.deadbeef"
    other.write_bytes(b"")
    ckptfmt.save({"v": 1}, p)
    assert sorted(os.listdir(tmp_path)) == ["x.ckpt"]


def test_temp_file_is_not_a_checkpoint(tmp_path):
    """An unfinished temp file has no magic: a reader that is handed one refuses it."""
    p = tmp_path / "x.ckpt"
    with commit.AtomicFile(str(p)) as f:
        os.write(f.fd, b"\0" * 4096)
        with pytest.raises(ckptfmt.IncompleteError, match="did not finish"):
            ckptfmt.load(f.tmp)
    assert not p.exists()
    assert os.listdir(tmp_path) == []


def test_write_error_keeps_previous_checkpoint(tmp_path):
    import resource
    import subprocess
    import sys

    p = tmp_path / "x.ckpt"
    ckptfmt.save({"v": torch.ones(10)}, p)
    before = p.read_bytes()
    code = (
        "import resource, sys, torch, ckptfmt\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n"
        f"    ckptfmt.save({{'v': torch.ones(1 << 20)}}, {str(p)!r})\n"
        "except OSError as e:\n"
        "    print('ERR', e.errno, e.filename)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["ERR", "27", str(p)], out.stderr  # EFBIG
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.ckpt"]
    del resource
