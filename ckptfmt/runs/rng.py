"""Capture and restore every global random-number generator, as storable values.

A resumed run draws the same dropout masks, augmentations and sampler orders as
the uninterrupted one only if every generator it uses is back where it was.
:func:`capture_rng` returns the state of the process-wide generators as plain
values that :func:`ckptfmt.save` stores without pickle; :func:`restore_rng`
puts them back.

What is captured (the keys of the returned dict)::

    {
        "version": 1,                       # layout of this dict
        "python": {                         # the `random` module (random.getstate())
            "version": 3,
            "state": ndarray uint32 (625,), # 624 Mersenne Twister words + position
            "gauss_next": None | float,     # the second value of the last random.gauss pair
        },
        "numpy": {                          # numpy's legacy global RandomState (np.random.*)
            "bit_generator": "MT19937",
            "keys": ndarray uint32 (624,),
            "pos": int,
            "has_gauss": int,               # 0 or 1
            "cached_gaussian": float,
        },
        "torch_cpu": uint8 tensor,          # torch.get_rng_state()
        "accelerators": {                   # device type -> one uint8 tensor per device
            "cuda": [tensor, ...],          # torch.cuda.get_rng_state_all(), when CUDA is available
            "xpu": [tensor, ...],           # other accelerators (privateuse1 backends such as NPU,
        },                                  # XPU, MPS) through torch.accelerator; {} on a CPU-only machine
    }

Capturing reads the generator of every visible device, which initialises each of
them; limit them with ``CUDA_VISIBLE_DEVICES`` (or the backend's equivalent).

What is not captured: generators a program owns rather than the process.  Store
them next to the capture yourself:

- a ``torch.Generator`` object: ``g.get_state()`` (a uint8 tensor), restored
  with ``g.set_state(t)``;
- a ``numpy.random.Generator`` (``np.random.default_rng()``):
  ``g.bit_generator.state``, a dict of str keys and ints (PCG64's 128-bit ints
  included, ckptfmt stores ints of any size exactly), restored by assigning it
  back to ``g.bit_generator.state``;
- ``random.Random`` instances: ``r.getstate()`` as above;
- DataLoader workers: each worker seeds itself from the main process's torch
  generator when its iterator starts, so restoring ``torch_cpu`` before creating
  the iterator reproduces the worker seeds; a ``generator=`` passed to the
  DataLoader or sampler is a ``torch.Generator`` as above.

The recipe: call ``capture_rng()`` right before saving, and ``restore_rng()``
right after loading, as the last thing before training resumes, since anything
that draws in between (building a model, a warm-up step) would move the
generators again::

    ckptfmt.save({"model": model.state_dict(), "rng": ckptfmt.capture_rng()}, path)
    ...
    state = ckptfmt.load(path)
    model.load_state_dict(state["model"])
    ckptfmt.restore_rng(state["rng"])

:func:`restore_rng` checks the whole dict before touching any generator, so a
malformed one raises :class:`RNGStateError` (a ``ValueError``) or
:class:`RNGStateTypeError` (also a ``TypeError``) and changes nothing.  States for
devices this machine lacks (captured on 8 GPUs, restored on CPU or on fewer
GPUs) are skipped with one :class:`RNGSkippedWarning`.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointWarning, UnsupportedObjectError
from ..format.render import short_repr
from . import resumecheck
from .resumecheck import RNGStateError, RNGStateTypeError

#: the layout of a capture, shared with the checks of a file's RNG entry (resumecheck.py)
RNG_STATE_VERSION = resumecheck.RNG_STATE_VERSION
_MT_WORDS = resumecheck.MT_WORDS
_fields = resumecheck.fields


class RNGSkippedWarning(CheckpointWarning):
    """:func:`restore_rng` skipped the states of devices this machine does not have."""


# ---------------------------------------------------------------------------
# devices: CUDA through torch.cuda, every other accelerator through torch's generic API


def _current_accelerator_type() -> str | None:
    accelerator = getattr(torch, "accelerator", None)  # absent before torch 2.6
    if accelerator is None:
        return None
    current = accelerator.current_accelerator()
    return None if current is None else str(current.type)


def _device_count(kind: str) -> int:
    """How many devices of `kind` this process can reach (0 when the backend is absent)."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == _current_accelerator_type():
        return int(torch.accelerator.device_count())
    return 0


def _device_module(kind: str) -> ModuleType:
    return torch.cuda if kind == "cuda" else torch.get_device_module(kind)


def _accelerator_states() -> dict[str, list[torch.Tensor]]:
    states: dict[str, list[torch.Tensor]] = {}
    if torch.cuda.is_available():
        states["cuda"] = list(torch.cuda.get_rng_state_all())
    kind = _current_accelerator_type()
    if kind is not None and kind not in states:
        module = _device_module(kind)
        states[kind] = [module.get_rng_state(i) for i in range(_device_count(kind))]
    return states


# ---------------------------------------------------------------------------
# capture


