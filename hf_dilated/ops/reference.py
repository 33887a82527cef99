"""The spec in plain PyTorch: gather each branch's dilated rows, attend within segments with log-sum-exp, merge exactly.

Runs anywhere (CPU or GPU, any float dtype); autograd gives exact gradients through the merge (the merge weights are
not detached). Memory is linear in N: per branch and head-offset class it holds ``N / r`` gathered rows and scores of
``w / r`` keys per query, never an ``N x N`` tensor.
"""

from __future__ import annotations

import torch

from .layout import TokenLayout


def _bucketize(pos: torch.Tensor, seq: torch.Tensor, w: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket key ``(batch, sequence, segment)`` and slot ``(p mod w) / r`` of each token."""
    b = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
    segment = torch.div(pos, w, rounding_mode="floor")
    key = torch.stack([b, seq, segment], -1)
    slot = torch.div(torch.remainder(pos, w), r, rounding_mode="floor")
    return key, slot


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over allowed keys; rows with no allowed key give output 0 and lse -inf, without NaN."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    scores = torch.where(allowed, scores, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    has_key = denom > 0
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    out = torch.matmul(p / safe, v.to(dtype))
    lse = torch.where(has_key, row_max + torch.log(safe), torch.full_like(safe, float("-inf"))).squeeze(-1)
    return out, lse


def _branch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    w: int,
    r: int,
    is_causal: bool,
    scale: float,
    head_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One branch ``(w, r)``: output ``[B, H, Nq, D]`` and lse ``[B, H, Nq]`` (-inf where the branch skips a query)."""
    B, H, Nq, D = q.shape
    Dv = v.shape[-1]
    group = H // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(B, H, Nq, Dv, dtype=acc)
    lse = q.new_full((B, H, Nq), float("-inf"), dtype=acc)
    qkey, qslot = _bucketize(layout.q_pos, layout.q_seq, w, r)
    kkey, kslot = _bucketize(layout.k_pos, layout.k_seq, w, r)
    for offset in range(r):
        heads = [h for h in range(H) if (h + head_offset) % r == offset]
        if not heads:
            continue
        qsel = (torch.remainder(layout.q_pos, r) == offset) & layout.q_valid
        ksel = (torch.remainder(layout.k_pos, r) == offset) & layout.k_valid
        if not bool(qsel.any()) or not bool(ksel.any()):
            continue
        qb, qn = qsel.nonzero(as_tuple=True)
        kb, kn = ksel.nonzero(as_tuple=True)
        keys, inverse = torch.unique(torch.cat([qkey[qb, qn], kkey[kb, kn]]), dim=0, return_inverse=True)
        q_bucket, k_bucket = inverse[: qb.numel()], inverse[qb.numel() :]
        q_slot, k_slot = qslot[qb, qn], kslot[kb, kn]
        nb = keys.shape[0]
        cap = int(torch.maximum(q_slot.max(), k_slot.max())) + 1
        hidx = torch.tensor(heads, device=q.device)
        kvh = torch.div(hidx, group, rounding_mode="floor")
        # Gather the selected rows into [buckets, heads, slots, D] (zeros where a slot holds no token).
        Q = q.new_zeros(nb, cap, len(heads), D)
        Q[q_bucket, q_slot] = q[qb[:, None], hidx[None], qn[:, None]]
        K = k.new_zeros(nb, cap, len(heads), D)
        K[k_bucket, k_slot] = k[kb[:, None], kvh[None], kn[:, None]]
        V = v.new_zeros(nb, cap, len(heads), Dv)
        V[k_bucket, k_slot] = v[kb[:, None], kvh[None], kn[:, None]]
        present = torch.zeros(nb, cap, dtype=torch.bool, device=q.device)
        present[k_bucket, k_slot] = True
        allowed = present[:, None, None, :]
        if is_causal:
            slots = torch.arange(cap, device=q.device)
            allowed = allowed & (slots[None, None, :, None] >= slots[None, None, None, :])
        o_b, lse_b = _masked_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), allowed, scale)
        # Scatter back to [B, H, Nq]: index_put keeps autograd through the gathered rows.
        o_tok = o_b[q_bucket, :, q_slot]  # [nq_sel, heads, Dv]
        l_tok = lse_b[q_bucket, :, q_slot]
        out = out.index_put((qb[:, None], hidx[None], qn[:, None]), o_tok)
        lse = lse.index_put((qb[:, None], hidx[None], qn[:, None]), l_tok)
    return out, lse


def merge_branches(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge: ``sum_i softmax(lse)_i o_i``; rows no branch selected give 0 and lse -inf."""
    lse = torch.stack(lses)  # [branches, B, H, N]
    total = torch.logsumexp(torch.where(torch.isfinite(lse), lse, -1e30), dim=0)
    reached = torch.isfinite(lse).any(0)
    weights = torch.where(torch.isfinite(lse), torch.exp(lse - total), torch.zeros_like(lse))
    out = sum(wt[..., None] * o for wt, o in zip(weights.unbind(0), outs))
    out = torch.where(reached[..., None], out, torch.zeros_like(out))
    total = torch.where(reached, total, torch.full_like(total, float("-inf")))
    return out, total


def dilated_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    layout: TokenLayout,
    is_causal: bool,
    scale: float,
    head_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention per SPEC.md. Returns ``(out [B, Hq, Nq, Dv] in query.dtype, lse [B, Hq, Nq])``.

    The lse is float32 (float64 for float64 inputs); rows that attend nowhere (padding) give 0 and lse -inf.
    """
    outs, lses = [], []
    for w, r in branches:
        o, l = _branch(query, key, value, layout, w, r, is_causal, scale, head_offset)
        outs.append(o)
        lses.append(l)
    out, lse = merge_branches(outs, lses)
    return out.to(query.dtype), lse
