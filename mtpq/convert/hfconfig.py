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
    log.warning("%s: transformers cannot read it (%s); converting from config.json as written",
                Path(folder) / "config.json", reason)


def _one_line(text: str, limit: int = 200) -> str:
    """An exception's text on one line, at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


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
