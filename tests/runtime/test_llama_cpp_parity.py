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
    "hy_v3": ("hy3", "bf16"),
    "cohere2moe": ("cohere2moe", "bf16"),
    "bailingmoe3": ("ling3_flash", "bf16"),
    "glm-dsa": ("glm5", "bf16"),
    "glm-dsa-shared": ("glm5", "bf16"),  # with GLM-5.2's shared indexer layers (SHARPER)
    "deepseek32": ("deepseek_v32", "fp8"),
    "qwen3next": ("qwen3next", "bf16"),
    "nemotron_h_moe": ("nemotron3_super", "bf16"),
    "step35": ("step35_flash", "bf16"),
    "mimo2": ("mimo_v25", "fp8"),  # (MiMo-V2-Flash's split q/k/v has no MTP graph in llama.cpp)
    "deepseek4": ("deepseek_v4_flash", "fp8"),  # a trunk file and a head file (--no-mtp, --mtp-only), as llama.cpp's
}
# the architectures whose head lives in a file of its own (llama.cpp's -md): DeepSeek-V4's output_hc_* are the
# trunk's in one file and the head's in the other
HEAD_FILE = {"deepseek4"}
# tokens per parity run where N_TOKENS hides a detail: DeepSeek-V4's compressed attention makes one key per 128
# tokens in its HCA blocks (two here, seen from position 127 and 255 on)
TOKENS = {"deepseek4": 300}
# metadata the parity file changes where the release's value hides a detail from N_TOKENS tokens of a random model:
# Cohere's window (4096) never binds and its logit_scale (1.0) scales nothing; Ling's SwiGLU clamps (4-7) never
# bind (|up| and silu(gate) stay below 2): here they bind on a few % of the values, the head's and a dense FFN's too.
# Step-3.5's and MiMo-V2's windows (512, 128) neither: 48 binds from token 48 on, in the trunk and in every head;
# Step-3.5's clamps (7 routed, 16 shared) neither (its SwiGLU inputs stay below ~3)
SHARPER = {
    "cohere2moe": {"attention.sliding_window": 32, "logit_scale": 2.0},
    "bailingmoe3": {"swiglu_clamp_exp": [0.0, 0.0, 1.0, 0.8, 1.0], "swiglu_clamp_shexp": [0.8, 0.0, 1.0, 0.8, 0.9]},
    # GLM-5 runs its indexer in every block; GLM-5.2's "shared" blocks reuse the top-k of the full block before them
    "glm-dsa-shared": {"attention.indexer.types": [True, False]},
    "step35": {
        "attention.sliding_window": 48,
        "swiglu_clamp_exp": [0.0, 0.0, 1.5, 1.5, 0.0, 0.0, 0.0],
        "swiglu_clamp_shexp": [0.0, 0.0, 0.0, 1.5, 0.0, 0.0, 0.0],
    },
    "mimo2": {"attention.sliding_window": 48},
    # DeepSeek-V4: its window (128) and indexer top-k (512) never bind on 300 tokens, nor its SwiGLU clamps (10):
    # here the window drops raw keys from token 48 on, the indexer keeps 8 of up to 75 compressed keys, and the
    # clamps (on the gate before its silu, and on up) bind on a few % of the values
    "deepseek4": {
        "attention.sliding_window": 48,
        "attention.indexer.top_k": 8,
        "swiglu_clamp_exp": [0.06] * 5,
        "swiglu_clamp_shexp": [0.06] * 5,
    },
}
# tensors the parity file scales where the fixture's values hide a detail: DeepSeek-V4's streams all start as the
# embedding and stay nearly equal on the tiny random model, so mixing them (comb) or Sinkhorn's later passes moved
# the logits by under 1e-7; with the hyper-connections' biases x20 (pre, post and comb logits) they show
SHARPER_TENSORS = {"deepseek4": {r"hc_(attn|ffn)_base": 20.0}}
# llama.cpp runs these with f32 KV caches and without flash attention (the harness's "f32"): the sparse attention's
# top-k is a discrete choice, and its default f16 storage of keys moves the indexer's scores by ~1e-4, enough to
# flip a near-tie between the k-th and the next key (one flip costs ~1e-3 KLD at its position). The fixtures'
# contexts (N_TOKENS) are twice the releases' shrunk top-k (64), so half the positions drop keys. Step-3.5's
# routers flip on the f16 rounding of keys alike (trunk KLD ~1e-2 with llama.cpp's defaults), and one of MiMo-V2.5's
# heads' near-ties (one argmax in 127: top-1 99.2 %, KLD 3.5e-8).
F32_CACHE = {"glm-dsa", "glm-dsa-shared", "deepseek32", "step35", "mimo2", "deepseek4"}
# the families whose converted "f32" file still holds other types (DeepSeek-V4: its FP8 weights become Q8_0, its FP4
# experts MXFP4, its BF16 ones stay BF16, whatever the outtype), rewritten with every float tensor F32: llama.cpp's
# CPU backend rounds the activations a Q8_0 / MXFP4 / BF16 weight multiplies (to q8_0 / bf16), and by another path
# for a batch of 300 rows than for a few (~1e-3 apart), so only f32 weights compare the graphs themselves
ALL_F32 = {"deepseek4"}


