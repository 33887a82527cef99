"""Dilated dK/dV and dQ on Hopper, written in Gluon. dK/dV: the arrangement of ``block_sparse_hopper.py`` (K / V
resident in shared memory, 64-query steps, asynchronous ``wgmma``s) over a branch's dilated rows.

The portable kernel (``backward.dilated_bwd_dkdv_kernel``) holds K and V of a 64-key tile in registers (255
registers with spills at D = 128) and runs 32-query tiles, so its transposed products are m64 n32 tensor-core
instructions. Here one warpgroup owns a tile of 64 dilated key rows of one segment item and one kv head x offset
class (the portable kernel's grid and contract):

- K and V read once by TMA through descriptors over the item's dilated key rows (row stride ``r`` rows) and kept in
  shared memory, the A operand of ``K Q^T`` / ``V dO^T``;
- 64-query steps over the query heads of the class, Q and dO double-buffered by TMA (descriptors over each head's
  dilated query rows, zeros past the last), lse and delta read a step ahead into registers;
- ``P^T`` / ``dS^T`` as the register A operands of the asynchronous dV / dK products (``hopper.dkdv_products``),
  retired within the step (through shared memory until session 23: the register operands made the D = 64 backward
  1.07x faster, D = 256's 1.01-1.02x, bit-identical); the fused dQ step below keeps them in shared memory;
- only steps on the causal diagonal are masked (rows past an item's end read as zeros and add nothing);
- the branch's share is added to the float32 sums of the earlier launches (read, add, write the rows they wrote: no
  two programs write one key row); the ``LAST`` launch writes the final dK / dV in their dtype (``launch.backward``).

It covers the training path's common case: bf16 / fp16, head dim 64 / 128 / 256, the tensor-descriptor path (no
holes), no sliding window and no dropout (``applies``); everything else runs the portable kernel, as does
``HF_DILATED_GLUON=0``. The products are the portable kernel's, summed in the same order (16-row k-steps in query
order), so the gradients are expected bit-identical (``benchmarks/ab_gluon.py`` checks it on the GPU).

dQ (``dilated_bwd_dq_hopper_kernel``, head dim 128 and 256: ``DQ_STEPS``): one warpgroup owns 64 dilated query rows
of an item and head, Q and dO resident in shared memory, K / V tiles streamed by TMA (3 K and 2 V buffers of 64 keys
at D = 128; at 256 two warpgroups own 128 rows and share 2 K and 1 V buffers of 64 keys, 224 KB: one program per SM,
each K / V tile read once for 128 rows; session 54). Per key tile the scores and ``dP`` are issued, then the previous
tile's ``dQ += dS K`` (``hopper.dq_step``): in source order the exponentials and ``dS`` run while products are on the
tensor cores (the compiler moves them after the waits: the comment above ``hopper.dq_first``), where the portable
kernel waits for ``S`` and ``dP`` as soon as it issues them. Same products, same order: bit-identical gradients
(H100, 16K-256K); with it the backward runs 1.07 / 1.04 / 1.02x faster than with the portable dQ at 16K / 64K / 256K
and D = 128 (means of 2 interleaved rounds), 0.98x at D = 64, where the portable one stays
(``benchmarks/results/ab_gluon_dq-dilated-*.jsonl``). At D = 256, where the portable dq kernel spills 184-1392 bytes
(96-485 spill loads inside its loops), the Gluon dQ runs the backward 1.19x / 1.21x faster at 16K / 64K (8 / 2 heads,
bit-identical, ``results/ab_gluon_backward-dilated-d256-session19-*``).

dK/dV at D = 256: 64 keys of dK and dV would be 256 float32 registers per thread of one warpgroup, so each branch
runs the kernel twice, ``PART`` 1 for dV (``S^T``, ``dV += P^T dO``; no V in shared memory, 96 KB at 32-query steps:
two programs per SM) and ``PART`` 2 for dK (``S^T``, ``dP^T``, ``dK += dS^T Q``; 128 KB), five products per tile pair
instead of four, where the portable kernel spilled 560-744 bytes (103-334 spill loads in its loops). With both Gluon
kernels the D = 256 backward runs 1.39x / 1.46x faster than the portable one at 16K / 64K, bit-identical
(``results/ab_gluon_backward-dilated-d256-split-dkdv-session19-*``; 16-query steps for dK, 98 KB and two programs per
SM, 1.28x / 1.41x).

Since round 2 session 52 the two run as one warp-specialized launch of two roles by default (``_dkdv_ws_role``,
``ROLES_STEPS``; ``HF_DILATED_WS_DKDV=0`` keeps the launch per gradient): a producer warp copies K / V once and each
step's Q / dO, a dV warpgroup computes ``S^T``, ``P^T`` and ``dV += P^T dO`` and hands ``P^T`` (float32) to a dK
warpgroup through shared memory, which computes ``dP^T``, ``dS^T`` and ``dK += dS^T Q``: four products a tile pair, K
/ Q / dO read once. dK and dV are the launch per gradient's bit for bit; forward+backward 1.30x / 1.24x / 1.24x at
16K / 64K / 256K at 64-query steps (224 KB), 1.21x / 1.15x / 1.16x at 32 (144 KB) (8 / 2 heads, H200,
``compare_checkouts.py --warm-s 1``, ``results/session52-*``).

dQ from the dK/dV launch at D = 128 (``FUSED_DQ``, FA3's scheme, the default where it applies): the dQ kernel
computes ``S`` and ``dP`` a second time, so a backward ran 7 tensor-core products per (query, key) pair where FA2
runs 5. Here the dK/dV program also issues ``dS K`` for each step's queries and adds the float32 tile to the dQ sums
with a TMA reduce-add (``cp.reduce.async.bulk``; ``hopper.tma_reduce_add``): 5 products. A program then owns 128 keys
on two warpgroups (K, V, Q and dO double-buffered, ``P^T``, ``dS^T`` and the dQ tile: 192 KB, one program per SM), so
that each added tile covers 128 keys. The dQ sums start at zero and are copied to dQ at the end; the reduce-adds of the
programs sharing a query row land in no fixed order, so dQ may differ in its last bits between runs (dK, dV stay
bit-identical): ``HF_DILATED_FUSED_DQ=0`` or ``torch.use_deterministic_algorithms(True)`` keeps the dQ kernel.
Measured (H100, bf16, LongNet branches, ``results/*fused-dq*session20*``):

- at the 700 W power cap, where every method runs from 64K on, fewer products mean a higher clock: forward+backward
  timed sustained (``--warm-s 1``) at 1822-1935 MHz against 1527-1620 with the dQ kernel, 1.04-1.05x faster at 64K /
  256K (H 16) and 1.02-1.04x (GQA 32 / 8); 0.99-1.07x SDPA-flash's useful rate from 16K to 1M;
- back-to-back backward timings (``ab_gluon.py --switch fused_dq``, 200 ms, below the cap): 0.96-0.98x at 16K,
  1.02-1.05x at 64K;
- the alternatives, same run: dQ by register atomics (``atom.add.v2.f32``) 0.45-0.63x; the 128-key two-warpgroup
  tile without dQ 0.95-0.98x (the warpgroups step in lock-step, where two 64-key programs per SM interleave);
- D = 64 (9 / 3 heads): no gain at 64K (3.79 / 4.21 ms with 64 / 128 keys against 3.73 ms), it is not power-capped
  there; D = 256: a float32 dQ tile of 64 rows would take 64 KB more shared memory and keeps the dQ kernel. Since
  session 49 D = 64 takes the warp-specialized fused launch from 128K keys (``FUSED_DQ_MIN_KEYS``), where the
  backward is power-capped: forward+backward 1.04x at 256K / 192K, 1.03x at 128K, 1.00x at 64K, 0.83x at 16K (H200,
  9 / 3 heads); since session 59, on nested pairs, from 64K keys (1.071x there, 0.875x at 16K).

The fused dK/dV warp-specialized (``dilated_bwd_dkdv_ws_kernel``, the default at head dim 128 and 64 from 64K keys;
``HF_DILATED_WS_DKDV=0`` keeps the program of 8 warps): a producer warp copies K / V once and each step's Q / dO into
two buffers; each consumer warpgroup owns 64 of the 128 keys, its ``S^T``, ``dP^T``, ``P^T``, ``dS^T`` and dK / dV
sums, and adds columns ``64 WG ..`` of each step's dQ share (``dS`` of all 128 keys times its half of K's columns, read
from shared memory). The two meet once a step, when both halves of ``dS^T`` are written (``ds_ready``); ``dS^T`` is
double-buffered, so a buffer's last readers (the step before last's dQ products) are done by then. Out of the 8-warp
program's CTA barriers, each warpgroup steps on its own between meetings. Same products in the same order: dK, dV
bit for bit those of the 8-warp program. To fit 240 registers (the 8-warp program has 255), lse / delta are read from
shared memory where they are used, ``dP^T`` is issued after the exponentials, and ``dS^T``'s double buffer keeps the
dQ product's operand descriptors from being hoisted out of the step loop and spilled (360 -> 80-108 bytes of spills,
4-7 reloads a step). Backward 1.02-1.04x at H 16 and 0.99-1.02x with GQA 32 / 8 (16K-256K, H100,
``results/ab_ws_dkdv_backward-dilated-session29-*``). Since session 48 ``P^T`` is the register A operand of the dV
product (where the 8-warp program keeps it in shared memory): one shared-memory tile, its stores and a proxy fence a
step fewer, spills 32-40 bytes, 2 reloads a step; forward+backward 1.03 / 1.04 / 1.05x at 64K / 256K / 16K (H 16) and
1.006x with GQA 32 / 8 on the H200, dK and dV unchanged bit for bit. Since session 49 launches with several query
heads a class (GQA's r = 1, 2) run here too: the program loops over the class's heads, Q / dO / dQ as 3-D descriptors
with the head a coordinate (``hopper.heads_desc``), one step count over all heads driving the buffers and barrier
phases; forward+backward 1.005x (32 / 8) and 1.02x (28 / 4) at 64K on the H200, dK and dV bit for bit. Since
session 60 at head dim 64 each consumer adds dQ of its own 64 keys over all columns instead (``OWN_DQ``): the two
never meet, and ``dS^T`` is one buffer a warpgroup; forward+backward 1.018x at 64K and 128K (9 / 3, H200), dK
and dV bit for bit. At 128 the same form spilled 132-200 bytes (a [64, 128] float32 dQ tile a consumer) and ran
0.93x / 0.87x (16 / 16, 32 / 8 at 64K); taken in two column halves one after the other, 80-128 bytes and 0.95x /
0.92x.
"""

