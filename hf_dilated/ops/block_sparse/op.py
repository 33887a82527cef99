"""The block-sparse op: a ``torch.library`` custom op over the Triton kernels (one graph node under ``torch.compile``,
autograd registered), and the public :func:`block_sparse_attention` that checks inputs and picks the backend.

Shapes or dtypes outside the kernels' range (float64, head dims not a power of two in 16..256) run the PyTorch
reference inside the op, explicitly; ``backend="torch"`` runs the reference with its own autograd.
"""

from __future__ import annotations

import math

import torch

from ..dilated import check_scale
from ..eager_autograd import call, register
from ..dilated import check_tensors as check_dilated_tensors
from ..dilated import choose_backend
from ..layout import TokenLayout, resolve_layout, zero_padding
from .layout import BlockLayout, check_block_size, from_mask
from .reference import block_sparse_reference



def _tokens(layout: TokenLayout) -> tuple[torch.Tensor, ...]:
    return layout.q_pos, layout.q_seq, layout.q_valid, layout.k_pos, layout.k_seq, layout.k_valid


def _token_layout(q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, contiguous) -> TokenLayout:
    return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, q_valid, contiguous)


def _blocks(kv_count, kv_index, block_size, n_blocks) -> BlockLayout:
    return BlockLayout(block_size, n_blocks, kv_count, kv_index)


def _kernels_ok(q, k, v, block_size) -> bool:
    from ..triton.block_sparse import kernels_support

    return kernels_support(q, k, v, block_size)


def _block_sparse_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_count: torch.Tensor, kv_index: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    block_size: int, contiguous: bool, is_causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = (q_pos, q_seq, q_valid, k_pos, k_seq, k_valid)
    if _kernels_ok(q, k, v, block_size):
        from ..triton import block_sparse as kernels

        return kernels.forward(q, k, v, kv_count, kv_index, tokens, block_size, contiguous, is_causal, scale)
    blocks = _blocks(kv_count, kv_index, block_size, math.ceil(k.shape[2] / block_size))
    out, lse = block_sparse_reference(q, k, v, blocks, _token_layout(*tokens, contiguous), is_causal, scale)
    return out.contiguous(), lse.float().contiguous()


block_sparse_fwd = torch.library.custom_op("hf_dilated::block_sparse_fwd", mutates_args=())(_block_sparse_fwd)


@block_sparse_fwd.register_fake
def _(q, k, v, kv_count, kv_index, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, block_size, contiguous,
      is_causal, scale):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, v.shape[-1]), q.new_empty(B, H, Nq, dtype=torch.float32)