def sharpened(
    src: Path,
    out: Path,
    factor: float = SHARPEN,
    metadata: dict | None = None,
    f32: bool = False,
    scales: dict | None = None,
) -> Path:
    """``src`` with ``output_norm`` and every head's final norm (``nextn.shared_head_norm``, Ling's and MiMo's
    ``layer_output_norm``) scaled by ``factor``, and the ``metadata`` values (keys without the arch) set; with
    ``f32`` every float tensor stored F32 (see ALL_F32); ``scales``: {regex: factor} for other tensors
    (SHARPER_TENSORS)."""
    import re

    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType

    from mtpq.gguf_io import plan_from_gguf, write_plan

    plan = plan_from_gguf(src)
    for key, value in (metadata or {}).items():
        old = plan.kv.get(f"{plan.arch}.{key}")  # a key the file has keeps its type; a new one is an array of bools
        kind, sub = (old.type, old.sub_type) if old is not None else (GGUFValueType.ARRAY, GGUFValueType.BOOL)
        plan.set_kv(f"{plan.arch}.{key}", value, kind, sub)
    scaled = ("output_norm.weight", ".nextn.shared_head_norm.weight")
    plan.tensors = [
        s.with_values(lambda s=s: s.load() * factor) if s.name.endswith(scaled) else s for s in plan.tensors
    ]
    for pattern, by in (scales or {}).items():
        plan.tensors = [
            s.with_values(lambda s=s, by=by: s.load() * by) if re.search(pattern, s.name) else s for s in plan.tensors
        ]
    if f32:
        plan.tensors = [
            s.with_values(s.load).with_type(T.F32, "parity: f32") if s.source_type not in (T.F32, T.I32) else s
            for s in plan.tensors
        ]
    write_plan(plan, out)
    return out


_heads: dict[Path, Path] = {}  # a trunk file -> its head file (HEAD_FILE)


def runtime(path: Path):
    """The torch runtime's model of a parity file (with its head file where the head lives apart)."""
    from mtpq.gguf_io.pair import PairedGGUF
    from mtpq.runtime.families import load

    head = _heads.get(Path(path))
    return load(path) if head is None else load(path, g=PairedGGUF(Path(path), head))


