"""A fixed allow-list of Python objects, stored as tagged plain dicts: no pickle, no imports on load.

Trainers put more than tensors and plain containers into their checkpoints:
Lightning's ``hyper_parameters`` hold whatever was passed to ``__init__`` (an
``argparse.Namespace``, a ``pathlib.Path``, an enum, a config dataclass) and
its ``AttributeDict``.  ckptfmt's object model (``ckptfmt/format/``) stores
dicts, lists, tuples, scalars, str, bytes, tensors and arrays only.
:func:`encode` turns the objects of the table below into dicts of the form
``{"__ckptfmt_object__": <tag>, ...}`` before a save, and :func:`decode` turns
them back after a load.  Anything else is refused with
:class:`ckptfmt.UnsupportedObjectError` naming its place in the state, before
any byte is written.

==========================================  ============================  =======================================
object                                      stored as (tag, fields)       given back
==========================================  ============================  =======================================
``argparse.Namespace``                      ``argparse.Namespace``,       ``argparse.Namespace``
                                            ``fields`` (a dict)
``types.SimpleNamespace``                   ``types.SimpleNamespace``     ``types.SimpleNamespace``
Lightning's ``AttributeDict`` (the four     its module and name,          the same class when that module can be
copies in ``lightning.fabric``,             ``items``                     imported (these four names only), else
``lightning.pytorch``, ``lightning_fabric``                               the sibling copy, else a plain ``dict``
and ``pytorch_lightning``)
``pathlib`` paths (``Path``,                ``pathlib.<Class>``, ``path`` ``pathlib.Path`` for concrete paths
``PurePosixPath``, ``PureWindowsPath``)                                   (this system's flavour), the same class
                                                                          for pure ones
``set``, ``frozenset``                      ``set`` / ``frozenset``,      ``set`` / ``frozenset``
                                            ``items`` (sorted when the
                                            elements can be sorted)
``enum.Enum`` members (``IntEnum``,         ``enum``, ``class`` (its      the member when its class is registered,
``StrEnum``, ``Flag`` ...)                  qualified name), ``name``,    else its **value**
                                            ``value``
dataclass instances                         ``dataclass``, ``class``,     an instance when the class is registered,
                                            ``fields`` (every field)      else a plain ``dict`` of its fields
``collections.namedtuple`` /                ``namedtuple``, ``class``,    an instance when the class is registered,
``typing.NamedTuple`` instances             ``fields``                    else a plain ``tuple``
a dict with keys of the kinds above, or     ``dict`` (or                  the ``dict`` / ``OrderedDict``
with a key ``"__ckptfmt_object__"``         ``collections.OrderedDict``),
                                            ``items`` (key-value pairs)
==========================================  ============================  =======================================

Loading never imports a class named by the file.  The classes of enums,
dataclasses and named tuples come back only when the program has registered
them with :func:`register` (or passes them as ``classes=``): the class object
is then already imported, and the file only selects it among the registered
ones by its qualified name (``module.QualName``).  Registering a dataclass
means trusting its ``__init__`` and ``__post_init__`` to run on field values
from the file (the fields ``init=False`` are set afterwards with
``object.__setattr__``).  An enum value that no longer exists in its
registered class is given back as the plain value, with a warning.

Not allowed: functions, classes (``type`` objects), modules, arbitrary
instances, other dict, list or tuple subclasses, ``defaultdict`` (its factory
is code), tensor subclasses.  A tag that this version does not know raises
:class:`ckptfmt.UnsupportedError`; a malformed tagged dict raises
:class:`ckptfmt.CorruptError`; both name the place in the state.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import importlib
import os
import pathlib
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointWarning, CorruptError, UnsupportedError, UnsupportedObjectError
from ..format.layout import Limits
from ..format.render import extend_path, render_key

TAG = "__ckptfmt_object__"

#: the copies of Lightning's AttributeDict (a dict with attribute access); the only modules
#: decode() ever imports, and only these names
ATTRIBUTE_DICTS = (
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
)
_PATHS: dict[str, type[pathlib.PurePath]] = {
    "pathlib.PosixPath": pathlib.Path,
    "pathlib.WindowsPath": pathlib.Path,
    "pathlib.PurePosixPath": pathlib.PurePosixPath,
    "pathlib.PureWindowsPath": pathlib.PureWindowsPath,
}
_PATH_TYPES = {pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath}
#: leaves ckptfmt's object model stores itself (tree.py checks their details)
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Size,
    torch.dtype,
    torch.device,
    torch.Tensor,
    torch.nn.Parameter,
    np.ndarray,
)
_KEY_TYPES = (type(None), bool, int, float, str)

_registry: dict[str, type] = {}
_registry_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child keeps the registered classes; the lock may have been held at the fork."""
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple_type(cls: type) -> bool:
    return issubclass(cls, tuple) and cls is not tuple and isinstance(getattr(cls, "_fields", None), tuple)


