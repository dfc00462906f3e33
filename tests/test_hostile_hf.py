"""Hostile ``checkpoint-N`` folders through the real Hugging Face Trainer paths (issue 20).

A run directory may hold folders from anywhere (a download, a shared filesystem other
users write to).  Each case below is a small builder that makes one hostile folder out of
a valid checkpoint, and an action that runs it through the real ``transformers.Trainer``
code with ckptfmt's integration: ``latest_checkpoint``, ``train(resume_from_checkpoint=...)``,
``load_model_state``/``load_model``, ``_save_checkpoint`` and its rotation.  CASES is the
expectations table: what the action must do ("ok" or the error it raises), a warning it
must give, and a check of the run afterwards.  For every case, a directory outside the
run (the targets of the links the builders plant) must be byte-for-byte unchanged; a
FIFO never blocks: each case runs under an alarm that fails it after ALARM_S seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from trainer_helpers import Tokens, tiny_gpt2  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.files import multifile  # noqa: E402

STEP = 4  # the step of the valid checkpoint every case starts from
NEWER = 8  # the step of the hostile folder, newer than STEP
ALARM_S = 30  # a case blocked this long (on a FIFO) fails instead of hanging CI
WEIGHT_DECAY = 0.123  # a value planted in a file the commit does not name
OUTSIDE = ("precious.txt", "victim.json", "state.json", "config.json", "ckpt")


# ---------------------------------------------------------------------------
# a tiny model and trainer


def _tokens() -> Tokens:
    return Tokens(n=8, length=8, vocab=32, seed=5)


def _model() -> Any:
    return tiny_gpt2(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=1)


def _trainer(run: str, limit: int | None = None) -> Any:
    from transformers import TrainingArguments

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    args = TrainingArguments(
        output_dir=run,
        max_steps=STEP + 1,
        per_device_train_batch_size=2,
        save_strategy="no",
        save_total_limit=limit,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=1,
        dataloader_num_workers=0,
    )
    return CkptfmtTrainer(model=_model(), args=args, train_dataset=_tokens())


def _save(run: str, step: int, limit: int | None = None) -> Any:
    """One real save of checkpoint-`step` (and rotation, with `limit`), as training does."""
    trainer = _trainer(run, limit)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.state.global_step = step
    trainer._save_checkpoint(trainer.model, None)
    return trainer


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid checkpoint folder, checkpoint-STEP, that every case copies."""
    run = str(tmp_path_factory.mktemp("template"))
    trainer = _trainer(run)
    trainer.args.max_steps = trainer.args.save_steps = STEP
    trainer.args.save_strategy = "steps"
    trainer.train()  # a real save at step STEP, as training makes it
    return os.path.join(run, f"checkpoint-{STEP}")


# ---------------------------------------------------------------------------
# the builders


@dataclass
class Env:
    run: str  # the output_dir
    outside: str  # what the planted links point to: must stay unchanged
    template: str

    def folder(self, step: int) -> str:
        return os.path.join(self.run, f"checkpoint-{step}")

    def out(self, name: str) -> str:
        return os.path.join(self.outside, name)


def _committed_json(folder: str) -> str:
    text: str = ckptfmt.load(os.path.join(folder, "trainer_state.ckpt"))["trainer_state_json"]
    return text


def _make_env(root: str, template: str) -> Env:
    e = Env(os.path.join(root, "run"), os.path.join(root, "outside"), template)
    os.makedirs(e.run)
    os.makedirs(e.outside)
    with open(e.out("precious.txt"), "wb") as f:
        f.write(b"not yours to touch\n")
    with open(e.out("victim.json"), "w") as f:
        f.write('{"victim": true}\n')
    with open(e.out("state.json"), "w") as f:
        f.write(_committed_json(template))  # exactly the committed text
    shutil.copy(os.path.join(template, "config.json"), e.out("config.json"))
    shutil.copytree(template, e.out("ckpt"))  # a complete checkpoint, outside the run
    return e


def valid(e: Env, step: int = STEP) -> str:
    shutil.copytree(e.template, e.folder(step))
    return e.folder(step)


def newer(e: Env) -> str:
    """checkpoint-STEP, valid, and a copy of it as checkpoint-NEWER to damage."""
    valid(e)
    return valid(e, NEWER)


