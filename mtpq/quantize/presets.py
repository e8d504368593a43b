"""llama-quantize's presets and its per-tensor choices, as data and small pure functions.

This mirrors ``llama_tensor_get_type`` / ``llama_tensor_get_type_impl`` in
llama.cpp's ``src/llama-quant.cpp`` for the presets mtpq has kernels for, with
or without an importance matrix (``has_imatrix``: Q4_0/Q5_0 give the first
eighth of ffn_down Q4_1/Q5_1, IQ4_NL/IQ4_XS stop bumping it to Q5_K; Q2_K_S
exists only with one). The reference quirks are kept on purpose:

- tensors are categorised by substring of their GGUF name, as llama.cpp does
  (``ffn_down`` also matches ``ffn_down_exps`` and ``ffn_down_shexp``);
- attn_v's "more bits" pattern counts attn_v tensors in file order (blocks by
  number, then name), including the MTP block's, and only those that reach the
  preset's mix (a ``--tensor-type`` match or ``--pure`` skips the count);
- ffn_down's layer is parsed from the name when the model has experts, and is
  the running count of ffn_down tensors otherwise; the layer total is
  ``block_count`` (trunk + MTP blocks).

tests/quantize/test_policy.py checks every choice against llama-quantize's own output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ..errors import InputError
from ..ggml.types import FLOAT_TYPES, WRITABLE_TYPES

T = GGMLQuantizationType
USER_TYPES = frozenset(WRITABLE_TYPES)  # what mtpq's kernels write: users may name any of these


@dataclass(frozen=True)
class Preset:
    name: str  # llama-quantize's spelling, e.g. "Q4_K_M"
    ftype: LlamaFileType  # written to general.file_type
    base: GGMLQuantizationType  # llama_ftype_get_default_type: the type most tensors get

    @property
    def is_float(self) -> bool:
        """F32/F16/BF16: llama-quantize applies no mix (and no --tensor-type) to these."""
        return self.base in FLOAT_TYPES


F = LlamaFileType
_PRESETS = [
    Preset("Q4_0", F.MOSTLY_Q4_0, T.Q4_0),
    Preset("Q4_1", F.MOSTLY_Q4_1, T.Q4_1),
    Preset("Q5_0", F.MOSTLY_Q5_0, T.Q5_0),
    Preset("Q5_1", F.MOSTLY_Q5_1, T.Q5_1),
    Preset("Q2_K", F.MOSTLY_Q2_K, T.Q2_K),
    Preset("Q2_K_S", F.MOSTLY_Q2_K_S, T.Q2_K),
    Preset("Q3_K_S", F.MOSTLY_Q3_K_S, T.Q3_K),
    Preset("Q3_K_M", F.MOSTLY_Q3_K_M, T.Q3_K),
    Preset("Q3_K_L", F.MOSTLY_Q3_K_L, T.Q3_K),
    Preset("Q4_K_S", F.MOSTLY_Q4_K_S, T.Q4_K),
    Preset("Q4_K_M", F.MOSTLY_Q4_K_M, T.Q4_K),
    Preset("Q5_K_S", F.MOSTLY_Q5_K_S, T.Q5_K),
    Preset("Q5_K_M", F.MOSTLY_Q5_K_M, T.Q5_K),
    Preset("Q6_K", F.MOSTLY_Q6_K, T.Q6_K),
    Preset("Q8_0", F.MOSTLY_Q8_0, T.Q8_0),
    Preset("IQ4_NL", F.MOSTLY_IQ4_NL, T.IQ4_NL),
    Preset("IQ4_XS", F.MOSTLY_IQ4_XS, T.IQ4_XS),
    # the i-quant presets: all but IQ3_S/IQ3_M need an importance matrix for most tensors
    Preset("IQ1_S", F.MOSTLY_IQ1_S, T.IQ1_S),
    Preset("IQ1_M", F.MOSTLY_IQ1_M, T.IQ1_M),
    Preset("IQ2_XXS", F.MOSTLY_IQ2_XXS, T.IQ2_XXS),
    Preset("IQ2_XS", F.MOSTLY_IQ2_XS, T.IQ2_XS),
    Preset("IQ2_S", F.MOSTLY_IQ2_S, T.IQ2_XS),
    Preset("IQ2_M", F.MOSTLY_IQ2_M, T.IQ2_S),
    Preset("IQ3_XXS", F.MOSTLY_IQ3_XXS, T.IQ3_XXS),
    Preset("IQ3_XS", F.MOSTLY_IQ3_XS, T.IQ3_S),
    Preset("IQ3_S", F.MOSTLY_IQ3_S, T.IQ3_S),
    Preset("IQ3_M", F.MOSTLY_IQ3_M, T.IQ3_S),
    Preset("Q1_0", F.MOSTLY_Q1_0, T.Q1_0),
    Preset("Q2_0", F.MOSTLY_Q2_0, T.Q2_0),
    Preset("TQ1_0", F.MOSTLY_TQ1_0, T.TQ1_0),
    Preset("TQ2_0", F.MOSTLY_TQ2_0, T.TQ2_0),
    Preset("MXFP4_MOE", F.MOSTLY_MXFP4_MOE, T.MXFP4),
    Preset("F16", F.MOSTLY_F16, T.F16),
    Preset("BF16", F.MOSTLY_BF16, T.BF16),
    Preset("F32", F.ALL_F32, T.F32),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # as llama-quantize spells them


def preset_named(name: str, option: str = "PRESET") -> Preset:
    """The preset called ``name`` (case-insensitive, llama-quantize's aliases accepted)."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    raise InputError(option, f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


# ggml types llama-quantize refuses to write without importance data ("the result will be garbage")
IMATRIX_ONLY_TYPES = frozenset(getattr(T, n) for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"))


def requires_imatrix(name: str, qtype: GGMLQuantizationType, preset: Preset) -> bool:
    """``tensor_requires_imatrix``: the very-low-bit i-quants, and Q2_K inside a Q2_K_S file;
    never token_embd or output."""
    if category(name) in (Category.TOKEN_EMBD, Category.OUTPUT):
        return False
    return qtype in IMATRIX_ONLY_TYPES or (qtype == T.Q2_K and preset.name == "Q2_K_S")


def type_named(name: str, option: str) -> GGMLQuantizationType:
    """A ggml type by llama.cpp's name (q8_0, q4_k, f16, bf16, ...), case-insensitive."""
    key = name.strip().upper()
    if key in T.__members__ and T[key] in USER_TYPES:
        return T[key]
    known = ", ".join(sorted(t.name.lower() for t in USER_TYPES))
    raise InputError(option, f"unknown or unsupported type {name!r}; choose one of {known}")


# ----------------------------------------------------------------------------- what llama-quantize never quantizes

_NEVER_QUANTIZED = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
    *(
        f"time_mix_{k}.weight"
        for k in (
            "first",
            "w0",
            "w1",
            "w2",
            "v0",
            "v1",
            "v2",
            "a0",
            "a1",
            "a2",
            "g1",
            "g2",
            "decay_w1",
            "decay_w2",
            "lerp_fused",
        )
    ),
)
_NEVER_QUANTIZED_GLM5_NEXT = (
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
)


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml's n_dims: trailing size-1 dims (GGUF order) do not count, so a [1, 4096] gate is 1-D."""
    ne = list(reversed(shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return len(ne)


def llama_quantizes(name: str, shape: tuple[int, ...], arch: str) -> bool:
    """``tensor_allows_quantization``: 2-D/3-D ``*weight`` tensors minus norms, routers and small tables."""
    if ggml_n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    if any(s in name for s in _NEVER_QUANTIZED) or name in ("position_embd.weight", "token_types.weight"):
        return False
    if arch == "glm5-next" and any(s in name for s in _NEVER_QUANTIZED_GLM5_NEXT):
        return False
    return True


# ----------------------------------------------------------------------------- llama-quantize's categories


class Category(str, Enum):
    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_QKV = "attn_qkv"
    ATTN_KV_B = "attn_kv_b"
    ATTN_V = "attn_v"
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


_SUBSTRING_CATEGORIES = [  # first match wins, in llama.cpp's order
    ("attn_qkv.weight", Category.ATTN_QKV),
    ("attn_kv_b.weight", Category.ATTN_KV_B),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
]
ATTN_V_LIKE = (Category.ATTN_V, Category.ATTN_QKV, Category.ATTN_KV_B)


def category(name: str) -> Category:
    """``tensor_get_category``: llama-quantize's broad category of a GGUF tensor name."""
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    for needle, cat in _SUBSTRING_CATEGORIES:
        if needle in name:
            return cat
    return Category.OTHER


def llama_order_key(name: str) -> tuple[int, str]:
    """llama.cpp's weight order: tensors outside blocks first, then by block number, then by name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


# ----------------------------------------------------------------------------- the model facts the mix reads


@dataclass(frozen=True)
class ModelFacts:
    arch: str
    n_layer_all: int  # block_count: trunk + MTP blocks
    n_expert: int
    n_head: int
    n_head_kv: int
    tied_embeddings: bool  # no output.weight: token_embd follows the output rules

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        # llama.cpp sets LLM_TYPE_70B for LLaMA with 80 layers and GQA; only that type changes attn_v
        return self.arch == "llama" and self.n_layer_all == 80 and self.n_head != self.n_head_kv


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's pattern: the first and last eighth of the layers, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def block_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot determine the layer of {name}")
    return int(m.group(1))


# 256-wide i-quants fall back to the 32-wide IQ4_NL, K-quants and the 1-2-bit types to the legacy 32-wide ones
_ROW_FALLBACK = {
    T.Q2_K: T.Q4_0,
    T.Q3_K: T.Q4_0,
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
    T.Q2_0: T.Q4_0,
    T.TQ1_0: T.Q4_0,
    T.TQ2_0: T.Q4_0,
    **{getattr(T, n): T.IQ4_NL for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")},
}


def row_fallback(qtype: GGMLQuantizationType, row: int) -> tuple[GGMLQuantizationType, str]:
    """``tensor_type_fallback``: a type whose block does not divide the row length falls back (a block wider
    than 32 without a fallback -- Q1_0 -- stops llama-quantize: ValueError)."""
    block = GGML_QUANT_SIZES[qtype][0]
    if row % block == 0:
        return qtype, ""
    if qtype not in _ROW_FALLBACK and block > 32:
        raise ValueError(
            f"a row of {row} is not a multiple of {qtype.name.lower()}'s block of {block}, and "
            f"llama-quantize has no fallback type for {qtype.name.lower()}"
        )
    fallback = _ROW_FALLBACK.get(qtype, qtype)
    if row % GGML_QUANT_SIZES[fallback][0] != 0:
        fallback = T.F16
    return fallback, f"row of {row} not a multiple of {block}: {qtype.name.lower()} -> {fallback.name.lower()}"


# ----------------------------------------------------------------------------- the mix (llama_tensor_get_type_impl)

Choice = tuple[GGMLQuantizationType, str]

# the very-low-bit presets llama.cpp mixes with their own branch (attn_v, ffn_down, attn_output only)
_IQ_LOW = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M")
# output (and tied token_embd) at q5_k instead of q6_k
_OUTPUT_Q5_K = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS")
_TOKEN_EMBD = {
    "IQ1_S": T.Q2_K,
    "IQ1_M": T.Q2_K,
    "IQ2_XXS": T.Q2_K,
    "IQ2_XS": T.Q2_K,
    "IQ2_S": T.IQ3_S,
    "IQ2_M": T.IQ3_S,
    "IQ3_XXS": T.IQ3_S,
    "TQ1_0": T.Q4_K,
    "TQ2_0": T.Q4_K,
    "Q2_0": T.Q4_K,
}
_MOE_FFN = (Category.FFN_UP, Category.FFN_GATE, Category.FFN_DOWN)  # bailingmoe3's experts in MXFP4_MOE
# attn_output of an 8-expert model goes to q5_k in these
_ATTN_OUTPUT_8_EXPERTS = (
    "Q2_K",
    "Q3_K_S",
    "Q3_K_M",
    "Q4_K_S",
    "Q4_K_M",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_XS",
    "IQ3_XXS",
    "IQ3_S",
    "IQ3_M",
)


def llama_mix(
    name: str,
    row: int,
    preset: Preset,
    m: ModelFacts,
    *,
    i_running: int,
    n_attn_v: int,
    output_tensor_type: GGMLQuantizationType | None = None,
    has_imatrix: bool = False,
    n_mat: int = 1,
) -> Choice:
    """The type llama-quantize's preset gives one quantizable tensor, and why.

    ``i_running`` is llama.cpp's running count for the tensor's category
    (qs.i_attention_wv, qs.i_ffn_down, qs.i_ffn_gate, qs.i_ffn_up): how many
    tensors of that category reached the mix before this one; ``row`` is the
    row length (GGUF ne[0]); ``n_mat`` GGUF's ne[2] (the experts of a stack).
    """
    p, base, cat = preset.name, preset.base, category(name)

    if m.arch == "glm5-next" and any(s in name for s in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        return T.Q8_0, "glm5-next keeps this at q8_0"

    if cat is Category.OUTPUT or (m.tied_embeddings and cat is Category.TOKEN_EMBD):
        what = "output" if cat is Category.OUTPUT else "token_embd (tied to output)"
        if output_tensor_type is not None:
            return output_tensor_type, f"{what}: --output-tensor-type"
        if p == "MXFP4_MOE":
            return T.Q8_0, f"{what}: q8_0 in {p}"
        if m.arch == "falcon" or row % GGML_QUANT_SIZES[base][0] != 0:
            return T.Q8_0, f"{what}: q8_0 (row does not fit {base.name.lower()})"
        if p in _OUTPUT_Q5_K:
            return T.Q5_K, f"{what}: q5_k in {p}"
        if base != T.Q8_0:
            return T.Q6_K, f"{what}: q6_k"
        return base, f"{what}: {p} base type"

    if p == "MXFP4_MOE":
        if n_mat > 1 and (m.arch != "bailingmoe3" or cat in _MOE_FFN):
            return T.MXFP4, "expert stack: mxfp4 in MXFP4_MOE"
        return T.Q8_0, "not an expert stack: q8_0 in MXFP4_MOE"

    if cat is Category.TOKEN_EMBD:
        if p in _TOKEN_EMBD:
            return _TOKEN_EMBD[p], f"token_embd in {p}"
        return base, f"{p} base type"

    if p in _IQ_LOW:
        return _low_bit_mix(name, p, base, cat, m, i_running)
    return _mix(name, p, base, cat, m, i_running, n_attn_v, has_imatrix)


def _low_bit_mix(name: str, p: str, base: GGMLQuantizationType, cat: Category, m: ModelFacts, i_running: int) -> Choice:
    """IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS/IQ2_S/IQ2_M: llama.cpp's separate branch for these."""
    iq2_sm = p in ("IQ2_S", "IQ2_M")
    if cat in ATTN_V_LIKE:
        if m.n_gqa >= 4 or m.n_expert >= 4:
            return T.Q4_K, "attn_v with GQA >= 4 or >= 4 experts"
        return (T.IQ3_S if iq2_sm else T.Q2_K), f"attn_v in {p}"
    if m.n_expert == 8 and cat is Category.ATTN_K:
        return T.Q4_K, "attn_k in an 8-expert model"
    if cat is Category.FFN_DOWN:
        # llama.cpp compares the running count of ffn_down tensors (experts and shared experts count
        # one each) with an eighth of the layers, here even in MoE models
        if i_running < m.n_layer_all // 8:
            return (T.IQ3_S if iq2_sm else T.Q2_K), f"ffn_down #{i_running} < {m.n_layer_all // 8}"
    if cat is Category.ATTN_OUTPUT:
        if m.n_expert == 8:
            return T.Q5_K, "attn_output in an 8-expert model"
        if p in ("IQ1_S", "IQ1_M"):
            return T.IQ2_XXS, f"attn_output in {p}"
        if iq2_sm:
            return T.IQ3_S, f"attn_output in {p}"
    return base, f"{p} base type"


def _mix(
    name: str,
    p: str,
    base: GGMLQuantizationType,
    cat: Category,
    m: ModelFacts,
    i_running: int,
    n_attn_v: int,
    has_imatrix: bool,
) -> Choice:
    """Every other quantized preset (llama.cpp's main chain)."""
    falcon = m.arch == "falcon"
    if cat in ATTN_V_LIKE:
        new, why = base, f"{p} base type"
        if p == "Q2_K":
            new, why = (T.Q4_K, "attn_v with GQA >= 4") if m.n_gqa >= 4 else (T.Q3_K, "attn_v in Q2_K")
        elif p == "Q2_K_S" and m.n_gqa >= 4:
            new, why = T.Q4_K, "attn_v with GQA >= 4"
        elif p == "IQ3_XXS":
            if m.n_gqa >= 4:
                new, why = T.Q4_K, "attn_v with GQA >= 4"
            else:
                new, why = (T.IQ3_XXS, "attn_v in IQ3_XXS") if has_imatrix else (T.IQ3_S, "attn_v (no imatrix)")
        elif p in ("IQ3_XS", "IQ3_S") and m.n_gqa >= 4:
            new, why = T.Q4_K, "attn_v with GQA >= 4"
        elif p == "IQ3_M":
            new, why = T.Q4_K, "attn_v in IQ3_M"
        elif p == "Q3_K_M":
            new, why = (T.Q5_K, f"attn_v #{i_running} < 2") if i_running < 2 else (T.Q4_K, "attn_v in Q3_K_M")
        elif p == "Q3_K_L":
            new, why = T.Q5_K, "attn_v in Q3_K_L"
        elif p in ("IQ4_NL", "IQ4_XS") and m.n_gqa >= 4:
            new, why = T.Q5_K, "attn_v with GQA >= 4"
        elif p in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_running, n_attn_v):
            new, why = T.Q6_K, f"attn_v #{i_running} of {n_attn_v}: a more-bits layer"
        elif p == "Q4_K_S" and i_running < 4:
            new, why = T.Q5_K, f"attn_v #{i_running} < 4"
        if m.is_70b and new in (T.Q3_K, T.Q4_K):
            new, why = T.Q5_K, "attn_v in a 70B model"
        if m.n_expert == 8:
            new, why = T.Q8_0, "attn_v in an 8-expert model"
        return new, why

    if cat in (Category.ATTN_K, Category.ATTN_Q):
        if cat is Category.ATTN_K and m.n_expert == 8:
            return T.Q8_0, "attn_k in an 8-expert model"
        if p == "IQ3_XS":
            return T.IQ3_XXS, f"{cat.value} in IQ3_XS"
        if p == "IQ3_XXS":
            return T.IQ2_S, f"{cat.value} in IQ3_XXS"
        return base, f"{p} base type"

    if cat is Category.FFN_DOWN:
        # with experts the layer comes from the name (experts need not be consecutive), else the running count
        i, n = (block_of(name) if m.n_expert > 1 else i_running), m.n_layer_all
        more = use_more_bits(i, n)
        where = f"ffn_down of layer {i}/{n}"
        if p == "Q2_K":
            return T.Q3_K, "ffn_down in Q2_K"
        if p == "Q2_K_S":
            return (T.Q4_K, f"{where}: first eighth") if i < n // 8 else (base, f"{p} base type")
        if p == "IQ3_XXS" and not has_imatrix:
            return (T.Q4_K, f"{where}: first eighth (no imatrix)") if i < n // 8 else (T.Q3_K, f"{where} (no imatrix)")
        if p == "Q3_K_M":
            if i < n // 16:
                return T.Q5_K, f"{where}: first sixteenth"
            if not falcon or more:
                return T.Q4_K, f"{where} in Q3_K_M"
            return T.Q3_K, f"{where} in Q3_K_M (falcon)"
        if p == "IQ3_M" and (i < n // 8 or (m.n_expert == 8 and more)):
            return T.Q4_K, f"{where}: first eighth or an 8-expert more-bits layer"
        if p == "Q3_K_L":
            return (T.Q4_K if falcon else T.Q5_K), "ffn_down in Q3_K_L"
        if p == "Q4_K_M":
            if falcon:
                if i < n // 16:
                    return T.Q6_K, f"{where}: first sixteenth (falcon)"
                return (T.Q5_K, f"{where}: a more-bits layer (falcon)") if more else (base, f"{p} base type")
            if more:
                return T.Q6_K, f"{where}: a more-bits layer"
        if p in ("IQ4_NL", "IQ4_XS") and i < n // 8 and not has_imatrix:  # only without an imatrix
            return T.Q5_K, f"{where}: first eighth (no imatrix)"
        if p == "Q5_K_M" and more:
            return T.Q6_K, f"{where}: a more-bits layer"
        if p == "Q4_K_S" and not falcon and i < n // 8:
            return T.Q5_K, f"{where}: first eighth"
        if p in ("Q4_0", "Q5_0") and has_imatrix and i < n // 8:  # llama.cpp's guard, with an imatrix only
            return (T.Q4_1 if p == "Q4_0" else T.Q5_1), f"{where}: first eighth (with imatrix)"
        return base, f"{p} base type"

    if cat is Category.ATTN_OUTPUT:
        if not falcon:
            if m.n_expert == 8:
                if p in _ATTN_OUTPUT_8_EXPERTS:
                    return T.Q5_K, "attn_output in an 8-expert model"
            else:
                bump = {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(p)
                if bump is not None:
                    return bump, f"attn_output in {p}"
        elif p == "Q3_K_L":
            return T.Q4_K, "attn_output in Q3_K_L (falcon)"

    if cat in (Category.FFN_GATE, Category.FFN_UP) and p == "IQ3_XS":
        i, n = (block_of(name) if m.n_expert > 1 else i_running), m.n_layer_all
        if n // 8 <= i < 7 * n // 8:
            return T.IQ3_XXS, f"{cat.value} of layer {i}/{n}: the middle layers in IQ3_XS"

    return base, f"{p} base type"
