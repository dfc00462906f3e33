"""Dict keys read from a file: one rule (spec section 6) for every path that reads them.

A key is a node of kind none, bool, int, float, str, or a tuple whose elements follow the
same rule, however deep.  `ckptfmt.load` and `ckptfmt.open(path).get(...)` (and load_into,
which walks keys too) must agree on every key a file holds: both give the value, or both
refuse the file with a CheckpointError.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
import make_corpus as mc  # noqa: E402

KEY_KINDS = ("none", "bool", "int", "float", "str", "tuple")
#: leaf nodes of every other kind that needs no storage
OTHER_LEAVES: dict[str, list[Any]] = {
    "bytes": ["bytes", "AAE="],
    "dtype": ["dtype", "float32"],
    "device": ["device", "cpu"],
    "size": ["size", ["2"]],
    "complex": ["complex", "0000000000000000", "000000000000f03f"],
    "npscalar": ["npscalar", "<f4", "AADAPw=="],
}
KEY_LEAVES: dict[str, list[Any]] = {
    "none": ["none"],
    "bool": ["bool", True],
    "int": ["int", "-7"],
    "float": ["float", "000000000000f03f"],
    "str": ["str", "k"],
}

#: a key as a shape: a leaf kind name, or a tuple of shapes
Shape = Any


def _shapes(leaves: list[str]) -> st.SearchStrategy[Shape]:
    return st.recursive(
        st.sampled_from(leaves),
        lambda inner: st.lists(inner, max_size=3).map(tuple),
        max_leaves=6,
    )


def _emit(shape: Shape, nodes: list[list[Any]]) -> int:
    """Append the nodes of `shape` (children first) and return its node id."""
    if isinstance(shape, tuple):
        ids = [_emit(s, nodes) for s in shape]
        nodes.append(["tuple", ids])
    elif shape == "list":  # a container that is not a key kind, as a tuple element
        nodes.append(["list", []])
    else:
        nodes.append(list({**KEY_LEAVES, **OTHER_LEAVES}[shape]))
    return len(nodes) - 1


def _file(tmp_path, keys: list[Shape], name: str = "k.ckpt") -> str:
    """A file whose root dict has one entry (an int value) per key shape."""
    nodes: list[list[Any]] = []
    pairs = []
    for i, shape in enumerate(keys):
        k = _emit(shape, nodes)
        nodes.append(["int", format(i, "x")])
        pairs.append([k, len(nodes) - 1])
    nodes.append(["dict", pairs])
    path = tmp_path / name
    path.write_bytes(mc.build(mc.idx(storages=[], nodes=nodes), []))
    return str(path)


def _is_key(shape: Shape) -> bool:
    if isinstance(shape, tuple):
        return all(_is_key(s) for s in shape)
    return shape in KEY_LEAVES


def _through_load(path: str) -> Any:
    try:
        return ("ok", list(ckptfmt.load(path).values()))
    except ckptfmt.CheckpointError as e:
        return ("refused", type(e).__name__)


def _through_open(path: str) -> Any:
    try:
        with ckptfmt.open(path) as r:
            return ("ok", [r.get(k) for k in r.keys()])
    except ckptfmt.CheckpointError as e:
        return ("refused", type(e).__name__)


def _through_load_into(path: str) -> Any:
    try:
        report = ckptfmt.load_into(path, {}, strict=False)
        return ("ok", len(report.unexpected_keys))
    except ckptfmt.CheckpointError as e:
        return ("refused", type(e).__name__)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keys=st.lists(
        _shapes(list(KEY_LEAVES) + list(OTHER_LEAVES) + ["list"]), min_size=1, max_size=2, unique_by=repr
    )
)
def test_every_path_agrees_on_every_key(tmp_path, keys):
    path = _file(tmp_path, keys)
    loaded, opened, filled = _through_load(path), _through_open(path), _through_load_into(path)
    if all(_is_key(k) for k in keys):
        # well-formed keys may still be equal (1 == 1.0 == True): refused alike then
        assert loaded == opened, (keys, loaded, opened)
        assert (filled[0] == "ok") == (loaded[0] == "ok"), (keys, loaded, filled)
    else:
        assert loaded == opened == filled == ("refused", "CorruptError"), (keys, loaded, opened, filled)


@pytest.mark.parametrize("kind", sorted(OTHER_LEAVES) + ["list"])
@pytest.mark.parametrize("depth", [1, 3])
def test_a_tuple_key_holding_another_kind_is_refused_by_load(tmp_path, kind, depth):
    shape: Shape = kind
    for _ in range(depth):
        shape = ("str", shape)
    path = _file(tmp_path, [shape])  # one entry: no second key to compare it with
    with pytest.raises(ckptfmt.CorruptError, match=f"a dict key contains a {kind} node"):
        ckptfmt.load(path)
    with pytest.raises(ckptfmt.CorruptError, match=f"a dict key contains a {kind} node"):
        ckptfmt.open(path)


def test_nested_tuple_keys_of_key_kinds_load_everywhere(tmp_path):
    state = {(1, ("a", (None, 2.5, True))): torch.ones(2), ("x",): 3}
    path = tmp_path / "ok.ckpt"
    ckptfmt.save(state, path)
    assert list(ckptfmt.load(path)) == list(state)
    with ckptfmt.open(path) as r:
        assert r.get((1, ("a", (None, 2.5, True)))).tolist() == [1.0, 1.0]
        assert r.get(("x",)) == 3
