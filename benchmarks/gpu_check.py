"""Everything the runtime must show on a GPU, in one run: the demo models and a synthetic model of about a billion
parameters, drafting on CUDA and on the CPU: tokens/s with and without drafting, acceptance, peak memory, and the
host syncs each drafted token costs (counted with torch.cuda.set_sync_debug_mode). One JSON file and one
Markdown table (docs/performance.md quotes it with the date and the GPU).

    python benchmarks/gpu_check.py --out gpu-check/
    python benchmarks/gpu_check.py --out gpu-check/ --models prepared/   # GGUFs made beforehand (below)
    python benchmarks/gpu_check.py --prepare prepared/                    # make the demo GGUFs only (no GPU needed)

Without a CUDA device it says so and exits 0. ``--device cpu`` runs the same steps with the CPU standing in for
the GPU (a smoke test of the script; no sync is counted there).

What is measured, per model:
- speculative decoding (greedy, k=3) and plain decoding over the same prompts: tokens/s of each, their ratio;
- acceptance: vLLM's rate and mean acceptance length;
- peak GPU memory (torch.cuda.max_memory_allocated) of loading and decoding;
- host syncs: every synchronizing CUDA call in the drafting rounds after the prefill, per round and per drafted
  token (the loop reads back one small tensor per round: the accepted count and the round's token ids);
- the same decoding on the CPU (fewer tokens for the big model), for the GPU/CPU ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMOS = {  # file name -> (demo folder, convert/quantize steps)
    "demo-glm-f16.gguf": ("mtpq/data/demo", None),
    "demo-glm-Q4_K_M.gguf": ("mtpq/data/demo", "Q4_K_M"),
    "demo-qwen35-f16.gguf": ("mtpq/data/demo_qwen35", None),
}
PROMPTS = {
    "demo-glm": "mtpq/data/prompts/demo_heldout.jsonl",
    "demo-qwen35": "mtpq/data/prompts/demo_qwen35_heldout.jsonl",
}


def mtpq(*args) -> None:
    subprocess.run([sys.executable, "-m", "mtpq.cli", *map(str, args), "--quiet"], check=True, cwd=ROOT)


def prepare(folder: Path) -> dict[str, Path]:
    """The demo GGUFs (f16, Q4_K_M with the head at q8_0, Qwen3.5 f16) in ``folder``, made once."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (src, preset) in DEMOS.items():
        path = folder / name
        if not path.exists():
            if preset is None:
                mtpq("convert", ROOT / src, path, "--outtype", "f16")
            else:
                f16 = folder / name.replace(preset, "f16")
                if not f16.exists():
                    mtpq("convert", ROOT / src, f16, "--outtype", "f16")
                mtpq("quantize", f16, path, preset)
        out[name] = path
    return out


