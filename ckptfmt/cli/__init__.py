"""The ckptfmt command line: verify, ls, inspect, consolidate, convert, diff, info, keygen, sign.

Results go to stdout, diagnostics to stderr (one line naming the path); --json prints
exactly one JSON document.  Exit status, the same for every command (EXIT_CODES): 0
success, 1 a file is damaged, incomplete, unsupported or over a limit, or the files
differ (diff), 2 usage error, a path that is missing, unreadable or not a ckptfmt
file, or an object store that refuses or fails a request (never a file's damage: verify
lists such a path as unreadable).  ERROR_EXIT_CODES (cli.exitcodes) is the one table from errors to exit statuses.

This module wires the parser; each command group has its module: verify, runs (ls),
inspect, convert (convert, consolidate), diff, info, signing (keygen, sign).  exitcodes
and terminal are what they share: the statuses and the terminal-safe output.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from .. import __version__
from .exitcodes import EXIT_CODES, EXIT_OK, UsageError, exit_code
from .terminal import say

__all__ = ["build_parser", "main"]


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The function of a command, its module imported only when the command runs: commands
    that build tensors (convert, consolidate, diff, info) import torch, and the others (verify,
    ls, inspect, keygen, sign) must not pay for it."""

    def run(args: argparse.Namespace) -> int:
        fn: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(f".{module}", __name__), name
        )
        return fn(args)

    run.__name__ = name
    return run


