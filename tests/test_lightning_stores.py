"""Lightning's Trainer.fit with ModelCheckpoint(dirpath="gs://..." / "az://...") and ckptfmt's
plugin, against the real `lightning` package and the GCS and Azure emulators.

The plugin writes and reads the objects through ckptfmt's own clients; Lightning asks what
exists through fsspec, which serves gs:// with gcsfs and az:// with adlfs, reached here as
their users reach an emulator: STORAGE_EMULATOR_HOST (with fsspec's configuration giving gcsfs
token "anon", and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's bucket-type probe speaks
gRPC over TLS, which the emulator does not serve, and waits 60 s) and
AZURE_STORAGE_CONNECTION_STRING."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest
import torch
from test_lightning import _boring_trainer, _diff, _final_state, _fit_net

from ckptfmt.storage import listing
from ckptfmt.storage.urls import parse_url

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("lightning", "gcsfs", "adlfs")),
    reason="needs ckptfmt[lightning], gcsfs and adlfs (the dev extra)",
)


@pytest.fixture(params=["gs", "az"])
def root(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket (container) on the store's emulator, fsspec's filesystem for it pointed
    there: the URL of a run beneath it."""
    import fsspec

    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # no metadata server to ask on this machine
    if request.param == "gs":
        url = f"gs://{request.getfixturevalue('gcs_bucket')}/run"
        monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
    else:
        url = f"az://{request.getfixturevalue('azure_container')}/run"
    fsspec.get_filesystem_class(request.param).clear_instance_cache()  # made under another environment
    yield url
    fsspec.get_filesystem_class(request.param).clear_instance_cache()


def _plugin(**kwargs: Any) -> Any:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    return CkptfmtCheckpointIO(**kwargs)


def _objects(url: str) -> set[str]:
    return set(listing.objects(parse_url(url, need_key=False), {}))


def test_fit_keeps_the_top_k_checkpoints_and_last_on_the_store(root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    dirpath = f"{root}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True
    )
    trainer = _boring_trainer(pl, root, max_epochs=4, callbacks=[mc], plugins=[_plugin()])
    trainer.fit(BoringModel())
    names = {"epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt", "last.ckpt"}
    assert _objects(root) == {f"ckpts/{n}" for n in names}
    assert {pathlib.PurePosixPath(p).name for p in mc.best_k_models} == names - {"last.ckpt"}
    assert mc.best_model_path == f"{dirpath}/epoch=3-step=4.ckpt"
    state = _plugin().load_checkpoint(mc.last_model_path)
    assert state["global_step"] == 4 and state["epoch"] == 3
    assert _diff(dict(state["state_dict"]), dict(trainer.lightning_module.state_dict())) == []


def test_fit_resumes_bit_exactly_from_the_store(root: str, tmp_path: pathlib.Path) -> None:
    """A run stopped after 2 of 4 epochs with non-blocking saves to the store, resumed by a new
    Trainer with fit(ckpt_path=".../last.ckpt"), continues the uninterrupted run bit for bit:
    every per-step loss, the weights, the optimizer and scheduler, the loops and the RNG."""
    import lightning.pytorch as pl

    torch.set_num_threads(1)
    full_trainer, full = _fit_net(pl, _plugin(), str(tmp_path / "full"), epochs=4)
    expected = _final_state(full_trainer, full)
    dirpath = f"{root}/ckpts"
    _fit_net(pl, _plugin(blocking=False), dirpath, epochs=2)
    assert "ckpts/last.ckpt" in _objects(root)
    trainer, resumed = _fit_net(pl, _plugin(), dirpath, epochs=4, ckpt_path=f"{dirpath}/last.ckpt")
    assert resumed.losses == full.losses[2 * 8 :]  # 2 epochs of 8 batches
    problems = _diff(expected, _final_state(trainer, resumed))
    assert problems == [], problems[:10]
