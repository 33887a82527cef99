"""A cost model of sequence-parallel dilated attention: bytes each rank receives, FLOPs each rank computes, and the
step time they predict, for one attention layer (forward + backward) on one contiguous causal sequence.

It counts exactly what :func:`~hf_dilated.distributed.dilated_ring.build_plan` exchanges for that layout (the rows
``p % r`` of each kv head's offset classes inside each branch's segment window, union over branches) and the
(query, key) pairs the kernels compute, then divides by measured rates (:class:`Hardware`). ``scripts/bench_ring.py``
checks the byte counts against the plans of real runs and the times against measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))


@dataclass
class Hardware:
    """Rates the model divides by. Defaults: H100/H200 with NVLink within a node of 8 and 400 Gb/s InfiniBand per
    GPU across nodes; ``flops`` is the dilated kernels' measured forward+backward rate (bench_attention.py, H100,
    1M tokens: 190 TFLOP/s counting useful pairs, backward = 2.5x forward)."""

    flops: float = 190e12
    intra_bw: float = 150e9  # bytes/s a GPU receives in an all-to-all inside its node
    inter_bw: float = 40e9  # bytes/s a GPU receives from other nodes (400 Gb/s, ~80% achieved)
    latency: float = 30e-6  # per collective (signature all-gather, all-to-all forward, all-to-all backward)
    gpus_per_node: int = 8


def _classes(branches, heads: int, kv_heads: int) -> list[np.ndarray]:
    group = heads // kv_heads
    tables = []
    for _, r in branches:
        t = np.zeros((kv_heads, r), dtype=bool)
        for h in range(heads):
            t[h // group, h % r] = True
        tables.append(t)
    return tables


def rows_received(n_tokens: int, world: int, rank: int, branches=LONGNET, heads: int = 16, kv_heads: int = 16,
                  causal: bool = True, shift: int = 0) -> dict[int, int]:
    """``{source rank: rows}`` that ``rank`` receives per call (a row is one kv head's key and value at one token).

    The sequence's positions are ``column + shift``: ``shift = 0`` aligns segments with power-of-two shards (often
    no exchange at all); ``shift = w_max // 2`` is the misaligned case (a document continuing from earlier, or
    packed documents), where every shard boundary cuts every branch's segment.
    """
    from .sharding import shard_sizes

    sizes = shard_sizes(n_tokens, world)
    starts = np.cumsum([0] + sizes)
    s, e = int(starts[rank]), int(starts[rank + 1])
    windows = []
    for w, _ in branches:
        lo = max(((s + shift) // w) * w - shift, 0)
        hi = e if causal else min(((e - 1 + shift) // w + 1) * w - shift, n_tokens)
        windows.append((lo, hi))
    lo_all = min(lo for lo, _ in windows)
    hi_all = max(hi for _, hi in windows)
    tables = _classes(branches, heads, kv_heads)
    out: dict[int, int] = {}
    for a, b in ((lo_all, s), (e, hi_all)):
        if a >= b:
            continue
        cols = np.arange(a, b)
        need = np.zeros((kv_heads, b - a), dtype=bool)
        for (w, r), (lo, hi), table in zip(branches, windows, tables):
            inside = (cols >= lo) & (cols < hi)
            need |= inside[None] & table[:, (cols + shift) % r]
        per_col = need.sum(0)
        owner = np.searchsorted(starts, cols, side="right") - 1
        for src in np.unique(owner):
            out[int(src)] = out.get(int(src), 0) + int(per_col[owner == src].sum())
    return out


def pairs_computed(n_tokens: int, world: int, rank: int, branches=LONGNET, heads: int = 16,
                   causal: bool = True, shift: int = 0) -> int:
    """(query, key, head) triples the kernels compute for ``rank``'s queries (a pair in m branches counts m)."""
    from .sharding import shard_range

    s, e = shard_range(n_tokens, world, rank)
    p = np.arange(s, e, dtype=np.int64) + shift
    total = 0
    for w, r in branches:
        start = np.maximum((p // w) * w, shift)
        end = np.minimum((p // w) * w + w, n_tokens + shift)
        # keys of the query's offset class in its segment: causal up to the query, else the whole segment
        last = p if causal else end - 1
        keys = (last - start) // r + 1
        total += int(keys.sum()) * heads // r  # each query is selected for heads // r of the heads
    return total


@dataclass
class Prediction:
    n_tokens: int
    world: int
    bytes_per_rank: float  # received per layer, forward + backward (dK, dV return the same rows)
    flops_per_rank: float  # forward + backward
    compute_s: float
    comm_s: float
    step_s: float  # without overlap: compute + communication
    step_overlap_s: float  # with communication hidden behind compute
    layout_bytes: float  # per forward: the all-gather of global position_ids (int64), shared by all layers
    detail: dict = field(default_factory=dict)


def predict(n_tokens: int, world: int, branches=LONGNET, heads: int = 16, kv_heads: int = 16, head_dim: int = 128,
            dtype_bytes: int = 2, causal: bool = True, shift: int = 0, hw: Hardware | None = None,
            max_ranks: int = 48) -> Prediction:
    """Step time of one attention layer (forward + backward) on ``world`` GPUs, set by the slowest rank.

    Ranks are evaluated exactly: all of them, or (``world > max_ranks``) three contiguous blocks, at the start, the
    middle and the end of the group (interior ranks repeat the pattern of their neighbours).
    """
    hw = hw or Hardware()
    k = max_ranks // 3
    ranks = range(world) if world <= max_ranks else sorted(
        set(range(k)) | set(range(world // 2, world // 2 + k)) | set(range(world - k, world)))
    row_bytes = 2 * head_dim * dtype_bytes  # one key row and one value row
    worst = None
    for rank in ranks:
        got = rows_received(n_tokens, world, rank, branches, heads, kv_heads, causal, shift)
        node = rank // hw.gpus_per_node
        intra = sum(v for src, v in got.items() if src // hw.gpus_per_node == node) * row_bytes
        inter = sum(v for src, v in got.items() if src // hw.gpus_per_node != node) * row_bytes
        comm = 2 * (max(intra / hw.intra_bw, inter / hw.inter_bw) + 2 * hw.latency)  # forward and backward
        flops = 3.5 * 4 * head_dim * pairs_computed(n_tokens, world, rank, branches, heads, causal, shift)
        compute = flops / hw.flops
        cand = (compute + comm, rank, 2 * (intra + inter), flops, compute, comm, max(compute, comm))
        worst = cand if worst is None or cand > worst else worst
    step, rank, nbytes, flops, compute, comm, overlap = worst
    return Prediction(n_tokens, world, nbytes, flops, compute, comm, step, overlap,
                      layout_bytes=8.0 * n_tokens, detail={"slowest_rank": rank})


def table(tokens=(2**20, 2**22, 2**24), worlds=(8, 64, 512), **kwargs) -> str:
    """A markdown table of predictions (the README's); ``kwargs`` go to :func:`predict`."""
    lines = ["| tokens | GPUs | tokens/GPU | recv MB/rank/layer (fwd+bwd) | compute ms | comm ms | step ms | "
             "step ms (overlap) | comm share |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in tokens:
        for p in worlds:
            if n < p:
                continue
            r = predict(n, p, **kwargs)
            lines.append(
                f"| {n / 2**20:g}M | {p} | {n // p:,} | {r.bytes_per_rank / 1e6:.1f} | {r.compute_s * 1e3:.2f} | "
                f"{r.comm_s * 1e3:.2f} | {r.step_s * 1e3:.2f} | {r.step_overlap_s * 1e3:.2f} | "
                f"{r.comm_s / r.step_s:.0%} |"
            )
    return "\n".join(lines)
