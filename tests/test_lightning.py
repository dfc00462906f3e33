"""ckptfmt's Lightning plugin against the real `lightning` and `pytorch_lightning` packages.

A small LightningModule (dropout, AdamW, StepLR) trains on CPU with a shuffling
DataLoader that draws its order from the global torch generator, a validation
loader, and ModelCheckpoint(save_last=True, save_top_k=2).  The runs happen in
child processes (this file is also the child program, see `child()`):

* "train": in one process, the uninterrupted 4-epoch run, then 2-epoch runs
  that stop (blocking saves, non-blocking saves, Lightning's default IO);
* "resume": a fresh process resumes a stopped run with fit(ckpt_path="last")
  and trains to epoch 4, with pickle and torch.load made to raise (ckptfmt) or
  with Lightning's default IO (the control).

The resumed run must continue the uninterrupted one bit-exactly: every
per-step loss, the final weights, optimizer state, loop counters and RNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from trainer_helpers import ban_pickle, run_child

import ckptfmt
from ckptfmt.format.sniff import sniff
from ckptfmt.integrations import objects

needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None or importlib.util.find_spec("pytorch_lightning") is None,
    reason="needs ckptfmt[lightning] (lightning and pytorch-lightning)",
)

EPOCHS = 4
STOP_AFTER = 2


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Schedule:
    step_size: int = 3
    gamma: float = 0.5


# ---------------------------------------------------------------------------
# the child program


def _make_module_class(pl: Any) -> Any:
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(
            self,
            config: argparse.Namespace | None = None,
            data_dir: pathlib.Path | None = None,
            mode: Mode = Mode.FAST,
            schedule: Schedule | None = None,
            tags: frozenset[str] = frozenset(),
            lr: float = 1e-2,
        ) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = self.hparams.schedule or Schedule()
            step_size = sched["step_size"] if isinstance(sched, dict) else sched.step_size
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.5)]

    return Net


def _loaders() -> tuple[Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1234)  # the data itself; the order comes from the global generator
    x = torch.randn(96, 16, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(96, 1, generator=g)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16)
    return train, val


def _hparams(kind: str) -> dict[str, Any]:
    if kind == "plain":
        return {"lr": 1e-2}
    return {
        "config": argparse.Namespace(width=32, name="mlp"),
        "data_dir": pathlib.Path("/data/set"),
        "mode": Mode.SLOW,
        "schedule": Schedule(step_size=3),
        "tags": frozenset({"a", "b"}),
        "lr": 1e-2,
    }


def _fit(pl: Any, out: str, *, epochs: int, io: str, hparams: str, resume: bool, **fit_kwargs: Any) -> Any:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    pl.seed_everything(7, verbose=False)
    model = _make_module_class(pl)(**_hparams(hparams))
    train, val = _loaders()
    plugins = [] if io == "default" else [CkptfmtCheckpointIO(blocking=io != "ckptfmt-nb")]
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=os.path.join(out, "ckpts"), monitor="val_loss", save_top_k=2, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        plugins=plugins,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2,
    )
    trainer.fit(model, train, val, ckpt_path="last" if resume else None, **fit_kwargs)
    return trainer, model


def _record(out: str, trainer: Any, model: Any) -> None:
    os.makedirs(out, exist_ok=True)
    final = {
        "model": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "loops": {"global_step": trainer.global_step, "epoch": trainer.current_epoch},
        "fit_loop": trainer.fit_loop.state_dict(),
        "rng": ckptfmt.capture_rng(),
    }
    ckptfmt.save(objects.encode(final), os.path.join(out, "final.ckpt"))
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump([v.hex() for v in model.losses], f)


def child(argv: list[str]) -> None:
    what, package, base = argv
    torch.set_num_threads(1)
    if package == "lightning":
        import lightning.pytorch as pl
    else:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    import warnings

    warnings.filterwarnings("ignore")
    if what == "train":
        runs = [
            ("full", EPOCHS, "ckptfmt", "objects"),
            ("blocking", STOP_AFTER, "ckptfmt", "objects"),
            ("nonblocking", STOP_AFTER, "ckptfmt-nb", "objects"),
            ("default", STOP_AFTER, "default", "objects"),
        ]
        if package != "lightning":
            runs = [("nonblocking", STOP_AFTER, "ckptfmt-nb", "objects")]
        for name, epochs, io, hp in runs:
            out = os.path.join(base, name)
            trainer, model = _fit(pl, out, epochs=epochs, io=io, hparams=hp, resume=False)
            _record(out, trainer, model)
    elif what == "resume":
        out = os.path.join(base, "nonblocking")
        import ckptfmt.integrations.lightning  # noqa: F401 - imported before the ban, as an application would

        ban_pickle()
        trainer, model = _fit(pl, out, epochs=EPOCHS, io="ckptfmt", hparams="objects", resume=True)
        _record(os.path.join(out, "resumed"), trainer, model)
    elif what == "resume-default":
        out = os.path.join(base, "default")
        report: dict[str, str] = {}
        try:
            _fit(pl, out, epochs=EPOCHS, io="default", hparams="objects", resume=True)
        except Exception as e:  # what Lightning's default load does with Namespace/Path hparams
            report["error"] = f"{type(e).__name__}: {e}"
        trainer, model = _fit(
            pl, out, epochs=EPOCHS, io="default", hparams="objects", resume=True, weights_only=False
        )
        _record(os.path.join(out, "resumed"), trainer, model)
        with open(os.path.join(out, "resumed", "report.json"), "w") as f:
            json.dump(report, f)
    else:
        raise SystemExit(f"unknown child command {what}")


# ---------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = str(tmp_path_factory.mktemp("lightning"))
    pl_base = os.path.join(base, "pl")
    os.makedirs(pl_base)

    trained = threading.Event()

    def chain_lightning() -> None:
        try:
            run_child(__file__, "train", "lightning", base)
            # the files as the stopped run left them (the resumed run goes on writing there)
            shutil.copytree(os.path.join(base, "nonblocking"), os.path.join(base, "nonblocking-stopped"))
        finally:
            trained.set()
        run_child(__file__, "resume", "lightning", base)

    def chain_pl() -> None:
        run_child(__file__, "train", "pytorch_lightning", pl_base)
        run_child(__file__, "resume", "pytorch_lightning", pl_base)
        trained.wait()
        run_child(__file__, "resume-default", "lightning", base)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(chain_lightning), pool.submit(chain_pl)]
        for f in futures:
            f.result()
    return {"base": base, "pl": pl_base}


def _losses(directory: str) -> list[float]:
    with open(os.path.join(directory, "losses.json")) as f:
        return [float.fromhex(v) for v in json.load(f)]


def _final(directory: str) -> Any:
    return ckptfmt.load(os.path.join(directory, "final.ckpt"))


def _renamed(obj: Any, old: str, new: str) -> Any:
    """`obj` with `old` replaced by `new` in every string, dict keys included."""
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, dict):
        return type(obj)((_renamed(k, old, new), _renamed(v, old, new)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_renamed(v, old, new) for v in obj)
    return obj


def _diff(a: Any, b: Any, path: str = "state") -> list[str]:
    """Places where a and b differ (tensors and arrays bit for bit)."""
    import numpy as np

    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
            )
        )
        return [] if same else [f"{path}: tensors differ"]
    if isinstance(a, np.ndarray):
        return [] if a.dtype == b.dtype and a.tobytes() == b.tobytes() else [f"{path}: arrays differ"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and a != a and b != b:
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _steps_per_epoch() -> int:
    return 64 // 8


@needs_lightning
def test_resume_is_bit_exact(runs: dict[str, str]) -> None:
    full = os.path.join(runs["base"], "full")
    resumed = os.path.join(runs["base"], "nonblocking", "resumed")
    done = STOP_AFTER * _steps_per_epoch()
    expected = _losses(full)
    assert len(expected) == EPOCHS * _steps_per_epoch()
    assert _losses(resumed) == expected[done:]  # every per-step loss, bit for bit
    problems = _diff(_final(full), _final(resumed))
    assert problems == [], problems[:10]  # weights, optimizer, scheduler, loop counters, RNG


@needs_lightning
def test_stopped_runs_match_the_uninterrupted_one(runs: dict[str, str]) -> None:
    expected = _losses(os.path.join(runs["base"], "full"))[: STOP_AFTER * _steps_per_epoch()]
    for name in ("blocking", "nonblocking", "default"):
        assert _losses(os.path.join(runs["base"], name)) == expected, name


@needs_lightning
def test_pytorch_lightning_package_resumes_bit_exact(runs: dict[str, str]) -> None:
    """The same plugin object in `pytorch_lightning`'s Trainer (its own copy of CheckpointIO)."""
    full = os.path.join(runs["base"], "full")
    resumed = os.path.join(runs["pl"], "nonblocking", "resumed")
    assert _losses(resumed) == _losses(full)[STOP_AFTER * _steps_per_epoch() :]
    final_full, final_resumed = _final(full), _final(resumed)
    del final_full["fit_loop"], final_resumed["fit_loop"]  # same counters, package-specific layout details
    problems = _diff(final_full, final_resumed)
    assert problems == [], problems[:10]


