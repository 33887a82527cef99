"""What the programs in ``scripts/`` share: the results table, the plot and the results JSON. (The output-directory
rule and the check of optional packages are the command line's: ``hf_dilated.cli``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1e4 else f"{value:.4g}"
    return str(value)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], width: int = 12) -> str:
    """A plain-text table, one line per row, columns right-aligned to at least ``width`` characters."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([width, len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    head = " | ".join(f"{c:>{w}}" for c, w in zip(columns, widths))
    return "\n".join([head, "-" * len(head)] + [" | ".join(f"{v:>{w}}" for v, w in zip(r, widths)) for r in cells])


def plot(path: str | Path, panels: Sequence[dict[str, Any]], title: str | None = None) -> Path:
    """Write a PNG of one or more panels side by side.

    A panel is ``{"title", "xlabel", "ylabel", "series": [{"label", "x", "y", "points": bool}], "logx", "logy",
    "vline": (x, label) or None}``; a series with ``points`` is drawn as markers only (e.g. evaluations), in the
    colour of the line drawn just before it; ``yerr`` (``[below, above]``) adds error bars (own colour) and
    ``annotate`` (one string per point) labels the points.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        last = None
        for s in panel["series"]:
            if s.get("yerr") is not None:  # error bars (e.g. the spread over windows); own colour
                last = ax.errorbar(s["x"], s["y"], yerr=s["yerr"], fmt=s.get("marker", "o") + ("" if s.get("points") else "-"),
                                   ms=4, capsize=2, lw=1, label=s["label"]).lines[0]
            elif s.get("points"):
                colour = last.get_color() if last is not None else None
                ax.scatter(s["x"], s["y"], marker=s.get("marker", "o"), s=30, zorder=3, color=colour, label=s["label"])
            else:
                (last,) = ax.plot(s["x"], s["y"], lw=1.3, marker=s.get("marker"), label=s["label"])
            for x, y, text in zip(s["x"], s["y"], s.get("annotate") or ()):
                ax.annotate(text, (x, y), fontsize=5, xytext=(3, 2), textcoords="offset points")
        if panel.get("vline"):
            x, label = panel["vline"]
            ax.axvline(x, color="gray", linestyle="--", linewidth=1, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path
