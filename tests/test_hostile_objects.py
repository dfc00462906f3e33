"""Tagged objects (ckptfmt.integrations.objects) read from a file: refused with a CheckpointError
that names the file and the place, never an error from a constructor or from rendering a key."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import ckptfmt
from ckptfmt.integrations import objects

TAG = objects.TAG
HUGE = 10**5000  # repr() and str() of it raise ValueError


@dataclasses.dataclass
class WithInitVar:
    a: int
    scale: dataclasses.InitVar[int]  # not a field: never stored, but __init__ needs it

    def __post_init__(self, scale: int) -> None:
        self.a *= scale


@dataclasses.dataclass
class Checked:
    a: int

    def __post_init__(self) -> None:
        if not isinstance(self.a, int) or self.a < 0:
            raise ValueError(f"a must be a non-negative int, not {self.a!r}")


def _through_a_file(tmp_path, value: Any) -> tuple[Any, str]:
    """`value` as a load gives it back, and the file's path."""
    path = str(tmp_path / "o.ckpt")
    ckptfmt.save({"x": value}, path)
    return ckptfmt.load(path)["x"], path


@pytest.mark.parametrize(
    "cls, fields, message",
    [
        (WithInitVar, {"a": 1}, "WithInitVar refuses the fields the file holds"),
        (Checked, {"a": -1}, "Checked refuses the fields the file holds: ValueError: a must be"),
        (Checked, {"a": "x" * 10_000}, "Checked refuses the fields"),
    ],
)
def test_a_registered_class_refusing_the_files_fields_is_corrupt(tmp_path, cls, fields, message):
    tagged = {TAG: "dataclass", "class": objects.qualified_name(cls), "fields": fields}
    value, path = _through_a_file(tmp_path, {"cfg": tagged})
    with pytest.raises(ckptfmt.CorruptError, match=message) as info:
        objects.decode(value, classes=[cls], source=path)
    assert info.value.path == path and "state['cfg']" in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600


def test_a_changed_class_error_names_the_file(tmp_path):
    tagged = {TAG: "dataclass", "class": objects.qualified_name(Checked), "fields": {"a": 1, "b" * 5000: 2}}
    value, path = _through_a_file(tmp_path, tagged)
    with pytest.raises(ckptfmt.UnsupportedError, match="Checked has no field 'bbb") as info:
        objects.decode(value, classes=[Checked], source=path)
    assert info.value.path == path and len(str(info.value)) < 600


@pytest.mark.parametrize(
    "value",
    [
        {HUGE: {TAG: "set", "items": [1]}},
        {TAG: "builtins.dict", "items": [[HUGE, {TAG: "frozenset", "items": []}]]},
        {"k" * 100_000: {TAG: "types.SimpleNamespace", "fields": {"f" * 100_000: 1}}},
    ],
    ids=["huge-int-key", "huge-int-pair-key", "long-names"],
)
def test_keys_of_any_size_are_decoded(tmp_path, value):
    loaded, path = _through_a_file(tmp_path, value)
    decoded = objects.decode(loaded, source=path)
    assert len(decoded) == 1


def test_a_state_with_a_huge_int_key_encodes(tmp_path):
    state = {HUGE: {1, 2}, "ns": {HUGE: frozenset()}}
    encoded = objects.encode(state)
    loaded, path = _through_a_file(tmp_path, encoded)
    assert objects.decode(loaded, source=path) == state


def test_an_unstorable_value_under_a_huge_int_key_is_named_bounded():
    with pytest.raises(ckptfmt.UnsupportedObjectError, match="cannot store") as info:
        objects.encode({HUGE: object()})
    assert len(str(info.value)) < 1000
