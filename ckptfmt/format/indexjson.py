"""The index's JSON text (spec section 5): parsed as the spec's JSON rules say.

UTF-8, integer literals only (and none longer than 20 characters: a literal of thousands of
digits costs quadratic time to convert), no float or constant literals, no object repeating a
member, nesting within the parser's depth, and exactly the top-level members.  index.py checks
the members' values; it may parse the text without json's check for repeated members and count
the members instead (validate.TextCount), parsing again with the check when the count differs.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptError, LimitError

INDEX_FIELDS = ("chunk_size", "producer", "source_devices", "metadata", "storages", "chunks", "nodes")
#: with required feature bit 0 the index also lists the files its external chunks lie in
INDEX_FIELDS_EXTERNAL = (*INDEX_FIELDS[:5], "externals", *INDEX_FIELDS[5:])


def _parse_int(text: str) -> int:
    if len(text) > 20:
        raise ValueError("integer literal too long")
    return int(text)


def _reject_float(text: str) -> Any:
    raise ValueError(f"floating-point literal {text[:20]!r} is not allowed in the index")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate field {k[:40]!r}")
            seen.add(k)
    return out


#: every digit made "0", so that a run of 20 digits (one that may be an integer literal over the
#: length cap) is a plain substring search; without one anywhere in the index, json's own
#: integer parsing (no Python call per number) is safe
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_DIGIT_RUN = b"0" * 20


def _has_long_digit_run(raw: bytes) -> bool:
    return raw.translate(_DIGITS_AS_ZERO).find(_DIGIT_RUN) >= 0


def parse_index_json(
    raw: bytes, path: str, fields: tuple[str, ...] = INDEX_FIELDS, repeats: bool = True
) -> dict[str, Any]:
    """The index's JSON text parsed and its top-level members checked.  `repeats=False`: a
    member repeated in an object is not looked for (json keeps its last value): the caller
    counts the members instead (index._IndexParser.parse), which spares json a call of
    `_pairs` per object (a tensor node has one)."""
    try:
        text = raw.decode("utf-8")
        obj = json.loads(
            text,
            object_pairs_hook=_pairs if repeats else None,
            parse_int=_parse_int if _has_long_digit_run(raw) else None,
            parse_float=_reject_float,
            parse_constant=_reject_float,
        )
    except UnicodeDecodeError as e:
        raise CorruptError(f"index is not valid UTF-8 (byte {e.start})", path=path) from e
    except RecursionError as e:
        raise LimitError("index JSON is nested too deeply", path=path) from e
    except ValueError as e:
        raise CorruptError(f"index is not valid JSON: {str(e)[:200]}", path=path) from e
    if type(obj) is not dict or set(obj) != set(fields):
        raise CorruptError("index must be an object with exactly the fields " + ", ".join(fields), path=path)
    return obj
