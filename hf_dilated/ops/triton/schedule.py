"""Work lists of the Triton kernels: a layout's *runs*, and per branch the segment *items* built from them.

A *run* is the part of one sequence in one batch row that the kernels address in place: its tokens sit at
consecutive columns, and the valid ones have positions that step with the columns, so position ``p`` sits at column
``col0 + (p - pos0)``. Invalid columns inside a run (keys hidden by a 0 in the middle of a mask row) are allowed:
the kernels then read per-token validity and mask them (``RunPlan.holes``). A sequence whose valid tokens are not
one run (positions that do not step with columns, e.g. counted across a hole) is not expressible in place.

For a branch ``(w, r)`` each segment ``[s w, (s + 1) w)`` of a run that holds queries gives one item; the queries at
positions ``[q_lo, q_hi)`` (column ``q_base + p``) attend to the keys at positions ``[k_lo, k_hi)`` (column
``k_base + p``). Kernels tile an item's dilated rows themselves, so the lists do not depend on block sizes. Lists for
the common contiguous case are cached, so steady-state training builds none.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..layout import TokenLayout, _IdentityMemo

# Columns of the runs table ([R, 7] int64, CPU).
RUN_B, RUN_Q_COL, RUN_Q_POS, RUN_Q_LEN, RUN_K_COL, RUN_K_POS, RUN_K_LEN = range(7)
RUN_COLUMNS = 7
# Columns of an items table ([n, 7] int32, on the device); the kernels read them with ``tiles.load_item``.
IT_B, IT_Q_BASE, IT_K_BASE, IT_Q_LO, IT_Q_HI, IT_K_LO, IT_K_HI = range(7)
ITEM_COLUMNS = 7
# the forward's table of parts (``launch.forward``): first program, first item, tiles per item, r, compact row base,
# branch index
PART_COLUMNS = 6
# a branch's row of the nesting table (``tiles.nest_weight``): below, n_higher, the higher branches' rates
NEST_COLUMNS = 8
# Positions and columns must stay below this (int32 arithmetic in the kernels, DENSE_SEGMENT = 2**30 included).
MAX_POSITION = 2**30


@dataclass(frozen=True)
class RunPlan:
    """A layout as runs: ``runs`` ``[R, 7]`` CPU int64 (columns ``RUN_*``), ``holes`` True when some run has invalid
    columns inside (the kernels then read ``k_valid`` / ``q_valid``)."""

    runs: torch.Tensor
    holes: bool

    @functools.cached_property
    def from_start(self) -> bool:
        """Whether every run's queries and keys start at position 0 (whole sequences, not a cache's tail): then every
        item starts at a segment's start, and the tiles of its rows at fixed offsets from it."""
        return bool((self.runs[:, RUN_Q_POS] == 0).all() and (self.runs[:, RUN_K_POS] == 0).all())


def _runs_of(pos: torch.Tensor, seq: torch.Tensor, valid: torch.Tensor):
    """Per batch row, the maximal runs ``(sequence, first column, first position, columns, valid tokens)`` of valid
    tokens whose positions step with their columns (CPU tensors in, Python ints out)."""
    out = []
    for b in range(pos.shape[0]):
        cols = valid[b].nonzero().flatten()
        if cols.numel() == 0:
            out.append([])
            continue
        p, s = pos[b, cols], seq[b, cols]
        brk = torch.ones(cols.numel(), dtype=torch.bool)
        brk[1:] = (p[1:] - p[:-1] != cols[1:] - cols[:-1]) | (s[1:] != s[:-1])
        starts = brk.nonzero().flatten().tolist()
        ends = starts[1:] + [cols.numel()]
        out.append([(int(s[i]), int(cols[i]), int(p[i]), int(cols[e - 1] - cols[i]) + 1, e - i)
                    for i, e in zip(starts, ends)])
    return out


