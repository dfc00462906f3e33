"""The checks of a manager state file's "resume" and "rng" entries, made on decoded plain values
(`format.decode.decode_raw`: tensors and arrays as RawArrays), without torch or numpy.

A manager's load_into makes them before anything of the caller's changes, and verify of a step
makes the same ones (spec 13.4): a file verify accepts is one these checks let a resume use.
What only a machine can tell is left to the load (runs/rng.py's check_capture): the sizes of
the states of the accelerators it has, and the libraries' own probes, which these checks
already cover for every state a CPU machine restores.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CorruptError, UnsupportedError
from ..format.decode import RawArray, RawValue
from ..format.layout import Limits
from ..format.render import render_key, short_repr
from .steps import MAX_STEP

PAYLOAD_VERSION = 1
#: optimizer hyper-parameters compared on resume: plain values only
HPARAM_TYPES = (bool, int, float, str, type(None))
_FP_FIELDS = frozenset({"version", "step", "architecture", "optimizer", "data", "environment"})

RNG_STATE_VERSION = 1
TOP_FIELDS = ("version", "python", "numpy", "torch_cpu", "accelerators")
PYTHON_FIELDS = ("version", "state", "gauss_next")
NUMPY_FIELDS = ("bit_generator", "keys", "pos", "has_gauss", "cached_gaussian")
MT_WORDS = 624  # the Mersenne Twister state both `random` and numpy's RandomState use
PYTHON_STATE_VERSION = 3  # what random.getstate() has returned since Python 2.3
DEVICE_TYPE_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}")
#: the key of one rank's RNG states in a sharded step ({"rng": {key: (capture,)}}, runs/sharded.py)
RANK_KEY_RE = re.compile(r"rank-[0-9]{5,}")
#: torch.get_rng_state().numel(): sizeof(CPUGeneratorImplState) (ATen/CPUGeneratorImpl.h), its
#: layout the one below since torch 1.x; tests/test_resume_entries.py checks it against torch
TORCH_CPU_STATE_BYTES = 5056
#: the fields of that state torch's CPU generator checks (set_state: mt19937 is_valid): the
#: initial seed (u64), `left` (i32, in [1, 624]), `seeded` (i32, nonzero), `next` (u64, whose
#: low 32 bits are at most 624), in the machine's byte order as torch writes them
_TORCH_CPU_HEAD = struct.Struct("=QiiQ")
_NATIVE = "<" if sys.byteorder == "little" else ">"
_WORD = _NATIVE + "u4"  # numpy's dtype.str of np.uint32 on this machine


def rng_key(rank: int) -> str:
    """The key of rank `rank`'s RNG states in a sharded step (RANK_KEY_RE)."""
    return f"rank-{rank:05d}"


# -- errors (raised by restore_rng too, runs/rng.py, on a dict the caller gives it) ---------------


class RNGStateError(CheckpointError, ValueError):
    """A dict given to :func:`restore_rng` is not a valid capture (missing field,
    wrong length, wrong dtype, value out of range)."""

    def __init__(self, field_name: str, problem: str) -> None:
        self.field = field_name  # "" for the dict itself
        self.problem = problem
        where = f"field {field_name}" if field_name else "the capture"
        super().__init__(f"malformed RNG state: {where} {problem}")


class RNGStateTypeError(RNGStateError, TypeError):
    """A field of a dict given to :func:`restore_rng` has the wrong Python type."""


def shown(key: object) -> str:
    """A field name as a message shows it: a str as it is, anything else as a bounded repr."""
    return key[:40] if type(key) is str else short_repr(key, 40)


def type_name(v: object) -> str:
    """The type of a decoded value as messages name it: a RawArray or RawValue as the type
    torch or numpy would have built ("Tensor", "ndarray", "int64")."""
    if isinstance(v, RawArray):
        return "Tensor" if v.kind == "tensor" else "ndarray"
    if isinstance(v, RawValue):
        return _npscalar_name(v) if v.kind == "npscalar" else v.kind
    return type(v).__name__


