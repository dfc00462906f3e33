"""Each normative rule spec/FORMAT.md states about the index's JSON (section 5), the element
formats and numpy names (section 6) and the limits (section 8), pinned to what the reader and
writer do: a test here fails when the code and the spec drift apart.

Files are crafted with tests/corpus/make_corpus.py (valid checksums everywhere, so the rule
under test, not a checksum, decides), most by editing the bytes of a valid index.
"""

from __future__ import annotations

import ast
import base64
import collections
import importlib.util
import json
import os
import struct
import sys
from typing import Any

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.format.layout import Limits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
import make_corpus as mc  # noqa: E402

MIB16 = Limits.MAX_STRING_BYTES
RAW16_RECORD = [64, 16, 16, 0, 0, 0, mc.chunk_check(mc.FID, 0, 64, mc.RAW16, 16, 0, 0, 0)]


def index(**changes: Any) -> dict[str, Any]:
    """The corpus's valid index ({"w": a float32 tensor of 4 in one raw chunk}), changed."""
    i = mc.idx(**changes)
    if i["chunks"] is None:
        i["chunks"] = [list(RAW16_RECORD)]
    return i


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


BASE = dumps(index())


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old  # the edit must apply, or the test would prove nothing
    return text.replace(old, new, 1)


def write(tmp_path, blob: str | bytes, payloads: list | None = None, name: str = "f.ckpt"):
    """A sealed file whose index is exactly `blob` (its chunks: `payloads`, default RAW16)."""
    p = tmp_path / name
    data = blob.encode("utf-8") if isinstance(blob, str) else blob
    p.write_bytes(mc.build(None, payloads, index_bytes=data))
    return p


def load(tmp_path, blob: str | bytes, payloads: list | None = None) -> Any:
    return ckptfmt.load(write(tmp_path, blob, payloads))


def refused(tmp_path, blob: str | bytes, cls: type[Exception], match: str | None = None) -> None:
    p = write(tmp_path, blob)
    with pytest.raises(cls, match=match) as info:
        ckptfmt.load(p)
    assert type(info.value) is cls, info.value  # exactly this class, not a subclass


def saved_index(path) -> dict[str, Any]:
    data = open(path, "rb").read()
    ioff, ilen = struct.unpack_from("<QQ", data, len(data) - 64)
    return json.loads(data[ioff : ioff + ilen])


def chunk_bytes(path, k: int = 0) -> bytes:
    with CheckpointFile(path) as f:
        ch = f.chunks[k]
        assert ch.codec == 0
    return open(path, "rb").read()[ch.offset : ch.offset + ch.stored_len]


def test_the_base_index_loads(tmp_path):
    assert torch.equal(load(tmp_path, BASE)["w"], torch.tensor([1.0, 2.0, 3.0, 4.0]))


# -- section 5: encoding ---------------------------------------------------------------


