"""nn.Module forms of the op: ``DilatedAttention`` (the functional op with its branches) and
``MultiheadDilatedAttention`` (a drop-in for ``torch.nn.MultiheadAttention(batch_first=True)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import validate_branches
from .ops.dilated import dilated_attention


class DilatedAttention(nn.Module):
    """Dilated attention over ``[B, H, N, D]`` query / key / value (no parameters).

    Args:
        segment_lengths, dilation_rates: the branches (validated at construction).
        is_causal: default causality of :meth:`forward`.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """

    def __init__(self, segment_lengths, dilation_rates, *, is_causal: bool = True, backend: str = "auto"):
        super().__init__()
        branches = validate_branches(segment_lengths, dilation_rates)
        self.segment_lengths = [w for w, _ in branches]
        self.dilation_rates = [r for _, r in branches]
        self.is_causal = is_causal
        self.backend = backend

    def forward(self, query, key, value, *, is_causal: bool | None = None, **kwargs) -> torch.Tensor:
        """Keyword arguments are those of :func:`hf_dilated.dilated_attention` (``attention_mask``, ``position_ids``...)."""
        return dilated_attention(
            query,
            key,
            value,
            self.segment_lengths,
            self.dilation_rates,
            is_causal=self.is_causal if is_causal is None else is_causal,
            backend=kwargs.pop("backend", self.backend),
            **kwargs,
        )

    def extra_repr(self) -> str:
        return f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, is_causal={self.is_causal}"


class MultiheadDilatedAttention(nn.Module):
    """Drop-in replacement for ``nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)``.

    Same parameters (``in_proj_weight``, ``in_proj_bias``, ``out_proj``), so a ``MultiheadAttention`` state dict
    loads as is, and the same call ``forward(query, key, value, key_padding_mask=None, need_weights=False,
    attn_mask=None, average_attn_weights=True, is_causal=False)``; ``dropout`` drops attention probabilities in
    training mode only (SPEC.md). Attention weights are never materialized:
    ``need_weights=True`` and dense ``attn_mask`` raise. Projections run in the input dtype; the attention
    accumulates in float32, so fp16 / bf16 inputs are safe.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths,
        dilation_rates,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if not batch_first:
            raise ValueError("MultiheadDilatedAttention supports batch_first=True only ([B, N, E] inputs)")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.head_dim = embed_dim // num_heads
        self.attention = DilatedAttention(segment_lengths, dilation_rates, is_causal=False, backend=backend)
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        if need_weights:
            raise ValueError("need_weights=True is not supported: dilated attention never materializes weights")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported; use is_causal=True and key_padding_mask")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.ndim != 3 or t.shape[-1] != self.embed_dim:
                raise ValueError(f"{name} must be [B, N, {self.embed_dim}], got {tuple(t.shape)}")
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = self._heads(F.linear(query, w_q, b_q))
        k = self._heads(F.linear(key, w_k, b_k))
        v = self._heads(F.linear(value, w_v, b_v))
        mask = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != key.shape[:2]:
                raise ValueError(f"key_padding_mask must be [B, Nk] = {tuple(key.shape[:2])}, got {tuple(key_padding_mask.shape)}")
            # torch convention: True (or a -inf float) marks a key to ignore.
            mask = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask == 0
        dropout = {"dropout_p": self.dropout} if self.training and self.dropout > 0 else {}  # as nn.MultiheadAttention
        out = self.attention(q, k, v, is_causal=is_causal, attention_mask=mask, **dropout)
        B, _, N, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, N, self.embed_dim)), None
