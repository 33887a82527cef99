"""Collectives of sequence parallelism: a differentiable uneven all-to-all (head-parallel layouts, gathering a
sequence; the ring's key window runs its own inside one autograd function), a variable-length all-gather, and an
agreement check that turns mismatched ranks into a ``ValueError`` instead of a hang or a wrong answer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import collective_device


class _AllToAll(torch.autograd.Function):
    """Rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to rank ``j``; the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """Uneven all-to-all along dim 0 (``send_splits[j]`` rows to rank ``j``, ``recv_splits[j]`` rows from it),
    differentiable: the gradient of what a rank received is returned to the rank that sent it."""
    return _AllToAll.apply(x, list(recv_splits), list(send_splits), group)


def all_gather_varlen(x: torch.Tensor, lengths: list[int], group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (lengths may differ per rank; not differentiable)."""
    dim = dim % x.ndim
    home, x = x.device, x.to(collective_device(x, group))
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim).to(home)


def agree(fields: dict[str, int], local: dict[str, int], group, like: torch.Tensor) -> list[dict[str, int]]:
    """All-gather this rank's ``fields`` (which every rank must share) and ``local`` values (which may differ).

    Raises ``ValueError`` on every rank, naming the field and the two ranks, when some rank's ``fields`` differ from
    rank 0's, so that mismatched calls fail at once instead of hanging in a later collective. Returns each rank's
    ``local`` values.
    """
    names = list(fields) + list(local)
    mine = torch.tensor([int(v) for v in list(fields.values()) + list(local.values())], dtype=torch.int64,
                        device=collective_device(like, group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    rows = [dict(zip(names, p.tolist())) for p in parts]
    for rank, row in enumerate(rows[1:], 1):
        for name in fields:
            if row[name] != rows[0][name]:
                raise ValueError(
                    f"sequence-parallel ranks disagree on {name}: rank 0 has {rows[0][name]}, rank {rank} has "
                    f"{row[name]}; every rank of the group must call the op with the same shapes and settings"
                )
    return [{k: row[k] for k in local} for row in rows]
