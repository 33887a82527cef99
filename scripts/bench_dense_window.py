"""Layers left dense through the dilated kernels (issue 9 item 2): one branch ``(DENSE_SEGMENT, 1)``, with and
without a sliding window, against dense SDPA (flash) on the same GPU, forward and forward+backward, time and peak
memory above the inputs. Each configuration is first checked against SDPA (with a boolean band mask where a window
applies) at a length where that mask fits.

    python scripts/bench_dense_window.py --lengths 16384 65536 --window 512 --heads 8 --kv-heads 2 --dim 256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from hf_dilated.config import DENSE_SEGMENT
from hf_dilated.ops import resolve_layout
from hf_dilated.ops.triton import dilated_attention_triton


def sdpa(q, k, v, causal, window=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    n = q.shape[2]
    d = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None]
    band = (d >= 0) & (d < window) if causal else d.abs() < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band)


def dilated(q, k, v, causal, window=None):
    lay = resolve_layout(q.shape[0], q.shape[2], k.shape[2], q.device)
    return dilated_attention_triton(q, k, v, ((DENSE_SEGMENT, 1),), lay, causal, q.shape[-1] ** -0.5, window=window,
                                    strict=True)[0]


def measure(fn, q, k, v, backward):
    do = torch.randn_like(q)

    def step():
        out = fn(q, k, v)
        if backward:
            torch.autograd.grad(out, (q, k, v), do)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = triton.testing.do_bench(step, warmup=10, rep=50)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--causal", type=int, default=1)
    args = ap.parse_args()
    dev, dt, causal = torch.device("cuda"), torch.bfloat16, bool(args.causal)
    H, Hk, D = args.heads, args.kv_heads, args.dim

    def qkv(n):
        return [torch.randn(1, h, n, D, device=dev, dtype=dt, requires_grad=True) for h in (H, Hk, Hk)]

    q, k, v = qkv(4096)
    for window in (None, args.window):
        want = sdpa(q, k, v, causal, window).float()
        err = float((dilated(q, k, v, causal, window).float() - want).norm() / want.norm())
        assert err < 1e-2, f"window {window}: rel err {err}"
        print(f"check window={window}: rel err {err:.1e}")
    rows = []
    for n in args.lengths:
        q, k, v = qkv(n)
        for name, fn, window in (("sdpa dense", sdpa, None), ("dilated dense", dilated, None),
                                 ("dilated window", dilated, args.window)):
            for bwd in (False, True):
                try:
                    ms, mib = measure(lambda a, b, c: fn(a, b, c, causal, window), q, k, v, bwd)
                except torch.OutOfMemoryError:
                    ms = mib = float("nan")
                row = dict(n=n, kernel=name, window=window, backward=bwd, ms=ms, peak_mib_above_inputs=mib)
                rows.append(row)
                print(json.dumps(row))
        del q, k, v
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                          heads=H, kv_heads=Hk, dim=D, causal=causal, rows=rows)))


if __name__ == "__main__":
    main()
