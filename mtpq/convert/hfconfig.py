"""config.json as llama.cpp's converter reads it.

llama.cpp's ``ModelBase.load_hparams`` takes ``AutoConfig.from_pretrained(folder).to_dict()`` where transformers
knows the model type, and config.json as stored where it does not (remote code, new architectures). The
derived view carries keys a saved config may omit: ``layer_types`` from ``sliding_window_pattern`` or
``full_attention_interval``, ``mlp_layer_types`` from ``first_k_dense_replace``, ``rope_parameters`` beside
4.x's ``rope_scaling``, and every default of the config class. A converter reading the raw file refuses
or misreads such configs where llama.cpp converts them.

mtpq's view: the stored keys, plus every key transformers derives that the file lacks. Stored values win
where both have a key: transformers 5 renames some releases' keys into a form llama.cpp's converter cannot
read itself (Step3.5's ``num_attention_groups``), and a value the user wrote is what the user meant.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import InputError

log = logging.getLogger(__name__)
_unread: dict[str, str] = {}  # folder -> why transformers could not read its config.json (see tell_unread)
_told: set[tuple[str, str]] = set()  # (folder, reason) already said: a build plans one checkpoint twice


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own warnings off (tiny or unusual configs make it warn about values it does not use, and
    its tokenizer loader about model types it does not know): what mtpq has to say, it says itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(level)


def transformers_view(folder: Path) -> dict:
    """``AutoConfig.from_pretrained(folder).to_dict()`` without remote code, or {} where transformers does not
    know the model type or cannot read the file (as llama.cpp falls back to config.json; its reason is kept
    for :func:`tell_unread`)."""
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            view = AutoConfig.from_pretrained(str(folder), trust_remote_code=False).to_dict()
    except Exception as exc:  # noqa: BLE001 - any failure: the stored file is read as it is (and the user told)
        _unread[str(folder)] = _one_line(f"{type(exc).__name__}: {exc}")
        return {}
    _unread.pop(str(folder), None)
    return view


def tell_unread(folder: Path) -> None:
    """One warning line when transformers could not read ``folder``'s config.json, with its reason (llama.cpp's
    converter logs it too): said once the checkpoint has passed validation, so that a config mtpq refuses
    gets its one error line alone."""
    reason = _unread.get(str(folder))
    if reason is None or (str(folder), reason) in _told:
        return
    _told.add((str(folder), reason))
    log.warning(
        "%s: transformers cannot read it (%s); converting from config.json as written",
        Path(folder) / "config.json",
        reason,
    )


def _one_line(text: str, limit: int = 200) -> str:
    """An exception's text on one line, at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def merged(stored: dict, derived: dict) -> dict:
    """The stored config with the keys only ``derived`` has added, nested configs (``text_config``) likewise."""
    out = dict(stored)
    for key, value in derived.items():
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict) and key.endswith("_config"):
            out[key] = merged(out[key], value)
    return out


def hparams_view(folder: Path, stored: dict) -> dict:
    """What the families read: config.json plus transformers' derived keys (see the module docstring)."""
    return merged(stored, transformers_view(folder))


# key -> (kind, minimum). "int" values must be JSON integers (not bools), "number" ints or floats,
# "bool" true/false, "strs" a list of strings, "flags" a list of 0/1 (or true/false). null is allowed everywhere
# (families decide what null means).
_POSITIVE, _NON_NEGATIVE = 1, 0
CONFIG_SCHEMA: dict[str, tuple[str, float | None]] = {
    **{
        k: ("int", _POSITIVE)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "n_routed_experts",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "full_attention_interval",
            "n_group",
            "topk_group",
            # Step3.5 and MiMo-V2 spellings
            "num_attention_groups",
            "moe_num_experts",
            "moe_top_k",
            "share_expert_dim",
            "swa_num_attention_heads",
            "swa_num_key_value_heads",
            "swa_head_dim",
            "swa_v_head_dim",
            "sliding_window_size",
            # GLM-5's sparse-attention indexer
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
    },
    **{
        k: ("int", _NON_NEGATIVE)
        for k in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "mtp_num_hidden_layers")
    },
    **{k: ("number", None) for k in ("rms_norm_eps", "routed_scaling_factor", "partial_rotary_factor")},
    "rope_theta": ("numbers", None),  # Step3.5 gives one base per attention kind: [full, sliding, ...]
    **{
        k: ("bool", None)
        for k in (
            "tie_word_embeddings",
            "attention_bias",
            "use_qk_norm",
            "norm_topk_prob",
            "use_head_wise_attn_gate",
            "use_moe_router_bias",
            "add_swa_attention_sink_bias",
            "add_full_attention_sink_bias",
        )
    },
    "hybrid_layer_pattern": ("flags", None),  # MiMo-V2: per layer, 1 = sliding window
    **{k: ("strs", None) for k in ("architectures", "layer_types")},
    **{k: ("dict", None) for k in ("text_config", "rope_scaling", "rope_parameters", "quantization_config")},
}


def _type_problem(key: str, value, kind: str, minimum: float | None) -> str | None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and not is_int:
        return f"{key} must be an integer, got {value!r}"
    if kind == "number" and not (is_int or isinstance(value, float)):
        return f"{key} must be a number, got {value!r}"
    if kind == "numbers":
        items = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            return f"{key} must be a number (or a list of numbers), got {value!r}"
        return None
    if kind == "bool" and not isinstance(value, bool):
        return f"{key} must be true or false, got {value!r}"
    if kind == "strs" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return f"{key} must be a list of strings, got {value!r}"
    if kind == "flags" and not (
        isinstance(value, list) and all(v in (0, 1) and not isinstance(v, float) for v in value)
    ):
        return f"{key} must be a list of 0/1 flags, got {value!r}"
    if kind == "dict" and not isinstance(value, dict):
        return f"{key} must be a JSON object, got {value!r}"
    if minimum is not None and value < minimum:
        return f"{key} must be {'positive' if minimum > 0 else 'at least 0'}, got {value}"
    return None


def check_config(config, path: Path) -> None:
    """config.json's values have the types the converter relies on; the first problem is an InputError."""
    if not isinstance(config, dict):
        raise InputError(path, f"expected a JSON object, got {type(config).__name__}")
    tables = [("", config)]
    if isinstance(config.get("text_config"), dict):
        tables.append(("text_config.", config["text_config"]))
    for prefix, table in tables:
        for key, value in table.items():
            rule = CONFIG_SCHEMA.get(key)
            if rule is None or value is None:
                continue
            if (problem := _type_problem(prefix + key, value, *rule)) is not None:
                raise InputError(path, problem)
