"""Writing to a person's terminal: lines made terminal-safe, one-line diagnostics on stderr
and a progress line for large work."""

from __future__ import annotations

import re
import sys

from .exitcodes import error_text, exit_code

#: characters a terminal acts on instead of showing: C0 and C1 controls and DEL (escape
#: sequences, carriage returns that rewrite a line), the bidirectional formatting characters
#: (an override makes text read backwards), line and paragraph separators, and lone
#: surrogates (which JSON carries and a UTF-8 stdout cannot encode)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def terminal_safe(text: str) -> str:
    """`text` with every character a terminal would act on written as a Python escape: names,
    keys and messages come from files, and anyone who can write a file could otherwise move
    the cursor, erase lines or forge rows in what a person reads."""
    return _UNSAFE.sub(_escape, text)


def say(text: str, *, err: bool = False) -> None:
    """Print one human-readable line (stdout, or stderr for diagnostics), made terminal-safe.
    JSON output does not come here: json.dumps escapes these characters itself."""
    print(terminal_safe(text), file=sys.stderr if err else sys.stdout)


def fail(error: BaseException, path: str) -> int:
    """Report `error` on stderr in one line naming `path`; its exit status."""
    say(f"error: {error_text(error, path)}", err=True)
    return exit_code(error)


class Progress:
    """A progress line on stderr, only when stderr is a terminal and the work is large."""

    def __init__(self, label: str, total_bytes: int) -> None:
        self.on = sys.stderr.isatty() and total_bytes >= 256 << 20
        self.label = terminal_safe(label)
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.on or not total:
            return
        pct = 100 * done // total
        if pct != self.last:
            self.last = pct
            sys.stderr.write(f"\r{self.label}: {pct:3d}%")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on and self.last >= 0:
            sys.stderr.write("\r" + " " * (len(self.label) + 6) + "\r")