def _block_sparse_bwd(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, kv_count: torch.Tensor, kv_index: torch.Tensor,
    q_ptr: torch.Tensor, q_flat: torch.Tensor,
    q_pos: torch.Tensor, q_seq: torch.Tensor, q_valid: torch.Tensor,
    k_pos: torch.Tensor, k_seq: torch.Tensor, k_valid: torch.Tensor,
    block_size: int, contiguous: bool, is_causal: bool, scale: float, has_dlse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = (q_pos, q_seq, q_valid, k_pos, k_seq, k_valid)
    blocks = _blocks(kv_count, kv_index, block_size, math.ceil(k.shape[2] / block_size))
    if _kernels_ok(q, k, v, block_size):
        from ..triton import block_sparse as kernels

        if q_flat.numel() == 0:  # traced, or the forward ran without grad mode: build the transpose now
            q_ptr, q_flat = blocks.transposed
        return kernels.backward(do, q, k, v, out, lse, kv_count, kv_index, q_ptr, q_flat, tokens, block_size,
                                contiguous, is_causal, scale, dlse if has_dlse else None)
    layout = _token_layout(*tokens, contiguous)

    def ref(qq, kk, vv):
        o, l = block_sparse_reference(qq, kk, vv, blocks, layout, is_causal, scale)
        return o, torch.where(torch.isfinite(l), l, torch.zeros_like(l))

    (o, l), vjp = torch.func.vjp(ref, q, k, v)
    dl = dlse.to(l.dtype).expand_as(l) if has_dlse else torch.zeros_like(l)
    return tuple(g.contiguous() for g in vjp((do.to(o.dtype), dl)))


block_sparse_bwd = torch.library.custom_op("hf_dilated::block_sparse_bwd", mutates_args=())(_block_sparse_bwd)


@block_sparse_bwd.register_fake
def _(do, dlse, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_count, kv_index, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid, b, contiguous, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_count, kv_index, q_pos, q_seq, q_valid, k_pos, k_seq, k_valid)
    ctx.params = (b, contiguous, is_causal, scale)


def _backward_through(bwd):
    """The op's backward, computing the gradients with ``bwd`` (the backward op, or in eager code
    :func:`~hf_dilated.ops.eager_autograd.eager_op`'s choice of it or its implementation)."""

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, kv_count, kv_index, *tokens = ctx.saved_tensors
        b = ctx.params[0]
        has_dlse = dlse is not None
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = lse if dlse is None else dlse  # a placeholder the backward ignores (has_dlse): no allocation a call
        q_ptr, q_flat = _transpose_of(kv_count, kv_index, b)
        dq, dk, dv = bwd(dout, dlse, q, k, v, out, lse, kv_count, kv_index, q_ptr, q_flat, *tokens, *ctx.params,
                         has_dlse)
        return (dq, dk, dv) + (None,) * 12

    return backward


# The transpose of the layout most recently used, keyed by its index tensor (a model's layers share one layout).
_TRANSPOSED: dict = {}


def _transpose_of(kv_count: torch.Tensor, kv_index: torch.Tensor, block_size: int):
    if torch.compiler.is_compiling() or type(kv_index) is not torch.Tensor:  # traced (fake / functional tensors)
        return kv_count.new_empty(0), kv_index.new_empty(0)  # built inside the backward op
    key = (id(kv_index), kv_index._version, id(kv_count))
    hit = _TRANSPOSED.get(key)
    if hit is not None and hit[0] is kv_index:
        return hit[1]
    value = _blocks(kv_count, kv_index, block_size, kv_index.shape[2]).transposed
    _TRANSPOSED.clear()
    _TRANSPOSED[key] = (kv_index, value)
    return value


_forward_op, _EagerAutograd = register(block_sparse_fwd, _block_sparse_fwd, block_sparse_bwd, _block_sparse_bwd,
                                       _setup_context, _backward_through, "BlockSparseAttentionFunction")


def block_sparse_op(query, key, value, blocks: BlockLayout, tokens: TokenLayout, is_causal: bool, scale: float):
    """The custom op on resolved layouts: ``(out, lse)``, differentiable w.r.t. query, key, value (and the lse)."""
    args = (query, key, value, blocks.kv_count, blocks.kv_index, *_tokens(tokens),
            int(blocks.block_size), bool(tokens.contiguous), bool(is_causal), float(scale))
    return call(_EagerAutograd, _forward_op, args, (query, key, value))


# ---- the public op -------------------------------------------------------------------------------------------------


def attend_blocks(query, key, value, blocks: BlockLayout, tokens: TokenLayout, is_causal: bool, scale: float,
                  backend: str, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` on ``backend`` (``"triton"`` or ``"torch"``, as :func:`choose_backend` gives it); ``padded``
    (an attention mask was given): the padding rows of q, k and v zeroed first (:func:`..layout.zero_padding`), so a
    NaN there reaches no real row. What :func:`block_sparse_attention` and the Transformers attention function run."""
    if padded:
        query, key, value = zero_padding(query, key, value, tokens)
    if backend == "triton":
        return block_sparse_op(query, key, value, blocks, tokens, bool(is_causal), float(scale))
    return block_sparse_reference(query, key, value, blocks, tokens, bool(is_causal), float(scale))


def check_tensors(query, key, value) -> None:
    """The dilated op's checks of ``[B, H, N, D]`` q, k, v (``ValueError`` naming the argument), and at least one key."""
    check_dilated_tensors(query, key, value)
    if key.shape[2] == 0:
        raise ValueError(f"key length must be positive, got key {tuple(key.shape)}")


def _mask_block_size(mask: torch.Tensor, kv_len: int) -> int:
    """The power-of-two block size that gives a square mask of this width for ``kv_len`` keys."""
    n = mask.shape[-1]
    for b in (16, 32, 64, 128, 256, 512, 1024):
        if math.ceil(kv_len / b) == n:
            return b
    raise ValueError(
        f"layout_or_pattern: a [{n}, {n}] block mask fits no block size 16..1024 for {kv_len} keys "
        "(n_blocks must be ceil(Nk / block_size)); pass a BlockLayout to choose the block size"
    )


def resolve_blocks(layout_or_pattern, query, key, tokens: TokenLayout, is_causal: bool) -> BlockLayout:
    """A :class:`BlockLayout` for this call from what the caller passed (see :func:`block_sparse_attention`)."""
    from .config import BlockSparseConfig

    if isinstance(layout_or_pattern, str):
        layout_or_pattern = BlockSparseConfig(pattern=layout_or_pattern)
    if isinstance(layout_or_pattern, BlockSparseConfig):
        blocks = layout_or_pattern.build(query, key, tokens, is_causal)
    elif isinstance(layout_or_pattern, BlockLayout):
        blocks = layout_or_pattern
    elif isinstance(layout_or_pattern, torch.Tensor):
        if layout_or_pattern.dtype != torch.bool:
            raise ValueError(f"layout_or_pattern: a block mask must be torch.bool, got {layout_or_pattern.dtype}")
        blocks = from_mask(layout_or_pattern.to(query.device), _mask_block_size(layout_or_pattern, key.shape[2]))
    else:
        raise ValueError(
            "layout_or_pattern must be a BlockLayout, a bool block mask [n_blocks, n_blocks], a BlockSparseConfig or "
            f"a pattern name, got {type(layout_or_pattern).__name__}"
        )
    blocks.check_for(query.shape[0], query.shape[1], key.shape[2])
    return blocks.to(query.device) if blocks.device != query.device else blocks


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout_or_pattern,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Block-sparse attention (SPEC.md): each query attends, with one softmax, to every key of its query block's
    active key blocks, under the position / padding / packing rules.

    Args:
        query: ``[B, Hq, Nq, D]``; key, value: ``[B, Hk, Nk, D]``, ``Hq % Hk == 0`` (GQA, no repeat). ``Nq < Nk``
            decodes: the queries are the last ``Nq`` key columns.
        layout_or_pattern: a :class:`BlockLayout` (``patterns.py``, ``adaptive.py``), a bool block mask
            ``[n, n]`` / ``[Hl, n, n]`` with ``n = ceil(Nk / b)``, a :class:`BlockSparseConfig`, or a pattern name.
        is_causal: causal by position (``p' <= p``).
        scale: score scale, default ``D ** -0.5``.
        attention_mask: ``[B, Nk]`` key mask, True / 1 for real tokens.
        position_ids: ``[B, N]`` positions (a restart marks a new packed sequence).
        backend: ``"auto"`` (Triton on CUDA, else the reference), ``"torch"`` or ``"triton"``.
        return_lse: also return the log-sum-exp ``[B, Hq, Nq]`` (float32; float64 for float64 inputs).
    """
    check_tensors(query, key, value)
    scale = check_scale(scale, query.shape[-1])
    backend = choose_backend(backend, query)
    B, _, Nq, _ = query.shape
    tokens = resolve_layout(B, Nq, key.shape[2], query.device, attention_mask, position_ids)
    blocks = resolve_blocks(layout_or_pattern, query, key, tokens, bool(is_causal))
    out, lse = attend_blocks(query, key, value, blocks, tokens, is_causal, scale, backend, attention_mask is not None)
    return (out, lse) if return_lse else out


__all__ = ["block_sparse_attention", "block_sparse_op", "BlockLayout", "check_block_size"]
