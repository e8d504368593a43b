"""Qwen3.5 / Qwen3.6 MoE (``Qwen3_5MoeForCausalLM``, ``Qwen3_5MoeForConditionalGeneration``) -> GGUF arch ``qwen35moe``.

Everything of the dense family (:mod:`.qwen35`), with a sparse MoE block in
every layer (the MTP block included): a softmax router ``mlp.gate``, routed
experts and one shared expert with a sigmoid gate ``mlp.shared_expert_gate``.
Routed experts come in either of two layouts, both stacked into 3-D
``ffn_{gate,up,down}_exps`` [n_expert, rows, cols] as llama.cpp expects:
- per expert: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what
  transformers' checkpoint conversion map expects of the published files);
- fused: ``mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows first, then up) and
  ``mlp.experts.down_proj`` [E, H, F], split and kept as they are.
"""

from __future__ import annotations

import re
from typing import Iterator

from gguf import GGUFWriter

from ...errors import InputError
from .. import stream
from .. import validate as V
from ..base import Emit
from ..validate import Expected
from .qwen35 import Qwen35

_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


class Qwen35Moe(Qwen35):
    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    arch = "qwen35moe"
    required_hparams = Qwen35.required_hparams + ("num_experts", "moe_intermediate_size")

    def expected_ffn(self, p: str) -> Iterator[Expected]:
        """Router, shared expert + its gate, and routed experts in whichever layout the layer stores."""
        hp = self.hparams
        h, n_exp, ff = hp["hidden_size"], hp["num_experts"], hp["moe_intermediate_size"]
        yield V.Expected(p + "gate.weight", (n_exp, h))
        if sff := hp.get("shared_expert_intermediate_size"):
            yield from V.dense_ffn(p + "shared_expert.", h, sff)
            yield V.Expected(p + "shared_expert_gate.weight", (1, h))
        fused = [p + f"experts.{n}{suffix}" for n in ("gate_up_proj", "down_proj") for suffix in ("", ".weight")]
        if any(self.resolve(n) for n in fused):  # fused layout, with or without the .weight suffix
            gate_up = next((n for n in fused[:2] if self.resolve(n)), fused[0])
            down = next((n for n in fused[2:] if self.resolve(n)), fused[2])
            yield V.Expected(gate_up, (n_exp, 2 * ff, h))
            yield V.Expected(down, (n_exp, h, ff))
            return
        yield from V.routed_experts(p + "experts.", h, n_exp, ff)

    def set_metadata(self, w: GGUFWriter) -> None:
        super().set_metadata(w)
        if (v := self.hparams.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(v)
        if (v := self.hparams.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(v)

    def block_tensors(self, bid: int, names: dict[str, str]) -> Iterator[Emit]:
        experts = {k: v for k, v in names.items() if k.startswith("mlp.experts.")}
        yield from super().block_tensors(bid, {k: v for k, v in names.items() if k not in experts})
        yield from self.expert_tensors(bid, experts)

    def expert_tensors(self, bid: int, experts: dict[str, str]) -> Iterator[Emit]:
        hp = self.hparams
        n_exp, ff, h = hp["num_experts"], hp["moe_intermediate_size"], hp["hidden_size"]
        per: dict[str, dict[int, str]] = {}
        fused: dict[str, str] = {}
        for inner, hf in experts.items():
            if m := _PER_EXPERT.match(inner):
                per.setdefault(m[2], {})[int(m[1])] = hf
            elif m := _FUSED.match(inner):
                fused[m[1]] = hf
            # anything else is reported by check_unused
        if not per and not fused:
            return
        gguf_name = {p: self.map_name(f"model.layers.{bid}.mlp.experts.{p}.weight") for p in _PROJS}

        for proj, by_expert in per.items():
            missing = [e for e in range(n_exp) if e not in by_expert]
            if missing or len(by_expert) != n_exp:
                raise InputError(
                    self.ckpt.folder,
                    f"layer {bid}: {proj} has experts {sorted(by_expert)}, config.json has num_experts={n_exp}",
                )
            parts = [by_expert[e] for e in range(n_exp)]
            for hf in parts:
                self.expect_shape(hf, (h, ff) if proj == "down_proj" else (ff, h))
            self.used.extend(parts)
            yield self.stack(gguf_name[proj], parts)

        if (hf := fused.get("gate_up_proj")) is not None:
            self.expect_shape(hf, (n_exp, 2 * ff, h))
            self.used.append(hf)
            load = self.ckpt.loader(hf)
            src = f"{self.ckpt.stored[hf].file.name}:{hf}"
            for proj, lo, what in (("gate_proj", 0, "gate"), ("up_proj", ff, "up")):
                # what the writer uses: this half alone, one expert at a time (not the fused stack, twice)
                encode = (
                    lambda hf, name, lo, s: (
                        lambda q: stream.encode_rows_of_stack(self.ckpt, hf, name, s, lo, lo + ff, q)
                    )
                )(hf, gguf_name[proj], lo, f"{src} [{what} half]")
                yield Emit(
                    gguf_name[proj],
                    (n_exp, ff, h),
                    (lambda lo: lambda: load()[:, lo : lo + ff, :])(lo),
                    f"{src} [{what} half]",
                    encode,
                )
        if (hf := fused.get("down_proj")) is not None:
            self.expect_shape(hf, (n_exp, h, ff))
            self.used.append(hf)
            yield self.emit(gguf_name["down_proj"], hf)
