"""The dropout draw of attention probabilities: a counter-based hash, identical in every backend.

SPEC.md: in training, every probability of every branch, for each (query, key, branch), is kept independently with
probability ``1 - p`` and scaled by ``1 / (1 - p)``; the backward pass uses the same draw. A counter-based hash of
``(seed, branch, batch row, query head, query column, key column)`` gives that draw without storing a mask: the
PyTorch reference evaluates it here on tensors, the Triton kernels evaluate the same arithmetic in ``uint32``
(``ops/triton``), so both backends drop exactly the same probabilities and tests can rebuild the mask.

The hash is the 32-bit finalizer of "lowbias32" (Wellons), applied to each coordinate in turn. Columns are tensor
columns (the index along ``N``), not positions, so the draw does not depend on how positions are resolved.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap mod 2^64, the low 32 bits are exact)."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * _M1) & MASK32
    x = ((x ^ (x >> 15)) * _M2) & MASK32
    return x ^ (x >> 16)


def keep_threshold(p: float) -> int:
    """Probabilities with ``hash >= threshold`` are kept: ``threshold = round(p * 2^32)``, so P(keep) = 1 - p."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    return min(int(round(p * 2**32)), MASK32)


def stream(seed: int | torch.Tensor, branch: int, batch: torch.Tensor | int, head: torch.Tensor | int) -> torch.Tensor:
    """The per-(seed, branch, batch row, head) stream id: ``mix32(mix32(mix32(seed ^ branch) ^ b) ^ h)``."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    x = mix32(seed ^ branch)
    x = mix32(x ^ torch.as_tensor(batch, dtype=torch.int64, device=x.device))
    return mix32(x ^ torch.as_tensor(head, dtype=torch.int64, device=x.device))


def keep_mask(seed: int | torch.Tensor, p: float, branch: int, batch, head, q_col: torch.Tensor,
              k_col: torch.Tensor) -> torch.Tensor:
    """Boolean keep decisions for broadcastable ``batch, head, q_col, k_col`` integer tensors:
    ``mix32(mix32(stream ^ q_col) ^ k_col) >= keep_threshold(p)``."""
    s = stream(seed, branch, batch, head)
    x = mix32(s ^ q_col.to(torch.int64))
    x = mix32(x ^ k_col.to(torch.int64))
    return x >= keep_threshold(p)