@needs_lightning
def test_checkpoints_are_ckptfmt_files(runs: dict[str, str]) -> None:
    for name in ("blocking", "nonblocking"):
        directory = os.path.join(runs["base"], name, "ckpts")
        files = sorted(os.listdir(directory))
        assert "last.ckpt" in files and len(files) == 3, files  # last + top 2, no temp files left
        for f in files:
            path = os.path.join(directory, f)
            assert sniff(path) == "ckptfmt", path
            assert ckptfmt.verify(path).ok
    default = os.path.join(runs["base"], "default", "ckpts", "last.ckpt")
    assert sniff(default) == "torch-zip"


@needs_lightning
def test_nonblocking_files_equal_blocking_ones(runs: dict[str, str]) -> None:
    """Non-blocking saves hold the values at the time of the call, although training went on."""
    blocking = os.path.join(runs["base"], "blocking")
    nonblocking = os.path.join(runs["base"], "nonblocking-stopped")
    names = sorted(os.listdir(os.path.join(blocking, "ckpts")))
    assert names == sorted(os.listdir(os.path.join(nonblocking, "ckpts")))
    for name in names:
        a = ckptfmt.load(os.path.join(blocking, "ckpts", name))
        b = ckptfmt.load(os.path.join(nonblocking, "ckpts", name))
        problems = _diff(_renamed(a, blocking, os.path.join(runs["base"], "nonblocking")), b)
        assert problems == [], (name, problems[:10])
    # and the saved weights are not simply the final ones: the two epochs' files differ
    epoch_files = [n for n in names if n.startswith("epoch=")]
    w = [ckptfmt.load(os.path.join(nonblocking, "ckpts", n))["state_dict"] for n in epoch_files]
    assert _diff(w[0], w[1]) != []


