"""Benchmark block-sparse attention on one GPU: our Triton kernels against FlexAttention on the same block layout,
an all-dense layout against SDPA-flash, the adaptive pattern against dense SDPA-flash, and layout construction time.

bf16, B = 1, H = 16, D = 128, causal. Every timed result is checked first: our kernels against the PyTorch
reference (the whole problem, gradients included, where the reference fits; else the first and last query rows,
which the reference computes alone), FlexAttention and SDPA against ours. Each timing records the GPU's mean SM
clock and power draw while it ran (``fwd_gpu`` / ``fwd_bwd_gpu``, ``gpu_monitor.py``); ``--warm-s`` runs each call
for that long first, so that every method is timed at the clock it sustains. Writes ``<out>/block_sparse-<gpu>-<date>``
``.json`` (rows, GPU, versions, command) and a ``.png`` beside it, and prints a table.

    python scripts/bench_block_sparse.py                       # 16K..256K, about 5 minutes on an H100
    python scripts/bench_block_sparse.py --sizes 16384 65536   # a subset
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
try:
    from .gpu_monitor import GpuMonitor
    from .timing import cuda_median_ms, timed_on_gpu
except ImportError:  # run as a file: python scripts/<name>.py
    from gpu_monitor import GpuMonitor  # noqa: E402
    from timing import cuda_median_ms, timed_on_gpu  # noqa: E402
from hf_dilated.ops.block_sparse import (  # noqa: E402
    BlockLayout,
    adaptive_blocks,
    block_sparse_op,
    block_sparse_reference,
    dense_blocks,
    dilated_blocks,
    global_blocks,
    local_blocks,
    union,
)
from hf_dilated.ops.layout import resolve_layout  # noqa: E402

TOL = 1e-2  # SPEC, bfloat16
B, H, D = 1, 16, 128


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def timed_ms(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def fixed_layout(N, b, device, num_heads=None):
    """The benchmark's layout: a 2K-token local window, the sink block, LongNet-style dilated blocks per head
    (``num_heads``, the benchmark's ``H`` by default)."""
    n = math.ceil(N / b)
    return union(local_blocks(n, b, 2048 // b, device=device), global_blocks(n, b, 1, device=device),
                 dilated_blocks(n, b, [16, 64, 256], [1, 4, 16], num_heads=num_heads or H, device=device))


def pair_count(lay: BlockLayout, N: int) -> int:
    """Causal (query, key) pairs the layout computes, summed over heads (for useful TFLOP/s)."""
    b = lay.block_size
    i = torch.arange(lay.n_blocks, device=lay.device)[:, None]
    idx = lay.kv_index.long()
    act = idx >= 0
    diag = act & (idx == i)
    full = act & (idx < i)
    per_head = full.sum((-1, -2)) * b * b + diag.sum((-1, -2)) * (b * (b + 1) // 2)
    heads = H // lay.layout_heads
    return int(per_head.sum()) * heads


# ---- methods ---------------------------------------------------------------------------------------------------------


def ours(q, k, v, lay, tokens, do=None):
    out, _ = block_sparse_op(q, k, v, lay, tokens, True, D**-0.5)
    if do is None:
        return (out,)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def sdpa(q, k, v, do=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if do is None:
        return (out,)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


_FLEX = {}


def flex_fn(block: int = 128):
    """FlexAttention compiled for masks of ``block``-token blocks. Below 128 with max-autotune: Inductor's one
    default backward config on the H100 (torch 2.11) has 128-wide tiles, which a 64-block mask does not divide, and
    it drops such configs before ``kernel_options`` apply (``NoValidChoicesError``); autotuning picks among its
    configs that fit."""
    if block not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[block] = torch.compile(flex_attention, dynamic=False,
                                     mode=None if block >= 128 else "max-autotune-no-cudagraphs")
    return _FLEX[block]


def flex_block_mask(lay: BlockLayout, N: int):
    """FlexAttention's BlockMask from our layout (no mask_mod evaluation over N x N): off-diagonal active blocks are
    full, diagonal blocks partial with the causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    idx = lay.kv_index.long()
    i = torch.arange(lay.n_blocks, device=idx.device)[:, None]
    act = idx >= 0

    def part(sel):
        key = torch.where(sel, idx, lay.n_blocks)
        key = torch.sort(key, -1)[0]
        cnt = (key < lay.n_blocks).sum(-1)
        key = torch.where(key < lay.n_blocks, key, 0)
        full_w = torch.zeros(*key.shape[:-1], lay.n_blocks, dtype=torch.int32, device=idx.device)
        full_w[..., : key.shape[-1]] = key.to(torch.int32)
        return cnt.to(torch.int32).expand(B, H, -1).contiguous(), full_w.expand(B, H, -1, -1).contiguous()

    kv_n, kv_i = part(act & (idx == i))
    full_n, full_i = part(act & (idx < i))
    return BlockMask.from_kv_blocks(kv_n, kv_i, full_n, full_i, BLOCK_SIZE=lay.block_size,
                                    mask_mod=lambda b, h, qi, ki: qi >= ki, seq_lengths=(N, N))


def flex(q, k, v, mask, do=None):
    out = flex_fn(min(mask.BLOCK_SIZE))(q, k, v, block_mask=mask)
    if do is None:
        return (out,)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


# ---- checks ----------------------------------------------------------------------------------------------------------


def check_rows(out, q, k, v, lay, rows=512):
    """Our output on the first and the last ``rows`` queries against the reference computed for those rows alone."""
    N = q.shape[2]
    errs = []
    nb = rows // lay.block_size
    head = BlockLayout(lay.block_size, nb, lay.kv_count[..., :nb].contiguous(), lay.kv_index[..., :nb, :].contiguous())
    t = resolve_layout(B, rows, rows, q.device)
    ref, _ = block_sparse_reference(q[:, :, :rows], k[:, :, :rows], v[:, :, :rows], head, t, True, D**-0.5)
    errs.append(rel_err(out[:, :, :rows], ref))
    t = resolve_layout(B, rows, N, q.device)
    ref, _ = block_sparse_reference(q[:, :, -rows:], k, v, lay, t, True, D**-0.5)
    errs.append(rel_err(out[:, :, -rows:], ref))
    return max(errs)


def check_full(res, q, k, v, lay, tokens, do):
    """Output and dq, dk, dv against the reference on the whole problem (float32 math)."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = block_sparse_reference(qf, kf, vf, lay, tokens, True, D**-0.5)
    grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    return max(rel_err(a, b) for a, b in zip(res, (ref, *grads)))


# ---- main ------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dense-max", type=int, default=65536, help="largest N for the all-dense layout vs SDPA")
    ap.add_argument("--full-check-max", type=int, default=32768, help="largest N checked whole, gradients included")
    ap.add_argument("--adaptive-n", type=int, default=131072)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--warm-s", type=float, default=1.0,
                    help="before timing a call, run it back to back for this many seconds (the sustained clock; 0: no)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not args.warm_s >= 0:
        ap.error(f"--warm-s must be >= 0 seconds, got {args.warm_s}")
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    b = args.block_size
    rows, errors = [], []
    t_start = time.time()

    monitor = GpuMonitor(torch.cuda.current_device())

    def timed(fn, reps):
        """``(median ms of fn(), the GPU's clock / power / temperature meanwhile)`` after ``--warm-s`` of warm-up."""
        ms, gpu, _ = timed_on_gpu(fn, lambda f: cuda_median_ms(f, reps), monitor, args.warm_s)
        return ms, gpu

    def bench(fn, reps):
        return timed(fn, reps)[0]

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    def guarded(name, fn):
        try:
            fn()
        except Exception as exc:  # keep the run going; the failure is in the JSON
            errors.append(dict(section=name, error=repr(exc), trace=traceback.format_exc()[-2000:]))
            print("FAILED", name, repr(exc), flush=True)
        finally:
            torch.cuda.empty_cache()

    monitor.__enter__()
    for N in args.sizes:
        gen = torch.Generator(device=dev).manual_seed(N)
        q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=gen)
        tokens = resolve_layout(B, N, N, dev)
        first = fixed_layout(N, b, dev)  # warm the allocator / kernels of the builders and of the transpose (the
        BlockLayout(b, first.n_blocks, first.kv_count, first.kv_index).transposed  # first took 65 ms at 16K, else ~1 ms)
        lay, build_ms = timed_ms(lambda: fixed_layout(N, b, dev))
        _, transpose_ms = timed_ms(lambda: BlockLayout(b, lay.n_blocks, lay.kv_count, lay.kv_index).transposed)
        pairs = pair_count(lay, N)
        base = dict(N=N, block_size=b, density=round(lay.density(), 5), active_blocks=lay.active_blocks(),
                    layout_build_ms=round(build_ms, 3), layout_transpose_ms=round(transpose_ms, 3))

        def run_ours():
            (out,) = ours(q, k, v, lay, tokens)
            err = check_rows(out, q, k, v, lay)
            if N <= args.full_check_max:
                err = max(err, check_full(ours(q, k, v, lay, tokens, do), q, k, v, lay, tokens, do))
            assert err < TOL, f"ours: rel err {err}"
            fwd, fwd_gpu = timed(lambda: ours(q, k, v, lay, tokens), 10)
            fb, fb_gpu = timed(lambda: ours(q, k, v, lay, tokens, do), 5)
            record(method="ours", **base, err=err, fwd_ms=fwd, fwd_bwd_ms=fb, fwd_gpu=fwd_gpu, fwd_bwd_gpu=fb_gpu,
                   fwd_tflops=4 * D * pairs / fwd / 1e9, fwd_bwd_tflops=14 * D * pairs / fb / 1e9,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            return out

        ours_out = {}
        guarded(f"ours N={N}", lambda: ours_out.setdefault("o", run_ours()))

        def run_flex():
            mask, mask_ms = timed_ms(lambda: flex_block_mask(lay, N))
            out = flex(q, k, v, mask)[0]
            err = rel_err(out, ours_out["o"]) if "o" in ours_out else float("nan")
            assert err < TOL, f"flex vs ours: rel err {err}"
            fwd, fwd_gpu = timed(lambda: flex(q, k, v, mask), 10)
            fb, fb_gpu = timed(lambda: flex(q, k, v, mask, do), 5)
            record(method="flex_blockmask", **base, err=err, mask_build_ms=mask_ms, fwd_ms=fwd, fwd_bwd_ms=fb,
                   fwd_gpu=fwd_gpu, fwd_bwd_gpu=fb_gpu,
                   fwd_tflops=4 * D * pairs / fwd / 1e9, fwd_bwd_tflops=14 * D * pairs / fb / 1e9)

        if not args.no_flex:
            guarded(f"flex N={N}", run_flex)

        if N <= args.dense_max:
            def run_dense():
                dl = dense_blocks(math.ceil(N / b), b, device=dev)
                ref = sdpa(q, k, v, do)
                res = ours(q, k, v, dl, tokens, do)
                err = max(rel_err(a, r) for a, r in zip(res, ref))
                assert err < TOL, f"dense layout vs sdpa: rel err {err}"
                dense_pairs = H * N * (N + 1) // 2
                for name, fn in (("ours_dense_layout", lambda g=None: ours(q, k, v, dl, tokens, g)),
                                 ("sdpa_flash", lambda g=None: sdpa(q, k, v, g))):
                    fwd, fwd_gpu = timed(fn, 5)
                    fb, fb_gpu = timed(lambda: fn(do), 3)
                    record(method=name, N=N, block_size=b, err=err, fwd_ms=fwd, fwd_bwd_ms=fb, fwd_gpu=fwd_gpu,
                           fwd_bwd_gpu=fb_gpu,
                           fwd_tflops=4 * D * dense_pairs / fwd / 1e9, fwd_bwd_tflops=14 * D * dense_pairs / fb / 1e9)

            guarded(f"dense N={N}", run_dense)

        if N == args.adaptive_n:
            def run_adaptive():
                def select():
                    return adaptive_blocks(q, k, b, args.top_k, local_blocks=8, global_blocks=1, tokens=tokens)

                alay = select()
                sel_ms = bench(select, 5)
                out = ours(q, k, v, alay, tokens)[0]
                err = check_rows(out, q, k, v, alay)
                assert err < TOL, f"adaptive: rel err {err}"

                def total(g=None):
                    return ours(q, k, v, select(), tokens, g)

                fwd = bench(total, 5)
                fb = bench(lambda: total(do), 3)
                sd_f = bench(lambda: sdpa(q, k, v), 3)
                sd_fb = bench(lambda: sdpa(q, k, v, do), 2)
                record(method="adaptive", N=N, block_size=b, top_k=args.top_k, density=round(alay.density(), 5),
                       err=err, select_ms=sel_ms, fwd_ms=fwd, fwd_bwd_ms=fb, sdpa_fwd_ms=sd_f, sdpa_fwd_bwd_ms=sd_fb,
                       speedup_fwd=sd_f / fwd, speedup_fwd_bwd=sd_fb / fb)

            guarded(f"adaptive N={N}", run_adaptive)
        del q, k, v, do
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    monitor.__exit__(None, None, None)
    write(rows, errors, args, gpu, time.time() - t_start)


def write(rows, errors, args, gpu, seconds):
    import triton

    os.makedirs(args.out, exist_ok=True)
    stem = f"block_sparse-{gpu.replace(' ', '_')}-{datetime.date.today().isoformat()}"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), command=" ".join([sys.executable] + sys.argv),
                shape=dict(B=B, H=H, D=D, dtype="bfloat16", causal=True), seconds=round(seconds, 1),
                warm_s=args.warm_s)
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, errors=errors), f, indent=1)
    print("wrote", path)
    print(f"\n{'method':<20}{'N':>8}{'fwd ms':>10}{'f+b ms':>10}{'fwd TF':>9}{'f+b TF':>9}{'err':>10}"
          f"{'MHz f/f+b':>11}")
    for r in rows:
        mhz = "/".join(f"{r[k]['gpu_clock_mhz']:.0f}" if r.get(k) else "-" for k in ("fwd_gpu", "fwd_bwd_gpu"))
        print(f"{r['method']:<20}{r['N']:>8}{r['fwd_ms']:>10.2f}{r['fwd_bwd_ms']:>10.2f}"
              f"{r.get('fwd_tflops', float('nan')):>9.1f}{r.get('fwd_bwd_tflops', float('nan')):>9.1f}{r['err']:>10.2e}"
              f"{mhz:>11}")
    by = {(r["method"], r["N"]): r for r in rows}
    for (method, N), r in sorted(by.items(), key=lambda x: x[0][1]):
        other = {"ours": "flex_blockmask", "ours_dense_layout": "sdpa_flash"}.get(method)
        if other and (other, N) in by:
            o = by[(other, N)]
            print(f"{method} vs {other} at N={N}: fwd {o['fwd_ms'] / r['fwd_ms']:.2f}x, "
                  f"fwd+bwd {o['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x faster")
        if method == "ours":
            print(f"layout build at N={N}: {r['layout_build_ms']:.1f} ms (+ {r['layout_transpose_ms']:.1f} ms transpose)")
        if method == "adaptive":
            print(f"adaptive at N={N}: {r['speedup_fwd']:.2f}x (fwd), {r['speedup_fwd_bwd']:.2f}x (fwd+bwd) dense SDPA")
    for e in errors:
        print("ERROR", e["section"], e["error"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("fwd_ms", "fwd_bwd_ms")):
        for method in ("ours", "flex_blockmask", "ours_dense_layout", "sdpa_flash"):
            pts = [(r["N"], r[key]) for r in rows if r["method"] == method]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(key.replace("_", " "))
        ax.legend()
    fig.suptitle(f"block-sparse attention, {gpu}, bf16, H={H}, D={D}, causal")
    fig.tight_layout()
    png = os.path.join(args.out, stem + ".png")
    fig.savefig(png, dpi=110)
    print("wrote", png)


if __name__ == "__main__":
    main()
