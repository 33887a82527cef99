"""Splitting a batch along the sequence across a sequence-parallel group, and reducing the loss over the shards.

Shards are contiguous and as even as possible: with ``N`` tokens over ``P`` ranks, the first ``N % P`` ranks hold
``N // P + 1`` tokens and the others ``N // P`` (:func:`shard_sizes`). Positions stay global (RoPE and the dilation
pattern need them), and the labels are shifted *before* sharding (``shift_labels``, which Transformers' causal-LM
loss accepts), since the label of a shard's last token is the first token of the next shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_varlen
from .group import get_sequence_parallel_group, world_and_rank


def shard_sizes(total: int, world_size: int) -> list[int]:
    """Tokens per rank: the first ``total % world_size`` ranks hold one token more."""
    if world_size < 1 or total < world_size:
        raise ValueError(f"cannot split {total} tokens over {world_size} ranks (each rank needs at least one token)")
    base, extra = divmod(total, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` columns of rank ``rank``'s shard."""
    sizes = shard_sizes(total, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]

IGNORE_INDEX = -100
# Batch entries that run along the sequence (dim 1); everything else passes through unchanged.
SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                 "token_type_ids")


def shard_batch(batch, group=None, *, rank: int | None = None, world_size: int | None = None) -> dict:
    """This rank's shard of a causal-LM batch (``input_ids [B, N]``, optional ``attention_mask``, ``position_ids``,
    ``labels``).

    Adds what a shard cannot compute alone: global ``position_ids`` (``0..N-1`` when absent; packed batches pass
    their own, restarting per sequence) and ``shift_labels`` (``labels`` shifted left by one, ``-100`` last), which
    Transformers' causal-LM loss uses instead of shifting the shard itself. ``labels`` become the sharded
    ``shift_labels`` too, so that models compute a loss at all. The group defaults to
    :func:`~hf_dilated.distributed.get_sequence_parallel_group`; ``rank``/``world_size`` override it (tests, tools).
    """
    if world_size is None or rank is None:
        world_size, rank = world_and_rank(get_sequence_parallel_group() if group is None else group)
    batch = dict(batch)
    ref = batch.get("input_ids", batch.get("inputs_embeds"))
    if ref is None:
        raise ValueError("shard_batch needs input_ids or inputs_embeds")
    n = ref.shape[1]
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(n, device=ref.device)[None].expand(ref.shape[0], n)
    if batch.get("labels") is not None and batch.get("shift_labels") is None:
        labels = batch["labels"]
        batch["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], 1)
    if batch.get("shift_labels") is not None:
        batch["labels"] = batch["shift_labels"]
    start, end = shard_range(n, world_size, rank)
    out = {}
    for k, v in batch.items():
        if k in SEQUENCE_KEYS and isinstance(v, torch.Tensor) and v.ndim >= 2:
            if v.shape[-1 if k == "position_ids" else 1] != n:
                raise ValueError(f"{k} has sequence length {v.shape[1]}, input_ids {n}")
            out[k] = (v[..., start:end] if k == "position_ids" else v[:, start:end]).contiguous()
        else:
            out[k] = v
    return out


def global_num_items(shift_labels: torch.Tensor, group=None) -> torch.Tensor:
    """The number of labelled tokens over all shards (pass it to the model as ``num_items_in_batch``: each rank's
    loss is then its own sum over that global count, and the shards' losses add up to the single-device mean)."""
    count = (shift_labels != IGNORE_INDEX).sum()
    group = get_sequence_parallel_group() if group is None else group
    if world_and_rank(group)[0] > 1:
        dist.all_reduce(count, group=group)
    return count


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The loss of the whole sequence from each shard's ``loss`` computed with :func:`global_num_items` (a sum over
    the group; detached: for logging. Backpropagate each rank's own ``loss``)."""
    total = loss.detach().clone()
    group = get_sequence_parallel_group() if group is None else group
    if world_and_rank(group)[0] > 1:
        dist.all_reduce(total, group=group)
    return total


def all_reduce_gradients(parameters, group=None) -> None:
    """Sum the parameters' gradients over the group: each rank holds the part its shard contributed.

    Not needed when a data-parallel wrapper already reduces over the same ranks (DDP / FSDP over the sequence
    group average instead of summing: multiply each rank's loss by the group size to get the sum).
    """
    group = get_sequence_parallel_group() if group is None else group
    if world_and_rank(group)[0] == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def gather_sequence(t: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's shard of ``t`` along ``dim`` (not differentiable; for evaluation and tests)."""
    group = get_sequence_parallel_group() if group is None else group
    world, _ = world_and_rank(group)
    if world == 1:
        return t
    lengths = [0] * world
    dist.all_gather_object(lengths, int(t.shape[dim]), group=group)
    return all_gather_varlen(t, lengths, group, dim=dim)
