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
