"""Benchmark dilated attention: dense SDPA-flash and cuDNN, cuDNN on exactly the dilated work (``cudnn-segments``:
each branch's segments gathered beforehand into dense causal sequences of ``w / r`` rows, one call per branch, the
gather, scatter and merge not timed), FlexAttention on the same pattern, the PyTorch reference and the Triton kernels,
forward, forward+backward and decode, on one GPU in one run.

Every result is checked against the PyTorch reference before it is timed. Where the reference does not fit a whole
sequence, it is run on windows of the largest segment (with causal, segment-local attention the rows and key gradients
of a window ``[a, a + w_max)``, ``a`` a multiple of every ``w``, depend on that window alone): the first and the last.

Writes ``<out>/<gpu>-<date>.json`` (rows, GPU, versions, command) and a PNG plot (time and peak memory against N,
log-log; useful TFLOP per joule where the power was read) beside it, and prints a table: ms, useful TFLOP/s (the FLOPs
of the dilated pattern, or of dense causal attention for SDPA), the ratios of TFLOP/s to SDPA-flash, to dense cuDNN and
to cuDNN on the same segments at the same N, peak memory and its ratio to the bytes the call must hold (``io_bytes``).
Each call is timed twice: eager, back to back (what a user's loop sees: where the host queues a call slower than the GPU
runs it, the host's time), and replayed from a CUDA graph (``graph_ms``: the GPU's time alone; calls under
``--graph-max-ms``). Each row also records the GPU's mean SM clock, power draw and highest temperature during its eager
timing (``gpu_monitor.py``): a power-capped GPU slows down under long heavy calls, and ``--warm-s`` runs each call for
that long before timing it, so that every method is timed at its own sustained clock rather than at whatever the
previous case left. Under the cap that clock still drifts a few percent from one timing to the next: ``--rounds R``
times each case's methods R times, alternated, and reports each one's median (every timing kept in the row's
``rounds``).

    python scripts/bench_attention.py                  # the full sweep (about 8 minutes on an H100)
    python scripts/bench_attention.py --quick          # 16K and 64K only
    python scripts/bench_attention.py --shapes 16/16/128 32/8/128 9/3/64 8/2/256   # model-shaped heads, one run

A run stopped by Ctrl-C or a timeout's SIGTERM still writes what it measured (``meta.interrupted``); ``--resume
<that JSON>`` on the same GPU measures the rest and writes the union, so a sweep longer than one sitting (a lent GPU's
per-command limit) still ends as one file of one GPU's numbers:

    timeout 590 python scripts/bench_attention.py --seqlens 16384 65536 --out results/run
    timeout 590 python scripts/bench_attention.py --seqlens 16384 65536 262144 --resume results/run/<gpu>-<date>.json

The plot's first row is each method's useful TFLOP/s against N (ours solid, the dense baselines dashed / dotted);
``--replot <JSON>`` redraws a results file's PNG beside it, on any machine, and ``--markdown <JSON>`` prints its
dilated rates as the README's table (a test checks the README's table is that of the file it links).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
try:
    from .gpu_monitor import GpuMonitor
    from .timing import cuda_graph_median_ms as graph_bench
    from .timing import cuda_median_ms as bench
    from .timing import timed_on_gpu, until_interrupted
except ImportError:  # run as a file: python scripts/<name>.py
    from gpu_monitor import GpuMonitor  # noqa: E402
    from timing import cuda_graph_median_ms as graph_bench  # noqa: E402
    from timing import cuda_median_ms as bench  # noqa: E402
    from timing import timed_on_gpu, until_interrupted  # noqa: E402
import hf_dilated  # noqa: E402
from hf_dilated.environment import kernel_switches  # noqa: E402

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
TOL = 1e-2  # SPEC, bfloat16
METHODS = ("triton", "reference", "sdpa", "cudnn", "cudnn-segments", "flex")


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def dilated_flops(N, branches, D, H, B, causal=True):
    """Useful forward FLOPs: 4 D per (query, key) pair that the pattern computes (a pair in m branches counts m)."""
    pairs = 0
    for w, r in branches:
        for s0 in range(0, N, w):
            L = min(w, N - s0)
            rows = math.ceil(L / r)  # per head: one offset class; the last one may hold one row fewer
            pairs += rows * (rows + 1) // 2 if causal else rows * rows
    return 4 * D * pairs * H * B


def computed_dilated_flops(N, branches, D, H, B, causal=True):
    """Forward FLOPs of the (query, key) pairs the Triton kernels compute: where the branches nest
    (``hf_dilated.ops.triton.launch.Problem.nesting``) each pair once, a branch above the first keeping a query's keys
    in the earlier segments of the branch below (its causal segments become rectangles); else
    :func:`dilated_flops`. LongNet's branches at 64K: 0.76x of :func:`dilated_flops`."""
    from hf_dilated.ops.triton.launch import Problem

    if Problem(tuple(branches), causal, 1.0, 0).nesting() is None:
        return dilated_flops(N, branches, D, H, B, causal)
    pairs = 0
    for i, (w, r) in enumerate(branches):
        for s0 in range(0, N, w):
            rows = math.ceil(min(w, N - s0) / r)
            if i == 0:
                pairs += rows * (rows + 1) // 2
                continue
            sub = branches[i - 1][0] // r  # rows of one segment of the branch below
            pairs += sum(min(sub, rows - t) * t for t in range(sub, rows, sub))
    return 4 * D * pairs * H * B


