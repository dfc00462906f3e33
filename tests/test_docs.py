"""The README and docs/ say what the code does: every example in them runs, every link inside
the repository resolves, and the README's chart is the one bench/run.py draws from the results
its table quotes.

Examples: every fenced block opened with ```` ```python run ```` or ```` ```sh run ```` runs, the
blocks of one page in order (Python ones in one namespace: a later block uses what an earlier
one made; shell ones by bash -e, where `ckptfmt` is this checkout's command line), in a fresh
process whose working directory is an empty temporary folder.  That process, and each
`ckptfmt` command, is forked from one that imported torch once (tests/docs_zygote.py): a page
costs its own work, not seconds of imports.  An `s3://bucket/...` example reaches the tests'
local S3 server (tests/s3_server.py) through the AWS_* environment, as a user's program
reaches a store, with the bucket `bucket` emptied first.  A ```` ```python ```` block without
`run` fails the test: nothing a page shows as Python goes untested.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import docs_zygote
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,})\s*(\S*)\s*(.*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
EXAMPLE_TIMEOUT = 240  # seconds for one page's examples on a busy machine (they take a few)
SVG = "{http://www.w3.org/2000/svg}"


def fenced_blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line of the first code line, language, rest of the info string, code) of each fenced
    block of `page`."""
    out = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, rest = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        out.append((i + 2, lang, rest.strip(), "\n".join(lines[i + 1 : j])))
        i = j + 1
    return out


def runnable(page: Path) -> list[tuple[int, str, str]]:
    """(line, language, code) of each block of `page` marked to run."""
    return [(line, lang, code) for line, lang, rest, code in fenced_blocks(page) if rest == "run"]


def test_every_python_example_is_run():
    unmarked = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in PAGES
        for line, lang, rest, _ in fenced_blocks(page)
        if lang == "python" and rest != "run"
    ]
    assert not unmarked, f"Python blocks not marked `python run` (so not tested): {unmarked}"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """tests/docs_zygote.py serving on a socket: every page's examples, and every `ckptfmt`
    command they run, in a fresh child forked from one process that imported torch once."""
    path = str(tmp_path_factory.mktemp("zygote") / "socket")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "docs_zygote.py"), path],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (
            "the zygote did not start"
        )
        yield path
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def docs_bucket(s3_server, monkeypatch):
    """The bucket `bucket` on the session's S3 server, empty, reached through the AWS_* environment."""
    client = s3_server.client()
    if "bucket" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        s3_server.new_bucket("bucket")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="bucket"):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket="bucket", Key=obj["Key"])
    opts = s3_server.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return "bucket"


@pytest.fixture
def docs_gcs_bucket(gcs_server, monkeypatch):
    """The bucket `bucket` on the session's GCS emulator, empty, reached through
    STORAGE_EMULATOR_HOST."""
    gcs_server.new_bucket("bucket", empty=True)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return "bucket"


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path, request, zygote):
    name = str(page.relative_to(ROOT))
    if "s3://" in "".join(code for _, _, code in runnable(page)):
        request.getfixturevalue("docs_bucket")
    if "gs://" in "".join(code for _, _, code in runnable(page)):
        request.getfixturevalue("docs_gcs_bucket")
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = tmp_path / "bin"  # `ckptfmt` in the shell examples: this checkout's, through the zygote
    bin_dir.mkdir()
    shim = bin_dir / "ckptfmt"
    shim.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -S "{ROOT / "tests" / "docs_zygote.py"}" --cli "$@"\n'
    )
    shim.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env[docs_zygote.SOCKET_ENV] = zygote
    header = {
        "kind": "page",
        "blocks": [(name, line, lang, code) for line, lang, code in runnable(page)],
        "cwd": str(work),
        "env": env,
        "root": str(ROOT),
    }
    out = tmp_path / "output"
    with open(os.devnull) as stdin, open(out, "w") as sink:
        try:
            _, status = docs_zygote.request(
                zygote, header, [stdin.fileno(), sink.fileno(), sink.fileno()], EXAMPLE_TIMEOUT
            )
        except docs_zygote.ChildTimeout as e:
            os.kill(e.pid, signal.SIGKILL)
            pytest.fail(f"{name}: {e}\n{out.read_text()[-6000:]}")
    assert status == 0, f"{name}: its examples failed\n{out.read_text()[-8000:]}"


