"""What the Gluon kernels for Hopper share: the import of Triton's Gluon API (experimental, so it may be missing or
named otherwise), the ``HF_DILATED_GLUON`` switch, when a Gluon kernel may run at all, the TMA row descriptor, the
``wgmma`` accumulator layout, and the forward, dK/dV and dQ steps.

Gluon (``triton.experimental.gluon``) lets a kernel say where each operand lives, which ``wgmma`` runs
asynchronously and when a buffer may be refilled: the arrangement of the dK/dV kernels in ``block_sparse_hopper.py``
and ``backward_hopper.py`` that Triton's compiler does not choose. Their step (the products of one key tile with one
query tile) and its buffers are here (:func:`dkdv_buffers`, :func:`dkdv_scores`, :func:`dkdv_products`); what a
kernel walks and masks is its own. Gluon has no interpreter: the CPU tests compile those kernels for sm_90
(``benchmarks/kernel_resources.py``), the GPU tests run them against the float64 reference.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import triton

from . import configs
from .tiles import (
    LOG2E, NEST_COLUMNS, PART_COLUMNS, _ITEM_COLUMNS, _IT_B, _IT_K_BASE, _IT_K_HI, _IT_K_LO, _IT_Q_BASE, _IT_Q_HI,
    _IT_Q_LO,
)

try:  # Gluon is experimental; a Triton without it (or with another API) keeps the portable kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
    )

    # The TMA load's name: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` after.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # A barrier of the calling warps (within a warp-specialized partition, its own): ``thread_barrier`` up to Triton
    # 3.6, ``barrier`` after.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # The TMA reduce-add (``cp.reduce.async.bulk.tensor ... .add``) of a shared tile into global memory: Gluon's
    # ``tma.async_atomic_add`` from Triton 3.7 on; Triton 3.6 builds the same op but names no Gluon function for it.
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if tma_reduce_add is None:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """Add shared tile ``src`` into the rows of ``tensor_desc`` at ``coord`` (asynchronous: a
            ``tma.store_wait`` before ``src`` is written again)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_init = None
    warpgroup_mma_wait = tma_load = tma_reduce_add = thread_barrier = None


def available() -> bool:
    """Whether this Triton has the Gluon Hopper API the kernels are written against (checked on Triton 3.6 and 3.9;
    earlier Gluon releases named and laid out things differently)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return gluon is not None and (major, minor) >= (3, 6)


_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def switch(name: str, default: bool = True) -> bool:
    """An on/off environment variable, ``default`` when unset: ``1`` / ``true`` / ``on`` / ``yes`` or ``0`` /
    ``false`` / ``off`` / ``no`` (any case); any other value is refused, naming the variable."""
    value = os.environ.get(name, "1" if default else "0").strip().lower()
    if value not in _SWITCH:
        raise ValueError(f"{name} must be one of {sorted(_SWITCH)}, got {os.environ[name]!r}")
    return _SWITCH[value]


def environment_values(names: tuple) -> tuple:
    """The values of the environment variables ``names`` (None where unset), for a key read at every call.

    ``os.environ.get`` raises and catches a ``KeyError`` inside for each unset name: 4.2 us for five unset switches on
    this project's CPU, a signature read twice a forward+backward. CPython's ``os.environ`` keeps its values in a dict
    of encoded names (``_data``, which ``os.environ[name] = value`` and ``del`` update): read directly there, 0.3 us.
    Where ``os.environ`` is not that object (replaced by a plain mapping, another Python), the ``get`` of each."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return tuple(map(os.environ.get, names))
    keys = _ENCODED.get(names)
    if keys is None:
        keys = _ENCODED[names] = tuple(map(encode, names))
    return tuple(map(data.get, keys))


_ENCODED: dict = {}


def enabled() -> bool:
    """``HF_DILATED_GLUON=0`` (or ``false`` / ``off`` / ``no``) in the environment keeps the portable kernels: for a
    Triton whose Gluon misbehaves, or to compare the two (``benchmarks/ab_gluon.py``). Unset or
    ``1`` / ``true`` / ``on`` / ``yes``: the Gluon kernels where they apply; any other value is refused."""
    return switch("HF_DILATED_GLUON")


@contextlib.contextmanager
def portable():
    """Inside the block the portable kernels run where a Gluon one would (``HF_DILATED_GLUON=0``): what the tuners
    time when they choose the portable dK/dV kernel's config."""
    with mock.patch.dict(os.environ, {"HF_DILATED_GLUON": "0"}):
        yield


# The warp-specialized launches (:func:`ws_barriers`): 9 warps (two consumer warpgroups and the producer warp) at 168
# registers fill the register file; ``setmaxnreg`` then gives the consumers 240 and the producer 24.
WS_LAUNCH = dict(CONSUMER_REGS=240, PRODUCER_REGS=24, num_warps=4, maxnreg=168)


def runnable(tma_path: bool) -> bool:
    """Whether a Gluon kernel may run on this call's device: :func:`enabled` (read first, so that a bad
    ``HF_DILATED_GLUON`` is refused on any machine), the tensor-descriptor path on (``tma_path``), not under Triton's
    interpreter (Gluon has none), an sm_90 GPU (``wgmma``) and a Triton with the API (:func:`available`)."""
    return enabled() and tma_path and not configs.interpreting() and configs.wgmma() and available()


