"""The ``"dilated"`` attention implementation for Transformers: attention function, mask function, registration.

Like Transformers' own backends (``sdpa_attention.py``), the attention function is small and stateless: it reads the
model's :class:`~hf_dilated.config.DilatedAttentionConfig` (parsed once per model config), resolves token positions
and calls the one op, :func:`~hf_dilated.ops.dilated.attend`. The mask function keeps padding compact: it hands the
attention function a ``[B, Nk]`` boolean key mask, a static cache's ``[B]`` filled lengths, or ``None``, never an
``N x N`` tensor; a decoding step without a 2-D mask costs the same at every cache length. Packed sequences travel as ``position_ids`` (restarting at 0, without a 2-D mask) or the
flash-style ``cu_seq_lens_q/k`` kwargs of ``DataCollatorWithFlattening``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.utils import logging

from ..config import DilatedAttentionConfig
from ..distributed.group import head_offset
from ..ops.dilated import DENSE, attend, draw_seed
from ..ops.layout import resolve_layout

ATTENTION_NAME = "dilated"
logger = logging.get_logger(__name__)


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
    """Mask function registered with ``AttentionMaskInterface``; called once per forward per mask type.

    Returns, never an ``N x N`` tensor and never reading a value on the host:

    - ``None`` when no 2-D mask was given and every key is filled (training, prefill, a dynamic cache);
    - a ``[B]`` int64 tensor of *key lengths* when no 2-D mask was given but a static cache has unfilled slots: the
      first ``q_offset + q_length - kv_offset`` columns hold real keys. O(B) work per decoding step, whatever the
      cache length (the attention function reads the unfilled tail from this length, not from a mask);
    - else a ``[B, kv_length]`` bool key mask: the given 2-D ``attention_mask`` (True = real key) and, with a static
      cache, only the written slots. A given 2-D mask is always passed on (it says "one sequence per row": packing
      is then not inferred from ``position_ids``, as in Transformers).

    Causality, dilation and packing are applied by the attention function from positions, so ``mask_function``
    (the dense pattern) is unused.
    """
    config = kwargs.get("config")
    if config is not None:
        DilatedAttentionConfig.of(config)  # a malformed stored config fails here, before any layer runs
    whole = isinstance(q_offset, int) and q_offset + q_length >= kv_offset + kv_length  # no unfilled slot
    if attention_mask is None:
        if whole:
            return None
        filled = torch.as_tensor(q_offset + q_length - kv_offset, device=device).reshape(1)
        return filled.to(torch.int64).clamp(0, kv_length).expand(batch_size)
    if attention_mask.ndim == 1:  # this function's own [B] key lengths, prepared once per step by generate() for a
        return attention_mask.to(device=device, dtype=torch.int64)  # static cache and passed back in as the mask
    attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    width = attention_mask.shape[-1]
    if whole and kv_offset == 0 and width == kv_length:
        return attention_mask
    index = kv_offset + torch.arange(kv_length, device=device)
    real = attention_mask[:, index.clamp(max=width - 1)] & (index < width)
    return real & (index < q_offset + q_length)


def attention_function(name: str, attend_fn: Callable[..., torch.Tensor], *, supports_dropout: bool = True) -> Callable:
    """Adapt ``attend_fn(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)`` (which
    returns ``[B, Hq, Nq, D]``) to Transformers' attention-function signature, the same way for every kind:

    ``attention_mask`` is what :func:`dilated_mask` returns: ``None``, a ``[B, Nk]`` key mask, or ``[B]`` key lengths.
    ``output_attentions=True`` warns once and gives ``None`` weights (as Transformers' sdpa and flash backends do);
    logit softcapping and attention sinks (``s_aux``), 4-D masks and, where ``supports_dropout=False``, attention dropout are
    refused with a ``ValueError``; ``is_causal`` defaults to the module's; under autocast (Trainer's ``bf16=True``,
    where RoPE leaves q, k in float32 and v in bf16) the op runs, like SDPA, in the autocast dtype with autocast off
    inside; the output is returned as ``([B, Nq, Hq, D], None)``.
    """

    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cls = type(module).__name__
        if kwargs.get("output_attentions"):
            logger.warning_once(
                f"`{name}` attention does not return attention weights (output_attentions=True gives None);"
                " set attn_implementation='eager' to inspect them."
            )
        if kwargs.get("softcap") is not None:
            raise ValueError(f"{cls}: attention logit softcapping is not supported by '{name}' attention")
        if kwargs.get("s_aux") is not None:
            raise ValueError(f"{cls}: attention sinks (s_aux) are not supported by '{name}' attention")
        if not supports_dropout and dropout and dropout > 0:
            raise ValueError(
                f"attention dropout ({dropout}) is not supported by '{name}' attention; set config.attention_dropout = 0.0"
            )
        if attention_mask is not None and attention_mask.ndim not in (1, 2):
            raise ValueError(
                f"'{name}' attention takes a 2-D key mask [B, Nk] (or the [B] key lengths of its mask function); got a "
                f"{attention_mask.ndim}-D mask of shape "
                f"{tuple(attention_mask.shape)} (custom 4-D masks are not supported: pass a 2-D attention_mask and "
                "position_ids)"
            )
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = (t.to(dtype) for t in (query, key, value))
            with torch.autocast(device_type, enabled=False):
                out = attend_fn(module, query, key, value, attention_mask, dropout, scaling, bool(is_causal), kwargs)
        else:
            out = attend_fn(module, query, key, value, attention_mask, dropout, scaling, bool(is_causal), kwargs)
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = forward.__qualname__ = f"{name}_attention_forward"
    forward.__doc__ = f"The ``{name!r}`` attention function (Transformers' signature); see :func:`attention_function`."
    return forward


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs) -> torch.Tensor:
    """Dilated attention for one layer: the model's branches, or the dense branch (with its sliding window) for layers
    outside ``config.layers``. ``[B, Hq, Nq, D]`` in, ``[B, Hq, Nq, D]`` out."""
    config = DilatedAttentionConfig.of(module.config)
    layer = getattr(module, "layer_idx", None)
    sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    dilated = config.applies_to(layer)
    if sliding is not None and dilated:
        raise ValueError(
            f"{type(module).__name__} (layer {layer if layer is not None else '?'}) is a sliding-window layer (window "
            f"{sliding}); '{ATTENTION_NAME}' attention replaces full-attention layers only: leave it dense with "
            "DilatedAttentionConfig(layers=[...]) or a patch recipe"
        )
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
    dropout = float(dropout or 0.0)
    # Under head parallelism (DeepSpeed Ulysses) this rank holds a slice of the heads: offsets use global indices.
    total_heads = getattr(module.config, "num_attention_heads", None) or query.shape[1]
    out, _ = attend(
        query,
        key,
        value,
        layout,
        config.branches if dilated else DENSE,
        is_causal=bool(is_causal),
        scale=scaling,
        head_offset=head_offset(query.shape[1], total_heads),
        window=sliding,
        global_tokens=config.global_tokens if dilated else 0,
        dropout_p=dropout,
        seed=draw_seed(query.device) if dropout > 0 else None,
        backend=config.backend,
    )
    return out


dilated_attention_forward = attention_function(ATTENTION_NAME, _attend)


def register() -> None:
    """Register ``"dilated"`` with Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface  # loads the model code: only on register

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
