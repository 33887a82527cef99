"""The benchmarks' GPU timer: the median of CUDA-event times over repetitions, after warm-up (one implementation
for ``bench_attention`` and ``bench_block_sparse``)."""

from __future__ import annotations

from typing import Callable


def cuda_median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream over ``reps`` calls, after ``warmup`` calls.

    The calls are queued back to back, a pair of CUDA events around each, and the stream is synchronised once at the
    end (as ``triton.testing.do_bench`` does): while the GPU works on one call the host prepares the next, as in a
    model's forward, so each time is the GPU's work on the call unless the host cannot keep up. Until 2026-11-24
    this timer synchronised after every call, which added each op's host time (about 0.35 ms for the block-sparse
    op, forward, H100) to every reading (``benchmarks/NOTES_triton.md``, session 10)."""
    import torch

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps!r}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return sorted(times)[len(times) // 2]
