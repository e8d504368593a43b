"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, V3.2-Exp / V3.2 / V3.2-Speciale) -> GGUF arch ``deepseek32``.

DeepSeek-V3 (:mod:`.deepseek2`: MLA with the kv_b split, grouped sigmoid router,
stacked experts, the MTP block at ``model.layers.{num_hidden_layers}``) plus
DeepSeek Sparse Attention: every layer, the MTP block included, has a lightning
indexer under ``self_attn.indexer.`` that picks the ``index_topk`` keys each query
attends to:

  ``wq_b`` [index_n_heads * index_head_dim, q_lora_rank] -> ``indexer.attn_q_b``
  ``wk``   [index_head_dim, hidden]                       -> ``indexer.attn_k``
  ``k_norm`` (a LayerNorm: weight and bias) [index_head_dim] -> ``indexer.k_norm``
  ``weights_proj`` [index_n_heads, hidden]                -> ``indexer.proj`` (kept F32, as llama.cpp does)

and ``{arch}.attention.indexer.{head_count, key_length, top_k}`` in the metadata
(llama.cpp's conversion/deepseek.py, ``DeepseekV32Model``). Unlike for deepseek2,
llama.cpp's converter keeps the MTP block here; the output must equal it.
Releases ship FP8 (128x128 block-scaled ``weight_scale_inv``).

gguf-py 0.19 has no deepseek32 entry; its ``glm-dsa`` tensor table (GLM-5, the same
MLA + indexer + NextN tensors) names the tensors instead.
"""

from __future__ import annotations

import gguf
from gguf import GGUFWriter

from ...errors import InputError
from .deepseek2 import DeepseekV3

_INDEXER_HPARAMS = ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk")


class DeepseekV32(DeepseekV3):
    hf_architectures = ("DeepseekV32ForCausalLM",)
    arch = "deepseek32"
    required_hparams = DeepseekV3.required_hparams + _INDEXER_HPARAMS
    f32_kinds = DeepseekV3.f32_kinds + ("indexer.proj",)

    def __init__(self, ckpt):
        super().__init__(ckpt)
        for key in _INDEXER_HPARAMS[1:]:  # not in validate's schema: checked here, before any use
            v = self.hparams[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InputError(ckpt.folder / "config.json", f"{key} must be a positive integer, got {v!r}")

    def mla_shapes(self) -> dict[str, tuple[int, ...]]:
        """The attention tensors of one layer: MLA's, and the indexer's (checked and expected alike)."""
        want = super().mla_shapes()
        hp = self.hparams
        n, d, h = hp["index_n_heads"], hp["index_head_dim"], hp["hidden_size"]
        p = "self_attn.indexer."
        want.update(
            {
                p + "wq_b.weight": (n * d, hp["q_lora_rank"]),
                p + "wk.weight": (d, h),
                p + "k_norm.weight": (d,),
                p + "k_norm.bias": (d,),
                p + "weights_proj.weight": (n, h),
            }
        )
        return want

    def set_metadata(self, w: GGUFWriter) -> None:
        super().set_metadata(w)
        hp = self.hparams
        w.add_indexer_head_count(hp["index_n_heads"])
        w.add_indexer_key_length(hp["index_head_dim"])
        w.add_indexer_top_k(hp["index_topk"])

    def map_name(self, hf_name: str, n_blocks: int | None = None) -> str | None:
        if self._name_map is None:
            arch = getattr(gguf.MODEL_ARCH, "DEEPSEEK32", gguf.MODEL_ARCH.GLM_DSA)
            self._name_map = gguf.get_tensor_name_map(arch, n_blocks or (self.n_trunk + self.n_mtp))
        return super().map_name(hf_name, n_blocks)
