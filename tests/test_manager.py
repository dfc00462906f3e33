"""CheckpointManager: a run's directory of step checkpoints, their commit records, damage,
resume checks, non-blocking saves; and ckptfmt.multifile, the commit record itself."""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.background import inflight
from ckptfmt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptError,
    IncompleteError,
    UnsupportedError,
    UnsupportedObjectError,
)
from ckptfmt.files import multifile
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.files.targets import MismatchError
from ckptfmt.runs import locks, resume
from ckptfmt.runs.manager import CheckpointManager
from ckptfmt.runs.steps import STATE_NAME, step_dirname

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_leaks():
    """Every test ends with no thread or file descriptor (step directory locks) left over."""
    threads = set(threading.enumerate())
    fds = len(os.listdir("/proc/self/fd"))
    yield
    for h in list(inflight._in_flight.values()):
        h._done.wait(30)
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - threads, "a thread outlived the test"
    assert len(os.listdir("/proc/self/fd")) <= fds, "a file descriptor leaked"


def _step(d, step):
    return os.path.join(d, step_dirname(step))


def _state_file(d, step):
    return os.path.join(_step(d, step), STATE_NAME)


def _dirs(d):
    return sorted(os.listdir(d))


def _tiny(value):
    return {"w": torch.full((3,), float(value)), "n": value}


def _training_state(seed=0, lr=0.1, out=2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, out))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "data": {"epoch": 1, "batch": 7}}


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_params(model, saved):
    return all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def _flip_tensor(path, key_part):
    """Flip the first byte of the chunk holding the tensor whose key contains key_part."""
    with CheckpointFile(path) as f:
        k = next(i for i, key in enumerate(f.chunk_keys()) if key_part in key)
        offset = f.chunks[k].offset
    _flip(path, offset)


def _caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(x.message) for x in w if issubclass(x.category, CheckpointWarning)]


# -- saving, listing, loading -----------------------------------------------------------


def test_save_list_load_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path)
    before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    assert mgr.save(1, _tiny(1), metrics={"loss": 0.5, "acc": 1}, metadata={"run": "a"}) is None
    mgr.save(20, _tiny(20), metrics={"loss": torch.tensor(0.25)})
    assert _dirs(tmp_path) == [step_dirname(1), step_dirname(20)]
    assert sorted(os.listdir(_step(tmp_path, 1))) == [".ckptfmt-folder", "COMMIT", "state.ckpt"]
    infos = mgr.checkpoints()
    assert [c.step for c in infos] == [1, 20]
    first, last = infos
    assert isinstance(first, ckptfmt.CheckpointInfo)
    assert first.path == _step(tmp_path, 1)
    assert first.metrics == {"loss": 0.5, "acc": 1} and first.metadata == {"run": "a"}
    assert last.metrics == {"loss": 0.25} and last.metadata == {}
    own = [n for n in os.listdir(first.path) if not n.startswith(".")]  # not ckptfmt's mark
    assert first.size == sum(os.path.getsize(os.path.join(first.path, n)) for n in own)
    assert before <= first.created <= last.created <= datetime.datetime.now(datetime.timezone.utc)
    assert mgr.latest() == last
    got = mgr.load()
    assert torch.equal(got["w"], torch.full((3,), 20.0)) and got["n"] == 20
    assert mgr.load(step=1)["n"] == 1
    assert mgr.load(1, map_location="cpu")["w"].device.type == "cpu"
    # a fresh manager on the same directory sees the same run
    assert CheckpointManager(tmp_path).checkpoints() == infos


def test_empty_run(tmp_path):
    mgr = CheckpointManager(tmp_path / "new" / "run")
    assert os.path.isdir(tmp_path / "new" / "run")
    assert mgr.latest() is None
    assert mgr.checkpoints() == []
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        mgr.load()
    with pytest.raises(CheckpointError):
        mgr.load_into({"w": torch.zeros(3)})
    with pytest.raises(CheckpointError):
        mgr.verify()


def test_stateful_objects_are_saved_as_state_dicts(tmp_path):
    state = _training_state()
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, state)
    got = mgr.load()
    assert set(got) == {"model", "opt", "data"}
    assert all(torch.equal(got["model"][k], v) for k, v in state["model"].state_dict().items())
    assert got["opt"]["param_groups"][0]["lr"] == 0.1
    assert got["data"] == {"epoch": 1, "batch": 7}


@pytest.mark.parametrize("step", [-1, 1.0, True, "3", None, 10**20, 10**30])
def test_bad_steps_are_rejected_before_anything_is_written(tmp_path, step):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        mgr.save(step, _tiny(0))
    assert os.listdir(tmp_path) == []


def test_the_largest_step_round_trips(tmp_path):
    mgr = CheckpointManager(tmp_path)
    big = 10**20 - 1
    mgr.save(big, _tiny(1))
    assert mgr.latest().step == big
    assert mgr.load()["n"] == 1
    # its resume entry holds the step: a resume and a verify accept every step a save does
    assert mgr.verify(big).ok
    state = _tiny(0)
    with pytest.warns(CheckpointWarning, match="no data position"):
        assert mgr.load_into(state).step == big and torch.equal(state["w"], torch.ones(3))


def test_saving_a_step_not_after_the_newest_says_what_to_do(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, _tiny(5))
    mgr.save(10, _tiny(10))
    for step in (10, 7, 0):
        with pytest.raises(ValueError, match=r"step 10\b.*remove") as e:
            mgr.save(step, _tiny(step))
        assert f"step {step} " in str(e.value)
    assert _dirs(tmp_path) == [step_dirname(5), step_dirname(10)]
    # resumed from step 5: remove the later ones, then the run goes on from there
    mgr.remove(10)
    assert _dirs(tmp_path) == [step_dirname(5)]
    assert mgr.latest().step == 5
    mgr.save(7, _tiny(7))
    assert [c.step for c in mgr.checkpoints()] == [5, 7]
    with pytest.raises(CheckpointError, match="no checkpoint of step 99"):
        mgr.remove(99)


def test_bad_metrics_and_metadata_are_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="metrics"):
        mgr.save(1, _tiny(1), metrics={"loss": "low"})
    with pytest.raises(TypeError, match="metrics"):
        mgr.save(1, _tiny(1), metrics=[("loss", 1.0)])
    with pytest.raises((TypeError, ValueError)):
        mgr.save(1, _tiny(1), metadata={"k": 3})
    assert os.listdir(tmp_path) == []


