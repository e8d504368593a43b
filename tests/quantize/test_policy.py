"""The precision policy against llama-quantize's own per-tensor choices.

Test data (tests/data/llama_quantize_choices/*.json) was recorded with the
llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (llama.cpp of
2026-10-01), by running this file as a script:

    MTPQ_LLAMA_CPP_BIN=.../llama.cpp/build/bin PYTHONPATH=. python tests/quantize/test_policy.py --record

For every variant in ``VARIANTS`` it builds the tiny checkpoint (tests/builders/tiny*.py,
f32), converts it with mtpq to an f32 GGUF, runs
``llama-quantize --dry-run [options] tiny-f32.gguf PRESET 1`` for every run in
``runs_for`` and stores the type its log gives every tensor. The variant's
first run and the runs that change metadata also write ``out.gguf``; gguf-py's
GGUFReader reads their types, and the first run's must equal its dry run's.
Runs with ``{"imatrix": true}`` pass ``--imatrix`` with a synthetic imatrix
(:func:`synthetic_imatrix`: an entry of ones for every 2-D/3-D weight, written
by mtpq's imatrix writer): which types a preset picks depends only on whether
importance data is given (Q4_0/Q5_0's first ffn_down
layers, IQ4_NL/IQ4_XS's, IQ3_XXS's attn_v and ffn_down, and Q2_K_S and the
IQ1/IQ2/IQ3_XXS/IQ3_XS presets, which need one). The variants exercise: GLM-4.5 with 8 trunk
layers + 1 MTP block (so llama.cpp's use_more_bits layer pattern has room); an
8-expert GLM with GQA 4 and tied embeddings (llama.cpp's n_expert == 8 and
n_gqa >= 4 rules, token_embd following the output rules); rows that are not
multiples of 256 or of 32 (the K-quant and q8_0 fallbacks); Qwen3.5 dense and
MoE (attn_qkv counted as attn_v, dense ffn_down by running count, ssm tensors);
DeepSeek-V3 (MLA's attn_kv_b, 8 experts); GLM-5.x (glm-dsa: its indexer tensors) and
GLM-4.7-Flash (deepseek2 with the MTP block llama-quantize then sees); Qwen3-Next (the split
in_proj_qkvz, ssm_ba); DeepSeek-V3.2 (the lightning indexer); Hy3, Cohere2 MoE, Nemotron-H MoE
and Ling 3.0 (their MTP blocks). ``test_recorded_choices_are_current``
(marked llama_cpp, slow) re-records into a temporary folder and compares.

Runs with llama-quantize's other options (``--leave-output-tensor``,
``--tensor-type-file``, ``--override-kv``, ``--prune-layers``) record, besides
the types, the output's tensor names when they differ from the input's
(``names``: pruning renumbers blocks) and, for ``--override-kv`` and
``--prune-layers``, the metadata those touch (``kv``: block and MTP counts,
per-layer arrays, the overridden keys), where ``test_metadata_as_llama_quantize_but_consistent``
shows what mtpq writes differently and why. ``--record --variant NAME`` re-records one variant.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from mtpq.errors import InputError  # noqa: E402
from mtpq.gguf_io import plan_from_gguf  # noqa: E402
from mtpq.quantize.pipeline import parse_options, plan_quantize  # noqa: E402
from mtpq.quantize.policy import Override, first_answer, preset_mix  # noqa: E402
from mtpq.quantize.presets import row_fallback, use_more_bits  # noqa: E402
from mtpq.tensors import Role  # noqa: E402
from tests.builders import tiny  # noqa: E402
from tests.helpers.quantize_tables import DATA, recorded_type  # noqa: E402
from tests.helpers.quantize_tables import load as _load  # noqa: E402

VARIANTS = {  # file stem -> (tiny builder, keyword arguments)
    "glm4moe_8layers": ("glm4moe", dict(num_hidden_layers=8)),
    "glm4moe_8experts_gqa4_tied": (
        "glm4moe",
        dict(num_hidden_layers=8, n_routed_experts=8, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "glm4moe_odd_rows": (
        "glm4moe",
        dict(num_hidden_layers=4, hidden_size=288, intermediate_size=320, moe_intermediate_size=80),
    ),
    # hybrid linear attention: attn_qkv counts as attn_v; dense ffn_down uses llama.cpp's running count
    "qwen35_8layers": ("qwen35", dict(num_hidden_layers=8)),
    "qwen35moe_8layers": ("qwen35", dict(moe=True, num_hidden_layers=8)),
    # MLA: attn_kv_b counts as attn_v, split attn_k_b/attn_v_b rows of 64 fall back
    "deepseek_v3_8layers": ("deepseek_v3", dict(num_hidden_layers=8)),
    # GLM-5.x: MLA + the DSA indexer (full/shared layers), arch glm-dsa; GLM-4.7-Flash: deepseek2 with its MTP block
    "glm_dsa_8layers": (
        "glm_dsa",
        dict(num_hidden_layers=8, indexer_types=["full"] * 3 + ["shared"] * 3 + ["full"] * 2),
    ),
    "glm4_moe_lite_8layers": ("glm4_moe_lite", dict(num_hidden_layers=8)),
    "qwen3next_8layers": ("tiny_qwen3next.qwen3next", dict(num_hidden_layers=8)),  # fused qkvz split, ssm_ba
    "deepseek_v32_8layers": ("tiny_deepseek32.deepseek_v32", dict(num_hidden_layers=8)),  # + lightning indexer
    "hyv3_8layers": ("tiny_hy_v3.hy_v3", dict(num_hidden_layers=8)),  # arch hy_v3 (not in pip gguf 0.19), MoE MTP block
    "cohere2moe_8layers": ("cohere2moe", dict(num_hidden_layers=8)),  # tied embeddings, no ffn_norm, MoE MTP block
    # Mamba2 + attention + MoE (ReLU^2 experts: no ffn_gate_exps), the two mtp.layers folded into blk.8
    "nemotronh_8layers": (
        "tiny_nemotron_h_moe.nemotron_h_moe",
        dict(num_hidden_layers=8, hybrid_override_pattern="MEM*EMEE"),
    ),
    # KDA + MLA (attn_k_b/attn_v_b) + MoE, MTP layer appended; arch not in pip gguf 0.19
    "bailingmoe3_8layers": ("bailingmoe3", dict(num_hidden_layers=8)),
}
PRESETS = [
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q5_K_S",
    "Q4_K_M",
    "Q4_K_S",
    "Q3_K_L",
    "Q3_K_M",
    "Q3_K_S",
    "Q2_K",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_S",
    "IQ3_M",
]
_OPTION_RUNS = {
    "glm4moe_8layers": [
        ("Q4_K_M", {"pure": True}),
        # blk.1's attn_v leaves llama.cpp's running attn_v count: later layers' "more bits" shift
        ("Q4_K_M", {"tensor_types": [r"blk\.1\.attn_v=q8_0", "ffn_down_exps=q5_k", "ffn_down=q2_k"]}),
        ("Q3_K_M", {"tensor_types": [r"blk\.0\.attn_v=q4_0"]}),
        ("Q4_K_M", {"output_tensor_type": "q8_0", "token_embedding_type": "q5_k"}),
        ("F16", {}),
        ("BF16", {}),
        ("F16", {"tensor_types": ["attn_v=q8_0"]}),  # llama-quantize ignores overrides here; mtpq applies them
        ("Q4_K_M", {"leave_output_tensor": True}),
        ("Q4_K_M", {"leave_output_tensor": True, "output_tensor_type": "q8_0"}),  # leaving it wins
        # the file's entries after --tensor-type's, first match wins; blk.1's attn_v leaves the count
        (
            "Q3_K_M",
            {
                "tensor_types": ["attn_q=q4_0"],
                "tensor_type_file": [r"blk\.1\.attn_v=q8_0", "attn_q=q2_k", "ffn_down_exps=q5_k"],
            },
        ),
        # the loader reads the override: 8 experts change attn_output's and attn_k's types
        (
            "Q4_K_M",
            {
                "override_kv": [
                    "glm4moe.expert_count=int:8",
                    "general.name=str:eight experts",
                    "general.file_type=int:7",
                ]
            },
        ),
        # trunk blocks pruned: the rest renumbered, the MTP block 8 -> 6; layer counts stay the input's
        ("Q4_K_M", {"prune_layers": "1,3"}),
        ("Q3_K_M", {"prune_layers": "0,8"}),  # the dense block 0 and the MTP block
    ],
    "glm4moe_8experts_gqa4_tied": [
        ("Q4_K_M", {"output_tensor_type": "q8_0"}),  # tied token_embd follows --output-tensor-type
        ("Q4_K_M", {"token_embedding_type": "q4_0"}),
        ("Q4_K_M", {"leave_output_tensor": True}),  # no output.weight: the tied token_embd is still quantized
    ],
    # per-layer attention.recurrent_layers: blocks 0 and 2 pruned, the rest renumbered
    "qwen35_8layers": [("Q5_K_M", {"prune_layers": "0,2"})],
    "glm4moe_odd_rows": [("Q4_K_M", {"tensor_types": ["ffn_gate_exps=q6_k", "attn_q=q2_k"]})],
}


IMATRIX_PRESETS = [
    "Q4_0",
    "Q5_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q2_K_S",
    "Q4_K_M",
    # the i-quant presets; all but IQ3_S/IQ3_M exist only with an imatrix
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ2_M",
    "IQ3_XXS",
    "IQ3_XS",
    "IQ3_S",
    "IQ3_M",
]


def runs_for(variant: str) -> list[tuple[str, dict]]:
    return (
        [(p, {}) for p in PRESETS] + _OPTION_RUNS.get(variant, []) + [(p, {"imatrix": True}) for p in IMATRIX_PRESETS]
    )


def synthetic_imatrix(weights: list[tuple[str, int, int]]):
    """An imatrix with an entry of ones for every (name, row length, n_mat) weight."""
    import numpy as np

    from mtpq.quantize.imatrix import Entry, Imatrix

    entries = {
        name: Entry(np.ones((n_mat, row), dtype=np.float32), np.ones(n_mat, dtype=np.float32))
        for name, row, n_mat in sorted(weights)
    }
    return Imatrix(entries, datasets=["synthetic"], chunk_count=1, chunk_size=1)


def _plan_weights(plan) -> list[tuple[str, int, int]]:
    return [
        (s.name, s.shape[-1], s.shape[0] if len(s.shape) == 3 else 1)
        for s in plan.tensors
        if len(s.shape) >= 2 and s.name.endswith("weight")
    ]


def llama_args(options: dict, imatrix_file: Path | None = None, work: Path | None = None) -> list[str]:
    args = ["--pure"] if options.get("pure") else []
    if options.get("imatrix"):
        args += ["--imatrix", str(imatrix_file)]
    for pattern in options.get("tensor_types", []):
        args += ["--tensor-type", pattern]
    if "tensor_type_file" in options:
        args += ["--tensor-type-file", str(tensor_type_file(options, work))]
    if "output_tensor_type" in options:
        args += ["--output-tensor-type", options["output_tensor_type"]]
    if "token_embedding_type" in options:
        args += ["--token-embedding-type", options["token_embedding_type"]]
    if options.get("leave_output_tensor"):
        args += ["--leave-output-tensor"]
    for kv in options.get("override_kv", []):
        args += ["--override-kv", kv]
    if "prune_layers" in options:
        args += ["--prune-layers", options["prune_layers"]]
    return args


def tensor_type_file(options: dict, folder: Path) -> Path:
    """The run's --tensor-type-file entries written as a file: one per line, the last two on one line."""
    entries = options["tensor_type_file"]
    path = folder / "tensor_types.txt"
    path.write_text("\n".join(entries[:-2] + [" ".join(entries[-2:])]) + "\n")
    return path


