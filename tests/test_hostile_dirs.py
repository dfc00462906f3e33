"""Hostile run directories: a checkpoint directory from anywhere never leads outside itself,
and `verify` never says OK to what a load refuses.

Each case of CASES is built from a real incremental run (step 2 reads the frozen tensor's
chunks from step 1) by a small builder, as someone who downloaded a run directory or shares
a filesystem with other users could leave it.  EXPECTED says what every public entry point
must answer; `outside` is a directory beside the run whose bytes must never change and must
never be returned as checkpoint data.
"""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.cli import main as cli
from ckptfmt.engine.ckptdir import CheckpointDir, LinkError
from ckptfmt.errors import CheckpointError, CorruptError, LimitError
from ckptfmt.files import multifile

S1, S2 = "step-000000001", "step-000000002"
FROZEN = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB: step 2 refers to step 1 for it


@dataclass
class Run:
    root: Path  # holds run/ and outside/
    run: Path
    outside: Path

    def step(self, name: str) -> Path:
        return self.run / name


def _state(step: int) -> dict:
    return {"frozen": FROZEN, "w": torch.full((16,), float(step)), "step": step}


def _make_run(tmp_path: Path) -> Run:
    run = tmp_path / "run"
    mgr = CheckpointManager(run, incremental=True)
    for s in (1, 2):
        mgr.save(s, _state(s))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_bytes(b"not yours\n")
    return Run(tmp_path, run, outside)


def _rewrite_record(r: Run, name: str, compression: str | None = None, **changes: object) -> None:
    """Replace `name`'s commit record by a valid one (checksums right) with `changes`."""
    path = r.step(name) / "COMMIT"
    value = ckptfmt.load(path)
    value.update(changes)
    os.unlink(path)
    ckptfmt.save(value, path, compression=compression)


# -- the builders ----------------------------------------------------------------------------


def ref_dir_is_a_link(r: Run) -> None:
    """Step 1 moved outside and a link left in its place: step 2's reference path goes through it."""
    shutil.copytree(r.step(S1), r.outside / "step1")
    shutil.rmtree(r.step(S1))
    os.symlink(r.outside / "step1", r.step(S1))


def record_omits_reference(r: Run) -> None:
    """Step 2's record names no references, yet its state file reads chunks from step 1."""
    _rewrite_record(r, S2, references=[])


def record_names_other_part(r: Run) -> None:
    """Step 2's record binds other.ckpt; state.ckpt is some other file."""
    os.rename(r.step(S2) / "state.ckpt", r.step(S2) / "other.ckpt")
    value = ckptfmt.load(r.step(S2) / "COMMIT")
    value["files"][0]["name"] = "other.ckpt"
    os.unlink(r.step(S2) / "COMMIT")
    ckptfmt.save(value, r.step(S2) / "COMMIT")
    ckptfmt.save({"state": {"evil": 1}, "rng": None, "resume": {}}, r.step(S2) / "state.ckpt")


def record_for_other_step(r: Run) -> None:
    """A copy of step 1 under the name of step 5: its record says step 1."""
    shutil.copytree(r.step(S1), r.step("step-000000005"))


def record_step_none(r: Run) -> None:
    _rewrite_record(r, S2, step=None)


def commit_checksum_fails(r: Run) -> None:
    """One bit of step 2's commit record flipped (in its index: the record's checksum fails)."""
    path = r.step(S2) / "COMMIT"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def record_expands(r: Run) -> None:
    """A record of a few KiB whose zstd member expands to 96 MiB (a record may hold a 'dcp' member)."""
    _rewrite_record(r, S2, compression="zstd", dcp=np.zeros(96 << 20, dtype=np.uint8))


def state_is_a_fifo(r: Run) -> None:
    os.unlink(r.step(S2) / "state.ckpt")
    os.mkfifo(r.step(S2) / "state.ckpt")


def step_dir_is_a_link(r: Run) -> None:
    """A complete-looking step 9 that is a link to a directory outside (a copy of step 1, renumbered)."""
    shutil.copytree(r.step(S1), r.outside / "step9")
    value = ckptfmt.load(r.outside / "step9" / "COMMIT")
    value["step"] = 9
    os.unlink(r.outside / "step9" / "COMMIT")
    ckptfmt.save(value, r.outside / "step9" / "COMMIT")
    os.symlink(r.outside / "step9", r.step("step-000000009"))


def link_inside_step(r: Run) -> None:
    """Step 1 holds a link to the outside directory (removed as a name when step 1 is deleted)."""
    os.symlink(r.outside, r.step(S1) / "junk")