def _python_state() -> dict[str, Any]:
    version, words, gauss_next = random.getstate()
    # 625 ints as one array instead of 625 tree nodes: every word and the
    # position fit in 32 bits, which np.array checks (it raises on overflow).
    return {"version": version, "state": np.array(words, dtype=np.uint32), "gauss_next": gauss_next}


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state(legacy=False)
    if st["bit_generator"] != "MT19937":
        # Only a program that replaced np.random.mtrand._rand gets here.
        raise UnsupportedObjectError(
            f"numpy's global RandomState uses {st['bit_generator']}, capture_rng handles MT19937 only"
        )
    return {
        "bit_generator": "MT19937",
        "keys": np.array(st["state"]["key"], dtype=np.uint32),
        "pos": int(st["state"]["pos"]),
        "has_gauss": int(st["has_gauss"]),
        "cached_gaussian": float(st["gauss"]),
    }


def capture_rng() -> dict[str, Any]:
    """The state of every global random-number generator, as values ckptfmt stores
    without pickle; see the module docstring for the layout and what is left out."""
    return {
        "version": RNG_STATE_VERSION,
        "python": _python_state(),
        "numpy": _numpy_state(),
        "torch_cpu": torch.get_rng_state(),
        "accelerators": _accelerator_states(),
    }


# ---------------------------------------------------------------------------
# validation: everything is checked before any generator changes


def _type_name(v: object) -> str:
    return type(v).__name__


def _int(v: object, name: str, lo: int, hi: int) -> int:
    # bool is an int subclass, but True as a position is a bug, not a value
    if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise RNGStateTypeError(name, f"is a {_type_name(v)}, expected an int")
    if not lo <= v <= hi:
        raise RNGStateError(name, f"is {short_repr(int(v), 40)}, expected an int in [{lo}, {hi}]")
    return int(v)


def _float(v: object, name: str) -> float:
    if not isinstance(v, float):
        raise RNGStateTypeError(name, f"is a {_type_name(v)}, expected a float")
    return float(v)


def _optional_float(v: object, name: str) -> float | None:
    if v is not None and not isinstance(v, float):
        raise RNGStateTypeError(name, f"is a {_type_name(v)}, expected None or a float")
    return None if v is None else float(v)


def _words(v: object, name: str, count: int) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise RNGStateTypeError(name, f"is a {_type_name(v)}, expected a numpy.ndarray of uint32")
    if v.dtype != np.uint32:
        raise RNGStateError(name, f"has dtype {v.dtype}, expected uint32")
    if v.ndim != 1 or v.shape[0] != count:
        raise RNGStateError(name, f"has {v.size} entries in shape {tuple(v.shape)}, expected {count}")
    return v


def _byte_tensor(v: object, name: str, numel: int | None) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise RNGStateTypeError(name, f"is a {_type_name(v)}, expected a uint8 torch.Tensor")
    if v.dtype != torch.uint8:
        raise RNGStateError(name, f"has dtype {v.dtype}, expected torch.uint8")
    if v.dim() != 1 or (numel is not None and v.numel() != numel):
        expected = "a 1-D tensor" if numel is None else f"{numel}"
        raise RNGStateError(name, f"has {v.numel()} entries in shape {tuple(v.shape)}, expected {expected}")
    # torch's set_rng_state wants a CPU tensor; a load with map_location may have moved it
    return v.detach().to("cpu").contiguous()


def _check_python(d: object) -> tuple[int, tuple[int, ...], float | None]:
    f = _fields(d, "python", resumecheck.PYTHON_FIELDS)
    version = _int(
        f["version"], "python.version", resumecheck.PYTHON_STATE_VERSION, resumecheck.PYTHON_STATE_VERSION
    )
    words = _words(f["state"], "python.state", _MT_WORDS + 1)
    if words[-1] > _MT_WORDS:
        raise RNGStateError("python.state", f"ends with position {words[-1]}, expected at most {_MT_WORDS}")
    return version, tuple(words.tolist()), _optional_float(f["gauss_next"], "python.gauss_next")


def _check_numpy(d: object) -> tuple[str, np.ndarray, int, int, float]:
    f = _fields(d, "numpy", resumecheck.NUMPY_FIELDS)
    name = f["bit_generator"]
    # The type first: an array compared with a str gives an array, not a bool.
    if not isinstance(name, str):
        raise RNGStateTypeError("numpy.bit_generator", f"is a {_type_name(name)}, expected 'MT19937'")
    if name != "MT19937":
        raise RNGStateError("numpy.bit_generator", f"is {name[:40]!r}, expected 'MT19937'")
    return (
        "MT19937",
        _words(f["keys"], "numpy.keys", _MT_WORDS).copy(),
        _int(f["pos"], "numpy.pos", 0, _MT_WORDS),
        _int(f["has_gauss"], "numpy.has_gauss", 0, 1),
        _float(f["cached_gaussian"], "numpy.cached_gaussian"),
    )


