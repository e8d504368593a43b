"""MiMo-V2-Flash / MiMo-V2.5 (``MiMoV2FlashForCausalLM``, ``MiMoV2ForCausalLM``) -> GGUF arch ``mimo2``.

Trunk: hybrid attention — ``hybrid_layer_pattern`` marks sliding-window layers
(1) among full ones (0), each kind with its own KV head count; q/k heads of
``head_dim``, v heads of ``v_head_dim`` (192 / 128 in the release); per-head
attention sinks ``self_attn.attention_sink_bias`` (-> ``attn_sinks``); partial
RoPE; a dense first layer, then MoE layers with a sigmoid router + correction
bias and per-expert tensors stacked into ``*_exps``.

The MTP blocks live under ``model.mtp.layers.{i}`` and become blocks N + i (the
config does not count them: llama.cpp's converter assumes the release's 3; mtpq
counts what the checkpoint holds). Each is a sliding-window decoder block whose FFN
norm the releases call ``pre_mlp_layernorm`` (-> ``ffn_norm``; ``post_attention_layernorm``,
the trunk's name, which llama.cpp's converter maps alike, is accepted in its place), plus
``eh_proj``, ``enorm``, ``hnorm`` and ``final_layernorm`` (-> ``layer_output_norm``, the
norm before the head). Metadata as llama.cpp's converter (conversion/mimo.py) writes
it: the SWA pattern and KV head counts extended over the MTP blocks; the window is
``sliding_window``, else ``sliding_window_size`` + 1 (what transformers' MiMoV2FlashConfig,
and so llama.cpp's converter, derive: the reference attends to that many previous tokens
plus the query).

MiMo-V2.5 / V2.5-Pro store one ``self_attn.qkv_proj`` per block (-> ``attn_qkv``), in FP8
with its rows sharded over ``num_key_value_heads`` tensor-parallel ranks (V2.5: 4,
V2.5-Pro: 8; SGLang's get_mimo_v2_fused_qkv_expected_tp_size, for every layer kind):
each rank's rows are [Q_r | K_r | V_r] with their own 128-row scale tiles. They are
dequantized with each rank's tiles and regrouped into [Q | K | V], as llama.cpp's
converter does (it guesses the rank count from the scale rows, 8 before 4, which can
fit both; the head count cannot be wrong); its
vision/audio towers are left for llama.cpp's mmproj file. Checkpoints with
``quantization_config.store_dtype: mxfp4`` keep their routed experts in OCP MXFP4
(``weight``: E2M1 codes two per byte, ``weight_scale``: an E8M0 byte per 32 values):
the bits are moved, not requantized, into ggml's ``MXFP4`` blocks and stay MXFP4
whatever the outtype (general.file_type MOSTLY_MXFP4_MOE), as llama.cpp's converter does
(mxfp4_experts.py, shared with Ling 3.0).
"""

from __future__ import annotations

from typing import Iterator

import gguf
import torch
from gguf import GGUFWriter

from ...errors import InputError
from .. import validate as V
from ..base import NEXTN_TENSORS, ConvertFamily, Emit, gguf_name, layer_of
from ..mxfp4_experts import GROUP as MXFP4_GROUP
from ..mxfp4_experts import Mxfp4Experts
from ..validate import Expected

VALUE_SCALE_KEY = "{arch}.attention.value_scale"  # newer than gguf-py 0.19's Keys
QKV = "self_attn.qkv_proj.weight"  # MiMo-V2.5's fused projection


