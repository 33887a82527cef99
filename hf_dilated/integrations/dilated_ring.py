"""The ``"dilated_ring"`` attention implementation for Transformers: sequence-parallel dilated attention.

Each rank runs the model on its shard of the sequence (:func:`~hf_dilated.distributed.sharding.shard_batch`), with
global ``position_ids``; this attention function exchanges the keys and values that the dilated segments need
(:func:`~hf_dilated.distributed.dilated_ring.dilated_ring_attention`). The configuration is the one ``"dilated"``
reads, ``config.dilated_attention``; layers left dense gather every earlier key (exact, memory linear in ``N``).
The mask function is ``"dilated"``'s: a ``[B, n_local]`` key mask of the shard, or ``None``.
"""

from __future__ import annotations


import torch

from ..config import DENSE_SEGMENT, DilatedAttentionConfig
from ..distributed.dilated_ring import dilated_ring_attention
from ..distributed.group import get_sequence_parallel_group
from .transformers import attention_function, dilated_mask

ATTENTION_NAME = "dilated_ring"


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs) -> torch.Tensor:
    """Sequence-parallel dilated attention for one layer: ``query [B, Hq, n_local, D]``, ``key/value
    [B, Hk, n_local, D]`` are this rank's shard, ``kwargs["position_ids"]`` its global positions; returns this
    shard's ``[B, Hq, n_local, D]``. Layers outside ``config.layers`` are the dense branch."""
    name = type(module).__name__
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            f"'{ATTENTION_NAME}' takes packed sequences as global position_ids (restarting at 0), not cu_seq_lens: "
            "shard the batch with hf_dilated.distributed.sharding.shard_batch"
        )
    config = DilatedAttentionConfig.of(module.config)
    layer = getattr(module, "layer_idx", None)
    if kwargs.get("sliding_window", getattr(module, "sliding_window", None)):
        raise ValueError(f"{name} (layer {layer}) is a sliding-window layer; '{ATTENTION_NAME}' does not shard those")
    dilated = config.applies_to(layer)
    branches = config.branches if dilated else ((DENSE_SEGMENT, 1),)
    return dilated_ring_attention(
        query, key, value, [w for w, _ in branches], [r for _, r in branches], is_causal=is_causal,
        scale=scaling, position_ids=kwargs.get("position_ids"), attention_mask=attention_mask,
        global_tokens=config.global_tokens if dilated else 0,
        group=get_sequence_parallel_group(), backend=config.backend,
    )


dilated_ring_attention_forward = attention_function(ATTENTION_NAME, _attend, supports_dropout=False)


def register() -> None:
    """Register ``"dilated_ring"`` with Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface  # loads the model code: only on register

    AttentionInterface.register(ATTENTION_NAME, dilated_ring_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, dilated_mask)
