"""A manager's state file as hostile input: the `resume` fingerprint and the `rng` states.

load_into() reads both from the file.  Whatever they hold, it raises nothing but a
CheckpointError (CorruptError naming the file and the entry for a malformed one), and when it
raises, the caller's model, optimizer and random generators are as they were: everything is
checked before the first byte is written into them.  The files are forged as someone else
would: a real save, then its state file rewritten and its commit record made to name it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import forge_state_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.runs.manager import CheckpointManager
from ckptfmt.runs.steps import STATE_NAME, step_dirname

Mutation = Callable[[dict[str, Any]], None]


# -- a run, and forging its state file (helpers.forge_state_file) -------------------------------------------------------


def _training_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # Adam holds per-parameter state now
    return {"model": model, "optimizer": opt, "step": seed}


def _saved_run(run_dir: str, steps: tuple[int, ...] = (1,)) -> None:
    mgr = CheckpointManager(run_dir)
    for s in steps:
        mgr.save(s, _training_state(s))


def _snapshot(target: dict[str, Any]) -> list[Any]:
    """Everything load_into may change: parameters, optimizer state, the global generators."""
    return [
        [p.detach().clone() for p in target["model"].parameters()],
        copy.deepcopy(target["optimizer"].state_dict()),
        target["step"],
        random.getstate(),
        np.random.get_state(legacy=False),
        torch.get_rng_state(),
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _load_into(run_dir: str, **kw: Any) -> tuple[dict[str, Any], list[Any], Any]:
    """A fresh target, what it held, and load_into's report or the CheckpointError it raised."""
    target = _training_state(99)
    before = _snapshot(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome: Any = CheckpointManager(run_dir).load_into(target, **kw)
        except ckptfmt.CheckpointError as e:
            outcome = e
    return target, before, outcome


# -- mutations ---------------------------------------------------------------------------------

#: what the state file's entries hold, to be replaced (the paths as the payload nests them)
RESUME_PATHS = [
    ("resume",),
    ("resume", "version"),
    ("resume", "step"),
    ("resume", "architecture"),
    ("resume", "architecture", "model"),
    ("resume", "architecture", "model", "weight"),
    ("resume", "architecture", "model", "weight", 0),
    ("resume", "architecture", "model", "weight", 0, 1),
    ("resume", "architecture", "model", "weight", 1),
    ("resume", "optimizer"),
    ("resume", "optimizer", "optimizer"),
    ("resume", "optimizer", "optimizer", 0),
    ("resume", "optimizer", "optimizer", 0, "lr"),
    ("resume", "optimizer", "optimizer", 0, "betas"),
    ("resume", "data"),
    ("resume", "environment"),
    ("resume", "environment", "torch"),
    ("resume", "environment", "devices"),
]
RNG_PATHS = [
    ("rng",),
    ("rng", "version"),
    ("rng", "python"),
    ("rng", "python", "version"),
    ("rng", "python", "state"),
    ("rng", "python", "gauss_next"),
    ("rng", "numpy"),
    ("rng", "numpy", "bit_generator"),
    ("rng", "numpy", "keys"),
    ("rng", "numpy", "pos"),
    ("rng", "numpy", "has_gauss"),
    ("rng", "numpy", "cached_gaussian"),
    ("rng", "torch_cpu"),
    ("rng", "accelerators"),
]
STATE_SIZE = torch.get_rng_state().numel()
#: values that are close to right: the kinds, dtypes and sizes the entries hold, and extremes
NEAR_MISSES = [
    np.zeros(625, np.uint32),
    np.arange(625, dtype=np.uint32),
    np.full(625, 2**32 - 1, np.uint32),
    np.zeros(624, np.uint32),
    np.zeros(625, np.int64),
    torch.zeros(STATE_SIZE, dtype=torch.uint8),
    torch.full((STATE_SIZE,), 255, dtype=torch.uint8),
    torch.zeros(STATE_SIZE),
    torch.zeros(2, 3),
    torch.tensor(0.5),
    {"cuda": [torch.zeros(16, dtype=torch.uint8)]},
    {"cpu": [torch.zeros(STATE_SIZE, dtype=torch.uint8)]},
    {"Not A Device": []},
    {"npu": "x"},
    [[3, 2], "float32"],
    [[3, 2], "float32", "extra"],
    [[-1, 2], "float32"],
    [[3, 2], 7],
    [3, 2],
    {"weight": [[3, 2], "float32"]},
    [{"lr": 0.1}],
    [{"lr": torch.tensor(0.1)}],
    [{1: 0.1}],
    {"torch": torch.ones(2)},
    {"devices": [np.zeros(2)]},
    "MT19937",
    "PCG64",
    2**31,
    -(10**4000),  # (over 4300 digits, hypothesis itself could not show it: see the tests below)
    float("nan"),
    float("inf"),
    b"\x00\x01",
]

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.sampled_from(NEAR_MISSES),
    st.binary(min_size=STATE_SIZE, max_size=STATE_SIZE).map(
        lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    ),
    st.integers(0, 2**32 - 1).map(lambda w: np.array([*range(624), w], dtype=np.uint32)),
)
VALUES = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-3, 3)), inner, max_size=3),
        st.tuples(inner),
    ),
    max_leaves=6,
)