def _commit_step(r: Run, name: str, step: int | None, **record: object) -> None:
    """A valid commit record for the files in step directory `name` (state.ckpt)."""
    d = r.step(name)
    parts = (multifile.describe_part(str(d / "state.ckpt"), "state.ckpt"),)
    multifile.write_commit(str(d), multifile.CommitRecord(step, "state", parts, **record))  # type: ignore[arg-type]


def state_root_is_a_list(r: Run) -> None:
    """A complete-looking step 3 whose state file is not a manager's (its root is a list)."""
    r.step("step-000000003").mkdir()
    ckptfmt.save([torch.ones(2)], r.step("step-000000003") / "state.ckpt")
    _commit_step(r, "step-000000003", 3)


def resume_entry_is_a_string(r: Run) -> None:
    """Step 3's state file holds a state, but its resume fingerprint is a string."""
    r.step("step-000000003").mkdir()
    ckptfmt.save({"state": _state(3), "rng": None, "resume": "x"}, r.step("step-000000003") / "state.ckpt")
    _commit_step(r, "step-000000003", 3)


def reference_repeated(r: Run) -> None:
    """Step 2's record names its one reference 3000 times (verify would read it 3000 times)."""
    value = ckptfmt.load(r.step(S2) / "COMMIT")
    _rewrite_record(r, S2, references=value["references"] * 3000)


def metric_beyond_int64(r: Run) -> None:
    _rewrite_record(r, S2, metrics={"loss": 10**400})


def deep_tree_in_a_step(r: Run) -> None:
    """An uncommitted step 3 holding directories 1500 deep (cleanup must neither recurse
    without bound nor fail the saves that try to remove it)."""
    r.step("step-000000003").mkdir()
    fd = os.open(r.step("step-000000003"), os.O_RDONLY)
    for _ in range(1500):
        os.mkdir("a", dir_fd=fd)
        sub = os.open("a", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)


def _flatten_deep(top: Path) -> None:
    """Remove a chain of nested directories `a/a/...` below `top` without recursion (pytest's
    own cleanup of tmp_path would recurse through it): each child is moved up in turn."""
    a, b = top / "a", top / "b"
    while os.path.isdir(a):
        if os.path.isdir(a / "a"):
            os.rename(a / "a", b)
            os.rmdir(a)
            os.rename(b, a)
        else:
            os.rmdir(a)


def commit_at_the_run_level(r: Run) -> None:
    """Step 2 damaged, and a valid checkpoint directory's COMMIT put at the top of the run:
    verify of the run must still verify (and fail) its steps."""
    commit_checksum_fails(r)
    ckptfmt.save({"x": 1}, r.run / "state.ckpt")
    part = multifile.describe_part(str(r.run / "state.ckpt"), "state.ckpt")
    multifile.write_commit(str(r.run), multifile.CommitRecord(None, "hf-trainer", (part,)))


def reference_is_a_socket(r: Run) -> None:
    """Step 1's state file (which step 2 reads chunks from) replaced by a Unix socket."""
    import socket

    os.unlink(r.step(S1) / "state.ckpt")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(r.step(S1) / "state.ckpt"))
    sock.close()


def commit_is_a_link(r: Run) -> None:
    """Step 2's commit record moved outside and a link left in its place."""
    shutil.copy(r.step(S2) / "COMMIT", r.outside / "COMMIT")
    os.unlink(r.step(S2) / "COMMIT")
    os.symlink(r.outside / "COMMIT", r.step(S2) / "COMMIT")


def state_is_a_link_to_its_copy(r: Run) -> None:
    """Step 2's state file moved outside (the same bytes) and a link left in its place."""
    shutil.copy(r.step(S2) / "state.ckpt", r.outside / "state.ckpt")
    os.unlink(r.step(S2) / "state.ckpt")
    os.symlink(r.outside / "state.ckpt", r.step(S2) / "state.ckpt")


def commit_is_a_fifo(r: Run) -> None:
    os.unlink(r.step(S2) / "COMMIT")
    os.mkfifo(r.step(S2) / "COMMIT")


def commit_is_a_directory(r: Run) -> None:
    os.unlink(r.step(S2) / "COMMIT")
    os.mkdir(r.step(S2) / "COMMIT")


def commit_is_huge(r: Run) -> None:
    """A sparse commit record beyond the record limit (never read to find that out)."""
    with open(r.step(S2) / "COMMIT", "r+b") as f:
        f.truncate(multifile.MAX_RECORD_BYTES + (1 << 20))


