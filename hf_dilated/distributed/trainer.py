"""Sequence parallelism under Transformers' ``Trainer``: groups, the model switched to ``"dilated_ring"``, and a
``Trainer`` whose steps shard every sequence over the group and reduce the loss and gradients exactly.

Launched by ``torchrun`` or ``accelerate launch`` with ``W`` processes, ``W`` divisible by the sequence-parallel size
``P``: ranks ``[0, P)``, ``[P, 2P)``, ... each split sequences (:func:`init_sequence_parallel`); data parallelism
runs over the ``W / P`` groups. Trainer's data loader hands every rank its own batch, as in data parallelism; a
step gathers the ``P`` batches of the group and runs them one after another, each sharded along the sequence
(:func:`~hf_dilated.distributed.sharding.shard_batch`: global ``position_ids``, labels shifted before sharding), so
memory per rank holds ``1/P`` of one batch at a time. The loss of a shard is a *sum* of token losses divided by the
count of labelled tokens of the whole step (every rank, every gradient-accumulation micro-batch, as Trainer's
``num_items_in_batch``), and the gradients are *summed* over all ranks once per optimizer step, so the update equals
the single-process step on the same batches. (DDP, which Trainer wraps the model in, is bypassed for this: it would
average, and the chunked loss of ``scripts/finetune.py`` calls the model's body directly.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .group import get_sequence_parallel_group, set_sequence_parallel_group, world_and_rank
from .sharding import IGNORE_INDEX, shard_batch

RING_ATTENTION = "dilated_ring"


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"sequence_parallel must be a positive integer, got {size!r}")
    return size


def init_sequence_parallel(size: int):
    """Create the sequence-parallel groups of ``size`` consecutive ranks of the default group and name this rank's
    (:func:`~hf_dilated.distributed.set_sequence_parallel_group`); returns it. Every rank must call it."""
    size = _check_size(size)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"sequence_parallel={size} needs torch.distributed initialized: launch with "
            f"`torchrun --nproc-per-node {size} ...` or `accelerate launch --num_processes {size} ...`"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence_parallel must divide the number of processes ({world}), got {size}")
    if size == world:
        group = dist.group.WORLD
    else:
        group = None
        for first in range(0, world, size):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                group = g
    set_sequence_parallel_group(group)
    return group


def enable_sequence_parallel(model: Any, size: int) -> Any:
    """Shard every sequence of ``model`` over groups of ``size`` ranks: create the groups and switch its attention to
    ``"dilated_ring"``, keeping its dilated configuration (``config.dilated_attention``, set by
    :func:`hf_dilated.training.prepare_attention` or :func:`hf_dilated.patch`). ``size == 1`` changes nothing.
    Train it with :class:`SequenceParallelTrainer` (or shard batches and reduce yourself: ``hf_dilated.distributed``).
    """
    from ..config import CONFIG_KEY, DilatedAttentionConfig
    from ..integrations import dilated_ring

    size = _check_size(size)
    if size == 1:
        return model
    if getattr(model.config, CONFIG_KEY, None) is None:
        raise ValueError(
            "sequence_parallel > 1 needs a dilated model (config.dilated_attention): switch it with "
            "hf_dilated.training.prepare_attention(model, 'dilated') first (--attn dilated)"
        )
    DilatedAttentionConfig.from_model_config(model.config)  # a malformed stored config fails here, on every rank
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(
            f"'{RING_ATTENTION}' has no attention dropout yet, but the model config sets attention_dropout={dropout}: "
            "set model.config.attention_dropout = 0 for sequence-parallel training ('dilated' on one device has it)"
        )
    init_sequence_parallel(size)
    dilated_ring.register()
    model.config.use_cache = False
    model.set_attn_implementation(RING_ATTENTION)
    return model


def label_count(batch: dict) -> torch.Tensor:
    """Labelled (predicted) tokens of an unsharded causal-LM batch, as Trainer counts them."""
    if batch.get("shift_labels") is not None:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    if batch.get("labels") is None:
        raise ValueError("sequence-parallel training needs labels (or shift_labels) in every batch")
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def gather_group_batches(batch: dict, group) -> list[dict]:
    """Every rank's batch of ``group``, in rank order (tensors on this rank's device; shapes may differ)."""
    world, _ = world_and_rank(group)
    if world == 1:
        return [batch]
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    parts: list = [None] * world
    dist.all_gather_object(parts, cpu, group=group)
    return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in part.items()} for part in parts]


def loss_sum(model, inputs: dict) -> torch.Tensor:
    """The summed next-token loss of a shard (``shift_labels`` are its targets): the model's logits, cross-entropy."""
    targets = inputs["shift_labels"]
    body = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
    logits = model(**body, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def _sum_gradients(parameters) -> None:
    """Sum the gradients over every process (sequence and data parallel alike), in one flat buffer."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _trainer_class():
    from transformers import Trainer

    class SequenceParallelTrainer(Trainer):
        """A ``Trainer`` that shards each sequence over the sequence-parallel group (see the module docstring).

        Call :func:`enable_sequence_parallel` on the model first. Supported: plain data parallelism (torchrun or
        ``accelerate launch``, the default DDP) and gradient accumulation; DeepSpeed and FSDP shard parameters and are
        refused. Evaluation computes the loss only (``prediction_loss_only``): each group's token-mean loss.
        Subclasses may override :meth:`shard_loss_sum` (the summed loss of one shard), e.g. with a chunked LM head.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            from accelerate.utils import DistributedType

            if self.accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
                raise ValueError(
                    f"sequence-parallel training supports data parallelism (DDP), not "
                    f"{self.accelerator.distributed_type.value}: launch without a DeepSpeed / FSDP config"
                )
            if self.sequence_parallel_group_size() < 2:
                raise ValueError("SequenceParallelTrainer needs a sequence-parallel group of at least 2 ranks: "
                                 "call hf_dilated.distributed.enable_sequence_parallel(model, size) first")

        @staticmethod
        def sequence_parallel_group_size() -> int:
            return world_and_rank(get_sequence_parallel_group())[0]

        def shard_loss_sum(self, model, inputs: dict) -> torch.Tensor:
            """Summed token loss of one shard (``inputs`` from ``shard_batch``; ``model`` unwrapped from DDP)."""
            return loss_sum(model, inputs)

        def _denominator(self, inputs: dict, num_items_in_batch) -> torch.Tensor:
            """Labelled tokens the step's loss is divided by: Trainer's count over every process when it averages
            tokens across devices (its default), else this group's count times the number of groups."""
            group = get_sequence_parallel_group()
            groups = dist.get_world_size() // world_and_rank(group)[0]
            average = self.args.average_tokens_across_devices
            device = self.args.device
            if num_items_in_batch is None:
                count = label_count(inputs).to(device) * self.current_gradient_accumulation_steps
                return _all_reduce(count) if average else _all_reduce(count, group) * groups
            count = torch.as_tensor(num_items_in_batch, device=device)
            return count if average else _all_reduce(count, group) * groups

        def training_step(self, model, inputs, num_items_in_batch=None):
            group = get_sequence_parallel_group()
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = self._prepare_inputs(inputs)
            denominator = self._denominator(inputs, num_items_in_batch).float().clamp_min(1)
            module = self.accelerator.unwrap_model(model)
            total = torch.zeros((), device=self.args.device)
            with self.accelerator.no_sync(model):  # gradients are summed below, once per optimizer step
                for batch in gather_group_batches(inputs, group):
                    local = shard_batch(batch, group)
                    with self.compute_loss_context_manager():
                        loss = self.shard_loss_sum(module, local) / denominator
                    self.accelerator.backward(loss)
                    total += loss.detach().to(total.device)
            if self.accelerator.sync_gradients:
                _sum_gradients(self.model.parameters())
            # Trainer logs the mean over processes of what this returns; the processes' shares add up to the loss.
            return total * dist.get_world_size()

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            if not prediction_loss_only:
                raise ValueError("sequence-parallel evaluation computes the loss only: set prediction_loss_only=True")
            group = get_sequence_parallel_group()
            inputs = self._prepare_inputs(inputs)
            module = self.accelerator.unwrap_model(model)
            total = torch.zeros((), dtype=torch.float64, device=self.args.device)
            count = torch.zeros((), dtype=torch.float64, device=self.args.device)
            with torch.no_grad():
                for batch in gather_group_batches(inputs, group):
                    local = shard_batch(batch, group)
                    with self.compute_loss_context_manager():
                        total += self.shard_loss_sum(module, local).double().to(total.device)
                    count += label_count(local).to(count.device)
            both = torch.stack([total, count])
            dist.all_reduce(both, group=group)
            return (both[0] / both[1].clamp_min(1)).float(), None, None

    return SequenceParallelTrainer


def __getattr__(name: str):  # Trainer imports Transformers' training stack: only when asked for
    if name == "SequenceParallelTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
