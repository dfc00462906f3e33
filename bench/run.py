"""ckptfmt against the tools people use: loads as a resume makes them, the disk's limit, durable saves.

The full run (1 GiB fp32 training state; about 8 minutes on an idle 2-core machine: some 80
fresh processes of 3-5 s each, and building and writing the state):

    python bench/run.py --size 1G --rounds 5

    python bench/run.py --quick          # 16 MiB state, 1 round: every row, not the speed (CI)

How it measures (the report repeats this, with the machine's state):
* Every load is the first thing a fresh process does (bench/loads.py), importing
  torch and the tool under test only (its modules' bytecode cached beforehand, as an
  installed package's is: common.installed_env); the clock covers the load and the consumer,
  a multi-threaded int64 sum over every byte of every tensor.  The consumer's own
  cost on resident memory is a row of the same run ("consumer alone").
* Each load is labelled a copy (ckptfmt.load, torch.load) or a zero-copy mapping
  (ckptfmt.load(mmap=True) with every chunk verified, torch.load(mmap=True),
  safetensors load_file); ratios compare copies with copies and mappings with
  mappings, each computed within a round and then reduced to its median.
* The limits are timed in the same run: one XXH3 pass over a verified mapping's
  resident bytes, in its own process (what checking adds), and, in fresh processes
  of their own among the load rows, the state's bytes of fresh memory faulted in on
  all cores and on one (what any copy into fresh memory pays); the report states the
  share of its floor each copy reaches.
* Warm rows read from tmpfs (/dev/shm) and from the disk's page cache (each disk
  file's residency is checked with mincore before its row); a round runs every row
  once, in an order rotated from round to round.  A second pass re-runs the main
  comparisons on the first location, to show the spread.
* Cold rows come last, in their own phase: before each one the file alone is
  evicted (fsync, then posix_fadvise(DONTNEED)), never the whole page cache
  (/proc/sys/vm/drop_caches leaves the machine slow to fault pages for a while,
  which would bias whatever runs next); dd reads the same file cold in the same
  rounds as the disk's limit.
* Saves: a fresh process per save, the state loaded from a torch file first; dd
  writing the same number of bytes (conv=fsync) is the limit.
* Figures are medians with min and max over rounds; the report records the exact
  command, the versions and the machine's state (memory free and available, THP
  mode, the virtio balloon's free page reporting, kernel, CPUs, filesystems)
  before and after.  Writes results/<name>.json and .md, and the chart results/<name>.svg
  (bench/chart.py); `--chart-from results/<name>.json` redraws a chart without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chart  # noqa: E402
import common  # noqa: E402
import loads  # noqa: E402
import state as bench_state  # noqa: E402
import tools  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
FORMATS = {"ckpt": tools.Ckptfmt, "pt": tools.TorchSave, "safetensors": tools.Safetensors}
# (ours, peer, the issue's target for ours' speed over the peer's): like with like only
COMPARISONS = [
    ("ckptfmt", "torch", 2.0),
    ("ckptfmt-mmap", "torch-mmap", 0.9),
    ("ckptfmt-mmap", "safetensors", 0.9),
]
# The same two mappings against the limit of verifying: the peer's mapping plus one XXH3
# pass over the same resident bytes (ckptfmt's engine, all cores, timed in the verified
# mapping's process).  A peer that verifies nothing skips that pass; this is the share of
# what verification could at best cost that ckptfmt reaches.
LIMIT_COMPARISONS = [("ckptfmt-mmap", "torch-mmap", 0.9), ("ckptfmt-mmap", "safetensors", 0.9)]
PHASES = ("warm", "spread", "cold", "saves")
# what a save's sample says of its CPU time besides the clock (common.cpu_spent)
CPU_FIELDS = (
    "cpu_s",
    "user_s",
    "sys_s",
    "caller_cpu_s",
    "other_threads_cpu_s",
    "caller_runq_wait_s",
    "voluntary_switches",
    "preempted",
)
# durable saves, like with like: each of ckptfmt's ways of saving measured (--save-tools) against
# (peer, the target for ckptfmt's speed over the peer's); dd is the limit, no target
SAVE_PEERS = [("safetensors", 1.0), ("torch", 1.0), ("dd", None)]
COLD_TARGET = 0.8  # ckptfmt.load cold, as a share of dd's cold read of the same file
LABELS = {
    "dd": "dd read to /dev/null (reference)",
    "ckptfmt": "ckptfmt.load (verified)",
    "torch": "torch.load",
    "ckptfmt-mmap": "ckptfmt.load(mmap=True), verified",
    "torch-mmap": "torch.load(mmap=True)",
    "safetensors": "safetensors load_file",
    "consumer": "consumer alone (resident memory)",
    "hash": "verification pass: XXH3 over the resident bytes, all cores",
    "fresh-memory": "fresh memory faulted in, all cores (no copy)",
    "fresh-memory-1": "fresh memory faulted in, one core (no copy)",
}
LIMIT_LABEL = "{peer} + verification pass (the limit)"
# costs timed inside a tool's processes, reported as rows of their own: field -> row name
REFERENCE_SOURCES = {
    "ckptfmt": [("consumer_seconds", "consumer")],
    "ckptfmt-mmap": [("hash_seconds", "hash")],
}
KINDS = {
    "dd": "reference",
    "consumer": "consumer",
    "hash": "reference",
    **{t: "reference" for t in loads.FRESH},
    **{t: k for t, (k, _f, _c) in loads.LOADS.items()},
}


# -- one measurement --------------------------------------------------------------------------


def dd_write(folder: str, nbytes: int) -> dict[str, Any]:
    """dd writing nbytes (4 MiB blocks, conv=fsync): the storage's write limit."""
    path = os.path.join(folder, "dd.bin")
    cpu = common.children_cpu()
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={max(1, nbytes >> 22)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t
    spent = common.cpu_spent(cpu, common.children_cpu())
    spent.pop("caller_runq_wait_s")  # a child's wait for a CPU is not counted for its parent
    out = {"op": "save", "seconds": seconds, "rss": 0, "bytes": os.path.getsize(path), **spent}
    os.unlink(path)
    return out


def save_worker(tool: str, folders: list[str], source: str) -> dict[str, list[dict[str, Any]]]:
    """One tool's saves to each folder, in a fresh process (bench/worker.py)."""
    spec = {"tool": tool, "dirs": folders, "source": source}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "worker.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=3600,
        env=common.installed_env(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"save worker {tool} failed:\n{proc.stderr[-3000:]}")
    results: dict[str, list[dict[str, Any]]] = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    return results


def load_row(tool: str, path: str, nbytes: int = 0) -> dict[str, Any]:
    """One load (or dd read) of a warm or cold file, with the file's residency just before it;
    or the fault-in of `nbytes` of fresh memory, in a process as fresh as a load's."""
    if tool in loads.FRESH:
        return loads.measure(tool, str(nbytes))
    resident = common.resident_fraction(path)
    out = loads.dd_read(path) if tool == "dd" else loads.measure(tool, path)
    out["resident_before"] = resident
    return out


# -- the run ----------------------------------------------------------------------------------


class Run:
    """The files every row reads, the samples gathered, and the order of the phases."""

    def __init__(self, args: argparse.Namespace, locations: dict[str, str]) -> None:
        self.args = args
        self.locations = locations
        self.files: dict[str, dict[str, str]] = {}
        self.samples: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
        self.state_bytes = 0
        self.t0 = time.perf_counter()

    def add(self, phase: str, location: str, tool: str, op: str, sample: dict[str, Any], r: int) -> None:
        self.samples.setdefault((phase, location, tool, op), []).append({**sample, "round": r})

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.0f}s] {text}", flush=True)

    def write_files(self) -> None:
        """The state, built once, saved in every format to every location (untimed)."""
        import torch

        self.say(f"building a {self.args.size >> 20} MiB {self.args.dtype} training state")
        st, _ = bench_state.build(self.args.size, getattr(torch, DTYPES[self.args.dtype]))
        self.state_bytes = bench_state.tensor_bytes(st)
        for location, folder in self.locations.items():
            self.files[location] = {}
            for fmt, tool in FORMATS.items():
                path = os.path.join(folder, f"state.{fmt}")
                tool().save(st, path)
                self.files[location][fmt] = path
        del st

    def path(self, location: str, tool: str) -> str:
        return self.files[location][loads.LOADS[tool][1] if tool in loads.LOADS else "ckpt"]

    def warm_pass(self, phase: str, locations: list[str], tools_: list[str], rounds: int) -> None:
        for files in self.files.values():
            for p in files.values():
                loads.dd_read(p)  # in the page cache, as a checkpoint written minutes ago is
        rows = [(loc, t) for loc in locations for t in tools_]
        for r in range(rounds):
            if r:
                self.recopy_tmpfs_files()
            for location, tool in common.rotated(rows, r * max(1, len(rows) // max(1, rounds))):
                sample = load_row(tool, self.path(location, tool), self.state_bytes)
                self.add(phase, location, tool, "load", sample, r)
            self.say(f"{phase}: round {r + 1}/{rounds}")

    def recopy_tmpfs_files(self) -> None:
        """Each tmpfs file copied onto fresh pages (untimed), between rounds: where a file's
        pages lie in physical memory changes how fast it is read by up to 1.7x a tensor (the
        same bytes summed in 46.5 ms from one tool's file and 40.5 ms from another's, 43.2
        and 43.7 once both were copied again: bench/README.md, the verified mapping taken
        apart), and a file written once per run would keep one draw of that for every round."""
        for p in self.files.get("tmpfs", {}).values():
            fresh = p + ".fresh"
            shutil.copyfile(p, fresh)
            os.replace(fresh, p)

    def cold_pass(self, rounds: int) -> None:
        path = self.files["disk"]["ckpt"]
        for r in range(rounds):
            for tool in common.rotated(["dd", "ckptfmt"], r):
                common.evict(path)
                self.add("cold", "disk", tool, "load", load_row(tool, path), r)
            self.say(f"cold: round {r + 1}/{rounds}")

    def save_pass(self, rounds: int, warmup: int = 0) -> None:
        """Per round: dd, then each tool in a process of its own saving to every location in turn.

        The `warmup` rounds before them are run the same way and not recorded: building the
        state frees gigabytes that the guest hands back to the host (free page reporting), and
        the first worker after it paid for faulting them in again, always the same tool (round
        0's order): ckptfmt's first round took 0.90-2.13 CPU-seconds against 0.43-0.53 in
        the others, in five runs of 2026-12-07 (bench/README.md, "Durable saves")."""
        source = self.files["tmpfs" if "tmpfs" in self.files else "disk"]["pt"]
        folders = {}
        for location, folder in self.locations.items():
            folders[location] = os.path.join(folder, "saves")
            os.makedirs(folders[location], exist_ok=True)
        locs = list(self.locations)
        for r in range(-warmup, rounds):
            order = common.rotated(locs, r)
            for tool in common.rotated(["dd", *self.args.save_tools], r):
                if tool == "dd":
                    results = {folders[loc]: [dd_write(folders[loc], self.state_bytes)] for loc in order}
                else:
                    results = save_worker(tool, [folders[loc] for loc in order], source)
                for location in order:
                    for res in results[folders[location]] if r >= 0 else []:
                        self.add("saves", location, tool, res.pop("op"), res, r)
            self.say(
                f"saves: round {r + 1}/{rounds}"
                if r >= 0
                else f"saves: warm-up round {r + warmup + 1}/{warmup}"
            )


# -- the report -------------------------------------------------------------------------------


def row_summary(
    key: tuple[str, str, str, str], samples: list[dict[str, Any]], state_bytes: int
) -> dict[str, Any]:
    phase, location, tool, op = key
    nbytes = samples[0].get("bytes", state_bytes) if tool == "dd" else state_bytes  # dd: what it moved
    secs = [s["seconds"] for s in samples]
    row: dict[str, Any] = {
        "id": "/".join(key),
        "phase": phase,
        "location": location,
        "tool": tool,
        "op": op,
        "kind": "save" if phase == "saves" else KINDS.get(tool, "?"),
        "bytes": nbytes,
        "seconds": common.summarise(secs),
        "gbps": common.summarise([nbytes / s / 1e9 for s in secs]),
        "samples": samples,
    }
    for field in ("load_seconds", "read_seconds", "rss", "peak_rss", *CPU_FIELDS):
        if all(field in s for s in samples):
            row[field] = common.summarise([s[field] for s in samples])
    if "bytes" in samples[0] and phase == "saves" and tool != "dd":
        row["file_bytes"] = samples[0]["bytes"]
    return row


def reference_rows(run: Run) -> list[dict[str, Any]]:
    """Costs measured inside the loads' processes, each as a row of its own: the consumer on
    resident memory (from ckptfmt's copy loads) and the verification pass (from its mappings)."""
    out = []
    for (phase, location, tool, op), samples in run.samples.items():
        for field, name in REFERENCE_SOURCES.get(tool, []):
            if phase in ("warm", "spread") and field in samples[0]:
                alone = [{"seconds": s[field], "round": s["round"]} for s in samples]
                out.append(row_summary((phase, location, name, op), alone, run.state_bytes))
    return out


def copy_floors(rows: dict[str, dict[str, Any]], locations: list[str]) -> list[dict[str, Any]]:
    """Per location, the least a copy into fresh memory costs with its consumer (medians): the
    state's bytes of fresh memory faulted in on all cores, as ckptfmt.load faults them, and on
    one, as torch.load does; and the share of its floor each copy reaches (the floor's time
    over the copy's: 1 is at the floor)."""
    out = []
    for loc in locations:
        got = {
            name: rows.get(f"warm/{loc}/{name}/load")
            for name in ("fresh-memory", "fresh-memory-1", "consumer", "ckptfmt", "torch")
        }
        if not all(got.values()):
            continue
        med = {name: row["seconds"]["median"] for name, row in got.items() if row}
        all_cores = med["fresh-memory"] + med["consumer"]
        one_core = med["fresh-memory-1"] + med["consumer"]
        out.append(
            {
                "location": loc,
                "all_cores": all_cores,
                "one_core": one_core,
                "ckptfmt_share": all_cores / med["ckptfmt"],
                "torch_share": one_core / med["torch"],
            }
        )
    return out


def per_round_ratios(
    ours: list[dict[str, Any]], peer: list[dict[str, Any]], plus_hash: bool = False
) -> list[float]:
    """peer seconds / our seconds, round by round (above 1: ckptfmt faster).  With `plus_hash`
    the peer's seconds gain the verification pass timed in our process of the same round."""
    theirs = {s["round"]: s["seconds"] for s in peer}
    return [
        (theirs[s["round"]] + (s["hash_seconds"] if plus_hash else 0.0)) / s["seconds"]
        for s in ours
        if s["round"] in theirs
    ]


def comparisons(run: Run) -> list[dict[str, Any]]:
    out = []
    pairs = [(o, p, t, False) for o, p, t in COMPARISONS]
    pairs += [(o, p, t, True) for o, p, t in LIMIT_COMPARISONS] + [("ckptfmt", "dd", COLD_TARGET, False)]
    for phase in ("warm", "spread", "cold"):
        for location in run.locations:
            for ours, peer, target, limit in pairs:
                if (peer == "dd") != (phase == "cold"):
                    continue
                a = run.samples.get((phase, location, ours, "load"))
                b = run.samples.get((phase, location, peer, "load"))
                if not a or not b:
                    continue
                ratios = per_round_ratios(a, b, plus_hash=limit)
                out.append(
                    {
                        "phase": phase,
                        "location": location,
                        "ours": ours,
                        "peer": peer,
                        "limit": limit,
                        "kind": KINDS[ours],
                        "target": target,
                        "per_round": ratios,
                        "ratio": common.summarise(ratios),
                    }
                )
    return out


def save_comparisons(run: Run) -> list[dict[str, Any]]:
    """Per location, each of ckptfmt's measured saves against each peer's, round by round (the
    peer's seconds over ckptfmt's: above 1 when ckptfmt is faster); against dd, no target."""
    out = []
    ours_tools = [t for t in run.args.save_tools if t.startswith("ckptfmt")]
    for location in run.locations:
        for ours, (peer, target) in ((o, p) for o in ours_tools for p in SAVE_PEERS):
            a = run.samples.get(("saves", location, ours, "save"))
            b = run.samples.get(("saves", location, peer, "save"))
            if not a or not b:
                continue
            ratios = per_round_ratios(a, b)
            out.append(
                {
                    "location": location,
                    "ours": ours,
                    "peer": peer,
                    "target": target,
                    "per_round": ratios,
                    "ratio": common.summarise(ratios),
                }
            )
    return out


def huge_pages_choice() -> dict[str, Any]:
    """ckptfmt's machine-specific choice for its load buffers, which the copy figures depend on."""
    from ckptfmt.engine import hostmem

    return {
        "setting": hostmem.huge_pages_setting(),
        "host_reclaims_huge_blocks": hostmem.host_reclaims_huge_blocks(),
    }


def report_of(run: Run, argv: list[str], before: dict[str, Any], started: str) -> dict[str, Any]:
    rows = [row_summary(k, v, run.state_bytes) for k, v in run.samples.items()] + reference_rows(run)
    return {
        "command": common.command_line(__file__, argv),
        "started": started,
        "seconds": time.perf_counter() - run.t0,
        "state": {"bytes": run.state_bytes, "size": run.args.size, "dtype": run.args.dtype},
        "rounds": {
            "warm": run.args.rounds,
            "spread": run.args.spread_rounds,
            "saves": run.args.save_rounds,
            "saves_warmup": run.args.save_warmup,
        },
        "machine_before": before,
        "machine_after": common.machine_state(run.locations),
        "versions": common.versions(),
        "ckptfmt_huge_pages": huge_pages_choice(),
        "loads": {t: {"kind": k, "format": f, "call": c} for t, (k, f, c) in loads.LOADS.items()}
        | {t: {"kind": "reference", "format": "", "call": c} for t, c in loads.FRESH_CALLS.items()},
        "save_notes": {t: tools.TOOLS[t]().note for t in run.args.save_tools},
        "cold_eviction": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) of the file read, before each cold row",
        "rows": rows,
        "comparisons": comparisons(run),
        "save_comparisons": save_comparisons(run),
        "copy_floors": copy_floors({r["id"]: r for r in rows}, list(run.locations)),
    }


def _cell(row: dict[str, Any] | None) -> str:
    if not row:
        return ""
    g = row["gbps"]
    return f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})"


