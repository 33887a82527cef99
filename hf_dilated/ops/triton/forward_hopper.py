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
- every branch launch but the last runs as one launch over the parts (``PARTS``, ``launch.forward``), each part's rows
  stored once, compact, and the last launch (``r = 1``) merges them in its epilogue (``merge_parts_weighted``: started
  from them, the merge made ptxas serialize the tile's wgmma pipeline);
- otherwise the rows earlier launches wrote (``MERGE``) are not merged in an epilogue: a tile's online softmax starts
  from them (``resume_rows``: a written row counts as one key whose score is its lse and whose value is its output),
  read before the first scores so that the loads overlap them; the ``LAST`` launch writes the output in its dtype.
  Against the portable kernel's epilogue merge this removed the merge's loads and math from the end of every tile and,
  at head dim 256, the last launch's 300 bytes of spills: forward 1.03-1.04x at D 256, 1.00-1.03x at D 128, 0.99-1.01x
  at D 64 (H200, session 35, ``benchmarks/results/session35-*``). It rounds in the last bits differently from that
  merge.

The arithmetic is ``tiles.softmax_step``'s, so with the portable kernel's 64-key steps a launch that merges nothing is
bit-identical (measured on the H100); 128-key steps move the running maximum less often and differ in the last bf16
bit. Used for bf16 / fp16, head dim 64 / 128 / 256, the tensor-descriptor path, no sliding window, dropout or holes
(``applies``).

At head dim 128 the forward runs warp-specialized instead (``dilated_fwd_ws_kernel``, ``ws_applies``; section below),
and at 64 where its persistent programs divide the call's launches evenly (``ws_balance``):
a producer warp and two consumer warpgroups share each K / V copy, and a program walks several 128-row query tiles
so that one tile's loads overlap the last one's epilogue: persistent programs, one per SM, dealt to the launch's offset
classes and walking pairs of tiles of equal causal work of their heads where the layout allows (``ws_schedule``),
else one segment item a program. Same products
in the same order as ``dilated_fwd_hopper_kernel``: bit-identical (H100, session 25: forward 0.98 / 1.05 / 1.09x at
16K / 64K / 256K, 1.11x with GQA 32 / 8 at 64K; session 27, persistent against one item a program: 1.15 / 1.07 /
1.05x, GQA 1.08 / 1.07 / 1.03x).
"""

from __future__ import annotations

import torch

from .hopper import (
    WS_LAUNCH, fence_async_shared, first_selected, fwd_first, fwd_last, fwd_step, gl, gluon, heads_desc,
    item_query_tile, kv_descs, kv_prefetch, load_item, masked_scores, mbarrier, mma_layout, mma_operand, n_rows,
    nest_pair_weights, nest_row, part_query_tile, query_tile_buffers, query_tile_keys, release_barriers, row_desc,
    rows_copy, runnable, softmax_finish, softmax_start, softmax_step, switch, tma_load, warpgroup_mma,
    warpgroup_mma_wait, written_before, written_keyed, ws_barriers, ws_copy_kv,
)
from .tiles import LOG2E, NEST_COLUMNS, PART_COLUMNS

BLOCK_M = 64  # dilated query rows per program (one warpgroup: m64 instructions)
# (key rows per step, K buffers, V buffers) by head dim, measured on the H100 (benchmarks/NOTES_triton.md, round 2
# session 14): at D = 128, (128, 1, 2) ran the forward 1.04-1.09x faster than the portable kernel at 64K / 256K and
# 1.06-1.09x with GQA 32 / 8, (64, 3, 3) 0.98-1.02x; at D = 64 (9 / 3 heads) (64, 2, 2) ran 1.06-1.11x, (128, 1, 2)
# 0.92-0.98x. At D = 256 (Gemma's heads, 8 / 2) (64, 1, 1) (96 KB: two programs per SM; the portable kernel spills
# 540-820 bytes there) ran 1.36x / 1.25x at 16K / 64K, bit-identical (round 2 session 19). There 128 rows on 8 warps
# (two warpgroups reading each K / V tile once, one program an SM; the kernel takes it unchanged) ran the forward 0.86x
# / 0.94x (64, 1, 1), 0.87x / 0.94x (64, 2, 1) and 0.89x / 0.95x (64, 2, 2) at 16K / 64K (H200, session 54).
STEPS = {64: (64, 2, 2), 128: (128, 1, 2), 256: (64, 1, 1)}
# Head dims at which the one-warpgroup kernel runs the forward's parts in one launch (``launch.forward``), with how the
# last launch merges them (``merge_parts_weighted``): (at most this many parts, unrolled; register cap). At 64, unrolled
# with the registers capped at 128 (four programs an SM, as the other launches; 8 bytes spilled, outside the tile
# loop) it ran the 16K 9 / 3 forward 1.32x as fast as a launch per branch, a loop over the parts 1.29x; at 64K
# 1.01x / 0.99x (H200, session 41). More parts than that (6 branches or more) take a launch per branch: the loop
# merge had no GPU test and was dropped (session 42). Not at 256: the epilogue merge spilled 1.2 KB there (session 35
# had moved the merge into ``resume_rows`` to end 300 bytes of spills), and it was not timed.
PARTS_MERGE = {64: (4, 128)}


def parts_merge_config(head_dim: int, n_parts: int) -> dict | None:
    """The last launch's merge of ``n_parts`` parts (``MAX_PARTS`` unrolled, the register cap), or None where this
    kernel takes no parts: a head dim not in ``PARTS_MERGE``, or more parts than it unrolls there."""
    if head_dim not in PARTS_MERGE or n_parts > PARTS_MERGE[head_dim][0]:
        return None
    unrolled, maxnreg = PARTS_MERGE[head_dim]
    return dict(MAX_PARTS=unrolled, maxnreg=maxnreg)


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


# Head dims the warp-specialized forward takes. Not 256: three stages of 128-key K / V tiles would take 384 KB; with
# 64-key steps and two K / V buffers (192 KB, one program an SM) it ran the forward 0.94x / 0.98x / 0.96x as fast as
# the one-warpgroup kernel's two programs an SM at 16K / 64K / 256K (8 / 2 heads, bit-identical; H200, session 53).
WS_HEAD_DIMS = (128,)
# Head dims it takes where its persistent launches keep at least WS_BALANCE of the SMs' time busy (``ws_balance``).
# At 64 the one-warpgroup kernel runs the branches but the last as one launch (parts) and loses less to uneven
# programs. Whole-op forward A/Bs against it (H200, sessions 45-46), programs of one head each: 1.01-1.06x at every
# balance from 0.907 (14 / 2 heads at 64K) to 0.97, 0.95x at 0.867 (9 / 3 at 64K); one item a program 0.87-0.93x.
# Programs dealt to offset classes (session 46): 14 / 2 at 64K 1.04x (balance 0.956), 9 / 3 at 64K 0.99x (0.914), so
# the line sits above 0.914; every case measured above it won. Measured from 64K query rows on; below, the
# one-warpgroup kernel's parts launch saves most (1.32x at 16K, session 41) and the warp-specialized kernel was not
# timed.
WS_BALANCED_HEAD_DIMS = (64,)
WS_BALANCE = 0.92
WS_BALANCED_MIN_ROWS = 65536


def ws_balance(launches, heads: int, sms: int) -> float:
    """The share of the SMs' time the warp-specialized forward's persistent launches keep busy, summed over a call's
    ``launches`` (``(n_items, items_per_group, max_q_rows, r)`` each) and weighted by their work: a launch's offset
    class of ``n_c`` heads has ``n_c U`` units (pairs of an item's tiles, each ``n_tiles + 1`` key tiles of work) a
    group on its ``G_c`` programs (``ws_schedule``), and the launch takes its slowest class's ``ceil(n_c U / G_c)``
    units' time on all the SMs. 0 where a launch would run one item a program."""
    useful = busy = 0
    for n_items, items_per_group, max_q_rows, r in launches:
        grid, sched = ws_schedule(n_items, items_per_group, max_q_rows, heads, r, sms)
        if not sched["PERSISTENT"]:
            return 0.0
        groups, units, cost = grid[2], sched["n_items"] * sched["n_units"], sched["n_tiles"] + 1
        useful += heads * groups * units * cost
        busy += sms * max(-(-n_c * units // g) for n_c, g in zip(sched["sizes"], sched["per_class"])) * cost
    return useful / busy if busy else 0.0


def ws_applies(q: torch.Tensor, flags: dict, tma: bool, launches=(), sms: int = 0) -> bool:
    """Whether the forward runs the warp-specialized kernel (``dilated_fwd_ws_kernel``): as :func:`applies`, at the
    head dims of ``WS_HEAD_DIMS`` (128), and at those of ``WS_BALANCED_HEAD_DIMS`` (64) from ``WS_BALANCED_MIN_ROWS``
    queries on where the call's ``launches`` on ``sms`` SMs keep ``WS_BALANCE`` of them busy (:func:`ws_balance`),
    with ``HF_DILATED_WS`` on (the default; ``0`` / ``false`` / ``off`` / ``no`` keep ``dilated_fwd_hopper_kernel``)."""
    if not (applies(q, flags, tma) and switch("HF_DILATED_WS")):
        return False
    D = q.shape[-1]
    return D in WS_HEAD_DIMS or (D in WS_BALANCED_HEAD_DIMS and q.shape[2] >= WS_BALANCED_MIN_ROWS and bool(launches)
                                 and ws_balance(launches, q.shape[1], sms) >= WS_BALANCE)


WS_WAVES = 4  # programs the one-item-a-program launch aims at, per SM (fewer, longer programs hide more loads)
WS_TILES = 2  # query tiles per program there at most: programs that run at once then share their items' K / V in L2
# The persistent launch is taken where its programs fill at least this share of the SMs: at full fill it ran 1.03-1.15x
# one item a program (H100, session 27), so below ~0.95 of the SMs it would lose what it gains (24 heads: 120 of 132)
WS_FILL = 0.95


def ws_class_sizes(heads: int, r: int) -> list[int]:
    """The heads of each offset class of a rate-``r`` launch: class ``c`` (``c < min(r, heads)``) holds heads ``c, c +
    r, ...``, which select the same dilated rows (one descriptor origin), so a persistent program can walk all of
    them (``dilated_fwd_ws_kernel``)."""
    return [(heads - c + r - 1) // r for c in range(min(r, heads))]


def ws_class_programs(sizes, heads: int, programs: int, units_per_head: int) -> list[int]:
    """Programs of each offset class (``ws_class_sizes``) out of ``programs`` per group, in proportion to its heads
    (class ``c`` takes ``programs x`` the heads of classes ``<= c`` ``// heads`` less the same for ``< c``, so all of
    them are dealt) and no more than its units; the kernel computes the same."""
    before = [sum(sizes[:c]) for c in range(len(sizes) + 1)]
    return [min(programs * before[c + 1] // heads - programs * before[c] // heads, n_c * units_per_head)
            for c, n_c in enumerate(sizes)]


def ws_schedule(n_items: int, items_per_group: int, max_q_rows: int, heads: int, r: int,
                sms: int) -> tuple[tuple, dict]:
    """The warp-specialized forward's grid and its schedule arguments (``dilated_fwd_ws_kernel``).

    Persistent where the items come in groups that share a batch row and column bases (``items_per_group``, e.g.
    every contiguous layout): the SMs' programs are dealt to the launch's offset classes (heads ``c, c + r, ...``,
    :func:`ws_class_sizes`) in proportion to their heads, and each walks every ``G_c``-th unit of its class (a pair of
    an item's tiles of equal causal work, or single tiles where pairs would leave SMs idle), head by head and in item
    order. So 9 heads at ``r = 1`` keep all 132 SMs busy, where programs of one head each kept 126. A program's
    descriptors, barriers and first loads are paid once for all its units, and a tile's loads overlap the last one's
    epilogue (session 26's profile: two fifths of the consumers' time was per-tile cost at 2048-row segments). Else,
    or where the programs fill under ``WS_FILL`` of the SMs, one item a program: a unit of ``WS_TILES`` tiles where
    there is work for ``WS_WAVES`` programs per SM, else one tile (more tiles per program overflowed L2 with the K / V
    of the items in flight, session 25). ``HF_DILATED_PERSISTENT`` off (``0`` / ``false`` / ``off`` / ``no``) keeps
    one item a program (``benchmarks/ab_gluon.py --switch persistent``)."""
    n_tiles = -(-max_q_rows // 128)
    pairs = -(-n_tiles // 2)
    groups = n_items // items_per_group if items_per_group else 0
    sizes = ws_class_sizes(heads, r)
    if groups and len(sizes) * groups <= sms and switch("HF_DILATED_PERSISTENT"):
        programs = sms // groups
        for per_unit, n_units in ((2, pairs), (1, n_tiles)):
            per_class = ws_class_programs(sizes, heads, programs, items_per_group * n_units)
            if min(per_class) >= 1 and sum(per_class) * groups >= WS_FILL * sms:
                return (max(per_class), len(sizes), groups), dict(
                    G=programs, n_tiles=n_tiles, n_units=n_units, n_items=items_per_group, PER_UNIT=per_unit,
                    PERSISTENT=True, per_class=per_class, sizes=sizes)
    per_program = max(1, min(n_tiles, WS_TILES, n_items * n_tiles * heads // (WS_WAVES * sms)))
    per_unit, n_units = (2, pairs) if per_program >= 2 else (1, n_tiles)
    if n_items * n_units >= 2**31 or heads > 65535:
        raise ValueError(f"too many work items for one launch: {n_items} items x {n_units} units x {heads} heads")
    return (n_items * n_units, heads, 1), dict(G=n_units, n_tiles=n_tiles, n_units=n_units, n_items=1,
                                               PER_UNIT=per_unit, PERSISTENT=False)


def ws_launch_config() -> dict:
    """128 dilated query rows on two consumer warpgroups, 128-key steps through three K / V buffers (224 KB, one
    program per SM)."""
    return dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, **WS_LAUNCH)


if gluon is not None:

    @gluon.jit
    def store_rows(o_b, lse_b, p_min, q_hi, qbase, b, h, r, O, L, OUT, stride_ob, stride_oh, stride_on, stride_lb,
                   stride_lh, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, LAST: gl.constexpr,
                   PL, base, PARTS: gl.constexpr):
        """The epilogue for ``ROWS`` dilated query rows from position ``p_min`` (those below ``q_hi``): their output
        ``o_b`` (merged with earlier launches already: ``resume_rows``) and lse ``lse_b`` stored to ``O`` / ``L`` or,
        ``LAST``, the output in its dtype to ``OUT`` (``O``'s strides). A part (``PARTS``, not ``LAST``) stores them
        compact: row ``base + column // r`` of ``O`` and ``PL``."""
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        qp = p_min + gl.arange(0, ROWS, layout=o_rows) * r
        in_range = qp < q_hi
        qc = qbase + qp
        qc64 = qc.to(gl.int64)
        if PARTS and not LAST:  # divided in 32 bits: a 64-bit division is a call to a division routine
            qc64 = (base + qc // r).to(gl.int64)
            L = PL
        h64 = h.to(gl.int64)
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        if LAST:
            out_ptrs = OUT + b * stride_ob + h64 * stride_oh + qc64[:, None] * stride_on + d[None, :]
            gl.store(out_ptrs, o_b.to(OUT.dtype.element_ty), mask=in_range[:, None])
        else:
            o_ptrs = O + b * stride_ob + h64 * stride_oh + qc64[:, None] * stride_on + d[None, :]
            gl.store(o_ptrs, o_b.to(O.dtype.element_ty), mask=in_range[:, None])
        gl.store(L + b * stride_lb + h64 * stride_lh + qc64, lse_b, mask=in_range)

    @gluon.jit
    def _part_rows(j, cols, in_range, key, PARTS_TABLE, n_parts):
        """Which of a tile's rows part ``j`` wrote (none when ``j >= n_parts``), and their compact rows there (int64).
        ``cols``: the rows' columns (``qbase`` + position, int32, >= 0); a part of rate ``rj`` wrote the columns
        congruent to ``key`` (``qbase`` + head + head offset) mod ``rj``, column ``c`` at row ``base + c // rj``. One
        32-bit division a row: a 64-bit one is a call to a division routine (it made the merge cost 1.3x as much,
        benchmarks/NOTES_triton.md, session 51)."""
        live = j < n_parts
        rj = gl.load(PARTS_TABLE + j * PART_COLUMNS + 3, mask=live, other=1)
        quot = cols // rj
        seen = in_range & live & (cols - quot * rj == ((key % rj) + rj) % rj)
        return seen, gl.where(seen, gl.load(PARTS_TABLE + j * PART_COLUMNS + 4, mask=live, other=0) + quot,
                              0).to(gl.int64)

    @gluon.jit
    def merge_parts_weighted(o_b, lse_b, p_min, q_hi, qbase, b, h, head_offset, r, O, PL, PARTS_TABLE, n_parts,
                             stride_ob, stride_oh, stride_on, stride_lb, stride_lh, o_layout: gl.constexpr,
                             HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, MAX_PARTS: gl.constexpr):
        """The last launch's rows (``o_b``, natural-log ``lse_b``) merged with the parts' (``launch.forward``: a part
        of rate ``rj`` holds the rows it selects at row ``base + column // rj`` of ``O`` / ``PL``) as one weighted sum
        (``tiles.merge_rows``' arithmetic): the lse of every part first (the softmax weights), then the outputs,
        unrolled over at most ``MAX_PARTS`` parts so that their loads can be in flight together. In the epilogue:
        started from them (as ``resume_rows`` starts from an earlier launch's rows), the merge made ptxas serialize
        the tile's wgmma pipeline, or took 172 registers."""
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        qp = p_min + gl.arange(0, ROWS, layout=o_rows) * r
        in_range = qp < q_hi
        cols = qbase + qp
        key = qbase + h + head_offset
        h64 = h.to(gl.int64)
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        lse_rows = PL + b * stride_lb + h64 * stride_lh
        o_rows_base = O + b * stride_ob + h64 * stride_oh
        m = lse_b
        for j in gl.static_range(MAX_PARTS):
            seen, rows = _part_rows(j, cols, in_range, key, PARTS_TABLE, n_parts)
            m = gl.maximum(m, gl.load(lse_rows + rows, mask=seen, other=float("-inf")))
        m = gl.where(m == float("-inf"), 0.0, m)
        w = gl.exp(lse_b - m)
        total = w
        out = o_b * w[:, None]
        for j in gl.static_range(MAX_PARTS):
            seen, rows = _part_rows(j, cols, in_range, key, PARTS_TABLE, n_parts)
            wj = gl.exp(gl.load(lse_rows + rows, mask=seen, other=float("-inf")) - m)
            total = total + wj
            out = out + gl.load((o_rows_base + rows * stride_on)[:, None] + d[None, :], mask=seen[:, None],
                                other=0.0) * wj[:, None]
        reached = total != 0
        t_safe = gl.where(reached, total, 1.0)
        return out / t_safe[:, None], gl.where(reached, m + gl.log(t_safe), float("-inf"))

    @gluon.jit
    def resume_rows(p_min, q_hi, qbase, b, h, head_offset, r, O, L, PREV, n_prev, stride_ob, stride_oh, stride_on,
                    stride_lb, stride_lh, o_layout: gl.constexpr, row_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
                    ROWS: gl.constexpr, MERGE: gl.constexpr, NESTED: gl.constexpr = False, written=None):
        """The online softmax's start ``(acc, m_i, l_i)`` for ``ROWS`` dilated query rows from position ``p_min``
        (``m_i``, ``l_i`` in ``row_layout``): empty (-1e30, 0, 0) or, ``MERGE``, the merge with earlier launches. A
        row an earlier launch wrote, with lse ``L`` and output ``O``, counts as one key of score ``L`` and value ``O``
        (``m_i`` = that lse in base 2, ``l_i`` = 1, ``acc`` = that output); the others start empty. Read before the
        tile's first scores, so the loads overlap them instead of ending the tile, and the branches are merged by one
        online softmax (no separate merge). Rounding differs from merging two finished rows in the last bits only.
        ``NESTED``: ``PREV`` is the earlier launches' ``(r, w, below)`` (:func:`written_keyed`); ``written``, if
        given, is which rows they wrote, found already (the warp-specialized forward's producer)."""
        if MERGE:
            o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
            qp = p_min + gl.arange(0, ROWS, layout=o_rows) * r
            if written is not None:  # (``NESTED``, read for the tile by the warp-specialized producer)
                seen = (qp < q_hi) & written
            elif NESTED:
                seen = (qp < q_hi) & written_keyed(qp, h, head_offset, PREV, n_prev)
            else:
                seen = (qp < q_hi) & written_before(qp, h, head_offset, PREV, n_prev, 1)
            qc64 = (qbase + qp).to(gl.int64)
            h64 = h.to(gl.int64)
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            old_lse = gl.load(L + b * stride_lb + h64 * stride_lh + qc64, mask=seen, other=float("-inf"))
            # rows not seen read row 0 (masked): the addresses then differ from the store's, which the compiler would
            # otherwise keep in registers (or spill) through the whole tile to reuse them
            rows = O + b * stride_ob + h64 * stride_oh + gl.where(seen, qc64, 0) * stride_on
            acc = gl.load(rows[:, None] + d[None, :], mask=seen[:, None], other=0.0).to(gl.float32)
            some = old_lse != float("-inf")  # NaN stays NaN through m_i
            m_i = gl.convert_layout(gl.where(some, old_lse * LOG2E, -1.0e30), row_layout)
            l_i = gl.convert_layout(gl.where(some, 1.0, 0.0), row_layout)
        else:
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=row_layout)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        return acc, m_i, l_i

    @gluon.jit
    def dilated_fwd_hopper_kernel(
        Q, K, V, O, L, OUT, PREV, T, PL, NESTS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        head_offset, group, r, qk_scale, n_tiles, n_prev, nest_i,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
        V_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr,
        PARTS: gl.constexpr, MAX_PARTS: gl.constexpr, num_warps: gl.constexpr, NESTED: gl.constexpr = False,
        NEST_T: gl.constexpr = 1,
    ):
        """One branch's output rows for one tile of ``BLOCK_M`` dilated query rows of one segment item and head,
        merged into what earlier launches wrote (``MERGE``), stored to ``O`` / ``L`` or, ``LAST``, to ``OUT``. With
        ``PARTS`` (``launch.forward``): the one launch over the parts, each program's part from ``PREV`` (the parts'
        table), its rows stored compact to ``O`` / ``PL``; or the last launch, starting from the parts' rows.
        ``NESTED``: a nested branch's pairs and weights (row ``nest_i`` of ``NESTS``, ``tiles.nest_weight``; the key
        weights repeat every ``NEST_T`` rows, ``hopper.nest_class_weights``)."""
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        LATE_P: gl.constexpr = HEAD_DIM >= 128  # (``hopper.step_probs``)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        row_axis: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        NBYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = query_tile_buffers(
            dtype, q_smem_layout, kv_smem_layout, BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES)

        base = 0
        if PARTS and not LAST:
            r, base, nest_i, b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = part_query_tile(
                PREV, n_prev, T, head_offset, BLOCK_M, IS_CAUSAL)
        else:
            b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = item_query_tile(
                T, n_tiles, head_offset, r, BLOCK_M, IS_CAUSAL)
        if p_min < q_hi:
            NEST, below = nest_row(NESTS, nest_i, NESTED)
            k_first, n_k, n_plain, n_kt, shift = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, BLOCK_M, BLOCK_N,
                                                                 IS_CAUSAL, NESTED, below)
            q_rows = q_hi  # the rows below it are read (``MERGE``) and stored
            if NESTED and not LAST and not PARTS:  # a tile with no key here adds nothing: none
                q_rows = gl.where(n_kt > 0, q_hi, 0)
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
            nest = 0.0
            if NESTED:  # the pairs' weights by (row, key class): a key tile's repeat
                nest = nest_pair_weights(s_zero, p_min + qidx * r, k_first, h, head_offset, r, NEST, NEST_T)
            # the online softmax starts from the rows earlier launches wrote (their lse, output), if any
            acc, m_i, l_i = resume_rows(p_min, q_rows, qbase, b, h, head_offset, r, O, L, PREV, n_prev, stride_ob,
                                        stride_oh, stride_on, stride_lb, stride_lh, o_layout, row_axis, HEAD_DIM,
                                        BLOCK_M, MERGE, NESTED and not PARTS)
            mbarrier.wait(q_bar, 0)
            if n_kt > 0:
                p, acc, m_i, l_i = fwd_first(n_kt, q_smem, k_smem, k_bar, k_desc, K_STAGES * BLOCK_N, s_zero,
                                             qk_scale, n_plain == 0, 0, n_k, shift, qidx, kidx, acc, m_i, l_i, o_rows,
                                             p_layout, K_STAGES, NBYTES, IS_CAUSAL, MERGE, LATE_P, nest, NEST_T)
                for j in range(1, n_plain):
                    acc, p, m_i, l_i = fwd_step(
                        j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, (j + K_STAGES) * BLOCK_N,
                        (j - 1 + V_STAGES) * BLOCK_N, acc, p, m_i, l_i, s_zero, qk_scale, False, j * BLOCK_N, n_k,
                        shift, qidx, kidx, o_rows, p_layout, K_STAGES, V_STAGES, NBYTES, False, IS_CAUSAL, LATE_P,
                        nest, NEST_T)
                for j in range(gl.maximum(n_plain, 1), n_kt):
                    acc, p, m_i, l_i = fwd_step(
                        j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, (j + K_STAGES) * BLOCK_N,
                        (j - 1 + V_STAGES) * BLOCK_N, acc, p, m_i, l_i, s_zero, qk_scale, True, j * BLOCK_N, n_k,
                        shift, qidx, kidx, o_rows, p_layout, K_STAGES, V_STAGES, NBYTES, True, IS_CAUSAL, LATE_P,
                        nest, NEST_T)
                o_b, lse_b = fwd_last(p, v_smem, v_bar, acc, n_kt, m_i, l_i, o_rows, p_layout, V_STAGES, LATE_P)
            else:  # no key of this branch: the earlier launches' rows as they are (none: 0, -inf)
                o_b, lse_b = softmax_finish(acc, m_i, l_i, o_rows)

            if PARTS and LAST:
                o_b, lse_b = merge_parts_weighted(o_b, lse_b, p_min, q_hi, qbase, b, h, head_offset, r, O, PL, PREV,
                                                  n_prev, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                                                  o_layout, HEAD_DIM, BLOCK_M, MAX_PARTS)
            store_rows(o_b, lse_b, p_min, q_rows, qbase, b, h, r, O, L, OUT, stride_ob, stride_oh, stride_on,
                       stride_lb, stride_lh, o_layout, HEAD_DIM, BLOCK_M, LAST, PL, base, PARTS)
        release_barriers(q_bar, k_bar, v_bar, K_STAGES, V_STAGES)

    # ---- the warp-specialized forward (head dim 128, and 64 by balance) -------------------------------------------
    # A program walks *units*: a unit is a segment item's 128-row query tiles ``T - 1 - j`` and ``j`` (``PER_UNIT`` 2:
    # equal causal work in every unit) or tile ``T - 1 - j`` alone (``PER_UNIT`` 1), ``T`` the launch's most tiles per
    # item, of one head. ``PERSISTENT``: the grid is ``(G_c, classes, groups)``, a launch's offset classes (heads ``c,
    # c + r, ...``: the same dilated rows) sharing ``G`` programs per group of items that share a batch row and column
    # bases (``BranchItems.items_per_group``) in proportion to their heads, at most one program per SM, so a
    # program's first loads and descriptors are paid once for many units. A class's units are numbered head by head,
    # each head's in item order, and a program takes ``k, k + G_c, ...``: the programs that run at once read the K / V
    # of one item (L2), and the SMs stay busy whatever the head count (programs of one head each left 6 of 132 SMs
    # idle at 9 heads, 12 at 24). Else ``(items x G, heads)``, one item a program (packed or padded layouts).
    # A producer warp reads each tile's Q and streams its K / V tiles (128 keys) through ``STAGES`` buffers
    # (``hopper.ws_copy_kv``), running on into the next tile (its Q once both consumers issued their last scores,
    # ``q_empty``), so that tile's loads overlap this one's last ``P V`` and epilogue. Each of two consumer warpgroups
    # owns 64 of the tile's rows and walks the key tiles its rows see in ``hopper.fwd_step``'s order (tile ``t``'s
    # scores issued before tile ``t - 1``'s ``P V``, the softmax of ``t`` while that product runs), from the rows
    # earlier launches wrote (``resume_rows``), and stores its rows as the one-warpgroup kernel does. Both consumers
    # read each K / V tile from one copy and drift apart by up to ``STAGES`` tiles. Causal, the first consumer's rows
    # may see one key tile fewer: it releases the tiles it skips once they arrived (an early release would count for
    # the buffer's previous tile).
    # The descriptors are made once per program, over every head (``hopper.heads_desc``: a tile's head is a
    # coordinate, so a program crosses heads without new descriptors): over the item's dilated rows (zeros past
    # them), or, persistent, over every column in the class's offset class (row stride ``r``), a tile at the row of its
    # first column. Only the producer reads through them.

    @gluon.jit
    def _ws_tile(i, T, h0, head_offset, r, k, G, it0, n_items, n_tiles, n_units, q_org, k_org,
                 PER_UNIT: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, NESTED: gl.constexpr,
                 below, LAST: gl.constexpr):
        """The program's ``i``-th tile slot: ``(live, h, b, qbase, q_hi, k_lo, k_hi, off, p_min, n_kt, q_row,
        k_row)`` -- whether it holds query rows (a short item's missing tiles and a unit's repeated middle tile do
        not; nor, in a nested launch before the last, a tile whose rows see no key of it), its head (of the class
        from ``h0``: ``h0 + r``, ... after every ``n_items x n_units`` units), the item's batch row, query column base
        and bounds, the head's offset class, the tile's first query position, how many key tiles some row of it sees,
        and the descriptor rows of its first query and of the item's first key."""
        unit = k + (i // PER_UNIT) * G
        per_head = n_items * n_units
        h = h0 + (unit // per_head) * r
        unit = unit % per_head
        s = i % PER_UNIT
        j = unit % n_units
        tile = gl.where(s == 0, n_tiles - 1 - j, j)
        b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, it0 + unit // n_units)
        off = (h + head_offset) % r
        q_first = first_selected(q_lo, off, r)
        k_first = first_selected(k_lo, off, r)
        p_min = q_first + tile * 128 * r
        live = (p_min < q_hi) & ((s == 0) | (tile != n_tiles - 1 - j))
        n_kt = query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, 128, BLOCK_N, IS_CAUSAL, NESTED, below)[3]
        if NESTED and not LAST:  # nothing to add: its rows stay as earlier launches wrote them (``written_keyed``)
            live = live & (n_kt > 0)
        q_row = (qbase + q_first - q_org) // r + tile * 128
        k_row = (kbase + k_first - k_org) // r
        return live, h, b, qbase, q_hi, k_lo, k_hi, off, p_min, n_kt, q_row, k_row

    @gluon.jit
    def _ws_consumer(a, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PER_UNIT: gl.constexpr,
                     IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr, LAST: gl.constexpr, WG: gl.constexpr,
                     NESTED: gl.constexpr, NEST_T: gl.constexpr):
        """Output and lse of rows ``64 WG ..`` of each of the program's query tiles (``NESTED``: a nested branch's
        pairs and weights, ``tiles.nest_weight``)."""
        (T, O, L, OUT, PREV, n_prev, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, h0, head_offset, r,
         group, qk_scale, k, G, it0, n_items, n_tiles, n_units, n_slots, q_org, k_org, q_smem, k_smem, v_smem, q_bar,
         q_empty, k_ready, v_ready, empty, NEST, below, rows_smem, rows_bar) = a
        s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        qs = q_smem.index(WG)
        qidx = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        kidx = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        c = 0  # key tiles streamed for the program's earlier query tiles
        n_q = 0  # query tiles read before
        for i in range(n_slots):
            live, h, b, qbase, q_hi, k_lo, k_hi, off, p_min, n_kt, q_row, k_row = _ws_tile(
                i, T, h0, head_offset, r, k, G, it0, n_items, n_tiles, n_units, q_org, k_org, PER_UNIT, BLOCK_N,
                IS_CAUSAL, NESTED, below, LAST)
            if live:
                p_w = p_min + WG * 64 * r
                k_first, n_k, n_plain, n_own, shift = query_tile_keys(p_w, q_hi, k_lo, k_hi, off, r, 64, BLOCK_N,
                                                                      IS_CAUSAL, NESTED, below)
                nest = 0.0
                if NESTED:  # the pairs' weights by (row, key class): a key tile's repeat
                    nest = nest_pair_weights(s_zero, p_w + qidx * r, k_first, h, head_offset, r, NEST, NEST_T)
                if p_w >= q_hi:  # no rows here (the item's last tile)
                    n_own = 0
                # the online softmax starts from the rows earlier launches wrote (their lse, output), if any
                written = None
                if MERGE and NESTED:  # which: the producer's reading for the tile
                    mbarrier.wait(rows_bar, n_q & 1)
                    written = rows_smem.slice(WG * 64, 64).load(o_rows) != 0
                acc, m_i, l_i = resume_rows(p_w, q_hi, qbase, b, h, head_offset, r, O, L, PREV, n_prev, stride_ob,
                                            stride_oh, stride_on, stride_lb, stride_lh, o_layout,
                                            gl.SliceLayout(1, s_layout), HEAD_DIM, 64, MERGE, NESTED, written)
                mbarrier.wait(q_bar, n_q & 1)
                if n_own > 0:
                    mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
                    sc = warpgroup_mma(qs, k_smem.index(c % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                    if n_plain == 0:
                        sc = masked_scores(sc, 0, n_k, shift, qidx, kidx, IS_CAUSAL)
                    pf, acc, m_i, l_i = softmax_start(sc, acc, m_i, l_i, qk_scale, o_rows, MERGE, nest, NEST_T)
                    for t in range(1, n_own):
                        acc, pf, m_i, l_i = _ws_step(t, c, qs, k_smem, v_smem, k_ready, v_ready, empty, acc, pf, m_i,
                                                    l_i, s_zero, qk_scale, n_k, n_plain, shift, qidx, kidx, o_rows,
                                                    p_layout, STAGES, BLOCK_N, IS_CAUSAL, nest, NEST_T)
                    mbarrier.arrive(q_empty, count=1)  # its last scores are in: the next tile's Q may come
                    out, lse = fwd_last(pf, v_smem, v_ready, acc, c + n_own, m_i, l_i, o_rows, p_layout, STAGES, True)
                    mbarrier.arrive(empty.index((c + n_own - 1) % STAGES), count=1)
                else:
                    mbarrier.arrive(q_empty, count=1)
                    out, lse = softmax_finish(acc, m_i, l_i, o_rows)  # earlier launches' rows as they are, or 0 / -inf
                for t in range(n_own, n_kt):  # key tiles only the other consumer's rows see
                    mbarrier.wait(k_ready.index((c + t) % STAGES), ((c + t) // STAGES) & 1)
                    mbarrier.arrive(empty.index((c + t) % STAGES), count=1)
                if p_w < q_hi:
                    store_rows(out, lse, p_w, q_hi, qbase, b, h, r, O, L, OUT, stride_ob, stride_oh, stride_on,
                               stride_lb, stride_lh, o_layout, HEAD_DIM, 64, LAST, L, 0, False)
                c += n_kt
                n_q += 1

    @gluon.jit
    def _ws_step(t, c, qs, k_smem, v_smem, k_ready, v_ready, empty, acc, pf, m_i, l_i, s_zero, qk_scale, n_k,
                 n_plain, shift, qidx, kidx, o_rows: gl.constexpr, p_layout: gl.constexpr, STAGES: gl.constexpr,
                 BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, nest, NEST_T: gl.constexpr):
        """A consumer's key tile ``t >= 1`` of a query tile whose first key tile is the program's ``c``-th:
        ``hopper.fwd_step``'s order from the producer's buffers, tile ``t - 1``'s buffer released once its ``P V`` is
        done; scores masked from tile ``n_plain`` on (``nest``, ``NEST_T``: as ``hopper.fwd_step``). ``pf``: the
        previous tile's probabilities in float32, made the ``P V`` operand here (``hopper.step_probs``, ``LATE_P``).
        ``(acc, pf, m_i, l_i)``, ``pf`` now tile ``t``'s."""
        st = (c + t) % STAGES
        pst = (c + t - 1) % STAGES
        mbarrier.wait(k_ready.index(st), ((c + t) // STAGES) & 1)
        sc = warpgroup_mma(qs, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p = mma_operand(pf, qs.dtype, p_layout, True)  # (``hopper.step_probs``)
        mbarrier.wait(v_ready.index(pst), ((c + t - 1) // STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        if t >= n_plain:
            sc = masked_scores(sc, t * BLOCK_N, n_k, shift, qidx, kidx, IS_CAUSAL)
        pf, alpha, m_i, l_i = softmax_step(sc, m_i, l_i, qk_scale, nest, NEST_T)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(empty.index(pst), count=1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        return acc, pf, m_i, l_i

    @gluon.jit
    def _ws_producer(a, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PER_UNIT: gl.constexpr,
                     IS_CAUSAL: gl.constexpr, NESTED: gl.constexpr, LAST: gl.constexpr, MERGE: gl.constexpr, q_desc,
                     k_desc, v_desc):
        """Each query tile's Q (two 64-row tiles, once both consumers are done with the last), then its key tiles. In
        a merging nested launch it first finds which of the tile's rows earlier launches wrote (``written_keyed``, a
        loop with table loads the consumers would otherwise run at their tile start) and hands them over in
        ``rows_smem`` (``rows_bar``): forward 1.006-1.007x (H200, D 128 at 64K, session 63)."""
        (T, O, L, OUT, PREV, n_prev, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, h0, head_offset, r,
         group, qk_scale, k, G, it0, n_items, n_tiles, n_units, n_slots, q_org, k_org, q_smem, k_smem, v_smem, q_bar,
         q_empty, k_ready, v_ready, empty, NEST, below, rows_smem, rows_bar) = a
        dtype: gl.constexpr = q_smem.dtype
        Q_BYTES: gl.constexpr = 64 * HEAD_DIM * dtype.primitive_bitwidth // 8
        KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
        c = 0
        n_q = 0
        for i in range(n_slots):
            live, h, b, qbase, q_hi, k_lo, k_hi, off, p_min, n_kt, q_row, k_row = _ws_tile(
                i, T, h0, head_offset, r, k, G, it0, n_items, n_tiles, n_units, q_org, k_org, PER_UNIT, BLOCK_N,
                IS_CAUSAL, NESTED, below, LAST)
            if live:
                mbarrier.wait(q_empty, (n_q & 1) ^ 1)
                if MERGE and NESTED:  # the consumers read the last tile's before they released its Q
                    rows = gl.arange(0, 128, layout=gl.BlockedLayout([4], [32], [1], [0]))
                    qp = p_min + rows * r
                    rows_smem.store(((qp < q_hi) & written_keyed(qp, h, head_offset, PREV, n_prev)).to(gl.int32))
                    mbarrier.arrive(rows_bar, count=1)
                mbarrier.expect(q_bar, 2 * Q_BYTES)
                rows_copy(q_desc, q_row, h, q_bar, q_smem.index(0))
                rows_copy(q_desc, q_row + 64, h, q_bar, q_smem.index(1))
                for t in range(0, n_kt):
                    ws_copy_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, c + t, k_row + t * BLOCK_N,
                               STAGES, KV_BYTES, h // group)
                c += n_kt
                n_q += 1

    @gluon.jit
    def dilated_fwd_ws_kernel(
        Q, K, V, O, L, OUT, PREV, T, NESTS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        head_offset, group, r, qk_scale, n_tiles, n_prev, G, n_units, n_items, heads, nest_i,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        PER_UNIT: gl.constexpr, PERSISTENT: gl.constexpr, IS_CAUSAL: gl.constexpr, MERGE: gl.constexpr,
        LAST: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
        NESTED: gl.constexpr = False, NEST_T: gl.constexpr = 1,
    ):
        """``dilated_fwd_hopper_kernel``'s contract for the ``BLOCK_M`` = 128-row query tiles of the program's units
        (``_ws_producer`` and two ``_ws_consumer`` s): ``n_tiles`` tiles an item at most, ``n_units`` units an item,
        ``G`` programs per item (``PERSISTENT``: ``G`` per group of ``n_items`` items, dealt to the launch's offset
        classes in proportion to their heads, ``forward_hopper.ws_schedule``; grid ``(most programs of a class,
        classes, groups)``), else ``(items x G, heads)``. ``NESTED``: a nested branch (row ``nest_i`` of
        ``NESTS``)."""
        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        h0 = gl.program_id(1)  # the class's first head (one head a program when not persistent)
        if PERSISTENT:
            k = gl.program_id(0)
            it0 = gl.program_id(2) * n_items
            n_c = (heads - h0 + r - 1) // r  # the class's heads: h0, h0 + r, ...
            before = (heads // r) * h0 + gl.minimum(heads % r, h0)  # heads of the classes before
            G = gl.minimum(G * (before + n_c) // heads - G * before // heads, n_c * n_items * n_units)
            G = gl.maximum(G, 1)  # (``ws_class_programs``)
            n_slots = gl.where(k < G, gl.maximum(n_c * n_items * n_units - k + G - 1, 0) // G * PER_UNIT, 0)
        else:
            k = gl.program_id(0) % G
            it0 = gl.program_id(0) // G
            n_items = 1
            n_slots = gl.maximum(n_units - k + G - 1, 0) // G * PER_UNIT
        b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, it0)
        off = (h0 + head_offset) % r
        q_first = first_selected(q_lo, off, r)
        k_first = first_selected(k_lo, off, r)
        if PERSISTENT:  # the head's columns in the offset class, up to the group's last item's last query / key:
            # rows past it (padding, another sequence) read as zeros, never as ``0 * v`` of a NaN there
            _, _, _, _, q_end, _, k_end = load_item(T, it0 + n_items - 1)
            q_org = ((qbase + off) % r + r) % r
            k_org = ((kbase + off) % r + r) % r
            n_q = n_rows(q_org, qbase + q_end, r)
            n_k = n_rows(k_org, kbase + k_end, r)
        else:  # the item's dilated rows
            q_org = qbase + q_first
            k_org = kbase + k_first
            n_q = n_rows(q_first, q_hi, r)
            n_k = n_rows(k_first, k_hi, r)
        # over every head (a tile's head is a coordinate): the class's heads share the rows' origin
        q_desc = heads_desc(Q + b * stride_qb + q_org.to(gl.int64) * stride_qn, heads, gl.maximum(n_q, 1), stride_qh,
                            r * stride_qn, 64, HEAD_DIM, dtype)
        # each consumer masks what its rows may not see
        k_desc = heads_desc(K + b * stride_kb + k_org.to(gl.int64) * stride_kn, heads // group, gl.maximum(n_k, 1),
                            stride_kh, r * stride_kn, BLOCK_N, HEAD_DIM, dtype)
        v_desc = heads_desc(V + b * stride_vb + k_org.to(gl.int64) * stride_vn, heads // group, gl.maximum(n_k, 1),
                            stride_vh, r * stride_vn, BLOCK_N, HEAD_DIM, dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar, k_ready, v_ready, empty = ws_barriers(STAGES)
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=2)
        # a nested merging launch: which of the tile's rows earlier launches wrote, found by the producer
        # (``_ws_producer``) while the consumers finish the last tile
        rows_smem = gl.allocate_shared_memory(gl.int32, [128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(rows_bar, count=1)
        fence_async_shared()
        NEST = NESTS + nest_i * NEST_COLUMNS  # not hopper.nest_row: its tensor 0 (not nested) handed to the
        below = 0  # partitions changed this kernel's SASS, a constant 0 keeps it
        if NESTED:
            below = gl.load(NEST)
        a = (T, O, L, OUT, PREV, n_prev, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, h0, head_offset, r,
             group, qk_scale, k, G, it0, n_items, n_tiles, n_units, n_slots, q_org, k_org, q_smem, k_smem, v_smem,
             q_bar, q_empty, k_ready, v_ready, empty, NEST, below, rows_smem, rows_bar)
        gl.warp_specialize([(_ws_consumer, (a, HEAD_DIM, BLOCK_N, STAGES, PER_UNIT, IS_CAUSAL, MERGE, LAST, 0,
                                            NESTED, NEST_T)),
                            (_ws_consumer, (a, HEAD_DIM, BLOCK_N, STAGES, PER_UNIT, IS_CAUSAL, MERGE, LAST, 1,
                                            NESTED, NEST_T)),
                            (_ws_producer, (a, HEAD_DIM, BLOCK_N, STAGES, PER_UNIT, IS_CAUSAL, NESTED, LAST, MERGE,
                                            q_desc, k_desc, v_desc))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
