"""The types mtpq writes, named without loading the kernels (the CLI checks a user's type names at start-up;
:mod:`.registry` holds one record for each, in this order), and gguf-py's enums, completed: PyPI's gguf 0.19 lacks
the type ``Q2_0`` (42, 64 values in 18 bytes) and the
file type ``MOSTLY_Q2_0`` (41), which llama-quantize writes and llama.cpp reads. They are added to
``GGMLQuantizationType`` (with ``GGML_QUANT_SIZES``) and ``LlamaFileType`` when missing, so that gguf-py's reader
and writer take such tensors; a gguf-py that has them is left alone."""

from __future__ import annotations

from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


def _add_member(enum: type[IntEnum], name: str, value: int):
    if hasattr(enum, name):
        return getattr(enum, name)
    member = int.__new__(enum, value)
    member._name_, member._value_ = name, value
    enum._member_map_[name] = member
    enum._value2member_map_[value] = member
    enum._member_names_.append(name)
    type.__setattr__(enum, name, member)
    return member


GGML_QUANT_SIZES.setdefault(_add_member(GGMLQuantizationType, "Q2_0", 42), (64, 18))
_add_member(LlamaFileType, "MOSTLY_Q2_0", 41)

T = GGMLQuantizationType
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})  # the types stored as floats, never quantized
WRITABLE_TYPES: tuple[GGMLQuantizationType, ...] = tuple(
    T[name]
    for name in "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS IQ2_XXS IQ2_XS IQ2_S "
    "IQ3_XXS IQ3_S IQ1_S IQ1_M TQ1_0 TQ2_0 Q1_0 Q2_0 MXFP4".split()
)