def dense_flops(N, D, H, B, causal=True):
    return 4 * D * (N * (N + 1) // 2 if causal else N * N) * H * B


def io_bytes(mode, N, D, H, Hk, B, elem=2, nq=None):
    """The bytes a call cannot do without, what its peak memory is compared with (issue 14: within 1.1x at 1M): q,
    k, v, the output and its float32 lse; forward+backward adds dO, dQ, dK and dV. ``nq`` query rows (decode: 1)."""
    nq = N if nq is None else nq
    queries, keys = B * H * nq * D * elem, B * Hk * N * D * elem
    per_pass = 2 * queries + 2 * keys  # q, o and k, v; or dO, dQ and dK, dV
    return per_pass * (2 if mode == "fwdbwd" else 1) + B * H * nq * 4


def reps_for(ms_guess):
    return max(3, min(20, int(2000 / max(ms_guess, 1e-3))))


# --------------------------------------------------------------------------------------------------------------
# methods: each returns out (fwd) or (out, dq, dk, dv) (fwd+bwd)


def run_dilated(backend, q, k, v, branches, do=None):
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
    if do is None:
        with torch.no_grad():
            return hf_dilated.dilated_attention(q, k, v, ws, rs, backend=backend)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = hf_dilated.dilated_attention(q, k, v, ws, rs, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out, dq, dk, dv


def run_sdpa(q, k, v, do=None, backend="flash"):
    """Dense causal SDPA on one named backend: FlashAttention-2 (``flash``) or cuDNN (``cudnn``, the fastest dense
    kernel on Hopper; K/V repeated for GQA, which its SDPA path does not take). Tensors off the GPU, where neither
    exists, take SDPA's math backend whatever ``backend`` names (CPU smoke runs of the benchmark tools)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    if backend == "cudnn" and gqa:
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
    chosen = SDPBackend.CUDNN_ATTENTION if backend == "cudnn" else SDPBackend.FLASH_ATTENTION
    if q.device.type != "cuda":
        chosen = SDPBackend.MATH
    with sdpa_kernel(chosen):
        if do is None:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return (out,) + torch.autograd.grad(out, (q, k, v), do)


def segments(t: torch.Tensor, w: int, r: int) -> torch.Tensor:
    """``t``'s rows (``[B, H, N, D]``) as the batch of dilated segments branch ``(w, r)`` attends within:
    ``[B * N / w, H, w / r, D]``, each head's rows of offset class 0 (the same shapes and work as its own class)."""
    B, H, N, D = t.shape
    rows = t.detach().view(B, H, N // w, w // r, r, D)[..., 0, :]
    return rows.permute(0, 2, 1, 3, 4).reshape(B * (N // w), H, w // r, D).contiguous()


def segment_calls(q, k, v, do, branches, backend="cudnn"):
    """``(forward, forward+backward)`` of dense causal SDPA on ``backend`` over each branch's segments, gathered once
    here (:func:`segments`): what the best dense kernel does with exactly the dilated work, without the gather, the
    scatter back or the merge of branches that a dense-kernel implementation would add (``cudnn-segments``)."""
    parts = [tuple(segments(t, w, r) for t in (q, k, v)) + ((segments(do, w, r),) if do is not None else (None,))
             for w, r in branches]

    def fwd():
        return [run_sdpa(sq, sk, sv, None, backend) for sq, sk, sv, _ in parts]

    def step():
        return [run_sdpa(sq, sk, sv, sdo, backend) for sq, sk, sv, sdo in parts]

    return fwd, step


_FLEX = {}


def flex_pattern(branches, N, H, device):
    """FlexAttention with exactly the dilated function: the union mask, and log(multiplicity) added to each score.
    The block mask is built directly (blocks of 128 lie inside one largest segment, all offsets present), not by
    evaluating the mask over N x N."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    key = (tuple(branches), N, H, str(device))
    if key in _FLEX:
        return _FLEX[key]

    def count(b, h, qi, ki):
        m = torch.zeros_like(qi)
        for w, r in branches:
            off = h % r
            m = m + ((qi % r == off) & (ki % r == off) & (qi // w == ki // w)).to(qi.dtype)
        return m

    def mask_mod(b, h, qi, ki):
        return (count(b, h, qi, ki) > 0) & (ki <= qi)

    def score_mod(score, b, h, qi, ki):
        return score + torch.log(count(b, h, qi, ki).clamp_min(1).to(score.dtype))

    bs = 128
    nb = N // bs
    span = max(1, min(max(w for w, _ in branches), N) // bs)
    qb = torch.arange(nb, device=device)
    start = (qb // span) * span
    num = (qb - start + 1).to(torch.int32)
    idx = start[:, None] + torch.arange(nb, device=device)[None, :]  # [q blocks, kv blocks], first `num` used
    idx = torch.where(idx <= qb[:, None], idx, 0).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(num[None, None], idx[None, None], BLOCK_SIZE=bs, mask_mod=mask_mod,
                                          seq_lengths=(N, N))
    compiled = torch.compile(flex_attention, dynamic=False)
    _FLEX[key] = (compiled, block_mask, score_mod)
    return _FLEX[key]


def run_flex(q, k, v, branches, do=None):
    fn, bm, sm = flex_pattern(branches, q.shape[2], q.shape[1], q.device)
    gqa = q.shape[1] != k.shape[1]
    if do is None:
        with torch.no_grad():
            return fn(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa)
    return (out,) + torch.autograd.grad(out, (q, k, v), do)


# --------------------------------------------------------------------------------------------------------------
# checks


def windows(N, branches):
    wmax = max(w for w, _ in branches)
    if N <= wmax:
        return [(0, N)]
    return [(0, wmax), (N - wmax, N)] if N % wmax == 0 else [(0, wmax)]


def check_dilated(result, q, k, v, branches, do):
    """Max relative error of out (and grads) against the reference on the check windows."""
    worst = 0.0
    for a, b in windows(q.shape[2], branches):
        sl = lambda t: t[:, :, a:b].contiguous()  # noqa: E731
        if do is None:
            ref = run_dilated("torch", sl(q), sl(k), sl(v), branches)
            worst = max(worst, rel_err(result[:, :, a:b], ref))
        else:
            ref = run_dilated("torch", sl(q), sl(k), sl(v), branches, sl(do))
            for x, y in zip(result, ref):
                worst = max(worst, rel_err(x[:, :, a:b], y))
        del ref
    return worst


def check_sdpa(result, q, k, v, do):
    """SDPA-flash against the reference with one dense branch (w >= n, r = 1) on a 4K prefix."""
    n = min(4096, q.shape[2])
    sl = lambda t: t[:, :, :n].contiguous()  # noqa: E731
    if do is None:
        return rel_err(result[:, :, :n], run_dilated("torch", sl(q), sl(k), sl(v), [(n, 1)]))
    ref = run_dilated("torch", sl(q), sl(k), sl(v), [(n, 1)], sl(do))
    return rel_err(result[0][:, :, :n], ref[0])  # the prefix's gradients depend on later rows: output only


# --------------------------------------------------------------------------------------------------------------


def parse_shape(text: str, option: str = "--shapes") -> tuple[int, int, int]:
    """``"H/Hk/D"`` (query heads, kv heads, head dim) -> ``(H, Hk, D)``; ``ValueError`` naming ``option`` (the
    benchmark tools' head-shape options all read this way)."""
    try:
        h, hk, d = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"{option} takes H/Hk/D triples such as 16/16/128 or 9/3/64, got {text!r}") from None
    if min(h, hk, d) < 1 or h % hk:
        raise ValueError(f"{option} {text!r}: heads and head dim must be positive and H a multiple of Hk")
    return h, hk, d


def bench_cases(modes, seqlens, shapes) -> list[tuple[str, int, int, int, int]]:
    """``(mode, N, D, H, Hk)`` of every case, in the order they run (mode, shape, N)."""
    return [(m, N, D, H, Hk) for m in modes for H, Hk, D in shapes for N in seqlens]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536, 262144, 1048576])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--gqa", type=int, nargs="+", default=[1, 4], help="query heads per kv head")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--shapes", nargs="+", metavar="H/Hk/D",
                    help="head shapes to run instead of --heads x --gqa x --dims, e.g. 16/16/128 32/8/128 9/3/64 8/2/256")
    ap.add_argument("--modes", nargs="+", default=["decode", "fwd", "fwdbwd"])
    ap.add_argument("--methods", nargs="+", default=["triton", "reference", "sdpa", "cudnn", "cudnn-segments", "flex"],
                    choices=METHODS, help="cudnn-segments: cuDNN on the branches' segments, gathered beforehand "
                                          "(the same work as the dilated pattern, no gather or merge timed)")
    ap.add_argument("--max-sdpa", type=int, default=262144, help="largest N for dense SDPA (1M takes ~15 s a call)")
    ap.add_argument("--max-flex", type=int, default=262144)
    ap.add_argument("--flex-dims", type=int, nargs="+", default=[128], help="head dims FlexAttention runs at")
    ap.add_argument("--flex-gqa", type=int, nargs="+", default=[1])
    ap.add_argument("--max-reference", type=int, default=65536)
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting new cases after this many seconds")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-graph-timing", dest="graph_timing", action="store_false",
                    help="skip the CUDA-graph replay timing (the GPU's time alone) beside the eager timing")
    ap.add_argument("--graph-max-ms", type=float, default=250.0,
                    help="replay from a CUDA graph only calls faster than this (the host matters only for short ones)")
    ap.add_argument("--warm-s", type=float, default=1.0,
                    help="before timing a call, run it back to back for this many seconds (the sustained clock; 0: no)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each case's methods this many times, alternated (each after --warm-s), and report the "
                         "median eager and graph ms: a power-capped GPU's clock drifts a few percent between timings")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--resume", metavar="JSON",
                    help="continue an earlier run of this script on the same GPU (one that a timeout stopped, or a "
                         "first part): its rows are kept, its measured cases skipped, and the union written")
    offline = ap.add_mutually_exclusive_group()  # what reads a results JSON instead of measuring (no GPU)
    offline.add_argument("--replot", metavar="JSON", help="redraw the PNG of a results JSON beside it and exit")
    offline.add_argument("--markdown", metavar="JSON",
                         help="print a results JSON's dilated rates as the README's Markdown table and exit")
    args = ap.parse_args()
    if args.replot or args.markdown:
        option, path = ("--replot", args.replot) if args.replot else ("--markdown", args.markdown)
        try:
            if args.replot:
                replot(path)
            else:
                with open(path) as f:
                    print(markdown_table(json.load(f)["rows"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"{option} {path}: not a results file of this script ({err})")
        return
    try:
        shapes = ([parse_shape(x) for x in args.shapes] if args.shapes
                  else [(args.heads, args.heads // g, d) for d in args.dims for g in args.gqa])
    except ValueError as err:
        ap.error(str(err))
    if not args.graph_max_ms > 0:
        ap.error(f"--graph-max-ms must be positive (--no-graph-timing turns the graph timing off), "
                 f"got {args.graph_max_ms}")
    if not args.warm_s >= 0:
        ap.error(f"--warm-s must be >= 0 seconds, got {args.warm_s}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.quick:
        args.seqlens = [n for n in args.seqlens if n <= 65536]
    t_start = time.time()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name()
    branches = LONGNET
    B = 1
    rows, args.resumed_meta = [], None
    if args.resume:
        try:
            rows, args.resumed_meta = resumed_rows(args.resume, gpu)
        except (OSError, ValueError, KeyError) as err:
            ap.error(f"--resume {args.resume}: {err}")
    done = {case_key(r) for r in rows}
    bar = tqdm(bench_cases(args.modes, args.seqlens, shapes), desc="bench", file=sys.stdout, mininterval=5)
    monitor = GpuMonitor(torch.cuda.current_device()).__enter__()
    with until_interrupted() as run:  # Ctrl-C or a timeout's SIGTERM: the cases measured so far are written
        for mode, N, D, H, Hk in bar:
            G = H // Hk
            if time.time() - t_start > args.budget_s:
                print(f"time budget reached, skipping {mode} N={N} H/Hk={H}/{Hk} D={D}")
                continue
            gen = torch.Generator(device=dev).manual_seed(N + D + G)
            nq = 1 if mode == "decode" else N
            q = torch.randn(B, H, nq, D, device=dev, dtype=dtype, generator=gen)
            k = torch.randn(B, Hk, N, D, device=dev, dtype=dtype, generator=gen)
            v = torch.randn(B, Hk, N, D, device=dev, dtype=dtype, generator=gen)
            do = torch.randn(B, H, nq, D, device=dev, dtype=dtype, generator=gen) if mode == "fwdbwd" else None
            again = []  # (row, call, timer, graph timer or None) of the methods --rounds times again
            for method in args.methods:
                row = dict(mode=mode, N=N, D=D, H=H, Hk=Hk, B=B, method=method)
                if case_key(row) in done:  # measured by the run this one resumes
                    continue
                if method in ("sdpa", "cudnn") and N > args.max_sdpa and mode != "decode":
                    continue
                if method in ("cudnn", "cudnn-segments") and mode == "decode":
                    continue
                if method == "cudnn-segments" and any(N % w for w, _ in branches):
                    continue
                if method == "flex" and (mode == "decode" or N > args.max_flex or D not in args.flex_dims
                                         or G not in args.flex_gqa):
                    continue
                if method == "reference" and N > args.max_reference:
                    continue
                torch.cuda.empty_cache()
                bar.set_postfix_str(f"{mode} N={N} D={D} G={G} {method}")
                try:
                    if mode == "decode" and method == "flex":
                        continue
                    fn = method_call(method, mode, q, k, v, do, branches)
                    if mode == "decode":
                        out = fn()
                        if method == "sdpa":
                            err = None
                        else:
                            seg = (N - 1) // max(w for w, _ in branches) * max(w for w, _ in branches)
                            tail = (k[:, :, seg:].contiguous(), v[:, :, seg:].contiguous())
                            ref = run_dilated("torch", q, *tail, branches)
                            err = rel_err(out, ref)
                    else:
                        t0 = time.time()
                        out = fn()  # first call: compiles / builds, checked below
                        row["first_call_s"] = round(time.time() - t0, 3)
                        if method == "cudnn-segments":  # per-branch outputs of a dense kernel: no merged result
                            err = None
                        else:
                            err = (check_sdpa(out, q, k, v, do) if method in ("sdpa", "cudnn")
                                   else check_dilated(out, q, k, v, branches, do))
                    del out
                    row["rel_err"] = err
                    if err is not None and not (err < TOL):
                        row["error"] = f"check failed: rel err {err}"
                        print(f"CHECK FAILED {row}")
                        rows.append(row)
                        continue
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    t1 = time.time()
                    fn()
                    torch.cuda.synchronize()
                    guess = (time.time() - t1) * 1e3
                    peak = torch.cuda.max_memory_allocated()
                    row["peak_gib"] = peak / 2**30
                    row["peak_extra_gib"] = (peak - base) / 2**30
                    row["peak_over_io"] = peak / io_bytes(mode, N, D, H, Hk, B, q.element_size(), nq)
                    timer = functools.partial(bench, reps=reps_for(guess), warmup=0 if guess > 500 else 1)
                    row["ms"], gpu_window, warm_calls = timed_on_gpu(fn, timer, monitor, args.warm_s)
                    if args.warm_s > 0:
                        row["warm_calls"] = warm_calls
                    row.update(gpu_window)
                    graph_timer = None
                    if args.graph_timing and guess < args.graph_max_ms and method != "reference":
                        try:  # the GPU's time alone: the same call replayed from a CUDA graph, no host work
                            t_graph = time.monotonic()
                            row["graph_ms"] = graph_bench(fn, reps_for(guess))
                            clock = monitor.window(t_graph, time.monotonic()).get("gpu_clock_mhz")
                            if clock is not None:
                                row["graph_gpu_clock_mhz"] = clock
                            graph_timer = functools.partial(graph_bench, reps=reps_for(guess))
                        except Exception as e:  # reported, not fatal: the eager time stands
                            row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            torch.cuda.synchronize()
                    if args.rounds > 1 and method != "reference":
                        again.append((row, fn, timer, graph_timer))
                except torch.cuda.OutOfMemoryError as e:
                    row["error"] = "out of memory"
                    print(f"OOM {mode} N={N} D={D} G={G} {method}: {str(e)[:120]}")
                except Exception as e:  # a backend that cannot run a case is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"ERROR {mode} N={N} D={D} G={G} {method}: {row['error']}")
                rows.append(row)
            retime(again, args.rounds, monitor, args.warm_s)
            fn = again = None  # the methods' calls may hold gathered copies (cudnn-segments)
            del q, k, v, do
    if run.interrupted:
        print(f"interrupted: writing the {len(rows)} results measured so far")
    args.interrupted = run.interrupted
    monitor.__exit__(None, None, None)
    for row in rows:
        add_rates(row, branches)
    add_ratios(rows)
    print_table(rows)
    write_results(rows, args, gpu, monitor)


def method_call(method: str, mode: str, q, k, v, do, branches):
    """The call that ``method`` times for one case: arguments bound now (``functools.partial``), so that a call kept
    for ``--rounds`` still runs its own method after the loop has moved on. ``cudnn-segments`` gathers its segments
    here, untimed; decoding has no cuDNN or FlexAttention rows."""
    if mode == "decode":
        if method == "sdpa":
            return functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=q.shape[1] != k.shape[1])
        return functools.partial(run_dilated, "triton" if method == "triton" else "torch", q, k, v, branches)
    if method in ("sdpa", "cudnn"):
        return functools.partial(run_sdpa, q, k, v, do, "cudnn" if method == "cudnn" else "flash")
    if method == "cudnn-segments":
        return segment_calls(q, k, v, do, branches)[mode == "fwdbwd"]
    if method == "flex":
        return functools.partial(run_flex, q, k, v, branches, do)
    return functools.partial(run_dilated, "triton" if method == "triton" else "torch", q, k, v, branches, do)


def retime(timed: list, rounds: int, monitor, warm_s: float) -> None:
    """Time each ``(row, call, timer, graph_timer)`` of one case ``rounds - 1`` times more, the methods alternated,
    each after ``warm_s`` of warm-up, and its CUDA-graph replay after it where ``graph_timer`` is given: the row's
    ``ms`` (and ``graph_ms``) become the medians of its timings (each kept in ``rounds``, with the GPU's clock and
    power during the eager timing), so that a ratio between two methods does not rest on one timing's clock."""
    if rounds < 2:
        return
    for row, _, _, _ in timed:  # the first timing, taken in the case's loop
        row["rounds"] = [dict(ms=row["ms"], gpu_clock_mhz=row.get("gpu_clock_mhz"), gpu_power_w=row.get("gpu_power_w"))]
        if "graph_ms" in row:
            row["rounds"][0]["graph_ms"] = row["graph_ms"]
    for _ in range(rounds - 1):
        for row, call, timer, graph_timer in timed:
            ms, gpu_window, _ = timed_on_gpu(call, timer, monitor, warm_s)
            entry = dict(ms=ms, gpu_clock_mhz=gpu_window.get("gpu_clock_mhz"),
                         gpu_power_w=gpu_window.get("gpu_power_w"))
            if graph_timer is not None:
                entry["graph_ms"] = graph_timer(call)
            row["rounds"].append(entry)
    for row, _, _, graph_timer in timed:
        row["ms"] = statistics.median(r["ms"] for r in row["rounds"])
        for key in ("gpu_clock_mhz", "gpu_power_w"):  # the row's clock and power: their means over the rounds
            read = [r[key] for r in row["rounds"] if r.get(key) is not None]
            if read:
                row[key] = statistics.fmean(read)
        if graph_timer is not None:
            row["graph_ms"] = statistics.median(r["graph_ms"] for r in row["rounds"])


def add_rates(row: dict, branches) -> None:
    """A timed row's useful TFLOP/s, eager and from the graph (none for decode): the FLOPs of the dilated pattern, or
    of dense causal attention for SDPA / cuDNN; forward+backward counts 3.5 x the forward (the flash-attention
    convention: the backward does 2.5 x the forward's products). With the GPU's mean power, ``tflop_per_j``: useful
    TFLOP per joule, the rate's bound at a power cap (TFLOP/s = TFLOP/J x W). Triton rows also carry
    ``computed_tflops``: the rate on the pairs the kernels compute (:func:`computed_dilated_flops`; useful FLOPs
    count a pair once per branch that has it, as every earlier record did)."""
    if "ms" not in row or row["mode"] == "decode":
        return
    N, D, H, B = row["N"], row["D"], row["H"], row.get("B", 1)
    fl = dense_flops(N, D, H, B) if row["method"] in ("sdpa", "cudnn") else dilated_flops(N, branches, D, H, B)
    fl *= 3.5 if row["mode"] == "fwdbwd" else 1.0
    row["tflops"] = fl / (row["ms"] * 1e-3) / 1e12
    if row.get("gpu_power_w"):  # useful TFLOP per joule: what a GPU at its power cap runs at
        row["tflop_per_j"] = row["tflops"] / row["gpu_power_w"]
    if "graph_ms" in row:
        row["graph_tflops"] = fl / (row["graph_ms"] * 1e-3) / 1e12
    if row["method"] == "triton":
        computed = computed_dilated_flops(N, branches, D, H, B) * (3.5 if row["mode"] == "fwdbwd" else 1.0)
        row["computed_tflops"] = computed / (row["ms"] * 1e-3) / 1e12


def add_ratios(rows: list) -> None:
    """Each row's rate against SDPA-flash at the same (mode, N, D, H, Hk) (SDPA's 1M rate taken from its largest
    measured N, ``sdpa_ratio_from_N``), and the Triton rows' against dense cuDNN, cuDNN on the same segments and
    FlexAttention; derived afresh on every call, so that the rows of a resumed run take the baselines measured since."""
    key = lambda r: (r["mode"], r["N"], r["D"], r["H"], r["Hk"])  # noqa: E731
    sd = {key(r): r for r in rows if r["method"] == "sdpa" and "ms" in r}
    for r in rows:
        if "ms" not in r:
            continue
        r.pop("sdpa_ratio_from_N", None)  # a resumed run's rows: their SDPA may be measured now
        s = sd.get(key(r))
        if s is None and r["mode"] != "decode":
            shape = lambda x: (x["mode"], x["D"], x["H"], x["Hk"])  # noqa: E731
            cands = [x for x in sd.values() if shape(x) == shape(r)]
            if cands:
                s = max(cands, key=lambda x: x["N"])
                r["sdpa_ratio_from_N"] = s["N"]
        if s is not None:
            if r["mode"] == "decode":
                r["speedup_vs_sdpa"] = s["ms"] / r["ms"]
            else:
                r["tflops_ratio_vs_sdpa"] = r["tflops"] / s["tflops"]
                if "graph_tflops" in r and "graph_tflops" in s:
                    r["graph_tflops_ratio_vs_sdpa"] = r["graph_tflops"] / s["graph_tflops"]
    cudnn = {key(r): r for r in rows if r["method"] == "cudnn" and "ms" in r}
    for r in rows:
        c = cudnn.get(key(r))
        if r["method"] == "triton" and "ms" in r and c is not None:
            r["tflops_ratio_vs_cudnn"] = r["tflops"] / c["tflops"]
            if "graph_tflops" in r and "graph_tflops" in c:
                r["graph_tflops_ratio_vs_cudnn"] = r["graph_tflops"] / c["graph_tflops"]
    same = {key(r): r for r in rows if r["method"] == "cudnn-segments" and "ms" in r}
    for r in rows:
        c = same.get(key(r))
        if r["method"] == "triton" and "ms" in r and c is not None:
            r["tflops_ratio_vs_cudnn_segments"] = r["tflops"] / c["tflops"]
    flex = {key(r): r for r in rows if r["method"] == "flex" and "ms" in r}
    for r in rows:
        f = flex.get(key(r))
        if r["method"] == "triton" and "ms" in r and f is not None:
            r["speedup_vs_flex"] = f["ms"] / r["ms"]


def print_table(rows):
    hdr = (f"{'mode':7} {'N':>8} {'D':>4} {'H/Hk':>6} {'method':14} {'ms':>10} {'TFLOP/s':>8} {'xSDPA':>6} "
           f"{'xcuDNN':>6} {'xSeg':>5} {'graph ms':>9} {'xSDPA':>6} {'xFlex':>6} {'peak GiB':>9} {'xIO':>5} {'err':>8} "
           f"{'MHz':>5} {'W':>4} {'TF/J':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "-")[:10]
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        ratio = r.get("tflops_ratio_vs_sdpa", r.get("speedup_vs_sdpa"))
        ratio = f"{ratio:.2f}" if ratio is not None else "-"
        if r.get("sdpa_ratio_from_N"):
            ratio += "*"
        fx = f"{r['speedup_vs_flex']:.1f}" if "speedup_vs_flex" in r else "-"
        cd = f"{r['tflops_ratio_vs_cudnn']:.2f}" if "tflops_ratio_vs_cudnn" in r else "-"
        sg = f"{r['tflops_ratio_vs_cudnn_segments']:.2f}" if "tflops_ratio_vs_cudnn_segments" in r else "-"
        pk = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        io = f"{r['peak_over_io']:.2f}" if "peak_over_io" in r else "-"
        gms = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "-"
        gx = f"{r['graph_tflops_ratio_vs_sdpa']:.2f}" if "graph_tflops_ratio_vs_sdpa" in r else "-"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        mhz = f"{r['gpu_clock_mhz']:.0f}" if "gpu_clock_mhz" in r else "-"
        watts = f"{r['gpu_power_w']:.0f}" if "gpu_power_w" in r else "-"
        per_j = f"{r['tflop_per_j']:.2f}" if "tflop_per_j" in r else "-"
        print(f"{r['mode']:7} {r['N']:>8} {r['D']:>4} {str(r['H']) + '/' + str(r['Hk']):>6} {r['method']:14} {ms:>10} "
              f"{tf:>8} {ratio:>6} {cd:>6} {sg:>5} {gms:>9} {gx:>6} {fx:>6} {pk:>9} {io:>5} {err:>8} {mhz:>5} "
              f"{watts:>4} {per_j:>5}")
    print("xSDPA: useful TFLOP/s over SDPA-flash's (decode: SDPA time / time); * = SDPA measured at a smaller N."
          " xcuDNN: useful TFLOP/s over dense cuDNN's; xSeg: over cuDNN's on the same segments (cudnn-segments)."
          " xFlex: FlexAttention time / Triton time.\n"
          "ms: back-to-back eager calls (host and GPU: where the host is slower, its time); graph ms: the same call"
          " replayed from a CUDA graph (the GPU's time alone), and its xSDPA against SDPA's graph time.\n"
          "xIO: peak memory over the bytes of q, k, v, o and lse (fwd+bwd: and dO, dQ, dK, dV).\n"
          "MHz, W: the GPU's mean SM clock and power draw while the eager time was taken (- : not sampled; --rounds:"
          " the means over the rounds); TF/J: useful TFLOP per joule (TFLOP/s over W), what sets the rate at a"
          " power cap.")


def case_key(row: dict) -> tuple:
    """What identifies a measured case: ``(mode, N, D, H, Hk, method)``."""
    return row["mode"], row["N"], row["D"], row["H"], row["Hk"], row["method"]


def resumed_rows(path: str, gpu: str) -> tuple[list, dict]:
    """``(rows, meta)`` of an earlier run's JSON, to be continued on this GPU (``--resume``). A run on another GPU is
    refused: the ratios this script reports compare methods measured on one GPU."""
    with open(path) as f:
        data = json.load(f)
    meta = data["meta"]
    if meta.get("gpu") != gpu:
        raise ValueError(f"it was measured on {meta.get('gpu')!r}, this GPU is {gpu!r} (ratios are within one GPU)")
    return data["rows"], meta


def write_results(rows, args, gpu, monitor=None):
    import triton

    os.makedirs(args.out, exist_ok=True)
    earlier = getattr(args, "resumed_meta", None)  # the commands of the runs this one continues, then its own
    commands = (earlier.get("commands") or [earlier["command"]] if earlier else []) + ["python " + " ".join(sys.argv)]
    stem = f"{gpu.replace(' ', '-').replace('/', '-')}-{datetime.date.today().isoformat()}"
    meta = dict(
        gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), command="python " + " ".join(sys.argv), branches=LONGNET,
        dtype="bfloat16", causal=True, date=datetime.datetime.now().isoformat(timespec="seconds"),
        flops="useful: 4*D per (query, key) pair of each branch, a pair in m branches counted m times (dense causal for "
              "SDPA); fwd+bwd = 3.5x fwd; computed_tflops: on the pairs the Triton kernels compute (nested: each once)",
        warm_s=args.warm_s, rounds=getattr(args, "rounds", 1), interrupted=getattr(args, "interrupted", False),
        switches=kernel_switches(),
        commands=commands, resumed_from=getattr(args, "resume", None),
        gpu_monitor=(None if monitor is None or not monitor.available
                     else f"{len(monitor.samples)} samples every {monitor.period_s} s, {monitor.errors} failed reads"),
    )
    path = os.path.join(args.out, stem + ".json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", path)
    plot(rows, gpu, os.path.join(args.out, stem + ".png"))


def plot(rows: list, gpu: str, png: str) -> None:
    """One column per mode that ran; rows: useful TFLOP/s against N (where rates were measured: the issue-14 table
    at a glance, ours solid against the dense baselines), time and peak memory against N (log-log), and where the
    GPU's power was read useful TFLOP per joule (what sets each method's rate at a power cap)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    modes = [m for m in ("fwd", "fwdbwd", "decode") if any(r["mode"] == m and "ms" in r for r in rows)]
    if not modes:
        return
    panels = [p for p, on in (("tflops", any("tflops" in r and r["mode"] != "decode" for r in rows)),
                              ("ms", True), ("peak_gib", True), ("tflop_per_j", any("tflop_per_j" in r for r in rows)))
              if on]
    fig, axes = plt.subplots(len(panels), len(modes), figsize=(5.5 * len(modes), 4.5 * len(panels)), squeeze=False)
    shapes = sorted({(r["D"], r["H"], r["Hk"]) for r in rows})
    for j, mode in enumerate(modes):
        # one colour per head shape, one marker and line style per method (solid: ours)
        for method, style in [("sdpa", "o--"), ("cudnn", "v:"), ("cudnn-segments", "x:"), ("flex", "s-."),
                              ("reference", "^-."), ("triton", "D-")]:
            for c, (D, H, Hk) in enumerate(shapes):
                timed = sorted((r for r in rows if r["mode"] == mode and r["method"] == method
                                and (r["D"], r["H"], r["Hk"]) == (D, H, Hk) and "ms" in r), key=lambda r: r["N"])
                if not timed:
                    continue
                lab = f"{method} H/Hk={H}/{Hk} D={D}"
                for i, key in enumerate(panels):
                    points = [(r["N"], r[key]) for r in timed if key in r]
                    if not points:
                        continue
                    xs, ys = [p[0] for p in points], [p[1] for p in points]
                    if key in ("ms", "peak_gib"):
                        axes[i, j].loglog(xs, ys, style, color=f"C{c % 10}", label=lab, base=2)
                    else:
                        axes[i, j].semilogx(xs, ys, style, color=f"C{c % 10}", label=lab, base=2)
        titles = dict(tflops="useful TFLOP/s", ms="time (ms)" + (" per token, N = cache length" if mode == "decode"
                                                                 else ""),
                      peak_gib="peak memory (GiB)", tflop_per_j="useful TFLOP per joule")
        for i, key in enumerate(panels):
            axes[i, j].set_title(f"{mode}: {titles[key]}")
            axes[i, j].set_xlabel("N (tokens)")
            axes[i, j].grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"Dilated attention (LongNet branches), bf16, causal, B=1\n{gpu}")  # two lines: one mode is narrow
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("wrote", png)


def markdown_table(rows: list) -> str:
    """The Triton rows as the README's Markdown table (``--markdown``): one line per mode and head shape (in the run's
    order), one column per N, each cell the useful TFLOP/s with, in brackets, its ratios to SDPA-flash / dense cuDNN
    measured at that N ("-": not measured there)."""
    timed = [r for r in rows if r["method"] == "triton" and r["mode"] != "decode" and "tflops" in r]
    seqlens = sorted({r["N"] for r in timed})
    label = lambda n: f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"  # noqa: E731
    lines = ["| mode | heads H / Hk / D | " + " | ".join(label(n) for n in seqlens) + " |",
             "| --- | --- | " + " | ".join("---" for _ in seqlens) + " |"]
    names = dict(fwd="forward", fwdbwd="forward+backward")
    for mode in ("fwd", "fwdbwd"):
        shapes = list(dict.fromkeys((r["H"], r["Hk"], r["D"]) for r in timed if r["mode"] == mode))
        for H, Hk, D in shapes:
            cells = []
            for n in seqlens:
                r = next((x for x in timed if (x["mode"], x["N"], x["H"], x["Hk"], x["D"]) == (mode, n, H, Hk, D)),
                         None)
                if r is None:
                    cells.append("")
                    continue
                sdpa = r.get("tflops_ratio_vs_sdpa") if not r.get("sdpa_ratio_from_N") else None
                cudnn = r.get("tflops_ratio_vs_cudnn")
                ratios = [f"{x:.2f}" if x is not None else "-" for x in (sdpa, cudnn)]
                cells.append(f"{r['tflops']:.0f}" + (f" ({ratios[0]} / {ratios[1]})" if (sdpa, cudnn) != (None, None) else ""))
            lines.append(f"| {names[mode]} | {H} / {Hk} / {D} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replot(path: str) -> str:
    """Redraw the PNG of a results JSON of this script beside it (``--replot``; no GPU): its path."""
    with open(path) as f:
        data = json.load(f)
    png = os.path.splitext(path)[0] + ".png"
    plot(data["rows"], data["meta"]["gpu"], png)
    return png


if __name__ == "__main__":
    main()