def test_encoding_is_utf8_without_bom(tmp_path):
    refused(tmp_path, b"\xef\xbb\xbf" + BASE.encode(), ckptfmt.CorruptError, "not valid JSON")
    refused(tmp_path, BASE.encode("utf-16-le"), ckptfmt.CorruptError)
    refused(tmp_path, BASE.encode("utf-32"), ckptfmt.CorruptError)
    # an encoded surrogate, an overlong form and a truncated sequence are not UTF-8
    for bad in (b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82"):
        blob = edit(BASE, '["str","w"]', '["str","@"]').encode().replace(b"@", bad)
        refused(tmp_path, blob, ckptfmt.CorruptError, "not valid UTF-8")


def test_non_ascii_is_accepted_raw_and_escaped(tmp_path):
    raw = edit(BASE, '["str","w"]', '["str","\u00e9\u20ac\U0001f600"]')
    assert list(load(tmp_path, raw)) == ["\u00e9\u20ac\U0001f600"]
    escaped = edit(BASE, '["str","w"]', r'["str","\u00e9\u20ac\ud83d\ude00"]')
    assert list(load(tmp_path, escaped)) == ["\u00e9\u20ac\U0001f600"]


def test_writers_emit_ascii_only(tmp_path):
    p = tmp_path / "w.ckpt"
    ckptfmt.save({"\u00e9": "\U0001f600"}, p, metadata={"k\u20ac": "v"})
    with CheckpointFile(p) as f:
        ioff, ilen = f.footer.index_offset, f.footer.index_length
    assert open(p, "rb").read()[ioff : ioff + ilen].isascii()


# -- section 5: one value, whitespace, control characters ----------------------------


def test_whitespace_is_accepted_anywhere(tmp_path):
    pretty = json.dumps(index(), indent="\t").replace("\n", "\r\n")
    assert list(load(tmp_path, " \n" + pretty + " \t\r\n")) == ["w"]


def test_only_one_value(tmp_path):
    refused(tmp_path, BASE + "x", ckptfmt.CorruptError, "not valid JSON")
    refused(tmp_path, BASE + "{}", ckptfmt.CorruptError, "not valid JSON")


def test_control_characters_only_escaped(tmp_path):
    refused(tmp_path, edit(BASE, '["str","w"]', '["str","\x01"]'), ckptfmt.CorruptError, "not valid JSON")
    assert list(load(tmp_path, edit(BASE, '["str","w"]', r'["str","\u0000\u001f"]'))) == ["\x00\x1f"]


# -- section 5: numbers ---------------------------------------------------------------


@pytest.mark.parametrize("literal", ["0.0", "1e3", "0E0", "0e0", "NaN", "Infinity", "-Infinity", "+0", "00"])
def test_numbers_are_integer_literals(tmp_path, literal):
    refused(tmp_path, edit(BASE, '"offset":0', f'"offset":{literal}'), ckptfmt.CorruptError, "not valid JSON")
    refused(
        tmp_path,
        edit(BASE, '"chunk_size":4096', '"chunk_size":4096e0'),
        ckptfmt.CorruptError,
        "not valid JSON",
    )


@pytest.mark.parametrize("literal", ["1" + "0" * 20, "-" + "1" * 20, "9" * 4000])
def test_integer_literals_over_the_length_cap_are_refused(tmp_path, literal):
    refused(tmp_path, edit(BASE, '"offset":0', f'"offset":{literal}'), ckptfmt.CorruptError, "too long")


def test_long_digit_runs_inside_strings_are_text(tmp_path):
    """Digits in a string are not numbers, however many (the cap is on integer literals)."""
    state = load(tmp_path, edit(BASE, '["str","w"]', '["str","' + "7" * 40 + '"]'))
    assert list(state) == ["7" * 40]


def test_minus_zero_is_zero(tmp_path):
    state = load(tmp_path, edit(BASE, '"offset":0', '"offset":-0'))
    assert state["w"].storage_offset() == 0 and state["w"].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"chunk_size":4096', '"chunk_size":-4096'),
        ('"offset":0', '"offset":-1'),
        ('"storages":[[16,', '"storages":[[-16,'),
        ('"shape":[4]', '"shape":[-4]'),
        ('"storage":0', '"storage":-1'),
        ("[[0,1]]", "[[-1,1]]"),
    ],
)
def test_no_number_is_negative(tmp_path, old, new):
    refused(tmp_path, edit(BASE, old, new), ckptfmt.CorruptError)


def test_literal_length_counts_the_sign(tmp_path):
    # 20 characters parse (then a value too large is a limit error, a negative one corrupt) ...
    refused(tmp_path, edit(BASE, '"offset":0', '"offset":99999999999999999999'), ckptfmt.LimitError)
    refused(
        tmp_path,
        edit(BASE, '"offset":0', '"offset":-9999999999999999999'),
        ckptfmt.CorruptError,
        "non-negative",
    )
    # ... 21 do not, with or without a sign
    for lit in ("100000000000000000000", "-10000000000000000000"):
        refused(tmp_path, edit(BASE, '"offset":0', f'"offset":{lit}'), ckptfmt.CorruptError, "not valid JSON")


def test_types_are_exact(tmp_path):
    refused(tmp_path, edit(BASE, '"requires_grad":false', '"requires_grad":0'), ckptfmt.CorruptError)
    refused(tmp_path, edit(BASE, '"chunk_size":4096', '"chunk_size":true'), ckptfmt.CorruptError)
    refused(tmp_path, edit(BASE, '"offset":0', '"offset":false'), ckptfmt.CorruptError)
    refused(tmp_path, edit(BASE, '"offset":0', '"offset":null'), ckptfmt.CorruptError)
    # null where the spec allows it: an odict without _metadata
    odict = edit(BASE, '["dict",[[0,1]]]', '["odict",[[0,1]],null]')
    assert type(load(tmp_path, odict)) is collections.OrderedDict


