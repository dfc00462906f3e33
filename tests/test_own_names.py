"""The names ckptfmt writes in a checkpoint's place (spec 13.7) are one rule, files/names.py:
every name a writer makes is one the cleanups own, and nothing else is (another program's
object beneath the same prefix is never deleted)."""

from __future__ import annotations

import ast
import os

import pytest

import ckptfmt
from ckptfmt.engine import commit
from ckptfmt.files import names
from ckptfmt.runs.objectnames import copy_marker, written_here

ROOT = os.path.dirname(os.path.abspath(ckptfmt.__file__))


def _written() -> list[str]:
    token = names.save_token()
    return [
        names.COMMIT_NAME,
        names.STATE_NAME,
        names.own_state_name(),
        names.rank_file_name(0),
        names.rank_file_name(12345, token),
        names.rank_file_name(10**9 - 1),
    ]


def test_every_name_a_writer_makes_is_owned_and_parsed_back() -> None:
    for name in _written():
        assert names.is_own_name(name) and written_here(name), name
    assert all(names.STATE_NAME_RE.fullmatch(n) for n in (names.STATE_NAME, names.own_state_name()))
    assert names.rank_of(names.rank_file_name(12345, names.save_token())) == 12345
    assert names.rank_of(names.rank_file_name(7)) == 7
    assert names.rank_of(names.own_state_name()) is None
    assert names.STATE_NAME_RE.fullmatch(names.rank_file_name(1)) is None


def test_a_copy_gives_each_file_its_own_digits_and_keeps_its_kind() -> None:
    token = names.save_token()
    other = names.own_state_name()
    assert (
        names.with_token(names.STATE_NAME, token) == names.with_token(other, token) == f"state.{token}.ckpt"
    )
    for rank in (0, 7, 10**9 - 1):
        for name in (names.rank_file_name(rank), names.rank_file_name(rank, names.save_token())):
            assert names.with_token(name, token) == names.rank_file_name(rank, token)
    for name in (names.COMMIT_NAME, "model.ckpt", "state.ckpt.tmp", "../step-000000001/state.ckpt"):
        assert names.with_token(name, token) is None, name


@pytest.mark.parametrize(
    "name",
    [
        "state.ckpt.tmp",
        "State.ckpt",
        "state.0123456789ABCDEF.ckpt",  # upper-case digits: never drawn
        "state.0123456789abcde.ckpt",  # 15 digits
        "state.0123456789abcdef0.ckpt",
        "rank-0001.ckpt",  # 4 digits
        "rank-0000000001.ckpt",  # 10 digits
        "rank-00001.distcp",
        "x/state.ckpt",
        "state.ckpt/x",
        "COMMIT.tmp",
        "commit",
        ".metadata",
        "model.safetensors",
    ],
)
def test_names_ckptfmt_never_writes_are_not_its_own(name: str) -> None:
    assert not names.is_own_name(name) and names.rank_of(name) is None


def test_temp_names_and_copy_markers_are_not_files_of_a_checkpoint() -> None:
    assert not names.is_own_name(commit.temp_prefix(names.STATE_NAME) + commit.owned_suffix())
    marker = copy_marker()
    assert not names.is_own_name(marker) and written_here(marker)


#: patterns that look like these names but are not names of files
NOT_FILE_NAMES = {
    # the key of one rank's RNG states inside a sharded step's tree (rng.rank-NNNNN), not a file
    ("runs/resumecheck.py", r"rank-[0-9]{5,}"),
}


def test_the_rule_is_written_once() -> None:
    """No module but files/names.py compiles a pattern of the names it defines."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for fname in files:
            path = os.path.join(folder, fname)
            if not fname.endswith(".py") or path == names.__file__:
                continue
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("compile", "fullmatch", "match")
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and any(w in node.args[0].value for w in ("ckpt", "COMMIT", "rank-"))
                    and (os.path.relpath(path, ROOT), node.args[0].value) not in NOT_FILE_NAMES
                ):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert found == []