@needs_lightning
def test_saved_dict_holds_rng_and_allow_listed_objects(runs: dict[str, str]) -> None:
    from ckptfmt.integrations.lightning import RNG_KEY, load_checkpoint

    path = os.path.join(runs["base"], "blocking", "ckpts", "last.ckpt")
    raw = ckptfmt.load(path)
    assert set(raw[RNG_KEY]) == {"version", "python", "numpy", "torch_cpu", "accelerators"}
    assert raw["hyper_parameters"]["config"] == {
        objects.TAG: "argparse.Namespace",
        "fields": {"width": 32, "name": "mlp"},
    }
    loaded = load_checkpoint(path)
    assert RNG_KEY not in loaded
    hp = loaded["hyper_parameters"]
    assert hp["config"] == argparse.Namespace(width=32, name="mlp")
    assert hp["data_dir"] == pathlib.Path("/data/set")
    assert hp["mode"] == "slow"  # not registered: the value
    assert hp["schedule"] == {"step_size": 3, "gamma": 0.5}
    assert hp["tags"] == frozenset({"a", "b"})
    typed = load_checkpoint(path, classes=[Mode, Schedule])["hyper_parameters"]
    assert typed["mode"] is Mode.SLOW and typed["schedule"] == Schedule(step_size=3)


@needs_lightning
def test_default_io_is_not_bit_exact_and_refuses_objects(runs: dict[str, str]) -> None:
    """The controls: Lightning's own checkpoints in the same scenario."""
    out = os.path.join(runs["base"], "default", "resumed")
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    assert "weights_only" in report.get("error", ""), report  # Namespace/Path hparams refused by default
    done = STOP_AFTER * _steps_per_epoch()
    expected = _losses(os.path.join(runs["base"], "full"))[done:]
    got = _losses(out)
    assert len(got) == len(expected) and got != expected  # resumed, but the random streams diverged
    assert _diff(_final(os.path.join(runs["base"], "full"))["model"], _final(out)["model"]) != []


# ---------------------------------------------------------------------------
# the plugin in this process


@needs_lightning
def test_plugin_is_a_checkpoint_io_of_both_packages() -> None:
    import lightning.fabric.plugins.io.checkpoint_io as a
    import lightning_fabric.plugins.io.checkpoint_io as b

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO()
    assert isinstance(io, a.CheckpointIO) and isinstance(io, b.CheckpointIO)


@needs_lightning
def test_load_from_checkpoint_builds_the_module(runs: dict[str, str]) -> None:
    import lightning.pytorch as pl

    from ckptfmt.integrations.lightning import load_checkpoint, load_from_checkpoint

    path = os.path.join(runs["base"], "blocking", "ckpts", "last.ckpt")
    net = load_from_checkpoint(_make_module_class(pl), path, classes=[Mode, Schedule])
    assert net.hparams.mode is Mode.SLOW and net.hparams.config == argparse.Namespace(width=32, name="mlp")
    assert _diff(dict(net.state_dict()), dict(load_checkpoint(path)["state_dict"])) == []


@needs_lightning
def test_rng_is_restored_on_load_unless_disabled(tmp_path: pathlib.Path) -> None:
    import random

    from ckptfmt.integrations.lightning import RNG_KEY, CkptfmtCheckpointIO

    path = str(tmp_path / "sub" / "x.ckpt")  # the directory is created
    io = CkptfmtCheckpointIO()
    io.save_checkpoint({"step": 3}, path)
    expected = (torch.rand(3), random.random())
    assert io.load_checkpoint(path) == {"step": 3}  # the reserved key is removed
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    CkptfmtCheckpointIO(restore_rng=False).load_checkpoint(path)
    assert not torch.equal(torch.rand(3), expected[0])
    with pytest.raises(ValueError, match=RNG_KEY):
        io.save_checkpoint({RNG_KEY: 1}, path)