def fields(d: object, name: str, names: tuple[str, ...]) -> Mapping[str, Any]:
    """`d` as a mapping with exactly the fields `names`; `name` is "" for the capture itself."""
    if not isinstance(d, Mapping):
        raise RNGStateTypeError(name, f"is a {type_name(d)}, expected a dict")
    prefix = f"{name}." if name else ""
    for n in names:
        if n not in d:
            raise RNGStateError(prefix + n, "is missing")
    # An unknown field is refused rather than ignored: it means a layout this code does not know.
    for k in d:
        if k not in names:
            raise RNGStateError(f"{prefix}{shown(k)}", "is not part of an RNG state of version 1")
    return d


# -- the resume fingerprint --------------------------------------------------------------


class _Shape:
    """Checks of one value read from a file; each failure a CorruptError naming the entry."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> CorruptError:
        return CorruptError(f"malformed resume fingerprint: {what}", path=self.path, key=where)

    def dict_(self, v: object, where: str) -> dict[Any, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"is a {type_name(v)}, expected a dict")
        return v

    def list_(self, v: object, where: str) -> list[Any]:
        if type(v) is not list:
            raise self.fail(where, f"is a {type_name(v)}, expected a list")
        return v

    def str_keys(self, d: dict[Any, Any], where: str) -> dict[str, Any]:
        for k in d:
            if type(k) is not str:
                raise self.fail(render_key(where, k), "has a key that is not a str")
        return d

    def int_(self, v: object, where: str, hi: int) -> int:
        if type(v) is not int or not 0 <= v <= hi:
            raise self.fail(where, f"is {short_repr(v, 40)}, expected an int in [0, {hi}]")
        return v

    def plain(self, v: object, where: str) -> None:
        """A value compared with == and shown in messages: a scalar, or a list of scalars."""
        items = v if type(v) is list else [v]
        for x in items:
            if not isinstance(x, HPARAM_TYPES):
                raise self.fail(where, f"holds a {type_name(x)}, expected plain values")


def check_fingerprint(fp: object, path: str) -> dict[str, Any]:
    """`fp` (a state file's "resume" entry) when it has the layout resume.fingerprint() writes,
    every entry of the right kind; else CorruptError naming `path` and the entry
    (UnsupportedError for a later version).  The resume checks compare and print these values:
    a tensor, a nested dict or a key of another kind there would raise from `==` or from sorting."""
    c = _Shape(path)
    d = c.dict_(fp, "resume")
    version = d.get("version")
    if type(version) is int and version != PAYLOAD_VERSION:
        raise UnsupportedError(
            f"resume fingerprint version {short_repr(version, 40)}; this ckptfmt reads "
            f"version {PAYLOAD_VERSION}",
            path=path,
            key="resume['version']",
        )
    if set(d) != _FP_FIELDS:
        raise c.fail("resume", "fields must be exactly " + ", ".join(sorted(_FP_FIELDS)))
    c.int_(d["version"], "resume['version']", PAYLOAD_VERSION)
    c.int_(d["step"], "resume['step']", MAX_STEP)  # every step a run's directory can be named for
    _check_architecture(c, d["architecture"])
    _check_optimizers(c, d["optimizer"])
    for i, name in enumerate(c.list_(d["data"], "resume['data']")):
        if type(name) is not str:
            raise c.fail(f"resume['data'][{i}]", f"is a {type_name(name)}, expected a str")
    env = c.str_keys(c.dict_(d["environment"], "resume['environment']"), "resume['environment']")
    for k, v in env.items():
        c.plain(v, render_key("resume['environment']", k))
    return d


def _check_architecture(c: _Shape, v: object) -> None:
    """{module path: {parameter name: [shape (ints), dtype name]}}."""
    top = "resume['architecture']"
    for path, params in c.str_keys(c.dict_(v, top), top).items():
        where = render_key(top, path)
        for name, entry in c.str_keys(c.dict_(params, where), where).items():
            at = render_key(where, name)
            pair = c.list_(entry, at)
            if len(pair) != 2 or type(pair[1]) is not str:
                raise c.fail(at, "expected [shape, dtype name]")
            for i, n in enumerate(c.list_(pair[0], f"{at}[0]")):
                c.int_(n, f"{at}[0][{i}]", Limits.MAX_NUMEL)


def _check_optimizers(c: _Shape, v: object) -> None:
    """{optimizer path: [{hyper-parameter: plain value}, one per parameter group]}."""
    top = "resume['optimizer']"
    for path, groups in c.str_keys(c.dict_(v, top), top).items():
        where = render_key(top, path)
        for i, group in enumerate(c.list_(groups, where)):
            at = f"{where}[{i}]"
            for k, hp in c.str_keys(c.dict_(group, at), at).items():
                c.plain(hp, render_key(at, k))


# -- the RNG states, as stored --------------------------------------------------------------


def check_rng_entry(d: object, path: str, key: str = "rng") -> None:
    """CorruptError naming `path` and the entry (`key`, then the field) unless `d`, a file's RNG
    entry as decode_raw builds it (None: the file holds none), is a capture restore_rng
    restores on a machine of any devices: every kind, dtype, shape and range, and what random,
    numpy and torch's CPU generator check of their states."""
    if d is None:
        return
    try:
        _check_capture(d)
    except RNGStateError as e:
        raise entry_error(e, path, key) from None


def entry_error(e: RNGStateError, path: str, key: str) -> CorruptError:
    """The CorruptError of a file whose RNG entry `key` (its field then named) is malformed."""
    where = f"{key}.{e.field}" if e.field else key
    return CorruptError(f"malformed RNG state: {e.problem}", path=path, key=where)


def _check_capture(d: object) -> None:
    # The version first: a newer layout's other fields would only confuse the message.
    if isinstance(d, Mapping) and "version" in d:
        version = _int(d["version"], "version", 0, 2**31)
        if version != RNG_STATE_VERSION:
            raise RNGStateError("version", f"is {version}; this ckptfmt reads version {RNG_STATE_VERSION}")
    f = fields(d, "", TOP_FIELDS)
    _check_python(f["python"])
    _check_numpy(f["numpy"])
    _check_torch_cpu(_byte_vector(f["torch_cpu"], "torch_cpu", TORCH_CPU_STATE_BYTES))
    _check_accelerators(f["accelerators"])


def _npscalar_name(v: RawValue) -> str:
    """numpy's type name of a numpy scalar of dtype v.fields[0] (validated: "<i8", "|b1", ...)."""
    kind, size = v.fields[0][1], int(v.fields[0][2:])
    return (
        "bool"
        if kind == "b"
        else {"i": "int", "u": "uint", "f": "float", "c": "complex"}[kind] + str(8 * size)
    )


def _scalar_bytes(v: RawValue) -> tuple[str, bytes]:
    import base64

    return v.fields[0], base64.b64decode(v.fields[1])


def _int(v: object, name: str, lo: int, hi: int) -> int:
    """An int, or a numpy integer scalar (as restore_rng accepts one); bool is not a position."""
    if isinstance(v, RawValue) and v.kind == "npscalar" and v.fields[0][1] in "iu":
        dtype, raw = _scalar_bytes(v)
        v = int.from_bytes(raw, "little" if dtype[0] == "<" else "big", signed=dtype[1] == "i")
    elif type(v) is not int:
        raise RNGStateTypeError(name, f"is a {type_name(v)}, expected an int")
    assert isinstance(v, int)
    if not lo <= v <= hi:
        raise RNGStateError(name, f"is {short_repr(v, 40)}, expected an int in [{lo}, {hi}]")
    return v


def _is_float(v: object) -> bool:
    """A float, or numpy's float64 scalar (a subclass of float)."""
    return type(v) is float or (isinstance(v, RawValue) and v.kind == "npscalar" and v.fields[0][1:] == "f8")


def _float(v: object, name: str, optional: bool = False) -> None:
    if not (_is_float(v) or (optional and v is None)):
        expected = "None or a float" if optional else "a float"
        raise RNGStateTypeError(name, f"is a {type_name(v)}, expected {expected}")


def _words(v: object, name: str, count: int) -> tuple[int, ...]:
    if not isinstance(v, RawArray) or v.kind != "ndarray":
        raise RNGStateTypeError(name, f"is a {type_name(v)}, expected a numpy.ndarray of uint32")
    if v.dtype != _WORD:
        raise RNGStateError(name, f"has dtype {v.dtype}, expected uint32")
    if len(v.shape) != 1 or v.shape[0] != count:
        numel = 1
        for n in v.shape:
            numel *= n
        raise RNGStateError(name, f"has {numel} entries in shape {v.shape}, expected {count}")
    return struct.unpack(f"{_NATIVE}{count}I", v.vector_bytes())


def _byte_vector(v: object, name: str, numel: int | None) -> RawArray:
    """A 1-D uint8 tensor (of `numel` entries, unless None)."""
    if not isinstance(v, RawArray) or v.kind != "tensor":
        raise RNGStateTypeError(name, f"is a {type_name(v)}, expected a uint8 torch.Tensor")
    if v.dtype != "uint8":
        raise RNGStateError(name, f"has dtype torch.{v.dtype}, expected torch.uint8")
    if len(v.shape) != 1 or (numel is not None and v.shape[0] != numel):
        expected = "a 1-D tensor" if numel is None else f"{numel}"
        count = 1
        for n in v.shape:
            count *= n
        raise RNGStateError(name, f"has {count} entries in shape {v.shape}, expected {expected}")
    return v


def _check_python(d: object) -> None:
    f = fields(d, "python", PYTHON_FIELDS)
    _int(f["version"], "python.version", PYTHON_STATE_VERSION, PYTHON_STATE_VERSION)
    words = _words(f["state"], "python.state", MT_WORDS + 1)
    if words[-1] > MT_WORDS:  # what random.setstate refuses
        raise RNGStateError("python.state", f"ends with position {words[-1]}, expected at most {MT_WORDS}")
    _float(f["gauss_next"], "python.gauss_next", optional=True)


def _check_numpy(d: object) -> None:
    f = fields(d, "numpy", NUMPY_FIELDS)
    name = f["bit_generator"]
    if type(name) is not str:
        raise RNGStateTypeError("numpy.bit_generator", f"is a {type_name(name)}, expected 'MT19937'")
    if name != "MT19937":
        raise RNGStateError("numpy.bit_generator", f"is {name[:40]!r}, expected 'MT19937'")
    _words(f["keys"], "numpy.keys", MT_WORDS)
    _int(f["pos"], "numpy.pos", 0, MT_WORDS)
    _int(f["has_gauss"], "numpy.has_gauss", 0, 1)
    _float(f["cached_gaussian"], "numpy.cached_gaussian")


def _check_torch_cpu(v: RawArray) -> None:
    """What torch's CPU generator refuses in a state of the right size ("Invalid mt19937 state")."""
    _, left, seeded, next_ = _TORCH_CPU_HEAD.unpack_from(v.vector_bytes())
    if not (1 <= left <= MT_WORDS and seeded != 0 and (next_ & 0xFFFFFFFF) <= MT_WORDS):
        raise RNGStateError(
            "torch_cpu",
            f"holds no valid Mersenne Twister state (left {left}, seeded {seeded}, next {next_}), "
            "which torch's CPU generator refuses",
        )


def _check_accelerators(d: object) -> None:
    """Every device's states are 1-D uint8 tensors, checked even for devices this machine lacks,
    so that a restore elsewhere cannot fail later; their sizes are the load's to check."""
    if not isinstance(d, Mapping):
        raise RNGStateTypeError("accelerators", f"is a {type_name(d)}, expected a dict")
    for kind, states in d.items():
        if type(kind) is not str or DEVICE_TYPE_RE.fullmatch(kind) is None:
            raise RNGStateError(f"accelerators[{short_repr(kind, 40)}]", "is not a device type name")
        if not isinstance(states, (list, tuple)):
            raise RNGStateTypeError(
                f"accelerators.{kind}", f"is a {type_name(states)}, expected a list of tensors"
            )
        for i, state in enumerate(states):
            _byte_vector(state, f"accelerators.{kind}[{i}]", None)
