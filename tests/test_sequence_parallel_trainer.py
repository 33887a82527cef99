"""Sequence parallelism under Transformers' ``Trainer`` (hf_dilated.distributed.trainer), on CPU with gloo: one step
of two ranks, each sequence sharded over both, equals the single-process step on the same rows (loss and gradients).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from naive import rel_err
from test_distributed import LLAMA, _packed_positions, launch

# Layer 0 dilated with global tokens, layer 1 dense.
BRANCHES = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4], "layers": [0], "global_tokens": 2}


def _rows(gen) -> list[dict]:
    """Two packed rows of unequal document pieces (labels -100 at each piece's first token) and different lengths."""
    rows = []
    for n, starts in ((29, [0, 11, 19]), (23, [0, 6])):
        ids = torch.randint(0, LLAMA["vocab_size"], (n,), generator=gen)
        labels = ids.clone()
        labels[starts] = -100
        rows.append({"input_ids": ids, "labels": labels, "position_ids": _packed_positions(n, starts)})
    return rows


def _collate(rows):
    assert len(rows) == 1 or len({len(r["input_ids"]) for r in rows}) == 1, "rows of one batch must be equal"
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _model():
    from hf_dilated import assets
    from hf_dilated.training import prepare_attention

    model = assets.tiny_llama(seed=0, **LLAMA)
    prepare_attention(model, "dilated", _config())
    return model


def _config():
    from hf_dilated import DilatedAttentionConfig

    return DilatedAttentionConfig(**BRANCHES)


def _args(out, batch_size, accumulation):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, max_steps=1, learning_rate=1e-3,
                             max_grad_norm=0.0, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                             gradient_accumulation_steps=accumulation, dataloader_num_workers=0, seed=0,
                             disable_tqdm=True)


def _step(trainer_cls, model, rows, out, batch_size, accumulation):
    """Run one optimizer step; ``(training loss, {parameter: gradient before the update})``."""
    from transformers import TrainerCallback

    grads = {}

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = trainer_cls(model=model, args=_args(out, batch_size, accumulation), train_dataset=rows,
                          data_collator=_collate, callbacks=[Grads()])
    loss = trainer.train().training_loss
    trainer.accelerator.free_memory()
    return loss, {n.removeprefix("module."): g for n, g in grads.items()}


def _worker(rank, world, rows, out, accumulation):
    from accelerate.state import AcceleratorState, PartialState

    from hf_dilated.distributed import enable_sequence_parallel, get_sequence_parallel_group
    from hf_dilated.distributed.trainer import SequenceParallelTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(True)  # forked from a parent that may hold a single-process state
    PartialState._reset_state()
    model = enable_sequence_parallel(_model(), world)
    assert model.config._attn_implementation == "dilated_ring" and get_sequence_parallel_group() is not None
    return _step(SequenceParallelTrainer, model, rows, f"{out}/rank{rank}", 1, accumulation)


def test_trainer_step_with_sequence_parallelism_matches_single_process(rng, tmp_path):
    """Two ranks, one row each by Trainer's sampler and gradient accumulation over two micro-batches (the rows differ
    in length): every sequence is sharded over both ranks; the step equals a single process accumulating both rows."""
    from transformers import Trainer

    rows = _rows(rng) * 2  # 4 rows: 2 ranks x 2 micro-batches
    ranks = launch(_worker, 2, rows, str(tmp_path), 2, timeout=120)
    for status, value in ranks:
        assert status == "ok", value
    want_loss, want = _step(Trainer, _model(), rows, str(tmp_path / "single"), 1, 4)
    assert want and set(want) == set(ranks[0][1][1])
    for _, (loss, grads) in ranks:
        assert abs(loss - want_loss) < 1e-5 * abs(want_loss), (loss, want_loss)
        for name, g in want.items():
            assert rel_err(grads[name], g) < 1e-5, (name, rel_err(grads[name], g))


def test_sequence_parallel_refuses_what_it_cannot_run(tmp_path):
    """Without a launcher, with a size that does not divide the processes, and --attn sdpa: a ValueError naming it."""
    from hf_dilated.distributed import enable_sequence_parallel, set_sequence_parallel_group

    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        enable_sequence_parallel(_model(), 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        with pytest.raises(ValueError, match="must divide the number of processes"):
            enable_sequence_parallel(_model(), 2)
    finally:
        dist.destroy_process_group()
        set_sequence_parallel_group(None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import finetune

    with pytest.raises(ValueError, match="--sequence-parallel 2 needs --attn dilated"):
        finetune.parse_args(["--model", "tiny", "--attn", "sdpa", "--sequence-parallel", "2",
                             "--output-dir", str(tmp_path / "out")])
