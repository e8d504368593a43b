"""DeepSeek-V4 (``DeepseekV4ForCausalLM``: DeepSeek-V4-Flash, -Pro) -> GGUF arch ``deepseek4``.

Stored in DeepSeek's own names (``embed``, ``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, the MTP
layer under ``mtp.0.``) and encodings, which the release mixes: FP8 projections (e4m3 ``weight`` + a UE8M0
``scale`` per 128x128 tile), FP4 routed experts (E2M1 codes two per byte + a UE8M0 ``scale`` per 32),
BF16 embeddings / norms / routers / compressors, F32 hyper-connections / sinks / ``ape`` / router biases, and
the hash layers' I64 ``tid2eid`` routing tables. The GGUF is what llama.cpp's converter (conversion/deepseek.py,
``DeepseekV4Model``) writes, tensor for tensor:

- FP8 weights dequantized, written Q8_0; the FP4 experts' bits moved into ggml MXFP4 (general.file_type
  MOSTLY_MXFP4_MOE); BF16 matrices kept BF16 and F32 sources F32, whatever the outtype; ``tid2eid`` as I32;
- every layer: multi-query attention with a low-rank q (``attn_q_a/b``), one shared KV head (``attn_kv``),
  a grouped low-rank output (``attn_output_a/b``), per-head sinks; per ``compress_ratios[i]`` a compressor
  (ratio 4 or 128) and, for ratio 4, the lightning indexer with its own compressor; hyper-connections
  (``hc_attn_*``, ``hc_ffn_*``; ``output_hc_*`` before the head); MoE with sqrt-softplus routing, by
  ``tid2eid`` in the first ``num_hash_layers`` layers, by score + ``exp_probs_b`` after;
- the MTP layer ``mtp.i`` is block N + i: a full layer, ``e_proj`` | ``h_proj`` concatenated into
  ``nextn.eh_proj`` (Q8_0), ``enorm``/``hnorm``, ``norm`` -> ``nextn.shared_head_norm``, and its own output
  hyper-connection ``hc_head_*``.

That last one decides the layout: llama.cpp's MTP graph mixes the head's streams with the file's top-level
``output_hc_*``, the name the trunk's own output hyper-connection takes, so one GGUF cannot hold both. llama.cpp
reads the head from a file of its own (its converter's ``--mtp``: the MTP block, ``token_embd``,
``output_norm``, ``output`` and the head's ``output_hc_*``) beside the trunk (its default, or ``--no-mtp``).
mtpq writes the same two files (``--mtp-only``, ``--no-mtp``) and refuses to write one file that would keep
the head with the trunk's hyper-connection in place of its own.

DeepSeek-V4-Flash-0731 stores DSpark draft stages under ``mtp.*`` instead: its trunk converts with ``--no-mtp``
(llama.cpp's default does the same), the stages are refused with the reason (llama.cpp writes them into a separate
``dflash`` file with its ``--dspark``, not an MTP head).

The pip ``gguf`` (0.19) mtpq depends on predates ``deepseek4``: tensor names and metadata keys are written out
below as llama.cpp's gguf-py spells them (constants.py ``TENSOR_NAMES`` / ``Keys``).
"""

from __future__ import annotations

import re
from typing import Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from ...errors import InputError
from ...tensors import mtp_only_keep
from .. import validate as V
from ..base import (
    BlockSelection,
    ConvertFamily,
    Emit,
    add_hparams,
    check_unused,
    layer_of,
    mxfp4_stack,
)
from ..checkpoint import fp8_scaled
from ..validate import Expected

_HC_HEAD = {
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
_TOP = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    **_HC_HEAD,
}
# name inside ``layers.N.`` / ``mtp.i.`` -> GGUF name inside ``blk.N.``
_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{w}_{x}": f"hc_{w}_{x}.weight" for w in ("attn", "ffn") for x in ("fn", "base", "scale")},
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    **{
        f"attn.compressor.{x}": f"attn_compressor_{y}.weight"
        for x, y in (("ape", "ape"), ("wkv.weight", "kv"), ("wgate.weight", "gate"), ("norm.weight", "norm"))
    },
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    **{
        f"attn.indexer.compressor.{x}": f"indexer_compressor_{y}.weight"
        for x, y in (("ape", "ape"), ("wkv.weight", "kv"), ("wgate.weight", "gate"), ("norm.weight", "norm"))
    },
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
_NEXTN = {
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_EXPS = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}
# a head-only file keeps the head's own output hyper-connection (tensors.mtp_only_keep)
assert mtp_only_keep("deepseek4")[-3:] == tuple(_HC_HEAD.values())

