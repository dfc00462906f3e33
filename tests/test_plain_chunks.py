"""Plain raw chunk records accepted column by column (format/chunks.py) exactly as one by one.

A file of many small tensors has one chunk record per tensor, so the index accepts a file's
records in one step, column by column, where every one is a local, uncompressed, unfiltered
chunk; anything else goes to the checks of one record at a time, which refuse it with their
own messages.  These tests pin down that both paths accept exactly the same records, build
the same Chunks, and that a damaged record read either way is refused the same."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.format import index as index_mod
from ckptfmt.format import layout as fmt
from ckptfmt.format.chunks import plain_raw_chunk, plain_raw_chunks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
import make_corpus as mc  # noqa: E402

ODD_VALUES = [
    True,
    False,
    -1,
    0,
    1,
    63,
    64,
    4096,
    1 << 70,
    1.0,
    "0",
    None,
    [],
    "0123456789ABCDEF",
    "0123456789abcde",
]


def _records(sizes: list[int], digests: bool) -> tuple[list[list], int]:
    """Sound records of raw chunks of `sizes` bytes, and where the data section ends."""
    items, off = [], fmt.PROLOGUE_SIZE
    for k, size in enumerate(sizes):
        item = [off, size, size, 0, 0, 0, f"{k * 7919:016x}"]
        if digests:
            item.append(f"{k:032x}")
        items.append(item)
        off = fmt.align_up(off + size)
    return items, off


def _one_by_one(items: list, raw_lens: list[int], end: int, digests: bool) -> list | None:
    """What the index's loop accepts with plain_raw_chunk alone, ending exactly at the index."""
    out, expect = [], fmt.PROLOGUE_SIZE
    for item, raw_len in zip(items, raw_lens):
        if type(item) is not list:
            return None
        ch = plain_raw_chunk(item, expect, raw_len, end, digests)
        if ch is None:
            return None
        out.append(ch)
        expect = ch.offset + ch.stored_len + ch.pad
    return out if out and expect == end else None


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    digests=st.booleans(),
    where=st.integers(0, 11),
    field=st.integers(0, 8),
    value=st.sampled_from(ODD_VALUES),
    end_shift=st.sampled_from([0, 0, 0, -64, 64]),
    damaged=st.booleans(),
)
def test_columns_accept_exactly_what_the_one_by_one_checks_accept(
    sizes, digests, where, field, value, end_shift, damaged
):
    items, end = _records(sizes, digests)
    raw_lens = list(sizes)
    k = where % len(items)
    if not damaged:
        pass
    elif field < len(items[k]):
        items[k][field] = value
    elif field == 8:
        items[k] = items[k][:-1]  # a record one field short
    end += end_shift
    items = json.loads(json.dumps(items))  # as the index's JSON gives them
    want = _one_by_one(items, raw_lens, end, digests)
    got = plain_raw_chunks(items, raw_lens, end, digests)
    assert got == want
    if not damaged and not end_shift:
        assert got is not None and len(got) == len(sizes)
    if got is not None:
        assert [type(ch) for ch in got] == [type(ch) for ch in want]


