"""The Lightning plugin on s3:// paths, against the real `lightning` and `pytorch_lightning`
packages and a real local S3 server (moto, tests/s3_server.py).

The plugin writes and reads the objects through ckptfmt's own client (streaming multipart
uploads, ETag-pinned ranged reads); Lightning asks what exists through fsspec, which serves
s3:// with s3fs, reached here as Lightning users reach a store: through the AWS_* environment.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import threading
from typing import Any

import pytest
import torch
from test_lightning import (
    _boring_trainer,
    _diff,
    _final_state,
    _fit_net,
    _hparams,
    _loaders,
    _make_module_class,
)

import ckptfmt

needs_lightning_and_s3fs = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("lightning", "pytorch_lightning", "s3fs")),
    reason="needs ckptfmt[lightning] and s3fs (the dev extra)",
)
pytestmark = needs_lightning_and_s3fs

PACKAGES = ["lightning.pytorch", "pytorch_lightning"]


@pytest.fixture
def store(s3_bucket: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fresh bucket; the AWS_* environment points s3fs (Lightning's filesystem) at the server,
    and the plugin gets the same settings as its storage_options."""
    import fsspec

    bucket, options = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", options["region"])
    fsspec.get_filesystem_class("s3").clear_instance_cache()  # made under another environment
    yield {"bucket": bucket, "options": options, "root": f"s3://{bucket}/run"}
    fsspec.get_filesystem_class("s3").clear_instance_cache()


def _client(store: dict[str, Any]) -> Any:
    from s3_server import s3_client

    return s3_client(store["options"]["endpoint_url"])


def _objects(store: dict[str, Any], prefix: str = "run/") -> dict[str, bytes]:
    """Every object under `prefix` in the store's bucket, read whole with boto3."""
    client = _client(store)
    listing = client.list_objects_v2(Bucket=store["bucket"], Prefix=prefix)
    return {
        o["Key"]: client.get_object(Bucket=store["bucket"], Key=o["Key"])["Body"].read()
        for o in listing.get("Contents", [])
    }


def _no_save_threads() -> bool:
    return not [t.name for t in threading.enumerate() if t.name.startswith("ckptfmt-save")]


def _plugin(store: dict[str, Any], **kwargs: Any) -> Any:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    return CkptfmtCheckpointIO(storage_options=store["options"], **kwargs)


# ---------------------------------------------------------------------------
# fit, top-k, removal


@pytest.mark.parametrize("package", PACKAGES)
def test_fit_keeps_the_top_k_checkpoints_and_last_on_the_store(store: dict[str, Any], package: str) -> None:
    """ModelCheckpoint to an s3:// dirpath: a ckptfmt object per kept epoch and `last`; the
    epochs that fell out of the top 2 were removed (remove_checkpoint deleted their objects)."""
    pl = importlib.import_module(package)
    BoringModel = importlib.import_module(f"{package}.demos.boring_classes").BoringModel

    dirpath = f"{store['root']}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True
    )
    trainer = _boring_trainer(pl, store["root"], max_epochs=4, callbacks=[mc], plugins=[_plugin(store)])
    trainer.fit(BoringModel())
    found = _objects(store)
    names = {"epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt", "last.ckpt"}
    assert set(found) == {f"run/ckpts/{n}" for n in names}
    assert all(data.startswith(b"\x89CKF\r\n\x1a\n") for data in found.values())
    assert {pathlib.PurePosixPath(p).name for p in mc.best_k_models} == names - {"last.ckpt"}
    assert mc.best_model_path == f"{dirpath}/epoch=3-step=4.ckpt"
    state = _plugin(store).load_checkpoint(mc.last_model_path)
    assert state["global_step"] == 4 and state["epoch"] == 3
    assert _diff(dict(state["state_dict"]), dict(trainer.lightning_module.state_dict())) == []


