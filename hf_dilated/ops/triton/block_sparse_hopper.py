"""Block-sparse kernels for Hopper, written in Gluon: the operand placement, load schedule and warp roles that
Triton's compiler does not choose for these loops. The forward (``bs_fwd_hopper_kernel``: one warpgroup, 64 query
rows), and at head dim 128 on 128-blocks the warp-specialized forward and dQ (``bs_fwd_ws_kernel``,
``bs_bwd_dq_hopper_kernel``: a producer warp streams K / V to two consumer warpgroups, section below); then the dK/dV.

The dK/dV. The portable kernel (``block_sparse.bs_bwd_dkdv_kernel``) runs 32-query x 64-key tiles with K and V in
registers; its two transposed products (``K Q^T``, ``V dO^T``) are then m64 n32 tensor-core instructions, and it
took 2.7 ms per product against dq's 1.8 ms (Nsight, 64K, benchmarks/NOTES_triton.md). Here, one warpgroup per 64-key
tile:

- K and V are read once by TMA and stay in **shared memory**: the A operand of ``K Q^T`` / ``V dO^T`` comes from
  there, not from registers;
- query tiles of 64 rows (n64 instructions), Q and dO double-buffered by TMA under ``mbarrier``s, the next tile's
  copy issued while this one computes; its lse and delta are read a step ahead into registers (one value per
  thread), so that no step waits on a global load (Nsight of the version without this: a third of the cycles
  between issues waited on global or local loads; reading lse / delta ahead made it 2-56% faster, most with GQA
  and at D = 64);
- ``P^T`` and ``dS^T`` are the register A operands of the dV / dK products (``hopper.dkdv_products``), and the
  products are asynchronous ``wgmma``s: ``V dO^T`` runs while the softmax of ``K Q^T`` is computed, this step's dV
  while ``dS`` is. Through shared memory (until session 23) they cost a fifth of the step's shared-memory traffic,
  the resource this kernel is bound by: the register operands made the backward 1.06-1.11x faster at H 16 / D 128
  and with GQA, bit-identical;
- 96 KB of shared memory and 255 registers per 128 threads: two programs share an SM and cover each other's
  latencies. (128-key tiles on two warpgroups, one program per SM, and a producer warp with register reallocation
  (FA3's arrangement) both measured slower: benchmarks/NOTES_triton.md. So did adding dQ here, on 128-key tiles as the
  dilated backward does (``hopper.dkdv_dq_products``), with no dQ kernel: 236 bytes of spills, 43 stores and 85 loads
  of them in the step loop; backward 0.73x at 64K, forward+backward 310 / 304 against 392 / 380 useful TFLOP/s at 64K
  / 256K, ``results/*block_sparse*fused-dq*session20*``.)

Every kernel here keeps its portable twin's contract (masks, GQA without repeating K / V, each program writes its own
rows, no atomics) and its bits (the same products summed in the same order); bf16 / fp16, head dim 64 or 128, queries
and keys the same rows (``q_offset == 0``) on sm_90 (``applies``; the forwards on contiguous layouts,
``forward_applies`` / ``ws_applies``). Gluon has no interpreter: the CPU tests compile the kernels for sm_90
(``benchmarks/kernel_resources.py``), the GPU tests check them against the float64 reference and assert which ran.
"""

from __future__ import annotations

import torch

from .hopper import (
    available, dkdv_buffers, dkdv_products, dkdv_scores, fwd_first, fwd_last, fwd_step, gl, gluon, lse_base2,
    masked_scores, mbarrier, mma_layout, query_tile_buffers, release_barriers, row_desc, runnable, softmax_first,
    softmax_step, step_probs, switch, tile_copy, tma_load, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
    WS_LAUNCH, ws_barriers, ws_copy_kv,
)

BLOCK_Q = 64  # query rows per step: n64 tensor-core instructions for the transposed products


def supported(q: torch.Tensor, block: int, q_offset: int) -> bool:
    """Whether the Gluon kernel covers this call's shapes and dtype (bf16 / fp16, head dim 64 / 128, layout blocks
    64 / 128, queries and keys the same rows) and this Triton has its API."""
    return (
        available()
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in (64, 128)
        and block in (64, 128)
        and q_offset == 0
    )


def applies(q: torch.Tensor, block: int, q_offset: int, tma: bool) -> bool:
    """Whether the backward runs this kernel: ``hopper.runnable`` (the switch, sm_90, the tensor-descriptor path on,
    not the interpreter) and :func:`supported`."""
    return runnable(tma) and supported(q, block, q_offset)


