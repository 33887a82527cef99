"""DilatedAttentionConfig: validation, defaults, and its round trip through a Transformers config."""

import pytest
from transformers import LlamaConfig

from hf_dilated import DilatedAttentionConfig, default_branches
from hf_dilated.config import CONFIG_KEY


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(segment_lengths=[0, 8], dilation_rates=[1, 2]), "segment_lengths"),
        (dict(segment_lengths=[8, 16], dilation_rates=[1, -2]), "dilation_rates"),
        (dict(segment_lengths=[8, 15], dilation_rates=[1, 2]), "multiple of its dilation rate"),
        (dict(segment_lengths=[8, 16], dilation_rates=[2, 4]), "rate 1"),
        (dict(segment_lengths=[8, 16, 32], dilation_rates=[1, 2]), "same length"),
        (dict(segment_lengths=[16, 8], dilation_rates=[1, 2]), "sorted"),
        (dict(segment_lengths=[], dilation_rates=[]), "empty"),
        (dict(segment_lengths=8, dilation_rates=[1]), "segment_lengths"),
        (dict(segment_lengths=[8.0], dilation_rates=[1]), "segment_lengths"),
        (dict(segment_lengths=[8], dilation_rates=[1], backend="cuda"), "backend"),
        (dict(segment_lengths=[8], dilation_rates=[1], layers=[-1]), "layers"),
    ],
)
def test_invalid_config_raises_naming_the_argument(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        DilatedAttentionConfig(**kwargs)


def test_default_branches_follow_trained_context():
    assert default_branches(8192) == ([2048, 4096, 8192], [1, 2, 4])
    assert default_branches(32768) == ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert default_branches(1000) == ([128, 256, 512, 1024], [1, 2, 4, 8])
    assert default_branches(8192, 32768) == ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert default_branches(8192, 32768, undilated_branches=2) == ([2048, 4096, 8192, 16384, 32768], [1, 1, 2, 4, 8])
    assert default_branches(8192, undilated_branches=9) == ([2048, 4096, 8192], [1, 1, 1])
    with pytest.raises(ValueError, match="context_length"):
        default_branches(0)


def test_config_round_trip_through_model_config(tmp_path):
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=3, max_position_embeddings=4096)
    assert DilatedAttentionConfig.from_model_config(cfg).segment_lengths == [1024, 2048, 4096]  # default_branches: w_0 <= ctx / 4
    ours = DilatedAttentionConfig(segment_lengths=[64, 128], dilation_rates=[1, 2], layers=[2, 0], backend="torch")
    ours.save_to(cfg)
    cfg.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert CONFIG_KEY in text
    loaded = DilatedAttentionConfig.from_model_config(LlamaConfig.from_pretrained(tmp_path))
    assert loaded == ours
    assert loaded.layers == [0, 2]
    assert loaded.applies_to(2) and not loaded.applies_to(1)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown"):
        DilatedAttentionConfig.from_dict({"segment_lengths": [8], "dilation_rates": [1], "dilation": 3})


@pytest.mark.parametrize(
    "stored, fragment",
    [
        ({}, "segment_lengths and dilation_rates"),
        ({"segment_lengths": [8, 16]}, "dilation_rates"),
        ([8, 16], "dilated_attention must be a dict"),
        ("8,16", "dilated_attention must be a dict"),
        ({"segment_lengths": [8], "dilation_rates": [1], "layers": [7]}, "layers names layer 7.*2 layers"),
        ({"segment_lengths": [8], "dilation_rates": [1], "global_tokens": -1}, "global_tokens"),
    ],
)
def test_malformed_stored_config_names_the_field(stored, fragment):
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    setattr(cfg, CONFIG_KEY, stored)
    with pytest.raises(ValueError, match=fragment):
        DilatedAttentionConfig.from_model_config(cfg)
    with pytest.raises(ValueError, match=fragment):
        DilatedAttentionConfig.of(cfg)


def test_global_tokens_round_trip(tmp_path):
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    DilatedAttentionConfig(segment_lengths=[8], dilation_rates=[1], global_tokens=4).save_to(cfg)
    cfg.save_pretrained(tmp_path)
    assert DilatedAttentionConfig.from_model_config(LlamaConfig.from_pretrained(tmp_path)).global_tokens == 4
    with pytest.raises(ValueError, match="global_tokens"):
        DilatedAttentionConfig(segment_lengths=[8], dilation_rates=[1], global_tokens=True)


def test_parsed_once_per_model_config_until_the_stored_value_changes(tmp_path):
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    DilatedAttentionConfig(segment_lengths=[8], dilation_rates=[1]).save_to(cfg)
    first = DilatedAttentionConfig.of(cfg)
    assert DilatedAttentionConfig.of(cfg) is first  # no re-parse per layer per call
    getattr(cfg, CONFIG_KEY)["segment_lengths"] = [16]  # changed in place
    assert DilatedAttentionConfig.of(cfg).segment_lengths == [16]
    DilatedAttentionConfig(segment_lengths=[32], dilation_rates=[1]).save_to(cfg)  # replaced
    assert DilatedAttentionConfig.of(cfg).segment_lengths == [32]
    cfg.save_pretrained(tmp_path)
    assert "_PARSED" not in (tmp_path / "config.json").read_text()


def test_save_to_checks_layers_against_the_model():
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    with pytest.raises(ValueError, match="layers names layer 7"):
        DilatedAttentionConfig(segment_lengths=[8], dilation_rates=[1], layers=[0, 7]).save_to(cfg)
    assert getattr(cfg, CONFIG_KEY, None) is None  # nothing stored
