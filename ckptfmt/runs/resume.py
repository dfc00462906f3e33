"""Resuming a training run: what a manager's state file holds, and the checks made on resume.

A checkpoint manager's state file is an ordinary ckptfmt file whose root is::

    {"state":  the caller's state; objects with state_dict()/load_state_dict()
               (modules, optimizers, schedulers, scalers, stateful data loaders)
               are stored as their state dicts,
     "rng":    capture_rng() at save time,
     "resume": {"version": 1, "step": ..., "architecture": ..., "optimizer": ...,
                "data": ..., "environment": ...}}

"resume" is the fingerprint the five resume checks compare against: module
parameter names, shapes and dtypes; optimizer hyper-parameters per group; which
entries hold a data position; that RNG state is present; and the environment
(versions, devices, world size) the checkpoint was written in.
"""

from __future__ import annotations

import collections
import platform
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import __version__
from ..errors import CorruptError
from ..files.load_into import fill_from_node
from ..files.reader import CheckpointFile
from ..files.targets import LoadReport, MismatchError
from ..format import dtypes
from ..format.decode import decode_key
from ..format.render import short_repr
from .resumecheck import HPARAM_TYPES, PAYLOAD_VERSION

#: top-level keys of a state that name a data position by convention (a plain
#: dict such as {"epoch": 3, "batch": 120} kept under one of these names)
DATA_KEYS = frozenset({"data", "data_position", "dataloader", "data_loader", "loader", "sampler"})


def is_stateful(obj: object) -> bool:
    """Has state_dict() and load_state_dict(), like torch.distributed.checkpoint's Stateful."""
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _walk(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, object) of every stateful object reachable through dicts and lists."""
    if is_stateful(state):
        yield prefix or "state", state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _walk(v, _join(prefix, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _walk(v, _join(prefix, i))


def to_storable(state: Any) -> Any:
    """The state with every stateful object replaced by its state_dict() (containers are copied)."""
    if is_stateful(state):
        return state.state_dict()
    if type(state) in (dict, collections.OrderedDict):
        out = type(state)((k, to_storable(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if type(state) is list:
        return [to_storable(v) for v in state]
    if type(state) is tuple:
        return tuple(to_storable(v) for v in state)
    return state


# -- fingerprints ------------------------------------------------------------------


def _architecture(module: torch.nn.Module) -> dict[str, list[Any]]:
    return {
        name: [list(t.shape), dtypes.TORCH_NAMES.get(t.dtype, str(t.dtype))]
        for name, t in module.state_dict().items()
        if isinstance(t, torch.Tensor)
    }


def _hparams(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for g in opt.param_groups:
        hp: dict[str, Any] = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, tuple) and all(isinstance(x, HPARAM_TYPES) for x in v):
                hp[k] = list(v)
            elif isinstance(v, HPARAM_TYPES):
                hp[k] = v
        groups.append(hp)
    return groups


def _is_data_position(path: str, obj: object) -> bool:
    name = type(obj).__name__
    return "DataLoader" in name or "Sampler" in name or path in DATA_KEYS


def environment() -> dict[str, Any]:
    """Where a checkpoint is written: versions, devices, world size."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    elif torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            devices += [f"{acc.type}:{i}" for i in range(torch.accelerator.device_count())]
    world = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    return {
        "ckptfmt": __version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "cuda": str(torch.version.cuda or "none"),
        "devices": devices,
        "world_size": world,
    }


def fingerprint(state: Any, step: int) -> dict[str, Any]:
    arch: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    data: list[str] = []
    for path, obj in _walk(state):
        if isinstance(obj, torch.nn.Module):
            arch[path] = _architecture(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            optim[path] = _hparams(obj)
        if _is_data_position(path, obj):
            data.append(path)
    if isinstance(state, dict):
        data += [k for k, v in state.items() if k in DATA_KEYS and not is_stateful(v)]
    return {
        "version": PAYLOAD_VERSION,
        "step": step,
        "architecture": arch,
        "optimizer": optim,
        "data": data,
        "environment": environment(),
    }


def build_payload(state: Any, step: int, rng: dict[str, Any] | None) -> dict[str, Any]:
    """What a manager writes for `state` at `step` (stateful objects become state dicts)."""
    return {"state": to_storable(state), "rng": rng, "resume": fingerprint(state, step)}


# -- checks on resume -----------------------------------------------------------------


@dataclass
class ResumeReport(LoadReport):
    """What a manager's load_into() did: LoadReport's keys, plus where it resumed from and
    every difference between the checkpoint and the current run."""

    step: int | None = None
    path: str = ""
    differences: list[str] = field(default_factory=list)
    rng_restored: bool = False
    skipped: list[str] = field(default_factory=list)


def _shown(v: object) -> str:
    """A value or name from the file as a message shows it: bounded, on one line (str() of an
    int of more than 4300 digits would raise)."""
    if type(v) is str and len(v) <= 80 and v.isprintable():
        return v
    return short_repr(v, 80)


def _few(items: list[str], n: int = 3) -> str:
    return "; ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")


