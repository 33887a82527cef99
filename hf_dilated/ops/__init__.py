"""The dilated-attention op: layout resolution, the one assembly (``attend``), the PyTorch reference, the Triton kernels."""

from .dilated import DENSE, attend, dilated_attention
from .layout import TokenLayout, resolve_layout
from .reference import dilated_attention_reference

__all__ = ["attend", "dilated_attention", "dilated_attention_reference", "DENSE", "TokenLayout", "resolve_layout"]
