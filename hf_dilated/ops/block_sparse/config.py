"""BlockSparseConfig: a named block pattern and its parameters, validated, storable in a model config.

A layer's layout is the union of the pattern's blocks with the local window (``local_blocks``) and the global / sink
blocks (``global_blocks``), the two that pretrained models lean on. Stored as a plain dict under
``config.block_sparse_attention`` so ``config.json`` carries it without remote code (like ``config.dilated_attention``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...config import BACKENDS
from ..layout import TokenLayout
from .layout import BlockLayout, check_block_size, union

CONFIG_KEY = "block_sparse_attention"
PATTERNS = ("local", "dilated", "hierarchical", "random", "adaptive", "dense")


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_list(name: str, values) -> list[int]:
    if isinstance(values, (int, str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    out = [_int(name, v, 1) for v in values]
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


@dataclass
class BlockSparseConfig:
    """Settings of block-sparse attention for one model.

    Args:
        pattern: one of ``"local"``, ``"dilated"``, ``"hierarchical"``, ``"random"``, ``"adaptive"``, ``"dense"``.
        block_size: tile size ``b`` (64 or 128 on GPU).
        local_blocks: sliding window in blocks (0: none), added to every pattern.
        global_blocks: the first key blocks every query reads (attention sink; 0: none), added to every pattern.
        top_k: ``"adaptive"``: key blocks chosen by content per query block.
        segment_blocks, dilation_rates: ``"dilated"``: LongNet branches in blocks (per-head offsets).
        windows, strides: ``"hierarchical"``: levels of (window, stride) in blocks.
        random_blocks, seed: ``"random"``: blocks drawn per query block, reproducibly.
        layers: decoder layers that use block-sparse attention (``None``: all); the others stay dense.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """

    pattern: str = "adaptive"
    block_size: int = 64
    local_blocks: int = 4
    global_blocks: int = 1
    top_k: int = 8
    segment_blocks: list[int] = field(default_factory=lambda: [8, 32])
    dilation_rates: list[int] = field(default_factory=lambda: [1, 4])
    windows: list[int] = field(default_factory=lambda: [4, 16, 64])
    strides: list[int] = field(default_factory=lambda: [1, 4, 16])
    random_blocks: int = 4
    seed: int = 0
    layers: list[int] | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "BlockSparseConfig":
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")
        check_block_size(self.block_size)
        _int("local_blocks", self.local_blocks, 0)
        _int("global_blocks", self.global_blocks, 0)
        _int("top_k", self.top_k, 1)
        _int("random_blocks", self.random_blocks, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        from ...config import validate_branches

        validate_branches(self.segment_blocks, self.dilation_rates)
        self.segment_blocks, self.dilation_rates = list(self.segment_blocks), list(self.dilation_rates)
        self.windows, self.strides = _int_list("windows", self.windows), _int_list("strides", self.strides)
        if len(self.windows) != len(self.strides):
            raise ValueError(f"windows and strides must have the same length, got {self.windows} and {self.strides}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__iter__"):
                raise ValueError(f"layers must be None or a list of non-negative layer indices, got {self.layers!r}")
            self.layers = sorted({_int("layers", i, 0) for i in self.layers})
        if self.pattern == "local" and self.local_blocks == 0:
            raise ValueError("local_blocks must be >= 1 for pattern='local'")
        return self

    def applies_to(self, layer_idx: int | None) -> bool:
        return self.layers is None or layer_idx is None or layer_idx in self.layers

    # ---- layouts ---------------------------------------------------------------------------------------------------
    def build(self, query: torch.Tensor, key: torch.Tensor, tokens: TokenLayout | None, is_causal: bool) -> BlockLayout:
        """The layout of one call (``query [B, Hq, Nq, D]``, ``key [B, Hk, Nk, D]``); fixed patterns are cached per
        (config, length, heads, device), the adaptive one is chosen from ``query`` and ``key``."""
        n = math.ceil(key.shape[2] / self.block_size)
        if self.pattern == "adaptive":
            from .adaptive import adaptive_blocks

            return adaptive_blocks(query, key, self.block_size, self.top_k, local_blocks=self.local_blocks,
                                   global_blocks=self.global_blocks, causal=is_causal, tokens=tokens)
        return _fixed_layout(self._key(), n, query.shape[1], bool(is_causal), str(query.device))

    def _key(self) -> tuple:
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in asdict(self).items()
                     if k not in ("layers", "backend"))

    # ---- cost ------------------------------------------------------------------------------------------------------
    def keys_per_query(self, seq_len: int, *, causal: bool = True, num_heads: int | None = None) -> float:
        """Mean keys scored per query on one sequence of ``seq_len`` tokens (see ``budget.py``): for ``"adaptive"``
        from the block counts (content picks which blocks, not how many), for fixed patterns from their layout
        (``num_heads``: heads of a per-head pattern, default the largest dilation rate, which covers every offset)."""
        from .budget import adaptive_keys_per_query, layout_keys_per_query

        if self.pattern == "adaptive":
            return adaptive_keys_per_query(seq_len, self.block_size, self.top_k, self.local_blocks,
                                           self.global_blocks, causal=causal)
        n = math.ceil(_int("seq_len", seq_len, 1) / self.block_size)
        heads = _int("num_heads", num_heads, 1) if num_heads is not None else max(self.dilation_rates)
        return layout_keys_per_query(_fixed_layout(self._key(), n, heads, bool(causal), "cpu"), seq_len, causal=causal)

    @classmethod
    def matching_budget(cls, dilated: Any, seq_len: int, *, causal: bool = True, block_size: int = 64,
                        local_blocks: int | None = None, global_blocks: int = 1, **settings: Any) -> "BlockSparseConfig":
        """The adaptive config that scores as many keys per query as dilated attention ``dilated`` (a
        ``DilatedAttentionConfig`` or its dict) at ``seq_len`` tokens: the same budget, chosen by content.

        The local window defaults to half the first (dense) segment, ``segment_lengths[0] / 2`` tokens (what a causal
        query of that branch sees on average), at least one block; one sink block; ``top_k`` is then the number of
        content-chosen blocks whose keys per query (:meth:`keys_per_query`) come closest to the dilated count
        (:func:`~hf_dilated.ops.block_sparse.budget.dilated_keys_per_query`, global tokens included), at least 1, so
        a window and sink already above the budget give ``top_k = 1``. ``layers`` and ``backend`` default to
        ``dilated``'s; other ``settings`` are passed to the config.

        Example: SmolLM2's default (``w = 2048, 4096, 8192``, ``r = 1, 2, 4``) attends to 1,408.5 keys per query at
        8192 tokens; ``matching_budget(dilated, 8192)`` gives ``block_size=64, local_blocks=16, global_blocks=1,
        top_k=8`` (1,418.5).
        """
        from ...config import DilatedAttentionConfig
        from .budget import dilated_keys_per_query

        if isinstance(dilated, dict):
            dilated = DilatedAttentionConfig.from_dict(dilated)
        if not isinstance(dilated, DilatedAttentionConfig):
            raise ValueError(f"dilated must be a DilatedAttentionConfig or its dict, got {type(dilated).__name__}")
        seq_len = _int("seq_len", seq_len, 1)
        b = check_block_size(block_size)
        if local_blocks is None:
            local_blocks = max(1, dilated.segment_lengths[0] // (2 * b))
        settings.setdefault("layers", dilated.layers)
        settings.setdefault("backend", dilated.backend)
        target = dilated_keys_per_query(dilated.segment_lengths, dilated.dilation_rates, seq_len, causal=causal,
                                        global_tokens=dilated.global_tokens)

        def make(k: int) -> "BlockSparseConfig":
            return cls(pattern="adaptive", block_size=b, local_blocks=local_blocks, global_blocks=global_blocks,
                       top_k=k, **settings)

        lo, hi = 1, max(1, math.ceil(seq_len / b))  # keys grow with top_k: the first top_k reaching the target
        while lo < hi:
            mid = (lo + hi) // 2
            if make(mid).keys_per_query(seq_len, causal=causal) >= target:
                hi = mid
            else:
                lo = mid + 1
        best = make(lo)
        if lo > 1:
            below = make(lo - 1)
            if target - below.keys_per_query(seq_len, causal=causal) < best.keys_per_query(seq_len, causal=causal) - target:
                best = below
        return best

    # ---- serialization ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BlockSparseConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a block-sparse config must be a dict, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown block-sparse config keys {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)

    @classmethod
    def from_model_config(cls, model_config: Any) -> "BlockSparseConfig":
        """The config under ``model_config.block_sparse_attention`` (checked against the model: ``layers`` within
        ``num_hidden_layers``), or the defaults."""
        stored = getattr(model_config, CONFIG_KEY, None)
        if isinstance(stored, cls):
            return stored.check_model(model_config)
        if stored is None:
            return cls()
        if not isinstance(stored, dict):
            raise ValueError(f"{CONFIG_KEY} must be a dict of BlockSparseConfig fields, got {type(stored).__name__}")
        return cls.from_dict(dict(stored)).check_model(model_config)

    def check_model(self, model_config: Any) -> "BlockSparseConfig":
        """Raise a ``ValueError`` naming ``layers`` when it names a layer the model does not have."""
        n_layers = getattr(model_config, "num_hidden_layers", None)
        if self.layers and isinstance(n_layers, int) and self.layers[-1] >= n_layers:
            raise ValueError(f"{CONFIG_KEY}.layers names layer {self.layers[-1]}, but the model has {n_layers} layers "
                             f"(indices 0..{n_layers - 1}); got layers={self.layers}")
        return self

    def save_to(self, model_config: Any) -> None:
        """Store this config in ``model_config`` (a JSON-friendly dict under ``block_sparse_attention``), after
        checking it against the model."""
        self.validate().check_model(model_config)
        setattr(model_config, CONFIG_KEY, self.to_dict())


@functools.lru_cache(maxsize=16)
def _fixed_layout(key: tuple, n: int, num_heads: int, causal: bool, device: str) -> BlockLayout:
    from . import patterns as P

    c = dict(key)
    b = c["block_size"]
    parts = []
    name = c["pattern"]
    if name == "dense":
        return P.dense_blocks(n, b, causal=causal, device=device)
    if name == "dilated":
        heads = num_heads if any(r > 1 for r in c["dilation_rates"]) else None
        parts.append(P.dilated_blocks(n, b, c["segment_blocks"], c["dilation_rates"], causal=causal,
                                      num_heads=heads, device=device))
    elif name == "hierarchical":
        parts.append(P.hierarchical_blocks(n, b, c["windows"], c["strides"], causal=causal, device=device))
    elif name == "random":
        parts.append(P.random_blocks(n, b, c["random_blocks"], seed=c["seed"], causal=causal, device=device))
    if c["local_blocks"]:
        parts.append(P.local_blocks(n, b, c["local_blocks"], causal=causal, device=device))
    if c["global_blocks"]:
        parts.append(P.global_blocks(n, b, c["global_blocks"], causal=causal, device=device))
    if not parts:
        raise ValueError(f"pattern {name!r} with local_blocks=0 and global_blocks=0 selects no block")
    return union(*parts)