# -- section 5: names, duplicates, lone surrogates --------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"metadata":{}', r'"metadata":{"a":"1","\u0061":"2"}'),
        ('"producer":{"ckptfmt":"corpus"}', r'"producer":{"ckptfmt":"corpus","\u0063kptfmt":"x"}'),
        ('"nodes":', r'"\u006eodes":[],"nodes":'),
        ('{"dtype":"float32",', r'{"dtype":"float32","\u0064type":"float32",'),
        ('"metadata":{}', '"metadata":{"\U0001f600":"1","\\ud83d\\ude00":"2"}'),
    ],
)
def test_duplicate_names_are_compared_after_unescaping(tmp_path, old, new):
    refused(tmp_path, edit(BASE, old, new), ckptfmt.CorruptError, "duplicate")


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ('"metadata":{}', '"metadata":{"a":"1","a":"2"}', "a"),
        ('"metadata":{}', '"metadata":{"k:1":"a:","k:1":"b"}', "k:1"),  # colons in the strings
        ('"producer":{"ckptfmt":"corpus"}', '"producer":{"ckptfmt":"corpus","ckptfmt":"corpus"}', "ckptfmt"),
        ('"nodes":', '"nodes":[],"nodes":', "nodes"),  # the last value is a valid table
        ('"chunk_size":4096,', '"chunk_size":4096,"chunk_size":4096,', "chunk_size"),
        ('{"dtype":"float32",', '{"dtype":"float32","dtype":"float32",', "dtype"),  # the same value
        ('{"dtype":"float32",', '{"dtype":"float32","dtype":"bogus",', "dtype"),  # the kept value refused
        ('{"dtype":"float32",', '{"dtype":"float32" ,"dtype" : "float32",', "dtype"),  # whitespace
        ('"offset":0,', '"offset":0,"offset":99999,', "offset"),  # the kept value outside its storage
        ('"nodes":[["str","w"]', '"nodes":[["str","w:"],["tensor",{"a":1,"a":2}]', "a"),  # a bad node
    ],
)
def test_duplicate_names_are_refused_first_without_escapes(tmp_path, old, new, name):
    """An index without escapes is parsed without json's per-object check for repeated members
    (the members are counted against what the checks accept): a repeated member is still
    refused with json's message, before any other fault of the file is reported."""
    blob = edit(BASE, old, new)
    assert "\\" not in blob
    refused(tmp_path, blob, ckptfmt.CorruptError, f"index is not valid JSON: duplicate field {name!r}")


def test_every_member_repeated_is_refused_without_escapes(tmp_path):
    """Each member of each object of an index without escapes (the index's, producer's,
    metadata's holding colons, a tensor node's), repeated right after itself: refused as a
    repeated member, whichever it is."""
    obj = index(metadata={"a:b": "c:d", "e": ":"})
    blob = dumps(obj)
    assert list(load(tmp_path, blob)) == ["w"]
    objects = [obj, obj["producer"], obj["metadata"], obj["nodes"][1][1]]
    members = [dumps({k: v})[1:-1] for o in objects for k, v in o.items()]
    assert len(members) == 7 + 1 + 2 + 8
    for member in members:
        refused(tmp_path, edit(blob, member, member + "," + member), ckptfmt.CorruptError, "duplicate field")


def test_colons_in_strings_keep_the_counted_parse(tmp_path, monkeypatch):
    """Keys, metadata and devices holding colons (each counted as a string's) are loaded without
    json's per-object hook; an escape anywhere sends the whole index through it."""
    from ckptfmt.format import indexjson

    calls: list[int] = []
    real = indexjson._pairs
    monkeypatch.setattr(indexjson, "_pairs", lambda pairs: calls.append(1) or real(pairs))
    state = {"a:b": torch.ones(2), "n": {"c::d": torch.zeros(3), "dev": torch.device("cpu:0")}, "s": ":"}
    p = str(tmp_path / "colons.ckpt")
    ckptfmt.save(state, p, metadata={"k:1": "v:2:3"})
    out = ckptfmt.load(p)
    assert out.keys() == state.keys() and out["n"]["dev"] == state["n"]["dev"] and out["s"] == ":"
    assert torch.equal(out["a:b"], state["a:b"]) and torch.equal(out["n"]["c::d"], state["n"]["c::d"])
    assert ckptfmt.open(p).metadata == {"k:1": "v:2:3"}
    assert calls == []
    blob = edit(BASE, '"metadata":{}', '"metadata":{"a:b":"\\u003a"}')  # an escape: the hook parse
    assert list(load(tmp_path, blob)) == ["w"] and calls


def test_escaped_names_are_the_same_names(tmp_path):
    blob = edit(edit(BASE, '"chunk_size"', r'"\u0063hunk_size"'), '"offset"', r'"\u006fffset"')
    assert list(load(tmp_path, blob)) == ["w"]


