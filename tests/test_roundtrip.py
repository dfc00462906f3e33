"""Saved states come back bit for bit, with types, strides and sharing."""

from __future__ import annotations

import collections
import math
import random
import struct

import numpy as np
import pytest
import torch
from helpers import ALL_DTYPES, assert_same, states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.format import dtypes


def roundtrip(tmp_path, state, **kw):
    p = tmp_path / "s.ckpt"
    ckptfmt.save(state, p, **kw)
    return ckptfmt.load(p)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    state=states(), compression=st.sampled_from([None, "zstd"]), chunk_size=st.sampled_from([4096, 1 << 20])
)
def test_generated_states_round_trip(tmp_path, state, compression, chunk_size):
    back = roundtrip(tmp_path, state, compression=compression, chunk_size=chunk_size)
    assert_same(state, back)


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_dtype_bit_exact(tmp_path, name, compression):
    dt = dtypes.TORCH_DTYPES[name]
    size = dtypes.torch_itemsize(name)
    raw = bytes(random.Random(name).getrandbits(8) for _ in range(size * 3000))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(30, 100)
    state = {"t": t, "0d": t[3, 4], "empty": t[:0], "cols": t[:, ::7], "T": t.t()}
    back = roundtrip(tmp_path, state, compression=compression, chunk_size=4096)
    assert_same(state, back)
    assert back["t"].untyped_storage().data_ptr() == back["T"].untyped_storage().data_ptr()


def test_float_specials_bit_exact(tmp_path):
    payload_nan = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, payload_nan, 5e-324, 1.7976931348623157e308]
    state = {
        "floats": values,
        "complex": [complex(-0.0, math.nan), complex(math.inf, -0.0)],
        "tensor": torch.tensor(values, dtype=torch.float64),
    }
    assert_same(state, roundtrip(tmp_path, state))


def test_big_ints_and_containers(tmp_path):
    state = collections.OrderedDict(
        [
            ("big", 2**127 + 12345),
            ("neg", -(2**300)),
            ("zero", 0),
            ((1, "a"), None),
            (3.5, True),
            (None, b"\x00\xff"),
            (False, ("nested", [(), [], {}])),
        ]
    )
    back = roundtrip(tmp_path, state)
    assert_same(state, back)
    assert list(back) == list(state)


def _train_a_bit(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.fc = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc(x))))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_real_training_state(tmp_path, compression):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd_model = torch.nn.Linear(16, 16)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _train_a_bit(model, opt)
    _train_a_bit(sgd_model, sgd)
    sched.step()
    np.random.seed(3)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sgd": sgd.state_dict(),
        "sched": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "pcg": np.random.default_rng(7).bit_generator.state,
        },
        "step": 3,
    }
    back = roundtrip(tmp_path, state, compression=compression)
    assert_same(state, back)
    assert back["model"]["emb.weight"].data_ptr() == back["model"]["out.weight"].data_ptr()

    # everything goes back where it came from
    model2 = Tiny()
    model2.load_state_dict(back["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optim"])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    sched2.load_state_dict(back["sched"])
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(back["scaler"])
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    rng = np.random.default_rng()
    rng.bit_generator.state = back["rng"]["pcg"]
    assert rng.integers(1 << 60) == np.random.default_rng(7).integers(1 << 60)
    # both copies continue identically
    torch.manual_seed(1)
    _train_a_bit(model, opt, 2)
    torch.manual_seed(1)
    _train_a_bit(model2, opt2, 2)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k


def test_module_metadata_keeps_version_hooks(tmp_path):
    bn = torch.nn.BatchNorm1d(4)
    sd = bn.state_dict()
    back = roundtrip(tmp_path, sd)
    assert back._metadata == sd._metadata
    assert back._metadata[""]["version"] == sd._metadata[""]["version"]
    torch.nn.BatchNorm1d(4).load_state_dict(back)


def test_parameters_and_requires_grad(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    g = torch.randn(4, requires_grad=True)
    back = roundtrip(tmp_path, [p, q, g, p])
    assert type(back[0]) is torch.nn.Parameter and back[0].requires_grad
    assert type(back[1]) is torch.nn.Parameter and not back[1].requires_grad
    assert type(back[2]) is torch.Tensor and back[2].requires_grad and back[2].is_leaf
    assert back[0].data_ptr() == back[3].data_ptr()


def test_views_of_one_storage_share_again(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    state = {
        "base": base,
        "mat": base.view(4, 6),
        "col": base.view(4, 6)[:, 2],
        "tail": base[20:],
        "as_int": base.view(torch.int32)[5:9],
    }
    back = roundtrip(tmp_path, state)
    assert_same(state, back)
    back["base"][21] = -1.0
    assert back["tail"][1] == -1.0 and back["mat"][3, 3] == -1.0


def test_numpy_values(tmp_path):
    state = {
        "a": np.arange(12, dtype=">i4").reshape(3, 4),
        "f": np.asfortranarray(np.ones((2, 3))),
        "s": np.float32(1.5),
        "b": np.bool_(True),
        "z": np.zeros((0, 3), dtype=np.complex64),
        "sliced": np.arange(10.0)[::3],
    }
    back = roundtrip(tmp_path, state)
    assert_same(
        {k: v for k, v in state.items() if k != "sliced"}, {k: v for k, v in back.items() if k != "sliced"}
    )
    np.testing.assert_array_equal(back["sliced"], state["sliced"])
    assert back["sliced"].flags.c_contiguous  # non-contiguous arrays come back contiguous


def test_large_tensor_spans_many_chunks(tmp_path):
    t = torch.randn(300_000)
    back = roundtrip(tmp_path, {"t": t}, chunk_size=1 << 16)
    assert torch.equal(back["t"], t)
    with ckptfmt.open(tmp_path / "s.ckpt") as r:
        assert len(r._file.chunks) == -(-t.nbytes // (1 << 16))


def test_metadata_round_trip(tmp_path):
    p = tmp_path / "m.ckpt"
    ckptfmt.save({"x": 1}, p, metadata={"run": "abc", "step": "100", "ünï": "cödé"})
    with ckptfmt.open(p) as r:
        assert r.metadata == {"run": "abc", "step": "100", "ünï": "cödé"}
        assert r.producer["torch"] == torch.__version__
        assert r.producer["format"] == "1.0"
        assert r.producer["ckptfmt"] == ckptfmt.__version__


def test_source_devices_recorded(tmp_path):
    p = tmp_path / "d.ckpt"
    ckptfmt.save({"a": torch.ones(2), "b": np.ones(2)}, p)
    with ckptfmt.open(p) as r:
        assert r.source_devices == ["cpu"]
