"""GPU time per kernel of a callable, from ``torch.profiler`` (no Nsight needed): which kernel a pass spends its time
in, measured on the queued launches of ``iters`` calls after one warm-up call.

    from kernel_times import kernel_times, print_times
    print_times("ours, 64K", kernel_times(lambda: step(), iters=5))
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn, iters: int = 5) -> dict[str, float]:
    """``{kernel name: milliseconds per call}``, longest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for avg in prof.key_averages():
        us = getattr(avg, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(avg, "self_cuda_time_total", 0)
        if us > 0:
            times[avg.key] = us / 1000 / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def print_times(title: str, times: dict[str, float], rows: int = 10) -> None:
    """The ``rows`` longest kernels with their share of the total."""
    total = sum(times.values())
    print(f"{title}: {total:.3f} ms per call on the GPU")
    for name, ms in list(times.items())[:rows]:
        print(f"  {ms:9.3f} ms  {100 * ms / total:5.1f}%  {name[:90]}")