@needs_lightning
def test_unsupported_object_is_refused_before_writing(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = tmp_path / "x.ckpt"
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"act": torch.relu, "ok": 1}}
    with pytest.raises(
        ckptfmt.UnsupportedObjectError, match=r"state\['hyper_parameters'\]\['act'\]: cannot store"
    ):
        CkptfmtCheckpointIO().save_checkpoint(checkpoint, path)
    assert list(tmp_path.iterdir()) == []


@needs_lightning
def test_storage_options(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO()
    path = tmp_path / "z.ckpt"
    io.save_checkpoint({"w": torch.zeros(1 << 16)}, path, storage_options={"compression": "zstd"})
    assert path.stat().st_size < (1 << 16)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.zeros(1 << 16))
    with pytest.raises(ValueError, match=r"z\.ckpt: storage_options \['bucket'\] apply to s3:// and other"):
        io.save_checkpoint({}, path, storage_options={"bucket": "s3"})
    with pytest.raises(ValueError, match="storage_options must be None or a dict"):
        io.save_checkpoint({}, path, storage_options="my instance storage options")
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # already gone: no error, as Lightning's own plugin
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(path)


@needs_lightning
def test_nonblocking_errors_surface_at_next_save_and_teardown(tmp_path: pathlib.Path) -> None:
    """A real write error (EFBIG under RLIMIT_FSIZE) in the background."""
    import resource
    import signal

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO(blocking=False)
    big = {"w": torch.ones(1 << 20)}
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def failing_save(name: str) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        try:
            io.save_checkpoint(big, tmp_path / name)  # returns: the write fails later
            ckptfmt.background.inflight.wait_for_path(tmp_path / name)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)

    try:
        failing_save("a.ckpt")
        with pytest.raises(OSError, match="a.ckpt") as info:
            io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b.ckpt")
        assert info.value.errno == 27  # EFBIG
        assert not (tmp_path / "b.ckpt").exists()  # the failed save's error comes first
        failing_save("c.ckpt")
        with pytest.raises(OSError, match="c.ckpt"):
            io.teardown()
        io.teardown()  # reported once
    finally:
        signal.signal(signal.SIGXFSZ, old_handler)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "d.ckpt")
    io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.ckpt"]  # no temp files left


@needs_lightning
def test_fabric_save_and_load(tmp_path: pathlib.Path) -> None:
    from lightning.fabric import Fabric

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[CkptfmtCheckpointIO(blocking=False)])
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 5, "cfg": argparse.Namespace(a=1)})
    fabric.strategy.checkpoint_io.teardown()
    assert sniff(path) == "ckptfmt"
    fresh = torch.nn.Linear(4, 2)
    state = {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1)}
    rest = fabric.load(path, state)
    assert rest == {"step": 5, "cfg": argparse.Namespace(a=1)}
    assert torch.equal(fresh.weight, model.weight)


# ---------------------------------------------------------------------------
# as Lightning's own tests use it (issue 25)


def _boring_trainer(pl: Any, root: str, **kwargs: Any) -> Any:
    """A quiet CPU Trainer for Lightning's BoringModel, 1 batch per epoch."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "limit_train_batches": 1,
        "limit_val_batches": 1,
        "default_root_dir": root,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def _fit_net(pl: Any, plugin: Any, dirpath: str, *, epochs: int, ckpt_path: str | None = None) -> Any:
    pl.seed_everything(7, verbose=False)
    model = _make_module_class(pl)(**_hparams("objects"))
    train, val = _loaders()
    mc = pl.callbacks.ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
    trainer = _boring_trainer(
        pl,
        dirpath,
        max_epochs=epochs,
        callbacks=[mc],
        plugins=[plugin],
        limit_train_batches=None,
        limit_val_batches=None,
        num_sanity_val_steps=2,
    )
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return trainer, model


def _final_state(trainer: Any, model: Any) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "loops": {"global_step": trainer.global_step, "epoch": trainer.current_epoch},
        "rng": ckptfmt.capture_rng(),
    }


@needs_lightning
def test_plugin_pickles_and_deep_copies_with_saves_in_flight(tmp_path: pathlib.Path) -> None:
    import copy
    import pickle

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO(blocking=False, compression="zstd", classes=[Mode])
    io.save_checkpoint({"w": torch.ones(1 << 18)}, tmp_path / "a.ckpt")  # possibly still in flight
    for other in (pickle.loads(pickle.dumps(io)), copy.deepcopy(io)):
        assert (other.blocking, other.compression, other.classes) == (False, "zstd", (Mode,))
        other.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "b.ckpt")
        other.teardown()  # waits for its own save only
        assert torch.equal(other.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.zeros(2))
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(1 << 18))


@needs_lightning
def test_ddp_spawn_with_two_cpu_processes(tmp_path: pathlib.Path) -> None:
    """The Trainer, the plugin inside it, is pickled into 2 processes (gloo); rank 0 saves,
    and the main process gets the final weights back through the plugin."""
    import lightning_spawn_model

    report = lightning_spawn_model.fit_ddp_spawn(str(tmp_path))
    assert report == {
        "files": ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"],
        "weights_back": True,
    }
    for name in report["files"]:
        assert sniff(tmp_path / "ckpts" / name) == "ckptfmt"


@needs_lightning
def test_nonblocking_saves_never_take_each_others_names(tmp_path: pathlib.Path) -> None:
    """Lightning's test_ckpt_version_after_rerun_same_trainer with a non-blocking plugin: every
    epoch's file is kept under its own -vN name, and no save thread outlives fit."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    mc = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = _boring_trainer(
        pl, str(tmp_path), max_epochs=2, callbacks=[mc], plugins=[CkptfmtCheckpointIO(blocking=False)]
    )
    trainer.fit(BoringModel())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(BoringModel())
    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {pathlib.Path(f).name for f in mc.best_k_models} == expected
    assert set(os.listdir(tmp_path)) == expected
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckptfmt-save")]


