"""``@triton.jit`` helpers shared by the forward, backward, decode and block-sparse kernels: reading a work item and
the order of its tiles, the
dilated row grid, the key (or query) range a tile may see and how much of it needs no mask, the (query, key) pair
mask, the online-softmax step and its finish, the tensor descriptor over a head's (dilated) rows, and the dropout
draw (the same uint32 arithmetic as ``ops/dropout.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import schedule

LOG2E_F = 1.4426950408889634
LOG2E = tl.constexpr(LOG2E_F)
LN2 = tl.constexpr(0.6931471805599453)

_IT_B = tl.constexpr(schedule.IT_B)
_IT_Q_BASE = tl.constexpr(schedule.IT_Q_BASE)
_IT_K_BASE = tl.constexpr(schedule.IT_K_BASE)
_IT_Q_LO = tl.constexpr(schedule.IT_Q_LO)
_IT_Q_HI = tl.constexpr(schedule.IT_Q_HI)
_IT_K_LO = tl.constexpr(schedule.IT_K_LO)
_IT_K_HI = tl.constexpr(schedule.IT_K_HI)
_ITEM_COLUMNS = tl.constexpr(schedule.ITEM_COLUMNS)
PART_COLUMNS = tl.constexpr(schedule.PART_COLUMNS)
NEST_COLUMNS = tl.constexpr(schedule.NEST_COLUMNS)


@triton.jit
def load_item(T, item):
    """``(b, q_base, k_base, q_lo, q_hi, k_lo, k_hi)`` of work item ``item`` (see ``schedule.py``); ``b`` as int64."""
    t = T + item * _ITEM_COLUMNS
    return (tl.load(t + _IT_B).to(tl.int64), tl.load(t + _IT_Q_BASE), tl.load(t + _IT_K_BASE),
            tl.load(t + _IT_Q_LO), tl.load(t + _IT_Q_HI), tl.load(t + _IT_K_LO), tl.load(t + _IT_K_HI))


@triton.jit
def item_tile(n_tiles, HEAVIEST_LAST: tl.constexpr):
    """``(item, tile)`` of this program in a launch over ``n_items * n_tiles`` programs on axis 0 (the launchers'
    ``items_grid``): the tiles of one segment item are consecutive programs, so the key/value rows they share are read
    from L2 while they run (an item-major order keeps every segment of a long input in flight at once and streams
    them from DRAM again and again). With ``HEAVIEST_LAST`` (query tiles under causal attention: the last tile sees
    the most keys) the tiles run last-first, so the heaviest start first and the launch ends on light ones."""
    pid = tl.program_id(0)
    item = pid // n_tiles
    tile = pid % n_tiles
    if HEAVIEST_LAST:
        tile = n_tiles - 1 - tile
    return item, tile


@triton.jit
def item_query_tile(T, n_tiles, head_offset, r, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """A query-tile program's work (the forward and dQ kernels; grid: items x tiles on axis 0, heads on axis 1):
    ``(b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min)``: its item (:func:`load_item`), head
    and offset class, the item's first selected query position, the tile, its first dilated row and that row's
    position; the tile has rows where ``p_min < q_hi``."""
    item, tile = item_tile(n_tiles, IS_CAUSAL)
    return query_tile(T, item, tile, head_offset, r, BLOCK_M)


@triton.jit
def part_query_tile(PARTS, n_parts, T, head_offset, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """:func:`item_query_tile` for a program of the forward's one launch over its parts (every branch but the last:
    ``launch.forward``), and the program's part: ``(r, base, nest_i, b, qbase, ..., p_min)``. ``PARTS``: int32 rows
    ``(first program, first item, tiles per item, r, compact row base, branch index)`` per part, axis 0 of the grid the
    parts' programs one after another (each part's as :func:`item_tile` orders them), ``T`` the parts' items in order.
    Returned after ``base``: the part's branch index (its row of the nesting table, :func:`nest_query_tile`)."""
    pid = tl.program_id(0)
    j = 0
    for i in range(1, n_parts):
        j = tl.where(pid >= tl.load(PARTS + i * PART_COLUMNS), i, j)
    row = PARTS + j * PART_COLUMNS
    local = pid - tl.load(row)
    n_tiles = tl.load(row + 2)
    r = tl.load(row + 3)
    nest_i = tl.load(row + 5)
    tile = local % n_tiles
    if IS_CAUSAL:
        tile = n_tiles - 1 - tile
    b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = query_tile(
        T, tl.load(row + 1) + local // n_tiles, tile, head_offset, r, BLOCK_M)
    return r, tl.load(row + 4), nest_i, b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min


@triton.jit
def query_tile(T, item, tile, head_offset, r, BLOCK_M: tl.constexpr):
    """:func:`item_query_tile`'s tuple for tile ``tile`` of item ``item`` (the head: axis 1 of the grid)."""
    h = tl.program_id(1)
    b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, item)
    off = (h + head_offset) % r
    q_first = first_selected(q_lo, off, r)
    row0 = tile * BLOCK_M
    p_min = q_first + row0 * r
    return b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min


