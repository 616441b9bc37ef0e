"""Drawing the memory picture with matplotlib: a PNG, and an HTML page holding the same chart as
SVG with a tooltip per op (its index, role, printed line and bytes), which any browser shows on
hover without scripts.

matplotlib is an optional dependency (``pip install 'metaopt[plot]'``): it is imported here
only, when a picture is drawn. Figures are made with `matplotlib.figure.Figure`, not pyplot,
so drawing never changes the caller's backend or opens a window.
"""

from __future__ import annotations

import html
import io
import math
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from metaopt.passes.memory_estimate import human_bytes
from metaopt.report.memory_picture import MemoryPicture, unit_for

if TYPE_CHECKING:  # matplotlib is optional: imported by `_matplotlib` when drawing
    from matplotlib.figure import Figure

# Role groups the picture colours (the list), each op role in one of them.
GROUPS: dict[str, tuple[str, ...]] = {
    "forward": ("forward", "loss"),
    "backward": ("backward",),
    "recompute": ("recompute", "partition"),
    "offload/prefetch": ("offload", "prefetch"),
    "optimize": ("optimize", "lr-sched", "backward-update"),
    "comm": ("comm", "startup"),
}
COLORS = {
    "forward": "#9ecae1",
    "backward": "#fdd0a2",
    "recompute": "#c7b9e2",
    "offload/prefetch": "#a1d99b",
    "optimize": "#d9d9d9",
    "comm": "#fff3a0",
}
GROUP_OF_ROLE = {r: g for g, rs in GROUPS.items() for r in rs}
MAX_TOOLTIPS = 4000  # past this many ops, one tooltip covers a few ops (page size)
LIST_VARS = 10  # the largest storages listed beside the chart


def _matplotlib():  # noqa: ANN202 - the module
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401 - loads the submodule
    except ImportError as e:
        raise ImportError(
            "the memory picture needs matplotlib, which metaopt lists as an optional extra: "
            "pip install 'metaopt[plot]'"
        ) from e
    return matplotlib


def role_runs(op_roles: list[str]) -> list[tuple[int, int, str]]:
    """(first op, one past the last, group) of each run of consecutive ops in one role group."""
    runs: list[tuple[int, int, str]] = []
    for i, r in enumerate(op_roles):
        g = GROUP_OF_ROLE.get(r, "comm")
        if runs and runs[-1][2] == g and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, g)
        else:
            runs.append((i, i + 1, g))
    return runs


def draw(pic: MemoryPicture, *, tooltips: bool = False) -> Figure:
    """The chart as a matplotlib Figure; `tooltips`: add one invisible column per op (or a few
    ops) whose gid `write_html` turns into an SVG ``<title>``."""
    mpl = _matplotlib()
    fig = mpl.figure.Figure(figsize=(12, 5.4), dpi=100, layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=(2.9, 1))
    ax, side = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    n = len(pic.roles)
    series = [s for s in (pic.predicted, pic.with_workspace, pic.measured) if s]
    top = max(1, max((x for s in series for x in s if x is not None), default=1))
    unit, scale = unit_for(top)
    for start, end, group in role_runs(pic.roles):
        ax.axvspan(start - 0.5, end - 0.5, color=COLORS[group], lw=0, zorder=0)
    _lines(ax, pic, scale)
    _mark_peak(ax, pic, scale)
    _legend(ax, pic)
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    ax.set_ylim(0, top / scale * 1.12)  # from zero: the state's share of the peak stays visible
    ax.set_xlabel("op index (program order)")
    ax.set_ylabel(f"live device memory ({unit})")
    dims = ", ".join(f"{k}={v}" for k, v in pic.dims.items())
    ax.set_title(f"{pic.name}: live bytes over one step ({dims}{', ' if dims else ''}{pic.device})",
                 loc="left", fontsize=11)  # fmt: skip
    if not pic.measured:
        ax.text(0.01, 0.02, f"predicted only: {pic.note}", transform=ax.transAxes, fontsize=8,
                color="#a50f15", wrap=True)  # fmt: skip
    _side_list(side, pic)
    if tooltips:
        _tooltip_columns(ax, pic, top / scale * 1.12)
    return fig


def _lines(ax, pic: MemoryPicture, scale: float) -> None:  # noqa: ANN001 - an Axes
    """Predicted wide and pale under measured thin and dark: where they agree one reads as a
    dark line on a pale band, and where they part the band shows beside it."""
    xs = list(range(len(pic.roles)))
    ax.plot(xs, [b / scale for b in pic.predicted], color="#e6550d", lw=3.2, alpha=0.55,
            label="predicted (estimate_memory)", zorder=2)  # fmt: skip
    if pic.with_workspace:
        ax.plot(xs, [b / scale for b in pic.with_workspace], color="#e6550d", lw=1, ls=":",
                label="predicted + kernel workspace", zorder=2)  # fmt: skip
    if pic.measured:
        ys = [math.nan if b is None else b / scale for b in pic.measured]
        ax.plot(xs, ys, color="#08306b", lw=1.1, label="measured (executor)", zorder=3)
    ax.axhline(pic.persistable_bytes / scale, color="#636363", lw=0.8, ls="--",
               label="params + optimizer state", zorder=1)  # fmt: skip


def _mark_peak(ax, pic: MemoryPicture, scale: float) -> None:  # noqa: ANN001 - an Axes
    op, b = pic.peak
    if op < 0:
        return
    ax.axvline(op, color="#a50f15", lw=0.9, ls=":", zorder=4)
    ax.plot([op], [b / scale], "o", color="#a50f15", ms=5, zorder=5)
    what = "measured" if pic.measured else "predicted"
    left = op > 0.6 * len(pic.roles)  # keep the label inside the axes
    ax.annotate(
        f"{what} peak {human_bytes(b)}\nop {op}: {_op_type(pic.labels[op])} ({pic.roles[op]})",
        (op, b / scale), xytext=(-8 if left else 8, 6), textcoords="offset points",
        ha="right" if left else "left", va="bottom", fontsize=8, color="#a50f15", zorder=6,
    )  # fmt: skip


