"""The benchmarks' GPU timer: the median of CUDA-event times over repetitions, after warm-up, and the timing step
with the GPU's clock and power beside it (one implementation for ``bench_attention``, ``bench_block_sparse`` and
``benchmarks/compare_checkouts.py``)."""

from __future__ import annotations

import contextlib
import signal
import types
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


def warm(fn: Callable[[], object], seconds: float) -> int:
    """Call ``fn()`` once (compilation, caches: the GPU may idle meanwhile), then back to back for at least ``seconds``
    of wall time (synchronised once per call), and return how many calls that took after the first: a power-capped
    GPU then runs at the clock it sustains under this load, not at the clock an idle moment (a compile, the previous
    case) left it at."""
    import time

    import torch

    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    fn()
    torch.cuda.synchronize()
    calls, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        fn()
        torch.cuda.synchronize()
        calls += 1
    return calls


def timed_on_gpu(fn: Callable[[], object], timer: Callable[[Callable[[], object]], float], monitor,
                 warm_s: float = 0.0) -> tuple[float, dict, int]:
    """``(ms, gpu, warm_calls)``: ``timer(fn)``'s milliseconds after ``warm_s`` seconds of :func:`warm`, the GPU's
    mean clock / power / temperature while the timer ran (``monitor.window``: ``gpu_monitor.GpuMonitor``), with
    ``mj``, the energy of one call (mean power x the time), where the power was read, and the warm-up's call count.
    The one timing step of ``bench_attention``, ``bench_block_sparse`` and ``benchmarks/compare_checkouts.py``,
    whatever their timers (``cuda_median_ms``, ``triton.testing.do_bench``)."""
    import time

    calls = warm(fn, warm_s) if warm_s > 0 else 0
    start = time.monotonic()
    ms = timer(fn)
    gpu = dict(monitor.window(start, time.monotonic()))
    if "gpu_power_w" in gpu:
        gpu["mj"] = round(gpu["gpu_power_w"] * ms, 1)
    return ms, gpu, calls


def captured(fn: Callable[[], object], warmup: int = 3):
    """``(graph, output)``: ``fn()`` captured once in a CUDA graph, after ``warmup`` calls on a side stream (what a
    capture needs: kernels compiled, caches built, nothing read on the host). The capture is thread-local: autograd
    runs the backward in a thread of its own. ``output`` is what the captured call returned; each replay rewrites it."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        output = fn()
    return graph, output


def cuda_graph_median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of one replay of ``fn()`` captured in a CUDA graph (:func:`captured`): the GPU's time
    alone, without the host's (Python, dispatch, kernel launches), as ``triton.testing.do_bench_cudagraph`` measures.
    Where the host takes longer to queue a call than the GPU to run it (small problems, few heads),
    :func:`cuda_median_ms` reads the host's time and this the kernels' (it times the replays)."""
    if reps < 1:  # before the capture's work
        raise ValueError(f"reps must be >= 1, got {reps!r}")
    graph, _ = captured(fn, warmup)
    ms = cuda_median_ms(graph.replay, reps, warmup=1)
    del graph
    return ms



@contextlib.contextmanager
def until_interrupted():
    """Run the block until it ends or is interrupted: by Ctrl-C or by a SIGTERM (what ``timeout`` and job schedulers
    send, raised here as ``KeyboardInterrupt``), which ends the block quietly with ``.interrupted`` set on the object
    it yields, so that a benchmark stopped from outside still writes the cases it measured. The previous SIGTERM
    handler is restored on the way out."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    state = types.SimpleNamespace(interrupted=False)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield state
    except KeyboardInterrupt:
        state.interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
