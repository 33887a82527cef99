"""Block-sparse attention kernels over a compact layout (``ops/block_sparse/layout.py``) and their launchers.

- forward: one program per (tile of ``BLOCK_M`` query columns, query head, batch row). It reads its query block's
  active key blocks from ``kv_index`` and runs one online softmax over all of them (exactly one softmax per query),
  then writes the output and the log-sum-exp. Queries sit at key columns ``q_offset + row``; decoding (``Nq < Nk``)
  is the same kernel with ``q_offset = Nk - Nq`` and small query tiles.
- dq: the same walk, flash-attention's ``dS = P (dO V^T - delta)``.
- dk / dv: one program per (tile of ``BLOCK_N`` key columns, kv head, batch row); it walks the transposed layout (the
  query blocks that read its key block) for every query head of its GQA group, so K / V are never repeated and each
  key row is written by one program (no atomics, deterministic). On sm_90 the same contract runs as a Gluon kernel
  (``block_sparse_hopper.py``: K / V held in shared memory, asynchronous ``wgmma``; bit-identical gradients) where
  it applies.

Masks inside tiles, per token: ``CONTIG`` (no padding, one sequence, keys at positions ``0..Nk-1``) masks by column
only, and when causal skips tiles wholly above the diagonal; otherwise positions, sequence ids and key validity are
loaded per tile (causal ``p' <= p``, same sequence, no padding). A query with no key gets output 0 and lse ``-inf``.
"""

from __future__ import annotations

import collections

import torch
import triton
import triton.language as tl

from . import block_sparse_hopper, relaunch
from .configs import _hopper, descriptor_scratch, dot_mode, interpreting, small_shared_memory, use_tma
from .launch import _constant, cdiv, forked, row_deltas, rowmajor
from .tiles import LOG2E, LOG2E_F, finish, mm, row_desc, softmax_step

# Kernel launches by name; tests read it to assert that the kernels (not a fallback) ran.
LAUNCHES: collections.Counter = collections.Counter()


@triton.jit
def _key_ok(qc, qp, qs, qv, kc, KPOS, KSEQ, KOK, kbase, Nk, IS_CAUSAL: tl.constexpr, CONTIG: tl.constexpr,
            TRANS: tl.constexpr = False):
    """Which keys (columns ``kc``) each query (columns ``qc``, valid ``qv``) may attend: ``[BLOCK_M, BLOCK_N]`` bool,
    or ``[BLOCK_N, BLOCK_M]`` with ``TRANS`` (built in that orientation, no transpose of a bool tile)."""
    kmask = kc < Nk
    if CONTIG:
        kp = kc
        kv = kmask
        ks = kc * 0
    else:
        kp = tl.load(KPOS + kbase + kc, mask=kmask, other=0)
        ks = tl.load(KSEQ + kbase + kc, mask=kmask, other=-2)
        kv = (tl.load(KOK + kbase + kc, mask=kmask, other=0) != 0) & kmask
        ks = tl.where(kv, ks, -2)
    if TRANS:
        ok = kv[:, None] & qv[None, :] & (ks[:, None] == qs[None, :])
        if IS_CAUSAL:
            ok = ok & (kp[:, None] <= qp[None, :])
    else:
        ok = kv[None, :] & qv[:, None] & (ks[None, :] == qs[:, None])
        if IS_CAUSAL:
            ok = ok & (kp[None, :] <= qp[:, None])
    return ok


@triton.jit
def _edge(k0, q0, q_whole, Nk, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, CONTIG: tl.constexpr):
    """Whether the tile (keys from column ``k0``, queries from ``q0``) needs its mask. Contiguous layouts skip it for
    interior tiles: every row a query, every key real and, when causal, every key before every query."""
    if CONTIG:
        edge = (k0 + BLOCK_N > Nk) | (q_whole == 0)
        if IS_CAUSAL:
            edge = edge | (k0 + BLOCK_N - 1 > q0)
    else:
        edge = k0 >= 0  # always true: masks come from per-token data
    return edge