def synthetic(path: Path, hidden: int, layers: int, ffn: int, vocab: int = 32000, seed: int = 0) -> Path:
    """A GLM-4.5-shaped model with random bf16 weights (dense FFNs, one MTP layer), written straight to GGUF:
    about ``layers * (4 hidden^2 * 5/8 + 3 hidden ffn) + 2 vocab hidden`` parameters. Made to draft something:
    its blocks' outputs are small (the current token's embedding weighs much in the trunk's prediction) and the
    head passes the next token's normed embedding through an identity eh_proj and a near-silent block into the
    trunk's norm and output, so it drafts the trunk's "bigram" guess (the tests' bigram models, at scale)."""
    import gguf

    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim = hidden // 128, max(1, hidden // 512), 128
    w = gguf.GGUFWriter(str(path) + ".tmp", "glm4moe")
    w.add_block_count(layers + 1)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    w.add_uint32("glm4moe.leading_dense_block_count", layers + 1)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim // 2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("glm4moe.expert_count", 0)
    w.add_uint32("glm4moe.expert_used_count", 0)

    def bf16(*shape, scale):
        x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
        return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even

    def add(name, *shape, scale=None, ones=False, eye=False):
        if ones:
            w.add_tensor(name, np.ones(shape, np.float32))
        elif eye:  # [I | 0]: the head's input is the normed embedding
            x = np.zeros(shape, np.float32)
            x[:, : shape[0]] = np.eye(shape[0], dtype=np.float32)
            w.add_tensor(
                name, x.view(np.uint32).__rshift__(16).astype(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16
            )
        else:
            w.add_tensor(name, bf16(*shape, scale=scale or shape[-1] ** -0.5), raw_dtype=gguf.GGMLQuantizationType.BF16)

    add("token_embd.weight", vocab, hidden, scale=1.0)
    add("output_norm.weight", hidden, ones=True)
    add("output.weight", vocab, hidden)
    for i in range(layers + 1):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", hidden, ones=True)
        add(p + "post_attention_norm.weight", hidden, ones=True)
        add(p + "attn_q.weight", heads * head_dim, hidden)
        add(p + "attn_k.weight", kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", kv_heads * head_dim, hidden)
        quiet = 0.02 if i == layers else 0.1  # the blocks' outputs scaled down (the head's most)
        add(p + "attn_output.weight", hidden, heads * head_dim, scale=quiet * (heads * head_dim) ** -0.5)
        add(p + "ffn_gate.weight", ffn, hidden)
        add(p + "ffn_up.weight", ffn, hidden)
        add(p + "ffn_down.weight", hidden, ffn, scale=quiet * ffn**-0.5)
        if i == layers:  # the MTP head (its embedding and output tied to the trunk's)
            add(p + "nextn.eh_proj.weight", hidden, 2 * hidden, eye=True)
            for n in ("enorm", "hnorm", "shared_head_norm"):
                add(p + f"nextn.{n}.weight", hidden, ones=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".tmp", path)
    return path


def n_params(path: Path) -> int:
    from mtpq.gguf_io import GGUFFile

    return GGUFFile(path).n_elements


def count_syncs(model, prompt: list[int], k: int, rounds: int) -> tuple[int, int, int]:
    """(synchronizing CUDA calls, rounds, drafted tokens) in ``rounds`` greedy drafting rounds after a prefill."""
    import torch

    from mtpq.runtime.speculative import SpeculativeDecoder

    dec = SpeculativeDecoder(model, k)
    dec.prefill(prompt)
    dec.step()  # warm: first-use allocations and memos
    torch.cuda.synchronize()
    drafted = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(rounds):
                drafted += len(dec.step()[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, rounds, drafted


def profile(path: Path, dtype, prompt: list[int], k: int = 3, rounds: int = 6) -> str:
    """Where the syncs of greedy drafting rounds come from (file:line of each synchronizing call), and the
    costliest ops of a few plain decoding steps (torch.profiler)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from mtpq.runtime.families import load
    from mtpq.runtime.speculative import SpeculativeDecoder

    model = load(path, device="cuda", dtype=dtype)
    dec = SpeculativeDecoder(model, k)
    dec.prefill(prompt)
    dec.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(rounds):
                dec.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno} {str(w.message)[:60]}" for w in caught)
    lines = [f"{path.name}: {len(caught)} syncs in {rounds} rounds"]
    lines += [f"  {n:4d}  {loc}" for loc, n in where.most_common(12)]
    model.reset()
    out = model.trunk(torch.tensor([prompt], device="cuda"), last_only=True)
    tok = out.logits[0, -1].argmax().view(1, 1)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            tok = model.trunk(tok, last_only=True).logits[0, -1].argmax().view(1, 1)
        torch.cuda.synchronize()
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    lines.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40))
    return "\n".join(lines)


def measure(path: Path, device: str, dtype, prompts, n_new: int, k: int, sync_rounds: int) -> dict:
    import torch

    from mtpq.acceptance.metrics import metrics_from_rounds
    from mtpq.runtime.speculative import load_model, run_plain, run_speculative

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if isinstance(prompts[0], str):
        model, tok = load_model(path, device=device, dtype=dtype)
        ids = [tok.encode(p) for p in prompts]
    else:  # token ids (the synthetic model has no tokenizer)
        from mtpq.runtime.families import load

        model, ids = load(path, device=device, dtype=dtype), prompts
    load_s = time.perf_counter() - t0
    run_speculative(model, ids[0], 8, k=k)  # warm-up (allocator, kernels, memos)
    run_plain(model, ids[0], 8)
    specs, plains = [], []
    for p in ids:
        specs.append(run_speculative(model, p, n_new, k=k))
        plains.append(run_plain(model, p, n_new))
    m = metrics_from_rounds(specs)
    spec_tps = sum(len(s.tokens) for s in specs) / sum(s.seconds for s in specs)
    plain_tps = sum(len(s.tokens) for s in plains) / sum(s.seconds for s in plains)
    row = {
        "model": path.name,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "load_s": round(load_s, 2),
        "prompts": len(ids),
        "new_tokens": n_new,
        "k": k,
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps,
        "acceptance_rate": m.acceptance_rate,
        "mean_acceptance_length": m.mean_acceptance_length,
        "identical_to_plain": all(s.tokens == p.tokens for s, p in zip(specs, plains)),
    }
    if device == "cuda":
        syncs, rounds, drafted = count_syncs(model, ids[0], k, sync_rounds)
        row.update(
            peak_gpu_bytes=torch.cuda.max_memory_allocated(),
            syncs=syncs,
            sync_rounds=rounds,
            syncs_per_round=syncs / rounds,
            syncs_per_drafted_token=syncs / max(drafted, 1),
        )
    del model
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| model | device | dtype | tok/s (k=3) | tok/s (plain) | speed-up | acceptance | mean acc. length "
        "| peak GPU memory | syncs / round | syncs / drafted token | GPU / CPU (k=3) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    cpu = {r["model"]: r for r in rows if r["device"] == "cpu"}
    for r in rows:
        gpu = r["device"] != "cpu"
        ratio = (
            f"{r['spec_tokens_per_s'] / cpu[r['model']]['spec_tokens_per_s']:.1f}x" if gpu and r["model"] in cpu else ""
        )
        mem = f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB" if gpu else ""
        syncs = (f"{r['syncs_per_round']:.2f}", f"{r['syncs_per_drafted_token']:.2f}") if gpu else ("", "")
        lines.append(
            f"| {r['model']} | {r['device']} | {r['dtype']} | {r['spec_tokens_per_s']:.1f} | "
            f"{r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance_rate']:.1%} | "
            f"{r['mean_acceptance_length']:.2f} | {mem} | {syncs[0]} | {syncs[1]} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for gpu_check.json and .md")
    ap.add_argument("--models", type=Path, default=None, help="folder with the demo GGUFs (made there if missing)")
    ap.add_argument("--prepare", type=Path, default=None, help="only make the demo GGUFs in this folder, then exit")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of this script")
    ap.add_argument("--hidden", type=int, default=2048, help="synthetic model: hidden size (2048: ~1.3 B params)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt on the GPU")
    ap.add_argument("--cpu-tokens", type=int, default=16, help="new tokens per prompt for the big model on the CPU")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per demo model")
    ap.add_argument("--sync-rounds", type=int, default=20)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only where the syncs and the time go (CUDA)")
    a = ap.parse_args()
    if a.prepare:
        print("\n".join(str(p) for p in prepare(a.prepare).values()))
        return 0
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to measure.")
        return 0
    work = a.models or a.out / "models"
    files = prepare(work)
    big = synthetic(work / f"synthetic-{a.hidden}x{a.layers}.gguf", a.hidden, a.layers, a.ffn)
    from mtpq.acceptance.prompts import load_prompts

    rng = np.random.default_rng(1)
    if a.profile:
        report = "\n\n".join(
            profile(p, dt, rng.integers(0, 2000, 48).tolist())
            for p, dt in (
                (files["demo-glm-f16.gguf"], torch.float32),
                (files["demo-glm-Q4_K_M.gguf"], torch.float32),
                (big, torch.bfloat16),
            )
        )
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "profile.txt").write_text(report)
        print(report)
        return 0
    cases = [
        (files["demo-glm-f16.gguf"], "demo-glm"),
        (files["demo-glm-Q4_K_M.gguf"], "demo-glm"),
        (files["demo-qwen35-f16.gguf"], "demo-qwen35"),
        (big, None),
    ]
    rows = []
    for path, prompt_set in cases:
        if prompt_set:
            prompts = [text for _, text in load_prompts(ROOT / PROMPTS[prompt_set], a.prompts)]
        else:
            prompts = [rng.integers(0, 32000, 64).tolist() for _ in range(2)]
        dtype = torch.bfloat16 if prompt_set is None else torch.float32
        devices = [a.device] + ([] if a.skip_cpu or a.device == "cpu" else ["cpu"])
        for device in devices:
            threads = torch.get_num_threads()
            if device == "cpu":
                torch.set_num_threads(1 if prompt_set else (os.cpu_count() or 1))
            n_new = a.tokens if device != "cpu" or prompt_set else a.cpu_tokens
            print(f"gpu_check: {path.name} on {device} ({dtype}), {len(prompts)} prompts x {n_new} tokens", flush=True)
            rows.append(
                measure(path, device, dtype if device != "cpu" else torch.float32, prompts, n_new, 3, a.sync_rounds)
            )
            torch.set_num_threads(threads)
    for r in rows:
        r["params"] = n_params(work / r["model"])
    a.out.mkdir(parents=True, exist_ok=True)
    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_cores": os.cpu_count(),
        "rows": rows,
    }
    (a.out / "gpu_check.json").write_text(json.dumps(info, indent=1))
    md = (
        f"GPU check, {info['date']}: {info['gpu']}, torch {info['torch']}, {info['cpu_cores']} CPU cores. "
        f"Synthetic model: {big.name}, {n_params(big) / 1e9:.2f} B parameters, bf16 weights, random, its head "
        f"drafting the trunk's bigram guess.\n\n" + table(rows)
    )
    (a.out / "gpu_check.md").write_text(md)
    print(md)
    bad = [r["model"] for r in rows if not r["identical_to_plain"] and r["dtype"] == "float32"]
    if bad:
        print(f"gpu_check: greedy speculative output differs from plain greedy output on {bad}")
    return 0 if not math.isnan(sum(r["spec_tokens_per_s"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
