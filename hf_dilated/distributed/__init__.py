"""Sequence-parallel dilated attention over ``torch.distributed`` (see ``dilated_ring.py``), the sharding of a
batch and the reduction of the loss across the shards (``sharding.py``), and the ``"dilated_ring"`` attention
implementation for Transformers (``transformers.py``)."""

from .dilated_ring import dilated_ring_attention
from .group import (
    get_head_parallel_group,
    get_sequence_parallel_group,
    head_offset,
    set_head_parallel_group,
    set_sequence_parallel_group,
)

__all__ = [
    "dilated_ring_attention",
    "get_head_parallel_group",
    "get_sequence_parallel_group",
    "head_offset",
    "set_head_parallel_group",
    "set_sequence_parallel_group",
]
