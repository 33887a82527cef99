"""Patch a loaded Transformers model to use dilated or block-sparse attention, and undo it.

``patch(model)`` switches a model's attention implementation to ``"dilated"`` (or, with
``attention="block_sparse"``, to ``"block_sparse"``; both registered by ``import hf_dilated``), writes the attention
config (:class:`~hf_dilated.config.DilatedAttentionConfig` or
:class:`~hf_dilated.ops.block_sparse.BlockSparseConfig`) into ``model.config`` and, when asked for a context longer
than the trained one, sets the RoPE scaling its recipe names. Recipes are YAML files in ``hf_dilated/patches`` (the
top-level ``patches/`` directory of the repository), one per architecture family; each gives the dilated branches
and the block-sparse defaults.

What a patched model carries in its config (all plain JSON in ``config.json``, no remote code):

- ``dilated_attention`` or ``block_sparse_attention``: the branches or block pattern and the converted layers (read
  by the attention function);
- ``attn_implementation = "dilated"`` (or ``"block_sparse"``): Transformers' own config loader turns this key into
  the attention implementation, so ``from_pretrained(path)`` after ``import hf_dilated`` reloads the model patched;
- ``dilated_attention_patch``: the patch record (for either attention: the key keeps its first name so that every
  patched checkpoint is found the same way): attention, recipe, target context and the base settings (attention
  implementation, RoPE, ``max_position_embeddings``) that :func:`unpatch` restores.

Without ``hf_dilated`` installed, ``from_pretrained(path)`` raises Transformers' own
``ValueError: Specified `attn_implementation="dilated"` is not supported ...``; pass ``attn_implementation="sdpa"``
to load the weights as a dense model.
"""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Sequence

import torch
import yaml

from .config import CONFIG_KEY, DilatedAttentionConfig, default_branches, trained_context
from .ops.block_sparse.config import CONFIG_KEY as BLOCK_SPARSE_KEY
from .ops.block_sparse.config import PATTERNS, BlockSparseConfig

PATCH_KEY = "dilated_attention_patch"
ATTN_KEY = "attn_implementation"
ROPE_TYPES = ("linear", "dynamic", "yarn")
ROPE_CHOICES = ("recipe", "none") + ROPE_TYPES
LAYER_POLICIES = ("keep", "refuse")
ATTENTIONS = ("dilated", "block_sparse")
CONFIG_KEYS = {"dilated": CONFIG_KEY, "block_sparse": BLOCK_SPARSE_KEY}
BLOCK_SPARSE_PATTERNS = PATTERNS
# BlockSparseConfig fields a recipe may set (layers come from the recipe's layer choice, backend from the caller).
RECIPE_BLOCK_SPARSE_FIELDS = tuple(f for f in BlockSparseConfig.__dataclass_fields__ if f not in ("layers", "backend"))
_STATE_ATTR = "_hf_dilated_patch_state"
_MISSING = object()



def shipped_directory(name: str):
    """``patches/`` or ``model_cards/``: installed as ``hf_dilated.<name>``, or beside the package in a source checkout
    run without installing (``PYTHONPATH=.``)."""
    try:
        return importlib.resources.files(f"hf_dilated.{name}")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / name


def _attention_name(attention: str = "dilated") -> str:
    """The registered implementation name of ``attention`` (registering it, in case Transformers was reset)."""
    if attention == "block_sparse":
        from .integrations import block_sparse as integration
    else:
        from .integrations import transformers as integration
    integration.register()
    return integration.ATTENTION_NAME