def test_lone_surrogates_are_code_points(tmp_path):
    # three keys that differ only in a lone surrogate (or its U+FFFD replacement) stay three
    nodes = [
        ["str", "\ud800"],
        ["int", "1"],
        ["str", "\ud801"],
        ["int", "2"],
        ["str", "\ufffd"],
        ["int", "3"],
        ["str", "\udcff"],
        ["dict", [[0, 1], [2, 3], [4, 5]]],
        ["list", [7, 6]],
    ]
    blob = dumps(index(storages=[], chunks=[], nodes=nodes, metadata={"\ud800": "\udc80"}))
    assert "\\ud800" in blob and "\\udcff" in blob  # escaped, as JSON carries them
    p = write(tmp_path, blob, payloads=[])
    keys = [chr(0xD800), chr(0xD801), chr(0xFFFD)]  # (a dict display of these trips some linters)
    assert ckptfmt.load(p) == [dict(zip(keys, [1, 2, 3])), "\udcff"]
    with ckptfmt.open(p) as r:
        assert r.metadata == {"\ud800": "\udc80"}


def test_writer_writes_lone_surrogates_as_escapes(tmp_path):
    p = tmp_path / "s.ckpt"
    name = b"caf\xe9".decode("utf-8", "surrogateescape")  # '\udce9'
    ckptfmt.save({name: "\ud800"}, p, metadata={"m": name})
    assert saved_index(p)["nodes"][0] == ["str", "caf\udce9"]
    assert ckptfmt.load(p) == {name: "\ud800"}
    with ckptfmt.open(p) as r:
        assert r.metadata == {"m": name}


def test_lone_surrogate_counts_three_bytes_for_the_string_limit(tmp_path):
    n = MIB16 // 3  # 3n <= 16 MiB < 3(n+1)
    at_limit = index(storages=[], chunks=[], nodes=[["str", "\ud800" * n]])
    assert load(tmp_path, dumps(at_limit), payloads=[]) == "\ud800" * n
    over = index(storages=[], chunks=[], nodes=[["str", "\ud800" * (n + 1)]])
    p = write(tmp_path, dumps(over), payloads=[])
    with pytest.raises(ckptfmt.LimitError, match="longer than"):
        ckptfmt.load(p)


# -- section 5: member order ------------------------------------------------------------


def _reversed_members(obj: Any, keep: bool = False) -> Any:
    """`obj` with the members of every object in reverse order (tensor and ndarray records
    too, unless `keep`)."""
    if isinstance(obj, list):
        if keep and len(obj) == 2 and obj[0] in ("tensor", "ndarray"):
            return [obj[0], dict(obj[1])]
        return [_reversed_members(x, keep) for x in obj]
    if isinstance(obj, dict):
        return {k: _reversed_members(obj[k], keep) for k in reversed(list(obj))}
    return obj


def test_member_order_is_insignificant_everywhere(tmp_path):
    arr = np.arange(4, dtype="<i4")
    nodes = [
        ["str", "w"],
        mc.tensor_node(),
        ["str", "a"],
        ["ndarray", {"dtype": "<i4", "shape": [4], "order": "C", "storage": 1}],
        ["dict", [[0, 1], [2, 3]]],
    ]
    i = index(
        storages=[[16, "cpu"], [16, "cpu"]],
        producer={"ckptfmt": "corpus", "format": "1.0"},
        metadata={"first": "1", "second": "2"},
        nodes=nodes,
        chunks=None,
    )
    payloads = [(mc.RAW16, 16, 0, 0, 0), (arr.tobytes(), 16, 0, 0, 0)]
    i["chunks"] = [
        list(RAW16_RECORD),
        [128, 16, 16, 0, 0, 0, mc.chunk_check(mc.FID, 1, 128, arr.tobytes(), 16, 0, 0, 0)],
    ]

    # every object but the records reversed: what a writer that ignores member order emits
    p = write(tmp_path, dumps(_reversed_members(i, keep=True)), payloads)
    state = ckptfmt.load(p)
    assert state["w"].tolist() == [1.0, 2.0, 3.0, 4.0] and state["a"].tolist() == [0, 1, 2, 3]
    with ckptfmt.open(p) as r:
        assert r.metadata == {"first": "1", "second": "2"}
        assert list(r.metadata) == ["second", "first"]  # kept in file order, for display only

    # the records' own members reversed, and sort_keys (an order-insensitive library's
    # usual output): the same state
    for text in (dumps(_reversed_members(i)), json.dumps(i, sort_keys=True)):
        p = write(tmp_path, text, payloads)
        state = ckptfmt.load(p)
        assert state["w"].tolist() == [1.0, 2.0, 3.0, 4.0] and state["a"].tolist() == [0, 1, 2, 3]
    # a missing or extra member is still corrupt
    for k in (1, 3):
        bad = json.loads(dumps(i))
        bad["nodes"][k][1]["extra"] = 1
        p = write(tmp_path, dumps(bad), payloads)
        with pytest.raises(ckptfmt.CorruptError, match="must have exactly the fields"):
            ckptfmt.load(p)