def part_name_climbs_out(r: Run) -> None:
    """Step 2's record names its state file as ../../outside/state.ckpt (a valid copy there)."""
    shutil.copy(r.step(S2) / "state.ckpt", r.outside / "state.ckpt")
    value = ckptfmt.load(r.step(S2) / "COMMIT")
    value["files"][0]["name"] = "../../outside/state.ckpt"
    _rewrite_record(r, S2, files=value["files"])


def part_name_is_absolute(r: Run) -> None:
    shutil.copy(r.step(S2) / "state.ckpt", r.outside / "state.ckpt")
    value = ckptfmt.load(r.step(S2) / "COMMIT")
    value["files"][0]["name"] = str(r.outside / "state.ckpt")
    _rewrite_record(r, S2, files=value["files"])


def reference_climbs_out(r: Run) -> None:
    """Step 2's record names its reference as ../../outside/step1/state.ckpt (a copy of step 1)."""
    shutil.copytree(r.step(S1), r.outside / "step1")
    value = ckptfmt.load(r.step(S2) / "COMMIT")
    value["references"][0]["name"] = "../../outside/step1/state.ckpt"
    _rewrite_record(r, S2, references=value["references"])


CASES: dict[str, Callable[[Run], None]] = {
    f.__name__: f
    for f in (
        ref_dir_is_a_link,
        record_omits_reference,
        record_names_other_part,
        record_for_other_step,
        record_step_none,
        commit_checksum_fails,
        record_expands,
        state_is_a_fifo,
        step_dir_is_a_link,
        link_inside_step,
        state_root_is_a_list,
        resume_entry_is_a_string,
        reference_repeated,
        metric_beyond_int64,
        deep_tree_in_a_step,
        commit_at_the_run_level,
        reference_is_a_socket,
        commit_is_a_link,
        state_is_a_link_to_its_copy,
        commit_is_a_fifo,
        commit_is_a_directory,
        commit_is_huge,
        part_name_climbs_out,
        part_name_is_absolute,
        reference_climbs_out,
    )
}

#: step 2 refused by every entry point: step 1 is the latest and what loads, verify fails both
STEP2_REFUSED: dict[str, object] = dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1)
# latest: the step latest() returns; load: the step load() returns, or the error it raises;
# fallback: the same with fallback=True; verify_run / verify_step: exit codes of `ckptfmt verify`
# on the run and on `target` (the directory the case concerns)
EXPECTED: dict[str, dict[str, object]] = {
    "ref_dir_is_a_link": dict(
        target=S2, latest=None, load=CheckpointError, fallback=CheckpointError, verify_run=1, verify_step=1
    ),
    "record_omits_reference": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "record_names_other_part": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "record_for_other_step": dict(
        target="step-000000005", latest=2, load=2, fallback=2, verify_run=1, verify_step=1
    ),
    "record_step_none": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "commit_checksum_fails": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "record_expands": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "state_is_a_fifo": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "step_dir_is_a_link": dict(target=S2, latest=2, load=2, fallback=2, verify_run=0, verify_step=0),
    "link_inside_step": dict(target=S1, latest=2, load=2, fallback=2, verify_run=0, verify_step=0),
    "state_root_is_a_list": dict(
        target="step-000000003", latest=2, load=2, fallback=2, verify_run=1, verify_step=1
    ),
    # load() returns the state; load_into refuses the fingerprint, so verify fails
    "resume_entry_is_a_string": dict(
        target="step-000000003", latest=3, load=3, fallback=3, verify_run=1, verify_step=1
    ),
    "reference_repeated": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "metric_beyond_int64": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "deep_tree_in_a_step": dict(
        target="step-000000003", latest=2, load=2, fallback=2, verify_run=0, verify_step=1
    ),
    "commit_at_the_run_level": dict(target=S2, latest=1, load=1, fallback=1, verify_run=1, verify_step=1),
    "reference_is_a_socket": dict(
        target=S2, latest=None, load=CheckpointError, fallback=CheckpointError, verify_run=1, verify_step=1
    ),
    "commit_is_a_link": STEP2_REFUSED,
    "state_is_a_link_to_its_copy": STEP2_REFUSED,
    "commit_is_a_fifo": STEP2_REFUSED,
    "commit_is_a_directory": STEP2_REFUSED,
    "commit_is_huge": STEP2_REFUSED,
    "part_name_climbs_out": STEP2_REFUSED,
    "part_name_is_absolute": STEP2_REFUSED,
    "reference_climbs_out": STEP2_REFUSED,
}


