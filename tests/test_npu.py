"""The accelerator paths on a device: the npu test backend (tests/npu).

"npu" is torch's PrivateUse1 backend built from tests/npu/npu_ext.cpp: two devices
over host memory, pinned host memory, streams and events, and non_blocking copies
between pinned memory and a device that run later, on the device's stream worker,
after a delay the tests set.  Until a fence says so the host bytes are stale, so a
missing or misplaced synchronize makes these tests fail; the tests marked "the
backend catches" remove a fence on purpose and check that it does.

Everything is compared bit for bit with the CPU state it was made from: dtype,
shape, strides, offset, bytes and storage sharing (helpers.assert_same), and the
device of every loaded tensor.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import npu
import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.background import copysave as background
from ckptfmt.background import staging
from ckptfmt.files.reader import CheckpointFile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import gpu_check  # noqa: E402  (the bench script: its state helpers serve the tests too)
from gpu_check import moved, tensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("npu_devices")

CHUNK = 4 << 10  # the smallest chunk: a few KB span several chunks, and streamed loads fill often

Where = Callable[[str], str]


# -- states ---------------------------------------------------------------------------------


def _cpu_state(seed: int = 0) -> dict[str, Any]:
    """Views, odd dtypes, NaN payloads, empty and 0-d tensors: what a device copy could get wrong."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g)  # 24 KiB: six chunks
    return {
        "w": w,
        "w_t": w.t(),  # shares w's storage, transposed
        "row": w[3],  # shares it at an offset
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
        "f16": torch.randn(77, generator=g).half(),
        "i64": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "c64": torch.randn(50, dtype=torch.complex64, generator=g),
        "u8": torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g),
        "odd": _odd_floats(),
        "empty": torch.empty(0),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 7,
    }


def _odd_floats() -> torch.Tensor:
    """NaNs with payloads, a negative denormal: what only a bit-exact copy keeps."""
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    return special.view(torch.int32).add(1).view(torch.float32)


def _check_devices(state: Any, where: Where) -> None:
    wrong = {k: str(t.device) for k, t in tensors(state) if t.device != torch.device(where(k))}
    assert not wrong, f"tensors on the wrong device: {wrong}"


def _storages(state: Any) -> list[torch.UntypedStorage]:
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for _, t in tensors(state):
        s = t.untyped_storage()
        seen.setdefault((str(s.device), s.data_ptr()), s)
    return list(seen.values())


def _scramble(state: Any) -> None:
    """Overwrite every tensor of `state` in place (a training step after the save call)."""
    for _, t in tensors(state):
        if t.dtype in (torch.bool, torch.uint8, torch.int64):
            t.bitwise_not_()
        elif t.numel():
            t.add_(1)


def everywhere(device: str) -> Where:
    return lambda key: device


@pytest.fixture
def staging_config() -> Iterator[Callable[..., None]]:
    """Set the staging limit (the streamed loads' budget too) and slab size for one test."""
    pool = staging.POOL
    saved = (pool.limit, pool.slab_bytes)
    yield ckptfmt.configure_staging
    ckptfmt.configure_staging(*saved)


@pytest.fixture(autouse=True)
def _settled() -> Iterator[None]:
    """Every test starts on device 0 and leaves no copy running and no staging slab in use."""
    torch.accelerator.set_device_index(0)
    yield
    torch.accelerator.set_device_index(0)
    for i in range(torch.accelerator.device_count()):
        torch.accelerator.synchronize(i)
    npu.set_delay(0)
    assert staging.POOL.in_use == 0, "a staging slab was not returned"


# -- the backend ----------------------------------------------------------------------------


def test_the_backend_is_an_accelerator_whose_copies_from_pinned_memory_run_later():
    acc = torch.accelerator.current_accelerator(check_available=True)
    assert acc is not None and acc.type == "npu" and torch.accelerator.device_count() == 2
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    assert host.is_pinned() and not torch.empty(16).is_pinned()
    src = torch.full((1 << 16,), 7, dtype=torch.uint8, device="npu:1")
    with npu.delay(0.2):
        host.copy_(src, non_blocking=True)
        on_1 = torch.accelerator.current_stream(src.device).record_event()
        on_0 = torch.accelerator.current_stream(torch.device("npu:0")).record_event()
        assert not on_1.query(), "the copy ran at once: the tests below would prove nothing"
        assert on_0.query(), "device 0's stream has nothing queued"
        assert not bool((host == 7).all())
        on_1.synchronize()
    assert on_1.query() and bool((host == 7).all())


