"""Write only what can be read back: save refuses, before writing a byte, every state a
reader would refuse for its limits (spec section 8), naming the place in the state; and
values at the limits round-trip."""

from __future__ import annotations

import collections
import os
import sys

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.format import layout as fmt
from ckptfmt.format import tree
from ckptfmt.format.encode import check_chunks, check_metadata, encode
from ckptfmt.format.layout import Limits
from ckptfmt.format.render import PATH_CHARS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
import make_corpus as mc  # noqa: E402

MIB16 = Limits.MAX_STRING_BYTES


def _refused(tmp_path, state, cls=ckptfmt.LimitError, match: str | None = None) -> BaseException:
    p = tmp_path / "x.ckpt"
    with pytest.raises(cls, match=match) as info:
        ckptfmt.save(state, p)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temp file
    return info.value


def _roundtrip(tmp_path, state):
    p = tmp_path / "ok.ckpt"
    ckptfmt.save(state, p)
    assert ckptfmt.verify(p).ok
    return ckptfmt.load(p)


def _index_file(tmp_path, nodes, storages=None, payloads=None, name="h.ckpt"):
    p = tmp_path / name
    p.write_bytes(mc.build(mc.idx(storages=storages or [], nodes=nodes), payloads or []))
    return p


# -- strings, bytes, ints -------------------------------------------------------


def test_bytes_over_the_limit_by_one_is_refused_by_save(tmp_path):
    err = _refused(tmp_path, {"blob": b"\0" * (MIB16 + 1)}, match=r"state\['blob'\]: a bytes value")
    assert isinstance(err, ckptfmt.CheckpointError)


def test_bytes_at_the_limit_round_trip(tmp_path):
    assert _roundtrip(tmp_path, {"blob": b"\1" * MIB16})["blob"] == b"\1" * MIB16


def test_reader_refuses_bytes_over_the_limit_by_one(tmp_path):
    """Base64 of 16 MiB + 1 bytes is no longer than that of 16 MiB + 2: the decoded size decides."""
    import base64

    p = _index_file(tmp_path, [["bytes", base64.b64encode(b"\0" * (MIB16 + 1)).decode()]])
    with pytest.raises(ckptfmt.LimitError, match="more than"):
        ckptfmt.load(p)


