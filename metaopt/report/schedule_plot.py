"""Drawing the schedule picture with matplotlib: a Gantt chart per worker, measured above and
the simulator's timeline of the same work below, as a PNG and as an HTML page whose bars carry
tooltips (the action, its start, end and waits). matplotlib is the ``plot`` extra, imported
when a picture is drawn; figures are `matplotlib.figure.Figure`, never pyplot."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from metaopt.report.plot import SVG, _matplotlib, svg_tree, write_page
from metaopt.report.schedule_picture import Bar, SchedulePicture

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = {"F": "#9ecae1", "B": "#fdae6b", "W": "#a1d99b"}
WAIT = "#d9d9d9"


def draw(pic: SchedulePicture, *, tooltips: bool = False) -> Figure:
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [("measured", pic.workers, pic.bubble)] if pic.workers else []
    if pic.ideal:
        ideal_span = max((e for line in pic.ideal for _, _, e, _ in line), default=0.0)
        idle = [
            1 - sum(e - s for _, s, e, _ in line) / ideal_span if ideal_span else 0.0 for line in pic.ideal
        ]
        panels.append(("simulated (free communication)", pic.ideal, idle))
    rows = max(len(lines) for _, lines, _ in panels)
    fig = Figure(figsize=(12, 1.2 + 0.5 * rows * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    scale = 1e3  # seconds -> ms
    for n, (ax, (title, lines, idle)) in enumerate(zip(axes, panels, strict=True)):
        for w, bars in enumerate(lines):
            for k, bar in enumerate(bars):
                _bar(ax, w, bar, scale, f"metaopt-bar-{n}-{w}-{k}" if tooltips else None)
        ax.set_yticks(range(len(lines)), [f"worker {w} ({b:.0%} idle)" for w, b in enumerate(idle)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    # a simulated picture alone is in the simulator's cost units (x 1000), a measured one in ms
    axes[-1].set_xlabel("ms from the step's start" if pic.workers else "time, in cost units x 1000")
    legend = [Patch(color=c, label=k) for k, c in COLORS.items()] + [Patch(color=WAIT, label="waiting")]
    axes[0].legend(handles=legend, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=4)
    ideal = f"; simulated bubble {pic.ideal_bubble:.3f}" if pic.ideal_bubble is not None else ""
    fig.suptitle(f"{pic.name}: {pic.schedule}, {pic.micro_batches} micro-batches{ideal}", fontsize=11)
    fig.tight_layout()
    return fig


def _bar(ax, row: int, bar: Bar, scale: float, gid: str | None) -> None:  # noqa: ANN001 - an Axes
    action, start, end, waited = bar
    kind = action[0]
    # a stage's receives come first in its phase: its waits are drawn at the start of the bar
    if waited > 0:
        ax.barh(row, waited * scale, left=start * scale, color=WAIT, height=0.7, hatch="//", edgecolor="#999")
    patches = ax.barh(
        row,
        (end - start - waited) * scale,
        left=(start + waited) * scale,
        color=COLORS.get(kind, "#ccc"),
        height=0.7,
        edgecolor="#555",
        linewidth=0.3,
    )
    if gid is not None:
        patches[0].set_gid(gid)
    if (end - start) * scale > 0:
        ax.text((start + end) / 2 * scale, row, action, ha="center", va="center", fontsize=6, clip_on=True)


def write_png(pic: SchedulePicture, path: str) -> str:
    draw(pic).savefig(path, format="png", dpi=100)
    return path


def _tooltips(pic: SchedulePicture) -> str:
    root, ns = svg_tree(draw(pic, tooltips=True)), SVG
    panels = [pic.workers] if pic.workers else []
    panels += [pic.ideal] if pic.ideal else []
    for g in root.iter(f"{{{ns}}}g"):
        gid = g.get("id", "")
        if gid.startswith("metaopt-bar-"):
            n, w, k = (int(x) for x in gid.split("-")[2:])
            action, start, end, waited = panels[n][w][k]
            title = ET.Element(f"{{{ns}}}title")
            title.text = (
                f"worker {w} {action}: {start * 1e3:.2f}-{end * 1e3:.2f} ms, "
                f"compute {(end - start - waited) * 1e3:.2f} ms, waiting {waited * 1e3:.2f} ms"
            )
            g.insert(0, title)
    return ET.tostring(root, encoding="unicode")


def write_html(pic: SchedulePicture, path: str) -> str:
    hint = "Hover over a bar for its action, times and waits."
    return write_page(path, f"schedule picture: {pic.name}", hint, _tooltips(pic), pic.summary())
