"""The Triton backend as ``torch.library`` custom ops with fake implementations and registered autograd.

``torch.ops.hf_dilated.dilated_attention_fwd`` and ``..._bwd`` take the layout as plain tensors and the dropout seed
as an int64 scalar tensor, so that ``torch.compile(fullgraph=True)`` traces them as single opaque nodes (no graph
break, no host value). Inside, each call runs the Triton kernels: in place on the layout's runs, or on the gathered
valid tokens (scattered back) when positions step with the valid tokens but not with the columns. Where they cannot
(:func:`fallback_reason`) it runs the PyTorch reference with a one-time warning naming the reason; with ``strict``
it raises ``ValueError`` instead.

``torch.ops.hf_dilated.dilated_attention_decode`` is the decoding step against a cache described by the layout's
``keys`` (``(base, lo, hi)`` per row, :func:`~hf_dilated.ops.layout.cache_layout`): it reads no per-key metadata, so
its host work and allocations do not grow with the cache.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..eager_autograd import call, eager_op, register
from ..layout import TokenLayout, _IdentityMemo
from ..reference import dilated_attention_reference
from . import launch
from .schedule import RUN_B, RUN_K_COL, RUN_K_LEN, RUN_K_POS, RUN_Q_COL, RUN_Q_LEN, Compaction, RunPlan, compact, \
    layout_runs

MAX_HEAD_DIM = 256
MAX_RATE = 2**22  # rows * r stays within int32 next to positions below 2^30
_WARNED: set = set()


def _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous) -> TokenLayout:
    return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, q_valid, contiguous)


def shape_fallback_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors (dtype, head dims), or ``None``. No host sync."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{q.dtype} inputs (the kernels run float16, bfloat16 and float32)"
    if v.shape[-1] != q.shape[-1]:
        return f"value head dim {v.shape[-1]} differs from the query head dim {q.shape[-1]}"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} above {MAX_HEAD_DIM}"
    return None


LAYOUT_REASON = ("a sequence whose valid tokens' positions do not step by one (after gathering the valid tokens), "
                 "or positions beyond 2^30")
DROPOUT_GATHER_REASON = ("dropout on a layout whose valid tokens' positions do not step with their columns (positions "
                         "counted across a hole in the mask): the kernels would gather the tokens and so change the "
                         "columns that the dropout draw hashes")
_COMPACT = _IdentityMemo()


def _compaction(layout: TokenLayout) -> Compaction | None:
    tensors = (layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid)
    return _COMPACT(lambda: compact(layout), tensors, ())


_CONTIGUOUS = _IdentityMemo()


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (no value may be read on the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# The last answer read outside CUDA-graph capture, per (batch, queries, keys, device): what a capture reuses.
_CONTIGUOUS_SEEN: dict = {}


def _really_contiguous(layout: TokenLayout) -> bool:
    """Whether a layout passed as not contiguous is contiguous all the same: under ``torch.compile`` the flag is
    decided while tracing, where values cannot be read, so a model that passes ``position_ids`` (every Transformers
    model does) arrives here with ``contiguous=False``. One scalar read per distinct layout (memoized on the
    identity of its tensors, which the layers of one compiled forward share), instead of a host copy of the layout
    and work lists rebuilt per layer and per call.

    While a CUDA graph is being captured no value can be read (a read would end the capture): the answer is the one
    read for a layout of the same shape outside the capture, as in the eager warm-up that ``torch.compile``'s
    CUDA-graph trees (``mode="reduce-overhead"``) and ``torch.cuda.make_graphed_callables`` run first; a graph's
    launches are fixed when it is captured, so its replays take the layout's structure as it was then."""
    nq, nk = layout.q_pos.shape[1], layout.k_pos.shape[1]
    shape = (layout.q_pos.shape[0], nq, nk, str(layout.k_pos.device))

    def check() -> bool:
        if _capturing(layout.k_pos.device):
            if shape not in _CONTIGUOUS_SEEN:
                raise ValueError(
                    "attention layout: whether position_ids / attention_mask describe one contiguous sequence per row "
                    "cannot be read while a CUDA graph is captured; run the model once outside the capture with the "
                    "same shapes first (torch.compile's mode='reduce-overhead' does)"
                )
            return _CONTIGUOUS_SEEN[shape]
        cols = torch.arange(nk, device=layout.k_pos.device)
        ok = layout.k_valid.all() & layout.q_valid.all() & (layout.k_seq == 0).all() & (layout.q_seq == 0).all()
        ok = ok & (layout.k_pos == cols).all() & (layout.q_pos == cols[nk - nq:]).all()
        if len(_CONTIGUOUS_SEEN) >= 1024:  # decoding under compile sees a new key length per step
            _CONTIGUOUS_SEEN.clear()
        _CONTIGUOUS_SEEN[shape] = bool(ok)
        return _CONTIGUOUS_SEEN[shape]

    tensors = (layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid)
    return _CONTIGUOUS(check, tensors, ())


