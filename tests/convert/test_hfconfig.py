"""config.json read as llama.cpp's converter reads it: transformers' derived keys added, stored values kept."""

from __future__ import annotations

import json

from mtpq.convert.hfconfig import hparams_view, merged


def test_stored_values_win_and_derived_keys_fill_nested_configs_too():
    stored = {"a": 1, "text_config": {"x": 1}, "rope_scaling": {"factor": 2.0}}
    derived = {"a": 2, "b": 3, "text_config": {"x": 2, "y": 4}, "rope_scaling": {"factor": 4.0, "type": "yarn"}}
    assert merged(stored, derived) == {"a": 1, "b": 3, "text_config": {"x": 1, "y": 4}, "rope_scaling": {"factor": 2.0}}


def test_a_known_model_type_gains_what_transformers_derives(tmp_path):
    """A Qwen3-Next config saved without layer_types: transformers derives them from full_attention_interval
    (as llama.cpp's converter then sees them); keys transformers does not know stay."""
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "mtp_num_hidden_layers": 1,
        "a_release_only_key": [1, 2],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    view = hparams_view(tmp_path, cfg)
    assert view["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert view["a_release_only_key"] == [1, 2] and view["num_hidden_layers"] == 4


def test_an_unknown_model_type_is_read_as_stored(tmp_path):
    cfg = {"architectures": ["SomethingNewForCausalLM"], "model_type": "something_new", "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hparams_view(tmp_path, cfg) == cfg


def test_a_config_transformers_cannot_read_is_said_once_with_its_reason(tmp_path, caplog):
    """AutoConfig's failure is not silent (llama.cpp's converter logs it too): one warning naming the file and
    transformers' reason, then the stored keys are read as they are; a second read of the folder says nothing."""
    from mtpq.convert import hfconfig

    cfg = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "head_dim": "sixty-four",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="mtpq.convert.hfconfig"):
        assert hparams_view(tmp_path, cfg) == cfg
        hfconfig.tell_unread(tmp_path)
        assert hparams_view(tmp_path, cfg) == cfg
        hfconfig.tell_unread(tmp_path)
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith(f"{tmp_path / 'config.json'}: transformers cannot read it (") and "\n" not in text
    assert "'>' not supported between instances of 'str' and 'int'" in text  # transformers' own reason
    assert text.endswith("converting from config.json as written") and hfconfig.log.name == record.name


def test_an_unknown_model_type_is_said_when_the_conversion_goes_on(tmp_path, caplog):
    """A conversion whose model type transformers does not know: one warning (stderr, in the CLI's format), exit 0;
    a config mtpq refuses gets its one error line alone."""
    from tests.builders import tiny_bailingmoe3
    from tests.helpers.runcli import run_cli

    src = tiny_bailingmoe3.bailingmoe3(tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="mtpq.convert.hfconfig"):
        res = run_cli("convert", src, tmp_path / "out.gguf", "--quiet")
    assert res.exit_code == 0, res.output
    (record,) = [r for r in caplog.records if r.name == "mtpq.convert.hfconfig"]
    assert str(src / "config.json") in record.getMessage() and "bailing_moe_v3" in record.getMessage()
    caplog.clear()
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "four"}))
    with caplog.at_level("WARNING", logger="mtpq.convert.hfconfig"):
        res = run_cli("convert", src, tmp_path / "bad.gguf", "--quiet")
    assert res.exit_code == 2 and "num_hidden_layers" in res.output
    assert not [r for r in caplog.records if r.name == "mtpq.convert.hfconfig"]