# ---- recipes ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """One architecture family's patch settings, read from ``patches/<name>.yaml``.

    Attributes:
        name: the recipe's name (its file name).
        model_types: the ``config.model_type`` values it covers.
        causal: whether the family's self-attention is causal (decoders) or bidirectional (encoders).
        convert: which layers to convert by default: ``"all"`` or ``"full_attention"`` (layers whose
            ``config.layer_types`` entry is ``"full_attention"``; the others keep exact attention).
        max_first_segment, first_segment_divisor: the first (dense, ``r = 1``) branch is
            ``w_0 = min(max_first_segment, 2^floor(log2(trained_context / first_segment_divisor)))``;
            each further branch doubles ``w`` and ``r`` until a segment covers the target context.
        undilated_branches: how many of the first branches keep ``r = 1`` (``config.default_branches``).
        global_tokens: the default ``global_tokens`` (attention sinks) of a patched model.
        context_offset: subtracted from ``max_position_embeddings`` to get the trained context (RoBERTa: 2).
        sliding_window: ``"keep"`` (sliding-window layers stay out of the conversion and keep exact attention) or
            ``"refuse"`` (patching a model with sliding-window layers raises ``ValueError``).
        positions: ``"rope"`` or ``"absolute"`` (learned position embeddings: the context cannot grow).
        rope_type: RoPE scaling applied for a context past the trained one: ``"linear"``, ``"dynamic"``, ``"yarn"``
            or ``None``.
        rope_layer_types: for nested ``rope_parameters`` (one entry per layer type), the entries to scale.
        fidelity: what the recipe's dilated defaults measured without fine-tuning (one sentence, with its source),
            quoted in the model card.
        block_sparse_fidelity: the same for ``attention="block_sparse"`` with the recipe's block-sparse defaults.
        finetuned_fidelity: what a short fine-tune of the patched model measured against the dense model fine-tuned
            the same way (``scripts/finetune_recipe.py``), quoted in the model card beside the zero-shot number.
        block_sparse_finetuned_fidelity: the same for ``attention="block_sparse"``
            (``finetune_recipe.py --sparse-attention block_sparse``).
        block_sparse: defaults of ``attention="block_sparse"`` (``BlockSparseConfig`` fields but ``layers`` and
            ``backend``); see :meth:`block_sparse_config` for what is derived when left out.
    """

    name: str
    model_types: tuple[str, ...]
    description: str = ""
    causal: bool = True
    convert: str = "all"
    max_first_segment: int = 2048
    first_segment_divisor: int = 4
    undilated_branches: int = 1
    global_tokens: int = 0
    context_offset: int = 0
    sliding_window: str = "refuse"
    positions: str = "rope"
    rope_type: str | None = "yarn"
    rope_layer_types: tuple[str, ...] = ("full_attention",)
    block_sparse: dict = field(default_factory=dict)
    fidelity: str = ""
    block_sparse_fidelity: str = ""
    finetuned_fidelity: str = ""
    block_sparse_finetuned_fidelity: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError(f"recipe {self.name!r}: model_types must not be empty")
        if self.convert not in ("all", "full_attention"):
            raise ValueError(f"recipe {self.name!r}: convert must be 'all' or 'full_attention', got {self.convert!r}")
        if self.sliding_window not in LAYER_POLICIES:
            raise ValueError(
                f"recipe {self.name!r}: sliding_window must be one of {LAYER_POLICIES}, got {self.sliding_window!r}"
            )
        if self.positions not in ("rope", "absolute"):
            raise ValueError(f"recipe {self.name!r}: positions must be 'rope' or 'absolute', got {self.positions!r}")
        if self.rope_type is not None and self.rope_type not in ROPE_TYPES:
            raise ValueError(f"recipe {self.name!r}: rope.type must be one of {ROPE_TYPES} or null, got {self.rope_type!r}")
        if self.positions == "absolute" and self.rope_type is not None:
            raise ValueError(f"recipe {self.name!r}: absolute positions take no rope.type")
        for key in ("max_first_segment", "first_segment_divisor", "undilated_branches"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"recipe {self.name!r}: {key} must be a positive integer, got {value!r}")
        if isinstance(self.global_tokens, bool) or not isinstance(self.global_tokens, int) or self.global_tokens < 0:
            raise ValueError(f"recipe {self.name!r}: global_tokens must be an integer >= 0, got {self.global_tokens!r}")
        for key in ("fidelity", "block_sparse_fidelity", "finetuned_fidelity", "block_sparse_finetuned_fidelity"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"recipe {self.name!r}: {key} must be a string, got {getattr(self, key)!r}")
        if not isinstance(self.block_sparse, dict):
            raise ValueError(f"recipe {self.name!r}: block_sparse must be a mapping, got {self.block_sparse!r}")
        unknown = sorted(set(self.block_sparse) - set(RECIPE_BLOCK_SPARSE_FIELDS))
        if unknown:
            raise ValueError(f"recipe {self.name!r}: unknown block_sparse keys {unknown}; allowed: "
                             f"{list(RECIPE_BLOCK_SPARSE_FIELDS)}")
        try:
            BlockSparseConfig(**self.block_sparse)
        except ValueError as err:
            raise ValueError(f"recipe {self.name!r}: block_sparse: {err}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        data = dict(data)
        branches = data.pop("branches", {}) or {}
        rope = data.pop("rope", {}) or {}
        kwargs = {
            "name": data.pop("name"),
            "model_types": tuple(data.pop("model_types", ())),
            "max_first_segment": branches.pop("max_first_segment", 2048),
            "first_segment_divisor": branches.pop("first_segment_divisor", 4),
            "undilated_branches": branches.pop("undilated_branches", 1),
            "rope_type": rope.pop("type", None),
            "rope_layer_types": tuple(rope.pop("layer_types", None) or ("full_attention",)),
            "block_sparse": dict(data.pop("block_sparse", None) or {}),
        }
        if branches or rope:
            raise ValueError(f"recipe {kwargs['name']!r}: unknown keys {sorted(branches) + sorted(rope)}")
        known = set(cls.__dataclass_fields__) - set(kwargs)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"recipe {kwargs['name']!r}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**kwargs, **data)

    def trained_context(self, model_config: Any) -> int | None:
        ctx = trained_context(model_config)
        return None if ctx is None else ctx - self.context_offset

    def branches(self, trained: int, target: int | None = None) -> tuple[list[int], list[int]]:
        """Default branches for a model trained on ``trained`` tokens, covering ``max(target, trained)``.

        The branches always reach the trained context: a shorter target does not shrink them to one dense segment
        (which would make "dilated" silently exact dense attention at short lengths).
        """
        return default_branches(max(trained, 1), target, max_first_segment=self.max_first_segment,
                                first_segment_divisor=self.first_segment_divisor,
                                undilated_branches=self.undilated_branches)

    def block_sparse_config(self, trained: int, target: int | None = None, *, dilated: Any = None,
                            **settings: Any) -> BlockSparseConfig:
        """Block-sparse settings for a model trained on ``trained`` tokens, read at ``max(target, trained)``:
        ``settings`` (any ``BlockSparseConfig`` field) over the recipe's ``block_sparse`` entries, the rest derived
        from the dilated default :meth:`branches`, or from ``dilated`` (a ``DilatedAttentionConfig``) when given
        (same budget, same reach):

        - ``local_blocks``: half the first dilated segment (``w_0 / 2`` tokens), at least one block;
        - ``"adaptive"`` (the default pattern): ``top_k`` such that a query attends to as many keys as under the
          dilated default at the context (:meth:`BlockSparseConfig.matching_budget`);
        - ``"dilated"``: the dilated default's branches in blocks (``segment_blocks = w_i / block_size``).
        """
        context = max(trained, target or trained)
        ws, rs = (self.branches(trained, target) if dilated is None
                  else (list(dilated.segment_lengths), list(dilated.dilation_rates)))
        merged = {**self.block_sparse, **settings}
        merged.setdefault("pattern", "adaptive")
        b = merged.setdefault("block_size", BlockSparseConfig.block_size)
        if isinstance(b, int) and not isinstance(b, bool) and b > 0:
            merged.setdefault("local_blocks", max(1, ws[0] // (2 * b)))
            if merged["pattern"] == "dilated" and "segment_blocks" not in merged:
                merged["segment_blocks"] = [max(1, w // b) for w in ws]
                merged.setdefault("dilation_rates", rs)
        if merged["pattern"] == "adaptive" and "top_k" not in merged:
            if dilated is None:
                dilated = DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, global_tokens=self.global_tokens)
            else:  # its branches set the budget; layers and backend come from the caller
                dilated = DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs,
                                                 global_tokens=dilated.global_tokens)
            rest = {k: v for k, v in merged.items() if k not in ("pattern", "top_k")}
            return BlockSparseConfig.matching_budget(dilated, context, causal=self.causal, **rest)
        return BlockSparseConfig(**merged)


DEFAULT_RECIPE = Recipe(
    name="default",
    model_types=("*",),
    description="Any model whose attention uses Transformers' generic AttentionInterface dispatch.",
)


@lru_cache(maxsize=1)
def _load_recipes() -> dict[str, Recipe]:
    recipes = {}
    root = shipped_directory("patches")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            data = yaml.safe_load(entry.read_text(encoding="utf-8"))
            recipe = Recipe.from_dict(data)
            if recipe.name != entry.name[: -len(".yaml")]:
                raise ValueError(f"recipe file {entry.name} declares name {recipe.name!r}; they must match")
            recipes[recipe.name] = recipe
    return recipes


def list_recipes() -> list[str]:
    """Names of the shipped recipes."""
    return sorted(_load_recipes())


def load_recipe(name: str) -> Recipe:
    """The shipped recipe called ``name``; ``ValueError`` listing the names when there is none."""
    recipes = _load_recipes()
    if name not in recipes:
        raise ValueError(f"recipe must be 'auto' or one of {sorted(recipes)}, got {name!r}")
    return recipes[name]


def supported_model_types() -> list[str]:
    return sorted({t for r in _load_recipes().values() for t in r.model_types})


def recipe_for(model: Any) -> Recipe:
    """The recipe covering ``model.config.model_type``; the defaults for other generic-dispatch models.

    Raises ``ValueError`` listing the supported model types when the model has no recipe and its attention does not
    go through Transformers' ``AttentionInterface``.
    """
    model_type = getattr(model.config, "model_type", None)
    for recipe in _load_recipes().values():
        if model_type in recipe.model_types:
            return recipe
    if _uses_generic_dispatch(model):
        return DEFAULT_RECIPE
    raise ValueError(
        f"no patch recipe for model_type {model_type!r} ({type(model).__name__}), and its attention does not use "
        f"Transformers' generic attention dispatch; supported model types: {supported_model_types()}"
    )


def _uses_generic_dispatch(model: Any) -> bool:
    from .integrations.transformers import supports_dilated_attention

    return supports_dilated_attention(model)


# ---- model inspection ------------------------------------------------------------------------------------------------
def _num_layers(config: Any) -> int:
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell how many layers {type(config).__name__} has (no num_hidden_layers)")


def sliding_window_layers(config: Any) -> list[int]:
    """Indices of the layers that use sliding-window (local) attention, as the config declares them."""
    n = _num_layers(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [i for i, t in enumerate(layer_types[:n]) if t == "sliding_attention"]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return list(range(n))
    return []


def _has_sinks(model: Any) -> bool:
    return any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters())


def _check_is_model(model: Any) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"model must be a Transformers PreTrainedModel (e.g. from AutoModelForCausalLM.from_pretrained), got "
            f"{type(model).__name__}; for a plain module use hf_dilated.DilatedAttention or dilated_attention()"
        )


def _check_heads(config: Any) -> None:
    """Zero heads or an empty head dimension are refused by name (they would divide by zero deep in a forward)."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0):
        raise ValueError(f"config.num_attention_heads must be a positive integer, got {heads!r}")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or (heads and heads % kv)):
        raise ValueError(
            f"config.num_key_value_heads must be a positive divisor of num_attention_heads ({heads}), got {kv!r}"
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and heads and isinstance(getattr(config, "hidden_size", None), int):
        head_dim = config.hidden_size // heads
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0):
        raise ValueError(f"the head dimension (config.head_dim or hidden_size / num_attention_heads) must be a "
                         f"positive integer, got {head_dim!r}")


