"""GLM-5 / 5.1 / 5.2 (``GlmMoeDsaForCausalLM``) -> GGUF arch ``glm-dsa``.

DeepSeek-V3 underneath (MLA with ``kv_b_proj`` split into ``attn_k_b``/``attn_v_b``,
dense first layers, sigmoid-routed experts with a correction bias, one shared
expert), so this is :class:`~.deepseek2.DeepseekV3` with three additions, as
llama.cpp's ``conversion/glm.py: GlmMoeDsaModel`` writes them:

- the DeepSeek sparse-attention indexer of each layer,
  ``self_attn.indexer.{wq_b, wk, k_norm (LayerNorm: weight + bias), weights_proj}``
  -> ``blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}`` (``proj`` kept at F32);
  GLM-5.2 runs the indexer only in the layers ``indexer_types`` calls ``"full"``,
  the ``"shared"`` ones reuse the previous full layer's top-k and store no indexer;
- ``attention.indexer.{head_count, key_length, top_k, types}`` metadata, and
  ``rope.dimension_count`` = qk_rope_head_dim * partial_rotary_factor;
- GLM's vocab (``[gMASK]`` as BOS, ...), as GLM-4.5's.

The MTP block is ``model.layers.{num_hidden_layers}`` (78 in GLM-5.x): nextn tensors
plus a full MLA + MoE block (its indexer, if stored, is converted too; llama.cpp's
MTP graph runs dense attention and ignores it). Unlike deepseek2, llama.cpp's
converter keeps this block.
"""

from __future__ import annotations

from typing import Iterator

import gguf
from gguf import GGUFWriter

from ...errors import InputError
from ..validate import Expected
from .deepseek2 import DeepseekV3
from .glm4moe import Glm4Moe

_INDEXER_TYPES_KEY = "{arch}.attention.indexer.types"  # not in gguf-py 0.19's Keys


def derived_indexer_types(hp: dict, n_layers: int) -> list[str]:
    """The indexer pattern transformers' GlmMoeDsaConfig derives when config.json lists no indexer_types
    (and llama.cpp's converter then writes): from index_topk_pattern ("FFS..." or a list), else from
    index_topk_freq / index_skip_topk_offset (defaults 1 / 2: every layer full, as GLM-5 / 5.1 run)."""
    if (pattern := hp.get("index_topk_pattern")) is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq, offset = max(hp.get("index_topk_freq", 1), 1), hp.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


class GlmMoeDsa(DeepseekV3):
    hf_architectures = ("GlmMoeDsaForCausalLM",)
    arch = "glm-dsa"
    f32_kinds = DeepseekV3.f32_kinds + ("indexer.proj",)  # llama.cpp's converter keeps the indexer weights F32
    required_hparams = DeepseekV3.required_hparams + ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk")

    write_vocab = Glm4Moe.write_vocab

    def indexer_types(self) -> list[str]:
        """Per layer, "full" (runs its indexer) or "shared": config.json's list, else :func:`derived_indexer_types`."""
        n = self.n_trunk
        types = self.hparams.get("indexer_types")
        if types is None:
            try:
                types = derived_indexer_types(self.hparams, n)
            except (TypeError, ValueError):  # a pattern that is not a sequence, a frequency that is not a number
                types = {
                    k: self.hparams.get(k)
                    for k in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
                    if k in self.hparams
                }
        if not (isinstance(types, list) and len(types) >= n and all(t in ("full", "shared") for t in types[:n])):
            raise InputError(
                self.ckpt.folder / "config.json",
                "indexer_types (or the index_topk_* keys it derives from) must give "
                f'"full" or "shared" for each of the {n} layers, got {types!r}',
            )
        return types  # as stored: llama.cpp writes every entry (the MTP block may have one too)

    def expected_tensors(self, keep_mtp: bool) -> Iterator[Expected]:
        yield from super().expected_tensors(keep_mtp)
        hp, types = self.hparams, self.indexer_types()
        h, heads, dim = hp["hidden_size"], hp["index_n_heads"], hp["index_head_dim"]
        for bid in range(self.n_trunk + (self.n_mtp if keep_mtp else 0)):
            mtp = bid >= self.n_trunk
            if not mtp and types[bid] != "full":
                continue
            p = f"model.layers.{bid}.self_attn.indexer."
            for rest, shape in (
                ("wq_b.weight", (heads * dim, hp["q_lora_rank"])),
                ("wk.weight", (dim, h)),
                ("k_norm.weight", (dim,)),
                ("k_norm.bias", (dim,)),
                ("weights_proj.weight", (heads, h)),
            ):
                yield Expected(p + rest, shape, optional=mtp)  # the MTP block's indexer is unused by llama.cpp

    def set_metadata(self, w: GGUFWriter) -> None:
        super().set_metadata(w)
        hp = self.hparams
        self._replace(w, gguf.Keys.Rope.DIMENSION_COUNT)
        partial = self.rope_parameters.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(hp["qk_rope_head_dim"] * partial))
        w.add_indexer_head_count(hp["index_n_heads"])
        w.add_indexer_key_length(hp["index_head_dim"])
        w.add_indexer_top_k(hp["index_topk"])
        # llama.cpp's converter writes what transformers' config holds: config.json's list, or the derived one
        w.add_array(_INDEXER_TYPES_KEY.format(arch=self.arch), [t == "full" for t in self.indexer_types()])
