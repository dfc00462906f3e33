"""CkptfmtTrainer beside the stock ``transformers.Trainer``, in this process, on a two-parameter
regression model whose config class transformers does not know (as transformers' own tests
use it): a folder ckptfmt did not write is never deleted, rotation follows the Trainer's own
rules (the same folders are left), a stock run switches to ckptfmt, the errors the Trainer's
users catch, and no pickle in a checkpoint folder.  Each run takes well under a second."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import ckptfmt  # noqa: E402
from ckptfmt.files import multifile  # noqa: E402
from ckptfmt.integrations.transformers import CkptfmtTrainer  # noqa: E402
from ckptfmt.integrations.transformers.names import MARK_NAME  # noqa: E402


class RegressionConfig(PretrainedConfig):
    model_type = "ckptfmt-test-regression"  # registered nowhere: only the class knows it

    def __init__(self, a: float = 0.0, b: float = 0.0, noise: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.noise = noise  # drawn in training: a resume matches only with the RNG restored


class RegressionModel(PreTrainedModel):
    config_class = RegressionConfig

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> Any:
        y = input_x * self.a + self.b
        if self.training and getattr(self.config, "noise", 0.0):
            y = y + self.config.noise * torch.randn_like(y)
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


class Line(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """y = 2x + 3 at `n` points drawn from seed 0."""

    def __init__(self, n: int = 16) -> None:
        self.x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        self.y = 2 * self.x + 3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_x": self.x[i], "labels": self.y[i]}


def _args(out: str, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        max_steps=6,
        save_steps=1,
        per_device_train_batch_size=4,
        learning_rate=0.1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        seed=7,
    )
    if kw.get("load_best_model_at_end"):
        base.update(eval_strategy="steps", eval_steps=1, metric_for_best_model="loss")
    base.update(kw)
    return TrainingArguments(out, **base)


def _trainer(cls: type, out: str, **kw: Any) -> Any:
    torch.manual_seed(0)
    extra = kw.pop("ckptfmt", {})
    return cls(
        model=RegressionModel(RegressionConfig(noise=kw.pop("noise", 0.0))),
        args=_args(out, **kw),
        train_dataset=Line(),
        eval_dataset=Line(8),
        **extra,
    )


def _folders(out: str) -> list[str]:
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))


def _stock_run(out: str, **kw: Any) -> list[str]:
    _trainer(Trainer, out, **kw).train()
    return _folders(out)


def _tree(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


# -- 1. a folder ckptfmt did not write is never deleted --------------------------------------------


def test_stock_checkpoints_in_output_dir_are_never_deleted(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    _stock_run(out, max_steps=3)  # checkpoint-1..3, the stock Trainer's
    before = {n: _tree(os.path.join(out, n)) for n in _folders(out)}
    _trainer(CkptfmtTrainer, out, max_steps=5, save_steps=5, save_total_limit=5).train()
    assert _folders(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-5"]
    assert {n: _tree(os.path.join(out, n)) for n in before} == before
    ckptfmt.integrations.transformers.check_checkpoint(os.path.join(out, "checkpoint-5"))


def test_rotation_counts_stock_folders_as_the_trainer_does_and_leaves_them(tmp_path: Any) -> None:
    stock, ours = str(tmp_path / "stock"), str(tmp_path / "ours")
    for out, cls in ((stock, Trainer), (ours, CkptfmtTrainer)):
        _stock_run(out, max_steps=3)
        _trainer(cls, out, max_steps=5, save_steps=5, save_total_limit=2).train()
    # the Trainer deletes checkpoint-1 and -2; ckptfmt leaves them (not its own) and keeps
    # what the Trainer keeps
    assert _folders(stock) == ["checkpoint-3", "checkpoint-5"]
    assert _folders(ours) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-5"]


def test_a_stock_folder_at_the_name_of_a_save_is_refused_untouched(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    _stock_run(out, max_steps=2)
    before = _tree(os.path.join(out, "checkpoint-1"))
    with pytest.raises(ckptfmt.UnsupportedError, match="checkpoint-1 exists and ckptfmt did not write it"):
        _trainer(CkptfmtTrainer, out, max_steps=2).train()
    assert _tree(os.path.join(out, "checkpoint-1")) == before


def test_a_resume_that_would_save_into_stock_folders_is_refused_before_any_step(tmp_path: Any) -> None:
    # a switched run resumed from an older stock folder, the stock run's later folders still
    # there (as transformers' own resume tests leave them): refused up front, not after
    # training up to the first save that would meet one
    out = str(tmp_path / "run")
    _stock_run(out, max_steps=6)  # checkpoint-1..6, the stock Trainer's
    before = {n: _tree(os.path.join(out, n)) for n in _folders(out)}
    opt_in = {"ckptfmt_read_trainer_checkpoints": True}
    trainer = _trainer(CkptfmtTrainer, out, max_steps=6, ckptfmt=opt_in)
    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps.append(state.global_step)

    trainer.add_callback(Steps())
    # the save steps are the resumed state's (save_steps 1, the stock run's), as the Trainer's are
    with pytest.raises(
        ckptfmt.UnsupportedError, match=r"checkpoint-4 exists .*\(nor checkpoint-5, checkpoint-6, "
    ):
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    assert steps == []
    assert {n: _tree(os.path.join(out, n)) for n in _folders(out)} == before
    # saves that meet no stock folder go ahead: from the newest, checkpoint-6, to step 8
    trainer = _trainer(CkptfmtTrainer, out, max_steps=8, ckptfmt=opt_in)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 8
    for name in ("checkpoint-7", "checkpoint-8"):
        ckptfmt.integrations.transformers.check_checkpoint(os.path.join(out, name))


def test_only_marked_incomplete_folders_are_removed(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    _trainer(CkptfmtTrainer, out, max_steps=2).train()
    # checkpoint-1 as a ckptfmt save cut short (its commit record never written): removed
    os.unlink(os.path.join(out, "checkpoint-1", multifile.COMMIT_NAME))
    # another tool's folders, incomplete by ckptfmt's rules: left
    shutil.copytree(os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-0"))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, "checkpoint-0", MARK_NAME))
    os.unlink(os.path.join(out, "checkpoint-0", multifile.COMMIT_NAME))
    os.makedirs(os.path.join(out, "checkpoint-3-notes"))
    with open(os.path.join(out, "checkpoint-3-notes", "eval.txt"), "w") as f:
        f.write("mine")
    # the Trainer orders folders by modification time once they span a second or more (by step
    # otherwise): times set apart, so the oldest, the one its rule deletes, is the foreign
    # checkpoint-0 in every run, however long the runs take
    t2 = os.path.getmtime(os.path.join(out, "checkpoint-2"))
    os.utime(os.path.join(out, "checkpoint-0"), (t2 - 20, t2 - 20))
    os.utime(os.path.join(out, "checkpoint-3-notes"), (t2 + 1, t2 + 1))
    _trainer(CkptfmtTrainer, out, max_steps=4, save_steps=4, save_total_limit=3).train()
    assert sorted(os.listdir(out)) == ["checkpoint-0", "checkpoint-2", "checkpoint-3-notes", "checkpoint-4"]
    assert os.path.isfile(os.path.join(out, "checkpoint-3-notes", "eval.txt"))


# -- 5. rotation: the Trainer's own rules, side by side ---------------------------------------------

ROTATIONS = {
    "limit-2": dict(save_total_limit=2),
    "limit-1": dict(save_total_limit=1),
    # the best folder is the first (the highest loss is "best"): kept beside the newest, and at
    # the end of training with save_total_limit=1 the only one left
    "best-limit-1": dict(save_total_limit=1, load_best_model_at_end=True, greater_is_better=True),
    "best-limit-2": dict(save_total_limit=2, load_best_model_at_end=True, greater_is_better=True),
    "best-limit-3-lowest": dict(save_total_limit=3, load_best_model_at_end=True),
    "save-only-model": dict(save_total_limit=2, save_only_model=True),
    "save-only-model-best": dict(
        save_total_limit=1, save_only_model=True, load_best_model_at_end=True, greater_is_better=True
    ),
}


@pytest.mark.parametrize("rules", sorted(ROTATIONS))
def test_rotation_leaves_the_folders_the_trainer_leaves(rules: str, tmp_path: Any) -> None:
    kw = ROTATIONS[rules]
    stock = _stock_run(str(tmp_path / "stock"), **kw)
    trainer = _trainer(CkptfmtTrainer, str(tmp_path / "ours"), **kw)
    trainer.train()
    assert _folders(str(tmp_path / "ours")) == stock
    for name in stock:
        ckptfmt.integrations.transformers.check_checkpoint(str(tmp_path / "ours" / name))


# -- 6. errors a Trainer user catches as ValueError ------------------------------------------------


@pytest.mark.parametrize("resume", ["missing", "", "empty-dir", True])
def test_nothing_to_resume_is_a_value_error_as_with_the_trainer(resume: Any, tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    os.makedirs(out)
    os.makedirs(tmp_path / "empty-dir")
    given = resume if resume in ("", True) else str(tmp_path / resume)
    with pytest.raises(ValueError) as stock:
        _trainer(Trainer, out).train(resume_from_checkpoint=given)
    with pytest.raises(ValueError) as caught:
        _trainer(CkptfmtTrainer, out).train(resume_from_checkpoint=given)
    assert isinstance(caught.value, ckptfmt.CheckpointError)
    assert caught.value.path is not None
    # the Trainer's own words are there too (transformers' tests match them)
    words = "No valid checkpoint found" if resume is True else "Can't find a valid checkpoint at"
    assert words in str(stock.value) and words in str(caught.value)


# -- 4. load_model with a model class whose config type transformers does not register -------------


class BareConfig(PretrainedConfig):  # no model_type at all, as transformers' own test models
    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = a
        self.b = b


class BareModel(RegressionModel):
    config_class = BareConfig  # type: ignore[assignment]


@pytest.mark.parametrize("model_class", [RegressionModel, BareModel])
def test_load_model_reads_the_config_with_the_class_config_class(model_class: type, tmp_path: Any) -> None:
    out = str(tmp_path / "run")

    torch.manual_seed(0)
    trainer = CkptfmtTrainer(
        model=model_class(model_class.config_class(a=0.5)), args=_args(out, max_steps=2), train_dataset=Line()
    )
    trainer.train()
    model = ckptfmt.integrations.transformers.load_model(os.path.join(out, "checkpoint-2"), model_class)
    assert type(model) is model_class and model.config.a == 0.5
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with pytest.raises(ckptfmt.CheckpointError, match="model_type"):
        ckptfmt.integrations.transformers.load_model(os.path.join(out, "checkpoint-2"))


# -- 7. no pickle in a checkpoint folder ----------------------------------------------------------


def _is_pickle_or_torch_save(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return head[:1] == b"\x80" or head == b"PK\x03\x04"  # a pickle's PROTO opcode; torch.save's zip


def test_checkpoint_folders_hold_no_pickle(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    trainer = _trainer(CkptfmtTrainer, out, max_steps=2, save_total_limit=1)
    trainer.train()
    folder = os.path.join(out, "checkpoint-2")
    names = sorted(os.listdir(folder))
    assert "training_args.bin" not in names
    assert not [n for n in names if _is_pickle_or_torch_save(os.path.join(folder, n))]
    args = ckptfmt.integrations.transformers.load_training_args(folder)
    assert args == json.loads(trainer.args.to_json_string())
    assert args["max_steps"] == 2 and args["save_total_limit"] == 1
    # hostile: read bounded, never through a link, only a JSON object
    path = os.path.join(folder, "training_args.json")
    for make, error in (
        (lambda: os.symlink(os.path.join(folder, "config.json"), path), ckptfmt.CheckpointError),
        (lambda: open(path, "w").write("[1]"), ckptfmt.CorruptError),
        (lambda: open(path, "wb").write(b"\xff{"), ckptfmt.CorruptError),
    ):
        os.unlink(path)
        make()
        with pytest.raises(error):
            ckptfmt.integrations.transformers.load_training_args(folder)


# -- 2. an existing run switches: resuming from a folder of the stock Trainer ----------------------


def _torch_load_spy(monkeypatch: Any) -> list[Any]:
    """torch.load, unchanged, recording the weights_only each call passes."""
    calls: list[Any] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


@pytest.mark.parametrize("how", ["latest", "path"])
def test_a_stock_run_switches_to_ckptfmt_without_losing_its_state(
    how: str, tmp_path: Any, monkeypatch: Any
) -> None:
    reference, switched = str(tmp_path / "stock"), str(tmp_path / "switched")
    stock = _trainer(Trainer, reference, max_steps=6, save_steps=3, noise=0.1)
    stock.train()
    shutil.copytree(os.path.join(reference, "checkpoint-3"), os.path.join(switched, "checkpoint-3"))
    before = _tree(os.path.join(switched, "checkpoint-3"))
    calls = _torch_load_spy(monkeypatch)
    trainer = _trainer(
        CkptfmtTrainer,
        switched,
        max_steps=6,
        save_steps=3,
        noise=0.1,
        ckptfmt={"ckptfmt_read_trainer_checkpoints": True},
    )
    trainer.train(resume_from_checkpoint=True if how == "latest" else os.path.join(switched, "checkpoint-3"))
    assert calls and all(w is True for w in calls)  # optimizer, scheduler, RNG: weights_only only
    # the uninterrupted stock run, bit for bit: step, weights (the noise needs the RNG), optimizer
    assert trainer.state.global_step == 6
    for name, value in stock.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    folder = os.path.join(switched, "checkpoint-6")
    ckptfmt.integrations.transformers.check_checkpoint(folder)
    saved = ckptfmt.load(os.path.join(folder, "optimizer.ckpt"))
    expected = torch.load(os.path.join(reference, "checkpoint-6", "optimizer.pt"), weights_only=True)
    for key, state in expected["state"].items():
        for k, v in state.items():
            assert torch.equal(saved["state"][key][k], v), (key, k)
    assert _tree(os.path.join(switched, "checkpoint-3")) == before
    # the next resume takes ckptfmt's newer folder
    again = _trainer(
        CkptfmtTrainer, switched, max_steps=6, ckptfmt={"ckptfmt_read_trainer_checkpoints": True}
    )
    assert again._ckptfmt_resume_source(True).path == folder


def test_a_stock_folder_is_not_resumed_from_without_the_opt_in(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    _stock_run(out, max_steps=2)
    for given in (True, os.path.join(out, "checkpoint-2")):
        with pytest.raises(ckptfmt.UnsupportedError, match="ckptfmt_read_trainer_checkpoints=True"):
            _trainer(CkptfmtTrainer, out, max_steps=3).train(resume_from_checkpoint=given)
    os.unlink(os.path.join(out, "checkpoint-2", "model.safetensors"))
    trainer = _trainer(CkptfmtTrainer, out, max_steps=3, ckptfmt={"ckptfmt_read_trainer_checkpoints": True})
    with pytest.raises(ckptfmt.UnsupportedError, match="no model.safetensors"):
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))


# -- 3. from_pretrained on a ckptfmt checkpoint folder (enable()) ----------------------------------


def test_from_pretrained_opens_ckptfmt_folders_once_enabled(tmp_path: Any) -> None:
    from trainer_helpers import Tokens, tiny_gpt2
    from transformers import AutoModelForCausalLM

    from ckptfmt.integrations.transformers import disable, enable

    out = str(tmp_path / "gpt2")
    args = _args(out, max_steps=2, save_steps=2)
    gpt2 = tiny_gpt2(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = CkptfmtTrainer(model=gpt2, args=args, train_dataset=Tokens(n=8, length=16, vocab=64, seed=1))
    trainer.train()
    folder = os.path.join(out, "checkpoint-2")
    with pytest.raises(OSError):  # transformers alone finds no weights there
        AutoModelForCausalLM.from_pretrained(folder)
    enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert type(model) is type(gpt2)
        for name, value in gpt2.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name
        assert model.generation_config is not None
        # a model class of its own, its config type registered nowhere
        reg = _trainer(CkptfmtTrainer, str(tmp_path / "reg"), max_steps=1)
        reg.train()
        loaded = RegressionModel.from_pretrained(str(tmp_path / "reg" / "checkpoint-1"))
        assert torch.equal(loaded.a, reg.model.a) and torch.equal(loaded.b, reg.model.b)
        # a damaged folder is refused with ckptfmt's error, never read
        with open(os.path.join(folder, "model.ckpt"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        with pytest.raises(ckptfmt.CheckpointError):
            AutoModelForCausalLM.from_pretrained(folder)
        # transformers' own folders are transformers' business, as before
        trainer.save_model(str(tmp_path / "final"))
        assert type(AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))) is type(gpt2)
    finally:
        disable()
