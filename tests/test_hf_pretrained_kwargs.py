"""``from_pretrained(folder, **kwargs)`` on a ckptfmt checkpoint folder (``enable()``) sends the
keywords where transformers' own ``from_pretrained`` sends them on a folder of its own: those the
config holds to the config (``output_attentions=True``, ``resid_pdrop=0.0``), the rest to the
model's ``__init__``, its own (``dtype``) to itself.  Each case is checked against transformers
loading the same model from a ``save_pretrained`` folder."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_trainer_rules import _args  # noqa: E402
from trainer_helpers import Tokens, tiny_gpt2  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2LMHeadModel  # noqa: E402

from ckptfmt.integrations.transformers import CkptfmtTrainer, disable, enable  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(a ckptfmt checkpoint folder, transformers' save_pretrained folder of the same model)."""
    out = str(tmp_path_factory.mktemp("kwargs") / "gpt2")
    gpt2 = tiny_gpt2(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = CkptfmtTrainer(
        model=gpt2,
        args=_args(out, max_steps=1, save_steps=1),
        train_dataset=Tokens(n=4, length=16, vocab=64, seed=1),
    )
    trainer.train()
    stock = os.path.join(out, "stock")
    trainer.model.save_pretrained(stock)
    enable()
    try:
        yield os.path.join(out, "checkpoint-1"), stock
    finally:
        disable()


class _Marked(GPT2LMHeadModel):
    """A model whose ``__init__`` takes a keyword of its own, which no config holds."""

    def __init__(self, config: Any, marker: str | None = None) -> None:
        super().__init__(config)
        self.marker = marker


def _config_values(model: Any) -> dict[str, Any]:
    """The config's values but for the folder's name and the architectures save_pretrained
    records (ckptfmt's folder keeps the config as the model had it)."""
    values = model.config.to_dict()
    for name in ("_name_or_path", "architectures"):
        values.pop(name, None)
    return values


@pytest.mark.parametrize(
    "kwargs",
    [
        {"output_attentions": True},
        {"output_attentions": True, "resid_pdrop": 0.0, "num_labels": 3},
        {"output_attentions": True, "dtype": torch.float16},
    ],
    ids=["output_attentions", "config_attributes", "with_dtype"],
)
def test_config_keywords_reach_the_config_as_transformers_sends_them(
    folders: Any, kwargs: dict[str, Any]
) -> None:
    path, stock = folders
    ours = GPT2LMHeadModel.from_pretrained(path, **kwargs)
    theirs = GPT2LMHeadModel.from_pretrained(stock, **kwargs)
    assert ours.config.output_attentions is True
    assert _config_values(ours) == _config_values(theirs)
    for name, value in theirs.state_dict().items():
        assert ours.state_dict()[name].dtype == value.dtype, name
        assert torch.equal(ours.state_dict()[name], value), name


def test_keywords_the_config_does_not_hold_reach_the_model(folders: Any) -> None:
    path, stock = folders
    ours = _Marked.from_pretrained(path, marker="m", output_attentions=True)
    theirs = _Marked.from_pretrained(stock, marker="m", output_attentions=True)
    assert (ours.marker, theirs.marker) == ("m", "m")
    assert ours.config.output_attentions is True
    assert _config_values(ours) == _config_values(theirs)


def test_a_config_given_as_a_path_takes_the_config_keywords(folders: Any) -> None:
    path, stock = folders
    ours = _Marked.from_pretrained(path, config=stock, marker="m", output_attentions=True)
    assert ours.marker == "m" and ours.config.output_attentions is True


def test_auto_model_sends_the_keywords_as_well(folders: Any) -> None:
    path, stock = folders
    ours = AutoModelForCausalLM.from_pretrained(path, output_attentions=True, resid_pdrop=0.0)
    theirs = AutoModelForCausalLM.from_pretrained(stock, output_attentions=True, resid_pdrop=0.0)
    assert ours.config.output_attentions is True
    assert _config_values(ours) == _config_values(theirs)


def test_a_keyword_the_model_does_not_take_is_transformers_own_type_error(folders: Any) -> None:
    path, stock = folders
    for folder in (stock, path):
        with pytest.raises(TypeError, match="no_such_keyword"):
            GPT2LMHeadModel.from_pretrained(folder, no_such_keyword=1)


def test_output_loading_info_returns_the_model_and_its_info_as_transformers_does(folders: Any) -> None:
    path, stock = folders
    ours, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    theirs, stock_info = GPT2LMHeadModel.from_pretrained(stock, output_loading_info=True)
    assert ours.config.name_or_path == path
    assert set(info) == set(stock_info)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


def test_a_subfolder_of_a_checkpoint_folder_is_refused_not_ignored(folders: Any) -> None:
    path, _ = folders
    with pytest.raises(ValueError, match="subfolder='text'.*pass the subfolder's path"):
        GPT2LMHeadModel.from_pretrained(path, subfolder="text")


def test_the_keywords_kept_for_transformers_are_those_its_from_pretrained_takes() -> None:
    """Every keyword transformers' own from_pretrained pops for itself is in FROM_PRETRAINED_OWN:
    a transformers that takes one more fails here before that keyword is offered to the config
    (the set also keeps deprecated ones older releases took)."""
    import inspect
    import re

    from transformers import PreTrainedModel

    from ckptfmt.integrations.transformers.pretrained import FROM_PRETRAINED_OWN

    source = inspect.getsource(PreTrainedModel.from_pretrained.__func__)
    popped = set(re.findall(r'kwargs\.pop\(\s*"(\w+)"', source))
    assert len(popped) > 20 and popped <= FROM_PRETRAINED_OWN, popped - FROM_PRETRAINED_OWN
