"""The ``"dilated_ring"`` attention implementation for Transformers: sequence-parallel dilated attention.

Each rank runs the model on its shard of the sequence (:func:`~hf_dilated.distributed.sharding.shard_batch`), with
global ``position_ids``; this attention function exchanges the keys and values that the dilated segments need
(:func:`~hf_dilated.distributed.dilated_ring.dilated_ring_attention`). The configuration is the one ``"dilated"``
reads, ``config.dilated_attention``; layers left dense gather every earlier key (exact, memory linear in ``N``).
The mask function is ``"dilated"``'s: a ``[B, n_local]`` key mask of the shard, or ``None``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from ..config import DENSE_SEGMENT, DilatedAttentionConfig
from ..distributed.dilated_ring import dilated_ring_attention
from ..distributed.group import get_sequence_parallel_group
from .transformers import dilated_mask

ATTENTION_NAME = "dilated_ring"


def dilated_ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with ``AttentionInterface`` as ``"dilated_ring"`` (Transformers' signature).

    ``query [B, Hq, n_local, D]``, ``key/value [B, Hk, n_local, D]``: this rank's shard; ``kwargs["position_ids"]``
    its global positions. Returns ``([B, n_local, Hq, D], None)``.
    """
    name = type(module).__name__
    if dropout and dropout > 0:
        raise ValueError(f"attention dropout ({dropout}) is not supported by '{ATTENTION_NAME}'; set config.attention_dropout = 0.0")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{name}: {unsupported} is not supported by '{ATTENTION_NAME}' attention")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            f"'{ATTENTION_NAME}' takes packed sequences as global position_ids (restarting at 0), not cu_seq_lens: "
            "shard the batch with hf_dilated.distributed.sharding.shard_batch"
        )
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"'{ATTENTION_NAME}' takes a 2-D key mask [B, n_local], got shape {tuple(attention_mask.shape)}")
    config = DilatedAttentionConfig.from_model_config(module.config)
    layer = getattr(module, "layer_idx", None)
    if kwargs.get("sliding_window", getattr(module, "sliding_window", None)):
        raise ValueError(f"{name} (layer {layer}) is a sliding-window layer; '{ATTENTION_NAME}' does not shard those")
    if getattr(config, "global_tokens", 0):
        raise ValueError(f"'{ATTENTION_NAME}' does not support global_tokens yet (config.dilated_attention); use 'dilated'")
    branches = config.branches if config.applies_to(layer) else ((DENSE_SEGMENT, 1),)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # like "dilated": run in the autocast dtype, autocast off inside
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    with torch.autocast(device_type, enabled=False):
        out = dilated_ring_attention(
            query, key, value, [w for w, _ in branches], [r for _, r in branches], is_causal=bool(is_causal),
            scale=scaling, position_ids=kwargs.get("position_ids"), attention_mask=attention_mask,
            group=get_sequence_parallel_group(), backend=config.backend,
        )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"dilated_ring"`` with Transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, dilated_ring_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, dilated_mask)