# -- links -----------------------------------------------------------------------------------


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives `page`'s headings (lower case, punctuation dropped, spaces to -)."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_links_inside_the_repository_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_fits_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


# -- the chart -------------------------------------------------------------------------------


def _chart_module():
    sys.path.insert(0, str(BENCH))
    try:
        import chart
    finally:
        sys.path.remove(str(BENCH))
    return chart


def _row(row_id: str, median: float, lo: float, hi: float) -> dict:
    return {"id": row_id, "gbps": {"median": median, "min": lo, "max": hi, "n": 3}}


SMALL_REPORT = {
    "command": "python bench/run.py --size 64M --rounds 3",
    "started": "2026-12-06T10:00:00Z",
    "state": {"bytes": 64 << 20, "size": 64 << 20, "dtype": "fp32"},
    "rows": [
        _row("warm/disk/ckptfmt/load", 3.0, 2.5, 3.5),
        _row("warm/disk/torch/load", 1.5, 1.0, 2.0),
        _row("warm/disk/consumer/load", 20.0, 19.0, 21.0),  # not a bar of the chart
        _row("saves/disk/ckptfmt/save", 0.8, 0.7, 0.9),
        _row("saves/disk/dd/save", 0.4, 0.3, 0.5),
    ],
}


def _bars(doc: ET.Element) -> dict[str, float]:
    """Each bar's label -> its width, in the order drawn (a label text precedes its bar)."""
    bars: dict[str, float] = {}
    label = None
    for el in doc:
        if el.tag == SVG + "text" and el.get("text-anchor") == "end":
            label = el.text
        elif el.tag == SVG + "rect" and el.get("x") and label is not None:
            bars[label] = float(el.get("width"))
            label = None
    return bars


def test_bench_run_draws_the_chart_of_a_results_file(tmp_path):
    results = tmp_path / "small.json"
    results.write_text(json.dumps(SMALL_REPORT))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--chart-from", str(results)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = ET.parse(tmp_path / "small.svg").getroot()
    texts = [el.text for el in doc.iter(SVG + "text")]
    assert SMALL_REPORT["command"] + " (started 2026-12-06T10:00:00Z)" in texts
    assert "Loads into fresh memory (a copy), every byte read" in texts and "Durable saves" in texts
    assert "Loads mapping the file, every byte read" not in texts  # no row of that panel
    assert {"3.00", "1.50", "0.80", "0.40"} <= set(texts) and "20.00" not in texts
    bars = _bars(doc)
    assert set(bars) == {"ckptfmt.load, verified", "torch.load", "ckptfmt.save", "dd conv=fsync"}
    # each panel has its own scale: within one, widths are in the medians' proportion
    assert bars["torch.load"] / bars["ckptfmt.load, verified"] == pytest.approx(0.5, abs=0.01)
    assert bars["dd conv=fsync"] / bars["ckptfmt.save"] == pytest.approx(0.5, abs=0.01)


def test_a_report_without_any_bar_is_refused():
    chart = _chart_module()
    with pytest.raises(chart.ChartError, match="no row of the chart.*--quick"):
        chart.svg({"command": "python bench/run.py --quick", "rows": [SMALL_REPORT["rows"][2]]})


def test_committed_chart_is_drawn_from_the_committed_results():
    """README shows bench/results/latest.svg beside figures from latest.md: both from latest.json."""
    chart = _chart_module()
    rep = json.loads((BENCH / "results" / "latest.json").read_text())
    assert (BENCH / "results" / "latest.svg").read_text() == chart.svg(rep), (
        "bench/results/latest.svg is stale: python bench/run.py --chart-from bench/results/latest.json"
    )
