"""A/B of a host-side switch of the dilated op on one GPU, in one process, call by call: the time the host takes to
queue one call, and the time a call takes when ``--queue`` calls are queued back to back (what the benchmarks time).

Host-time changes are measured this way, not by separate runs: the lent machine's host speed drifts between runs by
more than such a change (``benchmarks/NOTES_triton.md``, round 2, sessions 38-41). The op is called as the attention
benchmark calls it (``scripts/bench_attention.py``'s ``run_dilated``: ``hf_dilated.dilated_attention`` under eager
autograd, LongNet branches, causal, bf16, B 1), so the numbers include the op's own Python and autograd.

    PYTHONPATH=$PWD python benchmarks/host_ab.py --switch plans --shapes 9/3/64 16/16/128 --seqlens 16384
    python benchmarks/host_ab.py --plot-from A.json [B.json ...] --plot ab.png    # redraw records (no GPU needed)

``--switch plans``: recorded launch plans (``ops/triton/plans.py``) against the launchers' code at every call;
``relaunch``: kernels relaunched directly against Triton's launch; ``concurrent``: the backward's dQ launches on a
second stream beside the dK/dV ones (``launch.CONCURRENT_BACKWARD``) against all on the current stream; ``graphs``:
replays of a pointer set seen before as one CUDA graph (``plans.GRAPHS``) against launch by launch. Both sides
must give the same bits (checked first; dQ summed by reduce-adds at head dim 128 within 1e-2). Writes
``host_ab_<switch>-<GPU>-<date>.json`` under ``--out`` and a PNG beside it: both sides' host and queued
milliseconds per case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import LONGNET, parse_shape, run_dilated  # noqa: E402

from hf_dilated.environment import run_environment  # noqa: E402
from hf_dilated.ops.triton import launch, plans, relaunch  # noqa: E402

SWITCHES = {"plans": (plans, "ENABLED"), "relaunch": (relaunch, "ENABLED"),
            "concurrent": (launch, "CONCURRENT_BACKWARD"), "graphs": (plans, "GRAPHS")}  # the module flag each switch sets


def host_ms(call, n: int) -> float:
    """Median host milliseconds to queue one call, the GPU idle at each start (synchronised before)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def queued_ms(call, n: int) -> float:
    """Milliseconds a call of ``n`` queued back to back, by CUDA events around the block."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def run_case(switch: str, mode: str, N: int, H: int, Hk: int, D: int, rounds: int, queue: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(N + H)
    q = torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hk, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q) if mode == "fwdbwd" else None
    module, flag_name = SWITCHES[switch]
    saved = getattr(module, flag_name)

    def call():
        return run_dilated("triton", q, k, v, LONGNET, do)

    results, row = {}, dict(switch=switch, mode=mode, N=N, H=H, Hk=Hk, D=D, host_ms={}, queued_ms={})
    try:
        for flag in (False, True):
            setattr(module, flag_name, flag)
            call()  # compile, record
            results[flag] = call()
            row["host_ms"][str(flag)], row["queued_ms"][str(flag)] = [], []
        names = ("out", "dq", "dk", "dv")
        pairs = list(zip(names, *(r if isinstance(r, tuple) else (r,) for r in results.values())))
        row["identical"] = {n: bool(torch.equal(a, b)) for n, a, b in pairs}
        row["rel_err"] = {n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                          for n, a, b in pairs}
        for i in range(rounds):  # alternate the order round by round
            for flag in ((False, True) if i % 2 == 0 else (True, False)):
                setattr(module, flag_name, flag)
                row["host_ms"][str(flag)].append(round(host_ms(call, 12), 4))
                row["queued_ms"][str(flag)].append(round(queued_ms(call, queue), 4))
    finally:
        setattr(module, flag_name, saved)
    for what in ("host_ms", "queued_ms"):
        off, on = (statistics.median(row[what][k]) for k in ("False", "True"))
        row[f"{what}_median"] = dict(off=round(off, 4), on=round(on, 4), speedup=round(off / on, 3))
    return row


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bars of each case's median host ms and queued ms, switch off and on, labelled with on's speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['mode']} {r['N'] // 1024}K\n{r['H']}/{r['Hk']}/{r['D']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 1.3 * len(rows) + 3), 4.4))
    x = list(range(len(rows)))
    for ax, what, name in zip(axes, ("host_ms", "queued_ms"),
                              ("host ms to queue one call", "ms a call, calls queued back to back")):
        off = [r[f"{what}_median"]["off"] for r in rows]
        on = [r[f"{what}_median"]["on"] for r in rows]
        ax.bar([i - 0.2 for i in x], off, 0.4, label="off", color="#999999")
        ax.bar([i + 0.2 for i in x], on, 0.4, label="on", color="#1f77b4")
        for i, r in enumerate(rows):
            ax.annotate(f"{r[f'{what}_median']['speedup']:.2f}x", (i + 0.2, on[i]), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(name)
    axes[0].legend(title=rows[0]["switch"] if rows else None)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", choices=tuple(SWITCHES), default="plans")
    ap.add_argument("--shapes", nargs="+", default=["9/3/64", "16/16/128"], metavar="H/Hk/D")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    ap.add_argument("--modes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    ap.add_argument("--rounds", type=int, default=8, help="blocks each way, alternated")
    ap.add_argument("--queue", type=int, default=20, help="calls queued back to back per block")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON", help="draw these records' rows (no GPU run)")
    ap.add_argument("--plot", metavar="PNG", help="where --plot-from draws")
    args = ap.parse_args()
    if args.plot_from or args.plot:
        if not (args.plot_from and args.plot):
            ap.error("--plot-from and --plot go together (records to draw, and the PNG to draw them in)")
        rows, gpus = [], set()
        for name in args.plot_from:
            with open(name) as f:
                record = json.load(f)
            rows += record["rows"]
            gpus.add(record["meta"].get("device", "?"))
        plot(rows, args.plot, f"host A/B on {', '.join(sorted(gpus))} ({len(args.plot_from)} records)")
        print("wrote", args.plot)
        return 0
    try:
        shapes = [parse_shape(x) for x in args.shapes]
    except ValueError as err:
        ap.error(str(err))
    if args.rounds < 1 or args.queue < 1:
        ap.error(f"--rounds and --queue must be >= 1, got {args.rounds} and {args.queue}")
    if min(args.seqlens) < 1:
        ap.error(f"--seqlens must be positive token counts, got {args.seqlens}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (host time against GPU time)")
    rows = []
    for mode in args.modes:
        for N in args.seqlens:
            for H, Hk, D in shapes:
                rows.append(run_case(args.switch, mode, N, H, Hk, D, args.rounds, args.queue))
                print(json.dumps({k: rows[-1][k] for k in ("mode", "N", "H", "Hk", "D", "identical",
                                                             "host_ms_median", "queued_ms_median")}), flush=True)
    gpu = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"host_ab_{args.switch}-{gpu.replace(' ', '_')}-{datetime.date.today()}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=run_environment(dtype=torch.bfloat16), command=" ".join(sys.argv), rows=rows), f, indent=1)
    plot(rows, path[:-len(".json")] + ".png", f"{args.switch} off / on, {gpu}: {' '.join(sys.argv[1:])}")
    print("wrote", path)
    # dQ at head dim 128 is summed by reduce-adds in no fixed order (the fused dK/dV launch): held to 1e-2, the rest
    # bit for bit
    bad = [r for r in rows if any(v > 1e-2 for v in r["rel_err"].values())
           or not all(same for n, same in r["identical"].items() if n != "dq")]
    if bad:
        print(f"the two sides gave different results: {[(r['mode'], r['N'], r['H'], r['D']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
