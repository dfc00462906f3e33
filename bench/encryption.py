"""The cost of encryption at rest (spec section 17): save and load of one state, plain and
encrypted, in fresh processes, interleaved, medians, on each directory given (tmpfs, disk).

Each round runs, in rotating order, one fresh process per measurement:

* save_plain:     ckptfmt.save(state, path)
* save_encrypted: ckptfmt.save(state, path, encrypt_with=kek): AES-256-GCM of every chunk in
  the engine's threads, in the pass that checksums and writes it; the index encrypted
* load_plain:     ckptfmt.load(path) of a plain file
* load_encrypted: ckptfmt.load(path, decrypt_with=kek): every chunk decrypted and its tag
  checked as it is read

Saves are blocking and durable (fsync, rename, directory fsync); the state is built in the
child before the clock starts (fp32, normal with std 0.02).  Loads read a file the page cache
holds (written just before).  The primitive's speed is measured here too (AES-256-GCM through
``cryptography``'s OpenSSL, 4 MiB buffers, one core), and the target of issue 23 printed next to
the figures: with `c` cores each encrypting at `a` bytes/s, an encrypted operation can at best
reach plain / (plain + bytes / (c * a)) of the plain one's speed.

    python bench/encryption.py [--size 1G] [--rounds 5] [--dirs /dev/shm,/tmp] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, normal_state, parse_size, rotated, summarise, write_json  # noqa: E402

KINDS = ["save_plain", "save_encrypted", "load_plain", "load_encrypted"]


def child(kind: str, path: str, key_path: str, size: int) -> float:
    """One measurement in this fresh process: seconds of one save or load."""
    import ckptfmt

    with open(key_path, "rb") as fh:  # the key is read before the clock starts, as a trainer holds it
        kek = fh.read()
    encrypted = kind.endswith("encrypted")
    if kind.startswith("save"):
        state = normal_state(size)
        t = time.perf_counter()
        ckptfmt.save(state, path, encrypt_with=kek if encrypted else None)
        return time.perf_counter() - t
    t = time.perf_counter()
    out = ckptfmt.load(path, decrypt_with=kek if encrypted else None)
    took = time.perf_counter() - t
    del out
    return took


def primitive_speed(seconds: float = 1.0) -> float:
    """AES-256-GCM bytes/s of one core (cryptography, i.e. OpenSSL EVP with AES-NI), 4 MiB buffers."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    gcm = AESGCM(os.urandom(32))
    buf = os.urandom(4 << 20)
    done, n, t = 0, 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        gcm.encrypt(n.to_bytes(12, "little"), buf, None)
        done += len(buf)
        n += 1
    return done / (time.perf_counter() - t)


def measure_dir(directory: str, size_text: str, rounds: int) -> dict[str, list[float]]:
    """Interleaved rounds (round 0 warms up) on one directory: every kind's seconds."""
    work = tempfile.mkdtemp(dir=directory, prefix="ckptfmt-encbench-")
    key = os.path.join(work, "kek")
    with open(key, "wb") as fh:
        fh.write(os.urandom(32))
    paths = {"plain": os.path.join(work, "plain.ckpt"), "encrypted": os.path.join(work, "enc.ckpt")}
    times: dict[str, list[float]] = {k: [] for k in KINDS}

    def run(kind: str) -> float:
        path = paths[kind.split("_")[1]]
        argv = ["--child", kind, "--path", path, "--key", key, "--size", size_text]
        out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True, text=True)
        return float(out.stdout.strip().splitlines()[-1])

    try:
        for r in range(rounds + 1):
            # each save is followed by the load of the file it wrote (in the page cache)
            for variant in rotated(["plain", "encrypted"], r):
                s = run(f"save_{variant}")
                lo = run(f"load_{variant}")
                if r:
                    times[f"save_{variant}"].append(s)
                    times[f"load_{variant}"].append(lo)
    finally:
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)
    return times


def report(directory: str, size: int, rounds: int, times: dict[str, list[float]], aes: float) -> dict:
    cores = os.cpu_count() or 1
    med = {k: summarise(v)["median"] for k, v in times.items()}
    gib = size / (1 << 30)
    print(f"{size >> 20} MiB fp32, {directory}, {cores} cores, {rounds} rounds (medians; min-max)")
    for k in KINDS:
        print(
            f"  {k:15s} {med[k]:.3f} s  {size / med[k] / 1e9:5.2f} GB/s  ({min(times[k]):.3f}-{max(times[k]):.3f})"
        )
    out = {"dir": directory, "median": med, "times": times}
    for op in ("save", "load"):
        plain, enc = med[f"{op}_plain"], med[f"{op}_encrypted"]
        best = plain + size / (cores * aes)  # the model: the primitive spread over all cores
        target = plain / best  # the best speed ratio encrypted/plain the model allows
        reached = (plain / enc) / target
        print(
            f"  {op}: encryption costs {enc - plain:+.3f} s ({(enc - plain) / gib:+.3f} s/GiB, x{enc / plain:.2f}); "
            f"target plain/(plain + bytes/(cores x {aes / 1e9:.2f} GB/s)) = {target:.2f}; "
            f"encrypted/plain speed {plain / enc:.2f}, {reached:.2f} of the target"
        )
        out[op] = {
            "cost_s_per_gib": (enc - plain) / gib,
            "target": target,
            "ratio": plain / enc,
            "reached": reached,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dirs", default="/dev/shm,/tmp", help="comma-separated: tmpfs, then disk")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--child", default=None)
    ap.add_argument("--path", default=None)
    ap.add_argument("--key", default=None)
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.child:
        print(json.dumps(child(args.child, args.path, args.key, size)))
        return
    aes = primitive_speed()
    print(f"AES-256-GCM, one core, 4 MiB buffers: {aes / 1e9:.2f} GB/s")
    results = []
    for directory in args.dirs.split(","):
        times = measure_dir(directory, args.size, args.rounds)
        results.append(report(directory, size, args.rounds, times, aes))
    if args.out:
        doc = {
            "command": command_line(__file__, sys.argv[1:]),
            "size": size,
            "aes_gcm_one_core": aes,
            "runs": results,
        }
        write_json(args.out, doc, echo=False)


if __name__ == "__main__":
    main()