@triton.jit
def _query_cols(q0, q_offset, Nq, BLOCK_M: tl.constexpr):
    """The columns of the query tile starting at column ``q0``: ``(columns, query rows, in range)`` (queries are the
    last ``Nq`` of the key columns: row = column - ``q_offset``)."""
    qc = q0 + tl.arange(0, BLOCK_M)
    qr = qc - q_offset
    return qc, qr, (qr >= 0) & (qr < Nq)


@triton.jit
def _query_meta(QPOS, QSEQ, QOK, qbase, qr, qc, qmask, CONTIG: tl.constexpr):
    """Positions, sequence ids and validity of a query tile (rows outside the queries are invalid)."""
    if CONTIG:
        qp = qc
        qs = qc * 0
        qv = qmask
    else:
        qp = tl.load(QPOS + qbase + qr, mask=qmask, other=0)
        qs = tl.load(QSEQ + qbase + qr, mask=qmask, other=0)
        qv = tl.load(QOK + qbase + qr, mask=qmask, other=0) != 0
    return qp, qs, qv


@triton.jit
def _query_tile(tile0, IS_CAUSAL: tl.constexpr):
    """This program's query tile: under causal attention last-first, so that the tiles with the most active key blocks
    (late in the sequence) start first and the launch ends on light ones (longest-first scheduling)."""
    if IS_CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0) + tile0
    return tl.program_id(0) + tile0


@triton.jit
def _key_tile(kv_heads, batch):
    """``(key tile, kv head, batch row)`` of a dK/dV program on a 1-D grid with the key tile slowest: every head's
    first key tiles start in the first wave. They are the longest programs (causal: the most queries; the sink block:
    every query); with the key tile fastest (a grid of key tiles x heads), a late head's sink tile started near the
    end and ran on alone."""
    pid = tl.program_id(0)
    rows = kv_heads * batch
    rest = pid % rows
    return pid // rows, rest % kv_heads, (rest // kv_heads).to(tl.int64)