def _has_index(parent: Any, k: Any) -> bool:
    return isinstance(parent, list) and isinstance(k, int) and 0 <= k < len(parent)


@dataclasses.dataclass
class _Edit:
    """Replace the value at `path` (adding the key when absent), or delete it."""

    path: tuple[Any, ...]
    value: Any = None
    delete: bool = False

    def __call__(self, payload: dict[str, Any]) -> None:
        parent: Any = payload
        for k in self.path[:-1]:
            if isinstance(parent, dict) and k in parent or _has_index(parent, k):
                parent = parent[k]
            else:
                return  # an earlier edit removed the way: nothing to do
        last = self.path[-1]
        if isinstance(parent, dict):
            if self.delete:
                parent.pop(last, None)
            else:
                parent[last] = self.value
        elif _has_index(parent, last):
            if self.delete:
                del parent[last]
            else:
                parent[last] = self.value


def _edits(paths: list[tuple[Any, ...]]) -> st.SearchStrategy[list[_Edit]]:
    one = st.one_of(
        st.builds(_Edit, st.sampled_from(paths), VALUES),
        st.builds(_Edit, st.sampled_from(paths), st.none(), st.just(True)),
        # an extra field next to the known ones
        st.builds(
            lambda p, v: _Edit((*p[:-1], "unknown"), v),
            st.sampled_from([p for p in paths if len(p) > 1]),
            VALUES,
        ),
    )
    return st.lists(one, min_size=1, max_size=3)


# -- the property ------------------------------------------------------------------------------


def _assert_refused_cleanly_or_loaded(run_dir: str, **kw: Any) -> Any:
    target, before, outcome = _load_into(run_dir, **kw)
    if isinstance(outcome, ckptfmt.CheckpointError):
        assert _same(_snapshot(target), before), f"{outcome!r} raised after the target changed"
        text = str(outcome)
        assert "\n" not in text and len(text) < 2000, text
        if isinstance(outcome, ckptfmt.CorruptError):
            assert STATE_NAME in text, text  # names the file
    return outcome


_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("paths", [RESUME_PATHS, RNG_PATHS], ids=["resume", "rng"])
@_SETTINGS
@given(data=st.data())
def test_mangled_entries_are_refused_before_anything_changes(paths, data):
    edits = data.draw(_edits(paths))
    with tempfile.TemporaryDirectory() as run_dir:
        _saved_run(run_dir)
        forge_state_file(run_dir, 1, lambda p: [e(p) for e in edits])
        _assert_refused_cleanly_or_loaded(run_dir)
        _assert_refused_cleanly_or_loaded(run_dir, strict=False, restore_rng=False)


# -- the audit's cases, one by one ----------------------------------------------------------------


