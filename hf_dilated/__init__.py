"""hf_dilated: LongNet dilated attention for Hugging Face Transformers.

Importing the package registers three attention implementations with Transformers' ``AttentionInterface`` and
``AttentionMaskInterface``: ``"dilated"`` (one device), ``"dilated_ring"`` (the sequence split over a
``torch.distributed`` group) and ``"block_sparse"``.
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
from .integrations import block_sparse as _block_sparse_integration
from .integrations import dilated_ring as _dilated_ring_integration
from .modules import DilatedAttention, MultiheadDilatedAttention
from .ops import attend, dilated_attention, resolve_layout
from .ops.block_sparse import BlockLayout, BlockSparseConfig, block_sparse_attention
from .patching import list_recipes, load_recipe, patch, save_patched, unpatch

register()
_dilated_ring_integration.register()
_block_sparse_integration.register()

__all__ = [
    "BlockLayout",
    "BlockSparseConfig",
    "block_sparse_attention",
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
