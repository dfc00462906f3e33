"""Keys and encrypted files against hostile or careless input: a key given in the wrong form
or a failing key service never has its bytes (or the data key's) repeated in an error."""

from __future__ import annotations

import base64
import secrets

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError

KEY = secrets.token_bytes(32)


def _texts(e: BaseException) -> str:
    """Everything a traceback of `e` would print: its text, repr and the chain shown with it."""
    out = []
    while e is not None:
        out += [str(e), repr(e)]
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "\n".join(out)


@pytest.mark.parametrize(
    "form",
    [
        lambda k: base64.b64encode(k).decode(),  # a key from a secret store, as text
        lambda k: k.hex() + "\n",  # hex read from a file with its line feed
        lambda k: " " + k.hex(),
        lambda k: k.hex()[:-1],  # hex with a digit lost
    ],
)
def test_a_key_given_as_text_is_never_repeated(tmp_path, form):
    p = tmp_path / "e.ckpt"
    ckptfmt.save({"a": torch.ones(4)}, p, encrypt_with=KEY)
    text = form(KEY)
    with pytest.raises(OSError) as e:
        ckptfmt.load(p, decrypt_with=text)
    shown = _texts(e.value)
    assert "cannot open the key file" in shown
    assert text.strip() not in shown and KEY.hex()[:16] not in shown


def test_a_key_file_path_that_is_not_a_file_is_refused_without_the_path(tmp_path):
    p = tmp_path / "e.ckpt"
    ckptfmt.save({"a": torch.ones(4)}, p, encrypt_with=KEY)
    with pytest.raises(ckptfmt.UnsupportedError, match="not a regular file"):
        ckptfmt.load(p, decrypt_with=str(tmp_path))


def test_a_failing_key_service_never_repeats_the_data_key(tmp_path):
    seen: list[bytes] = []

    def service(data_key: bytes) -> bytes:
        seen.append(data_key)
        raise RuntimeError(f"the key service refused to wrap {data_key.hex()}")

    with pytest.raises(CheckpointError, match=r"failed to wrap the data key \(RuntimeError\)") as e:
        ckptfmt.save({"a": torch.ones(4)}, tmp_path / "e.ckpt", encrypt_with=service)
    assert seen and seen[0].hex() not in _texts(e.value)
    assert not (tmp_path / "e.ckpt").exists()


def test_misplaced_store_credentials_are_not_repeated_by_the_lightning_plugin(tmp_path):
    # Lightning's per-call storage_options are ckptfmt's save options; credentials passed
    # there by mistake are refused by name, their values never shown
    pytest.importorskip("lightning")
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    with pytest.raises(ValueError, match="aws_secret_access_key") as e:
        CkptfmtCheckpointIO().save_checkpoint(
            {"w": torch.ones(2)}, str(tmp_path / "c.ckpt"), storage_options={"aws_secret_access_key": secret}
        )
    assert secret not in _texts(e.value)