def _check_model(model: Any, recipe: Recipe, attention: str = "dilated") -> None:
    _check_is_model(model)
    _check_heads(model.config)
    if getattr(model.config, "sub_configs", None) and any(
        getattr(model.config, key, None) is not None for key in model.config.sub_configs
    ):
        raise ValueError(
            f"{type(model).__name__} is a composite model ({sorted(model.config.sub_configs)}); patch its language "
            "model instead (e.g. model.language_model or the *ForCausalLM text-only class)"
        )
    if not _uses_generic_dispatch(model):
        raise ValueError(
            f"{type(model).__name__} does not use Transformers' generic attention dispatch (AttentionInterface); "
            f"supported model types: {supported_model_types()}"
        )
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{type(model).__name__} uses attention logit softcapping (attn_logit_softcapping="
            f"{model.config.attn_logit_softcapping}), which {attention} attention does not compute; recipe "
            f"{recipe.name!r} refuses it"
        )
    if _has_sinks(model):
        raise ValueError(f"{type(model).__name__} uses attention sinks, which {attention} attention does not compute")
    sliding = sliding_window_layers(model.config)
    if sliding and recipe.sliding_window == "refuse":
        raise ValueError(
            f"{type(model).__name__} has sliding-window attention on layers {sliding} (sliding_window="
            f"{getattr(model.config, 'sliding_window', None)}); recipe {recipe.name!r} refuses sliding-window layers. "
            "If the checkpoint was trained with full attention, set model.config.sliding_window = None first"
        )


