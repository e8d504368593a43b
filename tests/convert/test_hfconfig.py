"""config.json read as llama.cpp's converter reads it: transformers' derived keys added, stored values kept."""

from __future__ import annotations

import json

from mtpq.convert.hfconfig import hparams_view, merged


def test_stored_values_win_and_derived_keys_fill_nested_configs_too():
    stored = {"a": 1, "text_config": {"x": 1}, "rope_scaling": {"factor": 2.0}}
    derived = {"a": 2, "b": 3, "text_config": {"x": 2, "y": 4}, "rope_scaling": {"factor": 4.0, "type": "yarn"}}
    assert merged(stored, derived) == {"a": 1, "b": 3, "text_config": {"x": 1, "y": 4},
                                       "rope_scaling": {"factor": 2.0}}


def test_a_known_model_type_gains_what_transformers_derives(tmp_path):
    """A Qwen3-Next config saved without layer_types: transformers derives them from full_attention_interval
    (as llama.cpp's converter then sees them); keys transformers does not know stay."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
           "full_attention_interval": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 300, "mtp_num_hidden_layers": 1, "a_release_only_key": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    view = hparams_view(tmp_path, cfg)
    assert view["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert view["a_release_only_key"] == [1, 2] and view["num_hidden_layers"] == 4


def test_an_unknown_model_type_is_read_as_stored(tmp_path):
    cfg = {"architectures": ["SomethingNewForCausalLM"], "model_type": "something_new", "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hparams_view(tmp_path, cfg) == cfg
