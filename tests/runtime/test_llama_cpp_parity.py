"""The torch runtime computes what llama.cpp computes, per architecture: the trunk's logits and every MTP head's,
teacher-forced on the same tokens, against libllama itself (tests/helpers/mtp_harness.cpp).

Each architecture runs on a release-shaped checkpoint (tests/releases/), converted to f32 by mtpq and sharpened:
``output_norm`` and every head's ``shared_head_norm`` are scaled (a final RMSNorm's weight scales the logits), so
the tiny random models' flat distributions become peaked enough that a wrong detail shows in the KLD. Both
engines read the same file. The gates (issue 36): mean KLD <= 1e-5 and the same argmax at >= 99.5 % of the
positions, for the trunk and for each head.

A parity check that cannot fail proves nothing: each architecture's broken variants (a wrong RoPE frequency, the
router's correction bias dropped, a norm epsilon changed, the head's pairs one position off, ...) must fail it.

Run: ``python -m pytest -m llama_cpp tests/runtime/test_llama_cpp_parity.py -s`` (prints the table of
docs/notes/runtime.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from tests import releases
from tests.helpers.llamacpp_logits import agreement, llama_cpp_logits, ours
from tests.helpers.runtime import convert

pytestmark = pytest.mark.llama_cpp

MAX_KLD, MIN_TOP1 = 1e-5, 0.995
SHARPEN = 6.0  # the factor on the final norms' weights: logits' spread ~0.3 -> ~2 on the tiny models
N_TOKENS = 128

# GGUF architecture -> (release manifest, form): one release-shaped checkpoint per architecture the runtime runs
PARITY = {
    "glm4moe": ("glm47", "bf16"),
    "qwen35": ("qwen35", "bf16"),
    "qwen35moe": ("qwen35_moe", "bf16"),
    "deepseek2": ("deepseek_v3_hf5", "bf16"),
    "deepseek2-lite": ("glm47_flash", "bf16"),  # GLM-4.7-Flash: deepseek2 without q_lora, with its own head
    "step35": ("step35_flash", "bf16"),
    "mimo2": ("mimo_v25", "fp8"),  # (MiMo-V2-Flash's split q/k/v has no MTP graph in llama.cpp)
}
# architectures whose sequences must be longer: past the release's sliding window (Step-3.5: 512, MiMo-V2: 128)
TOKENS = {"step35": 640, "mimo2": 256}


def sharpened(src: Path, out: Path, factor: float = SHARPEN) -> Path:
    """``src`` with ``output_norm`` and every head's norm (``nextn.shared_head_norm``, MiMo's ``layer_output_norm``)
    scaled by ``factor``, and the clamped SwiGLUs driven past their clamps (:func:`clamps_reached`)."""
    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    scaled = ("output_norm.weight", ".nextn.shared_head_norm.weight")
    factors = {s.name: factor for s in plan.tensors if s.name.endswith(scaled)} | clamps_reached(plan)
    plan.tensors = [replace(s, load=(lambda s=s: s.load() * factors[s.name]), load_raw=None) if s.name in factors
                    else s for s in plan.tensors]
    write_plan(plan, out)
    return out


CLAMP_REACH = 4.0  # the tiny random models' SwiGLU inputs stay below ~3; the releases' clamps are 7 (routed), 16


def clamps_reached(plan) -> dict[str, float]:
    """{tensor: factor} scaling the gate and up projections of every block with a SwiGLU clamp (Step-3.5's
    ``swiglu_clamp_exp`` / ``swiglu_clamp_shexp``) so that some activations pass it and the clamp shows."""
    out = {}
    for key, kind, reach in (("swiglu_clamp_exp", "exps", CLAMP_REACH), ("swiglu_clamp_shexp", "shexp",
                                                                           2 * CLAMP_REACH)):
        value = plan.kv.get(f"{plan.arch}.{key}")
        for i, limit in enumerate(value.value if value is not None else []):
            if limit > 0:
                out |= {f"blk.{i}.ffn_{p}_{kind}.weight": reach for p in ("gate", "up")}
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory, llama_cpp_bin, llama_cpp_src):
    """get(arch) -> (model path, tokens, llama.cpp's Logits), built once per module run."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            name, form = PARITY[arch]
            work = tmp_path_factory.mktemp(f"parity-{arch}")
            ckpt = releases.build(releases.manifests()[name], work / "ckpt", form)
            path = sharpened(convert(ckpt, work / "f32.gguf"), work / "sharp.gguf")
            from mtpq.runtime.families import load

            vocab = load(path).vocab_size
            n = TOKENS.get(arch, N_TOKENS)
            tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7)).tolist()
            cache[arch] = path, tokens, llama_cpp_logits(llama_cpp_bin, llama_cpp_src, path, tokens, work)
        return cache[arch]

    return get