def _route(q, k, v, layout: TokenLayout, dropout_p: float, branches=()):
    """``(reason, plan, cache_key, compaction)``: the kernels run ``plan`` in place (``compaction`` None) or on the
    gathered valid tokens (layouts whose positions step with the valid tokens but not the columns); ``reason`` (not
    None) says why they cannot run at all."""
    reason = shape_fallback_reason(q, k, v)
    if reason is None and any(r > MAX_RATE for _, r in branches):
        reason = f"dilation rates above {MAX_RATE} (int32 row arithmetic)"
    if reason is not None:
        return reason, None, None, None
    if not layout.contiguous and layout.q_pos.shape[1] <= layout.k_pos.shape[1] and _really_contiguous(layout):
        layout = TokenLayout(layout.q_pos, layout.q_seq, layout.k_pos, layout.k_seq, layout.k_valid, layout.q_valid,
                             True)
    plan = layout_runs(layout)
    if plan is not None:
        key = ("contiguous", q.shape[0], q.shape[2], k.shape[2]) if layout.contiguous else None
        return None, plan, key, None
    comp = _compaction(layout)
    if comp is None:
        return LAYOUT_REASON, None, None, None
    if dropout_p:
        return DROPOUT_GATHER_REASON, None, None, None
    return None, comp.plan, None, comp


def fallback_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout,
                    dropout_p: float = 0.0, branches=()) -> str | None:
    """Why the Triton kernels cannot run this call, or ``None`` when they can (the check the op itself makes). The
    layout part reads the layout on the host (once, memoized) unless ``layout.contiguous``."""
    return _route(q, k, v, layout, dropout_p, branches)[0]


def _fallback(reason: str, strict: bool) -> None:
    """Warn once per reason that the reference runs (count it in ``launch.LAUNCHES``), or raise with ``strict``."""
    msg = f"hf_dilated: the Triton kernels do not cover {reason}"
    if strict:
        raise ValueError(msg + "; use backend='torch' or backend='auto'")
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(msg + "; running the PyTorch reference instead (slower, more memory)", stacklevel=3)
    launch.LAUNCHES["reference"] += 1
    return None


def _decode_desc(layout: TokenLayout, plan: RunPlan, q: torch.Tensor, k: torch.Tensor):
    """Per-row key descriptors for the decode kernel, or ``None`` when a row is not one query run against one key
    run holding all its valid queries."""
    runs = plan.runs
    B, Nq = q.shape[0], q.shape[2]
    if Nq > 64 or Nq >= k.shape[2] or runs.shape[0] != B or not torch.equal(runs[:, RUN_B], torch.arange(B)):
        return None
    if not layout.contiguous:
        cols = torch.arange(Nq)
        inside = (cols >= runs[:, RUN_Q_COL, None]) & (cols < (runs[:, RUN_Q_COL] + runs[:, RUN_Q_LEN])[:, None])
        if bool((layout.q_valid.cpu() & ~inside).any()):
            return None  # some valid query is in no run (no keys of its sequence): leave it to the general path
    desc = torch.stack([runs[:, RUN_K_COL] - runs[:, RUN_K_POS], runs[:, RUN_K_POS],
                        runs[:, RUN_K_POS] + runs[:, RUN_K_LEN]], 1)
    return desc.to(torch.int32).to(q.device)


def _problem(segment_lengths, dilation_rates, is_causal, scale, head_offset, window, global_tokens, dropout_p, seed):
    return launch.Problem(tuple(zip(segment_lengths, dilation_rates)), is_causal, scale, head_offset,
                          int(window or 0), int(global_tokens), float(dropout_p), seed)


