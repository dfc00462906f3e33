"""ckptfmt inspect: a file's object tree, index, metadata and referenced files, read without
its chunk data."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from typing import Any

from ..fileio import is_url
from ..format import layout as fmt
from ..format.encryption import EncryptionBlock, KeyRequired
from . import remote
from .exitcodes import EXIT_OK, KNOWN_ERRORS, error_text, exit_code, require_ckptfmt
from .runs import show_dcp
from .terminal import fail, say
from .verify import problem_dict


def encryption_info(block: EncryptionBlock | None, with_key: bool) -> dict[str, Any] | None:
    """What an encrypted file's block shows in clear (spec 17.2): never key material but the hint."""
    if block is None:
        return None
    return {
        "cipher": "AES-256-GCM",
        "key_wrap": "key" if block.wrap == 1 else "key service",
        "key_hint": block.hint.hex() if block.wrap == 1 else None,
        "index_encrypted": block.index_encrypted,
        "chunks": block.nchunks,
        "decrypted": with_key,
    }


def encryption_line(e: dict[str, Any]) -> str:
    by = f"a key with hint {e['key_hint']}" if e["key_hint"] else "a key service"
    index = "index encrypted" if e["index_encrypted"] else "index in clear"
    checked = "decrypted with the key given" if e["decrypted"] else "not decrypted: pass --decrypt-key"
    return f"encrypted: {e['cipher']} under {by}, {index}, {e['chunks']} chunks ({checked})"