def recorded_kv_options(options: dict) -> bool:
    """Whether a run changes metadata, which only its written file shows."""
    return "prune_layers" in options or "override_kv" in options


# llama-quantize --dry-run logs one line per tensor (src/llama-quant.cpp):
#   [   1/ 175] output.weight      - [   256,    512,      1,      1], type = f32, size = 0.50 MiB -> 0.10 MiB (q6_K)
#   [   2/ 175] output_norm.weight - [   256,      1,      1,      1], type = f32, size = 0.001 MiB
# the type in brackets where it quantizes, the source type where it keeps the tensor as it is.
_DRY_RUN_LINE = re.compile(
    r"^\[\s*\d+/\s*\d+\] (\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =[^(\n]*(?:\((\w+)\))?$", re.M
)


def dry_run_types(args: list[str], preset: str) -> dict[str, str]:
    """{tensor name: GGML type name} as ``llama-quantize --dry-run`` decides them, in the file's order."""
    res = subprocess.run([args[0], "--dry-run", *args[1:], preset, "1"], check=True, capture_output=True, text=True)
    found = {m[1]: (m[3] or m[2]).upper() for m in _DRY_RUN_LINE.finditer(res.stderr + res.stdout)}
    n_tensors = re.search(r"^\[\s*\d+/\s*(\d+)\]", res.stderr + res.stdout, re.M)
    assert n_tensors and len(found) == int(n_tensors[1]), "llama-quantize --dry-run: its log did not parse"
    return {name: T[t].name for name, t in found.items()}