from __future__ import annotations

import torch

from .hopper import (
    WS_LAUNCH, dkdv_buffers, dkdv_dq_products, dkdv_products, dkdv_scores, dq_first, dq_last, dq_step,
    fence_async_shared, first_selected, gl, gluon, heads_desc, item_query_tile, kv_descs, kv_prefetch, load_item,
    lse_base2, mbarrier, mma_layout, n_rows, nest_class_weights, nest_first_query, nest_pair_weights, nest_row,
    nest_row_weights, nest_scores, nest_weight, query_tile_buffers, query_tile_keys, register_product,
    release_barriers, row_desc, rows_copy, runnable, score_buffers, step_rows, switch, thread_barrier, tma, tma_load,
    tma_reduce_add, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait, written_before,
)

BLOCK_N = 64  # dilated key rows per program (one warpgroup)
BLOCK_Q = 64  # dilated query rows per step at D <= 128: n64 instructions for the transposed products
# dQ: (query rows per program, key rows per step, K buffers, V buffers, warps) by head dim. Not D = 64: there the
# Gluon dQ measured 0.98x of the portable one (H100, 64K, benchmarks/results/ab_gluon_dq-*), which runs there; on the
# H200 (session 50, forward+backward in one process) (64, 64, 3, 2, 4) ran 0.984x at 9 / 3 heads and 0.987x at 14 / 2
# (64K), 0.997x at 16K; (64, 128, 2, 2, 4) and (64, 64, 4, 4, 4) 0.94-0.96x. At D = 256 (8 / 2 heads, H200, session 53)
# 128 query rows on two warpgroups, one program an SM, each K / V tile read once for them: (128, 32, 2, 1, 8), 176 KB,
# 0.94x / 0.96x at 16K / 64K; (128, 32, 3, 2, 8), 208 KB, 1.00x / 1.01x; (128, 32, 4, 2, 8) 1.00x / 1.01x; (128, 64,
# 2, 1, 8), 224 KB, 1.01x / 1.03x / 1.03x at 16K / 64K / 256K (dQ bit-equal in each), kept in session 54 after its
# GPU tests (`-k "gemma or d256 or nan_query_row"` 13 passed, the whole GPU suite 135 passed). Its warp-specialized
# form (a producer warp, two 64-row consumer warpgroups, K / V buffers released by both; session 55) ran 0.956x /
# 0.958x at 16K / 64K, dQ bit-equal: the worker consumer gets 240 registers and spills in its loops (248: ptxas
# serializes the wgmma).
DQ_STEPS = {128: (64, 64, 3, 2, 4), 256: (128, 64, 2, 1, 8)}


# dK/dV: (PART, query rows per step) of each launch per branch, by head dim. At D = 256, dK and dV of 64 keys would
# take 256 float32 registers per thread of one warpgroup: one launch computes dV (2 products per tile pair, no V in
# shared memory: 96 KB at 32-query steps) and one dK (3 products), 5 products where D <= 128 runs 4 in one launch.
DKDV_STEPS = {64: ((0, BLOCK_Q),), 128: ((0, BLOCK_Q),), 256: ((1, 32), (2, 32))}  # measured (H100): the docstring
DKDV_HEAD_DIMS = tuple(DKDV_STEPS)
# Head dims whose dK/dV runs as one warp-specialized launch of two roles (``_dkdv_ws_role``: a dV warpgroup and a dK
# warpgroup on the same 64 keys) instead of ``DKDV_STEPS``' launch per gradient: query rows per step. At 256, 64 rows
# take 224 KB (K, V, two Q / dO buffers, two float32 P^T tiles) and ran forward+backward 1.07x as fast as 32 rows
# (144 KB; session 52, the module docstring). ``HF_DILATED_WS_DKDV=0`` keeps the launches per gradient.
ROLES_STEPS = {256: 64}
# dK/dV with the step's dQ (``FUSED_DQ``): (key rows per program, query rows per step, warps) by head dim. 128 keys on
# two warpgroups, FA3's tile: each dQ share added to the sums covers 128 keys, and K, V, Q, dO, P^T, dS^T and the dQ
# tile take 192 KB, one program per SM. D = 64 only from FUSED_DQ_MIN_KEYS keys. Not D = 256: there the roles
# (``ROLES_STEPS``) with dQ^T = K^T dS^T added at 32-query steps (185 KB; branch ``s52-d256-fused-dq``) ran
# forward+backward 0.89x / 0.98x at 16K / 64K with dQ in the dK warpgroup, and 0.94x / 1.01x / 1.01x / 1.02x at 16K /
# 64K / 128K / 256K with dQ^T's halves split between the two warpgroups (8 / 2 heads, H200, session 53).
FUSED_DQ_STEPS = {64: (128, 64, 8), 128: (128, 64, 8)}
# Head dim 64 (9 / 3 heads, forward+backward, H200, session 49): 0.83x at 16K (half the 64-key programs do not fill
# the GPU), 1.00x at 64K, 1.03x at 128K, 1.04x at 192K and 256K (there the backward runs at the 700 W cap, and fewer
# products mean a higher clock). Session 50: 0.988x at 64K with 9 / 3 and with 14 / 2 heads; 128-query steps at D = 64
# (192 KB, 168-340 bytes of spills) 0.96-0.97x at 64K, 0.80x at 16K. Session 59, with the fused launch on nested pairs
# (the separate path's portable dQ takes every pair): 1.071x at 64K, 0.875x at 16K (9 / 3; 32K not measured).
FUSED_DQ_MIN_KEYS = {64: 65536}


def applies(q: torch.Tensor, flags: dict, tma: bool) -> bool:
    """Whether the dilated backward may run these kernels: ``hopper.runnable`` (the switch, sm_90, the
    tensor-descriptor path, not the interpreter), bf16 / fp16, no sliding window, no dropout (``flags``: the
    launchers' constexpr flags; holes never reach here, they turn the descriptor path off). Which of the two runs at
    the call's head dim: ``dkdv_launch_configs`` / ``dq_launch_config``."""
    return (
        runnable(tma)
        and q.dtype in (torch.bfloat16, torch.float16)
        and (q.shape[-1] in DKDV_HEAD_DIMS or q.shape[-1] in DQ_STEPS)
        and not flags["WINDOW"]
        and not flags["DROPOUT"]
        and not flags["HOLES"]
    )


