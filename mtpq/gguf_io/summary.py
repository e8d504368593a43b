"""What a GGUF holds, as JSON-ready data: ``mtpq inspect`` prints it, a release describes its artifacts by it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..tensors import Role
from .buffers import tensor_nbytes
from .read import plan_from_gguf


def summarize_gguf(path: Path) -> dict:
    """A JSON-ready description of a GGUF (a file, or a split set from any of its shards): arch, blocks, MTP
    blocks, tensors, totals by role, and the files (``shards``: shard 1 first) with their sizes."""
    plan = plan_from_gguf(path)
    tensors = []
    by_role: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    for s in plan.tensors:
        nbytes = tensor_nbytes(s.shape, s.ggml_type)
        tensors.append(
            {
                "name": s.name,
                "shape": list(s.shape),
                "type": s.ggml_type.name,
                "bytes": nbytes,
                "role": s.role.value,
                "mtp": s.role is Role.MTP,
            }
        )
        r = by_role[s.role.value]
        r["tensors"] += 1
        r["bytes"] += nbytes
        r["elements"] += s.n_elements
    total_bytes = sum(t["bytes"] for t in tensors)
    total_el = sum(r["elements"] for r in by_role.values())
    mtp_blocks = list(range(plan.n_trunk_layers, plan.n_trunk_layers + plan.n_mtp_layers))
    return {
        "file": str(path),
        "shards": [{"file": p.name, "bytes": p.stat().st_size} for p in plan.inputs],
        "arch": plan.arch,
        "name": plan.kv_value("general.name"),
        "block_count": plan.kv_value(f"{plan.arch}.block_count"),
        "trunk_blocks": plan.n_trunk_layers,
        "nextn_predict_layers": plan.n_mtp_layers,
        "mtp_blocks": mtp_blocks,
        # the head's weight matrices (its router stays f32 whatever the head's precision)
        "mtp_types": sorted(
            {t["type"] for t in tensors if t["mtp"] and len(t["shape"]) > 1 and ".ffn_gate_inp" not in t["name"]}
        ),
        "tensor_count": len(tensors),
        "bytes": total_bytes,
        "bits_per_weight": round(8 * total_bytes / total_el, 3) if total_el else 0.0,
        "by_role": dict(sorted(by_role.items())),
        "tensors": tensors,
    }
