"""ckptfmt's Hugging Face Trainer integration against the real `transformers` package.

A tiny GPT-2 built from a config (random weights, no downloads, dropout on)
trains on CPU for 20 steps, 6 steps an epoch, a checkpoint every 4 steps,
save_total_limit=2.  The runs happen in child processes (this file is also
the child program, see `child()`):

* "reference": the uninterrupted run with CkptfmtTrainer; then the control:
  the stock Trainer, its newest checkpoint torn, resumed with
  resume_from_checkpoint=True;
* "crash": CkptfmtTrainer with non-blocking saves dies (os._exit) in the
  middle of saving checkpoint-12, after its model, optimizer and scheduler
  files; the test then cuts one of them short;
* "resume": a fresh process, pickle and torch.load made to raise, resumes
  with resume_from_checkpoint=True and trains to step 20.

The resumed run must skip the torn checkpoint-12 with a warning, start from
checkpoint-8 (mid-epoch) and continue the uninterrupted run bit-exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_helpers import Tokens, ban_pickle, run_child, tiny_gpt2  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.files import multifile  # noqa: E402
from ckptfmt.format.sniff import sniff  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STEPS = 20
SAVE_STEPS = 4
CRASH_AT = 12
OURS = ("model.ckpt", "optimizer.ckpt", "scheduler.ckpt", "rng_state.ckpt", "trainer_state.ckpt")


# ---------------------------------------------------------------------------
# the child program


def _tokens() -> Tokens:
    return Tokens(n=24, length=16, vocab=64, seed=99)


def _model() -> Any:
    return tiny_gpt2(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def _args(out: str, max_steps: int = MAX_STEPS) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=42,
        dataloader_num_workers=0,
    )


def _recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        losses: list[float]

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss.item()))
            return loss

    Recording.losses = []
    return Recording


def _record(out: str, trainer: Any, extra: dict[str, Any] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    final = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
    ckptfmt.save(final, os.path.join(out, "final.ckpt"))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"losses": [v.hex() for v in trainer.losses], **(extra or {})}, f)


def _tear_stock(folder: str) -> None:
    """What a crash in the middle of Trainer._save_checkpoint leaves: the model written,
    the optimizer file cut short, the rest missing."""
    for name in ("scheduler.pt", "rng_state.pth", "trainer_state.json"):
        os.unlink(os.path.join(folder, name))
    opt = os.path.join(folder, "optimizer.pt")
    os.truncate(opt, os.path.getsize(opt) // 2)


def child(argv: list[str]) -> None:
    what, base = argv
    torch.set_num_threads(1)
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    if what == "reference":
        out = os.path.join(base, "full")
        trainer = _recording(CkptfmtTrainer)(model=_model(), args=_args(out), train_dataset=_tokens())
        trainer.train()
        _record(out, trainer)
        # the control: the stock Trainer picks a torn newest checkpoint
        out = os.path.join(base, "stock")
        Trainer(model=_model(), args=_args(out, CRASH_AT), train_dataset=_tokens()).train()
        _tear_stock(os.path.join(out, f"checkpoint-{CRASH_AT}"))
        try:
            Trainer(model=_model(), args=_args(out), train_dataset=_tokens()).train(
                resume_from_checkpoint=True
            )
            error = ""
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"error": error}, f)
    elif what == "crash":

        class Crashing(CkptfmtTrainer):
            def _save_rng_state(self, output_dir: str) -> None:
                if self.state.global_step == CRASH_AT:
                    self.wait_for_checkpoints()  # earlier checkpoints are committed
                    for h in self._ckptfmt_current.handles:  # this one's files so far are written
                        h.wait()
                    os._exit(9)
                super()._save_rng_state(output_dir)

        out = os.path.join(base, "run")
        trainer = Crashing(model=_model(), args=_args(out), train_dataset=_tokens(), ckptfmt_blocking=False)
        trainer.train()
        raise SystemExit("the crash did not happen")
    elif what == "resume":
        out = os.path.join(base, "run")
        ban_pickle()
        trainer = _recording(CkptfmtTrainer)(
            model=_model(), args=_args(out), train_dataset=_tokens(), ckptfmt_blocking=False
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ckptfmt.CheckpointWarning)
            trainer.train(resume_from_checkpoint=True)
        skipped = [str(w.message) for w in caught if issubclass(w.category, ckptfmt.CheckpointWarning)]
        _record(
            os.path.join(base, "resumed"), trainer, {"warnings": skipped, "folders": sorted(os.listdir(out))}
        )
    else:
        raise SystemExit(f"unknown child command {what}")


# ---------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = str(tmp_path_factory.mktemp("hf"))

    def interrupted() -> None:
        run_child(__file__, "crash", base, expect=9)
        torn = os.path.join(base, "run", f"checkpoint-{CRASH_AT}")
        opt = os.path.join(torn, "optimizer.ckpt")
        os.truncate(opt, os.path.getsize(opt) // 2)  # one file cut short, others never written
        run_child(__file__, "resume", base)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_child, __file__, "reference", base), pool.submit(interrupted)]
        for f in futures:
            f.result()
    return base


def _result(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, "result.json")) as f:
        result: dict[str, Any] = json.load(f)
    result["losses"] = [float.fromhex(v) for v in result.get("losses", [])]
    return result


def _same(a: Any, b: Any, path: str = "state") -> list[str]:
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [f"{path}: differs"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in _same(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]")] + (
            [] if len(a) == len(b) else [f"{path}: lengths differ"]
        )
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_torn_newest_checkpoint_is_skipped_and_resume_is_bit_exact(runs: str) -> None:
    full, resumed = _result(os.path.join(runs, "full")), _result(os.path.join(runs, "resumed"))
    assert len(full["losses"]) == MAX_STEPS
    # resumed from checkpoint-8: steps 9..20, every loss bit for bit
    assert resumed["losses"] == full["losses"][2 * SAVE_STEPS :]
    problems = _same(
        ckptfmt.load(os.path.join(runs, "full", "final.ckpt")),
        ckptfmt.load(os.path.join(runs, "resumed", "final.ckpt")),
    )
    assert problems == [], problems[:10]
    skipped = [w for w in resumed["warnings"] if f"checkpoint-{CRASH_AT}" in w]
    assert len(skipped) == 1 and "not a complete checkpoint" in skipped[0], resumed["warnings"]


def test_stock_trainer_picks_the_torn_checkpoint_and_fails(runs: str) -> None:
    error = _result(os.path.join(runs, "stock"))["error"]
    assert error.startswith("FileNotFoundError") and f"checkpoint-{CRASH_AT}" in error, error


def test_folders_are_committed_ckptfmt_checkpoints(runs: str) -> None:
    from ckptfmt.integrations.transformers import check_checkpoint

    run = os.path.join(runs, "run")
    # rotation kept the two newest complete checkpoints; the torn one was rewritten, then rotated out
    assert _result(os.path.join(runs, "resumed"))["folders"] == ["checkpoint-16", "checkpoint-20"]
    for name in ("checkpoint-16", "checkpoint-20"):
        folder = os.path.join(run, name)
        record = check_checkpoint(folder)
        assert record.step == int(name.split("-")[1])
        assert sorted(p.name for p in record.files) == sorted(OURS)
        for f in OURS:
            assert sniff(os.path.join(folder, f)) == "ckptfmt"
            assert ckptfmt.verify(os.path.join(folder, f)).ok
        files = set(os.listdir(folder))
        assert not any(n.endswith((".pt", ".pth", ".safetensors")) for n in files), files
        assert {"COMMIT", "config.json", "trainer_state.json"} <= files
        with open(os.path.join(folder, "trainer_state.json")) as f:
            text = f.read()
        assert ckptfmt.load(os.path.join(folder, "trainer_state.ckpt"))["trainer_state_json"] == text
        assert json.loads(text)["global_step"] == record.step


def _copy_checkpoint(src: str, dst: str) -> None:
    import shutil

    shutil.copytree(src, dst)


def test_rotation_keeps_the_newest_complete_checkpoint(runs: str, tmp_path: Any) -> None:
    """A torn folder newer than every complete one: the stock rotation (by mtime) keeps the
    torn one and deletes the last complete checkpoint; ours keeps the complete one."""
    import time

    from transformers import TrainingArguments
    from transformers.trainer_utils import rotate_checkpoints

    from ckptfmt.integrations.transformers import CkptfmtTrainer, latest_checkpoint

    src = os.path.join(runs, "run", "checkpoint-20")

    def make(root: str) -> None:
        for step in (4, 8):
            _copy_checkpoint(src, os.path.join(root, f"checkpoint-{step}"))
            time.sleep(0.6)
        torn = os.path.join(root, "checkpoint-12")
        _copy_checkpoint(src, torn)
        os.unlink(os.path.join(torn, "COMMIT"))

    # the copies keep checkpoint-20's record (step 20); completeness is about the files, not the name
    stock, ours = str(tmp_path / "stock"), str(tmp_path / "ours")
    make(stock)
    make(ours)
    rotate_checkpoints(stock, save_total_limit=1, use_mtime=True)
    assert sorted(os.listdir(stock)) == ["checkpoint-12"]  # the only complete checkpoint is gone

    trainer = CkptfmtTrainer(
        model=_model(), args=TrainingArguments(ours, save_total_limit=1, report_to="none")
    )
    trainer._ckptfmt_rotate(ours, 1)
    assert sorted(os.listdir(ours)) == ["checkpoint-12", "checkpoint-8"]
    with pytest.warns(ckptfmt.CheckpointWarning, match="checkpoint-12"):
        assert latest_checkpoint(ours) == os.path.join(ours, "checkpoint-8")


def test_damaged_file_in_a_committed_folder_is_skipped(runs: str, tmp_path: Any) -> None:
    from ckptfmt.integrations.transformers import latest_checkpoint

    src = os.path.join(runs, "run", "checkpoint-20")
    for step in (16, 20):
        _copy_checkpoint(src, str(tmp_path / f"checkpoint-{step}"))
    newest = tmp_path / "checkpoint-20" / "rng_state.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x40
    newest.write_bytes(bytes(data))  # bit rot inside a data chunk: the commit check alone passes
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")
    with pytest.warns(ckptfmt.CheckpointWarning, match=r"checkpoint-20.*rng_state.ckpt is damaged"):
        assert latest_checkpoint(str(tmp_path), verify=True) == str(tmp_path / "checkpoint-16")
    (tmp_path / "checkpoint-16" / "scheduler.ckpt").unlink()
    with pytest.warns(ckptfmt.CheckpointWarning) as caught:
        assert latest_checkpoint(str(tmp_path), verify=True) is None
    messages = [str(w.message) for w in caught]
    assert any("checkpoint-16" in m and "scheduler.ckpt" in m and "missing" in m for m in messages), messages


def test_trainer_state_json_is_restored_from_the_commit(runs: str, tmp_path: Any) -> None:
    from ckptfmt.integrations.transformers.trainer_state import restore_trainer_state_json

    folder = str(tmp_path / "checkpoint-20")
    _copy_checkpoint(os.path.join(runs, "run", "checkpoint-20"), folder)
    path = os.path.join(folder, "trainer_state.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])  # written without fsync: cut short by a power loss
    with pytest.warns(ckptfmt.CheckpointWarning, match="trainer_state.json"):
        restore_trainer_state_json(folder)
    with open(path) as f:
        assert f.read() == text
    multifile.check_complete(folder)


def test_explicit_incomplete_path_is_refused(runs: str, tmp_path: Any) -> None:
    from ckptfmt.integrations.transformers import CkptfmtTrainer

    folder = str(tmp_path / "checkpoint-4")
    _copy_checkpoint(os.path.join(runs, "run", "checkpoint-20"), folder)
    os.unlink(os.path.join(folder, "COMMIT"))
    trainer = CkptfmtTrainer(model=_model(), args=_args(str(tmp_path)), train_dataset=_tokens())
    with pytest.raises(ckptfmt.CheckpointError, match="not a complete ckptfmt checkpoint"):
        trainer.train(resume_from_checkpoint=folder)


def test_scaler_optimizer_and_scheduler_round_trip(tmp_path: Any) -> None:
    """The files of one save, a gradient scaler included (none exists on a CPU run)."""
    from ckptfmt.integrations.transformers import CkptfmtTrainer, check_checkpoint

    def make(scale: float) -> Any:
        t = CkptfmtTrainer(model=_model(), args=_args(str(tmp_path)), train_dataset=_tokens())
        t.create_optimizer_and_scheduler(num_training_steps=10)
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        return t

    saver = make(1024.0)
    saver.optimizer.step()
    saver.lr_scheduler.step()
    saver.state.global_step = 3
    saver._save_checkpoint(saver.model, None)
    folder = os.path.join(str(tmp_path), "checkpoint-3")
    names = {p.name for p in check_checkpoint(folder, verify=True).files}
    assert names == {*OURS, "scaler.ckpt"}
    loader = make(1.0)
    loader._load_optimizer_and_scheduler(folder)
    loader._load_scaler(folder)
    assert loader.accelerator.scaler.get_scale() == 1024.0
    assert loader.lr_scheduler.state_dict() == saver.lr_scheduler.state_dict()
    assert loader.optimizer.state_dict()["param_groups"] == saver.optimizer.state_dict()["param_groups"]


def test_load_model_from_a_checkpoint_folder(runs: str) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from ckptfmt.integrations.transformers import load_model, load_model_state

    folder = os.path.join(runs, "run", "checkpoint-20")
    expected = load_model_state(folder)
    for cls in (AutoModelForCausalLM, GPT2LMHeadModel):
        model = load_model(folder, cls)
        assert type(model) is GPT2LMHeadModel
        assert _same(dict(model.state_dict()), dict(expected)) == []


def test_import_ckptfmt_imports_no_framework() -> None:
    code = "import sys, ckptfmt, ckptfmt.integrations; print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_transformers  # the classes above, under the module name the tests see

    test_transformers.child(sys.argv[1:])


def test_encrypted_checkpoints_resume_with_the_key_only(tmp_path: Any) -> None:
    """ckptfmt_encrypt_with: every ckptfmt file of a folder is encrypted (no tensor bytes in
    clear); a trainer with the key resumes from it; one without finds no checkpoint it can
    read and one with another key neither, and an explicit path is refused."""
    import struct

    from ckptfmt.integrations.transformers import CkptfmtTrainer, latest_checkpoint, load_model_state

    key = bytes(range(32))
    out = str(tmp_path / "run")

    def trainer(steps: int, **kw: Any) -> Any:
        return CkptfmtTrainer(model=_model(), args=_args(out, max_steps=steps), train_dataset=_tokens(), **kw)

    trainer(4, ckptfmt_encrypt_with=key).train()  # the one real save of this test: step 4
    folder = os.path.join(out, "checkpoint-4")
    for name in OURS:
        with open(os.path.join(folder, name), "rb") as fh:
            assert struct.unpack("<Q", fh.read(48)[40:48])[0] & 4, name  # required feature bit 2
    weights = load_model_state(folder, decrypt_with=key)
    raw = next(iter(weights.values())).numpy().tobytes()[:64]
    with open(os.path.join(folder, "model.ckpt"), "rb") as fh:
        assert raw not in fh.read()
    assert latest_checkpoint(out, verify=True, decrypt_with=key) == folder
    resumed = trainer(5, ckptfmt_encrypt_with=key)
    resumed.train(resume_from_checkpoint=True)  # one step, from step 4
    assert resumed.state.global_step == 5
    for kw in ({}, {"ckptfmt_decrypt_with": bytes(32)}):
        with (
            pytest.warns(ckptfmt.CheckpointWarning),
            pytest.raises(ValueError, match="No valid checkpoint found in output directory"),
        ):
            trainer(5, **kw).train(resume_from_checkpoint=True)
    with pytest.raises(ckptfmt.CheckpointError):
        trainer(5).train(resume_from_checkpoint=folder)


def test_signed_encrypted_folders_load_with_both_keys(tmp_path: Any) -> None:
    """ckptfmt_sign_with + ckptfmt_encrypt_with: every public load entry takes decrypt_with and
    trusted_keys; a folder is read with the key only after its signed record and the file's
    SHA-256 held, so a changed wrapped key is a SignatureError, a missing key a DecryptionError."""
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from transformers import GPT2LMHeadModel

    from ckptfmt.integrations.transformers import (
        CkptfmtTrainer,
        check_checkpoint,
        latest_checkpoint,
        load_model,
        load_model_state,
    )

    key, signer = bytes(range(32)), ed25519.Ed25519PrivateKey.generate()
    pub, stranger = signer.public_key(), ed25519.Ed25519PrivateKey.generate().public_key()
    out = str(tmp_path / "run")
    CkptfmtTrainer(
        model=_model(),
        args=_args(out, max_steps=4),
        train_dataset=_tokens(),
        ckptfmt_sign_with=signer,
        ckptfmt_encrypt_with=key,
    ).train()  # one save: checkpoint-4
    folder = os.path.join(out, "checkpoint-4")
    both = {"decrypt_with": key, "trusted_keys": [pub]}
    assert latest_checkpoint(out, verify=True, **both) == folder
    assert check_checkpoint(folder, verify=True, **both).step == 4
    expected = load_model_state(folder, **both)
    model = load_model(folder, GPT2LMHeadModel, **both)
    assert _same(dict(model.state_dict()), dict(expected)) == []
    with pytest.raises(ckptfmt.DecryptionError):
        load_model(folder, GPT2LMHeadModel, trusted_keys=[pub])
    for load in (load_model_state, lambda f, **kw: load_model(f, GPT2LMHeadModel, **kw)):
        with pytest.raises(ckptfmt.SignatureError, match="not among the trusted keys"):
            load(folder, decrypt_with=key, trusted_keys=[stranger])
    data = bytearray(open(os.path.join(folder, "model.ckpt"), "rb").read())
    ioff, ilen = (int.from_bytes(data[len(data) - 64 + i : len(data) - 56 + i], "little") for i in (0, 8))
    data[(ioff + ilen + 63) // 64 * 64 + 64] ^= 1  # the wrapped data key (its identity unchanged)
    with open(os.path.join(folder, "model.ckpt"), "wb") as fh:
        fh.write(data)
    for load in (load_model_state, lambda f, **kw: load_model(f, GPT2LMHeadModel, **kw)):
        with pytest.raises(ckptfmt.SignatureError, match="SHA-256"):
            load(folder, **both)
    with pytest.raises(ckptfmt.SignatureError):
        check_checkpoint(folder, verify=True, **both)