def recorded_kv(reader: GGUFReader, options: dict) -> dict | None:
    """For runs that change metadata: the block and MTP counts, the per-layer arrays and the overridden keys,
    as {key: [GGUF type, value]}."""
    if not recorded_kv_options(options):
        return None
    from gguf import GGUFValueType

    arch = reader.fields["general.architecture"].contents()
    keys = {f"{arch}.block_count", f"{arch}.nextn_predict_layers", f"{arch}.leading_dense_block_count"}
    keys |= {k.partition("=")[0] for k in options.get("override_kv", [])}
    keys |= {k for k, f in reader.fields.items() if k.startswith(f"{arch}.") and f.types[0] == GGUFValueType.ARRAY}
    return {
        k: [GGUFValueType(reader.fields[k].types[0]).name, reader.fields[k].contents()]
        for k in sorted(keys)
        if k in reader.fields
    }


def make_checkpoint(folder: Path, builder: str, config: dict) -> Path:
    if "." in builder:  # "tiny_<family>.<function>": a tests/builders/tiny_*.py builder
        import importlib

        module, function = builder.split(".")
        return getattr(importlib.import_module(f"tests.builders.{module}"), function)(
            folder / "ckpt", dtype=torch.float32, **config
        )
    if builder == "glm4moe":
        return tiny.glm4moe(folder / "ckpt", dtype=torch.float32, **config)
    if builder == "deepseek_v3":
        from tests.builders import tiny_deepseek2

        return tiny_deepseek2.deepseek_v3(folder / "ckpt", dtype=torch.float32, **config)
    if builder in ("glm_dsa", "glm4_moe_lite"):
        from tests.builders import tiny_glm_dsa

        return getattr(tiny_glm_dsa, builder)(folder / "ckpt", dtype=torch.float32, **config)
    if builder != "qwen35":  # tests/builders/tiny_<builder>.py with a function <builder>(folder, dtype=..., **config)
        import importlib

        return getattr(importlib.import_module(f"tests.builders.tiny_{builder}"), builder)(
            folder / "ckpt", dtype=torch.float32, **config
        )
    from tests.builders import tiny_qwen35

    return tiny_qwen35.qwen35(folder / "ckpt", dtype=torch.float32, **config)


def make_f32_gguf(folder: Path, builder: str, config: dict) -> Path:
    """The tiny checkpoint and its ``mtpq convert --outtype f32`` GGUF (what llama-quantize was given)."""
    from mtpq.convert import plan_checkpoint
    from mtpq.gguf_io import write_plan

    out = folder / "tiny-f32.gguf"
    write_plan(plan_checkpoint(make_checkpoint(folder, builder, config), outtype=T.F32), out)
    return out


def n_trunk_layers(doc: dict) -> int:
    return doc["config"]["num_hidden_layers"]