@pytest.fixture(scope="module")
def parity(tmp_path_factory, llama_cpp_bin, llama_cpp_src):
    """get(arch) -> (model path, tokens, llama.cpp's Logits), built once per module run."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            name, form = PARITY[arch]
            work = tmp_path_factory.mktemp(f"parity-{arch}")
            ckpt = releases.build(releases.manifests()[name], work / "ckpt", form)
            meta = SHARPER.get(arch)
            head = None
            if arch in HEAD_FILE:
                from mtpq.runtime.weights import GGUFFile

                trunk = convert(ckpt, work / "f32.gguf", "f32", "--no-mtp")
                n = GGUFFile(trunk).n_blocks  # (the trunk file's per-block arrays end with its blocks)
                path = sharpened(
                    trunk,
                    work / "sharp.gguf",
                    f32=arch in ALL_F32,
                    scales=SHARPER_TENSORS.get(arch),
                    metadata={k: v[:n] if isinstance(v, list) else v for k, v in (meta or {}).items()},
                )
                head = sharpened(
                    convert(ckpt, work / "f32-head.gguf", "f32", "--mtp-only"),
                    work / "sharp-head.gguf",
                    metadata=meta,
                    f32=arch in ALL_F32,
                    scales=SHARPER_TENSORS.get(arch),
                )
                _heads[path] = head
            else:
                path = sharpened(
                    convert(ckpt, work / "f32.gguf"),
                    work / "sharp.gguf",
                    metadata=meta,
                    f32=arch in ALL_F32,
                    scales=SHARPER_TENSORS.get(arch),
                )
            vocab = runtime(path).vocab_size
            n = TOKENS.get(arch, N_TOKENS)
            tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7)).tolist()
            cache[arch] = (
                path,
                tokens,
                llama_cpp_logits(
                    llama_cpp_bin, llama_cpp_src, path, tokens, work, f32_cache=arch in F32_CACHE, head=head
                ),
            )
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
    return [
        f"{part}: mean KLD {k:.2e}, top-1 {t:.2%}"
        for part, (k, _, t) in figs.items()
        if not (k <= MAX_KLD and t >= MIN_TOP1)
    ]


@pytest.mark.parametrize("arch", sorted(PARITY))
def test_runtime_matches_llama_cpp(arch, parity):
    path, tokens, ref = parity(arch)
    model = runtime(path)
    assert model.n_heads >= 1
    figs = figures(model, tokens, ref)
    print(
        f"\n{arch:16s} " + "  ".join(f"{p}: KLD {k:.1e} (max {m:.1e}) top-1 {t:.2%}" for p, (k, m, t) in figs.items())
    )
    assert not failing(figs), failing(figs)
    # and the trunk's NextN states are llama.cpp's (what the head is fed)
    h = model.trunk(torch.tensor([tokens]), use_cache=False).hidden[0].numpy()
    assert np.abs(h - ref.hidden).max() <= 1e-3 * max(1.0, np.abs(ref.hidden).max())


@pytest.mark.parametrize("arch", sorted(PARITY))
def test_trunk_matches_llama_perplexity_base(arch, parity, llama_cpp_bin, tmp_path):
    """The trunk against llama-perplexity's own logits: its --kl-divergence-base file of the same GGUF on a text,
    read by ``mtpq compare --kld-base`` (its 16-bit log-probabilities), within the gates."""
    import inspect
    import json
    import json.decoder

    from tests.acceptance.test_compare_kld_base import perplexity
    from tests.helpers.runcli import run_cli

    path = parity(arch)[0]
    text, base = tmp_path / "text.txt", tmp_path / "base.kld"
    text.write_text(inspect.getsource(json.decoder) * 3)
    f32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off") if arch in F32_CACHE else ()  # (as the harness runs them)
    perplexity(llama_cpp_bin, "-m", path, "-f", text, "-c", 128, "--chunks", 4, *f32, "--kl-divergence-base", base)
    res = run_cli("compare", "--kld-base", base, path, "--numerics", "exact", "--json", "-", "--threads", 1)
    assert res.exit_code == 0, res.output
    f = json.loads(res.stdout)["files"][0]
    print(
        f"\n{arch:16s} against llama-perplexity's base: mean KLD {f['kld_mean']:.1e} (max {f['kld_max']:.1e}) "
        f"top-1 {f['top1']:.2%}"
    )
    assert f["kld_mean"] <= MAX_KLD and f["top1"] >= MIN_TOP1


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


def routed_scale_dropped(model) -> bool:
    """Every MoE's routed scaling factor (``expert_weights_scale``) taken as 1."""
    moes = [m for m in _modules(model, "MoE") if m.cfg.scale != 1.0]
    for m in moes:
        m.cfg = replace(m.cfg, scale=1.0)
    return bool(moes)


def expert_groups_ignored(model) -> bool:
    """Group-limited routing skipped: the top-k over every expert."""
    moes = [m for m in _modules(model, "MoE") if m.cfg.n_group > 1]
    for m in moes:
        m.cfg = replace(m.cfg, n_group=1, topk_group=1)
    return bool(moes)


