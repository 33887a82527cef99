"""The dilated forward on Hopper, written in Gluon: the softmax of one key tile runs while the tensor cores multiply
the previous tile's probabilities with V (FA3's intra-warpgroup pipelining; the step is ``hopper.fwd_step``).

The portable kernel (``forward.dilated_fwd_branch_kernel``) waits for every ``wgmma`` at once under Triton 3.6, so a
warpgroup's tensor cores idle through its softmax and only the SM's second program fills the gap. Here, with the
portable kernel's grid and contract (one warpgroup per segment item, 64 dilated query rows and query head):

- Q is read once by TMA; K and V go through ``K_STAGES`` / ``V_STAGES`` shared-memory buffers by TMA, through
  descriptors over the item's dilated rows (row stride ``r`` rows, zeros past the last); a buffer is refilled as soon
  as its product has read it;
- ``P`` stays in registers as the A operand of the asynchronous ``P V`` (the wait holds it until the product is done);
- 128-key steps at head dim 128 (one K buffer, two V buffers: 112 KB, two programs per SM), 64-key steps at 64 and
  256 (at 256 one K and one V buffer: 96 KB, two programs per SM);
- only tiles that cross the causal diagonal or the item's last key are masked;
- the epilogue is the portable kernel's: merge with the rows earlier launches wrote (``MERGE``), the ``LAST`` launch
  writes the output in its dtype.

The arithmetic is ``tiles.softmax_step``'s, so with the portable kernel's 64-key steps the output is bit-identical
(measured on the H100); 128-key steps move the running maximum less often and differ in the last bf16 bit. Used for
bf16 / fp16, head dim 64 / 128 / 256, the tensor-descriptor path, no sliding window, dropout or holes (``applies``).
"""

from __future__ import annotations

import torch

from .hopper import (
    fwd_first, fwd_last, fwd_step, gl, gluon, item_query_tile, kv_descs, kv_prefetch, mbarrier, n_rows,
    query_tile_buffers, query_tile_keys, release_barriers, row_desc, runnable, tma_load, written_before,
)

BLOCK_M = 64  # dilated query rows per program (one warpgroup: m64 instructions)
# (key rows per step, K buffers, V buffers) by head dim, measured on the H100 (benchmarks/NOTES_triton.md, round 2
# session 14): at D = 128, (128, 1, 2) ran the forward 1.04-1.09x faster than the portable kernel at 64K / 256K and
# 1.06-1.09x with GQA 32 / 8, (64, 3, 3) 0.98-1.02x; at D = 64 (9 / 3 heads) (64, 2, 2) ran 1.06-1.11x, (128, 1, 2)
# 0.92-0.98x. At D = 256 (Gemma's heads, 8 / 2) (64, 1, 1) (96 KB: two programs per SM; the portable kernel spills
# 540-820 bytes there) ran 1.36x / 1.25x at 16K / 64K, bit-identical (round 2 session 19).
STEPS = {64: (64, 2, 2), 128: (128, 1, 2), 256: (64, 1, 1)}


def applies(q: torch.Tensor, flags: dict, tma: bool) -> bool:
    """Whether the dilated forward runs this kernel: ``hopper.runnable`` (the switch, sm_90, the tensor-descriptor
    path, not the interpreter), bf16 / fp16, head dim 64 / 128, no sliding window, dropout or holes."""
    return (
        runnable(tma)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in STEPS
        and not flags["WINDOW"]
        and not flags["DROPOUT"]
        and not flags["HOLES"]
    )


def launch_config(head_dim: int) -> dict:
    n, k_stages, v_stages = STEPS[head_dim]
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=n, K_STAGES=k_stages, V_STAGES=v_stages, num_warps=4)


