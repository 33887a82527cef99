"""The ``"block_sparse"`` attention implementation for Transformers: attention function, mask function, registration.

Like the ``"dilated"`` function beside it, small and stateless: it reads :class:`BlockSparseConfig` from
``module.config.block_sparse_attention``, resolves token positions and calls the block-sparse op. The mask function
is the dilated one (a compact ``[B, Nk]`` key mask or ``None``, never ``N x N``). Layers outside ``config.layers``
and sliding-window layers stay exact dense attention.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.block_sparse.config import BlockSparseConfig
from ..ops.block_sparse.op import attend_blocks, check_tensors, choose_backend, resolve_blocks
from ..ops.dilated import DENSE, attend
from ..ops.layout import key_mask_from_lengths, resolve_layout
from .transformers import attention_function

ATTENTION_NAME = "block_sparse"


def block_sparse_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function registered with ``AttentionMaskInterface``: the ``[B, Nk]`` key mask of ``"dilated"``. A
    malformed stored config fails here, at the first forward, before any layer runs (as for ``"dilated"``)."""
    from .transformers import dilated_mask

    config = kwargs.pop("config", None)
    if config is not None and not torch.compiler.is_compiling():
        BlockSparseConfig.from_model_config(config)
    return dilated_mask(*args, **kwargs)


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs) -> torch.Tensor:
    """Block-sparse attention for one layer (``[B, Hq, Nq, D]`` in and out); layers outside ``config.layers`` and
    sliding-window layers are the dense branch of :func:`~hf_dilated.ops.dilated.attend`."""
    check_tensors(query, key, value)
    config = BlockSparseConfig.from_model_config(module.config)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None and attention_mask.ndim == 1:  # a static cache's filled lengths (dilated_mask)
        attention_mask = key_mask_from_lengths(attention_mask.to(query.device), key.shape[2])
    if query.shape[2] < key.shape[2] and attention_mask is not None and not torch.compiler.is_compiling():
        # A static cache holds unfilled slots after the last written key: drop them, so that the new queries are
        # the last key columns (blocks are tiles of key columns, see ops/block_sparse/layout.py).
        filled = int(attention_mask.any(0).nonzero().max()) + 1 if attention_mask.any() else key.shape[2]
        if query.shape[2] <= filled < key.shape[2]:
            key, value, attention_mask = key[:, :, :filled], value[:, :, :filled], attention_mask[:, :filled]
    tokens = resolve_layout(
        query.shape[0], query.shape[2], key.shape[2], query.device, attention_mask=attention_mask,
        position_ids=kwargs.get("position_ids"), cu_seqlens_q=kwargs.get("cu_seq_lens_q"),
        cu_seqlens_k=kwargs.get("cu_seq_lens_k"),
    )
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    if sliding is None and config.applies_to(getattr(module, "layer_idx", None)):
        blocks = resolve_blocks(config, query, key, tokens, bool(is_causal))
        out, _ = attend_blocks(query, key, value, blocks, tokens, is_causal, scale,
                               choose_backend(config.backend, query), attention_mask is not None)
    else:
        out, _ = attend(query, key, value, tokens, DENSE, is_causal=bool(is_causal), scale=scale, window=sliding,
                        backend=config.backend)
    return out


block_sparse_attention_forward = attention_function(ATTENTION_NAME, _attend, supports_dropout=False)


def register() -> None:
    """Register ``"block_sparse"`` with Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, block_sparse_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, block_sparse_mask)
