"""An independent float64 statement of SPEC.md for the tests: one softmax over the union of the branches' key sets,
where a key reached by ``m`` branches carries an extra ``log m`` on its score. Dense ``N x N`` on purpose (small N only);
it shares no code with the library."""

from __future__ import annotations

import math

import torch


def naive_positions(B, Nq, Nk, attention_mask=None, position_ids=None):
    """Positions / sequence ids / validity by the SPEC rules, written out plainly (no packing detection)."""
    valid = torch.ones(B, Nk, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
    if position_ids is None:
        kpos = counted
    elif position_ids.shape[-1] == Nk:
        kpos = position_ids.cpu().long().expand(B, Nk)
    else:
        kpos = counted
    qpos = kpos[:, Nk - Nq:] if (position_ids is None or position_ids.shape[-1] == Nk) else position_ids.cpu().long().expand(B, Nq)
    return qpos, kpos, valid


def naive_dilated_attention(q, k, v, branches, *, is_causal=True, scale=None, q_pos=None, k_pos=None,
                            q_seq=None, k_seq=None, k_valid=None, q_valid=None, head_offset=0,
                            window=None, global_tokens=0, dropout_p=0.0, keep=None, return_lse=False):
    """q [B,Hq,Nq,D], k/v [B,Hk,Nk,D] (float64 recommended). Positions default to 0..N-1 with queries last.

    ``window``: every branch also needs ``0 <= p - p' < window`` (causal) or ``|p - p'| < window``.
    ``global_tokens = g``: one more branch (index ``len(branches)``) of the keys at positions ``p' < g``.
    ``dropout_p`` with ``keep(branch, b [B,1,1,1], h [1,H,1,1], q_col [1,1,Nq,1], k_col [1,1,1,Nk]) -> bool``: each
    branch's probabilities are dropped by ``keep`` and scaled by ``1 / (1 - p)``, merged with the undropped lse.
    ``return_lse``: also return the merged (undropped) log-sum-exp ``[B, Hq, Nq]``, -inf where no key is reached."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    dev = q.device
    scale = D ** -0.5 if scale is None else scale
    if k_pos is None:
        k_pos = torch.arange(Nk, device=dev).expand(B, Nk)
    if q_pos is None:
        q_pos = k_pos[:, Nk - Nq:]
    if k_seq is None:
        k_seq = torch.zeros(B, Nk, dtype=torch.long, device=dev)
    if q_seq is None:
        q_seq = torch.zeros(B, Nq, dtype=torch.long, device=dev)
    if k_valid is None:
        k_valid = torch.ones(B, Nk, dtype=torch.bool, device=dev)
    if q_valid is None:
        q_valid = torch.ones(B, Nq, dtype=torch.bool, device=dev)
    k_pos, q_pos, k_seq, q_seq = (t.to(dev).long() for t in (k_pos, q_pos, k_seq, q_seq))
    k_valid, q_valid = k_valid.to(dev).bool(), q_valid.to(dev).bool()
    heads = torch.arange(Hq, device=dev) + head_offset
    masks = []  # per branch: [B, H, Nq, Nk] bool, the (query, key) pairs the branch attends
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    for w, r in list(branches) + ([(None, 1)] if global_tokens else []):
        off = (heads % r)[None, :, None]  # [1, H, 1]
        sel_q = (q_pos[:, None, :] % r == off) & q_valid[:, None, :]  # [B, H, Nq]
        sel_k = (k_pos[:, None, :] % r == off) & k_valid[:, None, :]  # [B, H, Nk]
        same = q_seq[:, :, None] == k_seq[:, None, :]
        if w is None:
            same = same & (k_pos[:, None, :] < global_tokens)
        else:
            same = same & (q_pos[:, :, None] // w == k_pos[:, None, :] // w)
        if is_causal:
            same = same & (dist >= 0)
        if window is not None:
            same = same & ((dist < window) & (dist >= 0) if is_causal else dist.abs() < window)
        masks.append(sel_q[..., :, None] & sel_k[..., None, :] & same[:, None])
    group = Hq // Hk
    kr = k.repeat_interleave(group, 1)
    vr = v.repeat_interleave(group, 1)
    mult = sum(m.to(q.dtype) for m in masks)
    scores = scale * q @ kr.transpose(-1, -2) + torch.log(mult.clamp_min(1e-300))
    scores = torch.where(mult > 0, scores, torch.full_like(scores, -math.inf))
    has = (mult > 0).any(-1, keepdim=True)
    lse = torch.logsumexp(torch.where(has, scores, torch.zeros_like(scores)), -1)  # no NaN gradient on empty rows
    lse = torch.where(has[..., 0], lse, torch.full_like(lse, -math.inf))
    if dropout_p:
        out = _naive_dropped(q, kr, vr, masks, scale, dropout_p, keep)
        return (out, lse) if return_lse else out
    p = torch.softmax(torch.where(has, scores, torch.zeros_like(scores)), -1)
    p = torch.where(has & (mult > 0), p, torch.zeros_like(p))
    return (p @ vr, lse) if return_lse else p @ vr


def _naive_dropped(q, kr, vr, masks, scale, dropout_p, keep):
    """Per-branch softmax, dropout by ``keep``, merge by the undropped log-sum-exps (SPEC.md, dropout)."""
    B, H, Nq, _ = q.shape
    Nk = kr.shape[2]
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qc = torch.arange(Nq)[None, None, :, None]
    kc = torch.arange(Nk)[None, None, None, :]
    outs, lses = [], []
    for i, m in enumerate(masks):
        s = torch.where(m, scale * q @ kr.transpose(-1, -2), torch.full((), -math.inf, dtype=q.dtype))
        lse = torch.logsumexp(s, -1)  # -inf where the branch selects no key
        p = torch.where(m, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0)
        p = torch.where(keep(i, b, h, qc, kc).to(q.device), p / (1 - dropout_p), 0)
        outs.append(p @ vr)
        lses.append(lse)
    lse = torch.stack(lses)
    total = torch.logsumexp(lse, 0)
    wts = torch.where(torch.isfinite(lse), torch.exp(lse - torch.where(torch.isfinite(total), total, 0)), 0)
    return sum(w[..., None] * o for w, o in zip(wts.unbind(0), outs))


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
