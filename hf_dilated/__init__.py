"""hf_dilated: LongNet dilated attention for Hugging Face Transformers.

Importing the package registers the ``"dilated"`` attention implementation with Transformers'
``AttentionInterface`` and ``AttentionMaskInterface``.
"""

__version__ = "0.1.0"

from .config import CONFIG_KEY, DilatedAttentionConfig, default_branches
from .ops import dense_attention, dilated_attention, resolve_layout

__all__ = [
    "__version__",
    "CONFIG_KEY",
    "DilatedAttentionConfig",
    "default_branches",
    "dilated_attention",
    "dense_attention",
    "resolve_layout",
]
