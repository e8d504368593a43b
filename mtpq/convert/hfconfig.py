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
from pathlib import Path


def transformers_view(folder: Path) -> dict:
    """``AutoConfig.from_pretrained(folder).to_dict()`` without remote code, or {} where transformers does not
    know the model type or cannot read the file (as llama.cpp falls back to config.json)."""
    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # tiny or unusual configs make it warn about values it does not use
    logging.disable(logging.WARNING)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False).to_dict()
    except Exception:  # noqa: BLE001 - any failure means "not known": the stored file is read as it is
        return {}
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(level)


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