# metadata keys gguf 0.19's GGUFWriter has no helper for
_KEYS = {
    "o_groups": ("{arch}.attention.output_group_count", "uint32"),
    "o_lora_rank": ("{arch}.attention.output_lora_rank", "uint32"),
    "compress_rope_theta": ("{arch}.attention.compress_rope_freq_base", "float32"),
    "hc_mult": ("{arch}.hyper_connection.count", "uint32"),
    "hc_sinkhorn_iters": ("{arch}.hyper_connection.sinkhorn_iterations", "uint32"),
    "hc_eps": ("{arch}.hyper_connection.epsilon", "float32"),
    "num_hash_layers": ("{arch}.hash_layer_count", "uint32"),
}
COMPRESS_RATIOS_KEY = "{arch}.attention.compress_ratios"
_INTS = (
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "qk_rope_head_dim",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "sliding_window",
    "hc_mult",
    "hc_sinkhorn_iters",
)
_REQUIRED = (
    *_INTS,
    "num_hash_layers",
    "compress_ratios",
    "compress_rope_theta",
    "hc_eps",
    "swiglu_limit",
    "routed_scaling_factor",
    "norm_topk_prob",
)
_FP8_TILE = 128  # llama.cpp's converter dequantizes 128x128 tiles, whatever weight_block_size says
_FP4_GROUP = 32  # values per E8M0 scale of an FP4 expert (ggml's MXFP4 block)
_SCALE_DTYPES = ("F8_E8M0", "U8")  # UE8M0 exponents, as llama.cpp reads them