def record(bin_dir: Path, out_dir: Path, work: Path, variants: list[str] | None = None) -> None:
    """Run llama-quantize for every variant (or those named) and run; write one JSON file per variant."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for variant, (builder, config) in VARIANTS.items():
        if variants and variant not in variants:
            continue
        (work / variant).mkdir(parents=True, exist_ok=True)
        f32 = make_f32_gguf(work / variant, builder, config)
        reader = GGUFReader(f32)
        names = [t.name for t in reader.tensors]
        from mtpq.quantize.imatrix import write_imatrix

        imatrix_file = work / variant / "synthetic.imatrix.gguf"
        write_imatrix(
            synthetic_imatrix(
                [
                    (t.name, int(t.shape[0]), int(t.shape[2]) if len(t.shape) == 3 else 1)
                    for t in reader.tensors
                    if len(t.shape) >= 2 and t.name.endswith("weight")
                ]
            ),
            imatrix_file,
        )
        runs = []
        for i, (preset, options) in enumerate(runs_for(variant)):
            args = [str(bin_dir / "llama-quantize"), *llama_args(options, imatrix_file, work / variant), str(f32)]
            run = {"preset": preset, "options": options}
            # A run that changes metadata writes its file; the rest ask --dry-run, which decides each tensor's
            # type as the real run does (llama_tensor_get_type) and logs it without quantizing: ~0.01 s a run
            # against seconds for the i-quants. The first run of every variant does both and checks they agree.
            if i == 0 or recorded_kv_options(options):
                q = work / variant / "q.gguf"
                subprocess.run([*args, str(q), preset, "1"], check=True, capture_output=True)
                out = GGUFReader(q)
                types = {t.name: T(t.tensor_type).name for t in out.tensors}
                kv = recorded_kv(out, options)
                del out
                q.unlink()
                if i == 0:
                    assert dry_run_types(args, preset) == types, f"{variant} {preset}: --dry-run and the file disagree"
            else:
                types, kv = dry_run_types(args, preset), None
            if set(types) != set(names):  # pruned: fewer tensors, renumbered
                run["names"] = list(types)
            run["types"] = [types[n] for n in run.get("names", names)]
            if kv is not None:
                run["kv"] = kv
            runs.append(run)
        head = {
            "_doc": "llama-quantize's per-tensor types for a tiny GGUF; tests/quantize/test_policy.py says how it "
            "was recorded",
            "llama_cpp": "vendored by llama-cpp-python 0.3.36 (2026-10-01)",
            "builder": f"tests/builders/tiny*.py {builder}(dtype=float32, **config) -> mtpq convert --outtype f32",
            "config": config,
        }
        write_doc(out_dir / f"{variant}.json", head, names, runs)


def write_doc(path: Path, head: dict, names: list[str], runs: list[dict]) -> None:
    # one line per tensor name and per run: small diffs when llama.cpp changes its mind
    text = json.dumps(head, indent=1)[:-2] + ',\n "tensors": [\n  '
    text += ",\n  ".join(json.dumps(n) for n in names) + '\n ],\n "runs": [\n  '
    text += ",\n  ".join(json.dumps(r) for r in runs) + "\n ]\n}\n"
    path.write_text(text)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def f32_plan(tmp_path_factory):
    """variant -> the plan of its ``mtpq convert --outtype f32`` output, without writing the file.

    Names, shapes, roles and metadata are those of the GGUF llama-quantize was given;
    test_plan_from_gguf_decides_the_same checks that reading the written file back changes nothing.
    """
    from mtpq.convert import plan_checkpoint

    cache = {}

    def get(variant: str):
        if variant not in cache:
            builder, config = VARIANTS[variant]
            assert _load(variant)["config"] == config, "VARIANTS and the recorded data disagree: re-record"
            ckpt = make_checkpoint(tmp_path_factory.mktemp(variant), builder, config)
            cache[variant] = plan_checkpoint(ckpt, outtype=T.F32)
        return cache[variant]

    return get


def _cases():
    for f in sorted(DATA.glob("*.json")):
        doc = json.loads(f.read_text())
        for i, run in enumerate(doc["runs"]):
            opts = ",".join(f"{k}={v}" for k, v in run["options"].items())
            yield pytest.param(f.stem, i, id=f"{f.stem}-{run['preset']}{'-' + opts if opts else ''}")


def _quantized(plan, preset: str, options: dict, **extra):
    if options.get("imatrix"):
        extra["imatrix"] = synthetic_imatrix(_plan_weights(plan))
    with tempfile.TemporaryDirectory() as tmp:
        files = [tensor_type_file(options, Path(tmp))] if "tensor_type_file" in options else []
        return plan_quantize(
            plan,
            parse_options(
                preset,
                pure=options.get("pure", False),
                tensor_types=options.get("tensor_types", ()),
                tensor_type_files=files,
                output_tensor_type=options.get("output_tensor_type"),
                token_embedding_type=options.get("token_embedding_type"),
                leave_output_tensor=options.get("leave_output_tensor", False),
                kv_overrides=options.get("override_kv", ()),
                prune_layers=options.get("prune_layers"),
                **extra,
            ),
        )


def _ours(plan, preset: str, options: dict, **extra) -> dict[str, str]:
    return {s.name: s.ggml_type.name for s in _quantized(plan, preset, options, **extra).tensors}


def _theirs(doc: dict, run: dict, plan) -> dict[str, str]:
    """llama-quantize's types, with one documented difference: it ignores --tensor-type for float
    presets; mtpq applies it (first match; never to 1-D tensors, norms or routers)."""
    theirs = dict(zip(run.get("names", doc["tensors"]), run["types"]))
    if run["preset"] not in ("F16", "BF16", "F32") or not run["options"].get("tensor_types"):
        return theirs
    patterns = [p.rpartition("=") for p in run["options"]["tensor_types"]]
    for s in plan.tensors:
        if len(s.shape) < 2 or s.name.endswith("_norm.weight") or "ffn_gate_inp" in s.name:
            continue
        for regex, _, qtype in patterns:
            if re.search(regex, s.name):
                theirs[s.name] = qtype.upper()
                break
    return theirs


# ----------------------------------------------------------------------------- against llama-quantize


@pytest.mark.parametrize("variant,i", list(_cases()))
def test_same_as_llama_quantize_with_mtp_type_same(f32_plan, variant, i):
    doc = _load(variant)
    run = doc["runs"][i]
    plan = f32_plan(variant)
    theirs = _theirs(doc, run, plan)
    ours = _ours(plan, run["preset"], run["options"], mtp_type="same")
    assert set(ours) == set(theirs)
    diff = {n: (ours[n], theirs[n]) for n in theirs if ours[n] != theirs[n]}
    assert not diff, f"(ours, llama-quantize) differ for {len(diff)} tensors: {diff}"


@pytest.mark.parametrize("variant,i", list(_cases()))
def test_default_holds_mtp_block_at_q8_0_and_nothing_else_changes(f32_plan, variant, i):
    doc = _load(variant)
    run = doc["runs"][i]
    if run["preset"] in ("F16", "BF16", "F32"):
        pytest.skip("float presets keep the MTP block like the trunk by default")
    plan = f32_plan(variant)
    theirs = _theirs(doc, run, plan)
    ours = _ours(plan, run["preset"], run["options"])
    pruned = [int(b) for b in run["options"].get("prune_layers", "").split(",") if b]
    n_trunk = n_trunk_layers(doc)
    if n_trunk in pruned:
        pytest.skip("the MTP block is pruned")
    rows = {_renumbered(s.name, pruned): s.shape[-1] for s in plan.tensors}
    overridden = [
        re.compile(p.rpartition("=")[0])
        for p in run["options"].get("tensor_types", []) + run["options"].get("tensor_type_file", [])
    ]
    mtp_prefix = f"blk.{n_trunk - sum(1 for b in pruned if b < n_trunk)}."  # the MTP block, renumbered
    n_mtp_checked = 0
    for name, their_type in theirs.items():
        if name.startswith(mtp_prefix) and their_type != "F32" and not any(p.search(name) for p in overridden):
            want = "Q8_0" if rows[name] % 32 == 0 else "F16"  # q8_0, or llama.cpp's f16 fallback
            assert ours[name] == want, name
            n_mtp_checked += 1
        else:
            assert ours[name] == their_type, name
    assert n_mtp_checked >= 7  # eh_proj + attention + FFN/experts of the MTP block


def _renumbered(name: str, pruned: list[int]) -> str:
    """A tensor's name after llama-quantize's --prune-layers (block i -> i minus the pruned blocks below it)."""
    m = re.match(r"blk\.(\d+)\.", name)
    if m is None or not pruned:
        return name
    b = int(m.group(1))
    return f"blk.{b - sum(1 for p in pruned if p < b)}.{name[m.end() :]}"


def _kv_cases():
    for case in _cases():
        variant, i = case.values
        if "kv" in _load(variant)["runs"][i]:
            yield case


@pytest.mark.parametrize("variant,i", list(_kv_cases()))
def test_metadata_as_llama_quantize_but_consistent(f32_plan, variant, i):
    """The metadata --override-kv and --prune-layers write, against llama-quantize's. Equal, but where
    llama-quantize's file is broken (each checked in llama.cpp by test_quantize_options.py):

    - a pruned MTP block leaves its nextn_predict_layers behind there (llama.cpp then runs the last trunk
      block as the head); here the key counts the MTP blocks kept, and goes with the last;
    - per-layer arrays keep their old length there (llama.cpp: "wrong array length"); here they lose the
      pruned blocks' entries;
    - leading_dense_block_count keeps counting a pruned dense block there; here only the kept ones.
    """
    doc = _load(variant)
    run = doc["runs"][i]
    plan = f32_plan(variant)
    ours = _quantized(plan, run["preset"], run["options"], mtp_type="same")
    pruned = [int(b) for b in run["options"].get("prune_layers", "").split(",") if b]
    kept = [b for b in range(plan.n_trunk_layers + plan.n_mtp_layers) if b not in pruned]
    arch = plan.arch
    for key, (vtype, value) in run["kv"].items():
        want = value
        if key == f"{arch}.nextn_predict_layers" and pruned:
            want = sum(1 for b in kept if b >= plan.n_trunk_layers) or None  # None: no key
        elif key == f"{arch}.leading_dense_block_count" and pruned:
            want = sum(1 for b in kept if b < plan.kv_value(key))
        elif vtype == "ARRAY" and pruned and len(plan.kv_value(key)) == len(kept) + len(pruned):
            want = [plan.kv_value(key)[b] for b in kept]
        have = ours.kv.get(key)
        if want is None:
            assert have is None, key
            continue
        assert have is not None and have.value == want, (key, have, want)
        assert have.type.name == vtype, key
    if pruned:  # llama-quantize left a stale key where mtpq writes the consistent one: say so
        theirs_nextn = run["kv"].get(f"{arch}.nextn_predict_layers", [None, None])[1]
        if plan.n_trunk_layers in pruned:
            assert theirs_nextn == plan.n_mtp_layers and ours.kv_value(f"{arch}.nextn_predict_layers") is None


def test_plan_from_gguf_decides_the_same(f32_plan, tmp_path):
    """The f32 GGUF read back gives the same decisions as the conversion plan it was written from."""
    from mtpq.gguf_io import write_plan

    plan = f32_plan("glm4moe_odd_rows")
    write_plan(plan, tmp_path / "f32.gguf")
    back = plan_from_gguf(tmp_path / "f32.gguf")
    for preset in ("Q4_K_M", "Q3_K_M", "Q2_K"):
        assert _ours(back, preset, {}) == _ours(plan, preset, {})


def test_a_type_without_a_fallback_stops_naming_the_tensor_once(f32_plan, tmp_path):
    """Q1_0 on rows of 288 (no whole 128-value blocks): llama-quantize stops, as it has no fallback for Q1_0
    (test_llama_quantize_stops_on_q1_0_too); mtpq stops naming the file and the tensor, each once."""
    from mtpq.gguf_io import write_plan

    plan = f32_plan("glm4moe_odd_rows")
    write_plan(plan, tmp_path / "odd.gguf")
    for source in (plan, plan_from_gguf(tmp_path / "odd.gguf")):
        with pytest.raises(InputError) as exc:
            plan_quantize(source, parse_options("Q1_0"))
        name = re.search(r"(blk\.\d+\.\w+\.weight|token_embd\.weight|output\.weight)", str(exc.value))[1]
        assert str(exc.value).count(name) == 1, str(exc.value)
        assert "288" in exc.value.problem and "no fallback type for q1_0" in exc.value.problem


@pytest.mark.llama_cpp
def test_llama_quantize_stops_on_q1_0_too(f32_plan, llama_cpp_bin, tmp_path):
    from mtpq.gguf_io import write_plan

    write_plan(f32_plan("glm4moe_odd_rows"), tmp_path / "odd.gguf")
    res = subprocess.run(
        [str(llama_cpp_bin / "llama-quantize"), tmp_path / "odd.gguf", tmp_path / "q.gguf", "Q1_0", "1"],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "no tensor type fallback is defined for type q1_0" in res.stderr + res.stdout


@pytest.mark.llama_cpp
@pytest.mark.slow
def test_recorded_choices_are_current(llama_cpp_bin, tmp_path):
    """Re-run llama-quantize and compare with the committed data (catches stale or hand-edited data)."""
    record(llama_cpp_bin, tmp_path / "data", tmp_path / "work")
    for f in sorted(DATA.glob("*.json")):
        fresh = json.loads((tmp_path / "data" / f.name).read_text())
        old = json.loads(f.read_text())
        assert fresh["tensors"] == old["tensors"] and fresh["runs"] == old["runs"], f.name


# ----------------------------------------------------------------------------- the rules on their own


def test_use_more_bits_pattern():
    # n = 9 (8 trunk + 1 MTP): first eighth {0}, last eighth {7, 8}, every third from 1 + 2 {3, 6}
    assert [i for i in range(9) if use_more_bits(i, 9)] == [0, 3, 6, 7, 8]
    # n = 32: {0..3}, {28..31}, 6, 9, ..., 27
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]


@pytest.mark.parametrize(
    "qtype,row,want",
    [
        (T.Q4_K, 512, T.Q4_K),
        (T.Q4_K, 288, T.Q5_0),
        (T.Q5_K, 288, T.Q5_1),
        (T.Q6_K, 288, T.Q8_0),
        (T.Q2_K, 288, T.Q4_0),
        (T.Q3_K, 288, T.Q4_0),
        (T.Q4_K, 80, T.F16),
        (T.Q8_0, 80, T.F16),
        (T.Q8_0, 96, T.Q8_0),
    ],
)
def test_row_fallbacks(qtype, row, want):
    assert row_fallback(qtype, row)[0] == want


@pytest.fixture(scope="module")
def glm8(f32_plan):
    return f32_plan("glm4moe_8layers")


def _by_name(plan):
    return {s.name: s for s in plan.tensors}


def _llama_quantize(name: str, preset: str = "Q4_K_M") -> T:
    """llama-quantize's recorded type for a tensor of the 8-layer GLM (the trunk's choice, the head included)."""
    return T[recorded_type("glm4moe_8layers", preset, name)]


def test_every_decision_has_its_reason(glm8):
    q = _by_name(plan_quantize(glm8, parse_options("Q4_K_M")))
    assert all(s.reason for s in q.values())
    assert q["blk.8.nextn.eh_proj.weight"].reason == "mtp block held at q8_0"
    assert q["blk.8.ffn_down_exps.weight"].ggml_type == T.Q8_0
    assert q["blk.8.ffn_gate_inp.weight"].ggml_type == T.F32 and "router" in q["blk.8.ffn_gate_inp.weight"].reason
    assert q["blk.8.nextn.enorm.weight"].ggml_type == T.F32 and "1-D" in q["blk.8.nextn.enorm.weight"].reason
    attn_v = q["blk.0.attn_v.weight"]
    assert "more-bits" in attn_v.reason and attn_v.ggml_type == _llama_quantize("blk.0.attn_v.weight") == T.Q6_K
    assert q["output.weight"].ggml_type == _llama_quantize("output.weight")


def test_override_beats_the_mtp_rule_and_first_match_wins(glm8):
    q = _by_name(
        plan_quantize(
            glm8, parse_options("Q4_K_M", tensor_types=[r"blk\.8\.ffn_.*_exps=q4_k", r"blk\.8\.=f16", "exps=q2_k"])
        )
    )
    assert q["blk.8.ffn_up_exps.weight"].ggml_type == T.Q4_K
    assert q["blk.8.ffn_up_exps.weight"].reason == r"user override blk\.8\.ffn_.*_exps=q4_k"
    assert q["blk.8.nextn.eh_proj.weight"].ggml_type == T.F16
    assert q["blk.3.ffn_up_exps.weight"].ggml_type == T.Q2_K
    assert q["blk.8.attn_norm.weight"].ggml_type == T.F32  # 1-D tensors are never overridden


def test_overrides_apply_under_float_presets(glm8):
    q = _by_name(plan_quantize(glm8, parse_options("BF16", tensor_types=["attn_v=q8_0"], mtp_type="q8_0")))
    assert q["blk.2.attn_v.weight"].ggml_type == T.Q8_0
    assert q["blk.2.attn_q.weight"].ggml_type == T.BF16
    assert q["blk.8.nextn.eh_proj.weight"].ggml_type == T.Q8_0  # an explicit --mtp-type applies too
    default = _by_name(plan_quantize(glm8, parse_options("BF16")))
    assert default["blk.8.nextn.eh_proj.weight"].ggml_type == T.BF16  # default: never coarser than the trunk


def test_mtp_experts_type_and_same(glm8):
    q = _by_name(plan_quantize(glm8, parse_options("Q4_K_M", mtp_type="f16", mtp_experts_type="q4_k")))
    assert q["blk.8.ffn_down_exps.weight"].ggml_type == T.Q4_K
    assert q["blk.8.ffn_down_shexp.weight"].ggml_type == T.F16
    assert q["blk.8.nextn.shared_head_head.weight"].ggml_type == T.F16
    q = _by_name(plan_quantize(glm8, parse_options("Q4_K_M", mtp_experts_type="same")))
    for name in ("blk.8.ffn_gate_exps.weight", "blk.8.ffn_down_exps.weight"):  # the trunk's choice
        assert q[name].ggml_type == _llama_quantize(name), name
    assert q["blk.8.ffn_down_exps.weight"].ggml_type == T.Q6_K  # layer 8 of 9 is a more-bits layer
    assert q["blk.8.attn_q.weight"].ggml_type == T.Q8_0
    q = _by_name(plan_quantize(glm8, parse_options("Q2_K", mtp_type="q6_k")))
    assert {
        q[n].ggml_type
        for n in q
        if n.startswith("blk.8.") and q[n].role is Role.MTP and len(q[n].shape) > 1 and "gate_inp" not in n
    } == {T.Q6_K}


def test_mtp_type_keep_holds_the_source_types(glm8):
    before = _by_name(glm8)
    q = _by_name(plan_quantize(glm8, parse_options("Q4_K_M", mtp_type="keep", mtp_experts_type="q4_k")))
    assert before["blk.8.attn_q.weight"].ggml_type in (T.F16, T.F32, T.BF16)
    for name, spec in q.items():
        if spec.role is Role.MTP and "_exps" not in name:
            assert spec.ggml_type == before[name].ggml_type, name
    assert "--mtp-type keep" in q["blk.8.attn_q.weight"].reason
    assert q["blk.8.ffn_down_exps.weight"].ggml_type == T.Q4_K
    assert q["blk.3.attn_q.weight"].ggml_type == _llama_quantize("blk.3.attn_q.weight")  # the trunk: the preset's


def test_one_parsed_mtp_precision_at_every_boundary():
    from mtpq.quantize.mtp_precision import KEEP, SAME, MtpPrecisionKind, of_type, parse_mtp

    assert parse_mtp("Q8_0", "--mtp-type") == of_type(T.Q8_0) and str(of_type(T.Q8_0)) == "q8_0"
    assert parse_mtp(" Same ", "--mtp-type") is not None and parse_mtp("same", "x") == SAME
    assert parse_mtp("keep", "x") == KEEP and parse_mtp(KEEP, "x") is KEEP and parse_mtp(None, "x", SAME) == SAME
    with pytest.raises(InputError) as exc:
        parse_mtp("same", "--mtp-type", allow=(MtpPrecisionKind.KEEP, MtpPrecisionKind.TYPE))
    assert exc.value.where == "--mtp-type" and "keep or a ggml type" in exc.value.problem
    with pytest.raises(InputError) as exc:
        parse_mtp("q9_9", "recipe.toml: variant[0].mtp_type")
    assert "q9_9" in exc.value.problem and "same" in exc.value.problem and "keep" in exc.value.problem


def test_pure_and_file_type(glm8):
    q = plan_quantize(glm8, parse_options("Q5_K_M", pure=True, mtp_type="same"))
    assert {s.ggml_type for s in q.tensors if len(s.shape) > 1 and "gate_inp" not in s.name} == {T.Q5_K}
    assert q.kv_value("general.file_type") == 17 and q.kv_value("general.quantization_version") == 2


def test_counters_skip_tensors_decided_before_the_mix(glm8):
    from mtpq.quantize.pipeline import model_facts
    from mtpq.quantize.policy import PolicyContext, with_counters
    from mtpq.quantize.presets import preset_named

    ctx = with_counters(
        PolicyContext(
            preset_named("Q4_K_M"), model_facts(glm8), overrides=(Override("x", re.compile(r"blk\.1\.attn_v"), T.Q8_0),)
        ),
        glm8.tensors,
    )
    assert ctx.n_attn_v == 9 and "blk.1.attn_v.weight" not in ctx.running_index
    assert ctx.running_index["blk.2.attn_v.weight"] == 1
    # llama.cpp counts every name containing "ffn_up": blk.0's dense ffn_up, blk.1's ffn_up_exps and ffn_up_shexp
    assert ctx.running_index["blk.2.ffn_up_exps.weight"] == 3
    spec = _by_name(glm8)["blk.2.attn_v.weight"]
    assert first_answer(spec, ctx)[0] is preset_mix


def test_imatrix_entries_reach_the_tensors_and_select(glm8):
    im = synthetic_imatrix(_plan_weights(glm8))
    plan = plan_quantize(glm8, parse_options("Q4_K_M", imatrix=im))
    got = {s.name: s.importance for s in plan.tensors}
    assert got["blk.0.ffn_down.weight"].shape == (1, glm8_row(glm8, "blk.0.ffn_down.weight"))
    assert got["blk.1.ffn_up_exps.weight"].shape[0] > 1  # one row per expert
    assert got["blk.0.attn_norm.weight"] is None  # never quantized: no weights
    kv = plan.kv_value("quantize.imatrix.entries_count")
    assert kv == len(im.entries)
    excl = plan_quantize(glm8, parse_options("Q4_K_M", imatrix=im, exclude_weights=["ffn_down"]))
    assert all(s.importance is None for s in excl.tensors if "ffn_down" in s.name)
    assert any(s.importance is not None for s in excl.tensors)
    incl = plan_quantize(glm8, parse_options("Q4_K_M", imatrix=im, include_weights=["attn_q"]))
    assert {s.name for s in incl.tensors if s.importance is not None} == {
        s.name for s in glm8.tensors if "attn_q" in s.name and s.name.endswith("weight") and len(s.shape) >= 2
    }
    with pytest.raises(InputError, match="cannot be combined"):
        plan_quantize(glm8, parse_options("Q4_K_M", imatrix=im, include_weights=["a"], exclude_weights=["b"]))


def glm8_row(plan, name):
    return next(s.shape[-1] for s in plan.tensors if s.name == name)


def test_imatrix_for_another_model_or_size_is_refused(glm8):
    from mtpq.quantize.imatrix import Entry

    other = synthetic_imatrix([("blk.0.attn_qkv.weight", 64, 1)])
    with pytest.raises(InputError, match="names a tensor of this model"):
        plan_quantize(glm8, parse_options("Q4_K_M", imatrix=other))
    wrong = synthetic_imatrix(_plan_weights(glm8))
    wrong.entries["blk.0.attn_q.weight"] = Entry(
        wrong.entries["blk.0.attn_q.weight"].sums[:, :-32], wrong.entries["blk.0.attn_q.weight"].counts
    )
    with pytest.raises(InputError, match="entry blk.0.attn_q.weight has .* values, the tensor needs"):
        plan_quantize(glm8, parse_options("Q4_K_M", imatrix=wrong))


def test_type_needing_imatrix_without_head_data_names_tensors_and_remedies(glm8):
    """llama-imatrix never runs the MTP head: its entries are missing. With the head in a type
    that needs importance data (here Q2_K of a Q2_K_S file) the plan is refused before anything
    is written, naming the head's tensors and both remedies; the default head type needs none."""
    trunk_only = synthetic_imatrix([w for w in _plan_weights(glm8) if not w[0].startswith("blk.8.")])
    plan = plan_quantize(glm8, parse_options("Q2_K_S", imatrix=trunk_only))  # head at q8_0: fine
    assert {s.ggml_type for s in plan.tensors if s.role is Role.MTP and s.importance is None} <= {T.Q8_0, T.F32}
    with pytest.raises(InputError) as exc:
        plan_quantize(glm8, parse_options("Q2_K_S", imatrix=trunk_only, mtp_type="q2_k"))
    msg = exc.value.problem
    assert exc.value.where == "imatrix"
    assert "blk.8." in msg and "q2_k" in msg and "mtpq imatrix --mtp" in msg and "--mtp-type q8_0" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "kwargs,where,says",
    [
        (dict(preset="Q9_X"), "PRESET", "unknown preset"),
        (dict(preset="IQ2_XXS"), "--imatrix", "need importance data"),  # as llama-quantize, which refuses it
        (dict(preset="Q2_K_S"), "--imatrix", "need importance data"),  # Q2_K_S exists only with an imatrix
        (dict(tensor_types=["(blk=q8_0"]), "--tensor-type", "bad regular expression"),
        (dict(tensor_types=["attn_v=q9_0"]), "--tensor-type", "unknown or unsupported type"),
        (dict(tensor_types=["attn_v"]), "--tensor-type", "REGEX=TYPE"),
        (dict(mtp_type="fp8"), "--mtp-type", "unknown"),
        (dict(mtp_experts_type="q8_k"), "--mtp-experts-type", "unsupported"),
        (dict(output_tensor_type="q4"), "--output-tensor-type", "unknown"),
    ],
)
def test_bad_options_name_the_option(glm8, kwargs, where, says):
    kwargs = {"preset": "Q4_K_M", **kwargs}
    with pytest.raises(InputError) as exc:
        plan_quantize(glm8, parse_options(kwargs.pop("preset"), **kwargs))
    assert exc.value.where == where and says in exc.value.problem


if __name__ == "__main__":
    import argparse
    import os
    import tempfile

    ap = argparse.ArgumentParser(description="Record llama-quantize's per-tensor choices as test data.")
    ap.add_argument("--record", action="store_true", required=True)
    ap.add_argument("--bin", default=os.environ.get("MTPQ_LLAMA_CPP_BIN"), help="folder with llama-quantize")
    ap.add_argument("--variant", action="append", help="only this variant (repeatable)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        record(Path(a.bin), DATA, Path(d), a.variant)
    print(f"wrote {', '.join(sorted(p.name for p in DATA.glob('*.json')))}")
