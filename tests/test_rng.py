"""capture_rng / restore_rng: bit-exact resumption of every global generator, through a file."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.format.encode import encode
from ckptfmt.runs import rng
from ckptfmt.runs.rng import RNGSkippedWarning, RNGStateError, RNGStateTypeError, capture_rng, restore_rng

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def draw() -> list[str]:
    """Numbers from every global generator, as exact text (float.hex, bytes.hex)."""
    py = [random.random(), random.gauss(0.0, 1.0), random.gauss(0.0, 1.0), random.gauss(0.0, 1.0)]
    out = [x.hex() for x in py] + [str(random.getrandbits(64))]
    out += [
        np.random.randn(5).tobytes().hex(),  # odd: leaves a cached gaussian behind
        np.random.randint(0, 2**31, size=3).tobytes().hex(),
        torch.randn(7).numpy().tobytes().hex(),
        torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True).numpy().tobytes().hex(),
        torch.randint(0, 1000, (4,)).numpy().tobytes().hex(),
    ]
    return out


def seed_all(py: int = 1, npy: int = 2, pt: int = 3, gauss: int = 1, np_gauss: int = 1) -> None:
    """Seed every generator, then leave gaussians cached when the counts are odd."""
    random.seed(py)
    np.random.seed(npy)
    torch.manual_seed(pt)
    for _ in range(gauss):
        random.gauss(0.0, 1.0)
    np.random.randn(np_gauss)
    torch.rand(3)


def native_state() -> tuple[Any, Any, torch.Tensor]:
    # The libraries' own getters, independent of the code under test.
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_native_state(s: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(s[0])
    np.random.set_state(s[1])
    torch.set_rng_state(s[2])


@pytest.fixture(autouse=True)
def _keep_global_generators():
    """These tests move the process-wide generators; give other test files theirs back."""
    saved = native_state()
    yield
    set_native_state(saved)


def copy_capture(c: dict[str, Any]) -> dict[str, Any]:
    """A copy deep enough that tests can replace any field without touching `c`."""
    return {
        "version": c["version"],
        "python": dict(c["python"]),
        "numpy": dict(c["numpy"]),
        "torch_cpu": c["torch_cpu"],
        "accelerators": {k: list(v) for k, v in c["accelerators"].items()},
    }


# ---------------------------------------------------------------------------
# the capture itself


def test_capture_holds_storable_values_matching_the_libraries():
    seed_all()
    c = capture_rng()
    assert set(c) == {"version", "python", "numpy", "torch_cpu", "accelerators"}
    assert c["version"] == 1

    version, words, gauss_next = random.getstate()
    assert c["python"]["version"] == version == 3
    assert c["python"]["state"].dtype == np.uint32 and c["python"]["state"].shape == (625,)
    assert tuple(c["python"]["state"].tolist()) == words
    assert c["python"]["gauss_next"] == gauss_next is not None  # one gauss call: the pair's second

    name, keys, pos, has_gauss, cached = np.random.get_state()
    n = c["numpy"]
    assert n["bit_generator"] == name == "MT19937"
    assert n["keys"].dtype == np.uint32 and np.array_equal(n["keys"], keys)
    assert (n["pos"], n["has_gauss"], n["cached_gaussian"]) == (pos, has_gauss, cached)
    assert has_gauss == 1  # one randn(1): the cached gaussian is exercised
    assert all(type(n[k]) is int for k in ("pos", "has_gauss"))

    assert torch.equal(c["torch_cpu"], torch.get_rng_state()) and c["torch_cpu"].dtype == torch.uint8
    expected_kinds = {"cuda"} if torch.cuda.is_available() else set()
    assert set(c["accelerators"]) >= expected_kinds
    encode(c)  # raises UnsupportedObjectError on anything the format cannot store


def test_capture_is_a_snapshot_not_a_view():
    seed_all()
    c = capture_rng()
    keys, words = c["numpy"]["keys"].copy(), c["python"]["state"].copy()
    draw()
    assert np.array_equal(c["numpy"]["keys"], keys) and np.array_equal(c["python"]["state"], words)


def test_public_names():
    assert ckptfmt.capture_rng is capture_rng and ckptfmt.restore_rng is restore_rng


# ---------------------------------------------------------------------------
# round trips


def test_round_trip_through_a_file_is_bit_exact(tmp_path):
    seed_all()
    path = tmp_path / "rng.ckpt"
    ckptfmt.save(capture_rng(), path)
    first = draw()
    assert draw() != first  # the draws move the generators, so equality below means something

    restore_rng(ckptfmt.load(path))
    assert draw() == first


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    py=st.integers(0, 2**128),
    npy=st.integers(0, 2**32 - 1),
    pt=st.integers(0, 2**64 - 1),
    gauss=st.integers(0, 3),
    np_gauss=st.integers(0, 3),
)
def test_round_trip_any_seeds(py, npy, pt, gauss, np_gauss):
    seed_all(py, npy, pt, gauss, np_gauss)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rng.ckpt")
        ckptfmt.save(capture_rng(), path)
        first = draw()
        loaded = ckptfmt.load(path)
    restore_rng(loaded)
    assert draw() == first


CAPTURE_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import ckptfmt
from ckptfmt.runs.rng import capture_rng
from test_rng import draw, seed_all
seed_all(11, 12, 13)
ckptfmt.save(capture_rng(), sys.argv[1])
print(json.dumps(draw()))
"""