def swiglu_clamp_dropped(model) -> bool:
    """Every SwiGLU clamp (routed experts, shared expert, dense FFN) ignored."""
    from mtpq.runtime.layers import MoE, SwiGLU

    found = False
    for m in model.modules():
        if isinstance(m, SwiGLU) and m.limit > 0:
            m.limit, found = 0.0, True
        elif isinstance(m, MoE) and m.cfg.swiglu_limit > 0:
            m.cfg, found = replace(m.cfg, swiglu_limit=0.0), True
    return found


def window_one_short(model) -> bool:
    """Every sliding window one position short."""
    from mtpq.runtime.swa import SlidingWindowAttention, WindowedAttention

    layers = [m for m in model.modules() if isinstance(m, SlidingWindowAttention)]
    for m in layers:
        m.window -= 1
    windowed = [m for m in model.modules() if isinstance(m, WindowedAttention) and m.cfg.window is not None]
    for m in windowed:
        m.cfg = replace(m.cfg, window=m.cfg.window - 1)
    compressed = _compressed(model)
    for m in compressed:
        m.window -= 1
    return bool(layers or windowed or compressed)


def nope_layers_rotated(model) -> bool:
    """The full-attention layers that have no RoPE (Cohere's) rotated like the others."""
    layers = [m for m in _modules(model, "Attention") if m.rope.dim == 0]
    for m in layers:
        m.rope = model.family.rope
    return bool(layers)


def logit_scale_dropped(model) -> bool:
    """The logits, trunk's and heads', not multiplied by ``logit_scale``."""
    owners = [m for m in (model, model.mtp, *model.later_heads) if m is not None and m.logit_scale != 1.0]
    for m in owners:
        m.logit_scale = 1.0
    return bool(owners)


def kda_gate_bound_changed(model) -> bool:
    """Every KDA decay's lower bound 10 % off (the log decay is bound * sigmoid(...))."""
    from mtpq.runtime.kda import KimiDeltaAttention

    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in layers:
        m.cfg = replace(m.cfg, gate_lower_bound=0.9 * m.cfg.gate_lower_bound)
    return bool(layers)


def kda_conv_reversed(model) -> bool:
    """Every KDA short convolution's taps in reverse time order."""
    from mtpq.runtime.kda import KimiDeltaAttention

    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in layers:
        m.taps = m.taps.flip(0)
    return bool(layers)


class _Open(torch.nn.Module):
    """A gate projection whose sigmoid is 1 everywhere."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x.new_full((*x.shape[:-1], self.n), 100.0)


def mla_gate_dropped(model) -> bool:
    """Ling's head-wise MLA output gate left open (every head's output passed as it is)."""
    from mtpq.runtime.families.bailingmoe3 import GatedMLA

    layers = [m for m in model.modules() if isinstance(m, GatedMLA)]
    for m in layers:
        m.gate = _Open(m.cfg.n_heads)
    return bool(layers)


def _sparse(model, full: bool | None = None):
    """The sparse-attention layers (``full``: only those with their own indexer, False: only shared ones)."""
    from mtpq.runtime.dsa import SparseMLA

    return [
        m for m in model.modules() if isinstance(m, SparseMLA) and (full is None or (m.indexer is not None) == full)
    ]


def top_k_one_fewer(model) -> bool:
    """Every sparse-attention query reads one key fewer than the indexer's top-k."""
    layers = _sparse(model) + _compressed(model, indexed=True)
    for m in layers:
        m.top_k -= 1
    return bool(layers)


def indexer_relu_dropped(model) -> bool:
    """The indexer's scores summed over heads without the ReLU on each head's dot products."""
    layers = _sparse(model, full=True)
    for m in layers:
        m.indexer.activation = lambda t: t
    compressed = _compressed(model, indexed=True)
    for m in compressed:
        m.activation = lambda t: t
    return bool(layers or compressed)