def figures(model, tokens, ref) -> dict[str, tuple[float, float, float]]:
    """{"trunk" / "head i": (mean KLD, max KLD, same argmax)} of our runtime against llama.cpp's logits (a head's
    row 0, drafted from the zero state, predicts nothing and is left out)."""
    mine = ours(model, tokens)
    out = {"trunk": agreement(mine.trunk, ref.trunk)}
    assert len(mine.heads) == len(ref.heads), "a different number of MTP heads"
    for i, ((logits, _), (ref_logits, _)) in enumerate(zip(mine.heads, ref.heads)):
        out[f"head {i}"] = agreement(logits[1:], ref_logits[1:])
    return out


def failing(figs: dict) -> list[str]:
    return [f"{part}: mean KLD {k:.2e}, top-1 {t:.2%}" for part, (k, _, t) in figs.items()
            if not (k <= MAX_KLD and t >= MIN_TOP1)]


@pytest.mark.parametrize("arch", sorted(PARITY))
def test_runtime_matches_llama_cpp(arch, parity):
    from mtpq.runtime.families import load

    path, tokens, ref = parity(arch)
    model = load(path)
    assert model.n_heads >= 1
    figs = figures(model, tokens, ref)
    print(f"\n{arch:16s} " + "  ".join(f"{p}: KLD {k:.1e} (max {m:.1e}) top-1 {t:.2%}" for p, (k, m, t) in figs.items()))
    assert not failing(figs), failing(figs)
    # and the trunk's NextN states are llama.cpp's (what the head is fed)
    h = model.trunk(torch.tensor([tokens]), use_cache=False).hidden[0].numpy()
    assert np.abs(h - ref.hidden).max() <= 1e-3 * max(1.0, np.abs(ref.hidden).max())


# ----------------------------------------------------------------------------- broken on purpose


def _modules(model, kind: str):
    from mtpq.runtime import layers

    return [m for m in model.modules() if isinstance(m, getattr(layers, kind))]


def wrong_rope_base(model) -> bool:
    """Every RoPE's frequencies 5 % off (a wrong rope base or scaling factor)."""
    ropes = {id(r): r for m in model.modules() for r in [getattr(m, "rope", None)] if r is not None}.values()
    for r in ropes:
        r.inv_freq = r.inv_freq * 1.05
        r._memo = []
    return bool(ropes)


def router_bias_dropped(model) -> bool:
    """Every MoE router's correction bias (``exp_probs_b``) ignored."""
    moes = [m for m in _modules(model, "MoE") if m.bias is not None]
    for m in moes:
        m.bias = None
    return bool(moes)


def norm_eps_changed(model) -> bool:
    """Every block's and head's RMSNorm epsilon 1e-2 instead of the file's."""
    owners = [m for m in model.modules() if isinstance(getattr(m, "eps", None), float)]
    for m in owners:
        m.eps = 1e-2
    return bool(owners)


def head_pairs_shifted(model) -> bool:
    """The head's pairs one position off: no (zero state, x_0) pair first, as transformers feeds them."""
    model.first_pair = "none"
    return True


def _windowed(model):
    from mtpq.runtime.swa import WindowedAttention

    return [m for m in model.modules() if isinstance(m, WindowedAttention)]


