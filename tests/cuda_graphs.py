"""A check shared by the GPU tests of both ops: a forward+backward captured in a CUDA graph replays what eager
computes (what ``torch.compile(mode="reduce-overhead")`` and the benchmarks' graph timer rely on)."""

from __future__ import annotations

import torch


def assert_graph_replays_eager(step, inputs, trials: int = 2) -> None:
    """Capture ``step(*inputs)`` (a tuple of tensors) in a CUDA graph, then, ``trials`` times, write fresh random
    values into ``inputs`` and replay: every output equals, bit for bit, eager ``step`` on the same values. Fresh
    values show that the graph reads its inputs (nothing was baked in at capture) and that the host work a replay
    skips (work lists, caches, the stream fork) changes nothing."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):  # warm up off the capture stream: kernels compiled, caches built
        for _ in range(2):
            step(*inputs)
    current.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # autograd's backward runs in its own thread
        captured = step(*inputs)
    for trial in range(trials):
        with torch.no_grad():
            for t in inputs:
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        expected = step(*inputs)
        assert len(captured) == len(expected)
        for i, (a, b) in enumerate(zip(captured, expected)):
            assert torch.equal(a, b), f"output {i} of the graph replay differs from eager (trial {trial})"