def test_writer_emits_records_in_the_listed_order(tmp_path):
    p = tmp_path / "o.ckpt"
    ckptfmt.save({"t": torch.ones(2), "a": np.ones(2)}, p)
    idx = saved_index(p)
    assert list(idx) == [
        "chunk_size",
        "producer",
        "source_devices",
        "metadata",
        "storages",
        "chunks",
        "nodes",
    ]
    records = {n[0]: list(n[1]) for n in idx["nodes"] if n[0] in ("tensor", "ndarray")}
    assert records == {
        "tensor": ["dtype", "shape", "stride", "offset", "storage", "requires_grad", "param", "conj"],
        "ndarray": ["dtype", "shape", "order", "storage"],
    }


# -- section 6: element formats -----------------------------------------------------------

#: (dtype, values, the bytes section 6's table gives them)
FLOAT8 = [
    ("float8_e4m3fn", [448.0, float("nan"), -0.0, 1.0, -448.0], [0x7E, 0x7F, 0x80, 0x38, 0xFE]),
    ("float8_e5m2", [57344.0, float("inf"), -float("inf"), -0.0, 1.0], [0x7B, 0x7C, 0xFC, 0x80, 0x3C]),
    ("float8_e4m3fnuz", [240.0, float("nan"), -0.0, 1.0, 0.0], [0x7F, 0x80, 0x00, 0x40, 0x00]),
    ("float8_e5m2fnuz", [57344.0, float("nan"), -0.0, 1.0, float("inf")], [0x7F, 0x80, 0x00, 0x40, 0x80]),
    ("float8_e8m0fnu", [1.0, float("nan"), 2.0**-127, 2.0**127, 0.5], [0x7F, 0xFF, 0x00, 0xFE, 0x7E]),
]


@pytest.mark.parametrize(("name", "values", "expected"), FLOAT8, ids=[f[0] for f in FLOAT8])
def test_float8_formats_are_torchs_and_stored_verbatim(tmp_path, name, values, expected):
    dt = getattr(torch, name)
    t = torch.tensor(values).to(dt)
    assert t.view(torch.uint8).tolist() == expected  # torch encodes as the spec's table says
    p = tmp_path / f"{name}.ckpt"
    ckptfmt.save({"t": t}, p)
    assert list(chunk_bytes(p)) == expected
    back = ckptfmt.load(p)["t"]
    assert back.dtype == dt and back.view(torch.uint8).tolist() == expected


