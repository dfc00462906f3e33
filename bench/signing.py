"""The cost of signing (spec section 16): save and load of one state, plain and signed, in
fresh processes, interleaved, medians.

Each round runs, in rotating order, one fresh process per measurement:

* save_plain:  ckptfmt.save(state, path)
* save_signed: ckptfmt.save(state, path, sign_with=key): SHA-256 of every chunk in the
  engine's threads, the signature block, Ed25519
* load_plain:  ckptfmt.load(path) of the signed file (a reader that demands no signature)
* load_signed: ckptfmt.load(path, trusted_keys=[pub]): the signature checked before any
  chunk, every chunk's SHA-256 as it is read

Saves are blocking and durable (fsync, rename, directory fsync); the state is built in the
child before the clock starts (fp32, normal with std 0.02).  Loads read a file the page
cache holds (the save before it wrote it).  The model of issue 23 is printed next to the
figures: with `c` cores each hashing at `h` bytes/s (SHA-256, one core, OpenSSL EVP, 4 MiB
chunks), a signed operation can at best take `plain + bytes / (c * h)`.

    python bench/signing.py [--size 1G] [--rounds 5] [--dir /dev/shm] [--sha-speed 1.43e9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import normal_state  # noqa: E402

KINDS = ["save_plain", "save_signed", "load_plain", "load_signed"]


def child(kind: str, path: str, key_path: str, size: int) -> float:
    import ckptfmt

    if kind.startswith("save"):
        state = normal_state(size)
        kw = {"sign_with": key_path} if kind == "save_signed" else {}
        if kw:  # the key is read before the clock starts, as a trainer holds it
            from ckptfmt.files.signing import load_private_key

            kw = {"sign_with": load_private_key(key_path)}
        t = time.perf_counter()
        ckptfmt.save(state, path, **kw)
        return time.perf_counter() - t
    kw = {}
    if kind == "load_signed":
        from ckptfmt.files.signing import load_private_key

        kw = {"trusted_keys": [load_private_key(key_path).public_key()]}
    t = time.perf_counter()
    out = ckptfmt.load(path, **kw)
    took = time.perf_counter() - t
    del out
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--sha-speed", type=float, default=1.43e9, help="SHA-256 bytes/s of one core")
    ap.add_argument("--child", default=None)
    ap.add_argument("--path", default=None)
    ap.add_argument("--key", default=None)
    args = ap.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    size = int(args.size[:-1]) * units[args.size[-1]] if args.size[-1] in units else int(args.size)
    if args.child:
        print(json.dumps(child(args.child, args.path, args.key, size)))
        return
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    work = tempfile.mkdtemp(dir=args.dir, prefix="ckptfmt-signbench-")
    key = os.path.join(work, "key")
    with open(key, "wb") as fh:
        fh.write(
            ed25519.Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    path = os.path.join(work, "state.ckpt")
    times: dict[str, list[float]] = {k: [] for k in KINDS}

    def run(kind: str) -> float:
        out = subprocess.run(
            [sys.executable, __file__, "--child", kind, "--path", path, "--key", key, "--size", args.size],
            check=True,
            capture_output=True,
            text=True,
        )
        return float(out.stdout.strip().splitlines()[-1])

    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            order = [("save_plain", "load_plain"), ("save_signed", "load_signed")]
            if r % 2:
                order.reverse()
            for save_kind, load_kind in order:
                s = run(save_kind)
                # loads read the signed file: save_signed before each pair of loads
                if save_kind != "save_signed":
                    run("save_signed")
                loads = [load_kind, "load_signed" if load_kind == "load_plain" else "load_plain"]
                if r % 2:
                    loads.reverse()
                got = {k: run(k) for k in loads}
                if r:
                    times[save_kind].append(s)
                    for k, v in got.items():
                        times[k].append(v)
    finally:
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)
    cores = os.cpu_count() or 1
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = size / (1 << 30)
    print(f"{args.size} fp32, {args.dir}, {cores} cores, {args.rounds} rounds (medians; min-max)")
    for k in KINDS:
        print(
            f"  {k:12s} {med[k]:.3f} s  {size / med[k] / 1e9:5.2f} GB/s  ({min(times[k]):.3f}-{max(times[k]):.3f})"
        )
    for op in ("save", "load"):
        plain, signed = med[f"{op}_plain"], med[f"{op}_signed"]
        bound = plain + size / (cores * args.sha_speed)
        print(
            f"  {op}: signing costs {signed - plain:+.3f} s ({(signed - plain) / gib:+.3f} s/GiB, "
            f"x{signed / plain:.2f}); the model's best {bound:.3f} s; signed reaches "
            f"{bound / signed:.2f} of it"
        )
    print(json.dumps({"size": size, "dir": args.dir, "cores": cores, "times": times, "median": med}))


if __name__ == "__main__":
    main()
