"""A build's measuring and gating: what a GGUF is (types by role, size), its draft acceptance and its trunk's
quality against the reference, each on either engine, and the verdict of a recipe's gate on those figures.

The release runner (:mod:`mtpq.release.runner`) calls these for every artifact; the figures are deterministic (no
timings), so a rebuilt artifact gets the same manifest entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Gate:
    prompts: str = "builtin"
    draft: int = 3
    max_new_tokens: int = 64
    min_rate: float | None = None
    max_drop: float | None = None
    temperature: float = 0.0
    max_prompts: int | None = None
    engine: str = "torch"  # or "llama.cpp": llama-server with --spec-type draft-mtp (mtpq.engines)
    llama_cpp: str | None = None  # llama.cpp's bin folder (default: $MTPQ_LLAMA_CPP_BIN, then PATH)
    ngl: int | None = None
    ctx_size: int | None = None
    threads: int | None = None
    rpc: str | None = None
    server_args: tuple[str, ...] = ()
    # the trunk's quality against the reference (mtpq compare): on ``text``, chunks of kld_ctx_size tokens
    text: str | None = None
    kld_ctx_size: int = 512
    kld_chunks: int | None = None
    max_kld: float | None = None
    min_top1: float | None = None
    max_ppl_ratio: float | None = None

    @property
    def scores_quality(self) -> bool:
        return self.text is not None


# ----------------------------------------------------------------------------- artifacts


def describe(path: Path) -> dict:
    """Per-role type table, MTP precision and size (all shards) of a GGUF (from
    :func:`~mtpq.gguf_io.summary.summarize_gguf`)."""
    from ..gguf_io.summary import summarize_gguf

    info = summarize_gguf(path)
    by_role: dict[str, dict[str, int]] = {}
    for t in info["tensors"]:
        by_role.setdefault(t["role"], {}).setdefault(t["type"], 0)
        by_role[t["role"]][t["type"]] += 1
    return {
        "bytes": sum(s["bytes"] for s in info["shards"]),
        "bits_per_weight": info["bits_per_weight"],
        "types_by_role": by_role,
        "mtp_precision": info["mtp_types"],
        "mtp_blocks": len(info["mtp_blocks"]),
    }


# ----------------------------------------------------------------------------- gates


def measure(path: Path, gate: Gate, head: Path | None = None) -> dict:
    """Greedy acceptance figures of one GGUF (``head``: a trunk with this head file, as llama.cpp's -md) on the
    gate's prompts (deterministic: no timings)."""
    kw = dict(
        prompts=gate.prompts,
        draft=gate.draft,
        max_new_tokens=gate.max_new_tokens,
        temperature=gate.temperature,
        max_prompts=gate.max_prompts,
    )
    if gate.engine == "llama.cpp":
        from ..engines.llama_cpp import ServerConfig, find_server, measure_with_llama_cpp, with_draft_model

        cfg = ServerConfig(
            find_server(gate.llama_cpp),
            ngl=gate.ngl,
            ctx_size=gate.ctx_size,
            threads=gate.threads,
            rpc=gate.rpc,
            extra=list(gate.server_args),
        )
        report = measure_with_llama_cpp(path, **kw, server=cfg if head is None else with_draft_model(cfg, head))
    else:
        from ..runtime.accept import measure_file

        report = measure_file(path, **kw, threads=gate.threads, head=head)
    return {**report.deterministic_summary(), "engine": report.engine}


def measure_quality(reference: Path, path: Path, gate: Gate) -> dict:
    """The trunk's figures against the reference on gate.text (mtpq compare's), deterministic: no timings."""
    if gate.engine == "llama.cpp":
        from ..engines.perplexity import PerplexityConfig, find_perplexity, kld_with_llama_cpp

        cfg = PerplexityConfig(
            find_perplexity(gate.llama_cpp),
            ctx_size=gate.kld_ctx_size,
            chunks=gate.kld_chunks,
            threads=gate.threads,
            ngl=gate.ngl,
        )
        _, (figures,), chunks = kld_with_llama_cpp(reference, [path], Path(gate.text), cfg)
        return {**figures, "chunks": chunks, "ctx_size": gate.kld_ctx_size, "engine": "llama.cpp"}
    from ..runtime.accept import use_threads
    from ..runtime.trunk_quality import QualityRun, compare_runs

    use_threads(path, gate.threads)
    ref, q = QualityRun(reference), QualityRun(path)
    chunks = compare_runs(ref, [q], Path(gate.text).read_text(), n_ctx=gate.kld_ctx_size, n_chunks=gate.kld_chunks)
    keep = ("ppl", "ppl_ratio", "kld_mean", "kld_median", "kld_p99", "kld_max", "top1", "dp_rms")
    return {
        **{k: v for k, v in q.quality.summary(ref.quality).items() if k in keep},
        "chunks": chunks,
        "ctx_size": gate.kld_ctx_size,
        "engine": "torch",
    }


def judge(rate: float | None, ref_rate: float | None, gate: Gate, quality: dict | None = None) -> dict:
    """The gate's verdict (:func:`mtpq.acceptance.quality.judge`): a gated figure that is missing or not finite
    fails, as one below its limit does."""
    from ..acceptance.quality import CHECKS, Gates
    from ..acceptance.quality import judge as judge_figures

    drop = ref_rate - rate if rate is not None and ref_rate is not None else None
    row = {**(quality or {}), "file": "", "accept_rate": rate, "accept_drop": drop}
    gates = Gates(
        max_kld=gate.max_kld,
        min_top1=gate.min_top1,
        max_ppl_ratio=gate.max_ppl_ratio,
        min_rate=gate.min_rate,
        max_drop=gate.max_drop,
    )
    reasons = judge_figures([row], gates, {g: f"gate.{g}" for g in CHECKS})[""]
    return {"passed": not reasons, "reason": "; ".join(reasons) or "ok"}