def _resolve_layers(model_config: Any, recipe: Recipe, layers: Any, config_layers: list[int] | None) -> list[int]:
    n = _num_layers(model_config)
    sliding = set(sliding_window_layers(model_config))
    if recipe.convert == "full_attention" or recipe.sliding_window == "keep":
        allowed = [i for i in range(n) if i not in sliding]
    else:
        allowed = list(range(n))
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a list of layer indices in [0, {n}), got {layers!r}")
        chosen = config_layers if config_layers is not None else allowed
    else:
        if isinstance(layers, (bytes, int)) or not isinstance(layers, Sequence):
            raise ValueError(f"layers must be 'all' or a list of layer indices in [0, {n}), got {layers!r}")
        chosen = list(layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in chosen):
            raise ValueError(f"layers must be 'all' or a list of layer indices in [0, {n}), got {chosen!r}")
        if config_layers is not None and sorted(set(config_layers)) != sorted(set(chosen)):
            raise ValueError(f"layers={chosen!r} contradicts config.layers={config_layers!r}; give one of them")
    bad = sorted(set(chosen) & sliding)
    if bad:
        raise ValueError(
            f"layers {bad} use sliding-window attention and stay exact under recipe {recipe.name!r}; "
            f"choose among {allowed}"
        )
    if any(i >= n for i in chosen):
        raise ValueError(f"layers must be indices in [0, {n}), got {sorted(chosen)}")
    return sorted(set(chosen))


# ---- RoPE --------------------------------------------------------------------------------------------------------
def _rope_entries(rope_parameters: dict, recipe: Recipe) -> list[dict]:
    """The (mutable) rope-parameter dicts to scale: the dict itself, or the recipe's layer-type entries if nested."""
    if "rope_type" in rope_parameters or "rope_theta" in rope_parameters:
        return [rope_parameters]
    return [rope_parameters[key] for key in recipe.rope_layer_types if isinstance(rope_parameters.get(key), dict)]


def rope_scaling_for(model_config: Any, recipe: Recipe, context_length: int, rope: str = "recipe") -> dict | None:
    """The ``rope_parameters`` a model should get to read ``context_length`` tokens, or ``None`` for no change.

    Transformers 5.x names this field ``config.rope_parameters`` (``rope_scaling`` is its legacy alias): a dict with
    ``rope_type`` (``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ...), ``rope_theta`` and, for scaled types,
    ``factor`` (and ``original_max_position_embeddings`` for YaRN). Models with one RoPE per layer type (Gemma3,
    ModernBERT) nest one such dict per type; only the recipe's ``rope_layer_types`` are scaled.
    """
    if rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES}, got {rope!r}")
    trained = recipe.trained_context(model_config)
    if trained is None or context_length <= trained:
        return None
    if recipe.positions == "absolute":
        raise ValueError(
            f"context_length={context_length} exceeds the {trained} learned absolute positions of "
            f"{getattr(model_config, 'model_type', '?')} (recipe {recipe.name!r}); absolute position embeddings "
            f"cannot be extended by patching, use context_length <= {trained}"
        )
    rope_type = recipe.rope_type if rope == "recipe" else rope
    if rope_type in (None, "none"):
        return None
    params = getattr(model_config, "rope_parameters", None)
    if not isinstance(params, dict):
        raise ValueError(
            f"{type(model_config).__name__} has no rope_parameters to scale; pass rope='none' to keep its positions"
        )
    params = copy.deepcopy(params)
    entries = _rope_entries(params, recipe)
    if not entries:
        raise ValueError(f"rope_parameters {params} has none of the layer types {recipe.rope_layer_types} to scale")
    factor = context_length / trained
    for entry in entries:
        current = entry.get("rope_type", "default")
        if current == "linear" and rope_type == "linear":
            entry["factor"] = float(entry.get("factor", 1.0)) * factor
            continue
        if current != "default":
            raise ValueError(
                f"the model already uses RoPE scaling {current!r}; recipe scaling {rope_type!r} cannot be stacked on "
                "it: pass rope='none' to keep the model's own RoPE setting"
            )
        kept = {k: v for k, v in entry.items() if k in ("rope_theta", "partial_rotary_factor")}
        entry.clear()
        entry.update(kept, rope_type=rope_type, factor=float(factor))
        if rope_type == "yarn":
            entry["original_max_position_embeddings"] = trained
    return params


def _rotary_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "config")]


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _rebuild_rotary(model: torch.nn.Module) -> None:
    """Recompute every rotary embedding from its (updated) config, on the device and dtype of its old buffers."""
    for name, old in _rotary_modules(model):
        new = type(old)(old.config)
        buffer = next(old.buffers(), None)
        if buffer is not None:
            new = new.to(device=buffer.device, dtype=buffer.dtype)
        _set_module(model, name, new)


