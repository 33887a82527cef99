"""Time the attention op of one checkout and print checksums, so that two checkouts (before and after a kernel
change) can be compared in one device call, bit for bit and in milliseconds.

    git archive HEAD~1 hf_dilated scripts | tar -x -C /tmp/base     # the checkout to compare against
    python benchmarks/compare_checkouts.py /tmp/base base 16384 65536 262144
    python benchmarks/compare_checkouts.py . new 16384 65536 262144
    python benchmarks/compare_checkouts.py . new 65536 --op block_sparse --heads 32 --kv-heads 8

One JSON line per (head dim, N): forward and forward+backward medians (``triton.testing.do_bench``) on seeded inputs
(B = 1, bf16, causal), and per tensor (out, dq, dk, dv) a float64 sum, the sum of its int16 bit patterns and the
float64 sum of magnitudes: equal bit-pattern sums on both sides mean identical results, and a difference of sums is
read against the magnitudes (``ab_summary.py``). ``--op dilated``: the LongNet branches (w = 2048..32768,
r = 1..16); ``--op block_sparse``: ``scripts/bench_block_sparse.py``'s layout (``--block-size``, 128 by default), from
the checkout's own ``scripts``. ``--dtype`` float16 / float32 instead of bfloat16.

    python benchmarks/compare_checkouts.py . new 16384 65536 --op block_sparse --block-size 64 --dims 64 128

Each line also carries the GPU's mean clock and power while each call was timed (``fwd_gpu`` / ``fwdbwd_gpu``, from
this checkout's ``scripts/gpu_monitor.py``) and the energy of one call (``mj``: mean power x median time).
``--warm-s S`` runs each call back to back for ``S`` seconds before timing it: a power-capped GPU (the H100 at 700 W,
from 64K on) sustains a lower clock than a short timing sees, and a change that does more work per cycle may then
lower the clock instead of the time (benchmarks/NOTES_triton.md, session 23).

    python benchmarks/compare_checkouts.py . new 65536 262144 --op block_sparse --warm-s 1

``benchmarks/ab_summary.py`` turns the collected lines into each checkout's speed against the base and whether its
results are the base's bit for bit."""

from __future__ import annotations

import argparse
import json
import os
import sys

BRANCHES = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]


def checksums(t) -> list:
    import torch

    return [float(t.double().sum()), int(t.contiguous().view(torch.int16).long().sum()), float(t.double().abs().sum())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="the checkout whose hf_dilated is timed")
    ap.add_argument("label")
    ap.add_argument("seqlens", type=int, nargs="+")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); --heads by default")
    ap.add_argument("--op", choices=("dilated", "block_sparse"), default="dilated")
    ap.add_argument("--block-size", type=int, choices=(64, 128), default=128, help="the block-sparse layout's block")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--warm-s", type=float, default=0.0,
                    help="run each call back to back this many seconds before timing it (the sustained clock)")
    args = ap.parse_args()
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads < 1 or kv_heads < 1 or args.heads % kv_heads:
        ap.error(f"--heads and --kv-heads must be positive with --heads a multiple of --kv-heads, got {args.heads} "
                 f"and {kv_heads}")
    if not args.warm_s >= 0:
        ap.error(f"--warm-s must be >= 0 seconds, got {args.warm_s}")
    # the GPU monitor and warm-up from this checkout's scripts (the timed checkout's may predate them)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from gpu_monitor import GpuMonitor
    from timing import timed_on_gpu

    sys.path.insert(0, args.root)
    sys.path.insert(0, os.path.join(args.root, "scripts"))
    import torch
    from triton.testing import do_bench

    import hf_dilated

    monitor = GpuMonitor(torch.cuda.current_device())

    def timed(fn, rep: int) -> tuple[float, dict]:
        """``(median ms, the GPU's clock / power meanwhile, with the energy of one call in mJ)``."""
        ms, gpu, _ = timed_on_gpu(fn, lambda f: do_bench(f, warmup=50, rep=rep, return_mode="median"), monitor,
                                  args.warm_s)
        return ms, gpu

    ws, rs = [w for w, _ in BRANCHES], [r for _, r in BRANCHES]
    if args.op == "block_sparse":
        import bench_block_sparse

    def attention(N: int):
        """The op timed at length ``N``: the LongNet branches, or block-sparse on the benchmark's layout for N."""
        if args.op == "dilated":
            return lambda q, k, v: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton")
        layout = bench_block_sparse.fixed_layout(N, args.block_size, "cuda", num_heads=args.heads)
        return lambda q, k, v: hf_dilated.block_sparse_attention(q, k, v, layout, is_causal=True, backend="triton")

    with monitor:  # samples the clock and power while the calls run
        for D in args.dims:
            for N in args.seqlens:
                attend = attention(N)
                g = torch.Generator(device="cuda").manual_seed(1234 + N + D)
                q, k, v, do = (torch.randn(1, h, N, D, device="cuda", dtype=getattr(torch, args.dtype), generator=g)
                               for h in (args.heads, kv_heads, kv_heads, args.heads))
                with torch.no_grad():
                    out = attend(q, k, v)
                    fwd, fwd_gpu = timed(lambda: attend(q, k, v), 400)
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

                def fwd_bwd():
                    return torch.autograd.grad(attend(qq, kk, vv), (qq, kk, vv), do)

                grads = fwd_bwd()
                both, both_gpu = timed(fwd_bwd, 600)
                print(json.dumps(dict(label=args.label, op=args.op, N=N, D=D, heads=args.heads, kv_heads=kv_heads,
                                      dtype=args.dtype, block=args.block_size if args.op == "block_sparse" else None,
                                      fwd_ms=round(fwd, 3), fwdbwd_ms=round(both, 3), bwd_ms=round(both - fwd, 3),
                                      warm_s=args.warm_s, fwd_gpu=fwd_gpu, fwdbwd_gpu=both_gpu,
                                      cks=[checksums(out)] + [checksums(x) for x in grads])), flush=True)
                del q, k, v, do, qq, kk, vv, out, grads
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
