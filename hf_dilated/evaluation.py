"""Next-token negative log-likelihood of a causal LM over long sequences, without an ``[N, vocab]`` logits tensor.

The decoder body runs once; the LM head and the cross-entropy run over ``chunk_size`` tokens at a time (each chunk
under activation checkpointing when gradients are on), so at 64K tokens SmolLM2 never holds its 12.9 GB of float32
logits. One implementation serves evaluation (perplexity of a long text, patched against dense) and fine-tuning
(the training loss): it applies ``final_logit_softcapping`` as the model does and refuses the logit scalings it does
not implement, so it always equals the model's own loss.

Beside it, the cost axis of the fidelity study (``scripts/fidelity_study.py``): the mean number of keys a query attends
under a dilated configuration, a block-sparse layout or dense / sliding-window attention, counted exactly.
"""

from __future__ import annotations

import math
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


# ---- attended keys per query: the cost axis of the fidelity study ----------------------------------------------------
def _count_congruent(lo: torch.Tensor, hi: torch.Tensor, residue: int, modulus: int) -> torch.Tensor:
    """How many integers ``x`` in ``[lo, hi]`` (elementwise; empty when ``hi < lo``) have ``x % modulus == residue``."""
    count = torch.div(hi - residue, modulus, rounding_mode="floor") - torch.div(lo - 1 - residue, modulus, rounding_mode="floor")
    return torch.where(hi >= lo, count, torch.zeros_like(count))