def _file_of_plain_chunks(n: int, mutate=None) -> bytes:
    """A file of `n` float32 tensors of 4 elements, one plain raw chunk each."""
    nodes: list = []
    for i in range(n):
        nodes += [["str", f"t{i}"], mc.tensor_node(storage=i)]
    nodes.append(["dict", [[2 * i, 2 * i + 1] for i in range(n)]])
    index = mc.idx(storages=[[16, "cpu"]] * n, nodes=nodes)
    return mc.build(index, [(mc.RAW16, 16, 0, 0, 0)] * n, mutate_chunks=mutate)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (6, "0123456789ABCDEF", "chunk 30 checksum must be 16 lowercase hex digits"),
        (3, 1, "chunk 30 stored length is 16, expected an integer in"),
        (1, True, "chunk 30 offset|chunk 30 stored length"),
        (0, 64, "chunk 30 offset is 64, expected an integer in"),
    ],
)
def test_a_damaged_record_among_plain_ones_is_refused_with_its_message(tmp_path, field, value, message):
    """A file whose records are all plain but one is parsed record by record, and the damaged
    one is named as the one-by-one checks name it."""
    path = tmp_path / "x.ckpt"
    path.write_bytes(_file_of_plain_chunks(50))
    loaded = ckptfmt.load(path)
    assert [loaded[f"t{i}"].tolist() for i in (0, 49)] == [[1.0, 2.0, 3.0, 4.0]] * 2

    def damage(chunks: list) -> None:
        chunks[30][field] = value

    path.write_bytes(_file_of_plain_chunks(50, damage))
    with pytest.raises(ckptfmt.CheckpointError, match=message):
        ckptfmt.load(path)


_ODD_JSON = ["1e3", "-0", "true", "null", "-64", "18446744073709551616", "9223372036854775808", '"10"']
_ODD_JSON += ['"0123456789ABCDEF"', "0", "1", "63", "64", "65", "4096", "4160", "8256"]


def _parse_outcome(path, blob: bytes) -> tuple:
    """What parse_index makes of `blob`: its chunks, or the error's type and message."""
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        return ("ok", list(index_mod.parse_index(fd, str(path), None).chunks))
    except Exception as e:  # the outcome compared, whatever it is
        return ("error", type(e).__name__, str(e))
    finally:
        os.close(fd)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 15, 64, 65, 4095, 4096, 4097, 9000]), min_size=1, max_size=4),
    digests=st.booleans(),
    damage=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 8), st.sampled_from(_ODD_JSON)), max_size=3),
    swap=st.booleans(),
)
def test_the_fast_paths_parse_every_index_as_the_full_checks_do(
    tmp_path_factory, sizes, digests, damage, swap
):
    """Whole files with damaged chunk records, parsed with the fast paths (columns, then one
    record at a time) and with the full checks alone: the same chunks or the same refusal.
    A check added to the full path for raw chunks and missed by the fast ones fails here."""
    chunk_size = 4096
    nodes: list = []
    payloads = []
    for i, size in enumerate(sizes):
        nodes += [["str", f"t{i}"], mc.tensor_node(storage=i, dtype="uint8", shape=[size])]
        data = bytes(range(256)) * (size // 256 + 1)
        for j in range(0, size, chunk_size):
            piece = data[j : min(size, j + chunk_size)]
            payloads.append((piece, len(piece), 0, 0, 0))
    nodes.append(["dict", [[2 * i, 2 * i + 1] for i in range(len(sizes))]])
    index = mc.idx(storages=[[s, "cpu"] for s in sizes], nodes=nodes, chunk_size=chunk_size)
    if digests:
        index["externals"] = []

    def mutate(chunks: list) -> None:
        if digests:
            for record in chunks:
                record.append("0" * 32)
        for k, f, text in damage:
            if k < len(chunks) and f < len(chunks[k]):
                chunks[k][f] = f"@@{text}@@"  # replaced by the raw JSON text below
        if swap and len(chunks) > 1:
            chunks[0], chunks[-1] = chunks[-1], chunks[0]

    mc.build(index, payloads, required=1 if digests else 0, mutate_chunks=mutate)
    text = re.sub(
        r'"@@(.*?)@@"', lambda m: m.group(1).replace('\\"', '"'), json.dumps(index, separators=(",", ":"))
    )
    blob = mc.build(index, payloads, required=1 if digests else 0, index_bytes=text.encode())
    path = tmp_path_factory.mktemp("plain") / "x.ckpt"
    fast = _parse_outcome(path, blob)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(index_mod, "plain_raw_chunks", lambda *a: None)
        mp.setattr(index_mod, "plain_raw_chunk", lambda *a: None)
        full = _parse_outcome(path, blob)
    assert fast == full