def architecture_problems(saved: dict[str, Any], state: Any) -> list[str]:
    """Differences in module parameter names, shapes and dtypes (what strict loading refuses)."""
    out = []
    for path, obj in _walk(state):
        if not isinstance(obj, torch.nn.Module):
            continue
        before = saved.get(path)
        if not isinstance(before, dict):
            out.append(f"{path}: the checkpoint holds no module here")
            continue
        now = _architecture(obj)
        missing = [k for k in now if k not in before]
        extra = [_shown(k) for k in before if k not in now]
        if missing:
            out.append(f"{path}: parameters not in the checkpoint: {', '.join(missing[:5])}")
        if extra:
            out.append(f"{path}: checkpoint parameters the model lacks: {', '.join(extra[:5])}")
        for k in now:
            if k in before and list(before[k]) != now[k]:
                (s0, d0), (s1, d1) = before[k], now[k]
                what = "shape" if s0 != s1 else "dtype"
                out.append(
                    f"{path}.{k}: {what} {_shown(s0 if what == 'shape' else d0)} in the checkpoint, "
                    f"{s1 if what == 'shape' else d1} in the model"
                )
    return out


def other_differences(resume: dict[str, Any], has_rng: bool, state: Any) -> list[str]:
    """Differences that do not stop a resume but change what it means."""
    out = []
    saved_opt = resume.get("optimizer", {})
    for path, obj in _walk(state):
        if isinstance(obj, torch.optim.Optimizer) and isinstance(saved_opt.get(path), list):
            out += _hparam_differences(path, saved_opt[path], _hparams(obj))
    if not resume.get("data"):
        out.append("no data position in the checkpoint: the resumed run will not see the same batches")
    if not has_rng:
        out.append("no RNG state in the checkpoint: random draws (dropout, shuffling) will differ")
    env_then, env_now = resume.get("environment", {}), environment()
    for k in sorted(set(env_then) | set(env_now)):
        if env_then.get(k) != env_now.get(k):
            out.append(
                f"environment {_shown(k)}: {_shown(env_then.get(k))} in the checkpoint, {env_now.get(k)} now"
            )
    return out


def _hparam_differences(path: str, saved: list[Any], now: list[dict[str, Any]]) -> list[str]:
    if len(saved) != len(now):
        return [f"{path}: {len(saved)} parameter groups in the checkpoint, {len(now)} now"]
    out = []
    for i, (g0, g1) in enumerate(zip(saved, now)):
        if not isinstance(g0, dict):
            continue
        # an LR scheduler owns "lr" and records the configured value as "initial_lr"
        scheduled = "initial_lr" in g0 and "initial_lr" in g1
        for k in sorted(set(g0) | set(g1)):
            if scheduled and k == "lr":
                continue
            if k in g0 and k in g1 and g0[k] != g1[k]:
                out.append(
                    f"{path}.param_groups[{i}].{k}: {_shown(g0[k])} in the checkpoint, {g1[k]} now "
                    "(the checkpoint's value is used)"
                )
    return out


def check_resume(resume: dict[str, Any], has_rng: bool, state: Any, strict: bool, path: str) -> list[str]:
    """All differences between the run saved in file `path` and `state`, most serious first;
    raise MismatchError for architecture ones when strict.  `resume`: the file's fingerprint,
    and its RNG states, checked already (stepcheck.resume_entries) before anything of the
    caller's changes."""
    arch = architecture_problems(resume["architecture"], state)
    if arch and strict:
        raise MismatchError(f"the model does not match the checkpoint: {_few(arch)}", path=path)
    return arch + other_differences(resume, has_rng, state)


# -- filling the caller's objects ---------------------------------------------------------


def node_items(f: CheckpointFile, node: int) -> dict[Any, int]:
    """key -> node id of a dict node's entries."""
    n = f.tree.nodes[node]
    if n[0] not in ("dict", "odict"):
        return {}
    return {decode_key(f.tree, k, f.path): v for k, v in n[1]}


def _merge(report: LoadReport, sub: LoadReport, prefix: str) -> None:
    report.missing_keys += [_join(prefix, k) for k in sub.missing_keys]
    report.unexpected_keys += [_join(prefix, k) for k in sub.unexpected_keys]
    report.loaded += sub.loaded


