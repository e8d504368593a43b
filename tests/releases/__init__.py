"""Release manifests: checkpoints shaped like the ones actually published, not like our reading of a converter.

One module per published release layout (``glm45_air.py``, ``step35_flash.py``, ...). Each declares, as data:

``RELEASE``   the Hugging Face repository (or repositories) it describes, e.g. ``"stepfun-ai/Step-3.5-Flash"``.
``SOURCES``   where every config key and tensor name below was read: the release's own config.json and
              safetensors index where they could be found, else the loaders of inference engines (vLLM,
              SGLang, transformers' modeling code, llama.cpp's conversion/*.py) -- file paths, cited. Each
              entry names its location (a URL, a repository path, a pull request), then in parentheses what
              was read there; every config key or tensor name it names there the manifest has
              (_citations.py checks both). What was read without a recorded location goes in the docstring.
``CONFIG``    the release's config.json with every key it has; sizes (hidden, layers, experts, heads, ...)
              shrunk, everything else as released. ``vocab_size`` is replaced by the tiny tokenizer's size.
``tensors(cfg) -> dict[name, shape]``
              every tensor the release stores (bf16 form), named as released, MTP layers included, with the
              shape ``cfg`` implies.
``FORMS``     ``{form: encoder or None}``: the forms the release ships ("bf16", "fp8", "mxfp4" ...); an encoder
              ``(folder) -> None`` rewrites the bf16 folder into that form (config.json included). Each name is
              one of _forms.KNOWN and the built folder must hold what it says; the docstring names each form,
              and a quantized one is cited (by a source, or by the release's own config.json).
optional:
``SPECIALS``  the tokenizer's special tokens (default GLM's, which llama.cpp's GLM vocab code expects).
``LLAMA_CPP_RAW_CONFIG``  True where llama.cpp's converter must read config.json as stored because it cannot
              read transformers 5's rewritten view of it (say why in the module).
``DIFFERS``   ``{(form, mode): LlamaCpp*}``: matrix cells where mtpq knowingly does not do what llama.cpp's
              converter does (mode: None, "--no-mtp", "--mtp"): mtpq must still convert, and the record says
              what llama.cpp does instead (:class:`LlamaCppRefuses`, :class:`LlamaCppWritesOurs`,
              :class:`LlamaCppDiffersIn`); the matrix asserts it, so a cell where llama.cpp now does
              something else fails.
``LLAMA_CPP_MODE``  ``{mode: llama.cpp's mode}``: cells compared with another mode of llama.cpp's converter
              (deepseek2: it drops the MTP layer by default and refuses --no-mtp, so its default file is what
              mtpq's --no-mtp writes).
``DIFFERS_KEYS``  ``{metadata key: reason}``: keys mtpq knowingly writes where llama.cpp's converter writes another
              value or none (each must really differ); every other key and tensor is still compared.
``REFUSES``   ``{(form, mode): LlamaCpp*}``: cells where mtpq knowingly refuses (exit 2, one line) what llama.cpp's
              converter writes, the record saying what llama.cpp writes (asserted as for ``DIFFERS``). Where the
              default mode is refused, the head is checked in its head-only file (``--mtp-only``) beside a
              ``--no-mtp`` trunk.
``DRAFTS``    True when llama.cpp has an MTP graph for the GGUF arch (the file must draft there).

:func:`build` writes the tiny checkpoint; tests/convert/test_release_matrix.py runs every manifest.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

MODES = (None, "--no-mtp", "--mtp")  # llama.cpp converter's flags: the full file, trunk only, head only
# GGUF architecture -> (release manifest, form): the release-shaped checkpoint the runtime tests build for each
# architecture the demo trainer cannot (tests/runtime/test_trained_acceptance.py, test_commands_per_arch.py)
BY_ARCH = {
    "deepseek4": ("deepseek_v4_flash", "fp8"),
    "glm-dsa": ("glm5", "bf16"),
    "deepseek32": ("deepseek_v32", "fp8"),
    "qwen3next": ("qwen3next", "bf16"),
    "nemotron_h_moe": ("nemotron3_super", "bf16"),
    "step35": ("step35_flash", "bf16"),
    "mimo2": ("mimo_v25", "fp8"),
    "hy_v3": ("hy3", "bf16"),
    "cohere2moe": ("cohere2moe", "bf16"),
    "bailingmoe3": ("ling3_flash", "bf16"),
}
# the architectures whose head llama.cpp's converter writes to a file of its own (--no-mtp / --mtp-only; -md)
HEAD_FILE = {"deepseek4"}


# ----------------------------------------------------------------------------- what llama.cpp does where mtpq does not


@dataclass(frozen=True)
class LlamaCppRefuses:
    """llama.cpp's converter exits non-zero in the cell, its log matching the regular expression ``log``."""

    reason: str
    log: str