def test_an_object_that_cannot_be_stored_fails_at_save_and_leaves_nothing(tmp_path):
    for blocking in (True, False):
        d = tmp_path / str(blocking)
        mgr = CheckpointManager(d, blocking=blocking)
        mgr.save(1, _tiny(1))
        mgr.wait()
        with pytest.raises(UnsupportedObjectError):
            mgr.save(2, {"f": lambda: 0})
        assert _dirs(d) == [step_dirname(1)]
        mgr.wait()  # nothing in flight failed: the error was already raised
        h = mgr.save(2, _tiny(2))
        if h is not None:
            h.wait()
        assert mgr.latest().step == 2


# -- damaged and incomplete step directories ---------------------------------------------


def _no_commit(d):
    os.unlink(os.path.join(_step(d, 3), "COMMIT"))


def _truncated(d):
    p = _state_file(d, 3)
    os.truncate(p, os.path.getsize(p) // 2)


def _truncated_footer(d):
    p = _state_file(d, 3)
    os.truncate(p, os.path.getsize(p) - 1)


def _commit_flipped(d):
    p = os.path.join(_step(d, 3), "COMMIT")
    _flip(p, os.path.getsize(p) // 2)


def _replaced_same_size(d):
    p = _state_file(d, 3)
    other = p + ".other"
    ckptfmt.save(resume.build_payload(_tiny(3), 3, ckptfmt.capture_rng()), other)
    assert os.path.getsize(other) == os.path.getsize(p)
    os.replace(other, p)


def _replaced_other_size(d):
    ckptfmt.save({"w": torch.zeros(100)}, _state_file(d, 3))


def _only_the_directory(d):
    shutil.rmtree(_step(d, 3))
    os.mkdir(_step(d, 3))


def _commit_of_another_step(d):
    shutil.copy(os.path.join(_step(d, 2), "COMMIT"), os.path.join(_step(d, 3), "COMMIT"))
    shutil.copy(_state_file(d, 2), _state_file(d, 3))


def _state_missing(d):
    os.unlink(_state_file(d, 3))


#: damage -> (words the warning holds, whether a commit record is left: "damaged", kept while newest)
DAMAGE = {
    _no_commit: ("no commit record", False),
    _truncated: ("state.ckpt", True),
    _truncated_footer: ("state.ckpt", True),
    _commit_flipped: ("COMMIT", True),
    _replaced_same_size: ("not the file the commit record names", True),
    _replaced_other_size: ("state.ckpt", True),
    _only_the_directory: ("no commit record", False),
    _commit_of_another_step: ("step 2", True),
    _state_missing: ("state.ckpt named by the commit record is missing", True),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__.strip("_"))
def test_an_incomplete_step_is_skipped_with_a_warning_then_cleaned_up(tmp_path, damage):
    words, damaged = DAMAGE[damage]
    mgr = CheckpointManager(tmp_path)
    for s in (1, 2, 3):
        mgr.save(s, _tiny(s))
    damage(str(tmp_path))
    latest, warned = _caught(mgr.latest)
    assert latest.step == 2
    assert len(warned) == 1, warned
    assert _step(tmp_path, 3) in warned[0] and words in warned[0]
    assert "\n" not in warned[0]
    assert [c.step for c in mgr.checkpoints()] == [1, 2]
    assert mgr.load()["n"] == 2
    with pytest.raises(CheckpointError, match="step 3 is not a complete checkpoint"):
        mgr.load(step=3)
    with pytest.raises(CheckpointError, match="step 3 is not a complete checkpoint"):
        mgr.verify(step=3)
    # the next save removes a save that never finished; a committed step damaged later, newer
    # than every complete one, is the newest data there is: it goes once a newer step commits
    mgr.save(4, _tiny(4))
    assert _dirs(tmp_path) == [step_dirname(s) for s in ((1, 2, 3, 4) if damaged else (1, 2, 4))]
    mgr.save(5, _tiny(5))
    assert _dirs(tmp_path) == [step_dirname(s) for s in (1, 2, 4, 5)]
    _, warned = _caught(mgr.latest)
    assert warned == []


def test_a_damaged_step_can_be_saved_again(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    mgr.save(2, _tiny(2))
    _truncated_footer_of = _state_file(tmp_path, 2)
    os.truncate(_truncated_footer_of, 100)
    with pytest.warns(CheckpointWarning):
        assert mgr.latest().step == 1
    mgr.save(2, _tiny(22))
    assert mgr.load()["n"] == 22


def test_an_older_incomplete_step_is_removed_too(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for s in (1, 2, 3):
        mgr.save(s, _tiny(s))
    os.unlink(os.path.join(_step(tmp_path, 1), "COMMIT"))
    with pytest.warns(CheckpointWarning, match="step-000000001"):
        assert mgr.latest().step == 3
    mgr.save(4, _tiny(4))
    assert _dirs(tmp_path) == [step_dirname(s) for s in (2, 3, 4)]


def test_every_flipped_byte_of_a_commit_record_makes_the_step_incomplete(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    step = _step(tmp_path, 1)
    commit = os.path.join(step, "COMMIT")
    good = open(commit, "rb").read()
    undetected = []
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        with open(commit, "wb") as fh:
            fh.write(bad)
        try:
            multifile.check_complete(step)
            undetected.append(i)
        except CheckpointError as e:
            assert "\n" not in str(e)
    assert undetected == []
    # through the manager: skipped, never raised
    with open(commit, "wb") as fh:
        fh.write(bytes(good[:-1]) + bytes([good[-1] ^ 1]))
    latest, warned = _caught(mgr.latest)
    assert latest is None and len(warned) == 1 and step in warned[0]


def test_foreign_names_in_the_run_directory_are_ignored_not_deleted(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(2, _tiny(2))
    # a complete checkpoint under a name that is not canonical does not count
    shutil.copytree(_step(tmp_path, 2), tmp_path / "step-1")
    shutil.copytree(_step(tmp_path, 2), tmp_path / "step-0000000009")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "step-000000005").write_text("a file, not a directory")
    (tmp_path / ".hidden").mkdir()
    latest, warned = _caught(mgr.latest)
    assert latest.step == 2
    assert [c.step for c in mgr.checkpoints()] == [2]
    for name in ("step-1", "step-0000000009", "step-000000005"):
        assert any(os.path.join(str(tmp_path), name) in w for w in warned), (name, warned)
    assert not any("notes.txt" in w or ".hidden" in w for w in warned), warned
    mgr.save(3, _tiny(3))
    mgr.save(6, _tiny(6))
    assert _dirs(tmp_path) == sorted(
        [".hidden", "notes.txt", "step-0000000009", "step-000000005", "step-1"]
        + [step_dirname(s) for s in (2, 3, 6)]
    )


def test_a_symlinked_step_directory_is_never_deleted_through(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not a checkpoint")
    mgr = CheckpointManager(run)
    os.symlink(outside, run / step_dirname(1))
    mgr.save(2, _tiny(2))
    mgr.save(3, _tiny(3))
    assert (outside / "precious.txt").read_text() == "not a checkpoint"
    # and one that links to a real checkpoint is not rotated away through the link either
    shutil.copytree(_step(run, 2), outside / "copy")
    os.symlink(outside / "copy", run / step_dirname(4))
    keep = CheckpointManager(run, keep_last=1)
    keep.save(5, _tiny(5))
    keep.save(6, _tiny(6))
    assert sorted(os.listdir(outside / "copy")) == [".ckptfmt-folder", "COMMIT", "state.ckpt"]


LOCKER = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()
    """
)


def _lock_in_other_process(path):
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _release(proc):
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()


def test_a_step_directory_locked_by_a_live_process_is_never_removed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    mgr.save(2, _tiny(2))
    # an older and a newer step that another process is (still) writing
    for s in (0, 3):
        os.mkdir(_step(tmp_path, s))
        (tmp_path / step_dirname(s) / "state.ckpt").write_bytes(b"partial")
        (tmp_path / step_dirname(s) / ".ckptfmt-folder").write_bytes(
            b'{"writer": "ckptfmt"}\n'
        )  # made by ckptfmt
    older, newer = _lock_in_other_process(_step(tmp_path, 0)), _lock_in_other_process(_step(tmp_path, 3))
    try:
        assert locks.is_locked(_step(tmp_path, 3)) is True
        mgr.save(4, _tiny(4))
        assert os.path.isdir(_step(tmp_path, 0)) and os.path.isdir(_step(tmp_path, 3))
        assert (tmp_path / step_dirname(3) / "state.ckpt").read_bytes() == b"partial"
        # a save of that very step refuses rather than deleting the other writer's files
        mgr.remove(4)
        with pytest.raises(CheckpointError, match="being written by another process"):
            mgr.save(3, _tiny(3))
        assert (tmp_path / step_dirname(3) / "state.ckpt").read_bytes() == b"partial"
    finally:
        _release(older)
        _release(newer)
    assert locks.is_locked(_step(tmp_path, 3)) is False
    mgr.save(5, _tiny(5))  # the writers died without committing: now it goes
    assert _dirs(tmp_path) == [step_dirname(s) for s in (1, 2, 5)]


def test_a_step_directory_stays_locked_when_its_lock_was_probed_at_creation(tmp_path, monkeypatch):
    """Another process's cleanup probes a new directory's lock (is_locked takes it for an
    instant): the save must still end up holding its lock, not go on unlocked."""
    real = locks.try_lock
    probed = []

    def busy_once(fd):
        if not probed:
            probed.append(fd)
            return False  # as if the probe held it right now
        return real(fd)

    monkeypatch.setattr(locks, "try_lock", busy_once)
    gate = threading.Event()
    real_commit = multifile.write_commit

    def held(directory, record, within=None):
        assert gate.wait(20)
        real_commit(directory, record, within)

    monkeypatch.setattr(multifile, "write_commit", held)
    mgr = CheckpointManager(tmp_path, blocking=False)
    h = mgr.save(1, _tiny(1))
    try:
        assert probed
        monkeypatch.setattr(locks, "try_lock", real)
        assert locks.is_locked(_step(tmp_path, 1)) is True
    finally:
        gate.set()
        h.wait()
    assert mgr.latest().step == 1


def test_leftover_temporary_step_directories(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    dead = tmp_path / ".step-000000002.ckptfmt-tmp.99999.0badcafe"
    live = tmp_path / ".step-000000003.ckptfmt-tmp.99998.0badbeef"
    dead.mkdir()
    live.mkdir()
    proc = _lock_in_other_process(live)
    try:
        _, warned = _caught(mgr.latest)
        assert warned == []
        mgr.save(4, _tiny(4))
        assert not dead.exists()
        assert live.exists()
    finally:
        _release(proc)


def test_a_concurrent_save_of_another_manager_in_this_process_is_not_disturbed(tmp_path, monkeypatch):
    a, b = CheckpointManager(tmp_path, blocking=False), CheckpointManager(tmp_path)
    a.save(1, _tiny(1))
    a.wait()
    gate = threading.Event()
    real = multifile.write_commit

    def held(directory, record, within=None):
        if record.step == 2:
            assert gate.wait(20)
        real(directory, record, within)

    monkeypatch.setattr(multifile, "write_commit", held)
    h = a.save(2, _tiny(2))
    b.save(3, _tiny(3))  # b's cleanup sees step 2 without a commit record, but locked
    assert os.path.isdir(_step(tmp_path, 2))
    gate.set()
    h.wait()
    assert [c.step for c in b.checkpoints()] == [1, 2, 3]


# -- corrupt files: load, fallback, verify ---------------------------------------------------


def test_load_of_a_corrupt_step_names_the_file_key_and_chunk(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.arange(6.0), "b": torch.ones(2)})
    path = _state_file(tmp_path, 1)
    _flip_tensor(path, "'w'")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert mgr.latest().step == 1  # sizes and footer still match: found on reading
    with pytest.raises(CorruptError) as e:
        mgr.load()
    assert e.value.path == path and "'w'" in e.value.key and e.value.chunk is not None
    assert path in str(e.value) and "'w'" in str(e.value) and f"chunk {e.value.chunk}" in str(e.value)
    with pytest.raises(CorruptError, match="'w'"):
        mgr.load_into({"w": torch.zeros(6), "b": torch.zeros(2)}, restore_rng=False)
    report = mgr.verify(1)
    assert not report.ok
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert problem.kind == "corrupt" and "state.ckpt" in problem.message and "'w'" in problem.key
    assert problem.chunk is not None


def test_verify_covers_every_file_of_the_step(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    mgr.save(2, _tiny(2))
    report = mgr.verify()
    assert report.ok and report.path == _step(tmp_path, 2)
    assert report.bytes_checked == mgr.latest().size
    assert mgr.verify(1).ok
    with pytest.raises(CheckpointError, match="no checkpoint of step 3"):
        mgr.verify(3)


def test_fallback_loads_the_newest_step_that_verifies_and_says_what_it_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.full((4,), float(s))})
    _flip_tensor(_state_file(tmp_path, 3), "'w'")
    _flip_tensor(_state_file(tmp_path, 2), "'w'")
    with pytest.raises(CorruptError):
        mgr.load()
    got, warned = _caught(lambda: mgr.load(fallback=True))
    assert torch.equal(got["w"], torch.full((4,), 1.0))
    assert len(warned) == 2 and "step 3" in warned[0] and "step 2" in warned[1]
    assert "state.ckpt" in warned[0]
    target = {"w": torch.zeros(4)}
    report, warned = _caught(lambda: mgr.load_into(target, fallback=True, restore_rng=False))
    assert report.step == 1 and torch.equal(target["w"], torch.full((4,), 1.0))
    assert len(report.skipped) == 2 and report.skipped[0].startswith("step 3")
    # a step asked for by number never falls back
    with pytest.raises(CorruptError):
        mgr.load(step=3, fallback=True)
    _flip_tensor(_state_file(tmp_path, 1), "'w'")
    with pytest.raises(CheckpointError, match="no checkpoint .* loads"):
        _caught(lambda: mgr.load(fallback=True))


# -- resume: load_into and its consistency checks ----------------------------------------------


def test_load_into_restores_everything_and_reports_no_difference(tmp_path):
    state = _training_state(seed=0)
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, state, metrics={"loss": 1.0})
    saved = _params(state["model"])
    saved_opt = state["opt"].state_dict()
    expected_draws = torch.rand(4)
    fresh = _training_state(seed=1)
    fresh["data"] = {"epoch": 0, "batch": 0}
    torch.rand(100)
    report, warned = _caught(lambda: mgr.load_into(fresh))
    assert isinstance(report, ckptfmt.ResumeReport)
    assert report.step == 10 and report.path == _step(tmp_path, 10)
    assert report.differences == [] and warned == []
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert report.rng_restored and torch.equal(torch.rand(4), expected_draws)
    assert _same_params(fresh["model"], saved)
    assert fresh["data"] == {"epoch": 1, "batch": 7}
    buf = fresh["opt"].state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, saved_opt["state"][0]["momentum_buffer"])


def test_the_state_file_carries_the_resume_fingerprint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, _training_state())
    payload = ckptfmt.load(_state_file(tmp_path, 4))
    assert set(payload) == {"state", "rng", "resume"}
    fp = payload["resume"]
    assert fp["step"] == 4
    assert fp["architecture"]["model"]["0.weight"] == [[3, 4], "float32"]
    assert fp["optimizer"]["opt"][0]["lr"] == 0.1 and fp["optimizer"]["opt"][0]["momentum"] == 0.9
    assert fp["data"] == ["data"]
    env = fp["environment"]
    assert set(env) >= {"ckptfmt", "torch", "python", "cuda", "devices", "world_size"}
    assert env == resume.environment()
    assert env["ckptfmt"] == ckptfmt.__version__ and env["world_size"] == 1 and "cpu" in env["devices"]


@pytest.mark.parametrize("strict", [True, False])
def test_a_shape_difference_raises_before_any_tensor_changes(tmp_path, strict):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _training_state(out=2))
    target = _training_state(seed=5, out=3)
    target["data"] = {"epoch": 0}
    before = _params(target["model"])
    with pytest.raises(MismatchError, match=r"model\.2\.weight.*shape") as e:
        mgr.load_into(target, strict=strict)
    assert "\n" not in str(e.value)
    assert _same_params(target["model"], before)
    assert target["data"] == {"epoch": 0}


def test_a_dtype_difference_raises(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _training_state())
    target = _training_state(seed=5)
    target["model"].double()
    before = _params(target["model"])
    with pytest.raises(MismatchError, match="dtype"):
        mgr.load_into(target)
    assert _same_params(target["model"], before)


def test_parameter_name_differences(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(4, 3)})
    target = {"model": torch.nn.Linear(4, 3, bias=False)}
    before = _params(target["model"])
    with pytest.raises(MismatchError, match="checkpoint parameters the model lacks: bias"):
        mgr.load_into(target)
    assert _same_params(target["model"], before)
    # not strict: what fits is loaded, the difference is reported and warned about once
    report, warned = _caught(lambda: mgr.load_into(target, strict=False))
    assert any("bias" in d for d in report.differences)
    assert report.unexpected_keys == ["model.bias"]
    assert len(warned) == 1 and "bias" in warned[0]
    assert torch.equal(target["model"].weight, mgr.load()["model"]["weight"])


def test_a_mismatch_names_the_first_few(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(5)])})
    target = {"model": torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(5)])}
    with pytest.raises(MismatchError) as e:
        mgr.load_into(target)
    msg = str(e.value)
    assert "0.weight" in msg and "more)" in msg and "4.bias" not in msg


def test_a_plain_tensor_shape_difference_raises_before_the_model_is_filled(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(3, 2), "ema": torch.zeros(3)})
    target = {"model": torch.nn.Linear(3, 2), "ema": torch.zeros(4)}
    before = _params(target["model"])
    with pytest.raises(MismatchError, match="ema"):
        mgr.load_into(target, restore_rng=False)
    assert _same_params(target["model"], before), "the model was filled before the mismatch was found"
    assert torch.equal(target["ema"], torch.zeros(4))


def test_key_differences_raise_when_strict_before_anything_changes(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(3, 2), "step": 1})
    target = {"model": torch.nn.Linear(3, 2), "step": 0, "ema": torch.zeros(2)}
    before = _params(target["model"])
    with pytest.raises(MismatchError, match="ema"):
        mgr.load_into(target, restore_rng=False)
    assert _same_params(target["model"], before) and target["step"] == 0
    report = mgr.load_into(target, strict=False, restore_rng=False)
    assert report.missing_keys == ["ema"] and target["step"] == 1
    assert not _same_params(target["model"], before)


def test_an_optimizer_with_other_groups_raises_before_the_model_is_filled(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _training_state())
    target = _training_state(seed=3)
    model = target["model"]
    target["opt"] = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}], lr=0.1
    )
    before = _params(model)
    with pytest.raises(MismatchError, match="opt"):
        mgr.load_into(target, restore_rng=False)
    assert _same_params(model, before)


def test_optimizer_hyper_parameter_differences_are_reported_once(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _training_state(lr=0.1))
    target = _training_state(seed=2, lr=0.05)
    target["opt"].param_groups[0]["momentum"] = 0.5
    report, warned = _caught(lambda: mgr.load_into(target))
    lr = [d for d in report.differences if "opt.param_groups[0].lr" in d]
    mom = [d for d in report.differences if "opt.param_groups[0].momentum" in d]
    assert lr and "0.1" in lr[0] and "0.05" in lr[0]
    assert mom
    assert len(warned) == 1 and "2 difference(s)" in warned[0]
    assert target["opt"].param_groups[0]["lr"] == 0.1, "the checkpoint's value is used"


def test_a_scheduler_owned_learning_rate_is_not_a_difference(tmp_path):
    state = _training_state()
    state["sched"] = torch.optim.lr_scheduler.StepLR(state["opt"], step_size=1, gamma=0.5)
    state["opt"].step()
    state["sched"].step()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    target = _training_state(seed=4)
    target["sched"] = torch.optim.lr_scheduler.StepLR(target["opt"], step_size=1, gamma=0.5)
    report = mgr.load_into(target)
    assert report.differences == []
    assert target["opt"].param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_missing_data_position_is_reported(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    report, warned = _caught(lambda: mgr.load_into({"model": torch.nn.Linear(2, 2)}))
    assert any("no data position" in d for d in report.differences)
    assert len(warned) == 1


def test_a_stateful_sampler_counts_as_a_data_position(tmp_path):
    class ResumableSampler:
        def __init__(self):
            self.pos = 0

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, sd):
            self.pos = sd["pos"]

    sampler = ResumableSampler()
    sampler.pos = 42
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": torch.nn.Linear(2, 2), "train": sampler})
    target = {"model": torch.nn.Linear(2, 2), "train": ResumableSampler()}
    report = mgr.load_into(target)
    assert report.differences == [] and target["train"].pos == 42


def test_missing_rng_state_is_reported(tmp_path, monkeypatch):
    import ckptfmt.runs.rng

    monkeypatch.setattr(ckptfmt.runs.rng, "capture_rng", lambda: None)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.zeros(2), "data": {"batch": 3}})
    report, warned = _caught(lambda: mgr.load_into({"w": torch.ones(2), "data": {"batch": 0}}))
    assert any("no RNG state" in d for d in report.differences)
    assert not report.rng_restored and len(warned) == 1


def test_environment_differences_are_reported(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.zeros(2), "data": {"batch": 3}})
    now = dict(resume.environment(), torch="9.9.9", world_size=8)
    monkeypatch.setattr(resume, "environment", lambda: now)
    report, warned = _caught(lambda: mgr.load_into({"w": torch.ones(2), "data": {"batch": 0}}))
    env = [d for d in report.differences if d.startswith("environment")]
    assert len(env) == 2
    assert any("torch" in d and "9.9.9" in d and torch.__version__ in d for d in env)
    assert any("world_size" in d and "8" in d for d in env)
    assert len(warned) == 1


# -- non-blocking saves ----------------------------------------------------------------------------


def test_non_blocking_save_holds_the_values_at_call_time(tmp_path):
    mgr = CheckpointManager(tmp_path, blocking=False)
    w = torch.arange(200_000, dtype=torch.float32)
    expected = w.clone()
    h = mgr.save(1, {"w": w})
    assert isinstance(h, ckptfmt.SaveHandle)
    w.mul_(-1)  # training goes on
    w[:10] = 7
    h.wait()
    assert h.done()
    mgr.wait()
    assert torch.equal(mgr.load()["w"], expected)
    assert mgr.verify().ok


def test_non_blocking_save_of_a_model_and_optimizer_holds_their_values_at_call_time(tmp_path):
    state = _training_state()
    expected = _params(state["model"])
    expected_buf = state["opt"].state_dict()["state"][0]["momentum_buffer"].clone()
    mgr = CheckpointManager(tmp_path, blocking=False)
    h = mgr.save(1, state)
    for _ in range(3):  # training goes on while the file is written
        state["model"](torch.randn(5, 4)).sum().backward()
        state["opt"].step()
    h.wait()
    got = mgr.load()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    assert torch.equal(got["opt"]["state"][0]["momentum_buffer"], expected_buf)
    assert not _same_params(state["model"], expected)


def _delay_first_file(monkeypatch, delay_step, seconds):
    """Make the state file of `delay_step` look slow to finish, and record each commit."""
    commits = []
    real_write = CheckpointManager._write_state
    real_commit = multifile.write_commit

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def wait(self, timeout=None):
            time.sleep(seconds)
            return self.inner.wait(timeout)

        def done(self):
            return False

        def exception(self, timeout=None):
            return self.inner.exception(timeout)

    def write_state(self, job, payload):
        handle = real_write(self, job, payload)
        return Slow(handle) if job.step == delay_step else handle

    def commit(directory, record, within=None):
        part = os.path.join(directory, "state.ckpt")
        # every file the record names is in place, whole, before the record is written
        assert multifile.describe_part(part, "state.ckpt") == record.files[0]
        commits.append((record.step, sorted(os.listdir(os.path.dirname(directory)))))
        real_commit(directory, record, within)

    monkeypatch.setattr(CheckpointManager, "_write_state", write_state)
    monkeypatch.setattr(multifile, "write_commit", commit)
    return commits


def test_saves_in_flight_commit_in_step_order(tmp_path, monkeypatch):
    commits = _delay_first_file(monkeypatch, 1, 0.5)
    mgr = CheckpointManager(tmp_path, blocking=False, keep_last=1)
    t0 = time.monotonic()
    handles = [mgr.save(s, _tiny(s)) for s in (1, 2, 3)]
    assert time.monotonic() - t0 < 0.5, "save() waited for the commit"
    assert not handles[0].done()
    # while they are in flight, latest() sees none of them and warns about none of them
    latest, warned = _caught(mgr.latest)
    assert latest is None and warned == []
    mgr.wait()
    assert all(h.done() for h in handles)
    assert [s for s, _ in commits] == [1, 2, 3]
    # rotation (keep_last=1) runs after each commit: the older step is still there when the next commits
    assert step_dirname(1) in commits[1][1] and step_dirname(2) in commits[2][1]
    assert _dirs(tmp_path) == [step_dirname(3)]
    assert mgr.load()["n"] == 3


def test_a_step_while_saves_are_in_flight_must_still_be_new(tmp_path, monkeypatch):
    _delay_first_file(monkeypatch, 1, 0.3)
    mgr = CheckpointManager(tmp_path, blocking=False)
    mgr.save(1, _tiny(1))
    with pytest.raises(ValueError, match="not after"):
        mgr.save(1, _tiny(1))
    mgr.wait()


def _failing_file(monkeypatch, fail_step):
    real_write = CheckpointManager._write_state

    class Failed:
        def __init__(self, inner):
            self.inner = inner

        def wait(self, timeout=None):
            self.inner.wait(timeout)
            raise OSError(errno.ENOSPC, "No space left on device")

        def done(self):
            return self.inner.done()

        def exception(self, timeout=None):
            return OSError(errno.ENOSPC, "No space left on device")

    failures = [fail_step]  # once

    def write_state(self, job, payload):
        handle = real_write(self, job, payload)
        if job.step not in failures:
            return handle
        failures.clear()
        if handle is None:  # a blocking save: its error comes from the write itself
            raise OSError(errno.ENOSPC, "No space left on device")
        return Failed(handle)

    monkeypatch.setattr(CheckpointManager, "_write_state", write_state)


def test_a_background_error_surfaces_from_wait_once(tmp_path, monkeypatch):
    _failing_file(monkeypatch, 2)
    mgr = CheckpointManager(tmp_path, blocking=False)
    mgr.save(1, _tiny(1))
    h = mgr.save(2, _tiny(2))
    with pytest.raises(CheckpointError, match="step 2 failed.*No space") as e:
        mgr.wait()
    assert isinstance(e.value.__cause__, OSError)
    mgr.wait()  # reported once
    assert h.done()
    assert _dirs(tmp_path) == [step_dirname(1)], "the failed step's files are removed"
    mgr.save(3, _tiny(3)).wait()
    assert [c.step for c in mgr.checkpoints()] == [1, 3]


def test_a_background_error_surfaces_from_the_next_save(tmp_path, monkeypatch):
    _failing_file(monkeypatch, 1)
    mgr = CheckpointManager(tmp_path, blocking=False)
    h = mgr.save(1, _tiny(1))
    while not h.done():  # (h.exception() or h.wait() would be seeing the error)
        time.sleep(0.005)
    with pytest.raises(CheckpointError, match="earlier save of step 1 failed"):
        mgr.save(2, _tiny(2))
    assert os.listdir(tmp_path) == []
    mgr.save(2, _tiny(2))
    mgr.wait()
    assert mgr.latest().step == 2


def test_an_error_seen_through_the_handle_is_not_raised_again(tmp_path, monkeypatch):
    _failing_file(monkeypatch, 1)
    mgr = CheckpointManager(tmp_path, blocking=False)
    h = mgr.save(1, _tiny(1))
    with pytest.raises(OSError, match="No space"):
        h.wait()
    mgr.wait()
    mgr.save(2, _tiny(2))
    mgr.wait()


def test_a_blocking_save_raises_its_own_error(tmp_path, monkeypatch):
    _failing_file(monkeypatch, 2)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _tiny(1))
    with pytest.raises(OSError, match="No space"):
        mgr.save(2, _tiny(2))
    assert _dirs(tmp_path) == [step_dirname(1)]
    mgr.wait()
    mgr.save(2, _tiny(2))


FSIZE_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys, threading, time
    import torch
    from ckptfmt import CheckpointManager, CheckpointError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    run = sys.argv[1]
    out = {}
    small = {"w": torch.zeros(4)}
    big = {"w": torch.zeros(1 << 20)}
    mgr = CheckpointManager(run, blocking=False)
    mgr.save(1, small).wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    h = mgr.save(2, big)
    try:
        mgr.wait()
        out["wait"] = None
    except CheckpointError as e:
        out["wait"] = [type(e.__cause__).__name__, getattr(e.__cause__, "errno", None), str(e)]
    h = mgr.save(3, big)
    while not h.done():
        time.sleep(0.005)
    try:
        mgr.save(4, small)
        out["next"] = None
    except CheckpointError as e:
        out["next"] = str(e)
    blocking = CheckpointManager(run)
    try:
        blocking.save(5, big)
        out["blocking"] = None
    except Exception as e:
        out["blocking"] = [type(e).__name__, getattr(e, "errno", None)]
    mgr.wait()
    out["threads"] = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    out["dirs"] = sorted(os.listdir(run))
    out["latest"] = mgr.latest().step
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("backend", ["c", "python"])
def test_write_errors_from_a_file_size_limit(tmp_path, backend):
    if backend == "c" and ckptfmt.backend() != "c":
        pytest.skip("the C engine is not built")
    env = dict(os.environ, PYTHONPATH=ROOT, CKPTFMT_BACKEND=backend)
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["wait"] is not None and out["wait"][1] == errno.EFBIG and "step 2" in out["wait"][2]
    assert out["next"] is not None and "step 3" in out["next"]
    assert out["blocking"] is not None and out["blocking"][1] == errno.EFBIG
    assert out["threads"] == []
    assert out["dirs"] == [step_dirname(1)] and out["latest"] == 1


def test_no_commit_thread_outlives_wait(tmp_path):
    mgr = CheckpointManager(tmp_path, blocking=False, keep_last=2)
    for s in range(1, 6):
        mgr.save(s, _tiny(s))
    mgr.wait()
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptfmt")]
    assert _dirs(tmp_path) == [step_dirname(4), step_dirname(5)]


@given(st.lists(st.booleans(), min_size=1, max_size=6))
@settings(max_examples=15, deadline=None)
def test_interleaved_waits_keep_every_step_in_order(waits):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d, blocking=False)
        for s, wait in enumerate(waits, 1):
            h = mgr.save(s, _tiny(s))
            if wait:
                h.wait()
        mgr.wait()
        assert [c.step for c in mgr.checkpoints()] == list(range(1, len(waits) + 1))
        assert all(mgr.load(step=s)["n"] == s for s in range(1, len(waits) + 1))


# -- incremental runs --------------------------------------------------------------------------


def test_incremental_runs_keep_the_files_later_steps_refer_to(tmp_path):
    mgr = CheckpointManager(tmp_path, incremental=True, keep_last=1)
    frozen = torch.randn(1000)
    for s in (1, 2, 3):
        mgr.save(s, {"frozen": frozen, "w": torch.full((3,), float(s))})
    got = mgr.load()
    assert torch.equal(got["frozen"], frozen) and got["w"][0] == 3
    assert mgr.verify().ok
    assert [c.step for c in mgr.checkpoints()] == [3]


def _frozen_run(tmp_path, **kw):
    """Steps 1..3 of a run whose 'frozen' tensor never changes (about 1 MiB, several chunks)."""
    mgr = CheckpointManager(tmp_path / "run", incremental=True, keep_last=1, **kw)
    frozen = torch.randn(256 * 1024)
    for s in (1, 2, 3):
        h = mgr.save(s, {"frozen": frozen, "w": torch.full((1000,), float(s))})
        if h is not None:
            h.wait()
    return mgr, frozen


@pytest.mark.parametrize("blocking", [True, False])
def test_rotation_keeps_only_the_referenced_files(tmp_path, blocking):
    mgr, frozen = _frozen_run(tmp_path, blocking=blocking)
    run = tmp_path / "run"
    # step 1 holds the frozen bytes that step 3 refers to: its commit record is gone, its file
    # stays; step 2 held nothing step 3 needs and is gone entirely
    assert sorted(os.listdir(run)) == ["step-000000001", "step-000000003"]
    assert sorted(os.listdir(run / "step-000000001")) == [".ckptfmt-folder", "state.ckpt"]
    info = mgr.latest()
    assert info.step == 3 and info.references == (str(run / "step-000000001" / "state.ckpt"),)
    assert info.size < frozen.nbytes // 4  # step 3 did not write the frozen tensor again
    statuses = {s.step: s for s in mgr.statuses()}
    assert statuses[1].retained and statuses[1].info is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a retained directory is not worth a warning
        assert mgr.latest().step == 3
    assert torch.equal(mgr.load()["frozen"], frozen)
    # once nothing refers to step 1 any more, the next save removes it
    mgr.save(4, {"frozen": frozen + 1, "w": torch.zeros(1000)})
    mgr.wait()
    mgr.save(5, {"frozen": frozen + 1, "w": torch.ones(1000)})
    mgr.wait()
    assert sorted(os.listdir(run)) == ["step-000000004", "step-000000005"]
    assert torch.equal(mgr.load()["frozen"], frozen + 1)


def test_damaged_referenced_file_fails_verify_and_load_naming_both_files(tmp_path):
    mgr, _ = _frozen_run(tmp_path)
    held = tmp_path / "run" / "step-000000001" / "state.ckpt"
    with ckptfmt.open(held) as r:
        offset = r._file.chunks[0].offset
    data = bytearray(held.read_bytes())
    data[offset + 100] ^= 0x01
    held.write_bytes(bytes(data))
    report = mgr.verify()
    assert not report.ok
    text = str(report.problems[0])
    assert "state.ckpt" in text and "step-000000001" in text, text
    with pytest.raises(ckptfmt.CorruptError) as e:
        mgr.load()
    assert "step-000000003" in str(e.value) and "step-000000001" in str(e.value)


def test_a_frozen_tensor_changed_through_data_is_saved(tmp_path):
    mgr = CheckpointManager(tmp_path, incremental=True)
    model = torch.nn.Linear(256, 256)
    model.weight.requires_grad_(False)
    mgr.save(1, {"model": model})
    model.weight.data[7, 7] += 1.0  # bypasses autograd and the version counter of the Parameter
    mgr.save(2, {"model": model})
    assert torch.equal(mgr.load(step=2)["model"]["weight"], model.weight)
    assert not torch.equal(mgr.load(step=1)["model"]["weight"], model.weight)


def test_an_incremental_checkpoint_consolidates_into_one_file(tmp_path):
    mgr, frozen = _frozen_run(tmp_path)
    out = tmp_path / "alone.ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt", "consolidate", mgr.latest().state_path, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(tmp_path / "run")
    alone = ckptfmt.load(out)
    assert torch.equal(alone["state"]["frozen"], frozen) and alone["state"]["w"][0] == 3
    assert ckptfmt.verify(out).ok


# -- multifile: the commit record ----------------------------------------------------------------


@pytest.fixture
def part_dir(tmp_path):
    d = tmp_path / "step"
    d.mkdir()
    ckptfmt.save({"x": torch.arange(4)}, d / "state.ckpt")
    return d


def _record_value(part_dir, **changes):
    rec = multifile.describe_part(str(part_dir / "state.ckpt"), "state.ckpt")
    value = multifile.CommitRecord(7, "state", (rec,), metrics={"loss": 1.5}, metadata={"a": "b"}).as_value()
    value.update(changes)
    return value


def _write_raw(part_dir, value):
    ckptfmt.save(value, part_dir / "COMMIT")


def _one_line(e, d):
    msg = str(e)
    assert "\n" not in msg and str(d) in msg
    return msg


def test_a_valid_commit_record_round_trips(part_dir):
    rec = multifile.describe_part(str(part_dir / "state.ckpt"), "state.ckpt")
    assert rec.length == os.path.getsize(part_dir / "state.ckpt") and len(rec.file_id) == 16
    multifile.write_commit(str(part_dir), multifile.CommitRecord(7, "state", (rec,), metrics={"m": 2}))
    got = multifile.check_complete(str(part_dir))
    assert got.step == 7 and got.files == (rec,) and got.metrics == {"m": 2} and got.created.endswith("Z")
    assert not [n for n in os.listdir(part_dir) if n not in ("COMMIT", "state.ckpt")], "no temporaries left"


def test_a_commit_record_naming_a_missing_part(part_dir):
    value = _record_value(part_dir)
    value["files"][0]["name"] = "rank1.ckpt"
    _write_raw(part_dir, value)
    with pytest.raises(IncompleteError, match="rank1.ckpt named by the commit record is missing") as e:
        multifile.check_complete(str(part_dir))
    _one_line(e.value, part_dir)


def test_a_part_that_is_another_file(part_dir):
    _write_raw(part_dir, _record_value(part_dir))
    ckptfmt.save({"x": torch.arange(4)}, part_dir / "state.ckpt")  # same bytes, new file id
    with pytest.raises(CorruptError, match="not the file the commit record names") as e:
        multifile.check_complete(str(part_dir))
    _one_line(e.value, part_dir)
    ckptfmt.save({"x": torch.arange(40)}, part_dir / "state.ckpt")
    with pytest.raises(CorruptError, match="bytes, the commit record says") as e:
        multifile.check_complete(str(part_dir))


def test_a_part_that_is_not_a_ckptfmt_file_or_not_a_regular_file(part_dir):
    _write_raw(part_dir, _record_value(part_dir))
    part = part_dir / "state.ckpt"
    part.unlink()
    part.write_bytes(b"\0" * 4096)
    with pytest.raises(CorruptError, match="state.ckpt is damaged"):
        multifile.check_complete(str(part_dir))
    part.unlink()
    os.mkfifo(part)
    with pytest.raises(CheckpointError, match="state.ckpt"):
        multifile.check_complete(str(part_dir))
    part.unlink()
    os.symlink("/dev/zero", part)
    with pytest.raises(CheckpointError, match="state.ckpt"):
        multifile.check_complete(str(part_dir))


BAD_NAMES = ["/etc/passwd", "../x", "..", ".", ".hidden", "a/b", "", "x" * 129, "a\0b", "a b", "é"]
BAD_REFERENCES = ["../../a/b", "../.a/b", "../a/.b", "/abs/x/y", "../a/b/c", "./a/b", "../a/", "..//b"]


@pytest.mark.parametrize("name", BAD_NAMES + ["../step-000000001/state.ckpt", "COMMIT"])
def test_part_names_that_are_not_allowed(part_dir, name):
    value = _record_value(part_dir)
    value["files"][0]["name"] = name
    _write_raw(part_dir, value)
    with pytest.raises(CorruptError, match="commit record") as e:
        multifile.check_complete(str(part_dir))
    _one_line(e.value, part_dir)
    if name != "COMMIT":  # a well-formed name, but a record may not name itself
        assert not multifile.valid_part_name(name, reference=False)


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n not in ("../x", "a/b")] + BAD_REFERENCES)
def test_reference_names_that_are_not_allowed(part_dir, name):
    value = _record_value(part_dir)
    value["references"] = [dict(value["files"][0], name=name)]
    _write_raw(part_dir, value)
    with pytest.raises(CorruptError, match=r"references\[0\]\.name") as e:
        multifile.check_complete(str(part_dir))
    _one_line(e.value, part_dir)


def test_allowed_names():
    assert multifile.valid_part_name("state.ckpt", reference=False)
    assert multifile.valid_part_name("rank_00-1.ckpt", reference=False)
    assert multifile.valid_part_name("../step-000000001/state.ckpt", reference=True)
    # the reference paths of spec section 12: NAME, DIR/NAME, ../NAME, ../DIR/NAME
    for ref in ("base.ckpt", "sub/base.ckpt", "../base.ckpt"):
        assert multifile.valid_part_name(ref, reference=True)
        assert not multifile.valid_part_name(ref, reference=False) or "/" not in ref
    assert not multifile.valid_part_name("../step-000000001/state.ckpt", reference=False)


@pytest.mark.parametrize(
    "mangle, error, words",
    [
        (lambda v: [v], CorruptError, "the record must be dict"),
        (lambda v: "COMMIT", CorruptError, "must be dict"),
        (lambda v: dict(v, extra=1), CorruptError, "fields must be exactly"),
        (lambda v: {k: x for k, x in v.items() if k != "metrics"}, CorruptError, "fields must be exactly"),
        (lambda v: dict(v, ckptfmt_commit=2), UnsupportedError, "version 2"),
        (lambda v: dict(v, ckptfmt_commit="1"), CorruptError, "ckptfmt_commit must be int"),
        (lambda v: dict(v, layout="sharded"), UnsupportedError, "layout 'sharded'"),
        (lambda v: dict(v, step=-1), CorruptError, "step"),
        (lambda v: dict(v, step=True), CorruptError, "step"),
        (lambda v: dict(v, files=[]), CorruptError, "names 0 files"),
        (lambda v: dict(v, files=v["files"] * 2), CorruptError, "named twice"),
        (lambda v: dict(v, files=[dict(v["files"][0], file_id=b"x" * 15)]), CorruptError, "file id"),
        (lambda v: dict(v, files=[dict(v["files"][0], length=3)]), CorruptError, "impossible length"),
        (lambda v: dict(v, files=[dict(v["files"][0], index_checksum=-1)]), CorruptError, "index_checksum"),
        (lambda v: dict(v, files=[dict(v["files"][0], extra=0)]), CorruptError, "exactly name"),
        (lambda v: dict(v, metrics={"loss": "low"}), CorruptError, "metrics"),
        (lambda v: dict(v, metadata={"a": 1}), CorruptError, "metadata"),
        (lambda v: dict(v, created=5), CorruptError, "created must be str"),
    ],
)
def test_malformed_commit_records(part_dir, mangle, error, words):
    _write_raw(part_dir, mangle(_record_value(part_dir)))
    with pytest.raises(error) as e:
        multifile.check_complete(str(part_dir))
    assert words in _one_line(e.value, part_dir)


def test_a_commit_record_that_is_not_a_regular_ckptfmt_file(part_dir):
    commit = part_dir / "COMMIT"
    commit.write_bytes(b"just text\n" * 10)
    with pytest.raises(CheckpointError) as e:
        multifile.check_complete(str(part_dir))
    _one_line(e.value, part_dir)
    commit.unlink()
    commit.mkdir()
    with pytest.raises(UnsupportedError, match="not a regular file"):
        multifile.check_complete(str(part_dir))
    commit.rmdir()
    os.mkfifo(commit)
    with pytest.raises(UnsupportedError, match="not a regular file"):  # and does not block
        multifile.check_complete(str(part_dir))
    commit.unlink()
    _write_raw(part_dir, _record_value(part_dir))
    os.rename(commit, part_dir / "real")
    os.symlink("real", commit)
    with pytest.raises(CheckpointError, match="COMMIT"):
        multifile.check_complete(str(part_dir))
    commit.unlink()
    with pytest.raises(IncompleteError, match="no commit record"):
        multifile.check_complete(str(part_dir))


def test_load_into_leaves_every_object_untouched_when_a_later_part_is_damaged(tmp_path):
    """The model comes first in the state; damage in the optimizer's chunks must not leave
    the model filled from the checkpoint and the optimizer not."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"model": model, "optimizer": opt})
    state_file = mgr.latest().state_path
    with ckptfmt.open(state_file) as r:
        f = r._file
        opt_storages = [rec for rec in f.storages if "optimizer" in rec.key]
        assert opt_storages and "model" in f.storages[0].key
        offset = f.chunks[opt_storages[-1].first_chunk].offset
    data = bytearray(open(state_file, "rb").read())
    data[offset + 1] ^= 0x40
    with open(state_file, "wb") as fh:
        fh.write(bytes(data))
    fresh = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ckptfmt.CorruptError):
        mgr.load_into({"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters())}, restore_rng=False)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_commit_names_only_the_files_the_state_was_written_against(tmp_path):
    """Step 1's state file saved again (another file id) after step 2's state file was written
    against it: the record of step 2 must not name the new file, whose chunks are not the ones
    step 2 refers to (the check every writer and every load makes: multifile.check_named)."""

    from ckptfmt.runs.steps import StepJob

    mgr = CheckpointManager(tmp_path, incremental=True)
    frozen = torch.randn(256 * 1024)  # about 1 MiB: chunks worth referring to
    mgr.save(1, {"frozen": frozen, "w": torch.zeros(3)})
    mgr.save(2, {"frozen": frozen, "w": torch.ones(3)})
    step2 = tmp_path / "step-000000002"
    record = multifile.read_commit(str(step2))
    assert record.references, "step 2 reads chunks from step 1"
    os.remove(step2 / multifile.COMMIT_NAME)
    ckptfmt.save({"frozen": frozen}, tmp_path / "step-000000001" / "state.ckpt")
    fd = os.open(step2, os.O_RDONLY | os.O_DIRECTORY)
    try:
        job = StepJob(2, str(step2), fd, {}, {}, inflight.SaveHandle(str(step2)))
        with pytest.raises(ckptfmt.CorruptError, match="file id"):
            mgr._commit(job)
    finally:
        os.close(fd)
    assert not (step2 / multifile.COMMIT_NAME).exists()