def _torch_pack_uint4():
    """torch's own fp4 packing helper, taken from its source (its module needs test-only deps)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    path = os.path.join(os.path.dirname(spec.origin), "testing", "_internal", "common_quantized.py")
    if not os.path.exists(path):
        pytest.skip("this torch has no common_quantized.py")
    funcs = {
        n.name: n
        for n in ast.parse(open(path).read()).body
        if isinstance(n, ast.FunctionDef) and n.name in ("down_size", "pack_uint4")
    }
    if len(funcs) != 2:
        pytest.skip("this torch has no pack_uint4")
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=list(funcs.values()), type_ignores=[]), path, "exec"), ns)
    return ns["pack_uint4"]


def test_float4_pairs_put_the_first_value_in_the_low_nibble(tmp_path):
    # E2M1 codes: 0.5 = 0001, 6.0 = 0111, -1.0 = 1010, 1.5 = 0011
    packed = _torch_pack_uint4()(torch.tensor([[0b0001, 0b0111, 0b1010, 0b0011]], dtype=torch.uint8))
    assert packed.tolist() == [[0x71, 0x3A]]  # value 0 in bits 0-3, value 1 in bits 4-7
    t = packed.view(torch.float4_e2m1fn_x2)
    assert t.shape == (1, 2) and t.element_size() == 1  # shapes count bytes (pairs)
    p = tmp_path / "fp4.ckpt"
    ckptfmt.save({"t": t}, p)
    assert chunk_bytes(p) == b"\x71\x3a"
    back = ckptfmt.load(p)["t"]
    assert back.dtype == torch.float4_e2m1fn_x2 and back.shape == (1, 2)
    assert back.view(torch.uint8).tolist() == [[0x71, 0x3A]]
    assert saved_index(p)["nodes"][1][1]["shape"] == [1, 2]


def test_bool_bytes(tmp_path):
    # writers write 0 and 1
    p = tmp_path / "b.ckpt"
    ckptfmt.save({"t": torch.tensor([True, False, True]), "a": np.array([False, True])}, p)
    assert chunk_bytes(p, 0) == b"\x01\x00\x01" and chunk_bytes(p, 1) == b"\x00\x01"
    # other bytes: the reader does not inspect element bytes, loads them unchanged, verify passes
    weird = b"\x00\x01\x02\xff"
    nodes = [
        ["str", "t"],
        mc.tensor_node(dtype="bool"),
        ["str", "a"],
        ["ndarray", {"dtype": "|b1", "shape": [4], "order": "C", "storage": 1}],
        ["dict", [[0, 1], [2, 3]]],
    ]
    i = mc.idx(storages=[[4, "cpu"], [4, "cpu"]], nodes=nodes)
    q = tmp_path / "weird.ckpt"
    q.write_bytes(mc.build(i, [(weird, 4, 0, 0, 0), (weird, 4, 0, 0, 0)]))
    state = ckptfmt.load(q)
    assert state["t"].dtype == torch.bool and state["t"].view(torch.uint8).tolist() == [0, 1, 2, 255]
    assert state["a"].dtype == np.bool_ and state["a"].view(np.uint8).tolist() == [0, 1, 2, 255]
    assert ckptfmt.verify(q).ok


# -- section 6: numpy dtype names ---------------------------------------------------------


def _array_file(tmp_path, name: str, payload: bytes, shape: list[int]):
    nodes = [["ndarray", {"dtype": name, "shape": shape, "order": "C", "storage": 0}]]
    i = mc.idx(storages=[[len(payload), "cpu"]], nodes=nodes)
    p = tmp_path / "a.ckpt"
    p.write_bytes(mc.build(i, [(payload, len(payload), 0, 0, 0)]))
    return p


def _scalar_file(tmp_path, name: str, payload: bytes):
    i = mc.idx(storages=[], chunks=[], nodes=[["npscalar", name, base64.b64encode(payload).decode()]])
    p = tmp_path / "s.ckpt"
    p.write_bytes(mc.build(i, []))
    return p


@pytest.mark.parametrize(
    ("name", "payload", "value"),
    [
        ("<i4", b"\x01\x00\x00\x00", 1),
        (">i4", b"\x00\x00\x00\x01", 1),
        (">f8", struct.pack(">d", 1.5), 1.5),
        ("<u2", b"\x02\x01", 258),
        ("|i1", b"\xff", -1),
        ("|u1", b"\xff", 255),
        ("|b1", b"\x01", True),
        (">c8", struct.pack(">ff", 1.0, -2.0), 1 - 2j),
    ],
)
def test_canonical_numpy_names_and_their_byte_order(tmp_path, name, payload, value):
    a = ckptfmt.load(_array_file(tmp_path, name, payload, [1]))
    assert a.dtype.str == name and a.tolist() == [value]
    s = ckptfmt.load(_scalar_file(tmp_path, name, payload))  # numpy scalars are native-endian
    assert s.dtype.newbyteorder("=") == np.dtype(name).newbyteorder("=") and s == value


@pytest.mark.parametrize(
    "name", ["|i4", "|f8", "|c16", "<i1", ">u1", "<b1", "=i4", "<i08", "<f02", "<f16", "|O8"]
)
def test_other_numpy_spellings_are_not_names(tmp_path, name):
    size = int(name[2:]) if name[2:].isdigit() else 8
    # the same answer for an array and a scalar of that name
    with pytest.raises(ckptfmt.UnsupportedError, match="numpy dtype"):
        ckptfmt.load(_array_file(tmp_path, name, bytes(size), [1]))
    with pytest.raises(ckptfmt.UnsupportedError, match="numpy dtype"):
        ckptfmt.load(_scalar_file(tmp_path, name, bytes(min(size, 16))))


def test_writer_uses_numpy_canonical_names(tmp_path):
    p = tmp_path / "n.ckpt"
    state = {"be": np.arange(3, dtype=">i4"), "b": np.zeros(2, dtype="=?"), "s": np.float32(2.0)}
    ckptfmt.save(state, p)
    dtypes_written = [
        n[1]["dtype"] if n[0] == "ndarray" else n[1]
        for n in saved_index(p)["nodes"]
        if n[0] in ("ndarray", "npscalar")
    ]
    assert dtypes_written == [">i4", "|b1", "<f4"]
    assert chunk_bytes(p, 0) == b"\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x02"  # big-endian
    back = ckptfmt.load(p)
    assert back["be"].dtype.str == ">i4" and back["be"].tolist() == [0, 1, 2]


def test_npscalar_holds_exactly_its_itemsize(tmp_path):
    assert ckptfmt.load(_scalar_file(tmp_path, "<f4", struct.pack("<f", 0.5))) == np.float32(0.5)
    for wrong in (b"\0" * 3, b"\0" * 8):
        with pytest.raises(ckptfmt.CorruptError, match="bytes for a 4-byte scalar"):
            ckptfmt.load(_scalar_file(tmp_path, "<f4", wrong))


# -- section 8: limits ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "cls"),
    [
        ('"stride":[1]', f'"stride":[{(1 << 48) + 1}]', ckptfmt.LimitError),
        ('"stride":[1]', f'"stride":[{1 << 48}]', None),  # at the limit: only the extent decides
        ('"shape":[4]', f'"shape":[{(1 << 48) + 1},0],"stride":[1,1]', ckptfmt.LimitError),
        ('"offset":0', f'"offset":{(1 << 50) + 1}', ckptfmt.LimitError),
        ('"chunk_size":4096', f'"chunk_size":{1 << 31}', ckptfmt.LimitError),
        ('"chunk_size":4096', '"chunk_size":2048', ckptfmt.CorruptError),
        ('"chunk_size":4096', '"chunk_size":4097', ckptfmt.CorruptError),
    ],
)
def test_limits_of_tensor_records_and_chunk_size(tmp_path, old, new, cls):
    blob = edit(BASE, old, new)
    if '"stride":[1,1]' in new:
        blob = edit(blob, ',"stride":[1],', ",")
    if cls is None:  # 2**48 is allowed as a stride; the tensor then reaches past its storage
        refused(tmp_path, blob, ckptfmt.CorruptError, "reaches byte")
    else:
        refused(tmp_path, blob, cls)


def test_producer_has_at_most_64_members(tmp_path):
    ok = {f"k{i}": "v" for i in range(64)}
    assert list(load(tmp_path, dumps(index(producer=ok)))) == ["w"]
    refused(tmp_path, dumps(index(producer={**ok, "one_more": "v"})), ckptfmt.LimitError, "producer")


def test_size_node_has_at_most_64_dimensions_more_is_corrupt(tmp_path):
    i = index(storages=[], chunks=[], nodes=[["size", ["1"] * 64]])
    assert load(tmp_path, dumps(i), payloads=[]) == torch.Size([1] * 64)
    i = index(storages=[], chunks=[], nodes=[["size", ["1"] * 65]])
    p = write(tmp_path, dumps(i), payloads=[])
    with pytest.raises(ckptfmt.CorruptError, match="malformed"):
        ckptfmt.load(p)


def test_string_limit_covers_metadata_values_not_names(tmp_path):
    big = "k" * (MIB16 + 1)
    refused(tmp_path, dumps(index(metadata={"k": big})), ckptfmt.LimitError, "longer than")
    p = write(tmp_path, dumps(index(metadata={big: "v"})))
    with ckptfmt.open(p) as r:
        assert list(r.metadata) == [big]


def _json_depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max((_json_depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((_json_depth(x) for x in v), default=0)
    return 0


def test_json_nesting(tmp_path):
    # a valid index nests at most 5 levels, whatever the state holds
    p = tmp_path / "deep.ckpt"
    inner: Any = torch.ones(2, 2)
    for _ in range(100):
        inner = {"x": [inner, (1, 2.0)]}
    od = collections.OrderedDict(a=torch.Size([2, 3]))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    ckptfmt.save({"deep": inner, "od": od, "a": np.ones((2, 3)), "s": np.int8(3), "c": 1j, "b": b"x"}, p)
    assert _json_depth(saved_index(p)) == 5
    # shallow excess nesting fails the structure checks (corrupt) ...
    refused(tmp_path, edit(BASE, '"shape":[4]', '"shape":[[4]]'), ckptfmt.CorruptError)
    refused(
        tmp_path,
        edit(BASE, '"metadata":{}', '"metadata":{"k":' + "[" * 50 + "]" * 50 + "}"),
        ckptfmt.CorruptError,
    )
    # ... nesting the JSON parser cannot recurse into is a limit error, before any structure check
    bomb = edit(BASE, '"metadata":{}', '"metadata":{"k":' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(tmp_path, bomb, ckptfmt.LimitError, "nested too deeply")


# -- the tree is checked without torch: dtypes by the format's table, devices by the grammar ------


def test_the_dtype_table_agrees_with_torch():
    """format/dtypes.py answers without torch (validation needs no torch); every answer is
    torch's, and the torch this package requires has every dtype of the table."""
    from ckptfmt.format import dtypes

    for name, (attr, _, _) in dtypes._TORCH_TABLE.items():
        dt = getattr(torch, attr)
        assert dtypes.TORCH_DTYPES[name] is dt and dtypes.TORCH_NAMES[dt] == name
        assert dtypes.is_tensor_dtype(name)
        assert dtypes.is_floating_point(name) == dt.is_floating_point, name
        assert dtypes.is_complex(name) == dt.is_complex, name
        assert dtypes.torch_itemsize(name) == dt.itemsize, name
    assert not dtypes.is_tensor_dtype("float128")


