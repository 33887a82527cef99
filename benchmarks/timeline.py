"""Where the wall time of a call goes on the GPU: busy (any kernel running, on any stream), idle (no kernel: launch
gaps, host waits), overlap (two kernels at once), and how long the host takes to queue a call.

``benchmarks/kernel_times.py`` sums each kernel's time; this reads the kernels' start and end times from a
``torch.profiler`` trace, so it sees what a sum cannot: a call whose kernels add up to less than its wall time is
waiting on something (the host, a synchronisation, a launch gap), and two streams show as overlap.

    PYTHONPATH=$PWD python benchmarks/timeline.py                    # dilated and block-sparse, 16K and 64K
    PYTHONPATH=$PWD python benchmarks/timeline.py --ops dilated --seqlens 16384 65536 262144

Per case it prints the CUDA-event median of back-to-back calls (the benchmarks' timer), then from a trace of
``--iters`` calls: wall time per call, busy / idle / overlapped time, the sum of kernel times, the kernels
per call, and the host's time to queue one call (no synchronisation; when it exceeds the GPU's time, the GPU waits).
``torch.cuda.set_sync_debug_mode`` reports any host synchronisation inside the op.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import LONGNET, parse_shape, run_dilated  # noqa: E402
from timing import cuda_median_ms  # noqa: E402


def kernel_intervals(trace_path: str) -> list[tuple[float, float, int, str]]:
    """``(start_us, end_us, stream, name)`` of every GPU kernel in a chrome trace written by ``torch.profiler``."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e.get("args", {}).get("stream", -1)),
                        e.get("name", "")))
    return sorted(out)


def busy_idle(intervals) -> dict:
    """Wall span, time with at least one kernel running, with two or more, and the sum of durations (us)."""
    if not intervals:
        return dict(span=0.0, busy=0.0, overlap=0.0, kernel_sum=0.0)
    points = sorted([(s, 1) for s, _, _, _ in intervals] + [(e, -1) for _, e, _, _ in intervals])
    busy = overlap = 0.0
    depth, last = 0, points[0][0]
    for t, d in points:
        if depth >= 1:
            busy += t - last
        if depth >= 2:
            overlap += t - last
        depth += d
        last = t
    span = max(e for _, e, _, _ in intervals) - intervals[0][0]
    return dict(span=span, busy=busy, overlap=overlap, kernel_sum=sum(e - s for s, e, _, _ in intervals))


def timeline(fn, iters: int = 5) -> dict:
    """Run ``fn`` ``iters`` times back to back under the profiler; per-call figures in milliseconds."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        iv = kernel_intervals(path)
    stats = busy_idle(iv)
    per = {k: v / iters / 1e3 for k, v in stats.items()}
    per["idle"] = per["span"] - per["busy"]
    per["kernels"] = len(iv) / iters
    per["streams"] = len({s for _, _, s, _ in iv})
    per["non_kernel"] = sorted({n for _, _, _, n in iv if "memset" in n.lower() or "memcpy" in n.lower()})
    return per


def host_ms(fn, iters: int = 5) -> float:
    """Host time to queue one call (no synchronisation inside the loop), median of ``iters``."""
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def host_split(fn, iters: int = 10) -> dict:
    """Host milliseconds per call (median of ``iters`` synchronised calls), and of them: inside our launchers
    (``launch.forward`` / ``backward``, ``block_sparse.forward`` / ``backward``: allocations, work lists and the kernel
    launches); inside the kernel launches (``relaunch.run``: the key and the compiled kernel's own launcher, Triton's
    ``JITFunction.run`` on a first launch; in a checkout without ``relaunch``, ``JITFunction.run``: argument binding,
    specialisation, cache lookup, the driver launch); and of that inside the driver launch (the compiled launcher's
    ``__call__``: scratch allocation, argument packing, ``cuLaunchKernelEx``). The rest is PyTorch's custom-op
    dispatch, autograd and the op's own checks."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.jit import JITFunction

    from hf_dilated.ops.triton import block_sparse, launch

    try:
        from hf_dilated.ops.triton import relaunch
        launches = (relaunch, "run", "triton")
    except ImportError:  # a checkout from before round 2's session 38
        launches = (JITFunction, "run", "triton")
    spent = {"triton": 0.0, "launchers": 0.0, "driver": 0.0}
    patched = [launches, (CudaLauncher, "__call__", "driver"), (launch, "forward", "launchers"),
               (launch, "backward", "launchers"), (block_sparse, "forward", "launchers"),
               (block_sparse, "backward", "launchers")]
    originals = [getattr(owner, name) for owner, name, _ in patched]

    def timed(original, bucket):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[bucket] += time.perf_counter() - t
        return wrapper

    for (owner, name, bucket), original in zip(patched, originals):
        setattr(owner, name, timed(original, bucket))
    rows = []
    try:
        for _ in range(iters):
            torch.cuda.synchronize()
            spent.update(triton=0.0, launchers=0.0, driver=0.0)
            t = time.perf_counter()
            fn()
            rows.append(((time.perf_counter() - t) * 1e3, spent["launchers"] * 1e3, spent["triton"] * 1e3,
                         spent["driver"] * 1e3))
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)
    torch.cuda.synchronize()
    rows.sort()
    total, launchers, triton_ms, driver_ms = rows[len(rows) // 2]
    return dict(host_total_ms=total, host_launchers_ms=launchers, host_triton_ms=triton_ms,
                host_triton_driver_ms=driver_ms)


def profile_host(fn, iters: int, rows: int) -> None:
    """Print where the host's time goes over ``iters`` calls (``cProfile``, sorted by internal time)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def sync_free(fn) -> str:
    """``"ok"``, or the first warning PyTorch gives for a host synchronisation inside ``fn``."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    msgs = [str(w.message).splitlines()[0] for w in caught  # not the mode's own notice that it is a prototype
            if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)]
    return "ok" if not msgs else msgs[0][:200]


