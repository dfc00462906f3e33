"""Which checkpoints a run keeps: retention.kept_steps as a pure function, and the step
directories a real CheckpointManager leaves on disk after a sequence of saves."""

from __future__ import annotations

import math
import os
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.files import multifile
from ckptfmt.runs import retention
from ckptfmt.runs.manager import CheckpointManager
from ckptfmt.runs.steps import parse_step_dirname, step_dirname


def documented(history, keep_last=None, keep_every=None, keep_best=None, best_mode="min"):
    """The issue's rules, written out independently of retention.py.

    No rule: everything.  Otherwise the newest, the `keep_last` newest, every step divisible
    by `keep_every`, and the best by `keep_best` (NaN or absent never best; ties: earliest).
    """
    steps = sorted(s for s, _ in history)
    if keep_last is None and keep_every is None and keep_best is None:
        return set(steps)
    if not steps:
        return set()
    kept = {steps[-1]}
    if keep_last is not None:
        kept |= set(steps[len(steps) - min(keep_last, len(steps)) :])
    if keep_every is not None:
        kept |= {s for s in steps if s % keep_every == 0}
    if keep_best is not None:
        scored = [(m[keep_best], s) for s, m in history if keep_best in m and not math.isnan(m[keep_best])]
        if scored:
            target = min(v for v, _ in scored) if best_mode == "min" else max(v for v, _ in scored)
            kept.add(min(s for v, s in scored if v == target))
    return kept


# -- the pure function ---------------------------------------------------------------


def _h(*pairs):
    return [(s, {} if v is None else {"loss": v}) for s, v in pairs]


def test_no_rule_keeps_everything():
    assert retention.kept_steps(_h((1, 3.0), (2, 1.0), (5, None))) == {1, 2, 5}
    assert retention.kept_steps([]) == set()
    assert retention.kept_steps([], keep_last=2) == set()


def test_keep_last():
    hist = _h(*[(s, None) for s in (10, 20, 30, 40, 50)])
    assert retention.kept_steps(hist, keep_last=1) == {50}
    assert retention.kept_steps(hist, keep_last=2) == {40, 50}
    assert retention.kept_steps(hist, keep_last=99) == {10, 20, 30, 40, 50}


def test_keep_every_also_keeps_the_newest():
    hist = _h(*[(s, None) for s in range(1, 8)])
    assert retention.kept_steps(hist, keep_every=3) == {3, 6, 7}
    assert retention.kept_steps(hist, keep_every=3, keep_last=2) == {3, 6, 7}
    assert retention.kept_steps(hist, keep_every=2, keep_last=3) == {2, 4, 5, 6, 7}


def test_keep_best_min_max_ties_nan_and_missing():
    hist = _h((1, 0.5), (2, 0.2), (3, float("nan")), (4, 0.2), (5, None), (6, 0.9))
    assert retention.kept_steps(hist, keep_best="loss") == {2, 6}  # tie 2/4: the earlier
    assert retention.kept_steps(hist, keep_best="loss", best_mode="max") == {6}
    assert retention.kept_steps(hist, keep_best="loss", keep_last=2) == {2, 5, 6}
    # a metric nobody logged keeps only the newest; NaN is never best
    assert retention.kept_steps(hist, keep_best="acc") == {6}
    assert retention.best_step(_h((1, float("nan")), (2, None)), "loss", "min") is None
    assert retention.best_step(_h((1, -math.inf), (2, 0.0)), "loss", "min") == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_last": True},
        {"keep_last": 1.0},
        {"keep_every": 0},
        {"keep_every": "2"},
        {"keep_best": ""},
        {"keep_best": 3},
        {"best_mode": "mean"},
        {"best_mode": None},
    ],
)
def test_meaningless_rules_are_rejected(kwargs, tmp_path):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        retention.kept_steps(_h((1, None)), **kwargs)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CheckpointManager(run, **kwargs)
    assert not run.exists(), "a rejected configuration must not create the run directory"


metric_values = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-3, 3),
    st.sampled_from([0.0, -0.0, 1.0]),
)
histories = st.lists(st.integers(0, 60), unique=True, max_size=14).flatmap(
    lambda steps: st.tuples(*[st.tuples(st.just(s), metric_values) for s in steps]).map(list)
)
rules = st.fixed_dictionaries(
    {
        "keep_last": st.none() | st.integers(1, 5),
        "keep_every": st.none() | st.integers(1, 7),
        "keep_best": st.none() | st.sampled_from(["loss", "acc"]),
        "best_mode": st.sampled_from(["min", "max"]),
    }
)


def _hist(pairs):
    return [(s, {} if v is None else {"loss": v}) for s, v in pairs]


@given(histories, rules)
@settings(max_examples=400, deadline=None)
def test_kept_steps_is_the_documented_set(pairs, rule):
    hist = _hist(pairs)
    kept = retention.kept_steps(hist, **rule)
    assert kept == documented(hist, **rule)
    steps = {s for s, _ in hist}
    assert kept <= steps
    if steps:
        assert max(steps) in kept, "the newest checkpoint must always be kept"
    # order of the input does not matter
    assert retention.kept_steps(list(reversed(hist)), **rule) == kept


