"""The UTC timestamps the format writes: a file header's ``created`` (spec section 5,
``YYYY-MM-DDTHH:MM:SSZ``) and a commit record's ``created`` (section 13.1, with optional
microseconds), made and read back in one place."""

from __future__ import annotations

import datetime

#: a file header's ``created``: whole seconds
SECONDS = "%Y-%m-%dT%H:%M:%SZ"
#: a commit record's ``created``: with microseconds
MICROSECONDS = "%Y-%m-%dT%H:%M:%S.%fZ"
#: what a timestamp that cannot be read stands for
EPOCH = datetime.datetime.fromtimestamp(0, datetime.timezone.utc)


def utc_now() -> datetime.datetime:
    """The current time, in UTC."""
    return datetime.datetime.now(datetime.timezone.utc)


def utc_at(epoch_seconds: int) -> datetime.datetime:
    """The UTC time `epoch_seconds` after the Unix epoch."""
    return datetime.datetime.fromtimestamp(epoch_seconds, datetime.timezone.utc)


def format_utc(when: datetime.datetime, layout: str = SECONDS) -> str:
    """`when` (in UTC) written as `layout` (SECONDS or MICROSECONDS)."""
    return when.strftime(layout)


def parse_utc(text: str) -> datetime.datetime:
    """A timestamp written by format_utc in either layout; EPOCH when it is neither (the
    field is informational: a malformed one never fails a read)."""
    for layout in (MICROSECONDS, SECONDS):
        try:
            return datetime.datetime.strptime(text, layout).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
    return EPOCH