def test_remove_checkpoint_deletes_the_object_after_its_save(store: dict[str, Any]) -> None:
    io = _plugin(store, blocking=False)
    url = f"{store['root']}/a.ckpt"
    io.save_checkpoint({"w": torch.ones(1 << 20)}, url)
    io.remove_checkpoint(url)  # waits for the save in flight there, then deletes what it wrote
    io.remove_checkpoint(url)  # an absent object: nothing to do
    assert _objects(store) == {}
    io.save_checkpoint({"w": torch.zeros(3)}, f"{store['root']}/b.ckpt")
    io.save_checkpoint({"w": torch.zeros(4)}, f"{store['root']}/a.ckpt/c.ckpt")  # a key beneath a.ckpt
    io.teardown()
    io.remove_checkpoint(url)
    assert set(_objects(store)) == {"run/b.ckpt", "run/a.ckpt/c.ckpt"}  # only that one object
    assert torch.equal(io.load_checkpoint(f"{store['root']}/b.ckpt")["w"], torch.zeros(3))
    with pytest.raises(FileNotFoundError, match="a.ckpt"):
        io.load_checkpoint(url)


# ---------------------------------------------------------------------------
# resume bit-exactly from an s3:// ckpt_path


@pytest.mark.parametrize("package", PACKAGES)
def test_fit_resumes_bit_exactly_from_an_s3_checkpoint(
    store: dict[str, Any], tmp_path: pathlib.Path, package: str
) -> None:
    """A run stopped after 2 of 4 epochs with non-blocking saves to the store, resumed by a new
    Trainer with fit(ckpt_path="s3://.../last.ckpt"), continues the uninterrupted run bit for
    bit: every per-step loss, the weights, the optimizer and scheduler, the loops and the RNG."""
    pl = importlib.import_module(package)
    torch.set_num_threads(1)
    full_trainer, full = _fit_net(pl, _plugin(store), str(tmp_path / "full"), epochs=4)
    expected = _final_state(full_trainer, full)
    dirpath = f"{store['root']}/ckpts"
    _fit_net(pl, _plugin(store, blocking=False), dirpath, epochs=2)
    assert _no_save_threads()
    assert "run/ckpts/last.ckpt" in _objects(store)
    trainer, resumed = _fit_net(pl, _plugin(store), dirpath, epochs=4, ckpt_path=f"{dirpath}/last.ckpt")
    done = 2 * 8  # 2 epochs of 8 batches
    assert resumed.losses == full.losses[done:]
    assert len(resumed.losses) == 2 * 8
    problems = _diff(expected, _final_state(trainer, resumed))
    assert problems == [], problems[:10]


# ---------------------------------------------------------------------------
# load_from_checkpoint


@pytest.mark.parametrize("package", PACKAGES)
def test_enable_makes_load_from_checkpoint_read_s3_objects(store: dict[str, Any], package: str) -> None:
    """LitModel.load_from_checkpoint("s3://...") after enable(): ckptfmt objects through
    ckptfmt's reader (no pickle); an object written by Lightning's own CheckpointIO (through
    s3fs) still goes to Lightning's loader."""
    from ckptfmt.integrations.lightning import enable

    pl = importlib.import_module(package)
    enable(storage_options=store["options"])
    net_class = _make_module_class(pl)
    model = net_class(**_hparams("objects"))
    train, _ = _loaders()
    trainer = _boring_trainer(pl, store["root"], plugins=[_plugin(store)])
    trainer.fit(model, train)
    url = f"{store['root']}/model.ckpt"
    trainer.save_checkpoint(url)
    assert _objects(store)["run/model.ckpt"].startswith(b"\x89CKF")
    loaded = net_class.load_from_checkpoint(url, lr=0.5)
    assert loaded.hparams.data_dir == pathlib.Path("/data/set") and loaded.hparams.lr == 0.5
    assert _diff(dict(loaded.state_dict()), dict(model.state_dict())) == []
    default = _boring_trainer(pl, store["root"])  # Lightning's TorchCheckpointIO, writing through s3fs
    default.fit(net_class(), train)
    torch_url = f"{store['root']}/torch.ckpt"
    default.save_checkpoint(torch_url)
    assert _objects(store)["run/torch.ckpt"].startswith(b"PK\x03\x04")
    from_torch = net_class.load_from_checkpoint(torch_url, weights_only=False)
    assert _diff(dict(from_torch.state_dict()), dict(default.model.state_dict())) == []
    with pytest.raises(FileNotFoundError):
        net_class.load_from_checkpoint(f"{store['root']}/missing.ckpt")


