"""The cost of encryption at rest (spec section 17): save and load of one state, plain and
encrypted, in fresh processes, interleaved, medians, on each directory given (tmpfs, disk).

Each round runs, in rotating order, one fresh process per measurement:

* save_plain:     ckptfmt.save(state, path)
* save_encrypted: ckptfmt.save(state, path, encrypt_with=kek): AES-256-GCM of every chunk in
  the engine's threads, in the pass that checksums and writes it; the index encrypted
* load_plain:     ckptfmt.load(path) of a plain file
* load_encrypted: ckptfmt.load(path, decrypt_with=kek): every chunk decrypted and its tag
  checked as it is read
* save_signed_encrypted: ckptfmt.save(state, path, sign_with=priv, encrypt_with=kek): each
  chunk encrypted and the SHA-256 of its ciphertext taken in the same pass (spec 17.8)
* load_signed_encrypted: ckptfmt.load(path, trusted_keys=[pub], decrypt_with=kek): the
  signature checked, then each chunk's SHA-256 and tag as it is read
* save_tensorizer_plain / save_tensorizer_encrypted (when the ``tensorizer`` package is
  installed): tensorizer's TensorSerializer.write_state_dict of the same state, without and
  with its encryption (``EncryptionParams(kek)``: libsodium, per chunk), then an fsync of the
  file, as ckptfmt's saves are durable; load_tensorizer_*: TensorDeserializer (lazy_load=False,
  ``DecryptionParams.from_key(kek)``), every tensor read into memory

Saves are blocking and durable (fsync, rename, directory fsync); the state is built in the
child before the clock starts (fp32, normal with std 0.02).  Loads read a file the page cache
holds (written just before).  The primitive's speed is measured here too (AES-256-GCM through
``cryptography``'s OpenSSL, 4 MiB buffers, one core), and the target of issue 23 printed next to
the figures: with `c` cores each encrypting at `a` bytes/s, an encrypted operation can at best
reach plain / (plain + bytes / (c * a)) of the plain one's speed; signed and encrypted, with
SHA-256 at `h` bytes/s a core, plain / (plain + bytes / (c * a) + bytes / (c * h)).

    python bench/encryption.py [--size 1G] [--rounds 5] [--dirs /dev/shm,/tmp] [--out FILE]
                               [--variants plain,encrypted,...]
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
from common import command_line, fsync_path, normal_state, parse_size, rotated, summarise, write_json  # noqa: E402

VARIANTS = ["plain", "encrypted", "signed_encrypted"]
#: tensorizer's own format, plain and encrypted (measured when the package is installed)
TENSORIZER = ["tensorizer_plain", "tensorizer_encrypted"]
KINDS = [f"{op}_{v}" for op in ("save", "load") for v in VARIANTS + TENSORIZER]


def have_tensorizer() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorizer") is not None


def tensorizer_child(kind: str, path: str, kek: bytes, size: int) -> float:
    """One tensorizer save (then an fsync of the file) or load of the same state."""
    from tensorizer import DecryptionParams, EncryptionParams, TensorDeserializer, TensorSerializer

    encrypted = kind.endswith("_encrypted")
    if kind.startswith("save"):
        state = normal_state(size)
        t = time.perf_counter()
        writer = TensorSerializer(path, encryption=EncryptionParams(kek) if encrypted else None)
        writer.write_state_dict(state)
        writer.close()
        fsync_path(path)
        return time.perf_counter() - t
    t = time.perf_counter()
    reader = TensorDeserializer(
        path, device="cpu", encryption=DecryptionParams.from_key(kek) if encrypted else None
    )
    out = dict(reader)
    took = time.perf_counter() - t
    reader.close()
    del out
    return took


#: the signing key of the signed variant: a fixed test seed (the bench proves nothing about who wrote it)
SIGNING_SEED = bytes(range(32))


def child(kind: str, path: str, key_path: str, size: int) -> float:
    """One measurement in this fresh process: seconds of one save or load."""
    import ckptfmt

    with open(key_path, "rb") as fh:  # the keys are read before the clock starts, as a trainer holds them
        kek = fh.read()
    if "tensorizer" in kind:
        return tensorizer_child(kind, path, kek, size)
    encrypted = kind.endswith("encrypted")
    priv = pub = None
    if kind.endswith("signed_encrypted"):
        from cryptography.hazmat.primitives.asymmetric import ed25519

        priv = ed25519.Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)
        pub = [priv.public_key()]
    if kind.startswith("save"):
        state = normal_state(size)
        t = time.perf_counter()
        ckptfmt.save(state, path, encrypt_with=kek if encrypted else None, sign_with=priv)
        return time.perf_counter() - t
    t = time.perf_counter()
    out = ckptfmt.load(path, decrypt_with=kek if encrypted else None, trusted_keys=pub)
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


def sha256_speed(seconds: float = 1.0) -> float:
    """SHA-256 bytes/s of one core (hashlib, i.e. OpenSSL), 4 MiB buffers."""
    import hashlib

    buf = os.urandom(4 << 20)
    done, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        hashlib.sha256(buf).digest()
        done += len(buf)
    return done / (time.perf_counter() - t)


def measure_dir(directory: str, size_text: str, rounds: int, variants: list[str]) -> dict[str, list[float]]:
    """Interleaved rounds (round 0 warms up) on one directory: every kind's seconds."""
    work = tempfile.mkdtemp(dir=directory, prefix="ckptfmt-encbench-")
    key = os.path.join(work, "kek")
    with open(key, "wb") as fh:
        fh.write(os.urandom(32))
    paths = {v: os.path.join(work, f"{v}.ckpt") for v in variants}
    times: dict[str, list[float]] = {f"{op}_{v}": [] for op in ("save", "load") for v in variants}

    def run(kind: str) -> float:
        path = paths[kind.split("_", 1)[1]]
        argv = ["--child", kind, "--path", path, "--key", key, "--size", size_text]
        out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True, text=True)
        return float(out.stdout.strip().splitlines()[-1])

    try:
        for r in range(rounds + 1):
            # each save is followed by the load of the file it wrote (in the page cache)
            for variant in rotated(variants, r):
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


