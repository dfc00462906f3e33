"""``pipeline(model=folder)`` on a ckptfmt checkpoint folder (``enable()``): transformers reads
``config.json`` with ``AutoConfig.from_pretrained`` before any model class is reached, so the
folder's checks apply there first: a link out of the folder, a FIFO are refused (a
CheckpointError naming the file) before transformers opens them, and an intact folder makes
a pipeline whose model holds the committed weights."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_trainer_rules import _args  # noqa: E402
from trainer_helpers import Tokens, tiny_gpt2  # noqa: E402
from transformers import AutoConfig, PreTrainedTokenizerFast, pipeline  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.integrations.transformers import CkptfmtTrainer, disable, enable  # noqa: E402

VOCAB = 64


@pytest.fixture
def folder(tmp_path: Any) -> Any:
    out = str(tmp_path / "gpt2")
    gpt2 = tiny_gpt2(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = CkptfmtTrainer(
        model=gpt2,
        args=_args(out, max_steps=1, save_steps=1),
        train_dataset=Tokens(n=4, length=16, vocab=VOCAB, seed=1),
    )
    trainer.train()
    enable()
    try:
        yield os.path.join(out, "checkpoint-1"), gpt2
    finally:
        disable()


def _tokenizer() -> Any:
    """A word-level tokenizer over the tiny model's vocabulary, made here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB)}
    inner = Tokenizer(models.WordLevel(words, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="w0", pad_token="w0")


def _link_config_out(path: str, target: Any, text: str) -> None:
    target.write_text(text)
    os.unlink(os.path.join(path, "config.json"))
    os.symlink(target, os.path.join(path, "config.json"))


def test_a_pipeline_on_an_intact_folder_holds_the_committed_weights(folder: Any) -> None:
    path, gpt2 = folder
    pipe = pipeline("text-generation", model=path, tokenizer=_tokenizer(), device="cpu")
    for name, value in gpt2.state_dict().items():
        assert torch.equal(pipe.model.state_dict()[name].float(), value.float()), name
    out = pipe("w1 w2 w3", max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"].startswith("w1 w2 w3")


def test_a_config_json_linking_out_is_refused_before_autoconfig_reads_it(folder: Any, tmp_path: Any) -> None:
    """The link leads to a file that is not JSON: AutoConfig would fail on it with an error of
    its own (an OSError or a plain ValueError), the folder's check refuses the link first."""
    path, _ = folder
    _link_config_out(path, tmp_path / "elsewhere.json", "not json")
    with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
        pipeline("text-generation", model=path, tokenizer=_tokenizer(), device="cpu")
    with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
        AutoConfig.from_pretrained(path)


def test_a_config_json_fifo_is_refused_before_autoconfig_waits_on_it(folder: Any) -> None:
    path, _ = folder
    os.unlink(os.path.join(path, "config.json"))
    os.mkfifo(os.path.join(path, "config.json"))
    signal.alarm(60)  # a read that waits on the FIFO would hang here
    try:
        with pytest.raises(ckptfmt.CheckpointError, match="config.json"):
            pipeline("text-generation", model=path, tokenizer=_tokenizer(), device="cpu")
    finally:
        signal.alarm(0)


def test_disable_gives_autoconfig_its_own_from_pretrained_back(folder: Any, tmp_path: Any) -> None:
    path, _ = folder
    disable()
    _link_config_out(path, tmp_path / "elsewhere.json", "not json")
    with pytest.raises((OSError, ValueError)) as raised:
        AutoConfig.from_pretrained(path)
    assert not isinstance(raised.value, ckptfmt.CheckpointError)
