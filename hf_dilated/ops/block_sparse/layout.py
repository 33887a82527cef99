"""BlockLayout: which ``b x b`` tiles of the attention matrix a block-sparse call computes, in compact form.

Blocks are tiles of tensor columns in the keys' coordinates: key block ``j`` holds key columns ``[j b, (j + 1) b)``;
a query at column ``c`` of ``q`` sits at key column ``c + q_offset`` (``q_offset = Nk - Nq``: queries are the last
ones, as when decoding against a cache) and belongs to query block ``(c + q_offset) // b``. Both axes therefore have
``n_blocks = ceil(Nk / b)`` blocks. Inside the active tiles the usual rules apply per token (SPEC.md): causal by
position, padding excluded, same packed sequence only.

The form is CSR-like and never ``N x N``: ``kv_count [L, Hl, n_blocks]`` int32 (active key blocks of each query
block) and ``kv_index [L, Hl, n_blocks, A]`` int32 (their indices, increasing, padded with -1). ``L`` is 1 (shared by
the batch) or ``B`` (content-chosen layouts); ``Hl`` is 1 (shared by all heads), the number of kv heads or of query
heads: query head ``h`` reads layout head ``h // (Hq // Hl)``. The backward pass also needs the transpose (per key
block, its query blocks), built once on demand with a sort: O(entries log entries).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_block_size(block_size) -> int:
    """Block sizes are powers of two >= 16 (the kernels tile by them; 64 and 128 are the GPU sizes)."""
    b = _check_positive_int("block_size", block_size, 16)
    if b & (b - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (64 or 128 on GPU), got {block_size!r}")
    return b


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Active key blocks per query block (see the module docstring).

    Attributes:
        block_size: ``b``, a power of two >= 16.
        n_blocks: blocks per axis, ``ceil(Nk / b)`` for the calls this layout serves.
        kv_count: ``[L, Hl, n_blocks]`` int32.
        kv_index: ``[L, Hl, n_blocks, A]`` int32, each row increasing without repeats, -1 after ``kv_count``.
    """

    block_size: int
    n_blocks: int
    kv_count: torch.Tensor
    kv_index: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.kv_index.device

    @property
    def max_active(self) -> int:
        return self.kv_index.shape[-1]

    @property
    def layout_heads(self) -> int:
        return self.kv_index.shape[1]

    @property
    def layout_batch(self) -> int:
        return self.kv_index.shape[0]

    def active_blocks(self) -> int:
        """Number of active tiles, summed over the layout's batch and head entries."""
        return int(self.kv_count.sum())

    def density(self) -> float:
        """Fraction of the ``n_blocks^2`` tiles that are active, averaged over layout entries."""
        return self.active_blocks() / (self.layout_batch * self.layout_heads * self.n_blocks**2)

    def to(self, device) -> "BlockLayout":
        return BlockLayout(self.block_size, self.n_blocks, self.kv_count.to(device), self.kv_index.to(device))

    def to_mask(self) -> torch.Tensor:
        """``[L, Hl, n_blocks, n_blocks]`` bool (for tests and inspection; ``(N / b)^2`` entries, never ``N x N``)."""
        L, H, n, _ = self.kv_index.shape
        mask = torch.zeros(L, H, n, n + 1, dtype=torch.bool, device=self.device)
        idx = torch.where(self.kv_index >= 0, self.kv_index, n).long()
        mask.scatter_(-1, idx, True)
        return mask[..., :n]

    @functools.cached_property
    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_ptr [L, Hl, n_blocks + 1], q_flat [L, Hl, n_blocks * A])`` int32, true CSR of the transpose: the
        query blocks that read key block ``j`` are ``q_flat[..., q_ptr[j]:q_ptr[j + 1]]``, increasing. (A padded
        form would be ``(N / b)^2`` wide for the sink block, which every query block reads.)"""
        L, H, n, A = self.kv_index.shape
        active = self.kv_index >= 0
        i = torch.arange(n, device=self.device, dtype=torch.int64).view(1, 1, n, 1).expand(L, H, n, A)
        j = torch.where(active, self.kv_index.long(), n)  # inactive entries sort last, under a spare row n
        key, _ = torch.sort((j * (n + 1) + i).reshape(L, H, n * A), dim=-1)
        jj, ii = key // (n + 1), key % (n + 1)
        counts = torch.zeros(L, H, n + 1, dtype=torch.int64, device=self.device)
        counts.scatter_add_(-1, jj, torch.ones_like(jj))
        ptr = torch.nn.functional.pad(torch.cumsum(counts[..., :n], -1), (1, 0))
        flat = torch.where(jj < n, ii, -1)
        return ptr.to(torch.int32).contiguous(), flat.to(torch.int32).contiguous()

    def check_for(self, batch: int, q_heads: int, kv_len: int) -> None:
        """Raise ``ValueError`` naming the fault when this layout cannot serve a call of these sizes."""
        need = math.ceil(kv_len / self.block_size)
        if self.n_blocks != need:
            raise ValueError(
                f"layout has n_blocks={self.n_blocks} but the keys need ceil({kv_len} / block_size {self.block_size}) "
                f"= {need}; build the layout for the key length"
            )
        if self.layout_batch not in (1, batch):
            raise ValueError(f"layout batch dimension must be 1 or the batch size {batch}, got {self.layout_batch}")
        if q_heads % self.layout_heads:
            raise ValueError(
                f"layout heads ({self.layout_heads}) must divide the query heads ({q_heads}): use 1, the kv heads or "
                "the query heads"
            )


def compact(candidates: torch.Tensor, block_size: int, n_blocks: int) -> BlockLayout:
    """A :class:`BlockLayout` from candidate key blocks ``[L, Hl, n, c]`` (any order, repeats and out-of-range
    entries, e.g. -1, allowed and dropped). Costs one sort of ``n * c`` entries per layout head."""
    if candidates.ndim != 4 or candidates.shape[2] != n_blocks:
        raise ValueError(f"candidates must be [L, Hl, n_blocks={n_blocks}, c], got {tuple(candidates.shape)}")
    c = candidates.long()
    c = torch.where((c >= 0) & (c < n_blocks), c, n_blocks)
    if c.shape[-1] == 0:
        c = c.new_full(c.shape[:-1] + (1,), n_blocks)
    c, _ = torch.sort(c, dim=-1)
    dup = torch.zeros_like(c, dtype=torch.bool)
    dup[..., 1:] = c[..., 1:] == c[..., :-1]
    c = torch.sort(c.masked_fill(dup, n_blocks), dim=-1)[0]
    count = (c < n_blocks).sum(-1)
    width = max(int(count.max()), 1)
    index = c[..., :width].masked_fill(c[..., :width] >= n_blocks, -1)
    return BlockLayout(block_size, n_blocks, count.to(torch.int32).contiguous(), index.to(torch.int32).contiguous())


def from_mask(mask: torch.Tensor, block_size: int) -> BlockLayout:
    """A layout from a boolean block mask ``[nq, nk]``, ``[Hl, nq, nk]`` or ``[L, Hl, nq, nk]`` (``nq == nk``)."""
    b = check_block_size(block_size)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"layout mask must be a torch.bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    if mask.ndim not in (2, 3, 4) or mask.shape[-1] != mask.shape[-2] or mask.shape[-1] == 0:
        raise ValueError(
            f"layout mask must be square [n_blocks, n_blocks] (optionally with leading [L, Hl] dims), got {tuple(mask.shape)}"
        )
    while mask.ndim < 4:
        mask = mask[None]
    n = mask.shape[-1]
    cols = torch.arange(n, device=mask.device).expand(mask.shape)
    return compact(torch.where(mask, cols, -1), b, n)


def union(*layouts: BlockLayout) -> BlockLayout:
    """The union of layouts of one block size and length (their batch / head dims broadcast)."""
    if not layouts:
        raise ValueError("union needs at least one layout")
    b, n = layouts[0].block_size, layouts[0].n_blocks
    for lay in layouts:
        if not isinstance(lay, BlockLayout):
            raise ValueError(f"union takes BlockLayouts, got {type(lay).__name__}")
        if (lay.block_size, lay.n_blocks) != (b, n):
            raise ValueError(
                f"union needs one block_size and n_blocks, got ({b}, {n}) and ({lay.block_size}, {lay.n_blocks})"
            )
    L = max(lay.layout_batch for lay in layouts)
    H = max(lay.layout_heads for lay in layouts)
    parts = []
    for lay in layouts:
        idx = lay.kv_index.to(layouts[0].device)
        if H % idx.shape[1] or L % idx.shape[0]:
            raise ValueError(f"union: layout dims {tuple(idx.shape[:2])} do not broadcast to ({L}, {H})")
        idx = idx.repeat_interleave(H // idx.shape[1], 1).expand(L, H, -1, -1)
        parts.append(idx)
    return compact(torch.cat(parts, -1), b, n)


BlockLayout.__or__ = lambda self, other: union(self, other)
