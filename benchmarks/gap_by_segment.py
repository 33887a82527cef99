"""Where the gap between the dilated kernels and dense cuDNN comes from, measured rather than guessed: the kernels on
one branch ``(w, 1)`` as the segment grows (at ``w = N`` that is dense causal attention through the dilated path),
LongNet's branches added one at a time to ``(2048, 1)``, all of them, and dense causal SDPA on cuDNN and
FlashAttention-2, at one shape, forward and forward+backward. ``cudnn-segments`` rows run cuDNN on exactly the dilated
work: each branch's segments gathered beforehand into a batch of dense causal sequences of ``w / r`` rows (the gather,
the scatter back and the merge of branches not timed), what the best dense kernel reaches on segments that short.

    python benchmarks/gap_by_segment.py --out benchmarks/results        # H100, 64K, H 16, D 128: about 2 minutes

Each call is timed after ``--warm-s`` seconds of back-to-back calls (the clock a power-capped GPU sustains under it),
as the median of CUDA-event times, with the mean SM clock read meanwhile (``scripts/gpu_monitor.py``). Rows give useful
TFLOP/s (``bench_attention``'s FLOP count: the pairs each pattern computes, fwd+bwd = 3.5 x fwd) and TFLOP/s per GHz
of that clock, which compares methods that ran at different clocks. A single branch whose per-GHz rate grows with
``w`` up to the dense kernels' says the loop runs at their rate and the gap is each query tile's fixed cost (its
prologue and epilogue, paid once per ~w / 256 key tiles); each added branch's time over its share of the work says
what its launch costs beyond its FLOPs. Session 26's reading: ``benchmarks/NOTES_triton.md``.

Writes ``<out>/gap-by-segment-<gpu>-<date>.json`` and a PNG beside it. Without CUDA it runs the PyTorch reference and
SDPA's math backend (``bench_attention.run_sdpa`` off the GPU) at ``--n 1024`` (a smoke run of the script: those times say nothing about the kernels)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)

from bench_attention import dense_flops, dilated_flops, run_sdpa, segment_calls  # noqa: E402
from gpu_monitor import GpuMonitor  # noqa: E402
from timing import cuda_median_ms, timed_on_gpu  # noqa: E402

from hf_dilated import dilated_attention  # noqa: E402
from hf_dilated.environment import kernel_switches  # noqa: E402

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
DENSE = ("cudnn", "flash")
SEGMENTS = "cudnn-segments"  # cuDNN on the branches' segments, gathered (``bench_attention.segment_calls``)


def cases(n: int) -> list[tuple[str, list | None]]:
    """``(kind, branches)``: one branch ``(w, 1)`` for each power of two from 2048 (or ``n``) to ``n``; ``(2048, 1)``
    with each LongNet branch of ``r > 1`` that fits; all that fit; then the dense kernels."""
    base = min(2048, n)
    single = [("dilated", [(w, 1)]) for w in sorted({min(base * 2 ** i, n) for i in range(32) if base * 2 ** i <= n}
                                                   | {n})]
    fits = [(w, r) for w, r in LONGNET if w <= max(n, base)] or [(base, 1)]
    added = [("dilated", [(base, 1), (w, r)]) for w, r in fits if r > 1]
    full = [("dilated", fits)] if len(fits) > 2 else []
    # cuDNN on the same segments, each branch's rows gathered beforehand: shorter than N and dividing it
    same = [(SEGMENTS, b) for _, b in single + full if all(w < n and n % w == 0 for w, _ in b)]
    return single + added + full + same + [(kind, None) for kind in DENSE]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=None, help="tokens (default 65536 on a GPU, 1024 without)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--warm-s", type=float, default=1.0, help="seconds of back-to-back calls before each timing")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    n = args.n if args.n is not None else (65536 if cuda else 1024)
    hk = args.kv_heads or args.heads
    if n < 256:
        ap.error(f"--n must be >= 256, got {n}")
    if args.heads < 1 or hk < 1 or args.heads % hk:
        ap.error(f"--heads must be a positive multiple of --kv-heads, got {args.heads} and {hk}")
    if args.dim not in (64, 128, 256):
        ap.error(f"--dim must be one of 64, 128, 256, got {args.dim}")
    if not args.warm_s >= 0:
        ap.error(f"--warm-s must be >= 0, got {args.warm_s}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = "triton" if cuda else "torch"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, args.heads, n, args.dim, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, hk, n, args.dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def timer(fn):
        if cuda:
            return cuda_median_ms(fn, args.reps)
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]

    rows = []
    with GpuMonitor() as monitor:
        todo = [(kind, br, mode) for kind, br in cases(n) for mode in args.modes]
        for kind, branches, mode in tqdm(todo, desc="gap by segment", disable=None):
            if kind == "dilated":
                ws, rs = [w for w, _ in branches], [r for _, r in branches]

                def fwd():
                    with torch.no_grad():
                        return dilated_attention(q, k, v, ws, rs, is_causal=True, backend=backend)

                def step():
                    out = dilated_attention(q, k, v, ws, rs, is_causal=True, backend=backend)
                    return torch.autograd.grad(out, (q, k, v), do)

                flops = dilated_flops(n, branches, args.dim, args.heads, 1)
            elif kind == SEGMENTS:
                fwd, step = segment_calls(q, k, v, do, branches, "cudnn")
                flops = dilated_flops(n, branches, args.dim, args.heads, 1)
            else:
                def fwd():
                    return run_sdpa(q, k, v, None, kind)

                def step():
                    return run_sdpa(q, k, v, do, kind)

                flops = dense_flops(n, args.dim, args.heads, 1)
            fn = fwd if mode == "fwd" else step
            try:
                if cuda:
                    ms, gpu, _ = timed_on_gpu(fn, timer, monitor, args.warm_s)
                else:
                    fn()
                    ms, gpu = timer(fn), {}
            except RuntimeError as e:  # a dense backend this GPU or build lacks: say so in the row
                rows.append(dict(kind=kind, branches=branches, mode=mode, error=str(e).splitlines()[0][:200]))
                continue
            tflops = flops * (3.5 if mode == "fwdbwd" else 1.0) / ms / 1e9
            mhz = gpu.get("gpu_clock_mhz")
            rows.append(dict(kind=kind, branches=branches, mode=mode, ms=float(f"{ms:.5g}"), tflops=float(f"{tflops:.4g}"),
                             **gpu, tflops_per_ghz=round(tflops / (mhz / 1000), 1) if mhz else None))

    for r in rows:
        label = r["kind"] if r["branches"] is None else " + ".join(f"({w},{rr})" for w, rr in r["branches"])
        if r["kind"] == SEGMENTS:
            label = "cuDNN on the segments of " + label
        tail = r.get("error") or (f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s" + (
            f" {r['gpu_clock_mhz']:6.0f} MHz {r['tflops_per_ghz']:6.1f} per GHz" if r.get("tflops_per_ghz") else ""))
        print(f"{r['mode']:7s} {label:60s} {tail}")

    gpu_name = torch.cuda.get_device_name() if cuda else "cpu"
    try:  # the version is part of what made the numbers
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = dict(gpu=gpu_name, torch=torch.__version__, triton=triton_version,
                N=n, H=args.heads, Hk=hk, D=args.dim, dtype=str(dtype).replace("torch.", ""), causal=True,
                backend=backend, warm_s=args.warm_s, reps=args.reps, switches=kernel_switches(),
                date=datetime.datetime.now().isoformat()[:19],
                command="python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
                flops="useful: 4*D per computed (query, key) pair; dense causal for SDPA; fwd+bwd = 3.5x fwd")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "gap-by-segment-" + re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") + "-"
                        + meta["date"][:10])
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, meta, stem + ".png")
    print(f"wrote {stem}.json and {stem}.png")
    return 0


def plot(rows: list, meta: dict, png: str) -> None:
    """TFLOP/s per GHz (or TFLOP/s where no clock was read) of one branch against its segment length, per mode, with
    the dense kernels and the full LongNet set as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=["fwd", "fwdbwd"].index)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    per_ghz = all(r.get("tflops_per_ghz") for r in rows if "ms" in r)
    key = "tflops_per_ghz" if per_ghz else "tflops"
    for ax, mode in zip(axes[0], modes):
        ok = [r for r in rows if r["mode"] == mode and "ms" in r]
        single = [r for r in ok if r["kind"] == "dilated" and len(r["branches"]) == 1]
        ax.plot([r["branches"][0][0] for r in single], [r[key] for r in single], "o-", label="dilated, one branch (w, 1)")
        same = [r for r in ok if r["kind"] == SEGMENTS and len(r["branches"]) == 1]
        if same:
            ax.plot([r["branches"][0][0] for r in same], [r[key] for r in same], "s:",
                    label="cuDNN on the same segments (gathered)")
        colors = iter(["tab:red", "tab:green", "tab:purple", "tab:brown"])
        names = {"dilated": "dilated, LongNet branches", SEGMENTS: "cuDNN on LongNet's segments (gathered)"}
        for r in ok:
            if r["kind"] in DENSE or len(r["branches"]) == len(LONGNET):
                name = names.get(r["kind"], f"dense {r['kind']}")
                ax.axhline(r[key], ls="--", color=next(colors, "gray"), label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment length w")
        ax.set_ylabel("useful TFLOP/s per GHz of SM clock" if per_ghz else "useful TFLOP/s")
        ax.set_title(f"{mode}, N={meta['N']}, {meta['H']}/{meta['Hk']}/{meta['D']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']}: the gap by segment length ({meta['dtype']}, causal)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