def test_torch_objects_are_read_when_allowed(store: dict[str, Any]) -> None:
    """Switching a run on a store: a torch.save object is refused, or read with
    torch.load(weights_only=True) when read_torch_checkpoints=True."""
    import io as bytes_io

    buffer = bytes_io.BytesIO()
    torch.save({"state_dict": {"w": torch.arange(5.0)}, "global_step": 3}, buffer)
    _client(store).put_object(Bucket=store["bucket"], Key="run/old.ckpt", Body=buffer.getvalue())
    url = f"{store['root']}/old.ckpt"
    with pytest.raises(ckptfmt.UnsupportedError, match="read_torch_checkpoints=True"):
        _plugin(store).load_checkpoint(url)
    state = _plugin(store, read_torch_checkpoints=True).load_checkpoint(url)
    assert state["global_step"] == 3 and torch.equal(state["state_dict"]["w"], torch.arange(5.0))


# ---------------------------------------------------------------------------
# non-blocking saves: what Lightning sees of an object in flight


def test_a_save_in_flight_is_seen_as_the_object_it_will_be(store: dict[str, Any]) -> None:
    """What ModelCheckpoint asks through fsspec (file_exists, ls for `last` files) while an
    object is being written: held in flight here by an unfinished handle, so the answer is
    certain; and what the store has once it is written, with no stale listing in between."""
    import fsspec
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem

    from ckptfmt.integrations.lightning import filesystems

    io = _plugin(store, blocking=False)
    dirpath = f"{store['root']}/ckpts"
    trainer = _boring_trainer(pl, store["root"])
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath)
    mc._fs = get_filesystem(dirpath)
    fs = fsspec.filesystem("s3")
    assert type(mc._fs).__name__ == "_InFlight_s3" and isinstance(fs, type(mc._fs))
    url = f"{dirpath}/last.ckpt"
    assert not fs.exists(dirpath)
    handle = ckptfmt.SaveHandle(url)
    filesystems.IN_FLIGHT.add(url, handle)
    bare = f"{store['bucket']}/run/ckpts/last.ckpt"
    try:
        assert mc.file_exists(url, trainer) and fs.isfile(url) and fs.exists(bare)
        assert fs.exists(dirpath)  # a "directory" holding only a save in flight
        assert fs.ls(dirpath) == [bare]
        assert mc._find_last_checkpoints(trainer) == {bare}
        assert not fs.exists(f"{dirpath}/other.ckpt")
        ckptfmt.save({"x": 1}, url, storage_options=store["options"])
    finally:
        handle._finish(None)
    assert fs.info(url)["size"] == len(_objects(store)["run/ckpts/last.ckpt"])
    io.save_checkpoint({"w": torch.ones(1 << 20)}, f"{dirpath}/real.ckpt")
    assert fs.isfile(f"{dirpath}/real.ckpt")  # in flight or done: there either way
    io.teardown()
    assert sorted(fs.ls(dirpath)) == [bare, f"{store['bucket']}/run/ckpts/real.ckpt"]
    io.remove_checkpoint(f"{dirpath}/real.ckpt")
    assert not fs.exists(f"{dirpath}/real.ckpt")  # no cached listing still shows it
    assert _no_save_threads()