def _holds_stateful(obj: object) -> bool:
    return any(True for _ in _walk(obj))


# -- checking the caller's objects before any of them changes ---------------------------------


def check_target(f: CheckpointFile, node: int, state: Any, strict: bool, fp: dict[str, Any]) -> None:
    """Raise MismatchError for anything restore_into() would refuse, before it changes anything:
    tensors whose kind, shape or dtype differ, optimizers whose parameter groups differ, and
    (strict) keys on one side only.  restore_into() fills objects one after another, so a
    problem found there would leave the ones before it already overwritten.  `fp`: the file's
    checked fingerprint: where it names a saved optimizer, a state that holds none there is
    the file contradicting itself (CorruptError: damage, which a fallback skips), not the
    caller's mistake."""
    problems: list[str] = []
    _check_saved_optimizers(f, node, state, "", fp)
    _target_problems(f, node, state, "", strict, problems)
    if problems:
        raise MismatchError(f"the state does not match the checkpoint: {_few(problems)}", path=f.path)


def _target_problems(
    f: CheckpointFile, node: int, target: Any, path: str, strict: bool, out: list[str]
) -> None:
    """restore_into()'s walk, checking instead of filling."""
    if isinstance(target, torch.nn.Module):
        _plain_problems(f, node, target.state_dict(), path, strict, out)
    elif isinstance(target, torch.optim.Optimizer):
        _optimizer_problems(f, node, target, path, out)
    elif is_stateful(target):
        return  # its own load_state_dict() decides
    elif isinstance(target, dict) and _holds_stateful(target):
        saved = node_items(f, node)
        for k in target:
            if k in saved:
                _target_problems(f, saved[k], target[k], _join(path, k), strict, out)
            elif strict:
                out.append(f"{_join(path, k)}: not in the checkpoint")
        if strict:
            out += [
                f"{_join(path, k)}: in the checkpoint, not in the target" for k in saved if k not in target
            ]
    elif isinstance(target, (dict, list)):
        _plain_problems(f, node, target, path, strict, out)
    elif isinstance(target, torch.Tensor):
        problem = _tensor_problem(f, node, target)
        if problem:
            out.append(f"{path or 'state'}: {problem}")


