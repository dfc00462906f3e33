"""The Lightning plugin on fsspec URLs other than s3:// (``memory://`` here: fsspec's real
in-memory filesystem, as Lightning's own tests use), against the real `lightning` and
`pytorch_lightning` packages.

Such a checkpoint is written by ckptfmt to a local temporary file and uploaded with the
filesystem's put_file; a load fetches it into a local temporary file that ckptfmt reads.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import pickle
import tempfile
import threading
import warnings
from collections.abc import Iterator
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

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None or importlib.util.find_spec("pytorch_lightning") is None,
    reason="needs ckptfmt[lightning] (lightning and pytorch-lightning)",
)

PACKAGES = ["lightning.pytorch", "pytorch_lightning"]
MAGIC = b"\x89CKF\r\n\x1a\n"


@pytest.fixture
def root(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh folder on fsspec's in-memory filesystem; the local temporary folder is one of
    this test's, checked empty at the end (every temporary file removed)."""
    import fsspec

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    url = f"memory://{tmp_path.name}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
    assert [p.name for p in temp.iterdir() if "ckptfmt" in p.name] == []
    assert _no_save_threads()


def _files(url: str) -> dict[str, bytes]:
    """Every file beneath `url` on the memory filesystem, by name relative to it."""
    import fsspec

    fs = fsspec.filesystem("memory")
    base = fs._strip_protocol(url).rstrip("/") + "/"
    return {p[len(base) :]: fs.cat_file(p) for p in fs.find(url)}


def _no_save_threads() -> bool:
    return not [t.name for t in threading.enumerate() if t.name.startswith("ckptfmt-save")]


def _plugin(**kwargs: Any) -> Any:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    return CkptfmtCheckpointIO(**kwargs)


# ---------------------------------------------------------------------------
# fit, resume, top-k


@pytest.mark.parametrize("package", PACKAGES)
def test_fit_resumes_bit_exactly_from_a_memory_checkpoint(
    root: str, tmp_path: pathlib.Path, package: str
) -> None:
    """A run stopped after 2 of 4 epochs with non-blocking saves to memory://, resumed by a new
    Trainer with fit(ckpt_path="memory://.../last.ckpt"), continues the uninterrupted run bit for
    bit: every per-step loss, the weights, the optimizer and scheduler, the loops and the RNG."""
    pl = importlib.import_module(package)
    torch.set_num_threads(1)
    full_trainer, full = _fit_net(pl, _plugin(), str(tmp_path / "full"), epochs=4)
    expected = _final_state(full_trainer, full)
    dirpath = f"{root}/ckpts"
    _fit_net(pl, _plugin(blocking=False), dirpath, epochs=2)
    assert _no_save_threads()
    found = _files(dirpath)
    assert "last.ckpt" in found and len(found) == 3  # the top 2 and last
    assert all(data.startswith(MAGIC) for data in found.values())
    trainer, resumed = _fit_net(pl, _plugin(), dirpath, epochs=4, ckpt_path=f"{dirpath}/last.ckpt")
    assert resumed.losses == full.losses[2 * 8 :] and len(resumed.losses) == 2 * 8
    problems = _diff(expected, _final_state(trainer, resumed))
    assert problems == [], problems[:10]


