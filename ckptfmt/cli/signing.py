"""ckptfmt keygen and ckptfmt sign: Ed25519 keys and signed files (spec section 16).

``keygen OUT`` writes a new private key to OUT (PEM, PKCS#8, unencrypted, mode 0600, never
replacing a file) and its public key to OUT.pub (PEM, or an OpenSSH ``ssh-ed25519`` line
with --openssh).  ``sign PATH --key PRIV`` signs a file in place through the commit
protocol, without re-encoding its data.  Checking a signature is ``verify --trusted-key``.
No key material is ever printed.
"""

from __future__ import annotations

import argparse
import os

from .exitcodes import EXIT_OK, UsageError, error_text, exit_code, require_ckptfmt
from .terminal import say


def _write_new(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _keygen_encryption(out: str) -> int:
    """A key file for encrypted files (files/encryption.py): never replaces a file."""
    from ..files.encryption import generate_key_file

    try:
        generate_key_file(out)
    except FileExistsError:
        error = UsageError(f"{out}: exists; keygen never replaces a file")
        say(f"error: {error}", err=True)
        return exit_code(error)
    say(f"wrote {out} (a key-encryption key for encrypt_with / --decrypt-key; keep it secret)")
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    if getattr(args, "encryption", False):
        return _keygen_encryption(args.out)
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        error = UsageError("keygen needs the cryptography package (pip install cryptography)")
        say(f"error: {error}", err=True)
        return exit_code(error)
    out = args.out
    pub_path = out + ".pub"
    for p in (out, pub_path):
        if os.path.lexists(p):
            error = UsageError(f"{p}: exists; keygen never replaces a file")
            say(f"error: {error}", err=True)
            return exit_code(error)
    key = ed25519.Ed25519PrivateKey.generate()
    if args.openssh:
        priv = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        pub = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        pub += b" ckptfmt\n"
    else:
        priv = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        pub = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    try:
        _write_new(out, priv, 0o600)
        _write_new(pub_path, pub, 0o644)
    except OSError as e:
        say(f"error: {error_text(e, out)}", err=True)
        return exit_code(e)
    from ..files.signing import fingerprint, load_public_key

    say(f"{out}: private key; {pub_path}: public key {fingerprint(load_public_key(key))}")
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..files.signfile import sign_file

    path = args.path
    if os.path.isdir(path):
        error = UsageError(f"{path}: signing a directory (a multi-file checkpoint) is not implemented yet")
        say(f"error: {error}", err=True)
        return exit_code(error)
    try:
        require_ckptfmt(path)
        sign_file(path, args.key)
    except (CheckpointError, OSError) as e:
        say(f"error: {error_text(e, path)}", err=True)
        return exit_code(e)
    except (ValueError, TypeError) as e:  # the key: not a PEM/OpenSSH Ed25519 private key
        error = UsageError(f"{args.key}: {e}")
        say(f"error: {error}", err=True)
        return exit_code(error)
    except Exception as e:
        from .exitcodes import NotCheckpointError

        if isinstance(e, NotCheckpointError):
            say(f"error: {path}: {e}", err=True)
            return exit_code(e)
        raise
    say(f"{path}: signed")
    return EXIT_OK
