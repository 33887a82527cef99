"""Which ``torch.distributed`` process group splits the sequence (and which one splits heads).

Sequence parallelism needs one group per model replica whose ranks each hold a contiguous shard of the sequence.
:func:`set_sequence_parallel_group` names it; without one the default (world) group is used. Head parallelism
(Ulysses, as DeepSpeed's ``DistributedAttention`` does it) hands each rank a slice of the heads: the dilation offset
must use the head's global index, which :func:`head_offset` derives from the head-parallel group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

_SEQUENCE_GROUP = None
_HEAD_GROUP = None


def set_sequence_parallel_group(group) -> None:
    """Use ``group`` (a ``torch.distributed`` ProcessGroup, or ``None`` for the default group) to split sequences."""
    global _SEQUENCE_GROUP
    _SEQUENCE_GROUP = group


def get_sequence_parallel_group():
    """The group named by :func:`set_sequence_parallel_group`, else the default group (``None`` when not initialized)."""
    if _SEQUENCE_GROUP is not None:
        return _SEQUENCE_GROUP
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def set_head_parallel_group(group) -> None:
    """Name the group across which heads are split (Ulysses); ``None`` clears it."""
    global _HEAD_GROUP
    _HEAD_GROUP = group


def get_head_parallel_group():
    """The group named by :func:`set_head_parallel_group`, else DeepSpeed's Ulysses group when DeepSpeed has set one
    up (``register_with_transformers``, or accelerate with ``sp_backend="deepspeed"``), else ``None``."""
    if _HEAD_GROUP is not None:
        return _HEAD_GROUP
    ulysses = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if ulysses is not None:
        try:
            return ulysses.get_sequence_parallel_group()
        except Exception:  # DeepSpeed imported but no Ulysses group initialized
            return None
    return None


def world_and_rank(group) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` when there is no initialized process group."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def head_offset(local_heads: int, total_heads: int, group=None) -> int:
    """Global index of this rank's first query head when ``total_heads`` are split evenly over ``group``.

    ``local_heads == total_heads`` (no head split) gives 0. A split without a head-parallel group raises: the
    dilation offsets would silently use local indices.
    """
    if local_heads == total_heads:
        return 0
    group = group if group is not None else get_head_parallel_group()
    world, rank = world_and_rank(group)
    if world == 1 or local_heads * world != total_heads:
        raise ValueError(
            f"attention received {local_heads} of {total_heads} query heads but no head-parallel group of "
            f"{total_heads // max(local_heads, 1)} ranks is set: call "
            "hf_dilated.distributed.set_head_parallel_group(group) so dilation offsets use global head indices"
        )
    return rank * local_heads


def collective_device(tensor: torch.Tensor, group) -> torch.device:
    """Where small bookkeeping tensors of a collective must live: CUDA for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return tensor.device if "nccl" in str(backend).lower() else torch.device("cpu")