def link_folder(e: Env) -> None:
    valid(e)
    os.symlink(e.out("ckpt"), e.folder(NEWER))


def link_older_folder(e: Env) -> None:
    os.symlink(e.out("ckpt"), e.folder(STEP))
    valid(e, NEWER)


def link_only(e: Env) -> None:
    os.symlink(e.out("ckpt"), e.folder(NEWER))


def link_dangling_folder(e: Env) -> None:
    valid(e)
    os.symlink(e.out("made-by-ckptfmt"), e.folder(NEWER))


def fifo_folder(e: Env) -> None:
    valid(e)
    os.mkfifo(e.folder(NEWER))


def _replace(folder: str, name: str, make: Callable[[str], None]) -> None:
    os.unlink(os.path.join(folder, name))
    make(os.path.join(folder, name))


def link_entry(name: str, target: str) -> Callable[[Env], None]:
    def build(e: Env) -> None:
        _replace(newer(e), name, lambda p: os.symlink(e.out(target), p))

    build.__name__ = f"link_{name}_to_{target}"
    return build


def fifo_entry(name: str) -> Callable[[Env], None]:
    def build(e: Env) -> None:
        _replace(newer(e), name, os.mkfifo)

    build.__name__ = f"fifo_{name}"
    return build


def _cut_json(folder: str) -> None:
    """trainer_state.json cut short (it is written without fsync): a resume rewrites it."""
    path = os.path.join(folder, "trainer_state.json")
    with open(path, "r+") as f:
        f.truncate(10)


def link_at_old_temp_name(e: Env) -> None:
    """The name the rewrite of trainer_state.json used to write through, planted as a link."""
    folder = newer(e)
    _cut_json(folder)
    os.symlink(e.out("victim.json"), os.path.join(folder, f"trainer_state.json.ckptfmt-tmp.{os.getpid()}"))


def fifo_at_old_temp_name(e: Env) -> None:
    folder = newer(e)
    _cut_json(folder)
    os.mkfifo(os.path.join(folder, f"trainer_state.json.ckptfmt-tmp.{os.getpid()}"))


def links_in_stale_folder(e: Env) -> None:
    """An incomplete checkpoint-NEWER (a crashed save) whose entries are links out: a save of
    that step removes them as names."""
    folder = newer(e)
    os.unlink(os.path.join(folder, "COMMIT"))
    for name, target in (("trainer_state.json", "victim.json"), ("config.json", "config.json")):
        _replace(folder, name, lambda p, t=target: os.symlink(e.out(t), p))  # type: ignore[misc]
    os.symlink(e.outside, os.path.join(folder, "sub"))


def _rewrite_commit(
    folder: str, drop: tuple[str, ...] = (), refs: tuple[multifile.PartRecord, ...] = ()
) -> None:
    record = multifile.read_commit(folder)
    files = tuple(p for p in record.files if p.name not in drop)
    os.unlink(os.path.join(folder, "COMMIT"))
    multifile.write_commit(folder, dataclasses.replace(record, files=files, references=refs))


def _part(folder: str, name: str) -> multifile.PartRecord:
    return next(p for p in multifile.read_commit(folder).files if p.name == name)


def model_not_committed(e: Env) -> None:
    """model.ckpt present (other weights: zeros) but not named by the commit record."""
    folder = newer(e)
    state = ckptfmt.load(os.path.join(folder, "model.ckpt"))
    _rewrite_commit(folder, drop=("model.ckpt",))
    os.unlink(os.path.join(folder, "model.ckpt"))
    ckptfmt.save({k: torch.zeros_like(v) for k, v in state.items()}, os.path.join(folder, "model.ckpt"))


def optimizer_not_committed(e: Env) -> None:
    """optimizer.ckpt present with a planted weight decay, not named by the commit record."""
    folder = newer(e)
    state = ckptfmt.load(os.path.join(folder, "optimizer.ckpt"))
    for group in state["param_groups"]:
        group["weight_decay"] = WEIGHT_DECAY
    _rewrite_commit(folder, drop=("optimizer.ckpt",))
    os.unlink(os.path.join(folder, "optimizer.ckpt"))
    ckptfmt.save(state, os.path.join(folder, "optimizer.ckpt"))