# ---- patch / unpatch ---------------------------------------------------------------------------------------------
@dataclass
class PatchSummary:
    """What :func:`patch` changed (also stored, as a dict, under ``config.dilated_attention_patch``).

    ``segment_lengths`` / ``dilation_rates`` are the dilated branches (``None`` under block-sparse attention);
    ``block_sparse`` the block-sparse settings (``None`` under dilated attention); ``keys_per_query`` the mean
    number of keys a query of a converted layer attends to at ``context_length`` (``ops/block_sparse/budget.py``).
    Records written before block-sparse existed lack the last three fields and read as dilated.
    """

    recipe: str
    model_type: str | None
    num_layers: int
    converted_layers: list[int]
    dense_layers: list[int]
    segment_lengths: list[int]
    dilation_rates: list[int]
    trained_context: int | None
    context_length: int | None
    rope_parameters_before: Any = None
    rope_parameters_after: Any = None
    attn_implementation_before: str | None = None
    base: dict = field(default_factory=dict)
    attention: str = "dilated"
    block_sparse: dict | None = None
    keys_per_query: float | None = None

    def lines(self) -> list[str]:
        out = [
            f"recipe: {self.recipe} (model_type {self.model_type})",
            f"attention: {self.attn_implementation_before} -> {self.attention}",
            f"branches: w={self.segment_lengths} r={self.dilation_rates}" if self.attention == "dilated" else
            "block-sparse: " + block_sparse_description(self.block_sparse or {}),
        ]
        if self.keys_per_query is not None:
            out.append(f"keys per query at {self.context_length} tokens: {self.keys_per_query:.1f} (mean)")
        out += [
            f"converted layers ({len(self.converted_layers)}/{self.num_layers}): {self.converted_layers}",
            f"dense layers: {self.dense_layers or 'none'}",
            f"context: trained {self.trained_context} -> target {self.context_length}",
        ]
        if self.rope_parameters_after != self.rope_parameters_before:
            out.append(f"rope_parameters: {self.rope_parameters_before} -> {self.rope_parameters_after}")
        else:
            out.append("rope_parameters: unchanged")
        return out


def block_sparse_description(settings: dict) -> str:
    """The settings of a block-sparse config that its pattern reads, in one line (``pattern=adaptive ...``)."""
    pattern = settings.get("pattern")
    keys = ["pattern", "block_size", "local_blocks", "global_blocks"] + {
        "adaptive": ["top_k"], "dilated": ["segment_blocks", "dilation_rates"], "hierarchical": ["windows", "strides"],
        "random": ["random_blocks", "seed"]}.get(pattern, [])
    return " ".join(f"{k}={settings[k]}" for k in keys if k in settings)


def is_patched(model: Any) -> bool:
    """Whether ``model`` carries a patch of :func:`patch` (made in this process or loaded from disk)."""
    return getattr(model.config, PATCH_KEY, None) is not None


def patched_attention(model: Any) -> str | None:
    """``"dilated"`` or ``"block_sparse"``: the attention a patched model uses (``None`` when unpatched)."""
    record = getattr(model.config, PATCH_KEY, None)
    return None if record is None else record.get("attention", "dilated")


def _attention_kind(attention: str | None, config: Any) -> str:
    """The attention a :func:`patch` call asks for: ``attention``, or the kind of ``config`` when ``None``."""
    if attention is None:
        return "block_sparse" if isinstance(config, (BlockSparseConfig, str)) else "dilated"
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    wrong = ((attention == "dilated" and isinstance(config, (BlockSparseConfig, str)))
             or (attention == "block_sparse" and isinstance(config, DilatedAttentionConfig)))
    if wrong:
        raise ValueError(f"config ({type(config).__name__} {config!r}) does not fit attention={attention!r}: give a "
                         "DilatedAttentionConfig for 'dilated', a BlockSparseConfig or pattern name for 'block_sparse'")
    return attention


def _config_layers(config: Any) -> list[int] | None:
    layers = config.get("layers") if isinstance(config, dict) else getattr(config, "layers", None)
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence)):
        raise ValueError(f"config.layers must be None or a list of layer indices, got {layers!r}")
    return None if layers is None else list(layers)


