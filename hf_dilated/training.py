"""What training needs from this package and nothing else: attention switched on for training, and the hook for
sequence-parallel training. The fine-tuning program (``scripts/finetune.py``) does the rest with Transformers'
``Trainer``, ``datasets`` and PEFT; its loss is :func:`hf_dilated.evaluation.causal_lm_nll`.
"""

from __future__ import annotations

from typing import Any, Sequence

from .config import DilatedAttentionConfig, trained_context
from .ops.block_sparse.config import BlockSparseConfig
from .patching import ROPE_CHOICES, is_patched, patch, patched_attention, unpatch

ATTENTIONS = ("dilated", "block_sparse", "sdpa")


def prepare_attention(
    model: Any,
    attn: str = "dilated",
    config: DilatedAttentionConfig | None = None,
    *,
    seq_len: int | None = None,
    layers: str | Sequence[int] = "all",
    backend: str | None = None,
    rope: str | None = None,
) -> DilatedAttentionConfig | BlockSparseConfig | None:
    """Switch ``model`` to ``attn`` for training at ``seq_len`` tokens; return the dilated config in effect.

    ``"dilated"`` patches the model (:func:`hf_dilated.patch`): ``config`` gives the branches, else the recipe's are
    extended until a segment covers ``seq_len``; ``rope`` (default ``"recipe"``) scales RoPE to ``seq_len`` past the
    trained context. ``"block_sparse"`` patches with ``attention="block_sparse"`` (``config``: a ``BlockSparseConfig``,
    a pattern name or ``None`` for the recipe's adaptive defaults at ``seq_len``). A model loaded already patched with
    the same attention keeps its stored patch unless ``config``, ``layers``, ``backend`` or ``rope`` say otherwise. ``"sdpa"`` is dense attention (a patched model is unpatched), the baseline. The KV
    cache is turned off: training has no use for it, and with one Transformers' dense masks ignore packing.
    """
    if attn not in ATTENTIONS:
        raise ValueError(f"attn must be one of {ATTENTIONS}, got {attn!r}")
    if rope is not None and rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES}, got {rope!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2):
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    model.config.use_cache = False
    if attn == "sdpa":
        if config is not None or layers != "all" or backend is not None or rope is not None:
            raise ValueError("config, layers, backend and rope are dilated-attention settings; attn='sdpa' takes none")
        if is_patched(model):
            unpatch(model)
        model.set_attn_implementation("sdpa")
        return None
    overrides = config is not None or layers != "all" or backend is not None or rope is not None
    kind = DilatedAttentionConfig if attn == "dilated" else BlockSparseConfig
    if is_patched(model):
        if not overrides and patched_attention(model) == attn:
            return kind.from_model_config(model.config)
        unpatch(model)
    trained = trained_context(model.config)
    longer = seq_len is not None and (trained is None or seq_len > trained)
    patch(model, config, attention=attn, layers=layers, backend=backend, context_length=seq_len if longer else None,
          rope=rope or "recipe")
    return kind.from_model_config(model.config)


def enable_sequence_parallel(model: Any, size: int) -> Any:
    """Shard every sequence over groups of ``size`` ranks (``"dilated_ring"`` attention, see
    :func:`hf_dilated.distributed.enable_sequence_parallel`); 1 is a no-op. Train with
    ``hf_dilated.distributed.trainer.SequenceParallelTrainer``."""
    from .distributed import enable_sequence_parallel as enable

    return enable(model, size)
