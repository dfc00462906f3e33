"""Chunk, the record of one chunk of a validated index (spec section 3), and the records of
plain raw chunks accepted in one step.

Most files are mostly local, uncompressed, unfiltered chunks, each a record the index's full
checks (index.py: `_parse_layout`, `_check_local`) would accept field by field.  Such records
are accepted here with the same tests made in fewer steps: one record at a time
(`plain_raw_chunk`), or every record of a file at once, column by column (`plain_raw_chunks`,
which builds no Python loop per field: a file of many small tensors has one chunk per
tensor).  Whatever either does not accept goes back to the full checks, which refuse it with
their precise messages, so a refusal reads the same whichever path saw the record first.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, NamedTuple

from . import layout as fmt

HEX16 = frozenset("0123456789abcdef")


class Chunk(NamedTuple):
    """A chunk record of a validated index (spec section 3), immutable: a named tuple, which
    builds in a quarter of the time a frozen dataclass does (a file may hold millions)."""

    offset: int
    stored_len: int
    raw_len: int
    codec: int
    filter: int
    width: int
    checksum: int
    pad: int  # zero bytes after the chunk, up to the next chunk or the index
    digest: bytes = b""  # XXH3-128 of the raw bytes (feature bit 0), canonical order
    source: int = -1  # -1: in this file; else the entry of `externals` whose file holds it
    number: int = -1  # for an external chunk: its chunk number in that file
    sha: bytes = b""  # signed files read with trusted keys: SHA-256 the stored bytes must have (section 16)
    tag: bytes = b""  # encrypted files read with the key: the GCM tag of the stored bytes (section 17)


_new_tuple = tuple.__new__
#: the fields of a local chunk's record after its digest, at their defaults (source, number, sha, tag)
_LOCAL_TAIL = tuple(Chunk._field_defaults[f] for f in Chunk._fields[Chunk._fields.index("digest") + 1 :])
_ALIGN_MASK = ~(fmt.ALIGNMENT - 1)


def plain_raw_chunk(
    item: list[Any], offset: int, raw_len: int, end_of_data: int, digests: bool
) -> Chunk | None:
    """(The same rules as plain_raw_chunks, for one record: a change to one is made to both.)
    The Chunk of a local, uncompressed, unfiltered record that passes every check of
    index.py's _parse_layout and _check_local (at `offset`, `raw_len` bytes, ending before the
    index), built in one step; None for any other record, which the full checks then parse
    (and refuse with their precise messages)."""
    if len(item) != (8 if digests else 7):
        return None
    off, slen, rlen, codec, filt, width, check = item[:7]
    # every test inline (this runs once per chunk): _is_hex's, and align_up's as -end % ALIGNMENT
    if not (
        type(off) is int
        and off == offset
        and type(slen) is int
        and type(rlen) is int
        and slen == rlen == raw_len
        and type(codec) is int
        and codec == fmt.CODEC_RAW
        and type(filt) is int
        and filt == fmt.FILTER_NONE
        and type(width) is int
        and width == 0
        and off + slen <= end_of_data
        and type(check) is str
        and len(check) == 16
        and HEX16.issuperset(check)
    ):
        return None
    digest = b""
    if digests:
        digest_hex = item[7]
        if not (type(digest_hex) is str and len(digest_hex) == 32 and HEX16.issuperset(digest_hex)):
            return None
        digest = bytes.fromhex(digest_hex)
    pad = -(off + slen) % fmt.ALIGNMENT
    # tuple.__new__: the Chunk without NamedTuple.__new__'s Python call (its fields in order)
    return _new_tuple(Chunk, (off, slen, rlen, codec, filt, width, int(check, 16), pad, digest, *_LOCAL_TAIL))


def plain_raw_chunks(
    items: list[Any], raw_lens: list[int], end_of_data: int, digests: bool
) -> list[Chunk] | None:
    """(The same rules as plain_raw_chunk, by columns: a change to one is made to both.)
    The Chunks of `items` (a file's chunk records, `raw_lens` their raw lengths as the
    storages give them) when every one is a local, uncompressed, unfiltered record that
    plain_raw_chunk would accept in turn (the first at the end of the prologue, each next one
    where the previous one's padding ends, the last ending before the index at
    `end_of_data`, its padding ending there), built column by column; None otherwise, for the records to be parsed one
    at a time: so also where the last one's padding does not end at the index (the full checks
    then name where the data ends)."""
    n = len(items)
    if not n or set(map(type, items)) != {list} or set(map(len, items)) != {8 if digests else 7}:
        return None
    columns = list(zip(*items))
    offsets, stored, raw, codecs, filters, widths, checks = columns[:7]
    if (
        set(map(type, offsets)) != {int}
        or set(map(type, stored)) != {int}
        or set(map(type, raw)) != {int}
        or set(map(type, codecs)) != {int}
        or set(map(type, filters)) != {int}
        or set(map(type, widths)) != {int}
        or codecs.count(fmt.CODEC_RAW) != n
        or filters.count(fmt.FILTER_NONE) != n
        or widths.count(0) != n
        or stored != raw
        or list(raw) != raw_lens
        or set(map(type, checks)) != {str}
        or set(map(len, checks)) != {16}
        or not HEX16.issuperset("".join(checks))
    ):
        return None
    # each chunk starts where the previous one's padding ends (the next alignment boundary)
    ends = [off + slen for off, slen in zip(offsets, stored)]
    if offsets[0] != fmt.PROLOGUE_SIZE:  # sizes are >= 0: offsets rise
        return None
    starts = [(end + fmt.ALIGNMENT - 1) & _ALIGN_MASK for end in ends]
    if list(offsets[1:]) != starts[:-1] or starts[-1] != end_of_data:
        return None
    digest_column: Any = repeat(b"")
    if digests:
        hexes = columns[7]
        if (
            set(map(type, hexes)) != {str}
            or set(map(len, hexes)) != {32}
            or not HEX16.issuperset("".join(hexes))
        ):
            return None
        digest_column = map(bytes.fromhex, hexes)
    pads = map(int.__sub__, starts, ends)
    sums = map(int, checks, repeat(16))
    tails = [repeat(value) for value in _LOCAL_TAIL]
    rows = zip(offsets, stored, raw, codecs, filters, widths, sums, pads, digest_column, *tails)
    # tuple.__new__: each Chunk without NamedTuple.__new__'s Python call (its fields in order)
    return list(map(_new_tuple, repeat(Chunk), rows))
