"""Sequence-parallel dilated attention: each rank of a process group holds a contiguous shard of the sequence.

LongNet's distributed algorithm (Ding et al. 2023, section 3.2), exact in forward and backward. For a branch
``(w, r)`` a rank's queries need the keys of the segments they lie in; a segment inside the rank's shard needs
nothing from elsewhere, a segment that spans ranks needs from the other ranks only the *selected* rows
(``p % r`` equal to a head's offset class) of its keys and values. One uneven all-to-all per call moves exactly
those rows (the union over branches, per kv head); the backward returns their gradients to the owning ranks.
Each rank then runs the single-device op (Triton on CUDA, the reference elsewhere) on its own queries against a
*key window*: its shard plus the received halo, laid out at their global positions so that the kernels address
dilated rows in place and merge the branches exactly, as on one device.

Memory per rank: the local shard plus a window of at most the largest segment on each side (the exchanged rows
sit in it at their columns; the rest of the halo is zeros that no branch reads). Causal attention needs no keys
from later ranks. A dense layer (one branch ``(DENSE_SEGMENT, 1)``) gathers every earlier key: correct, but its
memory grows with ``N``, like an all-gather context parallelism.

Per forward (memoized over the layers, which share ``position_ids``) each rank gathers the global positions and
key mask (``O(N)`` integers) and resolves the same :class:`~hf_dilated.ops.layout.TokenLayout` the single-device
op would, so packing and padding mean exactly what they mean on one device. Every call first all-gathers a small
signature: ranks that disagree on shapes or settings raise ``ValueError`` instead of hanging.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import validate_branches
from ..ops.layout import TokenLayout, resolve_layout
from .collectives import agree, all_gather_varlen
from .group import get_sequence_parallel_group, world_and_rank

from ..ops.dilated import attend as _attend_op
from ..ops.dilated import check_scale, check_tensors


@dataclass(frozen=True)
class RingPlan:
    """What one rank sends, receives and attends to, for one layout (shared by all layers of a forward).

    ``layout`` describes the local queries against ``prefix`` global-token slots (the first ``global_tokens``
    positions of the sequence a row's first query belongs to, where they lie before the window; empty slots are
    invalid keys), then the key window ``[window_start, window_end)`` (global columns), which is ``left`` received
    columns, the local shard, then ``right`` received columns. ``send_index`` lists the rows of the local
    ``[B * Hk * n]`` keys to send (grouped by destination rank, ``send_splits`` of them each); ``recv_index`` places
    the received rows into the ``[B * Hk * (prefix + left + right)]`` halo.
    """

    layout: TokenLayout
    shard_start: int
    shard_end: int
    window_start: int
    window_end: int
    left: int
    right: int
    send_index: torch.Tensor
    send_splits: list[int]
    recv_index: torch.Tensor
    recv_splits: list[int]
    exchange: bool  # False when no rank needs any key it does not hold (the same on every rank)
    prefix: int = 0


def shard_lengths_and_starts(lengths: list[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


def _head_classes(branches, hq: int, hk: int, head_offset: int, device) -> list[torch.Tensor]:
    """Per branch, ``[Hk, r]`` bool: kv head ``kh`` serves a query head of offset class ``c`` (``(h + off) % r``)."""
    group = hq // hk
    out = []
    for _, r in branches:
        table = torch.zeros(hk, r, dtype=torch.bool)
        for h in range(hq):
            table[h // group, (h + head_offset) % r] = True
        out.append(table.to(device))
    return out


def _windows(layout: TokenLayout, starts: list[int], branches, is_causal: bool):
    """``lo, hi [branches, B, P]``: per branch, row and rank, the key columns of the segments its queries lie in."""
    B, N = layout.k_pos.shape
    P = len(starts) - 1
    dev = layout.k_pos.device
    col = torch.arange(N, device=dev)
    lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(P)], device=dev)
    rank_of = torch.repeat_interleave(torch.arange(P, device=dev), lengths)[None].expand(B, N)
    s = torch.tensor(starts[:-1], device=dev)[None].expand(B, P)
    e = torch.tensor(starts[1:], device=dev)[None].expand(B, P)
    valid = layout.q_valid
    first = torch.full((B, P), N, device=dev).scatter_reduce(1, rank_of, torch.where(valid, col, N), "amin")
    last = torch.full((B, P), -1, device=dev).scatter_reduce(1, rank_of, torch.where(valid, col, -1), "amax")
    empty = first >= N
    same_seq = layout.k_seq[:, 1:] == layout.k_seq[:, :-1]
    if bool((same_seq & (layout.k_pos[:, 1:] < layout.k_pos[:, :-1])).any()):
        raise ValueError(
            "sequence parallelism needs positions that do not decrease within a sequence (position_ids restart only "
            "where a new packed sequence begins)"
        )
    los, his = [], []
    for w, _ in branches:
        seg = torch.div(layout.k_pos, w, rounding_mode="floor")
        change = torch.zeros(B, N, dtype=torch.long, device=dev)
        change[:, 1:] = (~same_seq | (seg[:, 1:] != seg[:, :-1])).long()
        bucket = change.cumsum(1)  # (sequence, segment) in column order: non-decreasing, one run per bucket
        bmin = bucket.gather(1, first.clamp(max=N - 1))
        bmax = bucket.gather(1, last.clamp(min=0))
        lo = torch.searchsorted(bucket, bmin)
        hi = torch.searchsorted(bucket, bmax, right=True)
        if is_causal:
            hi = torch.minimum(hi, e)
        los.append(torch.where(empty, s, lo))
        his.append(torch.where(empty, s, torch.maximum(hi, lo)))
    return torch.stack(los), torch.stack(his)


def _needed(layout, lo, hi, classes, branches, rank: int, a: int, b: int) -> torch.Tensor:
    """``[B, Hk, b - a]`` bool: which rows of key columns ``[a, b)`` rank ``rank`` reads, per kv head."""
    dev = layout.k_pos.device
    cols = torch.arange(a, b, device=dev)
    pos = layout.k_pos[:, a:b]
    need = None
    for i, (_, r) in enumerate(branches):
        inside = (cols[None] >= lo[i, :, rank, None]) & (cols[None] < hi[i, :, rank, None])  # [B, L]
        cls = classes[i][:, torch.remainder(pos, r)]  # [Hk, B, L]
        term = inside[:, None] & cls.permute(1, 0, 2)
        need = term if need is None else need | term
    return need & layout.k_valid[:, None, a:b]


def _global_keys(layout: TokenLayout, starts: list[int], win, global_tokens: int) -> list[torch.Tensor | None]:
    """Per rank, ``[B, N]`` bool: the global-token keys (positions ``< global_tokens``) its queries read that other
    ranks hold: before its shard, so of the sequence its first valid query belongs to (sequences are runs of
    columns). Every kv head's row of them is sent; those inside the window go to their window columns, those before
    it to the prefix slots."""
    if not global_tokens:
        return [None] * (len(starts) - 1)
    B, N = layout.k_pos.shape
    col = torch.arange(N, device=layout.k_pos.device)
    base = layout.k_valid & (layout.k_pos < global_tokens)
    out = []
    for j in range(len(starts) - 1):
        s, e = starts[j], starts[j + 1]
        valid = layout.q_valid[:, s:e]
        first = torch.where(valid, col[s:e], N).amin(1)  # [B]
        seq = layout.q_seq.gather(1, first.clamp(max=N - 1)[:, None])  # [B, 1]
        need = base & (col[None] < s) & (layout.k_seq == seq) & (first < N)[:, None]
        out.append(need)
    return out


def build_plan(layout: TokenLayout, starts: list[int], rank: int, branches, is_causal: bool, hq: int, hk: int,
               head_offset: int, global_tokens: int = 0) -> RingPlan:
    """The plan of rank ``rank`` from the global layout (every rank derives every other rank's needs alike)."""
    P = len(starts) - 1
    lo, hi = _windows(layout, starts, branches, is_causal)
    lo_c, hi_c = lo.amin((0, 1)).cpu().tolist(), hi.amax((0, 1)).cpu().tolist()
    win = [(min(lo_c[i], starts[i]), max(hi_c[i], starts[i + 1])) for i in range(P)]
    glob = _global_keys(layout, starts, win, global_tokens)
    col = torch.arange(layout.k_pos.shape[1], device=layout.k_pos.device)
    mine = None if glob[rank] is None else glob[rank] & (col[None] < win[rank][0])  # the prefix: before the window
    g = global_tokens if mine is not None and bool(mine.any()) else 0
    classes = _head_classes(branches, hq, hk, head_offset, layout.k_pos.device)
    s, e = starts[rank], starts[rank + 1]
    n = e - s
    ws, we = win[rank]
    left, right = s - ws, we - e
    B = layout.k_pos.shape[0]
    dev = layout.k_pos.device
    halo = g + left + right
    if g:  # the slot of each of my prefix columns: its order among them in its row
        prefix_slot = mine.long().cumsum(1) - 1
    send_idx, send_splits, recv_idx, recv_splits = [], [], [], []
    empty = torch.zeros(0, dtype=torch.long, device=dev)

    def rows(dst: int, a: int, b: int) -> torch.Tensor:
        """``[B, Hk, b - a]``: rows of columns ``[a, b)`` rank ``dst`` reads (window rows, and global-token rows:
        every kv head, disjoint from the window since they lie before it)."""
        lo_w, hi_w = max(a, win[dst][0]), min(b, win[dst][1])
        need = torch.zeros(B, hk, b - a, dtype=torch.bool, device=dev)
        if lo_w < hi_w:
            need[:, :, lo_w - a : hi_w - a] = _needed(layout, lo, hi, classes, branches, dst, lo_w, hi_w)
        if glob[dst] is not None:
            need |= glob[dst][:, None, a:b]
        return need

    for j in range(P):
        # rows I send to rank j: my columns inside j's window, and j's global-token columns I own
        reach = glob[j] is not None and bool(glob[j][:, s:e].any())
        a, b = (s, e) if reach else (max(s, win[j][0]), min(e, win[j][1]))
        if j != rank and a < b:
            bb, hh, cc = rows(j, a, b).nonzero(as_tuple=True)
            send_idx.append((bb * hk + hh) * n + (cc + a - s))
        else:
            send_idx.append(empty)
        send_splits.append(send_idx[-1].numel())
        # rows I receive from rank j: j's columns inside my window, and my global-token columns j owns
        reach = glob[rank] is not None and bool(glob[rank][:, starts[j] : starts[j + 1]].any())
        a, b = (starts[j], starts[j + 1]) if reach else (max(starts[j], ws), min(starts[j + 1], we))
        if j != rank and a < b:
            bb, hh, cc = rows(rank, a, b).nonzero(as_tuple=True)
            c = cc + a
            slot = torch.where(c < s, g + c - ws, g + left + c - e)
            if g:
                slot = torch.where(c < ws, prefix_slot[bb, c.clamp(max=layout.k_pos.shape[1] - 1)], slot)
            recv_idx.append((bb * hk + hh) * halo + slot)
        else:
            recv_idx.append(empty)
        recv_splits.append(recv_idx[-1].numel())
    exchange = any(win[i] != (starts[i], starts[i + 1]) for i in range(P)) or any(
        x is not None and bool(x.any()) for x in glob)
    k_pos, k_seq, k_valid = layout.k_pos[:, ws:we], layout.k_seq[:, ws:we], layout.k_valid[:, ws:we]
    if g:  # prefix slots: the global-token keys before the window, then invalid keys
        bb, cc = mine.nonzero(as_tuple=True)
        slot = prefix_slot[bb, cc]
        p_pos = torch.zeros(B, g, dtype=k_pos.dtype, device=dev)
        p_seq = k_seq[:, :1].expand(B, g).clone()
        p_valid = torch.zeros(B, g, dtype=torch.bool, device=dev)
        p_pos[bb, slot], p_seq[bb, slot], p_valid[bb, slot] = layout.k_pos[bb, cc], layout.k_seq[bb, cc], True
        k_pos, k_seq, k_valid = (torch.cat([x, y], 1) for x, y in ((p_pos, k_pos), (p_seq, k_seq), (p_valid, k_valid)))
    local = TokenLayout(
        q_pos=layout.q_pos[:, s:e].clone(), q_seq=layout.q_seq[:, s:e].clone(),
        k_pos=k_pos.clone(), k_seq=k_seq.clone(), k_valid=k_valid.clone(), q_valid=layout.q_valid[:, s:e].clone(),
        contiguous=False,
    )
    return RingPlan(local, s, e, ws, we, left, right, torch.cat(send_idx), send_splits, torch.cat(recv_idx),
                    recv_splits, exchange, g)


def _coords(index: torch.Tensor, hk: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat row indices ``(b * hk + h) * width + c`` -> ``(b, h, c)``."""
    bh, c = torch.div(index, width, rounding_mode="floor"), torch.remainder(index, width)
    return torch.div(bh, hk, rounding_mode="floor"), torch.remainder(bh, hk), c


class _KeyWindow(torch.autograd.Function):
    """This rank's key and value windows ``[prefix, left, shard, right]`` (``RingPlan``): the selected rows of the
    local shard go to the ranks that read them (one uneven all-to-all of keys and values together), the received rows
    fill the halo, zeros elsewhere. The backward sends the halo's gradients back to their owners and adds the returned
    ones into the window's gradients in place. Nothing of the size of the shard is copied except into the window
    itself (nothing on a rank without a halo): the shard is 1 GB per tensor at 256K tokens, H = 16, D = 128, where
    concatenating keys and values and the autograd of gathers cost ~10 ms a step (profiled on 4 H200s); the
    gradients are views of the window's (no copy here; a leaf's accumulation may make one)."""

    @staticmethod
    def forward(ctx, key, value, plan: RingPlan, group):
        B, hk, n, dk = key.shape
        dv = value.shape[-1]
        sb, sh, sc = _coords(plan.send_index, hk, n)
        rows = torch.cat([key[sb, sh, sc], value[sb, sh, sc]], -1)
        got = rows.new_empty(sum(plan.recv_splits), dk + dv)
        dist.all_to_all_single(got, rows, plan.recv_splits, plan.send_splits, group=group)
        g, width = plan.prefix, plan.prefix + plan.left + plan.right
        rb, rh, slot = _coords(plan.recv_index, hk, width)
        col = torch.where(slot < g + plan.left, slot, slot + n)  # window column of each received row
        ctx.plan, ctx.group, ctx.n = plan, group, n
        ctx.save_for_backward(sb, sh, sc, rb, rh, col)
        if width == 0:
            return key.view_as(key), value.view_as(value)
        lo = g + plan.left
        windows = []
        for x, part in ((key, got[:, :dk]), (value, got[:, dk:])):
            zeros = lambda m: [x.new_zeros(B, hk, m, x.shape[-1])] if m else []  # noqa: E731
            w = torch.cat(zeros(lo) + [x] + zeros(plan.right), 2)  # cat's batched copy: 2x a strided copy_'s speed
            w[rb, rh, col] = part
            windows.append(w)
        return tuple(windows)

    @staticmethod
    def backward(ctx, dk_all, dv_all):
        plan, n = ctx.plan, ctx.n
        sb, sh, sc, rb, rh, col = ctx.saved_tensors
        lo = plan.prefix + plan.left
        # the incoming gradients are this op's alone (the attention's backward made them): add into them in place
        dk, dv = (x if x.is_contiguous() else x.contiguous() for x in (dk_all, dv_all))
        back = torch.cat([dk[rb, rh, col], dv[rb, rh, col]], -1)
        ret = back.new_empty(sum(plan.send_splits), back.shape[-1])
        dist.all_to_all_single(ret, back, plan.send_splits, plan.recv_splits, group=ctx.group)
        dk.index_put_((sb, sh, sc + lo), ret[:, : dk.shape[-1]], accumulate=True)  # on the whole (contiguous) window:
        dv.index_put_((sb, sh, sc + lo), ret[:, dk.shape[-1] :], accumulate=True)  # on the shard's view it copies
        return dk[:, :, lo : lo + n], dv[:, :, lo : lo + n], None, None


class _PlanCache:
    """The plans of recent forwards, keyed by the identity (and version) of the local ``position_ids`` and mask.

    A hit must be unanimous (building a plan runs collectives): each call's signature carries this rank's hit flag,
    and any rank's miss makes every rank rebuild.
    """

    def __init__(self, size: int = 2):
        self.size, self.entries = size, []

    @staticmethod
    def _key(tensors, extra):
        return tuple(None if t is None else (id(t), t._version) for t in tensors), extra

    def get(self, tensors, extra):
        if torch.compiler.is_compiling() or any(t is not None and t.is_inference() for t in tensors):
            return None
        key = self._key(tensors, extra)
        for k, held, plan in self.entries:
            if k == key and all(a is b for a, b in zip(held, tensors)):
                return plan
        return None

    def put(self, tensors, extra, plan) -> None:
        if torch.compiler.is_compiling() or any(t is not None and t.is_inference() for t in tensors):
            return
        self.entries = [(self._key(tensors, extra), tensors, plan)] + self.entries[: self.size - 1]


_PLANS = _PlanCache()


def _local_positions(position_ids, batch: int, n: int, device) -> torch.Tensor:
    if position_ids.ndim == 3:  # multimodal RoPE (3, B, N): the first row is the text position
        position_ids = position_ids[0]
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != n:
        raise ValueError(f"position_ids must have shape [B, n_local] = [{batch}, {n}], got {tuple(position_ids.shape)}")
    return position_ids.to(device=device, dtype=torch.long).expand(batch, n)


def _global_layout(query, position_ids, attention_mask, lengths, any_mask, group) -> TokenLayout:
    B, n, dev = query.shape[0], query.shape[2], query.device
    pos = None
    if position_ids is not None:
        pos = all_gather_varlen(_local_positions(position_ids, B, n, dev), lengths, group, dim=1)
    mask = None
    if any_mask:
        local = torch.ones(B, n, dtype=torch.bool, device=dev)
        if attention_mask is not None:
            if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (B, n):
                raise ValueError(
                    f"attention_mask must be a 2-D key mask of this rank's shard, [B, n_local] = [{B}, {n}], got "
                    f"{tuple(attention_mask.shape)}"
                )
            if attention_mask.is_floating_point():
                raise ValueError(f"attention_mask must be a boolean or 0/1 integer key mask, got {attention_mask.dtype}")
            local = attention_mask.to(dev) != 0
        mask = all_gather_varlen(local.to(torch.uint8), lengths, group, dim=1).bool()
    return resolve_layout(B, sum(lengths), sum(lengths), dev, mask, pos)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def dilated_ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths,
    dilation_rates,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    head_offset: int = 0,
    global_tokens: int = 0,
    group=None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Dilated attention (SPEC.md) over a sequence split into contiguous shards, one per rank of ``group``.

    Every rank calls it with its own shard: ``query [B, Hq, n_rank, D]``, ``key, value [B, Hk, n_rank, D]`` (the
    ranks' shards concatenated in rank order form the sequence; lengths may differ, see
    :func:`~hf_dilated.distributed.sharding.shard_sizes`). ``position_ids [B, n_rank]`` are the *global* positions of
    the shard's tokens (restarting where a packed sequence begins), ``attention_mask [B, n_rank]`` its key mask;
    either may be ``None`` (then positions count the real tokens from the start of the whole sequence).
    Returns this rank's shard of the output ``[B, Hq, n_rank, D]`` (and of the lse): equal, with every gradient, to
    :func:`hf_dilated.dilated_attention` on the gathered tensors. ``group`` defaults to
    :func:`~hf_dilated.distributed.get_sequence_parallel_group`; with one rank (or no process group) this is the
    single-device op. Collectives time out after the process group's ``timeout``.
    """
    check_tensors(query, key, value)
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"sequence-parallel attention needs queries and keys of the same shard (no KV cache), got {query.shape[2]} "
            f"queries and {key.shape[2]} keys; use hf_dilated.dilated_attention for decoding"
        )
    branches = validate_branches(segment_lengths, dilation_rates)
    scale = check_scale(scale, query.shape[-1])
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be a non-negative int, got {head_offset!r}")
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
        raise ValueError(f"global_tokens must be a non-negative int, got {global_tokens!r}")
    group = get_sequence_parallel_group() if group is None else group
    world, rank = world_and_rank(group)
    B, hq, n, _ = query.shape
    hk = key.shape[1]
    if world == 1:
        layout = resolve_layout(B, n, n, query.device, attention_mask, position_ids)
        out, lse = _attend_op(query, key, value, layout, branches, is_causal=bool(is_causal), scale=float(scale),
                              head_offset=head_offset, global_tokens=global_tokens, backend=backend)
        return (out, lse) if return_lse else out

    extra = (B, n, hq, hk, branches, bool(is_causal), head_offset, global_tokens, str(query.device), id(group), world,
             rank)
    plan = _PLANS.get((position_ids, attention_mask), extra)
    fields = {
        "batch size": B, "query heads": hq, "key/value heads": hk, "head dim": query.shape[-1],
        "value head dim": value.shape[-1], "dtype": _dtype_code(query.dtype), "is_causal": int(bool(is_causal)),
        "scale": struct.unpack("<q", struct.pack("<d", float(scale)))[0], "head_offset": head_offset,
        "branches (segment_lengths, dilation_rates)": zlib.crc32(repr(branches).encode()),
        "global_tokens": global_tokens,
        "whether position_ids are given": int(position_ids is not None),
    }
    ranks = agree(fields, {"n": n, "mask": int(attention_mask is not None), "hit": int(plan is not None)}, group, query)
    if any(r["n"] < 1 for r in ranks):
        raise ValueError(f"every rank needs at least one token of the sequence, got shard lengths {[r['n'] for r in ranks]}")
    if not all(r["hit"] for r in ranks):
        lengths = [r["n"] for r in ranks]
        layout = _global_layout(query, position_ids, attention_mask, lengths, any(r["mask"] for r in ranks), group)
        plan = build_plan(layout, shard_lengths_and_starts(lengths), rank, branches, bool(is_causal), hq, hk,
                          head_offset, global_tokens)
        _PLANS.put((position_ids, attention_mask), extra, plan)

    k_all, v_all = (key, value) if not plan.exchange else _KeyWindow.apply(key, value, plan, group)
    out, lse = _attend_op(query, k_all, v_all, plan.layout, branches, is_causal=bool(is_causal), scale=float(scale),
                          head_offset=head_offset, global_tokens=global_tokens, backend=backend)
    return (out, lse) if return_lse else out
