"""The benchmark harness runs end to end in --quick mode; its report has every row and is consistent.

No timing assertions: only that every row is there, labelled (copy or mapping), with
the machine's state recorded, and that the ratios agree with the raw times they were
computed from.  Also the consumer itself: it reads every byte of every tensor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
BENCH = os.path.join(HERE, "..", "bench")
RUN = os.path.join(BENCH, "run.py")
LOADS = ("ckptfmt", "torch", "ckptfmt-mmap", "torch-mmap", "safetensors")


def _s3_benches_can_run() -> bool:
    if os.environ.get("CKPTFMT_REQUIRE_S3"):  # CI requires them: there, their absence fails
        return True
    return all(importlib.util.find_spec(m) is not None for m in ("moto", "boto3"))


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """The module's three --quick bench runs, started side by side: each is mostly one process
    on one core at a time (fresh processes one after another), and none checks speed, so
    together they take about as long as the longest alone.  name -> (process, output folder)."""
    names = ["run"] + (["objects", "object_clients"] if _s3_benches_can_run() else [])
    runs = {}
    for name in names:
        out = tmp_path_factory.mktemp(name)
        script = RUN if name == "run" else os.path.join(BENCH, f"{name}.py")
        argv = [sys.executable, script, "--quick", "--out", str(out)]
        if name == "run":
            argv += ["--disk-dir", str(out)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[name] = (proc, out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _finished(quick_runs, name, timeout):
    """Wait for one of the quick runs; its stdout and output folder (it must have succeeded)."""
    proc, out = quick_runs[name]
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout, out


@pytest.fixture(scope="module")
def report(quick_runs):
    stdout, out = _finished(quick_runs, "run", 900)
    assert "saves: round 1/1" in stdout  # progress is printed
    doc = json.loads((out / "quick.json").read_text())
    doc["_md"] = (out / "quick.md").read_text()
    doc["_left"] = [p for p in os.listdir(out) if p.startswith("ckptfmt-bench-")]
    return doc


def _rows(report):
    return {r["id"]: r for r in report["rows"]}


def test_every_row_is_produced(report):
    rows = _rows(report)
    want = set()
    for loc in ("tmpfs", "disk"):
        want |= {
            f"warm/{loc}/{t}/load"
            for t in ("dd", *LOADS, "consumer", "hash", "fresh-memory", "fresh-memory-1")
        }
        want |= {f"saves/{loc}/{t}/save" for t in ("dd", "ckptfmt", "torch", "safetensors")}
        want |= {f"saves/{loc}/ckptfmt/{op}" for op in ("save_nb_blocked", "save_nb_durable")}
    want |= {f"spread/tmpfs/{t}/load" for t in ("ckptfmt", "torch", "consumer")}
    want |= {"cold/disk/dd/load", "cold/disk/ckptfmt/load"}
    assert want <= set(rows), sorted(want - set(rows))
    for row in rows.values():
        assert row["seconds"]["n"] == len(row["samples"]) >= 1
        assert row["seconds"]["min"] <= row["seconds"]["median"] <= row["seconds"]["max"]
        assert row["gbps"]["median"] > 0
    assert report["_left"] == []  # the scratch folders are removed


def test_rows_say_copy_or_mapping(report):
    rows = _rows(report)
    kinds = {t: rows[f"warm/tmpfs/{t}/load"]["kind"] for t in LOADS}
    assert kinds == {
        "ckptfmt": "copy",
        "torch": "copy",
        "ckptfmt-mmap": "mapping",
        "torch-mmap": "mapping",
        "safetensors": "mapping",
    }
    for row in rows.values():
        if row["tool"] in LOADS and row["op"] == "load":
            assert row["load_seconds"]["n"] and row["read_seconds"]["n"]  # load and consumer, apart


def test_comparisons_are_like_with_like(report):
    pairs = {(c["phase"], c["location"], c["ours"], c["peer"]) for c in report["comparisons"]}
    for loc in ("tmpfs", "disk"):
        assert {
            ("warm", loc, "ckptfmt", "torch"),
            ("warm", loc, "ckptfmt-mmap", "torch-mmap"),
            ("warm", loc, "ckptfmt-mmap", "safetensors"),
        } <= pairs
        limits = {
            (c["ours"], c["peer"]) for c in report["comparisons"] if c["limit"] and c["location"] == loc
        }
        assert limits == {("ckptfmt-mmap", "torch-mmap"), ("ckptfmt-mmap", "safetensors")}
    assert ("spread", "tmpfs", "ckptfmt", "torch") in pairs
    assert ("cold", "disk", "ckptfmt", "dd") in pairs
    kinds = {t: k["kind"] for t, k in report["loads"].items()}
    for c in report["comparisons"]:
        if c["peer"] != "dd":
            assert kinds[c["ours"]] == kinds[c["peer"]] == c["kind"]


def test_copy_floors_agree_with_their_rows(report):
    """The copies' floor (fresh memory faulted in, plus the consumer) is stated per location and
    computed from the medians of its rows, with the share of it each copy reaches."""
    rows = _rows(report)
    floors = {f["location"]: f for f in report["copy_floors"]}
    assert set(floors) == {"tmpfs", "disk"}
    for loc, f in floors.items():
        med = {
            n: rows[f"warm/{loc}/{n}/load"]["seconds"]["median"]
            for n in ("fresh-memory", "fresh-memory-1", "consumer", "ckptfmt", "torch")
        }
        assert f["all_cores"] == pytest.approx(med["fresh-memory"] + med["consumer"])
        assert f["one_core"] == pytest.approx(med["fresh-memory-1"] + med["consumer"])
        assert f["ckptfmt_share"] == pytest.approx(f["all_cores"] / med["ckptfmt"])
        assert f["torch_share"] == pytest.approx(f["one_core"] / med["torch"])
        assert f"The copies' floor, {loc}:" in report["_md"]
    threads = {
        s["threads"]
        for n in ("fresh-memory", "fresh-memory-1")
        for s in rows[f"warm/tmpfs/{n}/load"]["samples"]
    }
    assert threads == {os.cpu_count(), 1}


def test_ratios_agree_with_raw_figures(report):
    rows = _rows(report)
    for c in report["comparisons"]:
        ours = rows[f"{c['phase']}/{c['location']}/{c['ours']}/load"]["samples"]
        peer = rows[f"{c['phase']}/{c['location']}/{c['peer']}/load"]["samples"]
        # the limit rows add the verification pass timed in our process of the same round
        want = [
            (p["seconds"] + (o["hash_seconds"] if c["limit"] else 0)) / o["seconds"]
            for o, p in zip(ours, peer)
        ]
        assert c["per_round"] == pytest.approx(want)
        assert c["ratio"]["min"] <= c["ratio"]["median"] <= c["ratio"]["max"]


def test_saves_report_cpu_time_and_ratios_per_round(report):
    """Each durable save carries its CPU time beside its clock (the process's, split into the
    calling thread's and the other threads'), and ckptfmt's saves are compared with each peer's
    round by round, from the raw times."""
    rows = _rows(report)
    for loc in ("tmpfs", "disk"):
        for tool in ("dd", "ckptfmt", "torch", "safetensors"):
            for s in rows[f"saves/{loc}/{tool}/save"]["samples"]:
                assert s["cpu_s"] == pytest.approx(s["user_s"] + s["sys_s"])
                assert s["cpu_s"] > 0 and s["voluntary_switches"] >= 0 and s["preempted"] >= 0
                assert s["other_threads_cpu_s"] >= 0 and s["caller_cpu_s"] >= 0
                assert ("caller_runq_wait_s" in s) == (tool != "dd")  # dd runs in a child
    found = {(c["location"], c["peer"]): c for c in report["save_comparisons"]}
    assert set(found) == {(loc, p) for loc in ("tmpfs", "disk") for p in ("safetensors", "torch", "dd")}
    for (loc, peer), c in found.items():
        ours = rows[f"saves/{loc}/ckptfmt/save"]["samples"]
        theirs = rows[f"saves/{loc}/{peer}/save"]["samples"]
        assert c["per_round"] == pytest.approx([p["seconds"] / o["seconds"] for o, p in zip(ours, theirs)])
    md = report["_md"]
    assert "| ckptfmt vs safetensors | tmpfs |" in md and "caller waited s" in md


def test_cold_rows_read_an_evicted_file(report):
    for tool in ("dd", "ckptfmt"):
        for s in _rows(report)[f"cold/disk/{tool}/load"]["samples"]:
            assert s["resident_before"] is None or s["resident_before"] < 0.5


def test_machine_state_and_command_are_recorded(report):
    assert report["command"].startswith("python bench/run.py --quick")
    for when in ("machine_before", "machine_after"):
        m = report[when]
        assert m["cores"] >= 1 and m["kernel"]
        assert {"MemTotal", "MemFree", "MemAvailable"} <= set(m["memory"])
        assert "thp_enabled" in m and "present" in m["balloon"]
        assert set(m["targets"]) == {"tmpfs", "disk"}
        assert m["targets"]["tmpfs"]["type"] == "tmpfs"
    assert report["versions"]["ckptfmt_backend"] in ("python", "c")
    assert "fsync added" in report["save_notes"]["torch"]


def test_markdown_has_every_section(report):
    md = report["_md"]
    for text in (
        "Command: `python bench/run.py --quick",
        "Machine before:",
        "THP",
        "consumer alone",
        "verification pass",
        "safetensors load_file + verification pass (the limit)",
        "| copy |",
    ):
        assert text in md
    for section in ("## Loads", "## Comparisons", "## Cold from the disk", "## Durable saves"):
        assert section in md


def test_saves_alone(tmp_path):
    """--phases saves runs the durable saves and nothing else (no load row is measured)."""
    argv = [sys.executable, RUN, "--phases", "saves", "--size", "1M", "--locations", "tmpfs"]
    argv += ["--save-tools", "ckptfmt", "--save-rounds", "1", "--out", str(tmp_path), "--name", "saves"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "saves.json").read_text())
    assert {r["phase"] for r in doc["rows"]} == {"saves"}
    assert {"saves/tmpfs/dd/save", "saves/tmpfs/ckptfmt/save"} <= {r["id"] for r in doc["rows"]}
    bad = subprocess.run([*argv[:2], "--phases", "saves,nope"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown phases: ['nope']" in bad.stderr


def test_saves_warmup_rounds_are_run_and_not_recorded(tmp_path):
    """--save-warmup runs rounds before the measured ones (the first worker after the state's
    build no longer pays alone for the memory the build freed) and records none of them."""
    argv = [sys.executable, RUN, "--phases", "saves", "--size", "1M", "--locations", "tmpfs"]
    argv += ["--save-tools", "ckptfmt", "--save-rounds", "2", "--save-warmup", "1"]
    argv += ["--out", str(tmp_path), "--name", "warm"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saves: warm-up round 1/1" in proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "warm.json").read_text())
    assert doc["rounds"]["saves_warmup"] == 1
    rows = {r["id"]: r for r in doc["rows"]}
    for tool in ("dd", "ckptfmt"):
        assert [s["round"] for s in rows[f"saves/tmpfs/{tool}/save"]["samples"]] == [0, 1]
    assert "after 1 unrecorded warm-up round" in (tmp_path / "warm.md").read_text()


def test_measured_processes_compile_nothing(tmp_path, monkeypatch):
    """A measured process finds ckptfmt's modules compiled beforehand, as an installed wheel's
    are, even where PYTHONDONTWRITEBYTECODE is set: importing the save and load paths compiles
    no source (torch's and safetensors' bytecode was written when they were installed)."""
    common = _common()
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    pycache = str(tmp_path / "pycache")
    common.cache_bytecode(pycache)
    probe = (
        "import importlib._bootstrap_external as b, json\n"
        "seen = []\n"
        "compile_source = b.SourceLoader.source_to_code\n"
        "def spy(self, data, path, *a, **k):\n"
        "    seen.append(path)\n"
        "    return compile_source(self, data, path, *a, **k)\n"
        "b.SourceLoader.source_to_code = spy\n"
        "import ckptfmt, ckptfmt.files.save, ckptfmt.files.load\n"
        "print(json.dumps([p for p in seen if 'ckptfmt' in p]))\n"
    )
    env = common.installed_env(pycache)
    assert "PYTHONDONTWRITEBYTECODE" not in env
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _common():
    """bench/common.py, loaded by its path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_common", os.path.join(BENCH, "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_consumer_reads_every_byte(dtype):
    """Every byte counts (a change to any one changes the sum), whatever the size and offset."""
    common = _common()
    base = torch.arange(61, dtype=torch.uint8)
    nbytes = torch.tensor([], dtype=dtype).element_size()
    for start, length in ((0, 7), (1, 13), (3, 40), (5, 1)):
        if start * nbytes + length * nbytes > 61:
            continue
        storage = base.clone()
        t = storage[: (61 // nbytes) * nbytes].view(dtype)[start : start + length]
        before = common.read_every_byte({"t": t})
        for i in range(length * nbytes):
            flat = storage[start * nbytes + i : start * nbytes + i + 1]
            flat += 1
            assert common.read_every_byte({"t": t}) != before, (start, length, i)
            flat -= 1


def test_consumer_reads_a_shared_region_once():
    common = _common()
    w = torch.ones(1000, dtype=torch.int64)
    assert common.read_every_byte({"a": w, "b": w, "c": [w]}) == common.read_every_byte({"a": w})


def _object_bench_quick(name, quick_runs):
    """The report of bench/<name>.py --quick (it starts its own moto server): the JSON document
    and the markdown."""
    if name not in quick_runs:
        pytest.skip("moto and boto3 are not installed")
    _, out = _finished(quick_runs, name, 600)
    doc = json.loads((out / f"{name}-quick.json").read_text())
    return doc, (out / f"{name}-quick.md").read_text()


def test_object_clients_quick(quick_runs):
    """bench/object_clients.py --quick: a moto server of its own, every installed client up and
    down (each download checked against the source's digest inside the bench), a report."""
    doc, md = _object_bench_quick("object_clients", quick_runs)
    assert "boto3-parallel" in doc["clients"] and "boto3-managed" in doc["clients"]
    assert set(doc["clients"]) | set(doc["missing"]) == {"boto3-parallel", "boto3-managed", "obstore", "s3fs"}
    for client in doc["clients"]:
        for op in ("up", "down"):
            row = doc["rows"][f"{client}/{op}/{40 << 20}"]
            assert row["seconds"]["n"] == 1 and row["gbps"] > 0 and row["peak_rss"] > 0
    assert "Command: `python bench/object_clients.py --quick" in md
    assert all(f"| {c} | 40 MiB |" in md for c in doc["clients"])


def test_objects_quick(quick_runs):
    """bench/objects.py --quick: a moto server of its own, ckptfmt's s3:// save and load, every
    installed peer and the raw floor, each load checked against the saved state's digest inside
    the bench; ratios agree with the rows they come from."""
    doc, md = _object_bench_quick("objects", quick_runs)
    assert {"ckptfmt", "floor"} <= set(doc["tools"])
    assert set(doc["tools"]) | set(doc["missing"]) == {
        "ckptfmt",
        "s3torchconnector",
        "dcp-s3fs",
        "floor",
    }
    rows = doc["rows"]
    for tool in doc["tools"]:
        for op in ("save", "load"):
            # s3torchconnector's save cannot complete against moto (reported)
            if op == "save" and tool == "s3torchconnector":
                assert f"{tool}/{op}" not in rows
                continue
            row = rows[f"{tool}/{op}"]
            assert row["seconds"]["n"] == 1 and row["gbps"] > 0 and row["peak_rss"] > 0
            assert row["requests"].get("GET" if op == "load" else "PUT", 0) >= 1  # seen by the server
    for key, ratio in doc["ratios"].items():
        op, other = key.split("/")
        assert ratio == pytest.approx(
            rows[f"{other}/{op}"]["seconds"]["median"] / rows[f"ckptfmt/{op}"]["seconds"]["median"]
        )
    assert "Command: `python bench/objects.py --quick" in md
    assert all(f"| {t} | load |" in md for t in doc["tools"])


def _bench_tools():
    """bench/tools.py, loaded by its path; its `import common` is bench/common.py, taken off
    sys.modules again so the name stays free."""
    spec = importlib.util.spec_from_file_location("bench_tools", os.path.join(BENCH, "tools.py"))
    module = importlib.util.module_from_spec(spec)
    had_common = "common" in sys.modules
    sys.path.insert(0, BENCH)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(BENCH)
        if not had_common:
            sys.modules.pop("common", None)
    return module


@pytest.mark.parametrize("tool", sorted(_bench_tools().TOOLS))
def test_every_save_tool_imports_all_its_save_needs_before_the_clock(tool, tmp_path):
    """A fresh save worker's first timed save imports nothing: each tool's prepare() (which the
    worker calls before the clock, and which every tool must define) imported it all, as each
    loader does; `import ckptfmt` alone leaves the save path to its first call, which the
    clock counted, and torch.save and safetensors' save_file import modules on first use too."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import torch, tools; "
        "state = {'model': {'w': torch.ones(4, 4), 'b': torch.zeros(4)}, 'step': 3}; "
        "tool = tools.TOOLS[sys.argv[2]](); tool.prepare(); before = set(sys.modules); "
        "tool.save(state, tool.path(sys.argv[3])); print(sorted(set(sys.modules) - before))"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe, BENCH, tool, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{tool}'s first save imported {out.stdout.strip()}"


def test_a_tool_that_does_not_say_what_its_save_imports_is_refused():
    """A new tool class without prepare() cannot be measured with its imports inside the clock."""

    class Unprepared(_bench_tools().Tool):
        name = "unprepared"

    with pytest.raises(NotImplementedError, match="Unprepared does not say what its save imports"):
        Unprepared().prepare()


def test_mmap_phases_finds_every_phase_of_a_mapped_load(tmp_path):
    """bench/mmap_phases.py times a verified mapped load by wrapping the reader's functions by
    name: each phase of the current code is found (a renamed function would leave its phase out
    and its time in "the rest"), and the report has both tools' rows and the limit ratio."""
    import safetensors.torch

    import ckptfmt

    state = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    ckptfmt.save(state, tmp_path / "s.ckpt")
    safetensors.torch.save_file(state, str(tmp_path / "s.safetensors"))
    files = f"{tmp_path / 's.ckpt'},{tmp_path / 's.safetensors'}"
    cmd = [sys.executable, os.path.join(BENCH, "mmap_phases.py"), "--files", files, "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=os.path.join(HERE, ".."))
    assert done.returncode == 0, done.stderr[-3000:]
    for phase in (
        "index: JSON parse",
        "index: tree check",
        "engine: records, check started",
        "engine: waiting for the check",
        "mapping + tensors",
        "decode (the objects)",
        "the rest of the load",
        "**consumer, pages resident**",
        "limit ratio by CPU",
    ):
        assert phase in done.stdout, phase