def commit_through_linked_subdir(e: Env) -> None:
    """The commit record names sub/model.ckpt, sub being a link to a checkpoint outside."""
    folder = newer(e)
    ref = dataclasses.replace(_part(folder, "model.ckpt"), name="sub/model.ckpt")
    _rewrite_commit(folder, refs=(ref,))
    os.symlink(e.out("ckpt"), os.path.join(folder, "sub"))


def commit_through_linked_sibling(e: Env) -> None:
    """The commit record names ../checkpoint-2/model.ckpt, checkpoint-2 a link to outside."""
    folder = newer(e)
    ref = dataclasses.replace(_part(folder, "model.ckpt"), name="../checkpoint-2/model.ckpt")
    _rewrite_commit(folder, refs=(ref,))
    os.symlink(e.out("ckpt"), e.folder(2))


def rotation_over_links(e: Env) -> None:
    """Old complete folders holding links out (to a file, to a directory): rotation deletes
    the folders, never what the links point to."""
    folder = valid(e)
    os.symlink(e.out("precious.txt"), os.path.join(folder, "notes.txt"))
    os.symlink(e.outside, os.path.join(folder, "sub"))
    valid(e, NEWER)


def _config_json(folder: str, write: Callable[[str], None]) -> None:
    """config.json (which the commit record does not cover) replaced by what `write` writes."""
    os.unlink(os.path.join(folder, "config.json"))
    write(os.path.join(folder, "config.json"))


def config_with(label: str, **changes: Any) -> Callable[[Env], None]:
    """config.json of checkpoint-NEWER with `changes`: valid JSON, hostile values."""

    def build(e: Env) -> None:
        folder = newer(e)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config.update(changes)

        def write(path: str) -> None:
            with open(path, "w") as f:
                json.dump(config, f)

        _config_json(folder, write)

    build.__name__ = f"config_{label}"
    return build


def config_bytes(label: str, data: bytes) -> Callable[[Env], None]:
    def build(e: Env) -> None:
        def write(path: str) -> None:
            with open(path, "wb") as f:
                f.write(data)

        _config_json(newer(e), write)

    build.__name__ = f"config_{label}"
    return build


# ---------------------------------------------------------------------------
# the actions: the real Trainer paths


def do_latest(e: Env) -> Any:
    from ckptfmt.integrations.transformers import latest_checkpoint

    found = latest_checkpoint(e.run, verify=True)
    assert found == e.folder(STEP), found
    return None


def do_resume_latest(e: Env) -> Any:
    trainer = _trainer(e.run)
    trainer.train(resume_from_checkpoint=True)
    return trainer


def do_resume_newer(e: Env) -> Any:
    trainer = _trainer(e.run)
    trainer.train(resume_from_checkpoint=e.folder(NEWER))
    return trainer


def do_load_state(e: Env) -> Any:
    from ckptfmt.integrations.transformers import load_model_state

    return load_model_state(e.folder(NEWER))


def do_load_model(e: Env) -> Any:
    from transformers import GPT2LMHeadModel

    from ckptfmt.integrations.transformers import load_model

    return load_model(e.folder(NEWER), GPT2LMHeadModel)


def do_load_auto_model(e: Env) -> Any:
    """load_model through an Auto class: the model is made by from_config (config.json's dtype)."""
    from transformers import AutoModelForCausalLM

    from ckptfmt.integrations.transformers import load_model

    return load_model(e.folder(NEWER), AutoModelForCausalLM)


def do_save_newer(e: Env) -> Any:
    return _save(e.run, NEWER)


def do_save_and_rotate(e: Env) -> Any:
    return _save(e.run, NEWER + 4, limit=1)


def do_load_best_outside(e: Env) -> Any:
    """The end of training with load_best_model_at_end: the best folder a resumed state
    records (trainer_state.json: from the folder) is outside the run."""
    trainer = _trainer(e.run)
    trainer.state.best_model_checkpoint = e.out("ckpt")
    trainer._load_best_model()
    return trainer


def do_load_best(e: Env) -> Any:
    trainer = _trainer(e.run)
    trainer.state.best_model_checkpoint = os.path.join("/elsewhere/moved/run", f"checkpoint-{STEP}")
    trainer._load_best_model()
    return trainer


# ---------------------------------------------------------------------------
# checks of the run afterwards