if gluon is not None:

    @gluon.constexpr_function
    def mma_layout(warps, columns):
        """The register layout of a Hopper ``wgmma`` accumulator (and of what lives beside it): ``warps`` warps
        stacked along the rows, 16 rows a warp an instruction, ``columns`` (a tile's keys or its head dim) an
        instruction wide. One definition for every Gluon kernel's score, output and gradient tiles."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, columns, 16])

    @gluon.jit
    def row_desc(base, n, row_stride, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """A TMA descriptor over a head's ``n`` rows (``row_stride`` apart: a head's rows, or its dilated rows with
        ``r * stride_n``), read ``BLOCK_ROWS`` at a time into shared memory of ``layout``; rows past ``n`` read as
        zeros (Gluon's ``tiles.row_desc``)."""
        return tma.make_tensor_descriptor(base, shape=[n, HEAD_DIM], strides=[row_stride, 1],
                                          block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)

    @gluon.jit
    def heads_desc(base, heads, n, head_stride, row_stride, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   dtype: gl.constexpr):
        """:func:`row_desc` over ``heads`` heads at once (``head_stride`` apart, ``n`` rows each): a tile's head is the
        first coordinate, a copy lands in a ``[1, BLOCK_ROWS, HEAD_DIM]`` view of a 2-D buffer laid out for
        ``[BLOCK_ROWS, HEAD_DIM]``. Rows past ``n`` read as zeros in every head."""
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_ROWS, HEAD_DIM], dtype)
        return tma.make_tensor_descriptor(base, shape=[heads, n, HEAD_DIM], strides=[head_stride, row_stride, 1],
                                          block_shape=[1, BLOCK_ROWS, HEAD_DIM], layout=layout)

    @gluon.jit
    def rows_copy(desc, row, head, bar, buf):
        """The TMA copy of the tile at ``row`` of ``desc`` into ``buf`` under ``bar``: of a :func:`row_desc`
        (``head`` None), or of head ``head`` of a :func:`heads_desc`, landing in a ``[1, rows, HEAD_DIM]`` view of the
        2-D buffer."""
        if head is None:
            tma_load(desc, [row, 0], bar, buf)
        else:
            tma_load(desc, [head, row, 0], bar, buf.reshape([1, buf.shape[0], buf.shape[1]]))

    @gluon.jit
    def load_item(T, item):
        """``tiles.load_item`` in Gluon: ``(b, q_base, k_base, q_lo, q_hi, k_lo, k_hi)`` of work item ``item``
        (``schedule.py``), ``b`` as int64."""
        t = T + item * _ITEM_COLUMNS
        return (gl.load(t + _IT_B).to(gl.int64), gl.load(t + _IT_Q_BASE), gl.load(t + _IT_K_BASE),
                gl.load(t + _IT_Q_LO), gl.load(t + _IT_Q_HI), gl.load(t + _IT_K_LO), gl.load(t + _IT_K_HI))

    @gluon.jit
    def first_selected(lo, off, r):
        """``tiles.first_selected`` in Gluon: the smallest position ``p >= lo`` with ``p % r == off``."""
        return lo + ((off - lo) % r + r) % r

    @gluon.jit
    def n_rows(first, hi, r):
        """``tiles.n_rows`` in Gluon: how many dilated rows ``first, first + r, ...`` lie below ``hi``."""
        return gl.maximum((hi - first + r - 1) // r, 0)

    @gluon.jit
    def part_query_tile(PARTS, n_parts, T, head_offset, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """``tiles.part_query_tile`` in Gluon: ``(r, base, nest_i, b, qbase, ..., p_min)`` of a program of the
        forward's one launch over its parts."""
        pid = gl.program_id(0)
        j = 0
        for i in range(1, n_parts):
            j = gl.where(pid >= gl.load(PARTS + i * PART_COLUMNS), i, j)
        row = PARTS + j * PART_COLUMNS
        local = pid - gl.load(row)
        n_tiles = gl.load(row + 2)
        r = gl.load(row + 3)
        tile = local % n_tiles
        if IS_CAUSAL:
            tile = n_tiles - 1 - tile
        b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min = query_tile(
            T, gl.load(row + 1) + local // n_tiles, tile, head_offset, r, BLOCK_M)
        return r, gl.load(row + 4), gl.load(row + 5), b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, \
            p_min

    @gluon.jit
    def item_query_tile(T, n_tiles, head_offset, r, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """``tiles.item_query_tile`` in Gluon: ``(b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0,
        p_min)`` of a query-tile program (an item's tiles last-first when causal: ``tiles.item_tile``)."""
        pid = gl.program_id(0)
        item = pid // n_tiles
        tile = pid % n_tiles
        if IS_CAUSAL:
            tile = n_tiles - 1 - tile
        return query_tile(T, item, tile, head_offset, r, BLOCK_M)

    @gluon.jit
    def query_tile(T, item, tile, head_offset, r, BLOCK_M: gl.constexpr):
        """``tiles.query_tile`` in Gluon: the tuple of :func:`item_query_tile` for tile ``tile`` of item ``item``."""
        h = gl.program_id(1)
        b, qbase, kbase, q_lo, q_hi, k_lo, k_hi = load_item(T, item)
        off = (h + head_offset) % r
        q_first = first_selected(q_lo, off, r)
        row0 = tile * BLOCK_M
        p_min = q_first + row0 * r
        return b, qbase, kbase, q_hi, k_lo, k_hi, h, off, q_first, tile, row0, p_min

    @gluon.jit
    def query_tile_keys(p_min, q_hi, k_lo, k_hi, off, r, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        IS_CAUSAL: gl.constexpr, NESTED: gl.constexpr = False, below=0):
        """``tiles.query_tile_keys`` in Gluon without window or holes: ``(k_first, n_k, n_plain, n_kt, shift)``, the
        tile's first selected key position, how many selected key rows it may see, how many ``BLOCK_N`` key tiles
        every query of the tile sees whole (no mask), how many key tiles there are, and the tile's first query in
        dilated rows after ``k_first`` (exact: both positions are in the offset class). ``NESTED``: a nested
        branch's keys, those before the query's ``below``-segment (``tiles.nest_limit``)."""
        p_max = gl.minimum(p_min + (BLOCK_M - 1) * r, q_hi - 1)
        k_end = k_hi
        if IS_CAUSAL:
            k_end = gl.minimum(k_end, p_max + 1)
        if NESTED:
            k_end = gl.minimum(k_end, nest_limit(p_max, below))
        k_first = first_selected(k_lo, off, r)
        n_k = n_rows(k_first, k_end, r)
        n_full = n_k
        if IS_CAUSAL:
            n_full = gl.minimum(gl.where(p_min >= k_first, (p_min - k_first) // r + 1, 0), n_k)
        if NESTED:
            n_full = gl.minimum(n_full, n_rows(k_first, nest_limit(p_min, below), r))
        n_plain = n_full // BLOCK_N
        n_kt = (n_k + BLOCK_N - 1) // BLOCK_N
        shift = (p_min - k_first) // r
        return k_first, n_k, n_plain, n_kt, shift

    @gluon.jit
    def kv_descs(K, V, b, kvh, kbase, k_first, n_k, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                 r, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """TMA descriptors over a query tile's ``n_k`` selected K and V rows from ``k_first`` (row stride ``r``
        rows): ``(k_desc, v_desc)``."""
        k0 = (kbase + k_first).to(gl.int64)
        n_desc = gl.maximum(n_k, 1)  # no copy is issued without keys
        k_desc = row_desc(K + b * stride_kb + kvh * stride_kh + k0 * stride_kn, n_desc, r * stride_kn, BLOCK_N,
                          HEAD_DIM, layout)
        v_desc = row_desc(V + b * stride_vb + kvh * stride_vh + k0 * stride_vn, n_desc, r * stride_vn, BLOCK_N,
                          HEAD_DIM, layout)
        return k_desc, v_desc

    @gluon.jit
    def kv_prefetch(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, n_kt, BLOCK_N: gl.constexpr,
                    K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, NBYTES: gl.constexpr):
        """The copies of the first ``K_STAGES`` K and ``V_STAGES`` V tiles (of ``n_kt``) issued."""
        for i in gl.static_range(K_STAGES):
            if i < n_kt:
                tile_copy(k_desc, k_smem, k_bar, i, i * BLOCK_N, K_STAGES, NBYTES)
        for i in gl.static_range(V_STAGES):
            if i < n_kt:
                tile_copy(v_desc, v_smem, v_bar, i, i * BLOCK_N, V_STAGES, NBYTES)

    @gluon.jit
    def written_before(p, head, head_offset, PREV, n_prev, heads):
        """``tiles.written_before`` in Gluon: whether a launch before this one wrote row ``p`` for one of the heads
        ``head .. head + heads - 1`` (earlier branches' rates in ``PREV[:n_prev]``)."""
        seen = p < -1
        for i in range(n_prev):
            ri = gl.load(PREV + i)
            seen = seen | ((((p - head - head_offset) % ri) + ri) % ri < heads)
        return seen

    @gluon.jit
    def written_keyed(p, head, head_offset, PREV, n_prev):
        """:func:`written_before` of a query row of nested launches (``launch.Problem.nesting``), whose tiles with no
        key skip their rows: ``PREV`` holds the earlier launches' ``(r, w, below)``, and launch ``i`` wrote row ``p``
        where its branch selects ``p`` and ``p`` keeps keys of it, at or past ``below`` in its segment of length ``w``
        (segments from position 0: ``launch._nests``; ``below`` 0: every row). Nested rates are powers of two
        (``launch.Problem.nesting``), and so are LongNet's segment lengths: their residues are masks. A tensor's
        remainder by a number known only at run time is a division routine per element: with three per row and
        earlier launch at every query tile's start, the r = 1 forward launch took 1.343 ms, with masks 1.317 ms (H200,
        16 / 16 / 128 at 64K, session 62)."""
        seen = p < -1
        for i in range(n_prev):
            ri = gl.load(PREV + 3 * i)
            wi = gl.maximum(gl.load(PREV + 3 * i + 1), 1)
            below = gl.load(PREV + 3 * i + 2)
            keyed = p >= -1
            if below != 0:
                if (wi & (wi - 1)) == 0:
                    keyed = (p & (wi - 1)) >= below
                else:
                    keyed = p % wi >= below
            seen = seen | ((((p - head - head_offset) & (ri - 1)) == 0) & keyed)
        return seen

    # The forward's pipeline (``forward_hopper.py``, ``block_sparse_hopper.py``). Triton 3.6 runs the portable
    # forward kernels with every ``wgmma`` waited for at once: its pipeliner keeps a product in flight only when the
    # next use of the result is another product's accumulator, and the online softmax rescales the output between
    # the products. So within a warpgroup the tensor cores wait for the softmax and the softmax for them. Here key
    # tile ``j``'s scores are issued before tile ``j - 1``'s ``P V``, and tile ``j``'s softmax runs while that product
    # is on the tensor cores (FA3's intra-warpgroup pipelining); the arithmetic is ``tiles.softmax_step``'s.

    @gluon.jit
    def query_tile_buffers(dtype: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
        """A query-tile program's shared memory (forward, dQ), ``(Q, K[K_STAGES], V[V_STAGES], Q's barrier, K's,
        V's)``, barriers initialised."""
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_bar.index(i), count=1)
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()
        return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar

    @gluon.jit
    def release_barriers(q_bar, k_bar, v_bar, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
        """The barriers of a query-tile program (forward, dQ) invalidated at its end."""
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(K_STAGES):
            mbarrier.invalidate(k_bar.index(i))
        for i in gl.static_range(V_STAGES):
            mbarrier.invalidate(v_bar.index(i))

    @gluon.jit
    def tile_copy(desc, smem, bar, j, row, STAGES: gl.constexpr, NBYTES: gl.constexpr):
        """Start the copy of key tile ``j`` (K or V: ``NBYTES`` from row ``row`` of ``desc``) into buffer
        ``j % STAGES``."""
        stage = j % STAGES
        mbarrier.expect(bar.index(stage), NBYTES)
        tma_load(desc, [row, 0], bar.index(stage), smem.index(stage))

    @gluon.jit
    def masked_scores(s, key0, n_k, shift, qidx, kidx, IS_CAUSAL: gl.constexpr):
        """Scores with the pairs no query may see at ``-inf``: key rows ``key0 + c`` at or past ``n_k`` and, when
        causal, keys after the query (key row ``key0 + c`` after query row ``i`` iff ``key0 + c > i + shift``)."""
        kj = key0 + kidx
        ok = (kj < n_k)[None, :]
        if IS_CAUSAL:
            ok = ok & (kj[None, :] <= (qidx + shift)[:, None])
        return gl.where(ok, s, float("-inf"))

    # Nested branches (``tiles.nest_weight``, ``launch.Problem.nesting``), in Gluon, where each branch's segments of the
    # branch below start at multiples of 128 of its dilated rows (``launch._nests``): a tile then lies in one of
    # them, so the kept keys are a range (the loop bounds: ``query_tile_keys``, ``_key_tile``) and no score needs a
    # mask beyond the causal one. The rates are powers of two, so a residue is a mask, and a tile's key weights repeat
    # every ``NEST_T`` rows (the highest rate over this branch's), so they are made once a tile.

    @gluon.jit
    def nest_row(NESTS, nest_i, NESTED: gl.constexpr):
        """A launch's row of the nest table (``launch._nests``: ``below`` first) and its ``below``, the segment length
        of the branch below whose earlier segments keep a query's keys (0 where the launch does not nest)."""
        NEST = NESTS + nest_i * NEST_COLUMNS
        below = 0
        if NESTED:
            below = gl.load(NEST)
        return NEST, below

    @gluon.jit
    def nest_limit(p, below):
        """``tiles.nest_limit``: the position the kept keys of a query at ``p`` lie below."""
        return gl.where(below > 0, p - p % gl.maximum(below, 1), p + 1)

    @gluon.jit
    def nest_first_query(kp, below):
        """``tiles.nest_first_query``: the first query position that keeps a key at ``kp``."""
        return gl.where(below > 0, kp - kp % gl.maximum(below, 1) + below, kp)

    @gluon.jit
    def nest_weight(p, head, head_offset, NEST, inv_scale):
        """``tiles.nest_weight`` (rates powers of two): ``log2(1 + higher branches that select p) * inv_scale``."""
        n = (p * 0 + 1).to(gl.int32)
        for j in range(gl.load(NEST + 1)):
            n += (((p - head - head_offset) & (gl.load(NEST + 2 + j) - 1)) == 0).to(gl.int32)
        return gl.log2(n.to(gl.float32)) * inv_scale

    @gluon.jit
    def nest_class_weights(s, k_first, head, head_offset, r, NEST, inv_scale, NEST_T: gl.constexpr):
        """:func:`nest_weight` of a score tile's key columns by class (column ``c`` is in class ``c % NEST_T``: the
        weights repeat every ``NEST_T`` key rows, ``NEST_T`` a power of two that the higher rates over ``r`` divide),
        in the layout :func:`nest_scores` reads them in: a thread holds one value per class it meets, 4 of a 128-key
        tile's at ``NEST_T`` 16, not one per column (32 held through the loop spilled the warp-specialized
        forward)."""
        M: gl.constexpr = s.shape[0]
        N: gl.constexpr = s.shape[1]
        layout: gl.constexpr = gl.reshape(s, [M, N // NEST_T, NEST_T]).type.layout
        c = gl.arange(0, NEST_T, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        u = (k_first - head - head_offset) // r  # exact: the key rows are in the head's offset class
        y = (c + u) & (NEST_T - 1)
        n = (y * 0 + 1).to(gl.int32)
        for j in range(gl.load(NEST + 1)):
            n += ((y & (gl.load(NEST + 2 + j) // r - 1)) == 0).to(gl.int32)
        return gl.log2(n.to(gl.float32)) * inv_scale

    @gluon.jit
    def nest_row_weights(s, p, head, head_offset, NEST, inv_scale, NEST_T: gl.constexpr):
        """:func:`nest_weight` of a score tile's rows (positions ``p``, in the tile's row layout), in the layout
        :func:`nest_scores` reads them in (converted once a tile, not once a step)."""
        M: gl.constexpr = s.shape[0]
        N: gl.constexpr = s.shape[1]
        layout: gl.constexpr = gl.reshape(s, [M, N // NEST_T, NEST_T]).type.layout
        return gl.convert_layout(nest_weight(p, head, head_offset, NEST, inv_scale),
                                 gl.SliceLayout(1, gl.SliceLayout(2, layout)))

    @gluon.jit
    def nest_scores(s, wq, wk, NEST_T: gl.constexpr):
        """Scores plus each pair's weight, ``min`` of its query's (``wq``, the tile's rows:
        :func:`nest_row_weights`) and its key's (``wk``, by column class: :func:`nest_class_weights`); ``NEST_T`` 1
        has none (every weight is 1). The dK / dV kernels' form, whose rows' terms (lse) change along a score row."""
        if NEST_T == 1:
            out = s
        else:
            M: gl.constexpr = s.shape[0]
            N: gl.constexpr = s.shape[1]
            s3 = gl.reshape(s, [M, N // NEST_T, NEST_T])
            s3 = s3 + gl.minimum(wq[:, None, None], wk[None, None, :])
            out = gl.convert_layout(gl.reshape(s3, [M, N]), s.type.layout, assert_trivial=True)
        return out

    @gluon.jit
    def nest_pair_weights(s, p, k_first, head, head_offset, r, NEST, NEST_T: gl.constexpr):
        """``log2 m`` of each (row, key class) pair of a score tile (rows at positions ``p``, its first key at
        ``k_first``; ``tiles.nest_weight``): ``[M, 1, NEST_T]`` in :func:`exp2_rows`' class layout, made once a
        tile; 0 where ``NEST_T`` is 1 (every weight is 1)."""
        if NEST_T == 1:
            w = 0.0
        else:
            w = gl.minimum(nest_row_weights(s, p, head, head_offset, NEST, 1.0, NEST_T)[:, None, None],
                           nest_class_weights(s, k_first, head, head_offset, r, NEST, 1.0, NEST_T)[None, None, :])
        return w

    @gluon.jit
    def exp2_rows(s, qk_scale, rows, w, NEST_T: gl.constexpr):
        """``exp2(s * qk_scale - rows)`` of a score tile against a term per row (the running maximum, or lse), times
        each pair's nested weight ``m`` (``w``: :func:`nest_pair_weights`; ``NEST_T`` 1: none). The weight goes into
        the row's term by key class, ``[M, 1, NEST_T]`` values, so a score still costs one multiply-add (added to
        each score: 56 more instructions in the warp-specialized forward's tile loop; NOTES_triton, session 58). The
        row maximum is the unweighted scores', so ``p`` is at most ``m`` (the branch count at most)."""
        if NEST_T == 1:
            p = gl.exp2(s * qk_scale - rows[:, None])
        else:
            M: gl.constexpr = s.shape[0]
            N: gl.constexpr = s.shape[1]
            s3 = gl.reshape(s, [M, N // NEST_T, NEST_T])
            r3 = gl.convert_layout(rows, gl.SliceLayout(1, gl.SliceLayout(2, s3.type.layout)), assert_trivial=True)
            p3 = gl.exp2(s3 * qk_scale + (w - r3[:, None, None]))
            p = gl.convert_layout(gl.reshape(p3, [M, N]), s.type.layout, assert_trivial=True)
        return p

    @gluon.jit
    def softmax_first(s, qk_scale, w=0.0, NEST_T: gl.constexpr = 1):
        """``(p, m_i, l_i)`` of a row block's first score tile (``w``, ``NEST_T``: a nested branch's weights,
        :func:`exp2_rows`)."""
        m_i = gl.maximum(gl.max(s, 1) * qk_scale, -1.0e30)
        p = exp2_rows(s, qk_scale, m_i, w, NEST_T)
        return p, m_i, gl.sum(p, 1)

    @gluon.jit
    def softmax_step(s, m_i, l_i, qk_scale, w=0.0, NEST_T: gl.constexpr = 1):
        """``(p, alpha, m_new, l_new)`` of a further score tile: its probabilities against the new maximum, and the
        factor ``alpha`` that rescales what was summed before (``w``, ``NEST_T``: as :func:`softmax_first`)."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = exp2_rows(s, qk_scale, m_new, w, NEST_T)
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def softmax_start(s, acc, m_i, l_i, qk_scale, o_rows: gl.constexpr, RESUME: gl.constexpr, w=0.0,
                      NEST_T: gl.constexpr = 1):
        """``(p, acc, m_i, l_i)`` of a row block's first score tile: ``softmax_first``, or, ``RESUME``, a
        ``softmax_step`` from the sums carried in (the rows earlier launches wrote: ``forward_hopper.resume_rows``),
        ``acc`` rescaled (``w``, ``NEST_T``: as :func:`softmax_first`)."""
        if RESUME:
            p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale, w, NEST_T)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        else:
            p, m_i, l_i = softmax_first(s, qk_scale, w, NEST_T)
        return p, acc, m_i, l_i

    @gluon.jit
    def fwd_first(n_kt, q_smem, k_smem, k_bar, k_desc, k_next, s_zero, qk_scale, mask, key0, n_k, shift, qidx, kidx,
                  acc, m_i, l_i, o_rows: gl.constexpr, p_layout: gl.constexpr, K_STAGES: gl.constexpr,
                  NBYTES: gl.constexpr, IS_CAUSAL: gl.constexpr, RESUME: gl.constexpr, LATE_P: gl.constexpr, nest=0.0,
                  NEST_T: gl.constexpr = 1):
        """Key tile 0 (its K in buffer 0): its scores alone, nothing to overlap yet; its K buffer refilled with tile
        ``K_STAGES`` (row ``k_next``). ``(p, acc, m_i, l_i)`` (``softmax_start``; ``p`` as :func:`step_probs`
        carries it). ``nest``, ``NEST_T``: a nested branch's weights (:func:`nest_pair_weights`)."""
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if K_STAGES < n_kt:
            tile_copy(k_desc, k_smem, k_bar, K_STAGES, k_next, K_STAGES, NBYTES)
        if mask:
            s = masked_scores(s, key0, n_k, shift, qidx, kidx, IS_CAUSAL)
        p, acc, m_i, l_i = softmax_start(s, acc, m_i, l_i, qk_scale, o_rows, RESUME, nest, NEST_T)
        return step_probs(p, q_smem.dtype, p_layout, LATE_P), acc, m_i, l_i

    @gluon.jit
    def fwd_step(j, n_kt, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, k_next, v_next, acc, p, m_i, l_i,
                 s_zero, qk_scale, mask, key0, n_k, shift, qidx, kidx, o_rows: gl.constexpr, p_layout: gl.constexpr,
                 K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, NBYTES: gl.constexpr, MASKABLE: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, LATE_P: gl.constexpr, nest=0.0, NEST_T: gl.constexpr = 1):
        """Key tile ``j >= 1`` of ``n_kt`` (``nest``, ``NEST_T``: as :func:`fwd_first`): its scores issued, then tile
        ``j - 1``'s ``P V`` (``p``: its probabilities, :func:`step_probs`), the softmax of tile ``j`` while that
        product runs, then the rescale of the output. The scores are masked where ``MASKABLE`` and ``mask``
        (:func:`masked_scores`). Each buffer is refilled as soon as its product has read it: K with tile
        ``j + K_STAGES`` (from row ``k_next``) once the scores are in, V with tile ``j - 1 + V_STAGES`` (row
        ``v_next``) once ``P V`` is. ``(acc, p, m_i, l_i)``, ``p`` now tile ``j``'s."""
        ks = j % K_STAGES
        vs = (j - 1) % V_STAGES
        mbarrier.wait(k_bar.index(ks), (j // K_STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p = mma_operand(p, q_smem.dtype, p_layout, LATE_P)
        mbarrier.wait(v_bar.index(vs), ((j - 1) // V_STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(vs), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if j + K_STAGES < n_kt:
            tile_copy(k_desc, k_smem, k_bar, j + K_STAGES, k_next, K_STAGES, NBYTES)
        if MASKABLE:
            if mask:
                s = masked_scores(s, key0, n_k, shift, qidx, kidx, IS_CAUSAL)
        pj, alpha, m_new, l_i = softmax_step(s, m_i, l_i, qk_scale, nest, NEST_T)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        if j - 1 + V_STAGES < n_kt:
            tile_copy(v_desc, v_smem, v_bar, j - 1 + V_STAGES, v_next, V_STAGES, NBYTES)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        return acc, step_probs(pj, q_smem.dtype, p_layout, LATE_P), m_new, l_i

    # Where a tile's probabilities become the ``P V`` product's register operand. ``LATE_P``: carried to the next step
    # in float32 and converted just before that product is issued. The new ``P`` is then not written into the
    # registers the previous ``P V`` still reads, and ptxas runs the softmax under that product; converted at the
    # softmax's end, ptxas waited for the product before the exponentials (session 64: the warp-specialized forward
    # 1.03x at head dim 128). It holds 16-32 more registers through the step: a head-dim-64 program at 128 registers
    # (four an SM) spilled, or fell to three an SM, and ran 0.97x, so it converts at the softmax's end there, as the
    # block-sparse forwards do (0.98x / 1.000x late). The warp-specialized dilated forward (240 registers a consumer)
    # converts late at every head dim (1.013x at head dim 64, 256K).

    @gluon.jit
    def step_probs(pf, dtype: gl.constexpr, p_layout: gl.constexpr, LATE_P: gl.constexpr):
        """What a step hands the next of its float32 probabilities: themselves (``LATE_P``), or the operand."""
        if LATE_P:
            p = pf
        else:
            p = gl.convert_layout(pf.to(dtype), p_layout)
        return p

    @gluon.jit
    def mma_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, LATE_P: gl.constexpr):
        """The ``P V`` product's register operand from what :func:`step_probs` handed over."""
        if LATE_P:
            p = gl.convert_layout(p.to(dtype), p_layout)
        return p

    @gluon.jit
    def fwd_last(p, v_smem, v_bar, acc, n_kt, m_i, l_i, o_rows: gl.constexpr, p_layout: gl.constexpr,
                 V_STAGES: gl.constexpr, LATE_P: gl.constexpr):
        """The last tile's ``P V`` (``p``: its probabilities, :func:`step_probs`), then ``tiles.finish``:
        ``(output, natural-log lse)`` of each row (0 and -inf for a row that saw no key), in the output's layout."""
        last = (n_kt - 1) % V_STAGES
        p = mma_operand(p, v_smem.dtype, p_layout, LATE_P)
        mbarrier.wait(v_bar.index(last), ((n_kt - 1) // V_STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        return softmax_finish(acc, m_i, l_i, o_rows)

    @gluon.jit
    def softmax_finish(acc, m_i, l_i, o_rows: gl.constexpr):
        """``tiles.finish``: ``(output, natural-log lse)`` of each row from the online softmax's sums (0 and -inf for
        a row that saw no key), in the output's layout."""
        l_o = gl.convert_layout(l_i, o_rows)
        m_o = gl.convert_layout(m_i, o_rows)
        has = l_o != 0  # tiles.finish: 0 is a row that saw no key, NaN (a NaN input) stays NaN
        l_safe = gl.where(has, l_o, 1.0)
        return acc / l_safe[:, None], gl.where(has, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    # Warp-specialized programs (``forward_hopper.dilated_fwd_ws_kernel``, ``block_sparse_hopper.bs_fwd_ws_kernel`` /
    # ``bs_bwd_dq_hopper_kernel``): a producer warp streams K / V tiles through ``STAGES`` buffers to two consumer
    # warpgroups, each owning 64 of the program's 128 query rows; a buffer is refilled once both consumers released it.

    @gluon.jit
    def ws_barriers(STAGES: gl.constexpr):
        """A warp-specialized program's barriers, initialised: ``(Q's (and dO's), K ready[STAGES], V ready[STAGES],
        empty[STAGES])``. The producer's ``expect`` completes a ready barrier with its copy; an empty one takes an
        arrival from each consumer."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        return q_bar, k_ready, v_ready, empty

    @gluon.jit
    def ws_copy_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, t, row, STAGES: gl.constexpr,
                   NBYTES: gl.constexpr, head=None):
        """The producer's step: key tile ``t``'s K and V (``NBYTES`` each, from row ``row`` of the descriptors, and of
        kv head ``head`` for :func:`heads_desc` ones) into buffer ``t % STAGES`` once both consumers released its
        last use, each copy under its own ready barrier (so the scores need not wait for V)."""
        st = t % STAGES
        mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(st), NBYTES)
        rows_copy(k_desc, row, head, k_ready.index(st), k_smem.index(st))
        mbarrier.expect(v_ready.index(st), NBYTES)
        rows_copy(v_desc, row, head, v_ready.index(st), v_smem.index(st))

    # The dQ pipeline (``backward_hopper.dilated_bwd_dq_hopper_kernel``): per key tile, ``S = Q K^T`` and
    # ``dP = dO V^T`` are issued, then the previous tile's ``dQ += dS K``; the exponentials of this tile run while
    # ``dP`` and that product are on the tensor cores, ``dS`` while the product is. The portable dq kernel waits for
    # ``S`` and ``dP`` as soon as they are issued (Triton 3.6 keeps only the chained ``dQ`` product in flight). ``dS``
    # stays in registers as the A operand, held by the wait's ``deps`` until its product is done. That is the source
    # order; the compiler moves the exponentials and ``dS`` after the waits (Triton 3.6, sm_90: after ``dP``'s at
    # D = 128, after every product's at D = 256). Pinning them (``P`` and the new ``dS`` as the waits' ``deps``) and
    # reordering the products were both bit-equal and within noise at D = 256 (session 55, NOTES_triton.md).

    @gluon.jit
    def dq_first(n_kt, q_smem, do_smem, k_smem, v_smem, k_bar, v_bar, v_desc, s_zero, lse, delta, qk_scale, mask,
                 n_k, shift, qidx, kidx, ds_layout: gl.constexpr, BLOCK_N: gl.constexpr, V_STAGES: gl.constexpr,
                 NBYTES: gl.constexpr, IS_CAUSAL: gl.constexpr, nest=0.0, NEST_T: gl.constexpr = 1):
        """Key tile 0: its scores and ``dP``, nothing to overlap yet; its V buffer refilled with tile ``V_STAGES``.
        Its ``dS`` (K stays in its buffer for the product). ``nest``, ``NEST_T``: a nested branch's weights
        (:func:`nest_pair_weights`)."""
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(0), 0)
        dp = warpgroup_mma(do_smem, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if mask:
            s = masked_scores(s, 0, n_k, shift, qidx, kidx, IS_CAUSAL)
        p = exp2_rows(s, qk_scale, lse, nest, NEST_T)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        if V_STAGES < n_kt:
            tile_copy(v_desc, v_smem, v_bar, V_STAGES, V_STAGES * BLOCK_N, V_STAGES, NBYTES)
        ds = p * (dp - delta[:, None])
        return gl.convert_layout(ds.to(q_smem.dtype), ds_layout)

    @gluon.jit
    def dq_step(j, n_kt, q_smem, do_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, dq, ds, s_zero, lse, delta,
                qk_scale, mask, n_k, shift, qidx, kidx, ds_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, NBYTES: gl.constexpr, MASKABLE: gl.constexpr,
                IS_CAUSAL: gl.constexpr, nest=0.0, NEST_T: gl.constexpr = 1):
        """Key tile ``j >= 1`` of ``n_kt`` (``nest``, ``NEST_T``: as :func:`dq_first`): ``S`` and ``dP`` issued, then
        tile ``j - 1``'s ``dQ += dS K`` (``ds``: its ``dS``); this tile's ``P`` while ``dP`` and that product run, its
        ``dS`` while the product does. V's buffer is refilled with tile ``j + V_STAGES`` once ``dP`` is in, tile ``j -
        1``'s K buffer with tile ``j - 1 + K_STAGES`` once its product is done. Scores masked where ``MASKABLE`` and
        ``mask``. ``(dq, ds)``, ``ds`` now tile ``j``'s."""
        ks = j % K_STAGES
        vs = j % V_STAGES
        pk = (j - 1) % K_STAGES
        mbarrier.wait(k_bar.index(ks), (j // K_STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(vs), (j // V_STAGES) & 1)
        dp = warpgroup_mma(do_smem, v_smem.index(vs).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds, k_smem.index(pk), dq, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
        if MASKABLE:
            if mask:
                s = masked_scores(s, j * BLOCK_N, n_k, shift, qidx, kidx, IS_CAUSAL)
        p = exp2_rows(s, qk_scale, lse, nest, NEST_T)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
        if j + V_STAGES < n_kt:
            tile_copy(v_desc, v_smem, v_bar, j + V_STAGES, (j + V_STAGES) * BLOCK_N, V_STAGES, NBYTES)
        ds_j = (p * (dp - delta[:, None])).to(q_smem.dtype)
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
        if j - 1 + K_STAGES < n_kt:
            tile_copy(k_desc, k_smem, k_bar, j - 1 + K_STAGES, (j - 1 + K_STAGES) * BLOCK_N, K_STAGES, NBYTES)
        return dq, gl.convert_layout(ds_j, ds_layout)

    @gluon.jit
    def dq_last(n_kt, k_smem, dq, ds, K_STAGES: gl.constexpr):
        """The last tile's ``dQ += dS K``, waited for."""
        dq = warpgroup_mma(ds, k_smem.index((n_kt - 1) % K_STAGES), dq, is_async=True)
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
        return dq

    @gluon.jit
    def dkdv_buffers(dtype: gl.constexpr, kv_layout: gl.constexpr, q_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr, PART: gl.constexpr = 0):
        """The shared memory of a dK/dV program: ``(K, V, Q[2], dO[2], the K/V copy's barrier, a barrier per Q/dO
        buffer)``, barriers initialised: K and V read once, Q and dO double-buffered. A program that computes dV alone
        (``PART`` 1) has no V (``V`` is K's buffer, never loaded)."""
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        if PART == 1:
            v_smem = k_smem
        else:
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)
        fence_async_shared()
        return k_smem, v_smem, q_smem, do_smem, kv_bar, ready

    @gluon.jit
    def lse_base2(lse):
        """lse rows in base 2, a row that saw no key read as 0: what every Gluon backward kernel multiplies scores
        against. In a dK/dV step, apply it where the step begins, before the rows are spread over the score tile's
        columns: once a row, not once per column a thread holds (16 at 64 queries: 45 instructions a step). And a step
        after their load: applied as they were loaded, the step waited there for its load (0.97-0.99x;
        ``benchmarks/NOTES_triton.md``, session 39)."""
        return gl.where(lse == float("-inf"), 0.0, lse) * LOG2E

    @gluon.jit
    def step_rows(l_row, dl_row, first, rows, n, r, live):
        """lse and delta of a dK/dV step's query rows ``first + rows`` (dilated, ``r`` rows apart from ``l_row`` /
        ``dl_row``), 0 past row ``n`` or where ``live`` is false: read a step ahead of their use, one value a thread
        (``rows`` in a one-row-a-thread layout), so no step waits on a global load."""
        mask = (first + rows < n) & live
        return (gl.load(l_row + (first + rows) * r, mask=mask, other=0.0),
                gl.load(dl_row + (first + rows) * r, mask=mask, other=0.0))

    @gluon.jit
    def dkdv_scores(k_smem, v_smem, qs, dos, s_zero, dk, dv):
        """A dK/dV step's transposed products, ``S^T = K Q^T`` and ``dP^T = V dO^T`` (K, V, Q, dO in shared memory),
        issued asynchronously: ``(S^T, dP^T in flight, dk, dv)``. Products of the last step still in flight (the
        fused dQ step leaves dK so) are issued before them; leaving only dP^T outstanding also retires those, whose
        buffers the next tile's copy overwrites."""
        sT = warpgroup_mma(k_smem, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sT, dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(sT, dk, dv))
        return sT, dpT, dk, dv

    # The dV / dK products of a step read ``P^T`` and ``dS^T`` from registers, as the A operand (``a_layout``: the
    # dot-operand layout of the gradient tile's ``wgmma``, which the score tile's accumulator converts to without
    # shared memory). Through shared memory each would be stored and read back: 32 of the step's 160 KB of
    # shared-memory traffic at 64 x 64 x 128, the resource the block-sparse dK/dV kernel is bound by (Nsight: 73%).
    # A register operand stays locked until its product retires, so both are retired within the step: carried into
    # the next step's wait, they spilled (60-136 bytes) and ran slower (benchmarks/NOTES_triton.md, session 23).

    @gluon.jit
    def dkdv_products(pT, dpT, delta, qs, dos, dk, dv, dtype: gl.constexpr, a_layout: gl.constexpr):
        """The rest of a dK/dV step: ``dV += P^T dO`` issued while ``dS^T = P^T (dP^T - delta)`` is computed, then
        ``dK += dS^T Q``; both waited for, ``(dk, dv)`` as accumulators of the next step's products."""
        pa = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(pa, dos, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        da = gl.convert_layout((pT * (dpT - delta[None, :])).to(dtype), a_layout)
        dk = warpgroup_mma(da, qs, dk, is_async=True)
        dk, dv, pa, da = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pa, da))
        return warpgroup_mma_init(dk), warpgroup_mma_init(dv)

    @gluon.jit
    def register_product(a, b_smem, acc, dtype: gl.constexpr, a_layout: gl.constexpr):
        """``acc += a @ b_smem`` with ``a`` (float32 scores) as the register A operand, waited for: the one gradient
        product of a program that computes dV alone (``P^T dO``) or dK alone (``dS^T Q``)."""
        a = gl.convert_layout(a.to(dtype), a_layout)
        acc = warpgroup_mma(a, b_smem, acc, is_async=True)
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        return warpgroup_mma_init(acc)

    @gluon.jit
    def score_buffers(dtype: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr):
        """``(P^T, dS^T)`` in shared memory, for :func:`dkdv_dq_products` (the ``dS K`` product reads ``dS^T``
        transposed, which only shared memory gives)."""
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_Q], p_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_Q], p_layout)
        return p_smem, ds_smem

    @gluon.jit
    def dkdv_dq_products(pT, dpT, delta, qs, dos, k_smem, p_smem, ds_smem, dq_smem, dq_desc, dk, dv, q_row, scale,
                         dtype: gl.constexpr, dq_layout: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr):
        """:func:`dkdv_products` with the step's dQ, ``P^T`` and ``dS^T`` through shared memory (``p_smem``,
        ``ds_smem``; as register operands here they spilled 50-70 bytes and ran no faster): ``dV += P^T dO`` issued
        while ``dS^T`` is computed, then ``dS K`` (the step's queries' share of dQ) and ``dK += dS^T Q``; waiting
        for ``dS K`` leaves ``dK`` in flight while the share goes through shared memory to a TMA reduce-add into the
        float32 sums (rows ``q_row ..`` of the head's dilated rows; rows past the item's last query lie outside the
        descriptor and are dropped). ``dq_layout``: the share's register layout (its columns split over the
        warpgroups); ``BLOCK_Q`` x ``HEAD_DIM``: its shape."""
        p_smem.store(pT.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(p_smem, dos, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        ds_smem.store((pT * (dpT - delta[None, :])).to(dtype))
        fence_async_shared()
        dq_zero = gl.zeros([BLOCK_Q, HEAD_DIM], gl.float32, layout=dq_layout)  # made here: no live registers
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_smem, qs, dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))  # also retires dV, issued before it
        tma.store_wait(0)  # the last step's reduce has read the tile
        dq_smem.store(dq * scale)
        fence_async_shared()
        tma_reduce_add(dq_desc, [q_row, 0], dq_smem)
        return dk, dv

else:  # pragma: no cover - a Triton without Gluon: the kernel modules import these names and define no kernel
    query_tile_keys = row_desc = dkdv_buffers = dkdv_scores = dkdv_products = lse_base2 = first_selected = n_rows = None
    step_rows = None
    dkdv_dq_products = register_product = score_buffers = None
    written_before = load_item = item_query_tile = kv_descs = kv_prefetch = heads_desc = rows_copy = None
    query_tile_buffers = release_barriers = tile_copy = masked_scores = fwd_first = fwd_step = fwd_last = None
    mma_operand = step_probs = None
    nest_row = nest_limit = nest_first_query = nest_weight = nest_class_weights = nest_row_weights = nest_scores = None
    nest_pair_weights = exp2_rows = written_keyed = None
    softmax_first = softmax_step = softmax_start = softmax_finish = None
    dq_first = dq_step = dq_last = ws_barriers = ws_copy_kv = mma_layout = None
