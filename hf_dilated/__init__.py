"""hf_dilated: LongNet dilated attention for Hugging Face Transformers.

Importing the package registers the ``"dilated"`` attention implementation with Transformers'
``AttentionInterface`` and ``AttentionMaskInterface``.
"""

__version__ = "0.1.0"

from .config import CONFIG_KEY, DilatedAttentionConfig, default_branches
from .integrations.transformers import (
    ATTENTION_NAME,
    dilated_attention_forward,
    dilated_mask,
    ensure_supported,
    register,
    supports_dilated_attention,
)
from .modules import DilatedAttention, MultiheadDilatedAttention
from .ops import attend, dilated_attention, resolve_layout
from .patching import list_recipes, load_recipe, patch, save_patched, unpatch

register()

__all__ = [
    "__version__",
    "ATTENTION_NAME",
    "DilatedAttention",
    "list_recipes",
    "load_recipe",
    "patch",
    "save_patched",
    "unpatch",
    "MultiheadDilatedAttention",
    "dilated_attention_forward",
    "dilated_mask",
    "ensure_supported",
    "register",
    "supports_dilated_attention",
    "CONFIG_KEY",
    "DilatedAttentionConfig",
    "default_branches",
    "dilated_attention",
    "attend",
    "resolve_layout",
]
