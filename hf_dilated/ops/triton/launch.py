"""Launchers: allocate outputs, build the work lists, pick launch configurations and run the kernels.

No autograd here (that is ``op.py``); these are plain functions of tensors.
"""

from __future__ import annotations

import math

import torch
import triton

from .backward import delta_kernel, dilated_bwd_dkdv_kernel, dilated_bwd_dq_kernel
from .configs import bwd_config, decode_config, fwd_config, interpreting
from .decode import dilated_decode_kernel
from .forward import LOG2E_F as LOG2E, dilated_fwd_branch_kernel
from .schedule import branch_items


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _upcast(q: torch.Tensor) -> int:
    """Dot mode of ``forward.mm``: 1 for bfloat16 under the interpreter, 2 for float32 on a GPU, else 0."""
    if interpreting():
        return int(q.dtype == torch.bfloat16)
    return 2 if q.dtype == torch.float32 else 0


def forward(q, k, v, branches, runs, cache_key, is_causal: bool, scale: float, head_offset: int):
    """Merged output ``[B, H, Nq, D]`` (query dtype) and float32 lse ``[B, H, Nq]`` over all branches."""
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    B, H, Nq, D = q.shape
    group = H // k.shape[1]
    acc_dtype = torch.float32
    o = torch.zeros(B, H, Nq, D, device=q.device, dtype=acc_dtype)
    lse = torch.full((B, H, Nq), float("-inf"), device=q.device, dtype=torch.float32)
    cfg = fwd_config(D, q.dtype)
    first = True
    for w, r in branches:
        it = branch_items(runs, w, r, is_causal, q.device, cache_key)
        if it.n_items == 0:
            continue
        grid = (it.n_items, triton.cdiv(it.max_q_rows, cfg["BLOCK_M"]), H)
        dilated_fwd_branch_kernel[grid](
            q, k, v, o, lse, it.items,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
            head_offset, group, r, scale * LOG2E,
            HEAD_DIM=D, IS_CAUSAL=is_causal, FIRST=first, UPCAST=_upcast(q), **cfg,
        )
        first = False
    return o.to(q.dtype), lse