def dilated_case(N: int, H: int, Hk: int, D: int, backward: bool):
    """The attention benchmark's call (``bench_attention.run_dilated``): LongNet branches, causal, the Triton kernels."""
    g = torch.Generator(device="cuda").manual_seed(N)
    q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hk, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q) if backward else None
    return lambda: run_dilated("triton", q, k, v, LONGNET, do)


def block_sparse_case(N: int, H: int, Hk: int, D: int, backward: bool):
    from bench_block_sparse import fixed_layout, ours

    from hf_dilated.ops.layout import resolve_layout

    g = torch.Generator(device="cuda").manual_seed(N)
    q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, Hk, N, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    do = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lay = fixed_layout(N, 128, q.device, num_heads=H)
    tokens = resolve_layout(1, N, N, q.device)
    if not backward:
        return lambda: ours(q, k, v, lay, tokens)
    return lambda: ours(q, k, v, lay, tokens, do)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", default=["dilated", "block_sparse"], choices=["dilated", "block_sparse"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--shape", default="16/16/128", help="H/Hk/D")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None, help="append one JSON line per case to this file")
    ap.add_argument("--scratch-min-gib", type=float, default=None,
                    help="the dilated backward's float32 scratch floor (launch.SCRATCH_MIN_BYTES, default 1 GiB): "
                         "a larger one runs the heads in fewer chunks")
    ap.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                    help="also print a cProfile (internal time) of --iters calls per case, this many rows")
    args = ap.parse_args()
    try:  # every option checked before any work
        H, Hk, D = parse_shape(args.shape, "--shape")
    except ValueError as err:
        ap.error(str(err))
    for name, value, low in (("--iters", args.iters, 1), ("--cprofile", args.cprofile, 0),
                             ("--scratch-min-gib", args.scratch_min_gib or 0, 0)):
        if value < low:
            ap.error(f"{name} must be at least {low}, got {value}")
    if any(n < 1 for n in args.seqlens):
        ap.error(f"--seqlens must be positive, got {args.seqlens}")
    if args.scratch_min_gib is not None:
        from hf_dilated.ops.triton import launch

        launch.SCRATCH_MIN_BYTES = int(args.scratch_min_gib * 2**30)
    make = dict(dilated=dilated_case, block_sparse=block_sparse_case)
    for op in args.ops:
        for N in args.seqlens:
            for mode in args.modes:
                fn = make[op](N, H, Hk, D, mode == "fwdbwd")
                fn()
                reps = max(3, min(20, int(2000 / max(1e-3, cuda_median_ms(fn, 1)))))
                row = dict(op=op, N=N, shape=args.shape, mode=mode, scratch_min_gib=args.scratch_min_gib,
                           bench_ms=cuda_median_ms(fn, reps), host_ms=host_ms(fn), sync=sync_free(fn), **host_split(fn),
                           **timeline(fn, args.iters))
                print(f"{op:12s} {mode:6s} N={N:7d}  bench {row['bench_ms']:8.3f}  wall {row['span']:8.3f}  "
                      f"busy {row['busy']:8.3f}  idle {row['idle']:6.3f}  overlap {row['overlap']:6.3f}  "
                      f"kernel sum {row['kernel_sum']:8.3f}  kernels {row['kernels']:5.1f}  host {row['host_ms']:6.3f}"
                      f" (of {row['host_total_ms']:6.3f}: launchers {row['host_launchers_ms']:6.3f}, "
                      f"launches {row['host_triton_ms']:6.3f}, their driver launch {row['host_triton_driver_ms']:6.3f})"
                      f"  sync {row['sync'][:20]}"
                      f"  {row['non_kernel'] or ''}", flush=True)
                if args.cprofile:
                    profile_host(fn, args.iters, args.cprofile)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
                del fn
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