@pytest.mark.parametrize("text", ["<i08", "|i4", "<b1", ">f4", "<c16", "|u1", "<f16", "=i4", "<U4"])
def test_numpy_item_sizes_without_numpy_agree_with_numpy(text):
    from ckptfmt.format import dtypes

    dt = dtypes.numpy_dtype(text)
    assert dtypes.numpy_itemsize(text) == (None if dt is None else dt.itemsize)


def test_a_device_torch_does_not_know_fails_where_it_is_built(tmp_path):
    """A device node of the format's grammar passes the tree's checks (made without torch: a
    backend's name exists only where its extension is loaded, spec section 6); building it asks
    torch, and a name torch does not know is a CorruptError naming it."""
    nodes = [
        ["str", "w"],
        mc.tensor_node(),
        ["str", "d"],
        ["device", "nosuchdevice:0"],
        ["dict", [[0, 1], [2, 3]]],
    ]
    path = tmp_path / "device.ckpt"
    path.write_bytes(mc.build(mc.idx(nodes=nodes)))
    assert ckptfmt.verify(path).ok
    with pytest.raises(ckptfmt.CorruptError, match="names device 'nosuchdevice:0', unknown to torch"):
        ckptfmt.load(path)


# -- section 6: the tree check's messages, each fault one the common node's fast check passes on ---

