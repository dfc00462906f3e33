"""Exit codes of the command line: every command gives the documented status for the same kind
of problem, through the one table in ckptfmt/cli/exitcodes.py (ERROR_EXIT_CODES), prints no traceback,
and names the path in a one-line diagnostic.

Runs in-process (ckptfmt.cli.main) over every file of tests/corpus/, whose expected error
classes are tests/corpus/expected.json, and over a missing file, a directory and a FIFO.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

import ckptfmt
from ckptfmt import cli
from ckptfmt.cli import exitcodes
from ckptfmt.format.sniff import sniff

CORPUS = os.path.join(os.path.dirname(__file__), "corpus")
EXPECTED: dict[str, str] = json.load(open(os.path.join(CORPUS, "expected.json")))
NAMES = sorted(EXPECTED)

#: The statuses EXIT_CODES documents: 1 for a file that is damaged, incomplete, unsupported
#: or over a limit (the four error classes of spec section 9) ...
DOCUMENTED = {"CorruptError": 1, "IncompleteError": 1, "UnsupportedError": 1, "LimitError": 1}
#: ... and so is an encrypted file read without its key (a CheckpointError too)
DOCUMENTED["DecryptionError"] = 1
#: ... and 2 for a path that is not a ckptfmt file at all (recognised by its first bytes)
NOT_CKPTFMT = {"not_ckptfmt.ckpt"}


def expected_code(name: str) -> int:
    return 2 if name in NOT_CKPTFMT else DOCUMENTED[EXPECTED[name]]


def run(*args: object) -> tuple[int, str, str]:
    """ckptfmt.cli.main in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def assert_one_line_naming(text: str, path: object) -> None:
    lines = text.splitlines()
    assert len(lines) == 1, text
    assert str(path) in lines[0], (path, text)
    assert "Traceback" not in text


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    p = tmp_path_factory.mktemp("codes") / "good.ckpt"
    ckptfmt.save({"w": torch.arange(4.0), "b": torch.ones(2, 2)}, p)  # tensors only: convertible
    return p


def test_the_table_gives_the_documented_codes():
    """One table: each error class the reader raises maps to the status EXIT_CODES documents."""
    assert (exitcodes.EXIT_OK, exitcodes.EXIT_FAILED, exitcodes.EXIT_USAGE) == (0, 1, 2)
    for name, code in DOCUMENTED.items():
        assert exitcodes.exit_code_for(getattr(ckptfmt, name)) == code
    assert exitcodes.exit_code(ckptfmt.UnsupportedObjectError("x")) == 1
    assert exitcodes.exit_code(FileNotFoundError(2, "No such file or directory", "p")) == 2
    assert exitcodes.exit_code(IsADirectoryError(21, "Is a directory", "p")) == 2
    assert exitcodes.exit_code(exitcodes.NotCheckpointError("p", "not a ckptfmt file")) == 2
    assert exitcodes.exit_code(exitcodes.UsageError("x")) == 2
    assert exitcodes.exit_code(exitcodes.ForeignFileError("x")) == 1
    with pytest.raises(RuntimeError):  # an error without a row is a bug, never a status
        exitcodes.exit_code(RuntimeError("bug"))
    for line in ("  0  success", "  1  a file is damaged, incomplete, unsupported", "  2  usage error"):
        assert line in exitcodes.EXIT_CODES


def test_corpus_is_classified():
    assert sorted(f for f in os.listdir(CORPUS) if f.endswith(".ckpt")) == NAMES
    for name in NAMES:
        recognised = sniff(os.path.join(CORPUS, name)) == "ckptfmt"
        assert recognised == (name not in NOT_CKPTFMT), name


def test_good_file_is_zero_everywhere(good, tmp_path):
    assert run("verify", good)[0] == 0
    assert run("verify", "--quick", good)[0] == 0
    assert run("inspect", good)[0] == 0
    assert run("diff", good, good) == (0, "identical\n", "")
    assert run("consolidate", good, tmp_path / "c.ckpt")[0] == 0
    assert run("convert", good, tmp_path / "c.safetensors")[0] == 0
    assert run("info")[0] == 0


@pytest.mark.parametrize("name", NAMES)
def test_corpus_file_same_code_from_every_command(name, good, tmp_path):
    path = os.path.join(CORPUS, name)
    code = expected_code(name)

    # verify: one result line on stdout naming the file; extra problems on stderr
    rc, out, err = run("verify", path)
    assert rc == code, (out, err)
    assert out.splitlines()[0].startswith(f"{path}: ") and len(out.splitlines()) == 1, out
    assert "Traceback" not in out + err
    doc = json.loads(run("verify", "--json", path)[1])
    assert doc["ok"] is False

    # inspect does what verify --quick does: structure, index and referenced files, no chunk data
    quick, qout, qerr = run("verify", "--quick", path)
    rc, out, err = run("inspect", path)
    assert rc == quick, (out, err, qout)
    assert quick in (code, 0)
    if quick == 0:  # what only a full read finds is in chunk data: verify names the chunk
        assert all(p["chunk"] is not None for p in doc["files"][0]["problems"]), doc
        assert err == ""
    else:
        assert_one_line_naming(err, path)

    # diff against a good file (either side) and against itself: a damaged file is not "differ"
    for a, b in ((good, path), (path, good), (path, path)):
        rc, out, err = run("diff", a, b)
        assert rc == code, (a, b, out, err)
        assert out == ""
        assert_one_line_naming(err, path)

    # consolidate and convert read every chunk, as verify does
    dst = tmp_path / "out.ckpt"
    rc, out, err = run("consolidate", path, dst)
    assert rc == code, (out, err)
    assert_one_line_naming(err, path)
    assert not dst.exists()
    rc, out, err = run("convert", path, tmp_path / "out.safetensors")
    assert rc == code, (out, err)
    assert_one_line_naming(err, path)


