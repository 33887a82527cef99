"""Time the dilated op of one checkout and print checksums, so that two checkouts (before and after a kernel change)
can be compared in one device call, bit for bit and in milliseconds.

    git archive HEAD~1 hf_dilated | tar -x -C /tmp/base     # the checkout to compare against
    python benchmarks/compare_checkouts.py /tmp/base base 16384 65536 262144
    python benchmarks/compare_checkouts.py . new 16384 65536 262144

One JSON line per (head dim, N): forward and forward+backward medians (``triton.testing.do_bench``) of the LongNet
branches (w = 2048..32768, r = 1..16; B = 1, H = 16, bf16, causal) on seeded inputs, and per tensor (out, dq, dk, dv) a
float64 sum and the sum of its int16 bit patterns: equal checksums on both sides mean identical results."""

from __future__ import annotations

import argparse
import json
import sys

BRANCHES = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]


def checksums(t) -> list:
    import torch

    return [float(t.double().sum()), int(t.contiguous().view(torch.int16).long().sum())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", help="the checkout whose hf_dilated is timed")
    ap.add_argument("label")
    ap.add_argument("seqlens", type=int, nargs="+")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    import torch
    from triton.testing import do_bench

    import hf_dilated

    ws, rs = [w for w, _ in BRANCHES], [r for _, r in BRANCHES]
    attend = lambda q, k, v: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton")  # noqa: E731
    for D in args.dims:
        for N in args.seqlens:
            g = torch.Generator(device="cuda").manual_seed(1234 + N + D)
            q, k, v, do = (torch.randn(1, args.heads, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            with torch.no_grad():
                out = attend(q, k, v)
                fwd = do_bench(lambda: attend(q, k, v), warmup=50, rep=400, return_mode="median")
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

            def fwd_bwd():
                return torch.autograd.grad(attend(qq, kk, vv), (qq, kk, vv), do)

            grads = fwd_bwd()
            both = do_bench(fwd_bwd, warmup=50, rep=600, return_mode="median")
            print(json.dumps(dict(label=args.label, N=N, D=D, fwd_ms=round(fwd, 3), fwdbwd_ms=round(both, 3),
                                  bwd_ms=round(both - fwd, 3), cks=[checksums(out)] + [checksums(x) for x in grads])),
                  flush=True)
            del q, k, v, do, qq, kk, vv, out, grads
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