def _check_registrable(cls: object) -> type:
    if not isinstance(cls, type):
        raise TypeError(f"register() takes classes, not {cls!r}")
    if not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls) or _is_namedtuple_type(cls)):
        raise TypeError(f"{qualified_name(cls)} is not an enum, a dataclass or a named tuple class")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"{qualified_name(cls)} is defined inside a function: its name does not identify it")
    return cls


def register(*classes: type) -> None:
    """Allow these enum, dataclass and named-tuple classes to come back as themselves on load.

    Process-wide; see also the ``classes=`` argument of :func:`decode` for one load.
    """
    checked = [_check_registrable(c) for c in classes]
    with _registry_lock:
        for cls in checked:
            name = qualified_name(cls)
            other = _registry.get(name)
            if other is not None and other is not cls:
                raise ValueError(f"another class named {name} is already registered")
            _registry[name] = cls


def unregister(*classes: type) -> None:
    """Undo :func:`register` for these classes."""
    with _registry_lock:
        for cls in classes:
            if _registry.get(qualified_name(cls)) is cls:
                del _registry[qualified_name(cls)]


def registered() -> dict[str, type]:
    """The registered classes by qualified name."""
    with _registry_lock:
        return dict(_registry)


# ---------------------------------------------------------------------------
# encoding


def _render(parent: str, key: object) -> str:
    """The path of `parent`'s entry under `key`: bounded, and never raising (repr() of an int of
    more than 4300 digits does), since keys come from the caller's state or from a file."""
    return render_key(parent, key)


def _field(parent: str, name: str) -> str:
    return extend_path(parent, f".{name}")


def _short(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(obj).__name__} object>"
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(path: str, obj: object) -> UnsupportedObjectError:
    return UnsupportedObjectError(
        f"{path}: cannot store {_short(obj)} (a {qualified_name(type(obj))}): not a plain value, "
        "tensor or array, nor one of the allow-listed objects (Namespace, Path, enum, dataclass, "
        "named tuple, set, AttributeDict; see ckptfmt.integrations.objects)"
    )


def _short_text(error: BaseException) -> str:
    """The first line of an error's message, at most 200 characters."""
    try:
        text = str(error)
    except Exception:  # a broken __str__ must not hide the refusal
        return "<unprintable message>"
    lines = text.splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= 200 else first[:197] + "..."


def _is_key(value: object) -> bool:
    """Whether ckptfmt's object model can store `value` as a dict key."""
    if type(value) is tuple:
        return all(_is_key(v) for v in value)
    return type(value) in _KEY_TYPES


def _sorted_items(items: Iterable[Any]) -> list[Any]:
    out = list(items)
    try:
        out.sort()
    except TypeError:
        pass  # mixed types: iteration order
    return out