@dataclass
class _Plan:
    """Validated states, ready to apply, plus what this machine lacks."""

    python: tuple[int, tuple[int, ...], float | None]
    numpy: tuple[str, np.ndarray, int, int, float]
    torch_cpu: torch.Tensor
    devices: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _check_devices(d: object, plan: _Plan) -> None:
    if not isinstance(d, Mapping):
        raise RNGStateTypeError("accelerators", f"is a {_type_name(d)}, expected a dict")
    for kind, states in d.items():
        name = f"accelerators.{kind}"
        if not isinstance(kind, str) or resumecheck.DEVICE_TYPE_RE.fullmatch(kind) is None:
            raise RNGStateError(f"accelerators[{short_repr(kind, 40)}]", "is not a device type name")
        if not isinstance(states, (list, tuple)):
            raise RNGStateTypeError(name, f"is a {_type_name(states)}, expected a list of tensors")
        have = min(_device_count(kind), len(states))
        module = _device_module(kind) if have else None
        checked = []
        for i, state in enumerate(states):
            # A device here must get a state of the size its generator has; one we skip can't be sized.
            numel = module.get_rng_state(i).numel() if module is not None and i < have else None
            checked.append(_byte_tensor(state, f"{name}[{i}]", numel))
        if have:
            plan.devices[kind] = checked[:have]
        if have < len(states):
            plan.skipped.append(_skipped_text(kind, have, len(states)))


def _skipped_text(kind: str, have: int, captured: int) -> str:
    ids = f"{kind}:{have}" if captured - have == 1 else f"{kind}:{have}..{kind}:{captured - 1}"
    return f"{ids} ({captured} captured, {have} here)"


def _check(d: object) -> _Plan:
    # The version first: a newer layout's other fields would only confuse the message.
    if isinstance(d, Mapping) and "version" in d:
        version = _int(d["version"], "version", 0, 2**31)
        if version != RNG_STATE_VERSION:
            raise RNGStateError("version", f"is {version}; this ckptfmt reads version {RNG_STATE_VERSION}")
    f = _fields(d, "", resumecheck.TOP_FIELDS)
    plan = _Plan(
        python=_check_python(f["python"]),
        numpy=_check_numpy(f["numpy"]),
        torch_cpu=_byte_tensor(f["torch_cpu"], "torch_cpu", torch.get_rng_state().numel()),
    )
    _check_devices(f["accelerators"], plan)
    _probe(plan)
    return plan


def _refused(name: str, library: str, e: Exception) -> RNGStateError:
    first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return RNGStateError(name, f"is refused by {library}: {first}")


def _probe(plan: _Plan) -> None:
    """Give every state to a throwaway generator of its kind: what a library checks itself
    (torch's CPU state holds a Mersenne Twister position that must be in range, for one) is
    found here, before any global generator changes."""
    try:
        random.Random().setstate(plan.python)
    except (ValueError, TypeError, OverflowError) as e:
        raise _refused("python", "random.setstate", e) from None
    try:
        np.random.RandomState().set_state(plan.numpy)
    except (ValueError, TypeError, OverflowError) as e:
        raise _refused("numpy", "numpy's RandomState.set_state", e) from None
    try:
        torch.Generator().set_state(plan.torch_cpu)
    except RuntimeError as e:
        raise _refused("torch_cpu", "torch's CPU generator", e) from None
    for kind, states in plan.devices.items():
        for i, state in enumerate(states):
            try:
                probe = torch.Generator(device=torch.device(kind, i))
            except (RuntimeError, ValueError, TypeError):
                continue  # a backend without Generator objects: only its own set_rng_state can tell
            try:
                probe.set_state(state)
            except RuntimeError as e:
                raise _refused(f"accelerators.{kind}[{i}]", f"the {kind} generator", e) from None


def check_capture(d: object, path: str, key: str = "rng") -> None:
    """Raise CorruptError naming `path` and the entry (`key`, then the field) unless `d`, read
    from a file, is a capture :func:`restore_rng` would restore: every kind, dtype, shape and
    range, and what the libraries themselves check.  For callers that must refuse a file
    before they change anything of the caller's (a manager's load_into)."""
    try:
        _check(d)
    except RNGStateError as e:
        raise resumecheck.entry_error(e, path, key) from None


# ---------------------------------------------------------------------------
# restore


def _apply(plan: _Plan) -> None:
    random.setstate(plan.python)
    np.random.set_state(plan.numpy)
    torch.set_rng_state(plan.torch_cpu)
    for kind, states in plan.devices.items():
        module = _device_module(kind)
        for i, state in enumerate(states):
            module.set_rng_state(state, i)


def restore_rng(d: object) -> None:
    """Put back the generators captured by :func:`capture_rng` (`d` as loaded, typed
    `object` because it is checked here, whatever a file held).

    Raises RNGStateError / RNGStateTypeError naming the bad field, without
    changing any generator, when `d` is not a valid capture.  Skips, with one
    RNGSkippedWarning, the states of devices this machine does not have.
    """
    plan = _check(d)
    # Validation rules out every bad state we know of; should a backend still
    # refuse one half-way, put back what was there rather than leave a mix.
    before = _check(capture_rng())
    try:
        _apply(plan)
    except BaseException:
        _apply(before)
        raise
    if plan.skipped:
        warnings.warn(
            "restore_rng: skipped RNG states for devices this machine lacks: " + ", ".join(plan.skipped),
            RNGSkippedWarning,
            stacklevel=2,
        )
