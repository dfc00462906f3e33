"""The chart of a bench/run.py report: GB/s of each tool, median with a min-max whisker, in panels.

bench/run.py draws it beside the report it writes (results/<name>.svg next to <name>.json and
<name>.md), and redraws it from a results file it wrote earlier without measuring anything:

    python bench/run.py --chart-from bench/results/latest.json

A plain SVG writer (no plotting library): the same report always gives the same bytes, so a
test can check that the committed chart is the one its committed report draws.
"""

from __future__ import annotations

from typing import Any
from xml.sax.saxutils import escape

# (panel title, row-id phase, [(location, location label)], [(tool, op, bar label)])
Panel = tuple[str, str, list[tuple[str, str]], list[tuple[str, str, str]]]
WARM = [("disk", "page cache"), ("tmpfs", "tmpfs")]
SAVES = [("disk", "local disk"), ("tmpfs", "tmpfs")]
PANELS: list[Panel] = [
    (
        "Loads into fresh memory (a copy), every byte read",
        "warm",
        WARM,
        [("ckptfmt", "load", "ckptfmt.load, verified"), ("torch", "load", "torch.load")],
    ),
    (
        "Loads mapping the file, every byte read",
        "warm",
        WARM,
        [
            ("ckptfmt-mmap", "load", "ckptfmt.load(mmap=True), verified"),
            ("torch-mmap", "load", "torch.load(mmap=True)"),
            ("safetensors", "load", "safetensors load_file"),
        ],
    ),
    (
        "Loads cold from the local disk",
        "cold",
        [("disk", "")],
        [("ckptfmt", "load", "ckptfmt.load, verified"), ("dd", "load", "dd reading the file")],
    ),
    (
        "Durable saves",
        "saves",
        SAVES,
        [
            ("ckptfmt", "save", "ckptfmt.save"),
            ("torch", "save", "torch.save + fsync"),
            ("safetensors", "save", "safetensors + fsync"),
            ("dd", "save", "dd conv=fsync"),
        ],
    ),
]
COLOURS = {"ckptfmt": "#1f5fa8", "ckptfmt-mmap": "#1f5fa8", "dd": "#9a9a9a"}
PEER_COLOUR = "#e08a2c"
WIDTH = 760
LABEL_W = 300  # the bars' labels, left of the plot
PLOT_W = 360  # the widest median's bar ends inside it; its value is written right of it
BAR_H = 14
BAR_GAP = 4
GROUP_GAP = 8
PANEL_GAP = 18
TOP = 66


class ChartError(ValueError):
    """A results file the chart cannot be drawn from (no row of any panel)."""


def _bars(rep: dict[str, Any]) -> list[tuple[str, list[tuple[str, list[tuple[str, str, dict[str, float]]]]]]]:
    """[(panel title, [(group label, [(bar label, tool, GB/s summary)])])] of the rows present."""
    rows = {r["id"]: r for r in rep.get("rows", [])}
    out = []
    for title, phase, locations, bars in PANELS:
        groups = []
        for location, group_label in locations:
            found = [
                (label, tool, rows[f"{phase}/{location}/{tool}/{op}"]["gbps"])
                for tool, op, label in bars
                if f"{phase}/{location}/{tool}/{op}" in rows
            ]
            if found:
                groups.append((group_label, found))
        if groups:
            out.append((title, groups))
    return out


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 11, weight: str = "normal") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'font-weight="{weight}">{escape(s)}</text>'
    )


def svg(rep: dict[str, Any]) -> str:
    """The chart of report `rep` (a bench/run.py results document) as an SVG document."""
    panels = _bars(rep)
    if not panels:
        raise ChartError(f"no row of the chart in the report of {rep.get('command', '?')!r}")
    mib = rep.get("state", {}).get("bytes", 0) / 2**20
    body: list[str] = [
        _text(
            10,
            20,
            f"{mib:.0f} MiB {rep.get('state', {}).get('dtype', '')} training state: GB/s, "
            "median of the rounds (bar), min to max (line)",
            size=13,
            weight="bold",
        ),
        _text(10, 36, f"{rep.get('command', '')} (started {rep.get('started', '?')})", size=11),
        _text(10, 52, "blue: ckptfmt; orange: the peers; grey: dd, the device's limit", size=11),
    ]
    y = float(TOP)
    for title, groups in panels:
        body.append(_text(10, y + 11, title, size=12, weight="bold"))
        y += 18
        top = max(s["max"] for _, bars in groups for _, _, s in bars)
        scale = PLOT_W / top
        for group_label, bars in groups:
            if group_label:
                body.append(_text(20, y + 11, group_label, size=11, weight="bold"))
                y += BAR_H + BAR_GAP
            for label, tool, s in bars:
                colour = COLOURS.get(tool, PEER_COLOUR)
                w, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
                mid = y + BAR_H / 2
                body += [
                    _text(LABEL_W - 8, y + 11, label, anchor="end"),
                    f'<rect x="{LABEL_W}" y="{y:.1f}" width="{w:.1f}" height="{BAR_H}" fill="{colour}"/>',
                    f'<line x1="{LABEL_W + lo:.1f}" y1="{mid:.1f}" x2="{LABEL_W + hi:.1f}" y2="{mid:.1f}" '
                    'stroke="#222" stroke-width="1.5"/>',
                    _text(LABEL_W + max(w, hi) + 6, y + 11, f"{s['median']:.2f}"),
                ]
                y += BAR_H + BAR_GAP
            y += GROUP_GAP
        y += PANEL_GAP
    height = int(y)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def write(rep: dict[str, Any], path: str) -> None:
    """Write the chart of `rep` to `path`."""
    with open(path, "w") as f:
        f.write(svg(rep))