@needs_lightning
def test_a_save_in_flight_is_seen_as_the_file_it_will_be(tmp_path: pathlib.Path) -> None:
    """What ModelCheckpoint asks (file_exists, and ls for `last` files) through fsspec, while a
    save is in flight: held in flight here by an unfinished handle, so the answer is certain."""
    import fsspec
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import get_filesystem

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, filesystems

    io = CkptfmtCheckpointIO(blocking=False)  # registers the filesystem
    trainer = _boring_trainer(pl, str(tmp_path))
    mc = pl.callbacks.ModelCheckpoint(dirpath=tmp_path)
    mc._fs = get_filesystem(str(tmp_path))
    path = str(tmp_path / "last.ckpt")
    temp = tmp_path / ".last.ckpt.ckptfmt-tmp.1-2-3.abcd"
    temp.write_bytes(b"")
    handle = ckptfmt.SaveHandle(path)
    filesystems.IN_FLIGHT.add(filesystems.local_key(path), handle)
    fs = fsspec.filesystem("file")
    try:
        assert mc.file_exists(path, trainer) and fs.isfile(path) and fs.exists(f"file://{path}")
        assert fs.ls(str(tmp_path)) == [path]  # the final name, not the temp file
        assert mc._find_last_checkpoints(trainer) == {path}
        assert not fs.exists(str(tmp_path / "other.ckpt"))
        temp.unlink()
        ckptfmt.save({"x": 1}, path + ".tmp")
        os.replace(path + ".tmp", path)
    finally:
        handle._finish(None)
    assert fs.info(path)["size"] == os.path.getsize(path)  # details are the written file's
    io.save_checkpoint({"w": torch.ones(1 << 20)}, tmp_path / "real.ckpt")
    assert fs.isfile(str(tmp_path / "real.ckpt"))  # in flight or done: there either way
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "real.ckpt"]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckptfmt-save")]


@needs_lightning
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_enable_makes_load_from_checkpoint_read_ckptfmt_files(tmp_path: pathlib.Path, package: str) -> None:
    """The standard call, after the one-line opt-in; torch files still load as before."""
    import importlib

    pl = importlib.import_module(package)
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, enable

    enable()
    enable()  # idempotent: one wrapper, not two
    saving = importlib.import_module(f"{package}.core.saving")
    assert saving.pl_load.__ckptfmt_wraps__.__module__.endswith("cloud_io")
    net_class = _make_module_class(pl)
    trainer = _boring_trainer(pl, str(tmp_path), plugins=[CkptfmtCheckpointIO()])
    model = net_class(**_hparams("objects"))
    train, _ = _loaders()
    trainer.fit(model, train)
    path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(path)
    assert sniff(path) == "ckptfmt"
    loaded = net_class.load_from_checkpoint(path, lr=0.5)
    assert loaded.hparams.config == argparse.Namespace(width=32, name="mlp") and loaded.hparams.lr == 0.5
    assert _diff(dict(loaded.state_dict()), dict(model.state_dict())) == []
    default = _boring_trainer(pl, str(tmp_path))  # Lightning's own TorchCheckpointIO
    default.fit(net_class(), train)
    torch_path = str(tmp_path / "torch.ckpt")
    default.save_checkpoint(torch_path)
    assert sniff(torch_path) == "torch-zip"
    from_torch = net_class.load_from_checkpoint(torch_path, weights_only=False)  # our file: Mode is in it
    assert _diff(dict(from_torch.state_dict()), dict(default.model.state_dict())) == []