def _refusal(run_dir: str, mutate: Mutation, **kw: Any) -> ckptfmt.CheckpointError:
    forge_state_file(run_dir, 1, mutate)
    outcome = _assert_refused_cleanly_or_loaded(run_dir, **kw)
    assert isinstance(outcome, ckptfmt.CheckpointError), outcome
    return outcome


@pytest.mark.parametrize(
    "entry, value, key",
    [
        ("torch_cpu", torch.zeros(STATE_SIZE, dtype=torch.uint8), "rng.torch_cpu"),
        ("torch_cpu", torch.zeros(7, dtype=torch.uint8), "rng.torch_cpu"),
        ("numpy", {"bit_generator": "MT19937"}, "rng.numpy.keys"),
        ("python", None, "rng.python"),
        ("version", 10**5000, "rng.version"),
    ],
    ids=["torch_cpu-invalid", "torch_cpu-short", "numpy-fields", "python-none", "version-huge"],
)
def test_a_malformed_rng_state_is_corrupt_and_the_model_is_untouched(tmp_path, entry, value, key):
    _saved_run(str(tmp_path))
    e = _refusal(str(tmp_path), lambda p: p["rng"].__setitem__(entry, value))
    assert isinstance(e, ckptfmt.CorruptError) and e.key == key, repr(e)
    assert e.path is not None and e.path.endswith(STATE_NAME)


@pytest.mark.parametrize(
    "path, value, key",
    [
        (("architecture",), [1, 2], "resume['architecture']"),
        (
            ("architecture", "model", "weight"),
            [[3, 2], "float32", "x"],
            "resume['architecture']['model']['weight']",
        ),
        (("optimizer", "optimizer", 0, "lr"), torch.ones(2), "resume['optimizer']['optimizer'][0]['lr']"),
        (("environment",), {1: "x", "torch": "1"}, "resume['environment'][1]"),
        (("data",), "data", "resume['data']"),
        (("step",), -1, "resume['step']"),
        (("step",), 10**5000, "resume['step']"),
    ],
    ids=["architecture", "weight", "lr-tensor", "environment-key", "data", "step", "step-huge"],
)
def test_a_malformed_fingerprint_is_corrupt_naming_the_entry(tmp_path, path, value, key):
    _saved_run(str(tmp_path))
    e = _refusal(str(tmp_path), _Edit(("resume", *path), value))
    assert isinstance(e, ckptfmt.CorruptError) and e.key == key, repr(e)


def test_a_later_fingerprint_version_is_unsupported(tmp_path):
    _saved_run(str(tmp_path))
    e = _refusal(str(tmp_path), _Edit(("resume", "version"), 2))
    assert isinstance(e, ckptfmt.UnsupportedError) and "version 2" in str(e)


def test_a_step_with_malformed_rng_is_skipped_by_fallback(tmp_path):
    _saved_run(str(tmp_path), steps=(1, 2))
    forge_state_file(
        str(tmp_path), 2, _Edit(("rng", "torch_cpu"), torch.zeros(STATE_SIZE, dtype=torch.uint8))
    )
    target, _, report = _load_into(str(tmp_path), fallback=True)
    assert not isinstance(report, Exception), report
    assert report.step == 1 and report.rng_restored
    assert target["step"] == 1
    assert "rng.torch_cpu" in report.skipped[0]


def test_huge_plain_values_are_differences_shown_bounded(tmp_path):
    _saved_run(str(tmp_path))
    forge_state_file(str(tmp_path), 1, _Edit(("resume", "optimizer", "optimizer", 0, "lr"), 10**5000))
    forge_state_file(str(tmp_path), 1, _Edit(("resume", "environment", "torch"), ["x" * 10_000, 10**5000]))
    _, _, report = _load_into(str(tmp_path))
    assert not isinstance(report, Exception), report
    lr = [d for d in report.differences if ".lr:" in d]
    env = [d for d in report.differences if d.startswith("environment torch")]
    assert len(lr) == 1 and len(env) == 1 and all(len(d) < 300 for d in lr + env), report.differences


