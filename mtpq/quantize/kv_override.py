"""``--override-kv KEY=TYPE:VALUE``: llama-quantize's metadata overrides.

As in llama-quantize (``string_parse_kv_override`` and ``llama_model_quantize_impl``):

- TYPE is ``int``, ``float``, ``bool`` (``true``/``false``) or ``str`` (at most
  127 characters); the value is written as GGUF UINT32, FLOAT32, BOOL or STRING
  whatever type the key had (llama.cpp writes every ``int`` as uint32);
- the override is what the model loader reads too, so an overridden hparam
  (``expert_count``, ``block_count``, ``attention.head_count_kv`` ...) changes
  the per-tensor choices the same way;
- it wins over ``general.file_type`` and ``general.quantization_version``; the
  imatrix keys and ``--prune-layers``' block count win over it.

Where llama-quantize writes a broken file, the value is refused (exit 2) instead:
an ``int`` outside uint32 (llama.cpp writes its absolute value, truncated), a
value that does not parse (``atol``/``atof`` read ``12abc`` as 12), a TYPE that is
not the one the key already has (the loader then ignores the override while the
file keeps it), arrays, and the keys the writer owns (``general.architecture``,
``general.alignment``, ``split.*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from gguf import GGUFValueType

from ..errors import InputError
from ..gguf_io.files import INT_TYPES
from ..tensors import Plan

OPTION = "--override-kv"
# TYPE -> (GGUF type written, the GGUF types a key must already have to take it)
_KINDS = {
    "int": (GGUFValueType.UINT32, frozenset(INT_TYPES)),
    "float": (GGUFValueType.FLOAT32, frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})),
    "bool": (GGUFValueType.BOOL, frozenset({GGUFValueType.BOOL})),
    "str": (GGUFValueType.STRING, frozenset({GGUFValueType.STRING})),
}
_OWNED_BY_WRITER = ("general.architecture", "general.alignment")
MAX_KEY, MAX_STR = 127, 127  # llama_model_kv_override's char key[128] and val_str[128]


@dataclass(frozen=True)
class KvOverride:
    text: str  # as the user wrote it
    key: str
    kind: str  # int | float | bool | str
    value: Union[int, float, bool, str]

    @property
    def gguf_type(self) -> GGUFValueType:
        return _KINDS[self.kind][0]


def parse_kv_override(text: str) -> KvOverride:
    """``KEY=TYPE:VALUE`` -> a checked :class:`KvOverride` (InputError naming ``--override-kv`` otherwise)."""
    key, eq, rest = text.partition("=")
    kind, colon, raw = rest.partition(":")
    if not eq or not key or not colon or kind not in _KINDS:
        raise InputError(
            OPTION,
            f"{text!r} is not KEY=TYPE:VALUE with TYPE int, float, bool or str (e.g. 'general.name=str:My model')",
        )
    if len(key) > MAX_KEY:
        raise InputError(OPTION, f"key {key[:40]!r}... is longer than llama.cpp's {MAX_KEY} characters")
    if key in _OWNED_BY_WRITER or key.startswith("split."):
        raise InputError(OPTION, f"{key} is written by mtpq itself and cannot be overridden")
    return KvOverride(text, key, kind, _parse_value(text, kind, raw))


def _parse_value(text: str, kind: str, raw: str) -> Union[int, float, bool, str]:
    if kind == "str":
        if len(raw) > MAX_STR:
            raise InputError(OPTION, f"{text[:60]!r}...: a str value has at most {MAX_STR} characters (llama.cpp)")
        return raw
    if kind == "bool":
        if raw not in ("true", "false"):
            raise InputError(OPTION, f"{text!r}: a bool is true or false")
        return raw == "true"
    if kind == "int":
        try:
            value = int(raw, 10)
        except ValueError:
            raise InputError(OPTION, f"{text!r}: {raw!r} is not an integer") from None
        if not 0 <= value < 2**32:
            raise InputError(OPTION, f"{text!r}: an int is written as uint32 (llama.cpp): 0 to {2**32 - 1}")
        return value
    try:
        value = float(raw)
    except ValueError:
        raise InputError(OPTION, f"{text!r}: {raw!r} is not a number") from None
    if math.isfinite(value) and abs(value) > 3.4028234663852886e38:
        raise InputError(OPTION, f"{text!r}: out of float32's range")
    return value


def parse_kv_overrides(items: Sequence[str]) -> tuple[KvOverride, ...]:
    return tuple(parse_kv_override(t) for t in items)


def check_against(plan: Plan, overrides: Sequence[KvOverride]) -> None:
    """Refuse an override whose TYPE is not the kind of value its key already holds."""
    for o in overrides:
        have = plan.kv.get(o.key)
        if have is None:
            continue
        if have.type == GGUFValueType.ARRAY:
            raise InputError(OPTION, f"{o.key} is an array; --override-kv sets single values only")
        if have.type not in _KINDS[o.kind][1]:
            raise InputError(
                OPTION,
                f"{o.text!r}: {o.key} holds a {have.type.name.lower()}, not {o.kind} "
                "(llama.cpp would ignore the override when loading, yet write it)",
            )


def apply_kv_overrides(plan: Plan, overrides: Sequence[KvOverride], skip: Sequence[str] = ()) -> None:
    """Set every override on ``plan`` (checked first), in order: a later one of the same key wins."""
    check_against(plan, overrides)
    for o in overrides:
        if o.key not in skip:
            plan.set_kv(o.key, o.value, o.gguf_type)
