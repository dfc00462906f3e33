"""Location tags (spec section 5): the devices a file names, as text.

The grammar needs no torch, so the index and the object tree are checked without it
(verify, inspect and sign build no tensor); devices.py turns tags into torch devices.
"""

from __future__ import annotations

import re

#: The largest device index torch can represent: c10::DeviceIndex is a signed 8-bit
#: integer, and torch.device("cuda:300") silently becomes cuda:44.
MAX_DEVICE_INDEX = 127

#: A device or location tag (spec section 5): a type of 1 to 32 characters, then
#: optionally ":" and an index from 0 to 127 in decimal without leading zeros.
LOCATION_RE = re.compile(r"[a-z_][a-z0-9_]{0,31}(?::(?:0|[1-9][0-9]{0,2}))?")


def valid_location(text: object) -> bool:
    """Whether `text` is a location tag of the format's grammar whose index torch can
    represent exactly (no leading zeros, at most MAX_DEVICE_INDEX)."""
    if type(text) is not str or LOCATION_RE.fullmatch(text) is None:
        return False
    _, _, index = text.partition(":")
    return not index or int(index) <= MAX_DEVICE_INDEX
