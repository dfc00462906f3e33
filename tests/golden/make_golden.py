"""Writes the golden files.  Run only on purpose, when the format gains a version.

    python tests/golden/make_golden.py [NAME ...]

Files written here are checked in and must keep loading to `expected()` forever.
"""

from __future__ import annotations

import collections
import math
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def expected() -> dict[str, object]:
    """The states stored in the golden files, built from constants only."""
    base = torch.arange(48, dtype=torch.float32) / 7
    od = collections.OrderedDict([("weight", base.view(6, 8)), ("bias", base[:8])])
    od._metadata = collections.OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]
    tensors = {
        "model": od,
        "t_view": base.view(6, 8).t()[2:5],
        "bf16": (torch.arange(64, dtype=torch.float32) - 20).to(torch.bfloat16).view(8, 8),
        "f16": torch.linspace(-3, 3, 33, dtype=torch.float16),
        "f64": torch.tensor([0.1, -0.0, math.inf, 1e-310], dtype=torch.float64),
        "f8": torch.tensor([0.5, -2.0, 448.0], dtype=torch.float32).to(torch.float8_e4m3fn),
        "c64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "bool": torch.tensor([True, False, True]),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
        "scalar": torch.tensor(3.25),
        "zeros": torch.zeros(2048),
        "ramp": torch.arange(6000, dtype=torch.float32).bfloat16(),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "step": torch.tensor(12.0, requires_grad=False),
    }
    nan_payload = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    values = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**127 + 5, -(2**70)],
        "floats": [0.5, -0.0, math.inf, nan_payload],
        "complex": 1.5 - 2j,
        "text": "héllo ✓",
        "blob": b"\x00\x01\xfe\xff",
        "tuple": (1, ("a", None)),
        "keys": {1: "one", 2.5: "x", (1, "t"): "tuple", None: "none", False: "f"},
        "dtype": torch.bfloat16,
        "device": torch.device("cuda", 3),
        "size": torch.Size([2, 3]),
        "np": np.arange(6, dtype="<i4").reshape(2, 3),
        "np_scalar": np.float64(2.5),
    }
    return {"values": values, "tensors": tensors}


FILES = {
    "v1_0_raw.ckpt": {"compression": None},
    "v1_0_zstd.ckpt": {"compression": "zstd"},
    # required feature bit 1 (spec section 16), signed with TEST_KEY
    "v1_0_signed.ckpt": {"compression": "zstd", "sign_with": "signing_test_key.pem"},
    # required feature bit 2 (spec section 17), encrypted under ENCRYPTION_TEST_KEY, index too
    "v1_0_encrypted.ckpt": {"compression": "zstd", "encrypt_with": "encryption_test_key.hex"},
    # required feature bits 1 and 2 (spec section 17.8): encrypted under ENCRYPTION_TEST_KEY,
    # then signed with TEST_KEY
    "v1_0_signed_encrypted.ckpt": {
        "compression": "zstd",
        "sign_with": "signing_test_key.pem",
        "encrypt_with": "encryption_test_key.hex",
    },
}

#: The golden encrypted file's key-encryption key: the bytes 32, 33, ..., 63, in
#: encryption_test_key.hex as 64 hex digits.  A published test key, for test vectors only.
ENCRYPTION_TEST_KEY = bytes(range(32, 64))

#: The golden signed file's key: Ed25519 from the seed bytes 0, 1, ..., 31.  A published
#: test key, for test vectors only: it proves nothing about who wrote a file.
TEST_KEY_SEED = bytes(range(32))


def write_test_key() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.from_private_bytes(TEST_KEY_SEED)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with open(os.path.join(HERE, "signing_test_key.pem"), "wb") as fh:
        fh.write(pem)
    with open(os.path.join(HERE, "signing_test_key.pem.pub"), "wb") as fh:
        fh.write(pub)


def main(only: list[str] | None = None) -> None:
    """Write the golden files (`only`: just these, e.g. a file a new feature adds)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    import ckptfmt

    os.environ["SOURCE_DATE_EPOCH"] = "1764460800"
    for i, (name, kw) in enumerate(FILES.items()):
        if only and name not in only:
            continue
        os.environ["CKPTFMT_FILE_ID"] = f"{i:02x}" * 16
        kw = dict(kw)
        if "sign_with" in kw:
            write_test_key()
            kw["sign_with"] = os.path.join(HERE, kw["sign_with"])
        if "encrypt_with" in kw:
            kw["encrypt_with"] = os.path.join(HERE, kw["encrypt_with"])
            with open(kw["encrypt_with"], "w") as fh:
                fh.write(ENCRYPTION_TEST_KEY.hex() + "\n")
        ckptfmt.save(expected(), os.path.join(HERE, name), metadata={"golden": name}, chunk_size=4096, **kw)  # type: ignore[arg-type]
        print("wrote", name)


if __name__ == "__main__":
    main(sys.argv[1:] or None)
