"""Every feature in every combination a large job needs, pairwise: where the run lives (a local
directory, an s3:// run, a local directory with an s3:// archive), how many ranks save (1, or 2
under gloo, which saves through the DCP backend), security (none, signed, encrypted, both),
incremental saves, how a save returns (blocking, non-blocking, a fork snapshot) and compression.

Every pair of values of any two dimensions is in some case (a greedy pairwise cover, the same
every run), and in a case that must work wherever some combination holding that pair works: a
refused value never hides its pairs with the other dimensions (none is refused now).  Each case
trains three steps saving every step in one group of processes, then
resumes in a fresh group (a tiered run on a "new node" whose local directory was deleted), and
compares the model and optimizer with the state saved at step 3 bit for bit.  A case whose
combination ckptfmt refuses must raise the refusal README's table states, before any step is
saved: nothing is silently ignored."""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import shutil
from typing import Any

import torch

import ckptfmt

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "where": ("local", "store", "tiered"),
    "ranks": (1, 2),
    "security": ("none", "signed", "encrypted", "both"),
    "incremental": (False, True),
    "mode": ("blocking", "nonblocking", "fork"),
    "compression": (None, "zstd"),
}
STEPS = 3
KEY = bytes(range(32))
SEED = bytes(range(1, 33))  # the Ed25519 signing key's seed

#: the refusals README's table of combinations states, each with its reason: the case's values
#: that make it, and what the error says
REFUSALS: list[tuple[dict[str, Any], str]] = []


def _pairs(case: dict[str, Any]) -> set[tuple[str, Any, str, Any]]:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(DIMENSIONS, 2)}


def _cover(pool: list[dict[str, Any]], todo: set[tuple[str, Any, str, Any]]) -> list[dict[str, Any]]:
    """Cases of `pool` holding every pair of `todo` (greedy: each next case holds the most)."""
    cases = []
    while todo:
        best = max(pool, key=lambda c: len(_pairs(c) & todo))
        cases.append(best)
        todo = todo - _pairs(best)
    return cases


def pairwise_cases() -> list[dict[str, Any]]:
    """A small set of cases holding every pair of values of any two dimensions: first cases that
    must work, for every pair some working combination holds, then refused ones for the rest."""
    every = [dict(zip(DIMENSIONS, values)) for values in itertools.product(*DIMENSIONS.values())]
    working = [c for c in every if refusal(c) is None]
    workable = set().union(*map(_pairs, working))
    cases = _cover(working, workable)
    return cases + _cover(every, set().union(*map(_pairs, every)) - workable)


def refusal(case: dict[str, Any]) -> str | None:
    """What a case's combination must be refused with (a regular expression: any refusal
    that applies, the first checked wins), or None where it must work."""
    says = [says for when, says in REFUSALS if all(case[k] == v for k, v in when.items())]
    return "|".join(f"(?:{s})" for s in says) or None


def case_name(case: dict[str, Any]) -> str:
    return "-".join(f"{case[k]}" for k in DIMENSIONS).replace("None", "raw")


def _manager(case: dict[str, Any], base: str, options: dict[str, str]) -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    name = case_name(case)
    kw: dict[str, Any] = {
        "keep_last": 2,
        "incremental": case["incremental"],
        "blocking": case["mode"] == "blocking",
        "snapshot": "fork" if case["mode"] == "fork" else "copy",
        "compression": case["compression"],
    }
    if case["security"] in ("signed", "both"):
        priv = ed25519.Ed25519PrivateKey.from_private_bytes(SEED)
        kw.update(sign_with=priv, trusted_keys=[priv.public_key()])
    if case["security"] in ("encrypted", "both"):
        kw["encrypt_with"] = KEY
    if case["where"] == "store":
        return ckptfmt.CheckpointManager(f"{options['url']}/{name}", storage_options=options["s3"], **kw)
    if case["where"] == "tiered":
        kw.update(
            archive=f"{options['url']}/{name}-archive", archive_keep_last=2, storage_options=options["s3"]
        )
    return ckptfmt.CheckpointManager(os.path.join(base, name), **kw)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v.clone()
    return out


def _save_case(case: dict[str, Any], base: str, options: dict[str, str]) -> dict[str, Any]:
    """Train STEPS steps, saving each; the error message if the combination was refused."""
    model, opt = _model()
    try:
        m = _manager(case, base, options)
        for step in range(1, STEPS + 1):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            m.save(step, {"model": model, "optim": opt})
        m.wait()
    except (ValueError, ckptfmt.UnsupportedError) as e:
        return {"refused": str(e)}
    return {"state": _flat(model, opt)}