def test_switched_off_it_is_like_a_cuda_build_on_a_machine_without_a_gpu(npu_ext, tmp_path):
    """The state the rest of the test session runs in once this module is done."""
    npu_ext.set_enabled(False)
    try:
        assert torch.accelerator.current_accelerator(check_available=True) is None
        assert not torch.accelerator.is_available() and torch.accelerator.device_count() == 0
        state = {"t": torch.arange(5000.0), "n": 1}
        p = tmp_path / "x.ckpt"
        ckptfmt.save(state, p, blocking=False, chunk_size=CHUNK).wait(timeout=60)
        assert_same(state, ckptfmt.load(p))
    finally:
        npu_ext.set_enabled(True)


def test_rng_capture_and_restore_cover_both_devices():
    mod = torch.get_device_module("npu")
    captured = ckptfmt.capture_rng()
    states = captured["accelerators"]["npu"]
    assert len(states) == 2 and all(torch.equal(s, mod.get_rng_state(i)) for i, s in enumerate(states))
    mod.manual_seed_all(1234)
    changed = mod.get_rng_state(1)
    ckptfmt.restore_rng(captured)
    assert torch.equal(mod.get_rng_state(1), states[1]) and not torch.equal(changed, states[1])


# -- blocking saves, loads ------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_state_on_npu_round_trips_onto_npu_and_cpu(tmp_path, compression):
    ref = _cpu_state()
    state = moved(ref, everywhere("npu:0"))
    p = tmp_path / "x.ckpt"
    ckptfmt.save(state, p, chunk_size=CHUNK, compression=compression)
    with ckptfmt.open(p) as r:
        assert r.source_devices == ["npu:0"]
    with npu.delay(0.001):
        out = ckptfmt.load(p, map_location="npu:0")
    _check_devices(out, everywhere("npu:0"))
    assert_same(ref, out)
    to_cpu: list[Any] = [None, "cpu", {"npu:0": "cpu"}]
    for map_location in to_cpu:
        out = ckptfmt.load(p, map_location=map_location)
        _check_devices(out, everywhere("cpu"))
        assert_same(ref, out)


def test_map_location_forms_on_a_two_device_state(tmp_path):
    ref = _cpu_state(1)

    def saved(k: str) -> str:
        return "npu:1" if k in ("i64", "mask", "w", "w_t", "row") else "npu:0"

    p = tmp_path / "x.ckpt"
    ckptfmt.save(moved(ref, saved), p, chunk_size=CHUNK)
    with ckptfmt.open(p) as r:
        assert sorted(r.source_devices) == ["npu:0", "npu:1"]
        got = r.get("u8", map_location="npu:1")
        assert got.device == torch.device("npu:1") and torch.equal(got.cpu(), ref["u8"])

    def cases() -> Iterator[tuple[Any, Where]]:  # (map_location, where each tensor must land)
        yield "npu:1", everywhere("npu:1")
        yield torch.device("npu", 1), everywhere("npu:1")
        yield {"npu:0": "npu:1"}, everywhere("npu:1")  # npu:1 keeps its place
        yield {"npu:0": "npu:1", "npu:1": "npu:0"}, lambda k: "npu:0" if saved(k) == "npu:1" else "npu:1"
        yield {"npu:1": "cpu"}, lambda k: "cpu" if saved(k) == "npu:1" else "npu:0"
        yield {"npu:0": torch.device("cpu")}, lambda k: "cpu" if saved(k) == "npu:0" else "npu:1"
        yield (lambda storage, location: None), saved  # the saved locations

    for map_location, where in cases():
        with npu.delay(0.001):
            out = ckptfmt.load(p, map_location=map_location)
        _check_devices(out, where)
        assert_same(ref, out)