def report(
    directory: str, size: int, rounds: int, times: dict[str, list[float]], aes: float, sha: float
) -> dict:
    cores = os.cpu_count() or 1
    med = {k: summarise(v)["median"] for k, v in times.items()}
    gib = size / (1 << 30)
    print(f"{size >> 20} MiB fp32, {directory}, {cores} cores, {rounds} rounds (medians; min-max)")
    for k in (k for k in KINDS if k in times):
        print(
            f"  {k:15s} {med[k]:.3f} s  {size / med[k] / 1e9:5.2f} GB/s  ({min(times[k]):.3f}-{max(times[k]):.3f})"
        )
    out = {"dir": directory, "median": med, "times": times}
    for op in ("save", "load"):
        if f"{op}_plain" not in med:
            continue
        if f"{op}_tensorizer_encrypted" in med:
            t_enc = med[f"{op}_tensorizer_encrypted"]
            t_plain = med.get(f"{op}_tensorizer_plain")
            own = f", its own plain {t_plain / t_enc:.2f}" if t_plain else ""
            print(
                f"  {op} tensorizer encrypted: ckptfmt plain/tensorizer encrypted speed "
                f"{med[f'{op}_plain'] / t_enc:.2f}{own}"
                + (
                    f"; ckptfmt encrypted is {t_enc / med[f'{op}_encrypted']:.2f}x its speed"
                    if f"{op}_encrypted" in med
                    else ""
                )
            )
        for variant, primitives in (("encrypted", [aes]), ("signed_encrypted", [aes, sha])):
            if f"{op}_{variant}" not in med:
                continue
            plain, enc = med[f"{op}_plain"], med[f"{op}_{variant}"]
            # the model: each primitive's work spread over all cores
            best = plain + sum(size / (cores * p) for p in primitives)
            target = plain / best  # the best speed ratio variant/plain the model allows
            reached = (plain / enc) / target
            print(
                f"  {op} {variant}: costs {enc - plain:+.3f} s ({(enc - plain) / gib:+.3f} s/GiB, "
                f"x{enc / plain:.2f}); target {target:.2f}; {variant}/plain speed {plain / enc:.2f}, "
                f"{reached:.2f} of the target"
            )
            out[op if variant == "encrypted" else f"{op}_{variant}"] = {
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
    ap.add_argument(
        "--variants",
        default=None,
        help="comma-separated, of "
        + ",".join(VARIANTS + TENSORIZER)
        + " (default: all; tensorizer's when installed)",
    )
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.child:
        print(json.dumps(child(args.child, args.path, args.key, size)))
        return
    variants = VARIANTS + (TENSORIZER if have_tensorizer() else [])
    if args.variants:
        variants = args.variants.split(",")
        unknown = set(variants) - set(VARIANTS + TENSORIZER)
        if unknown or "plain" not in variants:
            ap.error(f"--variants: plain and some of {VARIANTS + TENSORIZER} (not {sorted(unknown)})")
    aes = primitive_speed()
    sha = sha256_speed()
    print(f"AES-256-GCM, one core, 4 MiB buffers: {aes / 1e9:.2f} GB/s; SHA-256 {sha / 1e9:.2f} GB/s")
    results = []
    for directory in args.dirs.split(","):
        times = measure_dir(directory, args.size, args.rounds, variants)
        results.append(report(directory, size, args.rounds, times, aes, sha))
    if args.out:
        doc = {
            "command": command_line(__file__, sys.argv[1:]),
            "size": size,
            "aes_gcm_one_core": aes,
            "sha256_one_core": sha,
            "runs": results,
        }
        write_json(args.out, doc, echo=False)


if __name__ == "__main__":
    main()