def _resume_case(case: dict[str, Any], base: str, options: dict[str, str]) -> dict[str, Any]:
    if case["where"] == "tiered":
        shutil.rmtree(os.path.join(base, case_name(case)), ignore_errors=True)  # a new node
    model, opt = _model()
    m = _manager(case, base, options)
    report = m.load_into({"model": model, "optim": opt})
    return {"step": report.step, "state": _flat(model, opt), "verified": m.verify().ok}


def _group(rank: int, world: int, store: str, base: str, options: dict[str, Any], phase: str) -> None:
    """One process of a phase: every case of this world size, one after another."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)  # no data position saved, etc.
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    out: dict[str, Any] = {}
    for case in options["cases"]:
        if case["ranks"] != world or (phase == "resume" and case_name(case) in options["refused"]):
            continue
        try:
            got = (_save_case if phase == "save" else _resume_case)(case, base, options)
        except Exception as e:  # reported to the test, which names the case
            got = {"error": f"{type(e).__name__}: {e}"}
        state = got.pop("state", None)
        if rank == 0 and state is not None:  # every rank holds the same, replicated state
            ckptfmt.save(state, os.path.join(base, f"{phase}-{case_name(case)}.ckpt"))
        out[case_name(case)] = got
        if world > 1:
            dist.barrier()
    if world > 1:
        gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
        dist.destroy_process_group()
    with open(os.path.join(base, f"{phase}-{world}.{rank}.json"), "w") as fh:
        json.dump(out, fh)


def _phase(phase: str, tmp_path: Any, options: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    results: dict[str, list[dict[str, Any]]] = {}
    for world in (1, 2):
        args = (world, str(tmp_path / f"store-{phase}-{world}"), str(tmp_path), options, phase)
        mp.start_processes(_group, args=args, nprocs=world, join=True, start_method="spawn")
        for rank in range(world):
            for name, got in json.loads((tmp_path / f"{phase}-{world}.{rank}.json").read_text()).items():
                results.setdefault(name, []).append(got)
    return results


def test_the_cover_holds_every_pair():
    cases = pairwise_cases()
    working = [c for c in cases if refusal(c) is None]
    every = [dict(zip(DIMENSIONS, values)) for values in itertools.product(*DIMENSIONS.values())]
    for a, b in itertools.combinations(DIMENSIONS, 2):
        for va, vb in itertools.product(DIMENSIONS[a], DIMENSIONS[b]):
            assert any(c[a] == va and c[b] == vb for c in cases), (a, va, b, vb)
            if any(c[a] == va and c[b] == vb and refusal(c) is None for c in every):
                assert any(c[a] == va and c[b] == vb for c in working), (a, va, b, vb)
    # fork snapshots with several ranks, incremental saves, on a store and tiered, each run end to end
    for pair in ({"ranks": 2}, {"incremental": True}, {"where": "store"}, {"where": "tiered"}):
        assert any(c["mode"] == "fork" and all(c[k] == v for k, v in pair.items()) for c in working), pair
    assert len(cases) <= 20


def test_every_combination_resumes_bit_exactly_or_is_refused_as_documented(tmp_path, s3_bucket):
    bucket, s3 = s3_bucket
    cases = pairwise_cases()
    options: dict[str, Any] = {"cases": cases, "url": f"s3://{bucket}", "s3": s3, "refused": []}
    saved = _phase("save", tmp_path, options)
    worked = []
    for case in cases:
        name, expected = case_name(case), refusal(case)
        got = saved[name]
        assert all("error" not in g for g in got), (name, got)
        if expected is None:
            assert all("refused" not in g for g in got), (name, got)
            worked.append(case)
        else:
            assert all(re.search(expected, g.get("refused", "")) for g in got), (name, expected, got)
            options["refused"].append(name)
    resumed = _phase("resume", tmp_path, options)
    for case in worked:
        name = case_name(case)
        for got in resumed[name]:
            assert "error" not in got, (name, got)
            assert got["step"] == STEPS and got["verified"], (name, got)
        want = ckptfmt.load(tmp_path / f"save-{name}.ckpt")
        have = ckptfmt.load(tmp_path / f"resume-{name}.ckpt")
        assert want.keys() == have.keys(), name
        for k, v in want.items():
            assert torch.equal(v, have[k]), (name, k)
    assert len(worked) == len(cases)  # every case runs end to end: nothing is refused
