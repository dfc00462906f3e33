"""conftest.py for a scratch copy of transformers' Trainer checkpoint tests (see README.md here);
not collected by ckptfmt's own suite (not a test_*.py, not named conftest.py here).

HFT_TRAINER=stock|blocking|async|switch: which Trainer the tests build. blocking/async put a
subclass of CkptfmtTrainer (ckptfmt_blocking True/False) in place of transformers.Trainer
before the test modules import it; switch builds the stock Trainer first in each test and
CkptfmtTrainer(ckptfmt_read_trainer_checkpoints=True) after (an existing run switching).
HFT_NAMES=1: the tests' reads of the stock Trainer's file names go to ckptfmt's files.
HFT_LOCAL_HUB=1: local stand-ins for the three Hub downloads (a tokenizer, a feature extractor).
"""

import os

import transformers

_MODE = os.environ.get("HFT_TRAINER", "stock")
if _MODE == "switch":
    # an existing run switching: the first Trainer a test builds is the stock one, every later
    # one (the resumes) CkptfmtTrainer with ckptfmt_read_trainer_checkpoints=True
    import pytest

    from ckptfmt.integrations.transformers import CkptfmtTrainer as _Base

    _STOCK = transformers.Trainer
    _BUILT = [0]

    class CkptfmtTrainer(_Base):
        def __new__(cls, *args, **kwargs):
            _BUILT[0] += 1
            if _BUILT[0] == 1:
                return _STOCK(*args, **kwargs)  # not a cls instance: __init__ below is not run
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("ckptfmt_read_trainer_checkpoints", True)
            super().__init__(*args, **kwargs)

    @pytest.fixture(autouse=True)
    def _count_trainers():
        _BUILT[0] = 0
        yield

elif _MODE != "stock":
    from ckptfmt.integrations.transformers import CkptfmtTrainer as _Base

    _BLOCKING = _MODE == "blocking"

    class CkptfmtTrainer(_Base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("ckptfmt_blocking", _BLOCKING)
            super().__init__(*args, **kwargs)


if _MODE != "stock":
    # both: `from transformers import Trainer` may resolve through transformers.trainer
    import transformers.trainer

    transformers.Trainer = CkptfmtTrainer
    transformers.trainer.Trainer = CkptfmtTrainer


# HFT_NAMES=1 (with blocking/async/switch): the tests' reads of the stock Trainer's own file names are
# translated to ckptfmt's, so that everything else a test checks is still checked:
# model.safetensors -> model.ckpt (read with load_model_state), optimizer.pt -> optimizer.ckpt, ...;
# convert_to_sharded_checkpoint (which rewrites HF's model.safetensors) becomes a no-op, and
# from_pretrained reads ckptfmt folders (ckptfmt.integrations.transformers.enable()).
if _MODE != "stock" and os.environ.get("HFT_NAMES"):
    import pytest

    _RENAMES = {
        "model.safetensors": "model.ckpt",
        "training_args.bin": "training_args.json",
        "optimizer.pt": "optimizer.ckpt",
        "scheduler.pt": "scheduler.ckpt",
        "scaler.pt": "scaler.ckpt",
    }

    @pytest.fixture(autouse=True)
    def _ckptfmt_names(monkeypatch):
        import safetensors.torch
        from tests.trainer import trainer_test_utils as utils

        import ckptfmt.integrations.transformers as ckhf

        original_load = safetensors.torch.load_file

        def load_file(path, *args, **kwargs):
            folder, name = os.path.split(os.fspath(path))
            if name == "model.safetensors" and not os.path.exists(path):
                return ckhf.load_model_state(folder)
            return original_load(path, *args, **kwargs)

        original_check = utils.TrainerIntegrationCommon.check_saved_checkpoints

        def check_saved_checkpoints(self, output_dir, freq, total, is_pretrained=True, use_scaler=False):
            real_isfile = os.path.isfile
            for step in range(freq, total, freq):
                folder = os.path.join(output_dir, f"checkpoint-{step}")
                if not real_isfile(os.path.join(folder, "model.safetensors")):  # not a stock folder
                    ckhf.check_checkpoint(folder)

            def isfile(p):
                folder, name = os.path.split(p)
                return real_isfile(p) or real_isfile(os.path.join(folder, _RENAMES.get(name, name)))

            with monkeypatch.context() as m:
                m.setattr(os.path, "isfile", isfile)
                original_check(self, output_dir, freq, total, is_pretrained, use_scaler)

        monkeypatch.setattr(safetensors.torch, "load_file", load_file)
        monkeypatch.setattr(
            utils.TrainerIntegrationCommon, "check_saved_checkpoints", check_saved_checkpoints
        )
        original_convert = utils.TrainerIntegrationCommon.convert_to_sharded_checkpoint

        def convert_to_sharded_checkpoint(self, folder):
            if os.path.isfile(os.path.join(folder, "model.safetensors")):  # a stock folder (switch)
                original_convert(self, folder)

        monkeypatch.setattr(
            utils.TrainerIntegrationCommon, "convert_to_sharded_checkpoint", convert_to_sharded_checkpoint
        )
        ckhf.enable()
        yield
        ckhf.disable()


# HFT_LOCAL_HUB=1: the three tests that fetch a tokenizer / feature extractor from the Hub get
# local stand-ins of the same classes instead (no network here); every other from_pretrained
# call (the tests' reloads from the saved folders) goes to transformers unchanged.
if os.environ.get("HFT_LOCAL_HUB"):
    import atexit
    import shutil
    import tempfile

    from transformers import AutoFeatureExtractor, AutoTokenizer, BertTokenizer, Wav2Vec2FeatureExtractor

    _HUB_TOKENIZERS = {"bert-base-uncased", "google-bert/bert-base-uncased"}
    _HUB_EXTRACTORS = {"facebook/wav2vec2-base-960h"}
    _VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "this", "is", "a", "test", "sentence"]

    _VOCAB_DIR = tempfile.mkdtemp(prefix="hft-vocab-")
    atexit.register(shutil.rmtree, _VOCAB_DIR, True)

    def _local_bert():
        path = os.path.join(_VOCAB_DIR, "vocab.txt")
        with open(path, "w") as f:
            f.write("\n".join(_VOCAB) + "\n")
        return BertTokenizer(vocab_file=path, model_max_length=16)

    _tok_from = AutoTokenizer.from_pretrained.__func__
    _fe_from = AutoFeatureExtractor.from_pretrained.__func__

    def _tokenizer_from_pretrained(cls, name, *args, **kwargs):
        if name in _HUB_TOKENIZERS:
            return _local_bert()
        return _tok_from(cls, name, *args, **kwargs)

    def _extractor_from_pretrained(cls, name, *args, **kwargs):
        if name in _HUB_EXTRACTORS:
            return Wav2Vec2FeatureExtractor()
        return _fe_from(cls, name, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(_tokenizer_from_pretrained)
    AutoFeatureExtractor.from_pretrained = classmethod(_extractor_from_pretrained)