def _tree(path: Path) -> dict[str, bytes]:
    """Every file below `path` (links not followed) and its bytes."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = b"link" if os.path.islink(full) else Path(full).read_bytes()
    return out


def _loaded_step(got: object) -> int:
    assert isinstance(got, dict) and torch.equal(got["frozen"], FROZEN), "data that is not the run's"
    step = got["step"]
    assert isinstance(step, int) and torch.equal(got["w"], torch.full((16,), float(step)))
    return step


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return _loaded_step(fn())
    except CheckpointError as e:
        assert "\n" not in str(e), "an error is one line"
        return type(e)


class _Hang(Exception):
    pass


@pytest.fixture()
def no_hang():
    """Fail, rather than hang CI, when an entry point blocks (a FIFO opened for reading)."""

    def alarm(*_: object) -> None:
        raise _Hang("blocked for 60 s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _matches(got: object, want: object) -> bool:
    if isinstance(want, type):
        return isinstance(got, type) and issubclass(got, want)
    return got == want


@pytest.fixture()
def flatten_deep_trees(tmp_path):
    """After the test, pass or fail: the deep tree a case builds is removed without recursion."""
    yield
    deep = tmp_path / "run" / "step-000000003"
    if deep.is_dir() and not deep.is_symlink():
        _flatten_deep(deep)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_run_directory(tmp_path, case, no_hang, capsys, flatten_deep_trees):
    r = _make_run(tmp_path)
    CASES[case](r)
    outside = _tree(r.outside)
    want = EXPECTED[case]
    mgr = CheckpointManager(r.run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        latest = mgr.latest()
        got = {
            "latest": None if latest is None else latest.step,
            "load": _outcome(lambda: mgr.load()),
            "fallback": _outcome(lambda: mgr.load(fallback=True)),
        }
    got["verify_run"] = cli(["verify", str(r.run)])
    got["verify_step"] = cli(["verify", str(r.run / str(want["target"]))])
    assert cli(["ls", str(r.run)]) == 0
    capsys.readouterr()
    for what in ("latest", "load", "fallback", "verify_run", "verify_step"):
        assert _matches(got[what], want[what]), f"{case}: {what} gave {got[what]!r}, expected {want[what]!r}"
    assert _tree(r.outside) == outside
    # a save with rotation and cleanup never touches anything outside the run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CheckpointManager(r.run, keep_last=1).save(20, _state(20))
    assert _tree(r.outside) == outside
    assert os.path.isdir(r.outside)


def test_every_case_has_an_expectation():
    assert set(CASES) == set(EXPECTED)


def test_a_reference_through_a_linked_directory_is_refused_by_the_file_reader_too(tmp_path):
    r = _make_run(tmp_path)
    ref_dir_is_a_link(r)
    with pytest.raises(CorruptError, match="symbolic link"):
        ckptfmt.load(r.step(S2) / "state.ckpt")
    assert not ckptfmt.verify(r.step(S2) / "state.ckpt").ok


def test_a_record_is_bounded_before_its_members_are_decoded(tmp_path):
    r = _make_run(tmp_path)
    record_expands(r)
    assert (r.step(S2) / "COMMIT").stat().st_size < 1 << 20
    with pytest.raises(LimitError):
        multifile.read_commit(str(r.step(S2)))
    _rewrite_record(r, S1, unknown=np.zeros(16, dtype=np.uint8))
    with pytest.raises(CorruptError, match="fields must be exactly"):
        multifile.read_commit(str(r.step(S1)))


def test_deleting_a_step_swapped_for_a_link_after_it_was_opened_stays_inside(tmp_path):
    """The step directory is reached once, by descriptor: renaming it away and leaving a link
    to an outside directory in its place changes nothing about what is deleted."""
    r = _make_run(tmp_path)
    (r.outside / "state.ckpt").write_bytes(b"outside")
    with CheckpointDir.open(r.run) as run, run.sub(S1) as d:
        os.rename(r.step(S1), r.root / "moved")
        os.symlink(r.outside, r.step(S1))
        for name in d.names():
            d.remove_tree(name)
        assert not run.rmdir(S1)  # a link is not a directory to remove
        with pytest.raises(LinkError):
            run.sub(S1)
    assert (r.outside / "state.ckpt").read_bytes() == b"outside"
    assert os.listdir(r.root / "moved") == []


def test_rotation_removes_a_link_inside_a_step_as_a_name(tmp_path):
    r = _make_run(tmp_path)
    link_inside_step(r)
    mgr = CheckpointManager(r.run, keep_last=1)
    mgr.save(3, _state(3))
    mgr.save(4, _state(4))
    assert not os.path.lexists(r.step(S1) / "junk")
    assert (r.outside / "precious.txt").read_bytes() == b"not yours\n"


@pytest.mark.parametrize("command", ["consolidate", "convert"])
def test_copies_never_read_through_a_linked_directory(tmp_path, command, capsys):
    """consolidate (and convert to safetensors) read an incremental file's external chunks
    with the reader's rules: a link on a reference's path is refused, nothing is written."""
    r = _make_run(tmp_path)
    ref_dir_is_a_link(r)
    out = tmp_path / ("copy.ckpt" if command == "consolidate" else "copy.safetensors")
    assert cli([command, str(r.step(S2) / "state.ckpt"), str(out)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not out.exists()


def test_a_dcp_rank_file_that_is_a_link_is_never_read(tmp_path):
    """A rank file moved outside and linked back (the right bytes, through a link) is refused."""
    from ckptfmt import dcp as cdcp

    ckpt = tmp_path / "ckpt"
    cdcp.save({"w": torch.arange(8.0)}, ckpt)
    (rank,) = [n for n in os.listdir(ckpt) if n.startswith("rank-")]
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(ckpt / rank, outside / rank)
    os.symlink(outside / rank, ckpt / rank)
    target = {"w": torch.zeros(8)}
    with pytest.raises(CorruptError, match="symbolic link"):
        cdcp.load(target, ckpt)
    assert torch.equal(target["w"], torch.zeros(8))
    assert cli(["verify", str(ckpt)]) == 1


def test_a_save_writes_into_the_step_directory_it_made_even_if_it_is_swapped_for_a_link(
    tmp_path, monkeypatch
):
    """Between making its step directory and writing into it, the directory is renamed away
    and a link to an outside directory put in its place: the state file and the commit
    record still go into the directory the save made and holds, never through the link."""
    from ckptfmt.runs import manager as manager_mod

    r = _make_run(tmp_path)
    real = manager_mod.CheckpointManager._write_state

    def swap_then_write(self, job, payload):
        os.rename(job.path, r.root / "moved")
        os.symlink(r.outside, job.path)
        return real(self, job, payload)

    monkeypatch.setattr(manager_mod.CheckpointManager, "_write_state", swap_then_write)
    CheckpointManager(r.run).save(3, _state(3))
    assert sorted(os.listdir(r.outside)) == ["precious.txt"]
    assert sorted(os.listdir(r.root / "moved")) == [".ckptfmt-folder", "COMMIT", "state.ckpt"]


def test_a_state_file_replaced_after_verify_is_never_loaded_as_its_step(tmp_path):
    """verify says step 2 is whole; then its state file is replaced by another whole file (the
    same state, saved again: a new file id).  The load checks the file against the record it
    reads, not against what verify saw: step 2 is refused, and the fallback is step 1."""
    r = _make_run(tmp_path)
    assert cli(["verify", str(r.step(S2))]) == 0
    os.unlink(r.step(S2) / "state.ckpt")
    ckptfmt.save({"state": _state(2), "rng": None, "resume": {}}, r.step(S2) / "state.ckpt")
    mgr = CheckpointManager(r.run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _outcome(lambda: mgr.load(2)) is CorruptError
        assert _outcome(lambda: mgr.load(fallback=True)) == 1
    assert cli(["verify", str(r.step(S2))]) == 1


def test_load_into_refuses_what_verify_refuses(tmp_path):
    r = _make_run(tmp_path)
    resume_entry_is_a_string(r)
    mgr = CheckpointManager(r.run)
    assert not mgr.verify(3).ok
    target = {"frozen": torch.zeros_like(FROZEN), "w": torch.zeros(16), "step": 0}
    with pytest.raises(CorruptError, match="resume"):
        mgr.load_into(target, 3)
    assert not target["w"].any()


def test_a_huge_metric_never_stops_saves_that_rank_by_it(tmp_path):
    r = _make_run(tmp_path)
    metric_beyond_int64(r)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = CheckpointManager(r.run, keep_best="loss", keep_last=1)
        mgr.save(3, _state(3))
        assert mgr.latest().step == 3


def test_a_socket_where_a_referenced_file_should_be_is_a_problem_not_an_exception(tmp_path):
    r = _make_run(tmp_path)
    reference_is_a_socket(r)
    report = ckptfmt.verify(r.step(S2) / "state.ckpt")
    assert not report.ok and "not a regular file" in str(report.problems[0])
    with pytest.raises(CorruptError, match="not a regular file"):
        ckptfmt.load(r.step(S2) / "state.ckpt")
