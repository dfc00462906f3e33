"""The names ckptfmt gives the files of a multi-file checkpoint (spec 13.7), defined once.

A checkpoint's place (files/places.py) holds its commit record (``COMMIT``) and its files: a
manager step's state file (``state.ckpt``) or DCP's rank files (``rank-NNNNN.ckpt``).  On a
store a save that may meet another writer's objects names its own with 16 hex digits drawn
for it (``state.<16 hex>.ckpt``, ``rank-NNNNN.<16 hex>.ckpt``): a save never writes over,
nor needs to delete, an object another writer may commit.  These are the only names ckptfmt
writes there, so they are the only ones its cleanups delete (`is_own_name`): another
program's object beneath the same prefix is not ckptfmt's to remove.
"""

from __future__ import annotations

import re
import secrets

#: the commit record of a multi-file checkpoint, written last (files/multifile.py)
COMMIT_NAME = "COMMIT"
#: a manager step's state file
STATE_NAME = "state.ckpt"
#: the digits a save draws for the names of its own (save_token)
_TOKEN = r"[0-9a-f]{16}"
#: a step's state file: STATE_NAME, or a name of the save's own (own_state_name)
STATE_NAME_RE = re.compile(rf"state(?:\.{_TOKEN})?\.ckpt")
#: a DCP rank file, its rank in group 1: ``rank-NNNNN.ckpt`` or a name of the save's own
RANK_FILE_RE = re.compile(rf"rank-([0-9]{{5,9}})(?:\.{_TOKEN})?\.ckpt")
#: every name ckptfmt writes in a checkpoint's place
OWN_NAME_RE = re.compile(rf"{COMMIT_NAME}|{STATE_NAME_RE.pattern}|{RANK_FILE_RE.pattern}")


def save_token() -> str:
    """16 hex digits no other save draws (64 random bits), for the names of a save's own."""
    return secrets.token_hex(8)


def own_state_name() -> str:
    """A state file name no other save uses."""
    return f"state.{save_token()}.ckpt"


def rank_file_name(rank: int, token: str | None = None) -> str:
    """Rank `rank`'s file name; `token`: the save's own digits (save_token; None: none)."""
    return f"rank-{rank:05d}.ckpt" if token is None else f"rank-{rank:05d}.{token}.ckpt"


def with_token(name: str, token: str) -> str | None:
    """File name `name` (a state or rank file's, plain or of a save's own) as the save whose
    digits are `token` (save_token) names it; None for a name that takes no digits."""
    if STATE_NAME_RE.fullmatch(name) is not None:
        return f"state.{token}.ckpt"
    rank = rank_of(name)
    return None if rank is None else rank_file_name(rank, token)


def rank_of(name: str) -> int | None:
    """The rank whose file `name` is (None: not a rank file's name)."""
    m = RANK_FILE_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_own_name(name: str) -> bool:
    """Whether `name` (relative to a checkpoint's place) is one ckptfmt writes there."""
    return OWN_NAME_RE.fullmatch(name) is not None