# -- the caller's state as the file holds it ------------------------------------------------------


@pytest.mark.parametrize(
    "path, value, key",
    [
        (("param_groups", 0, "params"), [[0], 1], "optimizer.param_groups[0]"),
        (("param_groups", 0, "params"), ["w", "b"], "optimizer.param_groups[0]"),
        (("state",), [1, 2], "optimizer"),
        (("state",), {"w": {}}, "optimizer"),
    ],
    ids=["params-unhashable", "params-str", "state-list", "state-str-keys"],
)
def test_a_malformed_optimizer_state_is_corrupt_before_anything_changes(tmp_path, path, value, key):
    _saved_run(str(tmp_path))
    e = _refusal(str(tmp_path), _Edit(("state", "optimizer", *path), value))
    assert isinstance(e, ckptfmt.CorruptError) and e.key == key, repr(e)


def _with_scheduler(seed: int) -> dict[str, Any]:
    state = _training_state(seed)
    state["scheduler"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=2)
    return state


def test_a_state_an_object_refuses_is_corrupt_and_fallback_restores_the_older_step(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _with_scheduler(1))
    mgr.save(2, _with_scheduler(2))
    forge_state_file(str(tmp_path), 2, _Edit(("state", "scheduler"), 5))  # StepLR.load_state_dict: TypeError
    target = _with_scheduler(99)
    with pytest.raises(ckptfmt.CorruptError, match=r"StepLR\.load_state_dict\(\) refused") as info:
        CheckpointManager(tmp_path).load_into(target)
    assert info.value.key == "scheduler" and info.value.path.endswith(STATE_NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = CheckpointManager(tmp_path).load_into(target, fallback=True)
    assert report.step == 1
    expected = _with_scheduler(1)
    for a, b in zip(target["model"].parameters(), expected["model"].parameters()):
        assert torch.equal(a, b)  # all of step 1, none of the refused step 2 left


@pytest.mark.parametrize(
    "state",
    [
        None,
        [],
        {"epoch": 1},
        {"epoch": "1", "consumed": 0},
        {"epoch": True, "consumed": 0},
        {"epoch": 2**20, "consumed": 0},
        {"epoch": 0, "consumed": 17},
        {"epoch": 0, "consumed": -1},
        {"epoch": 0, "consumed": 1, "x": 0},
    ],
)
def test_the_training_sampler_refuses_a_malformed_state_and_keeps_its_own(state):
    from ckptfmt.demo.training import ResumableBatchSampler

    sampler = ResumableBatchSampler(256, 16, seed=1)
    sampler.load_state_dict({"epoch": 3, "consumed": 5})
    with pytest.raises(ValueError, match="sampler"):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == {"epoch": 3, "consumed": 5}


def test_restore_rng_refuses_a_state_torch_would_refuse_before_any_generator_changes():
    good = ckptfmt.capture_rng()
    bad = {**good, "torch_cpu": torch.zeros(STATE_SIZE, dtype=torch.uint8)}
    random.random(), np.random.rand(), torch.rand(1)  # move away from the capture
    before = [random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()]
    with pytest.raises(
        ckptfmt.runs.rng.RNGStateError, match="field torch_cpu is refused by torch's CPU generator"
    ):
        ckptfmt.restore_rng(bad)
    # refused by the probe, not rolled back after python and numpy were set
    assert _same([random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()], before)


@pytest.mark.parametrize("path", [("state", "optimizer"), ("state", "optimizer", "param_groups")])
def test_a_state_without_the_optimizer_its_fingerprint_names_is_damage_fallback_skips(tmp_path, path):
    """The fingerprint says an optimizer was saved at "optimizer", the state holds an int
    there: the file contradicts itself (CorruptError naming the entry), which a fallback
    skips for the older step, as for any damaged step."""
    _saved_run(str(tmp_path), steps=(1, 2))
    forge_state_file(str(tmp_path), 2, _Edit(path, 5))
    target, _, report = _load_into(str(tmp_path), fallback=True)
    assert not isinstance(report, Exception), report
    assert report.step == 1 and target["step"] == 1
    assert "names an optimizer saved here" in report.skipped[0]
    e = _refusal(str(tmp_path), lambda p: None, step=2)
    assert isinstance(e, ckptfmt.CorruptError) and e.key == "optimizer", repr(e)


def test_an_optimizer_the_checkpoint_never_saved_is_the_callers_mismatch(tmp_path):
    # saved without an optimizer (the fingerprint names none), resumed with one: the caller's
    # state differs from the run's, which a fallback does not paper over
    mgr = CheckpointManager(tmp_path)
    state = _training_state(1)
    mgr.save(1, {"model": state["model"], "optimizer": 5, "step": 1})
    outcome = _load_into(str(tmp_path), fallback=True)[2]
    assert isinstance(outcome, ckptfmt.MismatchError) and "no optimizer state here" in str(outcome)


# -- verify makes the same checks without torch ------------------------------------------------


def _entries_outcome(run_dir: str, build_rng: bool) -> Any:
    """stepcheck.resume_entries of step 1's state file: what it returned, or what it raised."""
    from ckptfmt.files.reader import CheckpointFile
    from ckptfmt.runs.stepcheck import resume_entries

    with CheckpointFile(os.path.join(run_dir, step_dirname(1), STATE_NAME)) as f:
        if not {"resume", "rng"} <= {k for k, _ in f.root_items()}:
            return "not a state file"  # what the step check refuses first, for both
        try:
            return resume_entries(f, build_rng=build_rng)[0]
        except ckptfmt.CheckpointError as e:
            return e


@pytest.mark.parametrize("paths", [RESUME_PATHS, RNG_PATHS], ids=["resume", "rng"])
@_SETTINGS
@given(data=st.data())
def test_verify_refuses_the_entries_a_load_refuses(paths, data):
    """Verify checks the entries as stored, without torch or numpy (resumecheck); a load then
    builds the RNG states and adds this machine's own checks, which must find nothing more on a
    CPU machine: torch's CPU generator and numpy refuse no state the plain checks let through."""
    edits = data.draw(_edits(paths))
    with tempfile.TemporaryDirectory() as run_dir:
        _saved_run(run_dir)
        forge_state_file(run_dir, 1, lambda p: [e(p) for e in edits])
        plain, built = _entries_outcome(run_dir, False), _entries_outcome(run_dir, True)
        if isinstance(plain, Exception) or isinstance(built, Exception):
            assert repr(plain) == repr(built), (plain, built)
        else:
            assert plain == built


@settings(max_examples=300, deadline=None)
@given(
    left=st.integers(-(2**31), 2**31 - 1),
    seeded=st.sampled_from([0, 1, 7, -1]),
    next_=st.integers(0, 2**64 - 1),
)
def test_the_plain_check_of_torchs_cpu_state_is_torchs(left, seeded, next_):
    """resumecheck reads the fields torch's CPU generator checks from the state's bytes: it
    refuses exactly the states torch refuses."""
    import struct

    from ckptfmt.format.decode import RawArray
    from ckptfmt.runs import resumecheck

    assert resumecheck.TORCH_CPU_STATE_BYTES == torch.get_rng_state().numel()
    raw = bytearray(torch.get_rng_state().numpy().tobytes())
    struct.pack_into("=iiQ", raw, 8, left, seeded, next_)
    meta = {"storage": 0, "offset": 0, "stride": [1]}
    value = RawArray("tensor", "uint8", (len(raw),), meta, lambda sid: bytes(raw))
    try:
        resumecheck._check_torch_cpu(value)
        plain_ok = True
    except resumecheck.RNGStateError:
        plain_ok = False
    try:
        torch.Generator().set_state(torch.frombuffer(raw, dtype=torch.uint8))
        torch_ok = True
    except RuntimeError:
        torch_ok = False
    assert plain_ok == torch_ok, (left, seeded, next_)
