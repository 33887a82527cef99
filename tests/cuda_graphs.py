"""A check shared by the GPU tests of both ops: a forward+backward captured in a CUDA graph replays what eager
computes (what ``torch.compile(mode="reduce-overhead")`` and the benchmarks' graph timer rely on)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from timing import captured  # noqa: E402  (the benchmarks' capture: warm-up on a side stream, thread-local)


def assert_graph_replays_eager(step, inputs, trials: int = 2, summed_in_any_order: tuple[int, ...] = ()) -> None:
    """Capture ``step(*inputs)`` (a tuple of tensors) in a CUDA graph, then, ``trials`` times, write fresh random
    values into ``inputs`` and replay: every output equals, bit for bit, eager ``step`` on the same values. Fresh
    values show that the graph reads its inputs (nothing was baked in at capture) and that the host work a replay
    skips (work lists, caches, the stream fork) changes nothing. Outputs ``summed_in_any_order`` (indices: atomic
    sums, whose order varies between runs) agree to a relative error of 1e-2 instead."""
    graph, outputs = captured(lambda: step(*inputs), warmup=2)
    for trial in range(trials):
        with torch.no_grad():
            for t in inputs:
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        expected = step(*inputs)
        assert len(outputs) == len(expected)
        for i, (a, b) in enumerate(zip(outputs, expected)):
            if i in summed_in_any_order:  # atomic sums (the fused dQ): equal up to rounding, and not all zeros
                err = float((a.float() - b.float()).norm() / b.float().norm())
                assert err < 1e-2 and b.abs().max() > 0, f"output {i}: relative error {err} (trial {trial})"
            else:
                assert torch.equal(a, b), f"output {i} of the graph replay differs from eager (trial {trial})"
