"""The dilated-attention op: layout resolution, the PyTorch reference, the Triton kernels and the dispatcher."""

from .dispatch import dense_attention, dilated_attention
from .layout import TokenLayout, resolve_layout
from .reference import dilated_attention_reference

__all__ = ["dilated_attention", "dense_attention", "dilated_attention_reference", "TokenLayout", "resolve_layout"]