def _reference(q, k, v, pb: launch.Problem, layout: TokenLayout):
    extra = {}  # only what differs from the defaults, so the call works on any reference signature
    if pb.window:
        extra["window"] = pb.window
    if pb.global_tokens:
        extra["global_tokens"] = pb.global_tokens
    if pb.dropout_p:
        extra.update(dropout_p=pb.dropout_p, seed=pb.seed)
    return dilated_attention_reference(q, k, v, pb.branches, layout, pb.is_causal, pb.scale, pb.head_offset, **extra)


def _attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    segment_lengths: list[int], dilation_rates: list[int],
    contiguous: bool, is_causal: bool, scale: float, head_offset: int,
    window: int, global_tokens: int, dropout_p: float, seed: Optional[torch.Tensor], strict: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    pb = _problem(segment_lengths, dilation_rates, is_causal, scale, head_offset, window, global_tokens, dropout_p,
                  seed)
    layout = _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous)
    reason, plan, key, comp = _route(q, k, v, layout, pb.dropout_p, pb.branches)
    if comp is not None:  # run on the gathered valid tokens, scatter back
        o, lse = _kernels_fwd(comp.gather(q, False), comp.gather(k, True), comp.gather(v, True), pb, plan, None,
                              comp.layout)
        return comp.scatter(o, q.shape[2], False), comp.scatter(lse, q.shape[2], False, float("-inf"))
    if plan is not None:
        return _kernels_fwd(q, k, v, pb, plan, key, layout)
    _fallback(reason, strict)
    out, lse = _reference(q, k, v, pb, layout)
    return out.contiguous(), lse.float().contiguous()


dilated_attention_fwd = torch.library.custom_op("hf_dilated::dilated_attention_fwd", mutates_args=())(_attention_fwd)


def _kernels_fwd(q, k, v, pb, plan, key, layout):
    desc = _decode_desc(layout, plan, q, k)
    if desc is not None:
        return launch.decode(q, k, v, pb, layout.q_pos, layout.q_valid, layout.k_valid if plan.holes else None, desc)
    return launch.forward(q, k, v, pb, plan, (layout.q_valid, layout.k_valid), key)


@dilated_attention_fwd.register_fake
def _(q, k, v, *args):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


def _attention_bwd(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    segment_lengths: list[int], dilation_rates: list[int],
    contiguous: bool, is_causal: bool, scale: float, head_offset: int,
    window: int, global_tokens: int, dropout_p: float, seed: Optional[torch.Tensor], strict: bool, has_dlse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pb = _problem(segment_lengths, dilation_rates, is_causal, scale, head_offset, window, global_tokens, dropout_p,
                  seed)
    layout = _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous)
    reason, plan, key, comp = _route(q, k, v, layout, pb.dropout_p, pb.branches)
    dlse = dlse if has_dlse else None
    if comp is not None:
        gq = lambda t: comp.gather(t, False)  # noqa: E731
        if dlse is not None:
            dlse = gq(dlse.expand_as(lse))
        dq, dk, dv = launch.backward(gq(do), gq(q), comp.gather(k, True), comp.gather(v, True), gq(out), gq(lse), pb,
                                     plan, (comp.layout.q_valid, comp.layout.k_valid), None, dlse)
        return (comp.scatter(dq, q.shape[2], False), comp.scatter(dk, k.shape[2], True),
                comp.scatter(dv, v.shape[2], True))
    if plan is not None:
        return launch.backward(do, q, k, v, out, lse, pb, plan, (q_valid, k_valid), key, dlse)
    _fallback(reason, strict)

    # The reference's own autograd, as a functional vjp (the op body runs below the autograd dispatch key).
    def ref(qq, kk, vv):
        o, l = _reference(qq, kk, vv, pb, layout)
        return o, torch.where(torch.isfinite(l), l, torch.zeros_like(l))

    (o, l), vjp = torch.func.vjp(ref, q, k, v)
    dl = dlse.to(l.dtype).expand_as(l) if dlse is not None else torch.zeros_like(l)
    return tuple(g.contiguous() for g in vjp((do.to(o.dtype), dl)))


dilated_attention_bwd = torch.library.custom_op("hf_dilated::dilated_attention_bwd", mutates_args=())(_attention_bwd)


