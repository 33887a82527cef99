"""Next-token negative log-likelihood of a causal LM over long sequences, without an ``[N, vocab]`` logits tensor.

The decoder body runs once; the LM head and the cross-entropy run over ``chunk_size`` tokens at a time (each chunk
under activation checkpointing when gradients are on), so at 64K tokens SmolLM2 never holds its 12.9 GB of float32
logits. One implementation serves evaluation (perplexity of a long text, patched against dense) and fine-tuning
(the training loss): it applies ``final_logit_softcapping`` as the model does and refuses the logit scalings it does
not implement, so it always equals the model's own loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
_UNSUPPORTED_SCALINGS = ("logit_scale", "output_multiplier_scale")


def _causal_lm(model: Any) -> Any:
    """The ``*ForCausalLM`` under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def causal_lm_nll(model: Any, inputs: dict[str, Any], chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)``: the summed next-token NLL and the number of predicted tokens (float32 and differentiable with
    gradients on, float64 without).

    ``inputs`` are the model's keyword arguments with ``labels`` (``-100`` = not a target), as a causal-LM forward
    takes them: the target of token ``t`` is ``labels[t + 1]``, or ``shift_labels[t]`` when given (labels shifted
    before a sequence was sharded, as Transformers' causal-LM loss takes them). ``sum / count`` is the model's own
    loss; Trainer's ``sum / num_items_in_batch`` its loss under gradient accumulation.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    causal = _causal_lm(model)
    head = causal.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(causal).__name__} has no language-model head; the NLL needs a *ForCausalLM model")
    for attr in _UNSUPPORTED_SCALINGS:
        if getattr(causal.config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"the chunked NLL does not implement {attr} of {type(causal).__name__}")
    softcap = getattr(causal.config, "final_logit_softcapping", None)
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    body_inputs = {k: v for k, v in inputs.items()
                   if k not in ("labels", "shift_labels", "num_items_in_batch", "use_cache")}
    hidden = causal.base_model(**body_inputs, use_cache=False).last_hidden_state
    targets = (shifted if shifted is not None else F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]).to(hidden.device)

    def chunk_nll(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    grad = torch.is_grad_enabled()
    total = hidden.new_zeros((), dtype=torch.float32 if grad else torch.float64)  # float64: a 1M-token sum keeps digits
    for s in range(0, hidden.shape[1], chunk_size):
        h, y = hidden[:, s : s + chunk_size], targets[:, s : s + chunk_size]
        total = total + (checkpoint(chunk_nll, h, y, use_reentrant=False) if grad else chunk_nll(h, y).double())
    return total, (targets != IGNORE_INDEX).sum()


@torch.no_grad()
def sequence_nll(model: Any, input_ids: torch.Tensor, chunk_size: int = 4096) -> tuple[float, int]:
    """Summed next-token NLL (float64) and number of predicted tokens of one ``[1, N]`` sequence of a long text."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, N], got {tuple(input_ids.shape)}")
    total, count = causal_lm_nll(model, {"input_ids": input_ids, "labels": input_ids}, chunk_size)
    return float(total), int(count)