if gluon is not None:

    @gluon.jit
    def _key_tile(T, n_tiles, n_classes, group, head_offset, r, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, NESTED: gl.constexpr = False, below=0):
        """What a dK/dV program's grid place means (the portable kernel's grid): its kv head ``kvh`` and the class's
        first query head ``h0``, its segment item (batch row, query / key column bases), the offset class's first key
        position and dilated key rows ``k_first`` / ``n_k``, the tile's first dilated key row ``j_first`` and last
        key position ``kp_max``, the class's first query position and rows ``q_first`` / ``n_q``, and the 64-query
        steps from dilated query row ``start_q`` (queries before the tile's first key see none of it) that see the
        tile: ``n_steps``, 0 where it holds no keys. ``NESTED``: a nested branch's queries, those after the keys'
        ``below``-segment (``tiles.nest_first_query``)."""
        pid = gl.program_id(0)
        item = pid // n_tiles
        tile = pid % n_tiles
        hc = gl.program_id(1)
        kvh = hc // n_classes
        h0 = kvh * group + hc % n_classes
        b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, item)
        off = (h0 + head_offset) % r
        k_first = first_selected(k_lo, off, r)
        n_k = n_rows(k_first, k_hi, r)
        j_first = tile * BLOCK_N  # this tile's first dilated key row
        kp_min = k_first + j_first * r
        kp_max = gl.minimum(kp_min + (BLOCK_N - 1) * r, k_hi - 1)
        q_first = first_selected(q_lo, off, r)
        n_q = n_rows(q_first, q_hi, r)
        lo = q_lo
        if IS_CAUSAL:
            lo = gl.maximum(lo, kp_min)
        j0 = gl.where(lo > q_first, (lo - q_first) // r, 0)  # queries before ``lo`` see none of the tile's keys
        if NESTED:  # from the first query row at or after the keys' next segment of the branch below, exactly: no
            # step may hold rows before it (the Gluon kernels have no mask for them)
            j0 = n_rows(q_first, gl.maximum(lo, nest_first_query(kp_min, below)), r)
        start_q = (j0 // BLOCK_Q) * BLOCK_Q
        n_steps = gl.where(j_first < n_k, gl.maximum(n_q - start_q + BLOCK_Q - 1, 0) // BLOCK_Q, 0)  # 0: no keys
        return kvh, h0, b, qbase, kbase, k_first, n_k, j_first, kp_max, q_first, n_q, start_q, n_steps

    @gluon.jit
    def _full_from(kp_max, q_first, r, IS_CAUSAL: gl.constexpr, NESTED: gl.constexpr, below):
        """The first dilated query row from which a dK/dV step sees every key of the tile (keys up to ``kp_max``)."""
        full_from = 0
        if NESTED:
            full_from = n_rows(q_first, nest_first_query(kp_max, below), r)
        elif IS_CAUSAL:
            full_from = gl.maximum(kp_max - q_first + r - 1, 0) // r
        return full_from

    @gluon.jit
    def _nest_head(h, kidx, j_first, nest, r, qk_scale, s_zero, NEST_T: gl.constexpr):
        """A dK/dV program's nested weights for query head ``h`` (``tiles.nest_weight``): its key rows' (``kidx``
        from ``j_first``, the score tile's rows) and its query columns' by class (``hopper.nest_class_weights``: the
        steps start at multiples of their rows, which ``NEST_T`` divides). ``nest``: ``(NEST, below, k_first,
        q_first, head_offset)``."""
        NEST, below, k_first, q_first, head_offset = nest
        inv = 1.0 / qk_scale
        return (nest_row_weights(s_zero, k_first + (j_first + kidx) * r, h, head_offset, NEST, inv, NEST_T),
                nest_class_weights(s_zero, q_first, h, head_offset, r, NEST, inv, NEST_T))

    @gluon.jit
    def _nest_rows(h0, r, j_first, start_q, nest, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_Q: gl.constexpr):
        """The fused dK/dV's nested weights (``tiles.nest_weight``, base 2), made before the partitions split, for each
        of the class's heads: its key rows' and its first step's query columns' as shared rows ``[HEADS, BLOCK_N]``
        and ``[HEADS, BLOCK_Q]``. A consumer holds its key rows' (2 registers a thread) and reads the query row each
        step in the score tile's column layout, as lse and delta are; the steps start ``BLOCK_Q`` apart, a multiple
        of every class period, so every step's columns have the first step's weights. Made in the consumers, or held
        in ``hopper.nest_scores``' ``[M, N / T, T]`` class form, they spilled 148-364 bytes and ptxas serialized the
        wgmma (NOTES_triton, sessions 57-59)."""
        NEST, below, k_first, q_first, head_offset = nest
        layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        wq = gl.allocate_shared_memory(gl.float32, [HEADS, BLOCK_Q], layout)
        wk = gl.allocate_shared_memory(gl.float32, [HEADS, BLOCK_N], layout)
        rows: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        for g in gl.static_range(HEADS):
            h = h0 + g * r
            wq.index(g).store(nest_weight(q_first + (start_q + gl.arange(0, BLOCK_Q, layout=rows)) * r, h,
                                          head_offset, NEST, 1.0))
            wk.index(g).store(nest_weight(k_first + (j_first + gl.arange(0, BLOCK_N, layout=rows)) * r, h,
                                          head_offset, NEST, 1.0))
        return nest + (wq, wk)

    @gluon.jit
    def dilated_bwd_dkdv_hopper_kernel(
        Q, K, V, DO, L, Delta, DK, DV, DK_OUT, DV_OUT, DQ, PREV, T, NESTS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_db, stride_dh, stride_dn,
        stride_lb, stride_lh,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        stride_xkb, stride_xkh, stride_xkn,
        stride_xvb, stride_xvh, stride_xvn,
        stride_dqb, stride_dqh, stride_dqn,
        head_offset, group, n_classes, r, scale, qk_scale, n_tiles, n_prev, nest_i,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr,
        IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, PART: gl.constexpr, FUSED_DQ: gl.constexpr,
        num_warps: gl.constexpr, NESTED: gl.constexpr = False, NEST_T: gl.constexpr = 1,
    ):
        """dK and dV of one tile of ``BLOCK_N`` dilated key rows of one segment item, for one kv head and offset
        class (the query heads ``h0, h0 + r, ...`` of its GQA group read the same key rows), added to the rows of
        ``DK`` / ``DV`` earlier launches wrote (``MERGE``), stored there or, ``LAST``, to ``DK_OUT`` / ``DV_OUT``.
        ``PART`` 0: both; 1: dV alone (``S^T``, ``dV += P^T dO``: no V); 2: dK alone (``S^T``, ``dP^T``,
        ``dK += dS^T Q``): one accumulator per program where two do not fit the registers (head dim 256).
        ``FUSED_DQ`` (with ``PART`` 0): each step also computes the step's share of dQ, ``dS K`` of its queries, and
        adds it to the float32 sums ``DQ`` by a TMA reduce-add (FA3's scheme): no dQ kernel, which would compute
        ``S`` and ``dP`` again. ``NESTED``: a nested branch's pairs and weights (row ``nest_i`` of ``NESTS``)."""
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_Q)
        g_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, HEAD_DIM], dtype)
        p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_Q], dtype)
        key_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_axis: gl.constexpr = gl.SliceLayout(0, s_layout)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)  # P^T, dS^T
        # dQ's step tile (queries x head dim): its columns split over the warpgroups, each one m64 instruction
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, HEAD_DIM // (num_warps // 4), 16])
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, HEAD_DIM], gl.float32)

        NEST, below = nest_row(NESTS, nest_i, NESTED)
        kvh, h0, b, qbase, kbase, k_first, n_k, j_first, kp_max, q_first, n_q, start_q, n_steps = _key_tile(
            T, n_tiles, n_classes, group, head_offset, r, BLOCK_N, BLOCK_Q, IS_CAUSAL, NESTED, below)
        nest = (NEST, below, k_first, q_first, head_offset)

        k_smem, v_smem, q_smem, do_smem, kv_bar, ready = dkdv_buffers(
            dtype, kv_smem_layout, q_smem_layout, BLOCK_N, BLOCK_Q, HEAD_DIM, PART)
        if FUSED_DQ:
            p_smem, ds_smem = score_buffers(dtype, p_smem_layout, BLOCK_N, BLOCK_Q)
            dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_Q, HEAD_DIM], dq_smem_layout)

        # K and V: the item's dilated key rows (row stride r rows, zeros past the last), read once.
        kvh64 = kvh.to(gl.int64)
        k0 = (kbase + k_first).to(gl.int64)
        n_desc = gl.maximum(n_k, 1)
        k_desc = row_desc(K + b * stride_kb + kvh64 * stride_kh + k0 * stride_kn, n_desc, r * stride_kn, BLOCK_N,
                          HEAD_DIM, kv_smem_layout)
        v_desc = row_desc(V + b * stride_vb + kvh64 * stride_vh + k0 * stride_vn, n_desc, r * stride_vn, BLOCK_N,
                          HEAD_DIM, kv_smem_layout)
        has_keys = j_first < n_k  # else nothing is read (the descriptor's one row may lie past the tensor)
        if has_keys:
            if PART == 1:  # dV alone: no V
                mbarrier.expect(kv_bar, BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
                tma_load(k_desc, [j_first, 0], kv_bar, k_smem)
            else:
                mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
                tma_load(k_desc, [j_first, 0], kv_bar, k_smem)
                tma_load(v_desc, [j_first, 0], kv_bar, v_smem)

        tile_bytes: gl.constexpr = 2 * BLOCK_Q * HEAD_DIM * dtype.primitive_bitwidth // 8
        kidx = gl.arange(0, BLOCK_N, layout=key_axis)
        # Keys and queries of one offset class: key row j_first + a is at or before query row q_cur + b iff
        # a <= b + q_cur + shift. Steps from query row ``full_from`` on see every key of the tile. No other mask is
        # needed: rows past the item's last query read as zeros (Q, dO by TMA; lse, delta masked to 0), so they add
        # nothing, and rows past its last key are never stored.
        shift = (q_first - k_first) // r - j_first
        full_from = _full_from(kp_max, q_first, r, IS_CAUSAL, NESTED, below)
        vrows = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        s_zero = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, layout=s_layout)
        if PART == 0:
            dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
            dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
        else:
            acc = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
        if has_keys:
            mbarrier.wait(kv_bar, 0)

        q0_row = (qbase + q_first).to(gl.int64)
        n_qdesc = gl.maximum(n_q, 1)
        it = 0  # steps issued over all heads: buffer it % 2, its barrier's phase (it // 2) % 2
        # The class's query heads h0, h0 + r, ... below the group's end: at most HEADS (a constexpr, so that with one
        # head per class there is no loop at all: Triton 3.6 then keeps the loop's values in registers instead of
        # spilling 150 bytes of them); a class with fewer runs no step for the rest.
        for g in range(0, HEADS):
            h = h0 + g * r
            n_steps_h = gl.where(h < (kvh + 1) * group, n_steps, 0)
            h64 = h.to(gl.int64)
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh + q0_row * stride_qn, n_qdesc, r * stride_qn,
                              BLOCK_Q, HEAD_DIM, q_smem_layout)
            do_desc = row_desc(DO + b * stride_db + h64 * stride_dh + q0_row * stride_dn, n_qdesc, r * stride_dn,
                               BLOCK_Q, HEAD_DIM, q_smem_layout)
            if FUSED_DQ:
                if g > 0:  # the last head's reduce-adds have read the descriptor this one replaces (its scratch slot)
                    tma.store_wait(0)
                dq_desc = row_desc(DQ + b * stride_dqb + h64 * stride_dqh + q0_row * stride_dqn, n_qdesc,
                                   r * stride_dqn, BLOCK_Q, HEAD_DIM, dq_smem_layout)
            l_row = L + b * stride_lb + h64 * stride_lh + q0_row
            dl_row = Delta + b * stride_lb + h64 * stride_lh + q0_row
            weights = 0
            if NESTED:
                weights = _nest_head(h, kidx, j_first, nest, r, qk_scale, s_zero, NEST_T)
            # Prologue: the first query tile's Q / dO by TMA, its lse / delta into registers (a step ahead).
            q_cur = start_q
            lse_next, delta_next = step_rows(l_row, dl_row, q_cur, vrows, n_q, r, n_steps_h > 0)
            if n_steps_h > 0:
                buf = it % 2
                mbarrier.expect(ready.index(buf), tile_bytes)
                tma_load(q_desc, [q_cur, 0], ready.index(buf), q_smem.index(buf))
                tma_load(do_desc, [q_cur, 0], ready.index(buf), do_smem.index(buf))
            for s in range(0, n_steps_h):
                buf = it % 2
                lse = gl.convert_layout(lse_base2(lse_next), query_axis)
                delta = gl.convert_layout(delta_next, query_axis)
                needs_mask = q_cur < full_from  # some key of the tile after some query of the step
                q_step = q_cur
                diag = q_cur + shift
                mbarrier.wait(ready.index(buf), (it // 2) % 2)
                qs = q_smem.index(buf)
                dos = do_smem.index(buf)
                if PART == 0:
                    sT, dpT, dk, dv = dkdv_scores(k_smem, v_smem, qs, dos, s_zero, dk, dv)
                elif PART == 1:  # S^T alone
                    sT = warpgroup_mma(k_smem, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    sT, acc = warpgroup_mma_wait(num_outstanding=0, deps=(sT, acc))
                else:  # S^T and dP^T
                    sT = warpgroup_mma(k_smem, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    dpT = warpgroup_mma(v_smem, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    sT, acc = warpgroup_mma_wait(num_outstanding=1, deps=(sT, acc))
                if s + 1 < n_steps_h:
                    q_cur = q_cur + BLOCK_Q
                    nbuf = 1 - buf
                    mbarrier.expect(ready.index(nbuf), tile_bytes)
                    tma_load(q_desc, [q_cur, 0], ready.index(nbuf), q_smem.index(nbuf))
                    tma_load(do_desc, [q_cur, 0], ready.index(nbuf), do_smem.index(nbuf))
                    lse_next, delta_next = step_rows(l_row, dl_row, q_cur, vrows, n_q, r, True)
                if NESTED:
                    sT = nest_scores(sT, weights[0], weights[1], NEST_T)
                pT = gl.exp2(sT * qk_scale - lse[None, :])
                if needs_mask:
                    qidx = gl.arange(0, BLOCK_Q, layout=query_axis)
                    pT = gl.where(kidx[:, None] <= (qidx + diag)[None, :], pT, 0.0)
                if FUSED_DQ:
                    dk, dv = dkdv_dq_products(pT, dpT, delta, qs, dos, k_smem, p_smem, ds_smem, dq_smem, dq_desc,
                                              dk, dv, q_step, scale, dtype, dq_layout, BLOCK_Q, HEAD_DIM)
                elif PART == 0:
                    dk, dv = dkdv_products(pT, dpT, delta, qs, dos, dk, dv, dtype, a_layout)
                elif PART == 1:  # dV += P^T dO
                    acc = register_product(pT, dos, acc, dtype, a_layout)
                else:  # dK += dS^T Q
                    dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dpT,))
                    acc = register_product(pT * (dpT - delta[None, :]), qs, acc, dtype, a_layout)
                it += 1
        if PART == 0:
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if FUSED_DQ:
            tma.store_wait(0)  # the last reduce has read its tile
        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))

        out = (DK, DV, DK_OUT, DV_OUT, PREV, kvh64, kvh * group, group, head_offset, n_prev, kbase, k_first, n_k,
               stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_xkb, stride_xkh,
               stride_xkn, stride_xvb, stride_xvh, stride_xvn)
        if PART == 0:
            _finish_keys(dk, dv, j_first, b, r, scale, out, BLOCK_N, HEAD_DIM, g_layout, MERGE, LAST, n_steps == 0)
        elif PART == 1:
            _finish_keys(None, acc, j_first, b, r, scale, out, BLOCK_N, HEAD_DIM, g_layout, MERGE, LAST,
                         n_steps == 0)
        else:
            _finish_keys(acc, None, j_first, b, r, scale, out, BLOCK_N, HEAD_DIM, g_layout, MERGE, LAST,
                         n_steps == 0)

    @gluon.jit
    def dilated_bwd_dq_hopper_kernel(
        Q, K, V, DO, L, Delta, DQ, DQ_OUT, PREV, T, NESTS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_db, stride_dh, stride_dn,
        stride_lb, stride_lh,
        stride_dqb, stride_dqh, stride_dqn,
        stride_xqb, stride_xqh, stride_xqn,
        head_offset, group, r, scale, qk_scale, n_tiles, n_prev, nest_i,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
        V_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr,
        num_warps: gl.constexpr, NESTED: gl.constexpr = False, NEST_T: gl.constexpr = 1,
    ):
        """dQ of one tile of ``BLOCK_M`` dilated query rows of one segment item and head (Q, dO, lse and delta
        resident), over the key tiles it sees (``hopper.dq_step``), added to the rows earlier launches wrote
        (``MERGE``), stored to ``DQ`` or, ``LAST``, to ``DQ_OUT``: the portable dq kernel's grid and contract.
        ``NESTED``: a nested branch's pairs and weights (row ``nest_i`` of ``NESTS``, as the forward's)."""
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
        g_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        row_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        g_rows: gl.constexpr = gl.SliceLayout(1, g_layout)
        NBYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = query_tile_buffers(
            dtype, q_smem_layout, kv_smem_layout, BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_smem_layout)  # dO's tile, Q's barrier

        b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = item_query_tile(
            T, n_tiles, head_offset, r, BLOCK_M, IS_CAUSAL)
        if p_min < q_hi:
            NEST, below = nest_row(NESTS, nest_i, NESTED)
            k_first, n_k, n_plain, n_kt, shift = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, BLOCK_M, BLOCK_N,
                                                                 IS_CAUSAL, NESTED, below)
            kvh = (h // group).to(gl.int64)
            h64 = h.to(gl.int64)
            q0 = (qbase + q_first).to(gl.int64)
            n_q = n_rows(q_first, q_hi, r)
            q_desc = row_desc(Q + b * stride_qb + h64 * stride_qh + q0 * stride_qn, n_q, r * stride_qn, BLOCK_M,
                              HEAD_DIM, q_smem_layout)
            do_desc = row_desc(DO + b * stride_db + h64 * stride_dh + q0 * stride_dn, n_q, r * stride_dn, BLOCK_M,
                               HEAD_DIM, q_smem_layout)
            k_desc, v_desc = kv_descs(K, V, b, kvh, kbase, k_first, n_k, stride_kb, stride_kh, stride_kn, stride_vb,
                                      stride_vh, stride_vn, r, BLOCK_N, HEAD_DIM, kv_smem_layout)
            mbarrier.expect(q_bar, 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma_load(q_desc, [row0, 0], q_bar, q_smem)
            tma_load(do_desc, [row0, 0], q_bar, do_smem)
            kv_prefetch(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, n_kt, BLOCK_N, K_STAGES, V_STAGES, NBYTES)

            # lse (base 2; a row that saw no key reads 0) and delta of the tile's rows (rows past the item's last
            # query read as zeros, as their Q and dO do: they add nothing and are never stored).
            qidx = gl.arange(0, BLOCK_M, layout=row_axis)
            qrow = row0 + qidx
            qmask = qrow < n_q
            l_rows = b * stride_lb + h64 * stride_lh + q0 + qrow.to(gl.int64) * r
            lse = gl.load(L + l_rows, mask=qmask, other=0.0)
            lse = lse_base2(lse)
            delta = gl.load(Delta + l_rows, mask=qmask, other=0.0)
            kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
            dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)
            nest = 0.0
            if NESTED:  # the pairs' weights by (row, key class), the forward's
                nest = nest_pair_weights(s_zero, p_min + qidx * r, k_first, h, head_offset, r, NEST, NEST_T)
            mbarrier.wait(q_bar, 0)
            if n_kt > 0:
                ds = dq_first(n_kt, q_smem, do_smem, k_smem, v_smem, k_bar, v_bar, v_desc, s_zero, lse, delta,
                              qk_scale, n_plain == 0, n_k, shift, qidx, kidx, ds_layout, BLOCK_N, V_STAGES, NBYTES,
                              IS_CAUSAL, nest, NEST_T)
                for j in range(1, n_plain):
                    dq, ds = dq_step(j, n_kt, q_smem, do_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, dq, ds,
                                     s_zero, lse, delta, qk_scale, False, n_k, shift, qidx, kidx, ds_layout, BLOCK_N,
                                     K_STAGES, V_STAGES, NBYTES, False, IS_CAUSAL, nest, NEST_T)
                for j in range(gl.maximum(n_plain, 1), n_kt):
                    dq, ds = dq_step(j, n_kt, q_smem, do_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, dq, ds,
                                     s_zero, lse, delta, qk_scale, True, n_k, shift, qidx, kidx, ds_layout, BLOCK_N,
                                     K_STAGES, V_STAGES, NBYTES, True, IS_CAUSAL, nest, NEST_T)
                dq = dq_last(n_kt, k_smem, dq, ds, K_STAGES)

            # The portable kernel's epilogue: scale, add the rows earlier launches wrote, store.
            qp = p_min + gl.arange(0, BLOCK_M, layout=g_rows) * r
            in_range = qp < q_hi
            qc64 = (qbase + qp).to(gl.int64)[:, None]
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
            seen = in_range
            if MERGE:
                seen = in_range & written_before(qp, h, head_offset, PREV, n_prev, 1)
            _finish(dq * scale, DQ + b * stride_dqb + h64 * stride_dqh, DQ_OUT + b * stride_xqb + h64 * stride_xqh,
                    qc64, d, in_range, seen, stride_dqn, stride_xqn, MERGE, LAST)
        release_barriers(q_bar, k_bar, v_bar, K_STAGES, V_STAGES)

    # ---- the warp-specialized dK/dV (128 / 64: fused with dQ; 256: two roles; any number of query heads a class) ---
    # ``dilated_bwd_dkdv_hopper_kernel``'s FUSED_DQ program (128 keys, 64-query steps, dQ by TMA reduce-add) with its
    # roles split: a producer warp copies K / V once and each step's Q / dO (two buffers, released by both consumers),
    # and each consumer warpgroup owns 64 of the keys. A consumer's dV / dK products, its P^T (in registers) / dS^T and
    # its dK / dV sums are its own; the step's dQ needs dS^T of all 128 keys, so the two meet once a step
    # (``ds_ready``: both halves written, in buffer it % 2) and each adds its half of dQ's columns (at head dim 64 each
    # adds dQ of its own keys over all columns instead, and they never meet: ``OWN_DQ``). With several query
    # heads a class the steps of head g follow those of head g - 1 (step ``it = g * n_steps + s``). Without FUSED_DQ
    # (head dim 256, whose dK and dV do not fit one warpgroup together) the warpgroups share 64 keys and take a gradient
    # each (``_dkdv_ws_role``), the same producer feeding them.

    @gluon.jit
    def _dkdv_ws_producer(steps, bufs, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr, q_desc,
                          do_desc, k_desc, v_desc):
        """K and V of the program's keys, then each step's Q and dO into buffer ``it % 2`` once both consumers
        released its last use (``it``: the step over all of the class's heads; with several heads a class, ``HEADS``,
        Q / dO are ``heads_desc`` s over the class's heads, the head a coordinate). ``steps`` and ``bufs``: the
        kernel's comment."""
        h0, n_heads, r, n_q, q0_row, start_q, n_steps, j_first, shift, full_from, b, scale, qk_scale = steps
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, rows_smem, kv_bar, ready, empty, ds_ready = bufs
        dtype: gl.constexpr = k_smem.dtype
        BLOCK_N: gl.constexpr = k_smem.shape[0]
        TILE_BYTES: gl.constexpr = BLOCK_Q * HEAD_DIM * dtype.primitive_bitwidth // 8
        if n_steps > 0:
            mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma_load(k_desc, [j_first, 0], kv_bar, k_smem)
            tma_load(v_desc, [j_first, 0], kv_bar, v_smem)
        # a constexpr bound: with one head a class Triton folds the loop away (its values stay in registers)
        for g in range(0, HEADS):  # the class's heads h0, h0 + r, ... in the kv head's group
            n_steps_h = gl.where(g < n_heads, n_steps, 0)
            head = None
            if HEADS > 1:  # Q / dO are heads_desc s: the head a coordinate
                head = g
            q_cur = start_q
            for s in range(n_steps_h):
                it = g * n_steps + s
                buf = it % 2
                mbarrier.wait(empty.index(buf), ((it // 2) & 1) ^ 1)
                mbarrier.expect(ready.index(buf), 2 * TILE_BYTES)
                rows_copy(q_desc, q_cur, head, ready.index(buf), q_smem.index(buf))
                rows_copy(do_desc, q_cur, head, ready.index(buf), do_smem.index(buf))
                q_cur += BLOCK_Q

    @gluon.jit
    def _ws_head_rows(g, n_heads, n_steps, h0, r, rows, b, q0_row, start_q, vrows, n_q, kv_bar):
        """A consumer's start of the class's ``g``-th query head (``h0 + g r``): its steps (none past the class's
        ``n_heads``), its lse / delta rows (``rows``: the lse and delta tensors and their strides) and their first
        step's values (read a step ahead); before the first head's first step, the wait for K / V (after those loads
        are on their way)."""
        L, Delta, stride_lb, stride_lh = rows
        n_steps_h = gl.where(g < n_heads, n_steps, 0)
        h64 = (h0 + g * r).to(gl.int64)
        l_row = L + b * stride_lb + h64 * stride_lh + q0_row
        dl_row = Delta + b * stride_lb + h64 * stride_lh + q0_row
        lse_next, delta_next = step_rows(l_row, dl_row, start_q, vrows, n_q, r, n_steps_h > 0)
        if g == 0 and n_steps > 0:  # K / V landed
            mbarrier.wait(kv_bar, 0)
        return n_steps_h, l_row, dl_row, lse_next, delta_next

    @gluon.jit
    def _dkdv_ws_consumer(steps, rows, out, bufs, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr,
                          IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, WG: gl.constexpr, dq_desc,
                          nest, NESTED: gl.constexpr, NEST_T: gl.constexpr, OWN_DQ: gl.constexpr):
        """dK and dV of keys ``64 WG ..`` of the program's tile, and the warpgroup's part of each step's dQ share
        (``dq_desc``; at head dim 128 columns ``HEAD_DIM / 2 * WG ..``): ``hopper.dkdv_dq_products``'s products, each
        summed in the same order (``dP^T`` is issued after the exponentials rather than beside ``S^T``: 32 registers
        fewer while they run). ``P^T`` is the register A operand of ``dV += P^T dO``, held until the step's dQ wait
        retires it: no shared-memory tile, store or proxy fence for it (session 48: spills 80-108 -> 32-40 bytes,
        forward+backward 1.03-1.05x at H 16, dK / dV bit for bit as before). ``dS^T`` also goes to shared memory: the dQ
        product reads it transposed. ``NESTED``: a nested branch's pairs and weights (``nest[5:]``: ``_nest_rows``'
        query and key rows). ``OWN_DQ`` (head dim 64): each consumer adds dQ of its own 64 keys over all columns
        instead, so the two never meet and ``dS^T`` is a warpgroup's own, in one buffer (its one reader, the step's dQ
        product, retires within the step). At both head dims ``dK += dS^T Q`` takes ``dS^T`` from registers too, issued
        before ``dS^T`` goes to shared memory for dQ, and the step's three products are retired together."""
        h0, n_heads, r, n_q, q0_row, start_q, n_steps, j_first, shift, full_from, b, scale, qk_scale = steps
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, rows_smem, kv_bar, ready, empty, ds_ready = bufs
        dtype: gl.constexpr = k_smem.dtype
        KW: gl.constexpr = 64  # keys per warpgroup
        DH: gl.constexpr = HEAD_DIM if OWN_DQ else HEAD_DIM // 2  # dQ columns per warpgroup
        s_layout: gl.constexpr = mma_layout(4, BLOCK_Q)
        g_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
        dq_layout: gl.constexpr = mma_layout(4, DH)
        key_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_axis: gl.constexpr = gl.SliceLayout(0, s_layout)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)  # P^T, dS^T
        k_w = k_smem.slice(WG * KW, KW)
        v_w = v_smem.slice(WG * KW, KW)
        if OWN_DQ:  # dQ of the warpgroup's keys, all columns
            k_cols = k_w
            ds_w = ds_smem.slice(WG * KW, KW)
        else:  # dQ of all 128 keys, the warpgroup's half of the columns
            k_cols = k_smem.slice(WG * DH, DH, dim=1)
        dq_w = dq_smem.index(WG)
        kidx = WG * KW + gl.arange(0, KW, layout=key_axis)
        vrows = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [4], [0]))
        s_zero = gl.zeros([KW, BLOCK_Q], gl.float32, layout=s_layout)
        dk = warpgroup_mma_init(gl.zeros([KW, HEAD_DIM], gl.float32, layout=g_layout))
        dv = warpgroup_mma_init(gl.zeros([KW, HEAD_DIM], gl.float32, layout=g_layout))
        lse_w = rows_smem[2 * WG]
        delta_w = rows_smem[2 * WG + 1]
        for g in range(0, HEADS):  # as the producer's: the class's heads h0, h0 + r, ... in the group
            n_steps_h, l_row, dl_row, lse_next, delta_next = _ws_head_rows(
                g, n_heads, n_steps, h0, r, rows, b, q0_row, start_q, vrows, n_q, kv_bar)
            wk = 0.0
            if NESTED and NEST_T > 1:  # this head's key rows' weights; its query columns' read each step
                wq_rows, wk_rows = nest[5:]  # _nest_rows' shared rows, after the nest columns
                wq_w = wq_rows.index(g)
                wk = wk_rows.index(g).slice(WG * KW, KW).load(key_axis)
            q_cur = start_q
            for s in range(n_steps_h):
                it = g * n_steps + s  # the step over all heads: buffer it % 2, the barriers' phases
                buf = it % 2
                lse_w.store(lse_base2(lse_next))
                delta_w.store(delta_next)
                needs_mask = q_cur < full_from
                diag = q_cur + shift
                mbarrier.wait(ready.index(buf), (it // 2) & 1)
                qs = q_smem.index(buf)
                dos = do_smem.index(buf)
                sT = warpgroup_mma(k_w, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                # (the last step retired its dK and dV)
                sT, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(sT, dk, dv))
                if it > 0:  # the last step's Q / dO are read by every product that reads them
                    mbarrier.arrive(empty.index(1 - buf), count=1)
                if s + 1 < n_steps_h:
                    lse_next, delta_next = step_rows(l_row, dl_row, q_cur + BLOCK_Q, vrows, n_q, r, True)
                pT = sT * qk_scale - lse_w.load(query_axis)[None, :]
                if NESTED and NEST_T > 1:  # each pair's weight, min of its key's and query's, in the exponent
                    pT = pT + gl.minimum(wk[:, None], wq_w.load(query_axis)[None, :])
                pT = gl.exp2(pT)
                if needs_mask:
                    qidx = gl.arange(0, BLOCK_Q, layout=query_axis)
                    pT = gl.where(kidx[:, None] <= (qidx + diag)[None, :], pT, 0.0)
                dpT = warpgroup_mma(v_w, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                pa = gl.convert_layout(pT.to(dtype), a_layout)
                dv = warpgroup_mma(pa, dos, dv, is_async=True)
                dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
                ds = (pT * (dpT - delta_w.load(query_axis)[None, :])).to(dtype)
                # dK += dS^T Q from registers (as dV's P^T), issued before the hand-over below: the product runs
                # under the store, the proxy fence and (head dim 128) the meeting (session 61: 1.001-1.022x)
                dsa = gl.convert_layout(ds, a_layout)
                dk = warpgroup_mma(dsa, qs, dk, is_async=True)
                if OWN_DQ:  # its one dS^T buffer's reader, the last step's dQ product, is done
                    ds_w.store(ds)
                    fence_async_shared()
                    thread_barrier()
                    ds_all = ds_w
                else:
                    # dS^T in buffer it % 2: its last readers, the step before last's dQ products, are done (each
                    # warpgroup's retired before it arrived at the last step's ds_ready, which this one has passed)
                    ds_all = ds_smem.index(buf)
                    ds_w = ds_all.slice(WG * KW, KW)
                    ds_w.store(ds)
                    fence_async_shared()
                    thread_barrier()
                    mbarrier.arrive(ds_ready, count=1)
                    mbarrier.wait(ds_ready, it & 1)  # both halves of dS^T written
                dq_zero = gl.zeros([BLOCK_Q, DH], gl.float32, layout=dq_layout)
                dq = warpgroup_mma(ds_all.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
                # dV, dK and dQ together (frees P^T's and dS^T's registers)
                dq, pa, dsa, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, pa, dsa, dk))
                dk = warpgroup_mma_init(dk)
                tma.store_wait(0)  # the last step's reduce has read the tile
                dq_w.store(dq * scale)
                fence_async_shared()
                if HEADS > 1:  # dq_desc: a heads_desc over the class's heads
                    tma_reduce_add(dq_desc, [g, q_cur, 0], dq_w.reshape([1, BLOCK_Q, DH]))
                else:
                    tma_reduce_add(dq_desc, [q_cur, 0], dq_w)
                q_cur += BLOCK_Q
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        tma.store_wait(0)

        _finish_keys(dk, dv, j_first + WG * KW, b, r, scale, out, KW, HEAD_DIM, g_layout, MERGE, LAST, n_steps == 0)

    @gluon.jit
    def _dkdv_ws_role(steps, rows, out, bufs, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr,
                      IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, WG: gl.constexpr, pt_smem,
                      pt_ready, pt_empty, nest, NESTED: gl.constexpr, NEST_T: gl.constexpr):
        """Without ``FUSED_DQ`` (head dim 256): the warpgroups share the program's 64 keys and split the gradients.
        ``WG`` 0 computes ``S^T``, ``P^T`` and ``dV += P^T dO`` and hands ``P^T`` (float32, buffer ``it % 2``) to
        ``WG`` 1, which computes ``dP^T``, ``dS^T`` and ``dK += dS^T Q``: four products a step where one warpgroup
        each for dV and dK (``PART`` 1 / 2, two launches) computed ``S^T`` twice, and K / Q / dO are read once. Each
        product as those launches compute it, so dK and dV are theirs bit for bit. ``NESTED``: ``WG`` 0 weights
        ``P^T``'s scores as ``_dkdv_ws_consumer`` does."""
        h0, n_heads, r, n_q, q0_row, start_q, n_steps, j_first, shift, full_from, b, scale, qk_scale = steps
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, rows_smem, kv_bar, ready, empty, ds_ready = bufs
        dtype: gl.constexpr = k_smem.dtype
        BLOCK_N: gl.constexpr = k_smem.shape[0]
        s_layout: gl.constexpr = mma_layout(4, BLOCK_Q)
        g_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
        key_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_axis: gl.constexpr = gl.SliceLayout(0, s_layout)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)  # P^T, dS^T
        kidx = gl.arange(0, BLOCK_N, layout=key_axis)
        vrows = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [4], [0]))
        s_zero = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, layout=s_layout)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=g_layout))
        row_w = rows_smem[WG]  # lse (base 2) for WG 0, delta for WG 1
        for g in range(0, HEADS):  # as the producer's: the class's heads h0, h0 + r, ... in the group
            n_steps_h, l_row, dl_row, lse_next, delta_next = _ws_head_rows(
                g, n_heads, n_steps, h0, r, rows, b, q0_row, start_q, vrows, n_q, kv_bar)
            weights = 0
            if NESTED and WG == 0:
                weights = _nest_head(h0 + g * r, kidx, j_first, nest, r, qk_scale, s_zero, NEST_T)
            q_cur = start_q
            for s in range(n_steps_h):
                it = g * n_steps + s  # the step over all heads: buffer it % 2, the barriers' phases
                buf = it % 2
                if WG == 0:
                    row_w.store(lse_base2(lse_next))
                else:
                    row_w.store(delta_next)
                mbarrier.wait(ready.index(buf), (it // 2) & 1)
                qs = q_smem.index(buf)
                dos = do_smem.index(buf)
                pt = pt_smem.index(buf)
                if WG == 0:
                    sT = warpgroup_mma(k_smem, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    sT, acc = warpgroup_mma_wait(num_outstanding=0, deps=(sT, acc))  # also retires the last dV
                else:
                    dpT = warpgroup_mma(v_smem, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    dpT, acc = warpgroup_mma_wait(num_outstanding=0, deps=(dpT, acc))  # also retires the last dK
                if it > 0:  # the last step's Q / dO are read by every product that reads them
                    mbarrier.arrive(empty.index(1 - buf), count=1)
                if s + 1 < n_steps_h:
                    lse_next, delta_next = step_rows(l_row, dl_row, q_cur + BLOCK_Q, vrows, n_q, r, True)
                if WG == 0:
                    if NESTED:
                        sT = nest_scores(sT, weights[0], weights[1], NEST_T)
                    pT = gl.exp2(sT * qk_scale - row_w.load(query_axis)[None, :])
                    if q_cur < full_from:  # some key of the tile after some query of the step
                        qidx = gl.arange(0, BLOCK_Q, layout=query_axis)
                        pT = gl.where(kidx[:, None] <= (qidx + q_cur + shift)[None, :], pT, 0.0)
                    mbarrier.wait(pt_empty.index(buf), ((it // 2) & 1) ^ 1)  # WG 1 read this buffer's last P^T
                    pt.store(pT)
                    thread_barrier()
                    mbarrier.arrive(pt_ready.index(buf), count=1)
                    acc = register_product(pT, dos, acc, dtype, a_layout)
                else:
                    mbarrier.wait(pt_ready.index(buf), (it // 2) & 1)
                    pT = pt.load(s_layout)
                    thread_barrier()
                    mbarrier.arrive(pt_empty.index(buf), count=1)
                    ds = pT * (dpT - row_w.load(query_axis)[None, :])
                    acc = register_product(ds, qs, acc, dtype, a_layout)
                q_cur += BLOCK_Q
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        if WG == 0:
            _finish_keys(None, acc, j_first, b, r, scale, out, BLOCK_N, HEAD_DIM, g_layout, MERGE, LAST,
                         n_steps == 0)
        else:
            _finish_keys(acc, None, j_first, b, r, scale, out, BLOCK_N, HEAD_DIM, g_layout, MERGE, LAST,
                         n_steps == 0)

    @gluon.jit
    def dilated_bwd_dkdv_ws_kernel(
        Q, K, V, DO, L, Delta, DK, DV, DK_OUT, DV_OUT, DQ, PREV, T, NESTS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_db, stride_dh, stride_dn,
        stride_lb, stride_lh,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        stride_xkb, stride_xkh, stride_xkn,
        stride_xvb, stride_xvh, stride_xvn,
        stride_dqb, stride_dqh, stride_dqn,
        head_offset, group, n_classes, r, scale, qk_scale, n_tiles, n_prev, nest_i,
        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr,
        IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, PART: gl.constexpr, FUSED_DQ: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
        NESTED: gl.constexpr = False, NEST_T: gl.constexpr = 1,
    ):
        """``dilated_bwd_dkdv_hopper_kernel``'s contract with ``FUSED_DQ``: ``_dkdv_ws_producer`` and two
        ``_dkdv_ws_consumer`` s (the section's comment), over the class's ``HEADS`` query heads at most; without it
        (``ROLES_STEPS``, 64 keys) the producer and the two roles of ``_dkdv_ws_role``, no dQ."""
        dtype: gl.constexpr = Q.dtype.element_ty
        gl.static_assert(PART == 0 and BLOCK_N == (128 if FUSED_DQ else 64))
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, HEAD_DIM], dtype)
        ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_Q], dtype)
        OWN_DQ: gl.constexpr = HEAD_DIM <= 64  # _dkdv_ws_consumer's; at 128 it spilled and ran 0.93-0.95x (session 60)
        DQ_COLS: gl.constexpr = HEAD_DIM if OWN_DQ else HEAD_DIM // 2  # each consumer's dQ tile's columns
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_Q, DQ_COLS], gl.float32)

        NEST, below = nest_row(NESTS, nest_i, NESTED)
        kvh, h0, b, qbase, kbase, k_first, n_k, j_first, kp_max, q_first, n_q, start_q, n_steps = _key_tile(
            T, n_tiles, n_classes, group, head_offset, r, BLOCK_N, BLOCK_Q, IS_CAUSAL, NESTED, below)
        n_steps = gl.where(h0 < (kvh + 1) * group, n_steps, 0)
        shift = (q_first - k_first) // r - j_first
        full_from = _full_from(kp_max, q_first, r, IS_CAUSAL, NESTED, below)
        nest = (NEST, below, k_first, q_first, head_offset)
        if FUSED_DQ and NESTED and NEST_T > 1:
            nest = _nest_rows(h0, r, j_first, start_q, nest, HEADS, BLOCK_N, BLOCK_Q)

        kvh64 = kvh.to(gl.int64)
        h64 = h0.to(gl.int64)
        k0 = (kbase + k_first).to(gl.int64)
        q0_row = (qbase + q_first).to(gl.int64)
        n_desc = gl.maximum(n_k, 1)
        n_qdesc = gl.maximum(n_q, 1)
        k_desc = row_desc(K + b * stride_kb + kvh64 * stride_kh + k0 * stride_kn, n_desc, r * stride_kn, BLOCK_N,
                          HEAD_DIM, kv_smem_layout)
        v_desc = row_desc(V + b * stride_vb + kvh64 * stride_vh + k0 * stride_vn, n_desc, r * stride_vn, BLOCK_N,
                          HEAD_DIM, kv_smem_layout)
        q_base = Q + b * stride_qb + h64 * stride_qh + q0_row * stride_qn
        do_base = DO + b * stride_db + h64 * stride_dh + q0_row * stride_dn
        dq_base = DQ + b * stride_dqb + h64 * stride_dqh + q0_row * stride_dqn
        # the class's heads in the kv head's group (h0, h0 + r, ...; at least 1: a descriptor's extent), at most HEADS
        n_heads = gl.maximum(gl.minimum((kvh * group + group - h0 + r - 1) // r, HEADS), 1)
        if HEADS == 1:
            q_desc = row_desc(q_base, n_qdesc, r * stride_qn, BLOCK_Q, HEAD_DIM, q_smem_layout)
            do_desc = row_desc(do_base, n_qdesc, r * stride_dn, BLOCK_Q, HEAD_DIM, q_smem_layout)
            if FUSED_DQ:
                dq_desc0 = row_desc(dq_base, n_qdesc, r * stride_dqn, BLOCK_Q, DQ_COLS, dq_smem_layout)
                dq_desc1 = row_desc(dq_base + HEAD_DIM - DQ_COLS, n_qdesc, r * stride_dqn, BLOCK_Q, DQ_COLS,
                                    dq_smem_layout)
        else:  # the class's query heads h0, h0 + r, ... of the kv head's group, the head a coordinate
            q_desc = heads_desc(q_base, n_heads, n_qdesc, r * stride_qh, r * stride_qn, BLOCK_Q, HEAD_DIM, dtype)
            do_desc = heads_desc(do_base, n_heads, n_qdesc, r * stride_dh, r * stride_dn, BLOCK_Q, HEAD_DIM, dtype)
            if FUSED_DQ:
                dq_desc0 = heads_desc(dq_base, n_heads, n_qdesc, r * stride_dqh, r * stride_dqn, BLOCK_Q, DQ_COLS,
                                      gl.float32)
                dq_desc1 = heads_desc(dq_base + HEAD_DIM - DQ_COLS, n_heads, n_qdesc, r * stride_dqh, r * stride_dqn,
                                      BLOCK_Q, DQ_COLS, gl.float32)

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_smem_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_smem_layout)
        if FUSED_DQ:
            if OWN_DQ:  # each warpgroup's half, its own
                ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_Q], ds_smem_layout)
            else:
                ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_Q], ds_smem_layout)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_Q, DQ_COLS], dq_smem_layout)
        else:  # the roles' P^T hand-over (``_dkdv_ws_role``), in float32 as the one-gradient launches use it
            pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_Q], gl.float32)
            ds_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, BLOCK_Q], pt_layout)
            dq_smem = ds_smem
        # each consumer's step rows of lse (base 2) and delta, read where they are used (in registers along the score
        # tile's columns they took 32 registers a thread through the step)
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        rows_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_Q], rows_layout),
                     gl.allocate_shared_memory(gl.float32, [BLOCK_Q], rows_layout),
                     gl.allocate_shared_memory(gl.float32, [BLOCK_Q], rows_layout),
                     gl.allocate_shared_memory(gl.float32, [BLOCK_Q], rows_layout))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        mbarrier.init(ds_ready, count=2)
        if not FUSED_DQ:
            pt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            pt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(pt_ready.index(i), count=1)
                mbarrier.init(pt_empty.index(i), count=1)
        fence_async_shared()
        # What the partitions share, by use: ``steps`` (the class's heads and query steps, the tile's keys), ``rows``
        # (lse / delta: ``_ws_head_rows``), ``out`` (the epilogue's: ``_finish_keys``) and ``bufs`` (shared memory
        # and barriers; the roles' P^T tile fills the ds / dq slots).
        steps = (h0, n_heads, r, n_q, q0_row, start_q, n_steps, j_first, shift, full_from, b, scale, qk_scale)
        rows = (L, Delta, stride_lb, stride_lh)
        out = (DK, DV, DK_OUT, DV_OUT, PREV, kvh64, kvh * group, group, head_offset, n_prev, kbase, k_first, n_k,
               stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_xkb, stride_xkh,
               stride_xkn, stride_xvb, stride_xvh, stride_xvn)
        bufs = (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, rows_smem, kv_bar, ready, empty, ds_ready)
        if FUSED_DQ:
            gl.warp_specialize(
                [(_dkdv_ws_consumer, (steps, rows, out, bufs, HEAD_DIM, BLOCK_Q, HEADS, IS_CAUSAL, MERGE, LAST, 0,
                                      dq_desc0, nest, NESTED, NEST_T, OWN_DQ)),
                 (_dkdv_ws_consumer, (steps, rows, out, bufs, HEAD_DIM, BLOCK_Q, HEADS, IS_CAUSAL, MERGE, LAST, 1,
                                      dq_desc1, nest, NESTED, NEST_T, OWN_DQ)),
                 (_dkdv_ws_producer, (steps, bufs, HEAD_DIM, BLOCK_Q, HEADS, q_desc, do_desc, k_desc, v_desc))],
                [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize(
                [(_dkdv_ws_role, (steps, rows, out, bufs, HEAD_DIM, BLOCK_Q, HEADS, IS_CAUSAL, MERGE, LAST, 0, ds_smem,
                                  pt_ready, pt_empty, nest, NESTED, NEST_T)),
                 (_dkdv_ws_role, (steps, rows, out, bufs, HEAD_DIM, BLOCK_Q, HEADS, IS_CAUSAL, MERGE, LAST, 1, ds_smem,
                                  pt_ready, pt_empty, nest, NESTED, NEST_T)),
                 (_dkdv_ws_producer, (steps, bufs, HEAD_DIM, BLOCK_Q, HEADS, q_desc, do_desc, k_desc, v_desc))],
                [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _key_rows(first, k_first, kbase, n_k, r, head0, heads, head_offset, PREV, n_prev, ROWS: gl.constexpr,
                  HEAD_DIM: gl.constexpr, g_layout: gl.constexpr, MERGE: gl.constexpr):
        """A dK/dV epilogue's ``ROWS`` dilated key rows from row ``first``, in the gradient tile's layout: their
        columns (int64, ``[ROWS, 1]``), the head-dim index, which lie in the item, and which an earlier launch wrote
        for one of the heads ``head0 .. head0 + heads - 1`` (``MERGE``; else those in the item)."""
        kr = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, g_layout))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
        kp = k_first + kr * r
        kc64 = (kbase + kp).to(gl.int64)[:, None]
        kin = kr < n_k
        seen = kin
        if MERGE:
            seen = kin & written_before(kp, head0, head_offset, PREV, n_prev, heads)
        return kc64, d, kin, seen

    @gluon.jit
    def _finish_keys(dk, dv, first, b, r, scale, out, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                     g_layout: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, idle):
        """A dK/dV program's epilogue for its ``ROWS`` dilated key rows from row ``first``: dK (``dk``, scaled here),
        then dV, each through ``_finish``; either may be ``None`` (a launch or role of one gradient). ``out``: the
        gradients' tensors, the item's keys and the heads earlier launches wrote (``_key_rows``), the strides.
        ``idle``: the program ran no query step. A merging launch before the last then leaves the rows earlier
        launches wrote as they are, neither read nor written (a nested branch's key tiles in the last segment of the
        branch below: half its tiles, 128 KB of float32 sums each read and written at head dim 128), and writes the
        others' zeros."""
        (DK, DV, DK_OUT, DV_OUT, PREV, kvh64, head0, group, head_offset, n_prev, kbase, k_first, n_k, stride_dkb,
         stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_xkb, stride_xkh, stride_xkn, stride_xvb,
         stride_xvh, stride_xvn) = out
        kc64, d, kin, seen = _key_rows(first, k_first, kbase, n_k, r, head0, group, head_offset, PREV, n_prev, ROWS,
                                       HEAD_DIM, g_layout, MERGE)
        if MERGE and not LAST:
            kin = kin & ~(seen & idle)
            seen = seen & ~idle
        if dk is not None:
            _finish(dk * scale, DK + b * stride_dkb + kvh64 * stride_dkh, DK_OUT + b * stride_xkb + kvh64 * stride_xkh,
                    kc64, d, kin, seen, stride_dkn, stride_xkn, MERGE, LAST)
        if dv is not None:
            _finish(dv, DV + b * stride_dvb + kvh64 * stride_dvh, DV_OUT + b * stride_xvb + kvh64 * stride_xvh, kc64,
                    d, kin, seen, stride_dvn, stride_xvn, MERGE, LAST)

    @gluon.jit
    def _finish(acc, SUMS, OUT, rows64, d, rmask, seen, stride_sn, stride_on, MERGE: gl.constexpr,
                LAST: gl.constexpr):
        """One gradient tile's epilogue: add the rows an earlier launch wrote to ``SUMS`` (``MERGE``), store to
        ``SUMS`` or, ``LAST``, to ``OUT`` in its dtype (one tensor at a time: fewer live registers)."""
        if MERGE:
            acc += gl.load(SUMS + rows64 * stride_sn + d[None, :], mask=seen[:, None], other=0.0).to(gl.float32)
        if LAST:
            gl.store(OUT + rows64 * stride_on + d[None, :], acc.to(OUT.dtype.element_ty), mask=rmask[:, None])
        else:
            gl.store(SUMS + rows64 * stride_sn + d[None, :], acc.to(SUMS.dtype.element_ty), mask=rmask[:, None])


def dkdv_launch_configs(head_dim: int) -> list[dict] | None:
    """dK/dV: the launches per branch: at D = 256 one of two roles (``ROLES_STEPS``, warp-specialized) unless
    ``HF_DILATED_WS_DKDV=0``, else ``DKDV_STEPS``' (one for both gradients, or at D = 256 one for dV and one for dK),
    each 64 dilated keys on one warpgroup; ``None`` where the portable dK/dV kernel runs."""
    if head_dim not in DKDV_STEPS:
        return None
    if head_dim in ROLES_STEPS and switch("HF_DILATED_WS_DKDV"):
        return [dict(BLOCK_N=BLOCK_N, BLOCK_Q=ROLES_STEPS[head_dim], PART=0, FUSED_DQ=False, **WS_LAUNCH)]
    return [dict(BLOCK_N=BLOCK_N, BLOCK_Q=q_rows, PART=part, FUSED_DQ=False, num_warps=4)
            for part, q_rows in DKDV_STEPS[head_dim]]


def fused_dq_launch_config(head_dim: int, n_keys: int) -> dict | None:
    """The dK/dV launch that also adds dQ (``FUSED_DQ_STEPS``) for a call of ``n_keys`` keys, replacing the dQ kernel;
    ``None`` where there is none (or fewer keys than ``FUSED_DQ_MIN_KEYS`` asks), where ``HF_DILATED_FUSED_DQ=0``, or
    under ``torch.use_deterministic_algorithms(True)`` (the reduce-adds of the programs that share a query row land in
    no fixed order, so dQ may differ in its last bits between runs). Warp-specialized (``WS_LAUNCH``:
    ``dilated_bwd_dkdv_ws_kernel``) unless ``HF_DILATED_WS_DKDV=0``."""
    if head_dim not in FUSED_DQ_STEPS or n_keys < FUSED_DQ_MIN_KEYS.get(head_dim, 0):
        return None
    if not switch("HF_DILATED_FUSED_DQ"):
        return None
    if torch.are_deterministic_algorithms_enabled():
        return None
    n, q_rows, warps = FUSED_DQ_STEPS[head_dim]
    if switch("HF_DILATED_WS_DKDV"):
        return dict(BLOCK_N=n, BLOCK_Q=q_rows, PART=0, FUSED_DQ=True, **WS_LAUNCH)
    return dict(BLOCK_N=n, BLOCK_Q=q_rows, PART=0, FUSED_DQ=True, num_warps=warps)


def dkdv_kernel(cfg: dict):
    """The dK/dV kernel that config ``cfg`` (``dkdv_launch_configs`` / ``fused_dq_launch_config``) launches with: the
    warp-specialized one where the fused config asks for it (``HF_DILATED_WS_DKDV``, on by default; any number of
    query heads a class, the class's heads looped inside the program), else ``dilated_bwd_dkdv_hopper_kernel``."""
    return dilated_bwd_dkdv_ws_kernel if "CONSUMER_REGS" in cfg else dilated_bwd_dkdv_hopper_kernel


def dq_launch_config(head_dim: int) -> dict | None:
    """dQ: ``DQ_STEPS`` of this head dim, or ``None`` where the portable dq kernel runs (no entry)."""
    if head_dim not in DQ_STEPS:
        return None
    m, n, k_stages, v_stages, warps = DQ_STEPS[head_dim]
    return dict(BLOCK_M=m, BLOCK_N=n, K_STAGES=k_stages, V_STAGES=v_stages, num_warps=warps)