@dilated_attention_bwd.register_fake
def _(do, dlse, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, *params = inputs
    *params, seed, strict = params
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid)
    ctx.seed = seed
    ctx.params = [list(x) if isinstance(x, (list, tuple)) else x for x in params]
    ctx.strict = strict


def _backward_through(bwd):
    """The op's backward, computing the gradients with ``bwd`` (the backward op, or in eager code :func:`eager_op`'s
    choice of it or its implementation)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid = ctx.saved_tensors
        has_dlse = dlse is not None
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:  # a placeholder the backward ignores (has_dlse): no allocation and fill launch a call
            dlse = lse
        dq, dk, dv = bwd(
            dout, dlse, q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, *ctx.params, ctx.seed,
            ctx.strict, has_dlse,
        )
        return (dq, dk, dv) + (None,) * 17

    return backward


_forward_op, _EagerAutograd = register(dilated_attention_fwd, _attention_fwd, dilated_attention_bwd, _attention_bwd,
                                       _setup_context, _backward_through, "DilatedAttentionFunction")


def _attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor,
    segment_lengths: list[int], dilation_rates: list[int], is_causal: bool, scale: float, head_offset: int,
    window: int, global_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (at most 64 per row) against a cache whose row ``b`` holds position ``p`` at column ``keys[b, 0] + p``
    for ``p`` in ``[keys[b, 1], keys[b, 2])``; every query is real. One kernel launch, no host read."""
    pb = _problem(segment_lengths, dilation_rates, is_causal, scale, head_offset, window, global_tokens, 0.0, None)
    return launch.decode(q, k, v, pb, q_pos, None, None, keys.to(torch.int32))


dilated_attention_decode = torch.library.custom_op("hf_dilated::dilated_attention_decode",
                                                   mutates_args=())(_attention_decode)
_decode_op = eager_op(dilated_attention_decode, _attention_decode)


@dilated_attention_decode.register_fake
def _(q, k, v, *args):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


DECODE_MAX_QUERIES = 64


def _decodes(query, key, value, layout: TokenLayout, branches, dropout_p: float) -> bool:
    """Whether the cache-decoding op takes this call: a cache layout, few queries, no dropout, no gradient wanted,
    tensors the kernels take."""
    if layout.keys is None or query.shape[2] > DECODE_MAX_QUERIES or dropout_p:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    return shape_fallback_reason(query, key, value) is None and all(r <= MAX_RATE for _, r in branches)


def dilated_attention_triton(query, key, value, branches, layout: TokenLayout, is_causal: bool, scale: float,
                             head_offset: int = 0, *, window: int | None = None, global_tokens: int = 0,
                         dropout_p: float = 0.0, seed: torch.Tensor | None = None, strict: bool = False):
    """Dilated attention per SPEC.md on the Triton kernels: ``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq]
    float32)``, differentiable w.r.t. q, k, v and through the lse.

    ``window``: sliding window on every branch (None: none); ``global_tokens``: SPEC's global-token branch;
    ``dropout_p`` > 0 with ``seed`` (int64 scalar tensor, any device): SPEC's dropout, the same draw in backward.
    Calls the kernels cannot run (:func:`fallback_reason`: float64, head dim above 256, value head dim != query
    head dim, layouts not expressible as runs) run the PyTorch reference after a one-time warning naming the reason,
    or raise ``ValueError`` with ``strict=True`` (what ``backend="triton"`` should pass). A decoding step on a cache
    layout (``layout.keys``, at most 64 queries, no gradient) runs the decode op, which reads no per-key tensor."""
    ws = [int(w) for w, _ in branches]
    rs = [int(r) for _, r in branches]
    if dropout_p:
        if not 0.0 < float(dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype != torch.int64:
            raise ValueError(f"dropout_p > 0 needs seed, an int64 scalar tensor, got {seed!r}")
    else:
        seed = None
    if _decodes(query, key, value, layout, branches, dropout_p):
        return _decode_op(
            query, key, value, layout.q_pos, layout.keys, ws, rs, bool(is_causal), float(scale), int(head_offset),
            int(window or 0), int(global_tokens),
        )
    args = (query, key, value, layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid,
            ws, rs, bool(layout.contiguous), bool(is_causal), float(scale), int(head_offset),
            int(window or 0), int(global_tokens), float(dropout_p), seed, bool(strict))
    return call(_EagerAutograd, _forward_op, args, (query, key, value))
