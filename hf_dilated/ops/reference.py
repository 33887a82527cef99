"""The spec in plain PyTorch: exact dilated attention for the CPU and any device without Triton, in memory linear in N.

Per branch ``(w, r)`` and head-offset class, the selected queries and keys are sorted by ``(batch row, sequence,
segment, position)`` and cut into tiles of at most ``_TILE`` tokens (a segment of a branch is a *bucket*; a tile
never crosses a bucket). Each query tile attends to the key tiles of its bucket that the causal / window rules can
reach: a list of (query tile, key tile) pairs, processed a bounded number of pairs at a time, so the largest
intermediate is ``budget`` scores whatever ``N``, ``w`` or the window (a dense layer, ``w = DENSE_SEGMENT``, is one
bucket per sequence; a sliding window only pairs tiles inside the band).

Forward: one online softmax over the whole multiset of (branch, key) pairs per query row, with a running max
``m``, sum ``l`` and accumulator: merging branches is the same max-shifted update as merging tiles, as the Triton
kernels do, so the merge weights sum to one at any logit size. Backward (``torch.autograd.Function``): the
flash-attention backward per branch with the *merged* ``p = exp((s - m) - log l)`` and ``delta = rowsum(dO * O) - dL``
(``dL`` the gradient through the returned lse), scores recomputed, nothing ``N x N`` stored. Half-precision inputs
keep half tiles and float32 scores / accumulators (flash-attention precision); dS is never rounded to half. Dropout (SPEC.md) draws its keep
decisions from ``ops/dropout.py`` by tensor column (local head index), in the forward and again in the backward.

The common case, a plain layout (one sequence per row, unpadded or, causal, right- or left-padded; no window or
dropout) in float16, bfloat16 or float32, runs instead on PyTorch's fused attention kernels, segment buckets batched
per branch (``ops/fused_buckets.py``; global tokens are this path's one tiled branch, merged by lse);
:func:`last_path` tells which path the last call took and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import fused_buckets
from .dropout import keep_mask, keep_threshold
from .layout import TokenLayout, _IdentityMemo

_TILE = 128  # most tokens of one bucket in one tile
_MIN_BUDGET, _MAX_BUDGET = 1 << 18, 1 << 26  # bounds of the scores per batch of tile pairs (see _budget)
_SHIFT = 1 << 34  # positions are offset by this inside the bucket-major sort keys (|position| < 2^34)


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class _Tiles:
    """One set of tokens (the queries or the keys of a branch class) cut into tiles of ``size`` rows."""

    b: torch.Tensor  # [n] batch row of each token, in tile order
    col: torch.Tensor  # [n] column of each token
    tile: torch.Tensor  # [n] its tile
    row: torch.Tensor  # [n] its row in the tile
    pos: torch.Tensor  # [tiles, size] position of each row (0 in empty rows)
    col_t: torch.Tensor  # [tiles, size] column of each row (0 in empty rows)
    present: torch.Tensor  # [tiles, size] rows holding a token
    bucket: torch.Tensor  # [tiles] bucket of each tile
    b_t: torch.Tensor  # [tiles] batch row of each tile
    first: torch.Tensor  # [tiles] smallest position in the tile
    last: torch.Tensor  # [tiles] largest position in the tile
    size: int

    @property
    def n_tiles(self) -> int:
        return self.pos.shape[0]


def _tiles(bucket: torch.Tensor, pos: torch.Tensor, b: torch.Tensor, col: torch.Tensor, n_buckets: int) -> _Tiles:
    """Sort tokens by (bucket, position) and cut every bucket into tiles of ``size`` consecutive tokens."""
    low = int(pos.min()) if pos.numel() else 0
    span = (int(pos.max()) - low + 1) if pos.numel() else 1
    if n_buckets * span < 2**62:
        order = torch.argsort(bucket * span + (pos - low))
    else:
        order = torch.argsort(pos, stable=True)
        order = order[torch.argsort(bucket[order], stable=True)]
    bucket, pos, b, col = bucket[order], pos[order], b[order], col[order]
    counts = torch.bincount(bucket, minlength=n_buckets)
    size = min(_TILE, _pow2ceil(int(counts.max()))) if bucket.numel() else 1
    per = (counts + size - 1) // size
    tile_start = torch.cumsum(per, 0) - per
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(bucket.numel(), device=pos.device) - start[bucket]
    tile = tile_start[bucket] + torch.div(rank, size, rounding_mode="floor")
    row = rank % size
    n_tiles = int(per.sum())
    pos_t = pos.new_zeros(n_tiles, size)
    pos_t[tile, row] = pos
    col_t = col.new_zeros(n_tiles, size)
    col_t[tile, row] = col
    present = torch.zeros(n_tiles, size, dtype=torch.bool, device=pos.device)
    present[tile, row] = True
    tile_bucket = torch.repeat_interleave(torch.arange(n_buckets, device=pos.device), per)
    b_t = b.new_zeros(n_tiles)
    b_t[tile] = b
    last = pos_t.gather(1, (present.sum(1, keepdim=True) - 1)).squeeze(1)
    return _Tiles(b, col, tile, row, pos_t, col_t, present, tile_bucket, b_t, pos_t[:, 0], last, size)


@dataclass
class _Class:
    """The work of one branch and head-offset class: query and key tiles, the pairs to compute, the heads."""

    branch: int  # index of the branch (the dropout stream); len(branches) for global tokens
    q: _Tiles
    k: _Tiles
    pair_q: torch.Tensor  # [pairs] query tile of each pair, sorted
    pair_k: torch.Tensor  # [pairs] key tile of each pair
    heads: torch.Tensor  # [KH, GQ] query heads: slot (kv, g) reads key/value head kv_heads[kv]
    kv_heads: torch.Tensor  # [KH]
    batches: dict = field(default_factory=dict)  # budget -> [(pair_q, pair_k, query tiles, index into them)]


def _head_slots(heads: list[int], group: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads as ``[KH, GQ]`` sharing one kv head per row (no K/V repeat), or ``[H, 1]`` when the class holds
    unequal numbers of heads of different kv heads."""
    by_kv: dict[int, list[int]] = {}
    for h in heads:
        by_kv.setdefault(h // group, []).append(h)
    if len({len(hs) for hs in by_kv.values()}) == 1:
        kv = sorted(by_kv)
        return torch.tensor([by_kv[j] for j in kv], device=device), torch.tensor(kv, device=device)
    return torch.tensor(heads, device=device)[:, None], torch.tensor([h // group for h in heads], device=device)


def _pairs(q: _Tiles, k: _Tiles, is_causal: bool, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query tile, the contiguous range of key tiles of its bucket that hold a key it may attend to."""
    dev = q.pos.device
    if q.n_tiles == 0 or k.n_tiles == 0:
        return torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, dtype=torch.long, device=dev)
    big = 4 * _SHIFT

    def sort_key(bucket, position):
        return bucket * big + position.clamp(-_SHIFT + 1, _SHIFT - 1) + 2 * _SHIFT

    hi_pos = q.last + (window - 1 if window is not None and not is_causal else 0)
    if is_causal or window is not None:
        hi = torch.searchsorted(sort_key(k.bucket, k.first), sort_key(q.bucket, hi_pos), right=True)
    else:
        hi = torch.searchsorted(k.bucket, q.bucket, right=True)
    if window is not None:
        lo = torch.searchsorted(sort_key(k.bucket, k.last), sort_key(q.bucket, q.first - window + 1))
    else:
        lo = torch.searchsorted(k.bucket, q.bucket)
    count = (hi - lo).clamp_min(0)
    pair_q = torch.repeat_interleave(torch.arange(q.n_tiles, device=dev), count)
    offset = torch.cumsum(count, 0) - count
    pair_k = lo[pair_q] + torch.arange(pair_q.numel(), device=dev) - offset[pair_q]
    return pair_q, pair_k


def _bucket_ids(keys: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Dense ids, in lexicographic order, of the ``[n, 3]`` bucket keys of several token sets together."""
    allk = torch.cat(keys)
    low = allk.amin(0)
    span = (allk.amax(0) - low + 1).tolist()
    if span[0] * span[1] * span[2] < 2**62:  # one int64 per key: a 1-D unique (a sort) instead of unique(dim=0)
        x = allk - low
        flat = (x[:, 0] * span[1] + x[:, 1]) * span[2] + x[:, 2]
        ids, inverse = torch.unique(flat, return_inverse=True)
    else:
        ids, inverse = torch.unique(allk, dim=0, return_inverse=True)
    return list(torch.split(inverse, [t.shape[0] for t in keys])), ids.shape[0]


_PLANS = _IdentityMemo(size=4)  # every layer of a forward shares the layout: build its plan (and host syncs) once


def _plan(layout: TokenLayout, branches, Hq: int, Hk: int, is_causal: bool, head_offset: int,
          window: int | None, global_tokens: int) -> list[_Class]:
    """:func:`_build_plan`, memoized on the identity of the layout's tensors and the other arguments."""
    tensors = (layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid)
    extra = (tuple(branches), Hq, Hk, bool(is_causal), head_offset, window, global_tokens)
    return _PLANS(lambda: _build_plan(layout, *extra), tensors, extra)


def _build_plan(layout: TokenLayout, branches, Hq: int, Hk: int, is_causal: bool, head_offset: int,
                window: int | None, global_tokens: int) -> list[_Class]:
    """Every branch class of one call (index tensors only, O(N) of them)."""
    group = Hq // Hk
    dev = layout.q_pos.device
    classes = []
    todo = [(i, w, r) for i, (w, r) in enumerate(branches)]
    if global_tokens:
        todo.append((len(branches), None, 1))
    for index, w, r in todo:
        for offset in range(r):
            heads = [h for h in range(Hq) if (h + head_offset) % r == offset]
            if not heads:
                continue
            if w is None:  # global tokens: every query, the keys at positions < g of its sequence
                qsel = layout.q_valid
                ksel = layout.k_valid & (layout.k_pos < global_tokens)
            else:
                qsel = layout.q_valid & (torch.remainder(layout.q_pos, r) == offset)
                ksel = layout.k_valid & (torch.remainder(layout.k_pos, r) == offset)
            qb, qn = qsel.nonzero(as_tuple=True)
            kb, kn = ksel.nonzero(as_tuple=True)
            if qb.numel() == 0 or kb.numel() == 0:
                continue
            qpos, kpos = layout.q_pos[qb, qn], layout.k_pos[kb, kn]
            if w is None:
                qseg, kseg = torch.zeros_like(qpos), torch.zeros_like(kpos)
            else:
                qseg = torch.div(qpos, w, rounding_mode="floor")
                kseg = torch.div(kpos, w, rounding_mode="floor")
            (qbucket, kbucket), n_buckets = _bucket_ids([
                torch.stack([qb, layout.q_seq[qb, qn], qseg], 1),
                torch.stack([kb, layout.k_seq[kb, kn], kseg], 1),
            ])
            qt = _tiles(qbucket, qpos, qb, qn, n_buckets)
            kt = _tiles(kbucket, kpos, kb, kn, n_buckets)
            pair_q, pair_k = _pairs(qt, kt, is_causal, window)
            if pair_q.numel() == 0:
                continue
            hslots, kvslots = _head_slots(heads, group, dev)
            classes.append(_Class(index, qt, kt, pair_q, pair_k, hslots, kvslots))
    return classes


def _batches(c: _Class, elements_per_pair: int, budget: int) -> list:
    """Consecutive slices of the pair list of at most ``budget`` scores each (at least one pair), with their distinct
    query tiles; kept with the (memoized) plan, so the loops of later calls and of the backward need no host sync."""
    if budget not in c.batches:
        step = max(1, budget // elements_per_pair)
        out = []
        for s in range(0, c.pair_q.numel(), step):
            pq, pk = c.pair_q[s : s + step], c.pair_k[s : s + step]
            out.append((pq, pk, *torch.unique_consecutive(pq, return_inverse=True)))
        c.batches[budget] = out
    return c.batches[budget]


def _allowed(c: _Class, pq: torch.Tensor, pk: torch.Tensor, is_causal: bool, window: int | None) -> torch.Tensor:
    """``[P, 1, 1, Tq, Tk]``: which (query row, key row) of each pair attend (same bucket by construction)."""
    qp = c.q.pos[pq][:, :, None]
    kp = c.k.pos[pk][:, None, :]
    allowed = c.k.present[pk][:, None, :].expand(-1, qp.shape[1], -1)
    if is_causal:
        allowed = allowed & (kp <= qp)
    if window is not None:
        allowed = allowed & ((qp - kp) < window) & ((kp - qp) < window)
    return allowed[:, None, None]


def _dropout_scale(c: _Class, pq, pk, p: float, seed: torch.Tensor, dtype) -> torch.Tensor:
    """``[P, KH, GQ, Tq, Tk]`` keep / (1 - p), or 0 where dropped: the draw of ``ops/dropout.py`` by tensor column."""
    keep = keep_mask(seed, p, c.branch, c.q.b_t[pq][:, None, None, None, None], c.heads[None, :, :, None, None],
                     c.q.col_t[pq][:, None, None, :, None], c.k.col_t[pk][:, None, None, None, :])
    return keep.to(dtype) * (1.0 / (1.0 - p))


def _gather_q(c: _Class, q: torch.Tensor, dtype) -> torch.Tensor:
    """Query rows of the class as tiles ``[tiles, KH, GQ * Tq, D]`` (zeros in empty rows)."""
    KH, GQ = c.heads.shape
    out = q.new_zeros(c.q.n_tiles, KH, GQ, c.q.size, q.shape[-1], dtype=dtype)
    out[c.q.tile, :, :, c.q.row] = q[c.q.b[:, None, None], c.heads[None], c.q.col[:, None, None]].to(dtype)
    return out.view(c.q.n_tiles, KH, GQ * c.q.size, q.shape[-1])


def _gather_k(c: _Class, k: torch.Tensor, dtype) -> torch.Tensor:
    """Key (or value) rows of the class as tiles ``[tiles, KH, Tk, D]``."""
    out = k.new_zeros(c.k.n_tiles, c.kv_heads.numel(), c.k.size, k.shape[-1], dtype=dtype)
    out[c.k.tile, :, c.k.row] = k[c.k.b[:, None], c.kv_heads[None], c.k.col[:, None]].to(dtype)
    return out


def _gather_qkv(c, q, k, v, tile_dtype, acc_dtype, scale):
    """One class's query, key and value tiles; float32 query tiles come pre-scaled (half ones are scaled in the
    float32 scores instead, so half q is not rounded twice)."""
    Q, K, V = _gather_q(c, q, tile_dtype), _gather_k(c, k, tile_dtype), _gather_k(c, v, tile_dtype)
    if tile_dtype == acc_dtype:
        Q.mul_(scale)
    return Q, K, V


def _gather_rows(c: _Class, x: torch.Tensor, fill: float) -> torch.Tensor:
    """A per-query-row tensor ``[B, Hq, Nq, *]`` as tiles ``[tiles, KH, GQ * Tq, *]`` (``fill`` in empty rows)."""
    KH, GQ = c.heads.shape
    out = x.new_full((c.q.n_tiles, KH, GQ, c.q.size, *x.shape[3:]), fill)
    out[c.q.tile, :, :, c.q.row] = x[c.q.b[:, None, None], c.heads[None], c.q.col[:, None, None]]
    return out.view(c.q.n_tiles, KH, GQ * c.q.size, *x.shape[3:])


def _token_index(c: _Class):
    return c.q.b[:, None, None], c.heads[None], c.q.col[:, None, None]


def _budget(q: torch.Tensor) -> int:
    """Scores per batch of tile pairs: bounded, and a fraction of q's size (so peak memory stays a few q's)."""
    return min(_MAX_BUDGET, max(_MIN_BUDGET, q.numel() // 2 if q.device.type == "cpu" else q.numel()))


_HALF = (torch.float16, torch.bfloat16)
_BMM_OUT_DTYPE = [True]  # whether torch.bmm(..., out_dtype=float32) works for half operands here (CUDA)


def _tensor_cores(a: torch.Tensor) -> bool:
    return a.is_cuda and _BMM_OUT_DTYPE[0]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (same leading dims) in float32 (float64 for float64): half operands are multiplied exactly and
    summed in float32, on the tensor cores where ``bmm(out_dtype=)`` exists (CUDA), else upcast first."""
    if a.dtype not in _HALF:
        return torch.matmul(a, b)
    if _tensor_cores(a):
        lead = a.shape[:-2]
        try:
            out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
            return out.view(*lead, a.shape[-2], b.shape[-1])
        except (RuntimeError, TypeError):
            _BMM_OUT_DTYPE[0] = False
    return torch.matmul(a.float(), b.float())


def _mm_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a float32 ``a`` and a half ``b`` without rounding ``a`` to half: its high and low halves on the
    tensor cores (CUDA), or float32 products elsewhere. For dS, whose terms cancel (dq of one key reached twice is 0)."""
    if b.dtype not in _HALF:
        return torch.matmul(a, b)
    if not _tensor_cores(a):
        return torch.matmul(a, b.float())
    hi = a.to(b.dtype)
    return _mm(hi, b) + _mm((a - hi.float()).to(b.dtype), b)


def _forward(q, k, v, classes: list[_Class], is_causal, scale, window, dropout_p, seed):
    """Merged ``(out, lse, m, log l)`` in the accumulation dtype: one online softmax over all classes' pairs
    (``lse = m + log l``; ``m`` is +inf on rows without keys)."""
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    tile_dtype = q.dtype if q.dtype in _HALF else acc_dtype  # half tiles: flash-attention precision, half the bytes
    m_all = q.new_full((B, Hq, Nq), -math.inf, dtype=acc_dtype)
    l_all = q.new_zeros(B, Hq, Nq, dtype=acc_dtype)
    acc_all = q.new_zeros(B, Hq, Nq, Dv, dtype=acc_dtype)
    budget = _budget(q)
    for c in classes:
        KH, GQ = c.heads.shape
        Tq, Tk = c.q.size, c.k.size
        Q, K, V = _gather_qkv(c, q, k, v, tile_dtype, acc_dtype, scale)
        m = Q.new_full((c.q.n_tiles, KH, GQ, Tq), -math.inf, dtype=acc_dtype)
        l = Q.new_zeros(c.q.n_tiles, KH, GQ, Tq, dtype=acc_dtype)
        acc = Q.new_zeros(c.q.n_tiles, KH, GQ, Tq, Dv, dtype=acc_dtype)
        for pq, pk, tiles, inv in _batches(c, KH * GQ * Tq * Tk, budget):
            P = pq.numel()
            s = _mm(Q[pq], K[pk].transpose(-1, -2)).view(P, KH, GQ, Tq, Tk)
            if tile_dtype != acc_dtype:
                s.mul_(scale)
            s.masked_fill_(~_allowed(c, pq, pk, is_causal, window), -math.inf)
            m_old = m[tiles]
            top = s.amax(-1)
            m_new = m_old.scatter_reduce(0, inv.view(-1, 1, 1, 1).expand_as(top), top, "amax", include_self=True)
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m_old - shift)
            s.sub_(shift[inv][..., None]).exp_()  # s is now p = exp(s - m), 0 where masked
            l[tiles] = (l[tiles] * alpha).index_add_(0, inv, s.sum(-1))
            if dropout_p:
                s.mul_(_dropout_scale(c, pq, pk, dropout_p, seed, s.dtype))
            pv = _mm(s.view(P, KH, GQ * Tq, Tk).to(tile_dtype), V[pk]).view(P, KH, GQ, Tq, Dv)
            acc[tiles] = (acc[tiles] * alpha[..., None]).index_add_(0, inv, pv)
            m[tiles] = m_new
        # Merge this class into the running state of its query rows (max-shifted, as between tiles).
        idx = _token_index(c)
        mt, lt, at = (x[c.q.tile, :, :, c.q.row] for x in (m, l, acc))
        mg = m_all[idx]
        top = torch.maximum(mg, mt)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        a, b = torch.exp(mg - shift), torch.exp(mt - shift)
        m_all[idx] = top
        l_all[idx] = l_all[idx] * a + lt * b
        acc_all[idx] = acc_all[idx] * a[..., None] + at * b[..., None]
    reached = l_all > 0
    safe = torch.where(reached, l_all, torch.ones_like(l_all))
    out = acc_all / safe[..., None]
    log_l = torch.log(safe)
    lse = torch.where(reached, m_all + log_l, torch.full_like(m_all, -math.inf))
    # The backward takes p = exp((s - m) - log l): exact where one key dominates (s = m), unlike exp(s - fp32(lse)).
    m_all = torch.where(reached, m_all, torch.full_like(m_all, math.inf))  # rows without keys: p = 0
    return out, lse, m_all, log_l


def _backward(dout, dlse, q, k, v, out, m, log_l, classes, is_causal, scale, window, dropout_p, seed):
    """Flash-attention backward of every class with the merged ``lse = m + log l`` and
    ``delta = rowsum(dO * O) - dL``."""
    acc_dtype = m.dtype
    tile_dtype = q.dtype if q.dtype in _HALF else acc_dtype
    # dS = P (dP - delta) cancels exactly where a query sees one key (dq = 0): in float32, dP and delta are formed in
    # float64 (tile-sized, cheap next to the matmuls), so that cancellation leaves no float32 rounding noise.
    diff_dtype = torch.float64 if acc_dtype == torch.float32 else acc_dtype
    delta = (dout.to(diff_dtype) * out.to(diff_dtype)).sum(-1)
    dout = dout.to(tile_dtype)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(m), dlse.to(diff_dtype), torch.zeros_like(delta))
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    budget = _budget(q)
    for c in classes:
        KH, GQ = c.heads.shape
        Tq, Tk = c.q.size, c.k.size
        Q, K, V = _gather_qkv(c, q, k, v, tile_dtype, acc_dtype, scale)
        M = _gather_rows(c, m, math.inf)  # empty rows: p = 0
        logL = _gather_rows(c, log_l, 0.0)
        Dl = _gather_rows(c, delta, 0.0)
        dO = _gather_rows(c, dout, 0.0)
        dQ, dK, dV = (torch.zeros_like(t, dtype=acc_dtype) for t in (Q, K, V))
        for pq, pk, _, _ in _batches(c, KH * GQ * Tq * Tk, budget):
            P = pq.numel()
            Qb, Kb, Vb, dOb = Q[pq], K[pk], V[pk], dO[pq]
            s = _mm(Qb, Kb.transpose(-1, -2)).view(P, KH, GQ, Tq, Tk)
            if tile_dtype != acc_dtype:
                s.mul_(scale)
            s.masked_fill_(~_allowed(c, pq, pk, is_causal, window), -math.inf)
            p = s.view(P, KH, GQ * Tq, Tk).sub_(M[pq][..., None]).sub_(logL[pq][..., None]).exp_()
            dp = _mm(dOb, Vb.transpose(-1, -2)) if diff_dtype == acc_dtype else dOb.to(diff_dtype) @ Vb.to(
                diff_dtype).transpose(-1, -2)
            if dropout_p:
                z = _dropout_scale(c, pq, pk, dropout_p, seed, p.dtype).view(P, KH, GQ * Tq, Tk)
                dV.index_add_(0, pk, _mm((p * z).to(tile_dtype).transpose(-1, -2), dOb))
                dp.mul_(z)
                del z
            else:
                dV.index_add_(0, pk, _mm(p.to(tile_dtype).transpose(-1, -2), dOb))
            ds = dp.sub_(Dl[pq][..., None]).mul_(p).to(acc_dtype)
            del p
            dQ.index_add_(0, pq, _mm_exact(ds, Kb))
            dK.index_add_(0, pk, _mm_exact(ds.transpose(-1, -2), Qb))
        dQ = dQ.view(c.q.n_tiles, KH, GQ, Tq, -1)
        if tile_dtype != acc_dtype:
            dK.mul_(scale)  # q was not pre-scaled
        dq.index_put_(_token_index(c), dQ[c.q.tile, :, :, c.q.row] * scale, accumulate=True)
        kidx = (c.k.b[:, None], c.kv_heads[None], c.k.col[:, None])
        dk.index_put_(kidx, dK[c.k.tile, :, c.k.row], accumulate=True)
        dv.index_put_(kidx, dV[c.k.tile, :, c.k.row], accumulate=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _DilatedAttention(torch.autograd.Function):
    """Forward and exact backward of the reference; saves q, k, v, the output and the lse (O(N))."""

    @staticmethod
    def forward(q, k, v, classes, is_causal, scale, window, dropout_p, seed):
        return _forward(q, k, v, classes, is_causal, scale, window, dropout_p, seed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, classes, is_causal, scale, window, dropout_p, seed = inputs
        out, lse, m, log_l = output
        ctx.mark_non_differentiable(m, log_l)
        ctx.save_for_backward(q, k, v, out, m, log_l)
        ctx.params = (classes, is_causal, scale, window, dropout_p, seed)
        ctx.set_materialize_grads(False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse, _dm, _dlog_l):
        q, k, v, out, m, log_l = ctx.saved_tensors
        classes, is_causal, scale, window, dropout_p, seed = ctx.params
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(dout, dlse, q, k, v, out, m, log_l, classes, is_causal, scale, window, dropout_p, seed)
        return dq, dk, dv, None, None, None, None, None, None


def _check_options(window, global_tokens, dropout_p, seed) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
        raise ValueError(f"global_tokens must be a non-negative int, got {global_tokens!r}")
    keep_threshold(dropout_p)  # raises for p outside [0, 1)
    if dropout_p and (not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.is_floating_point()):
        raise ValueError(f"dropout_p > 0 needs seed, an integer scalar tensor, got {seed!r}")


def _merge_by_lse(out_a, lse_a, out_b, lse_b, valid):
    """Two branch sets' ``(out, lse)`` merged as SPEC's branches are (differentiable). Every valid query has finite
    lse in both (the fused set has an ``r = 1`` branch, the global one the key at position 0); padding rows get 0 and
    -inf, without NaN in the gradient."""
    rows = valid[:, None, :].to(lse_a.device)
    a, b = (torch.where(rows, x, torch.zeros_like(x)) for x in (lse_a, lse_b))
    lse = torch.logaddexp(a, b)
    out = out_a.float() * torch.exp(a - lse)[..., None] + out_b.float() * torch.exp(b - lse)[..., None]
    out = torch.where(rows[..., None], out, torch.zeros_like(out))
    return out.to(out_a.dtype), torch.where(rows, lse, torch.full_like(lse, -math.inf))


_LAST_PATH = ["", ""]  # (path, why the fused one was not taken) of the last call


def last_path() -> tuple[str, str]:
    """``("fused_buckets", "")`` or ``("tiled", reason)``: the path the last reference call took, and why."""
    return _LAST_PATH[0], _LAST_PATH[1]


def dilated_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    layout: TokenLayout,
    is_causal: bool,
    scale: float,
    head_offset: int = 0,
    *,
    window: int | None = None,
    global_tokens: int = 0,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention per SPEC.md. Returns ``(out [B, Hq, Nq, Dv] in query.dtype, lse [B, Hq, Nq])``.

    The lse is float32 (float64 for float64 inputs); rows that attend nowhere (padding) give 0 and lse -inf.
    ``window``: sliding window over positions (every branch); ``global_tokens``: SPEC's global branch;
    ``dropout_p`` with ``seed`` (an int64 scalar tensor): SPEC's dropout. Differentiable w.r.t. query, key, value,
    also through the lse. Plain layouts run on the fused kernels (:mod:`.fused_buckets`), the rest tiled.
    """
    _check_options(window, global_tokens, dropout_p, seed)
    why, valid, shift = fused_buckets.route(query, key, value, layout, bool(is_causal), window=window,
                                            dropout_p=float(dropout_p))
    if why is None:
        _LAST_PATH[:] = ["fused_buckets", ""]
        out, lse = fused_buckets.bucketed_attention(query, key, value, branches, bool(is_causal), float(scale),
                                                    head_offset, valid, shift)
        if global_tokens:  # SPEC's global branch, tiled (each query sees g keys), merged like any branch
            g_out, g_lse = tiled_attention_reference(query, key, value, (), layout, is_causal, scale, head_offset,
                                                     global_tokens=global_tokens)
            out, lse = _merge_by_lse(out, lse, g_out, g_lse, layout.q_valid)
        return out, lse
    _LAST_PATH[:] = ["tiled", why]
    return tiled_attention_reference(query, key, value, branches, layout, is_causal, scale, head_offset,
                                     window=window, global_tokens=global_tokens, dropout_p=dropout_p, seed=seed)


def tiled_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    branches: tuple[tuple[int, int], ...],
    layout: TokenLayout,
    is_causal: bool,
    scale: float,
    head_offset: int = 0,
    *,
    window: int | None = None,
    global_tokens: int = 0,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dilated_attention_reference` on the tiled path, whatever the layout: every case, any dtype."""
    _check_options(window, global_tokens, dropout_p, seed)
    dropout_p = float(dropout_p)
    if dropout_p:
        seed = seed.reshape(()).to(device=query.device, dtype=torch.int64)
    classes = _plan(layout, branches, query.shape[1], key.shape[1], is_causal, head_offset, window, global_tokens)
    out, lse, _, _ = _DilatedAttention.apply(query, key, value, classes, bool(is_causal), float(scale), window,
                                             dropout_p, seed)
    return out.to(query.dtype), lse