def real_complete(step: int) -> Callable[[Env, Any], None]:
    def check(e: Env, _result: Any) -> None:
        from ckptfmt.integrations.transformers import check_checkpoint

        assert stat.S_ISDIR(os.lstat(e.folder(step)).st_mode), f"checkpoint-{step} is not a real folder"
        check_checkpoint(e.folder(step))

    return check


def json_is_committed(e: Env, _result: Any) -> None:
    """trainer_state.json is now a regular file of the folder holding the committed text."""
    path = os.path.join(e.folder(NEWER), "trainer_state.json")
    assert stat.S_ISREG(os.lstat(path).st_mode), "trainer_state.json is still not a regular file"
    with open(path) as f:
        assert f.read() == _committed_json(e.folder(NEWER))


def optimizer_not_loaded(_e: Env, trainer: Any) -> None:
    assert all(g["weight_decay"] != WEIGHT_DECAY for g in trainer.optimizer.param_groups)


def _same_model(trainer: Any, folder: str) -> bool:
    saved = ckptfmt.load(os.path.join(folder, "model.ckpt"))
    return all(torch.equal(v, saved[k]) for k, v in trainer.model.state_dict().items() if k in saved)


def best_not_loaded(e: Env, trainer: Any) -> None:
    assert not _same_model(trainer, e.out("ckpt")), "the best model was loaded from outside the run"


def best_loaded(e: Env, trainer: Any) -> None:
    assert _same_model(trainer, e.folder(STEP)), "the best model of the run was not loaded"


def link_left_alone(e: Env, _result: Any) -> None:
    assert os.path.islink(e.folder(STEP))


def rotated(e: Env, _result: Any) -> None:
    assert sorted(os.listdir(e.run)) == [f"checkpoint-{NEWER + 4}"]


# ---------------------------------------------------------------------------
# the expectations table


@dataclass(frozen=True)
class Case:
    kind: str  # the class of hostile folder (the report counts cases per class)
    build: Callable[[Env], None]
    action: Callable[[Env], Any]
    expect: str  # "ok", or a regex the raised error's "<class>: <message>" must match
    warns: str | None = None  # a regex one CheckpointWarning must match
    after: Callable[[Env, Any], None] | None = None

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.build.__name__}-{self.action.__name__}"