def indexer_rope_pairs_swapped(model) -> bool:
    """The indexer's RoPE in the other pair order (NeoX halves <-> adjacent pairs), the main MLA's unchanged."""
    from mtpq.runtime.layers import Rope

    layers = _sparse(model, full=True)
    for m in layers:
        r = m.indexer.rope
        m.indexer.rope = Rope(r.inv_freq, neox=not r.neox, mscale=r.mscale)
    return bool(layers)


def ties_by_torch_topk(model) -> bool:
    """Ties at the k-th score broken by torch.topk instead of as ggml's CPU top-k breaks them."""

    def plain(scores, k):
        picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            -1, scores.topk(min(k, scores.shape[-1])).indices, True
        )
        return (picked & (scores > float("-inf")))[:, None]

    layers = _sparse(model, full=True)
    for m in layers:
        m.select = plain
    return bool(layers)


def shared_layers_dense(model) -> bool:
    """GLM-5.2's shared indexer layers attend to every earlier key instead of the last full layer's top-k."""
    from mtpq.runtime.dsa import Selections

    class Dense(Selections):
        def get(self, key):
            return None

    layers = _sparse(model, full=False)
    for m in layers:
        m.selections = Dense()
    return bool(layers)


def _layers(model, module: str, kind: str):
    """The model's layers of class ``kind`` from ``mtpq.runtime.<module>``."""
    import importlib

    cls = getattr(importlib.import_module(f"mtpq.runtime.{module}"), kind)
    return [m for m in model.modules() if isinstance(m, cls)]


def deltanet_heads_tiled(model) -> bool:
    """Qwen3-Next's DeltaNet reading key heads in Qwen3.5's tiled order (value head h -> key head h % n_k)."""
    layers = _layers(model, "deltanet", "GatedDeltaNet")
    for m in layers:
        m.cfg = replace(m.cfg, grouped_heads=False)
    return bool(layers)