if gluon is not None:

    @gluon.jit
    def dilated_fwd_hopper_kernel(
        Q, K, V, O, L, OUT, PREV, T,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        head_offset, group, r, qk_scale, n_tiles, n_prev,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
        V_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One branch's output rows for one tile of ``BLOCK_M`` dilated query rows of one segment item and head,
        merged into what earlier launches wrote (``MERGE``), stored to ``O`` / ``L`` or, ``LAST``, to ``OUT``."""
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        row_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        NBYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = query_tile_buffers(
            dtype, q_smem_layout, kv_smem_layout, BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES)

        b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = item_query_tile(
            T, n_tiles, head_offset, r, BLOCK_M, IS_CAUSAL)
        if p_min < q_hi:
            k_first, n_k, n_plain, n_kt, shift = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, BLOCK_M, BLOCK_N,
                                                                 IS_CAUSAL)
            kvh = (h // group).to(gl.int64)
            h64 = h.to(gl.int64)
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh + (qbase + q_first).to(gl.int64) * stride_qn,
                              n_rows(q_first, q_hi, r), r * stride_qn, BLOCK_M, HEAD_DIM, q_smem_layout)
            k_desc, v_desc = kv_descs(K, V, b, kvh, kbase, k_first, n_k, stride_kb, stride_kh, stride_kn, stride_vb,
                                      stride_vh, stride_vn, r, BLOCK_N, HEAD_DIM, kv_smem_layout)
            mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma_load(q_desc, [row0, 0], q_bar, q_smem)
            kv_prefetch(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, n_kt, BLOCK_N, K_STAGES, V_STAGES, NBYTES)

            qidx = gl.arange(0, BLOCK_M, layout=row_axis)
            kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_axis)
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_axis)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            o_b = acc
            lse_b = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=o_rows)
            mbarrier.wait(q_bar, 0)
            if n_kt > 0:
                p, m_i, l_i = fwd_first(n_kt, q_smem, k_smem, k_bar, k_desc, K_STAGES * BLOCK_N, s_zero, qk_scale,
                                        n_plain == 0, 0, n_k, shift, qidx, kidx, p_layout, K_STAGES, NBYTES,
                                        IS_CAUSAL)
                for j in range(1, n_plain):
                    acc, p, m_i, l_i = fwd_step(
                        j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, (j + K_STAGES) * BLOCK_N,
                        (j - 1 + V_STAGES) * BLOCK_N, acc, p, m_i, l_i, s_zero, qk_scale, False, j * BLOCK_N, n_k,
                        shift, qidx, kidx, o_rows, p_layout, K_STAGES, V_STAGES, NBYTES, False, IS_CAUSAL)
                for j in range(gl.maximum(n_plain, 1), n_kt):
                    acc, p, m_i, l_i = fwd_step(
                        j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, (j + K_STAGES) * BLOCK_N,
                        (j - 1 + V_STAGES) * BLOCK_N, acc, p, m_i, l_i, s_zero, qk_scale, True, j * BLOCK_N, n_k,
                        shift, qidx, kidx, o_rows, p_layout, K_STAGES, V_STAGES, NBYTES, True, IS_CAUSAL)
                o_b, lse_b = fwd_last(p, v_smem, v_bar, acc, n_kt, m_i, l_i, o_rows, V_STAGES)

            # The portable kernel's epilogue: merge with the rows earlier launches wrote, store.
            qp = p_min + gl.arange(0, BLOCK_M, layout=o_rows) * r
            in_range = qp < q_hi
            qc64 = (qbase + qp).to(gl.int64)
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            o_ptrs = O + b * stride_ob + h64 * stride_oh + qc64[:, None] * stride_on + d[None, :]
            l_ptrs = L + b * stride_lb + h64 * stride_lh + qc64
            if MERGE:  # rows an earlier launch wrote (the others read as no output, lse -inf)
                seen = in_range & written_before(qp, h, head_offset, PREV, n_prev, 1)
                old_lse = gl.load(l_ptrs, mask=seen, other=float("-inf"))
                old_o = gl.load(o_ptrs, mask=seen[:, None], other=0.0).to(gl.float32)
                m = gl.maximum(old_lse, lse_b)
                m = gl.where(m == float("-inf"), 0.0, m)
                a = gl.exp(old_lse - m)
                c = gl.exp(lse_b - m)
                tot = a + c
                reached = tot > 0
                tot_safe = gl.where(reached, tot, 1.0)
                out = (old_o * a[:, None] + o_b * c[:, None]) / tot_safe[:, None]
                lse = gl.where(reached, m + gl.log(tot_safe), float("-inf"))
            else:
                out = o_b
                lse = lse_b
            if LAST:  # the final output, in its dtype (OUT has O's strides)
                out_ptrs = OUT + b * stride_ob + h64 * stride_oh + qc64[:, None] * stride_on + d[None, :]
                gl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=in_range[:, None])
            else:
                gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_range[:, None])
            gl.store(l_ptrs, lse, mask=in_range)
        release_barriers(q_bar, k_bar, v_bar, K_STAGES, V_STAGES)
