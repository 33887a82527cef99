"""hf_dilated: LongNet dilated attention for Hugging Face Transformers.

Importing the package registers three attention implementations with Transformers' ``AttentionInterface`` and
``AttentionMaskInterface``: ``"dilated"`` (one device), ``"dilated_ring"`` (the sequence split over a
``torch.distributed`` group) and ``"block_sparse"``.

The import itself is light: the registration runs the moment Transformers loads its model code
(``transformers.modeling_utils``, which every ``from_pretrained`` and ``AttentionInterface`` goes through; at once if
it is loaded already), and the public names below load their modules on first use. So ``hf-dilated --help`` answers
without loading torch or Transformers, and ``import hf_dilated`` anywhere before a model is built is enough.
"""

from __future__ import annotations

import importlib

import wrapt

__version__ = "0.1.0"

# Public name -> module (relative to this package) that defines it; loaded on first access (PEP 562).
_EXPORTS = {
    "CONFIG_KEY": ".config",
    "DilatedAttentionConfig": ".config",
    "default_branches": ".config",
    "ATTENTION_NAME": ".integrations.transformers",
    "dilated_attention_forward": ".integrations.transformers",
    "dilated_mask": ".integrations.transformers",
    "ensure_supported": ".integrations.transformers",
    "register": ".integrations.transformers",
    "supports_dilated_attention": ".integrations.transformers",
    "DilatedAttention": ".modules",
    "MultiheadDilatedAttention": ".modules",
    "attend": ".ops",
    "dilated_attention": ".ops",
    "resolve_layout": ".ops",
    "BlockLayout": ".ops.block_sparse",
    "BlockSparseConfig": ".ops.block_sparse",
    "block_sparse_attention": ".ops.block_sparse",
    "list_recipes": ".patching",
    "load_recipe": ".patching",
    "patch": ".patching",
    "save_patched": ".patching",
    "unpatch": ".patching",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        try:  # a subpackage (``hf_dilated.ops``, ``hf_dilated.distributed``...) reached as an attribute
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module 'hf_dilated' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _register_all(_modeling_utils=None) -> None:
    """Register ``"dilated"``, ``"dilated_ring"`` and ``"block_sparse"`` with Transformers (idempotent)."""
    from .integrations import block_sparse, dilated_ring, transformers

    transformers.register()
    dilated_ring.register()
    block_sparse.register()


wrapt.register_post_import_hook(_register_all, "transformers.modeling_utils")
