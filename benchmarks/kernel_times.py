"""Time per kernel of a callable, from ``torch.profiler`` (no Nsight needed): which kernel a pass spends its time in,
measured on the queued launches of ``iters`` calls after one warm-up call. GPU kernels on CUDA; on a machine without
one, the CPU's operators (what the tests check the tool on).

    from kernel_times import kernel_times, print_times
    print_times("ours, 64K", kernel_times(lambda: step(), iters=5))
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn, iters: int = 5, device: str | None = None) -> dict[str, float]:
    """``{kernel name: milliseconds per call}``, longest first; ``device`` ``"cuda"`` (the default where CUDA is
    available: GPU kernels) or ``"cpu"`` (CPU operators, self time)."""
    if iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        sync()
    times = {}
    for avg in prof.key_averages():
        if device == "cuda":
            us = getattr(avg, "self_device_time_total", None)
            us = getattr(avg, "self_cuda_time_total", 0) if us is None else us  # older torch
        else:
            us = avg.self_cpu_time_total
        if us > 0:
            times[avg.key] = us / 1000 / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def print_times(title: str, times: dict[str, float], rows: int = 10) -> None:
    """The ``rows`` longest kernels with their share of the total."""
    total = sum(times.values())
    print(f"{title}: {total:.3f} ms per call")
    for name, ms in list(times.items())[:rows]:
        print(f"  {ms:9.3f} ms  {100 * ms / total:5.1f}%  {name[:90]}")