@given(histories, rules, st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_more_generous_rules_keep_a_superset(pairs, rule, extra):
    hist = _hist(pairs)
    kept = retention.kept_steps(hist, **rule)
    if rule["keep_last"] is not None:
        assert kept <= retention.kept_steps(hist, **{**rule, "keep_last": rule["keep_last"] + extra})
    if rule["keep_every"] is not None or rule["keep_best"] is not None:
        # adding keep_last to a rule set never drops anything the other rules keep
        assert kept <= retention.kept_steps(hist, **{**rule, "keep_last": (rule["keep_last"] or 0) + extra})


@given(histories, rules)
@settings(max_examples=200, deadline=None)
def test_rotating_after_every_save_ends_at_the_documented_set(pairs, rule):
    """What the manager does: apply the rules to what is left after each commit.  The end
    result must be the rules applied to the whole history (nothing deleted too early)."""
    hist = sorted(_hist(pairs))
    present = []
    for item in hist:
        present.append(item)
        kept = retention.kept_steps(present, **rule)
        present = [p for p in present if p[0] in kept]
    assert {s for s, _ in present} == documented(hist, **rule)


# -- through a real manager -------------------------------------------------------------


def _step_dirs(directory):
    return {s for s in map(parse_step_dirname, os.listdir(directory)) if s is not None}


def _tiny(step):
    return {"w": torch.full((2,), float(step)), "step": step}


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=9).map(
        lambda gaps: [sum(gaps[: i + 1]) for i in range(len(gaps))]
    ),
    st.data(),
    rules,
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_manager_leaves_the_documented_directories(steps, data, rule):
    values = data.draw(st.lists(metric_values, min_size=len(steps), max_size=len(steps)))
    hist = [(s, {} if v is None else {"loss": v}) for s, v in zip(steps, values)]
    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d, **rule)
        for s, metrics in hist:
            mgr.save(s, _tiny(s), metrics=metrics)
            # after every commit: the newest is there and is the one latest() returns
            assert mgr.latest().step == s
        expected = documented(hist, **rule)
        assert _step_dirs(d) == expected
        assert [c.step for c in mgr.checkpoints()] == sorted(expected)
        kept = [h for h in hist if h[0] in expected]
        # NaN metrics are stored too (and are never best): compare them by their text
        assert [repr(c.metrics) for c in mgr.checkpoints()] == [repr(m) for _, m in kept]
        # nothing else is left behind: no temporaries, no stray files
        assert sorted(os.listdir(d)) == sorted(step_dirname(s) for s in expected)


def test_non_blocking_manager_rotates_the_same_way(tmp_path):
    steps = [1, 2, 3, 4, 5, 6, 7, 8]
    losses = [5.0, 1.0, 4.0, 3.0, 0.5, 6.0, 7.0, 8.0]
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=4, keep_best="loss", blocking=False)
    for s, v in zip(steps, losses):
        mgr.save(s, _tiny(s), metrics={"loss": v})
    mgr.wait()
    assert _step_dirs(tmp_path) == {4, 5, 7, 8}


def test_nothing_is_deleted_before_the_newer_checkpoint_commits(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _tiny(1))
    seen = []
    real = multifile.write_commit

    def spy(directory, record, within=None):
        seen.append((record.step, _step_dirs(tmp_path)))
        real(directory, record, within)

    monkeypatch.setattr(multifile, "write_commit", spy)
    mgr.save(2, _tiny(2))
    mgr.save(3, _tiny(3))
    assert seen == [(2, {1, 2}), (3, {2, 3})]
    assert _step_dirs(tmp_path) == {3}


def test_a_failed_save_deletes_nothing(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _tiny(1))

    def fail(directory, record, within=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(multifile, "write_commit", fail)
    with pytest.raises(OSError, match="No space"):
        mgr.save(2, _tiny(2))
    assert _step_dirs(tmp_path) == {1}, "the failed step is removed, the old checkpoint kept"
    assert mgr.latest().step == 1


def test_the_only_complete_checkpoint_is_never_deleted(tmp_path):
    # the newest is the worst by the metric and not divisible by keep_every: still kept
    mgr = CheckpointManager(tmp_path, keep_last=1, keep_every=100, keep_best="loss")
    mgr.save(1, _tiny(1), metrics={"loss": 0.1})
    mgr.save(3, _tiny(3), metrics={"loss": 9.0})
    assert _step_dirs(tmp_path) == {1, 3}
    mgr.remove(1)
    mgr.save(5, _tiny(5), metrics={"loss": 10.0})
    assert _step_dirs(tmp_path) == {3, 5}, "3 is best among the complete ones now"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptfmt.CheckpointWarning)
        assert mgr.latest().step == 5