def _inspect_encrypted(args: argparse.Namespace, block: EncryptionBlock) -> int:
    """inspect without the key of a file whose index is encrypted: the clear parts only."""
    import os

    info = {
        "path": args.path,
        "file_bytes": os.path.getsize(args.path),
        "encryption": encryption_info(block, False),
        "index": "encrypted: names, shapes, dtypes and metadata need the key (--decrypt-key)",
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    say(f"{args.path}: ckptfmt, {info['file_bytes']} bytes")
    say(encryption_line(info["encryption"]))  # type: ignore[arg-type]
    say(f"index: {info['index']}")
    return EXIT_OK


def _value_text(f: Any, i: int) -> str:
    """A scalar node's value as inspect shows it, built without torch: a dtype and a device as
    torch prints them."""
    from ..format.decode import decode
    from ..format.render import short_repr

    node = f.tree.nodes[i]
    if node[0] == "dtype":
        return f"torch.{node[1]}"
    if node[0] == "device":
        kind, _, index = node[1].partition(":")
        return f"device(type={kind!r}" + (f", index={index})" if index else ")")
    return short_repr(decode(f.tree, i, lambda s: None, f.path), 60)  # type: ignore[arg-type, return-value]


def _inspect_tree(f: Any, max_nodes: int) -> tuple[list[dict[str, Any]], bool]:
    """A row for each of the first `max_nodes` nodes (all when 0), parents before children, and
    whether there are more."""
    from ..format import dtypes, tree

    rows = []
    chunks = f.chunks
    paths = tree.iter_paths(f.tree, f.tree.root, "state")
    for path, i in itertools.islice(paths, max_nodes or None):
        node = f.tree.nodes[i]
        kind = node[0]
        row: dict[str, Any] = {"key": path, "type": kind, "depth": f.tree.depth_of(i)}
        if kind in ("tensor", "ndarray"):
            m = node[1]
            rec = f.storages[m["storage"]]
            own = range(rec.first_chunk, rec.first_chunk + rec.n_chunks)
            stored = sum(chunks[k].stored_len for k in own)
            codecs = sorted({fmt.CODEC_NAMES[chunks[k].codec] for k in own}) or ["raw"]
            itemsize = (
                dtypes.torch_itemsize(m["dtype"]) if kind == "tensor" else dtypes.numpy_itemsize(m["dtype"])
            )
            numel = math.prod(m["shape"])
            row.update(
                dtype=m["dtype"],
                shape=m["shape"],
                bytes=numel * itemsize,
                storage=m["storage"],
                storage_bytes=rec.nbytes,
                stored_bytes=stored,
                codec="+".join(codecs),
                ratio=round(rec.nbytes / stored, 3) if stored else None,
                device=rec.device,
            )
            if f.has_digests:  # an incremental file: how much of it lies in referenced files
                row["external_chunks"] = sum(1 for k in own if chunks[k].source >= 0)
                row["chunks"] = len(own)
        elif kind in ("list", "tuple"):
            row["len"] = len(node[1])
        elif kind in ("dict", "odict"):
            row["len"] = len(node[1])
        elif kind in ("int", "float", "bool", "str", "none", "dtype", "device", "complex"):
            row["value"] = _value_text(f, i)
        rows.append(row)
    return rows, next(paths, None) is not None


def _inspect_externals(f: Any) -> dict[str, Any]:
    """The referenced files of an incremental checkpoint and what lies in each (spec section 12)."""
    per = [{"chunks": 0, "raw_bytes": 0, "stored_bytes": 0} for _ in f.externals]
    for ch in f.chunks:
        if ch.source >= 0:
            per[ch.source]["chunks"] += 1
            per[ch.source]["raw_bytes"] += ch.raw_len
            per[ch.source]["stored_bytes"] += ch.stored_len
    externals = [
        {"path": ext.rel, "resolved": ext.name, "file_id": ext.file_id.hex(), "file_length": ext.length, **n}
        for ext, n in zip(f.externals, per)
    ]
    return {
        "content_digests": f.has_digests,
        "externals": externals,
        "external_chunks": sum(n["chunks"] for n in per),
        "external_bytes": sum(n["raw_bytes"] for n in per),
    }


def _print_externals(info: dict[str, Any]) -> None:
    if not info["externals"]:
        say("externals: none (self-contained, with content digests for incremental saves)")
        return
    say(
        f"externals: {info['external_chunks']} of {info['chunks']} chunks ({info['external_bytes']} bytes) "
        f"lie in {len(info['externals'])} referenced file(s)"
    )
    for e, x in enumerate(info["externals"]):
        say(
            f"  [{e}] {x['path']} (file id {x['file_id']}, {x['file_length']} bytes): "
            f"{x['chunks']} chunks, {x['raw_bytes']} bytes"
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    """The tree and the index; like verify --quick, the referenced files of an incremental
    checkpoint are checked too (present, the recorded ones), but no chunk data is read."""
    from ..files.reader import CheckpointFile
    from ..files.signing import fingerprint
    from ..files.verify import problem_of

    decrypt = getattr(args, "decrypt_key", None)
    try:
        if is_url(args.path) and not remote.is_object(args.path) and remote.has_record(args.path):
            return show_dcp(args.path, args.json)  # a DCP checkpoint's prefix: its files and record
        require_ckptfmt(args.path)
        with CheckpointFile(args.path, decrypt_with=decrypt, ciphertext_only=decrypt is None) as f:
            rows, truncated = _inspect_tree(f, args.max_nodes)
            problems = f.external_problems()
            info = {
                "path": args.path,
                "file_bytes": f.prologue.file_length,
                "format": f"{f.prologue.major}.{f.prologue.minor}",
                "chunk_size": f.chunk_size,
                "chunks": len(f.chunks),
                "storages": len(f.storages),
                "producer": f.producer,
                "metadata": f.metadata,
                "source_devices": f.source_devices,
                # the signer's key as its fingerprint; inspect does not check the signature
                "signed_by": None if f.index.signature is None else fingerprint(f.index.signature.public_key),
                "encryption": encryption_info(f.index.encryption, decrypt is not None),
                **_inspect_externals(f),
                "problems": [problem_dict(problem_of(p)) for p in problems],
                "nodes": len(f.tree.nodes),
                "tree": rows,
                # only the first --max-nodes nodes are listed
                "tree_truncated": truncated,
            }
    except KeyRequired as e:  # an encrypted index, no key: what is in clear
        return _inspect_encrypted(args, e.block)
    except KNOWN_ERRORS as e:
        return fail(e, args.path)
    status = exit_code(problems[0]) if problems else EXIT_OK
    if args.json:
        print(json.dumps(info, indent=2))
        return status
    say(
        f"{args.path}: ckptfmt {info['format']}, {info['file_bytes']} bytes, {info['storages']} storages "
        f"in {info['chunks']} chunks of up to {info['chunk_size']} bytes"
    )
    say("producer: " + ", ".join(f"{k} {v}" for k, v in info["producer"].items()))
    say("metadata: " + (json.dumps(info["metadata"]) if info["metadata"] else "(none)"))
    if info["encryption"]:
        say(encryption_line(info["encryption"]))
    if info["signed_by"]:
        say(f"signed by key {info['signed_by']} (not checked here: verify --trusted-key checks it)")
    if info["content_digests"]:
        _print_externals(info)
    for r in rows:
        depth = r["depth"]
        name = r["key"] if depth == 0 else "  " * (depth - 1) + r["key"][r["key"].rfind("[") :]
        if r["type"] in ("tensor", "ndarray"):
            ratio = f" x{r['ratio']:.2f}" if r["codec"] != "raw" and r["ratio"] else ""
            ext = (
                f", {r['external_chunks']}/{r['chunks']} chunks external" if r.get("external_chunks") else ""
            )
            say(
                f"{name}: {r['type']} {r['dtype']} {list(r['shape'])} {r['bytes']} B "
                f"{r['codec']}{ratio} (storage {r['storage']}, {r['device']}{ext})"
            )
        elif "len" in r:
            say(f"{name}: {r['type']} ({r['len']})")
        elif "value" in r:
            say(f"{name}: {r['value']}")
        else:
            say(f"{name}: {r['type']}")
    if truncated:
        say(
            f"... the first {len(rows)} nodes shown, of {info['nodes']} in the file (dict keys "
            "included): --max-nodes N shows more, --max-nodes 0 all"
        )
    if problems:  # after the tree, which shows what the referenced files should hold
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        say(f"error: {error_text(problems[0], args.path)}{more}", err=True)
    return status
