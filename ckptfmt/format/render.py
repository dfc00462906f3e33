"""Bounded text of values and key paths, for messages.

Every error that names a place in a state ("state['model']['w']") or shows a value
renders it here: the encoder and the checked tree (tree.py) build key paths with
`extend_path`, the resume checks and the CLI name entries with `render_key`, and
anything that shows a value a user or a file supplied uses `short_repr`.  The text is
bounded and rendering never raises, whatever the value: a message must not be the
thing that fails or that runs out of memory.
"""

from __future__ import annotations

import reprlib

#: characters of one dict key in a key path
KEY_CHARS = 120
#: characters of a whole key path; longer ones keep their start and end
PATH_CHARS = 400
_PATH_HEAD = 120


class _Repr(reprlib.Repr):
    """reprlib with a bound on ints: repr() of an int of more than 4300 digits raises."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = max(limit, 8)

    def repr_int(self, x: int, level: int) -> str:
        return _int_text(x)


def _int_text(x: int) -> str:
    if x.bit_length() <= 256:
        return repr(x)
    return f"<int of {(x.bit_length() + 3) // 4} hex digits>"


def short_repr(value: object, limit: int = 80) -> str:
    """repr(value) in at most `limit` characters; never raises, never renders a huge value whole."""
    try:
        text = _Repr(limit).repr(value)
    except Exception:  # a __repr__ that raises, or recursion in one
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def key_text(key: object) -> str:
    """One dict key as a key path shows it: repr, cut to KEY_CHARS."""
    t = type(key)
    if t is str and len(key) <= KEY_CHARS:  # type: ignore[arg-type]
        text = repr(key)
        if len(text) <= KEY_CHARS:
            return text
    elif t is int:
        return _int_text(key)  # type: ignore[arg-type]
    return short_repr(key, KEY_CHARS)


def extend_path(path: str, segment: str) -> str:
    """path + segment, cut in the middle when longer than PATH_CHARS."""
    out = path + segment
    if len(out) <= PATH_CHARS:
        return out
    return out[:_PATH_HEAD] + "..." + out[len(out) - (PATH_CHARS - _PATH_HEAD - 3) :]


def render_key(parent: str, key: object) -> str:
    """The key path of the value under `key` in the container at `parent`."""
    return extend_path(parent, f"[{key_text(key)}]")