def _layout_runs(layout: TokenLayout) -> RunPlan | None:
    B, Nq = layout.q_pos.shape
    Nk = layout.k_pos.shape[1]
    if layout.contiguous:
        rows = [[b, 0, Nk - Nq, Nq, 0, 0, Nk] for b in range(B)]
        return RunPlan(torch.tensor(rows, dtype=torch.int64).reshape(-1, RUN_COLUMNS), False)
    qr = _runs_of(layout.q_pos.cpu(), layout.q_seq.cpu(), layout.q_valid.cpu())
    kr = _runs_of(layout.k_pos.cpu(), layout.k_seq.cpu(), layout.k_valid.cpu())
    rows, holes = [], False
    for b in range(B):
        qs: dict[int, tuple[int, int, int]] = {}
        ks: dict[int, tuple[int, int, int]] = {}
        for runs, into in ((qr[b], qs), (kr[b], ks)):
            for s, c0, p0, n, count in runs:
                if s in into:
                    return None  # one sequence in two runs: not expressible in place
                into[s] = (c0, p0, n)
                holes = holes or count != n
        for s, (qc, qp, qn) in qs.items():
            if s in ks:
                rows.append([b, qc, qp, qn, *ks[s]])
    runs = torch.tensor(rows, dtype=torch.int64).reshape(-1, RUN_COLUMNS)
    if runs.numel() and int(torch.maximum(runs[:, RUN_Q_POS] + runs[:, RUN_Q_LEN],
                                          runs[:, RUN_K_POS] + runs[:, RUN_K_LEN]).max()) > MAX_POSITION:
        return None
    return RunPlan(runs, holes)


_RUNS = _IdentityMemo()


def layout_runs(layout: TokenLayout) -> RunPlan | None:
    """The layout as runs, one per (batch row, sequence) with both queries and keys, or ``None`` when some sequence's
    valid queries or keys are not one run (or positions reach 2^30). Rows ``(b, q_col0, q_pos0, q_len, k_col0,
    k_pos0, k_len)``: the sequence's queries sit at columns ``q_col0 + (p - q_pos0)`` for ``p`` in
    ``[q_pos0, q_pos0 + q_len)``, its keys likewise. Sequences with queries but no keys (or the reverse) attend to /
    are attended by nothing and are left out. Costs one device-to-host copy of the layout unless ``layout.contiguous``;
    memoized on the identity of the layout's tensors."""
    tensors = (layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid)
    return _RUNS(lambda: _layout_runs(layout), tensors, (layout.contiguous,))


