"""The forms a release manifest may ship (its ``FORMS`` keys), and what each one's built checkpoint must hold.

A form name is a claim: ``fp8`` says the folder stores e4m3 weights with their scales and a quantization_config,
``tf5`` that config.json is what transformers 5 writes. :func:`form_problems` reads the built folder (config.json
and the safetensors headers, no tensor data) and lists where it is not what its name says, so a manifest cannot
name a form its encoder does not write.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

from safetensors import safe_open

KNOWN = {
    "bf16": "the release's unquantized weights (bf16, or the manifest's DTYPE; F32 where the release keeps it)",
    "fp8": "e4m3 weights, each beside its scale, described by a quantization_config",
    "mxfp4": "MXFP4 experts: packed E2M1 codes (U8) beside one E8M0 scale per 32 values",
    "fp8_mxfp4": "fp8 with the routed experts in MXFP4",
    "tf5": "config.json as the installed transformers 5 saves it",
    "no_layer_types": "config.json without the layer_types transformers derives",
    "no_dense_keys": "config.json without first_k_dense_replace / mlp_layer_types",
    "rope_theta": "RoPE spelled as a top-level rope_theta, no rope_parameters",
}
_QUANTIZED = ("F8_E4M3", "F8_E8M0", "U8", "I8")


def _tables(cfg: dict) -> list[dict]:
    """The config and its text_config (where a multimodal release keeps the language model's keys)."""
    return [cfg] + ([cfg["text_config"]] if isinstance(cfg.get("text_config"), dict) else [])


def _find(cfg: dict, key: str):
    return next((t[key] for t in _tables(cfg) if key in t), None)


def headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} of every shard, read from the headers."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    return out


def _scale_of(name: str, stored: dict) -> str | None:
    """The scale stored beside quantized weight ``name``: ``_scale_inv`` (block FP8, MXFP4), ``_scale``
    (compressed-tensors, ModelOpt) or DeepSeek's own ``.scale``."""
    candidates = (name + "_scale_inv", name + "_scale", name.removesuffix("weight") + "scale")
    return next((c for c in candidates if c in stored), None)


def _fp8_problems(cfg: dict, stored: dict) -> list[str]:
    qc = _find(cfg, "quantization_config")
    if not qc:
        return ["no quantization_config"]
    fp8 = [n for n, (dtype, _) in stored.items() if dtype == "F8_E4M3" and not n.endswith("scale")]
    if not fp8:
        return ["no e4m3 weight"]
    block = qc.get("weight_block_size")
    groups = qc.get("config_groups") or {}
    channel = any((g.get("weights") or {}).get("strategy") == "channel" for g in groups.values())
    out = []
    for name in fp8:
        scale = _scale_of(name, stored)
        if scale is None:
            out.append(f"{name}: e4m3 without a scale")
            continue
        shape, got = stored[name][1], stored[scale][1]
        if block and qc.get("quant_method") == "fp8":  # tiles cover the weight (more where it is tiled by parts)
            fits = (
                got[:-2] == shape[:-2]
                and got[-1] == math.ceil(shape[-1] / block[1])
                and math.ceil(shape[-2] / block[0]) <= got[-2] <= shape[-2]
            )
        elif channel:
            fits = got == (*shape[:-1], 1)
        else:  # per-tensor (ModelOpt)
            fits = math.prod(got) == 1
        if not fits:
            out.append(f"{scale}: shape {got} does not fit {name} {shape} in the release's scheme")
    return out


def _mxfp4_problems(cfg: dict, stored: dict) -> list[str]:
    if not _find(cfg, "quantization_config"):
        return ["no quantization_config"]
    packed = [n for n, (dtype, _) in stored.items() if dtype == "U8" and not n.endswith(("scale", "scale_inv"))]
    if not packed:
        return ["no packed (U8) weight"]
    out = []
    for name in packed:
        scale = _scale_of(name, stored)
        shape = stored[name][1]
        if scale is None or stored[scale][0] not in ("U8", "F8_E8M0"):
            out.append(f"{name}: packed codes without an E8M0 scale")
        elif stored[scale][1] != (*shape[:-1], shape[-1] * 2 // 32):
            out.append(f"{scale}: shape {stored[scale][1]} for {shape[-1] * 2} values a row")
    return out


def _bf16_problems(manifest: ModuleType, cfg: dict, stored: dict) -> list[str]:
    import torch

    want = str(getattr(manifest, "DTYPE", torch.bfloat16)).removeprefix("torch.").replace("bfloat16", "BF16")
    want = want.replace("float16", "F16").replace("float32", "F32")
    out = ["a quantization_config"] if _find(cfg, "quantization_config") else []
    out += [f"{n}: {d}" for n, (d, s) in stored.items() if d in _QUANTIZED]
    out += [f"{n}: {d}" for n, (d, s) in stored.items() if len(s) >= 2 and d not in (want, "F32")]
    if not any(d == want for d, s in stored.values() if len(s) >= 2):
        out.append(f"no {want} matrix")
    return out


def form_problems(manifest: ModuleType, form: str, folder: Path) -> list[str]:
    """Where the checkpoint built for ``form`` is not what the form's name says (empty: it is)."""
    if form not in KNOWN:
        return [f"unknown form {form!r} (known: {', '.join(KNOWN)})"]
    cfg = json.loads((folder / "config.json").read_text())
    released = manifest.CONFIG
    if form == "tf5":
        import transformers

        got = _find(cfg, "transformers_version")
        return [] if got == transformers.__version__ else [f"transformers_version {got}"]
    if form == "no_layer_types":
        return (
            []
            if _find(released, "layer_types") and _find(cfg, "layer_types") is None
            else ["layer_types not dropped (or the release has none)"]
        )
    if form == "no_dense_keys":
        kept = [k for k in ("first_k_dense_replace", "mlp_layer_types") if _find(cfg, k) is not None]
        return [f"{k} kept" for k in kept] or (
            []
            if _find(released, "first_k_dense_replace") is not None
            else ["the release has no first_k_dense_replace to drop"]
        )
    if form == "rope_theta":
        return (
            []
            if "rope_theta" in cfg and "rope_parameters" not in cfg and "rope_parameters" in released
            else ["RoPE not moved from rope_parameters to a top-level rope_theta"]
        )
    stored = headers(folder)
    out = []
    if form == "bf16":
        out += _bf16_problems(manifest, cfg, stored)
    if form in ("fp8", "fp8_mxfp4"):
        out += _fp8_problems(cfg, stored)
    if form in ("mxfp4", "fp8_mxfp4"):
        out += _mxfp4_problems(cfg, stored)
    declared = _find(released, "quantization_config")
    if declared is not None and _find(cfg, "quantization_config") != declared:
        out.append(f"quantization_config {_find(cfg, 'quantization_config')}, the manifest's CONFIG has {declared}")
    return out