def test_nonblocking_saves_never_take_each_others_names(root: str) -> None:
    """Lightning's test_ckpt_version_after_rerun_same_trainer with a non-blocking plugin and a
    memory:// dirpath: every epoch's file is kept under its own -vN name."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    dirpath = f"{root}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = _boring_trainer(pl, root, max_epochs=2, callbacks=[mc], plugins=[_plugin(blocking=False)])
    trainer.fit(BoringModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(BoringModel())
    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {pathlib.PurePosixPath(f).name for f in mc.best_k_models} == expected
    assert set(_files(dirpath)) == expected


@pytest.mark.parametrize("package", PACKAGES)
def test_top_k_removes_the_checkpoints_that_fall_out(root: str, package: str) -> None:
    """Non-blocking saves with save_top_k=2: remove_checkpoint waits for the upload in flight,
    then deletes through the filesystem; the kept files hold the weights of their epoch."""
    pl = importlib.import_module(package)
    BoringModel = importlib.import_module(f"{package}.demos.boring_classes").BoringModel
    dirpath = f"{root}/ckpts"
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True
    )
    trainer = _boring_trainer(pl, root, max_epochs=4, callbacks=[mc], plugins=[_plugin(blocking=False)])
    trainer.fit(BoringModel())
    assert set(_files(dirpath)) == {"epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt", "last.ckpt"}
    state = _plugin().load_checkpoint(mc.last_model_path)
    assert state["global_step"] == 4 and state["epoch"] == 3
    assert _diff(dict(state["state_dict"]), dict(trainer.lightning_module.state_dict())) == []


def test_a_save_in_flight_is_seen_as_the_file_it_will_be(root: str) -> None:
    """What ModelCheckpoint asks through fsspec (exists, isfile, ls) while an upload is in
    flight: held in flight here by an unfinished handle, so the answer is certain."""
    import fsspec
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem

    from ckptfmt.integrations.lightning import filesystems

    _plugin(blocking=False)  # registers the filesystem
    dirpath = f"{root}/ckpts"
    trainer = _boring_trainer(pl, root)
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath)
    mc._fs = get_filesystem(dirpath)
    fs = fsspec.filesystem("memory")
    assert type(mc._fs).__name__ == "_InFlight_memory" and isinstance(fs, type(mc._fs))
    url = f"{dirpath}/last.ckpt"
    bare = fs._strip_protocol(url)
    handle = ckptfmt.SaveHandle(url)
    filesystems.IN_FLIGHT.add(filesystems.url_key(fs, url), handle)
    try:
        assert mc.file_exists(url, trainer) and fs.isfile(url) and fs.exists(bare)
        assert fs.exists(dirpath)  # a folder holding only a save in flight
        assert fs.ls(dirpath, detail=False) == [bare]
        assert mc._find_last_checkpoints(trainer) == {bare}
        assert not fs.exists(f"{dirpath}/other.ckpt")
        restored = pickle.loads(pickle.dumps(mc))  # ddp_spawn pickles the callback and its fs
        assert type(restored._fs) is type(mc._fs) and restored._fs.isfile(url)
    finally:
        handle._finish(None)
    assert not fs.exists(url)


# ---------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("package", PACKAGES)
def test_enable_makes_load_from_checkpoint_read_memory_files(root: str, package: str) -> None:
    """LitModel.load_from_checkpoint("memory://...") after enable(): ckptfmt files through
    ckptfmt's reader; a file Lightning's own CheckpointIO wrote there still goes to its loader."""
    from ckptfmt.integrations.lightning import enable

    pl = importlib.import_module(package)
    enable()
    net_class = _make_module_class(pl)
    model = net_class(**_hparams("objects"))
    train, _ = _loaders()
    trainer = _boring_trainer(pl, root, plugins=[_plugin()])
    trainer.fit(model, train)
    url = f"{root}/model.ckpt"
    trainer.save_checkpoint(url)
    assert _files(root)["model.ckpt"].startswith(MAGIC)
    loaded = net_class.load_from_checkpoint(url, lr=0.5)
    assert loaded.hparams.data_dir == pathlib.Path("/data/set") and loaded.hparams.lr == 0.5
    assert _diff(dict(loaded.state_dict()), dict(model.state_dict())) == []
    default = _boring_trainer(pl, root)  # Lightning's TorchCheckpointIO, writing through fsspec
    default.fit(net_class(), train)
    default.save_checkpoint(f"{root}/torch.ckpt")
    assert _files(root)["torch.ckpt"].startswith(b"PK")
    from_torch = net_class.load_from_checkpoint(f"{root}/torch.ckpt", weights_only=False)
    assert _diff(dict(from_torch.state_dict()), dict(default.model.state_dict())) == []


def test_damage_and_absence_name_the_url(root: str) -> None:
    """A changed byte is found by ckptfmt's chunk checksums in the fetched copy, and the error
    names the URL, not the temporary file; an absent file is a FileNotFoundError naming it."""
    import fsspec

    io = _plugin()
    url = f"{root}/a.ckpt"
    io.save_checkpoint({"w": torch.arange(4096.0)}, url)
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(url))
    data[len(data) // 3] ^= 0x40  # inside the tensor's chunk
    fs.pipe_file(url, bytes(data))
    with pytest.raises(ckptfmt.CorruptError) as info:
        io.load_checkpoint(url)
    assert str(info.value).startswith(f"{url}: ") and "ckptfmt-download" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=f"{root}/none.ckpt"):
        io.load_checkpoint(f"{root}/none.ckpt")
    torch_url = f"{root}/t.ckpt"
    with fs.open(torch_url, "wb") as f:
        torch.save({"state_dict": {"w": torch.ones(2)}}, f)
    with pytest.raises(ckptfmt.UnsupportedError, match=f"^{torch_url}: written by torch.save"):
        io.load_checkpoint(torch_url)
    state = _plugin(read_torch_checkpoints=True).load_checkpoint(torch_url)
    assert torch.equal(state["state_dict"]["w"], torch.ones(2))


# ---------------------------------------------------------------------------
# removal, failures, options


def test_remove_checkpoint_waits_for_the_upload_and_deletes_one_file(root: str) -> None:
    io = _plugin(blocking=False)
    url = f"{root}/a.ckpt"
    io.save_checkpoint({"w": torch.ones(1 << 20)}, url)
    io.remove_checkpoint(url)  # waits for the upload in flight there, then deletes it
    io.remove_checkpoint(url)  # absent: nothing to do
    io.save_checkpoint({"w": torch.zeros(3)}, f"{root}/b.ckpt")
    io.save_checkpoint({"w": torch.zeros(4)}, f"{root}/sub/c.ckpt")
    io.remove_checkpoint(f"{root}/sub")  # a folder is never removed
    io.teardown()
    assert set(_files(root)) == {"b.ckpt", "sub/c.ckpt"}
    assert torch.equal(io.load_checkpoint(f"{root}/b.ckpt")["w"], torch.zeros(3))


def test_a_failed_upload_names_the_url(root: str) -> None:
    """The filesystem refuses the upload (a file where the folder would be): blocking, the save
    raises StorageError naming the URL; non-blocking, the next save or teardown does."""
    blocker = f"{root}/taken"
    _plugin().save_checkpoint({"x": 1}, blocker)
    url = f"{blocker}/a.ckpt"
    with pytest.raises(ckptfmt.StorageError, match=f"^{url}: uploading the checkpoint failed: ") as info:
        _plugin().save_checkpoint({"w": torch.ones(3)}, url)
    assert "\n" not in str(info.value)
    io = _plugin(blocking=False)
    io.save_checkpoint({"w": torch.ones(3)}, url)
    with pytest.raises(ckptfmt.StorageError, match=f"^{url}: uploading"):
        io.teardown()
    assert set(_files(root)) == {"taken"}


def test_storage_options_reach_the_filesystem(root: str, tmp_path: pathlib.Path) -> None:
    """Trainer.save_checkpoint(url, storage_options=...): entries other than ckptfmt's save
    options make the URL's filesystem (here fsspec's dir:// over memory://, which puts the file
    beneath `path`); compression applies as on a local file."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = _boring_trainer(pl, root, plugins=[_plugin()], enable_checkpointing=False)
    trainer.fit(BoringModel())
    options = {"path": f"{root}/under", "target_protocol": "memory", "compression": "zstd"}
    trainer.save_checkpoint("dir://x/model.ckpt", storage_options=options)
    found = _files(root)
    assert set(found) == {"under/x/model.ckpt"} and found["under/x/model.ckpt"].startswith(MAGIC)
    state = _plugin().load_checkpoint(f"{root}/under/x/model.ckpt")
    assert state["global_step"] == 1
    with pytest.raises(ValueError, match=r"model\.ckpt: storage_options \['path'\] apply to s3://"):
        trainer.save_checkpoint(tmp_path / "model.ckpt", storage_options={"path": "/x"})


def test_a_filesystem_without_a_view_is_written_blocking(root: str) -> None:
    """A non-blocking save to a protocol whose filesystem ckptfmt did not replace (dir://)
    could hide from Lightning while in flight: it is written blocking, with a warning."""
    io = _plugin(blocking=False)
    options = {"path": f"{root}/d", "target_protocol": "memory"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io.save_checkpoint({"w": torch.ones(2)}, "dir://a.ckpt", storage_options=options)
    assert [str(w.message) for w in caught if issubclass(w.category, ckptfmt.CheckpointWarning)]
    assert set(_files(root)) == {"d/a.ckpt"}  # there when save_checkpoint returned
    io.teardown()
