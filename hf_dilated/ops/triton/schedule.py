"""Work lists for the kernels: the segment items of each branch, built from the layout's runs.

A *run* (``TokenLayout.runs()``) is one sequence of one batch row whose queries and keys each sit at consecutive
columns with consecutive positions. For a branch ``(w, r)`` each segment ``[s w, (s + 1) w)`` of a run that holds
queries gives one item ``(b, q_base, k_base, q_lo, q_hi, k_lo, k_hi)``: the queries at positions ``[q_lo, q_hi)``
(column ``q_base + p``) attend to the keys at positions ``[k_lo, k_hi)`` (column ``k_base + p``). Kernels tile an
item's dilated rows themselves, so the lists do not depend on block sizes. Lists for the common contiguous case are
cached, so steady-state training builds none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BranchItems:
    items: torch.Tensor  # [n, 7] int32 on the device
    n_items: int
    max_q_rows: int  # most dilated query rows of one item (over every head offset)
    max_k_rows: int  # most dilated key rows of one item


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _build(runs: torch.Tensor, w: int, r: int, is_causal: bool) -> tuple[torch.Tensor, int, int]:
    b, qc, qp, qn, kc, kp, kn = runs.unbind(1)
    keep = qn > 0
    b, qc, qp, qn, kc, kp, kn = (x[keep] for x in (b, qc, qp, qn, kc, kp, kn))
    s0 = torch.div(qp, w, rounding_mode="floor")
    s1 = torch.div(qp + qn - 1, w, rounding_mode="floor")
    count = s1 - s0 + 1
    idx = torch.repeat_interleave(torch.arange(count.numel()), count)
    first = torch.cumsum(count, 0) - count
    seg = s0[idx] + torch.arange(int(count.sum())) - first[idx]
    q_lo = torch.maximum(seg * w, qp[idx])
    q_hi = torch.minimum((seg + 1) * w, (qp + qn)[idx])
    k_lo = torch.maximum(seg * w, kp[idx])
    k_hi = torch.minimum((seg + 1) * w, (kp + kn)[idx])
    if is_causal:
        k_hi = torch.minimum(k_hi, q_hi)
    ok = k_lo < k_hi
    items = torch.stack([b[idx], (qc - qp)[idx], (kc - kp)[idx], q_lo, q_hi, k_lo, k_hi], 1)[ok]
    if items.numel() and int(items.abs().max()) >= 2**31 - 1:
        raise ValueError("positions or columns beyond 2^31 are not supported by the Triton kernels")
    if items.numel() == 0:
        return items.to(torch.int32), 0, 0
    max_q = int(((items[:, 4] - items[:, 3] + r - 1) // r).max())
    max_k = int(((items[:, 6] - items[:, 5] + r - 1) // r).max())
    return items.to(torch.int32), max_q, max_k


def branch_items(runs: torch.Tensor, w: int, r: int, is_causal: bool, device: torch.device, cache_key=None) -> BranchItems:
    """The items of branch ``(w, r)`` on ``device``; ``cache_key`` (hashable, e.g. the shapes of a contiguous layout)
    lets repeated calls reuse them."""
    key = None if cache_key is None else (cache_key, w, r, is_causal, str(device))
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    items, max_q, max_k = _build(runs, w, r, is_causal)
    out = BranchItems(items.to(device), items.shape[0], max_q, max_k)
    if key is not None:
        _CACHE[key] = out
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out