def _machine_line(m: dict[str, Any]) -> str:
    mem = m["memory"]
    balloon = m["balloon"]
    return (
        f"{m['cpu']}, {m['cores']} CPUs, kernel {m['kernel']}; memory free {mem.get('MemFree', 0) / 2**30:.1f} GiB, "
        f"available {mem.get('MemAvailable', 0) / 2**30:.1f} GiB of {mem.get('MemTotal', 0) / 2**30:.1f}; "
        f"THP `{m['thp_enabled']}`; virtio balloon {'present' if balloon.get('present') else 'absent'}"
        + (
            f", free page reporting {'on' if balloon.get('free_page_reporting') else 'off'}"
            if balloon.get("present")
            else ""
        )
        + f"; load average {m['loadavg'].split(' ')[:3]}"
    )


def markdown(rep: dict[str, Any]) -> str:
    rows = {r["id"]: r for r in rep["rows"]}
    locs = list(rep["machine_before"]["targets"])
    mib = rep["state"]["bytes"] / 2**20
    lines = [
        f"# {mib:.0f} MiB {rep['state']['dtype']} training state",
        "",
        f"Command: `{rep['command']}` (started {rep['started']}, {rep['seconds']:.0f} s). "
        f"torch {rep['versions']['torch']}, safetensors {rep['versions']['safetensors']}, "
        f"ckptfmt {rep['versions']['ckptfmt']} ({rep['versions'].get('ckptfmt_backend', '?')} backend).",
        "",
        f"Machine before: {_machine_line(rep['machine_before'])}.  ",
        f"Machine after: {_machine_line(rep['machine_after'])}.  ",
        "Locations: "
        + ", ".join(
            f"{n} = {t['path']} ({t['type']} on {t['device']})"
            for n, t in rep["machine_before"]["targets"].items()
        )
        + ".",
        f"ckptfmt's huge pages for load buffers: setting `{rep['ckptfmt_huge_pages']['setting']}`, "
        f"host reclaims free huge blocks: {rep['ckptfmt_huge_pages']['host_reclaims_huge_blocks']}.",
        "",
        f"## Loads, every byte read: GB/s of tensor bytes, median (min–max) of {rep['rounds']['warm']} rounds",
        "",
        "Each load in a fresh process that imports torch and the tool only; the clock covers the load and "
        "a multi-threaded int64 sum over every byte.  Disk = the disk's page cache (files resident, checked).",
        "",
        "| load | kind | " + " | ".join(locs) + " |",
        "|---|---|" + "---|" * len(locs),
    ]
    for tool, label in LABELS.items():
        cells = [_cell(rows.get(f"warm/{loc}/{tool}/load")) for loc in locs]
        if any(cells):
            lines.append(f"| {label} | {KINDS[tool]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Comparisons, like with like: ckptfmt's speed over the peer's",
        "",
        "Per-round ratio of the peer's time to ckptfmt's, median (min–max); pass 2 re-runs the same rows "
        "later in the run, to show the spread.  A verified mapping reads every byte twice (the hash, "
        "then the consumer) where a peer's mapping reads it once; the rows marked *the limit* add to "
        "the peer's time one verification pass over the same bytes, timed in the same round: the best a "
        "mapping that verifies can do.",
        "",
        "| comparison | kind | location | pass | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rep["comparisons"]:
        r = c["ratio"]
        peer = LIMIT_LABEL.format(peer=LABELS[c["peer"]]) if c.get("limit") else LABELS[c["peer"]]
        name = f"{LABELS[c['ours']]} vs {peer}"
        pass_ = {"warm": "1", "spread": "2", "cold": "cold"}[c["phase"]]
        lines.append(
            f"| {name} | {c['kind']} | {c['location']} | {pass_} | {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) "
            f"| ≥ {c['target']} | {'yes' if r['median'] >= c['target'] else 'no'} |"
        )
    for f in rep.get("copy_floors", []):
        lines += [
            "",
            f"The copies' floor, {f['location']}: the state's bytes of fresh memory faulted in (fresh "
            f"processes) and read once by the consumer take {f['all_cores']:.3f} s on all cores and "
            f"{f['one_core']:.3f} s on one (medians).  ckptfmt.load, which faults on all cores, reaches "
            f"**{f['ckptfmt_share']:.2f}** of the first (the floor's time over its own); torch.load, which "
            f"faults on one thread, **{f['torch_share']:.2f}** of the second.",
        ]
    lines += ["", "## Cold from the disk (file evicted with posix_fadvise before each row)", ""]
    lines += ["| read | GB/s | resident before (max) |", "|---|---|---|"]
    for tool in ("dd", "ckptfmt"):
        row = rows.get(f"cold/disk/{tool}/load")
        if row:
            res = [s["resident_before"] for s in row["samples"] if s.get("resident_before") is not None]
            lines.append(
                f"| {LABELS[tool]} | {_cell(row)} | {max(res):.1%} |"
                if res
                else f"| {LABELS[tool]} | {_cell(row)} | ? |"
            )
    warmup = rep["rounds"].get("saves_warmup", 0)
    unrecorded = f", after {warmup} unrecorded warm-up round{'s' if warmup > 1 else ''}" if warmup else ""
    lines += [
        "",
        f"## Durable saves: GB/s, median (min–max) of {rep['rounds']['saves']} rounds{unrecorded}",
        "",
    ]
    lines += [
        "| save | " + " | ".join(locs) + " | file | peak extra RSS |",
        "|---|" + "---|" * (len(locs) + 2),
    ]
    save_ops = {
        "save": "",
        "save_nb_blocked": ", non-blocking: caller blocked",
        "save_nb_durable": ", non-blocking: until durable",
    }
    for tool in ["dd", *rep["save_notes"]]:
        for op, suffix in save_ops.items():
            found = [rows.get(f"saves/{loc}/{tool}/{op}") for loc in locs]
            any_row = next((r for r in found if r), None)
            if not any_row:
                continue
            size = f"{any_row['file_bytes'] / 2**20:.1f} MiB" if "file_bytes" in any_row else ""
            rss = f"{any_row['rss']['median'] / 2**20:.0f} MiB" if "rss" in any_row and tool != "dd" else ""
            lines.append(
                f"| {tool}{suffix} | " + " | ".join(_cell(r) for r in found) + f" | {size} | {rss} |"
            )
    lines += save_ratio_lines(rep) + save_cpu_lines(rep, rows, locs)
    lines += [
        "",
        "Loads: "
        + "; ".join(f"**{t}**: {d['kind']}, `{d['call']}`" for t, d in rep["loads"].items() if t in LABELS)
        + ".",
    ]
    lines += ["Saves: " + "; ".join(f"**{t}**: {n}" for t, n in rep["save_notes"].items()) + "."]
    return "\n".join(lines) + "\n"


def save_ratio_lines(rep: dict[str, Any]) -> list[str]:
    """The durable saves compared round by round: the peer's seconds over ckptfmt's."""
    found = rep.get("save_comparisons", [])
    if not found:
        return []
    lines = [
        "",
        "Durable saves, ckptfmt's speed over the peer's: the peer's seconds over ckptfmt's in each "
        "round (round order), and their median (min–max).",
        "",
        "| comparison | location | per round | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for c in found:
        r = c["ratio"]
        rounds = " ".join(f"{x:.2f}" for x in c["per_round"])
        target, met = (
            ("", "")
            if c["target"] is None
            else (f"≥ {c['target']}", "yes" if r["median"] >= c["target"] else "no")
        )
        lines.append(
            f"| {c['ours']} vs {c['peer']} | {c['location']} | {rounds} | {r['median']:.2f} "
            f"({r['min']:.2f}–{r['max']:.2f}) | {target} | {met} |"
        )
    return lines


def save_cpu_lines(rep: dict[str, Any], rows: dict[str, dict[str, Any]], locs: list[str]) -> list[str]:
    """Each blocking save's clock beside its CPU time (medians over rounds): whether a tool
    works more per byte or waits more."""
    lines = [
        "",
        "Durable saves, clock and CPU time, medians over rounds: CPU = user + system time of the "
        "saving process (every thread), split into the calling thread's and the other threads'; "
        "*waited* = the calling thread's time runnable but not running (another task had its CPU); "
        "switches = voluntary (it blocked) / preempted.  dd's figures are its own process's.",
        "",
        "| save | location | clock s | CPU s (user / sys) | caller CPU s | other threads CPU s "
        "| caller waited s | switches | CPU s per GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gib = rep["state"]["bytes"] / 2**30
    for tool in ["dd", *rep["save_notes"]]:
        for loc in locs:
            row = rows.get(f"saves/{loc}/{tool}/save")
            if not row or "cpu_s" not in row:
                continue

            def med(field: str, row: dict[str, Any] = row) -> float:
                return float(row[field]["median"]) if field in row else float("nan")

            waited = f"{med('caller_runq_wait_s'):.3f}" if "caller_runq_wait_s" in row else ""
            lines.append(
                f"| {tool} | {loc} | {med('seconds'):.3f} | {med('cpu_s'):.3f} ({med('user_s'):.3f} / "
                f"{med('sys_s'):.3f}) | {med('caller_cpu_s'):.3f} | {med('other_threads_cpu_s'):.3f} | "
                f"{waited} | {med('voluntary_switches'):.0f} / {med('preempted'):.0f} | {med('cpu_s') / gib:.3f} |"
            )
    return lines


# -- the command line ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MiB state, 1 round: every row, for CI")
    ap.add_argument("--size", default=None, help="state size (default 1G; quick: 16M)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument(
        "--rounds", type=int, default=None, help="rounds of the warm and cold rows (default 5; quick: 1)"
    )
    ap.add_argument(
        "--spread-rounds", type=int, default=None, help="rounds of the second pass (default 3; quick: 1)"
    )
    ap.add_argument("--save-rounds", type=int, default=None, help="rounds of the saves (default 3; quick: 1)")
    ap.add_argument(
        "--save-warmup",
        type=int,
        default=None,
        help="unrecorded rounds of the saves before them (default 1; quick: 0)",
    )
    ap.add_argument("--locations", default="tmpfs,disk", help="tmpfs,disk (cold rows need disk)")
    ap.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="the phases to run, of " + ",".join(PHASES) + " (e.g. saves alone: --phases saves)",
    )
    ap.add_argument("--loads", default=",".join(loads.MAIN), help="load rows: " + ",".join(loads.MAIN))
    ap.add_argument(
        "--spread",
        default=None,
        help="load rows the second pass re-runs (default: every compared one; quick: ckptfmt,torch)",
    )
    ap.add_argument("--save-tools", default="ckptfmt,torch,safetensors", help="of " + ",".join(tools.TOOLS))
    ap.add_argument(
        "--disk-dir", default=None, help="a directory on the disk (default: a temp dir under bench/)"
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where the report goes")
    ap.add_argument("--name", default=None, help="report file stem (default: latest; quick: quick)")
    ap.add_argument(
        "--chart-from",
        default=None,
        metavar="JSON",
        help="measure nothing: draw the chart of this results file beside it (<stem>.svg)",
    )
    args = ap.parse_args(argv)
    args.size = common.parse_size(args.size or ("16M" if args.quick else "1G"))
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.spread_rounds = args.spread_rounds if args.spread_rounds is not None else (1 if args.quick else 3)
    args.save_rounds = args.save_rounds if args.save_rounds is not None else (1 if args.quick else 3)
    args.save_warmup = args.save_warmup if args.save_warmup is not None else (0 if args.quick else 1)
    args.loads = args.loads.split(",")
    compared = [t for t in args.loads if any(t in (o, p) for o, p, _ in COMPARISONS)]
    args.spread = (
        args.spread.split(",") if args.spread else (["ckptfmt", "torch"] if args.quick else compared)
    )
    args.save_tools = [t for t in args.save_tools.split(",") if t]
    args.phases = [p for p in args.phases.split(",") if p]
    if unknown_phases := [p for p in args.phases if p not in PHASES]:
        ap.error(f"unknown phases: {unknown_phases}")
    args.name = args.name or ("quick" if args.quick else "latest")
    for name, known in (
        (args.loads, loads.LOADS),
        (args.spread, loads.LOADS),
        (args.save_tools, tools.TOOLS),
    ):
        if unknown := [n for n in name if n not in known]:
            ap.error(f"unknown: {unknown}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.chart_from:
        return redraw_chart(args.chart_from)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    names = args.locations.split(",")
    made = {
        "tmpfs": lambda: tempfile.mkdtemp(prefix="ckptfmt-bench-", dir="/dev/shm"),
        "disk": lambda: tempfile.mkdtemp(prefix="ckptfmt-bench-", dir=args.disk_dir or HERE),
    }
    locations = {n: made[n]() for n in names}
    run = Run(args, locations)
    try:
        before = common.machine_state(locations)
        common.cache_bytecode()
        run.write_files()
        if "warm" in args.phases:
            run.warm_pass("warm", names, ["dd", *args.loads, *loads.FRESH], args.rounds)
        if args.spread_rounds and "spread" in args.phases:
            run.warm_pass("spread", names[:1], args.spread, args.spread_rounds)
        if "disk" in locations and "cold" in args.phases:
            run.cold_pass(args.rounds)
        if "saves" in args.phases:
            run.save_pass(args.save_rounds, args.save_warmup)
        rep = report_of(run, argv, before, started)
    finally:
        for folder in locations.values():
            shutil.rmtree(folder, ignore_errors=True)
    stem = os.path.join(args.out, args.name)
    common.write_json(stem + ".json", rep, echo=False)
    md = markdown(rep)
    with open(stem + ".md", "w") as f:
        f.write(md)
    chart.write(rep, stem + ".svg")
    print("\n" + md)
    print(f"wrote {stem}.json, {stem}.md and {stem}.svg")
    return 0


def redraw_chart(results: str) -> int:
    """Draw the chart of a results file this script wrote, beside it: <stem>.json -> <stem>.svg."""
    with open(results) as f:
        rep = json.load(f)
    out = os.path.splitext(results)[0] + ".svg"
    chart.write(rep, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