def test_string_over_the_limit_is_refused_by_save(tmp_path):
    _refused(tmp_path, ["x" * (MIB16 + 1)], match=r"state\[0\]: a string of more than")
    # the limit is on UTF-8 bytes (spec section 8), not characters
    _refused(tmp_path, {"k": "\u00e9" * (MIB16 // 2 + 1)}, match=r"state\['k'\]: a string")


def test_string_key_over_the_limit_is_refused_by_save(tmp_path):
    _refused(tmp_path, {"y" * (MIB16 + 1): 1}, match=r"\(key\): a string of more than")


def test_reader_counts_string_limit_in_utf8_bytes(tmp_path):
    text = "\u00e9" * (MIB16 // 2 + 1)  # 16 MiB + 2 bytes in UTF-8
    index = mc.idx(storages=[], nodes=[["str", "PLACEHOLDER"]], chunks=[])
    blob = mc.json.dumps(index, separators=(",", ":")).replace("PLACEHOLDER", text).encode("utf-8")
    p = tmp_path / "u.ckpt"
    p.write_bytes(mc.build(index, [], index_bytes=blob))
    with pytest.raises(ckptfmt.LimitError, match="longer than"):
        ckptfmt.load(p)


def test_int_over_the_digit_limit_is_refused_by_save(tmp_path):
    _refused(tmp_path, {"n": 1 << (4 * MIB16)}, match=r"state\['n'\]: an int of more than")


def test_negative_int_with_the_most_digits_round_trips(tmp_path):
    """The sign is not a digit: -(16 MiB hex digits) is within the limit."""
    n = -((1 << (4 * MIB16)) - 1)
    assert _roundtrip(tmp_path, [n])[0] == n


# -- counts and nesting ---------------------------------------------------------


def test_too_many_nodes_is_refused_by_save(tmp_path, monkeypatch):
    monkeypatch.setattr(Limits, "MAX_NODES", 50)
    _refused(tmp_path, {"a": list(range(100))}, match=r"state\['a'\]\[\d+\]: the state holds more than 50")


def test_too_many_storages_is_refused_by_save(tmp_path, monkeypatch):
    monkeypatch.setattr(Limits, "MAX_STORAGES", 5)
    _refused(
        tmp_path, {"w": [torch.ones(1) for _ in range(10)]}, match=r"state\['w'\]\[5\]: more than 5 storages"
    )


def test_too_many_chunks_helper(monkeypatch):
    """The chunk count depends on the chunk size: the writer checks it (encode.check_chunks)."""
    enc = encode([torch.ones(1024) for _ in range(3)])
    check_chunks(enc, 4096)
    monkeypatch.setattr(Limits, "MAX_CHUNKS", 2)
    with pytest.raises(ckptfmt.LimitError, match="3 chunks of 4096 bytes"):
        check_chunks(enc, 4096)


def test_metadata_helper():
    check_metadata({"a": "b"})
    with pytest.raises(ckptfmt.LimitError, match=r"metadata\['a'\]"):
        check_metadata({"a": "x" * (MIB16 + 1)})


def _nested(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def test_nesting_over_the_limit_is_a_limit_error(tmp_path):
    err = _refused(tmp_path, {"deep": _nested(Limits.MAX_DEPTH)}, match="nesting deeper than 256 levels")
    assert not isinstance(err, ckptfmt.UnsupportedObjectError)


def test_nesting_at_the_limit_round_trips(tmp_path):
    assert _roundtrip(tmp_path, _nested(Limits.MAX_DEPTH)) == _nested(Limits.MAX_DEPTH)


def test_a_cycle_is_unsupported_not_a_limit(tmp_path):
    d: dict = {}
    d["self"] = [d]
    _refused(tmp_path, d, ckptfmt.UnsupportedObjectError, match="contains itself")


# -- tensors, arrays, sizes -----------------------------------------------------


def test_rank_over_the_limit_is_refused_by_save(tmp_path):
    _refused(tmp_path, {"t": torch.zeros([1] * 65)}, match=r"state\['t'\]: a tensor of 65 dimensions")
    _refused(tmp_path, {"s": torch.Size([1] * 65)}, match=r"state\['s'\]: a torch.Size of 65")


def test_rank_at_the_limit_round_trips(tmp_path):
    out = _roundtrip(tmp_path, {"t": torch.ones([1] * 64), "s": torch.Size([2] * 64)})
    assert out["t"].shape == (1,) * 64 and out["s"] == torch.Size([2] * 64)


def test_expanded_tensor_over_the_element_limit_is_refused_by_save(tmp_path):
    t = torch.zeros(1).expand(Limits.MAX_NUMEL + 1)  # 4 bytes of storage, 2**48 + 1 elements
    _refused(tmp_path, {"t": t}, match=r"state\['t'\]: a tensor of shape")


def test_dimension_over_the_element_limit_is_refused_even_when_empty(tmp_path):
    t = torch.zeros(1).expand(0, Limits.MAX_NUMEL + 1)
    _refused(tmp_path, {"t": t}, match="elements")


def test_huge_stride_is_refused_by_save(tmp_path):
    t = torch.zeros(1, 1).as_strided((1, 1), (Limits.MAX_NUMEL + 1, 1))
    _refused(tmp_path, {"t": t}, match="stride")


def test_broadcast_array_is_refused_before_it_is_copied(tmp_path):
    a = np.broadcast_to(np.zeros(1), (Limits.MAX_NUMEL + 1,))  # would need 2 PiB to copy
    _refused(tmp_path, {"a": a}, match=r"state\['a'\]: an array")


def test_empty_views_past_their_storage_round_trip(tmp_path):
    """torch.zeros(0, 5)[:, 2:] starts 2 elements into a 0-byte storage, which the format
    forbids: its offset (meaningless without elements) is clamped, shape and strides kept."""
    views = {
        "slice": torch.zeros(0, 5)[:, 2:],
        "set": torch.empty(0).set_(torch.UntypedStorage(4), 100, (0,), (1,)),
    }
    out = _roundtrip(tmp_path, views)
    for k, v in views.items():
        assert out[k].shape == v.shape and out[k].stride() == v.stride() and out[k].numel() == 0


def test_negative_size_is_unsupported(tmp_path):
    _refused(tmp_path, {"s": torch.Size([2, -1])}, ckptfmt.UnsupportedObjectError, match="non-negative")


def test_device_index_round_trips_at_the_limit(tmp_path):
    d = torch.device("cuda", 127)
    assert _roundtrip(tmp_path, {"d": d})["d"] == d


# -- dict keys ------------------------------------------------------------------


def test_keys_that_collide_in_hash_are_refused_by_save(tmp_path):
    keys = [k * (2**61 - 1) for k in range(1, Limits.MAX_KEY_COLLISIONS + 2)]
    assert len({hash(k) for k in keys}) == 1
    _refused(tmp_path, {"d": dict.fromkeys(keys)}, match=r"state\['d'\]: more than 64 keys")
    # at the limit, save and load work
    ok = dict.fromkeys(keys[:-1])
    assert _roundtrip(tmp_path, {"d": ok})["d"] == ok


def test_huge_int_key_is_named_without_repr_raising(tmp_path):
    """repr() of an int of more than 4300 decimal digits raises ValueError: key paths must not."""
    big = 10**5000
    err = _refused(tmp_path, {big: object()}, ckptfmt.UnsupportedObjectError)
    assert "state[<int of" in str(err)
    state = {big: {"w": torch.ones(2)}, (big, 1): 2, "x": {big: 3}}
    out = _roundtrip(tmp_path, state)
    assert out[big]["w"].tolist() == [1.0, 1.0] and out[(big, 1)] == 2
    with ckptfmt.open(tmp_path / "ok.ckpt") as r:
        assert r._file.storages[0].key.startswith("state[<int of")
        assert big in r.keys()
        paths = [p for p, _ in tree.iter_paths(r._file.tree, r._file.tree.root, "state")]
    assert any("<int of" in p for p in paths)


def test_unsupported_object_with_a_huge_int_inside_is_named(tmp_path):
    class Weird:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    _refused(
        tmp_path, {"a": {1, 10**5000}}, ckptfmt.UnsupportedObjectError, match=r"state\['a'\]: cannot store"
    )
    _refused(
        tmp_path, {"b": Weird()}, ckptfmt.UnsupportedObjectError, match=r"state\['b'\]: cannot store <Weird"
    )
    od = collections.OrderedDict(a=1)
    od._metadata = [10**5000]  # type: ignore[attr-defined]
    _refused(tmp_path, od, ckptfmt.UnsupportedObjectError, match=r"state\._metadata: cannot store")


def test_long_key_paths_are_cut():
    long_key = "k" * 100_000
    state: dict = {"w": torch.ones(1)}
    for _ in range(50):
        state = {long_key: state}
    enc = encode(state)
    assert len(enc.storages[0].key) <= PATH_CHARS
    assert enc.storages[0].key.startswith("state['kkk") and enc.storages[0].key.endswith("['w']")


# -- every limit at once: the writer and the reader agree -----------------------


@pytest.mark.parametrize(
    "state",
    [
        {"b": b"x" * 10},
        {"s": "é" * 100},
        {"n": -(16**100)},
        {"t": torch.zeros(3).expand(2, 3)},
        {"z": torch.zeros(0, 5)[:, 2:]},
        {"a": np.zeros((2, 0, 3))},
        {"size": torch.Size([0, 2**62])},
        {"d": {float("nan"): 1, -0.0: 2, (1, (2, None)): 3}},
    ],
)
def test_what_save_accepts_loads(tmp_path, state):
    p = tmp_path / "x.ckpt"
    ckptfmt.save(state, p)
    assert ckptfmt.verify(p).ok
    ckptfmt.load(p)


def test_limits_are_the_spec_numbers():
    assert Limits.MAX_STRING_BYTES == 16 << 20
    assert Limits.MAX_KEY_COLLISIONS == 64
    assert Limits.MAX_SIZE_DIM == 2**63 - 1
    assert fmt.INDEX_MEMORY_PER_BYTE > 0