@needs_lightning
def test_a_run_switches_from_torch_checkpoints_when_allowed(tmp_path: pathlib.Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    def trainer(epochs: int, plugins: list[Any]) -> Any:
        mc = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, save_top_k=0)
        return _boring_trainer(pl, str(tmp_path), max_epochs=epochs, callbacks=[mc], plugins=plugins)

    trainer(1, []).fit(BoringModel())  # Lightning's default CheckpointIO
    last = tmp_path / "ckpts" / "last.ckpt"
    assert sniff(last) == "torch-zip"
    with pytest.raises(ckptfmt.UnsupportedError, match="read_torch_checkpoints=True"):
        trainer(2, [CkptfmtCheckpointIO()]).fit(BoringModel(), ckpt_path=str(last))
    resumed = trainer(2, [CkptfmtCheckpointIO(read_torch_checkpoints=True)])
    resumed.fit(BoringModel(), ckpt_path=str(last))
    assert resumed.global_step == 2 and sniff(last) == "ckptfmt"  # resumed at step 1, saved as ckptfmt
    assert CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(last)["global_step"] == 2
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hook": print}, evil)  # only torch.load(weights_only=False) would run this
    with pytest.raises(
        ckptfmt.UnsupportedError,
        match=r"weights_only=True\) refuses it: Unsupported global: GLOBAL (builtins\.)?print",
    ):
        CkptfmtCheckpointIO(read_torch_checkpoints=True).load_checkpoint(evil)


@needs_lightning
def test_unknown_protocols_are_refused_and_missing_filesystems_named(tmp_path: pathlib.Path) -> None:
    """Every fsspec protocol goes through its filesystem (test_lightning_fsspec.py); one fsspec
    does not know is refused by name, one whose package is missing gets fsspec's advice."""
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, RemotePathError

    io = CkptfmtCheckpointIO()
    for call in (
        lambda: io.save_checkpoint({}, "nosuch://bucket/run/last.ckpt"),
        lambda: io.load_checkpoint("nosuch://bucket/last.ckpt"),
        lambda: io.remove_checkpoint("nosuch://bucket/last.ckpt"),
    ):
        with pytest.raises(RemotePathError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and message.startswith("nosuch://bucket/")
        assert "no filesystem for the nosuch:// protocol" in message
        assert isinstance(info.value, ckptfmt.CheckpointError) and isinstance(info.value, ValueError)
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(ImportError, match="install gcsfs"):
            io.save_checkpoint({}, "gcs://bucket/run/last.ckpt")  # gcsfs's form (gs:// is ckptfmt's)
    io.save_checkpoint({"x": 1}, f"file://{tmp_path}/local.ckpt")  # a local URL is a local path
    assert io.load_checkpoint(tmp_path / "local.ckpt") == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["local.ckpt"]


def _class_keyed_callback(pl: Any) -> type:
    """A callback whose state_key is its class (as before Lightning 1.5), defined at module
    level under this module's name, where an imported class is found by its name."""

    class ClassKeyedCallback(pl.Callback):
        def __init__(self) -> None:
            self.loaded: dict[str, Any] = {}

        @property
        def state_key(self) -> Any:
            return type(self)

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 3}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = state_dict

    ClassKeyedCallback.__qualname__ = "ClassKeyedCallback"
    globals()["ClassKeyedCallback"] = ClassKeyedCallback
    return ClassKeyedCallback


