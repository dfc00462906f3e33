"""atheris fuzz target for the reader: any input gives a state or a CheckpointError.

Short run (CI):   python tests/fuzz/fuzz_reader.py -max_total_time=60
Long run:         python tests/fuzz/fuzz_reader.py -max_total_time=36000 -jobs=2
Crashes are written as crash-* files; minimise them into tests/corpus/ with the
expected error in make_corpus.py.

Half of the inputs are used as files as they are.  The other half are "sealed":
the input is split into an index and a data section and assembled into a file
with correct prologue, footer, index and chunk checksums, so mutations reach the
JSON, chunk-table and object-tree validation instead of stopping at a checksum.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import atheris
import numpy  # noqa: F401 - imported first so that only ckptfmt is instrumented
import torch  # noqa: F401
import xxhash  # noqa: F401
import zstandard  # noqa: F401

with atheris.instrument_imports(include=["ckptfmt"]):
    import ckptfmt
    from ckptfmt.errors import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "corpus"))
from make_corpus import FID, build, chunk_check  # noqa: E402

PATH = os.path.join(tempfile.gettempdir(), f"ckptfmt-fuzz-{os.getpid()}.ckpt")


def seal(data: bytes) -> bytes:
    """Assemble the input into a file whose checksums are all correct."""
    split = data[0] if data else 0
    payload, index_bytes = data[1 : 1 + split * 8], data[1 + split * 8 :]
    try:
        index = json.loads(index_bytes)
    except (ValueError, RecursionError):
        index = None
    if isinstance(index, dict) and isinstance(index.get("chunks"), list):
        # recompute checksums of records that point into the payload
        for k, rec in enumerate(index["chunks"]):
            if isinstance(rec, list) and len(rec) == 7 and all(type(x) is int for x in rec[:6]):
                off, slen = rec[0], rec[1]
                if 64 <= off and 0 <= slen and off - 64 + slen <= len(payload):
                    stored = payload[off - 64 : off - 64 + slen]
                    rec[6] = chunk_check(FID, k, off, stored, rec[2], rec[3], rec[4], rec[5])
        index_bytes = json.dumps(index).encode()
    padded = payload + bytes(-len(payload) % 64)  # the index starts 64-aligned
    return build(index_bytes=index_bytes, payloads=[], data_override=lambda d: d.extend(padded))


def test_one(data: bytes) -> None:
    if data[:1] == b"S":
        data = seal(data[1:])
    with open(PATH, "wb") as f:
        f.write(data)
    try:
        ckptfmt.load(PATH)
    except CheckpointError:
        pass
    try:
        with ckptfmt.open(PATH) as r:
            for k in r.keys():
                r.get(k, map_location="meta")
    except CheckpointError:
        pass
    report = ckptfmt.verify(PATH)
    assert isinstance(report.ok, bool)


def write_sealed_seeds(folder: str) -> None:
    """Seeds in the sealed form: "S", payload length / 8, payload, index JSON."""
    from make_corpus import RAW16, base_index, tensor_node

    variants = [
        base_index(),
        base_index()
        | {
            "nodes": [
                ["str", "w"],
                tensor_node(shape=[2, 2], stride=[2, 1]),
                ["str", "n"],
                ["int", "-1f"],
                ["dict", [[0, 1], [2, 3]]],
            ]
        },
        base_index()
        | {"storages": [], "nodes": [["float", "000000000000f03f"], ["bytes", "AAE="], ["tuple", [0, 1]]]},
    ]
    for i, index in enumerate(variants):
        if index["storages"]:
            index["chunks"] = [[64, 16, 16, 0, 0, 0, "0" * 16]]
            payload = RAW16
        else:
            index["chunks"] = []
            payload = b""
        with open(os.path.join(folder, f"sealed-{i}"), "wb") as f:
            f.write(b"S" + bytes([len(payload) // 8]) + payload + json.dumps(index).encode())


def main() -> None:
    argv = list(sys.argv)
    seeds = [a for a in argv[1:] if not a.startswith("-")]
    if not seeds:
        work = tempfile.mkdtemp(prefix="ckptfmt-fuzz-corpus-")
        write_sealed_seeds(work)
        argv += [work, os.path.join(HERE, "..", "corpus"), os.path.join(HERE, "..", "golden")]
    atheris.Setup(argv, test_one)
    try:
        atheris.Fuzz()
    finally:
        if os.path.exists(PATH):
            os.unlink(PATH)


if __name__ == "__main__":
    main()
