"""Block-sparse attention: compact block layouts (``layout.py``), named patterns (``patterns.py``), content-chosen
selection (``adaptive.py``), the PyTorch reference (``reference.py``), the custom op and public function (``op.py``)
and the model-config entry (``config.py``). The Triton kernels live in ``ops/triton/block_sparse.py``; the
Transformers glue in ``integrations/block_sparse.py``."""

from .adaptive import adaptive_blocks
from .config import CONFIG_KEY, PATTERNS, BlockSparseConfig
from .layout import BlockLayout, compact, from_mask, union
from .op import block_sparse_attention, block_sparse_op
from .patterns import (
    dense_blocks,
    dilated_blocks,
    global_blocks,
    hierarchical_blocks,
    local_blocks,
    random_blocks,
)
from .reference import block_sparse_reference

__all__ = [
    "BlockLayout", "BlockSparseConfig", "CONFIG_KEY", "PATTERNS", "adaptive_blocks", "block_sparse_attention",
    "block_sparse_op", "block_sparse_reference", "compact", "dense_blocks", "dilated_blocks", "from_mask",
    "global_blocks", "hierarchical_blocks", "local_blocks", "random_blocks", "union",
]
