"""ckptfmt keygen and ckptfmt sign: Ed25519 keys and signed files (spec section 16).

``keygen OUT`` writes a new private key to OUT (PEM, PKCS#8, unencrypted, mode 0600) and
its public key to OUT.pub (PEM, or an OpenSSH ``ssh-ed25519`` line with --openssh): both
or neither, never replacing a file (what it created is removed when a write fails).
``sign PATH --key PRIV`` signs a file in place through the commit protocol, without
re-encoding its data; ``sign DIR --key PRIV`` signs a checkpoint directory's commit record
(spec 16.7) without rewriting its data files.  Checking a signature is ``verify
--trusted-key``.  No key material is ever printed.
"""

from __future__ import annotations

import argparse
import os

from .exitcodes import EXIT_OK, UsageError, error_text, exit_code, require_ckptfmt
from .terminal import say


def _write_new(path: str, data: bytes, mode: int) -> tuple[int, int]:
    """Create `path` (never replacing anything, never through a link) holding `data`, durably:
    its (device, inode).  On any failure the file is removed again."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _remove_created(path, (st.st_dev, st.st_ino))
        raise
    os.close(fd)
    return st.st_dev, st.st_ino


def _remove_created(path: str, ident: tuple[int, int]) -> None:
    """Remove the file this process created at `path`, if that is still what the name holds."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _write_pair(out: str, priv: bytes, pub_path: str, pub: bytes) -> None:
    """Write both key files or neither: the private key is removed when the public one fails."""
    ident = _write_new(out, priv, 0o600)
    try:
        _write_new(pub_path, pub, 0o644)
    except BaseException:
        _remove_created(out, ident)
        raise


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
        _write_pair(out, priv, pub_path, pub)
    except OSError as e:
        say(f"error: {error_text(e, out)}", err=True)
        return exit_code(e)
    from ..files.signing import fingerprint, load_public_key

    say(f"{out}: private key; {pub_path}: public key {fingerprint(load_public_key(key))}")
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..files.names import COMMIT_NAME
    from ..files.signfile import sign_file
    from ..files.signing import load_private_key

    path = args.path
    is_dir = os.path.isdir(path)
    if is_dir and not os.path.lexists(os.path.join(path, COMMIT_NAME)):
        error = UsageError(
            f"{path}: no commit record (COMMIT): sign a checkpoint directory (a step, a DCP save), "
            "not a run directory"
        )
        say(f"error: {error}", err=True)
        return exit_code(error)
    try:
        # the key is an argument: one that cannot be read or used (missing, a FIFO, not an
        # Ed25519 private key) is a usage error (2), never a verdict on the checkpoint (1)
        key = load_private_key(args.key)
    except (OSError, ValueError, TypeError) as e:  # a CheckpointError (a FIFO) is a ValueError
        # a key given as its text (load_private_key accepts that too) is never echoed
        shown = "--key" if args.key.lstrip().startswith(("-----BEGIN", "ssh-")) else args.key
        error = UsageError(error_text(e, shown))
        say(f"error: {error}", err=True)
        return exit_code(error)
    try:
        if is_dir:
            from ..runs.signdir import sign_directory

            sign_directory(path, key, decrypt_with=args.decrypt_key)
        else:
            require_ckptfmt(path)
            sign_file(path, key, decrypt_with=args.decrypt_key)
    except (CheckpointError, OSError) as e:
        say(f"error: {error_text(e, path)}", err=True)
        return exit_code(e)
    except Exception as e:
        from .exitcodes import NotCheckpointError

        if isinstance(e, NotCheckpointError):
            say(f"error: {path}: {e}", err=True)
            return exit_code(e)
        raise
    say(f"{path}: signed")
    return EXIT_OK