def test_a_device_without_index_is_the_current_device(tmp_path):
    ref = _cpu_state(2)
    p = tmp_path / "x.ckpt"
    ckptfmt.save(moved(ref, everywhere("npu:0")), p, chunk_size=CHUNK)
    torch.accelerator.set_device_index(1)
    out = ckptfmt.load(p, map_location="npu")
    _check_devices(out, everywhere("npu:1"))
    assert_same(ref, out)


# -- streamed loads: bounded pinned buffers, one asynchronous copy per fill -------------------


@pytest.mark.parametrize(
    ("budget", "device", "compression"),
    [(CHUNK, "npu:1", None), (3 * CHUNK + 100, "npu:0", "zstd"), (64 << 20, "npu:1", None)],
)
def test_streamed_loads_through_a_small_pinned_buffer(tmp_path, staging_config, budget, device, compression):
    ref = _cpu_state(3)
    p = tmp_path / "x.ckpt"
    ckptfmt.save(ref, p, chunk_size=CHUNK, compression=compression)
    staging_config(budget)
    before = npu.stats()["async_copies"]
    with npu.delay(0.002):  # device 0 stays current: the load onto npu:1 must wait for npu:1
        out = ckptfmt.load(p, map_location=device)
    fills = npu.stats()["async_copies"] - before
    _check_devices(out, everywhere(device))
    assert_same(ref, out)
    sizes = [s.nbytes() for s in _storages(ref)]
    staged = min(max(budget, CHUNK), sum(sizes))  # the reader's staging: the budget, or all there is
    halves = 2 if staged >= 2 * CHUNK else 1  # two buffers, one filling while the other copies
    per_fill = max(1, staged // halves // CHUNK) * CHUNK
    expected = sum(math.ceil(n / per_fill) for n in sizes)
    assert fills == expected, f"{fills} asynchronous copies from pinned memory, expected {expected}"


def test_the_backend_catches_a_streamed_load_that_does_not_wait_for_its_copies(
    tmp_path, staging_config, monkeypatch
):
    ref = _cpu_state(4)
    p = tmp_path / "x.ckpt"
    ckptfmt.save(ref, p, chunk_size=CHUNK)
    staging_config(CHUNK)

    class NoWait:  # a fence that does not wait: what a reader without fences would do
        def synchronize(self) -> None:
            pass

    class Stream:
        def record_event(self) -> NoWait:
            return NoWait()

    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: Stream())
    with npu.delay(0.02):  # later than the next fill, even on a busy machine
        out = ckptfmt.load(p, map_location="npu:1")
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_same(ref, out)


def test_a_corrupt_chunk_in_a_streamed_device_load_is_reported(tmp_path, staging_config):
    ref = _cpu_state(9)
    p = tmp_path / "x.ckpt"
    ckptfmt.save(ref, p, chunk_size=CHUNK)
    with CheckpointFile(str(p)) as f:
        k = [i for i, key in enumerate(f.chunk_keys()) if key == "state['w']"][3]  # four fills into w
        offset = f.chunks[k].offset + 100
    with open(p, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))
    staging_config(CHUNK)
    with npu.delay(0.002), pytest.raises(ckptfmt.CorruptError, match="checksum mismatch") as e:
        ckptfmt.load(p, map_location="npu:1")
    assert (e.value.key, e.value.chunk) == ("state['w']", k)


# -- non-blocking saves from device tensors -------------------------------------------------


def _two_devices(k: str) -> str:
    return "npu:1" if k in ("w", "w_t", "row", "f16", "mask", "u8", "scalar") else "npu:0"


@pytest.mark.parametrize("where", [everywhere("npu:0"), _two_devices], ids=["npu0", "npu0+npu1"])
def test_a_nonblocking_save_holds_the_values_at_call_time(tmp_path, where):
    ref = _cpu_state(5)
    state = moved(ref, where)
    p = tmp_path / "x.ckpt"
    before = npu.stats()
    with npu.delay(0.005):
        h = ckptfmt.save(state, p, blocking=False, chunk_size=CHUNK)
        _scramble(state)  # at once: the device's stream runs it after the snapshot's copies
        h.wait(timeout=60)
    after = npu.stats()
    assert not torch.equal(state["w"].cpu(), ref["w"])
    assert_same(ref, ckptfmt.load(p))
    assert after["async_copies"] > before["async_copies"], "not staged through pinned memory"
    assert after["event_waits"] > before["event_waits"], "no fence was waited for"
    out = ckptfmt.load(p, map_location=lambda s, loc: None)
    _check_devices(out, where)
    assert_same(ref, out)


