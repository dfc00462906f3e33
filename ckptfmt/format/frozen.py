"""Frozen: the base of the format's small immutable records, written out instead of generated.

A frozen dataclass's methods are generated (compiled) when its module is imported, about a
millisecond each on these machines, and a process's first load imports every record class on
its path.  A subclass lists its fields in `__slots__`, sets them in its own `__init__` with
`self._set(...)` (the values in the order of its slots), and gets what `@dataclass(frozen=True)` gives: equality and hash by the
fields (in order), a repr of the fields it shows, FrozenInstanceError on any change, and
copies and pickles of the same fields.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any


class Frozen:
    """Fields in `__slots__`, compared, hashed and shown as a frozen dataclass's are."""

    __slots__ = ()
    #: the fields repr shows (all of them unless a subclass says otherwise)
    _shown: tuple[str, ...] = ()

    def _set(self, *values: object) -> None:
        """Set the fields, in the order of `__slots__`, past __setattr__'s refusal: for __init__
        and for copies and pickles, which are made without __init__."""
        names: tuple[str, ...] = self.__slots__
        if len(values) != len(names):
            raise TypeError(f"{type(self).__name__} has {len(names)} fields, not {len(values)}")
        for name, value in zip(names, values):
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[Any, ...]:
        names: tuple[str, ...] = self.__slots__
        return tuple(getattr(self, name) for name in names)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        names: tuple[str, ...] = self._shown or self.__slots__
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({shown})"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __getstate__(self) -> tuple[Any, ...]:
        return self._values()

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._set(*state)
