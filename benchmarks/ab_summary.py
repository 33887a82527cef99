"""Summarize the JSON lines of ``compare_checkouts.py`` runs: per shape, each checkout's median forward and
forward+backward time over its rounds (a median: the first round on a cold machine can read 10% slow, session 60),
its speed against a base checkout (> 1: faster than the base), and whether its results are the base's bit for bit
(the checksums' int16 bit-pattern sums; a tensor that differs shows its largest difference of float64 sums instead,
relative to the sum of magnitudes where the line has it, else to the sum, which for a tensor summing to about zero,
such as dK, overstates it).

    python benchmarks/compare_checkouts.py .base/ck_main main 65536 262144 >> ab.jsonl   # the base
    python benchmarks/compare_checkouts.py . new 65536 262144 >> ab.jsonl                 # the change
    python benchmarks/ab_summary.py ab.jsonl --base main [--json summary.json] [--plot speed.png]

``--plot`` draws each checkout's speed against the base per shape, forward and forward+backward, as bars around 1.0.

Lines that are not JSON objects (a log mixed in) are skipped. Why a tool: every kernel A/B of the issue-14 sessions
ended in this arithmetic, done by hand."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

TENSORS = ("out", "dq", "dk", "dv")  # the order of compare_checkouts.py's ``cks``
SHAPE_KEYS = ("op", "N", "D", "heads", "kv_heads", "dtype", "block")


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a file of ``compare_checkouts.py`` lines (anything else skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"label", "fwd_ms", "cks"} <= row.keys():
            rows.append(row)
    return rows


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _same_results(base_cks: list, cks: list) -> dict:
    """Per tensor: ``"bit-equal"`` when every run's int16 sum matches every base run's, else the largest difference
    between the float64 sums, relative to the base's sum of magnitudes (``cks[i][2]``, where given) or its sum."""
    verdict = {}
    for i, name in enumerate(TENSORS):
        if i >= len(cks[0]) or i >= len(base_cks[0]):
            continue
        bits = {c[i][1] for c in base_cks} | {c[i][1] for c in cks}
        if len(bits) == 1:
            verdict[name] = "bit-equal"
        else:
            ref = base_cks[0][i][0]
            scale = base_cks[0][i][2] if len(base_cks[0][i]) > 2 else abs(ref)
            worst = max(abs(c[i][0] - ref) for c in cks)
            verdict[name] = f"rel diff {worst / max(scale, 1e-30):.1e}"
    return verdict


def summarize(rows: list[dict], base: str) -> list[dict]:
    """One entry per (shape, label): median times, rounds, speed against ``base`` at the same shape and result check."""
    labels = sorted({r["label"] for r in rows})
    if base not in labels:
        raise ValueError(f"{base!r} is not one of the file's labels {labels}")
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[tuple(r.get(k) for k in SHAPE_KEYS)][r["label"]].append(r)
    out = []
    for shape, by_label in groups.items():
        base_rows = by_label.get(base)
        for label, runs in sorted(by_label.items(), key=lambda kv: (kv[0] != base, kv[0])):
            entry = dict(zip(SHAPE_KEYS, shape), label=label, rounds=len(runs),
                         fwd_ms=_median([r["fwd_ms"] for r in runs]),
                         fwdbwd_ms=_median([r.get("fwdbwd_ms") for r in runs]))
            if base_rows and label != base:
                for mode in ("fwd_ms", "fwdbwd_ms"):
                    b = _median([r.get(mode) for r in base_rows])
                    entry[f"speed_{mode[:-3]}"] = b / entry[mode] if b and entry[mode] else None
                entry["results"] = _same_results([r["cks"] for r in base_rows], [r["cks"] for r in runs])
            out.append(entry)
    return out


def speed_pairs(summary: list[dict], base: str) -> list[dict]:
    """The entries that have a speed against ``base`` (a shape both ran); a ``ValueError`` where there is none."""
    pairs = [e for e in summary if "results" in e]
    if not pairs:
        raise ValueError(f"no shape has both {base!r} and another checkout: nothing to plot")
    return pairs


def plot(summary: list[dict], base: str, path: Path, title: str | None = None) -> None:
    """Bars of each checkout's speed against ``base`` per shape (forward, forward+backward), a line at 1.0."""
    pairs = speed_pairs(summary, base)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("fwd", "fwdbwd") if any(e.get(f"speed_{m}") for e in pairs)]
    names = {"fwd": "forward", "fwdbwd": "forward+backward"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(pairs) * len(modes) + 2), 4.2))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(pairs))]
        ys = [e.get(f"speed_{mode}") or 0.0 for e in pairs]
        bars = ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, label=names[mode])
        ax.bar_label(bars, labels=[f"{y:.3f}" for y in ys], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(pairs)))
    ax.set_xticklabels([f"{e['label']}\nN={e['N'] // 1024}K D={e['D']}\nH {e['heads']}/{e['kv_heads']}"
                        + (f"\nblock {e['block']}" if e.get("block") else "") for e in pairs], fontsize=8)
    speeds = [e.get(f"speed_{m}") for e in pairs for m in modes if e.get(f"speed_{m}")]
    span = max(0.05, max(abs(s - 1.0) for s in speeds) * 1.3)
    ax.set_ylim(1.0 - span, 1.0 + span)
    ax.set_ylabel(f"speed against {base} (> 1: faster)")
    ax.set_title(title or f"A/B against {base}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", type=Path, help="compare_checkouts.py output (JSON lines; other lines are skipped)")
    ap.add_argument("--base", default="main", help="the label the others are measured against (default: main)")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--plot", type=Path, help="also draw each checkout's speed against the base here (PNG)")
    ap.add_argument("--title", help="the plot's title (default: 'A/B against BASE')")
    args = ap.parse_args(argv)
    if args.title is not None and args.plot is None:
        ap.error("--title: names the plot, so it needs --plot")
    if not args.jsonl.is_file():
        ap.error(f"jsonl: {str(args.jsonl)!r} is not a file")
    rows = read_rows(args.jsonl)
    if not rows:
        ap.error(f"jsonl: {str(args.jsonl)!r} holds no compare_checkouts.py line")
    try:
        summary = summarize(rows, args.base)
    except ValueError as e:
        ap.error(f"--base: {e}")
    if args.plot:  # refused before anything is printed or written
        try:
            speed_pairs(summary, args.base)
        except ValueError as e:
            ap.error(f"--plot: {e}")
    for e in summary:
        shape = f"{e['op'] or 'dilated'} N={e['N']} D={e['D']} H={e['heads']}/{e['kv_heads']}"
        if e.get("block"):  # a shape key: block-sparse A/Bs at two block sizes are two shapes
            shape += f" block={e['block']}"
        line = f"{shape:34s} {e['label']:>10s} x{e['rounds']}  fwd {e['fwd_ms']:.3f} ms"
        if e["fwdbwd_ms"] is not None:
            line += f"  fwd+bwd {e['fwdbwd_ms']:.3f} ms"
        if "results" in e:
            speeds = [f"{m} {e[f'speed_{m}']:.3f}x" for m in ("fwd", "fwdbwd") if e.get(f"speed_{m}")]
            line += "  speed vs " + args.base + ": " + ", ".join(speeds)
            line += "  | " + ", ".join(f"{k} {v}" for k, v in e["results"].items())
        print(line)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot(summary, args.base, args.plot, args.title)


if __name__ == "__main__":
    main(sys.argv[1:])