def dense_attended_keys(seq_len: int, window: int | None = None, causal: bool = True) -> float:
    """Mean keys per query of exact attention over ``seq_len`` tokens: ``(N + 1) / 2`` causal, ``N`` not; with a
    sliding ``window`` (Transformers' rule, the query counted: ``0 <= p - p' < W``, or ``|p - p'| < W``) fewer."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    p = torch.arange(seq_len, dtype=torch.int64)
    if causal:
        keys = p + 1 if window is None else torch.clamp(p + 1, max=window)
    else:
        keys = torch.full_like(p, seq_len) if window is None else (
            torch.clamp(p + window - 1, max=seq_len - 1) - torch.clamp(p - window + 1, min=0) + 1)
    return float(keys.sum()) / seq_len


def dilated_attended_keys(config: Any, seq_len: int, num_heads: int, num_layers: int | None = None,
                          causal: bool = True, device: Any = None) -> float:
    """Mean number of distinct keys a query attends in one sequence of ``seq_len`` tokens, over every query, query head
    and layer, exactly as SPEC.md defines the key sets (a key reached by several branches counts once).

    ``config`` is a :class:`~hf_dilated.config.DilatedAttentionConfig`: its branches, ``global_tokens`` and ``layers``
    (the other layers of ``num_layers`` are dense: a causal query at position ``p`` attends ``p + 1`` keys). Query head
    ``h`` uses offset ``h % r`` in each branch. Per query, the union of the branches' key sets is counted by
    inclusion-exclusion: branch ``(w, r)`` gives the positions ``= h (mod r)`` in the query's segment (up to ``p`` when
    causal), the global branch ``[0, g)``; an intersection is an interval and one congruence modulo the ``lcm`` of
    the rates (all residues are ``h``). Cost ``O(num_heads * 2^branches * seq_len)``, nothing ``N x N``; ``device``
    (e.g. a GPU) runs it there: at 64K tokens with 7 branches it is ~2,000 small vector operations.
    """
    import itertools

    for name, value in (("seq_len", seq_len), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0):
        raise ValueError(f"num_layers must be None or a positive int, got {num_layers!r}")
    branches = [(int(w), int(r)) for w, r in config.branches]
    g = int(getattr(config, "global_tokens", 0) or 0)
    n = seq_len
    p = torch.arange(n, dtype=torch.int64, device=device)
    h = torch.arange(num_heads, dtype=torch.int64, device=device)[:, None]  # [H, 1]: all heads at once
    last = p if causal else torch.full_like(p, n - 1)
    # Each branch as (lo, hi, rate) per query; the global branch is the interval [0, g - 1] at rate 1.
    spans = []
    for w, r in branches:
        start = torch.div(p, w, rounding_mode="floor") * w
        spans.append((start, torch.minimum(last, (start + w - 1).clamp_max(n - 1)), r))
    if g:
        spans.append((torch.zeros_like(p), torch.minimum(last, torch.full_like(p, g - 1)), 1))
    keys = torch.zeros(num_heads, n, dtype=torch.int64, device=device)
    for size in range(1, len(spans) + 1):
        sign = 1 if size % 2 else -1
        for subset in itertools.combinations(spans, size):
            lo, hi = subset[0][0], subset[0][1]
            for s_lo, s_hi, _ in subset[1:]:
                lo, hi = torch.maximum(lo, s_lo), torch.minimum(hi, s_hi)
            m = math.lcm(*(s[2] for s in subset))
            selected = (p % m) == (h % m)  # the query is in every branch of the subset: p = h mod each rate
            keys += sign * torch.where(selected, _count_congruent(lo, hi, h % m, m), 0)
    total = int(keys.sum())
    dilated_mean = total / (num_heads * n)
    dense_mean = (n + 1) / 2 if causal else float(n)
    if num_layers is None or config.layers is None:
        return dilated_mean
    converted = sum(1 for i in config.layers if i < num_layers)
    return (converted * dilated_mean + (num_layers - converted) * dense_mean) / num_layers


def layout_attended_keys(layout: Any, seq_len: int, causal: bool = True) -> float:
    """Mean number of keys a query attends under a block-sparse ``BlockLayout`` for one sequence of ``seq_len``
    tokens (queries at key columns ``0 .. seq_len - 1``), over queries and the layout's batch and heads: every key of
    an active tile, causal keys ``<= p`` in the diagonal tile."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    b, n = layout.block_size, layout.n_blocks
    if n != math.ceil(seq_len / b):
        raise ValueError(f"the layout has {n} blocks, but seq_len {seq_len} needs ceil({seq_len} / {b})")
    index = layout.kv_index.long().cpu()  # [L, H, n, A], -1 padded
    i = torch.arange(n).view(1, 1, n, 1)
    active = index >= 0
    key_len = (seq_len - index * b).clamp(max=b)  # keys in key block j (the last one may be short)
    q_len = (seq_len - torch.arange(n) * b).clamp(max=b).view(1, 1, n)  # queries in query block i
    if causal:
        before = (active & (index < i)).mul(key_len).sum(-1)  # whole earlier blocks, for every query of block i
        diag = (active & (index == i)).any(-1)  # within the diagonal tile, query t sees keys 0..t
        total = before * q_len + diag * q_len * (q_len + 1) // 2
    else:
        total = (active * key_len).sum(-1) * q_len
    return float(total.sum()) / (index.shape[0] * index.shape[1] * seq_len)


def block_sparse_attended_keys(config: Any, seq_len: int, num_heads: int, num_layers: int | None = None,
                               causal: bool = True) -> float:
    """Mean keys per query of a :class:`~hf_dilated.ops.block_sparse.BlockSparseConfig` (layers outside
    ``config.layers`` dense), exact for the fixed patterns. The ``"adaptive"`` pattern depends on the content: this
    gives its upper bound (with ``local_blocks >= 1``, every chosen block distinct: ``top_k + local_blocks +
    global_blocks`` blocks ending at the diagonal); :func:`layout_attended_keys` of the layouts a forward built gives
    the exact count."""
    if config.pattern == "adaptive":
        from .ops.block_sparse.patterns import local_blocks

        budget = config.top_k + config.local_blocks + config.global_blocks
        layout = local_blocks(math.ceil(seq_len / config.block_size), config.block_size, budget, causal=causal)
    else:
        layout = config.build(torch.empty(1, num_heads, seq_len, 0), torch.empty(1, 1, seq_len, 0), None, causal)
    keys = layout_attended_keys(layout, seq_len, causal)
    if num_layers is None or config.layers is None:
        return keys
    dense_mean = (seq_len + 1) / 2 if causal else float(seq_len)
    converted = sum(1 for i in config.layers if i < num_layers)
    return (converted * keys + (num_layers - converted) * dense_mean) / num_layers
