"""The benchmarks' GPU timer: the median of CUDA-event times over repetitions, after warm-up (one implementation
for ``bench_attention`` and ``bench_block_sparse``)."""

from __future__ import annotations

from typing import Callable


def cuda_median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream over ``reps`` calls, after ``warmup`` calls."""
    import torch

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps!r}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
