"""A ``ckpt_path`` that is a damaged ``torch.save`` file, read by CkptfmtCheckpointIO with
``read_torch_checkpoints=True``: a ckptfmt error naming the file, never torch's RuntimeError or
pickle's UnpicklingError without it."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import zipfile

import pytest
import torch

import ckptfmt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs ckptfmt[lightning]"
)


def _torch_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, buf)
    return buf.getvalue()


def _zip_of_other_things() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", "not a torch archive")
    return buf.getvalue()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="cut-in-half"),
        pytest.param(lambda b: _zip_of_other_things(), id="zip-of-other-things"),
        pytest.param(lambda b: b"\x80\x02" + bytes(range(100)), id="legacy-pickle-garbage"),
        pytest.param(lambda b: b[:-30] + b"\xff" * 30, id="central-directory-overwritten"),
    ],
)
def test_a_damaged_torch_checkpoint_raises_a_checkpoint_error_naming_it(
    damage, tmp_path: pathlib.Path
) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "damaged.ckpt"
    path.write_bytes(damage(_torch_bytes()))
    with pytest.raises(ckptfmt.CheckpointError) as caught:
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path))
    assert str(path) in str(caught.value)
    assert "torch.load" in str(caught.value)


def test_an_intact_torch_checkpoint_is_still_read(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "intact.ckpt"
    path.write_bytes(_torch_bytes())
    state = CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path))
    assert state["global_step"] == 1 and torch.equal(state["state_dict"]["w"], torch.ones(3))


def _rewritten_pickle(change) -> bytes:
    """torch's archive of a small checkpoint with its data.pkl changed (the archive itself intact)."""
    src = zipfile.ZipFile(io.BytesIO(_torch_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info.filename)
            z.writestr(info, change(data) if info.filename.endswith("data.pkl") else data)
    return out.getvalue()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d[:5] + b"\xee" * 8 + d[13:], id="unknown-opcodes"),
        pytest.param(lambda d: d[: len(d) // 2], id="cut-in-half"),
    ],
)
def test_a_damaged_pickle_in_an_intact_archive_is_corrupt(change, tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "damaged.ckpt"
    path.write_bytes(_rewritten_pickle(change))
    with pytest.raises(ckptfmt.CorruptError) as caught:
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path))
    message = str(caught.value)
    assert str(path) in message and "\x1b" not in message and "\n" not in message


class _Custom:
    pass


def test_a_class_weights_only_refuses_is_unsupported(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "custom.ckpt"
    torch.save({"state_dict": {}, "thing": _Custom()}, str(path))
    with pytest.raises(ckptfmt.UnsupportedError, match="Unsupported global") as caught:
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path))
    assert "\x1b" not in str(caught.value)


def test_a_map_location_this_process_cannot_use_is_torchs_error_not_corrupt(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "intact.ckpt"
    path.write_bytes(_torch_bytes())
    with pytest.raises(RuntimeError) as caught:
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path), map_location="cuda:99")
    assert not isinstance(caught.value, ckptfmt.CheckpointError)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(MemoryError, id="host"),
        pytest.param(lambda: torch.OutOfMemoryError("CUDA out of memory"), id="device"),
    ],
)
def test_running_out_of_memory_is_not_corrupt(error, tmp_path: pathlib.Path, monkeypatch) -> None:
    """(torch.load is replaced: running a real machine out of memory is not a unit test)"""
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "intact.ckpt"
    path.write_bytes(_torch_bytes())
    raised = error()

    def out_of_memory(*_args, **_kwargs):
        raise raised

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(type(raised)) as caught:
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(str(path))
    assert caught.value is raised
