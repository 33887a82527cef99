"""Sequence parallelism for dilated attention over ``torch.distributed``.

- ``dilated_ring.py``: :func:`dilated_ring_attention`, the op (each rank holds a contiguous shard of the sequence).
- ``sharding.py``: :func:`~sharding.shard_batch` (input_ids, labels as ``shift_labels``, global ``position_ids``),
  :func:`~sharding.global_num_items`, :func:`~sharding.reduce_loss`, :func:`~sharding.all_reduce_gradients`.
- ``hf_dilated/integrations/dilated_ring.py`` registers the ``"dilated_ring"`` attention implementation.
- ``trainer.py``: under ``Trainer``: :func:`enable_sequence_parallel` (groups of ``P`` ranks, the model switched to
  ``"dilated_ring"``) and ``trainer.SequenceParallelTrainer`` (each step gathers the group's batches, shards them,
  reduces loss and gradients exactly); ``scripts/finetune.py --sequence-parallel P`` uses them.
- ``group.py``: which process group splits the sequence (and which splits heads, for Ulysses).
- ``collectives.py``: the differentiable all-to-all and the signature check; ``cost_model.py``: bytes, FLOPs, time.

A training step on ``P`` GPUs (``torchrun --nproc-per-node P train.py``, or ``accelerate launch`` with
``--num_processes P``), every rank of the group loading the *same* batch::

    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))   # a dead peer fails after this
    import hf_dilated                                      # registers "dilated_ring" with Transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dilated_ring")  # config.dilated_attention
    local = sharding.shard_batch(batch)
    out = model(**local, num_items_in_batch=sharding.global_num_items(local["shift_labels"]), use_cache=False)
    out.loss.backward()                                    # this shard's share of the mean loss
    sharding.all_reduce_gradients(model.parameters())      # sum the shards' parameter gradients
    log(sharding.reduce_loss(out.loss))                    # the whole sequence's loss

Under DDP / FSDP spanning the sequence-parallel ranks, skip ``all_reduce_gradients`` and backpropagate
``out.loss * P`` instead (they average gradients over the ranks; the shards' gradients must be summed). With
several model replicas, give each its own group (``dist.new_group``) and name it with
:func:`set_sequence_parallel_group`. Ranks that call with different shapes or settings raise ``ValueError`` at once;
a rank that dies makes the others fail when the process group's ``timeout`` expires (NCCL: with
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default, the watchdog aborts them).
"""

from .dilated_ring import dilated_ring_attention
from .trainer import enable_sequence_parallel, init_sequence_parallel
from .group import (
    get_head_parallel_group,
    get_sequence_parallel_group,
    head_offset,
    set_head_parallel_group,
    set_sequence_parallel_group,
)

__all__ = [
    "dilated_ring_attention",
    "enable_sequence_parallel",
    "init_sequence_parallel",
    "get_head_parallel_group",
    "get_sequence_parallel_group",
    "head_offset",
    "set_head_parallel_group",
    "set_sequence_parallel_group",
]