class MiMoV2(Mxfp4Experts, ConvertFamily):
    hf_architectures = ("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM")
    arch = "mimo2"
    mtp_prefix = "model.mtp.layers."
    other_towers = ("visual.", "speech_embeddings.", "audio_encoder.")  # MiMo-V2.5's: llama.cpp's mmproj file
    # gguf-py 0.19's mimo2 table lacks the head's tensors; final_layernorm is the norm before the MTP head
    nextn_tensors = {**NEXTN_TENSORS, "final_layernorm.weight": gguf.MODEL_TENSOR.LAYER_OUT_NORM}

    required_hparams = ConvertFamily.required_hparams + (
        "hybrid_layer_pattern",
        "head_dim",
        "v_head_dim",
        "num_attention_heads",
        "num_key_value_heads",
        "swa_num_key_value_heads",
        "intermediate_size",
        "n_routed_experts",
        "moe_intermediate_size",
    )

    def __init__(self, ckpt):
        super().__init__(ckpt)
        cfg = ckpt.folder / "config.json"
        hp = self.hparams
        # llama.cpp's converter asserts the same: its graph has one attention shape for both layer kinds
        for swa_key, key in (
            ("swa_head_dim", "head_dim"),
            ("swa_num_attention_heads", "num_attention_heads"),
            ("swa_v_head_dim", "v_head_dim"),
        ):
            if hp.get(swa_key, hp[key]) != hp[key]:
                raise InputError(cfg, f"{swa_key} {hp[swa_key]} differs from {key} {hp[key]} (not supported)")
        if hp.get("sliding_window") is None and hp.get("sliding_window_size") is None:
            raise InputError(cfg, "missing sliding_window (or sliding_window_size)")
        if hp.get("topk_method", "noaux_tc") != "noaux_tc":
            raise InputError(cfg, f"topk_method {hp['topk_method']!r} is not supported (noaux_tc only)")
        if len(hp["hybrid_layer_pattern"]) != self.n_trunk:
            raise InputError(
                cfg,
                f"hybrid_layer_pattern has {len(hp['hybrid_layer_pattern'])} entries, "
                f"num_hidden_layers is {self.n_trunk}",
            )
        freq = hp.get("moe_layer_freq")
        if freq is not None and not (
            isinstance(freq, list)
            and len(freq) >= self.n_trunk
            and all(f in (0, 1) and not isinstance(f, float) for f in freq)
        ):
            raise InputError(cfg, f"moe_layer_freq must be a 0/1 flag per layer ({self.n_trunk}), got {freq!r}")
        qc = hp.get("quantization_config")
        if isinstance(qc, dict) and qc.get("store_dtype") == "mxfp4":  # MXFP4 experts beside a weight_scale
            self.find_mxfp4_experts(
                "_scale", qc.get("mxfp4_block_size", MXFP4_GROUP), "quantization_config.mxfp4_block_size"
            )
        found = sorted({i for n in ckpt.names() if (i := layer_of(n, self.mtp_prefix)) is not None})
        if found != list(range(len(found))):
            raise InputError(ckpt.folder, f"MTP layers must be {self.mtp_prefix}0..N-1, found {found}")
        self.n_mtp = len(found)
        fused = {n: bid for n in ckpt.names() if n.endswith("." + QKV) and (bid := self._block_of(n)) is not None}
        if fused and hp.get("attention_bias"):
            raise InputError(cfg, "attention_bias with a fused qkv_proj is not supported")
        # FP8 fused qkv_proj -> its tensor-parallel rank count (scale tiles per rank), checked before anything
        self.tp_ranks = {
            n: self._tp_ranks(n, bid) for n, bid in fused.items() if n + "_scale_inv" in ckpt.stored and ckpt.is_fp8(n)
        }

    # -- what config.json implies (checked before anything is planned) -------------------

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        """Per block: attention with the layer kind's KV heads (q/k heads of head_dim, v heads of v_head_dim)
        and its attention sinks, then MoE (moe_layer_freq) or a dense MLP; the MTP blocks are sliding-window,
        dense-MLP blocks with eh_proj, enorm, hnorm and final_layernorm."""
        hp = self.hparams
        h, vocab, n_head = hp["hidden_size"], hp["vocab_size"], hp["num_attention_heads"]
        yield from V.embeddings(h, vocab, tied=bool(hp.get("tie_word_embeddings")))
        blocks = [f"model.layers.{bid}." for bid in range(self.n_trunk)]
        blocks += [f"{self.mtp_prefix}{i}." for i in range(self.n_mtp if keep_mtp else 0)]
        for bid, p in enumerate(blocks):
            swa = self._is_swa(bid)
            n_kv = hp["swa_num_key_value_heads" if swa else "num_key_value_heads"]
            yield from V.norms(p, h, "input_layernorm", self._ffn_norm(bid, p))
            attention = V.attention(
                p + "self_attn.",
                h,
                n_head,
                n_kv,
                hp["head_dim"],
                v_head_dim=hp["v_head_dim"],
                bias=bool(hp.get("attention_bias")),
            )
            if self.resolve(p + QKV) is not None:  # MiMo-V2.5: q, k and v rows in one tensor
                qkv = [e for e in attention if e.name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
                attention = [e for e in attention if e not in qkv]
                attention.append(Expected(p + QKV, (sum(e.shape[0] for e in qkv), h)))
            yield from attention
            sinks = hp.get("add_swa_attention_sink_bias" if swa else "add_full_attention_sink_bias")
            yield from V.switched(sinks, Expected(p + "self_attn.attention_sink_bias", (n_head,)))
            if bid < self.n_trunk and self._is_moe(bid):
                yield from V.deepseek_moe(p + "mlp.", h, hp["n_routed_experts"], hp["moe_intermediate_size"])
            else:
                yield from V.dense_ffn(p + "mlp.", h, hp["intermediate_size"])
            if bid >= self.n_trunk:
                yield from V.nextn_head(p, h, vocab, norm="final_layernorm")
                yield Expected(p + "shared_head.norm.weight", (h,), optional=True)  # llama.cpp prefers it if present

    def _ffn_norm(self, bid: int, p: str) -> str:
        """The block's FFN norm: the trunk's post_attention_layernorm; in an MTP block pre_mlp_layernorm, as
        released (vLLM's and SGLang's MTP loaders), or post_attention_layernorm in its place (both are ffn_norm
        to llama.cpp's converter; both stored is refused: which one is the block's?)."""
        legacy = "post_attention_layernorm"
        if bid < self.n_trunk or (
            f"{p}{legacy}.weight" in self.ckpt and f"{p}pre_mlp_layernorm.weight" not in self.ckpt
        ):
            return legacy
        return "pre_mlp_layernorm"

    def _is_swa(self, bid: int) -> bool:
        return bid >= self.n_trunk or self.hparams["hybrid_layer_pattern"][bid] == 1  # MTP blocks: sliding

    def _is_moe(self, bid: int) -> bool:
        if (freq := self.hparams.get("moe_layer_freq")) is not None:
            return bool(freq[bid])
        return f"model.layers.{bid}.mlp.gate.weight" in self.ckpt  # no schedule given: the stored router decides

    # -- metadata -----------------------------------------------------------------------

    def set_metadata(self, w: GGUFWriter) -> None:
        hp, K = self.hparams, gguf.Keys
        hybrid = list(hp["hybrid_layer_pattern"]) + [1] * (self.n_blocks - self.n_trunk)  # MTP blocks: SWA
        for key in (
            K.Attention.HEAD_COUNT_KV,
            K.Attention.VALUE_LENGTH,
            K.LLM.EXPERT_COUNT,
            K.Attention.LAYERNORM_RMS_EPS,
        ):
            w.kv_data[0].pop(key.format(arch=self.arch), None)  # the values below replace the common ones
        n_kv, n_kv_swa = hp["num_key_value_heads"], hp["swa_num_key_value_heads"]
        w.add_head_count_kv([n_kv_swa if s == 1 else n_kv for s in hybrid])
        window = hp.get("sliding_window")
        w.add_sliding_window(window if window is not None else hp["sliding_window_size"] + 1)
        w.add_sliding_window_pattern(hybrid)  # 0/1 integers, as llama.cpp's converter writes them
        w.add_value_length(hp["v_head_dim"])
        w.add_expert_count(hp["n_routed_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        partial = self.rope_parameters.get("partial_rotary_factor", hp.get("partial_rotary_factor"))
        if partial is None:
            raise InputError(self.ckpt.folder / "config.json", "missing partial_rotary_factor")
        w.add_rope_dimension_count(int(hp["head_dim"] * partial))
        w.add_layer_norm_rms_eps(hp.get("layernorm_epsilon", 1e-5))
        if (v := hp.get("attention_value_scale")) is not None:
            w.add_float32(VALUE_SCALE_KEY.format(arch=self.arch), float(v))

    # -- tensors: the base's per-layer loop ---------------------------------------------

    def modify(self, bid: int, rest: str, hf: str) -> list[Emit] | None:
        if rest == "self_attn.attention_sink_bias":  # llama.cpp appends .weight before naming it
            return [self.emit(self.map_name(f"{self.block_prefix}{bid}.{rest}.weight"), hf)]
        if rest == QKV:  # (gguf-py 0.19's mimo2 table lacks attn_qkv)
            name = gguf_name(gguf.MODEL_TENSOR.ATTN_QKV, bid)
            if hf not in self.tp_ranks:
                return [self.emit(name, hf)]
            src = f"{self.ckpt.stored[hf].file.name}:{hf}"
            return [Emit(name, tuple(self.ckpt.shape(hf)), lambda: self._tp_qkv(hf, bid), src)]
        return None

    @property
    def own_encodings(self) -> frozenset[str]:
        return super().own_encodings | frozenset(self.tp_ranks)

    def _qkv_rows(self, bid: int) -> tuple[int, int, int]:
        hp = self.hparams
        n_kv = hp["swa_num_key_value_heads" if self._is_swa(bid) else "num_key_value_heads"]
        return hp["num_attention_heads"] * hp["head_dim"], n_kv * hp["head_dim"], n_kv * hp["v_head_dim"]

    def _block_of(self, hf: str) -> int | None:
        """The block a name is in (MTP blocks after the trunk's), None outside the blocks config.json declares."""
        if (i := layer_of(hf, self.mtp_prefix)) is not None:
            return self.n_trunk + i  # (n_mtp is counted from these names)
        bid = layer_of(hf)
        return bid if bid is not None and bid < self.n_trunk else None

    def _tp_ranks(self, hf: str, bid: int) -> int:
        """The ranks a fused FP8 qkv_proj is sharded over: num_key_value_heads, each rank holding rows/tp rows
        in its own tiles of 128 (checked against the scale rows; an unsharded layout llama.cpp refuses too)."""
        st, scale = self.ckpt.stored[hf], self.ckpt.stored[hf + "_scale_inv"]
        bh, bw = V.fp8_block_size(self.ckpt)
        rows, cols = st.shape if len(st.shape) == 2 else (0, 0)
        tp = self.hparams["num_key_value_heads"]
        if rows % tp or tuple(scale.shape) != (tp * -(-rows // tp // bh), -(-cols // bw)):
            raise InputError(
                scale.file,
                f"{scale.name} has shape {list(scale.shape)}: not the per-rank {bh}x{bw} "
                f"tiles of {hf} {list(st.shape)} sharded over num_key_value_heads ({tp}) "
                "tensor-parallel ranks",
            )
        sizes = self._qkv_rows(bid)
        if sum(sizes) != rows or any(n % tp for n in sizes):
            raise InputError(
                st.file,
                f"{hf} has {rows} rows: config.json implies q/k/v rows {list(sizes)}, "
                f"split over {tp} tensor-parallel ranks",
            )
        return tp

    def _tp_qkv(self, hf: str, bid: int) -> torch.Tensor:
        """A fused FP8 qkv_proj dequantized with each rank's tiles, its rows regrouped from per rank
        [Q_r | K_r | V_r] into [Q | K | V] (float32: one multiply per value, as llama.cpp's converter)."""
        ck, tp = self.ckpt, self.tp_ranks[hf]
        bh, bw = V.fp8_block_size(ck)
        w = ck.raw(hf).to(torch.float32)
        scale = ck.raw(hf + "_scale_inv").to(torch.float32)
        rows, cols = w.shape
        per_rank = rows // tp
        parts = [n // tp for n in self._qkv_rows(bid)]  # (checked to split evenly: _tp_ranks)
        r = torch.arange(rows)
        tile_row = (r // per_rank) * -(-per_rank // bh) + (r % per_rank) // bh
        w *= scale[tile_row].repeat_interleave(bw, dim=1)[:, :cols]
        ranks = w.view(tp, per_rank, cols).split(parts, dim=1)  # q, k, v: [tp, rows per rank, cols] each
        return torch.cat([part.reshape(-1, cols) for part in ranks])