def _legend(ax, pic: MemoryPicture) -> None:  # noqa: ANN001 - an Axes
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    present = dict.fromkeys(g for _, _, g in role_runs(pic.roles))
    handles += [Patch(color=COLORS[g], label=g) for g in GROUPS if g in present]
    # below the chart, so it never covers the lines wherever the peak is
    ax.figure.legend(handles=handles, loc="outside lower center", fontsize=8, ncol=5, frameon=False)


def _side_list(side, pic: MemoryPicture) -> None:  # noqa: ANN001 - an Axes
    """The largest storages alive at the marked peak, beside the chart."""
    side.axis("off")
    w = pic.where
    roles = "\n".join(f"  {r:<10} {human_bytes(b):>10}" for r, b in list(w.by_role().items())[:6])
    rows = "\n".join(
        f"{human_bytes(v.nbytes):>10}  {v.role:<9} {_shorten(v.name, 38)}" for v in w.largest(LIST_VARS)
    )
    where = f"op {w.op}" if w.op >= 0 else "the start"
    text = (
        f"alive at {where} ({human_bytes(w.total_bytes)}),\nby the estimate\n\n"
        f"by role:\n{roles}\n\nlargest:\n{rows}"
    )
    side.text(0, 1, text, va="top", ha="left", family="monospace", fontsize=7, transform=side.transAxes)


def _tooltip_columns(ax, pic: MemoryPicture, height: float) -> None:  # noqa: ANN001 - an Axes
    from matplotlib.patches import Rectangle

    n = len(pic.roles)
    per = max(1, math.ceil(n / MAX_TOOLTIPS))
    for start in range(0, n, per):
        end = min(n, start + per)
        ax.add_patch(Rectangle((start - 0.5, 0), end - start, height, facecolor="white", alpha=0.0,
                               lw=0, zorder=7, gid=f"metaopt-op-{start}"))  # fmt: skip


def tooltip_text(pic: MemoryPicture, start: int, end: int) -> str:
    """The tooltip of ops start..end-1: the op with the most measured (else predicted) bytes."""
    vals = pic.measured if pic.measured else pic.predicted
    i = max(range(start, end), key=lambda k: -1 if vals[k] is None else vals[k])
    head = f"op {i}" if end - start == 1 else f"ops {start}-{end - 1}, most at op {i}"
    parts = [f"{head} ({pic.roles[i]})", pic.labels[i].split("  #")[0].strip()]
    if pic.measured and pic.measured[i] is not None:
        parts.append(f"measured {human_bytes(pic.measured[i])}")
    parts.append(f"predicted {human_bytes(pic.predicted[i])}")
    return "\n".join(parts)


def write_png(pic: MemoryPicture, path: str) -> str:
    fig = draw(pic)
    fig.savefig(path, format="png", dpi=100)
    return path


SVG = "http://www.w3.org/2000/svg"


def svg_tree(fig: Figure) -> ET.Element:
    """`fig` as an SVG element tree, to which tooltips (``<title>``) can be added by element id."""
    buf = io.BytesIO()
    fig.savefig(buf, format="svg")
    ET.register_namespace("", SVG)
    ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")
    return ET.fromstring(buf.getvalue())


def svg_with_tooltips(pic: MemoryPicture) -> str:
    """The chart as SVG text, each op's column carrying a ``<title>`` tooltip."""
    root, ns = svg_tree(draw(pic, tooltips=True)), SVG
    n = len(pic.roles)
    per = max(1, math.ceil(n / MAX_TOOLTIPS))
    for g in root.iter(f"{{{ns}}}g"):
        gid = g.get("id", "")
        if gid.startswith("metaopt-op-"):
            start = int(gid.rsplit("-", 1)[1])
            title = ET.Element(f"{{{ns}}}title")
            title.text = tooltip_text(pic, start, min(n, start + per))
            g.insert(0, title)
            # matplotlib writes an invisible patch as `fill: none`, which takes no hover: an
            # unpainted fill does not receive pointer events; a transparent painted one does
            for path in g.iter(f"{{{ns}}}path"):
                path.set("style", "fill: #ffffff; fill-opacity: 0; stroke: none")
    return ET.tostring(root, encoding="unicode")


def write_html(pic: MemoryPicture, path: str) -> str:
    """A self-contained page: the SVG chart (hover an op for its tooltip) and the summary."""
    svg = svg_with_tooltips(pic)
    return write_page(
        path,
        f"memory picture: {pic.name}",
        "Hover over the chart for each op's line and bytes.",
        svg,
        pic.summary(n=30),
    )


def write_page(path: str, title: str, hint: str, svg: str, summary: str) -> str:
    """A self-contained HTML page: a heading, a hint, the SVG chart and a text summary."""
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:1em}svg{max-width:100%;height:auto}"
        "pre{font-size:12px}</style></head><body>\n"
        f"<h2>{html.escape(title)}</h2>\n<p>{html.escape(hint)}</p>\n"
        f"{svg}\n<pre>{html.escape(summary)}</pre>\n</body></html>\n"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def _op_type(label: str) -> str:
    """The op type in a printed op line (``outs = Type(args)  # fields``)."""
    code = label.split("  #")[0]
    call = code.split(" = ", 1)[-1]
    return call.split("(", 1)[0].strip()


def _shorten(name: str, width: int) -> str:
    """`name` in at most `width` characters, keeping its end (the layer and the @ suffixes)."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]
