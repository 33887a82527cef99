"""Time and peak memory of the PyTorch reference backend against a gather + SDPA lower bound (issue 9, item 6).

Three rows per (N, layer, pass): ``reference`` (the backend as users get it: on a plain layout the fused-bucket path,
``ops/fused_buckets.py``), ``tiled`` (the reference's tiled path, which the other layouts take) and the lower bound.
Each row records which path ran and the reference's relative error against the tiled path (same inputs).

The baseline gathers each branch's dilated rows per head-offset class into ``[segments, heads, w / r, D]`` and runs
``F.scaled_dot_product_attention(is_causal=True)`` on them, then adds the branch outputs: the work the reference
does, on the fused kernel, *without* the log-sum-exp or the exact merge (so a lower bound on its time). Both run on a
contiguous layout (one sequence per row, no padding). Writes one JSON file.

    python scripts/bench_reference.py --device cuda --lengths 4096 8192 16384 32768 65536 --out DIR/reference.json
    python scripts/bench_reference.py --device cpu --lengths 1024 2048 4096 --heads 4 --dim 64 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_dilated.config import DENSE_SEGMENT  # noqa: E402
from hf_dilated.ops.layout import resolve_layout  # noqa: E402
from hf_dilated.ops import fused_buckets  # noqa: E402
from hf_dilated.ops.reference import dilated_attention_reference, last_path, tiled_attention_reference  # noqa: E402

LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))


def gather_sdpa(q, k, v, branches, scale):
    """The lower bound: per branch and offset class, gather, SDPA (causal), scatter-add (no lse, no exact merge)."""
    B, H, N, D = q.shape
    out = torch.zeros_like(q)
    for w, r in branches:
        for o in range(r):
            heads = torch.arange(o, H, r, device=q.device)
            slots = min(w, N) // r if w >= N else w // r
            parts = []
            for t in (q, k, v):
                x = t[:, heads, o::r]
                n = x.shape[2]
                seg = -(-n // slots)
                x = F.pad(x, (0, 0, 0, seg * slots - n))
                x = x.view(B, len(heads), seg, slots, D).transpose(1, 2)
                parts.append(x.reshape(B * seg, len(heads), slots, D))
            y = F.scaled_dot_product_attention(*parts, is_causal=True, scale=scale)
            y = y.view(B, seg, len(heads), slots, D).transpose(1, 2).reshape(B, len(heads), seg * slots, D)[:, :, :n]
            out[:, heads, o::r] += y / len(branches)
    return out


def measure(fn, q, k, v, backward: bool, reps: int):
    """Median seconds and peak extra bytes (CUDA) of ``fn`` (forward, or forward + backward)."""
    dev = q.device
    times, peak = [], None
    for i in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
        del out
    times.sort()
    return times[len(times) // 2], peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", nargs="+", default=["longnet", "dense"], choices=["longnet", "dense"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiled-max", type=int, default=1 << 30, help="time the tiled path only up to this N")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    rows = []
    for N in args.lengths:
        for layer in args.layers:
            branches = tuple((w, r) for w, r in LONGNET if w <= N) or ((N, 1),) if layer == "longnet" else (
                (DENSE_SEGMENT, 1),)
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, N, args.dim, generator=g, device=dev, dtype=dtype).requires_grad_()
                       for _ in range(3))
            scale = args.dim ** -0.5
            layout = resolve_layout(1, N, N, dev)
            qkvo = 4 * q.numel() * q.element_size()
            with torch.no_grad():
                ref_out = dilated_attention_reference(q, k, v, branches, layout, True, scale)[0]
                path, why = last_path()
                err = None
                if N <= args.tiled_max:
                    want = tiled_attention_reference(q, k, v, branches, layout, True, scale)[0].float()
                    err = float((ref_out.float() - want).norm() / want.norm())
                del ref_out
            print(f"N={N} {layer}: reference path {path} {why} rel err vs tiled {err}", flush=True)
            cases = [("reference", lambda: dilated_attention_reference(q, k, v, branches, layout, True, scale)[0]),
                     ("gather_sdpa_lower_bound", lambda: gather_sdpa(q, k, v, branches, scale))]
            if N <= args.tiled_max:
                cases.append(("tiled", lambda: tiled_attention_reference(q, k, v, branches, layout, True,
                                                                         scale)[0]))
            for backend, fn in cases:
                for backward in (False, True):
                    seconds, peak = measure(fn, q, k, v, backward, args.reps)
                    row = dict(N=N, layer=layer, backend=backend, pass_="fwd+bwd" if backward else "fwd",
                               ms=round(seconds * 1e3, 2), peak_MiB=None if peak is None else round(peak / 2**20, 1),
                               peak_over_qkvo=None if peak is None else round(peak / qkvo, 2))
                    if backend == "reference":
                        row.update(path=path, fallback_reason=why, rel_err_vs_tiled=err)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    ratios = {}
    for row in rows:
        if row["backend"] == "reference":
            base = [x for x in rows if x["backend"] == "gather_sdpa_lower_bound" and
                    (x["N"], x["layer"], x["pass_"]) == (row["N"], row["layer"], row["pass_"])]
            ratios[f'{row["layer"]} N={row["N"]} {row["pass_"]}'] = round(row["ms"] / base[0]["ms"], 2)
    print("reference / lower bound:", json.dumps(ratios, indent=1))
    summary = dict(device=name, dtype=args.dtype, heads=args.heads, dim=args.dim, batch=1, causal=True,
                   longnet_branches=LONGNET, torch=torch.__version__, reference_over_lower_bound=ratios,
                   fused_kernel=fused_buckets.kernel_report(dev, dtype, args.dim),
                   command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                   date=datetime.now(timezone.utc).isoformat(timespec="seconds"), rows=rows)
    out = args.out or str(ROOT / "benchmarks" / "results" / f"reference_vs_sdpa-{name.replace(' ', '-')}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