def test_back_to_back_saves_in_flight_keep_both_checkpoints(store: dict[str, Any]) -> None:
    """A non-blocking save followed at once by another of the same ModelCheckpoint name: the
    second save sees the first (still in flight or done) and takes the next -vN name."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem

    io = _plugin(store, blocking=False)
    dirpath = f"{store['root']}/ckpts"
    trainer = _boring_trainer(pl, store["root"])
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath, filename="same")
    mc._fs = get_filesystem(dirpath)
    first = {"w": torch.full((4 << 20,), 1.0)}  # 16 MiB: two parts of a multipart upload
    second = {"w": torch.full((4 << 20,), 2.0)}
    paths = []
    for state in (first, second):
        path = mc._get_metric_interpolated_filepath_name({}, trainer)
        io.save_checkpoint(state, path)
        paths.append(path)
    io.teardown()
    assert paths == [f"{dirpath}/same.ckpt", f"{dirpath}/same-v1.ckpt"]
    for path, state in zip(paths, (first, second)):
        assert torch.equal(io.load_checkpoint(path)["w"], state["w"])
    assert _no_save_threads()


def test_nonblocking_saves_never_take_each_others_names_on_the_store(store: dict[str, Any]) -> None:
    """Lightning's test_ckpt_version_after_rerun_same_trainer with a non-blocking plugin and
    an s3:// dirpath: every epoch's object is kept under its own -vN name."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    dirpath = f"{store['root']}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = _boring_trainer(
        pl, store["root"], max_epochs=2, callbacks=[mc], plugins=[_plugin(store, blocking=False)]
    )
    trainer.fit(BoringModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(BoringModel())
    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {pathlib.PurePosixPath(f).name for f in mc.best_k_models} == expected
    assert set(_objects(store)) == {f"run/ckpts/{n}" for n in expected}
    assert _no_save_threads()


# ---------------------------------------------------------------------------
# the plugin on a store: pickling, other protocols


def test_plugin_with_storage_options_pickles(store: dict[str, Any]) -> None:
    import copy
    import pickle

    io = _plugin(store, blocking=False)
    io.save_checkpoint({"w": torch.ones(1 << 18)}, f"{store['root']}/a.ckpt")  # possibly in flight
    for other in (pickle.loads(pickle.dumps(io)), copy.deepcopy(io)):
        assert other.storage_options == io.storage_options
        other.save_checkpoint({"w": torch.zeros(2)}, f"{store['root']}/b.ckpt")
        other.teardown()
        assert torch.equal(other.load_checkpoint(f"{store['root']}/b.ckpt")["w"], torch.zeros(2))
    io.teardown()
    assert torch.equal(io.load_checkpoint(f"{store['root']}/a.ckpt")["w"], torch.ones(1 << 18))


def test_model_checkpoint_on_the_store_pickles_with_its_filesystem(store: dict[str, Any]) -> None:
    """ddp_spawn pickles the Trainer's callbacks: ModelCheckpoint's s3:// filesystem (the
    plugin's s3fs subclass) pickles by name and still sees saves in flight afterwards."""
    import copy
    import pickle

    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem

    from ckptfmt.integrations.lightning import filesystems

    _plugin(store)
    dirpath = f"{store['root']}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath)
    mc._fs = get_filesystem(dirpath)
    for other in (pickle.loads(pickle.dumps(mc)), copy.deepcopy(mc)):
        assert type(other._fs) is type(mc._fs) and type(mc._fs).__name__ == "_InFlight_s3"
    url = f"{dirpath}/last.ckpt"
    handle = ckptfmt.SaveHandle(url)
    filesystems.IN_FLIGHT.add(url, handle)
    try:
        assert pickle.loads(pickle.dumps(mc))._fs.isfile(url)
    finally:
        handle._finish(None)


def test_bad_storage_options_are_refused_at_construction() -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    with pytest.raises(ValueError, match="unknown storage option 'compression'"):
        CkptfmtCheckpointIO(storage_options={"compression": "zstd"})


def test_a_missing_bucket_is_named(store: dict[str, Any]) -> None:
    """A bucket that is not there: errors naming the URL, not botocore's."""
    io = _plugin(store)
    url = f"{store['root']}/a.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, url)
    missing_bucket = f"s3://{store['bucket']}-absent/run/a.ckpt"
    with pytest.raises(FileNotFoundError, match="-absent"):
        io.load_checkpoint(missing_bucket)
    with pytest.raises((ckptfmt.CheckpointError, FileNotFoundError), match="-absent"):
        io.save_checkpoint({"w": torch.ones(3)}, missing_bucket)


def test_per_call_storage_options_reach_the_client(store: dict[str, Any]) -> None:
    """Trainer.save_checkpoint(url, storage_options=...) on s3://: client settings over the
    plugin's own (another endpoint is used: it fails, naming the URL), ckptfmt's save options
    (compression), and an unknown setting refused naming the URL."""
    import re

    io = _plugin(store)
    url = f"{store['root']}/a.ckpt"
    io.save_checkpoint(
        {"w": torch.zeros(1 << 16)}, url, storage_options={"compression": "zstd", "max_attempts": 2}
    )
    assert len(_objects(store)["run/a.ckpt"]) < (1 << 16)
    other = f"{store['root']}/b.ckpt"
    with pytest.raises(ckptfmt.StorageError, match=re.escape(other)):
        io.save_checkpoint(
            {"w": torch.zeros(3)}, other, storage_options={"endpoint_url": "http://127.0.0.1:9"}
        )
    with pytest.raises(ValueError, match=re.escape(url) + ": unknown storage option 'bogus'"):
        io.save_checkpoint({}, url, storage_options={"bogus": 1})
    assert set(_objects(store)) == {"run/a.ckpt"}
    assert torch.equal(io.load_checkpoint(url)["w"], torch.zeros(1 << 16))
