"""``from_pretrained`` (once ckptfmt's ``enable()`` is called) on a ckptfmt checkpoint folder
whose ``config.json``, which the commit record does not cover, is missing or hostile: the
config is read as ``load_model`` reads it (through the folder, bounded, no link followed, no
FIFO waited on), and a missing one is an IncompleteError naming the folder, never a model
built from transformers' default config."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_trainer_rules import _args  # noqa: E402
from trainer_helpers import Tokens, tiny_gpt2  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.integrations.transformers import CkptfmtTrainer, disable, enable  # noqa: E402


@pytest.fixture
def folder(tmp_path: Any) -> Any:
    out = str(tmp_path / "gpt2")
    gpt2 = tiny_gpt2(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = CkptfmtTrainer(
        model=gpt2,
        args=_args(out, max_steps=1, save_steps=1),
        train_dataset=Tokens(n=4, length=16, vocab=64, seed=1),
    )
    trainer.train()
    enable()
    try:
        yield os.path.join(out, "checkpoint-1"), gpt2
    finally:
        disable()


def test_a_folder_without_config_json_is_incomplete(folder: Any) -> None:
    path, _ = folder
    os.unlink(os.path.join(path, "config.json"))
    with pytest.raises(ckptfmt.IncompleteError, match="config.json"):
        GPT2LMHeadModel.from_pretrained(path)


def test_a_config_json_that_is_a_fifo_is_refused_without_waiting(folder: Any) -> None:
    path, _ = folder
    os.unlink(os.path.join(path, "config.json"))
    os.mkfifo(os.path.join(path, "config.json"))
    signal.alarm(60)  # a read that waits on the FIFO would hang here
    try:
        with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
            GPT2LMHeadModel.from_pretrained(path)
    finally:
        signal.alarm(0)


def test_a_config_json_linking_out_of_the_folder_is_not_followed(folder: Any, tmp_path: Any) -> None:
    path, _ = folder
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(os.path.join(path, "config.json"), elsewhere)
    os.symlink(elsewhere, os.path.join(path, "config.json"))
    with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
        GPT2LMHeadModel.from_pretrained(path)


def test_an_intact_folder_still_loads(folder: Any) -> None:
    path, gpt2 = folder
    model = GPT2LMHeadModel.from_pretrained(path)
    for name, value in gpt2.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_generation_config_linking_out_of_the_folder_is_not_followed(folder: Any, tmp_path: Any) -> None:
    path, _ = folder
    elsewhere = tmp_path / "generation.json"
    elsewhere.write_text('{"max_length": 1234}')
    os.unlink(os.path.join(path, "generation_config.json"))
    os.symlink(elsewhere, os.path.join(path, "generation_config.json"))
    with pytest.raises(ckptfmt.CheckpointError, match="generation_config.json"):
        GPT2LMHeadModel.from_pretrained(path)


def test_the_folders_generation_config_is_read(folder: Any) -> None:
    path, _ = folder
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write('{"max_length": 77}')
    assert GPT2LMHeadModel.from_pretrained(path).generation_config.max_length == 77


def test_auto_model_refuses_a_config_json_linking_out_of_the_folder(folder: Any, tmp_path: Any) -> None:
    """AutoConfig follows the link and hands from_pretrained a config object: the folder's own
    config.json is still read through the folder, and the link refused."""
    path, _ = folder
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(os.path.join(path, "config.json"), elsewhere)
    os.symlink(elsewhere, os.path.join(path, "config.json"))
    with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
        AutoModelForCausalLM.from_pretrained(path)


def test_auto_model_loads_an_intact_folder(folder: Any) -> None:
    path, gpt2 = folder
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, value in gpt2.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_loaded_model_saves_back_with_a_doubtful_generation_config(folder: Any, tmp_path: Any) -> None:
    """transformers only warns about such values when they are as read from the folder."""
    path, _ = folder
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write('{"do_sample": false, "temperature": 0.5}')
    model = GPT2LMHeadModel.from_pretrained(path)
    model.save_pretrained(str(tmp_path / "exported"))
    assert os.path.isfile(tmp_path / "exported" / "generation_config.json")


class _WiderConfig(GPT2Config):
    @property
    def width(self) -> int:
        return int(self.n_embd)


class _WiderModel(GPT2LMHeadModel):
    config_class = _WiderConfig


def test_a_model_class_whose_config_subclasses_the_registered_one_gets_its_own(folder: Any) -> None:
    path, gpt2 = folder
    model = _WiderModel.from_pretrained(path)
    assert isinstance(model.config, _WiderConfig)
    assert model.config.width == gpt2.config.n_embd


def test_the_loaded_model_records_the_folder_as_its_name(folder: Any) -> None:
    path, _ = folder
    model = GPT2LMHeadModel.from_pretrained(path)
    assert model.config.name_or_path == path
    assert model.name_or_path == path


def test_auto_model_refuses_a_config_json_fifo_before_autoconfig_reads_it(folder: Any) -> None:
    path, _ = folder
    os.unlink(os.path.join(path, "config.json"))
    os.mkfifo(os.path.join(path, "config.json"))
    signal.alarm(60)  # a read that waits on the FIFO would hang here
    try:
        with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
            AutoModelForCausalLM.from_pretrained(path)
    finally:
        signal.alarm(0)


def test_disable_gives_the_auto_classes_their_own_from_pretrained_back(folder: Any) -> None:
    hooked = AutoModelForCausalLM.__dict__["from_pretrained"]
    disable()
    try:
        assert AutoModelForCausalLM.__dict__["from_pretrained"] is not hooked
        assert "ckptfmt" not in AutoModelForCausalLM.from_pretrained.__func__.__module__
    finally:
        enable()


_REMOTE_CONFIG = """
from transformers import GPT2Config