def fused_ba_halved(model) -> bool:
    """The fused ``ssm_ba`` read as [n_v betas ; n_v alphas] instead of per key head (r betas, r alphas): the
    correct split of the rows that split would read."""
    layers = [m for m in _layers(model, "deltanet", "GatedDeltaNet") if m.wba is not None]
    for m in layers:
        w = m.wba.weight
        n_k, n_v = m.cfg.n_k_heads, m.cfg.n_v_heads
        # row k*2r + c of the correct layout takes what the halved reading gives it: beta / alpha row k*r + c
        halves = torch.arange(2 * n_v).view(2, n_k, n_v // n_k).transpose(0, 1).reshape(-1)
        w.data = w.data[halves]
    return bool(layers)


def mamba_groups_tiled(model) -> bool:
    """Mamba-2 head h reading B/C group h % G instead of h // (heads / G) (repeat for repeat_interleave)."""
    layers = _layers(model, "mamba2", "Mamba2")
    for m in layers:
        m.group_of_head = torch.arange(m.cfg.n_heads) % m.cfg.n_groups
    return bool(layers)


def mamba_norm_ungrouped(model) -> bool:
    """Mamba-2's gated RMSNorm over the whole inner width instead of per group."""
    layers = _layers(model, "mamba2", "Mamba2")
    for m in layers:
        m.norm = m.norm.reshape(1, -1)
    return bool(layers)


def mamba_d_skip_dropped(model) -> bool:
    """Mamba-2 without its D skip (y + D x)."""
    layers = _layers(model, "mamba2", "Mamba2")
    for m in layers:
        m.d = torch.zeros_like(m.d)
    return bool(layers)


def attention_roped(model) -> bool:
    """RoPE (NeoX, base 10000, every dim) on attention that llama.cpp runs without position encoding."""
    from mtpq.runtime.layers import Rope, rope_inv_freq

    layers = [m for m in _modules(model, "Attention") if m.rope is None]
    for m in layers:
        m.rope = Rope(rope_inv_freq(m.cfg.head_dim, 10000.0))
    return bool(layers)


def head_norm_rms(model) -> bool:
    """Nemotron-H's head ending in an RMSNorm instead of its LayerNorm."""
    heads = [h for h in (model.mtp, *model.later_heads) if h.layer_norm_head]
    for h in heads:
        h.layer_norm_head = False
    return bool(heads)


def _windowed(model):
    from mtpq.runtime.swa import WindowedAttention

    return [m for m in model.modules() if isinstance(m, WindowedAttention)]


def sinks_dropped(model) -> bool:
    """The attention sinks left out of the softmax."""
    layers = [m for m in _windowed(model) if m.sinks is not None]
    for m in layers:
        m.sinks = None
    compressed = _compressed(model)
    for m in compressed:  # (a sink of -inf weighs nothing)
        m.sinks = torch.full_like(m.sinks, float("-inf"))
    return bool(layers or compressed)


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


def nextn_state_post_norm(model) -> bool:
    """The heads fed the trunk's (and each other's) state after the final norm, where llama.cpp's graph feeds the
    state before it."""
    model.hidden = "post_norm"
    return True


def _compressed(model, indexed: bool = False):
    """DeepSeek-V4's attention layers (``indexed``: only those with the lightning indexer)."""
    from mtpq.runtime.dsv4 import CompressedAttention

    return [m for m in model.modules() if isinstance(m, CompressedAttention) and (not indexed or m.indexer is not None)]


def swiglu_clamp_after_silu(model) -> bool:
    """DeepSeek-V4's SwiGLU clamps applied as the other families' are (silu(gate) clamped, not the gate before it)."""
    from mtpq.runtime.layers import MoE, SwiGLU

    found = False
    for m in model.modules():
        if isinstance(m, SwiGLU) and m.clamp_gate:
            m.clamp_gate, found = False, True
        elif isinstance(m, MoE) and m.cfg.clamp_gate:
            m.cfg, found = replace(m.cfg, clamp_gate=False), True
    return found


def hash_routing_by_score(model) -> bool:
    """DeepSeek-V4's hash layers routed by score instead of by their token -> experts table."""
    from mtpq.runtime.dsv4 import HashMoE

    layers = [m for m in model.modules() if isinstance(m, HashMoE) and m.tid2eid is not None]
    for m in layers:
        m.tid2eid = None
    return bool(layers)


def _hyper_pre_changed(model, change) -> bool:
    """Every DeepSeek-V4 hyper-connection's (cur, post, comb) passed through ``change`` on their way out."""
    from mtpq.runtime.dsv4 import HyperMix

    mixes = [m for m in model.modules() if isinstance(m, HyperMix)]
    for m in mixes:
        m.pre = lambda x, pre=m.pre: change(*pre(x))
    return bool(mixes)


def streams_unmixed(model) -> bool:
    """DeepSeek-V4's hyper-connections without their stream mixing (comb the identity: each stream keeps its own)."""
    eye = lambda comb: torch.eye(comb.shape[-1], dtype=comb.dtype).expand_as(comb)  # noqa: E731
    return _hyper_pre_changed(model, lambda cur, post, comb: (cur, post, eye(comb)))


def sinkhorn_one_pass(model) -> bool:
    """The hyper-connections' Sinkhorn normalisation stopped after its first pass (columns only)."""
    from mtpq.runtime.dsv4 import HyperMix

    mixes = [m for m in model.modules() if isinstance(m, HyperMix) and m.cfg.iters > 1]
    for m in mixes:
        m.cfg = replace(m.cfg, iters=1)
    return bool(mixes)


def hyper_post_halved(model) -> bool:
    """DeepSeek-V4's hyper-connections writing each layer's output at sigmoid(...) instead of 2 sigmoid(...)."""
    return _hyper_pre_changed(model, lambda cur, post, comb: (cur, post * 0.5, comb))


def compressed_keys_dropped(model) -> bool:
    """DeepSeek-V4's compressed keys left out: every layer attends over its window only."""
    layers = [m for m in _compressed(model) if m.compressor is not None]
    for m in layers:
        keys = m.compressor.keys
        m.compressor.keys = lambda kv, score, keys=keys: keys(kv, score)[:, :, :0]
    return bool(layers)


BREAKS: dict[str, Callable] = {
    f.__name__: f
    for f in (
        wrong_rope_base,
        router_bias_dropped,
        norm_eps_changed,
        head_pairs_shifted,
        routed_scale_dropped,
        expert_groups_ignored,
        swiglu_clamp_dropped,
        window_one_short,
        nope_layers_rotated,
        logit_scale_dropped,
        kda_gate_bound_changed,
        kda_conv_reversed,
        mla_gate_dropped,
        top_k_one_fewer,
        indexer_relu_dropped,
        indexer_rope_pairs_swapped,
        ties_by_torch_topk,
        shared_layers_dense,
        deltanet_heads_tiled,
        fused_ba_halved,
        mamba_groups_tiled,
        mamba_norm_ungrouped,
        mamba_d_skip_dropped,
        attention_roped,
        head_norm_rms,
        sinks_dropped,
        head_gate_dropped,
        value_scale_dropped,
        rope_factors_dropped,
        nextn_state_post_norm,
        swiglu_clamp_after_silu,
        hash_routing_by_score,
        streams_unmixed,
        sinkhorn_one_pass,
        hyper_post_halved,
        compressed_keys_dropped,
    )
}
# the breaks every family takes (NO_BIAS: those without a router bias), and a DeepSeek sparse-attention indexer's
COMMON = ("wrong_rope_base", "router_bias_dropped", "norm_eps_changed", "head_pairs_shifted")
NO_BIAS = tuple(b for b in COMMON if b != "router_bias_dropped")
INDEXER = ("top_k_one_fewer", "indexer_relu_dropped", "indexer_rope_pairs_swapped", "ties_by_torch_topk")
# architecture -> the breaks that apply to it
BROKEN = {
    "glm4moe": COMMON,
    "qwen35": NO_BIAS,
    "qwen35moe": NO_BIAS,
    "deepseek2": COMMON,
    "deepseek2-lite": COMMON,
    "hy_v3": (*COMMON, "routed_scale_dropped"),
    "cohere2moe": (*NO_BIAS, "window_one_short", "nope_layers_rotated", "logit_scale_dropped"),
    "bailingmoe3": (
        *COMMON,
        "routed_scale_dropped",
        "expert_groups_ignored",
        "swiglu_clamp_dropped",
        "kda_gate_bound_changed",
        "kda_conv_reversed",
        "mla_gate_dropped",
    ),
    "glm-dsa": (*COMMON, *INDEXER),
    "glm-dsa-shared": ("top_k_one_fewer", "shared_layers_dense"),
    "deepseek32": (*COMMON, *INDEXER),
    "qwen3next": (*NO_BIAS, "deltanet_heads_tiled", "fused_ba_halved"),
    "nemotron_h_moe": (
        "router_bias_dropped",
        "norm_eps_changed",
        "head_pairs_shifted",
        "mamba_groups_tiled",
        "mamba_norm_ungrouped",
        "mamba_d_skip_dropped",
        "attention_roped",
        "head_norm_rms",
    ),
    "step35": (
        *COMMON,
        "window_one_short",
        "head_gate_dropped",
        "rope_factors_dropped",
        "swiglu_clamp_dropped",
        "nextn_state_post_norm",
    ),
    "mimo2": (*COMMON, "window_one_short", "sinks_dropped", "value_scale_dropped", "nextn_state_post_norm"),
    "deepseek4": (
        *COMMON,
        "window_one_short",
        "sinks_dropped",
        "top_k_one_fewer",
        "indexer_relu_dropped",
        "swiglu_clamp_dropped",
        "swiglu_clamp_after_silu",
        "hash_routing_by_score",
        "streams_unmixed",
        "sinkhorn_one_pass",
        "hyper_post_halved",
        "compressed_keys_dropped",
    ),
}


@pytest.mark.parametrize("arch, brk", [(a, b) for a in sorted(BROKEN) for b in BROKEN[a]])
def test_a_broken_runtime_fails_parity(arch, brk, parity):
    path, tokens, ref = parity(arch)
    model = runtime(path)
    assert BREAKS[brk](model), f"{brk} found nothing to break in {arch}"
    figs = figures(model, tokens, ref)
    print(f"\n{arch:16s} {brk:20s} " + "  ".join(f"{p}: KLD {k:.1e} top-1 {t:.2%}" for p, (k, _, t) in figs.items()))
    assert failing(figs), f"{arch} with {brk} still passes: {figs}"