@triton.jit
def bs_fwd_kernel(
    Q, K, V, O, L, CNT, IDX, QPOS, QSEQ, QOK, KPOS, KSEQ, KOK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
    Nq, Nk, q_offset, tile0, group, ratio, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CONTIG: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    t = _query_tile(tile0, IS_CAUSAL)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qc, qr, qmask = _query_cols(t * BLOCK_M, q_offset, Nq, BLOCK_M)
    qp, qs, qv = _query_meta(QPOS, QSEQ, QOK, b * Nq, qr, qc, qmask, CONTIG)
    i = (t * BLOCK_M) // BLOCK
    lh = h // ratio
    kvh = (h // group).to(tl.int64)
    h64 = h.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if TMA:  # q_offset == 0; rows past Nq come back as zeros
        q = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM).load([t * BLOCK_M, 0])
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM)
    else:
        q = tl.load(Q + b * stride_qb + h64 * stride_qh + qr.to(tl.int64)[:, None] * stride_qn + d[None, :],
                    mask=qmask[:, None], other=0.0)
    cnt = tl.load(CNT + b * stride_cb + lh * stride_ch + i)
    idx_row = IDX + b * stride_ib + lh * stride_ih + i * stride_iq
    q_first = t * BLOCK_M
    q_whole = (q_first >= q_offset) & (q_first + BLOCK_M <= Nk)  # every row of the tile is a query
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    cols = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(0, cnt * (BLOCK // BLOCK_N)):
        k0 = tl.load(idx_row + s // (BLOCK // BLOCK_N)) * BLOCK + (s % (BLOCK // BLOCK_N)) * BLOCK_N
        kc = k0 + cols
        kmask = kc < Nk
        kc64 = kc.to(tl.int64)[:, None]
        if TMA:
            k = k_desc.load([k0, 0])
        else:
            k = tl.load(k_row + kc64 * stride_kn, mask=kmask[:, None], other=0.0)
        qk = mm(q, tl.trans(k), UPCAST)
        if _edge(k0, q_first, q_whole, Nk, BLOCK_N, IS_CAUSAL, CONTIG):
            ok = _key_ok(qc, qp, qs, qv, kc, KPOS, KSEQ, KOK, b * Nk, Nk, IS_CAUSAL, CONTIG)
            qk = tl.where(ok, qk, float("-inf"))
        if TMA:
            v = v_desc.load([k0, 0])
        else:
            v = tl.load(v_row + kc64 * stride_vn, mask=kmask[:, None], other=0.0)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, qk_scale, v, qc, kc, 0, 1.0, False, UPCAST)
    out, lse = finish(acc, l_i, m_i)
    qr64 = qr.to(tl.int64)
    tl.store(O + b * stride_ob + h64 * stride_oh + qr64[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=qmask[:, None])
    tl.store(L + b * stride_lb + h64 * stride_lh + qr64, lse, mask=qmask)


@triton.jit
def bs_bwd_dq_kernel(
    Q, K, V, DO, L, Delta, DQ, CNT, IDX, QPOS, QSEQ, QOK, KPOS, KSEQ, KOK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
    Nq, Nk, q_offset, tile0, group, ratio, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CONTIG: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    t = tl.program_id(0) + tile0  # last-first measured 6% slower at 64K (benchmarks/NOTES_triton.md)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qc, qr, qmask = _query_cols(t * BLOCK_M, q_offset, Nq, BLOCK_M)
    qp, qs, qv = _query_meta(QPOS, QSEQ, QOK, b * Nq, qr, qc, qmask, CONTIG)
    i = (t * BLOCK_M) // BLOCK
    lh = h // ratio
    kvh = (h // group).to(tl.int64)
    h64 = h.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    qr64 = qr.to(tl.int64)
    if TMA:  # q_offset == 0; rows past Nq come back as zeros
        q = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM).load([t * BLOCK_M, 0])
        do = row_desc(DO + b * stride_db + h64 * stride_dh, Nq, stride_dn, BLOCK_M, HEAD_DIM).load([t * BLOCK_M, 0])
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM)
    else:
        q = tl.load(Q + b * stride_qb + h64 * stride_qh + qr64[:, None] * stride_qn + d[None, :],
                    mask=qmask[:, None], other=0.0)
        do = tl.load(DO + b * stride_db + h64 * stride_dh + qr64[:, None] * stride_dn + d[None, :],
                     mask=qmask[:, None], other=0.0)
    lse = tl.load(L + b * stride_lb + h64 * stride_lh + qr64, mask=qmask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta = tl.load(Delta + b * stride_lb + h64 * stride_lh + qr64, mask=qmask, other=0.0)
    cnt = tl.load(CNT + b * stride_cb + lh * stride_ch + i)
    idx_row = IDX + b * stride_ib + lh * stride_ih + i * stride_iq
    q_first = t * BLOCK_M
    q_whole = (q_first >= q_offset) & (q_first + BLOCK_M <= Nk)  # every row of the tile is a query
    k_row = K + b * stride_kb + kvh * stride_kh + d[None, :]
    v_row = V + b * stride_vb + kvh * stride_vh + d[None, :]
    cols = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(0, cnt * (BLOCK // BLOCK_N)):
        k0 = tl.load(idx_row + s // (BLOCK // BLOCK_N)) * BLOCK + (s % (BLOCK // BLOCK_N)) * BLOCK_N
        kc = k0 + cols
        kmask = kc < Nk
        kc64 = kc.to(tl.int64)[:, None]
        if TMA:
            k = k_desc.load([k0, 0])
            v = v_desc.load([k0, 0])
        else:
            k = tl.load(k_row + kc64 * stride_kn, mask=kmask[:, None], other=0.0)
            v = tl.load(v_row + kc64 * stride_vn, mask=kmask[:, None], other=0.0)
        qk = mm(q, tl.trans(k), UPCAST)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if _edge(k0, q_first, q_whole, Nk, BLOCK_N, IS_CAUSAL, CONTIG):
            ok = _key_ok(qc, qp, qs, qv, kc, KPOS, KSEQ, KOK, b * Nk, Nk, IS_CAUSAL, CONTIG)
            p = tl.where(ok, p, 0.0)
        dp = mm(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, UPCAST)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h64 * stride_dqh + qr64[:, None] * stride_dqn + d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qmask[:, None])


@triton.jit
def bs_bwd_dkdv_kernel(
    Q, K, V, DO, L, Delta, DK, DV, QPTR, QIDX, QPOS, QSEQ, QOK, KPOS, KSEQ, KOK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_cb, stride_ch, stride_ib, stride_ih,
    Nq, Nk, kv_heads, batch, q_offset, group, ratio, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CONTIG: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    kt, kvh, b = _key_tile(kv_heads, batch)
    k_first = kt * BLOCK_N
    kc = k_first + tl.arange(0, BLOCK_N)
    kmask = kc < Nk
    j = k_first // BLOCK
    d = tl.arange(0, HEAD_DIM)
    kvh64 = kvh.to(tl.int64)
    kc64 = kc.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + kvh64 * stride_kh + kc64 * stride_kn + d[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + kvh64 * stride_vh + kc64 * stride_vn + d[None, :], mask=kmask[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_M)
    for g in range(0, group):
        h = kvh * group + g
        h64 = h.to(tl.int64)
        lh = h // ratio
        ptr = QPTR + b * stride_cb + lh * stride_ch + j
        p0 = tl.load(ptr)
        cnt = tl.load(ptr + 1) - p0
        idx_row = QIDX + b * stride_ib + lh * stride_ih + p0
        q_row = Q + b * stride_qb + h64 * stride_qh + d[None, :]
        do_row = DO + b * stride_db + h64 * stride_dh + d[None, :]
        l_row = L + b * stride_lb + h64 * stride_lh
        dl_row = Delta + b * stride_lb + h64 * stride_lh
        if TMA:  # q_offset == 0
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM)
            do_desc = row_desc(DO + b * stride_db + h64 * stride_dh, Nq, stride_dn, BLOCK_M, HEAD_DIM)
        for s in range(0, cnt * (BLOCK // BLOCK_M)):
            q0 = tl.load(idx_row + s // (BLOCK // BLOCK_M)) * BLOCK + (s % (BLOCK // BLOCK_M)) * BLOCK_M
            qc = q0 + rows
            qr = qc - q_offset
            qmask = (qr >= 0) & (qr < Nq)
            qr64 = qr.to(tl.int64)
            if TMA:
                q = q_desc.load([q0, 0])
                do = do_desc.load([q0, 0])
            else:
                q = tl.load(q_row + qr64[:, None] * stride_qn, mask=qmask[:, None], other=0.0)
                do = tl.load(do_row + qr64[:, None] * stride_dn, mask=qmask[:, None], other=0.0)
            lse = tl.load(l_row + qr64, mask=qmask, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
            delta = tl.load(dl_row + qr64, mask=qmask, other=0.0)
            qkT = mm(k, tl.trans(q), UPCAST)
            pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
            q_whole = (q0 >= q_offset) & (q0 + BLOCK_M <= Nk)
            if _edge(k_first, q0, q_whole, Nk, BLOCK_N, IS_CAUSAL, CONTIG):
                qp, qs, qv = _query_meta(QPOS, QSEQ, QOK, b * Nq, qr, qc, qmask, CONTIG)
                ok = _key_ok(qc, qp, qs, qv, kc, KPOS, KSEQ, KOK, b * Nk, Nk, IS_CAUSAL, CONTIG, True)
                pT = tl.where(ok, pT, 0.0)
            dv += mm(pT.to(do.dtype), do, UPCAST)
            dpT = mm(v, tl.trans(do), UPCAST)
            dsT = pT * (dpT - delta[None, :])
            dk += mm(dsT.to(q.dtype), q, UPCAST)
    dk = dk * scale
    tl.store(DK + b * stride_dkb + kvh64 * stride_dkh + kc64 * stride_dkn + d[None, :],
             dk.to(DK.dtype.element_ty), mask=kmask[:, None])
    tl.store(DV + b * stride_dvb + kvh64 * stride_dvh + kc64 * stride_dvn + d[None, :],
             dv.to(DV.dtype.element_ty), mask=kmask[:, None])


# ---- launchers -------------------------------------------------------------------------------------------------------


def _fwd_config(block: int, d: int, dtype: torch.dtype, nq: int, tma: bool = False) -> dict:
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if nq <= 16:  # decoding: a few queries per program
        return dict(BLOCK_M=16, BLOCK_N=min(block, 64), num_warps=4, num_stages=2)
    wide = dtype == torch.float32 or d > 128
    if tma and not wide:  # benchmarks/tune_block_sparse.py, H100, the bench layout (tune_block_sparse_fwd-*.json):
        # up to 16K queries 64-row tiles, 0.799 against 0.827 ms for 128 x 128 at 16K; above, 128 x 128: 3.69 against
        # 3.90 ms at 64K, 15.6 against 17.8 at 256K (32K not swept; the benchmark's 32K row runs 128 x 128).
        m = n = min(block, 64 if nq <= 16384 else 128)
        return dict(BLOCK_M=m, BLOCK_N=n, num_warps=8 if m * n >= 16384 else 4, num_stages=3)
    m = min(block, 64 if wide else 128)
    n = min(block, 32 if wide else 64)
    cfg = dict(BLOCK_M=m, BLOCK_N=n, num_warps=8 if m * n >= 8192 else 4, num_stages=2 if wide else 3)
    return _fit_small_shared_memory("fwd", cfg, block, d, dtype) if small_shared_memory() else cfg


def _bwd_config(block: int, d: int, dtype: torch.dtype, tma: bool = False) -> tuple[dict, dict]:
    """(dq config, dk/dv config)."""
    if interpreting():
        c = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
        return c, dict(c)
    wide = dtype == torch.float32 or d > 128
    if _hopper() and not wide:  # benchmarks/tune_block_sparse.py, H100, 64K: backward 16.3 ms, 25.4 with (64, 64, 8, 2)
        # (that one serialized, below). 64-blocks: 64 x 64 tiles on one warpgroup, two stages (96 KB: two programs
        # per SM). On two warpgroups ptxas serialized every product of the kernel (`kernel_resources.py`, column
        # "wgmma"; Triton 3.6 and 3.9): the backward ran 1.44 / 1.54 / 1.20x faster with this at 64K (H 16 D 128 /
        # GQA 32/8 / 9/3 D 64, H100, round 2 session 21), 1.36x with three stages (128 KB, one program per SM)
        dq = (dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3) if block >= 128
              else dict(BLOCK_M=block, BLOCK_N=block, num_warps=4, num_stages=2))
    else:
        dq = dict(BLOCK_M=min(block, 64), BLOCK_N=min(block, 32 if wide else 64), num_warps=4 if wide else 8,
                  num_stages=1 if wide else 2)
    if tma and not wide:  # the same sweep with TMA loads: backward 13.4 ms, 14.4 with (64, 128, 8, 2)
        dkdv = dict(BLOCK_M=min(block, 32), BLOCK_N=min(block, 64), num_warps=4, num_stages=3)
    elif dtype == torch.float32:
        if d > 128:  # 32 x 64 tiles needed 320 KB of shared memory at head dim 256, more than any GPU has (an
            # OutOfResources on the H100); 16 x 32 on 8 warps: 144 KB
            dkdv = dict(BLOCK_M=min(block, 16), BLOCK_N=min(block, 32), num_warps=8, num_stages=1)
        else:  # (16 x 32 on 8 warps spills 20 bytes here instead of 2 KB, but ran 0.76x at D 128)
            dkdv = dict(BLOCK_M=min(block, 32), BLOCK_N=min(block, 64), num_warps=4, num_stages=1)
    elif wide:  # head dim 256: 64 keys of dK and dV over 8 warps; on 4 they spilled 2 KB and ptxas serialized the
        # products: backward 2.67 / 2.82x faster at 16K / 64K (8 / 2 heads, H100, round 2 session 21)
        dkdv = dict(BLOCK_M=min(block, 32), BLOCK_N=min(block, 64), num_warps=8, num_stages=1)
    else:
        dkdv = dict(BLOCK_M=min(block, 64), BLOCK_N=min(block, 128), num_warps=8, num_stages=2)
    if small_shared_memory():
        dq = _fit_small_shared_memory("dq", dq, block, d, dtype)
        dkdv = _fit_small_shared_memory("dkdv", dkdv, block, d, dtype)
    return dq, dkdv


def _fit_small_shared_memory(kernel: str, cfg: dict, block: int, d: int, dtype: torch.dtype) -> dict:
    """``cfg`` for a GPU with about 100 KB of shared memory per program (``configs.small_shared_memory``), where these
    asked for 112-288 KB: fewer stages, or smaller tiles for float32 and head dim 256. Each fits sm_86 / 89 / 120
    (``benchmarks/kernel_resources.py --arch 89``); not timed (no such GPU was at hand)."""
    f32, d256 = dtype == torch.float32, d > 128
    if kernel == "fwd":
        if f32:  # 64 x 32 tiles, two stages: 112 KB at head dim 128
            return dict(BLOCK_M=min(block, 32 if d256 else 64), BLOCK_N=min(block, 32), num_warps=4, num_stages=1)
        return dict(cfg, num_stages=min(cfg["num_stages"], 2))  # 128 x 64 tiles, three stages: 112 KB
    if kernel == "dq":
        if f32:  # 64 x 32 tiles: 144 KB at head dim 128, 288 KB at 256
            return dict(BLOCK_M=min(block, 16), BLOCK_N=min(block, 32), num_warps=4, num_stages=1)
        return cfg
    if f32:  # dK/dV: 32 x 64 tiles needed 160 KB at head dim 128
        return (dict(BLOCK_M=min(block, 16), BLOCK_N=min(block, 16), num_warps=4, num_stages=1) if d256
                else dict(BLOCK_M=min(block, 16), BLOCK_N=min(block, 32), num_warps=8, num_stages=1))
    if d256:  # 32 x 64 tiles: 112 KB
        return dict(BLOCK_M=min(block, 32), BLOCK_N=min(block, 32), num_warps=8, num_stages=1)
    return cfg


def _tma(tensors, q_offset: int) -> bool:
    """Whether the kernels read Q/K/V (and dO) through tensor descriptors: where ``use_tma`` allows it and queries
    and keys are the same rows (``q_offset == 0``; decoding keeps pointer loads)."""
    if q_offset != 0 or not use_tma(tensors, False, False):
        return False
    descriptor_scratch(tensors[0].device)
    LAUNCHES["tma"] += 1
    return True


def _layout_strides(count: torch.Tensor, index: torch.Tensor, batch: int):
    """Strides of ``count [L, Hl, n]`` and ``index [L, Hl, n, A]`` (or the flat ``[L, Hl, E]`` of the transpose,
    without the last); a shared batch (``L == 1``) gets stride 0."""
    cb = count.stride(0) if count.shape[0] == batch and batch > 1 else 0
    ib = index.stride(0) if index.shape[0] == batch and batch > 1 else 0
    return (cb, count.stride(1), ib, index.stride(1)) + ((index.stride(2),) if index.ndim == 4 else ())


def _meta(tokens, contiguous):
    """Per-token tensors for the kernels (contiguous int32 / int8); on a contiguous layout one-element placeholders of
    the same dtypes, made once per device (the kernels mask by column there and read none of them: six conversion
    kernels fewer per call)."""
    q_pos, q_seq, q_valid, k_pos, k_seq, k_valid = tokens
    if contiguous:
        dev = q_pos.device
        i32 = _constant("int32", dev, lambda: torch.zeros(1, dtype=torch.int32, device=dev))
        i8 = _constant("int8", dev, lambda: torch.zeros(1, dtype=torch.int8, device=dev))
        return i32, i32, i8, i32, i32, i8
    conv = lambda t, dt: t.to(dt).contiguous()  # noqa: E731
    return (conv(q_pos, torch.int32), conv(q_seq, torch.int32), conv(q_valid, torch.int8),
            conv(k_pos, torch.int32), conv(k_seq, torch.int32), conv(k_valid, torch.int8))


def forward(q, k, v, kv_count, kv_index, tokens, block: int, contiguous: bool, is_causal: bool, scale: float):
    """``(out [B, H, Nq, D] in q's dtype, lse [B, H, Nq] float32)``; ``tokens`` = (q_pos, q_seq, q_valid, k_pos,
    k_seq, k_valid) as ``[B, N]`` tensors on q's device."""
    q, k, v = rowmajor(q), rowmajor(k), rowmajor(v)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o = torch.empty(B, H, Nq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    if Nq == 0:
        return o, lse
    q_offset = Nk - Nq
    tma = _tma((q, k, v), q_offset)
    if block_sparse_hopper.ws_applies(q, block, q_offset, tma, contiguous):  # Gluon, sm_90, warp-specialized
        relaunch.run(block_sparse_hopper.bs_fwd_ws_kernel, (cdiv(Nq, block), H, B),
            q, k, v, o, lse, kv_count, kv_index,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
            *_layout_strides(kv_count, kv_index, B),
            Nq, Nk, H // k.shape[1], H // kv_index.shape[1], scale * LOG2E_F,
            HEAD_DIM=D, BLOCK=block, IS_CAUSAL=is_causal, **block_sparse_hopper.ws_forward_config(),
        )
        LAUNCHES["forward"] += 1
        LAUNCHES["forward_ws"] += 1
        return o, lse
    if block_sparse_hopper.forward_applies(q, block, q_offset, tma, contiguous):  # Gluon, sm_90
        hcfg = block_sparse_hopper.forward_config(block, D)
        relaunch.run(block_sparse_hopper.bs_fwd_hopper_kernel, (cdiv(Nq, hcfg["BLOCK_M"]), H, B),
            q, k, v, o, lse, kv_count, kv_index,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
            *_layout_strides(kv_count, kv_index, B),
            Nq, Nk, H // k.shape[1], H // kv_index.shape[1], scale * LOG2E_F,
            HEAD_DIM=D, BLOCK=block, IS_CAUSAL=is_causal, **hcfg,
        )
        LAUNCHES["forward"] += 1
        LAUNCHES["forward_hopper"] += 1
        return o, lse
    cfg = _fwd_config(block, D, q.dtype, Nq, tma)
    tile0 = q_offset // cfg["BLOCK_M"]
    grid = (cdiv(Nk, cfg["BLOCK_M"]) - tile0, H, B)
    meta = _meta(tokens, contiguous)
    relaunch.run(bs_fwd_kernel, grid,
        q, k, v, o, lse, kv_count, kv_index, *meta,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        *_layout_strides(kv_count, kv_index, B),
        Nq, Nk, q_offset, tile0, H // k.shape[1], H // kv_index.shape[1], scale * LOG2E_F,
        HEAD_DIM=D, BLOCK=block, IS_CAUSAL=is_causal, CONTIG=contiguous, UPCAST=dot_mode(q.dtype), TMA=tma, **cfg,
    )
    LAUNCHES["forward"] += 1
    return o, lse


def backward(do, q, k, v, o, lse, kv_count, kv_index, q_ptr, q_flat, tokens, block: int, contiguous: bool,
             is_causal: bool, scale: float, dlse=None):
    """``(dq, dk, dv)`` in the dtypes of q, k, v; a gradient ``dlse`` on the lse enters as ``delta - dlse``.
    ``q_ptr, q_flat``: the layout's transpose in CSR form (``BlockLayout.transposed``)."""
    q, k, v, o, do = (rowmajor(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    B, H, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if Nq == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = row_deltas(o, do, dlse)
    meta = _meta(tokens, contiguous)
    q_offset = Nk - Nq
    tma = _tma((q, k, v, do), q_offset)
    q_cfg, kv_cfg = _bwd_config(block, D, q.dtype, tma)
    group, ratio = H // Hk, H // kv_index.shape[1]
    common = dict(HEAD_DIM=D, BLOCK=block, IS_CAUSAL=is_causal, CONTIG=contiguous)
    portable = dict(common, UPCAST=dot_mode(q.dtype), TMA=tma)
    tile0 = q_offset // q_cfg["BLOCK_M"]
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, q_ptr, q_flat, *meta,
                 *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
                 *dk.stride()[:3], *dv.stride()[:3], *_layout_strides(q_ptr, q_flat, B), Nq, Nk, Hk, B)
    with forked(q.device) as beside:  # dK / dV on the current stream, dQ beside it (no order between them)
        if block_sparse_hopper.applies(q, block, q_offset, tma):  # Gluon, sm_90
            hopper = block_sparse_hopper.launch_config()
            relaunch.run(block_sparse_hopper.bs_bwd_dkdv_hopper_kernel, (cdiv(Nk, hopper["BLOCK_N"]) * Hk * B,),
                *dkdv_args, group, ratio, scale, scale * LOG2E_F, **common, **hopper,
            )
            LAUNCHES["dkdv_hopper"] += 1
        else:
            relaunch.run(bs_bwd_dkdv_kernel, (cdiv(Nk, kv_cfg["BLOCK_N"]) * Hk * B,),
                *dkdv_args, q_offset, group, ratio, scale, scale * LOG2E_F, **portable, **kv_cfg,
            )
        with beside():
            if block_sparse_hopper.ws_applies(q, block, q_offset, tma, contiguous):  # Gluon, sm_90, warp-specialized
                relaunch.run(block_sparse_hopper.bs_bwd_dq_hopper_kernel, (cdiv(Nq, block), H, B),
                    q, k, v, do, lse, delta, dq, kv_count, kv_index,
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
                    *dq.stride()[:3], *_layout_strides(kv_count, kv_index, B),
                    Nq, Nk, group, ratio, scale, scale * LOG2E_F, HEAD_DIM=D, BLOCK=block, IS_CAUSAL=is_causal,
                    **block_sparse_hopper.dq_config(),
                )
                LAUNCHES["dq_ws"] += 1
            else:
                relaunch.run(bs_bwd_dq_kernel, (cdiv(Nk, q_cfg["BLOCK_M"]) - tile0, H, B),
                    q, k, v, do, lse, delta, dq, kv_count, kv_index, *meta,
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2],
                    *dq.stride()[:3], *_layout_strides(kv_count, kv_index, B),
                    Nq, Nk, q_offset, tile0, group, ratio, scale, scale * LOG2E_F, **portable, **q_cfg,
                )
    LAUNCHES["backward"] += 1
    return dq, dk, dv


def kernels_support(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> bool:
    """Shapes and dtypes the kernels cover (the op runs the PyTorch reference otherwise)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and v.shape[-1] == d
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and block >= 16
    )
