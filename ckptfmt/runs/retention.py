"""Which checkpoints of a run to keep: the rotation rules, as one pure function."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def check_rules(keep_last: int | None, keep_every: int | None, keep_best: str | None, best_mode: str) -> None:
    """Reject rule values that cannot mean anything (before any checkpoint is written)."""
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    if keep_best is not None and (type(keep_best) is not str or not keep_best):
        raise ValueError(f"keep_best must be a metric name or None, not {keep_best!r}")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")


def best_step(checkpoints: Sequence[tuple[int, Mapping[str, float]]], metric: str, mode: str) -> int | None:
    """The step with the best value of `metric`; ties go to the earliest step.

    Checkpoints without the metric, or with a NaN value, are never best.
    """
    best: tuple[float, int] | None = None
    for step, metrics in sorted(checkpoints):
        value = metrics.get(metric)
        if value is None or math.isnan(value):
            continue
        score = value if mode == "min" else -value
        if best is None or score < best[0]:
            best = (score, step)
    return None if best is None else best[1]


def kept_steps(
    checkpoints: Sequence[tuple[int, Mapping[str, float]]],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: str | None = None,
    best_mode: str = "min",
) -> set[int]:
    """The steps to keep among complete checkpoints given as (step, metrics).

    With no rule set, every checkpoint is kept.  Otherwise a checkpoint is kept
    when any rule keeps it: it is one of the `keep_last` newest, its step is a
    multiple of `keep_every`, or it is the best by the metric `keep_best`.  The
    newest checkpoint is always kept, so a run never loses its resume point.
    """
    check_rules(keep_last, keep_every, keep_best, best_mode)
    steps = sorted({s for s, _ in checkpoints})
    if not steps:
        return set()
    if keep_last is None and keep_every is None and keep_best is None:
        return set(steps)
    kept = {steps[-1]}
    if keep_last is not None:
        kept.update(steps[-keep_last:])
    if keep_every is not None:
        kept.update(s for s in steps if s % keep_every == 0)
    if keep_best is not None:
        best = best_step(checkpoints, keep_best, best_mode)
        if best is not None:
            kept.add(best)
    return kept
