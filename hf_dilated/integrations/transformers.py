"""The ``"dilated"`` attention implementation for Transformers: attention function, mask function, registration.

Like Transformers' own backends (``sdpa_attention.py``), the attention function is small and stateless: it reads the
layer's :class:`~hf_dilated.config.DilatedAttentionConfig` from ``module.config``, resolves token positions and calls
the op. The mask function keeps padding compact: it hands the attention function a ``[B, Nk]`` boolean key mask
(or ``None`` when every key is real), never an ``N x N`` tensor. Packed sequences travel as ``position_ids``
(restarting at 0) or the flash-style ``cu_seq_lens_q/k`` kwargs of ``DataCollatorWithFlattening``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from ..config import DilatedAttentionConfig
from ..ops.dispatch import check_tensors, choose_backend, dense_attention, run_backend
from ..ops.layout import resolve_layout

ATTENTION_NAME = "dilated"


def dilated_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered with ``AttentionMaskInterface``.

    Returns a ``[B, kv_length]`` bool tensor, True for keys that hold a real token: not padding (from the 2-D
    ``attention_mask``) and, with a static cache, already written (absolute index ``< q_offset + q_length``).
    Returns ``None`` when every key is real. Causality, dilation and packing are applied by the attention function
    from positions, so ``mask_function`` (Transformers' dense pattern) is not evaluated.
    """
    index = kv_offset + torch.arange(kv_length, device=device)
    filled = index < (q_offset + q_length)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        width = attention_mask.shape[-1]
        in_range = index < width
        real = attention_mask[:, index.clamp(max=width - 1)] & in_range
        valid = real & filled
    else:
        if isinstance(q_offset, int) and q_offset + q_length >= kv_offset + kv_length:
            return None
        valid = filled.expand(batch_size, -1)
    if not torch.compiler.is_compiling() and bool(valid.all()):
        return None
    return valid


def _reject_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"attn_implementation='{ATTENTION_NAME}' does not return attention weights (output_attentions=True); "
            "use attn_implementation='eager' to inspect weights"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{name}: attention logit softcapping is not supported by '{ATTENTION_NAME}' attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{name}: attention sinks (s_aux) are not supported by '{ATTENTION_NAME}' attention")
    if dropout and dropout > 0:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by '{ATTENTION_NAME}' attention; "
            "set config.attention_dropout = 0.0 for training"
        )


def dilated_attention_forward(
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
    """Attention function registered with ``AttentionInterface`` (Transformers' signature).

    ``query [B, Hq, Nq, D]``, ``key/value [B, Hk, Nk, D]`` (GQA by head ratio, no repeat), ``attention_mask`` as
    :func:`dilated_mask` returns it. Returns ``([B, Nq, Hq, D], None)``. Layers outside ``config.layers`` get exact
    dense attention under the same padding and packing rules (sliding-window layers keep their window).
    """
    _reject_unsupported(module, dropout, kwargs)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast (Trainer's bf16=True) RoPE leaves q, k in float32 while v is bf16: run the op, like SDPA
        # under autocast, in the autocast dtype, and keep autocast from re-casting inside the op.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        with torch.autocast(device_type, enabled=False):
            return _attend(module, query, key, value, attention_mask, scaling, is_causal, kwargs)
    return _attend(module, query, key, value, attention_mask, scaling, is_causal, kwargs)


def _attend(module, query, key, value, attention_mask, scaling, is_causal, kwargs) -> tuple[torch.Tensor, None]:
    check_tensors(query, key, value)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"'{ATTENTION_NAME}' attention takes a 2-D key mask [B, Nk]; got a {attention_mask.ndim}-D mask of shape "
            f"{tuple(attention_mask.shape)} (custom 4-D masks are not supported: pass a 2-D attention_mask and position_ids)"
        )
    config = DilatedAttentionConfig.from_model_config(module.config)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    batch, _, q_len, _ = query.shape
    layout = resolve_layout(
        batch,
        q_len,
        key.shape[2],
        query.device,
        attention_mask=attention_mask,
        position_ids=kwargs.get("position_ids"),
        cu_seqlens_q=kwargs.get("cu_seq_lens_q"),
        cu_seqlens_k=kwargs.get("cu_seq_lens_k"),
    )
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    if sliding is not None and config.applies_to(getattr(module, "layer_idx", None)):
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) is a sliding-window layer (window "
            f"{sliding}); '{ATTENTION_NAME}' attention replaces full-attention layers only: leave it dense with "
            "DilatedAttentionConfig(layers=[...]) or a patch recipe"
        )
    if sliding is None and config.applies_to(getattr(module, "layer_idx", None)):
        backend = choose_backend(config.backend, query)
        out, _ = run_backend(backend, query, key, value, config.branches, layout, bool(is_causal), float(scale), 0)
    else:
        out = dense_attention(query, key, value, layout, bool(is_causal), float(scale), window=sliding)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"dilated"`` with Transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, dilated_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, dilated_mask)


def supports_dilated_attention(model_or_class: Any) -> bool:
    """Whether a model class routes attention through Transformers' generic ``AttentionInterface`` dispatch."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    check = getattr(cls, "is_backend_compatible", None)
    return bool(check()) if callable(check) else bool(getattr(cls, "_supports_attention_backend", False))


def ensure_supported(model_or_class: Any) -> None:
    """Raise a ``ValueError`` naming the model class when it cannot use ``"dilated"`` attention."""
    if not supports_dilated_attention(model_or_class):
        cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
        raise ValueError(
            f"{cls.__name__} does not use Transformers' generic attention dispatch (AttentionInterface), so "
            f"attn_implementation='{ATTENTION_NAME}' cannot reach its attention layers"
        )