def window_one_short(model) -> bool:
    """Every sliding window one key short (a query sees window - 1 keys back to itself)."""
    layers = [m for m in _windowed(model) if m.cfg.window is not None]
    for m in layers:
        m.cfg = replace(m.cfg, window=m.cfg.window - 1)
    return bool(layers)


def sinks_dropped(model) -> bool:
    """The attention sinks left out of the softmax."""
    layers = [m for m in _windowed(model) if m.sinks is not None]
    for m in layers:
        m.sinks = None
    return bool(layers)


def head_gate_dropped(model) -> bool:
    """Step-3.5's head-wise attention gate left out."""
    layers = [m for m in _windowed(model) if m.gate is not None]
    for m in layers:
        m.gate = None
    return bool(layers)


def value_scale_dropped(model) -> bool:
    """MiMo-V2.5's attention value scale left out."""
    layers = [m for m in _windowed(model) if m.cfg.value_scale != 1.0]
    for m in layers:
        m.cfg = replace(m.cfg, value_scale=1.0)
    return bool(layers)


def rope_factors_dropped(model) -> bool:
    """Step-3.5's full-attention RoPE without the rope_freqs factors (Llama-3 scaling)."""
    from mtpq.runtime.layers import rope_inv_freq

    rope = model.family.ropes[False]
    plain = rope_inv_freq(rope.dim, float(model.family.file.value("rope.freq_base")))
    if torch.equal(plain, rope.inv_freq):
        return False
    rope.inv_freq, rope._memo = plain, []
    return True


def swiglu_clamps_dropped(model) -> bool:
    """Step-3.5's SwiGLU clamps left out (routed and shared experts)."""
    moes = [m for m in _modules(model, "MoE") if m.cfg.swiglu_limit > 0 or m.cfg.shared_swiglu_limit > 0]
    for m in moes:
        m.cfg = replace(m.cfg, swiglu_limit=0.0, shared_swiglu_limit=0.0)
        if m.shared is not None:
            m.shared.limit = 0.0
    dense = [m for m in _modules(model, "SwiGLU") if m.limit > 0]
    for m in dense:
        m.limit = 0.0
    return bool(moes or dense)


def nextn_state_post_norm(model) -> bool:
    """The heads fed the trunk's (and each other's) state after the final norm, where llama.cpp's graph feeds the
    state before it."""
    model.hidden = "post_norm"
    return True


BREAKS: dict[str, Callable] = {f.__name__: f for f in (wrong_rope_base, router_bias_dropped, norm_eps_changed,
                                                        head_pairs_shifted, window_one_short, sinks_dropped,
                                                        head_gate_dropped, value_scale_dropped, rope_factors_dropped,
                                                        swiglu_clamps_dropped, nextn_state_post_norm)}
# architecture -> the breaks that apply to it (one without a router bias cannot drop it, ...)
BROKEN = {
    "glm4moe": ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted"),
    "qwen35": ("wrong_rope_base", "norm_eps_changed", "head_pairs_shifted"),
    "qwen35moe": ("wrong_rope_base", "norm_eps_changed", "head_pairs_shifted"),
    "deepseek2": ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted"),
    "deepseek2-lite": ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted"),
    "step35": ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted", "window_one_short",
               "head_gate_dropped", "rope_factors_dropped", "swiglu_clamps_dropped", "nextn_state_post_norm"),
    "mimo2": ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted", "window_one_short",
              "sinks_dropped", "value_scale_dropped", "nextn_state_post_norm"),
}


@pytest.mark.parametrize("arch, brk", [(a, b) for a in sorted(BROKEN) for b in BROKEN[a]])
def test_a_broken_runtime_fails_parity(arch, brk, parity):
    from mtpq.runtime.families import load

    path, tokens, ref = parity(arch)
    model = load(path)
    assert BREAKS[brk](model), f"{brk} found nothing to break in {arch}"
    figs = figures(model, tokens, ref)
    print(f"\n{arch:16s} {brk:20s} " + "  ".join(f"{p}: KLD {k:.1e} top-1 {t:.2%}" for p, (k, _, t) in figs.items()))
    assert failing(figs), f"{arch} with {brk} still passes: {figs}"
