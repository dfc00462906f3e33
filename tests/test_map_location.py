"""map_location: torch.load's four forms, and the saved device recorded for callables."""

from __future__ import annotations

import pytest
import torch

import ckptfmt


@pytest.fixture
def ckpt(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    state = {"w": base.view(3, 4), "row": base.view(3, 4)[1], "n": 5}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p)
    return p


@pytest.mark.parametrize("where", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, {}])
def test_cpu_forms(ckpt, where):
    s = ckptfmt.load(ckpt, map_location=where)
    assert s["w"].device.type == "cpu"
    assert torch.equal(s["w"], torch.arange(12.0).view(3, 4))
    assert s["w"].data_ptr() == s["row"].data_ptr() - 16


def test_meta_reads_no_data_but_keeps_layout(ckpt):
    s = ckptfmt.load(ckpt, map_location="meta")
    assert s["w"].is_meta and s["w"].shape == (3, 4) and s["row"].shape == (4,)
    assert s["row"].storage_offset() == 4
    assert s["n"] == 5


def test_meta_skips_chunk_reads_even_when_data_is_damaged(ckpt):
    data = bytearray(ckpt.read_bytes())
    data[64] ^= 0xFF  # first byte of the only chunk
    ckpt.write_bytes(bytes(data))
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load(ckpt)
    assert ckptfmt.load(ckpt, map_location="meta")["w"].is_meta


def test_dict_remaps_locations(ckpt):
    s = ckptfmt.load(ckpt, map_location={"cpu": "meta"})
    assert s["w"].is_meta


def test_callable_gets_cpu_storage_and_saved_location(ckpt):
    seen = []

    def where(storage, location):
        seen.append((storage.device.type, location, storage.nbytes()))
        return storage

    s = ckptfmt.load(ckpt, map_location=where)
    assert seen == [("cpu", "cpu", 48)]
    assert torch.equal(s["row"], torch.arange(4.0, 8.0))


def test_callable_returning_none_restores_saved_location(ckpt):
    s = ckptfmt.load(ckpt, map_location=lambda storage, location: None)
    assert s["w"].device.type == "cpu"


def test_callable_must_return_a_storage(ckpt):
    with pytest.raises(TypeError, match="expected a storage"):
        ckptfmt.load(ckpt, map_location=lambda s, loc: "cpu")


@pytest.mark.parametrize("bad", [3, ["cpu"], {"cpu": 3}])
def test_bad_map_location(ckpt, bad):
    with pytest.raises(TypeError, match="map_location"):
        ckptfmt.load(ckpt, map_location=bad)


def test_get_with_map_location(ckpt):
    with ckptfmt.open(ckpt) as r:
        assert r.get("w", map_location="meta").is_meta
        assert r.get("n") == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_path):
    t = torch.randn(1000, device="cuda")
    p = tmp_path / "c.ckpt"
    ckptfmt.save({"t": t, "v": t[10:20]}, p)
    with ckptfmt.open(p) as r:
        assert r.source_devices == ["cuda:0"]
    cpu = ckptfmt.load(p)
    assert cpu["t"].device.type == "cpu" and torch.equal(cpu["t"], t.cpu())
    back = ckptfmt.load(p, map_location=lambda s, loc: None)
    assert back["t"].device == t.device and back["v"].data_ptr() == back["t"].data_ptr() + 40
    assert ckptfmt.load(p, map_location="cuda")["t"].is_cuda