@dataclass(frozen=True)
class LlamaCppWritesOurs:
    """llama.cpp's converter writes, in the cell, the file mtpq writes in converter mode ``mode`` (every tensor
    and key compared, ``DIFFERS_KEYS`` aside)."""

    reason: str
    mode: str


@dataclass(frozen=True)
class LlamaCppDiffersIn:
    """llama.cpp's converter writes mtpq's file but for the tensors matching ``tensors``: each is ``ours`` in
    mtpq's file and ``theirs`` with ``their_width`` times the row length in llama.cpp's (at least one matches).
    ``keys`` are metadata keys derived from those tensors (file type, size label): they may differ."""

    reason: str
    tensors: str
    ours: str
    theirs: str
    their_width: float
    keys: tuple[str, ...] = field(default=())


def manifests() -> dict[str, ModuleType]:
    """Every manifest module in this package, by module name."""
    out = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        out[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return out


def cells(with_modes: bool = True) -> list[tuple[str, str, str | None]]:
    """(manifest, form, mode) for every manifest, each form it ships and each converter mode."""
    out = []
    for name, m in manifests().items():
        for form in m.FORMS:
            for mode in MODES if with_modes else (None,):
                out.append((name, form, mode))
    return out


def ci_cells() -> set[tuple[str, str, str | None]]:
    """The differential matrix's cells CI runs (``make test-extra``): for each GGUF architecture, the first manifest
    of it (by name) in its first form, every converter mode. The other cells are ``heavy`` (``make test-heavy``)."""
    from mtpq.convert import CONVERT_FAMILIES

    first: dict[str, str] = {}
    for name, m in manifests().items():
        arch = CONVERT_FAMILIES[m.CONFIG["architectures"][0]].arch
        first.setdefault(arch, name)
    return {(name, next(iter(manifests()[name].FORMS)), mode) for name in first.values() for mode in MODES}


def variant(base: dict, changes: dict, drop: tuple[str, ...] = (), first: tuple[str, ...] = ()) -> dict:
    """A config.json derived from a sibling release's (or from keys several releases share): ``base`` without
    ``drop``, with ``changes``. A key ``base`` has keeps its place; a new one goes before the first key that sorts
    after it (so a sorted ``base`` stays sorted, as transformers writes config.json); ``first`` names the keys the
    release lists at the top, in its order."""
    out = [[k, v] for k, v in base.items() if k not in drop]
    for key, value in changes.items():
        at = next((i for i, (k, _) in enumerate(out) if k == key), None)
        if at is not None:
            out[at][1] = value
        else:
            out.insert(next((i for i, (k, _) in enumerate(out) if k > key), len(out)), [key, value])
    table = dict(out)
    return {**{k: table[k] for k in first}, **table}


def mlp(p: str, ff: int, h: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's projections under ``p`` (``p + "gate_proj.weight"``, up, down), in the releases' order."""
    return {p + "gate_proj.weight": (ff, h), p + "up_proj.weight": (ff, h), p + "down_proj.weight": (h, ff)}


def experts(p: str, ne: int, ff: int, h: int) -> dict[str, tuple[int, ...]]:
    """``ne`` routed experts stored one by one (``p + "{e}.gate_proj.weight"``, ...)."""
    return {n: s for e in range(ne) for n, s in mlp(f"{p}{e}.", ff, h).items()}


def trunk(v: int, h: int, embed: str = "model.embed_tokens.weight", lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """The trunk's own tensors: the embeddings ``embed`` [v, h], the final ``model.norm`` and (unless tied)
    ``lm_head`` [v, h]."""
    out = {embed: (v, h), "model.norm.weight": (h,)}
    if lm_head:
        out["lm_head.weight"] = (v, h)
    return out


def block_norms(p: str, h: int) -> dict[str, tuple[int, ...]]:
    """A pre-norm decoder block's two norms under ``p``: ``input_layernorm``, ``post_attention_layernorm``."""
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


def attention(
    p: str, h: int, nh: int, nkv: int, d: int, *, bias: bool = False, qk_norm: bool = False, gated: bool = False
) -> dict[str, tuple[int, ...]]:
    """GQA projections under ``p`` (``p + "q_proj.weight"``, k, v, o; ``nh`` query and ``nkv`` key/value heads
    of ``d``), in the releases' order: with ``bias`` each of q/k/v followed by its bias, with ``qk_norm`` the
    per-head ``q_norm``/``k_norm`` after o; ``gated``: q_proj also holds the output gate (2 x the rows)."""
    out = {}
    for x, rows in (("q", (2 if gated else 1) * nh * d), ("k", nkv * d), ("v", nkv * d)):
        out[p + f"{x}_proj.weight"] = (rows, h)
        if bias:
            out[p + f"{x}_proj.bias"] = (rows,)
    out[p + "o_proj.weight"] = (h, nh * d)
    if qk_norm:
        out |= {p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)}
    return out


def nextn(p: str, h: int, *norms: str) -> dict[str, tuple[int, ...]]:
    """An MTP layer's NextN tensors under ``p``: ``eh_proj`` [h, 2h], ``enorm``, ``hnorm``, then the ``norms``
    the release adds (``shared_head.norm``, ``final_layernorm``)."""
    return {p + "eh_proj.weight": (h, 2 * h), **{p + n + ".weight": (h,) for n in ("enorm", "hnorm", *norms)}}


def _values(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values of a plausible kind: norms near 1, other 1-D tensors small, matrices ~N(0, 0.02)."""
    if len(shape) == 1:
        base = 1.0 if "norm" in name.rsplit(".", 2)[-2:][0] else 0.0  # (a top-level name may have no dot)
        return base + 0.05 * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)


def _shrink_token_ids(table: dict, n_specials: int) -> None:
    """Token ids (``eos_token_id``: 151329, ...) are shrunk with the vocab: each becomes one of the tiny
    tokenizer's special tokens (ids 0..n_specials-1), deterministically, so the release's structure (one id or
    a list) stays."""
    for key, value in table.items():
        if key.endswith("_token_id") and value is not None:
            table[key] = [v % n_specials for v in value] if isinstance(value, list) else value % n_specials


def build(manifest: ModuleType, folder: Path, form: str = "bf16", seed: int = 0) -> Path:
    """The tiny checkpoint of ``manifest`` in ``form``: config.json, tokenizer, 2 safetensors shards + index."""
    from tests.builders import tiny

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = getattr(manifest, "SPECIALS", tiny.GLM_SPECIALS)
    vocab = tiny.make_tokenizer(folder, specials=specials) + 4  # + padding ids, as releases have
    cfg = json.loads(json.dumps(manifest.CONFIG))  # a deep copy
    text = (
        cfg.get("text_config")
        if isinstance(cfg.get("text_config"), dict) and "vocab_size" in cfg.get("text_config", {})
        else cfg
    )
    text["vocab_size"] = vocab
    for table in {id(cfg): cfg, id(text): text}.values():
        _shrink_token_ids(table, len(specials))
    gen = torch.Generator().manual_seed(seed)
    shapes = manifest.tensors(cfg)
    dtype = getattr(manifest, "DTYPE", torch.bfloat16)
    tensors = {n: _values(n, tuple(s), gen).to(dtype) for n, s in shapes.items()}
    tiny.save_checkpoint(folder, cfg, tensors, n_shards=2)
    encoder = manifest.FORMS[form]
    if encoder is not None:
        encoder(folder)
    return folder


def set_config(folder: Path, **keys) -> None:
    """Sets ``keys`` in the folder's config.json (written as the encoders write it: indent 2)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(keys)
    path.write_text(json.dumps(cfg, indent=2))


def fp8_block_scaled(folder: Path, keep=None, **quantization_config) -> None:
    """The release's FP8 form as DeepSeek-V3 ships it: every 2-D projection e4m3 with 128x128 ``weight_scale_inv``
    tiles (embeddings, lm_head, norms and routers stay bf16, and every weight ``keep(name)`` names: the release's
    ``modules_to_not_convert``). The written quantization_config is the manifest's CONFIG's where it has one, else
    ``{"activation_scheme": "dynamic", "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``;
    ``quantization_config`` entries override it."""
    from tests.builders import tiny

    path = folder / "config.json"
    released = json.loads(path.read_text()).get("quantization_config")  # the manifest's own, where it has one
    tiny.to_fp8_block_scaled(folder, keep=keep)
    cfg = json.loads(path.read_text())
    qc = released or {"activation_scheme": "dynamic", **cfg["quantization_config"]}
    cfg["quantization_config"] = {**qc, **quantization_config}
    path.write_text(json.dumps(cfg, indent=2))


# compressed-tensors' FP8 scheme as llm-compressor writes it (GLM-4.5/4.6/4.7-FP8): one group, every Linear, weights
# per output channel (``weight_scale`` [out, 1]), activations dynamic per token
COMPRESSED_TENSORS_FP8 = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "actorder": None,
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": None,
                "observer_kwargs": {},
                "strategy": "token",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": None,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def fp8_per_channel(folder: Path, keep=None, **quantization_config) -> None:
    """The compressed-tensors FP8 form: every 2-D projection e4m3 with a per-channel ``weight_scale`` [out, 1]
    (embeddings, lm_head, norms and routers stay bf16, and every weight ``keep(name)`` names);
    ``quantization_config`` entries override :data:`COMPRESSED_TENSORS_FP8`."""
    from tests.builders import tiny

    tiny.to_fp8_per_channel(folder, keep=keep)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = json.loads(json.dumps({**COMPRESSED_TENSORS_FP8, **quantization_config}))
    path.write_text(json.dumps(cfg, indent=2))


def transformers_saved(folder: Path) -> None:
    """config.json as transformers 5 saves it (``AutoConfig.from_pretrained(folder).save_pretrained(folder)``, what a
    fine-tune or merge written by ``save_pretrained`` holds): ``rope_parameters`` where 4.x wrote ``rope_scaling`` /
    ``rope_theta`` / ``partial_rotary_factor``, ``dtype`` for ``torch_dtype``, the derived ``layer_types`` /
    ``mlp_layer_types``; the keys its config class does not know are kept."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(folder), trust_remote_code=False).save_pretrained(str(folder))


def without(*keys: str):
    """An encoder dropping ``keys`` from config.json (and its ``text_config``): a config that omits what
    transformers derives (``layer_types``, ``mlp_layer_types``, ...)."""

    def encode(folder: Path) -> None:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        for table in (cfg, cfg.get("text_config") or {}):
            for k in keys:
                table.pop(k, None)
        path.write_text(json.dumps(cfg, indent=2))

    return encode