@triton.jit
def mm(a, b, UPCAST: tl.constexpr):
    """``tl.dot`` by mode: 0 plain (bf16 / fp16), 1 float32 operands (works around the interpreter's wrong bfloat16
    dots, CPU tests only), 2 float32 inputs as ``tf32x3``: three tf32 tensor-core products, float32's accuracy
    (SPEC's 1e-5 in the H100 oracle tests; one tf32 product missed 1e-3) at 5x ``ieee``'s forward speed and 7x its
    forward+backward, since ``ieee`` runs on the FMA units and spills (benchmarks/NOTES_triton.md, session 10);
    3 float32 as ``ieee``, before Ampere (no tf32 tensor cores)."""
    if UPCAST == 1:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif UPCAST == 2:
        c = tl.dot(a, b, input_precision="tf32x3")
    elif UPCAST == 3:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def first_selected(lo, off, r):
    """Smallest position ``p >= lo`` with ``p % r == off`` (``off >= 0``; ``lo`` may be negative)."""
    return lo + ((off - lo) % r + r) % r


@triton.jit
def n_rows(first, hi, r):
    """How many dilated rows ``first, first + r, ...`` lie below ``hi``."""
    return tl.maximum((hi - first + r - 1) // r, 0)


@triton.jit
def rounded(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Float32 ``x`` in ``DTYPE``, rounded to nearest even as the GPU converts (``cvt.rn``). Triton's interpreter
    (``UPCAST`` 1: bfloat16 under it) truncates float32 to bfloat16, which doubled the gradients' rounding error in
    the CPU tests; there the rounding is done on the bits. The GPU's code is a plain conversion."""
    if UPCAST == 1 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def written_before(p, head, head_offset, PREV, n_prev, heads):
    """Whether a launch before this one wrote row ``p``: some earlier branch (rates ``PREV[:n_prev]``, int32) selects
    position ``p`` for one of the heads ``head .. head + heads - 1`` (``heads`` 1 for a query row; a kv head's query
    heads for a key row). Branch launches merge into what earlier ones wrote, reading only these rows, so the
    buffers need no fill when every selected row of every branch is written (contiguous layouts); elsewhere they
    start at zeros / -inf and the rows this names are a superset of those written."""
    seen = p < -1  # all false
    for i in range(n_prev):
        ri = tl.load(PREV + i)
        seen = seen | ((((p - head - head_offset) % ri) + ri) % ri < heads)
    return seen


@triton.jit
def tile_rows(first, tile, r, hi, base, VALID, valid_base, BLOCK: tl.constexpr, HOLES: tl.constexpr):
    """Tile ``tile`` of a branch's dilated rows (positions ``first + j r``, below ``hi``; column ``base + p``):
    ``(positions, in range, columns, mask)``, the mask being in range and, with ``HOLES``, valid
    (``VALID[valid_base + column]``). Queries in the forward and dq, keys in dK/dV."""
    p = first + (tile * BLOCK + tl.arange(0, BLOCK)) * r
    in_range = p < hi
    c = base + p
    ok = in_range
    if HOLES:
        ok = ok & (tl.load(VALID + valid_base + c, mask=in_range, other=0) != 0)
    return p, in_range, c, ok


@triton.jit
def unmasked_key_rows(p_min, k_first, n_k, r, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                      HOLES: tl.constexpr):
    """How many of a query tile's first key rows (a multiple of ``BLOCK_N``) every query of the tile, the first at
    position ``p_min``, sees whole: their tiles need no mask (plain causal or bidirectional layouts only)."""
    if WINDOW or HOLES:
        n_full = 0
    elif IS_CAUSAL:
        n_full = tl.minimum(tl.where(p_min >= k_first, (p_min - k_first) // r + 1, 0), n_k)
    else:
        n_full = n_k
    return (n_full // BLOCK_N) * BLOCK_N


@triton.jit
def query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HOLES: tl.constexpr):
    """The keys of a query tile (the forward's and dq's loop bounds): ``(k_first, n_k, n_full)``, the first selected
    key position the tile may see, how many selected key rows it may see, and how many of those (a multiple of
    ``BLOCK_N``, :func:`unmasked_key_rows`) need no mask. The tile's first query is at ``p_min``, its rows step by
    ``r`` below ``q_hi``."""
    p_max = tl.minimum(p_min + (BLOCK_M - 1) * r, q_hi - 1)
    lo, hi = key_range(p_min, p_max, k_lo, k_hi, window, IS_CAUSAL, WINDOW)
    k_first = first_selected(lo, off, r)
    n_k = n_rows(k_first, hi, r)
    return k_first, n_k, unmasked_key_rows(p_min, k_first, n_k, r, BLOCK_N, IS_CAUSAL, WINDOW, HOLES)


@triton.jit
def key_range(p_min, p_max, k_lo, k_hi, window, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Positions ``[lo, hi)`` of the item's keys that queries at positions ``p_min..p_max`` may see."""
    lo = k_lo
    hi = k_hi
    if IS_CAUSAL:
        hi = tl.minimum(hi, p_max + 1)
    if WINDOW:
        lo = tl.maximum(lo, p_min - window + 1)
        if not IS_CAUSAL:
            hi = tl.minimum(hi, p_max + window)
    return lo, hi


@triton.jit
def query_range(kp_min, kp_max, q_lo, q_hi, window, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Positions ``[lo, hi)`` of the item's queries that may see keys at positions ``kp_min..kp_max``."""
    lo = q_lo
    hi = q_hi
    if IS_CAUSAL:
        lo = tl.maximum(lo, kp_min)
    if WINDOW:
        hi = tl.minimum(hi, kp_max + window)
        if not IS_CAUSAL:
            lo = tl.maximum(lo, kp_min - window + 1)
    return lo, hi


@triton.jit
def allowed(ok, dist, window, IS_CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``ok`` and the causal / window rule on ``dist = p - p'`` (SPEC.md: causal ``0 <= dist < window``,
    bidirectional ``|dist| < window``)."""
    if IS_CAUSAL:
        ok = ok & (dist >= 0)
    if WINDOW:
        ok = ok & (dist < window)
        if not IS_CAUSAL:
            ok = ok & (dist > -window)
    return ok


@triton.jit
def row_desc(base, n, row_stride, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A TMA tensor descriptor over ``n`` rows of ``HEAD_DIM`` elements ``row_stride`` elements apart (a head's rows,
    or its dilated rows with ``r * stride_n``), read ``BLOCK_ROWS`` at a time; tiles past the last row read zeros."""
    return tl.make_tensor_descriptor(base, shape=[n, HEAD_DIM], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, HEAD_DIM])


@triton.jit
def load_rows(ptrs, rmask, dmask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``[rows, HEAD_DIM]`` tile, zero outside the valid rows (``MASK_ROWS``) and past the real head dim."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return x


@triton.jit
def tile_mask(rmask, dmask, EVEN_D: tl.constexpr):
    """The ``[rows, HEAD_DIM]`` store mask: valid rows, real head dims (no column mask when none is padded)."""
    if EVEN_D:
        m = rmask[:, None]
    else:
        m = rmask[:, None] & dmask[None, :]
    return m


@triton.jit
def softmax_step(acc, l_i, m_i, qk, qk_scale, v, row_hash, k_col, drop_threshold, inv_keep, DROPOUT: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One online-softmax step over a key tile: scores ``qk * qk_scale`` in log2 units (``qk`` unscaled, -inf where
    masked; ``qk_scale > 0``), so that the scaling and the max subtraction are one FMA per score. The normaliser
    ``l_i`` sums the undropped probabilities; with ``DROPOUT`` the keep decisions are drawn here (``drop_keep`` of the
    rows' ``row_hash`` and the keys' columns ``k_col``) and the output accumulates only the kept ones, scaled by
    ``inv_keep``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(drop_keep(row_hash[:, None], k_col[None, :], drop_threshold), p * inv_keep, 0.0)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST)
    return acc, l_i, m_new


@triton.jit
def finish(acc, l_i, m_i):
    """Output ``acc / l`` and natural-log lse of a row (0 and -inf for a row that saw no key: ``l`` exactly 0; a NaN
    ``l``, from a NaN in the inputs, gives NaN in both, as SPEC's formula does)."""
    has = l_i != 0
    l_safe = tl.where(has, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(has, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))


@triton.jit
def merge_rows(o_a, lse_a, o_b, lse_b):
    """The exact merge of two softmax-normalised row sets (outputs, natural-log lse): ``o = sum_i softmax(lse)_i
    o_i``; rows with no key in either stay (0, -inf), a NaN stays NaN (:func:`finish`)."""
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    a = tl.exp(lse_a - m)
    c = tl.exp(lse_b - m)
    s = a + c
    reached = s != 0
    s_safe = tl.where(reached, s, 1.0)
    return (o_a * a[:, None] + o_b * c[:, None]) / s_safe[:, None], tl.where(reached, m + tl.log(s_safe),
                                                                              float("-inf"))


@triton.jit
def mix32(x):
    """lowbias32 on uint32 (``ops/dropout.mix32``)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def drop_rows(S, b, h, H, q_col):
    """Per query row the first hash ``mix32(stream ^ q_col)``; ``S`` points at this branch's ``[B, H]`` int64 streams
    (``ops/dropout.stream``)."""
    s = tl.load(S + b * H + h).to(tl.uint32)
    return mix32(s ^ q_col.to(tl.uint32))


@triton.jit
def drop_keep(row_hash, k_col, threshold):
    """Keep decisions ``mix32(row_hash ^ k_col) >= threshold`` (operands already broadcast to the tile's shape)."""
    return mix32(row_hash ^ k_col.to(tl.uint32)) >= threshold.to(tl.uint32)


# Nested branches (``launch.Problem.nesting``): where every branch's segments and selected rows lie inside the next
# branch's, a (query, key) pair of branch i that lies in one segment of branch i - 1 is also a pair of every branch
# below i; each pair is then computed once, by the lowest branch that has it, with the weight ``m`` (a score
# ``+ log m``) of the branches that have it (SPEC: one softmax over the union, a key reached by m branches carrying
# log m). A branch's row of the nesting table: ``(below, n_higher, rates of the n_higher branches above it)``,
# ``below`` the segment length of the branch under it (0 for the first): a key of branch i is kept for a query only
# when it lies in an earlier ``below``-segment than the query's. The pair's weight is 1 + the number of higher
# branches that select both (each higher branch's segment holds the pair, so selecting both is enough).


@triton.jit
def nest_limit(p, below):
    """Per query position ``p``: the keys it keeps in a nested branch lie at positions below this (the start of its
    ``below``-segment; ``p + 1``, plain causal, where ``below`` is 0)."""
    return tl.where(below > 0, p - p % tl.maximum(below, 1), p + 1)


@triton.jit
def nest_first_query(kp, below):
    """Per key position ``kp``: the first query position of a nested branch that keeps it (the start of the next
    ``below``-segment; ``kp`` itself, plain causal, where ``below`` is 0)."""
    return tl.where(below > 0, kp - kp % tl.maximum(below, 1) + below, kp)


@triton.jit
def nest_query_tile(NESTS, nest_i, qp, p_min, q_hi, k_first, n_k, n_full, head, head_offset, r, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A query tile's keys in a nested branch (the forward's and dq's, after :func:`query_tile_keys`): ``(NEST, qlim,
    n_k, n_full, q_weight)``, the branch's row of the nesting table, each query's key limit (:func:`nest_limit`), the
    key rows it may see and those every query sees whole (a multiple of ``BLOCK_N``), and the rows' weights
    (:func:`nest_weight`, raw-score units)."""
    NEST = NESTS + nest_i * NEST_COLUMNS
    below = tl.load(NEST)
    p_max = tl.minimum(p_min + (BLOCK_M - 1) * r, q_hi - 1)
    n_k = tl.minimum(n_k, n_rows(k_first, nest_limit(p_max, below), r))
    n_full = tl.minimum(n_full, (n_rows(k_first, nest_limit(p_min, below), r) // BLOCK_N) * BLOCK_N)
    return NEST, nest_limit(qp, below), n_k, n_full, nest_weight(qp, head, head_offset, NEST, 1.0 / qk_scale)


@triton.jit
def nest_weight(p, head, head_offset, NEST, inv_scale):
    """Per position ``p`` (query head ``head``): ``log2(1 + higher branches that select p) * inv_scale``. A pair's
    weight is the smaller of its query's and key's (every higher branch that selects both has the pair), so the
    score bias is ``min(wq, wk)`` (``inv_scale`` 1 / the kernel's score scale, so the bias adds to raw scores)."""
    n = tl.zeros(p.shape, dtype=tl.int32) + 1
    for j in range(tl.load(NEST + 1)):
        rj = tl.load(NEST + 2 + j)
        n += (((p - head - head_offset) & (rj - 1)) == 0).to(tl.int32)  # rates are powers of two
    return tl.math.log2(n.to(tl.float32)) * inv_scale