class FooConfig(GPT2Config):
    model_type = "gpt2foo"
"""

_REMOTE_MODEL = """
from transformers import GPT2LMHeadModel

from .configuration_foo import FooConfig


class FooModel(GPT2LMHeadModel):
    config_class = FooConfig
"""


def _set_config(path: str, **changes: Any) -> None:
    name = os.path.join(path, "config.json")
    with open(name) as f:
        values = json.load(f)
    values.update(changes)
    values.pop("architectures", None)
    with open(name, "w") as f:
        json.dump(values, f)


def test_auto_model_loads_a_trust_remote_code_model_type(folder: Any) -> None:
    """The model type is one only the folder's own code knows (auto_map): AutoConfig resolves it
    and the concrete class's config accepts it; the Auto class has no config class to ask."""
    path, gpt2 = folder
    with open(os.path.join(path, "configuration_foo.py"), "w") as f:
        f.write(_REMOTE_CONFIG)
    with open(os.path.join(path, "modeling_foo.py"), "w") as f:
        f.write(_REMOTE_MODEL)
    _set_config(
        path,
        model_type="gpt2foo",
        auto_map={
            "AutoConfig": "configuration_foo.FooConfig",
            "AutoModelForCausalLM": "modeling_foo.FooModel",
        },
    )
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert type(model).__name__ == "FooModel"
    assert model.config.model_type == "gpt2foo"
    for name, value in gpt2.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_config_object_loads_a_folder_of_a_model_type_transformers_does_not_know(folder: Any) -> None:
    """Passing one's own config is the way to load a folder written by a newer transformers."""
    path, gpt2 = folder
    _set_config(path, model_type="gpt2_from_a_newer_transformers")
    model = GPT2LMHeadModel.from_pretrained(path, config=gpt2.config)
    for name, value in gpt2.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_with_a_config_object_a_config_json_link_is_still_refused(folder: Any, tmp_path: Any) -> None:
    path, gpt2 = folder
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(os.path.join(path, "config.json"), elsewhere)
    os.symlink(elsewhere, os.path.join(path, "config.json"))
    with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
        GPT2LMHeadModel.from_pretrained(path, config=gpt2.config)


def test_with_a_config_object_a_config_json_fifo_is_refused_without_waiting(folder: Any) -> None:
    path, gpt2 = folder
    os.unlink(os.path.join(path, "config.json"))
    os.mkfifo(os.path.join(path, "config.json"))
    signal.alarm(60)  # a read that waits on the FIFO would hang here
    try:
        with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
            GPT2LMHeadModel.from_pretrained(path, config=gpt2.config)
    finally:
        signal.alarm(0)