class _Encoder:
    def enc(self, obj: Any, path: str, depth: int) -> Any:
        """`obj` in storable form; the same object when nothing inside needed encoding."""
        if depth > Limits.MAX_DEPTH:
            raise UnsupportedObjectError(
                f"{path}: nesting deeper than {Limits.MAX_DEPTH} levels (is there a cycle?)"
            )
        t = type(obj)
        if isinstance(obj, enum.Enum):  # before the leaves: an IntEnum member is also an int
            return {
                TAG: "enum",
                "class": qualified_name(t),
                "name": obj.name,
                "value": self.enc(obj.value, _field(path, "value"), depth + 1),
            }
        if t in _LEAVES or isinstance(obj, np.generic):
            return obj
        if t is list:
            items = [self.enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
            return obj if all(a is b for a, b in zip(items, obj)) else items
        if t is tuple:
            values = tuple(self.enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj))
            return obj if all(a is b for a, b in zip(values, obj)) else values
        if t is dict or t is collections.OrderedDict:
            return self._dict(obj, path, depth)
        if t is argparse.Namespace or t is types.SimpleNamespace:
            return {TAG: qualified_name(t), "fields": self._fields(vars(obj), path, depth)}
        if qualified_name(t) in ATTRIBUTE_DICTS and isinstance(obj, dict):
            return {TAG: qualified_name(t), "items": self._pairs(obj, path, depth)}
        if t in _PATH_TYPES:
            return {TAG: f"pathlib.{t.__name__}", "path": str(obj)}
        if t is set or t is frozenset:
            items = [self.enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(_sorted_items(obj))]
            return {TAG: t.__name__, "items": items}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            record = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return {TAG: "dataclass", "class": qualified_name(t), "fields": self._fields(record, path, depth)}
        if _is_namedtuple_type(t):
            record = dict(zip(t._fields, obj))
            return {
                TAG: "namedtuple",
                "class": qualified_name(t),
                "fields": self._fields(record, path, depth),
            }
        raise _refuse(path, obj)

    def _fields(self, values: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        return {k: self.enc(v, _field(path, k), depth + 1) for k, v in values.items()}

    def _pairs(self, obj: dict[Any, Any], path: str, depth: int) -> list[list[Any]]:
        return [
            [self.enc(k, _render(path, k) + " (key)", depth + 1), self.enc(v, _render(path, k), depth + 1)]
            for k, v in obj.items()
        ]

    def _dict(self, obj: dict[Any, Any], path: str, depth: int) -> Any:
        keys = [self.enc(k, _render(path, k) + " (key)", depth + 1) for k in obj]
        if TAG in obj or not all(k is orig or _is_key(k) for k, orig in zip(keys, obj)):
            # a key that is an allow-listed object, or the tag itself: key-value pairs
            pairs = [
                [k, self.enc(v, _render(path, orig), depth + 1)] for k, (orig, v) in zip(keys, obj.items())
            ]
            return {TAG: qualified_name(type(obj)), "items": pairs}
        values = [self.enc(v, _render(path, k), depth + 1) for k, v in obj.items()]
        if all(a is b for a, b in zip(values, obj.values())) and all(a is b for a, b in zip(keys, obj)):
            return obj
        out: dict[Any, Any] = (
            dict(zip(keys, values)) if type(obj) is dict else collections.OrderedDict(zip(keys, values))
        )
        meta = getattr(obj, "_metadata", None)
        if meta is not None:  # a module state dict's version record
            out._metadata = meta  # type: ignore[attr-defined]
        return out


def encode(state: object, root: str = "state") -> Any:
    """`state` with every allow-listed object replaced by its tagged dict.

    Containers that hold nothing to replace are returned as they are (no copy);
    others are rebuilt, so `state` itself is never changed.  Raises
    UnsupportedObjectError naming the place of the first object that is neither
    storable nor allow-listed.
    """
    return _Encoder().enc(state, root, 0)


# ---------------------------------------------------------------------------
# decoding


class _Decoder:
    def __init__(self, classes: Iterable[type], source: str | None) -> None:
        self.classes = registered()
        for cls in classes:
            self.classes[qualified_name(_check_registrable(cls))] = cls
        self.source = source

    def corrupt(self, path: str, what: str) -> CorruptError:
        return CorruptError(f"{path}: {what}", path=self.source)

    def typed(self, d: dict[str, Any], path: str, name: str, kind: type) -> Any:
        if name not in d:
            raise self.corrupt(path, f"tagged object has no {name!r}")
        v = d[name]
        if type(v) is not kind:
            raise self.corrupt(
                path, f"{name!r} of a tagged object must be {kind.__name__}, not {type(v).__name__}"
            )
        return v

    def exact(self, d: dict[str, Any], path: str, names: tuple[str, ...]) -> None:
        if set(d) != {TAG, *names}:
            fields = ", ".join(sorted(str(k) for k in d if k != TAG))
            raise self.corrupt(
                path, f"tagged object {d[TAG]!r} has fields {fields}, expected {', '.join(names)}"
            )

    def dec(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is list:
            items = [self.dec(v, f"{path}[{i}]") for i, v in enumerate(obj)]
            return obj if all(a is b for a, b in zip(items, obj)) else items
        if t is tuple:
            members = tuple(self.dec(v, f"{path}[{i}]") for i, v in enumerate(obj))
            return obj if all(a is b for a, b in zip(members, obj)) else members
        if t is dict and TAG in obj:
            return self.tagged(obj, path)
        if t is dict or t is collections.OrderedDict:
            values = [self.dec(v, _render(path, k)) for k, v in obj.items()]
            if all(a is b for a, b in zip(values, obj.values())):
                return obj
            out: dict[Any, Any] = (
                dict(zip(obj, values)) if t is dict else collections.OrderedDict(zip(obj, values))
            )
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                out._metadata = meta  # type: ignore[attr-defined]
            return out
        return obj

    def fields(self, d: dict[str, Any], path: str) -> dict[str, Any]:
        raw = self.typed(d, path, "fields", dict)
        if not all(type(k) is str for k in raw):
            raise self.corrupt(path, "field names must be str")
        dunder = [k for k in raw if k.startswith("__") and k.endswith("__")]
        if dunder:  # an attribute of the object itself (__class__, __dict__), not a field
            raise self.corrupt(path, f"field name {_short(dunder[0])} is not allowed")
        return {k: self.dec(v, _field(path, k)) for k, v in raw.items()}

    def pairs(self, d: dict[str, Any], path: str) -> list[tuple[Any, Any]]:
        raw = self.typed(d, path, "items", list)
        out = []
        for i, pair in enumerate(raw):
            if type(pair) is not list or len(pair) != 2:
                raise self.corrupt(f"{path}[{i}]", "a key-value pair must be a list of two")
            key = self.dec(pair[0], f"{path}[{i}] (key)")
            try:
                hash(key)
            except TypeError:
                raise self.corrupt(f"{path}[{i}]", f"key {_short(key)} is not hashable") from None
            out.append((key, self.dec(pair[1], _render(path, key))))
        return out

    def tagged(self, d: dict[str, Any], path: str) -> Any:
        tag = d[TAG]
        if type(tag) is not str:
            raise self.corrupt(path, f"object tag must be str, not {type(tag).__name__}")
        if tag in ("argparse.Namespace", "types.SimpleNamespace"):
            self.exact(d, path, ("fields",))
            cls = argparse.Namespace if tag == "argparse.Namespace" else types.SimpleNamespace
            return cls(**self.fields(d, path))
        if tag in ("builtins.dict", "collections.OrderedDict"):
            self.exact(d, path, ("items",))
            pairs = self.pairs(d, path)
            return dict(pairs) if tag == "builtins.dict" else collections.OrderedDict(pairs)
        if tag in ATTRIBUTE_DICTS:
            self.exact(d, path, ("items",))
            return _attribute_dict(tag)(self.pairs(d, path))
        if tag in _PATHS:
            self.exact(d, path, ("path",))
            return _PATHS[tag](self.typed(d, path, "path", str))
        if tag in ("set", "frozenset"):
            self.exact(d, path, ("items",))
            items = [self.dec(v, f"{path}[{i}]") for i, v in enumerate(self.typed(d, path, "items", list))]
            try:
                return set(items) if tag == "set" else frozenset(items)
            except TypeError:
                raise self.corrupt(path, "a set element is not hashable") from None
        if tag == "enum":
            return self.enum(d, path)
        if tag in ("dataclass", "namedtuple"):
            return self.record(d, path, tag)
        raise UnsupportedError(
            f"{path}: unknown object tag {tag[:80]!r} (written by a newer ckptfmt?)", path=self.source
        )

    def enum(self, d: dict[str, Any], path: str) -> Any:
        self.exact(d, path, ("class", "name", "value"))
        name = self.typed(d, path, "class", str)
        member = d["name"]
        if member is not None and type(member) is not str:
            raise self.corrupt(path, "an enum member's name must be str or None")
        value = self.dec(d["value"], _field(path, "value"))
        cls = self.classes.get(name)
        if cls is None:
            return value
        try:
            return cls(value)
        except (ValueError, TypeError):
            warnings.warn(
                f"{path}: {name} has no member with value {_short(value)} (saved as {member}); "
                "giving back the value",
                CheckpointWarning,
                stacklevel=4,
            )
            return value

    def record(self, d: dict[str, Any], path: str, tag: str) -> Any:
        self.exact(d, path, ("class", "fields"))
        name = self.typed(d, path, "class", str)
        values = self.fields(d, path)
        cls = self.classes.get(name)
        if cls is None:
            return values if tag == "dataclass" else tuple(values.values())
        if tag == "namedtuple":
            if not _is_namedtuple_type(cls):
                raise self.unsupported(path, f"the class registered as {name} is not a named tuple")
            names = cls._fields  # type: ignore[attr-defined]
            self.check_fields(
                values, names, set(names) - set(getattr(cls, "_field_defaults", {})), path, name
            )
            return self.construct(path, name, lambda: cls(**values))
        if not dataclasses.is_dataclass(cls):
            raise self.unsupported(path, f"the class registered as {name} is not a dataclass")
        spec = {f.name: f for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in spec.values()
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        self.check_fields(values, spec, required, path, name)
        obj = self.construct(path, name, lambda: cls(**{k: v for k, v in values.items() if spec[k].init}))
        for k, v in values.items():
            if not spec[k].init:
                object.__setattr__(obj, k, v)
        return obj

    def unsupported(self, path: str, what: str) -> UnsupportedError:
        return UnsupportedError(f"{path}: {what}", path=self.source)

    def check_fields(
        self, values: dict[str, Any], known: Iterable[str], required: set[str], path: str, name: str
    ) -> None:
        """The registered class `name` takes these fields (else it changed since the save)."""
        unknown = set(values) - set(known)
        if unknown:
            raise self.unsupported(
                path, f"{name} has no field {_short(sorted(unknown)[0])} (the class changed?)"
            )
        missing = required - set(values)
        if missing:
            raise self.unsupported(
                path, f"{name} needs field {sorted(missing)[0]!r}, which the file lacks (the class changed?)"
            )

    def construct(self, path: str, name: str, make: Callable[[], Any]) -> Any:
        """make() an instance of the registered class `name` from the file's fields.  Its own
        __init__ or __post_init__ refusing them (a value it validates, an InitVar no file
        holds) makes this entry of the file unusable: CorruptError naming it, the class's
        error as the cause.  Other exceptions are bugs of the class and pass through."""
        try:
            return make()
        except (TypeError, ValueError) as e:
            raise self.corrupt(
                path, f"{name} refuses the fields the file holds: {type(e).__name__}: {_short_text(e)}"
            ) from e


def _attribute_dict(name: str) -> type[dict[Any, Any]]:
    """The AttributeDict class `name` (one of ATTRIBUTE_DICTS), a sibling copy, or dict."""
    for candidate in (name, *ATTRIBUTE_DICTS):
        module, _, cls = candidate.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        if isinstance(found, type) and issubclass(found, dict):
            return found
    return dict


def decode(
    state: object, *, classes: Iterable[type] = (), source: str | None = None, root: str = "state"
) -> Any:
    """`state` as loaded, with every tagged dict turned back into its object.

    `classes`: enum, dataclass and named-tuple classes to give back as
    themselves for this call, besides those :func:`register` made known.
    `source`: the file, named in errors.  Containers without tagged dicts
    inside are returned as they are.
    """
    return _Decoder(classes, source).dec(state, root)