def patch(
    model: Any,
    config: DilatedAttentionConfig | BlockSparseConfig | dict | str | None = None,
    *,
    attention: str | None = None,
    layers: str | Sequence[int] = "all",
    recipe: str = "auto",
    context_length: int | None = None,
    rope: str = "recipe",
    backend: str | None = None,
) -> Any:
    """Switch ``model`` to dilated (default) or block-sparse attention in place and return it.

    Args:
        model: a loaded Transformers model whose attention uses the generic ``AttentionInterface`` dispatch.
        config: the attention settings. Dilated: a :class:`DilatedAttentionConfig` or its dict; ``None``: the
            recipe's default branches for the trained context, extended to ``context_length``. Block-sparse: a
            :class:`BlockSparseConfig` (used as is), a pattern name (``"adaptive"``, ``"local"``, ...) or a dict of
            ``BlockSparseConfig`` fields, the fields not given taken from the recipe
            (:meth:`Recipe.block_sparse_config`: by default adaptive, attending to as many keys per query as the
            dilated default at the context); ``None``: the recipe's block-sparse defaults.
        attention: ``"dilated"`` or ``"block_sparse"``; ``None``: ``"block_sparse"`` for a ``BlockSparseConfig`` or a
            pattern name, else ``"dilated"``.
        layers: ``"all"`` (the recipe's default: every full-attention layer, or ``config.layers`` if set) or a list of
            layer indices; the other layers keep exact dense attention.
        recipe: ``"auto"`` (by ``config.model_type``) or a recipe name from :func:`list_recipes`.
        context_length: the context the patched model should read; past the trained context the recipe's RoPE
            scaling is applied. ``None``: the trained context (no RoPE change).
        rope: ``"recipe"`` (the recipe's RoPE type), ``"none"`` (leave RoPE as is), or ``"linear"``, ``"dynamic"``,
            ``"yarn"``.
        backend: overrides ``config.backend`` (``"auto"``, ``"torch"``, ``"triton"``) when given.

    Raises ``ValueError`` (with nothing changed) for an unsupported model or bad arguments.
    """
    _check_is_model(model)
    if is_patched(model):
        raise ValueError(f"model is already patched with {patched_attention(model)} attention; call "
                         "hf_dilated.unpatch(model) first")
    kind = _attention_kind(attention, config)
    if not isinstance(recipe, str):
        raise ValueError(f"recipe must be 'auto' or one of {list_recipes()}, got {recipe!r}")
    chosen = recipe_for(model) if recipe == "auto" else load_recipe(recipe)
    if recipe != "auto" and getattr(model.config, "model_type", None) not in chosen.model_types:
        raise ValueError(
            f"recipe {recipe!r} covers model types {list(chosen.model_types)}, not {model.config.model_type!r}"
        )
    _check_model(model, chosen, kind)
    if rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES}, got {rope!r}")
    if context_length is not None and (isinstance(context_length, bool) or not isinstance(context_length, int) or context_length <= 0):
        raise ValueError(f"context_length must be a positive integer or None, got {context_length!r}")
    if kind == "dilated":
        if isinstance(config, dict):
            config = DilatedAttentionConfig.from_dict(config)
        elif config is not None and not isinstance(config, DilatedAttentionConfig):
            raise ValueError(f"config must be a DilatedAttentionConfig, a dict or None, got {type(config).__name__}")
    else:
        if isinstance(config, str):
            config = {"pattern": config}
        if isinstance(config, dict):
            unknown = sorted(set(config) - set(BlockSparseConfig.__dataclass_fields__))
            if unknown:
                raise ValueError(f"unknown block-sparse config keys {unknown}; allowed: "
                                 f"{sorted(BlockSparseConfig.__dataclass_fields__)}")
        elif config is not None and not isinstance(config, BlockSparseConfig):
            raise ValueError(f"config must be a BlockSparseConfig, a pattern name {BLOCK_SPARSE_PATTERNS}, a dict or "
                             f"None for attention='block_sparse', got {type(config).__name__}")

    mc = model.config
    n = _num_layers(mc)
    converted = _resolve_layers(mc, chosen, layers, _config_layers(config))
    trained = chosen.trained_context(mc)
    target = context_length or trained
    new_rope = rope_scaling_for(mc, chosen, target, rope) if target else None
    if isinstance(config, (DilatedAttentionConfig, BlockSparseConfig)):
        config = copy.deepcopy(config)
    else:
        if trained is None:
            raise ValueError(
                f"{type(mc).__name__} does not state its trained context (max_position_embeddings); pass config="
            )
        if kind == "dilated":
            ws, rs = chosen.branches(trained, target)
            config = DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, backend="auto",
                                            global_tokens=chosen.global_tokens)
        else:
            settings = {k: v for k, v in (config or {}).items() if k not in ("layers", "backend")}
            config = chosen.block_sparse_config(trained, target, **settings)
    config.layers = None if converted == list(range(n)) else converted
    if backend is not None:
        config.backend = backend
    config.validate()

    name = _attention_name(kind)
    previous = {key: _snapshot(mc, key) for key in (CONFIG_KEY, BLOCK_SPARSE_KEY, ATTN_KEY, PATCH_KEY, "rope_parameters",
                                                     "max_position_embeddings")}
    previous_impl = mc._attn_implementation
    rotary = _rotary_modules(model)
    summary = PatchSummary(
        recipe=chosen.name,
        model_type=getattr(mc, "model_type", None),
        num_layers=n,
        converted_layers=converted,
        dense_layers=[i for i in range(n) if i not in converted],
        segment_lengths=list(config.segment_lengths) if kind == "dilated" else None,
        dilation_rates=list(config.dilation_rates) if kind == "dilated" else None,
        trained_context=trained,
        context_length=target,
        rope_parameters_before=copy.deepcopy(getattr(mc, "rope_parameters", None)),
        rope_parameters_after=copy.deepcopy(new_rope) if new_rope is not None else copy.deepcopy(getattr(mc, "rope_parameters", None)),
        attn_implementation_before=previous_impl,
        base={
            "attn_implementation": previous_impl,
            "rope_parameters": copy.deepcopy(getattr(mc, "rope_parameters", None)),
            "max_position_embeddings": getattr(mc, "max_position_embeddings", None),
        },
        attention=kind,
        block_sparse=config.to_dict() if kind == "block_sparse" else None,
        keys_per_query=_keys_per_query(config, target, chosen.causal) if target else None,
    )
    model.set_attn_implementation(name)
    try:
        config.save_to(mc)
        setattr(mc, ATTN_KEY, name)
        if new_rope is not None:
            mc.rope_parameters = new_rope
            rope_types = {e.get("rope_type") for e in _rope_entries(new_rope, chosen)}
            if "dynamic" not in rope_types and isinstance(getattr(mc, "max_position_embeddings", None), int):
                # dynamic NTK reads max_position_embeddings as the trained length; the others take the new one.
                mc.max_position_embeddings = target + chosen.context_offset
            _rebuild_rotary(model)
        record = {k: v for k, v in summary.__dict__.items() if k not in ("rope_parameters_before", "attn_implementation_before")}
        setattr(mc, PATCH_KEY, copy.deepcopy(record))
    except Exception:
        _restore(model, previous, previous_impl, rotary)
        raise
    object.__setattr__(model, _STATE_ATTR, (previous, previous_impl, rotary))
    return model


def _keys_per_query(config: Any, seq_len: int, causal: bool) -> float:
    """Mean keys a query of a converted layer attends to at ``seq_len`` tokens (``ops/block_sparse/budget.py``)."""
    if isinstance(config, BlockSparseConfig):
        return round(config.keys_per_query(seq_len, causal=causal), 2)
    from .ops.block_sparse.budget import dilated_keys_per_query

    return round(dilated_keys_per_query(config.segment_lengths, config.dilation_rates, seq_len, causal=causal,
                                        global_tokens=config.global_tokens), 2)