NOT_COMPLETE = r"(Incomplete|Corrupt|Signature|Decryption)Error: .*not a complete ckptfmt checkpoint"
CONFIG_MISFIT = r"CorruptError: .*checkpoint-8: config.json does not fit the committed model: "
CASES = [
    # a checkpoint-N that is a link: skipped with a warning, never written into or emptied
    Case("folder-link", link_folder, do_latest, "ok", r"checkpoint-8.*symbolic link"),
    Case("folder-link", link_folder, do_resume_latest, "ok", r"checkpoint-8.*symbolic link"),
    Case("folder-link", link_folder, do_save_newer, "ok", after=real_complete(NEWER)),
    Case("folder-link", link_dangling_folder, do_save_newer, "ok", after=real_complete(NEWER)),
    Case(
        "folder-link",
        link_only,
        do_resume_latest,
        r"IncompleteError: .*No valid checkpoint found in output directory",
    ),
    Case("folder-link", link_older_folder, do_save_and_rotate, "ok", after=link_left_alone),
    # links inside a folder: never followed
    Case(
        "entry-link",
        link_entry("trainer_state.json", "victim.json"),
        do_resume_newer,
        "ok",
        r"trainer_state.json",
        json_is_committed,
    ),
    Case(
        "entry-link",
        link_entry("trainer_state.json", "state.json"),
        do_resume_newer,
        "ok",
        r"trainer_state.json",
        json_is_committed,
    ),
    Case(
        "entry-link",
        link_entry("model.ckpt", "ckpt/model.ckpt"),
        do_latest,
        "ok",
        r"checkpoint-8.*model.ckpt",
    ),
    Case("entry-link", link_entry("model.ckpt", "ckpt/model.ckpt"), do_resume_newer, NOT_COMPLETE),
    Case("entry-link", link_entry("COMMIT", "ckpt/COMMIT"), do_load_state, r"CorruptError: .*symbolic link"),
    Case("entry-link", link_entry("config.json", "config.json"), do_load_model, r"LinkError: .*config.json"),
    Case("entry-link", links_in_stale_folder, do_save_newer, "ok", after=real_complete(NEWER)),
    Case("entry-link", rotation_over_links, do_save_and_rotate, "ok", after=rotated),
    # the commit record naming a file through a link
    Case("commit-link", commit_through_linked_subdir, do_load_state, r"CorruptError: .*sub/model.ckpt"),
    Case("commit-link", commit_through_linked_subdir, do_latest, "ok", r"checkpoint-8.*sub/model.ckpt"),
    Case(
        "commit-link",
        commit_through_linked_sibling,
        do_load_state,
        r"CorruptError: .*checkpoint-2/model.ckpt",
    ),
    # a name a temporary file was written through, planted beforehand
    Case("temp-name", link_at_old_temp_name, do_resume_newer, "ok", r"trainer_state.json", json_is_committed),
    Case("temp-name", fifo_at_old_temp_name, do_resume_newer, "ok", r"trainer_state.json", json_is_committed),
    # files the commit record does not name: never read
    Case("uncommitted", model_not_committed, do_load_state, r"IncompleteError: .*names no model.ckpt"),
    Case("uncommitted", model_not_committed, do_load_model, r"IncompleteError: .*names no model.ckpt"),
    Case("uncommitted", model_not_committed, do_resume_newer, r"IncompleteError: .*names no model.ckpt"),
    Case("uncommitted", optimizer_not_committed, do_resume_newer, "ok", after=optimizer_not_loaded),
    # FIFOs: refused or replaced, never waited on
    Case(
        "fifo",
        fifo_entry("trainer_state.json"),
        do_resume_newer,
        "ok",
        r"trainer_state.json",
        json_is_committed,
    ),
    Case(
        "fifo",
        fifo_entry("trainer_state.json"),
        do_resume_latest,
        "ok",
        r"trainer_state.json",
        json_is_committed,
    ),
    Case("fifo", fifo_entry("COMMIT"), do_latest, "ok", r"checkpoint-8.*COMMIT"),
    Case("fifo", fifo_entry("model.ckpt"), do_load_state, r"CorruptError: .*model.ckpt"),
    Case("fifo", fifo_entry("config.json"), do_load_model, r"UnsupportedError: .*config.json"),
    Case("fifo", fifo_folder, do_latest, "ok", r"checkpoint-8.*symbolic link or other entry"),
    Case("fifo", fifo_folder, do_save_newer, "ok", after=real_complete(NEWER)),
    # the best checkpoint a resumed state records: looked for in the run only, by name
    Case("best", valid, do_load_best_outside, "ok", after=best_not_loaded),
    Case("best", link_older_folder, do_load_best, "ok", after=best_not_loaded),
    Case("best", valid, do_load_best, "ok", after=best_loaded),
    # config.json, which the commit record does not cover: refused unless the model it makes is
    # the committed one, found on the meta device before anything is allocated
    Case(
        "config",
        config_with("huge_vocab", vocab_size=2**40),
        do_load_model,
        CONFIG_MISFIT + r".*transformer.wte.weight.*\[32, 8\].*\[1099511627776, 8\]",
    ),
    Case("config", config_with("wrong_n_embd", n_embd=16), do_load_model, CONFIG_MISFIT + r".*\[32, 16\]"),
    Case("config", config_with("fewer_layers", n_layer=0), do_load_model, CONFIG_MISFIT + r".*h.0"),
    Case(
        "config",
        config_with("dtype", dtype="float16"),
        do_load_auto_model,
        CONFIG_MISFIT + r".*torch.float32 \[32, 8\] in model.ckpt, torch.float16 \[32, 8\] in the model",
    ),
    Case("config", newer, do_load_auto_model, "ok"),
    Case(
        "config",
        config_with("many_layers", n_layer=100_000),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json does not make a model: .*more than",
    ),
    Case(
        "config",
        config_with("bad_heads", n_head=3),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json does not make a model: ValueError: .*divisible",
    ),
    Case(
        "config",
        config_with("negative_vocab", vocab_size=-5),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json does not make a model: RuntimeError: .*negative",
    ),
    Case(
        "config",
        config_with("wrong_type", n_layer="two"),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json is not a gpt2 config: .*n_layer",
    ),
    Case(
        "config",
        config_with("unknown_model_type", model_type="no-such-model"),
        do_load_model,
        r"UnsupportedError: .*checkpoint-8: config.json: model_type 'no-such-model' is not a model type",
    ),
    Case(
        "config",
        config_bytes("not_json", b"\xff\xfe not json"),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json is not JSON",
    ),
    Case(
        "config",
        config_bytes("deep_json", b"[" * 100_000 + b"]" * 100_000),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json is not JSON: RecursionError",
    ),
    Case(
        "config",
        config_bytes("not_an_object", b"[1, 2]"),
        do_load_model,
        r"CorruptError: .*checkpoint-8: config.json is not a model config: not an object",
    ),
]