RESTORE_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import ckptfmt
from ckptfmt.runs.rng import restore_rng
from test_rng import draw
restore_rng(ckptfmt.load(sys.argv[1]))
print(json.dumps(draw()))
"""


def run_child(code: str, path: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", code.format(tests=TESTS), path],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    result: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_capture_in_one_process_restore_in_another(tmp_path):
    path = str(tmp_path / "rng.ckpt")
    after_capture = run_child(CAPTURE_CHILD, path)
    # A fresh process seeds `random` and numpy from the OS, so only a restore makes these agree.
    assert run_child(RESTORE_CHILD, path) == after_capture


def test_load_and_restore_use_no_pickle(tmp_path, monkeypatch):
    seed_all()
    path = tmp_path / "rng.ckpt"
    ckptfmt.save(capture_rng(), path)
    first = draw()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(AssertionError):
        pickle.loads(b"")  # the trap is set
    restore_rng(ckptfmt.load(path))
    monkeypatch.undo()
    assert draw() == first


# ---------------------------------------------------------------------------
# malformed captures: the documented error, and no generator changed


def _set(part: str | None, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(c: dict[str, Any]) -> None:
        (c if part is None else c[part])[key] = value

    return mutate


def _delete(part: str | None, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(c: dict[str, Any]) -> None:
        del (c if part is None else c[part])[key]

    return mutate


def _edit(part: str, key: str, fn: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(c: dict[str, Any]) -> None:
        c[part][key] = fn(c[part][key])

    return mutate


def _last_word(words: np.ndarray, value: int) -> np.ndarray:
    out = words.copy()
    out[-1] = value
    return out


MALFORMED = [
    (_delete(None, "numpy"), RNGStateError, "field numpy is missing"),
    (_delete(None, "accelerators"), RNGStateError, "field accelerators is missing"),
    (_set(None, "extra", 1), RNGStateError, "field extra is not part of"),
    (_set(None, "version", 2), RNGStateError, "field version is 2; this ckptfmt reads version 1"),
    (_set(None, "version", "1"), RNGStateTypeError, "field version is a str"),
    (_set(None, "version", True), RNGStateTypeError, "field version is a bool"),
    (_delete("python", "gauss_next"), RNGStateError, "field python.gauss_next is missing"),
    (_set("python", "version", 2), RNGStateError, "field python.version is 2"),
    (_edit("python", "state", lambda w: w[:624]), RNGStateError, "field python.state has 624 entries"),
    (_edit("python", "state", lambda w: w.astype(np.int64)), RNGStateError, "python.state has dtype int64"),
    (
        _edit("python", "state", lambda w: _last_word(w, 625)),
        RNGStateError,
        "python.state ends with position 625",
    ),
    (_edit("python", "state", lambda w: w.tolist()), RNGStateTypeError, "field python.state is a list"),
    (_set("python", "gauss_next", "0.5"), RNGStateTypeError, "field python.gauss_next is a str"),
    (_set("python", "extra", None), RNGStateError, "field python.extra is not part of"),
    (_edit("numpy", "keys", lambda k: k[:10]), RNGStateError, "field numpy.keys has 10 entries"),
    (
        _edit("numpy", "keys", lambda k: k.reshape(2, 312)),
        RNGStateError,
        "field numpy.keys has 624 entries in shape (2, 312)",
    ),
    (_edit("numpy", "keys", lambda k: k.astype(np.float64)), RNGStateError, "numpy.keys has dtype float64"),
    (_edit("numpy", "keys", torch.from_numpy), RNGStateTypeError, "field numpy.keys is a Tensor"),
    (_set("numpy", "bit_generator", "PCG64"), RNGStateError, "field numpy.bit_generator is 'PCG64'"),
    (
        _set("numpy", "bit_generator", np.array(["MT19937"])),
        RNGStateTypeError,
        "field numpy.bit_generator is a ndarray",
    ),
    (_set("numpy", "pos", 625), RNGStateError, "field numpy.pos is 625"),
    (_set("numpy", "pos", -1), RNGStateError, "field numpy.pos is -1"),
    (_set("numpy", "pos", 3.0), RNGStateTypeError, "field numpy.pos is a float"),
    (_set("numpy", "has_gauss", 2), RNGStateError, "field numpy.has_gauss is 2"),
    (_set("numpy", "cached_gaussian", None), RNGStateTypeError, "field numpy.cached_gaussian is a NoneType"),
    (_set(None, "torch_cpu", torch.zeros(5056)), RNGStateError, "field torch_cpu has dtype torch.float32"),
    (
        _set(None, "torch_cpu", torch.zeros(100, dtype=torch.uint8)),
        RNGStateError,
        "field torch_cpu has 100 entries",
    ),
    (_set(None, "torch_cpu", np.zeros(5056, np.uint8)), RNGStateTypeError, "field torch_cpu is a ndarray"),
    (_set(None, "accelerators", []), RNGStateTypeError, "field accelerators is a list"),
    (_set(None, "accelerators", {"cuda": "x"}), RNGStateTypeError, "field accelerators.cuda is a str"),
    (
        _set(None, "accelerators", {"Not A Device": []}),
        RNGStateError,
        "field accelerators['Not A Device'] is not",
    ),
    # checked even for devices this machine lacks, so a restore elsewhere cannot fail later
    (
        _set(None, "accelerators", {"npu": [torch.zeros(16, dtype=torch.uint8), torch.zeros(16)]}),
        RNGStateError,
        "field accelerators.npu[1] has dtype torch.float32",
    ),
]


@pytest.mark.parametrize("mutate, error, message", MALFORMED, ids=[m[2] for m in MALFORMED])
def test_malformed_capture_raises_and_changes_nothing(mutate, error, message):
    seed_all()
    bad = copy_capture(capture_rng())
    mutate(bad)
    draw()  # move away from the capture, so a partial restore would show
    before = native_state()

    with pytest.raises(error) as info:
        restore_rng(bad)
    text = str(info.value)
    assert text.startswith("malformed RNG state: ") and message in text and "\n" not in text, text
    assert isinstance(info.value, ckptfmt.CheckpointError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, TypeError) == (error is RNGStateTypeError)

    after_failure = draw()
    set_native_state(before)
    assert after_failure == draw()


@pytest.mark.parametrize("bad", [None, 1, [], "state", torch.zeros(3)])
def test_not_a_dict(bad):
    with pytest.raises(
        RNGStateTypeError, match=r"^malformed RNG state: the capture is a \w+, expected a dict$"
    ):
        restore_rng(bad)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from([("numpy", "keys", 624), ("python", "state", 625)]),
    n=st.integers(0, 2000),
)
def test_any_wrong_length_is_refused(field, n):
    part, key, size = field
    c = copy_capture(capture_rng())
    c[part][key] = np.resize(c[part][key], n)
    if n == size:
        restore_rng(c)
        return
    with pytest.raises(RNGStateError, match=rf"field {part}\.{key} has {n} entries"):
        restore_rng(c)


def test_a_backend_refusing_half_way_is_rolled_back(monkeypatch):
    seed_all()
    good = capture_rng()
    draw()
    before = native_state()
    real = torch.set_rng_state
    calls = []

    def refuse_once(state: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:  # the restore's call; the rollback's goes through
            raise RuntimeError("backend refused")
        real(state)

    monkeypatch.setattr(torch, "set_rng_state", refuse_once)
    with pytest.raises(RuntimeError, match="backend refused"):
        restore_rng(good)
    monkeypatch.undo()
    # python and numpy were set before torch refused; the rollback must have undone them
    after_failure = draw()
    set_native_state(before)
    assert after_failure == draw()


# ---------------------------------------------------------------------------
# accelerators


def test_states_for_missing_devices_restore_the_rest_and_warn_once(tmp_path):
    seed_all()
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda_state = torch.cuda.get_rng_state(0) if here else torch.zeros(16, dtype=torch.uint8)
    c = copy_capture(capture_rng())
    c["accelerators"] = {"cuda": [cuda_state.clone() for _ in range(8)], "npu": [cuda_state.clone()] * 2}
    path = tmp_path / "rng.ckpt"
    ckptfmt.save(c, path)  # a hand-made capture stores like a real one
    first = draw()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore_rng(ckptfmt.load(path))
    assert draw() == first
    assert len(caught) == 1 and caught[0].category is RNGSkippedWarning
    text = str(caught[0].message)
    assert f"cuda:{here}..cuda:7 (8 captured, {here} here)" in text, text
    assert "npu:0..npu:1 (2 captured, 0 here)" in text, text
    assert caught[0].filename == __file__  # points at the caller


class FakeAccelerator:
    """A device module with `count` devices, standing in for torch.get_device_module(kind)."""

    def __init__(self, count: int) -> None:
        self.states = [torch.full((16,), i, dtype=torch.uint8) for i in range(count)]

    def get_rng_state(self, i: int) -> torch.Tensor:
        return self.states[i].clone()

    def set_rng_state(self, state: torch.Tensor, i: int) -> None:
        assert state.device.type == "cpu" and state.dtype == torch.uint8
        self.states[i] = state.clone()


@pytest.fixture
def fake(monkeypatch):
    """Two 'fakeacc' devices reached through the generic accelerator path."""
    dev = FakeAccelerator(2)
    count, module = rng._device_count, rng._device_module
    monkeypatch.setattr(rng, "_current_accelerator_type", lambda: "fakeacc")
    monkeypatch.setattr(rng, "_device_count", lambda kind: 2 if kind == "fakeacc" else count(kind))
    monkeypatch.setattr(rng, "_device_module", lambda kind: dev if kind == "fakeacc" else module(kind))
    return dev


def test_generic_accelerator_round_trip(fake, tmp_path):
    c = capture_rng()
    assert [s.tolist() for s in c["accelerators"]["fakeacc"]] == [[0] * 16, [1] * 16]
    ckptfmt.save(c, tmp_path / "rng.ckpt")
    fake.states = [torch.full((16,), 9, dtype=torch.uint8)] * 2  # what drawing would do

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every captured device exists: no warning
        restore_rng(ckptfmt.load(tmp_path / "rng.ckpt"))
    assert [s.tolist() for s in fake.states] == [[0] * 16, [1] * 16]


def test_fewer_devices_restore_those_present(fake):
    c = copy_capture(capture_rng())
    c["accelerators"]["fakeacc"] = [torch.full((16,), 40 + i, dtype=torch.uint8) for i in range(4)]
    with pytest.warns(RNGSkippedWarning, match=r"fakeacc:2\.\.fakeacc:3 \(4 captured, 2 here\)"):
        restore_rng(c)
    assert [s[0].item() for s in fake.states] == [40, 41]


def test_a_present_device_gets_only_a_state_of_its_size(fake):
    seed_all()
    c = copy_capture(capture_rng())
    c["accelerators"]["fakeacc"][1] = torch.zeros(8, dtype=torch.uint8)
    draw()
    before = native_state()
    with pytest.raises(
        RNGStateError, match=r"field accelerators\.fakeacc\[1\] has 8 entries .* expected 16$"
    ):
        restore_rng(c)
    assert [s[0].item() for s in fake.states] == [0, 1]
    after_failure = draw()
    set_native_state(before)
    assert after_failure == draw()