def backward(do, q, k, v, o, lse, branches, runs, cache_key, is_causal: bool, scale: float, head_offset: int,
             dlse=None):
    """Gradients ``(dq, dk, dv)`` of the merged output (and of the lse, through ``dlse``), in the dtypes of q, k, v.

    A gradient ``dlse`` on the lse adds ``dlse * P`` to ``dS``: it enters as ``delta - dlse``."""
    q, k, v, o, do = (_rowmajor(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    B, H, Nq, D = q.shape
    Hk = k.shape[1]
    group = H // Hk
    delta = torch.empty_like(lse)
    BLOCK = 64
    delta_kernel[(triton.cdiv(Nq, BLOCK), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, Nq, HEAD_DIM=D, BLOCK=BLOCK
    )
    if dlse is not None:
        delta = delta - dlse.to(torch.float32)
    kv_cfg, q_cfg = bwd_config(D, q.dtype)
    items = [(r, branch_items(runs, w, r, is_causal, q.device, cache_key)) for w, r in branches]
    items = [(r, it) for r, it in items if it.n_items]
    if q.dtype == torch.float32:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _backward_heads(q, k, v, do, lse, delta, dq, dk, dv, items, is_causal, scale, head_offset, kv_cfg, q_cfg)
        return dq, dk, dv
    # Half precision: sum the branches in float32 scratch (rounding once, not once per branch), a chunk of kv heads
    # at a time so the scratch stays within SCRATCH_FRACTION of q + k + v.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    limit = max(SCRATCH_MIN_BYTES, SCRATCH_FRACTION * (q.nbytes + k.nbytes + v.nbytes))
    per_kv_head = 2 * (q.nbytes + k.nbytes + v.nbytes) / Hk
    chunk = max(1, min(Hk, int(limit // per_kv_head)))
    for g0 in range(0, Hk, chunk):
        g1 = min(Hk, g0 + chunk)
        h0, h1 = g0 * group, g1 * group
        sq, sk, sv = q[:, h0:h1], k[:, g0:g1], v[:, g0:g1]
        gq = torch.zeros(sq.shape, device=q.device, dtype=torch.float32)
        gk = torch.zeros(sk.shape, device=q.device, dtype=torch.float32)
        gv = torch.zeros(sv.shape, device=q.device, dtype=torch.float32)
        _backward_heads(sq, sk, sv, do[:, h0:h1], lse[:, h0:h1], delta[:, h0:h1], gq, gk, gv, items, is_causal,
                        scale, head_offset + h0, kv_cfg, q_cfg)
        dq[:, h0:h1].copy_(gq)
        dk[:, g0:g1].copy_(gk)
        dv[:, g0:g1].copy_(gv)
        del gq, gk, gv
    return dq, dk, dv


SCRATCH_FRACTION = 0.125
SCRATCH_MIN_BYTES = 2**30


def _backward_heads(q, k, v, do, lse, delta, dq, dk, dv, items, is_causal, scale, head_offset, kv_cfg, q_cfg):
    """All branches of the backward for the heads of these (possibly head-sliced) tensors, summed into dq, dk, dv."""
    H, Hk, D = q.shape[1], k.shape[1], q.shape[3]
    group = H // Hk
    first = True
    for r, it in items:
        n_classes = min(group, r)
        grid = (it.n_items, triton.cdiv(it.max_k_rows, kv_cfg["BLOCK_N"]), Hk * n_classes)
        dilated_bwd_dkdv_kernel[grid](
            q, k, v, do, lse, delta, dk, dv, it.items,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
            *dk.stride()[:3], *dv.stride()[:3],
            head_offset, group, n_classes, r, scale, scale * LOG2E,
            HEAD_DIM=D, IS_CAUSAL=is_causal, FIRST=first, UPCAST=_upcast(q), **kv_cfg,
        )
        grid = (it.n_items, triton.cdiv(it.max_q_rows, q_cfg["BLOCK_M"]), H)
        dilated_bwd_dq_kernel[grid](
            q, k, v, do, lse, delta, dq, it.items,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
            *dq.stride()[:3],
            head_offset, group, r, scale, scale * LOG2E,
            HEAD_DIM=D, IS_CAUSAL=is_causal, FIRST=first, UPCAST=_upcast(q), **q_cfg,
        )
        first = False


def decode(q, k, v, branches, q_pos, q_valid, kdesc, is_causal: bool, scale: float, head_offset: int):
    """Short query blocks against a cache, all branches in one launch. ``kdesc`` ``[B, 3]`` int32 on the device:
    ``(k_base, k_lo, k_hi)`` per batch row (key of position ``p`` at column ``k_base + p``, positions ``[k_lo, k_hi)``)."""
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    B, H, Nq, D = q.shape
    group = H // k.shape[1]
    o = torch.empty(B, H, Nq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    br = torch.tensor([x for wr in branches for x in wr], dtype=torch.int32).to(q.device, non_blocking=True)
    cfg = decode_config(D, q.dtype)
    grid = (triton.cdiv(Nq, cfg["BLOCK_M"]), H, B)
    dilated_decode_kernel[grid](
        q, k, v, o, lse, q_pos.contiguous(), q_valid.to(torch.int8).contiguous(), kdesc, br,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        Nq, head_offset, group, scale * LOG2E,
        N_BRANCHES=len(branches), HEAD_DIM=D, IS_CAUSAL=is_causal, UPCAST=_upcast(q), **cfg,
    )
    return o, lse


def supported_head_dim(d: int) -> bool:
    return d >= 16 and d <= 256 and (d & (d - 1)) == 0 and math.log2(d) == int(math.log2(d))
