"""Encrypted Lightning checkpoints: ``CkptfmtCheckpointIO(encrypt_with=key)`` against the real
`lightning` and `pytorch_lightning` packages (ckptfmt's encryption, spec section 17)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
from typing import Any

import pytest
import torch
from test_lightning import (
    _boring_trainer,
    _diff,
    _final_state,
    _fit_net,
    _hparams,
    _loaders,
    _make_module_class,
)

import ckptfmt
from ckptfmt.engine import native

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None
        or importlib.util.find_spec("pytorch_lightning") is None,
        reason="needs ckptfmt[lightning] (lightning and pytorch-lightning)",
    ),
    pytest.mark.skipif(
        native.built() and not native.crypto_available() and not os.environ.get("CKPTFMT_REQUIRE_CRYPTO"),
        reason="engine built without libcrypto (CI sets CKPTFMT_REQUIRE_CRYPTO=1)",
    ),
]

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def _plugin(**kwargs: Any) -> Any:
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    return CkptfmtCheckpointIO(**kwargs)


def test_fit_writes_encrypted_checkpoints_and_resumes_only_with_the_key(tmp_path: pathlib.Path) -> None:
    """Non-blocking encrypted saves during fit; a new Trainer with the key resumes bit-exactly;
    without the key, or with another, the load and the resume raise DecryptionError."""
    import lightning.pytorch as pl

    torch.set_num_threads(1)
    full_trainer, full = _fit_net(pl, _plugin(), str(tmp_path / "full"), epochs=4)
    expected = _final_state(full_trainer, full)
    dirpath = str(tmp_path / "enc")
    _fit_net(pl, _plugin(encrypt_with=KEY, blocking=False), dirpath, epochs=2)
    last = os.path.join(dirpath, "last.ckpt")
    for name in os.listdir(dirpath):
        with pytest.raises(ckptfmt.DecryptionError):
            ckptfmt.load(os.path.join(dirpath, name))
    for plugin in (_plugin(), _plugin(decrypt_with=OTHER)):
        with pytest.raises(ckptfmt.DecryptionError) as info:
            plugin.load_checkpoint(last)
        assert isinstance(info.value, ckptfmt.CheckpointError) and last in str(info.value)
        assert KEY.hex() not in str(info.value)
    with pytest.raises(ckptfmt.DecryptionError):
        _fit_net(pl, _plugin(), dirpath, epochs=4, ckpt_path=last)
    trainer, resumed = _fit_net(pl, _plugin(encrypt_with=KEY), dirpath, epochs=4, ckpt_path=last)
    assert resumed.losses == full.losses[2 * 8 :]
    problems = _diff(expected, _final_state(trainer, resumed))
    assert problems == [], problems[:10]


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_load_from_checkpoint_after_enable_with_the_key(tmp_path: pathlib.Path, package: str) -> None:
    """LitModel.load_from_checkpoint(path) of an encrypted file: with enable(decrypt_with=key),
    also on memory:// (through the filesystem); with enable() alone, DecryptionError."""
    from ckptfmt.integrations.lightning import enable, load_from_checkpoint

    pl = importlib.import_module(package)
    net_class = _make_module_class(pl)
    model = net_class(**_hparams("objects"))
    train, _ = _loaders()
    trainer = _boring_trainer(pl, str(tmp_path), plugins=[_plugin(encrypt_with=KEY)])
    trainer.fit(model, train)
    paths = [str(tmp_path / "model.ckpt"), f"memory://{tmp_path.name}/model.ckpt"]
    for path in paths:
        trainer.save_checkpoint(path)
    try:
        enable(decrypt_with=KEY)
        for path in paths:
            loaded = net_class.load_from_checkpoint(path)
            assert loaded.hparams.data_dir == pathlib.Path("/data/set")
            assert _diff(dict(loaded.state_dict()), dict(model.state_dict())) == []
        enable()
        with pytest.raises(ckptfmt.DecryptionError):
            net_class.load_from_checkpoint(paths[0])
    finally:
        enable()
        _plugin().remove_checkpoint(paths[1])
    direct = load_from_checkpoint(net_class, paths[0], decrypt_with=KEY)
    assert _diff(dict(direct.state_dict()), dict(model.state_dict())) == []


def test_keys_are_checked_when_the_plugin_is_made() -> None:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    both = _plugin(encrypt_with=KEY, sign_with=ed25519.Ed25519PrivateKey.generate())  # spec 17.8
    assert both.encrypt_with == KEY and both.sign_with is not None
    with pytest.raises(ValueError, match="a key is 32 bytes, not 5"):
        _plugin(encrypt_with=b"short")
    plugin = _plugin(encrypt_with=KEY)
    assert plugin.decrypt_with == KEY and KEY.hex() not in repr(plugin) and str(KEY) not in repr(plugin)
