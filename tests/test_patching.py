"""patch / unpatch, recipes, save + reload, model card: tiny random models of every family, and SmolLM2 on real text."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import hf_dilated  # noqa: F401  (registers the "dilated" attention implementation)
from hf_dilated.config import CONFIG_KEY, DilatedAttentionConfig
from hf_dilated.patching import (
    Recipe,
    is_patched,
    list_recipes,
    load_recipe,
    patch,
    patch_summary,
    recipe_for,
    save_patched,
    unpatch,
)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
              max_position_embeddings=256)
DEGENERATE = {"segment_lengths": [512], "dilation_rates": [1]}  # one dense branch longer than any input: exact
SPARSE = {"segment_lengths": [16, 32], "dilation_rates": [1, 2]}


def tiny(family: str):
    """A tiny random model of one architecture family, in eval mode (fresh weights, seeded per family)."""
    torch.manual_seed(sum(map(ord, family)))
    t = transformers
    builders = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(num_key_value_heads=2, **COMMON)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(num_key_value_heads=2, **COMMON)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(num_key_value_heads=2, sliding_window=None, **COMMON)),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**COMMON)),
        "bert": lambda: t.BertModel(t.BertConfig(**COMMON)),
        "roberta": lambda: t.RobertaModel(t.RobertaConfig(**COMMON)),
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
            **COMMON)),
    }
    return builders[family]().eval()


def run(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def config_state(model) -> dict:
    return {"dict": model.config.to_dict(), "impl": model.config._attn_implementation}


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gpt_neox", "bert", "roberta"]


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_is_dilated_exact_when_degenerate_and_unpatch_restores(family, rng):
    model = tiny(family)
    ids = torch.randint(3, 128, (2, 96), generator=rng)
    dense, before = run(model, ids), config_state(model)

    patch(model, DEGENERATE)
    assert model.config._attn_implementation == "dilated" and is_patched(model)
    torch.testing.assert_close(run(model, ids), dense, atol=1e-5, rtol=1e-5)
    unpatch(model)

    patch(model, SPARSE)
    sparse = run(model, ids)
    assert (sparse - dense).abs().max() > 1e-3, "a sparse dilated config must change the outputs"
    assert getattr(model.config, CONFIG_KEY)["segment_lengths"] == [16, 32]
    unpatch(model)

    assert torch.equal(run(model, ids), dense)
    assert config_state(model) == before
    assert not is_patched(model) and not hasattr(model.config, CONFIG_KEY)


def test_per_layer_choice_leaves_other_layers_dense(rng):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 128), generator=rng)
    seen = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()))
             for i, layer in enumerate(model.model.layers)]
    run(model, ids)
    dense = dict(seen)
    patch(model, SPARSE, layers=[1])
    assert getattr(model.config, CONFIG_KEY)["layers"] == [1]
    assert patch_summary(model)["dense_layers"] == [0]
    run(model, ids)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(seen[0], dense[0], atol=1e-6, rtol=1e-6)  # layer 0 untouched
    assert (seen[1] - dense[1]).abs().max() > 1e-3  # layer 1 dilated


def test_rope_scaling_for_longer_context():
    model = tiny("llama")
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    patch(model, context_length=1024)  # trained 256 -> 1024: the llama recipe's YaRN, factor 4
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 256
    assert model.config.max_position_embeddings == 1024
    assert not torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    cfg = getattr(model.config, CONFIG_KEY)
    assert cfg["segment_lengths"] == [64, 128, 256, 512, 1024] and cfg["dilation_rates"] == [1, 1, 2, 4, 8]
    assert cfg["global_tokens"] == 4  # the llama recipe's sinks
    unpatch(model)
    assert model.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
    assert model.config.max_position_embeddings == 256
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)

    patch(model, context_length=512, rope="dynamic")  # dynamic NTK reads max_position_embeddings as the trained length
    assert model.config.rope_parameters["rope_type"] == "dynamic" and model.config.max_position_embeddings == 256
    unpatch(model)
    neox = tiny("gpt_neox")
    patch(neox, context_length=512)  # linear, partial rotary kept
    assert neox.config.rope_parameters == {"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                           "rope_type": "linear", "factor": 2.0}


def test_save_reload_model_card_and_loading_without_hf_dilated(tmp_path, rng):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 100), generator=rng)
    patch(model, SPARSE, layers=[0], context_length=512)
    patched = run(model, ids)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_patched(model, tmp_path, eval_results={"perplexity_dense": 10.0, "perplexity_dilated": 10.5})

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == "dilated" and saved[CONFIG_KEY]["layers"] == [0]
    card = (tmp_path / "README.md").read_text()
    from huggingface_hub import ModelCard

    data = ModelCard.load(tmp_path / "README.md").data  # Hub metadata the Hub's own parser reads back
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"dilated-attention", "llama"} <= set(data.tags)
    assert f'from_pretrained("{tmp_path}")' in card and "not on PyPI" in card
    assert "| Segment lengths `w` | 16, 32 |" in card
    assert "| Converted layers | 1 of 2: 0 |" in card and "| perplexity_dilated | 10.5 |" in card
    assert 'from_pretrained("' in card and "yarn" in card

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == "dilated"
    assert DilatedAttentionConfig.from_model_config(reloaded.config).layers == [0]
    assert torch.equal(run(reloaded, ids), patched)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in weights.items())

    # A reloaded checkpoint unpatches from the base settings recorded in its config.
    unpatch(reloaded)
    assert reloaded.config.rope_parameters["rope_type"] == "default" and reloaded.config.max_position_embeddings == 256
    unpatch(model)
    torch.testing.assert_close(run(reloaded, ids), run(model, ids), atol=1e-6, rtol=1e-6)

    # In a fresh interpreter: without hf_dilated Transformers refuses the checkpoint; after `import hf_dilated` it
    # reloads patched, with no remote code.
    script = textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
            print("LOADED_WITHOUT")
        except ValueError as err:
            print("REFUSED", err)
        import hf_dilated
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        print("IMPL", m.config._attn_implementation)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    assert 'REFUSED Specified `attn_implementation="dilated"` is not supported' in out, out
    assert "IMPL dilated" in out, out


def test_resave_of_reloaded_checkpoint_stays_patched(tmp_path):
    model = tiny("qwen2")
    patch(model, SPARSE)
    save_patched(model, tmp_path / "a")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    save_patched(reloaded, tmp_path / "b")  # Transformers consumed attn_implementation on load; save_patched re-marks
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert again.config._attn_implementation == "dilated"


def test_recipes_load_and_validate():
    names = list_recipes()
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt_neox", "bert"} <= set(names)
    owners = {}
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.model_types
        for model_type in recipe.model_types:
            assert model_type not in owners, f"{model_type} is in recipes {owners.get(model_type)} and {name}"
            owners[model_type] = name
        assert recipe.sliding_window in ("keep", "refuse")
    assert load_recipe("bert").positions == "absolute" and load_recipe("bert").causal is False
    assert load_recipe("gemma3").convert == "full_attention" and load_recipe("gemma3").rope_type == "linear"
    # SmolLM2-sized defaults, chosen by the fidelity study: trained 8192 -> two undilated branches, then r doubles,
    # and 4 global tokens; other families keep LongNet's geometric list up to the target
    assert load_recipe("llama").branches(8192) == ([2048, 4096, 8192], [1, 1, 2])
    assert load_recipe("llama").branches(8192, 65536) == ([2048, 4096, 8192, 16384, 32768, 65536], [1, 1, 2, 4, 8, 16])
    assert load_recipe("llama").global_tokens == 4 and load_recipe("qwen2").global_tokens == 0
    assert load_recipe("qwen2").branches(32768) == ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert load_recipe("bert").branches(512) == ([128, 256, 512], [1, 2, 4])
    # A target below the trained context still gets branches up to it, never one dense segment (which would make
    # "dilated" exact dense attention at short lengths without a word).
    assert load_recipe("llama").branches(8192, 1024) == ([2048, 4096, 8192], [1, 1, 2])
    with pytest.raises(ValueError, match="undilated_branches must be a positive integer"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "branches": {"undilated_branches": 0}})
    with pytest.raises(ValueError, match="global_tokens must be an integer >= 0"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "global_tokens": -1})
    with pytest.raises(ValueError, match="fidelity must be a string"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "fidelity": 1.09})
    with pytest.raises(ValueError, match="unknown keys.*softcapping"):  # recipe fields nothing read are gone
        Recipe.from_dict({"name": "x", "model_types": ["x"], "softcapping": "refuse"})
    with pytest.raises(ValueError, match="sliding_window must be one of"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "sliding_window": "approximate"})
    with pytest.raises(ValueError, match="unknown keys"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "rope": {"type": "yarn", "scale": 2}})
    assert recipe_for(tiny("roberta")).name == "bert"


def test_sliding_window_layers_stay_exact(rng):
    model = tiny("gemma3")
    ids = torch.randint(0, 128, (1, 64), generator=rng)
    dense = run(model, ids)
    patch(model, DEGENERATE)
    assert getattr(model.config, CONFIG_KEY)["layers"] == [1]  # only the global layer
    torch.testing.assert_close(run(model, ids), dense, atol=1e-5, rtol=1e-5)
    unpatch(model)
    patch(model, context_length=512)  # linear RoPE on the global layers only
    rope = model.config.rope_parameters
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 2.0
    assert rope["sliding_attention"]["rope_type"] == "default"


class _OpaqueConfig(transformers.PreTrainedConfig):
    model_type = "opaque-test"

    def __init__(self, **kwargs):
        self.num_hidden_layers = 1
        super().__init__(**kwargs)


class _OpaqueModel(transformers.PreTrainedModel):
    """A model whose attention does not use AttentionInterface (no _supports_attention_backend)."""

    config_class = _OpaqueConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = torch.nn.Linear(4, 4)
        self.post_init()


def test_bad_arguments_raise_clear_errors_and_change_nothing():
    model = tiny("llama")
    before = config_state(model)
    cases = [
        (dict(layers=[0, 5]), "layers must be 'all' or a list of layer indices in \\[0, 2\\)"),
        (dict(layers="some"), "layers must be 'all'"),
        (dict(recipe="gpt2"), "recipe must be 'auto' or one of \\['bert', "),
        (dict(recipe="bert"), "recipe 'bert' covers model types"),
        (dict(rope="ntk"), "rope must be one of"),
        (dict(context_length=0), "context_length must be a positive integer"),
        (dict(config={"segment_lengths": [100], "dilation_rates": [3]}), "multiple of its dilation rate"),
        (dict(config={"segment_lengths": [64], "dilation_rates": [1], "window": 3}), "unknown dilated-attention config keys"),
        (dict(config=DilatedAttentionConfig(layers=[0]), layers=[1]), "contradicts config.layers"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            patch(model, **kwargs)
        assert config_state(model) == before, kwargs
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)
    with pytest.raises(ValueError, match="model must be a Transformers PreTrainedModel.*got Linear"):
        patch(torch.nn.Linear(2, 2))
    for field, value, message in [("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
                                  ("head_dim", 0, "head dimension"),
                                  ("num_key_value_heads", 3, "num_key_value_heads must be a positive divisor")]:
        broken = tiny("llama")
        setattr(broken.config, field, value)
        with pytest.raises(ValueError, match=message):
            patch(broken)
        assert not is_patched(broken)
    patch(model)
    with pytest.raises(ValueError, match="already patched"):
        patch(model)

    bert = tiny("bert")
    with pytest.raises(ValueError, match="absolute position embeddings cannot be extended"):
        patch(bert, context_length=1024)
    assert not is_patched(bert)

    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, sliding_window=64, **COMMON))
    with pytest.raises(ValueError, match="recipe 'mistral' refuses sliding-window layers.*sliding_window = None"):
        patch(mistral)
    gemma = tiny("gemma3")
    gemma.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="softcapping"):
        patch(gemma)

    with pytest.raises(ValueError, match="supported model types: \\['bert', 'camembert'"):
        patch(_OpaqueModel(_OpaqueConfig()))


def test_unknown_generic_dispatch_architecture_gets_defaults(rng):
    # Phi-3 has no recipe but uses AttentionInterface, so the defaults apply.
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **COMMON)).eval()
    ids = torch.randint(0, 128, (1, 64), generator=rng)
    dense = run(model, ids)
    patch(model, DEGENERATE)
    assert patch_summary(model)["recipe"] == "default"
    torch.testing.assert_close(run(model, ids), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_degenerate_config_gives_dense_logits_on_smollm2(smollm2, shakespeare):
    model, tok = smollm2
    ids = tok(shakespeare[:4000], return_tensors="pt", add_special_tokens=False).input_ids[:, :256]
    dense = run(model, ids)
    patch(model, {"segment_lengths": [256], "dilation_rates": [1]})
    try:
        assert patch_summary(model)["recipe"] == "llama" and patch_summary(model)["converted_layers"] == list(range(30))
        torch.testing.assert_close(run(model, ids), dense, atol=1e-4, rtol=1e-4)
    finally:
        unpatch(model)
    # Sparse branches (w = 64, 128, 256 at 256 tokens) change the logits but keep the model reading real text.
    patch(model, {"segment_lengths": [64, 128, 256], "dilation_rates": [1, 2, 4]})
    try:
        sparse = run(model, ids)
    finally:
        unpatch(model)
    assert torch.equal(run(model, ids), dense)
    nll = lambda logits: torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert (sparse - dense).abs().max() > 1e-2
    assert nll(sparse) < nll(dense) + 1.0, (nll(sparse), nll(dense))


# ---- block-sparse attention through the same patch ----------------------------------------------------------------
BS_SPARSE = {"block_size": 16, "top_k": 1, "local_blocks": 1, "global_blocks": 1}  # 3 of 10 blocks at 160 tokens


def test_block_sparse_patch_save_reload_equal_logits_and_unpatch(tmp_path, rng):
    from hf_dilated import BlockSparseConfig
    from hf_dilated.ops.block_sparse.config import CONFIG_KEY as BS_KEY

    model = tiny("llama")
    ids = torch.randint(0, 128, (2, 160), generator=rng)
    dense, before = run(model, ids), config_state(model)

    patch(model, {"pattern": "dense", "block_size": 16}, attention="block_sparse")  # an all-dense layout: exact
    assert model.config._attn_implementation == "block_sparse" and is_patched(model)
    torch.testing.assert_close(run(model, ids), dense, atol=1e-5, rtol=1e-5)
    unpatch(model)
    assert config_state(model) == before

    patch(model, BS_SPARSE, attention="block_sparse", layers=[1], context_length=512)
    patched = run(model, ids)
    assert (patched - dense).abs().max() > 1e-3, "a sparse layout must change the outputs"
    record = patch_summary(model)
    assert record["attention"] == "block_sparse" and record["segment_lengths"] is None
    assert record["block_sparse"]["top_k"] == 1 and record["converted_layers"] == [1]
    save_patched(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == "block_sparse" and CONFIG_KEY not in saved
    assert saved[BS_KEY]["layers"] == [1] and saved[BS_KEY]["block_size"] == 16
    card = (tmp_path / "README.md").read_text()
    assert "block-sparse attention" in card and "| Pattern | `adaptive` |" in card and "| `top_k` | 1 |" in card
    assert 'attn_implementation="block_sparse"' in card and "Segment lengths" not in card

    for kwargs in ({}, {"attn_implementation": "block_sparse"}):  # config.json says it; saying it again is the same
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
        assert reloaded.config._attn_implementation == "block_sparse"
        assert BlockSparseConfig.from_model_config(reloaded.config) == BlockSparseConfig.from_model_config(model.config)
        assert torch.equal(run(reloaded, ids), patched)
    save_patched(reloaded, tmp_path / "again")  # a reloaded checkpoint saves as block-sparse again
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attn_implementation"] == "block_sparse"

    unpatch(reloaded)  # from the record on disk
    assert reloaded.config._attn_implementation == "sdpa" and not hasattr(reloaded.config, BS_KEY)
    assert reloaded.config.rope_parameters["rope_type"] == "default" and reloaded.config.max_position_embeddings == 256
    unpatch(model)  # in process: exact (save_pretrained itself adds config.architectures)
    assert torch.equal(run(model, ids), dense) and not is_patched(model) and not hasattr(model.config, BS_KEY)
    torch.testing.assert_close(run(reloaded, ids), dense, atol=1e-6, rtol=1e-6)


def test_block_sparse_recipe_defaults_match_the_dilated_budget():
    from hf_dilated import BlockSparseConfig
    from hf_dilated.ops.block_sparse.budget import dilated_keys_per_query

    model = tiny("llama")
    model.config.max_position_embeddings = 4096  # as if trained on 4K: dilated default w = 1024 .. 8192 at 8192
    patch(model, attention="block_sparse", context_length=8192)
    record = patch_summary(model)
    cfg = BlockSparseConfig.from_model_config(model.config)
    ws, rs = load_recipe("llama").branches(4096, 8192)
    want = BlockSparseConfig.matching_budget(
        DilatedAttentionConfig(segment_lengths=ws, dilation_rates=rs, global_tokens=4), 8192)  # the recipe's sinks
    assert cfg == want and cfg.pattern == "adaptive" and cfg.local_blocks == 8 and cfg.global_blocks == 1
    assert record["keys_per_query"] == pytest.approx(cfg.keys_per_query(8192), abs=0.01)
    assert abs(record["keys_per_query"] - dilated_keys_per_query(ws, rs, 8192, global_tokens=4)) <= cfg.block_size
    assert model.config.rope_parameters["rope_type"] == "yarn"  # the recipe's RoPE, as for dilated
    unpatch(model)

    patch(model, "dilated", context_length=8192)  # a pattern name: block-sparse; the rest from the recipe
    cfg = BlockSparseConfig.from_model_config(model.config)
    assert patch_summary(model)["attention"] == "block_sparse"
    assert cfg.segment_blocks == [16, 32, 64, 128] and cfg.dilation_rates == rs == [1, 1, 2, 4]  # w / 64 blocks
    unpatch(model)
    patch(model, BlockSparseConfig(pattern="local", block_size=16, local_blocks=2), backend="torch")  # as given
    assert BlockSparseConfig.from_model_config(model.config).local_blocks == 2
    assert BlockSparseConfig.from_model_config(model.config).backend == "torch"
    unpatch(model)

    gemma = tiny("gemma3")  # the sliding-window layer stays exact
    patch(gemma, attention="block_sparse")
    assert BlockSparseConfig.from_model_config(gemma.config).layers == [1]
    bert = tiny("bert")  # bidirectional: matched without causality
    patch(bert, attention="block_sparse")
    assert patch_summary(bert)["keys_per_query"] == pytest.approx(
        BlockSparseConfig.from_model_config(bert.config).keys_per_query(256, causal=False), abs=0.01)


def test_block_sparse_bad_arguments_name_the_argument_and_change_nothing():
    from hf_dilated import BlockSparseConfig

    model = tiny("llama")
    before = config_state(model)
    cases = [
        (dict(attention="sparse"), "attention must be one of \\('dilated', 'block_sparse'\\)"),
        (dict(config=BlockSparseConfig(), attention="dilated"), "does not fit attention='dilated'"),
        (dict(config="stripes"), "pattern must be one of \\('local', 'dilated'"),  # a name: block-sparse
        (dict(config="stripes", attention="block_sparse"), "pattern must be one of \\('local', 'dilated'"),
        (dict(config=DilatedAttentionConfig(), attention="block_sparse"), "does not fit attention='block_sparse'"),
        (dict(config={"patern": "local"}, attention="block_sparse"), "unknown block-sparse config keys \\['patern'\\]"),
        (dict(config={"block_size": 48}, attention="block_sparse"), "block_size must be a power of two"),
        (dict(config=3, attention="block_sparse"), "config must be a BlockSparseConfig, a pattern name"),
        (dict(config={"layers": [0]}, attention="block_sparse", layers=[1]), "contradicts config.layers"),
        (dict(attention="block_sparse", layers=[0, 5]), "layers must be 'all' or a list of layer indices"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            patch(model, **kwargs)
        assert config_state(model) == before, kwargs
    patch(model, attention="block_sparse")
    with pytest.raises(ValueError, match="already patched with block_sparse attention"):
        patch(model)
    with pytest.raises(ValueError, match="unknown block_sparse keys \\['window'\\]"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "block_sparse": {"window": 3}})
    with pytest.raises(ValueError, match="recipe 'x': block_sparse: top_k must be"):
        Recipe.from_dict({"name": "x", "model_types": ["x"], "block_sparse": {"top_k": 0}})
    assert all(load_recipe(name).block_sparse.get("pattern") == "adaptive" for name in list_recipes())

    # A malformed stored config fails at the first forward (the mask function), naming the field.
    broken = tiny("llama")
    broken.set_attn_implementation("block_sparse")
    ids = torch.randint(0, 128, (1, 20))
    for stored, message in [({"pattern": "star"}, "pattern must be one of"), ({"layers": [5]}, "layers names layer 5"),
                            ("adaptive", "must be a dict")]:
        broken.config.block_sparse_attention = stored
        with pytest.raises(ValueError, match=message):
            run(broken, ids)


@pytest.mark.slow
def test_block_sparse_on_smollm2_reads_real_text(smollm2, shakespeare):
    """The real checkpoint (its fixture is shared with the dilated test above), two forwards: the recipe's adaptive
    pattern at small blocks changes the logits but keeps the model reading Shakespeare. (Exactness of an all-dense
    layout is checked on the tiny models; the command line's `patch smollm2 DST --attention block_sparse` takes over
    a minute on 2 cores, GGUF dequantization and saving, and tests/test_cli.py covers it on a tiny checkpoint.)"""
    model, tok = smollm2
    ids = tok(shakespeare[:4000], return_tensors="pt", add_special_tokens=False).input_ids[:, :128]
    dense = run(model, ids)
    patch(model, {"block_size": 16, "local_blocks": 2, "top_k": 2}, attention="block_sparse")  # <= 5 of 8 blocks
    try:
        assert patch_summary(model)["recipe"] == "llama" and patch_summary(model)["converted_layers"] == list(range(30))
        sparse = run(model, ids)
    finally:
        unpatch(model)
    assert model.config._attn_implementation != "block_sparse" and not is_patched(model)
    nll = lambda logits: torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert (sparse - dense).abs().max() > 1e-2
    assert nll(sparse) < nll(dense) + 1.0, (nll(sparse), nll(dense))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_block_sparse_patch_triton_matches_reference(tmp_path):
    """A patched model on the GPU (bf16, block 64, the recipe's adaptive default at 2K tokens): the Triton kernels give
    the reference's logits, and the saved checkpoint reloads to the same."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048)
    # Loaded in bf16 as a user would: `.to(torch.bfloat16)` would also round the rotary inv_freq buffer, which
    # from_pretrained keeps in float32, and the reloaded model would then differ by the rounding (4% here).
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.randint(0, 256, (2, 2048), device="cuda")
    patch(model, attention="block_sparse", backend="triton")
    from hf_dilated import BlockSparseConfig

    cfg = BlockSparseConfig.from_model_config(model.config)
    assert cfg.pattern == "adaptive" and cfg.block_size == 64 and cfg.local_blocks == 4  # w0 = 512 -> 256 tokens
    fast = run(model, ids).float()
    model.config.block_sparse_attention = dict(model.config.block_sparse_attention, backend="torch")
    ref = run(model, ids).float()
    assert ((fast - ref).norm() / ref.norm()).item() < 2e-2
    model.config.block_sparse_attention = dict(model.config.block_sparse_attention, backend="triton")
    save_patched(model, tmp_path / "patched")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched", dtype=torch.bfloat16)
    reloaded = reloaded.to("cuda").eval()
    again, want = run(reloaded, ids).float(), run(model, ids).float()
    assert ((again - want).norm() / want.norm()).item() < 1e-3  # the same computation (GPU matmuls may reorder)


def test_model_card_quotes_the_recipes_measured_fidelity():
    """The card says how the recipe's defaults measured without fine-tuning, or that nothing is recorded."""
    from hf_dilated.patching import render_model_card

    model = tiny("llama")
    patch(model, context_length=1024)
    card = render_model_card(model)
    assert "without fine-tuning" in card and load_recipe("llama").fidelity.split()[0] in card
    assert "smollm2_fidelity.json" in card
    assert "After a short fine-tune" in card and "finetune_recipe-smollm2-H100" in card
    assert "block_sparse_adaptive" not in card  # not the block-sparse fine-tune
    assert not load_recipe("qwen2").fidelity  # unmeasured families say so
    unpatch(model)
    patch(model, attention="block_sparse", context_length=1024)  # the block-sparse defaults' own measurement
    card = render_model_card(model)
    assert "block-sparse defaults without fine-tuning" in card and "smollm2_recipe_fidelity-cpu.json" in card
    assert "smollm2_fidelity.json" not in card
    assert "After a short fine-tune" in card and "block_sparse_adaptive" in card  # its own fine-tune result
    assert "1.019-1.022x" not in card  # not the dilated fine-tune