class DeepseekV4(ConvertFamily):
    hf_architectures = ("DeepseekV4ForCausalLM",)
    arch = "deepseek4"
    required_hparams = ConvertFamily.required_hparams + _REQUIRED
    f32_kinds = ConvertFamily.f32_kinds + ("indexer.proj",)  # llama.cpp's converter keeps DSA indexer weights F32

    def __init__(self, ckpt):
        super().__init__(ckpt)
        hp, cfg = self.hparams, ckpt.folder / "config.json"
        for key in _INTS:
            if not isinstance(hp[key], int) or isinstance(hp[key], bool) or hp[key] <= 0:
                raise InputError(cfg, f"{key} must be a positive integer, got {hp[key]!r}")
        n_all = self.n_trunk + self.n_mtp
        ratios = hp["compress_ratios"]
        if not (isinstance(ratios, list) and len(ratios) >= n_all and all(r in (0, 4, 128) for r in ratios)):
            raise InputError(
                cfg,
                f"compress_ratios must give 0, 4 or 128 for each of the {n_all} layers (MTP included), got {ratios!r}",
            )
        if not isinstance(hp["num_hash_layers"], int) or not 0 <= hp["num_hash_layers"] <= self.n_trunk:
            raise InputError(cfg, f"num_hash_layers must be 0..{self.n_trunk}, got {hp['num_hash_layers']!r}")
        if hp.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":  # llama.cpp's deepseek4 loader: the only one
            raise InputError(cfg, f"scoring_func {hp['scoring_func']!r}: llama.cpp's deepseek4 runs sqrtsoftplus only")
        self.mtp_layers = sorted({i for n in ckpt.names() if (i := layer_of(n, "mtp.")) is not None})
        # DeepSeek-V4-Flash-0731 stores DSpark draft stages under mtp.i instead of the MTP layer
        self.dspark = any(n.startswith("mtp.") and ".main_proj." in n for n in ckpt.stored)
        # FP8 weight -> its scale, FP4 expert -> its scale (checked now, before anything is written)
        self.fp8: dict[str, str] = {}
        self.fp4: dict[str, str] = {}
        for name in ckpt.names():
            st = ckpt.stored[name]
            if st.dtype == "F8_E4M3":
                self.fp8[name] = self._scale_of(
                    name, (-(-st.shape[0] // _FP8_TILE), -(-st.shape[1] // _FP8_TILE)) if len(st.shape) == 2 else None
                )
            elif st.dtype in ("I8", "U8") and _EXPERT.match(name.split(".", 2)[-1]):
                self.fp4[name] = self._scale_of(
                    name,
                    (st.shape[0], 2 * st.shape[1] // _FP4_GROUP)
                    if len(st.shape) == 2 and (2 * st.shape[1]) % _FP4_GROUP == 0
                    else None,
                )
        claimed = set(self.fp8.values()) | set(self.fp4.values())
        for name, st in ckpt.stored.items():
            if name.endswith(".scale") and name not in claimed:
                weight = name.removesuffix(".scale") + ".weight"
                what = ckpt.stored[weight].dtype if weight in ckpt.stored else "not stored"
                raise InputError(
                    st.file,
                    f"{name} scales {weight}, which is {what}: expected F8_E4M3 (FP8) or I8 (FP4 experts), as released",
                )

    def _scale_of(self, name: str, want: tuple[int, ...] | None) -> str:
        st, scale_name = self.ckpt.stored[name], name.removesuffix(".weight") + ".scale"
        if want is None:
            raise InputError(
                st.file,
                f"{name} is {st.dtype} {list(st.shape)}: expected a matrix"
                + (f" of rows of a multiple of {_FP4_GROUP // 2} bytes" if st.dtype != "F8_E4M3" else ""),
            )
        scale = self.ckpt.stored.get(scale_name)
        if scale is None:
            raise InputError(st.file, f"{st.dtype} tensor {name} has no {scale_name}")
        if scale.dtype not in _SCALE_DTYPES or tuple(scale.shape) != want:
            raise InputError(
                scale.file,
                f"{scale_name} is {scale.dtype} {list(scale.shape)}, expected F8_E8M0 "
                f"{list(want)} (UE8M0 scales of {name} {list(st.shape)})",
            )
        return scale_name

    @property
    def own_encodings(self) -> frozenset[str]:
        tid2eid = {n for n in self.ckpt.names() if n.endswith(".ffn.gate.tid2eid")}
        return (
            frozenset(self.fp8)
            | frozenset(self.fp8.values())
            | frozenset(self.fp4)
            | frozenset(self.fp4.values())
            | tid2eid
        )

    # -- what config.json implies -------------------------------------------------------

    def logical_names(self) -> list[str]:
        scales = set(self.fp8.values()) | set(self.fp4.values())  # checked with their weights
        return [n for n in super().logical_names() if n not in scales]

    def logical_shape(self, hf_name: str) -> tuple[int, ...]:
        if hf_name in self.fp4:  # two E2M1 codes per byte
            rows, packed = self.ckpt.shape(hf_name)
            return rows, 2 * packed
        return super().logical_shape(hf_name)

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        hp = self.hparams
        h, v = hp["hidden_size"], hp["vocab_size"]
        yield from (Expected("embed.weight", (v, h)), Expected("norm.weight", (h,)), Expected("head.weight", (v, h)))
        yield from self._hc_head("")
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            p = self._prefix(bid)
            yield from self._layer(p, bid)
            if bid >= self.n_trunk:
                yield from (Expected(p + "e_proj.weight", (h, h)), Expected(p + "h_proj.weight", (h, h)))
                yield from V.norms(p, h, "enorm", "hnorm", "norm")
                yield from self._hc_head(p)

    def _hc_head(self, p: str) -> Iterator[Expected]:
        hc, h = self.hparams["hc_mult"], self.hparams["hidden_size"]
        yield from (
            Expected(p + "hc_head_fn", (hc, hc * h)),
            Expected(p + "hc_head_base", (hc,)),
            Expected(p + "hc_head_scale", (1,)),
        )

    def _layer(self, p: str, bid: int) -> Iterator[Expected]:
        """One layer as inference/model.py's Block builds it (Attention, Compressor, Indexer, Gate, MoE)."""
        hp = self.hparams
        h, hc, nh, d, ql = (
            hp["hidden_size"],
            hp["hc_mult"],
            hp["num_attention_heads"],
            hp["head_dim"],
            hp["q_lora_rank"],
        )
        og, ol, ff = hp["o_groups"], hp["o_lora_rank"], hp["moe_intermediate_size"]
        mix = (2 + hc) * hc  # pre, post and the hc x hc residual mix
        yield from V.norms(p, h, "attn_norm", "ffn_norm")
        for w in ("attn", "ffn"):
            yield from (
                Expected(f"{p}hc_{w}_fn", (mix, hc * h)),
                Expected(f"{p}hc_{w}_base", (mix,)),
                Expected(f"{p}hc_{w}_scale", (3,)),
            )
        a = p + "attn."
        yield from (
            Expected(a + "attn_sink", (nh,)),
            Expected(a + "wq_a.weight", (ql, h)),
            Expected(a + "q_norm.weight", (ql,)),
            Expected(a + "wq_b.weight", (nh * d, ql)),
            Expected(a + "wkv.weight", (d, h)),
            Expected(a + "kv_norm.weight", (d,)),
            Expected(a + "wo_a.weight", (og * ol, nh * d // og)),
            Expected(a + "wo_b.weight", (h, og * ol)),
        )
        ratio = hp["compress_ratios"][bid]
        if ratio:
            yield from self._compressor(a + "compressor.", ratio, d)
        if ratio == 4:
            n, di = hp["index_n_heads"], hp["index_head_dim"]
            yield from (
                Expected(a + "indexer.wq_b.weight", (n * di, ql)),
                Expected(a + "indexer.weights_proj.weight", (n, h)),
            )
            yield from self._compressor(a + "indexer.compressor.", ratio, di)
        ne = hp["n_routed_experts"]
        yield Expected(p + "ffn.gate.weight", (ne, h))
        if bid < hp["num_hash_layers"]:
            yield Expected(p + "ffn.gate.tid2eid", (hp["vocab_size"], hp["num_experts_per_tok"]))
        else:
            yield Expected(p + "ffn.gate.bias", (ne,))
        for e in range(ne):
            q = f"{p}ffn.experts.{e}."
            yield from (
                Expected(q + "w1.weight", (ff, h)),
                Expected(q + "w2.weight", (h, ff)),
                Expected(q + "w3.weight", (ff, h)),
            )
        sff = ff * hp["n_shared_experts"]
        s = p + "ffn.shared_experts."
        yield from (
            Expected(s + "w1.weight", (sff, h)),
            Expected(s + "w2.weight", (h, sff)),
            Expected(s + "w3.weight", (sff, h)),
        )

    def _compressor(self, p: str, ratio: int, d: int) -> list[Expected]:
        coff = 2 if ratio == 4 else 1  # ratio 4 pools overlapping windows: twice as wide
        h = self.hparams["hidden_size"]
        return [
            Expected(p + "ape", (ratio, coff * d)),
            Expected(p + "wkv.weight", (coff * d, h)),
            Expected(p + "wgate.weight", (coff * d, h)),
            Expected(p + "norm.weight", (d,)),
        ]

    def _prefix(self, bid: int) -> str:
        return f"layers.{bid}." if bid < self.n_trunk else f"mtp.{bid - self.n_trunk}."

    # -- metadata -----------------------------------------------------------------------

    @property
    def rope_parameters(self) -> dict:
        # transformers nests V4's RoPE as {"main", "compress"}; llama.cpp's converter reads rope_scaling as stored
        rp = dict(self.ckpt.config.get("rope_scaling") or {})
        if "rope_type" not in rp and "type" in rp:
            rp["rope_type"] = rp["type"]
        rp.setdefault("rope_theta", self.hparams.get("rope_theta"))
        return rp

    def set_common_metadata(self, w: GGUFWriter, n_blocks: int) -> None:
        super().set_common_metadata(w, n_blocks)
        from .deepseek2 import DeepseekV3

        DeepseekV3.set_yarn(self, w)  # beta_fast / beta_slow beside type, factor and original context

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, n = self.hparams, self.n_blocks
        add_hparams(
            w,
            hp,
            (
                ("add_rope_dimension_count", "qk_rope_head_dim"),
                ("add_q_lora_rank", "q_lora_rank"),
                ("add_sliding_window", "sliding_window"),
                ("add_expert_feed_forward_length", "moe_intermediate_size"),
                ("add_expert_shared_count", "n_shared_experts"),
                ("add_expert_weights_scale", "routed_scaling_factor"),
                ("add_expert_weights_norm", "norm_topk_prob"),
            ),
        )
        w.add_swiglu_clamp_exp([hp["swiglu_limit"]] * n)
        w.add_swiglu_clamp_shexp([hp["swiglu_limit"]] * n)
        w.add_indexer_head_count(hp["index_n_heads"])
        w.add_indexer_key_length(hp["index_head_dim"])
        w.add_indexer_top_k(hp["index_topk"])
        w.add_array(COMPRESS_RATIOS_KEY.format(arch=self.arch), list(hp["compress_ratios"]))
        for hkey, (key, kind) in _KEYS.items():
            getattr(w, f"add_{kind}")(key.format(arch=self.arch), hp[hkey])
        w.add_embedding_length_out(hp["hidden_size"] * hp["hc_mult"])  # the trunk's state: hc_mult streams

    def write_vocab(self, w: GGUFWriter) -> None:
        super().write_vocab(w)
        if gguf.Keys.Tokenizer.CHAT_TEMPLATE not in w.kv_data[0]:  # DeepSeek ships Python encoders, no template:
            # llama.cpp's converter writes its own (models/templates/, copied to mtpq/data/templates/), by the
            # folder's name as it picks it
            from importlib import resources

            name = "DeepSeek-V4-Flash-0731" if "0731" in self.ckpt.folder.name else "DeepSeek-V4"
            w.add_chat_template(
                resources.files("mtpq").joinpath(f"data/templates/deepseek-ai-{name}.jinja").read_text(encoding="utf-8")
            )

    def file_type(self, outtype: T) -> gguf.LlamaFileType:
        return gguf.LlamaFileType.MOSTLY_MXFP4_MOE  # as llama.cpp's converter, whatever the outtype

    # -- tensors ------------------------------------------------------------------------

    def plan(self, mtp: BlockSelection = BlockSelection.KEEP, outtype: T = T.F16):
        if mtp is not BlockSelection.DROP and self.dspark:  # the trunk converts (--no-mtp), as llama.cpp's default does
            raise InputError(
                self.ckpt.folder,
                "mtp.* holds DeepSeek-V4 DSpark draft stages (main_proj, "
                "markov_head, ...), not an MTP head: llama.cpp writes them into a "
                "separate dflash file (its converter's --dspark); convert the trunk "
                "with --no-mtp",
            )
        if mtp is not BlockSelection.DROP and any(i >= self.n_mtp for i in self.mtp_layers):  # llama.cpp stops the same
            raise InputError(
                self.ckpt.folder,
                f"MTP layers {self.mtp_layers} stored, config.json has num_nextn_predict_layers {self.n_mtp}",
            )
        if mtp is BlockSelection.KEEP and self.n_mtp:
            raise InputError(
                self.ckpt.folder,
                "DeepSeek-V4's MTP head has its own output hyper-connection "
                "(mtp.0.hc_head_*), which llama.cpp reads from a head-only file "
                "(one GGUF holds one output_hc_*): convert the trunk with --no-mtp "
                "and the head with --mtp-only, and draft with -m TRUNK -md HEAD",
            )
        return super().plan(mtp, outtype)

    def tensors(self) -> Iterator[Emit]:
        only, keep_mtp = self.block_selection is BlockSelection.ONLY, self.block_selection is not BlockSelection.DROP
        used: list[str] = []
        yield self._one("token_embd.weight", self.require("embed.weight"), used)
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            yield from self._block(bid, used)
        yield self._one("output_norm.weight", self.require("norm.weight"), used)
        yield self._one("output.weight", self.require("head.weight"), used)
        # one output hyper-connection per file: the head's in a head-only file, the trunk's otherwise
        p = self._prefix(self.n_trunk) if only else ""
        for hf, name in _HC_HEAD.items():
            yield self._one(name, self.require(p + hf), used)
        used += [n for n in self.ckpt.names() if n.startswith("mtp.") and not keep_mtp or n in _HC_HEAD and only]
        check_unused(self.ckpt, used + list(self.fp8.values()) + list(self.fp4.values()))

    def _block(self, bid: int, used: list[str]) -> Iterator[Emit]:
        p, blk, mtp = self._prefix(bid), f"blk.{bid}.", bid >= self.n_trunk
        names = [n for n in self.ckpt.names() if n.startswith(p)]
        if not names:
            hint = " (convert the trunk alone with --no-mtp)" if mtp else ""
            raise InputError(
                self.ckpt.folder,
                f"no tensors for layer {bid} ({p}*; config.json has {self.n_trunk} layers + {self.n_mtp} MTP){hint}",
            )
        experts: dict[str, list[tuple[int, str]]] = {}
        for hf in names:
            rest = hf[len(p) :]
            if m := _EXPERT.match(rest):
                experts.setdefault(m[2], []).append((int(m[1]), hf))
            elif rest in _LAYER:
                yield self._one(blk + _LAYER[rest], hf, used)
            elif mtp and rest in _NEXTN:
                yield self._one(blk + _NEXTN[rest], hf, used)
        if mtp:
            yield self._eh_proj(blk + "nextn.eh_proj.weight", p, used)
        for proj, name in _EXPS.items():
            parts = [hf for _, hf in sorted(experts.get(proj, []))]
            if parts:
                yield self._experts(blk + name, parts, used)

    def _one(self, name: str, hf: str, used: list[str]) -> Emit:
        """One tensor, typed as llama.cpp's converter types it: by its source encoding first."""
        used.append(hf)
        st = self.ckpt.stored[hf]
        if hf in self.fp8:
            load = self._fp8_loader(hf)
            return Emit(name, tuple(st.shape), load, f"{st.file.name}:{hf}", ggml_type=self._q8_0(st.shape))
        if st.dtype == "I64" or st.dtype == "I32":  # tid2eid: token -> experts, as int32

            def encode(qtype: T, hf=hf) -> np.ndarray:
                return self.ckpt.raw(hf).to(torch.int32).numpy()

            return Emit(
                name,
                tuple(st.shape),
                lambda: self.ckpt.raw(hf).to(torch.int32),
                f"{st.file.name}:{hf}",
                encode,
                ggml_type=T.I32,
            )
        if not st.dtype.startswith(("F", "BF")):
            raise InputError(st.file, f"tensor {hf} has dtype {st.dtype}; expected a float weight here")
        e = self.emit(name, hf)
        if len(st.shape) <= 1 or name.endswith("_norm.weight"):
            e.ggml_type = T.F32
        elif st.dtype == "F32":
            e.ggml_type = T.F32
        elif st.dtype == "BF16":
            e.ggml_type = T.BF16
        return e  # other sources: the outtype decides

    def _eh_proj(self, name: str, p: str, used: list[str]) -> Emit:
        """``e_proj`` | ``h_proj`` along the input: eh_proj [hidden, 2 hidden], applied to [enorm(e); hnorm(h)]."""
        e, h = self.require(p + "e_proj.weight"), self.require(p + "h_proj.weight")
        used += [e, h]
        loads = [self._fp8_loader(n) if n in self.fp8 else self.ckpt.loader(n) for n in (e, h)]
        rows, cols = self.ckpt.shape(e)
        shape = (rows, cols + self.ckpt.shape(h)[1])
        return Emit(
            name,
            shape,
            lambda: torch.cat([f().float() for f in loads], dim=1),
            f"{self.ckpt.stored[e].file.name}:{e} + {h}",
            ggml_type=self._q8_0(shape),
        )

    def _experts(self, name: str, parts: list[str], used: list[str]) -> Emit:
        used += parts
        missing = [hf for hf in parts if hf not in self.fp4]
        if missing:  # llama.cpp's converter needs them as released too (it repacks them, nothing else)
            st = self.ckpt.stored[missing[0]]
            raise InputError(
                st.file,
                f"routed expert {missing[0]} is {st.dtype}: DeepSeek-V4's experts must be FP4 "
                "(I8 codes + .scale), as released",
            )
        return mxfp4_stack(self.ckpt, name, [(hf, self.fp4[hf]) for hf in parts])

    @staticmethod
    def _q8_0(shape) -> T:
        return T.Q8_0 if shape[-1] % 32 == 0 else T.F16  # gguf-py's quantize falls back the same way

    def _fp8_loader(self, hf: str):
        """float32 values of an FP8 weight: e4m3 code x its 128x128 tile's power of two (exact products)."""
        ck, scale = self.ckpt, self.fp8[hf]

        def load() -> torch.Tensor:
            q = ck.raw(hf).view(torch.uint8).numpy()
            s = ck.raw(scale).view(torch.uint8).to(torch.int32)
            s = torch.where(s == 255, torch.nan, torch.exp2((s - 127).float())).numpy()  # UE8M0; 0xFF is NaN
            x = torch.empty(q.shape, dtype=torch.float32)
            fp8_scaled(q, torch.float8_e4m3fn, s, _FP8_TILE, _FP8_TILE, x)
            return x

        return load