def _snapshot(model_config: Any, key: str) -> Any:
    value = getattr(model_config, key, _MISSING)
    return value if value is _MISSING else copy.deepcopy(value)


def _restore(model: Any, previous: dict, previous_impl: str | None, rotary: list | None) -> None:
    mc = model.config
    for key, value in previous.items():
        if value is _MISSING:
            if key in mc.__dict__:
                delattr(mc, key)
        else:
            setattr(mc, key, copy.deepcopy(value))
    if rotary is not None:
        for name, module in rotary:
            _set_module(model, name, module)
    else:
        _rebuild_rotary(model)
    model.set_attn_implementation(previous_impl or "sdpa")


def unpatch(model: Any) -> Any:
    """Undo :func:`patch`: the previous attention implementation, config entries, RoPE and rotary modules.

    For a model patched in this process the restore is exact (the original rotary modules come back). For a patched
    checkpoint loaded from disk, the base settings recorded under ``config.dilated_attention_patch`` are restored and
    the rotary embeddings recomputed from them. Raises ``ValueError`` if the model is not patched.
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        previous, previous_impl, rotary = state
        _restore(model, previous, previous_impl, rotary)
        object.__delattr__(model, _STATE_ATTR)
        return model
    record = getattr(model.config, PATCH_KEY, None)
    if record is None:
        raise ValueError("model is not patched (no config.dilated_attention_patch): nothing to unpatch")
    base = record.get("base", {})
    previous = {CONFIG_KEY: _MISSING, BLOCK_SPARSE_KEY: _MISSING, ATTN_KEY: _MISSING, PATCH_KEY: _MISSING}
    for key in ("rope_parameters", "max_position_embeddings"):
        if base.get(key) is not None:
            previous[key] = base[key]
    _restore(model, previous, base.get("attn_implementation"), None)
    return model


def patch_summary(model: Any) -> dict | None:
    """The record :func:`patch` wrote into ``model.config`` (``None`` when unpatched)."""
    record = getattr(model.config, PATCH_KEY, None)
    return copy.deepcopy(record) if record is not None else None


def ensure_reloadable(model: Any) -> None:
    """Re-mark a patched model so that ``save_pretrained`` writes ``attn_implementation: "dilated"`` (or
    ``"block_sparse"``) again.

    Transformers consumes that key when loading, so a patched checkpoint loaded from disk and saved again would lose
    it; :func:`hf_dilated.save_patched` calls this for you.
    """
    if not is_patched(model):
        raise ValueError("model is not patched; call hf_dilated.patch(model) first")
    setattr(model.config, ATTN_KEY, _attention_name(patched_attention(model)))


# ---- saving and the model card -----------------------------------------------------------------------------------
MODEL_CARD_TEMPLATE = "dilated_attention.md"


def _fmt_layers(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if layers else "none"


def format_eval_table(eval_results: dict | None) -> str:
    """Markdown for the model card's evaluation section.

    Takes the JSON that `scripts/eval_long_context.py`'s ``evaluate`` writes (``{"results": [{"context": ..,
    "variant": .., "perplexity": ..}, ...]}``) or a flat ``{metric: value}`` dict.
    """
    if not eval_results:
        return "No evaluation numbers were given when this checkpoint was saved."
    if not isinstance(eval_results, dict):
        raise ValueError(f"eval_results must be a dict, got {type(eval_results).__name__}")
    rows = eval_results.get("results")
    if isinstance(rows, list) and rows:
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        contexts = sorted({r["context"] for r in rows})
        table = {(r["context"], r["variant"]): r["perplexity"] for r in rows}
        lines = [
            f"Perplexity on {eval_results.get('text', 'the evaluation text')} "
            f"({eval_results.get('windows', '?')} window(s) per context, lower is better):",
            "",
            "| context | " + " | ".join(variants) + " |",
            "|---:|" + "---:|" * len(variants),
        ]
        for c in contexts:
            cells = [f"{table[(c, v)]:.3f}" if (c, v) in table else "" for v in variants]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        if eval_results.get("variants_help"):
            lines += [""] + [f"- `{k}`: {v}" for k, v in eval_results["variants_help"].items()]
        return "\n".join(lines)
    lines = ["| metric | value |", "|---|---:|"]
    for key, value in eval_results.items():
        lines.append(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
    return "\n".join(lines)


# What the model card says of each attention: its name, tags, the explanation under the settings table.
_CARD_TEXT = {
    "dilated": {
        "title": "dilated attention",
        "name": "**LongNet dilated attention** ([Ding et al., 2023](https://arxiv.org/abs/2307.02486))",
        "tags": ["dilated-attention", "longnet"],
        "explainer": "Each branch `(w, r)` splits the sequence into segments of `w` tokens and, inside each, keeps "
                     "every `r`-th token (offset by head); the branches' outputs are merged by their softmax "
                     "normalisers, exactly.",
    },
    "block_sparse": {
        "title": "block-sparse attention",
        "name": "**block-sparse attention**",
        "tags": ["block-sparse-attention", "sparse-attention"],
        "explainer": "The sequence is cut into blocks of `block_size` tokens; each query block attends, with one "
                     "exact softmax, to all keys of its active key blocks: the local window, the first (sink) "
                     "blocks and the pattern's blocks (`adaptive`: the `top_k` key blocks whose mean key best "
                     "matches the block's mean query, chosen per kv head from the content at every forward).",
    },
}


def _card_rows(attention: str, config: Any, record: dict) -> list[tuple[str, str]]:
    """The settings table of the model card: ``(label, value)`` rows for this attention."""
    if attention == "dilated":
        rows = [("Segment lengths `w`", ", ".join(map(str, config.segment_lengths))),
                ("Dilation rates `r`", ", ".join(map(str, config.dilation_rates)))]
        if config.global_tokens:
            rows.append(("Global tokens", str(config.global_tokens)))
    else:
        settings = config.to_dict()
        rows = [("Pattern", f"`{config.pattern}`"), ("Block size", str(config.block_size)),
                ("Local window (blocks)", str(config.local_blocks)), ("Sink / global blocks", str(config.global_blocks))]
        for key in block_sparse_description(settings).split()[4:]:
            field_name, _, value = key.partition("=")
            rows.append((f"`{field_name}`", value))
    if record.get("keys_per_query") is not None:
        rows.append((f"Keys per query at {record.get('context_length')} tokens (mean)", f"{record['keys_per_query']:.1f}"))
    return rows


def render_model_card(model: Any, eval_results: dict | None = None, load_path: str = "path/to/checkpoint") -> str:
    """The README.md model card of a patched model: ``huggingface_hub.ModelCard`` rendered from the package's
    template (``model_cards/dilated_attention.md``, one template for both attentions) with Hub metadata
    (``ModelCardData``), which attention and its settings, how to load it from ``load_path``, and the evaluation
    table."""
    import json

    from huggingface_hub import ModelCard, ModelCardData

    record = patch_summary(model)
    if record is None:
        raise ValueError("model is not patched; call hf_dilated.patch(model) first")
    attention = record.get("attention", "dilated")
    if attention == "dilated":
        config = DilatedAttentionConfig.from_model_config(model.config)
    else:
        config = BlockSparseConfig.from_model_config(model.config)
    text = _CARD_TEXT[attention]
    name = _attention_name(attention)
    base = getattr(model.config, "_name_or_path", "") or ""
    is_hub_id = base.count("/") == 1 and not base.startswith((".", "/", "~"))
    recipe = load_recipe(record["recipe"]) if record["recipe"] in _load_recipes() else DEFAULT_RECIPE
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base if is_hub_id else None,
        pipeline_tag="text-generation" if recipe.causal else "feature-extraction",
        tags=["hf_dilated", *text["tags"], "long-context", record.get("model_type") or "transformers"],
    )
    template = (shipped_directory("model_cards") / MODEL_CARD_TEMPLATE).read_text(encoding="utf-8")
    rows = _card_rows(attention, config, record)
    card = ModelCard.from_template(
        card_data,
        template_str=template,
        title=f"{base.rsplit('/', 1)[-1] or type(model).__name__} with {text['title']}",
        base_sentence=f"[`{base}`](https://huggingface.co/{base})" if is_hub_id else (
            f"`{type(model).__name__}` (base: `{base}`)" if base else f"A `{type(model).__name__}` checkpoint"
        ),
        attention_name=text["name"],
        attention_title=text["title"],
        attn_implementation=name,
        recipe=record["recipe"],
        settings_rows="\n".join(f"| {label} | {value} |" for label, value in rows),
        explainer=text["explainer"],
        converted_layers=f"{len(record['converted_layers'])} of {record['num_layers']}: {_fmt_layers(record['converted_layers'])}",
        dense_layers=_fmt_layers(record["dense_layers"]),
        trained_context=record.get("trained_context"),
        context_length=record.get("context_length"),
        rope_before=json.dumps(record["base"].get("rope_parameters")),
        rope_after=json.dumps(getattr(model.config, "rope_parameters", None)),
        backend=config.backend,
        auto_class=_auto_class_name(model),
        load_path=str(load_path),
        evaluation=format_eval_table(eval_results),
        recipe_fidelity=_card_fidelity(recipe, attention),
        config_json=json.dumps({CONFIG_KEYS[attention]: config.to_dict(), PATCH_KEY: record}, indent=2),
    )
    return str(card)


def _card_fidelity(recipe: Recipe, attention: str) -> str:
    """The model card's sentences on how the recipe's defaults of ``attention`` measured without fine-tuning and, where
    measured, after the short fine-tune."""
    measured = recipe.block_sparse_fidelity if attention == "block_sparse" else recipe.fidelity
    finetuned = recipe.block_sparse_finetuned_fidelity if attention == "block_sparse" else recipe.finetuned_fidelity
    kind = "block-sparse" if attention == "block_sparse" else "dilated"
    if measured:
        text = (f"Quality of the `{recipe.name}` recipe's {kind} defaults without fine-tuning, as measured by "
                f"`hf_dilated`: {measured.strip()}")
    else:
        text = (f"No measurement of the `{recipe.name}` recipe's {kind} defaults without fine-tuning is recorded yet: "
                "evaluate before use (`hf-dilated eval`), or fine-tune (`hf-dilated finetune`).")
    if finetuned:
        text += f"\n\nAfter a short fine-tune (`hf-dilated finetune`): {finetuned.strip()}"
    return text


def _auto_class_name(model: Any) -> str:
    name = type(model).__name__
    for head in ("ForCausalLM", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification"):
        if name.endswith(head):
            return f"AutoModel{head}"
    return "AutoModel"


def save_patched(model: Any, path: str, tokenizer: Any = None, eval_results: dict | None = None,
                 card_path: str | None = None, **save_kwargs: Any) -> str:
    """``model.save_pretrained(path)`` (safetensors, weights untouched) plus a README.md model card.

    ``tokenizer`` is saved beside the model when given; ``eval_results`` (see :func:`format_eval_table`) fill the
    card's evaluation section; ``card_path`` is the path the card tells readers to load from (default ``path``; the
    command line writes into a staging directory and passes the final one). Returns ``path``.
    """
    from pathlib import Path

    ensure_reloadable(model)
    card = render_model_card(model, eval_results=eval_results, load_path=str(card_path or path))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), **save_kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    (out / "README.md").write_text(card, encoding="utf-8")
    return str(path)
