"""Qwen3-Next (GGUF arch ``qwen3next``), as llama.cpp's qwen3next graph computes it: Qwen3.5-MoE's
family (``qwen35.py``: gated DeltaNet x 3 + gated full attention, softmax-routed experts with a
sigmoid-gated shared expert in every block, the MTP head one gated full-attention MoE block) with
the DeltaNet in HF's grouped value-head order, which the converter keeps for this architecture:

- value head h reads key head h // (n_v / n_k) (Qwen3.5's files are tiled: h % n_k);
- beta and alpha come from one fused ``ssm_ba``, per key head r betas then r alphas.

Both are :class:`~mtpq.runtime.deltanet.GatedDeltaNet`'s (``grouped_heads``, and the fused tensor
when the block has it). RoPE is NeoX-ordered on ``rope.dimension_count`` dims (llama.cpp's
LLAMA_ROPE_TYPE_NEOX for qwen3next; Qwen3.5's IMROPE is the same for text positions).
"""

from __future__ import annotations

from .qwen35 import Qwen35


class Qwen3Next(Qwen35):
    archs = ("qwen3next",)
    grouped_heads = True