_NODES = BASE[BASE.index('"nodes":') :]
#: the keys 1 and 1.0, equal as Python compares them (so sharing a hash), before "w"
_KEYS_1_AND_1_0 = '"nodes":[["int","1"],["float","000000000000f03f"],["str","a"],["str","b"],' + _NODES[
    len('"nodes":[') :
].replace('["dict",[[0,1]]]', '["dict",[[0,2],[1,3],[4,5]]]')


@pytest.mark.parametrize(
    ("old", "new", "cls", "match"),
    [
        ('"dict",[[0,1]]', '"dict",[[1,1]]', ckptfmt.CorruptError, r"node 1 has two parents \(2 and 2\)"),
        (
            '"dict",[[0,1]]',
            '"dict",[[0,2]]',
            ckptfmt.CorruptError,
            "node 2 refers to node 2; children must come",
        ),
        (_NODES, _KEYS_1_AND_1_0, ckptfmt.CorruptError, "node 6 has the key 1.0 twice"),
        (
            '"shape":[4]',
            '"shape":[true]',
            ckptfmt.CorruptError,
            "node 1 shape entry is True, expected a non-neg",
        ),
        ('"stride":[1]', '"stride":[1,1]', ckptfmt.CorruptError, "node 1 has 1 dimensions but 2 strides"),
        (
            '"stride":[1]',
            '"stride":[-1]',
            ckptfmt.CorruptError,
            "node 1 stride entry is -1, expected a non-neg",
        ),
        (
            '"shape":[4]',
            '"shape":[5]',
            ckptfmt.CorruptError,
            "node 1 reaches byte 20 of a storage of 16 bytes",
        ),
        ('"offset":0', '"offset":1', ckptfmt.CorruptError, "node 1 reaches byte 20 of a storage of 16 bytes"),
        (
            '"storage":0',
            '"storage":1',
            ckptfmt.CorruptError,
            r"node 1 storage is 1, expected an integer in \[0, 0\]",
        ),
        ('"param":false', '"param":0', ckptfmt.CorruptError, "node 1 field param is not a boolean"),
        (
            '"conj":false',
            '"conj":true',
            ckptfmt.CorruptError,
            "node 1 is a conjugate view of a float32 tensor",
        ),
        (
            '"dtype":"float32"',
            '"dtype":"float8"',
            ckptfmt.UnsupportedError,
            "node 1 has dtype 'float8', unknown",
        ),
        (',"conj":false', "", ckptfmt.CorruptError, "node 1 must have exactly the fields dtype, shape"),
        # as many members as fields, one of them misnamed
        ('"conj":false', '"conk":false', ckptfmt.CorruptError, "node 1 must have exactly the fields"),
        ('["str","w"]', '["str","w",1]', ckptfmt.CorruptError, r"node 0 \(str\) is malformed"),
        ('["str","w"]', '["str",1]', ckptfmt.CorruptError, "node 0 is not a string"),
    ],
)
def test_tree_check_names_each_fault_of_a_common_node(tmp_path, old, new, cls, match):
    refused(tmp_path, edit(BASE, old, new), cls, match)


def test_tree_check_refuses_requires_grad_on_an_integer_tensor(tmp_path):
    blob = edit(
        edit(BASE, '"dtype":"float32"', '"dtype":"int32"'), '"requires_grad":false', '"requires_grad":true'
    )
    refused(tmp_path, blob, ckptfmt.CorruptError, "node 1 asks for requires_grad on a int32 tensor")