@dataclass(frozen=True)
class BranchItems:
    items: torch.Tensor  # [n, 7] int32 on the device, columns IT_*
    n_items: int
    max_q_rows: int  # most dilated query rows of one item (over every head offset)
    max_k_rows: int  # most dilated key rows of one item
    # items come in consecutive groups of this many that share a batch row and column bases (one group per batch
    # row of a contiguous layout; the persistent forward's descriptors span a group), or 0 where they do not
    items_per_group: int = 0


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _build(runs: torch.Tensor, w: int, r: int, is_causal: bool, k_cap: int | None) -> tuple[torch.Tensor, int, int]:
    b, qc, qp, qn, kc, kp, kn = runs.unbind(1)
    keep = qn > 0
    b, qc, qp, qn, kc, kp, kn = (x[keep] for x in (b, qc, qp, qn, kc, kp, kn))
    s0 = torch.div(qp, w, rounding_mode="floor")
    s1 = torch.div(qp + qn - 1, w, rounding_mode="floor")
    count = s1 - s0 + 1
    idx = torch.repeat_interleave(torch.arange(count.numel()), count)
    first = torch.cumsum(count, 0) - count
    seg = s0[idx] + torch.arange(int(count.sum())) - first[idx]
    q_lo = torch.maximum(seg * w, qp[idx])
    q_hi = torch.minimum((seg + 1) * w, (qp + qn)[idx])
    k_lo = torch.maximum(seg * w, kp[idx])
    k_hi = torch.minimum((seg + 1) * w, (kp + kn)[idx])
    if is_causal:
        k_hi = torch.minimum(k_hi, q_hi)
    if k_cap is not None:
        k_hi = torch.clamp_max(k_hi, k_cap)
    ok = k_lo < k_hi
    items = torch.stack([b[idx], (qc - qp)[idx], (kc - kp)[idx], q_lo, q_hi, k_lo, k_hi], 1)[ok]
    if items.numel() and int(items.abs().max()) > MAX_POSITION:
        raise ValueError("positions or columns beyond 2^30 are not supported by the Triton kernels")
    if items.numel() == 0:
        return items.to(torch.int32), 0, 0, 0
    max_q = int(((items[:, IT_Q_HI] - items[:, IT_Q_LO] + r - 1) // r).max())
    max_k = int(((items[:, IT_K_HI] - items[:, IT_K_LO] + r - 1) // r).max())
    return items.to(torch.int32), max_q, max_k, _items_per_group(items)


def _items_per_group(items: torch.Tensor) -> int:
    """How many consecutive items share a batch row and column bases, where every such group has as many; else 0."""
    key = items[:, [IT_B, IT_Q_BASE, IT_K_BASE]]
    new = torch.ones(key.shape[0], dtype=torch.bool)
    new[1:] = (key[1:] != key[:-1]).any(1)
    starts = new.nonzero().flatten()
    sizes = torch.diff(starts, append=torch.tensor([key.shape[0]]))
    if bool((sizes != sizes[0]).any()) or starts.numel() != torch.unique(key, dim=0).shape[0]:
        return 0
    return int(sizes[0])


def branch_items(runs: torch.Tensor, w: int, r: int, is_causal: bool, device: torch.device, cache_key=None,
                 k_cap: int | None = None) -> BranchItems:
    """The items of branch ``(w, r)`` on ``device``; ``k_cap`` keeps keys at positions below it only (the global-token
    branch: ``(DENSE_SEGMENT, 1)`` capped at ``g``). ``cache_key`` (hashable, e.g. the shapes of a contiguous layout)
    lets repeated calls reuse them."""
    key = None if cache_key is None else (cache_key, w, r, is_causal, k_cap, str(device))
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    items, max_q, max_k, per_group = _build(runs, w, r, is_causal, k_cap)
    out = BranchItems(items.to(device), items.shape[0], max_q, max_k, per_group)
    if key is not None:
        _CACHE[key] = out
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out


@dataclass(frozen=True)
class Compaction:
    """A layout that is not runs in place, made runs by gathering each row's valid tokens to the front: the kernels
    run on ``q[:, :, q_cols]`` / ``k[:, :, k_cols]`` (``[B, Nq']`` / ``[B, Nk']`` int64 column indices, a permutation
    prefix per row, so scattering back never collides) with ``layout`` and ``plan`` describing the gathered tensors."""

    q_cols: torch.Tensor
    k_cols: torch.Tensor
    layout: TokenLayout
    plan: RunPlan

    def gather(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        """``t[..., cols, :]`` for ``[B, H, N, D]`` (or ``t[..., cols]`` for ``[B, H, N]``)."""
        cols = self.k_cols if keys else self.q_cols
        idx = cols[:, None, :, None] if t.ndim == 4 else cols[:, None, :]
        return t.gather(2, idx.expand(*t.shape[:2], cols.shape[1], *t.shape[3:]))

    def scatter(self, t: torch.Tensor, n: int, keys: bool, fill: float = 0.0) -> torch.Tensor:
        """Inverse of :meth:`gather` into a tensor of length ``n`` along the token axis, ``fill`` elsewhere."""
        cols = self.k_cols if keys else self.q_cols
        idx = cols[:, None, :, None] if t.ndim == 4 else cols[:, None, :]
        out = t.new_full((*t.shape[:2], n, *t.shape[3:]), fill)
        return out.scatter_(2, idx.expand_as(t), t)


def _front(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    count = valid.sum(-1)
    n = max(int(count.max()), 1) if valid.numel() else 1
    cols = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[:, :n]
    return cols, torch.arange(n, device=valid.device)[None] < count[:, None], n


def compact(layout: TokenLayout) -> Compaction | None:
    """The :class:`Compaction` of ``layout``, or ``None`` when even the gathered tokens are not runs (positions of
    one sequence that do not step by one)."""
    q_cols, q_valid, _ = _front(layout.q_valid)
    k_cols, k_valid, _ = _front(layout.k_valid)
    packed = TokenLayout(layout.q_pos.gather(1, q_cols), layout.q_seq.gather(1, q_cols),
                         layout.k_pos.gather(1, k_cols), layout.k_seq.gather(1, k_cols), k_valid, q_valid, False)
    plan = _layout_runs(packed)
    return None if plan is None else Compaction(q_cols, k_cols, packed, plan)