@needs_lightning
def test_callback_state_keyed_by_a_class_round_trips(tmp_path: pathlib.Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckptfmt.integrations.lightning import CLASS_KEYS_KEY, CkptfmtCheckpointIO, load_checkpoint

    callback_class = _class_keyed_callback(pl)
    first = _boring_trainer(pl, str(tmp_path), callbacks=[callback_class()], plugins=[CkptfmtCheckpointIO()])
    first.fit(BoringModel())
    path = str(tmp_path / "c.ckpt")
    first.save_checkpoint(path)
    raw = ckptfmt.load(path)
    assert raw["callbacks"]["ClassKeyedCallback"] == {"seen": 3}  # keyed by name, as Lightning keys its own
    assert raw[CLASS_KEYS_KEY] == {"ClassKeyedCallback": __name__}
    assert load_checkpoint(path)["callbacks"][callback_class] == {"seen": 3}
    callback = callback_class()
    second = _boring_trainer(
        pl, str(tmp_path), max_epochs=2, callbacks=[callback], plugins=[CkptfmtCheckpointIO()]
    )
    second.fit(BoringModel(), ckpt_path=path)
    assert callback.loaded == {"seen": 3}


def _dataclass(fields: dict[str, Any]) -> dict[str, Any]:
    return {objects.TAG: "dataclass", "class": f"{__name__}.Frozen", "fields": fields}


@needs_lightning
@pytest.mark.parametrize(
    ("entries", "error", "where"),
    [
        ({"hyper_parameters": [1, 2]}, ckptfmt.CorruptError, "hyper_parameters: must be a dict, not list"),
        (
            {"hyper_parameters": {"__class__": 1}},
            ckptfmt.CorruptError,
            "'__class__' is not a hyper-parameter",
        ),
        ({"hyper_parameters": {3: 1}}, ckptfmt.CorruptError, "hyper_parameters: 3 is not a hyper-parameter"),
        ({"hparams_name": ["a"]}, ckptfmt.CorruptError, "hparams_name: must be a str, not list"),
        ({"hparams_type": 5}, ckptfmt.CorruptError, "hparams_type: must be a str, not int"),
        (
            {"hyper_parameters": {"config": {objects.TAG: "argparse.Namespace", "fields": {"__dict__": 1}}}},
            ckptfmt.CorruptError,
            r"state\['hyper_parameters'\]\['config'\]: field name '__dict__'",
        ),
        (
            {"hyper_parameters": {"frozen": _dataclass({"b": (1,)})}},
            ckptfmt.UnsupportedError,  # a registered class that changed since, like an unknown field
            r"state\['hyper_parameters'\]\['frozen'\]: .*Frozen needs field 'a'",
        ),
        (
            {"hyper_parameters": {"frozen": _dataclass({"a": 1, "z": 2})}},
            ckptfmt.UnsupportedError,
            r"state\['hyper_parameters'\]\['frozen'\]: .*Frozen has no field 'z'",
        ),
    ],
)
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_malformed_hyper_parameters_are_refused(
    tmp_path: pathlib.Path, package: str, entries: dict[str, Any], error: type, where: str
) -> None:
    """Through the package's load_from_checkpoint (after enable()), the plugin's function and its
    load: a ckptfmt error naming the place, never a TypeError or AttributeError from a constructor."""
    import importlib

    pl = importlib.import_module(package)
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO, enable, load_from_checkpoint

    enable()
    net_class = _make_module_class(pl)
    path = tmp_path / "bad.ckpt"
    state = {"state_dict": dict(net_class().state_dict()), "pytorch-lightning_version": "2.6.0"}
    ckptfmt.save({**state, "hyper_parameters": {"lr": 0.1}, **entries}, path)
    objects.register(Frozen)
    try:
        for load in (
            lambda: net_class.load_from_checkpoint(path),
            lambda: load_from_checkpoint(net_class, path),
            lambda: CkptfmtCheckpointIO().load_checkpoint(path),
        ):
            with pytest.raises(error, match=where):
                load()
    finally:
        objects.unregister(Frozen)


# ---------------------------------------------------------------------------
# the allow-listed objects


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: tuple[int, ...] = ()
    c: int = dataclasses.field(default=0, init=False)


class Point(tuple):  # a hand-made tuple subclass: not a named tuple, refused
    pass


def _everything() -> dict[str, Any]:
    import collections
    import types

    odict: Any = collections.OrderedDict([("w", torch.ones(2))])
    odict._metadata = {"": {"version": 1}}
    pt = collections.namedtuple("pt", ["x", "y"])  # noqa: PYI024
    globals()["pt"] = pt
    pt.__qualname__ = "pt"
    return {
        "ns": argparse.Namespace(lr=0.1, path=pathlib.Path("/a/b"), mode=Mode.FAST),
        "simple": types.SimpleNamespace(x=[1, 2]),
        "paths": [pathlib.PurePosixPath("/x"), pathlib.PureWindowsPath("C:\\x"), pathlib.Path("rel")],
        "sets": (set(), {3, 1, 2}, frozenset({"b", "a"})),
        "enums": {Color.RED: Mode.SLOW, "list": [Color.BLUE]},
        "frozen": Frozen(1, (2, 3)),
        "schedule": Schedule(),
        "point": pt(1, 2),
        "tagged": {objects.TAG: "not an object", "x": 1},
        "odict": odict,
        "plain": {"t": torch.arange(3), "n": None, (1, "a"): 2.5},
    }


def test_objects_round_trip_through_a_file(tmp_path: pathlib.Path) -> None:
    state = _everything()
    path = tmp_path / "o.ckpt"
    ckptfmt.save(objects.encode(state), path)
    raw = ckptfmt.load(path)
    typed = objects.decode(raw, classes=[Color, Mode, Frozen, Schedule, globals()["pt"]])
    assert typed["ns"] == state["ns"] and typed["simple"] == state["simple"]
    assert typed["paths"] == state["paths"] and type(typed["paths"][2]) is type(pathlib.Path("rel"))
    assert typed["sets"] == state["sets"] and type(typed["sets"][2]) is frozenset
    assert typed["enums"] == state["enums"] and next(iter(typed["enums"])) is Color.RED
    assert typed["frozen"] == state["frozen"] and typed["schedule"] == Schedule()
    assert typed["point"] == state["point"] and type(typed["point"]) is globals()["pt"]
    assert typed["tagged"] == state["tagged"]
    assert typed["odict"]._metadata == state["odict"]._metadata
    assert _diff(typed["plain"], state["plain"]) == []
    plain = objects.decode(raw)  # nothing registered: values, dicts and tuples
    assert plain["enums"] == {1: "slow", "list": [2]} and type(next(iter(plain["enums"]))) is int
    assert plain["frozen"] == {"a": 1, "b": (2, 3), "c": 0}
    assert plain["point"] == (1, 2) and type(plain["point"]) is tuple
    assert plain["ns"] == argparse.Namespace(lr=0.1, path=pathlib.Path("/a/b"), mode="fast")


def test_encode_copies_nothing_without_objects() -> None:
    state = {"model": {"w": torch.ones(2)}, "opt": [{"lr": 0.1, "betas": (0.9, 0.99)}], "rng": None}
    assert objects.encode(state) is state
    assert objects.decode(state) is state
    with_path = {"a": state["model"], "p": pathlib.Path("x")}
    out = objects.encode(with_path)
    assert out is not with_path and out["a"] is state["model"] and with_path["p"] == pathlib.Path("x")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (lambda: 0, "state['hp']"),
        (int, "state['hp']"),
        (__import__("collections").defaultdict(list), "state['hp']"),
        (Point((1, 2)), "state['hp']"),
        ({"deep": [argparse.Namespace(f=print)]}, "state['hp']['deep'][0].f"),
    ],
)
def test_objects_outside_the_allow_list_are_refused(value: Any, where: str) -> None:
    with pytest.raises(ckptfmt.UnsupportedObjectError) as info:
        objects.encode({"hp": value})
    assert str(info.value).startswith(f"{where}: cannot store"), str(info.value)