def _count(text: str) -> int:
    """A non-negative integer option (argparse's type)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, not {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    def sub(name: str, help_: str) -> argparse.ArgumentParser:
        return subs.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    ap = argparse.ArgumentParser(
        prog="ckptfmt",
        description="Check, inspect and convert ckptfmt checkpoints.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"ckptfmt {__version__}")
    subs = ap.add_subparsers(dest="command", metavar="COMMAND")
    v = sub(
        "verify",
        "Check files: structure, index and every chunk's checksum and size.  A run directory "
        "(or one step directory) is checked step by step: its commit record and every file it names.",
    )
    v.add_argument("paths", nargs="+", metavar="PATH")
    v.add_argument("--quick", action="store_true", help="check structure and index only, not the chunks")
    v.add_argument("--json", action="store_true", help="print one JSON document")
    v.add_argument("--step", type=int, default=None, help="with a run directory: only this step")
    v.add_argument(
        "--trusted-key",
        action="append",
        default=None,
        metavar="PUB",
        help="require a signature by this Ed25519 public key (PEM or OpenSSH; repeatable): "
        "a file that is unsigned, signed by another key or changed fails (exit 1); for a "
        "directory, each checkpoint's commit record and every file it names",
    )
    v.add_argument(
        "--decrypt-key",
        default=None,
        metavar="KEYFILE",
        help="decrypt encrypted files with this key file (32 bytes, or 64 hex digits): every GCM tag is "
        "checked too; without it an encrypted file is checked only as far as its clear parts allow",
    )
    v.set_defaults(fn=_command("verify", "cmd_verify"))
    ls = sub("ls", "List a run directory's checkpoints: step, complete or not, size, age, metrics.")
    ls.add_argument("dir", metavar="DIR")
    ls.add_argument("--json", action="store_true", help="print one JSON document")
    ls.set_defaults(fn=_command("runs", "cmd_ls"))
    i = sub("inspect", "Show the object tree, dtypes, shapes, sizes, codecs and metadata.")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--json", action="store_true", help="print one JSON document")
    i.add_argument(
        "--decrypt-key",
        default=None,
        metavar="KEYFILE",
        help="the key file of an encrypted file; without it only what is in clear is shown",
    )
    i.add_argument(
        "--max-nodes",
        type=_count,
        default=1000,  # a file may hold millions of nodes: all of 10^6 took over 20 s to show
        metavar="N",
        help="show the first N nodes of the tree (default 1000; 0: all of them)",
    )
    i.set_defaults(fn=_command("inspect", "cmd_inspect"))
    c = sub(
        "convert",
        "Convert torch.save or safetensors files to ckptfmt, or ckptfmt to safetensors "
        "(the direction follows the source's format).",
    )
    c.add_argument("src", metavar="SRC", help="a file, or a torch.distributed.checkpoint directory")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--compression", choices=["zstd"], default=None, help="compress chunks (to ckptfmt)")
    c.add_argument("--level", type=int, default=None, help="zstd level (default 1)")
    c.add_argument(
        "--decrypt-key",
        default=None,
        metavar="KEYFILE",
        help="a torch.distributed.checkpoint directory saved encrypted: its key file (the file "
        "written is encrypted under it too)",
    )
    c.set_defaults(fn=_command("convert", "cmd_convert"))
    k = sub(
        "consolidate",
        "Write a self-contained copy of a checkpoint: the chunks an incremental checkpoint refers to "
        "are read (and verified) from the files they lie in and stored in the copy.",
    )
    k.add_argument("src", metavar="IN")
    k.add_argument("dst", metavar="OUT")
    k.add_argument("--compression", choices=["zstd"], default=None, help="compress the copy's chunks")
    k.add_argument("--level", type=int, default=None, help="zstd level (default 1)")
    k.add_argument("--json", action="store_true", help="print one JSON document")
    k.add_argument(
        "--decrypt-key",
        default=None,
        metavar="KEYFILE",
        help="an encrypted checkpoint's key file (the copy is encrypted under it too)",
    )
    k.set_defaults(fn=_command("convert", "cmd_consolidate"))
    d = sub("diff", "Compare two checkpoints: keys, types, shapes, dtypes and values.")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    d.add_argument("--json", action="store_true", help="print one JSON document")
    d.set_defaults(fn=_command("diff", "cmd_diff"))
    n = sub("info", "Show package, format and library versions and the active backend.")
    n.add_argument("--json", action="store_true", help="print one JSON document")
    n.set_defaults(fn=_command("info", "cmd_info"))
    g = sub(
        "keygen",
        "Make an Ed25519 key pair for signing: OUT (private, mode 0600) and OUT.pub; with --encryption "
        "a key file for encrypted files instead (OUT, mode 0600, 64 hex digits).",
    )
    g.add_argument("out", metavar="OUT")
    g.add_argument("--openssh", action="store_true", help="OpenSSH encodings instead of PEM")
    g.add_argument(
        "--encryption",
        action="store_true",
        help="a random 32-byte key-encryption key for encrypt_with / --decrypt-key (spec section 17)",
    )
    g.set_defaults(fn=_command("signing", "cmd_keygen"))
    s = sub(
        "sign",
        "Sign a file with an Ed25519 private key, in place and atomically, without re-encoding its "
        "data (an existing signature is replaced); or a checkpoint directory (a step, a DCP save), "
        "whose commit record is signed with every file's SHA-256, its data files unchanged.",
    )
    s.add_argument("path", metavar="PATH|DIR")
    s.add_argument("--key", required=True, metavar="PRIV", help="the private key (PEM or OpenSSH)")
    s.add_argument(
        "--decrypt-key",
        default=None,
        metavar="KEYFILE",
        help="an encrypted file whose index is encrypted: its key file, to find its chunks (the file "
        "is signed over its ciphertext, not re-encrypted; not needed when its index is in clear); "
        "for an encrypted checkpoint directory, the key its files are verified with before signing",
    )
    s.set_defaults(fn=_command("signing", "cmd_sign"))
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors and 0 for --help
        return int(e.code or 0)
    if not getattr(args, "fn", None):
        ap.print_help(sys.stderr)
        return exit_code(UsageError("no command given"))
    if getattr(args, "level", None) is not None and not args.compression:
        error = UsageError("--level needs --compression zstd")
        say(f"error: {error}", err=True)
        return exit_code(error)
    try:
        return int(args.fn(args))
    except BrokenPipeError:
        return EXIT_OK
