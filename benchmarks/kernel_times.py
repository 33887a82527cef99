"""Time per kernel of a callable, from ``torch.profiler`` (no Nsight needed): which kernel a pass spends its time in,
measured on the queued launches of ``iters`` calls after one warm-up call (``kernel_times``), or every launch of one
call in the order it ran, with its start and duration (``launch_times``: which of the dilated op's branch launches
costs more than its share of the work). GPU kernels on CUDA; on a machine without one, the CPU's operators (what the
tests check the tool on).

    from kernel_times import kernel_times, launch_times, print_launches, print_times
    print_times("ours, 64K", kernel_times(lambda: step(), iters=5))
    print_launches("ours, 64K", launch_times(lambda: step()))
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def _device(device: str | None):
    """The device asked for (default: CUDA where available, else the CPU) and its synchronize."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    return device, (torch.cuda.synchronize if device == "cuda" else (lambda: None))


def kernel_times(fn, iters: int = 5, device: str | None = None) -> dict[str, float]:
    """``{kernel name: milliseconds per call}``, longest first; ``device`` ``"cuda"`` (the default where CUDA is
    available: GPU kernels) or ``"cpu"`` (CPU operators, self time)."""
    if iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    device, sync = _device(device)
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


def launch_times(fn, device: str | None = None) -> list[tuple[float, float, str]]:
    """``[(start, duration, name)]`` in milliseconds, one row per GPU kernel (CUDA) or top-level CPU operator of one
    call of ``fn`` after a warm-up call, in the order they started; ``start`` counts from the first."""
    device, sync = _device(device)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    kind = "CUDA" if device == "cuda" else "CPU"
    events = [e for e in prof.events() if e.device_type.name == kind and (device == "cuda" or e.cpu_parent is None)]
    events.sort(key=lambda e: e.time_range.start)
    if not events:
        return []
    t0 = events[0].time_range.start
    return [((e.time_range.start - t0) / 1000, (e.time_range.end - e.time_range.start) / 1000, e.name)
            for e in events]


def print_launches(title: str, launches: list[tuple[float, float, str]]) -> None:
    """One line per launch (start, +duration, name), then the span and the sum of the durations."""
    span = max((start + ms for start, ms, _ in launches), default=0.0)
    print(f"{title}: {len(launches)} launches, span {span:.3f} ms, sum {sum(ms for _, ms, _ in launches):.3f} ms")
    for start, ms, name in launches:
        print(f"  {start:9.3f} +{ms:.3f}  {name[:90]}")