def test_decode_imports_nothing_and_rejects_unknown_or_malformed_tags() -> None:
    tag = objects.TAG
    assert "antigravity" not in sys.modules
    got = objects.decode({"e": {tag: "enum", "class": "antigravity.Fly", "name": "UP", "value": 1}})
    assert got == {"e": 1} and "antigravity" not in sys.modules
    got = objects.decode({tag: "dataclass", "class": "antigravity.Cfg", "fields": {"a": 1}})
    assert got == {"a": 1} and "antigravity" not in sys.modules
    with pytest.raises(ckptfmt.UnsupportedError, match=r"state\['x'\]: unknown object tag 'os.system'"):
        objects.decode({"x": {tag: "os.system", "fields": {}}}, source="f.ckpt")
    with pytest.raises(ckptfmt.CorruptError, match="'path' of a tagged object must be str"):
        objects.decode({tag: "pathlib.PosixPath", "path": 3})
    with pytest.raises(ckptfmt.CorruptError, match="expected fields"):
        objects.decode({tag: "argparse.Namespace", "fields": {}, "extra": 1})
    with pytest.raises(ckptfmt.CorruptError, match="not hashable"):
        objects.decode({tag: "builtins.dict", "items": [[[1], 2]]})


def test_registered_classes_and_changed_classes() -> None:
    saved = objects.encode({"c": Schedule(step_size=5), "m": Mode.SLOW})
    objects.register(Schedule, Mode)
    try:
        assert objects.decode(saved) == {"c": Schedule(step_size=5), "m": Mode.SLOW}
        assert set(objects.registered()) >= {f"{__name__}.Schedule", f"{__name__}.Mode"}
    finally:
        objects.unregister(Schedule, Mode)
    assert objects.decode(saved)["m"] == "slow"
    renamed = objects.encode({"c": Schedule()})
    renamed["c"]["fields"]["removed_field"] = 1
    with pytest.raises(ckptfmt.UnsupportedError, match="has no field 'removed_field'"):
        objects.decode(renamed, classes=[Schedule])
    gone = {"m": {objects.TAG: "enum", "class": f"{__name__}.Mode", "name": "GONE", "value": "gone"}}
    with pytest.warns(ckptfmt.CheckpointWarning, match="no member with value 'gone'"):
        assert objects.decode(gone, classes=[Mode]) == {"m": "gone"}
    with pytest.raises(TypeError, match="not an enum, a dataclass or a named tuple"):
        objects.register(Point)


def test_decode_refuses_dunder_fields_and_fields_a_registered_class_lacks() -> None:
    """Errors naming the place, not a TypeError from a constructor."""
    tag = objects.TAG
    with pytest.raises(ckptfmt.CorruptError, match=r"state\['ns'\]: field name '__class__' is not allowed"):
        objects.decode({"ns": {tag: "argparse.Namespace", "fields": {"__class__": 1}}})
    missing = {tag: "dataclass", "class": f"{__name__}.Frozen", "fields": {"b": []}}
    with pytest.raises(ckptfmt.UnsupportedError, match=r"state: .*Frozen needs field 'a'"):
        objects.decode(missing, classes=[Frozen])
    assert objects.decode(missing) == {"b": []}  # not registered: the dict of fields
    pt = type(_everything()["point"])  # a named tuple class, registered under this module's name
    for fields, what in (({"x": 1}, "needs field 'y'"), ({"x": 1, "y": 2, "z": 3}, "has no field 'z'")):
        with pytest.raises(ckptfmt.UnsupportedError, match=what):
            objects.decode({tag: "namedtuple", "class": f"{__name__}.pt", "fields": fields}, classes=[pt])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_lightning  # the classes above, under the module name the tests see

    test_lightning.child(sys.argv[1:])
