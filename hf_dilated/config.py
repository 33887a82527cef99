"""DilatedAttentionConfig: the branches of LongNet dilated attention, validated, and their place in a model config.

A configuration is a list of branches ``(w_i, r_i)`` (segment length, dilation rate), see ``SPEC.md``.
It is stored in a Transformers model config under one key, ``config.dilated_attention`` (a plain dict), so that
``save_pretrained`` / ``from_pretrained`` carry it in ``config.json`` with no remote code.
"""

from __future__ import annotations

import copy
import weakref
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

CONFIG_KEY = "dilated_attention"
BACKENDS = ("auto", "torch", "triton")
DEFAULT_MIN_SEGMENT = 2048
# A layer left dense is one branch (DENSE_SEGMENT, 1): a segment longer than any position (SPEC.md), within int32.
DENSE_SEGMENT = 2**30
# id(model config) -> (weak reference to it, the stored value it was parsed from, the parsed config); see ``of``.
_PARSED: dict[int, tuple[Any, Any, Any]] = {}


def _check_int_list(name: str, values: Any) -> list[int]:
    if isinstance(values, (int, str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a list of positive integers, got {list(values)!r}")
        out.append(int(v))
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


def validate_branches(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Check a branch list against SPEC.md and return it as ``((w, r), ...)``; raise ``ValueError`` naming the fault.
    Lists and tuples that passed are remembered with their elements' types (every attention call of a model passes
    the same ones: the checks are host time a small problem waits on)."""
    memo = None
    if type(segment_lengths) in (list, tuple) and type(dilation_rates) in (list, tuple):
        memo = (tuple(segment_lengths), tuple(map(type, segment_lengths)), tuple(dilation_rates),
                tuple(map(type, dilation_rates)))
        try:
            hit = _VALIDATED.get(memo)
        except TypeError:  # an unhashable element: the checks below name it
            hit = memo = None
        if hit is not None:
            return hit
    branches = _validated(segment_lengths, dilation_rates)
    if memo is not None:
        if len(_VALIDATED) >= 1024:
            _VALIDATED.clear()
        _VALIDATED[memo] = branches
    return branches


_VALIDATED: dict = {}


def _validated(segment_lengths, dilation_rates) -> tuple[tuple[int, int], ...]:
    ws = _check_int_list("segment_lengths", segment_lengths)
    rs = _check_int_list("dilation_rates", dilation_rates)
    if len(ws) != len(rs):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got {len(ws)} and {len(rs)}"
        )
    if any(b < a for a, b in zip(ws, ws[1:])):
        raise ValueError(f"segment_lengths must be sorted in increasing order, got {ws}")
    for w, r in zip(ws, rs):
        if w % r:
            raise ValueError(f"each segment length must be a multiple of its dilation rate; got w={w}, r={r}")
    if 1 not in rs:
        raise ValueError(f"dilation_rates must contain at least one branch with rate 1 (got {rs}) so every query attends")
    return tuple(zip(ws, rs))


def default_branches(context_length: int, target: int | None = None, *, max_first_segment: int = DEFAULT_MIN_SEGMENT,
                     first_segment_divisor: int = 4, undilated_branches: int = 1) -> tuple[list[int], list[int]]:
    """LongNet's geometric branches for a model trained on ``context_length`` tokens: the one default rule, used by
    ``from_pretrained(..., attn_implementation="dilated")`` without a stored config and by the patch recipes.

    The first branch is local and dense: ``w_0`` is the power of two at most ``context_length / first_segment_divisor``,
    capped at ``max_first_segment``; ``r_0 = 1``. Each further branch doubles both (``w_i = 2^i w_0``, ``r_i = 2^i``),
    so every branch costs the same (``w_i / r_i`` keys per query), until a segment covers
    ``max(target, context_length)``. ``undilated_branches = u`` keeps ``r = 1`` on the first ``u`` branches (``w``
    still doubles), then ``r`` doubles: ``u = 2`` gives ``r = 1, 1, 2, 4, ...``, which keeps more of a pretrained
    model's local attention (benchmarks/FIDELITY.md). A model trained on 8192 tokens gets ``w = 2048, 4096, 8192``, ``r = 1, 2, 4``;
    one trained on 32768 gets LongNet's list up to 32768. The branches always reach the trained context, so a short
    model or target never collapses them into one dense segment.
    """
    for name, value in (("context_length", context_length), ("max_first_segment", max_first_segment),
                        ("first_segment_divisor", first_segment_divisor), ("undilated_branches", undilated_branches)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target <= 0):
        raise ValueError(f"target must be None or a positive int, got {target!r}")
    target = max(target or context_length, context_length)
    w = min(max_first_segment, 1 << int(math.log2(max(context_length // first_segment_divisor, 1))))
    ws, rs = [w], [1]
    while ws[-1] < target:
        ws.append(ws[-1] * 2)
        rs.append(1 if len(rs) < undilated_branches else rs[-1] * 2)
    return ws, rs


@dataclass
class DilatedAttentionConfig:
    """Settings of dilated attention for one model.

    Args:
        segment_lengths: ``w_i``, increasing.
        dilation_rates: ``r_i``, with ``w_i % r_i == 0`` and at least one ``r_i == 1``.
        layers: indices of the decoder layers that use dilated attention; ``None`` means all. The other layers keep
            dense attention (computed exactly, with the same padding and packing rules).
        backend: ``"auto"`` (Triton on CUDA when available, else the PyTorch reference), ``"torch"`` or ``"triton"``.
        global_tokens: ``g``: every query of a dilated layer also attends to the first ``g`` positions of its
            sequence (SPEC.md's global branch); 0 adds nothing.
    """

    segment_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384, 32768])
    dilation_rates: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    layers: list[int] | None = None
    backend: str = "auto"
    global_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "DilatedAttentionConfig":
        branches = validate_branches(self.segment_lengths, self.dilation_rates)
        self.segment_lengths = [w for w, _ in branches]
        self.dilation_rates = [r for _, r in branches]
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
                raise ValueError(f"layers must be None or a list of non-negative layer indices, got {self.layers!r}")
            layers = list(self.layers)
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"layers must be None or a list of non-negative layer indices, got {layers!r}")
            self.layers = sorted(set(layers))
        if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int) or self.global_tokens < 0:
            raise ValueError(f"global_tokens must be a non-negative int, got {self.global_tokens!r}")
        return self

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.segment_lengths, self.dilation_rates))

    def applies_to(self, layer_idx: int | None) -> bool:
        """Whether the layer with this index uses dilated attention."""
        return self.layers is None or layer_idx is None or layer_idx in self.layers

    # ---- serialization -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DilatedAttentionConfig":
        """Parse the stored form (``config.json``'s ``dilated_attention``): a dict that names at least
        ``segment_lengths`` and ``dilation_rates``; ``ValueError`` naming the field otherwise."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{CONFIG_KEY} must be a dict with segment_lengths and dilation_rates, got {type(data).__name__} {data!r}"
            )
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown dilated-attention config keys {sorted(unknown)} in {CONFIG_KEY}; allowed: {sorted(known)}")
        missing = [k for k in ("segment_lengths", "dilation_rates") if k not in data]
        if missing:
            raise ValueError(f"{CONFIG_KEY} must give {' and '.join(missing)} (no silent defaults), got {data!r}")
        return cls(**data)

    @classmethod
    def for_context(cls, context_length: int, **kwargs: Any) -> "DilatedAttentionConfig":
        """Default branches for a model trained on ``context_length`` tokens (see :func:`default_branches`)."""
        ws, rs = default_branches(context_length)
        return cls(segment_lengths=ws, dilation_rates=rs, **kwargs)

    # ---- place in a Transformers config --------------------------------------------------------------------------
    @classmethod
    def from_model_config(cls, model_config: Any) -> "DilatedAttentionConfig":
        """The config stored under ``model_config.dilated_attention``, or defaults derived from the model.

        A stored config is validated against the model too (``layers`` within ``num_hidden_layers``).
        Defaults come from the model's trained context, ``max_position_embeddings`` (or ``n_positions``,
        ``max_sequence_length``), else LongNet's list up to 32768.
        """
        stored = getattr(model_config, CONFIG_KEY, None)
        if stored is None:
            ctx = trained_context(model_config)
            return cls.for_context(ctx) if ctx else cls()
        parsed = stored if isinstance(stored, cls) else cls.from_dict(stored)
        return parsed.check_model(model_config)

    def check_model(self, model_config: Any) -> "DilatedAttentionConfig":
        """Raise a ``ValueError`` naming ``layers`` when it names a layer the model does not have."""
        n_layers = getattr(model_config, "num_hidden_layers", None)
        if self.layers and isinstance(n_layers, int) and self.layers[-1] >= n_layers:
            raise ValueError(
                f"{CONFIG_KEY}.layers names layer {self.layers[-1]}, but the model has {n_layers} layers "
                f"(indices 0..{n_layers - 1}); got layers={self.layers}"
            )
        return self

    @classmethod
    def of(cls, model_config: Any) -> "DilatedAttentionConfig":
        """:meth:`from_model_config`, parsed once per model config and reused until the stored value changes.

        The attention function runs per layer per call; parsing and validating there each time would repeat the
        same work dozens of times per forward. The cache lives beside the config (never in it, so nothing extra is
        saved to ``config.json``) and is dropped with it.
        """
        if torch_compiling():  # traced once; the compiled graph holds the result, nothing to cache
            return cls.from_model_config(model_config)
        stored = getattr(model_config, CONFIG_KEY, None)
        hit = _PARSED.get(id(model_config))
        if hit is not None and hit[0]() is model_config and hit[1] == stored:
            return hit[2]
        parsed = cls.from_model_config(model_config)
        try:
            ref = weakref.ref(model_config, lambda _, key=id(model_config): _PARSED.pop(key, None))
        except TypeError:  # objects without weak references are parsed each time
            return parsed
        _PARSED[id(model_config)] = (ref, copy.deepcopy(stored), parsed)
        return parsed

    def save_to(self, model_config: Any) -> None:
        """Store this config in ``model_config`` (as a JSON-friendly dict under ``dilated_attention``), after checking
        it against the model (``layers`` within ``num_hidden_layers``)."""
        self.validate().check_model(model_config)
        setattr(model_config, CONFIG_KEY, self.to_dict())


def torch_compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def trained_context(model_config: Any) -> int | None:
    """The context length a model was trained on, as its config says, or ``None``."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
