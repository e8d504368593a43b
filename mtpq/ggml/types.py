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
WRITABLE_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32,
    T.F16,
    T.BF16,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ4_NL,
    T.IQ4_XS,
    T.IQ2_XXS,
    T.IQ2_XS,
    T.IQ2_S,
    T.IQ3_XXS,
    T.IQ3_S,
    T.IQ1_S,
    T.IQ1_M,
    T.TQ1_0,
    T.TQ2_0,
    T.Q1_0,
    T.Q2_0,
    T.MXFP4,
)