def test_corpus_in_one_verify_gives_the_worst_code():
    paths = [os.path.join(CORPUS, n) for n in NAMES]
    rc, out, _ = run("verify", *paths)
    assert rc == max(expected_code(n) for n in NAMES) == 2
    assert len(out.splitlines()) == len(paths)
    damaged = [p for p, n in zip(paths, NAMES) if n not in NOT_CKPTFMT]
    assert run("verify", *damaged)[0] == 1


# -- paths that are not checkpoint files ------------------------------------------


@pytest.fixture()
def odd_paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"missing": tmp_path / "missing.ckpt", "directory": folder, "fifo": fifo}


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo"])
def test_file_commands_on_a_path_that_is_not_a_file(kind, odd_paths, good, tmp_path):
    """2 from every command that needs a file; stderr is one line naming the path."""
    path = odd_paths[kind]
    for args in (
        ("inspect", path),
        ("diff", good, path),
        ("diff", path, good),
        ("diff", path, path),
        ("consolidate", path, tmp_path / "out.ckpt"),
    ):
        rc, out, err = run(*args)
        assert rc == 2, (args, out, err)
        assert out == ""
        assert_one_line_naming(err, path)
    if kind != "directory":  # convert takes a directory as a DCP checkpoint (below)
        rc, out, err = run("convert", path, tmp_path / "out.ckpt")
        assert rc == 2, (out, err)
        assert_one_line_naming(err, path)
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("kind", ["missing", "fifo"])
def test_verify_and_ls_on_a_path_that_is_not_a_file(kind, odd_paths):
    path = odd_paths[kind]
    rc, out, err = run("verify", path)
    assert rc == 2 and err == ""
    assert_one_line_naming(out, path)
    assert ("UNREADABLE" if kind == "missing" else "NOT CKPTFMT") in out
    rc, out, err = run("ls", path)
    assert rc == 2 and out == ""
    assert_one_line_naming(err, path)


def test_a_directory_without_a_checkpoint(odd_paths, tmp_path):
    """verify and convert take directories: one with no commit record is an incomplete
    checkpoint (spec section 13.2), 1, never a silent success; ls lists its zero steps."""
    folder = odd_paths["directory"]
    rc, out, err = run("verify", folder)
    assert rc == 1 and err == ""
    assert_one_line_naming(out, folder)
    assert "INCOMPLETE" in out
    assert json.loads(run("verify", "--json", folder)[1])["files"][0]["status"] == "incomplete"
    rc, out, err = run("convert", folder, tmp_path / "out.ckpt")
    assert rc == 1 and out == ""
    assert_one_line_naming(err, folder)
    assert run("ls", folder) == (0, "", "")


def test_usage_errors_are_2(good, tmp_path):
    assert run()[0] == 2
    assert run("frobnicate")[0] == 2
    assert run("inspect")[0] == 2
    rc, _, err = run("consolidate", good, good)  # the output would replace the input
    assert rc == 2
    assert_one_line_naming(err, good)
    rc, _, err = run("convert", good, tmp_path / "x.ckpt", "--level", "3")
    assert rc == 2 and "--level needs --compression" in err
    # a ckptfmt state that safetensors cannot hold
    p = tmp_path / "mixed.ckpt"
    ckptfmt.save({"w": torch.ones(2), "step": 1}, p)
    rc, _, err = run("convert", p, tmp_path / "x.safetensors")
    assert rc == 2
    assert_one_line_naming(err, p)


def test_other_formats_are_2_everywhere(tmp_path, good):
    pt = tmp_path / "model.ckpt"  # a torch.save file under a checkpoint's name
    torch.save({"w": torch.ones(2)}, pt)
    assert run("verify", pt)[0] == 2
    for args in (("inspect", pt), ("diff", good, pt), ("consolidate", pt, tmp_path / "o.ckpt")):
        rc, out, err = run(*args)
        assert rc == 2, args
        assert_one_line_naming(err, pt)
        assert "torch.save zip archive" in err


def test_a_foreign_file_its_reader_refuses_is_1(tmp_path):
    """convert's source in another format that its own reader refuses is a file that failed (1)."""
    bad = tmp_path / "bad.safetensors"
    head = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    bad.write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 4)  # 12 bytes short
    assert sniff(bad) == "safetensors"
    rc, out, err = run("convert", bad, tmp_path / "x.ckpt")
    assert rc == 1, (out, err)
    assert_one_line_naming(err, bad)
    assert not (tmp_path / "x.ckpt").exists()


def test_inspect_of_an_incremental_file_whose_base_is_gone(tmp_path):
    """The tree is shown, then one line on stderr names the missing file; 1, as verify --quick."""
    from ckptfmt.files import incremental

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base, top = tmp_path / "a" / "s.ckpt", tmp_path / "b" / "s.ckpt"
    state = {"w": torch.arange(2048.0)}
    incremental.save(state, base, chunk_size=4096)
    incremental.save(state, top, base=base)
    assert run("inspect", top)[0] == 0
    os.unlink(base)
    rc, out, err = run("inspect", top)
    assert rc == run("verify", "--quick", top)[0] == run("verify", top)[0] == 1
    assert "['w']: tensor float32 [2048]" in out
    assert_one_line_naming(err, top)
    assert "a/s.ckpt" in err
    doc = json.loads(run("inspect", "--json", top)[1])
    assert doc["problems"][0]["kind"] == "incomplete"
