"""Launchers: allocate outputs, build the work lists, pick launch configurations and run the kernels.

No autograd here (that is ``op.py``); these are plain functions of tensors. ``LAUNCHES`` counts the calls of each
launcher, so tests can assert that the kernels (not a fallback) ran.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch

from ...config import DENSE_SEGMENT
from ..dropout import keep_threshold, stream
from . import backward_hopper, forward_hopper, plans, relaunch
from .backward import delta_kernel, dilated_bwd_dkdv_kernel, dilated_bwd_dq_kernel
from .configs import (
    bwd_config, decode_config, dot_mode, fwd_config, interpreting, sm_count, use_tma,
    state as config_state,
)
from .decode import dilated_decode_kernel
from .forward import dilated_fwd_branch_kernel
from .hopper import switch
from .schedule import NEST_COLUMNS, RunPlan, branch_items
from .tiles import LOG2E_F as LOG2E

LAUNCHES: Counter = Counter()


@dataclass(frozen=True)
class Problem:
    """Everything but the tensors: the branches and what restricts the (query, key) pairs.

    ``window`` 0 means none; ``global_tokens`` g > 0 adds the branch ``(DENSE_SEGMENT, 1)`` capped at position g;
    ``dropout_p`` > 0 needs ``seed`` (int64 scalar tensor)."""

    branches: tuple
    is_causal: bool
    scale: float
    head_offset: int
    window: int = 0
    global_tokens: int = 0
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None

    def kernel_branches(self):
        """``(w, r, k_cap)`` per branch in draw order (SPEC's global-token branch last, index ``len(branches)``)."""
        out = [(int(w), int(r), None) for w, r in self.branches]
        if self.global_tokens > 0:
            out.append((DENSE_SEGMENT, 1, int(self.global_tokens)))
        return out

    def nesting(self) -> tuple | None:
        """Per kernel branch its row of the nesting table (``tiles.nest_weight``: ``(below, n_higher, higher rates,
        0...)``), or None where the branches do not nest. They nest when each branch's segment length and rate divide
        the next one's: then every pair a branch shares with a lower branch lies in one segment of the branch just
        below, and the kernels compute each (query, key) pair once, weighted by the branches that have it, instead of
        once per branch (LongNet's 2048..32768 / 1..16: 24% fewer pairs, and the r > 1 branches' causal segments become
        full rectangles). Rates powers of two, the highest at most 64 times the lowest (a residue is then a mask, and a
        key tile's weights repeat in every key tile of at least 64 rows). Causal only (a bidirectional branch's kept
        keys lie on both sides of the query's segment: two ranges), without a window, and without dropout (SPEC draws
        each (query, key, branch) apart)."""
        br = [(int(w), int(r)) for w, r in self.branches]
        if (not NESTED_PAIRS or not self.is_causal or self.window or self.dropout_p > 0 or len(br) < 2
                or len(br) - 1 > NEST_COLUMNS - 2 or any(r & (r - 1) for _, r in br) or br[-1][1] > 64 * br[0][1]
                or any(w1 % w0 or r1 % r0 for (w0, r0), (w1, r1) in zip(br, br[1:]))):
            return None
        rows = []
        for i in range(len(br)):
            higher = [r for _, r in br[i + 1:]]
            rows.append((br[i - 1][0] if i else 0, len(higher), *higher) + (0,) * (NEST_COLUMNS - 2 - len(higher)))
        if self.global_tokens > 0:  # the global-token branch: plain causal, weight 1
            rows.append((0,) * NEST_COLUMNS)
        return tuple(rows)


# Nested branches computed once per (query, key) pair (``Problem.nesting``); False (``HF_DILATED_NESTED=0`` in the
# environment when this is imported): every branch computes all its pairs (the tests compare the two).
NESTED_PAIRS = switch("HF_DILATED_NESTED")


def _nests(pb: Problem, device, gluon: bool = False, plan: RunPlan | None = None) -> tuple[torch.Tensor, bool]:
    """The nesting table on ``device`` (int32 ``[branches, NEST_COLUMNS]``, made once per device and branches) and
    whether the kernels use it (``NESTED``); a one-row placeholder where the branches do not nest. The Gluon kernels
    (``gluon``) take it only where each branch's segments of the branch below start at multiples of ``GLUON_NEST_ROWS``
    of its dilated rows (LongNet's: 1024) and the items start at segments' starts (``plan.from_start``): their tiles
    then lie in one such segment, the kept keys are a range of whole tiles and no score needs a mask of its own
    (``hopper.exp2_rows``, ``hopper.nest_scores``); elsewhere they compute every branch's pairs (the same function)."""
    rows = pb.nesting()
    if rows and gluon:
        br = pb.branches
        aligned = all(w0 % (r1 * GLUON_NEST_ROWS) == 0 for (w0, _), (_, r1) in zip(br, br[1:]))
        rows = rows if aligned and (plan is None or plan.from_start) else None
    table = rows or ((0,) * NEST_COLUMNS,)
    return _constant(f"nests{table}", device, lambda: torch.tensor(table, dtype=torch.int32).to(device)), bool(rows)


GLUON_NEST_ROWS = 128  # the Gluon kernels' largest tile of dilated rows


def _nest_period(pb: Problem, branch_indices) -> int:
    """The period, in a launch's dilated key rows, of its nested key weights (``hopper.nest_class_weights``): the
    highest rate over the lowest rate of the launch's branches (1 for the global-token branch, whose weights are all
    1)."""
    rates = [r for _, r in pb.branches]
    return max((rates[-1] // rates[i] if i < len(rates) else 1) for i in branch_indices)


def _keyed_rates(pb: Problem, order, device) -> torch.Tensor:
    """The Gluon forward's table of its nested launches, ``(r, w, below)`` in launch order (``hopper.written_keyed``):
    a nested launch before the last skips its tiles whose rows keep no key of it, so an earlier launch wrote a row
    only where its branch selects it and it lies at or past ``below`` in its segment (made once per device and
    order)."""
    branches = pb.kernel_branches()
    rows = pb.nesting()
    table = [x for i, r, _ in order for x in (r, branches[i][0], rows[i][0])]
    return _constant(f"keyed{table}", device, lambda: torch.tensor(table, dtype=torch.int32).to(device))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the grids. Plain Python: ``triton.cdiv`` is a constexpr function in recent Triton
    releases and costs about 4 us a host call (26 calls per forward+backward)."""
    return -(-a // b)


def head_dim_block(d: int) -> int:
    """The kernels' padded head dim: the next power of two, at least 16 (``tl.dot`` operands)."""
    return max(16, 1 << (int(d) - 1).bit_length())


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride in its last dim (the kernels' row loads), copied only when it has not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def row_deltas(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None = None, rec=None) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` in float32, contiguous ``[B, H, N]`` (one Triton pass, no float copies of O and dO),
    minus ``dlse`` when the lse gets a gradient; the backward kernels read it with the contiguous lse's strides.
    ``rec``: a :class:`plans.Recorder` to run (and record) the pass through, the backward's first step."""
    B, H, N, D = o.shape
    delta = torch.empty(B, H, N, device=o.device, dtype=torch.float32)
    run = relaunch.run if rec is None else rec.run
    if rec is not None:
        rec.buffer(delta)
    if N:
        run(delta_kernel, (cdiv(N, 64), B * H),
            o, do, delta, *o.stride()[:3], *do.stride()[:3], H, N, HEAD_DIM=head_dim_block(D), D=D, BLOCK=64
        )
    if dlse is not None:
        delta = (delta - dlse.to(torch.float32)).contiguous()
    return delta


def items_grid(n_items: int, max_rows: int, block: int, heads: int) -> tuple[tuple[int, int], int]:
    """``((n_items * n_tiles, heads), n_tiles)``: the grid of a branch launch, every item's ``n_tiles`` row tiles as
    consecutive programs on axis 0 (``tiles.item_tile`` maps a program back; axis 0 admits 2**31 - 1 programs, the
    other axes 65535)."""
    n_tiles = cdiv(max_rows, block)
    if n_items * n_tiles >= 2**31 or heads > 65535:
        raise ValueError(f"too many work items for one launch: {n_items} items x {n_tiles} tiles x {heads} heads")
    return (n_items * n_tiles, heads), n_tiles


_CONSTANTS: dict = {}


def _constant(kind: str, device, make):
    """A small tensor that every launch of a kind can share (placeholders, branch tables): built once per device."""
    key = (kind, str(device))
    hit = _CONSTANTS.get(key)
    if hit is None:
        hit = _CONSTANTS[key] = make()
    return hit


def _int8(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the int8 the kernels read (a free view, no copy, when it is already contiguous)."""
    return mask.contiguous().view(torch.int8) if mask.dtype == torch.bool else mask.to(torch.int8).contiguous()


def _extras(pb: Problem, holes: bool, layout_valid, B: int, H: int, device, rec: plans.Recorder | None = None):
    """Kernel arguments shared by every launch: validity (int8, read with holes), dropout streams, flags; the shared
    placeholders declared constants of ``rec``."""
    q_valid, k_valid = layout_valid
    none = _constant("int8", device, lambda: torch.zeros(1, dtype=torch.int8, device=device))
    if rec is not None:
        rec.constant(none)
    qv = _int8(q_valid.to(device=device)) if holes and q_valid is not None else none
    kv = _int8(k_valid.to(device=device)) if holes and k_valid is not None else none
    n_br = len(pb.kernel_branches())
    if pb.dropout_p > 0:
        seed = pb.seed.to(device=device, dtype=torch.int64).reshape(())
        ids = torch.arange(n_br, device=device)[:, None, None]
        streams = stream(seed, ids, torch.arange(B, device=device)[:, None], torch.arange(H, device=device))
        streams = streams.expand(n_br, B, H).contiguous()
        thr, inv_keep = keep_threshold(pb.dropout_p), 1.0 / (1.0 - pb.dropout_p)
    else:
        streams = _constant(f"streams{n_br}", device,
                            lambda: torch.zeros((n_br, 1, 1), dtype=torch.int64, device=device))
        thr, inv_keep = 0, 1.0
    window = min(int(pb.window), DENSE_SEGMENT) if pb.window else 0
    flags = dict(IS_CAUSAL=pb.is_causal, WINDOW=window > 0, HOLES=holes, DROPOUT=pb.dropout_p > 0)
    return qv, kv, streams, window, thr, inv_keep, flags


def _launch_order(pb: Problem, plan: RunPlan, cache_key, device, rows_reached: bool):
    """The branch launches in order, ``[(branch index, r, BranchItems)]`` (branches without items left out), the
    rates in that order as an int32 device table (``tiles.written_before`` reads the first ``j`` for launch ``j``;
    built once per device and order), and the index of the branch launched last because it writes every row, or
    ``None``.

    On a contiguous layout (``cache_key`` is given only for those: no padding, one sequence per row) every selected
    row of every branch lies in one of its segments, so an ``r = 1`` branch reaches every query: it is launched last
    and writes the final output in its dtype, and the buffers the launches merge into need no fill (the launches read
    only rows that an earlier one wrote). ``rows_reached``: whether that holds for every row the caller writes (the
    backward's dK / dV also need every key reached: queries and keys the same rows, no global-token branch, which
    stops at position g). Contiguous layouts reuse the whole answer (a layer's forward and backward ask for the same
    one, and every layer of a model with the same shapes does: host time is what a small problem waits on)."""
    memo = None
    if cache_key is not None:
        memo = (cache_key, pb.branches, pb.is_causal, pb.global_tokens, str(device), rows_reached, plan.holes)
        hit = _ORDERS.get(memo)
        if hit is not None:
            return hit
    branches = pb.kernel_branches()
    items = [(i, r, branch_items(plan.runs, w, r, pb.is_causal, device, cache_key, cap))
             for i, (w, r, cap) in enumerate(branches)]
    items = [x for x in items if x[2].n_items]
    last = None
    if cache_key is not None and not plan.holes and rows_reached:
        last = next((i for i, r, _ in items if r == 1 and branches[i][2] is None), None)
    order = [x for x in items if x[0] != last] + [x for x in items if x[0] == last]
    rates = None
    if order:
        table = [r for _, r, _ in order]
        rates = _constant(f"rates{table}", device, lambda: torch.tensor(table, dtype=torch.int32).to(device))
    if memo is not None:
        if len(_ORDERS) >= 256:
            _ORDERS.clear()
        _ORDERS[memo] = (order, rates, last)
    return order, rates, last


_ORDERS: dict = {}


def _branch_views(streams: torch.Tensor) -> tuple:
    """``streams[i]`` for every branch, made once per streams tensor (the shared placeholder without dropout): a view
    per launch is host time that small problems wait on."""
    hit = _VIEWS.get(id(streams))
    if hit is None or hit[0] is not streams:
        hit = _VIEWS[id(streams)] = (streams, tuple(streams[i] for i in range(streams.shape[0])))
    return hit[1]


_VIEWS: dict = {}


# The backward's dQ launches run on a second stream beside the dK/dV launches (``forked``); False runs both on
# the current stream (tests compare the two: the same kernels, so the same bits).
CONCURRENT_BACKWARD = True
_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def forked(device: torch.device):
    """A fork of the current stream of ``device``: the body runs on the current stream, and launches inside
    ``with beside():`` (``forked(...) as beside``) on a second stream that starts where the current one stood at the
    fork and that the current stream waits for on exit.

    The backward's dQ launches and its dK/dV launches read the same tensors and write different ones, so they need
    no order between them; on one stream each launch's last, partly empty wave of programs leaves SMs idle, on two
    the other kind's programs fill them (the branch launches of one kind stay ordered: they merge into the same
    sums). Every tensor the second stream touches is allocated on the current stream and kept alive until the join,
    so the caching allocator cannot hand its memory out early. On the CPU, under the interpreter, or with
    ``CONCURRENT_BACKWARD`` False, everything stays on the current stream."""
    if not CONCURRENT_BACKWARD or device.type != "cuda" or interpreting():
        yield contextlib.nullcontext
        return
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(main)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def _buffer(rec: plans.Recorder, shape, device, filled: bool, dtype=torch.float32, like: torch.Tensor | None = None):
    """A buffer the launches write (contiguous, or laid out ``like`` a tensor of that shape and dtype), registered with
    ``rec``: zeros (``filled``: rows no launch reaches must read as 0), or uninitialized memory (a fill of 10% of the
    forward's time at 64K on the H100, ``benchmarks/NOTES_triton.md``); under the interpreter unfilled buffers start
    as NaN, so that the CPU tests would see any row the launches missed."""
    out = torch.empty(shape, device=device, dtype=dtype) if like is None else torch.empty_like(like, dtype=dtype)
    fill = 0.0 if filled else float("nan") if interpreting() else None
    return rec.buffer(out if fill is None else out.fill_(fill), fill)


# The forward's branch launches but the last in one launch, each branch's rows written once, compact, and merged by
# the last launch (``_parts``); False (``HF_DILATED_PARTS=0`` in the environment when this is imported): a launch per
# branch, each merging into what the launches before it wrote (the tests compare the two).
COMPACT_PARTS = switch("HF_DILATED_PARTS")


@dataclass(frozen=True)
class Parts:
    """The forward's one launch over its parts (every branch launch but the last, an ``r = 1`` branch that merges them):
    ``table`` (int32 rows of ``tiles.part_query_tile``: first program, first item, tiles per item, r, compact row base,
    branch index), the parts' ``items`` concatenated, ``n_programs`` (axis 0 of its grid); a part of rate ``r`` writes
    row ``base + column // r`` (its rows of one head have one residue mod ``r``: ``ceil(Nq / r)`` rows)."""

    table: torch.Tensor
    items: torch.Tensor
    n_programs: int


def _parts(order, Nq: int, block_m: int, device) -> Parts | None:
    """:class:`Parts` for the branch launches ``order[:-1]`` (made once per order, block and length), or None where
    their compact rows would not fit in the ``Nq`` rows of the buffer they share."""
    memo = (id(order), Nq, block_m, str(device))
    hit = _PARTS.get(memo)
    if hit is not None and hit[0] is order:
        return hit[1]
    table, start, first_item, rows = [], 0, 0, 0
    for i, r, it in order[:-1]:
        n_tiles = cdiv(it.max_q_rows, block_m)
        table.append([start, first_item, n_tiles, r, rows, i])
        start, first_item, rows = start + it.n_items * n_tiles, first_item + it.n_items, rows + cdiv(Nq, r)
    parts = None
    if rows <= Nq and start < 2**31:
        parts = Parts(torch.tensor(table, dtype=torch.int32).to(device),
                      torch.cat([it.items for _, _, it in order[:-1]]), start)
    if len(_PARTS) >= 256:
        _PARTS.clear()
    _PARTS[memo] = (order, parts)
    return parts


_PARTS: dict = {}


def _forward_launches(order, rates, last, parts: Parts | None, heads: int, cfg: dict, ws: bool):
    """The forward's launches: ``(j, branch, r, items, PREV, n_prev, grid, n_tiles, flags)``. Without ``parts``, one
    per branch of ``order``, launch ``j`` merging into the rows launches ``< j`` wrote (``PREV`` their rates, or the
    nested Gluon forward's ``(r, w, below)``: :func:`_keyed_rates`). With them, the parts' launch and the last
    branch's, which merges the parts' rows (``PREV`` the parts' table)."""
    if parts is None:
        for j, (i, r, it) in enumerate(order):
            grid, n_tiles = (None, None) if ws else items_grid(it.n_items, it.max_q_rows, cfg["BLOCK_M"], heads)
            yield j, i, r, it.items, rates, j, grid, n_tiles, dict(MERGE=j > 0, LAST=i == last, PARTS=False)
        return
    n_parts = len(order) - 1
    # r and the tiles per item of each program come from the table (2: placeholders no specialisation singles out)
    yield (0, order[0][0], 2, parts.items, parts.table, n_parts, (parts.n_programs, heads), 2,
           dict(MERGE=False, LAST=False, PARTS=True))
    i, r, it = order[-1]
    grid, n_tiles = items_grid(it.n_items, it.max_q_rows, cfg["BLOCK_M"], heads)
    yield n_parts, i, r, it.items, parts.table, n_parts, grid, n_tiles, dict(MERGE=False, LAST=True, PARTS=True)


def _plan_key(kind: str, tensors, pb: Problem, plan: RunPlan, cache_key, *extra):
    """The :mod:`.plans` key of a launcher call, or None where it is not replayed: layouts other than contiguous ones
    (their work lists and validity masks are the call's own), dropout (its streams are drawn per call)."""
    if cache_key is None or plan.holes or pb.dropout_p > 0 or not plans.ENABLED:
        return None
    return plans.signature(kind, tensors, pb, cache_key, COMPACT_PARTS, NESTED_PAIRS, CONCURRENT_BACKWARD,
                           SCRATCH_FRACTION, SCRATCH_MIN_BYTES, relaunch.ENABLED, config_state(), *extra)


def forward(q, k, v, pb: Problem, plan: RunPlan, layout_valid, cache_key):
    """Merged output ``[B, H, Nq, D]`` (query dtype) and float32 lse ``[B, H, Nq]`` over all branches: a launch per
    branch, or (:class:`Parts`, where the last launch reaches every row and the kernel takes them) two. A call with
    the signature of an earlier one on a contiguous layout replays its recorded launches (:mod:`.plans`)."""
    LAUNCHES["forward"] += 1
    q, k, v = rowmajor(q), rowmajor(k), rowmajor(v)
    key = _plan_key("forward", (q, k, v), pb, plan, cache_key)
    return plans.call(key, (q, k, v), LAUNCHES,
                      lambda rec, q, k, v: _forward(rec, q, k, v, pb, plan, layout_valid, cache_key))


def _forward(rec: plans.Recorder, q, k, v, pb: Problem, plan: RunPlan, layout_valid, cache_key):
    """:func:`forward`'s launches, each step through ``rec``."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    order, rates, last = _launch_order(pb, plan, cache_key, q.device, rows_reached=True)
    filled = last is None
    if filled:  # the launches merge into float32 zeros (lse: -inf), cast at the end
        lse = rec.buffer(torch.full((B, H, Nq), float("-inf"), device=q.device), float("-inf"))
        o = out = _buffer(rec, (B, H, Nq, D), q.device, True)
    else:  # the last launch writes the output in the query dtype; a float32 buffer only where launches merge into it
        lse = _buffer(rec, (B, H, Nq), q.device, False)
        out = _buffer(rec, (B, H, Nq, D), q.device, False, q.dtype)
        o = _buffer(rec, (B, H, Nq, D), q.device, False) if len(order) > 1 and q.dtype != torch.float32 else out
    qv, kv, streams, window, thr, inv_keep, flags = _extras(pb, plan.holes, layout_valid, B, H, q.device, rec)
    cfg = fwd_config(head_dim_block(D), q.dtype)
    tma = use_tma((q, k, v), head_dim_block(D) != D, plan.holes)
    if tma:
        rec.scratch(q.device)
        rec.count("forward_tma")
    gluon = forward_hopper.applies(q, flags, tma)  # the Gluon forward (sm_90)
    nests, nested = _nests(pb, q.device, gluon, plan)
    rec.constant(nests)
    rec.count("forward_nested", nested)
    ws = gluon and forward_hopper.ws_applies(  # warp-specialized: head dim 128, and 64 where balanced
        q, flags, tma, [(it.n_items, it.items_per_group, it.max_q_rows, r) for _, r, it in order], sm_count(q.device))
    if gluon:
        gcfg = forward_hopper.ws_launch_config() if ws else forward_hopper.launch_config(D)
        gkernel = forward_hopper.dilated_fwd_ws_kernel if ws else forward_hopper.dilated_fwd_hopper_kernel
    tiles_cfg = gcfg if gluon else cfg
    # the Gluon kernel's last launch: how it merges the parts (None where it takes none)
    merge_cfg = forward_hopper.parts_merge_config(D, len(order) - 1) if gluon and not ws else None
    parts = None
    if (COMPACT_PARTS and not filled and len(order) > 1 and not ws and not flags["DROPOUT"]
            and (not gluon or merge_cfg is not None)):
        parts = _parts(order, Nq, tiles_cfg["BLOCK_M"], q.device)
    if parts is not None:  # the parts' rows (compact) in ``o`` and ``part_lse``; ``out`` holds none of them
        if o is out:
            o = _buffer(rec, (B, H, Nq, D), q.device, False)
        part_lse = _buffer(rec, (B, H, Nq), q.device, False)
        rec.count("forward_parts")
    else:
        part_lse = lse
    per_branch = streams if flags["DROPOUT"] else tuple(map(rec.constant, _branch_views(streams)))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2])
    # which rows the launches before each one wrote: by their rates, or the nested Gluon launches' (r, w, below)
    written = _keyed_rates(pb, order, q.device) if gluon and nested and parts is None else rates
    for j, i, r, items, prev, n_prev, grid, n_tiles, merge in _forward_launches(order, written, last, parts, H,
                                                                                tiles_cfg, ws):
        rec.constant(prev)
        rec.constant(items)
        if gluon:
            args = (q, k, v, o, lse, out, prev, items, *(() if ws else (part_lse,)), nests, *strides, pb.head_offset,
                    group, r, pb.scale * LOG2E)
            common = dict(HEAD_DIM=D, IS_CAUSAL=flags["IS_CAUSAL"], MERGE=merge["MERGE"], LAST=merge["LAST"],
                          NESTED=nested, **gcfg)
            if nested:  # (a launch over the parts: every part's branch)
                parted = merge["PARTS"] and not merge["LAST"]
                common["NEST_T"] = _nest_period(pb, [x[0] for x in order[:-1]] if parted else [i])
            if not ws:  # (the warp-specialized kernel takes no parts)
                common["PARTS"] = merge["PARTS"]
                common.update(merge_cfg if merge["PARTS"] and merge["LAST"] else dict(MAX_PARTS=0))
            if ws:  # programs over units of an item's query tiles, persistent where the items allow
                it = order[j][2]
                grid, sched = forward_hopper.ws_schedule(it.n_items, it.items_per_group, it.max_q_rows, H, r,
                                                         sm_count(q.device))
                rec.run(gkernel, grid, *args, sched["n_tiles"], n_prev, sched["G"], sched["n_units"],
                        sched["n_items"], H, i, PER_UNIT=sched["PER_UNIT"], PERSISTENT=sched["PERSISTENT"], **common)
                rec.count("forward_persistent", sched["PERSISTENT"])
            else:
                rec.run(gkernel, grid, *args, n_tiles, n_prev, i, **common)
            rec.count("forward_ws" if ws else "forward_hopper")
            continue
        rec.run(dilated_fwd_branch_kernel, grid,
            q, k, v, o, lse, out, prev, items, qv, kv, per_branch[i], part_lse, nests, *strides,
            Nq, Nk, H, pb.head_offset, group, r, pb.scale * LOG2E, window, thr, inv_keep, n_tiles, n_prev, i,
            HEAD_DIM=head_dim_block(D), D=D, **merge, UPCAST=dot_mode(q.dtype), TMA=tma, NESTED=nested, **flags,
            **cfg,
        )
    return (o.to(q.dtype) if filled else out), lse


def backward(do, q, k, v, o, lse, pb: Problem, plan: RunPlan, layout_valid, cache_key, dlse=None):
    """Gradients ``(dq, dk, dv)`` of the merged output (and of the lse, through ``dlse``), in the dtypes of q, k, v.

    A gradient ``dlse`` on the lse adds ``dlse * P`` to ``dS``: it enters as ``delta - dlse``."""
    LAUNCHES["backward"] += 1
    q, k, v, o, do = (rowmajor(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    if dlse is None:  # the row deltas are the plan's first launch
        inputs = (q, k, v, do, lse, o)
        key = _plan_key("backward", inputs, pb, plan, cache_key)

        def launcher(rec, q, k, v, do, lse, o):
            return _backward(rec, q, k, v, do, lse, row_deltas(o, do, rec=rec), pb, plan, layout_valid, cache_key)
    else:  # (``delta - dlse`` is a tensor of this call alone: the deltas come in as an input)
        inputs = (q, k, v, do, lse, row_deltas(o, do, dlse))
        key = _plan_key("backward_dlse", inputs, pb, plan, cache_key)

        def launcher(rec, *inputs):
            return _backward(rec, *inputs, pb, plan, layout_valid, cache_key)
    return plans.call(key, inputs, LAUNCHES, launcher, forked)


def _backward(rec: plans.Recorder, q, k, v, do, lse, delta, pb: Problem, plan: RunPlan, layout_valid, cache_key):
    """:func:`backward`'s launches after the row deltas, each step through ``rec``."""
    B, H, Nq, D = q.shape
    Hk = k.shape[1]
    group = H // Hk
    extras = _extras(pb, plan.holes, layout_valid, B, H, q.device, rec)
    flags = extras[-1]
    hd = head_dim_block(D)
    kv_cfg, q_cfg = bwd_config(hd, q.dtype)
    order, rates, last = _launch_order(pb, plan, cache_key, q.device,
                                       rows_reached=Nq == k.shape[2] and pb.global_tokens == 0)
    filled = last is None
    # Descriptor loads and the Gluon kernels, decided once for the call: a head slice of these tensors keeps their
    # strides and 16-byte alignment, so every chunk below would decide the same. ``fused``: the Gluon dK/dV launch
    # that also adds dQ (``backward_hopper.fused_dq_launch_config``); None: dQ has kernels of its own.
    fused = backward_hopper.fused_dq_launch_config(hd, k.shape[2])
    tma = use_tma((q, k, v, do), hd != D, flags["HOLES"])
    gluon = backward_hopper.applies(q, flags, tma)
    fused = fused if gluon else None
    nests = _nests(pb, q.device, gluon, plan)
    rec.constant(nests[0])
    rec.count("backward_nested", nests[1] and _nests_dkdv(fused))
    args = (order, rates, last, pb, extras, nests, kv_cfg, q_cfg, tma, gluon, fused)
    if q.dtype == torch.float32 or (not filled and len(order) == 1 and fused is None):
        # The sums are the gradients (the last launch writes them in place; one launch alone writes them and merges
        # nothing), laid out like q, k, v (the op's fake implementation says so: compiled graphs rely on it).
        grads = tuple(_buffer(rec, t.shape, q.device, filled, q.dtype, like=t) for t in (q, k, v))
        _backward_heads(rec, q, k, v, do, lse, delta, grads, grads, 0, *args)
        return grads
    # Half precision: sum the branches in float32 scratch (rounding once, not once per branch), a chunk of kv heads
    # at a time so the scratch stays within SCRATCH_FRACTION of q + k + v; the last launch writes the gradients in
    # their dtype (a copy from the scratch when no launch reaches every row). A dQ the dK/dV launches add (``fused``)
    # sums into zeros, and is always that copy.
    dq, dk, dv = (rec.buffer(torch.empty_like(t)) for t in (q, k, v))
    limit = max(SCRATCH_MIN_BYTES, SCRATCH_FRACTION * (q.nbytes + k.nbytes + v.nbytes))
    per_kv_head = 2 * (q.nbytes + k.nbytes + v.nbytes) / Hk
    chunk = max(1, min(Hk, int(limit // per_kv_head)))
    for g0 in range(0, Hk, chunk):
        g1 = min(Hk, g0 + chunk)
        h0, h1 = g0 * group, g1 * group
        if chunk == Hk:  # one chunk: the tensors themselves (nine views are host time a small problem waits on)
            sq, sk, sv, sdo, slse, sdelta, outs = q, k, v, do, lse, delta, (dq, dk, dv)
        else:
            sq, sk, sv = q[:, h0:h1], k[:, g0:g1], v[:, g0:g1]
            sdo, slse, sdelta = do[:, h0:h1], lse[:, h0:h1], delta[:, h0:h1]
            outs = (dq[:, h0:h1], dk[:, g0:g1], dv[:, g0:g1])
        scratch = tuple(_buffer(rec, t.shape, q.device, filled or (t is sq and fused is not None))
                        for t in (sq, sk, sv))
        _backward_heads(rec, sq, sk, sv, sdo, slse, sdelta, scratch, outs, h0, *args)
        if filled:
            for out, sums in zip(outs, scratch):
                rec.copy(out, sums)
        elif fused is not None:
            rec.copy(outs[0], scratch[0])
        del scratch
    return dq, dk, dv


SCRATCH_FRACTION = 0.125
SCRATCH_MIN_BYTES = 2**30


def _nests_dkdv(cfg: dict | None) -> bool:
    """Whether a backward launch of config ``cfg`` (None: no dK/dV launch adds dQ) takes nested pairs: all but the
    one-program dK/dV that adds dQ (``HF_DILATED_WS_DKDV=0``), whose wgmma ptxas serializes nested. The
    warp-specialized one nests since session 59 (its weights made before its partitions split:
    ``backward_hopper._nest_rows``)."""
    return (cfg is None or not cfg.get("FUSED_DQ")
            or backward_hopper.dkdv_kernel(cfg) is backward_hopper.dilated_bwd_dkdv_ws_kernel)


def _backward_heads(rec: plans.Recorder, q, k, v, do, lse, delta, sums, outs, h0, order, rates, last, pb: Problem,
                    extras, nests, kv_cfg, q_cfg, tma, gluon, fused):
    """All branches of the backward for the heads ``h0..`` of these (possibly head-sliced) tensors, in launch
    ``order``, summed into the float32 ``sums`` (dq, dk, dv); the ``last`` branch's launches write ``outs`` in their
    dtype. Dropout streams stay indexed by the head in the whole tensor: the stream pointer is shifted by h0.
    The dQ launches run beside the dK / dV ones (``forked``); with ``fused`` (a config) the dK/dV launches add dQ to
    its zeroed sums and there are none. ``tma`` / ``gluon``: descriptor loads / the Gluon kernels (sm_90), each at
    the head dims it takes, as ``backward`` decided them; ``nests``: the nesting table and whether the kernels use it
    (``Problem.nesting``). Each step goes through ``rec``."""
    H, Hk, Nq, Nk, D = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    group = H // Hk
    qv, kv, streams, window, thr, inv_keep, flags = extras
    H_all = streams.shape[2]  # the dropout streams' heads: all of them, whatever this chunk holds
    dq, dk, dv = sums
    xq, xk, xv = outs
    hd = head_dim_block(D)
    if tma:
        rec.scratch(q.device)
        rec.count("backward_tma")
    dkdv_cfgs = ([fused] if fused else backward_hopper.dkdv_launch_configs(hd)) if gluon else None
    dq_cfg = backward_hopper.dq_launch_config(hd) if gluon else None
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2])
    per_branch = tuple(map(rec.constant, _branch_views(streams))) if not flags["DROPOUT"] else None
    rec.constant(rates)
    for _, _, it in order:
        rec.constant(it.items)
    launches = [(j, i, r, it, streams[i, :, h0:] if flags["DROPOUT"] else per_branch[i],
                 dict(MERGE=j > 0, LAST=i == last)) for j, (i, r, it) in enumerate(order)]
    kv_tensors = (q, k, v, do, lse, delta, dk, dv, xk, xv, rates)
    kv_strides = (*strides, *dk.stride()[:3], *dv.stride()[:3], *xk.stride()[:3], *xv.stride()[:3])
    hopper_tensors, hopper_strides = (*kv_tensors[:-1], dq, rates), (*kv_strides, *dq.stride()[:3])
    q_tensors, q_strides = (q, k, v, do, lse, delta, dq, xq, rates), (*strides, *dq.stride()[:3], *xq.stride()[:3])
    # The portable dq kernel beside Gluon dK/dV launches (head dim 64) computes every branch's pairs: its key weights,
    # made per key tile, cost it more than the pairs it skips (backward 0.84x at 9 / 3 / 64, 64K; NOTES_triton,
    # session 57). dQ and dK / dV are separate sums, so each may take the pairs either way.

    def nest_args(i: int, cfg: dict) -> dict:
        """The Gluon kernels' nesting constexprs for branch ``i`` (none where the branches do not nest, nor in the
        one-program dK/dV that adds dQ: ``_nests_dkdv``)."""
        return dict(NESTED=True, NEST_T=_nest_period(pb, [i])) if nests[1] and _nests_dkdv(cfg) else {}

    # The dQ stream only where there are dQ launches: with ``fused`` the fork and join were host time alone (16K
    # 16 / 16 / 128 forward+backward: 1.52 -> 1.31 ms of host, GPU time the same; NOTES_triton, session 43)
    no_fork = contextlib.nullcontext(contextlib.nullcontext)
    with (rec.forked(forked(q.device)) if not fused else no_fork) as beside:
        for j, i, r, it, s, merge in launches:  # dK / dV on the current stream
            n_classes = min(group, r)
            if dkdv_cfgs:
                for dkdv_cfg in dkdv_cfgs:  # one launch, or at D = 256 (HF_DILATED_WS_DKDV=0) one per gradient
                    kernel = backward_hopper.dkdv_kernel(dkdv_cfg)
                    grid, n_tiles = items_grid(it.n_items, it.max_k_rows, dkdv_cfg["BLOCK_N"], Hk * n_classes)
                    rec.run(kernel, grid,
                        *hopper_tensors, it.items, nests[0], *hopper_strides, pb.head_offset + h0, group, n_classes, r,
                        pb.scale, pb.scale * LOG2E, n_tiles, j, i, HEAD_DIM=hd, HEADS=cdiv(group, n_classes),
                        IS_CAUSAL=flags["IS_CAUSAL"], **merge, **dkdv_cfg, **nest_args(i, dkdv_cfg),
                    )
                    rec.count("dkdv_hopper")
                    rec.count("dkdv_ws", kernel is not backward_hopper.dilated_bwd_dkdv_hopper_kernel)
                    rec.count("dq_fused", bool(dkdv_cfg["FUSED_DQ"]))
            else:
                grid, n_tiles = items_grid(it.n_items, it.max_k_rows, kv_cfg["BLOCK_N"], Hk * n_classes)
                rec.run(dilated_bwd_dkdv_kernel, grid,
                    *kv_tensors, it.items, qv, kv, s, nests[0], *kv_strides,
                    Nq, Nk, H_all, pb.head_offset + h0, group, n_classes, r, pb.scale, pb.scale * LOG2E, window, thr,
                    inv_keep, n_tiles, j, i,
                    HEAD_DIM=hd, D=D, UPCAST=dot_mode(q.dtype), TMA=tma, NESTED=nests[1], **flags, **merge, **kv_cfg,
                )
        with beside():  # dQ on a second stream
            for j, i, r, it, s, merge in launches if not fused else ():
                if dq_cfg:
                    grid, n_tiles = items_grid(it.n_items, it.max_q_rows, dq_cfg["BLOCK_M"], H)
                    rec.run(backward_hopper.dilated_bwd_dq_hopper_kernel, grid,
                        *q_tensors, it.items, nests[0], *q_strides, pb.head_offset + h0, group, r, pb.scale,
                        pb.scale * LOG2E, n_tiles, j, i,
                        HEAD_DIM=hd, IS_CAUSAL=flags["IS_CAUSAL"], **merge, **dq_cfg, **nest_args(i, dq_cfg),
                    )
                    rec.count("dq_hopper")
                else:
                    grid, n_tiles = items_grid(it.n_items, it.max_q_rows, q_cfg["BLOCK_M"], H)
                    rec.run(dilated_bwd_dq_kernel, grid,
                        *q_tensors, it.items, qv, kv, s, nests[0], *q_strides,
                        Nq, Nk, H_all, pb.head_offset + h0, group, r, pb.scale, pb.scale * LOG2E, window, thr,
                        inv_keep, n_tiles, j, i, HEAD_DIM=hd, D=D, UPCAST=dot_mode(q.dtype), TMA=tma,
                        NESTED=nests[1] and not gluon, **flags, **merge, **q_cfg,
                    )


def decode(q, k, v, pb: Problem, q_pos, q_valid, k_valid, kdesc):
    """Short query blocks against a cache, all branches in one launch. ``kdesc`` ``[B, 3]`` int32 on the device:
    ``(k_base, k_lo, k_hi)`` per batch row (key of position ``p`` at column ``k_base + p``, positions ``[k_lo, k_hi)``).
    ``q_pos`` ``[B, Nq]``; ``q_valid`` ``[B, Nq]`` (None: every query is real); ``k_valid`` ``[B, Nk]`` (None: every
    key in ``[k_lo, k_hi)`` is real, and nothing of the cache's length is read or allocated)."""
    LAUNCHES["decode"] += 1
    q, k, v = rowmajor(q), rowmajor(k), rowmajor(v)
    B, H, Nq, D = q.shape
    group = H // k.shape[1]
    o = torch.empty(B, H, Nq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    holes = k_valid is not None
    _, kv, streams, window, thr, inv_keep, flags = _extras(pb, holes, (None, k_valid), B, H, q.device)
    if q_valid is None:
        qv = _constant(f"ones{B}x{Nq}", q.device, lambda: torch.ones(B, Nq, dtype=torch.int8, device=q.device))
    else:
        qv = _int8(q_valid)
    br = pb.kernel_branches()
    rows = [[w, r, DENSE_SEGMENT if cap is None else cap] for w, r, cap in br]
    table = _constant(f"branches{rows}", q.device, lambda: torch.tensor(rows, dtype=torch.int32).to(q.device))
    hd = head_dim_block(D)
    cfg = decode_config(hd, q.dtype)
    grid = (cdiv(Nq, cfg["BLOCK_M"]), H, B)
    relaunch.run(dilated_decode_kernel, grid,
        q, k, v, o, lse, q_pos.contiguous(), qv, kv, kdesc, table, streams,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        Nq, k.shape[2], B, H, pb.head_offset, group, pb.scale * LOG2E, window, thr, inv_keep,
        N_BRANCHES=len(br), HEAD_DIM=hd, D=D, UPCAST=dot_mode(q.dtype), **flags, **cfg,
    )
    return o, lse