def test_a_nonblocking_save_fences_every_source_device(tmp_path):
    """Copies from npu:1 run on npu:1's stream while npu:0 is current; each device's copies
    are fenced on its own stream (npu:1 has five copies queued, npu:0 one: waiting for npu:0
    would not cover npu:1's)."""
    ref = {f"t{i}": torch.randn(3000, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    state = moved(ref, lambda k: "npu:0" if k == "t5" else "npu:1")
    p = tmp_path / "x.ckpt"
    with npu.delay(0.01):
        ckptfmt.save(state, p, blocking=False, chunk_size=CHUNK).wait(timeout=60)
    assert_same(ref, ckptfmt.load(p))


def test_a_nonblocking_save_made_on_a_side_stream(tmp_path):
    """The snapshot's copies go on the current stream, a side stream here: the fence too."""
    ref = {f"t{i}": torch.randn(3000, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)}
    state = moved(ref, everywhere("npu:0"))
    default = torch.accelerator.current_stream(torch.device("npu:0"))
    side = torch.Stream(device="npu:0")
    assert side != default
    torch.accelerator.set_stream(side)
    try:
        with npu.delay(0.05):
            h = ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False, chunk_size=CHUNK)
            assert not side.query() and default.query()
            h.wait(timeout=60)
    finally:
        torch.accelerator.set_stream(default)
    assert_same(ref, ckptfmt.load(tmp_path / "x.ckpt"))


def test_the_backend_catches_a_fence_on_the_current_devices_stream(tmp_path, monkeypatch):
    """The mistake test_nonblocking.py's fence test describes, made on purpose: the event is
    recorded on the current device's stream, not the source device's."""
    ref = {f"t{i}": torch.randn(3000, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)}
    state = moved(ref, everywhere("npu:1"))
    monkeypatch.setattr(
        background, "_fence", lambda device: torch.accelerator.current_stream().record_event()
    )
    p = tmp_path / "x.ckpt"
    with npu.delay(0.05):
        ckptfmt.save(state, p, blocking=False, chunk_size=CHUNK).wait(timeout=60)
        torch.accelerator.synchronize(1)  # before the slabs are used again
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_same(ref, ckptfmt.load(p))


@pytest.mark.parametrize("blocking", [True, False])
def test_mixed_cpu_and_npu_state_with_a_tight_pool(tmp_path, staging_config, blocking):
    """AdamW's layout: a CPU `step` between two moments on a device, parameters on both devices;
    two slabs of room, so host and pinned slabs alternate and the snapshot waits for the writer."""
    g = torch.Generator().manual_seed(6)
    ref = {
        "state": {
            i: {
                "step": torch.tensor(float(i + 1)),
                "exp_avg": torch.randn(2500, generator=g),
                "exp_avg_sq": torch.rand(2500, generator=g),
            }
            for i in range(6)
        },
        "param_groups": [{"lr": 1e-3, "params": list(range(6))}],
    }

    def where(k: str) -> str:
        return "cpu" if k.endswith("step") else f"npu:{int(k.split('.')[1]) % 2}"

    state = moved(ref, where)
    staging_config(4 * CHUNK, 2 * CHUNK)
    p = tmp_path / "x.ckpt"
    with npu.delay(0.002):
        h = ckptfmt.save(state, p, blocking=blocking, chunk_size=CHUNK)
        if h is not None:
            _scramble(state)
            h.wait(timeout=60)
    assert staging.POOL.allocated <= 4 * CHUNK
    assert_same(ref, ckptfmt.load(p))
    out = ckptfmt.load(p, map_location=lambda s, loc: None)
    _check_devices(out, where)
    assert_same(ref, out)


# -- load_into and the checkpoint manager ---------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
def test_load_into_npu_targets_fills_them_in_place(tmp_path, atomic):
    g = torch.Generator().manual_seed(7)
    ref = {
        "w": torch.randn(64, 96, generator=g),
        "b": torch.randn(96, generator=g),
        "t": torch.randn(32, 16, generator=g),
    }
    p = tmp_path / "x.ckpt"
    ckptfmt.save(moved(ref, lambda k: "npu:1" if k == "b" else "cpu"), p, chunk_size=CHUNK)
    targets = {
        "w": torch.zeros(64, 96, device="npu:0"),
        "b": torch.zeros(96, device="npu:1"),
        "t": torch.zeros(16, 32, device="npu:1").t(),  # laid out unlike the file
    }
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    with npu.delay(0.001):
        ckptfmt.load_into(p, targets, atomic=atomic)
    assert {k: v.data_ptr() for k, v in targets.items()} == ptrs
    _check_devices(targets, lambda k: "npu:1" if k in ("b", "t") else "npu:0")
    for k, v in ref.items():
        assert torch.equal(targets[k].cpu().view(torch.int32), v.view(torch.int32)), k


def test_incremental_nonblocking_saves_from_two_devices(tmp_path):
    """A frozen tensor on npu:1 (256 KiB: chunks under 64 KiB are always written) is referred
    to, not written again; the digests are taken on the writer thread from pinned slabs, after
    the fences."""
    g = torch.Generator().manual_seed(8)
    ref1 = {"frozen": torch.randn(1 << 16, generator=g), "head": torch.randn(2048, generator=g)}
    ref2 = {"frozen": ref1["frozen"].clone(), "head": torch.randn(2048, generator=g)}

    def where(k: str) -> str:
        return "npu:1" if k == "frozen" else "npu:0"

    mgr = ckptfmt.CheckpointManager(tmp_path, blocking=False, incremental=True)
    with npu.delay(0.002):
        for step, ref in ((1, ref1), (2, ref2)):
            state = moved(ref, where)
            mgr.save(step, state)
            _scramble(state)
        mgr.wait()
    info = mgr.latest()
    assert info is not None and info.step == 2 and info.references, "step 2 refers to nothing"
    for step, ref in ((1, ref1), (2, ref2)):
        out = mgr.load(step, map_location=lambda s, loc: None)
        _check_devices(out, where)
        assert_same(ref, out)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to("npu:0")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Optimizer steps with gradients set directly: torch's autograd engine sizes its device
    queues once per process, before this backend's devices may have been switched on."""
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        opt.step()


@pytest.mark.parametrize("blocking", [True, False])
def test_checkpoint_manager_saves_and_resumes_an_npu_model(tmp_path, blocking):
    model, opt = _model(0)
    _train(model, opt, 2)
    mgr = ckptfmt.CheckpointManager(tmp_path, blocking=blocking)
    want = moved({"model": model.state_dict(), "opt": opt.state_dict()}, everywhere("cpu"))
    with npu.delay(0.001):
        h = mgr.save(2, {"model": model, "opt": opt})
        if h is not None:
            _train(model, opt, 1)  # the file holds step 2 all the same
    mgr.wait()
    model2, opt2 = _model(1)
    _train(model2, opt2, 1)
    with pytest.warns(ckptfmt.CheckpointWarning, match="no data position"):
        report = mgr.load_into({"model": model2, "opt": opt2})
    assert report.rng_restored
    got = {"model": model2.state_dict(), "opt": opt2.state_dict()}
    _check_devices(got["model"], everywhere("npu:0"))
    assert_same(want, moved(got, everywhere("cpu")), check_sharing=False)
    loaded = mgr.load(map_location="npu:1")
    _check_devices(loaded["model"], everywhere("npu:1"))
    assert_same(want["model"], moved(loaded["model"], everywhere("cpu")), check_sharing=False)


# -- bench/gpu_check.py, the same checks for a real accelerator --------------------------------


def test_gpu_check_passes_on_the_npu_backend(capsys):
    assert gpu_check.main(["--npu", "--size", "2M"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " GB/s" in line]
    assert len(lines) >= 12 and all(" ok " in line for line in lines), out
    assert "all checks passed" in out