# ---------------------------------------------------------------------------
# running a case


def _snapshot(root: str) -> dict[str, tuple[Any, ...]]:
    """Every entry below `root` (links not followed): its kind and mode, a file's bytes, a link's target."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    out[rel] = ("file", st.st_mode, f.read())
            else:
                out[rel] = ("other", st.st_mode)
    return out


class Blocked(BaseException):
    """A case blocked (on a FIFO): a BaseException, so no `except Exception` swallows it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Blocked(f"blocked for {ALARM_S} s (a FIFO waited on?)")


@pytest.fixture
def alarm() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(ALARM_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(case: Case, e: Env) -> tuple[str, Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, outcome = case.action(e), "ok"
        except Exception as ex:  # what the table expects is checked by the caller
            result, outcome = None, f"{type(ex).__name__}: {ex}"
    said = [str(w.message) for w in caught if issubclass(w.category, ckptfmt.CheckpointWarning)]
    return outcome, result, said


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_folder(case: Case, template: str, tmp_path: Any, alarm: None) -> None:
    e = _make_env(str(tmp_path), template)
    case.build(e)
    before = _snapshot(e.outside)
    outcome, result, said = _outcome(case, e)
    assert _snapshot(e.outside) == before, "a file outside the run directory was changed"
    assert not os.path.lexists(e.out("made-by-ckptfmt"))
    if case.expect == "ok":
        assert outcome == "ok", outcome
    else:
        assert re.search(case.expect, outcome.replace("\n", " ")), outcome
    if case.warns is not None:
        assert any(re.search(case.warns, w) for w in said), said
    if case.after is not None:
        case.after(e, result)


def test_the_corpus_covers_every_class() -> None:
    kinds = {c.kind for c in CASES}
    assert kinds == {
        "folder-link",
        "entry-link",
        "commit-link",
        "temp-name",
        "uncommitted",
        "fifo",
        "best",
        "config",
    }
    assert len({c.id for c in CASES}) == len(CASES), "two cases share an id"


def _committed_folder(folder: str, model: Any) -> None:
    """A complete checkpoint folder of `model` as the integration writes one (model.ckpt,
    trainer_state.ckpt, COMMIT naming both, config.json beside them)."""
    os.makedirs(folder)
    ckptfmt.save(dict(model.state_dict()), os.path.join(folder, "model.ckpt"))
    ckptfmt.save({"trainer_state_json": "{}"}, os.path.join(folder, "trainer_state.ckpt"))
    model.config.save_pretrained(folder)
    parts = tuple(
        multifile.describe_part(os.path.join(folder, n), n) for n in ("model.ckpt", "trainer_state.ckpt")
    )
    multifile.write_commit(folder, multifile.CommitRecord(1, "hf-trainer", parts, (), {}, {}))


def test_load_model_keeps_buffers_outside_the_state_dict(tmp_path: Any) -> None:
    """BERT's position_ids and token_type_ids are buffers outside its state dict: the model
    load_model builds (checked on the meta device first) has them as BERT makes them."""
    from transformers import AutoModel, BertConfig, BertModel

    from ckptfmt.integrations.transformers import load_model

    torch.manual_seed(0)
    saved = BertModel(
        BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )
    folder = os.path.join(str(tmp_path), "checkpoint-1")
    _committed_folder(folder, saved)
    for cls in (AutoModel, BertModel):
        model = load_model(folder, cls)
        assert type(model) is BertModel
        assert model.state_dict().keys() == saved.state_dict().keys()
        assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
        for name, buffer in saved.named_buffers():
            assert torch.equal(dict(model.named_buffers())[name], buffer), name
        ids = torch.tensor([[1, 2, 3]])
        model.eval()
        saved.eval()
        assert torch.equal(model(ids).last_hidden_state, saved(ids).last_hidden_state)