def _plain_problems(
    f: CheckpointFile, node: int, target: Any, path: str, strict: bool, out: list[str]
) -> None:
    """fill_from_node()'s checks: leaves matched by key path."""
    from ..files.targets import file_entries, target_leaves

    in_file = file_entries(f, node)
    seen = set()
    for key, _, _, value in target_leaves(target):
        seen.add(key)
        i = in_file.get(key)
        if i is None:
            if strict:
                out.append(f"{_join(path, key)}: not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            problem = _tensor_problem(f, i, value)
            if problem:
                out.append(f"{_join(path, key)}: {problem}")
    if strict:
        out += [f"{_join(path, k)}: in the checkpoint, not in the target" for k in in_file if k not in seen]


def _tensor_problem(f: CheckpointFile, node: int, value: torch.Tensor) -> str | None:
    kind, meta = f.tree.nodes[node][0], f.tree.nodes[node][1]
    if kind != "tensor":
        return f"the checkpoint holds a {kind}, the target a tensor"
    if list(value.shape) != list(meta["shape"]):
        return f"shape {list(meta['shape'])} in the checkpoint, {list(value.shape)} in the target"
    if dtypes.TORCH_DTYPES.get(meta["dtype"]) != value.dtype:
        now = dtypes.TORCH_NAMES.get(value.dtype, str(value.dtype))
        return f"dtype {meta['dtype']} in the checkpoint, {now} in the target"
    return None


def _check_saved_optimizers(f: CheckpointFile, node: int, target: Any, path: str, fp: dict[str, Any]) -> None:
    """CorruptError where the fingerprint says an optimizer was saved (at the path of one of
    the target's optimizers) and the state holds no optimizer's state dict there: the walk
    follows the target's dicts as _walk does, entries the file lacks left to check_target."""
    if isinstance(target, torch.optim.Optimizer):
        where = path or "state"
        if where in fp["optimizer"] and _saved_groups(f, node) is None:
            raise CorruptError(
                "the resume fingerprint names an optimizer saved here; the state holds no optimizer state",
                path=f.path,
                key=where,
            )
    elif isinstance(target, dict) and not is_stateful(target):
        saved = node_items(f, node)
        for k, v in target.items():
            if k in saved:
                _check_saved_optimizers(f, saved[k], v, _join(path, k), fp)


def _saved_groups(f: CheckpointFile, node: int) -> list[dict[Any, Any]] | None:
    """The parameter groups of the optimizer state dict at `node`; None when it is not one
    (not a dict, or no list of groups each with its list of params)."""
    saved = node_items(f, node)
    groups = f.load_subtree(saved["param_groups"], None, True) if "param_groups" in saved else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return None
    return groups


def _optimizer_problems(
    f: CheckpointFile, node: int, opt: torch.optim.Optimizer, path: str, out: list[str]
) -> None:
    """What torch's Optimizer.load_state_dict() would refuse: other numbers of groups or parameters."""
    where = path or "state"
    groups = _saved_groups(f, node)
    now = opt.param_groups
    if groups is None:
        out.append(f"{where}: the checkpoint holds no optimizer state here")
    elif len(groups) != len(now):
        out.append(f"{where}: {len(groups)} parameter groups in the checkpoint, {len(now)} in the optimizer")
    else:
        _check_optimizer_ids(f, node_items(f, node), groups, where)
        for i, (g0, g1) in enumerate(zip(groups, now)):
            n0 = len(g0["params"])
            if n0 != len(g1["params"]):
                out.append(
                    f"{where}.param_groups[{i}]: {n0} parameters in the checkpoint, "
                    f"{len(g1['params'])} in the optimizer"
                )


def _check_optimizer_ids(f: CheckpointFile, saved: dict[Any, int], groups: list[Any], where: str) -> None:
    """CorruptError for what torch's Optimizer.load_state_dict() would trip over after the
    objects before it were filled: parameter ids that are not ints (a list is not even
    hashable), or a "state" that is not a dict keyed by them.  Checked on the node table:
    the per-parameter tensors are not read here."""
    for i, g in enumerate(groups):
        if not all(type(p) is int for p in g["params"]):
            raise CorruptError(
                "the optimizer's parameter ids are not all ints",
                path=f.path,
                key=f"{where}.param_groups[{i}]",
            )
    node = saved.get("state")
    if node is None or f.tree.nodes[node][0] not in ("dict", "odict"):
        raise CorruptError("the optimizer's state is not a dict", path=f.path, key=where)
    if not all(type(k) is int for k in node_items(f, node)):
        raise CorruptError("the optimizer's state is not keyed by parameter ids", path=f.path, key=where)


def _load_state_dict(f: CheckpointFile, target: Any, saved: Any, path: str) -> None:
    """target.load_state_dict(saved), its refusal a CorruptError naming the entry.  Such an
    object decides alone what it accepts, so this is found only now: the objects restored
    before it already hold the checkpoint's values (a manager's fallback then loads an older
    step into all of them)."""
    try:
        target.load_state_dict(saved)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:
        lines = str(e).splitlines()
        first = (lines[0] if lines else "")[:200]
        raise CorruptError(
            f"{type(target).__name__}.load_state_dict() refused the checkpoint's state "
            f"({type(e).__name__}: {first}); the entries before it were already restored",
            path=f.path,
            key=path or "state",
        ) from e


def restore_into(
    f: CheckpointFile,
    node: int,
    target: Any,
    path: str,
    report: LoadReport,
    *,
    strict: bool,
    verify: bool,
    atomic: bool = True,
) -> Any:
    """Load the subtree at `node` into `target`; return the value the container should hold.

    atomic=False: the caller has verified the whole subtree already (one pass for
    every module, instead of one per module)."""
    if isinstance(target, torch.nn.Module):
        sub = fill_from_node(f, node, target.state_dict(), strict=strict, verify=verify, atomic=atomic)
        _merge(report, sub, path)
        return target
    if is_stateful(target):
        _load_state_dict(f, target, f.load_subtree(node, None, verify), path)
        report.loaded += 1
        return target
    if isinstance(target, dict) and _holds_stateful(target):
        saved = node_items(f, node)
        for k in list(target):
            if k not in saved:
                report.missing_keys.append(_join(path, k))
                continue
            target[k] = restore_into(
                f, saved[k], target[k], _join(path, k), report, strict=strict, verify=verify, atomic=atomic
            )
        report.unexpected_keys += [_join(path, k) for k in saved if k not in target]
        return target
    if isinstance(target, (dict, list)):
        _merge(report, fill_from_node(f, node, target, strict=strict, verify=verify, atomic=atomic), path)
        return target
    if isinstance(target, torch.Tensor):
        loaded = f.load_subtree(node, None, verify)
        if (
            not isinstance(loaded, torch.Tensor)
            or loaded.shape != target.shape
            or loaded.dtype != target.dtype
        ):
            raise MismatchError(
                f"{path}: the checkpoint holds another kind, shape or dtype here", path=f.path
            )
        with torch.no_grad():
            target.copy_(loaded)
        report.loaded += 1
        return target
    report.loaded += 1
    return f.load_subtree(node, None, verify)
