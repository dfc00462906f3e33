"""The CLI's human-readable output never hands a terminal a control character from a file.

Metric names, keys, reasons, names and error messages come from files: anyone who can write
a checkpoint can put escape sequences in them.  Every human-readable line goes through one
helper (cli.terminal.terminal_safe) that writes C0 and C1 controls, DEL, the bidirectional formatting
characters, line and paragraph separators and lone surrogates as Python escapes.  --json
output stays JSON, whose encoder escapes them itself.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import cli
from ckptfmt.cli.terminal import terminal_safe
from ckptfmt.files import multifile
from ckptfmt.runs.manager import CheckpointManager

FORGED = "\x1b[2K\rstep-9 complete"
#: every character a terminal acts on rather than shows
UNSAFE = (
    [chr(c) for c in range(0x20)]
    + [chr(c) for c in range(0x7F, 0xA0)]
    + ["\u061c", "\u200e", "\u200f", "\u2028", "\u2029"]
    + [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
    + ["\ud800", "\udfff"]
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_inert(text: str) -> None:
    """Only newlines between lines; nothing a terminal would act on."""
    bad = sorted({f"U+{ord(c):04X}" for line in text.split("\n") for c in line if c in UNSAFE})
    assert not bad, (bad, text)


def _run_with_forged_metric(tmp_path) -> str:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.ones(2)}, metrics={FORGED: 0.5, "loss": 1.25})
    return str(tmp_path)


def test_ls_escapes_a_metric_name_that_would_rewrite_the_row(tmp_path, capsys):
    run = _run_with_forged_metric(tmp_path)
    code, out, err = _run(["ls", run], capsys)
    assert code == 0 and err == ""
    _assert_inert(out)
    assert "\\x1b[2K\\x0dstep-9 complete=0.5" in out
    assert len(out.splitlines()) == 1 and "loss=1.25" in out  # one step, one row


def test_ls_json_keeps_the_name_exact(tmp_path, capsys):
    run = _run_with_forged_metric(tmp_path)
    code, out, _ = _run(["ls", "--json", run], capsys)
    assert code == 0
    _assert_inert(out)  # JSON escapes the characters itself
    assert json.loads(out)["steps"][0]["metrics"] == {FORGED: 0.5, "loss": 1.25}


def test_ls_escapes_the_reason_of_a_damaged_step(tmp_path, capsys):
    run = _run_with_forged_metric(tmp_path)
    step = os.path.join(run, os.listdir(run)[0])
    record = multifile.read_commit(step)
    # a record naming a part that is not there: the reason quotes the name from the record
    bad = multifile.PartRecord(
        "x\u202egnp.ckpt", record.files[0].length, record.files[0].file_id, record.files[0].index_checksum
    )
    multifile.write_commit(step, multifile.CommitRecord(1, record.layout, (bad,), metrics={FORGED: 1.0}))
    code, out, err = _run(["ls", run], capsys)
    _assert_inert(out + err)
    code, out, err = _run(["verify", run], capsys)
    _assert_inert(out + err)
    code, out, err = _run(["verify", step], capsys)
    _assert_inert(out + err)


def test_inspect_diff_and_errors_quote_keys_escaped(tmp_path, capsys):
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    key = "w" + FORGED + "\u202e\x9b"
    ckptfmt.save({key: torch.ones(2), "s": FORGED}, a, metadata={"note": FORGED})
    ckptfmt.save({key: torch.zeros(2), "s": "x", FORGED: 1}, b)
    for argv in (["inspect", str(a)], ["diff", str(a), str(b)], ["verify", str(a)]):
        code, out, err = _run(argv, capsys)
        _assert_inert(out + err)
    # a damaged chunk: the error names the key
    data = bytearray(a.read_bytes())
    data[64] ^= 0xFF
    a.write_bytes(bytes(data))
    for argv in (["verify", str(a)], ["diff", str(a), str(b)]):
        code, out, err = _run(argv, capsys)
        assert code == 1
        _assert_inert(out + err)


@given(st.text())
def test_terminal_safe_leaves_nothing_unsafe_and_keeps_the_rest(text):
    safe = terminal_safe(text)
    assert not any(c in UNSAFE for c in safe)
    safe.encode("utf-8")  # printable to a UTF-8 terminal: no lone surrogates left
    if not any(c in UNSAFE for c in text):
        assert safe == text


@pytest.mark.parametrize("char", UNSAFE, ids=[f"U+{ord(c):04X}" for c in UNSAFE])
def test_each_unsafe_character_becomes_an_escape_of_its_code_point(char):
    c = ord(char)
    escape = f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    assert terminal_safe(f"a{char}b") == f"a{escape}b"