if gluon is not None:

    @gluon.jit
    def _pair_ok(kc, qc, Nk, Nq, KPOS, KSEQ, KOK, QPOS, QSEQ, QOK, kbase, qbase,
                 IS_CAUSAL: gl.constexpr, CONTIG: gl.constexpr):
        """``[keys, queries]`` bool: which (key, query) pairs may attend (SPEC: causal by position, same sequence,
        valid tokens); ``kc`` / ``qc`` carry the slice layouts of the score tile's rows and columns."""
        kin = kc < Nk
        qin = qc < Nq
        if CONTIG:
            ok = kin[:, None] & qin[None, :]
            if IS_CAUSAL:
                ok = ok & (kc[:, None] <= qc[None, :])
        else:
            kp = gl.load(KPOS + kbase + kc, mask=kin, other=0)
            ks = gl.load(KSEQ + kbase + kc, mask=kin, other=-2)
            kv = (gl.load(KOK + kbase + kc, mask=kin, other=0) != 0) & kin
            qp = gl.load(QPOS + qbase + qc, mask=qin, other=0)
            qs = gl.load(QSEQ + qbase + qc, mask=qin, other=-3)
            qv = (gl.load(QOK + qbase + qc, mask=qin, other=0) != 0) & qin
            ok = kv[:, None] & qv[None, :] & (ks[:, None] == qs[None, :])
            if IS_CAUSAL:
                ok = ok & (kp[:, None] <= qp[None, :])
        return ok

    @gluon.jit
    def bs_bwd_dkdv_hopper_kernel(
        Q, K, V, DO, L, Delta, DK, DV, QPTR, QIDX, QPOS, QSEQ, QOK, KPOS, KSEQ, KOK,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_db, stride_dh, stride_dn,
        stride_lb, stride_lh,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        stride_cb, stride_ch, stride_ib, stride_ih,
        Nq, Nk, kv_heads, batch, group, ratio, scale, qk_scale,
        HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
        IS_CAUSAL: gl.constexpr, CONTIG: gl.constexpr, num_warps: gl.constexpr,
    ):
        """dK and dV of one tile of ``BLOCK_N`` keys (one kv head, one batch row): the query tiles that read it,
        for every query head of its GQA group, walked from the layout's transpose."""
        dtype: gl.constexpr = Q.dtype.element_ty
        # Score tiles [keys, queries] and gradient tiles [keys, HEAD_DIM]: keys along M.
        s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_Q)
        g_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, HEAD_DIM], dtype)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)  # P^T, dS^T
        key_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_axis: gl.constexpr = gl.SliceLayout(0, s_layout)
        STEPS_PER_BLOCK: gl.constexpr = BLOCK // BLOCK_Q

        # One program per (key tile, kv head, batch row) on a 1-D grid, key tile slowest (block_sparse._key_tile).
        pid = gl.program_id(0)
        rows = kv_heads * batch
        kt = pid // rows
        kvh = (pid % rows) % kv_heads
        b = ((pid % rows) // kv_heads).to(gl.int64)
        kvh64 = kvh.to(gl.int64)
        k_first = kt * BLOCK_N
        j = k_first // BLOCK

        # K and V: read once, kept in shared memory for the whole program.
        k_smem, v_smem, q_smem, do_smem, kv_bar, ready = dkdv_buffers(
            dtype, kv_smem_layout, q_smem_layout, BLOCK_N, BLOCK_Q, HEAD_DIM)

        k_desc = row_desc(K + b * stride_kb + kvh64 * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM, kv_smem_layout)
        v_desc = row_desc(V + b * stride_vb + kvh64 * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM, kv_smem_layout)
        mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
        tma_load(k_desc, [k_first, 0], kv_bar, k_smem)
        tma_load(v_desc, [k_first, 0], kv_bar, v_smem)

        tile_bytes: gl.constexpr = 2 * BLOCK_Q * HEAD_DIM * dtype.primitive_bitwidth // 8
        kc = k_first + gl.arange(0, BLOCK_N, layout=key_axis)
        rows = gl.arange(0, BLOCK_Q, layout=query_axis)
        vrows = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        s_zero = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, layout=s_layout)
        # The accumulators travel through the loops as wgmma accumulators (each step retires its products).
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
        mbarrier.wait(kv_bar, 0)

        it = 0  # steps issued over all heads: buffer it % 2, its barrier's phase (it // 2) % 2
        for g in range(0, group):
            h = kvh * group + g
            h64 = h.to(gl.int64)
            lh = h // ratio
            ptr = QPTR + b * stride_cb + lh * stride_ch + j
            p0 = gl.load(ptr)
            n_steps = (gl.load(ptr + 1) - p0) * STEPS_PER_BLOCK
            idx_row = QIDX + b * stride_ib + lh * stride_ih + p0
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, BLOCK_Q, HEAD_DIM, q_smem_layout)
            do_desc = row_desc(DO + b * stride_db + h64 * stride_dh, Nq, stride_dn, BLOCK_Q, HEAD_DIM, q_smem_layout)
            l_row = L + b * stride_lb + h64 * stride_lh
            dl_row = Delta + b * stride_lb + h64 * stride_lh
            # Prologue: this head's first query tile, its Q / dO by TMA and its lse / delta into registers (one value
            # per thread; each step's are read a step ahead, so no step waits on a global load).
            q_cur = gl.load(idx_row, mask=n_steps > 0, other=0) * BLOCK
            vmask = (q_cur + vrows < Nq) & (n_steps > 0)
            lse_next = gl.load(l_row + q_cur + vrows, mask=vmask, other=0.0)
            delta_next = gl.load(dl_row + q_cur + vrows, mask=vmask, other=0.0)
            if n_steps > 0:
                buf = it % 2
                mbarrier.expect(ready.index(buf), tile_bytes)
                tma_load(q_desc, [q_cur, 0], ready.index(buf), q_smem.index(buf))
                tma_load(do_desc, [q_cur, 0], ready.index(buf), do_smem.index(buf))
            for s in range(0, n_steps):
                buf = it % 2
                q0 = q_cur
                qc = q0 + rows
                lse = gl.convert_layout(lse_base2(lse_next), query_axis)
                delta = gl.convert_layout(delta_next, query_axis)
                mbarrier.wait(ready.index(buf), (it // 2) % 2)
                qs = q_smem.index(buf)
                dos = do_smem.index(buf)
                sT, dpT, dk, dv = dkdv_scores(k_smem, v_smem, qs, dos, s_zero, dk, dv)
                if s + 1 < n_steps:
                    nxt = s + 1
                    q_cur = gl.load(idx_row + nxt // STEPS_PER_BLOCK) * BLOCK + (nxt % STEPS_PER_BLOCK) * BLOCK_Q
                    nbuf = 1 - buf
                    mbarrier.expect(ready.index(nbuf), tile_bytes)
                    tma_load(q_desc, [q_cur, 0], ready.index(nbuf), q_smem.index(nbuf))
                    tma_load(do_desc, [q_cur, 0], ready.index(nbuf), do_smem.index(nbuf))
                    vmask = q_cur + vrows < Nq
                    lse_next = gl.load(l_row + q_cur + vrows, mask=vmask, other=0.0)
                    delta_next = gl.load(dl_row + q_cur + vrows, mask=vmask, other=0.0)
                pT = gl.exp2(sT * qk_scale - lse[None, :])
                if CONTIG:  # interior tiles need no mask
                    needs_mask = (k_first + BLOCK_N > Nk) | (q0 + BLOCK_Q > Nq)
                    if IS_CAUSAL:
                        needs_mask = needs_mask | (k_first + BLOCK_N - 1 > q0)
                else:  # masks come from per-token data
                    needs_mask = k_first >= 0
                if needs_mask:
                    ok = _pair_ok(kc, qc, Nk, Nq, KPOS, KSEQ, KOK, QPOS, QSEQ, QOK, b * Nk, b * Nq,
                                  IS_CAUSAL, CONTIG)
                    pT = gl.where(ok, pT, 0.0)
                dk, dv = dkdv_products(pT, dpT, delta, qs, dos, dk, dv, dtype, a_layout)
                it += 1
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))

        kr = k_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
        kr64 = kr.to(gl.int64)[:, None]
        kmask = (kr < Nk)[:, None]
        gl.store(DK + b * stride_dkb + kvh64 * stride_dkh + kr64 * stride_dkn + d[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=kmask)
        gl.store(DV + b * stride_dvb + kvh64 * stride_dvh + kr64 * stride_dvn + d[None, :],
                 dv.to(DV.dtype.element_ty), mask=kmask)

    @gluon.jit
    def _key_row(idx_row, s, n_kt, BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
        """First key row of the query block's ``s``-th key tile (``BLOCK // BLOCK_N`` tiles per active block); 0
        from ``n_kt`` on (the index row ends there)."""
        active = gl.load(idx_row + s // (BLOCK // BLOCK_N), mask=s < n_kt, other=0)
        return active * BLOCK + (s % (BLOCK // BLOCK_N)) * BLOCK_N

    @gluon.jit
    def _block_keys(CNT, IDX, b, lh, blk, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, BLOCK: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        """``(n_kt, idx_row)`` of query block ``blk`` under layout head ``lh``: how many ``BLOCK_N``-key tiles its
        active key blocks make, and its row of the layout's index (what :func:`_key_row` reads)."""
        n_kt = gl.load(CNT + b * stride_cb + lh * stride_ch + blk) * (BLOCK // BLOCK_N)
        return n_kt, IDX + b * stride_ib + lh * stride_ih + blk * stride_iq

    @gluon.jit
    def _edge(k0, q_first, q_edge, Nk, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """Whether the key tile from ``k0`` needs the mask for the query rows from ``q_first`` (64 of them; ``q_edge``:
        some row is past the last key): some key past the last or, causal, after some row."""
        edge = q_edge | (k0 + BLOCK_N > Nk)
        if IS_CAUSAL:
            edge = edge | (k0 + BLOCK_N - 1 > q_first)
        return edge

    @gluon.jit
    def bs_fwd_hopper_kernel(
        Q, K, V, O, L, CNT, IDX,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
        Nq, Nk, group, ratio, qk_scale,
        HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        """``bs_fwd_kernel``'s contract on a contiguous layout with queries and keys the same rows: one tile of
        ``BLOCK_M`` queries of one head, one online softmax over its query block's active key blocks, in
        ``hopper.fwd_step``'s pipeline; tiles that cross the diagonal or the last key are masked."""
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # P converted at the softmax's end (``hopper.step_probs``): late, it ran 1.000x at head dim 128 (session 64)
        LATE_P: gl.constexpr = False
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        row_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        NBYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = query_tile_buffers(
            dtype, q_smem_layout, kv_smem_layout, BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES)
        t = gl.program_id(0)
        if IS_CAUSAL:  # last-first: the tiles with the most active key blocks start first (block_sparse._query_tile)
            t = gl.num_programs(0) - 1 - t
        h = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        q0 = t * BLOCK_M
        blk = q0 // BLOCK
        lh = h // ratio
        kvh = (h // group).to(gl.int64)
        h64 = h.to(gl.int64)
        n_kt, idx_row = _block_keys(CNT, IDX, b, lh, blk, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, BLOCK,
                                    BLOCK_N)
        q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM, q_smem_layout)
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM, kv_smem_layout)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM, kv_smem_layout)
        mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
        tma_load(q_desc, [q0, 0], q_bar, q_smem)
        for i in gl.static_range(K_STAGES):
            if i < n_kt:
                tile_copy(k_desc, k_smem, k_bar, i, _key_row(idx_row, i, n_kt, BLOCK, BLOCK_N), K_STAGES, NBYTES)
        for i in gl.static_range(V_STAGES):
            if i < n_kt:
                tile_copy(v_desc, v_smem, v_bar, i, _key_row(idx_row, i, n_kt, BLOCK, BLOCK_N), V_STAGES, NBYTES)

        # A tile needs its mask where some key is past the last or (causal) after some query of the tile
        # (block_sparse._edge); the mask compares columns: key k0 + c after query q0 + i iff k0 + c > q0 + i.
        q_edge = q0 + BLOCK_M > Nk
        qidx = gl.arange(0, BLOCK_M, layout=row_axis)
        kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_axis)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_axis)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        out = acc
        lse = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=o_rows)
        mbarrier.wait(q_bar, 0)
        if n_kt > 0:
            k0 = _key_row(idx_row, 0, n_kt, BLOCK, BLOCK_N)
            edge = _edge(k0, q0, q_edge, Nk, BLOCK_N, IS_CAUSAL)
            k_next = _key_row(idx_row, K_STAGES, n_kt, BLOCK, BLOCK_N)
            p, acc, m_i, l_i = fwd_first(n_kt, q_smem, k_smem, k_bar, k_desc, k_next, s_zero, qk_scale, edge, k0, Nk,
                                         q0, qidx, kidx, acc, m_i, l_i, o_rows, p_layout, K_STAGES, NBYTES,
                                         IS_CAUSAL, False, LATE_P)
            for j in range(1, n_kt):
                k0 = _key_row(idx_row, j, n_kt, BLOCK, BLOCK_N)
                edge = _edge(k0, q0, q_edge, Nk, BLOCK_N, IS_CAUSAL)
                k_next = _key_row(idx_row, j + K_STAGES, n_kt, BLOCK, BLOCK_N)
                v_next = _key_row(idx_row, j - 1 + V_STAGES, n_kt, BLOCK, BLOCK_N)
                acc, p, m_i, l_i = fwd_step(
                    j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, k_next, v_next, acc, p, m_i, l_i,
                    s_zero, qk_scale, edge, k0, Nk, q0, qidx, kidx, o_rows, p_layout, K_STAGES, V_STAGES, NBYTES, True,
                    IS_CAUSAL, LATE_P)
            out, lse = fwd_last(p, v_smem, v_bar, acc, n_kt, m_i, l_i, o_rows, p_layout, V_STAGES, LATE_P)
        release_barriers(q_bar, k_bar, v_bar, K_STAGES, V_STAGES)
        qr = q0 + gl.arange(0, BLOCK_M, layout=o_rows)
        qmask = qr < Nq
        qr64 = qr.to(gl.int64)
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(O + b * stride_ob + h64 * stride_oh + qr64[:, None] * stride_on + d[None, :],
                 out.to(O.dtype.element_ty), mask=qmask[:, None])
        gl.store(L + b * stride_lb + h64 * stride_lh + qr64, lse, mask=qmask)

    # ---- the forward and dQ with a producer warp and two consumer warpgroups ---------------------------------------
    # One program per 128 query rows (one layout block of 128) of one head, ``gl.warp_specialize``d: a producer warp
    # reads Q (and dO) once and streams the block's active key tiles (K and V) through ``STAGES`` buffers; each
    # consumer warpgroup owns 64 of the rows and walks every key tile on its own, releasing a buffer (``empty`` takes
    # one arrival per consumer) once its last product has read it. Both consumers read each K / V tile from one copy,
    # half the L2 traffic of one-warpgroup programs (the forward's L2 was 82% busy, Nsight, session 22), and they drift
    # apart by up to ``STAGES`` tiles, so one's exponentials run under the other's products with no CTA barrier (the
    # portable dq kernel's 8 warps wait at one before every refill: its top stall). One program per SM (9 warps at
    # 168 registers; the consumers take 240 by ``setmaxnreg``, the producer 24). H100, 128-block bench layout, against
    # the one-warpgroup kernels (session 24): forward 1.11 / 1.14 / 1.20x at 16K / 64K / 256K, dq kernel 1.08-1.21x;
    # at head dim 64 both ran slower (0.87-0.92x), so they serve head dim 128.

    @gluon.jit
    def _stream_key_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, idx_row, n_kt, BLOCK: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NBYTES: gl.constexpr):
        """A producer's loop over the query block's active key tiles (``hopper.ws_copy_kv``)."""
        for t in range(0, n_kt):
            ws_copy_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, t,
                       _key_row(idx_row, t, n_kt, BLOCK, BLOCK_N), STAGES, NBYTES)

    @gluon.jit
    def _fwd_consumer(a, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      WG: gl.constexpr):
        """Output and lse of rows ``q0 + 64 WG ..``: ``hopper.fwd_step``'s order (tile ``t``'s scores issued before
        tile ``t - 1``'s ``P V``, the softmax of ``t`` while that product runs), buffers released once ``P V`` is
        done."""
        (O, L, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, Nq, Nk, b, h, q0, n_kt, idx_row, qk_scale,
         q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, BLOCK) = a
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # P converted at the softmax's end, not before the next P V (``hopper.step_probs``): late, it ran 0.98x
        # (session 64)
        LATE_P: gl.constexpr = False
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        qw = q0 + WG * 64
        qs = q_smem.index(WG)
        qidx = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
        out = acc
        lse = gl.full([64], float("-inf"), gl.float32, layout=o_rows)
        q_edge = qw + 64 > Nk
        mbarrier.wait(q_bar, 0)
        if n_kt > 0:
            k0 = _key_row(idx_row, 0, n_kt, BLOCK, BLOCK_N)
            mbarrier.wait(k_ready.index(0), 0)
            sc = warpgroup_mma(qs, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            if _edge(k0, qw, q_edge, Nk, BLOCK_N, IS_CAUSAL):
                sc = masked_scores(sc, k0, Nk, qw, qidx, kidx, IS_CAUSAL)
            pf, m_i, l_i = softmax_first(sc, qk_scale)
            p = step_probs(pf, dtype, p_layout, LATE_P)
            for t in range(1, n_kt):
                k0 = _key_row(idx_row, t, n_kt, BLOCK, BLOCK_N)
                st = t % STAGES
                pst = (t - 1) % STAGES
                mbarrier.wait(k_ready.index(st), (t // STAGES) & 1)
                sc = warpgroup_mma(qs, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(pst), ((t - 1) // STAGES) & 1)
                o = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
                if _edge(k0, qw, q_edge, Nk, BLOCK_N, IS_CAUSAL):
                    sc = masked_scores(sc, k0, Nk, qw, qidx, kidx, IS_CAUSAL)
                pf, alpha, m_i, l_i = softmax_step(sc, m_i, l_i, qk_scale)
                acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
                mbarrier.arrive(empty.index(pst), count=1)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                p = step_probs(pf, dtype, p_layout, LATE_P)
            out, lse = fwd_last(p, v_smem, v_ready, acc, n_kt, m_i, l_i, o_rows, p_layout, STAGES, LATE_P)
            mbarrier.arrive(empty.index((n_kt - 1) % STAGES), count=1)
        qr = qw + gl.arange(0, 64, layout=o_rows)
        qmask = qr < Nq
        qr64 = qr.to(gl.int64)
        h64 = h.to(gl.int64)
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(O + b * stride_ob + h64 * stride_oh + qr64[:, None] * stride_on + d[None, :],
                 out.to(O.dtype.element_ty), mask=qmask[:, None])
        gl.store(L + b * stride_lb + h64 * stride_lh + qr64, lse, mask=qmask)

    @gluon.jit
    def _fwd_producer(a, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, q_desc, k_desc, v_desc):
        """Q of the program's rows, then the key tiles (:func:`_stream_key_tiles`)."""
        (O, L, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, Nq, Nk, b, h, q0, n_kt, idx_row, qk_scale,
         q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, BLOCK) = a
        dtype: gl.constexpr = q_smem.dtype
        Q_BYTES: gl.constexpr = 64 * HEAD_DIM * dtype.primitive_bitwidth // 8
        KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        mbarrier.expect(q_bar, 2 * Q_BYTES)
        tma_load(q_desc, [q0, 0], q_bar, q_smem.index(0))
        tma_load(q_desc, [q0 + 64, 0], q_bar, q_smem.index(1))
        _stream_key_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, idx_row, n_kt, BLOCK, BLOCK_N,
                          STAGES, KV_BYTES)

    @gluon.jit
    def bs_fwd_ws_kernel(
        Q, K, V, O, L, CNT, IDX,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
        Nq, Nk, group, ratio, qk_scale,
        HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """``bs_fwd_hopper_kernel``'s contract for one layout block of 128 query rows of one head
        (``_fwd_producer`` and two ``_fwd_consumer`` s); the same products in the same order, so the same bits."""
        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        t = gl.program_id(0)
        if IS_CAUSAL:  # last-first: the blocks with the most active key blocks start first
            t = gl.num_programs(0) - 1 - t
        h = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        q0 = t * BLOCK
        lh = h // ratio
        kvh = (h // group).to(gl.int64)
        h64 = h.to(gl.int64)
        n_kt, idx_row = _block_keys(CNT, IDX, b, lh, t, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, BLOCK,
                                    BLOCK_N)
        q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, 64, HEAD_DIM, q_layout)
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM, kv_layout)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM, kv_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar, k_ready, v_ready, empty = ws_barriers(STAGES)
        a = (O, L, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, Nq, Nk, b, h, q0, n_kt, idx_row, qk_scale,
             q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, BLOCK)
        gl.warp_specialize([(_fwd_consumer, (a, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, 0)),
                            (_fwd_consumer, (a, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, 1)),
                            (_fwd_producer, (a, HEAD_DIM, BLOCK_N, STAGES, q_desc, k_desc, v_desc))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _dq_probabilities(s, lse, qk_scale, k0, qw, qc, qmask, kidx, Nq, Nk, IS_CAUSAL: gl.constexpr):
        """``P = exp2(S - lse)`` of a consumer's 64 rows and the 64 keys from ``k0``, zero where a key is past the last
        or (causal) after the query: masked only on tiles that cross the diagonal or the last key or row."""
        p = gl.exp2(s * qk_scale - lse[:, None])
        if _edge(k0, qw, qw + 64 > Nq, Nk, 64, IS_CAUSAL):
            kc = k0 + kidx
            ok = (kc < Nk)[None, :] & qmask[:, None]
            if IS_CAUSAL:
                ok = ok & (kc[None, :] <= qc[:, None])
            p = gl.where(ok, p, 0.0)
        return p

    @gluon.jit
    def _dq_walk(qs, dos, k_smem, v_smem, k_ready, v_ready, empty, dq, s_zero, lse, delta, qk_scale, n_kt, idx_row,
                 qw, qc, qmask, kidx, Nq, Nk, ds_layout: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr):
        """A consumer's walk over the key tiles, ``hopper.dq_step``'s order: tile ``t``'s ``S`` and ``dP`` issued
        before tile ``t - 1``'s ``dQ += dS K``, so that its exponentials run while ``dP`` and that product are on the
        tensor cores; tile ``t - 1``'s buffer released once its product is done."""
        dtype: gl.constexpr = qs.dtype
        if n_kt > 0:
            k0 = _key_row(idx_row, 0, n_kt, BLOCK, 64)
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(qs, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(0), 0)
            dp = warpgroup_mma(dos, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p = _dq_probabilities(s, lse, qk_scale, k0, qw, qc, qmask, kidx, Nq, Nk, IS_CAUSAL)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
            ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)
            for t in range(1, n_kt):
                k0 = _key_row(idx_row, t, n_kt, BLOCK, 64)
                st = t % STAGES
                pst = (t - 1) % STAGES
                mbarrier.wait(k_ready.index(st), (t // STAGES) & 1)
                s = warpgroup_mma(qs, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(st), (t // STAGES) & 1)
                dp = warpgroup_mma(dos, v_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds, k_smem.index(pst), dq, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
                p = _dq_probabilities(s, lse, qk_scale, k0, qw, qc, qmask, kidx, Nq, Nk, IS_CAUSAL)
                dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
                ds_t = (p * (dp - delta[:, None])).to(dtype)
                dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
                dq = warpgroup_mma_init(dq)
                mbarrier.arrive(empty.index(pst), count=1)
                ds = gl.convert_layout(ds_t, ds_layout)
            last = (n_kt - 1) % STAGES
            dq = warpgroup_mma(ds, k_smem.index(last), dq, is_async=True)
            dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
            dq = warpgroup_mma_init(dq)
            mbarrier.arrive(empty.index(last), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(a, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                     WG: gl.constexpr):
        """dQ of rows ``q0 + 64 WG ..`` over the query block's key tiles, stored scaled."""
        (L, Delta, DQ, stride_lb, stride_lh, stride_dqb, stride_dqh, stride_dqn, Nq, Nk, b, h, q0, n_kt, idx_row,
         qk_scale, scale, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty) = a
        BLOCK_N: gl.constexpr = 64
        s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
        g_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
        row_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        qw = q0 + WG * 64  # this warpgroup's first row
        qc = qw + gl.arange(0, 64, layout=row_axis)
        qmask = qc < Nq
        h64 = h.to(gl.int64)
        l_rows = b * stride_lb + h64 * stride_lh + qc
        lse = gl.load(L + l_rows, mask=qmask, other=0.0)
        lse = lse_base2(lse)
        delta = gl.load(Delta + l_rows, mask=qmask, other=0.0)
        kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        dq = warpgroup_mma_init(gl.zeros([64, HEAD_DIM], gl.float32, layout=g_layout))
        qs = q_smem.index(WG)
        dos = do_smem.index(WG)
        mbarrier.wait(q_bar, 0)
        dq = _dq_walk(qs, dos, k_smem, v_smem, k_ready, v_ready, empty, dq, s_zero, lse, delta, qk_scale, n_kt,
                      idx_row, qw, qc, qmask, kidx, Nq, Nk, ds_layout, BLOCK, STAGES, IS_CAUSAL)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        qr = qw + gl.arange(0, 64, layout=gl.SliceLayout(1, g_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
        gl.store(DQ + b * stride_dqb + h64 * stride_dqh + qr.to(gl.int64)[:, None] * stride_dqn + d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=(qr < Nq)[:, None])

    @gluon.jit
    def _dq_producer(a, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, q_desc, do_desc, k_desc,
                     v_desc):
        """Q and dO of the program's rows, then the key tiles (:func:`_stream_key_tiles`)."""
        (L, Delta, DQ, stride_lb, stride_lh, stride_dqb, stride_dqh, stride_dqn, Nq, Nk, b, h, q0, n_kt, idx_row,
         qk_scale, scale, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty) = a
        dtype: gl.constexpr = q_smem.dtype
        ROW_BYTES: gl.constexpr = 64 * HEAD_DIM * dtype.primitive_bitwidth // 8
        mbarrier.expect(q_bar, 4 * ROW_BYTES)
        tma_load(q_desc, [q0, 0], q_bar, q_smem.index(0))
        tma_load(q_desc, [q0 + 64, 0], q_bar, q_smem.index(1))
        tma_load(do_desc, [q0, 0], q_bar, do_smem.index(0))
        tma_load(do_desc, [q0 + 64, 0], q_bar, do_smem.index(1))
        _stream_key_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, idx_row, n_kt, BLOCK, 64, STAGES,
                          ROW_BYTES)

    @gluon.jit
    def bs_bwd_dq_hopper_kernel(
        Q, K, V, DO, L, Delta, DQ, CNT, IDX,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_db, stride_dh, stride_dn,
        stride_lb, stride_lh,
        stride_dqb, stride_dqh, stride_dqn,
        stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
        Nq, Nk, group, ratio, scale, qk_scale,
        HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """``bs_bwd_dq_kernel``'s contract on a contiguous layout of 128-blocks, queries and keys the same rows: dQ of
        one layout block of one head (``_dq_producer`` and two ``_dq_consumer`` s)."""
        dtype: gl.constexpr = Q.dtype.element_ty
        rows_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
        blk = gl.program_id(0)
        h = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        q0 = blk * BLOCK
        lh = h // ratio
        kvh = (h // group).to(gl.int64)
        h64 = h.to(gl.int64)
        n_kt, idx_row = _block_keys(CNT, IDX, b, lh, blk, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, BLOCK,
                                    64)
        q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh, Nq, stride_qn, 64, HEAD_DIM, rows_layout)
        do_desc = row_desc(DO + b * stride_db + h64 * stride_dh, Nq, stride_dn, 64, HEAD_DIM, rows_layout)
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh, Nk, stride_kn, 64, HEAD_DIM, rows_layout)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh, Nk, stride_vn, 64, HEAD_DIM, rows_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], rows_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], rows_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], rows_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_DIM], rows_layout)
        q_bar, k_ready, v_ready, empty = ws_barriers(STAGES)
        a = (L, Delta, DQ, stride_lb, stride_lh, stride_dqb, stride_dqh, stride_dqn, Nq, Nk, b, h, q0, n_kt, idx_row,
             qk_scale, scale, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty)
        gl.warp_specialize([(_dq_consumer, (a, HEAD_DIM, BLOCK, STAGES, IS_CAUSAL, 0)),
                            (_dq_consumer, (a, HEAD_DIM, BLOCK, STAGES, IS_CAUSAL, 1)),
                            (_dq_producer, (a, HEAD_DIM, BLOCK, STAGES, q_desc, do_desc, k_desc, v_desc))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def launch_config() -> dict:
    """64 queries x 64 keys per step on one warpgroup (a key tile lies within one layout block of 64 or 128)."""
    return dict(BLOCK_N=64, BLOCK_Q=BLOCK_Q, num_warps=4)


# The forward's (key rows per step, K buffers, V buffers) by step width: ``forward_hopper.STEPS``'s measurements.
FWD_STEPS = {64: (2, 2), 128: (1, 2)}


def forward_applies(q: torch.Tensor, block: int, q_offset: int, tma: bool, contiguous: bool) -> bool:
    """Whether the forward runs :func:`bs_fwd_hopper_kernel`: as :func:`applies`, on a contiguous layout (masks by
    column; per-token positions, sequences and padding keep the portable kernel)."""
    return applies(q, block, q_offset, tma) and contiguous


def forward_config(block: int, head_dim: int) -> dict:
    """64 query rows on one warpgroup; 128-key steps at head dim 128 on 128-blocks, else 64."""
    n = min(block, 128 if head_dim == 128 else 64)
    k_stages, v_stages = FWD_STEPS[n]
    return dict(BLOCK_M=64, BLOCK_N=n, K_STAGES=k_stages, V_STAGES=v_stages, num_warps=4)


def ws_applies(q: torch.Tensor, block: int, q_offset: int, tma: bool, contiguous: bool) -> bool:
    """Whether the forward and the backward's dQ run the warp-specialized kernels (:func:`bs_fwd_ws_kernel`,
    :func:`bs_bwd_dq_hopper_kernel`): as :func:`forward_applies`, at head dim 128 (at 64 both ran slower), on
    128-blocks (a program's rows are one layout block, so both consumers walk the same key tiles), and with
    ``HF_DILATED_WS`` on (the default; ``0`` / ``false`` / ``off`` / ``no`` keep the one-warpgroup Gluon forward and
    the portable dq kernel)."""
    return (forward_applies(q, block, q_offset, tma, contiguous) and block == 128 and q.shape[-1] == 128
            and switch("HF_DILATED_WS"))




def ws_forward_config() -> dict:
    """128-key steps through three K / V buffers (224 KB; two buffers ran 0.90-0.95x of three, 64-key steps
    0.86-0.91x; session 24)."""
    return dict(BLOCK_N=128, STAGES=3, **WS_LAUNCH)


def dq_config() -> dict:
    """64-key tiles through three K / V buffers (160 KB; two ran the backward 0.86-0.97x; session 24)."""
    return dict(STAGES=3, **WS_LAUNCH)
