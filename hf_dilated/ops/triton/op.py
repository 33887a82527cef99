"""The Triton backend as ``torch.library`` custom ops with fake implementations and registered autograd.

``torch.ops.hf_dilated.dilated_attention_fwd`` and ``..._bwd`` take the layout as plain tensors, so that
``torch.compile(fullgraph=True)`` traces them as single opaque nodes (no graph break in attention). Inside, each call
either runs the Triton kernels or, where the layout cannot be addressed in place (a sequence split over several runs)
or the shape is outside the kernels' range (head dim not a power of two in 16..256, value head dim != query head dim,
float64), the PyTorch reference: explicitly, never a wrong answer.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from ..reference import dilated_attention_reference
from . import launch


def _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous) -> TokenLayout:
    return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, q_valid, contiguous)


def kernels_support(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels cover these shapes and dtypes (otherwise the op runs the reference)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and v.shape[-1] == d
        and 16 <= d <= 256
        and d & (d - 1) == 0
    )


def _plan(layout: TokenLayout, q: torch.Tensor, k: torch.Tensor):
    """``(runs, cache_key)``, or ``(None, None)`` when the layout is not expressible as runs."""
    B, _, Nq, _ = q.shape
    Nk = k.shape[2]
    runs = layout.runs()
    key = ("contiguous", B, Nq, Nk) if layout.contiguous else None
    return runs, key


def _decode_desc(layout: TokenLayout, runs: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Per-row key descriptors for the decode kernel, or ``None`` when a row is not one query run against one key run."""
    B, Nq = q.shape[0], q.shape[2]
    if Nq > 64 or Nq >= k.shape[2] or runs.shape[0] != B or not torch.equal(runs[:, 0], torch.arange(B)):
        return None
    if not layout.contiguous and not torch.equal(runs[:, 3], layout.q_valid.sum(-1).cpu()):
        return None  # some valid query is in no run (no keys of its sequence): leave it to the general path
    desc = torch.stack([runs[:, 4] - runs[:, 5], runs[:, 5], runs[:, 5] + runs[:, 6]], 1)
    return desc.to(torch.int32).to(q.device)


@torch.library.custom_op("hf_dilated::dilated_attention_fwd", mutates_args=())
def dilated_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    segment_lengths: list[int], dilation_rates: list[int],
    contiguous: bool, is_causal: bool, scale: float, head_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    branches = tuple(zip(segment_lengths, dilation_rates))
    layout = _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous)
    if kernels_support(q, k, v):
        runs, key = _plan(layout, q, k)
        if runs is not None:
            desc = _decode_desc(layout, runs, q, k)
            if desc is not None:
                return launch.decode(q, k, v, branches, q_pos, q_valid, desc, is_causal, scale, head_offset)
            return launch.forward(q, k, v, branches, runs, key, is_causal, scale, head_offset)
    out, lse = dilated_attention_reference(q, k, v, branches, layout, is_causal, scale, head_offset)
    return out.contiguous(), lse.float().contiguous()


@dilated_attention_fwd.register_fake
def _(q, k, v, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, segment_lengths, dilation_rates,
      contiguous, is_causal, scale, head_offset):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


@torch.library.custom_op("hf_dilated::dilated_attention_bwd", mutates_args=())
def dilated_attention_bwd(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    segment_lengths: list[int], dilation_rates: list[int],
    contiguous: bool, is_causal: bool, scale: float, head_offset: int, has_dlse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    branches = tuple(zip(segment_lengths, dilation_rates))
    layout = _layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous)
    if kernels_support(q, k, v):
        runs, key = _plan(layout, q, k)
        if runs is not None:
            return launch.backward(do, q, k, v, out, lse, branches, runs, key, is_causal, scale, head_offset,
                                   dlse if has_dlse else None)
    # The reference's own autograd, as a functional vjp (the op body runs below the autograd dispatch key).
    def ref(qq, kk, vv):
        o, l = dilated_attention_reference(qq, kk, vv, branches, layout, is_causal, scale, head_offset)
        return o, torch.where(torch.isfinite(l), l, torch.zeros_like(l))

    (o, l), vjp = torch.func.vjp(ref, q, k, v)
    dl = dlse.to(l.dtype).expand_as(l) if has_dlse else torch.zeros_like(l)
    return tuple(g.contiguous() for g in vjp((do.to(o.dtype), dl)))


@dilated_attention_bwd.register_fake
def _(do, dlse, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, ws, rs, contiguous, is_causal, scale, head_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid)
    ctx.params = (list(ws), list(rs), contiguous, is_causal, scale, head_offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid = ctx.saved_tensors
    has_dlse = dlse is not None
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = lse.new_zeros(())
    dq, dk, dv = dilated_attention_bwd(
        dout, dlse, q, k, v, out, lse, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, *ctx.params, has_dlse
    )
    return (dq, dk, dv) + (None,) * 12


torch.library.register_autograd("hf_dilated::dilated_attention_fwd", _backward, setup_context=_setup_context)


def dilated_attention_op(query, key, value, branches, layout: TokenLayout, is_causal: bool, scale: float,
                         head_offset: int = 0):
    """Call the custom op with a :class:`TokenLayout`; returns ``(out, lse)``, differentiable w.r.t. q, k, v
    (and through the lse as well)."""
    ws = [int(w) for w, _ in branches]
    rs = [int(r) for _, r in branches]
    return torch.ops.hf_dilated.dilated_attention_fwd(
        query, key, value, layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid,
        ws, rs, bool(layout.contiguous), bool(is_causal), float(scale), int(head_offset),
    )
